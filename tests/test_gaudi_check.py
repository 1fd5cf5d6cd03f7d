"""The Gaudi self-check, as far as a machine without an HPU allows.

Off Gaudi it must say so and exit 2. Its stack checks run for real under the Habana stand-ins (they answer
optimum-habana's `pip list` probe); the training steps take a stand-in HPU count and step runner: one runs the real
Gaudi script on CPU (so every step must fail: the media-pipeline step because the script falls back to the PyTorch
loader here, the others because no HPU ran lazy mode), another reports results or a crash without training.
"""

import functools
import importlib.metadata
import json
import os
import sys

import pytest

from bridgetower_bench.tools import gaudi_check as gc
from bridgetower_bench.tools import self_check, tool_paths
from helpers import CPU_FLAGS, REPO, SHIM, all_strings, pinned, run_script, run_tool, script_module


# Habana-only flag -> how many values follow it
HABANA_ONLY_FLAGS = dict.fromkeys(["--use_habana", "--use_lazy_mode", "--use_hpu_graphs_for_inference"], 0)
HABANA_ONLY_FLAGS["--gaudi_config_name"] = 1


@pytest.mark.parametrize("with_shim", [False, True], ids=["no-habana", "shim-without-hpu"])
def test_off_gaudi_says_so_in_one_line_and_exits_2(tmp_path, with_shim):
    out = tmp_path / "check"
    result = run_tool("gaudi_check", ["--output_dir", out], process=True, gaudi=with_shim)
    assert result.returncode == 2
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("gaudi_check: not a Gaudi node: ")
    assert ("no HPU is visible" if with_shim else "habana_frameworks is not installed") in result.stdout
    assert not out.exists()


@pytest.fixture
def habana_shim(monkeypatch):
    """The stand-ins for this process: their habana_frameworks first on sys.path, their `pip` first on PATH."""
    monkeypatch.syspath_prepend(str(SHIM))
    for name, value in tool_paths.habana_standin_env(os.environ).items():
        monkeypatch.setenv(name, value)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] == "habana_frameworks":
            del sys.modules[name]


def run_on_cpu(step):
    """The step's real Gaudi-script command, Habana-only flags left out, on CPU in this process (run_script)."""
    command, skip = [], 0
    for part in step.command:
        if skip:
            skip -= 1
        elif part in HABANA_ONLY_FLAGS:
            skip = HABANA_ONLY_FLAGS[part]
        else:
            command.append(part)
    python, script, *args = command
    assert (python, script) == (sys.executable, str(gc.GAUDI_SCRIPT)), command
    result = run_script("gaudi", args + CPU_FLAGS["gaudi"], check=False)
    with open(step.log, "w") as log:
        log.write(result.stdout + result.stderr)
    return self_check.Ran(result.returncode, "on CPU behind the Habana stand-ins (no HPU here)")


def test_steps_on_cpu_fill_the_table_and_a_shareable_record(habana_shim, fixtures, tmp_path, capsys):
    # optimum.habana imported through the Gaudi script (helpers.script_module), not by the check
    script_module("gaudi")
    gaudi2 = functools.partial(
        gc.Hpus, 1, "GAUDI2 (test stand-in)", media_pipeline="habana_frameworks.mediapipe is not installed"
    )
    out = tmp_path / "check"
    (out / "fixtures").mkdir(parents=True)
    for built in fixtures.values():  # the session's fixtures, where the check builds its own
        (out / "fixtures" / built.name).symlink_to(built)
    status = gc.main(["--output_dir", str(out), "--max_steps", "2"], probe=gaudi2, runner=run_on_cpu)
    printed = capsys.readouterr().out
    print(printed)
    assert status == 1  # no step can pass without an HPU

    record = json.loads((out / "gaudi_check.json").read_text())
    assert record["passed"] is False and record["hpus"]["count"] == 1
    environment = record["environment"]
    assert set(gc.ENVIRONMENT_KEYS) <= set(environment)
    device = ("gaudi", "GAUDI2 (test stand-in)", 1)
    assert (environment["backend"], environment["device_name"], environment["device_count"]) == device
    assert environment["step_environment"] == {"PT_HPU_LAZY_MODE": "1"}
    stack = {row["name"]: row for row in record["stack"]}
    # the stand-in reports habana-pyhlml's version: "ok" when its pinned line is the one optimum-habana validated
    software = stack["Intel Gaudi software"]
    assert software["result"] == "ok" and software["detail"].startswith(importlib.metadata.version("habana-pyhlml"))
    assert stack["optimum-habana"]["result"] == "ok" and stack["optimum-habana"]["detail"].startswith(
        pinned("optimum-habana", "requirements-gaudi.txt")
    )
    for name in ("transformers", "accelerate", "datasets", "torch"):
        assert stack[name]["result"] == "ok", stack[name]
    assert stack["Gaudi driver"]["result"] == "warning"  # no hl-smi here
    media_row = stack["media pipeline"]
    assert media_row["result"] == "warning" and "habana_frameworks.mediapipe" in media_row["detail"]

    steps = {row["name"]: row for row in record["steps"]}
    torch_step = steps["1hpu-pytorch-loader"]
    # The run trained and recorded its figures, but on a CPU: the lazy mode it asked for never ran, so it fails.
    assert torch_step["result"] == "failed" and torch_step["loader"] == "torch", torch_step
    assert torch_step["execution_mode"] == "n/a"
    assert torch_step["detail"] == "asked for lazy mode, but the bridge ran: n/a"
    run_results = json.loads((out / "1hpu-pytorch-loader" / "run" / "train_results.json").read_text())
    assert run_results["execution_mode"] == "n/a" and run_results["backend"] == "cpu"
    assert torch_step["samples_per_second"] == run_results["train_samples_per_second"]  # the run's own figure
    assert torch_step["seconds"] > run_results["throughput_counted_seconds"]  # the whole step, start-up included
    media = steps["1hpu-media-pipeline"]
    assert media["result"] == "failed" and "--mediapipe_dataloader" in media["command"]
    unavailable = "torch (media pipeline unavailable"
    assert media["loader"].startswith(unavailable)
    assert media["detail"].startswith(f"the mediapipe loader did not run; the run says: {unavailable}")
    launcher = steps["8hpu-launcher"]
    assert (launcher["result"], launcher["detail"]) == ("skipped", "needs 8 HPUs, 1 visible")

    # What a user attaches to a bug report: paths relative to the output directory, no environment.
    assert torch_step["command"][:3] == ["PT_HPU_LAZY_MODE=1", "python", "run_bridgetower.py"]  # complete as pasted
    assert "--use_hpu_graphs_for_inference" in torch_step["command"]
    command = torch_step["command"]
    assert command[command.index("--model_name_or_path") + 1] == "fixtures/tiny-bridgetower"
    assert (out / torch_step["log"]).is_file()
    text = json.dumps(record)
    assert [string for string in all_strings(record) if os.path.isabs(string)] == []
    assert str(tmp_path) not in text and str(REPO) not in text and os.environ["PATH"] not in text

    for row in record["stack"] + record["steps"]:  # one table, every row
        assert any(line.startswith(row["name"]) and row["result"] in line for line in printed.splitlines())


def reports(outcomes):
    """A runner that trains nothing: per step, results for the script to have saved, or a crash."""

    def runner(step):
        outcome = outcomes[step.name]
        step.run_dir.mkdir(parents=True)
        if isinstance(outcome, str):
            step.log.write_text(f"Traceback (most recent call last):\n  ...\n{outcome}\nmpirun: one process exited\n")
            return self_check.Ran(1)
        (step.run_dir / "train_results.json").write_text(json.dumps(outcome))
        step.log.write_text("done\n")
        return self_check.Ran(0)

    return runner


def check(out, outcomes, hpus=1, *flags):
    """The check on `hpus` stand-in GAUDI2s (media pipeline available), its steps reporting `outcomes`."""
    probe = functools.partial(gc.Hpus, hpus, "GAUDI2", media_pipeline=None)
    return gc.main(["--output_dir", str(out), *flags], probe=probe, runner=reports(outcomes))


def test_eight_hpus_run_the_launcher_a_crash_shows_its_error_line_and_the_record_holds_no_credential(
    habana_shim, no_fixture_builds, tmp_path, capsys, monkeypatch
):
    token = "hf_FakeTokenForTheGaudiCheck123"
    monkeypatch.setenv("HF_TOKEN", token)
    out = tmp_path / "check"
    outcomes = {
        "1hpu-pytorch-loader": f"OSError: 401 Client Error for url with token {token}",  # a step that prints it
        "1hpu-media-pipeline": {"loader": "mediapipe", "train_samples_per_second": 140.25, "execution_mode": "lazy"},
        "8hpu-launcher": f"RuntimeError: synStatus 26 [Device not found] writing {out}/8hpu-launcher/run",
    }
    assert check(out, outcomes, 8, "--json", str(tmp_path / "report.json")) == 1
    record = json.loads((tmp_path / "report.json").read_text())
    steps = {row["name"]: row for row in record["steps"]}
    media = steps["1hpu-media-pipeline"]
    assert (media["result"], media["samples_per_second"]) == ("ok", 140.25)
    launcher = steps["8hpu-launcher"]
    detail = "exit status 1: RuntimeError: synStatus 26 [Device not found] writing 8hpu-launcher/run"  # relative
    assert (launcher["result"], launcher["detail"]) == ("failed", detail)
    launch = "PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.launch_gaudi --world_size 8 --use_mpi".split()
    assert launcher["command"][:7] == launch
    table = capsys.readouterr().out
    assert "RuntimeError: synStatus 26" in table and "140.2" in table
    written = [tmp_path / "report.json", *out.rglob("*.json")]
    assert all(token not in p.read_text() for p in written)
    failed = steps["1hpu-pytorch-loader"]
    assert failed["result"] == "failed" and "REDACTED" in failed["detail"]

    outcomes["1hpu-pytorch-loader"] = {"loader": "torch", "train_samples_per_second": 101.5, "execution_mode": "lazy"}
    outcomes["8hpu-launcher"] = {"loader": "torch", "train_samples_per_second": 790.0, "execution_mode": "lazy"}
    assert check(tmp_path / "again", outcomes, 8) == 0


@pytest.mark.parametrize("ran", ["eager", "eager+compile", None])
def test_a_step_whose_bridge_ran_another_mode_than_lazy_fails(habana_shim, no_fixture_builds, tmp_path, capsys, ran):
    """E.g. PT_HPU_LAZY_MODE lost on the way to the processes: the bridge runs eager and the step must not pass."""
    outcomes = {
        "1hpu-pytorch-loader": {"loader": "torch", "train_samples_per_second": 101.5, "execution_mode": ran},
        "1hpu-media-pipeline": {"loader": "mediapipe", "train_samples_per_second": 140.25, "execution_mode": "lazy"},
    }
    assert check(tmp_path / "check", outcomes) == 1
    record = json.loads((tmp_path / "check" / "gaudi_check.json").read_text())
    steps = {row["name"]: row for row in record["steps"]}
    assert steps["1hpu-pytorch-loader"]["result"] == "failed"
    assert steps["1hpu-pytorch-loader"]["detail"] == f"asked for lazy mode, but the bridge ran: {ran}"
    assert (steps["1hpu-media-pipeline"]["result"], steps["1hpu-media-pipeline"]["execution_mode"]) == ("ok", "lazy")
    table = capsys.readouterr().out
    assert any(line.startswith("1hpu-media-pipeline") and " lazy " in line for line in table.splitlines()), table


def test_every_step_runs_with_the_variable_that_selects_lazy_mode(tmp_path, monkeypatch):
    """The real runner hands each step PT_HPU_LAZY_MODE=1, whatever the caller's environment says."""
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    log = tmp_path / "log.txt"
    step = gc.Step(
        "echo", [sys.executable, "-c", "import os; print(os.environ.get('PT_HPU_LAZY_MODE'))"], tmp_path, log, "torch"
    )
    assert self_check.run_command(step, timeout=60, tool="gaudi_check").returncode == 0
    assert log.read_text().strip() == "1"


def test_gaudi_software_and_pins_are_compared_not_installed():
    optimum_habana = pinned("optimum-habana", "requirements-gaudi.txt")
    assert gc.compare_gaudi_software("7.3.2", "7.3.0", optimum_habana).result == "ok"
    mismatch = gc.compare_gaudi_software("7.2.0", "7.3.0", optimum_habana)
    assert mismatch.result == "warning" and "validated with 7.3.0" in mismatch.detail
    assert gc.compare_gaudi_software(None, "7.3.0", optimum_habana).result == "warning"

    pins = {name: f"{name}=={pinned(name, 'requirements-gaudi.txt')}" for name in ("transformers", "accelerate")}
    versions = {"transformers": "99.0", "accelerate": pinned("accelerate", "requirements-gaudi.txt")}

    def installed(name):
        if name not in versions:
            raise gc.metadata.PackageNotFoundError(name)
        return versions[name]

    def row(line):
        return self_check.requirement_row(line, "requirements-gaudi.txt", installed)

    assert row(pins["transformers"]).result == "warning"
    assert row(pins["accelerate"]).result == "ok"
    missing = row(f"optimum-habana=={optimum_habana}")
    assert missing.result == "failed" and "pip install -r requirements-gaudi.txt" in missing.detail
    listed = set(self_check.pinned_requirements(gc.REQUIREMENT_FILES))
    assert {f"optimum-habana=={optimum_habana}", pins["transformers"]} <= listed

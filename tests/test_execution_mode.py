"""Habana's execution mode: the Gaudi script refuses a PT_HPU_LAZY_MODE that does not select the mode its flags ask
for, in one line, before it loads anything; the mode the bridge ran is what the run records.

The refusals run the real Gaudi script's main() with `--use_habana` behind the Habana stand-ins (no HPU here), in the test
process with its argument parsing replaced by a failure (`run_script(..., refused=True)`): past the check,
GaudiTrainingArguments would set up Habana's bridge, which replaces transformers' model code for good. One refusal runs
as a process of its own: the exit status, the one line, and nothing loaded in a fresh interpreter."""

import json
import sys

import pytest
import torch

from bridgetower_bench.guards import execution_mode
from bridgetower_bench.tools.fixtures import script_arguments
from helpers import REFUSAL_MISSED, REPO, SHIM, run_script


VARIABLE = "PT_HPU_LAZY_MODE"


@pytest.fixture
def datasets_cache(tmp_path):
    """A data set cache the runs point to: any data set load would create it (none must: refusals come first)."""
    return tmp_path / "never-loaded" / "datasets-cache"


def short_run(fixtures, tmp_path) -> dict:
    """A short Gaudi run on the fixtures, as a JSON configuration's values (no --use_habana yet)."""
    run = {"output_dir": str(tmp_path / "run"), "do_train": True, "max_steps": 1, "report_to": "none"}
    return {**script_arguments(fixtures), **run}


def gaudi_args(fixtures, tmp_path, flags):
    """The short run's flags with --use_habana and `flags`."""
    args = []
    for name, value in short_run(fixtures, tmp_path).items():
        args += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return [*args, "--use_habana", *flags]


def run_gaudi_script(fixtures, tmp_path, flags, value, datasets_cache, process=False):
    environment = {VARIABLE: value, "HF_DATASETS_CACHE": str(datasets_cache)}
    args = gaudi_args(fixtures, tmp_path, flags)
    return run_script("gaudi", args, check=False, process=process, env=environment, refused=not process)


def assert_refused_before_loading(result, tmp_path, datasets_cache, message):
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("run_bridgetower.py: error: ") and message in lines[-1], lines[-1]
    assert "Traceback" not in result.stderr
    # Refused before anything was loaded or written: no data set cache, no output directory, no step-2 logging.
    assert not datasets_cache.exists() and not (tmp_path / "run").exists()
    assert "Process rank" not in result.stdout + result.stderr


REFUSED = [
    # flags, PT_HPU_LAZY_MODE, what the one line must say
    (
        [],
        None,
        "--use_habana with --use_lazy_mode (lazy mode, the default) needs PT_HPU_LAZY_MODE=1 in the environment, "
        "and it is unset (Habana's bridge would not run lazy mode): rerun as PT_HPU_LAZY_MODE=1 python ...",
    ),
    (["--use_lazy_mode"], "0", "needs PT_HPU_LAZY_MODE=1 in the environment, and it is '0'"),
    (
        ["--use_lazy_mode", "False"],
        None,
        "--use_habana with --use_lazy_mode False and no --torch_compile (eager mode) needs "
        "PT_HPU_LAZY_MODE=0 in the environment, and it is unset: rerun as PT_HPU_LAZY_MODE=0",
    ),
    (["--use_lazy_mode", "False"], "1", "(eager mode) needs PT_HPU_LAZY_MODE=0 in the environment, and it is '1'"),
    (["--use_lazy_mode", "False", "--torch_compile"], "1", "(eager+compile mode) needs PT_HPU_LAZY_MODE=0"),
    (
        ["--torch_compile_backend", "hpu_backend"],
        "1",
        "--use_lazy_mode (the default) with --torch_compile: lazy mode and torch.compile exclude each other",
    ),
    (["--torch_compile_mode", "max-autotune"], "1", "lazy mode and torch.compile exclude each other"),
]


@pytest.mark.parametrize(
    "flags, value, message, process",
    [(*refused, False) for refused in REFUSED] + [(*REFUSED[0], True)],  # the first once more in a fresh process
    ids=[f"{' '.join(f) or 'default'}-{v}" for f, v, _ in REFUSED] + ["default-None-in-a-fresh-process"],
)
def test_gaudi_script_refuses_a_variable_that_does_not_select_the_mode_asked(
    fixtures, tmp_path, datasets_cache, flags, value, message, process
):
    result = run_gaudi_script(fixtures, tmp_path, flags, value, datasets_cache, process=process)
    assert_refused_before_loading(result, tmp_path, datasets_cache, message)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"use_habana": True, "use_lazy_mode": True}, "needs PT_HPU_LAZY_MODE=1 in the environment, and it is unset"),
        ({"use_habana": True}, "needs PT_HPU_LAZY_MODE=1 in the environment, and it is unset"),  # lazy: the default
        ({"use_habana": True, "use_lazy_mode": False}, "needs PT_HPU_LAZY_MODE=0 in the environment, and it is unset"),
        ({}, None),  # no --use_habana: no Habana bridge to set up, nothing to refuse
    ],
    ids=["lazy", "lazy-by-default", "eager", "no-habana"],
)
def test_a_json_configuration_is_checked_the_same_way(fixtures, tmp_path, datasets_cache, config, message):
    (tmp_path / "args.json").write_text(json.dumps(short_run(fixtures, tmp_path) | config))
    environment = {VARIABLE: None, "HF_DATASETS_CACHE": str(datasets_cache)}
    result = run_script("gaudi", [tmp_path / "args.json"], check=False, env=environment, refused=True)
    if message is None:
        assert result.returncode == 1 and REFUSAL_MISSED in result.stderr, result.stderr[-3000:]
    else:
        assert_refused_before_loading(result, tmp_path, datasets_cache, message)


@pytest.mark.parametrize(
    "flags, value",
    [([], "1"), (["--use_lazy_mode", "False"], "0"), (["--use_lazy_mode", "False", "--torch_compile"], "0")],
    ids=["lazy-1", "eager-0", "eager+compile-0"],
)
def test_the_right_variable_passes_the_check(fixtures, tmp_path, datasets_cache, flags, value):
    """Past the check the run goes on to build its arguments (where GaudiTrainingArguments sets up the HPU)."""
    result = run_gaudi_script(fixtures, tmp_path, flags, value, datasets_cache)
    assert "PT_HPU_LAZY_MODE" not in result.stderr
    assert result.returncode == 1 and REFUSAL_MISSED in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize(
    "use_habana, lazy, compile_, value, refused",
    [
        (False, False, False, None, False),  # the tests' CPU runs: --use_cpu --use_lazy_mode False, no bridge
        (False, True, True, "0", False),
        (True, True, False, "1", False),
        (True, True, False, None, True),
        (True, True, False, "true", True),  # only "1" selects lazy mode
        (True, False, False, "0", False),
        (True, False, False, None, True),
        (True, False, True, "0", False),
        (True, False, True, None, True),
        (True, True, True, "1", True),
        (True, True, True, "0", True),
    ],
)
def test_which_variable_each_mode_needs(use_habana, lazy, compile_, value, refused):
    assert (execution_mode.refusal(use_habana, lazy, compile_, value) is not None) == refused


@pytest.fixture
def shim_bridge(monkeypatch):
    """The shim's habana_frameworks importable in this process (its is_lazy() follows PT_HPU_LAZY_MODE)."""
    monkeypatch.syspath_prepend(str(SHIM))
    before = set(sys.modules)
    yield monkeypatch
    for name in set(sys.modules) - before:
        if name.split(".")[0] == "habana_frameworks":
            del sys.modules[name]


@pytest.mark.parametrize(
    "value, compile_, recorded",
    [("1", False, "lazy"), (None, False, "eager"), ("0", False, "eager"), ("0", True, "eager+compile")],
)
def test_the_record_says_the_mode_the_bridge_reports(shim_bridge, value, compile_, recorded):
    if value is None:
        shim_bridge.delenv(VARIABLE, raising=False)
    else:
        shim_bridge.setenv(VARIABLE, value)
    assert execution_mode.mode_that_ran("hpu", compile_) == recorded
    assert execution_mode.mode_that_ran("cpu", compile_) == execution_mode.mode_that_ran("cuda", compile_) == "n/a"


def test_an_hpu_run_without_the_bridges_report_is_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)  # not importable
    assert execution_mode.mode_that_ran("hpu", False) == "unknown"


def test_the_cuda_script_carries_no_habana_mode_check():
    text = (REPO / "run_bridgetower_cuda.py").read_text()
    assert "check_lazy_mode_variable" in (REPO / "run_bridgetower.py").read_text()
    assert "check_lazy_mode_variable" not in text and VARIABLE not in text


def test_the_environment_record_off_gaudi_and_the_nvidia_driver_read_from_nvidia_smi(tmp_path, monkeypatch):
    from bridgetower_bench.measurement import run_record

    monkeypatch.setenv("PATH", "")  # neither nvidia-smi nor hl-smi found
    record = run_record.environment(torch.device("cpu"))
    assert record["backend"] == "cpu" and record["execution_mode"] == "n/a" and record["torch_compile"] is False
    assert record["driver_version"] is None and record["device_count"] == 1
    assert record["version_torch"] == torch.__version__ and record["version_cuda"] == torch.version.cuda
    assert run_record.nvidia_driver_version() is None and run_record.gaudi_driver_version() is None
    # with nvidia-smi on PATH, the driver is read from it without a device
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        '#!/bin/sh\n[ "$1 $2" = "--query-gpu=driver_version --format=csv,noheader" ] && printf "580.82.07\\n580.82.07\\n"\n'
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run_record.nvidia_driver_version() == "580.82.07"

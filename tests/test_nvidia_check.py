"""The NVIDIA self-check, as far as a machine without a GPU allows.

Without a GPU it must say why in one line and exit 2 (run for real here). The rest takes a stand-in
probe (what a GPU machine reports) and a step runner that trains nothing.
"""

import functools
import json
import os

from bridgetower_bench.tools import nvidia_check as nc
from helpers import all_strings, pinned, run_tool


def test_without_a_gpu_it_says_why_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / "check"
    result = run_tool("nvidia_check", ["--output_dir", out], process=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.count("\n") == 1
    assert result.stdout.startswith(
        "nvidia_check: no usable NVIDIA GPU: no NVIDIA driver found (no libcuda or libnvidia-ml library; "
    )
    assert result.stdout.endswith(
        "); CUDA_VISIBLE_DEVICES is also set empty, which would hide any GPU; nothing checked.\n"
    )
    assert not out.exists()


TORCH_CU126 = pinned("torch", "requirements-cuda12.txt")  # "<version>+cu126"
TORCH_CU130 = pinned("torch", "requirements-cuda.txt") + "+cu130"


def two_a100_40gb(**changes):
    facts = dict(count=2, names=["NVIDIA A100-SXM4-40GB"] * 2, memory_gib=[39.39, 39.39], capabilities=["8.0", "8.0"])
    facts.update(torch=TORCH_CU126, cuda="12.6", bf16=True, driver="535.104.05", driver_source="nvidia-smi")
    facts["jpeg"] = "ok: 64x48 JPEG decoded on the GPU, max difference from the host's pixels 0/255"
    return nc.Gpus(**{**facts, **changes})


def installed_as(versions):
    """Installed versions: those given, else what is installed here."""
    from importlib import metadata

    return lambda name: versions[name] if name in versions else metadata.version(name)


def reports(outcomes):
    """A runner that trains nothing: per step, results the script would have saved, or (status, last log line)."""

    def runner(step):
        outcome = outcomes[step.name]
        step.run_dir.mkdir(parents=True)
        if isinstance(outcome, tuple):
            step.log.write_text(f"loading...\n{outcome[1]}\n")
            return nc.Ran(outcome[0])
        # (execution_mode as a CUDA run records it)
        (step.run_dir / "train_results.json").write_text(json.dumps({"execution_mode": "n/a", **outcome}))
        step.log.write_text("done\n")
        return nc.Ran(0)

    return runner


def test_two_40gb_gpus_on_an_r535_driver_pass_with_the_batch_that_fits(no_fixture_builds, tmp_path, capsys):
    too_big = (
        "run_bridgetower_cuda.py: error: --per_device_train_batch_size 48 does not fit on NVIDIA A100-SXM4-40GB "
        "(39.4 GiB): ...; --per_device_train_batch_size 16 --gradient_accumulation_steps 3 keeps the global batch of 48"
    )
    outcomes = {
        "1gpu-pytorch-loader": {"loader": "torch", "train_samples_per_second": 31.5},
        "1gpu-device-decode": {"loader": "device_decode", "train_samples_per_second": 35.0},
        "2gpu-torchrun": {"loader": "torch", "train_samples_per_second": 60.2},
        "large-1step": (2, too_big),
    }
    out = tmp_path / "check"
    cu126 = {"torch": TORCH_CU126, "torchvision": pinned("torchvision", "requirements-cuda12.txt")}
    status = nc.main(
        ["--output_dir", str(out)], probe=two_a100_40gb, runner=reports(outcomes), installed=installed_as(cu126)
    )
    printed = capsys.readouterr().out
    assert status == 0, printed

    record = json.loads((out / "nvidia_check.json").read_text())
    assert record["tool"] == "python -m bridgetower_bench.tools.nvidia_check" and record["passed"] is True
    assert record["gpus"]["count"] == 2 and "hpus" not in record
    stack = {row["name"]: row for row in record["stack"]}
    assert stack["GPUs"]["detail"] == "2 x NVIDIA A100-SXM4-40GB (39.4 GiB, compute capability 8.0)"
    assert stack["NVIDIA driver"]["result"] == "ok" and stack["NVIDIA driver"]["detail"].startswith(
        f"535.104.05 (from nvidia-smi); torch {TORCH_CU126} is built for CUDA 12.6, which needs driver 525.60.13 or newer"
    )
    assert "route: requirements-cuda12.txt" in stack["torch build"]["detail"]
    assert stack["torch"]["result"] == "ok" and stack["torchvision"]["result"] == "ok"  # the cu126 pins of that route
    assert stack["published batch memory"]["result"] == "warning"
    fits = "--per_device_train_batch_size 16 --gradient_accumulation_steps 3 keeps the global batch of 96"
    assert fits in stack["published batch memory"]["detail"]
    assert stack["GPU JPEG decoding"]["result"] == "ok" and stack["bf16"]["result"] == "ok"

    steps = {row["name"]: row for row in record["steps"]}
    decode = steps["1gpu-device-decode"]
    assert decode["result"] == "ok" and "--device_decode" in decode["command"]
    torchrun = steps["2gpu-torchrun"]
    launch = "python -m torch.distributed.run --standalone --nproc_per_node 2 run_bridgetower_cuda.py".split()
    assert torchrun["command"][:7] == launch
    large = steps["large-1step"]
    assert large["result"] == "warning" and large["detail"].startswith("--per_device_train_batch_size 48 does not fit")
    assert large["command"][large["command"].index("--per_device_train_batch_size") + 1] == "48"
    assert large["command"][large["command"].index("--model_name_or_path") + 1] == "fixtures/bridgetower-large-random"
    assert [string for string in all_strings(record) if os.path.isabs(string)] == []
    assert str(tmp_path) not in json.dumps(record)
    lines = printed.splitlines()
    for row in record["stack"] + record["steps"]:  # one table, every row
        assert any(line.startswith(row["name"]) and row["result"] in line for line in lines), row["name"]


def test_a_decoder_that_did_not_run_fails_the_large_step_shows_its_peak_and_the_record_holds_no_credential(
    no_fixture_builds, tmp_path, monkeypatch
):
    token = "hf_FakeTokenForTheNvidiaCheck123"
    monkeypatch.setenv("HF_TOKEN", token)
    outcomes = {
        "1gpu-pytorch-loader": (1, f"OSError: 401 Client Error for url with token {token}"),  # a step that prints it
        "1gpu-device-decode": {"loader": "torch", "train_samples_per_second": 120.0},
        "1gpu-torchrun": {"loader": "torch", "train_samples_per_second": 130.2},
        "large-1step": {"loader": "torch", "train_samples_per_second": 80.0, "peak_gpu_memory_gb": 64.47},
    }
    h200 = dict(count=1, names=["NVIDIA H200"], memory_gib=[139.8], torch=TORCH_CU130, cuda="13.0")
    h200.update(driver="580.95.05", driver_source="NVML", capabilities=["9.0"])
    probe = functools.partial(two_a100_40gb, **h200)
    out = tmp_path / "check"
    status = nc.main(
        ["--output_dir", str(out), "--json", str(tmp_path / "r.json")], probe=probe, runner=reports(outcomes)
    )
    assert status == 1
    record = json.loads((tmp_path / "r.json").read_text())
    stack = {row["name"]: row for row in record["stack"]}
    assert stack["published batch memory"]["result"] == "ok"
    assert "route: requirements-cuda.txt" in stack["torch build"]["detail"]
    steps = {row["name"]: row for row in record["steps"]}
    assert steps["1gpu-device-decode"]["result"] == "failed"
    assert steps["1gpu-device-decode"]["detail"] == "the device_decode loader did not run; the run says: torch"
    large = steps["large-1step"]
    assert (large["result"], large["detail"]) == ("ok", "peak 64.47 GiB of tensors at per-device batch 48")

    written = [tmp_path / "r.json", *out.rglob("*.json")]
    assert all(token not in p.read_text() for p in written)
    failed = steps["1gpu-pytorch-loader"]
    assert failed["result"] == "failed" and "REDACTED" in failed["detail"]


def test_an_old_driver_a_missing_bf16_a_failed_decoder_and_the_pins_of_the_route_installed(no_fixture_builds):
    """The current route (today's transformers) was once reported off the pinned route's pins."""
    failing = two_a100_40gb(torch=TORCH_CU130, cuda="13.0", bf16=False, jpeg="failed: RuntimeError: nvjpeg")
    rows = {row.name: row for row in nc.stack_rows(failing)}
    assert rows["NVIDIA driver"].result == "failed" and rows["NVIDIA driver"].detail.startswith("535.104.05, too old")
    assert rows["bf16"].result == "failed"
    assert rows["GPU JPEG decoding"].result == "warning" and "decodes on the host" in rows["GPU JPEG decoding"].detail

    gpus = two_a100_40gb(torch=TORCH_CU130, cuda="13.0")
    for route in ("requirements-cuda-current.txt", "requirements-cuda.txt"):
        versions = {name: pinned(name, route) for name in ("transformers", "accelerate")}
        installed = installed_as({**versions, "torch": TORCH_CU130})
        rows = {row.name: row for row in nc.stack_rows(gpus, installed=installed)}
        assert f"route: {route}" in rows["torch build"].detail
        assert rows["transformers"].result == rows["accelerate"].result == "ok", rows["transformers"].detail
    rows = {row.name: row for row in nc.stack_rows(gpus, installed=installed_as({"transformers": "99.0"}))}
    assert rows["transformers"].result == "warning"
    assert rows["transformers"].detail == f"99.0, pinned: =={pinned('transformers', 'requirements-cuda.txt')}"


def test_memory_plan_without_a_gpu(capsys):
    assert nc.main(["--memory", "40", "48", "80"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("BridgeTower Large, 294 px, 128 tokens, bf16: about 12.9 GiB + 1.07 GiB per sample")
    assert lines[1] == (
        "40 GiB: per-device batch 48 does not fit (about 71.9 GiB); --per_device_train_batch_size 16 "
        "--gradient_accumulation_steps 3 (about 34.1 GiB)"
    )
    assert lines[2].startswith("48 GiB: per-device batch 48 does not fit")
    assert "--per_device_train_batch_size 24 --gradient_accumulation_steps 2" in lines[2]
    assert lines[3] == "80 GiB: per-device batch 48 fits (about 71.9 GiB)"

"""No usable NVIDIA GPU and no --use_cpu: the CUDA script ends in one line saying why, before anything loads.

The refusal runs for real on this machine (no GPU). The driver logic runs against recorded answers of `nvidia-smi
--query-gpu=driver_version --format=csv,noheader` and of NVML (nvidia-ml-py), replaced at the one call each wraps."""

import json
import re
import types

import pytest

from bridgetower_bench.guards import cuda_device as cd
from helpers import base_args, run_script


SMI_EIGHT_GPUS = "535.104.05\n" * 8  # an 8-GPU VM on the R535 long-term branch
SMI_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
    "latest NVIDIA driver is installed and running.\n\n"
)


def test_the_cuda_script_without_a_gpu_or_use_cpu_refuses_in_one_line_before_loading(fixtures, tmp_path):
    out = tmp_path / "run"
    # (a process of its own: the refusal comes before anything loads, from the environment the process starts with)
    result = run_script(
        "cuda", base_args(fixtures, out, max_steps=1) + ["--do_train", "--bf16"], check=False, process=True
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr[-3000:]
    # (what the driver query says after the missing libraries depends on whether nvidia-ml-py is installed)
    assert re.fullmatch(
        r"run_bridgetower_cuda.py: error: no usable NVIDIA GPU: no NVIDIA driver found \(no libcuda or "
        r"libnvidia-ml library; (no nvidia-smi on PATH|NVML: NVMLError_LibraryNotFound: .*)\); "
        r"CUDA_VISIBLE_DEVICES is also set empty, which would hide any GPU\. Fix that, or pass --use_cpu "
        r"to train on the CPU on purpose\.",
        errors[0],
    ), errors[0]
    assert not out.exists()  # refused before the run claimed its output directory, let alone loaded data
    assert "Loading" not in result.stdout + result.stderr


def test_use_cpu_in_any_spelling_lets_the_run_through(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)

    def never(argv, environ=None):
        cd.refuse_without_gpu(argv, environ, why=lambda: pytest.fail("asked for a GPU"))

    def refused(argv, environ=None):
        with pytest.raises(cd.NoUsableGpu, match=r"^no usable NVIDIA GPU: the reason\. Fix that, or pass --use_cpu"):
            cd.refuse_without_gpu(argv, environ, why=lambda: "the reason")

    for flags in ("--use_cpu", "--use_cpu True --bf16", "--use_cpu=yes", "--no_cuda", "--help", "--use_cpu maybe"):
        never(["s", *flags.split()])  # (an unreadable value is left to the parser's error)
    never(["s", "--bf16"], {"ACCELERATE_USE_CPU": "true"})
    for argv in (["s", "--bf16"], ["s", "--use_cpu", "False"], ["s", "--use_cpu=no", "--do_train"]):
        refused(argv)
    cd.refuse_without_gpu(["s", "--bf16"], {}, why=lambda: None)  # a usable GPU: nothing to say

    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": "o", "use_cpu": True}))
    never(["s", str(config)])
    config.write_text(json.dumps({"output_dir": "o", "bf16": True}))
    refused(["s", str(config)])
    config.write_text("{")
    never(["s", str(config)])  # the parser names the broken file


def smi(returncode, stdout, stderr=""):
    done = types.SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr)
    return lambda command, **kwargs: done


class FakeNvml:
    """nvidia-ml-py's pynvml, answering as it does with a driver loaded (older releases return bytes)."""

    def __init__(self, version=b"550.54.15", count=4, init_error=None):
        self.version, self.count, self.init_error, self.shut = version, count, init_error, False

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlSystemGetDriverVersion(self):
        return self.version

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlShutdown(self):
        self.shut = True


class NVMLError_LibraryNotFound(Exception):  # noqa: N801 (pynvml's own class name)
    def __str__(self):
        return "NVML Shared Library Not Found"


def test_nvidia_smi_answers_recorded_on_real_machines_and_nvml_asked_first():
    which = lambda name: "/usr/bin/nvidia-smi"  # noqa: E731
    eight = cd.ask_nvidia_smi(run=smi(0, SMI_EIGHT_GPUS), which=which)
    assert (eight.version, eight.gpus, eight.error) == ("535.104.05", 8, None)
    broken = cd.ask_nvidia_smi(run=smi(9, SMI_NO_DRIVER), which=which)
    assert broken.version is None and broken.error.startswith(
        "exit status 9: NVIDIA-SMI has failed because it couldn't communicate"
    )
    none = cd.ask_nvidia_smi(run=smi(6, "No devices were found\n"), which=which)
    assert none.error == "exit status 6: No devices were found"
    assert cd.ask_nvidia_smi(run=smi(0, SMI_EIGHT_GPUS), which=lambda name: None) is None  # no nvidia-smi at all

    nvml = FakeNvml()
    answer = cd.ask_nvml(nvml)
    assert (answer.source, answer.version, answer.gpus) == ("NVML", "550.54.15", 4) and nvml.shut
    missing = cd.ask_nvml(FakeNvml(init_error=NVMLError_LibraryNotFound()))
    assert missing.error == "NVMLError_LibraryNotFound: NVML Shared Library Not Found"
    # NVML first; where it failed, nvidia-smi's answer
    assert cd.ask_driver(nvml=lambda: answer, smi=lambda: eight) is answer
    assert cd.ask_driver(nvml=lambda: missing, smi=lambda: eight) is eight
    assert cd.ask_driver(nvml=lambda: None, smi=lambda: None) is None
    assert cd.ask_driver(nvml=lambda: missing, smi=lambda: None) is missing


def reason(**facts):
    """The reason given where only `facts` differ from torch 2.9.1+cu130 on 8 GPUs and driver 580.95.05."""
    driver = cd.DriverAnswer("nvidia-smi", version="580.95.05", gpus=8)
    base = dict(available=False, torch_version="2.9.1+cu130", torch_cuda="13.0", visible=None, driver=driver)
    return cd.unusable_reason(**{**base, "libraries": ["cuda", "nvidia-ml"], **facts})


def test_the_reason_names_the_driver_the_build_needs():
    # NVIDIA's figures: CUDA 13.x builds run on R580 or newer, 12.x on 525.60.13 or newer (minor version
    # compatibility); the toolkits shipped with 580.65.06 (13.0), 570.26 (12.8), 560.28.03 (12.6), 550.54.14 (12.4).
    assert [cd.driver_floor(v) for v in ("13.0", "12.6", "12.8")] == ["580", "525.60.13", "525.60.13"]
    toolkits = {"13.0": "580.65.06", "12.8": "570.26", "12.6": "560.28.03", "12.4": "550.54.14"}
    assert {v: cd.TOOLKIT_DRIVER[v] for v in toolkits} == toolkits

    old = reason(driver=cd.DriverAnswer("nvidia-smi", version="535.104.05", gpus=8))
    assert old == (
        "the NVIDIA driver is 535.104.05, too old: torch 2.9.1+cu130 is built for CUDA 13.0, which needs driver "
        "580 or newer (the CUDA 13.0 toolkit shipped with 580.65.06); install driver 580 or newer, or torch's CUDA "
        "12.6 build (pip install -r requirements-cuda12.txt), which runs on this driver"
    )
    older = reason(driver=cd.DriverAnswer("NVML", version="520.61.05", gpus=1))
    assert "install driver 580 or newer" in older and "requirements-cuda12.txt" not in older  # too old for 12.x too
    cu126 = dict(torch_cuda="12.6", torch_version="2.9.1+cu126")
    assert "too old" in reason(**cu126, driver=cd.DriverAnswer("NVML", version="470.82.01", gpus=1))
    assert "too old" not in reason(**cu126, driver=cd.DriverAnswer("NVML", version="535.104.05", gpus=1))
    assert "too old" not in reason()  # 580.95.05 is new enough: something else is wrong


def test_the_reason_for_each_other_cause():
    assert reason(available=True) is None
    assert reason(torch_cuda=None, torch_version="2.9.1+cpu").startswith(
        "this torch (2.9.1+cpu) is built without CUDA"
    )
    assert (
        reason(visible="") == "CUDA_VISIBLE_DEVICES is set but empty, which hides every GPU (driver 580.95.05, 8 GPUs)"
    )
    assert reason(visible="-1") == "CUDA_VISIBLE_DEVICES='-1' leaves torch no GPU (driver 580.95.05, 8 GPUs)"
    assert (
        reason(driver=None, libraries=[])
        == "no NVIDIA driver found (no libcuda or libnvidia-ml library; no nvidia-smi on PATH)"
    )
    nvml_alone = cd.ask_nvml(FakeNvml(init_error=NVMLError_LibraryNotFound()))  # nvidia-ml-py installed, no driver
    assert reason(driver=nvml_alone, libraries=[], visible="") == (
        "no NVIDIA driver found (no libcuda or libnvidia-ml library; NVML: NVMLError_LibraryNotFound: NVML Shared Library "
        "Not Found); CUDA_VISIBLE_DEVICES is also set empty, which would hide any GPU"
    )
    smi_failed = cd.ask_nvidia_smi(run=smi(9, SMI_NO_DRIVER), which=lambda name: "/usr/bin/nvidia-smi")
    assert reason(driver=smi_failed).startswith(
        "the NVIDIA driver does not answer (nvidia-smi: exit status 9: NVIDIA-SMI has failed"
    )
    assert (
        reason(driver=cd.DriverAnswer("NVML", version="580.95.05", gpus=0))
        == "the NVIDIA driver 580.95.05 sees no GPU"
    )
    assert reason(driver=None, libraries=["cuda"]).startswith(
        "torch 2.9.1+cu130 (CUDA 13.0) cannot use a GPU; found: only the driver's libraries (libcuda)"
    )

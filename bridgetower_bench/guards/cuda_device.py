"""Can this torch train on an NVIDIA GPU? If not, why, in one line, before anything loads (docs/UPSTREAM.md)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import json
import os
import re
import shutil
import subprocess
from collections import namedtuple
from collections.abc import Callable
from typing import Optional

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


# The oldest driver a CUDA major version's builds run on (NVIDIA's minor version compatibility table).
DRIVER_FLOOR = {13: "580", 12: "525.60.13", 11: "450.80.02"}
# The Linux x86_64 driver each CUDA toolkit release shipped with (NVIDIA's CUDA toolkit release notes).
TOOLKIT_DRIVER = {
    "13.0": "580.65.06",
    "12.9": "575.51.03",
    "12.8": "570.26",
    "12.6": "560.28.03",
    "12.5": "555.42.02",
    "12.4": "550.54.14",
    "12.3": "545.23.06",
    "12.2": "535.54.03",
    "12.1": "530.30.02",
    "12.0": "525.60.13",
}
CUDA12_REQUIREMENTS = "requirements-cuda12.txt"  # torch's CUDA 12.6 build, for drivers older than R580 (README)


class NoUsableGpu(UserInputError):
    """No CUDA device this torch can use, and --use_cpu not given. The message says why, when it can tell."""


# What NVML or nvidia-smi ("source") said about the driver: its version, the GPUs it sees (neither honours
# CUDA_VISIBLE_DEVICES), or why the query failed.
DriverAnswer = namedtuple("DriverAnswer", "source version gpus error", defaults=(None, None, None))


def ask_nvml(nvml=None) -> Optional[DriverAnswer]:
    """The driver through NVML (nvidia-ml-py's `pynvml`); None when those bindings are not installed."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        try:
            version, count = nvml.nvmlSystemGetDriverVersion(), int(nvml.nvmlDeviceGetCount())
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
    except Exception as error:
        return DriverAnswer("NVML", error=f"{type(error).__name__}: {error}".strip())
    return DriverAnswer("NVML", version=version.decode() if isinstance(version, bytes) else str(version), gpus=count)


def ask_nvidia_smi(run: Callable = subprocess.run, which: Callable = shutil.which) -> Optional[DriverAnswer]:
    """The driver through `nvidia-smi` (one version line per GPU); None when there is no nvidia-smi on PATH."""
    executable = which("nvidia-smi")
    if executable is None:
        return None
    command = [executable, "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        done = run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return DriverAnswer("nvidia-smi", error=f"{type(error).__name__}: {error}")
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    versions = [line for line in lines if re.fullmatch(r"\d+(\.\d+)+", line)]
    if done.returncode != 0 or not versions and lines:
        said = (lines or [line.strip() for line in done.stderr.splitlines() if line.strip()] or ["no output"])[0]
        return DriverAnswer("nvidia-smi", error=f"exit status {done.returncode}: {said}"[:300])
    return DriverAnswer("nvidia-smi", version=versions[0] if versions else None, gpus=len(versions))


def ask_driver(nvml=ask_nvml, smi=ask_nvidia_smi) -> Optional[DriverAnswer]:
    """NVML first, then nvidia-smi: the first answer with a version, else the first failure; None if neither exists."""
    failed = None
    for ask in (nvml, smi):
        answer = ask()
        if answer is not None and answer.version:
            return answer
        failed = failed or answer
    return failed


def driver_libraries() -> list[str]:
    return [name for name in ("cuda", "nvidia-ml") if ctypes.util.find_library(name)]


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def driver_floor(torch_cuda: str) -> Optional[str]:
    """The oldest driver a torch built for CUDA `torch_cuda` (e.g. "13.0") runs on; None if unknown."""
    major = version_tuple(torch_cuda)[:1]
    return DRIVER_FLOOR.get(major[0]) if major else None


def driver_too_old(driver: str, torch_cuda: str) -> bool:
    floor = driver_floor(torch_cuda)
    return floor is not None and version_tuple(driver) < version_tuple(floor)


def driver_needs(torch_version: str, torch_cuda: str) -> str:
    """What the installed torch build needs from the driver, in words."""
    floor = driver_floor(torch_cuda)
    minor = ".".join(torch_cuda.split(".")[:2])
    shipped = TOOLKIT_DRIVER.get(minor)
    needs = f"torch {torch_version} is built for CUDA {torch_cuda}" + (
        f", which needs driver {floor} or newer" if floor else ""
    )
    return needs + (f" (the CUDA {minor} toolkit shipped with {shipped})" if shipped else "")


def unusable_reason(available, torch_version, torch_cuda, visible, driver, libraries) -> Optional[str]:
    """Why torch has no CUDA device, from the facts (`torch_cuda`, `visible`, `driver`: None for none), or None."""
    if available:
        return None
    if torch_cuda is None:
        return f"this torch ({torch_version}) is built without CUDA: pip install -r requirements-cuda.txt (or {CUDA12_REQUIREMENTS})"
    driver = driver or DriverAnswer("none")  # (no NVML bindings, no nvidia-smi: an answer with nothing in it)
    gpus = f", {driver.gpus} GPU{'s' if driver.gpus != 1 else ''}" if driver.gpus is not None else ""
    seen = f"driver {driver.version}{gpus}" if driver.version else ""
    hidden = visible is not None and not visible.strip()
    if not libraries and not driver.version:
        said = f"{driver.source}: {driver.error}" if driver.error else "no nvidia-smi on PATH"
        also = "; CUDA_VISIBLE_DEVICES is also set empty, which would hide any GPU" if hidden else ""
        return f"no NVIDIA driver found (no libcuda or libnvidia-ml library; {said}){also}"
    if hidden:
        return "CUDA_VISIBLE_DEVICES is set but empty, which hides every GPU" + (f" ({seen})" if seen else "")
    if driver.version and driver_too_old(driver.version, torch_cuda):
        fix = f"install driver {driver_floor(torch_cuda)} or newer"
        if version_tuple(torch_cuda)[0] >= 13 and not driver_too_old(driver.version, "12.6"):
            fix += f", or torch's CUDA 12.6 build (pip install -r {CUDA12_REQUIREMENTS}), which runs on this driver"
        return f"the NVIDIA driver is {driver.version}, too old: {driver_needs(torch_version, torch_cuda)}; {fix}"
    if driver.error:
        return f"the NVIDIA driver does not answer ({driver.source}: {driver.error})"
    if driver.gpus == 0:
        return f"the NVIDIA driver {driver.version} sees no GPU"
    if visible is not None:
        return f"CUDA_VISIBLE_DEVICES={visible!r} leaves torch no GPU" + (f" ({seen})" if seen else "")
    libs = ", ".join("lib" + name for name in libraries)
    found = seen or (f"only the driver's libraries ({libs})" if libraries else "nothing")
    return f"torch {torch_version} (CUDA {torch_cuda}) cannot use a GPU; found: {found}; nvidia-smi may say why"


def why_no_cuda() -> Optional[str]:
    """Why this process has no usable CUDA device; None when it has one."""
    import torch

    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return unusable_reason(False, torch.__version__, torch.version.cuda, visible, ask_driver(), driver_libraries())


def cpu_requested(argv: list[str], environ=None) -> Optional[bool]:
    """Does the command train on the CPU on purpose (--use_cpu, the deprecated --no_cuda, ACCELERATE_USE_CPU)? None
    when it cannot be read here: the argument parser that follows refuses it in one line."""
    from transformers.hf_argparser import string_to_bool

    with contextlib.suppress(Exception):
        if string_to_bool((os.environ if environ is None else environ).get("ACCELERATE_USE_CPU", "False")):
            return True
    try:
        if len(argv) == 2 and argv[1].endswith(".json"):
            config = json.loads(read_regular_file(argv[1]))  # a FIFO is not waited on
            if not isinstance(config, dict):
                return None
            values = (config.get("use_cpu"), config.get("no_cuda"))
            return any(string_to_bool(value) if isinstance(value, str) else bool(value) for value in values)
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
        for name in ("use_cpu", "no_cuda"):
            parser.add_argument(
                f"--{name}", f"--{name.replace('_', '-')}", nargs="?", const=True, default=False, type=string_to_bool
            )
        known, _ = parser.parse_known_args(argv[1:])
    except (OSError, ValueError, TypeError, argparse.ArgumentError):
        return None
    return bool(known.use_cpu or known.no_cuda)


def refuse_without_gpu(argv: list[str], environ=None, why: Callable[[], Optional[str]] = why_no_cuda) -> None:
    """Step 1 of the CUDA script: no usable GPU and no --use_cpu is one line (exit status 2), before anything loads."""
    if any(arg in ("-h", "--help") for arg in argv[1:]) or cpu_requested(argv, environ) is not False:
        return
    if reason := why():
        raise NoUsableGpu(
            f"no usable NVIDIA GPU: {reason}. Fix that, or pass --use_cpu to train on the CPU on purpose."
        )

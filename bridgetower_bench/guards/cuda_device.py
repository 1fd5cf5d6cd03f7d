"""Is there an NVIDIA GPU this torch can train on? If not, why, in one line.

Without a usable device, transformers' Trainer trains on the CPU without a word (and under torchrun, as
one CPU process per rank). The CUDA script asks here first, before anything is loaded, and refuses in one
line unless `--use_cpu` says the CPU is meant.

What can make the GPU unusable, and how it is told apart:
- a torch built without CUDA (`torch.version.cuda` is None);
- `CUDA_VISIBLE_DEVICES` set but empty (or naming no GPU): the driver sees GPUs, torch is shown none;
- no NVIDIA driver at all: no NVML library (`pynvml` / nvidia-ml-py, when installed), no `nvidia-smi`, no
  libcuda / libnvidia-ml;
- a driver older than the one the installed torch build needs. The driver's version comes from NVML when
  the `pynvml` bindings are installed, else from `nvidia-smi --query-gpu=driver_version`. A CUDA 13.x
  build runs on an R580 or newer driver and a CUDA 12.x build on 525.60.13 or newer (NVIDIA's minor
  version compatibility); the driver each toolkit release shipped with is also named, as NVIDIA's CUDA
  toolkit release notes list it.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
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
# The install route for drivers older than R580: torch's CUDA 12.6 build (README, NVIDIA section).
CUDA12_REQUIREMENTS = "requirements-cuda12.txt"
CPU_ON_PURPOSE = "pass --use_cpu to train on the CPU on purpose"


class NoUsableGpu(UserInputError):
    """No CUDA device this torch can use, and --use_cpu not given. The message says why, when it can tell."""


@dataclass
class DriverAnswer:
    """What NVML or nvidia-smi said about the driver. Neither honours CUDA_VISIBLE_DEVICES."""

    source: str  # "NVML" or "nvidia-smi"
    version: Optional[str] = None  # e.g. "535.104.05"
    gpus: Optional[int] = None  # GPUs the driver sees
    error: Optional[str] = None  # why the query failed, when it did


# ----------------------------------------------------------------------------------------
# The two questions to the driver (each wraps one call, replaceable in tests)
# ----------------------------------------------------------------------------------------


def ask_nvml(nvml=None) -> Optional[DriverAnswer]:
    """The driver through NVML (the `pynvml` module of nvidia-ml-py); None when those bindings are not installed."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception as error:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return DriverAnswer("NVML", error=f"{type(error).__name__}: {error}".strip())
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as error:
        return DriverAnswer("NVML", error=f"{type(error).__name__}: {error}".strip())
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return DriverAnswer("NVML", version=version.decode() if isinstance(version, bytes) else str(version), gpus=count)


def ask_nvidia_smi(run: Callable = subprocess.run, which: Callable = shutil.which) -> Optional[DriverAnswer]:
    """The driver through `nvidia-smi` (one line per GPU); None when there is no nvidia-smi on PATH."""
    executable = which("nvidia-smi")
    if executable is None:
        return None
    try:
        done = run(
            [executable, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return DriverAnswer("nvidia-smi", error=f"{type(error).__name__}: {error}")
    return parse_nvidia_smi(done.returncode, done.stdout, done.stderr)


def parse_nvidia_smi(returncode: int, stdout: str, stderr: str = "") -> DriverAnswer:
    """`nvidia-smi --query-gpu=driver_version --format=csv,noheader`'s answer: one version line per GPU."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    versions = [line for line in lines if re.fullmatch(r"\d+(\.\d+)+", line)]
    if returncode != 0 or not versions and lines:
        said = (lines or [line.strip() for line in stderr.splitlines() if line.strip()] or ["no output"])[0]
        return DriverAnswer("nvidia-smi", error=f"exit status {returncode}: {said}"[:300])
    return DriverAnswer("nvidia-smi", version=versions[0] if versions else None, gpus=len(versions))


def ask_driver(
    nvml: Callable[[], Optional[DriverAnswer]] = ask_nvml, smi: Callable[[], Optional[DriverAnswer]] = ask_nvidia_smi
) -> Optional[DriverAnswer]:
    """NVML first, then nvidia-smi: the first answer with a version, else the first failure; None if neither exists."""
    answers = []
    for ask in (nvml, smi):
        answer = ask()
        if answer is not None and answer.version:
            return answer
        if answer is not None:
            answers.append(answer)
    return answers[0] if answers else None


def driver_libraries(find: Callable[[str], Optional[str]] = ctypes.util.find_library) -> list[str]:
    """The NVIDIA driver's user-space libraries the loader can find (libcuda, libnvidia-ml)."""
    return [name for name in ("cuda", "nvidia-ml") if find(name)]


# ----------------------------------------------------------------------------------------
# The verdict (pure: facts in, one line out)
# ----------------------------------------------------------------------------------------


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
    needs = (
        f"torch {torch_version} is built for CUDA {torch_cuda}, which needs driver {floor} or newer"
        if floor
        else (f"torch {torch_version} is built for CUDA {torch_cuda}")
    )
    return needs + (f" (the CUDA {minor} toolkit shipped with {shipped})" if shipped else "")


def unusable_reason(
    *,
    available: bool,
    torch_version: str,
    torch_cuda: Optional[str],
    visible: Optional[str],
    driver: Optional[DriverAnswer],
    libraries: list[str],
) -> Optional[str]:
    """Why torch has no CUDA device, from the facts; None when it has one."""
    if available:
        return None
    if torch_cuda is None:
        return f"this torch ({torch_version}) is built without CUDA: pip install -r requirements-cuda.txt (or {CUDA12_REQUIREMENTS})"
    seen = ""
    if driver is not None and driver.version:
        seen = f"driver {driver.version}" + (
            f", {driver.gpus} GPU{'s' if driver.gpus != 1 else ''}" if driver.gpus is not None else ""
        )
    hidden = visible is not None and not visible.strip()
    if not libraries and (driver is None or not driver.version):
        said = f"{driver.source}: {driver.error}" if driver is not None and driver.error else "no nvidia-smi on PATH"
        return f"no NVIDIA driver found (no libcuda or libnvidia-ml library; {said})" + (
            "; CUDA_VISIBLE_DEVICES is also set empty, which would hide any GPU" if hidden else ""
        )
    if hidden:
        return "CUDA_VISIBLE_DEVICES is set but empty, which hides every GPU" + (f" ({seen})" if seen else "")
    if driver is not None and driver.version and driver_too_old(driver.version, torch_cuda):
        fix = f"install driver {driver_floor(torch_cuda)} or newer"
        if version_tuple(torch_cuda)[0] >= 13 and not driver_too_old(driver.version, "12.6"):
            fix += f", or torch's CUDA 12.6 build (pip install -r {CUDA12_REQUIREMENTS}), which runs on this driver"
        return f"the NVIDIA driver is {driver.version}, too old: {driver_needs(torch_version, torch_cuda)}; {fix}"
    if driver is not None and driver.error:
        return f"the NVIDIA driver does not answer ({driver.source}: {driver.error})"
    if driver is not None and driver.gpus == 0:
        return f"the NVIDIA driver {driver.version} sees no GPU"
    if visible is not None:
        return f"CUDA_VISIBLE_DEVICES={visible!r} leaves torch no GPU" + (f" ({seen})" if seen else "")
    found = seen or (
        f"only the driver's libraries ({', '.join('lib' + name for name in libraries)})" if libraries else "nothing"
    )
    return f"torch {torch_version} (CUDA {torch_cuda}) cannot use a GPU; found: {found}; nvidia-smi may say why"


# ----------------------------------------------------------------------------------------
# This machine, and the script's refusal
# ----------------------------------------------------------------------------------------


def why_no_cuda(environ=None) -> Optional[str]:
    """Why this process has no usable CUDA device; None when it has one."""
    import torch

    environ = os.environ if environ is None else environ
    if torch.cuda.is_available():
        return None
    return unusable_reason(
        available=False,
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        visible=environ.get("CUDA_VISIBLE_DEVICES"),
        driver=ask_driver(),
        libraries=driver_libraries(),
    )


def cpu_requested(argv: list[str], environ=None) -> Optional[bool]:
    """Does the command train on the CPU on purpose (--use_cpu, the deprecated --no_cuda, ACCELERATE_USE_CPU)?

    None when the command cannot be read here (an unreadable .json configuration, a value that is no
    boolean): the argument parser that follows refuses it with its own one-line error.
    """
    from transformers.hf_argparser import string_to_bool

    environ = os.environ if environ is None else environ
    try:
        if string_to_bool(environ.get("ACCELERATE_USE_CPU", "False")):
            return True
    except Exception:
        pass
    try:
        if len(argv) == 2 and argv[1].endswith(".json"):
            config = json.loads(read_regular_file(argv[1]))  # a FIFO is not waited on
            if not isinstance(config, dict):
                return None
            return any(
                string_to_bool(config[key]) if isinstance(config[key], str) else bool(config[key])
                for key in ("use_cpu", "no_cuda")
                if key in config
            )
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
        for name in ("use_cpu", "no_cuda"):
            parser.add_argument(
                f"--{name}",
                f"--{name.replace('_', '-')}",
                dest=name,
                nargs="?",
                const=True,
                default=False,
                type=string_to_bool,
            )
        known, _ = parser.parse_known_args(argv[1:])
    except (OSError, ValueError, TypeError, argparse.ArgumentError):
        return None
    return bool(known.use_cpu or known.no_cuda)


def refuse_without_gpu(argv: list[str], environ=None, why: Callable[[], Optional[str]] = why_no_cuda) -> None:
    """Step 1 of the CUDA script: no usable GPU and no --use_cpu is one line (exit status 2), before anything loads."""
    if any(arg in ("-h", "--help") for arg in argv[1:]) or cpu_requested(argv, environ) is not False:
        return
    reason = why()
    if reason:
        raise NoUsableGpu(f"no usable NVIDIA GPU: {reason}. Fix that, or {CPU_ON_PURPOSE}.")

"""What ran where, saved with every record (the fields: docs/ARCHITECTURE.md, "Saved metrics")."""

from __future__ import annotations

import os
import platform
import shutil
from importlib import metadata
from typing import Optional

import torch

from bridgetower_bench.guards import cuda_device
from bridgetower_bench.guards.execution_mode import mode_that_ran


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "hpu":
        try:
            import habana_frameworks.torch.hpu as hthpu  # only present on Gaudi machines

            return hthpu.get_device_name()
        except (ImportError, AttributeError):
            return "HPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return "CPU " + (model if model is not None else platform.processor() or platform.machine())


def _installed(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict:
    dists = ("torch", "torchvision", "transformers", "datasets", "accelerate", "optimum-habana")
    return {"python": platform.python_version(), **{d: v for d in dists if (v := _installed(d)) is not None}}


def nvidia_driver_version() -> Optional[str]:
    """The NVIDIA driver's version as NVML or `nvidia-smi` reports it (no CUDA context needed), or None."""
    answer = cuda_device.ask_driver()
    return answer.version if answer is not None else None


def gaudi_driver_version() -> Optional[str]:
    """The Gaudi driver's version as `hl-smi` reports it, read by optimum-habana's own helper, or None."""
    if shutil.which("hl-smi") is None:
        return None
    try:
        from optimum.habana.utils.misc import get_driver_version

        found = get_driver_version()
    except Exception:  # optimum-habana absent, or an hl-smi answer it cannot parse
        return None
    return None if found is None else str(found)


def device_count(device: torch.device) -> Optional[int]:
    """Devices of the run's kind visible on this machine (1 for the CPU; None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.device_count()
    if device.type == "hpu":
        try:
            import habana_frameworks.torch.hpu as hthpu  # only present on Gaudi machines

            return int(hthpu.device_count())
        except Exception:
            return None
    return 1


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory of one device, in bytes: a GPU's total memory, the memory an HPU's allocator may use (its
    `memory_stats()["Limit"]`), the host's physical memory for the CPU; None where it cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "hpu":
            import habana_frameworks.torch.hpu as hthpu

            return int(hthpu.memory_stats(device)["Limit"]) or None
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except Exception:  # an HPU bridge without these queries, a platform without sysconf
        return None


def environment(device: torch.device, torch_compile: bool = False) -> dict:
    """What every record names its environment with; None where a value does not apply or cannot be read."""
    driver = {"cuda": nvidia_driver_version, "hpu": gaudi_driver_version}.get(device.type, lambda: None)()
    return {
        "backend": {"hpu": "gaudi"}.get(device.type, device.type),
        "execution_mode": mode_that_ran(device.type, torch_compile),
        "torch_compile": bool(torch_compile),
        "version_torch": torch.__version__,
        "version_cuda": torch.version.cuda,
        "version_intel_gaudi": _installed("habana-torch-plugin"),  # the Intel Gaudi software's version
        "driver_version": driver,
        "device_name": device_name(device),
        "device_count": device_count(device),
        "device_memory_bytes": device_memory_bytes(device),
        "cpu_threads": torch.get_num_threads(),  # torch's intra-op threads (OMP_NUM_THREADS): CPU kernels' order
    }


def describe_run(args) -> dict:
    """Flat keys for train_results.json (json metrics must be scalars, strings or null)."""
    record = {"device_type": args.device.type, **{f"version_{k}": v for k, v in software_versions().items()}}
    record.update(environment(args.device, bool(getattr(args, "torch_compile", False))))  # torch's own version string
    if args.device.type == "cuda":
        record["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated(args.device) / 2**30, 2)
    return record

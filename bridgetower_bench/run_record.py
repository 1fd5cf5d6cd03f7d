"""What ran where: device name and software versions, saved with every run's train metrics."""

from __future__ import annotations

import platform
from importlib import metadata

import torch


def device_name(device: torch.device) -> str:
    """A human name for the training device: the GPU or HPU model, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "hpu":
        try:
            import habana_frameworks.torch.hpu as hthpu  # only present on Gaudi machines

            return hthpu.get_device_name()
        except (ImportError, AttributeError):
            return "HPU"
    return "CPU " + _cpu_model()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def software_versions() -> dict:
    versions = {"python": platform.python_version()}
    for dist in ("torch", "torchvision", "transformers", "datasets", "accelerate", "optimum-habana"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return versions


def describe_run(args) -> dict:
    """Flat keys for train_results.json (json metrics must be scalars or strings)."""
    record = {"device_name": device_name(args.device), "device_type": args.device.type}
    if args.device.type == "cuda":
        record["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated(args.device) / 2**30, 2)
    record.update({f"version_{k}": v for k, v in software_versions().items()})
    return record

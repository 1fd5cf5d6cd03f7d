"""Where a training step's time goes: torch.profiler over a few optimizer steps after the warm-up.

``StepProfiler`` is a ``TrainerCallback``: it starts the profiler when ``start_step`` optimizer steps
are done and stops it ``steps`` steps later, then writes to ``out_dir``

* ``profile.txt``: the profiled steps' wall time, the time the device was busy running kernels (summed
  over kernels, so it reads as "busy" only for one stream at a time, as a training step is) and their
  ratio, then the operators and kernels that take the most device time (CPU time on a CPU run);
* ``profile_trace.json``: the timeline, for chrome://tracing or Perfetto.

The data-free ceiling uses it (``python lab/gpu_ceiling.py ... --profile_steps 3``) to show
why the step runs at the MFU it does: a device busy most of the wall time points at the kernels; a device
often idle points at the host (Python dispatch, synchronisations).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
from transformers import TrainerCallback

from bridgetower_bench.measurement.throughput import synchronize_device


PROFILE_TABLE = "profile.txt"
PROFILE_TRACE = "profile_trace.json"


class StepProfiler(TrainerCallback):
    def __init__(self, start_step: int, steps: int, out_dir: str, rows: int = 40):
        if steps < 1:
            raise ValueError(f"--profile_steps must be positive to profile; got {steps}")
        self.start_step, self.steps, self.out_dir, self.rows = start_step, steps, out_dir, rows
        self.profiler: Optional[torch.profiler.profile] = None
        self.started_at = 0.0
        self.device_type = "cpu"
        self.written: Optional[str] = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.profiler is None and self.written is None and state.global_step == self.start_step:
            self.device_type = args.device.type
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            synchronize_device(args.device)
            self.profiler.__enter__()
            self.started_at = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None and state.global_step >= self.start_step + self.steps:
            synchronize_device(args.device)
            wall = time.perf_counter() - self.started_at
            self.profiler.__exit__(None, None, None)
            self._write(wall, state.global_step - self.start_step)
            self.profiler = None

    def _write(self, wall_s: float, steps: int) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        averages = self.profiler.key_averages()
        on_device = self.device_type == "cuda"
        sort_key = _device_sort_key(averages) if on_device else "self_cpu_time_total"
        busy_s = sum(_self_device_us(event) for event in averages) / 1e6 if on_device else None
        lines = [
            f"profiled {steps} optimizer step(s) on {self.device_type}: {wall_s:.3f} s wall, "
            f"{wall_s / steps * 1000:.1f} ms per step"
        ]
        if busy_s is not None:
            lines.append(f"device busy (sum of kernel times): {busy_s:.3f} s = {busy_s / wall_s:.1%} of the wall time")
        lines += ["", averages.table(sort_by=sort_key, row_limit=self.rows)]
        path = os.path.join(self.out_dir, PROFILE_TABLE)
        with open(path, "w") as handle:
            handle.write("\n".join(lines) + "\n")
        self.profiler.export_chrome_trace(os.path.join(self.out_dir, PROFILE_TRACE))
        self.written = path


def _self_device_us(event) -> float:
    """An operator's own device time in microseconds (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _device_sort_key(averages) -> str:
    """torch 2.4 renamed the profiler's cuda_* figures to device_*; sort by whichever this torch has."""
    return (
        "self_device_time_total"
        if averages and hasattr(averages[0], "self_device_time_total")
        else "self_cuda_time_total"
    )

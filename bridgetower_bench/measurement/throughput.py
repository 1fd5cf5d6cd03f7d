"""Steady-state throughput and the share of time spent waiting for data.

`ThroughputCallback` counts only the optimizer steps after the first `throughput_warmup_steps`
(compilation, cache warm-up and worker start-up are excluded, as GaudiTrainer does), and
accumulates the time the training loop spends blocked on the next batch during those steps.

    samples/s          = samples fetched for the counted steps / (end of last step - end of warm-up)
    data_wait_fraction = time blocked on the loader during that window / that window

Epoch starts are accounted for apart: the first optimizer step of every epoch after the first one this
`train()` call trains ("epoch-start steps") waits for a fresh pass of the loader (without persistent
workers, for new worker processes), where the other steps find batches prefetched. Inside the window:

    data_wait_seconds_epoch_start  = time blocked on the loader in the epoch-start steps
    data_wait_fraction_epoch_start = that / the window
    data_wait_seconds_steady, data_wait_fraction_steady: the same for every other counted step

so the two fractions add up to `data_wait_fraction`. `throughput_epoch_starts` counts the epoch-start
steps in the window and `throughput_steps_per_epoch` is the run's optimizer steps per epoch.

Both ends of the window wait for the device to finish the work queued so far (`synchronize_device`), and
no other step does: the host may run ahead of the device (it does once the Trainer's per-step NaN check
is off, `--logging_nan_inf_filter False`), and the clock must read when the device is done, not when the
host has queued the step.

With an `energy` meter (energy.py), the device's energy is read over the same window: the counter is read
right after each end's synchronisation (and polled at every counted step end in between), so that
`energy_joules_per_sample` and `energy_watts_per_device` describe exactly the steps samples/s counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional

import torch
from transformers import TrainerCallback

from bridgetower_bench.measurement.energy import EnergyMeter


logger = logging.getLogger(__name__)


class ThroughputCallback(TrainerCallback):
    def __init__(
        self,
        warmup_steps: int = 0,
        world_size: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        synchronize: Optional[Callable[[torch.device], None]] = None,
        energy: Optional[EnergyMeter] = None,
    ):
        self.warmup_steps = max(0, int(warmup_steps))
        self.energy = energy
        self.world_size = world_size
        self.clock = clock
        self.synchronize = synchronize or synchronize_device
        self._reset(first_step=0)

    def _reset(self, first_step: int) -> None:
        self.first_step = first_step  # global step when this train() call began (non-zero after a resume)
        self.window_start: Optional[float] = None
        self.train_start: Optional[float] = None
        self.last_step_end: Optional[float] = None
        self.last_step = first_step
        self.counted_samples = 0  # this rank's samples fetched for counted steps
        self.all_samples = 0
        self.wait_seconds = 0.0
        self.all_wait_seconds = 0.0
        self.steps_per_epoch: Optional[int] = None
        self.epochs_begun = 0
        self.step_waits: dict[int, float] = {}  # global step -> seconds blocked on the loader for it
        self.epoch_start_steps: list[int] = []  # global steps that began an epoch (after this call's first)
        self._step_wait = 0.0
        self._step_is_epoch_start = False

    # Trainer events ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._reset(first_step=state.global_step)
        if self.energy is not None:
            self.energy.prepare()
        self.train_start = self.clock()
        if self.warmup_steps == 0:
            self.window_start = self.train_start
            if self.energy is not None:
                self.energy.start()
        loader = kwargs.get("train_dataloader")
        try:
            self.steps_per_epoch = max(len(loader) // max(1, getattr(args, "gradient_accumulation_steps", 1)), 1)
        except TypeError:  # no loader given, or one without a length
            self.steps_per_epoch = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epochs_begun += 1
        self._step_is_epoch_start = self.epochs_begun > 1  # the first one is the start of training

    def on_step_end(self, args, state, control, **kwargs):
        self.step_waits[state.global_step] = self._step_wait
        if self._step_is_epoch_start:
            self.epoch_start_steps.append(state.global_step)
        self._step_wait, self._step_is_epoch_start = 0.0, False
        window_starts = state.global_step - self.first_step == self.warmup_steps
        last_step = bool(state.max_steps) and state.global_step >= state.max_steps
        if window_starts or last_step:
            self.synchronize(args.device)
        now = self.clock()
        self.last_step, self.last_step_end = state.global_step, now
        if window_starts:
            self.window_start = now
        if self.energy is not None:
            if window_starts:
                self.energy.start()
            elif last_step:
                self.energy.stop()
            elif self.window_start is not None:
                self.energy.poll()

    # Called by the trainer around every fetch of a batch -------------------------------------------
    def record_fetch(self, seconds: float, num_samples: int) -> None:
        self._step_wait += seconds
        self.all_wait_seconds += seconds
        self.all_samples += num_samples
        if self.window_start is not None:
            self.wait_seconds += seconds
            self.counted_samples += num_samples

    # Results ------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Figures for train_results.json. Falls back to every step (and says so) when warm-up covers them all."""
        steps_run = self.last_step - self.first_step
        counted_steps = steps_run - self.warmup_steps
        if self.last_step_end is None or steps_run == 0:
            return {}
        energy = {}
        if counted_steps > 0:
            elapsed, samples, wait, warmup = (
                self.last_step_end - self.window_start,
                self.counted_samples,
                self.wait_seconds,
                self.warmup_steps,
            )
            if self.energy is not None:  # this process's device over this process's samples
                energy = self.energy.metrics(samples=self.counted_samples, seconds=max(elapsed, 1e-9))
        else:
            logger.warning(
                "throughput_warmup_steps=%d covers all %d steps of this run: throughput counts every step instead",
                self.warmup_steps,
                steps_run,
            )
            elapsed, samples, wait, warmup = (
                self.last_step_end - self.train_start,
                self.all_samples,
                self.all_wait_seconds,
                0,
            )
            counted_steps = steps_run
            if self.energy is not None:
                energy = self.energy.not_measured("the warm-up covers every step: no counted window")
        elapsed = max(elapsed, 1e-9)
        node_samples = samples * self.world_size
        first_counted = self.first_step + warmup + 1
        epoch_starts = [step for step in self.epoch_start_steps if step >= first_counted]
        epoch_start_wait = sum(self.step_waits.get(step, 0.0) for step in epoch_starts)
        steady_wait = max(0.0, wait - epoch_start_wait)
        shape = {"throughput_steps_per_epoch": self.steps_per_epoch} if self.steps_per_epoch else {}
        return {
            "train_samples_per_second": node_samples / elapsed,
            "train_samples_per_second_per_device": node_samples / elapsed / self.world_size,
            "throughput_warmup_steps": warmup,
            "throughput_counted_steps": counted_steps,
            "throughput_counted_samples": node_samples,
            "throughput_counted_seconds": elapsed,
            "data_wait_fraction": min(1.0, wait / elapsed),
            "throughput_epoch_starts": len(epoch_starts),
            "data_wait_seconds_epoch_start": epoch_start_wait,
            "data_wait_fraction_epoch_start": min(1.0, epoch_start_wait / elapsed),
            "data_wait_seconds_steady": steady_wait,
            "data_wait_fraction_steady": min(1.0, steady_wait / elapsed),
            **shape,
            "world_size": self.world_size,
            **energy,
        }


def synchronize_device(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":  # hpu (habana_frameworks registers torch.hpu), xpu, mps
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()

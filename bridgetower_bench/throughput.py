"""Steady-state throughput and the share of time spent waiting for data.

`ThroughputCallback` counts only the optimizer steps after the first `throughput_warmup_steps`
(compilation, cache warm-up and worker start-up are excluded, as GaudiTrainer does), and
accumulates the time the training loop spends blocked on the next batch during those steps.

    samples/s          = samples fetched for the counted steps / (end of last step - end of warm-up)
    data_wait_fraction = time blocked on the loader during that window / that window
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class ThroughputCallback(TrainerCallback):
    def __init__(self, warmup_steps: int = 0, world_size: int = 1, clock: Callable[[], float] = time.perf_counter):
        self.warmup_steps = max(0, int(warmup_steps))
        self.world_size = world_size
        self.clock = clock
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

    # Trainer events ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._reset(first_step=state.global_step)
        self.train_start = self.clock()
        if self.warmup_steps == 0:
            self.window_start = self.train_start

    def on_step_end(self, args, state, control, **kwargs):
        now = self.clock()
        self.last_step, self.last_step_end = state.global_step, now
        if state.global_step - self.first_step == self.warmup_steps:
            self.window_start = now

    # Called by the trainer around every fetch of a batch -------------------------------------------
    def record_fetch(self, seconds: float, num_samples: int) -> None:
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
        if counted_steps > 0:
            elapsed, samples, wait, warmup = self.last_step_end - self.window_start, self.counted_samples, self.wait_seconds, self.warmup_steps
        else:
            logger.warning(
                "throughput_warmup_steps=%d covers all %d steps of this run: throughput counts every step instead",
                self.warmup_steps,
                steps_run,
            )
            elapsed, samples, wait, warmup = self.last_step_end - self.train_start, self.all_samples, self.all_wait_seconds, 0
            counted_steps = steps_run
        elapsed = max(elapsed, 1e-9)
        node_samples = samples * self.world_size
        return {
            "train_samples_per_second": node_samples / elapsed,
            "train_samples_per_second_per_device": node_samples / elapsed / self.world_size,
            "throughput_warmup_steps": warmup,
            "throughput_counted_steps": counted_steps,
            "throughput_counted_samples": node_samples,
            "throughput_counted_seconds": elapsed,
            "data_wait_fraction": min(1.0, wait / elapsed),
            "world_size": self.world_size,
        }

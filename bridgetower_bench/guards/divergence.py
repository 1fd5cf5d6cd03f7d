"""Runs that diverge stop (`DivergenceWatch`, `TrainingDiverged`: exit status 3), and records hold only finite
numbers or null (`finite_or_none`: JSON has no NaN). How it is found without slowing training: docs/RUNS.md.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import torch


DIVERGED_EXIT_STATUS = 3


class TrainingDiverged(SystemExit):
    """The loss or the gradient norm of a step was not finite. Exit status 3."""

    def __init__(self, message: str):
        super().__init__(DIVERGED_EXIT_STATUS)
        self.message = message


class DivergenceWatch:
    """The first optimizer step whose loss or gradient norm was NaN or infinite, recorded on the device."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._step: Optional[torch.Tensor] = None  # int32; 0 while every step was finite
        self._values: Optional[torch.Tensor] = None  # float32 [loss, gradient norm] of that step
        self._counter: Optional[torch.Tensor] = None  # int32: the step being observed, counted on the device
        self._last_step = 0  # the last step observed (the Trainer hands the same step again at an epoch's end)

    def observe(self, step: int, loss_since_last_log: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> None:
        """Record global step `step` (1-based, just finished): device operations only, no host wait. The loss, the
        Trainer's running sum since its last log, stays non-finite until logged (a check runs before every log). The
        step is counted on the device: a host number changing every step makes lazy-mode backends build new graphs."""
        if step == self._last_step:
            return
        loss = loss_since_last_log.detach().reshape(()).float()
        if grad_norm is None:  # no clipping
            norm = torch.zeros((), device=loss.device)
        else:
            norm = grad_norm.detach().reshape(-1)[0].float().to(loss.device)
        if self._step is None or self._values is None:
            self._step = torch.zeros((), dtype=torch.int32, device=loss.device)
            self._values = torch.zeros(2, dtype=torch.float32, device=loss.device)
        if self._counter is None or step != self._last_step + 1:
            self._counter = torch.tensor(step, dtype=torch.int32).to(loss.device)  # (the first step, or after a gap)
        else:
            self._counter = self._counter + 1
        self._last_step = step
        first = (self._step == 0) & ~(torch.isfinite(loss) & torch.isfinite(norm))
        self._step = torch.where(first, self._counter, self._step)
        self._values = torch.where(first, torch.stack([loss, norm]), self._values)

    def first_non_finite(self, world_size: int = 1) -> Optional[tuple]:
        """(step, loss, grad norm) of the first non-finite step, or None; reads the device. With several ranks, the
        earliest on any of them (another rank's step as (step, None, None))."""
        found = None
        if self._step is not None and self._values is not None and (step := int(self._step.item())):
            found = (step, *self._values.tolist())
        if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            never = float(2**31)  # (a float: every backend reduces it)
            device = self._step.device if self._step is not None else torch.device("cpu")
            mine = torch.tensor([float(found[0]) if found else never], device=device)
            torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
            earliest = mine.item()
            if earliest >= never:
                return None
            if found is None or found[0] != int(earliest):
                return (int(earliest), None, None)
        return found

    def check(
        self, max_steps: int, output_dir: str, last_checkpoint, world_size: int = 1
    ) -> Optional[TrainingDiverged]:
        """The exception ending the run when a step was not finite, else None; `last_checkpoint`: a path, None, or a
        function giving it (called only then)."""
        found = self.first_non_finite(world_size)
        if found is None:
            return None
        if callable(last_checkpoint):
            last_checkpoint = last_checkpoint()
        step, loss, norm = found
        what = [
            f"{name} {'NaN' if math.isnan(value) else ('+Infinity' if value > 0 else '-Infinity')}"
            for name, value in (("loss", loss), ("gradient norm", norm))
            if value is not None and not math.isfinite(value)
        ]
        observed = " and ".join(what) or "a value on another process not finite"
        kept = "no checkpoint was saved before it"
        if last_checkpoint:
            kept = f"the last complete checkpoint is {last_checkpoint}"
        message = (
            f"Training diverged at step {step} of {max_steps} ({observed}): stopped, nothing published in {output_dir}; "
            f"{kept}. Change the recipe (a lower --learning_rate, --max_grad_norm) and rerun with --overwrite_output_dir "
            "or another --output_dir."
        )
        return TrainingDiverged(message)


def report(diverged: TrainingDiverged, is_main_process: bool) -> None:
    if is_main_process:
        sys.stderr.flush()
        print(diverged.message, file=sys.stderr, flush=True)
    raise diverged


def finite_or_none(record):
    """`record` (dicts, lists, numbers) with every NaN or infinite float replaced by None (JSON null)."""
    if isinstance(record, float):
        return record if math.isfinite(record) else None
    if isinstance(record, dict):
        return {key: finite_or_none(value) for key, value in record.items()}
    if isinstance(record, (list, tuple)):
        return [finite_or_none(value) for value in record]
    return record

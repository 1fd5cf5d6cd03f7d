"""Runs that diverge stop, and records that hold only finite numbers or null.

- `DivergenceWatch`: every optimizer step, the trainer hands it the loss summed since the last logging
  step and the step's gradient norm (both still on the device). It keeps, on the device, the first step at
  which either was NaN or infinite, and its values: no step waits for the device. `check` reads that
  record on the host (one tiny copy, made where the Trainer waits for the device anyway: a logging step,
  a checkpoint, an evaluation, the end of training) and returns the `TrainingDiverged` that ends the run.
  With several processes the ranks agree on the earliest such step (one all-reduce per check), so they all
  stop at the same check.
- `TrainingDiverged`: exit status 3 (`DIVERGED_EXIT_STATUS`), distinct from bad input (2) and signals
  (128 + n). Raised from inside training: nothing after it runs, so no model is published as if trained.
- `finite_or_none`: NaN and infinities in a record become null (JSON has no number for them; Python's
  json module would write the bare words NaN / Infinity, which strict parsers refuse).
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
        self._host: Optional[tuple] = None  # (step, loss, grad_norm) found without the device (a float grad norm)

    def observe(self, step: int, loss_since_last_log, grad_norm) -> None:
        """Record step `step` (1-based global step just finished). Device operations only: no host wait.

        `loss_since_last_log` is the Trainer's running sum since its last logging step: it turns non-finite
        at the first step whose loss did, and stays so until logged (a check runs before every log). The
        step number itself is counted on the device (a changing host number in every step's operations would
        make lazy-mode backends build a new graph each step).
        """
        if not isinstance(loss_since_last_log, torch.Tensor) or step == self._last_step:
            return
        loss = loss_since_last_log.detach().reshape(()).float()
        if isinstance(grad_norm, torch.Tensor):
            norm = grad_norm.detach().reshape(-1)[0].float().to(loss.device)
        else:
            if grad_norm is not None and not math.isfinite(grad_norm) and self._host is None:
                self._host = (step, None, float(grad_norm))
            norm = torch.zeros((), device=loss.device)
        if self._step is None:
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
        """(step, loss or None, grad norm or None) of the first non-finite step, or None. Reads the device."""
        found = None
        if self._step is not None:
            step = int(self._step.item())
            if step:
                loss, norm = self._values.tolist()
                found = (step, loss, norm)
        if self._host is not None and (found is None or self._host[0] < found[0]):
            found = self._host
        if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            found = _earliest_on_any_rank(found, self._device())
        return found

    def _device(self):
        return self._step.device if self._step is not None else torch.device("cpu")

    def check(
        self, max_steps: int, output_dir: str, last_checkpoint, world_size: int = 1
    ) -> Optional[TrainingDiverged]:
        """The exception ending the run when a step was not finite, else None.

        `last_checkpoint`: its path or None, or a function returning it (called only when the run diverged).
        """
        found = self.first_non_finite(world_size)
        if found is None:
            return None
        if callable(last_checkpoint):
            last_checkpoint = last_checkpoint()
        step, loss, norm = found
        what = []
        if loss is not None and not math.isfinite(loss):
            what.append(f"loss {_number(loss)}")
        if norm is not None and not math.isfinite(norm):
            what.append(f"gradient norm {_number(norm)}")
        observed = " and ".join(what) or "a value on another process not finite"
        kept = (
            f"the last complete checkpoint is {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was saved before it"
        )
        message = (
            f"Training diverged at step {step} of {max_steps} ({observed}): stopped, nothing published in {output_dir}; "
            f"{kept}. Change the recipe (a lower --learning_rate, --max_grad_norm) and rerun with --overwrite_output_dir "
            "or another --output_dir."
        )
        return TrainingDiverged(message)


def _number(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+Infinity" if value > 0 else "-Infinity")


def _earliest_on_any_rank(found: Optional[tuple], device) -> Optional[tuple]:
    """The earliest non-finite step over all ranks (this rank's values when it saw that step, else None)."""
    never = float(2**31)
    mine = torch.tensor([float(found[0]) if found else never], device=device)  # (float: every backend reduces it)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
    earliest = mine.item()
    if earliest >= never:
        return None
    if found is not None and found[0] == int(earliest):
        return found
    return (int(earliest), None, None)


def report(diverged: TrainingDiverged, is_main_process: bool) -> None:
    """Print the one line (once, from the main process) and raise it."""
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

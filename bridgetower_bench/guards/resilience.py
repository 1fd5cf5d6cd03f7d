"""Runs that stop cleanly, losing no work, on an image that fails mid-run and on signals (docs/RUNS.md)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Optional

import torch
from transformers import TrainerCallback

from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)
_taking_sigterm: Optional[int] = None  # the loader worker (pid) whose SIGTERM a thread takes


class ImageLoadError(UserInputError):
    """An image could not be loaded while training or evaluating; the message names the split and path. From a
    loader worker it arrives wrapped in the worker's traceback: `reason` is the original line."""

    @property
    def reason(self) -> str:
        text = str(self)
        if "Original Traceback" not in text:
            return text
        last_line = text.rstrip().splitlines()[-1]  # "<module>.ImageLoadError: <the original message>"
        return last_line.partition(f"{type(self).__name__}: ")[2] or last_line


class StoppedAtOnce(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: the run stops where it is (user_errors.exit_on_user_error prints its line). A
    KeyboardInterrupt, so that what handles Ctrl-C (PyTorch's loader workers end quietly) handles it too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class TrainingInterrupted(SystemExit):
    """Training stopped on SIGTERM/SIGINT after saving a checkpoint. Exit status 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(128 + signum)
        self.message = message


def image_label(value) -> str:
    """How an error names an image value: its path, or 'embedded bytes'."""
    if isinstance(value, dict):
        path = value.get("path")
        if not path:
            return "embedded bytes"
        return f"embedded bytes of {path!r}" if value.get("bytes") else repr(path)
    if isinstance(value, (str, os.PathLike)):
        return repr(os.fspath(value))
    return type(value).__name__


class StopOnSignal(TrainerCallback):
    """SIGTERM/SIGINT during training: a checkpoint after this step, then stop; a second one acts at once. Installed
    before the loader workers fork (they inherit the handlers). The ranks agree every `sync_every_steps` steps (one
    tiny all-reduce), or the others would wait forever in the next gradient all-reduce."""

    def __init__(self, sync_every_steps: int = 10):
        self.sync_every_steps = max(1, int(sync_every_steps))
        self.received: Optional[int] = None  # the signal number, once one arrived
        self.stopped_at: Optional[int] = None  # the global step the run stopped at because of it
        self.training_done = False  # the last step is done: a signal now waits for the final results to be saved
        self._previous: dict = {}

    def install(self) -> None:
        """Start catching SIGTERM/SIGINT, forgetting an earlier signal (no-op if already, or off the main thread)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        self.received, self.stopped_at, self.training_done = None, None, False
        self._previous = {signum: signal.signal(signum, self._handle) for signum in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None and torch.utils.data.get_worker_info() is None:  # (a loader worker says nothing)
            what = "training stops and saves a checkpoint after the current step"
            if self.training_done:
                what = "the run stops once the final results being saved are complete"
            logger.warning("%s received: %s (send it again to stop at once).", signal.Signals(signum).name, what)
        self.received = signum
        if signum in self._previous:
            previous = self._previous[signum]
            defaults = (signal.SIG_DFL, signal.default_int_handler)  # a silent kill, a traceback: StoppedAtOnce
            signal.signal(signum, _stop_at_once if previous in defaults else previous)

    def on_step_end(self, args, state, control, **kwargs):
        if self._all_ranks_stop(args, state):
            control.should_save = control.should_training_stop = True
            self.stopped_at = state.global_step
        self.training_done = state.global_step >= state.max_steps
        return control

    def _all_ranks_stop(self, args, state) -> bool:
        if args.world_size <= 1 or not torch.distributed.is_initialized():
            return self.received is not None
        if state.global_step % self.sync_every_steps != 0:
            return False
        flag = torch.tensor([0 if self.received is None else self.received], device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        agreed = int(flag.item())
        if agreed and self.received is None:
            self.received = agreed  # another rank got the signal
        return bool(agreed)

    def interruption(self, state, output_dir: str) -> Optional[TrainingInterrupted]:
        """The exception ending the run, when a signal stopped training before its last step."""
        if self.stopped_at is None or self.received is None or state.global_step >= state.max_steps:
            return None  # no signal, or it arrived as the last step finished: the run is complete
        name = signal.Signals(self.received).name
        checkpoint = os.path.join(output_dir, f"checkpoint-{self.stopped_at}")
        message = (
            f"Training stopped by {name} at step {self.stopped_at} of {state.max_steps}; checkpoint saved in "
            f"{checkpoint}. Rerun the same command (without --overwrite_output_dir) to resume from it."
        )
        return TrainingInterrupted(message, self.received)

    def stopped_after_saving(self, output_dir: str) -> Optional[TrainingInterrupted]:
        """The exception ending the run when a signal arrived after training or while results were being saved."""
        if self.received is None:
            return None
        message = (
            f"Stopped by {signal.Signals(self.received).name} after saving completely what the run had done so far in "
            f"{output_dir}. Rerun the same command (without --overwrite_output_dir) to do the phases that are left."
        )
        return TrainingInterrupted(message, self.received)


def _stop_at_once(signum, frame) -> None:
    raise StoppedAtOnce(signum)


def leave_sigterm_to_the_main_process() -> None:
    """In a loader worker (called for every batch): a SIGTERM from anyone but the main process is ignored from now
    on, not fatal as with PyTorch's handler. Handlers are not told who sent it: a thread takes it (`sigwaitinfo`)."""
    global _taking_sigterm
    if _taking_sigterm == os.getpid() or torch.utils.data.get_worker_info() is None:
        return
    _taking_sigterm = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_take_sigterm, name="sigterm", daemon=True).start()


def _take_sigterm() -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != os.getppid():
        pass  # the scheduler's, or anyone's but the main process: the main process stops the run
    os._exit(0)  # the main process ends its workers: as PyTorch's handler does


def report_and_exit(interrupted: TrainingInterrupted, is_main_process: bool) -> None:
    if is_main_process:
        logger.warning(interrupted.message)
        print(interrupted.message, file=sys.stderr, flush=True)
    raise interrupted

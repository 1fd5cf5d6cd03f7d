"""Long runs that stop cleanly and lose no work.

- `ImageLoadError`: an image that cannot be loaded once training has started (a file removed
  mid-run). `data.BatchTransform` raises it naming the split and the path; the trainer saves a
  checkpoint and stops with that message (see `TrainerExtensions.train`).
- `StopOnSignal`: SIGTERM or SIGINT during training saves a checkpoint at the next optimizer-step
  boundary and stops; the run then ends with `TrainingInterrupted` (exit status 128 + signal
  number, the shell's convention for "killed by that signal", so schedulers and `&&` chains see an
  unfinished run). Rerunning the same command resumes from the checkpoint.
- `check_output_dir`: the checkpoint to resume from, or a refusal when --output_dir holds anything
  other than a previous run of the scripts.
- `atomic_path` / `write_json_atomically` / `staged_directory`: files appear complete or not at
  all, so a kill never leaves a half-written metrics file or model.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class ImageLoadError(ValueError):
    """An image could not be loaded while training or evaluating. The message names the split and path.

    Raised inside a DataLoader worker, it reaches the main process re-created by PyTorch with a
    message that wraps the worker's whole traceback; `reason` recovers the original one-line message.
    """

    @property
    def reason(self) -> str:
        text = str(self)
        if "Original Traceback" not in text:
            return text
        last_line = text.rstrip().splitlines()[-1]  # "<module>.ImageLoadError: <the original message>"
        return last_line.partition(f"{type(self).__name__}: ")[2] or last_line


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


# ---------------------------------------------------------------------------------------------
# SIGTERM / SIGINT: checkpoint at the next step boundary, then stop
# ---------------------------------------------------------------------------------------------


class StopOnSignal(TrainerCallback):
    """Turn SIGTERM/SIGINT during training into "save a checkpoint after this step, then stop".

    The handlers are installed only while `installed()` is active (around `Trainer.train`), before
    the DataLoader workers are forked: workers inherit them, so Ctrl-C in a terminal (which signals
    the whole process group) does not kill a worker under the main process. After a first signal,
    that signal's previous handler is restored: sending it again acts at once (a second Ctrl-C
    raises KeyboardInterrupt).

    With several processes the ranks must stop at the same step, or the others would wait forever
    in the next gradient all-reduce: every `sync_every_steps` optimizer steps they all-reduce the
    "signal received" flag (one tiny collective, not one per step), so a distributed run stops
    within that many steps of the signal.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, sync_every_steps: int = 10):
        self.sync_every_steps = max(1, int(sync_every_steps))
        self.received: Optional[int] = None  # the signal number, once one arrived
        self.stopped_at: Optional[int] = None  # the global step the run stopped at because of it
        self._previous: dict = {}

    @contextmanager
    def installed(self) -> Iterator[None]:
        self.received, self.stopped_at = None, None
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        try:
            yield
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            logger.warning(
                "%s received: training stops and saves a checkpoint after the current step "
                "(send it again to stop at once).", signal.Signals(signum).name
            )
        self.received = signum
        if signum in self._previous:
            signal.signal(signum, self._previous[signum])

    def on_step_end(self, args, state, control, **kwargs):
        if self._all_ranks_stop(args, state):
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
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
        if self.stopped_at is None or state.global_step >= state.max_steps:
            return None  # no signal, or it arrived as the last step finished: the run is complete
        name = signal.Signals(self.received).name
        checkpoint = os.path.join(output_dir, f"checkpoint-{self.stopped_at}")
        message = (
            f"Training stopped by {name} at step {self.stopped_at} of {state.max_steps}; checkpoint saved in "
            f"{checkpoint}. Rerun the same command (without --overwrite_output_dir) to resume from it."
        )
        return TrainingInterrupted(message, self.received)


def report_and_exit(interrupted: TrainingInterrupted, is_main_process: bool) -> None:
    """Print the interruption's message (once, from the main process) and raise it."""
    if is_main_process:
        logger.warning(interrupted.message)
        print(interrupted.message, file=sys.stderr, flush=True)
    raise interrupted


# ---------------------------------------------------------------------------------------------
# --output_dir: resume a previous run, never overwrite anything else
# ---------------------------------------------------------------------------------------------

# What the scripts (and the Trainer) leave in an output directory.
RUN_MARKERS = (
    "trainer_state.json", "all_results.json", "train_results.json", "validation_results.json", "eval_results.json",
    "test_results.json",
)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str) -> list[str]:
    """checkpoint-N directories in output_dir, by step."""
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found) if os.path.isdir(os.path.join(output_dir, name))]


def is_complete_checkpoint(checkpoint: str) -> bool:
    """The Trainer writes trainer_state.json last: a checkpoint without a readable one was cut short."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The newest checkpoint that was saved completely (a kill during a save leaves an incomplete one)."""
    for checkpoint in reversed(checkpoints(output_dir)):
        if is_complete_checkpoint(checkpoint):
            return checkpoint
        logger.warning(f"{checkpoint} is incomplete (no readable trainer_state.json): not resuming from it")
    return None


def is_previous_run(output_dir: str) -> bool:
    """Whether output_dir holds a run of these scripts: metrics, trainer state or checkpoints."""
    return any(os.path.isfile(os.path.join(output_dir, m)) for m in RUN_MARKERS) or bool(checkpoints(output_dir))


def check_output_dir(output_dir: str, *, overwrite_output_dir: bool, do_train: bool, resume_from_checkpoint) -> Optional[str]:
    """The checkpoint to resume training from (None: start afresh), or a ValueError when output_dir must not be written.

    Without --overwrite_output_dir, a non-empty output_dir is only used when
    - training: it holds a (complete) checkpoint to resume from (upstream's rule);
    - evaluating or predicting only: it holds a previous run of these scripts (its results files are updated).
    """
    if overwrite_output_dir or not os.path.isdir(output_dir) or not os.listdir(output_dir):
        return None
    contents = ", ".join(sorted(os.listdir(output_dir))[:5]) + (", ..." if len(os.listdir(output_dir)) > 5 else "")
    if do_train:
        last = last_complete_checkpoint(output_dir)
        if last is None:
            raise ValueError(
                f"--output_dir={output_dir} already exists and is not empty ({contents}) but holds no checkpoint to "
                "resume from. Use --overwrite_output_dir to overcome."
            )
        if resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last}. Pass --overwrite_output_dir to start over.")
        return last
    if not is_previous_run(output_dir):
        raise ValueError(
            f"--output_dir={output_dir} already exists and holds files that are not from a run of this script "
            f"({contents}). Use --overwrite_output_dir to write into it anyway."
        )
    return None


# ---------------------------------------------------------------------------------------------
# Files that appear complete or not at all
# ---------------------------------------------------------------------------------------------


@contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one step, on failure it vanishes."""
    temporary = f"{path}.partial-{os.getpid()}"
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_json_atomically(path: str, obj) -> None:
    """json.dump(obj) to `path` (indent 4, sorted keys, as the Trainer writes metrics), atomically."""
    with atomic_path(path) as temporary:
        with open(temporary, "w") as f:
            json.dump(obj, f, indent=4, sort_keys=True)
            f.write("\n")


STAGING_DIR_NAME = ".partial-save"


@contextmanager
def staged_directory(target_dir: str, publish: bool = True) -> Iterator[str]:
    """Yield a staging directory inside `target_dir`; on success its files are moved into `target_dir`.

    Each file lands with one os.replace (same filesystem), so `target_dir` never holds a half-written
    file: a kill during the save leaves only the staging directory, which the next save clears.
    `publish=False` (processes other than the one that saves) moves nothing.
    """
    staging = os.path.join(target_dir, STAGING_DIR_NAME)
    if publish:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        if publish and os.path.isdir(staging):
            for root, _, files in os.walk(staging):
                destination = os.path.join(target_dir, os.path.relpath(root, staging))
                os.makedirs(destination, exist_ok=True)
                for name in files:
                    os.replace(os.path.join(root, name), os.path.join(destination, name))
    finally:
        if publish:
            shutil.rmtree(staging, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (a leftover temp file of a live build must not be removed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True

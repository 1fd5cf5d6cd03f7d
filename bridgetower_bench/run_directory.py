"""The run's --output_dir: one run at a time, nothing foreign touched, the final set published all-or-nothing.

- `claim`: an exclusive lock (`.bridgetower-lock`, fcntl.flock, holding the pid and host for the
  message) for the life of the process. A second run on the same directory is refused naming the
  holder; the lock of a process that died (the kernel releases its flock) is taken over with a
  warning. With several processes only the job's first one claims the directory: the others are
  part of the same run. Claiming also finishes a publication that a killed run had committed, and
  removes what killed writers on this host left (staging directories, temporary files of recorded
  names: `atomic_files`' names, which record the writer's host and pid).
- What is "ours": `.bridgetower-run.json` lists every top-level name a run of these scripts wrote
  (recorded before the name is first written). `foreign_entries` is everything else, minus our own
  bookkeeping; the scripts refuse a directory holding foreign entries and checkpoint rotation only
  ever deletes recorded checkpoints.
- `publication`: files saved together (final model, config, tokenizer, image processor, metrics,
  trainer state) appear together. They are written into a staging directory
  (`.staging.partial-<host>-<pid>.<random>/`); renaming it to `.publishing/` is the commit point;
  then each file is moved into place. A kill before the commit leaves the previous set untouched
  (the staging directory is discarded later); a kill after it is rolled forward by the next `claim`
  or `finish_publication`, so once either has run the directory holds exactly the old set or exactly
  the new one. A publication holding a model replaces the previous model's whole set (its eval/test
  results too).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from . import disk_space
from .atomic_files import parse_temp_name, remove_abandoned, temp_path, write_json_atomically
from .user_errors import UserInputError

logger = logging.getLogger(__name__)

LOCK_NAME = ".bridgetower-lock"
RECORD_NAME = ".bridgetower-run.json"
STAGING_NAME = ".staging"  # staged under a temporary name of it (atomic_files.temp_path)
PUBLISHING_NAME = ".publishing"
PUBLICATION_RECORD = ".publication.json"
# Names earlier versions staged and wrote under, without the host: removed at the next claim.
_LEGACY = re.compile(r"^(?:\.partial-save|\.staging-\d+|(?P<target>.+)\.partial-\d+)$")
# Test hook: "N:SIGNAME" sends that signal to this process at the N-th write or rename of the publications.
FAULT_ENV = "BRIDGETOWER_TEST_PUBLICATION_FAULT"

_held: dict = {}  # realpath of a claimed output_dir -> (open lock file, whether claim created the directory)
_steps_done = 0


class OutputDirInUse(UserInputError):
    """Another run holds the lock of this --output_dir."""


# ---------------------------------------------------------------------------------------------
# What runs of these scripts wrote
# ---------------------------------------------------------------------------------------------


def read_record(output_dir: str) -> dict:
    try:
        with open(os.path.join(output_dir, RECORD_NAME)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}
    record.setdefault("written", [])  # every top-level name a run wrote
    record.setdefault("current", [])  # the files of the last published model and everything published since
    return record


def record_written(output_dir: str, names) -> None:
    """Add top-level names to the record of what runs wrote (call before writing them)."""
    record = read_record(output_dir)
    new = set(names) - set(record["written"])
    if new:
        os.makedirs(output_dir, exist_ok=True)
        record["written"] = sorted(set(record["written"]) | new)
        write_json_atomically(os.path.join(output_dir, RECORD_NAME), record)


def _stands_for(name: str) -> Optional[str]:
    """The name a temporary (or an earlier version's leftover) stands for; None for other names."""
    if temp := parse_temp_name(name):
        return temp.target
    legacy = _LEGACY.match(name)
    return (legacy["target"] or STAGING_NAME) if legacy else None


def _is_bookkeeping(name: str) -> bool:
    return name in (LOCK_NAME, RECORD_NAME, PUBLISHING_NAME) or _stands_for(name) in (STAGING_NAME, RECORD_NAME)


def foreign_entries(output_dir: str) -> list[str]:
    """Entries of output_dir that no run of these scripts wrote (sorted)."""
    ours = set(read_record(output_dir)["written"])
    return sorted(name for name in os.listdir(output_dir)
                  if not (_is_bookkeeping(name) or name in ours or _stands_for(name) in ours))


def is_ours(output_dir: str, name: str) -> bool:
    return name in read_record(output_dir)["written"]


def finished_training(output_dir: str, max_steps: int, num_train_epochs: float) -> bool:
    """Whether output_dir holds a published model trained as far as asked (the same --max_steps, or the same
    --num_train_epochs when --max_steps is not set): its train_results.json and trainer state are part of the set."""
    if "train_results.json" not in read_record(output_dir)["current"]:
        return False
    try:
        with open(os.path.join(output_dir, "trainer_state.json")) as f:
            state = json.load(f)
        if state["global_step"] < state["max_steps"]:
            return False
        if max_steps > 0:
            return state["max_steps"] == max_steps
        return state["num_train_epochs"] == math.ceil(num_train_epochs)
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ---------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"process {holder['pid']} on host {holder['host']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


def claim(output_dir: str, holder: bool = True) -> None:
    """Lock output_dir for this run (until the process exits), then finish or clear what a killed run left.

    `holder=False` (every process of a distributed job but the first) does nothing: the job's first process
    holds the lock for all of them.
    """
    key = os.path.realpath(output_dir)
    if not holder or key in _held:
        return
    created = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    lock = open(os.path.join(output_dir, LOCK_NAME), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        text = lock.read()
        lock.close()
        raise OutputDirInUse(f"--output_dir={output_dir} is in use by another run ({_describe_holder(text)}): "
                             "wait for it to end, or choose another --output_dir") from None
    lock.seek(0)
    previous = lock.read().strip()
    if previous:  # the holder died without releasing it (killed): the kernel dropped its flock
        logger.warning(f"--output_dir={output_dir}: taking over the stale lock of {_describe_holder(previous)}, "
                       "which ended without releasing it")
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
    lock.flush()
    if not _held:
        atexit.register(release_all)
    _held[key] = (lock, created)
    finish_publication(output_dir)
    remove_leftovers(output_dir)


def release(output_dir: str) -> None:
    """Give up the lock; a directory in which this run wrote nothing is left as it was found."""
    entry = _held.pop(os.path.realpath(output_dir), None)
    if entry is None:
        return
    lock, created = entry
    try:
        if not read_record(output_dir)["written"] and all(_is_bookkeeping(n) for n in os.listdir(output_dir)):
            for name in (RECORD_NAME, LOCK_NAME):
                if os.path.exists(os.path.join(output_dir, name)):
                    os.remove(os.path.join(output_dir, name))
            if created and not os.listdir(output_dir):
                os.rmdir(output_dir)
        else:
            lock.seek(0)
            lock.truncate()  # an empty lock file: released cleanly, not stale
            lock.flush()
    except OSError:
        pass
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def release_all() -> None:
    for key in list(_held):
        release(key)


def remove_leftovers(output_dir: str) -> None:
    """Remove staging directories and temporary files of names runs wrote, whose writer died on this host.

    Leftovers of earlier versions (no host in the name) go too: whoever wrote them no longer holds the lock.
    """
    ours = set(read_record(output_dir)["written"]) | {RECORD_NAME, STAGING_NAME}
    removed = remove_abandoned(output_dir, only=ours.__contains__)
    for name in os.listdir(output_dir):
        if _LEGACY.match(name) and _stands_for(name) in ours:
            path = os.path.join(output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            removed.append(name)
    if removed:
        logger.warning(f"--output_dir={output_dir}: removed what killed writes left: {', '.join(sorted(removed))}")


# ---------------------------------------------------------------------------------------------
# Publication: a set of files, all or nothing
# ---------------------------------------------------------------------------------------------


def fault_point() -> None:
    """One write or rename of a publication. The fault-injection tests stop the process at a chosen one."""
    global _steps_done
    _steps_done += 1
    spec = os.environ.get(FAULT_ENV)
    if spec:
        step, _, name = spec.partition(":")
        if int(step) == _steps_done:
            os.kill(os.getpid(), getattr(signal, name or "SIGKILL"))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def publication(output_dir: str, publish: bool = True) -> Iterator[str]:
    """Yield a staging directory; what is saved into it appears in output_dir together, or (on an error) not at all.

    `publish=False` (processes other than the one that saves) yields the path and publishes nothing.
    """
    staging = temp_path(os.path.join(output_dir, STAGING_NAME))
    if not publish:
        yield staging
        return
    os.makedirs(output_dir, exist_ok=True)
    finish_publication(output_dir)
    with disk_space.removed_when_disk_full(staging, f"the final results into {output_dir}",
                                           after=lambda: "; the results published before are intact"):
        os.makedirs(staging)
        try:
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _commit(output_dir, staging)


def _commit(output_dir: str, staging: str) -> None:
    files = sorted(os.path.relpath(os.path.join(root, name), staging)
                   for root, _, names in os.walk(staging) for name in names)
    if not files:
        shutil.rmtree(staging)
        return
    for name in files:
        _fsync(os.path.join(staging, name))  # the data is on disk before the rename commits it
    record = read_record(output_dir)
    has_model = "config.json" in files
    remove = sorted(set(record["current"]) - set(files)) if has_model else []
    current = files if has_model else sorted(set(record["current"]) | set(files))
    record_written(output_dir, {name.split(os.sep)[0] for name in files})
    fault_point()
    with open(os.path.join(staging, PUBLICATION_RECORD), "w") as f:
        json.dump({"files": files, "remove": remove, "current": current}, f)
        f.flush()
        os.fsync(f.fileno())
    fault_point()
    os.rename(staging, os.path.join(output_dir, PUBLISHING_NAME))  # the commit point
    _fsync(output_dir)
    fault_point()
    finish_publication(output_dir)


def finish_publication(output_dir: str) -> None:
    """Move a committed publication's files into place (idempotent: a kill midway is finished by the next call)."""
    pending = os.path.join(output_dir, PUBLISHING_NAME)
    if not os.path.isdir(pending):
        return
    try:
        with open(os.path.join(pending, PUBLICATION_RECORD)) as f:
            plan = json.load(f)
    except (OSError, ValueError):  # its record goes last: every file was already moved
        shutil.rmtree(pending)
        return
    for name in plan["remove"]:
        if os.path.isfile(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
            fault_point()
    for name in plan["files"]:
        source = os.path.join(pending, name)
        if os.path.exists(source):
            os.makedirs(os.path.dirname(os.path.join(output_dir, name)), exist_ok=True)
            os.replace(source, os.path.join(output_dir, name))
            fault_point()
    record = read_record(output_dir)
    if record["current"] != plan["current"]:
        record["current"] = plan["current"]
        write_json_atomically(os.path.join(output_dir, RECORD_NAME), record)
        fault_point()
    os.remove(os.path.join(pending, PUBLICATION_RECORD))
    shutil.rmtree(pending)
    _fsync(output_dir)
    fault_point()

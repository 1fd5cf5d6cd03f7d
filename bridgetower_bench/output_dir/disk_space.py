"""A full disk ends the run in one line (`DiskFull`: a UserInputError naming the path and the free space), with
nothing half-written left behind; which failures count as a full disk: docs/RUNS.md, "A full disk"."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

from bridgetower_bench.user_errors import UserInputError


NEARLY_FULL_BYTES = 1 << 20  # torch.save's C++ writer reports a full disk only as "unexpected pos ...", no errno
# (safetensors says "No space left on device (os error 28)", with no errno)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


class DiskFull(UserInputError):
    """A write failed because its filesystem (or the user's quota) is full."""


def free_bytes(path) -> Optional[int]:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); None when unknown."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def describe_bytes(count: Optional[int]) -> str:
    if count is None:
        return "unknown"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def is_disk_full(error: BaseException, path) -> bool:
    """Whether `error`, raised while writing under `path`, comes from a full filesystem or quota."""
    seen = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(cause) for text in _FULL_TEXTS):
            return True
        cause = cause.__cause__ or cause.__context__
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: never a full disk
        return False
    free = free_bytes(path)
    return free is not None and free < NEARLY_FULL_BYTES


@contextmanager
def removed_when_disk_full(directory, what: str, after: Callable[[], str] = lambda: "") -> Iterator[None]:
    """Run the block that writes `directory` (`what` names it); when it fails on a full disk, remove `directory`
    (when the block created it) and raise `DiskFull`, its message ending with what `after()` adds (e.g. the last
    complete checkpoint). Any other failure passes through unchanged."""
    existed = os.path.lexists(directory)
    try:
        yield
    except BaseException as error:
        if not is_disk_full(error, directory):
            raise
        if existed:
            left = "; it was there before this write and may now be incomplete"
        else:
            shutil.rmtree(directory, ignore_errors=True)
            left = "; the partial files were removed"
        raise DiskFull(
            f"disk full while writing {what} ({directory}): {describe_bytes(free_bytes(directory))} free on "
            f"its filesystem{left}{after()}"
        ) from None

"""Reading a file that must be a regular file, without ever blocking on a FIFO or opening a device. No third-party
import, so that the tools that check paths start without loading torch."""

from __future__ import annotations

import errno
import os
import stat


class NotARegularFile(OSError):
    """An image path names a directory, FIFO, device or socket: nothing is read from it."""


_FILE_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def not_regular_reason(mode: int) -> str | None:
    """'not a regular file: <kind>' for a st_mode that is not a regular file's, else None."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "special file")
    return f"not a regular file: {kind}"


def read_regular_file(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit`` + 1 of them where ``limit`` is given, so that a
    caller sees it is longer); ``NotARegularFile`` (an OSError) for anything else. Looked at
    before it is opened (a device is never opened), opened with ``O_NONBLOCK`` (a FIFO swapped in meanwhile does not
    wait for a writer) and looked at again through the open descriptor, which is what is read."""
    reason = not_regular_reason(os.stat(path).st_mode)
    if reason is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as handle:
            reason = not_regular_reason(os.fstat(fd).st_mode)
            if reason is None:
                return handle.read(-1 if limit is None else limit + 1)
    raise NotARegularFile(errno.EINVAL, reason, os.fspath(path))

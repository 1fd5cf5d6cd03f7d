"""Files and directories that appear complete or not at all, and removal of what killed writers left.

Everything is written under a temporary name beside its target, `<target>.partial-<host>-<pid>.<random>`, then
renamed onto it in one step: output directories and caches may sit on a filesystem shared by several nodes, and
the host and pid let `remove_abandoned` delete only the leftovers of processes that died on this host.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, Optional

from psutil import pid_exists

from bridgetower_bench.regular_files import NotARegularFile, not_regular_reason


PARTIAL_MARK = ".partial-"
# The host takes everything up to the last "-<pid>.<random>": host names may hold "-" and "." themselves.
_TEMP_NAME = re.compile(rf"^(?P<target>.+){re.escape(PARTIAL_MARK)}(?P<host>.+)-(?P<pid>\d+)\.(?P<random>[0-9a-f]+)$")


class TempName(NamedTuple):
    target: str  # the name the temporary file or directory stands in for
    host: str
    pid: int


def temp_path(path) -> str:
    """A fresh temporary path beside `path`, naming this host and process (unique within the process too)."""
    return f"{os.fspath(path)}{PARTIAL_MARK}{socket.gethostname()}-{os.getpid()}.{secrets.token_hex(4)}"


def parse_temp_name(name: str) -> Optional[TempName]:
    """The target, host and pid a temporary name records; None for a name outside the scheme."""
    match = _TEMP_NAME.match(name)
    return TempName(match["target"], match["host"], int(match["pid"])) if match else None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def fsync_path(path) -> None:
    """Force a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(directory: str) -> list:
    """Every file under `directory`, as sorted paths relative to it."""
    return sorted(
        os.path.relpath(os.path.join(root, name), directory) for root, _, names in os.walk(directory) for name in names
    )


def read_json(path, default=None):
    """The JSON a file holds; `default` when it is absent or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _refuse_unless_regular(path) -> None:
    """NotARegularFile when `path` (its symbolic links followed) is there and is not a regular file."""
    try:
        reason = not_regular_reason(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    if reason:
        raise NotARegularFile(errno.EINVAL, f"{reason}; only a regular file is replaced", os.fspath(path))


@contextmanager
def atomic_path(path, fsync: bool = False) -> Iterator[str]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one step, on failure it vanishes.
    `path` must be absent or a regular file (a device such as /dev/null, a FIFO: never renamed over), checked before
    the yield and before the rename; a symbolic link stays, and what it points to is written (beside its target).
    `fsync=True`: a machine crash cannot leave `path` renamed but empty."""
    _refuse_unless_regular(path)
    if os.path.islink(path):
        path = os.path.realpath(path)
    temporary = temp_path(path)
    try:
        try:
            yield temporary
        except OSError as error:
            if error.filename is None:  # a write's own error (a full disk) names no file: name the target
                raise OSError(error.errno, error.strerror or str(error), os.fspath(path)) from error
            raise
        _refuse_unless_regular(path)
        if fsync:
            fsync_path(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            _remove(temporary)


def write_atomically(path, data, fsync: bool = False) -> None:
    """Write `data` (bytes, or text written as UTF-8) to `path`, atomically."""
    with atomic_path(path, fsync=fsync) as temporary:
        with open(temporary, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


def write_json_atomically(path, obj) -> None:
    """json.dump(obj) to `path` (indent 4, sorted keys, as the Trainer writes metrics), atomically."""
    with atomic_path(path) as temporary:
        with open(temporary, "w") as f:
            json.dump(obj, f, indent=4, sort_keys=True)
            f.write("\n")


@contextmanager
def staged_directory(path, keep_existing: Callable[[], bool] = lambda: False) -> Iterator[str]:
    """Yield a fresh temporary directory beside `path`; on success it replaces `path` (whose old content is
    moved aside first, so nobody sees it half deleted), on failure it is removed. When `keep_existing()` is true
    at the end (e.g. a concurrent writer already published the same result), it is dropped and `path` kept."""
    staged = temp_path(path)
    os.mkdir(staged)
    try:
        yield staged
        if keep_existing():
            shutil.rmtree(staged, ignore_errors=True)
            return
        if os.path.lexists(path):
            doomed = temp_path(path)
            os.replace(path, doomed)
            _remove(doomed)
        os.replace(staged, path)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def remove_abandoned(directory, only: Optional[Callable[[str], bool]] = None, min_age_s: float = 0.0) -> list[str]:
    """Remove the temporary files and directories in `directory` whose writer died on this host; return their names.
    Kept: names outside the scheme, of live processes, of other hosts, whose target `only(target)` rejects, or
    modified less than `min_age_s` seconds ago."""
    host, removed = socket.gethostname(), []
    for name in os.listdir(directory):
        temp = parse_temp_name(name)
        if temp is None or temp.host != host or (only is not None and not only(temp.target)):
            continue
        path = os.path.join(directory, name)
        try:
            if min_age_s and time.time() - os.lstat(path).st_mtime < min_age_s:
                continue
            if not pid_exists(temp.pid):  # (another user's process counts as alive)
                _remove(path)
                removed.append(name)
        except FileNotFoundError:  # another cleaner got there first
            continue
    return sorted(removed)

"""Everything about --output_dir: the path checked at step 1, files runs did not write refused, the run's lock, the
record of what runs wrote, the final set published all-or-nothing, the published model, the checkpoints by step
(docs/ARCHITECTURE.md, "`--output_dir`, from step 1 to the publication"; docs/RUNS.md)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, Optional

from filelock import FileLock, Timeout

from bridgetower_bench.output_dir import atomic_files, checkpoint_manifest, disk_space
from bridgetower_bench.regular_files import not_regular_reason
from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

LOCK_NAME = ".bridgetower-lock"
RECORD_NAME = ".bridgetower-run.json"
STAGING_NAME = ".staging"  # staged under a temporary name of it (atomic_files.temp_path)
PUBLISHING_NAME = ".publishing"
PUBLICATION_RECORD = ".publication.json"
PUBLISHED_MANIFEST = "model-manifest.json"  # a published model's files (not its results), as a checkpoint's manifest
# What the cluster check (tools/cluster_check.py) leaves in the run's directory, the only place that proves every node
# sees one directory: its record, and while it runs a token per node, `<CHECK_TOKEN>-<node>` under a temporary name
# of the check's host and process. Neither makes a run refuse the directory; a token is removed once its check is
# dead (a check killed by SIGKILL included) by the next run or check on that host.
CHECK_RECORD = "cluster_check.json"
CHECK_TOKEN = ".cluster_check"

_held: dict = {}  # realpath of a claimed output_dir -> (open lock file, whether claim created the directory)


class OutputDirInUse(UserInputError):
    """Another run holds the lock of this --output_dir."""


class OutputDirNotShared(UserInputError):
    """A process of the job does not see the lock its first process took: --output_dir is no shared directory."""


def read_record(output_dir: str) -> dict:
    record = atomic_files.read_json(os.path.join(output_dir, RECORD_NAME), {})
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
        atomic_files.write_json_atomically(os.path.join(output_dir, RECORD_NAME), record)


def _stands_for(name: str) -> Optional[str]:
    """The name a temporary stands for; None for other names."""
    temp = atomic_files.parse_temp_name(name)
    return temp.target if temp else None


def _is_bookkeeping(name: str) -> bool:
    return (
        name in (LOCK_NAME, RECORD_NAME, PUBLISHING_NAME, CHECK_RECORD)
        or _stands_for(name) in (STAGING_NAME, RECORD_NAME)
        or is_check_token(_stands_for(name))
    )


def is_check_token(target: Optional[str]) -> bool:
    """Whether a temporary name stands for one of the cluster check's tokens."""
    return bool(target and re.fullmatch(rf"{re.escape(CHECK_TOKEN)}-\d+", target))


def foreign_entries(output_dir: str) -> list[str]:
    """Entries of output_dir that no run of these scripts wrote (sorted)."""
    ours = set(read_record(output_dir)["written"])
    return sorted(n for n in os.listdir(output_dir) if not (_is_bookkeeping(n) or n in ours or _stands_for(n) in ours))


class Uncreatable(NamedTuple):
    ancestor: str  # the nearest existing ancestor of a path that cannot be created
    not_a_directory: bool  # a file or a link to nothing, rather than a directory this process may not write into


def uncreatable(path: str) -> Optional[Uncreatable]:
    """Why `path`, if absent, could not be created, or None when it could: the walk up to its nearest existing
    ancestor (a link to nothing counts as existing), which must be a directory this process may write into.
    The one check of the scripts' --output_dir and the tools' output paths (tools/tool_paths.py)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return Uncreatable(existing, True)
    if not os.access(existing, os.W_OK | os.X_OK):
        return Uncreatable(existing, False)
    return None


def check_output_dir_path(output_dir: Optional[str]) -> None:
    """--output_dir must be a directory, or a path where one can be created (checked before anything is written)."""
    if output_dir is None:
        return
    if not output_dir.strip():
        raise UserInputError(f"--output_dir={output_dir!r} is empty: give the directory the run writes into")
    path = os.path.abspath(os.path.expanduser(output_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserInputError(f"--output_dir={output_dir} is a file, not a directory")
    where = uncreatable(path)
    if where and where.not_a_directory:
        raise UserInputError(f"--output_dir={output_dir} cannot be created: {where.ancestor} is a file")
    if where:
        raise UserInputError(f"--output_dir={output_dir}: {where.ancestor} is not writable")


def check_output_dir(output_dir: str) -> None:
    """Refuse (UserInputError) an output_dir holding anything that runs of these scripts did not write: files of
    anyone else are never overwritten or deleted, --overwrite_output_dir or not; and one where something other than
    a regular file stands at a name of the published set, or of a publication waiting to be finished."""
    if not os.path.isdir(output_dir):
        return
    foreign = foreign_entries(output_dir)
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserInputError(
            f"--output_dir={output_dir} holds files this script did not write ({listed}); it never overwrites or "
            "deletes them, with or without --overwrite_output_dir: move them away or choose another --output_dir"
        )
    pending = _pending_plan(output_dir) or {}
    refuse_unless_files(output_dir, [*read_record(output_dir)["current"], *_replaced_by(pending)])


def refuse_unless_files(output_dir: str, names) -> None:
    """UserInputError naming the first of `names` (paths relative to output_dir) where a directory, FIFO, device or
    socket stands (its links followed), or whose way there is not a directory: a publication never renames a file
    over one nor removes it, so it is refused before anything is replaced."""
    for name in sorted(set(names)):
        try:
            reason = not_regular_reason(os.stat(os.path.join(output_dir, name)).st_mode)
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            reason = "under a file, not in a directory"
        if reason:
            raise UserInputError(
                f"--output_dir={output_dir}: {name} is {reason}, where the run publishes a file; it never replaces "
                "one: move it away and rerun the same command"
            )


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"process {holder['pid']} on host {holder['host']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


def claim(output_dir: str, holder: bool = True) -> None:
    """Lock output_dir for this run (until the process exits), then finish or clear what a killed run left.
    `holder=False` (every process of a distributed job but the first, which holds it for all) does nothing."""
    key = os.path.realpath(output_dir)
    if not holder or key in _held:
        return
    created = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    path, previous = os.path.join(output_dir, LOCK_NAME), []

    def sign(fd: int) -> None:  # once the lock is ours: note what a previous holder left, then who holds it now
        previous.append(os.pread(fd, 1 << 16, 0).decode(errors="replace").strip())
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        me["token"] = secrets.randbelow(2**31 - 1) + 1  # this claim's: `refuse_unless_shared`
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)  # a network filesystem shows the other nodes what was flushed

    # flock only (no soft-lock fallback): the kernel releases it when the holder dies, however it dies
    lock = FileLock(path, thread_local=False, fallback_to_soft=False, on_acquired=sign)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        with open(path) as f:
            raise OutputDirInUse(
                f"--output_dir={output_dir} is in use by another run ({_describe_holder(f.read())}): "
                "wait for it to end, or choose another --output_dir"
            ) from None
    if previous[0]:  # the holder died without releasing it (killed): the kernel dropped its flock
        logger.warning(
            f"--output_dir={output_dir}: taking over the stale lock of {_describe_holder(previous[0])}, "
            "which ended without releasing it"
        )
    if not _held:
        atexit.register(release_all)
    _held[key] = (lock, created)
    finish_publication(output_dir)
    remove_leftovers(output_dir)


def refuse_unless_shared(output_dir: str, device) -> None:
    """With several processes, after `claim`: each one must find in output_dir the lock the first one took (its
    token), else the job's nodes do not share the directory (a disk of each node's own, or another mount): no
    checkpoint could be complete there, so every process stops in one line, naming the ranks that do not see it."""
    import torch  # here only: the tools that check paths import this module and start without torch

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    try:
        token = int(atomic_files.read_json(os.path.join(output_dir, LOCK_NAME))["token"])
    except (ValueError, KeyError, TypeError):
        token = 0
    mine = torch.tensor([token], dtype=torch.int32, device=device)
    first = mine.clone()
    torch.distributed.broadcast(first, src=0)
    seen = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(seen, mine)
    blind = [str(rank) for rank, token in enumerate(seen) if token.item() != first.item()]
    if blind:
        raise OutputDirNotShared(
            f"--output_dir={output_dir} is not one directory for the whole job: rank(s) {', '.join(blind)} do not "
            "see the lock rank 0 took there (a disk of their own node?); put it on a filesystem every node mounts "
            "at the same path"
        )


def held_by(output_dir: str) -> Optional[str]:
    """Who holds output_dir's lock now ("process N on host H, since T"), or None when no live process does.
    Only tests the lock (flock, as `claim` takes it): takes nothing and creates no file."""
    path = os.path.join(output_dir, LOCK_NAME)
    if not os.path.isfile(path):  # no lock file (or no directory): nobody ever claimed it
        return None
    probe = FileLock(path, thread_local=False, fallback_to_soft=False)
    try:
        probe.acquire(blocking=False)
    except Timeout:
        with open(path) as f:
            return _describe_holder(f.read())
    probe.release()
    return None


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
            os.truncate(os.path.join(output_dir, LOCK_NAME), 0)  # an empty lock file: released cleanly, not stale
    except OSError:
        pass
    finally:
        lock.release()


def release_all() -> None:
    for key in list(_held):
        release(key)


def remove_leftovers(output_dir: str) -> None:
    """Remove staging directories and temporary files of names runs wrote, and the cluster check's tokens, whose
    writer died on this host."""
    ours = set(read_record(output_dir)["written"]) | {RECORD_NAME, STAGING_NAME}
    removed = atomic_files.remove_abandoned(output_dir, only=lambda target: target in ours or is_check_token(target))
    if removed:
        logger.warning(f"--output_dir={output_dir}: removed what killed writes left: {', '.join(sorted(removed))}")


@contextmanager
def publication(output_dir: str, publish: bool = True) -> Iterator[str]:
    """Yield a staging directory; what is saved into it appears in output_dir together, or (on an error) not at all.
    `publish=False` (processes other than the one that saves) yields the path and publishes nothing."""
    staging = atomic_files.temp_path(os.path.join(output_dir, STAGING_NAME))
    if not publish:
        yield staging
        return
    os.makedirs(output_dir, exist_ok=True)
    finish_publication(output_dir)
    with disk_space.removed_when_disk_full(
        staging, f"the final results into {output_dir}", after=lambda: "; the results published before are intact"
    ):
        os.makedirs(staging)
        try:
            yield staging
            _commit(output_dir, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # (gone once committed: renamed onto .publishing)
            raise


def _replaced_by(plan: dict) -> list:
    """The names in output_dir a publication's plan replaces or removes."""
    return [*plan.get("files", ()), *plan.get("remove", ())]


def _commit(output_dir: str, staging: str) -> None:
    files = atomic_files.files_under(staging)
    if not files:
        shutil.rmtree(staging)
        return
    for name in files:
        atomic_files.fsync_path(os.path.join(staging, name))  # the data is on disk before the rename commits it
    record = read_record(output_dir)
    has_model = "config.json" in files  # a new model replaces the previous model's whole set, its results too
    if has_model:  # its files' sizes and sha256, checked before a run trusts it (`published_model`)
        results = [name for name in files if _evaluation_results(name)]
        checkpoint_manifest.write(staging, [], PUBLISHED_MANIFEST, leave_out=results)
        files = atomic_files.files_under(staging)
    remove = sorted(set(record["current"]) - set(files)) if has_model else []
    current = files if has_model else sorted(set(record["current"]) | set(files))
    refuse_unless_files(output_dir, [*files, *remove])  # (before the commit point: the staged set is dropped)
    record_written(output_dir, {name.split(os.sep)[0] for name in files})
    with open(os.path.join(staging, PUBLICATION_RECORD), "w") as f:
        json.dump({"files": files, "remove": remove, "current": current}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(staging, os.path.join(output_dir, PUBLISHING_NAME))  # the commit point
    atomic_files.fsync_path(output_dir)
    finish_publication(output_dir)


def _pending_plan(output_dir: str) -> Optional[dict]:
    """The plan of a committed publication not yet moved into place, or None."""
    return atomic_files.read_json(os.path.join(output_dir, PUBLISHING_NAME, PUBLICATION_RECORD))


def finish_publication(output_dir: str) -> None:
    """Move a committed publication's files into place (idempotent: a kill midway is finished by the next call).
    Something other than a regular file at one of its names is refused before any is moved: the committed set
    waits in .publishing until it is moved away."""
    pending = os.path.join(output_dir, PUBLISHING_NAME)
    if not os.path.isdir(pending):
        return
    plan = _pending_plan(output_dir)
    if plan is None:  # its record goes last: every file was already moved
        shutil.rmtree(pending)
        return
    refuse_unless_files(output_dir, _replaced_by(plan))
    for name in plan["remove"]:
        if os.path.isfile(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
    for name in plan["files"]:
        source = os.path.join(pending, name)
        if os.path.exists(source):
            os.makedirs(os.path.dirname(os.path.join(output_dir, name)), exist_ok=True)
            os.replace(source, os.path.join(output_dir, name))
    record = read_record(output_dir)
    if record["current"] != plan["current"]:
        record["current"] = plan["current"]
        atomic_files.write_json_atomically(os.path.join(output_dir, RECORD_NAME), record)
    os.remove(os.path.join(pending, PUBLICATION_RECORD))
    shutil.rmtree(pending)
    atomic_files.fsync_path(output_dir)


class PublishedModel(NamedTuple):
    files: list  # the files of its published set (and of everything published since)
    finished: bool  # whether it was trained to its last step (trainer_state.json)
    damaged: Optional[str]  # why its model's files (train_results.json too) are not those published, or None
    results_missing: list  # the evaluations' results of its set (all_results.json too) that are gone


def published_model(output_dir: str) -> Optional[PublishedModel]:
    """The trained model published in output_dir (its set holds train_results.json and config.json), or None; its
    files checked against the set's manifest (sizes and sha256: the hashing reads the whole model)."""
    current = read_record(output_dir)["current"]
    if "train_results.json" not in current or "config.json" not in current:
        return None
    state = atomic_files.read_json(os.path.join(output_dir, "trainer_state.json"))
    try:
        finished = state["global_step"] >= state["max_steps"]
    except (KeyError, TypeError):
        finished = False
    gone = [name for name in current if not os.path.lexists(os.path.join(output_dir, name))]
    missing = [name for name in gone if not _evaluation_results(name)]
    damaged = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing" if missing else None
    if damaged is None and PUBLISHED_MANIFEST in current:  # (a set published without one: its files' presence only)
        damaged = checkpoint_manifest.incomplete_reason(output_dir, PUBLISHED_MANIFEST)
    return PublishedModel(current, finished, damaged, [name for name in gone if _evaluation_results(name)])


def _evaluation_results(name: str) -> bool:
    """all_results.json and the evaluated splits' results: rewritten by later evaluations, so left out of the model's
    manifest and its checks (train_results.json is the model's own, published with it only)."""
    return name.endswith("results.json") and name != "train_results.json"


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str) -> list[str]:
    """checkpoint-N directories in output_dir, by step."""
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [
        os.path.join(output_dir, name) for _, name in sorted(found) if os.path.isdir(os.path.join(output_dir, name))
    ]


def newest_complete_checkpoint(
    output_dir: str, refuse: Optional[Callable[[str], Optional[str]]] = None
) -> tuple[Optional[str], list[tuple[str, str]]]:
    """The newest complete checkpoint of output_dir (None: none, or no output_dir) that `refuse(checkpoint)`, asked
    of complete ones only, gives no reason against, and [(checkpoint, why)] for the newer ones passed over (newest
    first: incomplete, checkpoint_manifest.incomplete_reason, or refused)."""
    passed_over: list[tuple[str, str]] = []
    if not os.path.isdir(output_dir):
        return None, passed_over
    for checkpoint in reversed(checkpoints(output_dir)):
        reason = checkpoint_manifest.incomplete_reason(checkpoint)
        if reason is None and refuse is not None:
            reason = refuse(checkpoint)
        if reason is None:
            return checkpoint, passed_over
        passed_over.append((checkpoint, reason))
    return None, passed_over

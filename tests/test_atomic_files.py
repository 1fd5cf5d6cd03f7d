"""atomic_files: complete files or none, and the one cleaner of what killed writers left."""

import errno
import json
import os
import socket
import stat
import time
from pathlib import Path

import pytest

from bridgetower_bench.output_dir import atomic_files
from bridgetower_bench.output_dir.atomic_files import (
    atomic_path,
    parse_temp_name,
    remove_abandoned,
    staged_directory,
    temp_path,
    write_atomically,
    write_json_atomically,
)
from helpers import dead_pid


# --------------------------------------------------------------------------------------------- writing


def test_a_json_write_is_the_trainers_text_and_a_failed_one_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path, monkeypatch
):
    path = tmp_path / "eval_results.json"
    write_json_atomically(str(path), {"eval_loss": 1.0, "epoch": 1.0})
    assert path.read_text() == '{\n    "epoch": 1.0,\n    "eval_loss": 1.0\n}\n', "as the trainer writes it"

    def dump_half_then_die(obj, f, **kwargs):
        f.write('{"eval_lo')
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic_files.json, "dump", dump_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomically(path, {"eval_loss": 2.0})
    assert json.loads(path.read_text()) == {"eval_loss": 1.0, "epoch": 1.0}
    assert os.listdir(tmp_path) == ["eval_results.json"]


def test_a_failure_before_the_rename_keeps_the_old_file_leaves_no_temporary_and_names_the_target(tmp_path):
    path = tmp_path / "table.md"
    write_atomically(path, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as temporary:
            with open(temporary, "w") as f:
                f.write("half of the new")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["table.md"]
    # A full disk reaches write() as ENOSPC without a file name: the error names the file being written.
    with pytest.raises(OSError) as failed:
        with atomic_path(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["table.md"]
    write_atomically(path, b"new\n")
    assert path.read_bytes() == b"new\n" and os.listdir(tmp_path) == ["table.md"]


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_forces_the_temporary_to_disk_before_the_rename(tmp_path, monkeypatch, fsync):
    events = []

    def recording(event, real):  # the call, recorded with the inode of its first argument (a descriptor or a path)
        return lambda *args: (events.append((event, os.stat(args[0]).st_ino)), real(*args))

    monkeypatch.setattr(atomic_files.os, "fsync", recording("fsync", os.fsync))
    monkeypatch.setattr(atomic_files.os, "replace", recording("rename", os.replace))
    path = tmp_path / "image.jpg"
    write_atomically(path, b"\xff\xd8 jpeg", fsync=fsync)
    written = path.stat().st_ino
    assert events == ([("fsync", written)] if fsync else []) + [("rename", written)]


def test_an_atomic_write_never_replaces_a_path_that_is_not_a_regular_file(tmp_path):
    # A FIFO, a socket, a directory and (as root, who may make one) a character device like /dev/null.
    nodes = {"FIFO": tmp_path / "fifo", "socket": tmp_path / "socket", "directory": tmp_path / "directory"}
    os.mkfifo(nodes["FIFO"])
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(nodes["socket"]))
    nodes["directory"].mkdir()
    if os.geteuid() == 0:
        nodes["character device"] = tmp_path / "null"
        os.mknod(nodes["character device"], 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    nodes["link to a FIFO"] = tmp_path / "link"
    nodes["link to a FIFO"].symlink_to(nodes["FIFO"])
    with listener:
        for kind, path in nodes.items():
            before = os.lstat(path)
            with pytest.raises(atomic_files.NotARegularFile, match="not a regular file") as refused:
                write_atomically(path, "{}")
            assert refused.value.filename == str(path), kind
            after = os.lstat(path)
            assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), kind
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in nodes.values())  # no temporary left


def test_a_write_to_a_symbolic_link_writes_where_it_points(tmp_path):
    (tmp_path / "runs").mkdir()
    target, link = tmp_path / "runs" / "results.json", tmp_path / "results.json"
    link.symlink_to(Path("runs") / "results.json")  # relative, dangling: the target is created
    write_atomically(link, "{}")
    target_inode = target.stat().st_ino
    write_atomically(link, '{"again": 1}')  # an existing target: replaced, the link kept
    assert link.is_symlink() and link.read_text() == '{"again": 1}' and target.stat().st_ino != target_inode
    assert sorted(os.listdir(tmp_path)) == ["results.json", "runs"]
    assert os.listdir(tmp_path / "runs") == ["results.json"]


def test_a_node_swapped_in_while_writing_is_not_renamed_over(tmp_path):
    path = tmp_path / "results.json"
    with pytest.raises(atomic_files.NotARegularFile, match="FIFO"):
        with atomic_path(path) as temporary:
            Path(temporary).write_text("{}")
            os.mkfifo(path)
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and os.listdir(tmp_path) == ["results.json"]


def test_temporary_names_record_host_and_pid_whatever_the_host_name(monkeypatch):
    for host in ("node7", "gpu-node-12", "n-1.cluster.example", "3f2a9c"):
        monkeypatch.setattr(atomic_files.socket, "gethostname", lambda: host)
        first, second = temp_path("/out/all_results.json"), temp_path("/out/all_results.json")
        assert first != second  # two writers of one process never share a temporary
        assert parse_temp_name(os.path.basename(first)) == ("all_results.json", host, os.getpid())
    for name in "notes.txt notes.partial-123 .staging-123 x.partial-host-12 x.partial-12.ab .x.1a.host.12.tmp".split():
        assert parse_temp_name(name) is None, name


def test_a_staged_directory_replaces_the_old_one_whole_or_not_at_all(tmp_path):
    target = tmp_path / "fixture"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staged_directory(target) as staged:
            (Path(staged) / "new.txt").write_text("half")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["fixture"] and os.listdir(target) == ["old.txt"]

    with staged_directory(target, keep_existing=lambda: True) as staged:  # e.g. a concurrent build finished first
        (Path(staged) / "new.txt").write_text("new")
    assert os.listdir(tmp_path) == ["fixture"] and os.listdir(target) == ["old.txt"]

    with staged_directory(target) as staged:
        (Path(staged) / "new.txt").write_text("new")
    assert os.listdir(tmp_path) == ["fixture"] and os.listdir(target) == ["new.txt"]


# --------------------------------------------------------------------------------------------- the cleaner


def test_the_cleaner_removes_only_dead_writers_leftovers_of_this_host(tmp_path):
    host, dead = socket.gethostname(), dead_pid()
    removed = [f"pixels.npy.partial-{host}-{dead}.1a2b", f"fixture.partial-{host}-{dead}.3c4d"]
    kept = [
        f"pixels.npy.partial-{host}-{os.getppid()}.5e6f",  # a live writer's
        f"pixels.npy.partial-other-{host}-{dead}.7a8b",  # another node's: its pid means nothing here
        "pixels.npy",
        "notes.partial-123",
        f".pixels.npy.1a2b.{host}.{dead}.tmp",  # outside the scheme
    ]
    for name in removed[:1] + kept:
        (tmp_path / name).write_bytes(b"half")
    (tmp_path / removed[1]).mkdir()
    (tmp_path / removed[1] / "config.json").write_text("{}")
    assert remove_abandoned(tmp_path) == sorted(removed)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_the_cleaner_keeps_what_only_rejects_and_what_is_younger_than_min_age(tmp_path):
    host, dead = socket.gethostname(), dead_pid()
    recorded, unrecorded = f"all_results.json.partial-{host}-{dead}.aa", f"notes.txt.partial-{host}-{dead}.bb"
    old, young = f"old.partial-{host}-{dead}.cc", f"young.partial-{host}-{dead}.dd"
    for name in (recorded, unrecorded, old, young):
        (tmp_path / name).write_text("{")
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / old, (an_hour_ago, an_hour_ago))

    assert remove_abandoned(tmp_path, only={"all_results.json"}.__contains__) == [recorded]
    assert remove_abandoned(tmp_path, min_age_s=600) == [old]
    assert sorted(os.listdir(tmp_path)) == sorted([unrecorded, young])

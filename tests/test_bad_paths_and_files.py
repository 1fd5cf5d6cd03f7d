"""Paths that are not what they should be end in one line: a JSON configuration whose values have the wrong
type, image paths that are not regular files (a FIFO, a device: never read, never waited on), a full disk
(the decoded-image cache, a checkpoint, the final publication), an image that changed after the check, and
every `python -m bridgetower_bench.tools.*` given a bad path."""

import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
from transformers.trainer_utils import SchedulerType

from bridgetower_bench import arguments, data, preflight, regular_files
from bridgetower_bench.images import image_cache, images
from bridgetower_bench.output_dir import disk_space
from bridgetower_bench.output_dir.checkpoint_manifest import incomplete_reason
from bridgetower_bench.output_dir.run_directory import checkpoints
from helpers import (
    CPU_FLAGS,
    REPO,
    command,
    embedded,
    noise_jpeg,
    run_cuda_script,
    run_forked,
    run_script,
    run_tool,
)


# ---------------------------------------------------------------------------------------------
# A JSON configuration: every value of its field's type
# ---------------------------------------------------------------------------------------------

SCHEDULES = ", ".join(t.value for t in SchedulerType)
# key -> (its value in the file, what the line says after '"key" ') ("false" for a boolean was once taken as true)
CONFIG_REFUSALS = {
    "overwrite_output_dir": ("false", 'is "false" (a string), expected a boolean (true or false)'),
    "output_dir": (None, "is null, expected a path (null would write the run into ./trainer_output)"),
    "per_device_train_batch_size": ("four", 'is "four" (a string), expected an integer'),
    "max_steps": ("2", 'is "2" (a string), expected an integer'),
    "learning_rate": ([1e-4], "is [0.0001] (a list), expected a number"),
    "seed": (1.5, "is 1.5 (a number), expected an integer"),
    "num_train_epochs": (True, "is true (a boolean), expected a number"),
    "model_name_or_path": (None, "is null, expected a string"),
    "lr_scheduler_type": ("cosin", f'is "cosin" (a string), expected one of {SCHEDULES}'),
    "image_pipeline": ("fastt", f'is "fastt" (a string), expected one of {", ".join(images.IMAGE_PIPELINES)}'),
    "report_to": (["none", 3], 'is ["none", 3] (a list), expected null or a string or a list of strings'),
}


@pytest.fixture(scope="module")
def script_parser():
    """The CUDA script's own argument dataclasses, parsed as its step 1 does."""
    import runpy

    from transformers import HfArgumentParser

    names = runpy.run_path(str(REPO / "run_bridgetower_cuda.py"), run_name="arguments_only")
    return HfArgumentParser(
        (names["ModelArguments"], names["DataTrainingArguments"], names["arguments"].WarmupTrainingArguments)
    )


BASE_CONFIG = {"model_name_or_path": "a-model", "train_file": "train.csv", "do_train": True}


@pytest.mark.parametrize("key", sorted(CONFIG_REFUSALS))
def test_configuration_values_of_the_wrong_type_are_refused_naming_key_value_and_type(key, script_parser, tmp_path):
    value, expected = CONFIG_REFUSALS[key]
    config = tmp_path / "run.json"
    config.write_text(json.dumps({**BASE_CONFIG, "output_dir": str(tmp_path / "out"), key: value}))
    with pytest.raises(preflight.UserInputError) as refused:
        arguments.parse_arguments(script_parser, ["script.py", str(config)])
    assert str(refused.value) == f'{config}: "{key}" {expected}'


def test_configuration_values_of_the_right_type_are_taken_as_the_flags_take_them(script_parser, tmp_path):
    config = tmp_path / "run.json"
    values = {**BASE_CONFIG, "output_dir": str(tmp_path / "out"), "overwrite_output_dir": False, "learning_rate": 1}
    values.update(max_train_samples=None, lr_scheduler_type="cosine", report_to=["none"], log_level="info")
    values.update(num_train_epochs=2, image_pipeline="fast", image_column=None)
    config.write_text(json.dumps(values))
    _, data_args, training_args = arguments.parse_arguments(script_parser, ["script.py", str(config)])
    flags = "script.py --model_name_or_path a-model --train_file train.csv --do_train --learning_rate 1".split()
    flags += "--lr_scheduler_type cosine --report_to none --log_level info --num_train_epochs 2".split()
    flags += ["--image_pipeline", "fast", "--output_dir", str(tmp_path / "out")]
    from_flags = arguments.parse_arguments(script_parser, flags)
    assert training_args.overwrite_output_dir is False and training_args.learning_rate == 1.0
    assert training_args.lr_scheduler_type == from_flags[2].lr_scheduler_type
    assert training_args.report_to == from_flags[2].report_to == []
    assert data_args.image_pipeline == "fast" and data_args.image_column is None


# ---------------------------------------------------------------------------------------------
# Only regular files are read as images
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cuda", "gaudi"])
def test_a_configuration_or_data_file_that_is_a_fifo_is_refused_without_waiting(kind, tmp_path, within_seconds):
    """Four readers of a .json configuration (the flag guard, the GPU check, the execution mode, the parser) once
    opened it as it was: a FIFO blocked the script forever."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    result = run_script(kind, [fifo], check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith(f"error: {fifo}: cannot read the configuration file (not a regular file: FIFO)"), last
    data = tmp_path / "train.csv"
    os.mkfifo(data)
    args = ["--model_name_or_path", tmp_path, "--train_file", data, "--output_dir", tmp_path / "out", "--do_train"]
    result = run_script(kind, args + CPU_FLAGS[kind], check=False)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        f"error: --train_file={data}: not a regular file: FIFO"
    ), result.stderr[-3000:]


@pytest.fixture
def special_files(tmp_path):
    """name -> (a path that is not a regular file, the reason a row showing it gets)."""
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    directory = tmp_path / "folder.jpg"
    directory.mkdir()
    sock_path = tmp_path / "socket.jpg"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        yield {
            "FIFO": (str(fifo), "not a regular file: FIFO"),
            "directory": (str(directory), "not a regular file: directory"),
            "device": ("/dev/zero", "not a regular file: character device"),
            "socket": (str(sock_path), "not a regular file: socket"),
        }


def bad_rows(paths, good, cache_dir):
    """preflight's (row, reason) of each image of a data set of `paths`, then of the regular file `good`."""
    splits = {"train": datasets.Dataset.from_dict({"image": [*paths, good], "caption": ["c"] * (len(paths) + 1)})}
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=cache_dir)
    return [[p.row, p.reason] for p in problems]


def test_fifos_devices_directories_and_sockets_are_bad_rows_and_the_check_never_blocks(tmp_path, special_files):
    """What used to happen: a FIFO hung the check forever; /dev/zero was read until memory ran out (hence a process
    of its own: forked from this one, bounded)."""
    cases = special_files
    good = tmp_path / "good.jpg"
    good.write_bytes(noise_jpeg(0))
    names = sorted(cases)
    result = run_forked(bad_rows, [cases[n][0] for n in names], str(good), str(tmp_path / "cache"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    found = dict((row, reason) for row, reason in json.loads(result.stdout))
    assert found == {
        row: f"cannot read image file {cases[name][0]!r}: {cases[name][1]}" for row, name in enumerate(names)
    }


@pytest.fixture
def within_seconds():
    """Fails the test instead of letting it hang: SIGALRM interrupts a blocking open or read with TimeoutError."""

    def expire(signum, frame):
        raise TimeoutError("blocked: the call did not return within the time allowed")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_image_loading_refuses_what_is_not_a_regular_file_without_reading_it(special_files, within_seconds):
    """Before the fix, loading the FIFO blocked forever and /dev/zero was read until memory ran out."""
    for path, reason in special_files.values():
        for load in (images.load_image, images.make_image_transform("fast", 32, (), ())):
            with pytest.raises(ValueError) as refused:
                load(path)
            assert str(refused.value) == f"cannot read image file {path!r}: {reason}"


def test_a_fifo_swapped_in_after_the_look_is_not_waited_on(tmp_path, monkeypatch, within_seconds):
    """The race: the path was a regular file when looked at, a FIFO when opened. O_NONBLOCK opens it at once, and
    the second look, through the open descriptor, refuses it."""
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    real_stat = os.stat
    regular = real_stat(__file__)
    monkeypatch.setattr(
        images.os, "stat", lambda path, *a, **k: regular if str(path) == str(fifo) else real_stat(path, *a, **k)
    )
    with pytest.raises(regular_files.NotARegularFile, match="not a regular file: FIFO"):
        regular_files.read_regular_file(fifo)


# ---------------------------------------------------------------------------------------------
# Full disks
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_filesystem(tmp_path):
    """Real tmpfs of `size_kib` KiB (needs the right to mount, e.g. root), or a skip; simulated full disks run too."""
    mounted = []

    def make(size_kib: int):
        point = tmp_path / f"small-{len(mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(point)], capture_output=True, text=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({result.stderr.strip()})")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def decoded_cache_of(cache_dir, n_images: int, image_size: int):
    """data.decoded_image_cache over `n_images` embedded images: (the transform it gives, the fallback, a row)."""
    splits = {"train": embedded([noise_jpeg(i, (64, 64)) for i in range(n_images)], ["c"] * n_images)}
    args = SimpleNamespace(decoded_image_cache_dir=str(cache_dir), image_pipeline="fast", preprocessing_num_workers=1)
    fallback = images.make_image_transform("fast", image_size, (), ())
    return data.decoded_image_cache(splits, "image", args, image_size, fallback), fallback, splits["train"][0]["image"]


def decoded_cache_builds(cache_dir, n_images: int) -> str:
    """Whether data.decoded_image_cache gives its cache ("cache") or the fallback, and the shape a row gets."""
    transform, fallback, row = decoded_cache_of(cache_dir, n_images, 294)
    return f"{'cache' if transform is not fallback else 'fallback'} {transform(row).shape}"


def test_the_decoded_image_cache_on_a_nearly_full_disk_is_skipped_with_a_warning(small_filesystem, tmp_path):
    """On a real small filesystem, what used to happen: the pixel file (60 images x 3 x 294 x 294 = 15 MiB) did not
    fit in 4 MiB; writing it through its memory mapping died of SIGBUS (exit 135, no message, the partial file left):
    hence a process of its own, forked from this one."""
    disk = small_filesystem(4096)
    result = run_forked(decoded_cache_builds, str(disk / "cache"), 60)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert json.loads(result.stdout) == "fallback torch.Size([3, 294, 294])"
    assert "--cache_decoded_images: cannot write the decoded image cache in" in result.stderr
    assert "No space left on device" in result.stderr and "training without it" in result.stderr
    leftovers = [os.path.join(root, name) for root, _, names in os.walk(disk) for name in names]
    assert leftovers == [], leftovers


def test_the_decoded_image_cache_reserves_its_space_before_writing(tmp_path, monkeypatch, caplog):
    """Simulated full disk (runs everywhere): the reservation fails, the build is skipped with the warning and
    leaves no file; nothing was written through the mapping first."""

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    decoded = []
    monkeypatch.setattr(image_cache.os, "posix_fallocate", full)
    monkeypatch.setattr(image_cache, "_decode_into", lambda *a, **k: decoded.append(1))
    transform, fallback, _ = decoded_cache_of(tmp_path / "cache", 3, 32)
    assert transform is fallback
    assert decoded == []
    assert "cannot reserve" in caplog.text and "No space left on device" in caplog.text
    assert [n for _, _, names in os.walk(tmp_path / "cache") for n in names] == []


def _error_line(status: int, stderr: str) -> str:
    """The one-line error of a run that ended with status 2 and no traceback (a progress bar may be redrawn after
    the line, or stand before it on its line)."""
    assert status == 2 and "Traceback" not in stderr, (status, stderr[-3000:])
    mark = "run_bridgetower_cuda.py: error: "
    lines = [mark + line.partition(mark)[2] for line in stderr.splitlines() if mark in line]  # (a bar may precede it)
    assert lines, stderr[-3000:]
    return lines[-1]


def test_a_full_disk_while_saving_a_checkpoint_ends_in_one_line_keeping_the_last_complete_one(
    fixtures, small_filesystem
):
    """Real small filesystem: room for one checkpoint (about 7.6 MiB with the tiny model), not two."""
    out = small_filesystem(11 * 1024) / "out"
    result = run_script("cuda", command(fixtures, out, max_steps=3, save_steps=1), check=False, timeout=600)
    last = _error_line(result.returncode, result.stderr)
    assert last.startswith(
        f"run_bridgetower_cuda.py: error: disk full while writing a checkpoint ({out / 'checkpoint-2'}): "
    )
    assert (
        " free on its filesystem; the partial files were removed; the last complete checkpoint, "
        f"{out / 'checkpoint-1'}, is intact: free some space and rerun the same command to resume" in last
    )
    assert [os.path.basename(c) for c in checkpoints(str(out))] == ["checkpoint-1"]
    assert incomplete_reason(str(out / "checkpoint-1")) is None


def test_a_full_disk_while_publishing_ends_in_one_line_and_keeps_what_was_published(fixtures, small_filesystem):
    """Real small filesystem: training (no checkpoints) fits, the final model does not."""
    disk = small_filesystem(1024)
    out = disk / "out"
    result = run_script("cuda", command(fixtures, out, save_strategy="no", max_steps=1), check=False, timeout=600)
    last = _error_line(result.returncode, result.stderr)
    assert last.startswith(f"run_bridgetower_cuda.py: error: disk full while writing the final results into {out} (")
    assert last.endswith(
        "free on its filesystem; the partial files were removed; the results published before are intact"
    )
    # Nothing of the failed publication is left, and the disk is not left full (the run wrote nothing else there).
    assert [n for _, _, names in os.walk(disk) for n in names] == []


def test_disk_full_is_recognised_in_each_form_the_writers_report_it(tmp_path, monkeypatch):
    """Simulated (runs everywhere): OSError ENOSPC/EDQUOT, safetensors' text, torch.save's errno-less failure on a
    filesystem left with almost nothing free; other failures pass through unchanged."""
    assert disk_space.is_disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert disk_space.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert disk_space.is_disk_full(
        Exception("Error while serializing: I/O error: No space left on device (os error 28)"), tmp_path
    )
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not disk_space.is_disk_full(torch_error, tmp_path)
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 4096})())
    assert disk_space.is_disk_full(torch_error, tmp_path)
    assert not disk_space.is_disk_full(KeyboardInterrupt(), tmp_path)

    target = tmp_path / "checkpoint-5"
    with pytest.raises(
        disk_space.DiskFull,
        match=r"^disk full while writing a checkpoint \(.*checkpoint-5\): 4.0 KiB free "
        r"on its filesystem; the partial files were removed$",
    ):
        with disk_space.removed_when_disk_full(target, "a checkpoint"):
            target.mkdir()
            (target / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not target.exists()


# ---------------------------------------------------------------------------------------------
# An image that changed after the check
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replaced", [False, True], ids=["rewritten in place", "replaced by another file"])
def test_the_checks_cache_never_vouches_for_a_file_whose_content_changed(tmp_path, replaced):
    """What used to happen: the file changed (rewritten, or another file renamed over it) with its size and
    modification time as before (written within one tick of the filesystem's clock, or its mtime set back), and the
    cached verdict was reused."""
    path, other = tmp_path / "a.jpg", tmp_path / "b.jpg"
    good = noise_jpeg(0)
    path.write_bytes(good)
    other.write_bytes(good[:100] + b"\0" * (len(good) - 100))
    before = os.stat(path)
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    splits = {"train": datasets.Dataset.from_dict({"image": [str(path)], "caption": ["a caption"]})}
    assert preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")[0] == []
    if replaced:
        os.replace(other, path)
    else:
        path.write_bytes(b"\0" * len(good))  # garbage of the same size
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    problems = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")[0]
    assert [(p.row, p.reason.split(":")[0]) for p in problems] == [(0, f"cannot decode image file {str(path)!r}")]


def _csv_run_args(fixtures, tmp_path, **extra):
    """8 images and a csv of them in tmp_path; a CPU training run of the tiny model on it into tmp_path/out, then
    --name value for each of `extra`."""
    (tmp_path / "images").mkdir()
    for row in range(8):
        (tmp_path / "images" / f"{row}.jpg").write_bytes(noise_jpeg(row, (64, 48)))
    data_file = tmp_path / "train.csv"
    data_file.write_text("image_path,caption\n" + "".join(f"images/{row}.jpg,picture {row}\n" for row in range(8)))
    args = ["--model_name_or_path", fixtures["model"], "--train_file", data_file, "--output_dir", tmp_path / "out"]
    args += ["--do_train", "--report_to", "none", "--use_cpu", "--dataloader_num_workers", 0]
    return args + [word for name, value in extra.items() for word in (f"--{name}", value)]


def test_an_image_changed_between_the_check_and_step_1_stops_in_one_line_then_drop_bad_rows_drops_it(
    fixtures, tmp_path, monkeypatch
):
    """What used to happen: a traceback at step 1 (exit 1), and --drop_bad_rows, as the message advised, reused the
    check's cached verdict and stopped again."""
    original = preflight.check_splits
    changed = None

    def check_then_change(splits, image_column, *args, **kwargs):
        nonlocal changed
        checked = original(splits, image_column, *args, **kwargs)
        changed = Path(checked["train"][0][image_column])  # the first training row's image
        stat = os.stat(changed)
        changed.write_bytes(b"\0" * stat.st_size)  # same size, same mtime: only the content differs
        os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        return checked

    common = _csv_run_args(
        fixtures, tmp_path, per_device_train_batch_size=8, max_steps=1, preflight_cache_dir=tmp_path / "pre"
    )
    monkeypatch.setattr(preflight, "check_splits", check_then_change)
    status, stderr = run_cuda_script(common)
    assert _error_line(status, stderr).startswith(
        f"run_bridgetower_cuda.py: error: split 'train': cannot decode image from {str(changed)!r}"
    )
    assert (
        "(training stopped before step 1; no checkpoint saved). Restore the image, or rerun with --drop_bad_rows"
        in stderr
    )

    monkeypatch.setattr(preflight, "check_splits", original)
    status, stderr = run_cuda_script(common + ["--drop_bad_rows"])
    assert status == 0, stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_an_image_changed_mid_run_stops_with_advice_the_kit_accepts(fixtures, tmp_path, monkeypatch):
    """The line once advised passing --drop_bad_rows and rerunning to resume; that rerun was refused as another
    recipe (--drop_bad_rows false -> true). Each rerun it now advises is run as written."""
    from transformers.trainer_callback import CallbackHandler

    out = tmp_path / "out"
    common = _csv_run_args(fixtures, tmp_path, per_device_train_batch_size=4, num_train_epochs=2, seed=3)
    common += ["--save_strategy", "no", "--preflight_cache_dir", tmp_path / "pre"]
    broken, kept = tmp_path / "images" / "0.jpg", (tmp_path / "images" / "0.jpg").read_bytes()
    step_end = CallbackHandler.on_step_end

    def break_an_image_after_step_1(self, args, state, control):
        if state.global_step == 1:
            broken.write_bytes(b"\0" * len(kept))  # read again in the second epoch at the latest
        return step_end(self, args, state, control)

    with monkeypatch.context() as patched:
        patched.setattr(CallbackHandler, "on_step_end", break_an_image_after_step_1)
        status, stderr = run_cuda_script(common)
    line = _error_line(status, stderr)
    advice = re.fullmatch(
        r".*\(training stopped after step \d+; checkpoint saved in .*checkpoint-\d+\)\. Restore the image and rerun the "
        r"same command to resume, or rerun with (--drop_bad_rows --overwrite_output_dir) to train afresh without its rows\.",
        line,
    )
    assert advice, line

    rerun = run_script("cuda", common + advice.group(1).split())  # the image still broken: its row left out
    assert "1 bad row dropped (--drop_bad_rows):" in rerun.stdout + rerun.stderr
    assert (out / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# The tools: a bad path ends in one line, exit status 2
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def places(tmp_path):
    directory = tmp_path / "a-directory"
    directory.mkdir()
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("the user's own file")
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    sweep = tmp_path / "a-sweep"  # an earlier sweep's --out whose results.json is a FIFO
    sweep.mkdir()
    os.mkfifo(sweep / "results.json")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "truncated.jpg").write_bytes(noise_jpeg(1)[:300])
    return {
        "empty_jpeg": tmp_path / "empty.jpg",
        "truncated_jpeg": tmp_path / "truncated.jpg",
        "dir": directory,
        "file": a_file,
        "under_file": a_file / "out",
        "missing": tmp_path / "missing",
        "fifo": fifo,
        "sweep": sweep,
    }


OUT_IS_A_FILE = "--out={file} is a file, not a directory"
OUTPUT_DIR_IS_A_FILE = "--output_dir={file} is a file, not a directory"
# tool -> (its arguments before --json, after it): the tools that write a --json file
JSON_WRITERS = {
    "compare": (["{run}"], []),
    "image_bench": ([], []),
    "image_fidelity": ([], []),
    "cache_memory_bench": ([], []),
    "device_decode_check": (["{file}"], []),
    "gaudi_check": ([], ["--output_dir", "{missing}"]),
    "nvidia_check": ([], ["--output_dir", "{missing}"]),
    "cluster_check": (["--nodes", "localhost", "--output_dir", "{dir}"], []),
}
TOOL_CASES = {
    **{
        f"{tool} --json <a directory>": (
            [tool, *before, "--json", "{dir}", *after],
            "--json={dir} is a directory; give a file name to write",
        )
        for tool, (before, after) in JSON_WRITERS.items()
    },
    # A FIFO is neither waited on nor written through (the write would block until a reader came, or rename over
    # it); --prices and the sweep's results.json are read without waiting.
    **{
        f"{tool} --json <a FIFO>": (
            [tool, *before, "--json", "{fifo}", *after],
            "--json={fifo}: not a regular file: FIFO; give the name of a regular file to write",
        )
        for tool, (before, after) in JSON_WRITERS.items()
    },
    "compare --json under a file": (
        ["compare", "{run}", "--json", "{under_file}/x.json"],
        "--json={under_file}/x.json: cannot create the file: {file} is a file, not a directory",
    ),
    "fixtures --out <a file>": (["fixtures", "gaudi-config", "--out", "{file}"], OUT_IS_A_FILE),
    "fixtures --out under a file": (
        ["fixtures", "gaudi-config", "--out", "{under_file}"],
        "--out={under_file}: cannot create the directory: {file} is a file, not a directory",
    ),
    "bench --out <a file>": (["bench", "--dry-run", "--out", "{file}"], OUT_IS_A_FILE),
    "device_decode_check <a missing image>": (
        ["device_decode_check", "{missing}"],
        "images={missing}: No such file or directory",
    ),
    "device_decode_check <a directory>": (
        ["device_decode_check", "{dir}"],
        "images={dir}: not a regular file: directory",
    ),
    "gaudi_check --output_dir <a file>": (["gaudi_check", "--output_dir", "{file}"], OUTPUT_DIR_IS_A_FILE),
    "nvidia_check --output_dir <a file>": (["nvidia_check", "--output_dir", "{file}"], OUTPUT_DIR_IS_A_FILE),
    "gpu_ceiling --output_dir <a file>": (
        ["gpu_ceiling", "--model_name_or_path", "{dir}", "--output_dir", "{file}"],
        OUTPUT_DIR_IS_A_FILE,
    ),
    "gpu_ceiling --model_name_or_path <a missing directory>": (
        ["gpu_ceiling", "--model_name_or_path", "{missing}", "--output_dir", "{dir}"],
        "--model_name_or_path={missing}: no such directory",
    ),
    "upstream_diff --upstream <a directory>": (["upstream_diff", "--upstream", "{dir}"], None),
    # an image the tool cannot decode is named (the check decodes on the host first)
    "device_decode_check <an empty JPEG>": (
        ["device_decode_check", "--device", "cpu", "{empty_jpeg}"],
        "images: cannot decode image from '{empty_jpeg}': cannot identify image file ...",
    ),
    "device_decode_check <a truncated JPEG>": (
        ["device_decode_check", "--device", "cpu", "{truncated_jpeg}"],
        "images: cannot decode image from '{truncated_jpeg}': ...",
    ),
    "upstream_diff --upstream <a FIFO>": (["upstream_diff", "--upstream", "{fifo}"], None),
    "compare --prices <a FIFO>": (["compare", "{run}", "--prices", "{fifo}"], None),
    "bench --prices <a FIFO>": (["bench", "--dry-run", "--out", "{missing}", "--prices", "{fifo}"], None),
    "bench --out <a sweep whose results.json is a FIFO>": (["bench", "--dry-run", "--out", "{sweep}"], None),
    "upstream_diff --ours <a missing file>": (["upstream_diff", "--upstream", "{file}", "--ours", "{missing}"], None),
}


def _run_dir(tmp_path):
    """A finished run's directory, as `compare` reads it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "all_results.json").write_text(json.dumps({"train_samples_per_second": 10.0}))
    return run


def _tool_case(case, places, tmp_path):
    """The tool and arguments of TOOL_CASES[case] with the places filled in, and the line it must print."""
    args, expected = TOOL_CASES[case]
    fill = {**{k: str(v) for k, v in places.items()}, "run": str(_run_dir(tmp_path))}
    tool, *rest = args
    return tool, [a.format(**fill) for a in rest], expected and f"{tool}: error: {expected.format(**fill)}"


def _assert_ended_in_one_line(result, line, places):
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    if line is not None:
        assert lines[0].startswith(line[:-3]) if line.endswith("...") else lines[0] == line, (lines[0], line)
    assert places["file"].read_text() == "the user's own file"


@pytest.mark.parametrize("case", sorted(TOOL_CASES))
def test_every_tool_ends_in_one_line_on_a_bad_path(case, places, tmp_path, within_seconds):
    """Each tool as `python -m` runs it, here in the test process (helpers.run_tool); one in a process of its own."""
    tool, args, line = _tool_case(case, places, tmp_path)
    process = case == "compare --json <a directory>"
    _assert_ended_in_one_line(run_tool(tool, args, cwd=tmp_path, process=process), line, places)


def test_a_tool_never_writes_over_a_device_and_a_full_disk_ends_in_one_line(places, small_filesystem, tmp_path):
    """As root (Habana's container) an atomic --json write once renamed its file over a device node such as
    /dev/full; a full disk ended in a traceback (write() names no file)."""
    run = _run_dir(tmp_path)
    if os.geteuid() == 0:
        device = tmp_path / "full"
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # what /dev/full is
        result = run_tool("compare", [str(run), "--json", str(device)], cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"compare: error: --json={device}: not a regular file: character device; "
            "give the name of a regular file to write"
        ]
        assert stat.S_ISCHR(os.lstat(device).st_mode)
    full = small_filesystem(8)
    with pytest.raises(OSError, match="No space left"):
        with open(full / "filler", "wb") as filler:
            filler.write(b"x" * (1 << 20))
    result = run_tool("compare", [str(run), "--json", str(full / "comparison.json")], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"compare: error: {full / 'comparison.json'}: No space left on device (0 bytes free there)"
    ]
    assert sorted(os.listdir(full)) == ["filler"]


@pytest.mark.parametrize(
    "tool, args",
    [
        ("cache_memory_bench", ["--workers", "0"]),  # once a traceback inside datasets, after the --json check
        ("cache_memory_bench", ["--small", "0"]),
        ("device_decode_check", ["{file}", "--batch-size", "0"]),
        ("device_decode_check", ["{file}", "--limit", "0"]),
        ("image_bench", ["--repeat", "0"]),
        ("image_fidelity", ["--images", "-1"]),
    ],
)
def test_a_tools_count_below_one_is_refused_by_its_parser(tool, args, places, tmp_path):
    args = [a.format(file=places["file"]) for a in args]
    result = run_tool(tool, args, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].endswith(f"error: {args[-2]} must be at least 1; got {args[-1]}")


@pytest.fixture
def read_only_place(tmp_path):
    """A directory nobody may create anything in: a read-only tmpfs where it can be mounted (root may write into
    any directory whatever its mode), else a directory without write permission."""
    place = tmp_path / "read-only"
    place.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(place)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    if not mounted:
        place.chmod(0o555)
        if os.access(place, os.W_OK):
            pytest.skip("no read-only place can be made here")
    yield place
    if mounted:
        subprocess.run(["umount", "-l", str(place)], capture_output=True)
    else:
        place.chmod(0o755)


@pytest.mark.parametrize(
    "tool, args",
    [("fixtures", ["gaudi-config", "--out"]), ("gaudi_check", ["--output_dir"]), ("compare", ["{run}", "--json"])],
)
def test_a_read_only_place_is_refused_before_any_work(tool, args, read_only_place, tmp_path):
    run, flag = _run_dir(tmp_path), args[-1]
    target = read_only_place / "out"
    result = run_tool(tool, [a.format(run=run) for a in args] + [target], cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    what = "file" if flag == "--json" else "directory"
    assert result.stderr.strip().splitlines() == [
        f"{tool}: error: {flag}={target}: cannot create the {what}: {read_only_place} is not writable"
    ]


def test_the_launcher_refuses_a_training_script_that_is_not_a_file_without_a_traceback(tmp_path):
    """launch_gaudi checks its script with argparse (usage, then the error line)."""
    result = run_tool("launch_gaudi", ["--dry_run", tmp_path], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(f"error: training_script {tmp_path}: no such file")

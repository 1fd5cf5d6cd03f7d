"""Long runs: bad data is found before step 1, a failing image or a signal stops with a checkpoint that
resumes exactly, output directories are never clobbered, files are never half-written, and bad input
is refused with one line."""

import json
import os
import re
import runpy
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback, TrainerControl, TrainerState

from bridgetower_bench import data, preflight
from bridgetower_bench.guards import resilience
from bridgetower_bench.guards.resilience import ImageLoadError
from bridgetower_bench.output_dir import checkpoint_manifest, run_directory
from bridgetower_bench.tools.fixtures import script_flags
from helpers import (
    BOTH_ROUTES,
    CPU_FLAGS,
    REPO,
    SCRIPTS,
    ForkedRun,
    base_args,
    embedded,
    jpeg_bytes,
    logging_put_back,
    read_json,
    run_script,
    trainer_on,
    write_csv,
)


# 1. Preflight: bad data is found before step 1, reported by split, row and column, cached --------------------

GOOD, OTHER = jpeg_bytes(0), jpeg_bytes(1)


def test_preflight_names_split_row_and_column_of_every_bad_row_then_stops_the_run_or_drops_them(tmp_path, caplog):
    # train: embedded images (one truncated, one garbage, two captions unusable, a repeated image); validation: paths
    images = [GOOD, GOOD[: len(GOOD) // 2], GOOD, b"not an image", OTHER, OTHER]
    (tmp_path / "ok.jpg").write_bytes(OTHER)
    paths = [str(tmp_path / "ok.jpg"), str(tmp_path / "gone.jpg")]
    splits = {
        "train": embedded(images, ["a", "b", "c", "d", "   ", None]),
        "validation": datasets.Dataset.from_dict({"image": paths, "caption": ["e", "f"]}),
    }
    problems, cache_file = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    found = {(p.split, p.row, p.column): p.reason for p in problems}
    bad = [("train", 1, "image"), ("train", 3, "image"), ("train", 4, "caption"), ("train", 5, "caption")]
    assert sorted(found) == [*bad, ("validation", 1, "image")]
    assert "truncated" in found[("train", 1, "image")]
    assert "cannot decode embedded image" in found[("train", 3, "image")]
    assert found[("validation", 1, "image")] == f"missing image file {str(tmp_path / 'gone.jpg')!r}"
    assert read_json(cache_file)["distinct_images"] == 6  # GOOD, truncated, garbage, OTHER + 2 paths

    with pytest.raises(ValueError) as stop:
        preflight.check_splits(splits, "image", "caption", cache_dir=tmp_path / "c")
    lines = str(stop.value).splitlines()
    assert lines[0] == "5 bad rows found before training (pass --drop_bad_rows to train without them):"
    assert lines[1].startswith("  split 'train' row 1, column 'image': cannot decode embedded image")
    kept = preflight.check_splits(splits, "image", "caption", drop_bad_rows=True, cache_dir=tmp_path / "c")
    assert list(kept["train"]["caption"]) == ["a", "c"] and list(kept["validation"]["caption"]) == ["e"]
    assert "5 bad rows dropped (--drop_bad_rows):" in caplog.text and "split 'validation' row 1" in caplog.text


def test_rows_of_a_split_cut_from_train_are_also_named_as_loaded(tmp_path):
    raw = embedded([GOOD] * 10, [f"caption {i}" for i in range(7)] + ["", "caption 8", "caption 9"])
    splits = data.make_splits(datasets.DatasetDict({"train": raw}), seed=0)
    problems = [p for p in preflight.find_problems(dict(splits), "image", "caption", cache_dir=tmp_path)[0]]
    assert [p.source_row for p in problems] == [7]
    assert splits[problems[0].split][problems[0].row]["caption"] == ""
    assert f"row {problems[0].row} (row 7 of the data as loaded, before splitting), column 'caption'" in str(
        problems[0]
    )


def test_caption_column_of_numbers_is_refused_as_a_whole():
    ds = datasets.Dataset.from_dict({"image": ["a.jpg"], "caption": [3]})
    with pytest.raises(ValueError, match=r"^--caption_column=caption in split 'train' holds int64 values, not text$"):
        preflight.check_caption_column(ds, "caption", "train")


# 2. An image that fails during training: checkpoint, one clear error, resumable ------------------------------


def path_dataset(fixtures, directory, n_rows):
    """`n_rows` JPEG files in `directory` (their paths returned too), tokenized and decoded as the training split."""
    from bridgetower_bench.images.images import make_image_transform

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for row in range(n_rows):
        paths.append(str(directory / f"{row}.jpg"))
        (directory / f"{row}.jpg").write_bytes(jpeg_bytes(row))
    ds = datasets.Dataset.from_dict({"image": paths, "caption": [f"picture {row}" for row in range(n_rows)]})
    tokenizer = AutoTokenizer.from_pretrained(fixtures["model"])
    columns = dict(image_column="image", caption_column="caption", max_seq_length=16, num_proc=None)
    ds = data.tokenize_split(ds, tokenizer, **columns, overwrite_cache=True, split="train")
    transform = make_image_transform("fast", 294, mean=(), std=())
    ds.set_transform(data.BatchTransform("image", transform, "train"))
    return ds, paths


def test_image_error_in_a_dataloader_worker_keeps_its_one_line_message(fixtures, tmp_path):
    ds, paths = path_dataset(fixtures, tmp_path / "images", 4)
    os.remove(paths[2])
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1, collate_fn=data.collate_fn)
    with pytest.raises(ImageLoadError) as raised:
        list(loader)
    assert "Original Traceback" in str(raised.value)  # how PyTorch re-raises a worker's exception
    assert raised.value.reason == (
        f"split 'train': cannot read image file {paths[2]!r}: [Errno 2] No such file or directory: {paths[2]!r}"
    )


class _DeleteImagesAfterFirstStep(TrainerCallback):
    """Removes every image file once step 1 is done: a data set disappearing under a running job."""

    def __init__(self, paths):
        self.paths = paths

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            for path in self.paths:
                os.rename(path, path + ".away")


def test_image_removed_mid_run_saves_a_resumable_checkpoint(fixtures, tmp_path):
    ds, paths = path_dataset(fixtures, tmp_path / "images", 24)
    options = dict(max_steps=6, dataloader_num_workers=1, dataloader_prefetch_factor=1)
    with pytest.raises(ImageLoadError) as raised:
        trainer_on(fixtures, ds, tmp_path / "out", [_DeleteImagesAfterFirstStep(paths)], **options).train()
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message
    match = re.fullmatch(
        r"split 'train': cannot read image file '.*/images/\d+\.jpg': .* \(training stopped after step (\d+); "
        r"checkpoint saved in (.*checkpoint-\d+)\)\. Restore the image and rerun the same command to resume, .*",
        message,
    )
    assert match, message
    step, checkpoint = int(match.group(1)), match.group(2)
    assert 1 <= step < 6 and checkpoint.endswith(f"checkpoint-{step}")
    assert checkpoint_manifest.incomplete_reason(checkpoint) is None

    for path in paths:
        os.rename(path + ".away", path)
    resumed = trainer_on(fixtures, ds, tmp_path / "out", **options)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 6


class _SignalDuringLastEvaluation(TrainerCallback):
    def on_prediction_step(self, args, state, control, **kwargs):
        if state.global_step == state.max_steps and not getattr(self, "sent", False):
            self.sent = True
            signal.raise_signal(signal.SIGTERM)


@pytest.fixture
def caller():
    """A caller's own Ctrl-C and SIGTERM handler in place (put back by signal_handlers_as_they_were): `handler`, and
    the signals it got, `caught`."""
    caller = SimpleNamespace(caught=[])
    caller.handler = lambda signum, frame: caller.caught.append(signum)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, caller.handler)
    return caller


def handlers_are(handler) -> bool:
    return signal.getsignal(signal.SIGINT) is handler and signal.getsignal(signal.SIGTERM) is handler


def test_a_sigterm_in_the_last_steps_evaluation_waits_for_the_publication_or_without_one_is_the_callers(
    caller, fixtures, tmp_path
):
    ds, _ = path_dataset(fixtures, tmp_path / "images", 8)
    trainer_on(fixtures, ds, tmp_path / "one-step", max_steps=1).train()  # train() on its own: the caller's handlers
    assert handlers_are(caller.handler) and caller.caught == []

    def signalled(out):
        return trainer_on(fixtures, ds, out, [_SignalDuringLastEvaluation()], eval_strategy="steps", eval_steps=2)

    signalled(tmp_path / "alone").train()  # no publication follows: the SIGTERM is the caller's to handle
    assert caller.caught == [signal.SIGTERM] and handlers_are(caller.handler)

    out = tmp_path / "out"
    trainer = signalled(out)
    with pytest.raises(resilience.TrainingInterrupted) as stopped, trainer.catching_signals():  # as step 9
        trainer.train()
        assert trainer.state.global_step == 2
        trainer.save_model()  # the final save: the signal waited for it
    assert stopped.value.code == 128 + signal.SIGTERM
    assert stopped.value.message.startswith(
        f"Stopped by SIGTERM after saving completely what the run had done so far in {out}."
    )
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert handlers_are(caller.handler) and caller.caught == [signal.SIGTERM], "the signal reached the caller"


class _FailAfterTraining(RuntimeError):
    pass


@pytest.mark.parametrize("ending", ["published", "signal between training and publication", "failed there"])
def test_the_scripts_main_gives_the_callers_signal_handlers_back(ending, caller, fixtures, tmp_path, monkeypatch):
    """main() run in-process, as a caller that trains from Python does: its own handlers are in place again, and
    a signal between the end of training and the publication still waits for the published set."""
    import transformers

    log_metrics = transformers.Trainer.log_metrics

    def log_metrics_then(self, split, metrics):  # the script's first call after train() returned
        if ending == "failed there":
            raise _FailAfterTraining(split)
        if ending != "published":
            signal.raise_signal(signal.SIGTERM)
        return log_metrics(self, split, metrics)

    monkeypatch.setattr(transformers.Trainer, "log_metrics", log_metrics_then)
    script = runpy.run_path(str(REPO / SCRIPTS["cuda"]))  # its definitions, main() not run
    args = base_args(fixtures, tmp_path / "out", max_steps=1, max_train_samples=4, save_strategy="no")
    cache = ["--cache_dir", str(REPO / ".cache" / "hf_datasets")]
    monkeypatch.setattr(sys, "argv", [SCRIPTS["cuda"], *args, "--do_train", *cache, *CPU_FLAGS["cuda"]])
    # (the logging that main() sets up, transformers' verbosity included, is not left to the tests after this one)
    with logging_put_back():
        try:
            if ending == "published":
                script["main"]()
            elif ending == "failed there":
                with pytest.raises(_FailAfterTraining):
                    script["main"]()
            else:
                with pytest.raises(resilience.TrainingInterrupted) as stopped:
                    script["main"]()
                assert stopped.value.code == 128 + signal.SIGTERM
            assert (tmp_path / "out" / "model.safetensors").exists() is (ending != "failed there")
        finally:
            run_directory.release_all()  # what the process's exit does
    assert handlers_are(caller.handler)


@BOTH_ROUTES
def test_checkpoint_rotation_deletes_only_checkpoints_this_script_wrote(fixtures, tmp_path):
    ds, _ = path_dataset(fixtures, tmp_path / "images", 8)
    out = tmp_path / "out"
    (out / "checkpoint-0").mkdir(parents=True)  # someone else's, numbered below ours
    (out / "checkpoint-0" / "weights.pt").write_text("not ours")
    trainer = trainer_on(fixtures, ds, out, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer.train()
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-0", "checkpoint-3"]
    assert (out / "checkpoint-0" / "weights.pt").read_text() == "not ours"
    # the Trainer's own rotation is off while training; the run's limit is what the arguments and their saved copy say
    assert trainer.args.save_total_limit == 1
    saved = torch.load(out / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert saved.save_total_limit == 1


def test_with_a_limit_of_one_the_best_checkpoint_is_kept_beside_the_newest_then_alone_at_the_end(fixtures, tmp_path):
    """As the Trainer rotates: the best checkpoint (lowest eval_loss, here forced to be the first) is kept second to
    last while training, and once training ends it is the only checkpoint left."""

    class FirstIsBest(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_loss"] = float(state.global_step)

    class Kept(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")))

    seen = []
    ds, _ = path_dataset(fixtures, tmp_path / "images", 8)
    out = tmp_path / "out"
    options = dict(max_steps=3, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1)
    best = dict(load_best_model_at_end=True, metric_for_best_model="eval_loss", save_total_limit=1)
    trainer_on(fixtures, ds, out, callbacks=[FirstIsBest(), Kept()], **options, **best).train()
    # (on_save: once the checkpoint is saved, its manifest written and the older ones rotated)
    assert seen == [["checkpoint-1"], ["checkpoint-1", "checkpoint-2"], ["checkpoint-1", "checkpoint-3"]]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1"]


# 3. SIGTERM / SIGINT: checkpoint at the next step boundary, rerun resumes to the same weights ----------------


@contextmanager
def catching(stop):
    """`stop`'s handlers in place for the block, as the trainer installs them for train() and each publication."""
    stop.install()
    try:
        yield
    finally:
        stop.restore()


def test_signal_handler_requests_save_and_stop_and_a_second_signal_acts_at_once(ctrl_c_raises):
    stop, args = resilience.StopOnSignal(), ranks(1)
    before = signal.getsignal(signal.SIGINT)
    state, control = TrainerState(global_step=3, max_steps=10), TrainerControl()
    with catching(stop):
        stop.on_step_end(args, state, control)
        assert not control.should_training_stop
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(resilience.StoppedAtOnce) as at_once:  # a second Ctrl-C interrupts at once
            signal.raise_signal(signal.SIGINT)
        assert at_once.value.signum == signal.SIGINT and isinstance(at_once.value, KeyboardInterrupt)
        stop.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop
    assert signal.getsignal(signal.SIGINT) is before
    interrupted = stop.interruption(state, "out")
    assert interrupted.code == 128 + signal.SIGINT
    assert interrupted.message.startswith(
        "Training stopped by SIGINT at step 3 of 10; checkpoint saved in out/checkpoint-3."
    )


@pytest.mark.parametrize(
    "signum, to_the_group, times",
    [(signal.SIGINT, True, 2), (signal.SIGTERM, False, 2), (signal.SIGTERM, True, 1)],
    ids=["ctrl-c-twice", "sigterm-twice", "sigterm-to-every-process"],
)
def test_a_signal_sent_twice_or_to_every_process_ends_the_run_in_one_line(
    signum, to_the_group, times, fixtures, tmp_path
):
    """Ctrl-C twice (SIGINT to the process group, loader workers included) once ended in a KeyboardInterrupt
    traceback, a second SIGTERM to the run's process in silence; now, during the step or while exiting, the kit's
    line. SIGTERM to every process (Slurm's scancel) once ended in "DataLoader worker exited unexpectedly": the
    workers leave it to the main process, which saves a checkpoint at the step boundary."""
    send = (lambda pid: os.killpg(pid, signum)) if to_the_group else (lambda pid: os.kill(pid, signum))
    out = tmp_path / "out"
    command = base_args(fixtures, out, max_steps=400, save_strategy="no", dataloader_num_workers=2)
    run = ForkedRun("cuda", [*command, "--do_train", *CPU_FLAGS["cuda"]], tmp_path, new_session=True)
    for line in run.lines():
        if "'loss'" in line:  # training
            for _ in range(times):
                send(run.pid)
                time.sleep(0.05)
            break
    result = run.wait(timeout=300)
    stdout, text = result.stdout, result.stderr
    assert result.returncode == 128 + signum and "Traceback" not in text, text[-3000:]
    name = signal.Signals(signum).name
    ended = re.findall(
        rf"(?:Stopped at once by {name}: what was being saved is incomplete and is never used\. Rerun the same "
        r"command \(without --overwrite_output_dir\) to go on from the newest complete checkpoint\."
        rf"|Training stopped by {name} at step \d+ of 400; checkpoint saved in .*)$",  # (a progress bar may stand before it)
        text,
        re.MULTILINE,
    )
    assert len(ended) == 1, (stdout[-2000:], text[-3000:])
    assert (stdout + text).count(f"{name} received") == 1, "the loader workers say nothing"


# 4. --output_dir is never clobbered; files appear whole or not at all ----------------------------------------


def test_a_failed_publication_leaves_the_previous_files_alone(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(RuntimeError):
        with run_directory.publication(str(target)) as staging:
            with open(os.path.join(staging, "config.json"), "w") as f:
                f.write("new")
            with open(os.path.join(staging, "model.safetensors"), "wb") as f:
                f.write(b"half a mod")
                raise RuntimeError("killed mid-save")
    assert sorted(os.listdir(target)) == ["config.json"] and (target / "config.json").read_text() == "old"

    with run_directory.publication(str(target)) as staging:
        for name in ("config.json", "model.safetensors"):
            with open(os.path.join(staging, name), "w") as f:
                f.write("new")
    published = [".bridgetower-run.json", "config.json", run_directory.PUBLISHED_MANIFEST, "model.safetensors"]
    assert sorted(os.listdir(target)) == published and (target / "config.json").read_text() == "new"


# Script level: bad data (both scripts), and input refused with one line --------------------------------------


def bad_dataset(tmp_path):
    """A data set directory (train / validation / test csv files); its train split has 3 bad rows."""
    good = [(f"good{i}.jpg", jpeg_bytes(10 + i), f"good picture {i}") for i in range(2)]
    write_csv(tmp_path / "data" / "validation.csv", good)
    write_csv(tmp_path / "data" / "test.csv", good)
    train = [(f"{i}.jpg", jpeg_bytes(i), f"picture {i}") for i in range(8)]
    train[1] = ("1.jpg", jpeg_bytes(1)[:900], "truncated picture")
    train[3] = ("3.jpg", None, "missing picture")
    train[4] = ("4.jpg", jpeg_bytes(4), "")
    write_csv(tmp_path / "data" / "train.csv", train)
    return tmp_path / "data"


def csv_args(fixtures, dataset, out, *extra):
    paths = ["--model_name_or_path", fixtures["model"], "--dataset_name", dataset, "--output_dir", out]
    run = ["--per_device_train_batch_size", 4, "--num_train_epochs", 1, "--report_to", "none", "--save_strategy", "no"]
    return [*paths, "--do_train", *run, *extra]


def test_gaudi_script_stops_before_step_1_listing_the_bad_rows(fixtures, tmp_path):
    args = csv_args(fixtures, bad_dataset(tmp_path), tmp_path / "out", *CPU_FLAGS["gaudi"])
    result = run_script("gaudi", args, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = "3 bad rows found before training (pass --drop_bad_rows to train without them):"
    assert f"run_bridgetower.py: error: {said}" in result.stderr
    listed = result.stderr.strip().splitlines()[-3:]
    assert listed[0].startswith("  split 'train' row 1, column 'image_path': cannot decode image file ")
    assert "1.jpg': image file is truncated" in listed[0]
    assert listed[1].startswith("  split 'train' row 3, column 'image_path': missing image file ")
    assert listed[2] == "  split 'train' row 4, column 'caption': no caption (empty cell or missing value)"
    assert "'loss'" not in result.stdout


def test_cuda_script_drops_bad_rows_when_asked(fixtures, tmp_path):
    out = tmp_path / "out"
    result = run_script("cuda", csv_args(fixtures, bad_dataset(tmp_path), out, "--drop_bad_rows", *CPU_FLAGS["cuda"]))
    assert "3 bad rows dropped (--drop_bad_rows):" in result.stdout + result.stderr
    state = read_json(out / "trainer_state.json")
    assert state["global_step"] == 2  # 5 good rows of 8, 4 per step


def refusal_cases(fixtures, tmp_path, write=True):
    """(script args, the message of the last stderr line) for each input that must be refused; with `write`, the
    files they read are written under tmp_path."""
    model = fixtures["model"]
    quiet = ["--report_to", "none", *CPU_FLAGS["cuda"]]
    base = ["--output_dir", tmp_path / "out", "--do_train", *quiet]
    numbers, ints, config, foreign = (tmp_path / name for name in ("numbers.csv", "ints.csv", "args.json", "foreign"))
    if write:
        write_csv(numbers, [(f"{i}.jpg", jpeg_bytes(i), i) for i in range(4)])
        ints.write_text("image_path,caption\n" + "".join(f"{i},picture {i}\n" for i in range(4)))
        known = {"model_name_or_path": str(model), "train_file": str(numbers), "output_dir": str(tmp_path / "o")}
        config.write_text(json.dumps({**known, "use_cpu": True, "learning_rate_typo": 1e-4, "fp17": True}))
        foreign.mkdir()
        (foreign / "notes.txt").write_text("mine")
    newyorker = script_flags(fixtures, model_name_or_path=None)

    def into_foreign(*flags):
        return ["--model_name_or_path", model, *newyorker, "--output_dir", foreign, *flags, *quiet]

    not_theirs = (
        f"--output_dir={foreign} holds files this script did not write (notes.txt); it never overwrites or "
        "deletes them, with or without --overwrite_output_dir: move them away or choose another --output_dir"
    )
    return {
        "missing dataset directory": (
            ["--model_name_or_path", model, "--dataset_name", tmp_path / "no-such-dir", *base],
            f"--dataset_name={tmp_path / 'no-such-dir'}: no such directory",
        ),
        "caption column of numbers": (
            ["--model_name_or_path", model, "--train_file", numbers, *base],
            "--caption_column=caption in split 'train' holds int64 values, not text",
        ),
        "max_seq_length beyond the model": (
            ["--model_name_or_path", model, *newyorker, "--max_seq_length", 4096, *base],
            "--max_seq_length=4096 is larger than the model's 512 text positions",
        ),
        "image column of numbers": (
            ["--model_name_or_path", model, "--train_file", ints, *base],
            "--image_column=image_path in split 'train' holds Value('int64'), which is neither an image nor an image path",
        ),
        "json configuration with unknown keys": (
            [config],
            f"{config}: unknown arguments fp17, learning_rate_typo (see --help for the arguments this script takes)",
        ),
        "evaluation into a foreign output_dir": (into_foreign("--do_eval"), not_theirs),
        "training over a foreign output_dir with --overwrite_output_dir": (
            into_foreign("--overwrite_output_dir", "--do_train"),
            not_theirs,
        ),
    }


CASES = list(refusal_cases({"model": "model", "dataset": "dataset"}, Path("tmp"), write=False))  # the names


@BOTH_ROUTES
@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_with_one_line(case, fixtures, tmp_path):
    args, expected = refusal_cases(fixtures, tmp_path)[case]
    result = run_script("cuda", args, check=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == f"run_bridgetower_cuda.py: error: {expected}", result.stderr[-3000:]


def test_image_label_names_the_image_as_errors_do(tmp_path):
    assert resilience.image_label({"bytes": b"\xff\xd8", "path": None}) == "embedded bytes"
    assert resilience.image_label({"bytes": b"\xff\xd8", "path": ""}) == "embedded bytes"
    assert resilience.image_label({"bytes": b"\xff\xd8", "path": "cat.jpg"}) == "embedded bytes of 'cat.jpg'"
    assert resilience.image_label({"bytes": None, "path": "cat.jpg"}) == "'cat.jpg'"
    assert resilience.image_label(tmp_path / "cat.jpg") == repr(str(tmp_path / "cat.jpg"))
    assert resilience.image_label(3) == "int"


def ranks(world_size):
    """The TrainingArguments fields StopOnSignal reads: `world_size` processes on the CPU."""
    return SimpleNamespace(world_size=world_size, device=torch.device("cpu"))


@pytest.fixture
def distributed(monkeypatch):
    """torch.distributed initialised, its all_reduce the function given to the returned setter."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    return lambda all_reduce: monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)


def test_distributed_ranks_agree_every_ten_steps_to_stop_once_one_of_them_got_a_signal(distributed):
    other_rank, reductions = {"signal": 0}, []  # this rank gets no signal; the all-reduce's maximum: another rank's

    def all_reduce(flag, op):
        reductions.append(int(flag.item()))
        flag.fill_(max(int(flag.item()), other_rank["signal"]))

    distributed(all_reduce)
    stop, control = resilience.StopOnSignal(), TrainerControl()
    for step in range(1, 21):
        if step == 11:  # nobody got a signal by step 10: the run goes on, and ends as a complete run
            assert stop.received is None and stop.stopped_after_saving("out") is None
            other_rank["signal"] = int(signal.SIGTERM)
        stop.on_step_end(ranks(2), TrainerState(global_step=step, max_steps=30), control)
        # the flag is exchanged at steps 10, 20, ... only: the signal another rank got after step 10 stops at 20
        assert reductions == [0] * (step // 10) and control.should_training_stop is (step == 20), step
    assert control.should_save and stop.received == signal.SIGTERM and stop.stopped_at == 20


@pytest.mark.parametrize(
    "step, said",
    [
        (4, "SIGINT received: training stops and saves a checkpoint after the current step"),
        (10, "SIGINT received: the run stops once the final results being saved are complete"),
        # a second train() call, before its first step ends: the end of the first one is forgotten
        (None, "SIGINT received: training stops and saves a checkpoint after the current step"),
    ],
)
def test_the_first_signal_says_what_happens_next(caplog, step, said):
    stop = resilience.StopOnSignal()
    stop.training_done = step is None  # (what the trainer sets once a first train() call finished)
    with caplog.at_level("WARNING", logger="bridgetower_bench.guards.resilience"), catching(stop):
        if step is not None:
            stop.on_step_end(ranks(1), TrainerState(global_step=step, max_steps=10), TrainerControl())
        signal.raise_signal(signal.SIGINT)
    assert said in caplog.text and "(send it again to stop at once)" in caplog.text
    assert stop.received == signal.SIGINT


def test_a_single_process_stops_at_the_next_step_even_under_a_launcher(distributed):
    # torchrun with one process initialises torch.distributed; there is nobody to agree with.
    distributed(lambda flag, op: pytest.fail("no all-reduce for one process"))
    stop, control = resilience.StopOnSignal(), TrainerControl()
    stop.received = int(signal.SIGTERM)
    stop.on_step_end(ranks(1), TrainerState(global_step=3, max_steps=30), control)
    assert control.should_training_stop and stop.stopped_at == 3


def test_a_signal_on_the_last_step_leaves_a_complete_run():
    stop = resilience.StopOnSignal()
    stop.received = int(signal.SIGTERM)
    state = TrainerState(global_step=10, max_steps=10)
    stop.on_step_end(ranks(1), state, TrainerControl())
    assert stop.stopped_at == 10 and stop.interruption(state, "out") is None
    # (the run then ends after saving its results, stopped_after_saving)
    assert stop.stopped_after_saving("out").code == 128 + signal.SIGTERM


@pytest.mark.parametrize("every", [0, 1])
def test_ranks_can_agree_at_every_step(distributed, every):
    distributed(lambda flag, op: flag.fill_(int(signal.SIGTERM)))
    stop, control = resilience.StopOnSignal(sync_every_steps=every), TrainerControl()
    stop.on_step_end(ranks(2), TrainerState(global_step=1, max_steps=30), control)
    assert control.should_training_stop and stop.stopped_at == 1


@pytest.mark.parametrize(
    "count, listed",
    [(5, "(a0, a1, a2, a3, a4)"), (6, "(a0, a1, a2, a3, a4 and 1 more)"), (8, "(a0, a1, a2, a3, a4 and 3 more)")],
)
def test_foreign_files_are_listed_five_at_most(tmp_path, count, listed):
    for i in range(count):
        (tmp_path / f"a{i}").write_text("theirs")
    with pytest.raises(ValueError) as refused:
        run_directory.check_output_dir(str(tmp_path))
    assert f"holds files this script did not write {listed};" in str(refused.value)

"""Preflight in the cases a data set really has: one bad picture shown in many rows, files of the same name in
different folders, cells holding no image at all, and more distinct images than one decode round."""

import json
import logging
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace

import datasets
import pytest
from transformers import HfArgumentParser

from bridgetower_bench import preflight
from bridgetower_bench.arguments import check_arguments, parse_arguments
from bridgetower_bench.output_dir import run_directory
from helpers import embedded, jpeg_bytes


GOOD, OTHER = jpeg_bytes(0), jpeg_bytes(1)
TRUNCATED = GOOD[: len(GOOD) // 2]


def image_rows(problems):
    return [(p.split, p.row) for p in problems if p.column == "image"]


def test_a_bad_image_shown_in_several_rows_is_reported_and_dropped_in_every_row(tmp_path):
    images = [TRUNCATED, GOOD, TRUNCATED, OTHER, TRUNCATED, GOOD]
    (tmp_path / "good.jpg").write_bytes(GOOD)
    gone = str(tmp_path / "gone.jpg")
    paths = [gone, str(tmp_path / "good.jpg"), gone, gone]
    splits = {
        "train": embedded(images, [f"train {i}" for i in range(len(images))]),
        "validation": datasets.Dataset.from_dict({"image": paths, "caption": [f"val {i}" for i in range(len(paths))]}),
    }
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(problems) == [("train", row) for row in (0, 2, 4)] + [("validation", row) for row in (0, 2, 3)]
    assert all(p.reason == f"missing image file {gone!r}" for p in problems if p.split == "validation")

    with pytest.raises(ValueError, match=r"^6 bad rows found before training"):
        preflight.check_splits(splits, "image", "caption", cache_dir=tmp_path / "cache")
    kept = preflight.check_splits(splits, "image", "caption", drop_bad_rows=True, cache_dir=tmp_path / "cache")
    assert list(kept["train"]["caption"]) == ["train 1", "train 3", "train 5"]
    assert list(kept["validation"]["caption"]) == ["val 1"]


@pytest.mark.parametrize("bad_first", [True, False])
def test_files_of_the_same_name_in_different_folders_get_their_own_verdict(tmp_path, bad_first):
    for folder, data in (("a", GOOD), ("b", TRUNCATED)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "cartoon.jpg").write_bytes(data)
    good, bad = str(tmp_path / "a" / "cartoon.jpg"), str(tmp_path / "b" / "cartoon.jpg")
    paths = [bad, good, bad, good] if bad_first else [good, bad, good, bad]
    splits = {"train": datasets.Dataset.from_dict({"image": paths, "caption": ["c"] * 4})}
    problems, cache_file = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(problems) == ([("train", 0), ("train", 2)] if bad_first else [("train", 1), ("train", 3)])
    assert all(repr(bad) in p.reason for p in problems)

    # The cached outcome watches both files: replacing the good one with a broken one is noticed.
    (tmp_path / "a" / "cartoon.jpg").write_bytes(b"not a picture any more")
    again, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(again) == [("train", 0), ("train", 1), ("train", 2), ("train", 3)]


def test_cells_with_neither_bytes_nor_a_path_are_bad_rows(tmp_path):
    # As a parquet file's image struct holds them (no Image feature), and as an Image column holds an empty cell.
    cell = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    struct = datasets.Features({"image": cell, "caption": datasets.Value("string")})
    cells = [{"bytes": GOOD, "path": None}, {"bytes": None, "path": None}, {"bytes": b"", "path": ""}]
    cells += [{"bytes": None, "path": None}, {"bytes": OTHER, "path": None}]
    structs = datasets.Dataset.from_dict({"image": cells, "caption": ["c"] * len(cells)}, features=struct)
    image_feature = datasets.Features({"image": datasets.Image(decode=False), "caption": datasets.Value("string")})
    empty_cells = datasets.Dataset.from_dict(
        {"image": [None, {"bytes": GOOD, "path": None}, None], "caption": ["c"] * 3}, features=image_feature
    )
    (tmp_path / "ok.jpg").write_bytes(GOOD)
    path_cells = datasets.Dataset.from_dict({"image": [None, str(tmp_path / "ok.jpg"), ""], "caption": ["c"] * 3})
    splits = {"train": structs, "validation": empty_cells, "test": path_cells}
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    rows = {"train": (1, 2, 3), "validation": (0, 2), "test": (0, 2)}
    assert image_rows(problems) == [(split, row) for split in rows for row in rows[split]]
    assert {p.reason for p in problems} == {"no image (empty cell: neither embedded bytes nor a path)"}
    kept = preflight.check_splits(splits, "image", "caption", drop_bad_rows=True, cache_dir=tmp_path / "cache")
    assert [len(kept[split]) for split in splits] == [2, 1, 1]


@pytest.mark.parametrize("num_proc", [1, 2])
def test_more_distinct_images_than_one_decode_round(tmp_path, monkeypatch, num_proc):
    """Rounds of 3 distinct images: bad ones in the first, a middle and the last (partial) round, and a bad
    image seen again after its round was decoded; every image is decoded once and every bad row named."""
    monkeypatch.setattr(preflight, "_IMAGES_PER_ROUND", 3)
    pictures = [jpeg_bytes(10 + i, size=(64, 48)) for i in range(11)]
    for i in (1, 5, 10):
        pictures[i] = pictures[i][: len(pictures[i]) * 3 // 4]
    assert len(set(pictures)) == 11
    images = pictures + [pictures[1], pictures[0]]  # rows 11 and 12 repeat images of the first round
    splits = {"train": embedded(images, [f"c{i}" for i in range(len(images))])}
    decoded = []
    if num_proc == 1:
        original = preflight.image_problem
        monkeypatch.setattr(
            preflight,
            "image_problem",
            lambda payload, **budget: decoded.append(payload) or original(payload, **budget),
        )
    problems, cache_file = preflight.find_problems(splits, "image", "caption", num_proc=num_proc, cache_dir=tmp_path)
    assert image_rows(problems) == [("train", 1), ("train", 5), ("train", 10), ("train", 11)]
    assert all(p.reason.startswith("cannot decode embedded image") for p in problems)
    if num_proc == 1:
        assert sorted(decoded) == sorted(pictures), "each distinct image decoded exactly once"


# ---------------------------------------------------------------------------------------------
# What a user reads and what the flags do: the bad-row list, the log, the cache, the workers, the budget
# ---------------------------------------------------------------------------------------------


def test_the_error_lists_twenty_bad_rows_and_counts_the_rest(tmp_path):
    def error_lines(n_bad):
        splits = {"train": embedded([b"not a picture %d" % i for i in range(n_bad)] + [GOOD], ["c"] * (n_bad + 1))}
        with pytest.raises(ValueError) as stop:
            preflight.check_splits(splits, "image", "caption", cache_dir=tmp_path / "cache")
        return str(stop.value).splitlines()

    assert error_lines(1)[0] == "1 bad row found before training (pass --drop_bad_rows to train without them):"
    exactly = error_lines(20)
    assert exactly[0].startswith("20 bad rows found") and len(exactly) == 21  # all listed, no "... and 0 more"
    assert exactly[-1].startswith("  split 'train' row 19, column 'image': cannot decode embedded image")
    more = error_lines(21)
    assert len(more) == 22 and more[-2].startswith("  split 'train' row 19,"), more[-2:]
    assert more[-1].startswith("  ... and 1 more (all listed in "), more[-1]


def test_a_second_check_of_the_same_splits_reads_the_cache_and_logs_what_it_checked(tmp_path, caplog):
    splits = {
        "train": embedded([GOOD, TRUNCATED, GOOD], ["a", "b", "c"]),
        "validation": datasets.Dataset.from_dict({"image": [str(tmp_path / "gone.jpg")] * 2, "caption": ["d", "e"]}),
    }
    with caplog.at_level(logging.INFO, logger=preflight.logger.name):
        started = time.perf_counter()
        with pytest.raises(ValueError, match=r"^3 bad rows found before training"):
            preflight.check_splits(splits, "image", "caption", cache_dir=tmp_path / "cache")
        took = time.perf_counter() - started
    checked = re.search(
        r"Preflight: checked 5 rows of train, validation \(3 distinct images\) in ([0-9.]+) s: 3 bad\.", caplog.text
    )
    assert checked, caplog.text
    assert float(checked.group(1)) <= took + 0.1, "the time logged is the time the check took"

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=preflight.logger.name):
        with pytest.raises(ValueError, match=r"^3 bad rows found before training"):
            preflight.check_splits(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert "Preflight: the 5 rows of train, validation were checked before" in caplog.text


def test_the_cache_knows_a_file_by_what_it_was_when_checked_not_when_a_later_row_shows_it(tmp_path, monkeypatch):
    """A file rewritten after its decode, then shown by a later row: the next check decodes it again."""
    monkeypatch.setattr(preflight, "_IMAGES_PER_ROUND", 1)  # each distinct image decoded as soon as a row shows it
    first, second = tmp_path / "first.jpg", tmp_path / "second.jpg"
    first.write_bytes(GOOD)
    second.write_bytes(OTHER)
    original = preflight.image_problem

    def decode_then_cut_first(payload, **budget):
        reason = original(payload, **budget)
        if payload == str(first):
            first.write_bytes(TRUNCATED)  # changed after the check read it, before row 2 shows it
        return reason

    monkeypatch.setattr(preflight, "image_problem", decode_then_cut_first)
    splits = {
        "train": datasets.Dataset.from_dict({"image": [str(first), str(second), str(first)], "caption": list("abc")})
    }
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert problems == []  # what the check read was whole
    monkeypatch.setattr(preflight, "image_problem", original)
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert image_rows(problems) == [("train", 0), ("train", 2)]


def test_an_empty_split_is_refused_and_a_one_row_split_is_checked(tmp_path):
    one_row = embedded([GOOD], ["a"])
    assert preflight.check_splits({"train": one_row}, "image", "caption", cache_dir=tmp_path)["train"] is one_row
    with pytest.raises(ValueError, match=r"^split 'validation' has no rows$"):
        preflight.check_splits(
            {"train": one_row, "validation": one_row.select([])}, "image", "caption", cache_dir=tmp_path
        )


def test_images_are_checked_in_worker_processes_in_chunks_when_asked(tmp_path, monkeypatch):
    """--preprocessing_num_workers=2 shares a round out to two worker processes (40 images: chunks of 5) with the
    verdicts a check here gives; a fault put into this process's copy of the module (the EXIF step fails) is seen
    by a check run here, and not by one run in the workers."""
    pictures = [jpeg_bytes(100 + i, size=(40, 32)) for i in range(40)]
    for i in (3, 22, 39):
        pictures[i] = pictures[i][: len(pictures[i]) // 2]
    splits = {"train": embedded(pictures, [f"c{i}" for i in range(40)])}
    here, _ = preflight.find_problems(splits, "image", "caption", num_proc=1, cache_dir=tmp_path / "one")
    workers, _ = preflight.find_problems(splits, "image", "caption", num_proc=2, cache_dir=tmp_path / "two")
    assert image_rows(workers) == image_rows(here) == [("train", 3), ("train", 22), ("train", 39)]
    assert [p.reason for p in workers] == [p.reason for p in here]

    def broken_exif_step(img):
        raise OSError("broken in this process only")

    monkeypatch.setattr(preflight, "upright", broken_exif_step)
    broken, _ = preflight.find_problems(splits, "image", "caption", num_proc=1, cache_dir=tmp_path / "three")
    in_this_process = [p.reason for p in broken if p.row not in (3, 22, 39)]
    assert in_this_process == ["cannot decode embedded image: broken in this process only"] * 37
    unbroken, _ = preflight.find_problems(splits, "image", "caption", num_proc=2, cache_dir=tmp_path / "four")
    assert unbroken == workers


def test_pixel_budget_of_one_pixel_strips_and_empty_sizes():
    # A strip one pixel high is resized to 294 pixels high before the crop: 200x1 becomes 58800x294.
    assert preflight.pixel_budget_problem((200, 1), 1_000_000, image_size=294) == (
        "200x1 is resized to 58800x294 before the centre crop, 17,287,200 pixels, over the budget of 1,000,000 "
        "(--max_image_pixels; the aspect ratio is too extreme)"
    )
    assert preflight.pixel_budget_problem((1, 200), 1_000_000, image_size=294).startswith(
        "1x200 is resized to 294x58800"
    )
    # A header claiming no pixels is not a budget matter (decoding it is what fails).
    for size in ((0, 10), (10, 0), (0, 0)):
        assert preflight.pixel_budget_problem(size, 1_000_000, image_size=294) is None


def test_every_count_flag_is_refused_below_its_minimum_and_accepted_at_it(tmp_path):
    limits = ["max_seq_length", "max_train_samples", "max_eval_samples", "preprocessing_num_workers"]  # None: no limit
    sizes = ["per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"]

    def arguments(**values):
        data_args = SimpleNamespace(**dict.fromkeys(limits), max_image_pixels=1)
        others = dict(dataloader_num_workers=0, output_dir=str(tmp_path / "out"), do_train=False, max_steps=-1)
        training_args = SimpleNamespace(**dict.fromkeys(sizes, 1), **others, num_train_epochs=3.0)
        for name, value in values.items():
            setattr(data_args if hasattr(data_args, name) else training_args, name, value)
        return data_args, training_args

    check_arguments(*arguments())  # every count at its minimum
    check_arguments(*arguments(**dict.fromkeys(limits, 1)))
    for name in [*limits, "max_image_pixels", *sizes]:
        with pytest.raises(ValueError, match=rf"^--{name}=0: must be positive$"):
            check_arguments(*arguments(**{name: 0}))
    with pytest.raises(ValueError, match=r"^--dataloader_num_workers=-1: must be at least 0$"):
        check_arguments(*arguments(dataloader_num_workers=-1))


def test_output_dir_may_exist_or_be_created_below_existing_folders(tmp_path):
    (tmp_path / "existing").mkdir()
    for output_dir in (tmp_path / "existing", tmp_path / "new", tmp_path / "existing" / "a" / "b", tmp_path):
        run_directory.check_output_dir_path(str(output_dir))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"is a file, not a directory$"):
        run_directory.check_output_dir_path(str(tmp_path / "a_file"))
    with pytest.raises(ValueError, match=r"cannot be created: .*a_file is a file$"):
        run_directory.check_output_dir_path(str(tmp_path / "a_file" / "run" / "deeper"))
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # a link to nothing cannot be created over, nor below
    for output_dir in (tmp_path / "link", tmp_path / "link" / "run"):
        with pytest.raises(ValueError, match=rf"^--output_dir={output_dir} cannot be created: .*link is a file$"):
            run_directory.check_output_dir_path(str(output_dir))


def test_the_outcome_is_cached_in_a_new_nested_folder_and_again_after_a_recheck(tmp_path, monkeypatch, caplog):
    """A first run under a fresh $HF_HOME creates the cache's folders; a re-check after an image changed is
    cached again, so a third run decodes nothing."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "cat.jpg").write_bytes(GOOD)
    splits = {"train": datasets.Dataset.from_dict({"image": [str(tmp_path / "cat.jpg")], "caption": ["a cat"]})}
    original = preflight.image_problem
    decoded = []
    monkeypatch.setattr(
        preflight, "image_problem", lambda payload, **budget: decoded.append(payload) or original(payload, **budget)
    )
    with caplog.at_level(logging.WARNING):
        assert preflight.find_problems(splits, "image", "caption")[0] == []
        assert preflight.find_problems(splits, "image", "caption")[0] == []
        assert len(decoded) == 1
        (tmp_path / "cat.jpg").write_bytes(OTHER)
        assert preflight.find_problems(splits, "image", "caption")[0] == []
        assert preflight.find_problems(splits, "image", "caption")[0] == []
    assert len(decoded) == 2, "re-checked once after the change, then read from the cache"
    assert "cannot write its cache" not in caplog.text


def test_budget_boundaries_row_order_and_configuration_files(tmp_path):
    # An image of exactly the budget passes, as decoded and as resized; one pixel more does not.
    assert preflight.pixel_budget_problem((100, 100), 10_000) is None
    assert preflight.pixel_budget_problem((101, 100), 10_000).startswith(
        "101x100 is 10,100 pixels, over the budget of 10,000"
    )
    assert preflight.pixel_budget_problem((200, 1), 17_287_200, image_size=294) is None
    assert preflight.pixel_budget_problem((200, 1), 17_287_199, image_size=294) is not None

    # A row with a bad image and a bad caption: the image is named first.
    splits = {"train": embedded([GOOD, TRUNCATED], ["a", ""])}
    problems, _ = preflight.find_problems(splits, "image", "caption", cache_dir=tmp_path / "cache")
    assert [(p.row, p.column) for p in problems] == [(1, "image"), (1, "caption")]

    # No arguments at all: the defaults, not a crash; a missing configuration file: one line with the reason.
    @dataclass
    class Arguments:
        learning_rate: float = 0.5

    parser = HfArgumentParser(Arguments)
    assert parse_arguments(parser, ["script.py"]) == (Arguments(),)
    assert parse_arguments(parser, ["script.py", "--learning_rate", "0.25"]) == (Arguments(0.25),)
    missing = tmp_path / "gone.json"
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(missing))}: cannot read the configuration file \(No such file or directory\)$",
    ):
        parse_arguments(parser, ["script.py", str(missing)])
    # One unknown argument is named in the singular, several in the plural.
    for names, noun in ((["learning_rat"], "argument"), (["learning_rat", "sed"], "arguments")):
        config = tmp_path / f"{len(names)}.json"
        config.write_text(json.dumps({name: 1 for name in names}))
        with pytest.raises(
            ValueError, match=rf"^{re.escape(str(config))}: unknown {noun} {', '.join(sorted(names))} \(see --help"
        ):
            parse_arguments(parser, ["script.py", str(config)])

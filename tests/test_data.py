"""Data loading: csv / json / jsonl files with image paths, splits, and the errors users get for bad input."""

import csv
import json
import os

import datasets
import numpy as np
import pytest
from PIL import Image

from bridgetower_bench import arguments, data
from bridgetower_bench.tools.fixtures import script_flags
from helpers import CPU_FLAGS, load_raw, read_json, run_script


def write_images(directory):
    """One image per awkward case: every PIL mode we know of, PNG and JPEG, tiny, and extreme aspect ratios."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (120, 160, 3), dtype=np.uint8))
    palette_with_alpha = rgb.convert("P")
    palette_with_alpha.info["transparency"] = 0
    converted = "mode_1.png mode_L.jpg mode_LA.png mode_P.png mode_RGBA.png mode_CMYK.jpg".split()
    cases = {name: rgb.convert(name.removeprefix("mode_").split(".")[0]) for name in converted}  # mode_<mode>.<format>
    cases |= {"mode_P_transparent.png": palette_with_alpha, "mode_RGB.jpg": rgb}
    cases["mode_I16.png"] = Image.fromarray((rng.integers(0, 65535, (90, 70))).astype(np.uint16))
    sizes = {"tiny_12x9.png": (12, 9), "wide_2000x20.jpg": (2000, 20), "tall_20x900.png": (20, 900)}
    cases |= {name: rgb.resize(size) for name, size in sizes.items()}
    for name, image in cases.items():
        image.save(directory / name)
    return sorted(cases)


def write_rows(path, names, fmt):
    rows = [{"image_path": f"images/{n}", "caption": f"picture number {i} called {n}"} for i, n in enumerate(names)]
    if fmt == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["image_path", "caption"])
            writer.writeheader()
            writer.writerows(rows)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))


@pytest.mark.parametrize(
    "kind,fmt,pipeline", [("cuda", "csv", "upstream"), ("gaudi", "jsonl", "fast"), ("cuda", "json", "fast-draft")]
)
def test_scripts_train_on_files_with_every_kind_of_image(kind, fmt, pipeline, fixtures, tmp_path):
    names = write_images(tmp_path / "images")
    write_rows(tmp_path / f"train.{fmt}", names, fmt)
    write_rows(tmp_path / f"validation.{fmt}", names[:4], fmt)
    out = tmp_path / "out"
    files = ["--train_file", tmp_path / f"train.{fmt}", "--validation_file", tmp_path / f"validation.{fmt}"]
    recipe = (
        "--do_train --do_eval --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --num_train_epochs 1 "
        "--report_to none --save_strategy no"
    ).split()
    run_script(
        kind,
        ["--model_name_or_path", fixtures["model"], *files, "--output_dir", out, "--image_pipeline", pipeline]
        + recipe
        + CPU_FLAGS[kind],
    )
    train = read_json(out / "train_results.json")
    assert np.isfinite(train["train_loss"]) and train["image_pipeline"] == pipeline
    assert np.isfinite(read_json(out / "validation_results.json")["eval_loss"])


def test_wrong_column_is_named_with_the_available_columns(fixtures, tmp_path):
    args = script_flags(fixtures, image_column="picture", output_dir=tmp_path / "o", report_to="none")
    result = run_script("cuda", [*args, "--do_train", *CPU_FLAGS["cuda"]], check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("run_bridgetower_cuda.py: error: --image_column=picture is not a column")
    assert "image, contest_number" in last and "image_description" in last


def test_data_arguments_name_the_flag_of_an_unknown_extension_or_mixed_formats_and_json_jsonl_go_together(tmp_path):
    with pytest.raises(ValueError, match=r"--train_file=.*captions\.txt: unsupported file extension '\.txt'"):
        arguments.check_data_arguments(None, str(tmp_path / "captions.txt"), None)
    with pytest.raises(ValueError, match="Need either --dataset_name or --train_file"):
        arguments.check_data_arguments(None, None, None)
    with pytest.raises(
        ValueError, match=r"^--train_file=t\.csv and --validation_file=v\.json must have the same format"
    ):
        arguments.check_data_arguments(None, "t.csv", "v.json")
    arguments.check_data_arguments(None, "t.json", "v.jsonl")  # one builder (json) for both
    arguments.check_data_arguments(None, "t.csv", "v.CSV")


def test_data_dir_picks_the_folder_of_a_data_set_directory_that_is_read(tmp_path):
    for folder in ("2023", "2024"):
        (tmp_path / "set" / folder).mkdir(parents=True)
        (tmp_path / "set" / folder / "train.csv").write_text(f"image_path,caption\n{folder}.jpg,from {folder}\n")
    for folder in ("2023", "2024"):
        read = load_raw(dataset_name=str(tmp_path / "set"), data_dir=folder, cache_dir=str(tmp_path / "cache"))
        assert read["train"]["caption"] == [f"from {folder}"]


def test_dataset_config_name_picks_the_configuration(fixtures, tmp_path):
    common = dict(dataset_name=str(fixtures["dataset"]), cache_dir=str(tmp_path))
    assert "train" in load_raw(dataset_config_name="matching", **common)
    with pytest.raises(ValueError, match="'ranking' not found"):
        load_raw(dataset_config_name="ranking", **common)


def test_a_missing_data_file_a_missing_dataset_directory_and_one_with_an_unreadable_file_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"--train_file=.*nope\.csv: no such file"):
        load_raw(train_file=str(tmp_path / "nope.csv"))
    with pytest.raises(ValueError, match=r"--dataset_name=.*missing: no such directory"):
        load_raw(dataset_name=str(tmp_path / "missing"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"--dataset_name=.*data: cannot be read: JSON parse error"):
        load_raw(dataset_name=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"))


def test_resolve_column_lists_available_columns():
    with pytest.raises(
        ValueError, match="--caption_column=text is not a column of the data set; available columns: a, b"
    ):
        data.resolve_column(["a", "b"], "text", "--caption_column", 1)
    assert data.resolve_column(["a", "b"], None, "--caption_column", 1) == "b"


def _dataset(n):
    return datasets.Dataset.from_dict({"image": [f"{i}.png" for i in range(n)], "caption": [str(i) for i in range(n)]})


def test_an_existing_validation_split_is_kept_and_test_is_split_off_with_the_seed_only_for_do_predict():
    raw = datasets.DatasetDict({"train": _dataset(50), "validation": _dataset(7)})
    splits = data.make_splits(raw, seed=3)
    assert list(splits["validation"]["caption"]) == list(raw["validation"]["caption"])
    assert len(splits["train"]) == 40 and len(splits["test"]) == 10
    assert not set(splits["train"]["caption"]) & set(splits["test"]["caption"])
    again = data.make_splits(raw, seed=3)
    assert list(again["test"]["caption"]) == list(splits["test"]["caption"]), "the split must follow the run's seed"
    other_seed = list(data.make_splits(raw, seed=4)["test"]["caption"])
    assert other_seed != list(splits["test"]["caption"]), "drawn with the seed"
    assert sorted(splits["test"]["caption"]) != sorted(str(i) for i in range(40, 50)), "not taken from the end"
    # without --do_predict no test split is carved off train
    splits = data.make_splits(raw, seed=3, need_test=False)
    assert set(splits) == {"train", "validation"}, "no test split without --do_predict"
    assert list(splits["train"]["caption"]) == list(raw["train"]["caption"]), "every row trains, in order"
    # a missing validation split is still carved off (evaluation needs it)
    raw = datasets.DatasetDict({"train": _dataset(50), "test": _dataset(5)})
    no_validation = data.make_splits(raw, seed=3, need_test=False)
    assert len(no_validation["train"]) == 40 and len(no_validation["validation"]) == 10


@pytest.mark.parametrize("need_test", [True, False])
def test_train_only_data_is_split_60_20_20_into_upstreams_rows(need_test):
    raw = _dataset(100)
    # upstream: 40 % off train with the seed (shuffled), then that part halved in order into validation and test
    held_out = raw.train_test_split(test_size=0.4, shuffle=True, seed=11)
    halves = held_out["test"].train_test_split(test_size=0.5, shuffle=False)
    expected = {"train": held_out["train"], "validation": halves["train"], "test": halves["test"]}
    splits = data.make_splits(datasets.DatasetDict({"train": raw}), seed=11, need_test=need_test)
    assert {s: list(d["caption"]) for s, d in splits.items()} == {s: list(d["caption"]) for s, d in expected.items()}
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [60, 20, 20]
    assert sorted(sum((list(splits[s]["caption"]) for s in splits), [])) == sorted(str(i) for i in range(100))


def test_csv_cells_that_pandas_would_read_as_missing_stay_captions_and_an_unreadable_file_is_named_with_the_reason(
    tmp_path, monkeypatch
):
    path = tmp_path / "train.csv"
    path.write_text("image,caption\na.png,NA\nb.png,None\nc.png,null\n")
    rows = data.load_data_file(str(path), "--train_file", "train", cache_dir=str(tmp_path / "cache"))
    assert list(rows["caption"]) == ["NA", "None", "null"]
    path = tmp_path / "train.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"--train_file=.*train\.json: cannot be read as json: JSON parse error"):
        data.load_data_file(str(path), "--train_file", "train", cache_dir=str(tmp_path / "cache"))

    def refuse(*args, **kwargs):  # the reader's own error, two lines long and chained to another
        try:
            raise KeyError("inner detail")
        except KeyError as inner:
            raise ValueError("the header has 3 fields, the rows 4\nmore lines") from inner

    monkeypatch.setattr(data, "load_dataset", refuse)
    with pytest.raises(
        ValueError, match=r"^--train_file=t\.csv: cannot be read as csv: the header has 3 fields, the rows 4$"
    ):
        data.load_data_file("t.csv", "--train_file", "train")


def test_relative_image_path_found_from_the_working_directory_is_kept(tmp_path, monkeypatch):
    """Both the working directory and the data file's directory hold `pic.png`: the working directory's is read."""
    work, files = tmp_path / "work", tmp_path / "files"
    for folder in (work, files):
        folder.mkdir()
        Image.new("RGB", (4, 4)).save(folder / "pic.png")
    Image.new("RGB", (4, 4)).save(files / "only_here.png")
    (files / "train.csv").write_text("image,caption\npic.png,a\nonly_here.png,b\n")
    monkeypatch.chdir(work)
    raw = load_raw(train_file=str(files / "train.csv"), cache_dir=str(tmp_path / "cache"))
    assert list(raw["train"]["image"]) == ["pic.png", str(files / "only_here.png")]


@pytest.mark.parametrize(
    "given", [("validation",), ("test",), ("validation", "test"), ("train", "validation", "test")]
)
def test_without_a_train_split_or_with_all_three_the_given_splits_are_kept_as_they_are(given):
    raw = datasets.DatasetDict({s: _dataset(6) for s in given})  # e.g. only --validation_file, for --do_eval
    splits = data.make_splits(raw, seed=0)
    assert {s: list(d["caption"]) for s, d in splits.items()} == {s: list(raw[s]["caption"]) for s in given}


def test_max_seq_length_may_use_every_text_position_and_must_leave_room_for_one_caption_token():
    import transformers

    class TwoSpecialTokens:  # RoBERTa's <s> ... </s>
        def num_special_tokens_to_add(self):
            return 2

    config = transformers.BridgeTowerConfig(text_config={"max_position_embeddings": 24, "pad_token_id": 1})
    arguments.check_max_seq_length(22, config)  # RoBERTa-style positions: 2 are kept for the padding offset
    with pytest.raises(ValueError, match=r"--max_seq_length=23 is larger than the model's 22 text positions"):
        arguments.check_max_seq_length(23, config)
    arguments.check_max_seq_length(3, config, TwoSpecialTokens())
    with pytest.raises(
        ValueError,
        match=r"--max_seq_length=2 leaves no room for a caption: the tokenizer adds 2 special tokens; use at least 3",
    ):
        arguments.check_max_seq_length(2, config, TwoSpecialTokens())


def test_image_load_error_names_the_split_and_the_image_once():
    from bridgetower_bench.guards.resilience import ImageLoadError

    def batch_of(path):
        return {"image": [path], "input_ids": [[0, 2]], "attention_mask": [[1, 1]]}

    def missing_file(path):
        raise FileNotFoundError(f"[Errno 2] No such file or directory: {path!r}")

    def undecodable(path):
        raise OSError("cannot identify image file")

    with pytest.raises(ImageLoadError) as error:
        data.BatchTransform("image", missing_file, split="train")(batch_of("/data/a.png"))
    assert str(error.value) == "split 'train': [Errno 2] No such file or directory: '/data/a.png'"
    with pytest.raises(ImageLoadError) as error:
        data.BatchTransform("image", undecodable, split="validation")(batch_of("/data/b.png"))
    assert str(error.value) == "split 'validation': image '/data/b.png': cannot identify image file"


def test_captions_are_cut_or_padded_to_max_seq_length_non_strings_refused_and_tokenized_splits_cached(
    fixtures, tmp_path
):
    """Non-string captions are refused with their row. A data set read from disk is tokenized once; a second run
    reads the cached result (the same file, untouched), and --overwrite_cache writes it again."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixtures["model"])
    tokenize = data.TokenizeCaptions(tokenizer, caption_column="caption", max_seq_length=8)
    tokens = tokenize({"caption": ["a cat " * 40, "a cat"]}, [0, 1])
    assert [len(ids) for ids in tokens["input_ids"]] == [8, 8]
    assert tokens["attention_mask"][0] == [1] * 8 and tokens["attention_mask"][1][-1] == 0
    with pytest.raises(ValueError, match=r"--caption_column=caption: row 11 holds 42"):
        tokenize({"caption": ["fine", 42]}, indices=[10, 11])

    _dataset(6).save_to_disk(str(tmp_path / "saved"))
    dataset = datasets.load_from_disk(str(tmp_path / "saved"))
    options = dict(image_column="image", caption_column="caption", max_seq_length=8, num_proc=None, split="train")

    def tokenized_file(overwrite_cache):
        result = data.tokenize_split(dataset, tokenizer, overwrite_cache=overwrite_cache, **options)
        (cache_file,) = {f["filename"] for f in result.cache_files} - {f["filename"] for f in dataset.cache_files}
        return cache_file, os.stat(cache_file).st_mtime_ns

    first = tokenized_file(False)
    assert tokenized_file(False) == first, "read from the cache"
    again = tokenized_file(True)
    assert again[0] == first[0] and again[1] != first[1], "--overwrite_cache writes it again"


def test_only_non_empty_strings_of_the_image_column_are_resolved_as_paths(tmp_path):
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.jpg").write_bytes(b"jpeg")
    resolve = data._ResolveRelativePaths("image", str(tmp_path / "pictures"), str(tmp_path / "elsewhere"))
    embedded = {"bytes": b"jpeg", "path": None}
    batch = {"image": ["a.jpg", "", None, embedded], "caption": ["a.jpg", "b", "c", "d"]}
    assert resolve(batch) == {"image": [str(tmp_path / "pictures" / "a.jpg"), "", None, embedded]}


def test_an_image_feature_is_read_undecoded_a_path_column_is_left_as_it_is_and_any_other_is_refused():
    rgb = Image.new("RGB", (4, 3), (10, 20, 30))
    images = datasets.Dataset.from_dict({"image": [rgb], "caption": ["x"]}).cast_column("image", datasets.Image())
    prepared = data.prepare_image_column(images, "image", "train")
    assert prepared.features["image"] == datasets.Image(decode=False)
    assert set(prepared[0]["image"]) == {"bytes", "path"} and prepared[0]["image"]["bytes"]
    paths = datasets.Dataset.from_dict({"image": ["a.jpg"], "caption": ["x"]})
    assert data.prepare_image_column(paths, "image", "train") is paths
    numbers = datasets.Dataset.from_dict({"image": [1, 2], "caption": ["a", "b"]})
    with pytest.raises(
        ValueError, match="--image_column=image in split 'train' holds .* neither an image nor an image path"
    ):
        data.prepare_image_column(numbers, "image", "train")

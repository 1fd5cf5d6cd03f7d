"""Bad input ends in one line naming the flag, file, row or column, exit status 2 and no traceback;
nothing is written by a refused run; the input the user gave is read as given (image paths resolved in
the image column only, one empty cell costs one row); no image's size decides the run's memory; caches
that cannot be written are skipped."""

import gc
import json
import logging
import re
import runpy
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import transformers
from PIL import Image

from bridgetower_bench import data, preflight, published, user_errors
from bridgetower_bench.guards import flag_guard
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.fixtures import script_flags
from bridgetower_bench.user_errors import UserInputError, exit_on_user_error
from helpers import (
    BOTH_ROUTES,
    CPU_FLAGS,
    REPO,
    SCRIPTS,
    embedded,
    last_line,
    load_raw,
    noise_jpeg,
    run_cuda_script,
    run_forked,
    run_script,
    run_tool,
    write_csv,
)


SCRIPT = "run_bridgetower_cuda.py: error: "


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height and whose pixel data is empty: enough to read its size."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def cuda_args(model, *flags, **values):
    """A CPU training run of the CUDA script on `model` that reports nowhere: then `flags`, then --name value
    for each of `values`."""
    args = ["--model_name_or_path", model, "--do_train", "--report_to", "none", *CPU_FLAGS["cuda"], *flags]
    return args + [word for name, value in values.items() for word in (f"--{name}", value)]


# ---------------------------------------------------------------------------------------------
# One line, exit status 2, nothing written: the refusals that come before anything is loaded
# ---------------------------------------------------------------------------------------------

# (flag, value, what the line says after "--flag=value: "): numbers no run can use, refused at step 1 whatever the
# flag (torch or numpy once ended them in a traceback after the model loaded), and counts below their minimum
BAD_NUMBERS = [
    ("learning_rate", "nan", "must be a finite number"),
    ("max_grad_norm", "inf", "must be a finite number"),
    ("seed", -1, "a seed must be between 0 and 4294967295"),
    ("seed", 2**32, "a seed must be between 0 and 4294967295"),
    ("max_train_samples", 10**30, "beyond the 64-bit integers a run can use"),
    ("max_train_samples", 0, "must be positive"),
    ("per_device_train_batch_size", 0, "must be positive"),
    ("per_device_eval_batch_size", -1, "must be positive"),
    ("dataloader_num_workers", -1, "must be at least 0"),
    ("max_seq_length", 0, "must be positive"),
    ("max_seq_length", -5, "must be positive"),
    ("max_image_pixels", 0, "must be positive"),
]

ONE_OBJECT = "a configuration file holds one JSON object mapping argument names to values"
# name -> (the file's text, the line after "error: "); a text beginning with "," follows the members of a valid
# configuration of the same run (one value changed); {config} is the file's path
CONFIGURATIONS = {
    "json learning_rate NaN": (', "learning_rate": NaN}', "--learning_rate=nan: must be a finite number"),
    "json seed 10**30": (f', "seed": {10**30}}}', f"--seed={10**30}: a seed must be between 0 and 4294967295"),
    "json seed 1e30": (', "seed": 1e30}', '{config}: "seed" is 1e+30 (a number), expected an integer'),
    "json overwrite_output_dir string": (  # "false" was once taken as true
        ', "overwrite_output_dir": "false"}',
        '{config}: "overwrite_output_dir" is "false" (a string), expected a boolean (true or false)',
    ),
    "json output_dir empty": (
        ', "output_dir": ""}',
        "--output_dir='' is empty: give the directory the run writes into",
    ),
    "malformed json configuration": (
        '{"model_name_or_path": ',
        "{config}: not valid JSON (Expecting value: line 1 column 24 (char 23))",
    ),
    "json configuration holding a list": ('["use_habana", "output_dir"]', f"{{config}}: {ONE_OBJECT}"),
    "json configuration holding a number": ("5", f"{{config}}: {ONE_OBJECT}"),
}


# Data files `datasets` cannot read: name -> (file name, content, the line naming the file)
BAD_FILES = {
    "invalid UTF-8 csv": (
        "train.csv",
        b"image_path,caption\na.jpg,caf\xff\xfe\n",
        "--train_file={}: cannot be read as csv: 'utf-8' codec can't decode byte 0xff in position 3: invalid start byte",
    ),
    "unterminated quote in a csv": (
        "train.csv",
        b'image_path,caption\na.jpg,"no end\nb.jpg,ok\n',
        "--train_file={}: cannot be read as csv: Error tokenizing data. C error: EOF inside string starting at row 1",
    ),
    "malformed jsonl": (
        "train.jsonl",
        b'{"image_path": "a.jpg", "caption": "x"}\n{"image_path": "b.jpg", caption: }\n',
        "--train_file={}: cannot be read as json: JSON parse error: Missing a name for object member. in row 1",
    ),
    "header-only csv": ("train.csv", b"image_path,caption\n", "--train_file={}: the file holds no rows"),
}


def early_refusals(fixtures, tmp_path, write=True):
    """name -> (args, the line after "error: "), for inputs refused before training (most of them before the data
    or the model is loaded); with `write`, the files they read are written under tmp_path."""
    model, good, unreadable = fixtures["model"], tmp_path / "good.csv", tmp_path / "unreadable.csv"
    out, a_file = tmp_path / "out", tmp_path / "results.txt"
    if write:
        unreadable.write_bytes(BAD_FILES["invalid UTF-8 csv"][1])
        (tmp_path / "a.jpg").write_bytes(noise_jpeg(0))
        good.write_text("image_path,caption\n" + "".join(f"a.jpg,picture {i}\n" for i in range(10)))
        a_file.write_text("the user's own file")
    common = cuda_args(model, train_file=good)
    run = [*common, "--output_dir", out]
    valid = {"model_name_or_path": str(model), "train_file": str(good), "do_train": True, "report_to": "none"}
    valid.update(use_cpu=True, output_dir=str(out))
    cases = {
        f"{flag} {value}": ([*run, f"--{flag}", value], f"--{flag}={value}: {message}")
        for flag, value, message in BAD_NUMBERS
    }
    for number, (name, (text, line)) in enumerate(CONFIGURATIONS.items()):
        config = tmp_path / f"{number}.json"
        if write:
            config.write_text(json.dumps(valid)[:-1] + text if text.startswith(",") else text)
        cases[name] = ([config], line.replace("{config}", str(config)))
    return {
        **cases,
        "output_dir empty": (
            [*common, "--output_dir", ""],
            "--output_dir='' is empty: give the directory the run writes into",
        ),
        "output_dir that is a regular file": (
            [*common, "--output_dir", a_file],
            f"--output_dir={a_file} is a file, not a directory",
        ),
        "output_dir under a regular file": (
            [*common, "--output_dir", a_file / "run"],
            f"--output_dir={a_file / 'run'} cannot be created: {a_file} is a file",
        ),
        "no data flag": (
            cuda_args(model, output_dir=out),
            "Need either --dataset_name or --train_file / --validation_file.",
        ),
        "data file of an unknown format": (
            [*run, "--validation_file", tmp_path / "captions.txt"],
            f"--validation_file={tmp_path / 'captions.txt'}: unsupported file extension '.txt'; use one of "
            ".csv, .json, .jsonl",
        ),
        "persistent workers without workers": (
            [*run, "--dataloader_persistent_workers", "True", "--dataloader_num_workers", 0],
            "--dataloader_persistent_workers=True needs --dataloader_num_workers of 1 or more (with 0 the main "
            "process loads, and there are no workers to keep)",
        ),
        "gaudi-only flag": (
            [*run, "--use_habana"],
            "--use_habana is Gaudi-only (Habana HPU) and not supported by run_bridgetower_cuda.py; remove it, "
            "or run run_bridgetower.py on a Gaudi machine.",
        ),
        "a value TrainingArguments refuses": (
            [*run, "--load_best_model_at_end", "--eval_strategy", "steps", "--save_strategy", "epoch"],
            None,
        ),
        "max_seq_length without room for a caption": (
            cuda_args(model, *script_flags(fixtures, model_name_or_path=None), max_seq_length=2, output_dir=out),
            "--max_seq_length=2 leaves no room for a caption: the tokenizer adds 2 special tokens; use at least 3",
        ),
        # BridgeTower's tokenizer files (tokenizer.json and vocab.json, no merges.txt): transformers 4.x builds no slow
        # tokenizer from them (5.x does: then this case fails, and the refusal is no longer needed)
        "a slow tokenizer the model has no files for": (
            [*run, "--use_fast_tokenizer", "False"],
            f"--use_fast_tokenizer False: transformers {transformers.__version__} cannot build a slow tokenizer from "
            f"{model} (TypeError: expected str, bytes or os.PathLike object, not NoneType); leave the flag out to use "
            "its fast tokenizer",
        ),
        "data file that cannot be read": (
            cuda_args(model, train_file=unreadable, output_dir=out),
            BAD_FILES["invalid UTF-8 csv"][2].format(unreadable),
        ),
    }


EARLY = list(early_refusals({"model": "model", "dataset": "dataset"}, Path("tmp"), write=False))  # the names


@pytest.mark.parametrize("case", EARLY)
def test_bad_flags_and_configurations_end_in_one_line_with_status_2(case, fixtures, tmp_path):
    args, expected = early_refusals(fixtures, tmp_path)[case]
    status, stderr = run_cuda_script(args)
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    if expected is None:  # transformers' own message, passed on as one line
        assert last.startswith(SCRIPT) and "load_best_model_at_end" in last, last
    else:
        assert last == SCRIPT + expected
    # Nothing was written: no output directory, and the user's file is as it was.
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "results.txt").read_text() == "the user's own file"


def test_flag_guard_leaves_unreadable_configurations_to_the_parser(tmp_path):
    for name, text in (("bad.json", "{"), ("list.json", '["use_habana"]'), ("number.json", "5")):  # a list names none
        (tmp_path / name).write_text(text)
        assert flag_guard.hpu_only_flags_in(["x", str(tmp_path / name)]) == [], name


def test_internal_errors_keep_their_traceback_and_user_errors_end_with_status_2(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["run_bridgetower.py"])

    def bug():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        exit_on_user_error(bug)
    with pytest.raises(ValueError, match="not ours"):  # a plain ValueError (e.g. from a library) is not a user error
        exit_on_user_error(lambda: int("not ours"))

    def refuse():
        raise UserInputError("--flag=1: must be 2")

    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(refuse)
    assert stop.value.code == 2
    assert capsys.readouterr().err == "run_bridgetower.py: error: --flag=1: must be 2\n"


def script_collection_states() -> list:
    """In a fork with nothing frozen and collection on, the CUDA script run as a program (its --help): whether
    collection is on when freeze_imports is reached, and when main() is, with the freeze count then."""
    gc.unfreeze()
    gc.enable()
    seen: list = []
    freeze, run = user_errors.freeze_imports, user_errors.exit_on_user_error

    def freeze_seen():
        seen.append(gc.isenabled())
        freeze()

    def run_seen(main):
        seen.extend([gc.isenabled(), gc.get_freeze_count()])
        run(main)

    user_errors.freeze_imports, user_errors.exit_on_user_error = freeze_seen, run_seen
    sys.argv = [str(REPO / SCRIPTS["cuda"]), "--help"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit:  # (--help)
        pass
    return seen


def tool_freeze_counts(entry: str) -> list:
    """In a fork with nothing frozen: the freeze count after the launcher's --help, or as each of two main()s that
    tool_paths.run runs sees it (a cycle left unreachable between them)."""
    gc.unfreeze()
    if entry == "launch_cuda":
        run_tool("launch_cuda", ["--help"])
        return [gc.get_freeze_count()]
    counts: list = []
    for _ in range(2):
        try:
            tool_paths.run(lambda: counts.append(gc.get_freeze_count()))
        except SystemExit:  # (tool_paths.run's status)
            pass
        cycle: list = []
        cycle.append(cycle)
        del cycle
    return counts


def test_a_script_collects_no_garbage_while_it_imports_and_leaves_what_they_made_out_of_collection():
    # what the imports made is never garbage: no collection walks it, then or later; main() runs with collection on
    result = run_forked(script_collection_states)
    assert result.returncode == 0, result.stderr
    off_while_importing, on_at_main, frozen = json.loads(result.stdout)
    assert (off_while_importing, on_at_main) == (False, True) and frozen > 100_000


@pytest.mark.parametrize("entry", ["tools", "launch_cuda"])
def test_the_tools_leave_what_is_alive_before_main_out_of_garbage_collection_once(entry):
    # an earlier main()'s cycles are not kept
    result = run_forked(tool_freeze_counts, entry)
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout)
    assert counts[0] > 10_000 and counts[-1] <= counts[0], counts  # (the first main()'s own objects may be freed)


# ---------------------------------------------------------------------------------------------
# Data files `datasets` cannot read: one line naming the file
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_unreadable_data_files_are_named_in_one_line(case, tmp_path):
    name, content, expected = BAD_FILES[case]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserInputError) as refused:
        load_raw(cache_dir=str(tmp_path / "hf"), train_file=str(path))
    assert str(refused.value) == expected.format(path)


def test_a_data_set_directory_with_an_unreadable_file_and_too_few_rows_to_split_are_named(tmp_path):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "train.csv").write_bytes(BAD_FILES["invalid UTF-8 csv"][1])
    with pytest.raises(
        UserInputError, match=r"^--dataset_name=.*set: cannot be read: 'utf-8' codec can't decode byte 0xff"
    ):
        load_raw(cache_dir=str(tmp_path / "hf"), dataset_name=str(tmp_path / "set"))
    two_rows = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"image": ["a", "b"], "caption": ["x", "y"]})}
    )
    with pytest.raises(UserInputError, match="^the train split has 2 rows: too few to split off validation and test"):
        data.make_splits(two_rows, seed=0)


# ---------------------------------------------------------------------------------------------
# A data set given as a loading script: `datasets` 4 and later run none; one line and the fix
# ---------------------------------------------------------------------------------------------

LOADING_SCRIPT = "import datasets\n\n\nclass CaptionContest(datasets.GeneratorBasedBuilder):\n    pass\n"


def script_refusal(name: str, script: str, fix: str, revision: str = "") -> str:
    return (
        f"--dataset_name={name}{revision}: a loading script ({script}), not data files; datasets "
        f"{datasets.__version__} runs no loading scripts (none does since 4.0); {fix}"
    )


@pytest.mark.parametrize("kind", [pytest.param("cuda", marks=BOTH_ROUTES), "gaudi"])
def test_a_local_copy_of_the_script_revision_is_refused_in_one_line_before_the_model_loads(kind, tmp_path):
    """A folder holding `<folder>.py`, as a clone of the Hub's script revision does: `datasets` raises, the run ends in
    one line naming the flag, the reason and the parquet revision, before it looks at the model (there is none)."""
    folder = tmp_path / "newyorker_caption_contest"
    folder.mkdir()
    (folder / "newyorker_caption_contest.py").write_text(LOADING_SCRIPT)
    (tmp_path / "no-model").mkdir()
    args = ["--model_name_or_path", tmp_path / "no-model", "--dataset_name", folder, "--dataset_config_name"]
    args += ["matching", "--output_dir", tmp_path / "out", "--do_train", *CPU_FLAGS[kind]]
    result = run_script(kind, args, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    fix = f"the parquet files: --dataset_name {published.DATASET} --dataset_revision {published.DATASET_REVISION}"
    assert last_line(result) == f"{SCRIPTS[kind]}: error: " + script_refusal(
        str(folder), "newyorker_caption_contest.py", fix
    )


def test_a_loading_script_under_another_name_is_refused_and_a_helper_script_beside_data_files_is_not(tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "make_captions.py").write_text("print('no builder here')\n")
    (folder / "train.csv").write_text("image,caption\na.jpg,x\n")
    assert load_raw(cache_dir=str(tmp_path / "hf"), dataset_name=str(folder))["train"]["caption"] == ["x"]
    (folder / "loader.py").write_text(LOADING_SCRIPT.replace("datasets.", "datasets.builder."))
    with pytest.raises(UserInputError) as refused:
        load_raw(cache_dir=str(tmp_path / "hf"), dataset_name=str(folder))
    fix = "load its data files instead (parquet, csv, json: a Hub revision or a folder that holds them)"
    assert str(refused.value) == script_refusal(str(folder), "loader.py", fix)


def test_the_hubs_script_revision_is_refused_naming_both_flags_and_the_parquet_revision(monkeypatch):
    """`load_dataset` raises for a Hub revision that holds `<name>.py` as for a local folder (datasets/load.py; the Hub
    stands in here): the line names the name and the revision, and the fix for the published data set."""

    def hub_with_a_script(path, *args, **kwargs):
        raise RuntimeError(f"{data.SCRIPTS_REFUSED}{path.rsplit('/', 1)[-1]}.py")

    monkeypatch.setattr(data, "load_dataset", hub_with_a_script)
    revision = published.UPSTREAM_CI_DATASET_REVISION
    with pytest.raises(UserInputError) as refused:
        load_raw(dataset_name=published.DATASET, dataset_config_name="matching", dataset_revision=revision)
    fix = f"the parquet files: --dataset_name {published.DATASET} --dataset_revision {published.DATASET_REVISION}"
    assert str(refused.value) == script_refusal(
        published.DATASET, "newyorker_caption_contest.py", fix, f" --dataset_revision={revision}"
    )
    with pytest.raises(UserInputError, match=r"^--dataset_name=someone/else --dataset_revision=v1: .*a folder that"):
        load_raw(dataset_name="someone/else", dataset_revision="v1")


# ---------------------------------------------------------------------------------------------
# What a cell holds is what the run sees and says
# ---------------------------------------------------------------------------------------------


def load_csv(path, tmp_path, image_column="image_path"):
    return load_raw(cache_dir=str(tmp_path / "hf"), train_file=str(path), image_column=image_column)["train"]


def test_one_empty_image_cell_costs_one_row_among_relative_paths(tmp_path, monkeypatch, caplog):
    (tmp_path / "data" / "images").mkdir(parents=True)
    (tmp_path / "data" / "images" / "0.jpg").write_bytes(noise_jpeg(0))
    (tmp_path / "data" / "images" / "1.jpg").write_bytes(noise_jpeg(1))
    rows = [f"{'' if row == 7 else f'images/{row % 2}.jpg'},picture {row}\n" for row in range(1200)]
    path = tmp_path / "data" / "train.csv"
    path.write_text("image_path,caption\n" + "".join(rows))
    monkeypatch.chdir(tmp_path)  # the paths exist relative to the csv, not to the working directory
    train = load_csv(path, tmp_path)
    values = train["image_path"]
    assert values[7] is None
    assert all(v == str(tmp_path / "data" / f"images/{row % 2}.jpg") for row, v in enumerate(values) if row != 7)
    problems, _ = preflight.find_problems({"train": train}, "image_path", "caption", cache_dir=tmp_path / "cache")
    assert [(p.row, p.column, p.reason) for p in problems] == [
        (7, "image_path", "no image (empty cell: neither embedded bytes nor a path)")
    ]
    with caplog.at_level(logging.WARNING):
        kept = preflight.check_splits(
            {"train": train}, "image_path", "caption", drop_bad_rows=True, cache_dir=tmp_path / "cache"
        )
    assert len(kept["train"]) == 1199
    assert "1 bad row dropped" in caplog.text


def test_path_resolution_touches_the_image_column_only(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cat.jpg").write_bytes(noise_jpeg(0))
    path = tmp_path / "data" / "train.csv"
    path.write_text("image_path,caption,note\ncat.jpg,cat.jpg,cat.jpg\n")
    monkeypatch.chdir(tmp_path)
    row = load_csv(path, tmp_path)[0]
    assert row == {"image_path": str(tmp_path / "data" / "cat.jpg"), "caption": "cat.jpg", "note": "cat.jpg"}
    # The image column is the one the flag names; here the second.
    row = load_csv(path, tmp_path, image_column="caption")[0]
    assert row == {"image_path": "cat.jpg", "caption": str(tmp_path / "data" / "cat.jpg"), "note": "cat.jpg"}


def test_a_caption_holding_nan_is_named_by_what_it_holds(tmp_path):
    path = write_csv(
        tmp_path / "train.csv", [("a.jpg", noise_jpeg(0), caption) for caption in ("NaN", "", "a real caption")]
    )
    train = load_csv(path, tmp_path)
    assert train["caption"] == ["NaN", None, "a real caption"]
    problems, _ = preflight.find_problems({"train": train}, "image_path", "caption", cache_dir=tmp_path / "cache")
    assert [(p.row, p.reason) for p in problems] == [
        (0, "caption 'NaN' is a missing-value marker, not a caption"),
        (1, "no caption (empty cell or missing value)"),
    ]


# ---------------------------------------------------------------------------------------------
# The pixel budget: no image's size or aspect ratio decides the run's memory
# ---------------------------------------------------------------------------------------------


def test_pixel_budget_refuses_huge_and_extreme_aspect_images_without_decoding_them(tmp_path):
    huge, strip, normal = tmp_path / "huge.png", tmp_path / "strip.png", tmp_path / "normal.jpg"
    huge.write_bytes(png_header(12000, 12000))  # 144 MP: below Pillow's own hard limit (179 MP)
    Image.new("RGB", (100000, 10)).save(strip)  # 1 MP, but resized to 2940000x294 before the crop
    normal.write_bytes(noise_jpeg(0, size=(4000, 3000)))
    assert preflight.image_problem(str(huge), image_size=294) == (
        f"image file {str(huge)!r}: 12000x12000 is 144,000,000 pixels, over the budget of 50,000,000 (--max_image_pixels)"
    )
    assert preflight.image_problem(str(strip), image_size=294) == (
        f"image file {str(strip)!r}: 100000x10 is resized to 2940000x294 before the centre crop, 864,360,000 pixels, "
        "over the budget of 50,000,000 (--max_image_pixels; the aspect ratio is too extreme)"
    )
    assert preflight.image_problem(str(normal), image_size=294) is None
    assert preflight.image_problem(str(normal), max_pixels=11_999_999, image_size=294).endswith(
        "4000x3000 is 12,000,000 pixels, over the budget of 11,999,999 (--max_image_pixels)"
    )


def test_oversized_image_is_a_bad_row_the_script_names_or_drops(fixtures, tmp_path):
    # every other image is over the budget (the run's train split is 6 of these rows)
    images = [noise_jpeg(i, size=(120, 90) if i % 2 else (600, 450)) for i in range(10)]
    write_csv(tmp_path / "train.csv", [(f"{i}.jpg", image, f"picture {i}") for i, image in enumerate(images)])
    args = cuda_args(fixtures["model"], train_file=tmp_path / "train.csv", per_device_train_batch_size=2, max_steps=1)
    args += ["--save_strategy", "no", "--max_image_pixels", 150_000, "--preflight_cache_dir", tmp_path / "preflight"]
    status, stderr = run_cuda_script([*args, "--output_dir", tmp_path / "refused"])
    assert status == 2
    assert "Traceback" not in stderr
    error = stderr[stderr.index(SCRIPT) :].strip().splitlines()
    assert re.fullmatch(r"run_bridgetower_cuda.py: error: \d+ bad rows? found before training .*", error[0])
    assert all(
        line.startswith("  split 'train' row ")
        and line.endswith(".jpg': 600x450 is 270,000 pixels, over the budget of 150,000 (--max_image_pixels)")
        for line in error[1:]
    ), error
    assert not (tmp_path / "refused").exists()
    status, stderr = run_cuda_script([*args, "--output_dir", tmp_path / "dropped", "--drop_bad_rows"])
    assert status == 0, stderr[-3000:]
    assert (tmp_path / "dropped" / "train_results.json").exists()


# ---------------------------------------------------------------------------------------------
# Caches: where they live, and never fatal
# ---------------------------------------------------------------------------------------------


def test_cache_location_follows_the_flag_then_hf_home_then_xdg_cache_home_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert data.cache_dir("preflight") == str(tmp_path / "home" / ".cache" / "bridgetower_bench" / "preflight")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_dir("preflight") == str(tmp_path / "xdg" / "bridgetower_bench" / "preflight")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert data.cache_dir("decoded_images") == str(tmp_path / "hf" / "bridgetower_bench" / "decoded_images")
    assert data.cache_dir("preflight", "~/mine") == str(tmp_path / "home" / "mine")


def unwritable_home(tmp_path, monkeypatch):
    """HOME below a regular file: nothing can be created in it (even by root), and no variable points elsewhere."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)


def test_caches_that_cannot_be_written_are_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    """The check still finds the bad row without its cache; images are decoded every step without theirs."""
    unwritable_home(tmp_path, monkeypatch)
    (tmp_path / "a.jpg").write_bytes(noise_jpeg(0))
    paths = [str(tmp_path / "a.jpg"), str(tmp_path / "gone.jpg")]
    splits = {"train": datasets.Dataset.from_dict({"image": paths, "caption": ["x", "y"]})}
    args = SimpleNamespace(image_pipeline="fast", decoded_image_cache_dir=None, preprocessing_num_workers=None)

    def plain(value):
        return "decoded every step"

    with caplog.at_level(logging.WARNING):
        problems, cache_file = preflight.find_problems(splits, "image", "caption")
        transform = data.decoded_image_cache({"train": embedded([noise_jpeg(0)], ["x"])}, "image", args, 32, plain)
    assert [p.row for p in problems] == [1]
    assert str(cache_file).startswith(str(tmp_path / "file" / "home" / ".cache" / "bridgetower_bench" / "preflight"))
    assert "Preflight: cannot write its cache" in caplog.text
    assert transform is plain
    assert "--cache_decoded_images: cannot write the decoded image cache" in caplog.text


def test_unwritable_home_does_not_end_a_run(fixtures, tmp_path, monkeypatch):
    write_csv(tmp_path / "train.csv", [("a.jpg", noise_jpeg(0), f"picture {i}") for i in range(4)])
    unwritable_home(tmp_path, monkeypatch)
    args = cuda_args(fixtures["model"], "--cache_decoded_images", train_file=tmp_path / "train.csv", max_steps=1)
    args += ["--per_device_train_batch_size", 2, "--save_strategy", "no", "--image_pipeline", "fast"]
    status, stderr = run_cuda_script([*args, "--cache_dir", tmp_path / "hf", "--output_dir", tmp_path / "out"])
    assert status == 0, stderr[-3000:]
    assert (tmp_path / "out" / "train_results.json").exists()

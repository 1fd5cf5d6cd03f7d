"""Upstream's steps 4, 6 and 7: load the data set, split, check columns, tokenize, transform, collate. Bad input
raises a UserInputError naming the flag, file, column or row."""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Callable, Sequence
from typing import Optional

import datasets
import torch
from datasets import DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError

from bridgetower_bench import published
from bridgetower_bench.guards.resilience import ImageLoadError, image_label, leave_sigterm_to_the_main_process
from bridgetower_bench.regular_files import not_regular_reason, read_regular_file
from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

# Data files the scripts accept, and the `datasets` builder that reads each.
DATA_FILE_BUILDERS = {"csv": "csv", "json": "json", "jsonl": "json"}
# csv cells are read as written: only an empty cell is a missing value (pandas would also turn NaN, NA,
# null, None, ... into one, and a message could then not say what the cell holds).
CSV_OPTIONS = {"keep_default_na": False, "na_values": [""]}


# `load_dataset` of `datasets` 4 and later raises a RuntimeError starting so for a Hub revision or a local folder that
# holds `<name>.py` (datasets/load.py, dataset_module_factory): loading scripts are no longer run.
SCRIPTS_REFUSED = "Dataset scripts are no longer supported, but found "


BUILDER_CLASSES = {"DatasetBuilder", "GeneratorBasedBuilder", "ArrowBasedBuilder", "BeamBasedBuilder"}


def loading_script_in(folder: str) -> Optional[str]:
    """A `datasets` loading script at the top of a local data set folder that `load_dataset` would not see, else None:
    a .py file whose class derives from a builder class. (It looks for `<folder>.py` only, raising SCRIPTS_REFUSED, and
    would read the folder's data files past any other script.)"""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.name.endswith(".py") or entry.name == f"{os.path.basename(os.path.abspath(folder))}.py":
            continue
        try:
            tree = ast.parse(read_regular_file(entry.path))
        except (OSError, SyntaxError, ValueError):
            continue
        bases = [base for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for base in node.bases]
        if any(ast.unparse(base).rsplit(".", 1)[-1] in BUILDER_CLASSES for base in bases):
            return entry.name
    return None


def loading_script_refused(dataset_name: str, revision: Optional[str], script: str) -> UserInputError:
    """The one line that refuses a data set given as a loading script: which, why and the fix."""
    where = f"--dataset_name={dataset_name}" + (f" --dataset_revision={revision}" if revision else "")
    fix = "load its data files instead (parquet, csv, json: a Hub revision or a folder that holds them)"
    if published.DATASET.endswith(f"/{script.removesuffix('.py')}"):  # the published data set, or a copy of it
        fix = f"the parquet files: --dataset_name {published.DATASET} --dataset_revision {published.DATASET_REVISION}"
    return UserInputError(
        f"{where}: a loading script ({script}), not data files; datasets {datasets.__version__} runs no loading "
        f"scripts (none does since 4.0); {fix}"
    )


def data_file_builder(path: str, flag: str) -> str:
    """The `datasets` builder for a --train_file / --validation_file, or a ValueError naming the flag."""
    extension = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if extension not in DATA_FILE_BUILDERS:
        raise UserInputError(
            f"{flag}={path}: unsupported file extension '.{extension}'; use one of "
            + ", ".join("." + e for e in DATA_FILE_BUILDERS)
        )
    return DATA_FILE_BUILDERS[extension]


def load_raw_datasets(
    *,
    dataset_name: Optional[str],
    dataset_config_name: Optional[str],
    dataset_revision: str,
    data_dir: Optional[str],
    train_file: Optional[str],
    validation_file: Optional[str],
    cache_dir: Optional[str],
    token: Optional[str],
    image_column: Optional[str] = None,
) -> DatasetDict:
    """Step 4: a hub data set, a local data set directory, or csv / json / jsonl files, where a relative path in
    `image_column` (None: the first) not found from the working directory is read relative to the file."""
    if dataset_name is not None:
        # A name that is clearly a path (./x, /x, ~/x) must exist: otherwise `datasets` would try the hub.
        expanded = os.path.expanduser(dataset_name)
        if dataset_name.startswith((".", "/", "~")) and not os.path.isdir(expanded):
            raise UserInputError(f"--dataset_name={dataset_name}: no such directory")
        script = loading_script_in(expanded) if os.path.isdir(expanded) else None
        if script is not None:
            raise loading_script_refused(dataset_name, None, script)
        try:
            return load_dataset(
                expanded,
                dataset_config_name,
                cache_dir=cache_dir,
                keep_in_memory=False,
                data_dir=data_dir,
                token=token,
                revision=dataset_revision,
            )
        except DatasetGenerationError as error:  # a file of the data set cannot be read
            raise UserInputError(
                f"--dataset_name={dataset_name}: cannot be read: {_first_line(error.__cause__ or error)}"
            ) from None
        except RuntimeError as error:
            if not str(error).startswith(SCRIPTS_REFUSED):
                raise
            local = os.path.isdir(expanded)
            script = str(error)[len(SCRIPTS_REFUSED) :]
            raise loading_script_refused(dataset_name, None if local else dataset_revision, script) from None
    raw = DatasetDict()
    for split, path in (("train", train_file), ("validation", validation_file)):
        if path is None:
            continue
        flag = f"--{split}_file"
        if not os.path.isfile(path):
            reason = not_regular_reason(os.stat(path).st_mode) if os.path.exists(path) else "no such file"
            raise UserInputError(f"{flag}={path}: {reason}")
        raw[split] = load_data_file(path, flag, split, cache_dir=cache_dir, token=token)
        column = image_column if image_column is not None else raw[split].column_names[0]
        if column in raw[split].column_names:
            raw[split] = raw[split].map(
                _ResolveRelativePaths(column, os.path.dirname(os.path.abspath(path)), os.getcwd()),
                batched=True,
                desc=f"Resolving image paths in {path}",
            )
    return raw


def load_data_file(path: str, flag: str, split: str, *, cache_dir: Optional[str] = None, token: Optional[str] = None):
    """One csv / json / jsonl file as a Dataset; a file `datasets` cannot read is refused naming it."""
    builder = data_file_builder(path, flag)
    options = CSV_OPTIONS if builder == "csv" else {}
    try:
        return load_dataset(
            builder, data_files={split: path}, split=split, cache_dir=cache_dir, token=token, **options
        )
    except (DatasetGenerationError, ValueError) as error:  # ValueError: a file with no rows
        cause = error.__cause__ if isinstance(error, DatasetGenerationError) and error.__cause__ else error
        if "corresponds to no data" in str(cause):
            raise UserInputError(f"{flag}={path}: the file holds no rows") from None
        raise UserInputError(f"{flag}={path}: cannot be read as {builder}: {_first_line(cause)}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class _ResolveRelativePaths:
    """In the image column only (a caption may look like a file name), the data file's directory prefixed to a
    relative path where that finds the file. The working directory is state: `datasets` caches per directory."""

    def __init__(self, column: str, base_dir: str, working_dir: str):
        self.column = column
        self.base_dir = base_dir
        self.working_dir = working_dir

    def __call__(self, batch: dict) -> dict:
        return {self.column: [self._resolve(v) if isinstance(v, str) and v else v for v in batch[self.column]]}

    def _resolve(self, path: str) -> str:
        if os.path.isabs(path) or os.path.exists(path):
            return path
        candidate = os.path.join(self.base_dir, path)
        return candidate if os.path.exists(candidate) else path


def make_splits(dataset: DatasetDict, seed: int, *, need_test: bool = True) -> DatasetDict:
    """Train / validation / test: what exists is kept, what is missing split off train with the seed (train
    alone: 60/20/20, upstream's rows; else 20 %; no test split unless ``need_test``; docs/UPSTREAM.md)."""
    if "train" not in dataset and ("validation" not in dataset or "test" not in dataset):
        return dataset
    dataset = DatasetDict(dict(dataset))
    missing = [s for s in ("validation", "test") if s not in dataset]
    try:
        if missing == ["validation", "test"]:
            first = dataset["train"].train_test_split(test_size=0.4, shuffle=True, seed=seed)
            second = first["test"].train_test_split(test_size=0.5, shuffle=False)
            dataset["train"], dataset["validation"], dataset["test"] = first["train"], second["train"], second["test"]
        elif missing and (need_test or missing != ["test"]):
            split = dataset["train"].train_test_split(test_size=0.2, shuffle=True, seed=seed)
            dataset["train"], dataset[missing[0]] = split["train"], split["test"]
    except ValueError:  # a split would be empty
        raise UserInputError(
            f"the train split has {len(dataset['train'])} rows: too few to split off {' and '.join(missing)} "
            "(give more rows, or the missing splits)"
        ) from None
    return dataset


def resolve_column(column_names: Sequence[str], requested: Optional[str], flag: str, fallback_index: int) -> str:
    """The column a flag names, or a ValueError listing the available columns."""
    if requested is None:
        return column_names[fallback_index]
    if requested not in column_names:
        raise UserInputError(
            f"{flag}={requested} is not a column of the data set; available columns: {', '.join(column_names)}"
        )
    return requested


def prepare_image_column(dataset: datasets.Dataset, image_column: str, split: str) -> datasets.Dataset:
    """Images undecoded: an Image feature becomes {bytes, path} dicts, strings stay paths, anything else refused."""
    feature = dataset.features[image_column]
    if isinstance(feature, datasets.Image):
        return dataset.cast_column(image_column, datasets.Image(decode=False)) if feature.decode else dataset
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return dataset
    raise UserInputError(
        f"--image_column={image_column} in split '{split}' holds {feature!r}, which is neither an image nor an image path"
    )


class TokenizeCaptions:
    """Tokenize a batch of captions to max_length with padding='max_length' (upstream's shape)."""

    def __init__(self, tokenizer, caption_column: str, max_seq_length: int):
        self.tokenizer = tokenizer
        self.caption_column = caption_column
        self.max_seq_length = max_seq_length

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        captions = batch[self.caption_column]
        for row, caption in zip(indices, captions):
            if not isinstance(caption, str) or not caption.strip():
                raise UserInputError(
                    f"--caption_column={self.caption_column}: row {row} holds {caption!r}, not a non-empty string"
                )
        tokens = self.tokenizer(list(captions), max_length=self.max_seq_length, padding="max_length", truncation=True)
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}


def tokenize_split(
    dataset, tokenizer, *, image_column, caption_column, max_seq_length, num_proc, overwrite_cache, split
):
    """Tokenize one split, keeping only the image column and the token columns."""
    tokenized = dataset.map(
        TokenizeCaptions(tokenizer, caption_column, max_seq_length),
        batched=True,
        with_indices=True,
        remove_columns=[c for c in dataset.column_names if c != image_column],
        num_proc=num_proc,
        load_from_cache_file=not overwrite_cache,
        desc=f"Running tokenizer on {split} dataset",
    )
    # Loader workers fork next: tokenizers would turn their threads off in each with a warning nobody can act on.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return tokenized


class BatchTransform:
    """The lazy per-batch transform to pixel_values; an unloadable image: ImageLoadError naming split and path."""

    def __init__(self, image_column: str, image_transform: Callable, split: Optional[str] = None):
        self.image_column = image_column
        self.image_transform = image_transform
        self.split = split

    def __call__(self, batch: dict) -> dict:
        leave_sigterm_to_the_main_process()  # in a loader worker
        return {
            "pixel_values": [self._load(value) for value in batch[self.image_column]],
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
        }

    def _load(self, value):
        try:
            return self.image_transform(value)
        except MemoryError:
            raise
        except Exception as error:
            label = image_label(value)
            what = str(error) if label.strip("'") in str(error) else f"image {label}: {error}"
            raise ImageLoadError(f"split '{self.split or '?'}': {what}") from error


def collate_fn(examples: list[dict]) -> dict:
    """Stack a batch. pixel_values stay uint8 for the fast pipelines (normalised later, on the device)."""
    return {
        "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
        "input_ids": torch.tensor([e["input_ids"] for e in examples], dtype=torch.long),
        "attention_mask": torch.tensor([e["attention_mask"] for e in examples], dtype=torch.long),
        "return_loss": True,
    }


def cache_dir(name: str, flag_value: Optional[str] = None) -> str:
    """Where one of our caches lives: the flag's directory, else `bridgetower_bench/<name>` under $HF_HOME, else
    $XDG_CACHE_HOME, else ~/.cache (unset or empty variables skipped)."""
    if flag_value:
        return os.path.expanduser(flag_value)
    root = os.environ.get("HF_HOME") or os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(os.path.expanduser(root), "bridgetower_bench", name)


def decoded_image_cache(splits: dict, image_column: str, data_args, image_size: int, image_transform: Callable):
    """--cache_decoded_images: one cache over every split's images, or `image_transform` if it cannot be written."""
    from bridgetower_bench.images.image_cache import open_decoded_image_cache

    directory = cache_dir("decoded_images", data_args.decoded_image_cache_dir)
    combined = datasets.concatenate_datasets([d.select_columns([image_column]) for d in splits.values()])
    try:
        return open_decoded_image_cache(
            combined[image_column],
            pipeline=data_args.image_pipeline,
            image_size=image_size,
            cache_dir=directory,
            fingerprint="-".join(d._fingerprint for d in splits.values()),
            num_proc=data_args.preprocessing_num_workers,
        )
    except OSError as error:
        logger.warning(
            f"--cache_decoded_images: cannot write the decoded image cache in {directory} ({error}); "
            "training without it (set --decoded_image_cache_dir to a writable directory to use it)"
        )
        return image_transform

"""Bad input stops a run before step 1, not hours into it: every caption and image of the splits a run uses,
checked once per data set (identical images decoded once, by --preprocessing_num_workers processes) and the
outcome cached; --drop_bad_rows trains without the bad rows (docs/RUNS.md, "Before step 1" and what follows)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import datasets
import PIL
from PIL import Image, UnidentifiedImageError

from bridgetower_bench.data import cache_dir as bench_cache_dir
from bridgetower_bench.images.images import resize_geometry, upright
from bridgetower_bench.output_dir.atomic_files import read_json, write_json_atomically
from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

PREFLIGHT_VERSION = 4  # part of the cache key: a new version checks every data set again
# A file modified this close to the check may change again within one tick of the clock, its times unchanged.
RACY_WINDOW_NS = 2_000_000_000
# 50 MP admits current cameras' photographs; Pillow's own limit (179 MP) admits 5.5 GB for one image at the
# `upstream` pipeline's 31 bytes a pixel, and does not see the aspect ratio (a 100000x10 strip is 2940000x294).
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
# What pandas' csv reader (and so upstream's data loading) takes for a missing value, "|"-separated.
MISSING_VALUE_MARKERS = frozenset(
    "#N/A|#N/A N/A|#NA|-1.#IND|-1.#QNAN|-NaN|-nan|1.#IND|1.#QNAN|<NA>|N/A|NA|NULL|NaN|None|n/a|nan|null".split("|")
)
MAX_LISTED = 20  # problems named in the error / log; the cache file holds them all
_DRAFT_SIZE = (64, 64)  # JPEGs decode at the smallest DCT scale still at least this big
_ROWS_PER_BATCH = 1024  # rows read from the data set at a time
_IMAGES_PER_ROUND = 256  # distinct images handed to the worker processes at a time


@dataclasses.dataclass(frozen=True)
class Problem:
    """One unusable row. `row` counts rows of the split the run uses; `source_row`, where that split was cut from
    a bigger one, is the row in the data as loaded, which a user can find in their file."""

    split: str
    row: int
    column: str
    reason: str
    source_row: Optional[int] = None

    def __str__(self) -> str:
        where = f"split '{self.split}' row {self.row}"
        if self.source_row is not None and self.source_row != self.row:
            where += f" (row {self.source_row} of the data as loaded, before splitting)"
        return f"{where}, column '{self.column}': {self.reason}"


def check_splits(splits: dict, image_column: str, caption_column: str, *, drop_bad_rows: bool = False, **options):
    """The splits checked (`options`: find_problems'): refused listing the bad rows, or those rows dropped."""
    for split, dataset in splits.items():
        if len(dataset) == 0:
            raise UserInputError(f"split '{split}' has no rows")
        check_caption_column(dataset, caption_column, split)
    problems, cache_file = find_problems(splits, image_column, caption_column, **options)
    if not problems:
        return splits
    if not drop_bad_rows:
        raise UserInputError(
            describe_problems(
                problems, "found before training (pass --drop_bad_rows to train without them)", cache_file
            )
        )
    logger.warning(describe_problems(problems, "dropped (--drop_bad_rows)", cache_file))
    kept = dict(splits)
    for split in dict.fromkeys(problem.split for problem in problems):
        bad = {problem.row for problem in problems if problem.split == split}
        rows = [row for row in range(len(splits[split])) if row not in bad]
        if not rows:
            raise UserInputError(f"--drop_bad_rows: every row of split '{split}' is bad; nothing is left to use")
        kept[split] = splits[split].select(rows)
    return kept


def check_caption_column(dataset, caption_column: str, split: str) -> None:
    """The caption column must hold text; a column of numbers, lists or images is refused as a whole."""
    feature = dataset.features[caption_column]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return
    held = f"{feature.dtype} values" if isinstance(feature, datasets.Value) else f"{type(feature).__name__} values"
    raise UserInputError(f"--caption_column={caption_column} in split '{split}' holds {held}, not text")


def describe_problems(problems: list[Problem], what: str, cache_file: Path) -> str:
    """'N bad rows <what>:' then up to MAX_LISTED of them, one per line."""
    lines = [f"{len(problems)} bad row{'s' if len(problems) != 1 else ''} {what}:"]
    lines += [f"  {problem}" for problem in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more (all listed in {cache_file})")
    return "\n".join(lines)


def find_problems(
    splits: dict,
    image_column: str,
    caption_column: str,
    *,
    num_proc: Optional[int] = None,
    overwrite_cache: bool = False,
    cache_dir: Optional[str] = None,
    image_size: Optional[int] = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> tuple[list[Problem], Path]:
    """Every bad row of `splits` (name -> Dataset), by split and row, and the cache file holding them. image_size:
    the model's input size, for the budget of the resized image (None: only the decoded size is budgeted)."""
    settings = {
        "version": PREFLIGHT_VERSION,
        "pillow": PIL.__version__,
        "image_column": image_column,
        "caption_column": caption_column,
        "image_size": image_size,
        "max_image_pixels": max_image_pixels,
        "fingerprints": {split: dataset._fingerprint for split, dataset in splits.items()},
    }
    key = hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=12).hexdigest()
    cache_file = Path(bench_cache_dir("preflight", cache_dir)) / f"{key}.json"
    names = ", ".join(splits)
    cached = {} if overwrite_cache else read_json(cache_file, {})
    if cached.get("settings") == settings:  # the outcome, unless an image file changed since
        checked_at_ns = cached.get("checked_at_ns", 0)
        if all(_file_identity(path, checked_at_ns) == identity for path, identity in cached.get("files", {}).items()):
            logger.info(f"Preflight: the {cached['rows_checked']} rows of {names} were checked before ({cache_file}).")
            return [Problem(**p) for p in cached["problems"]], cache_file
        logger.info("Preflight: image files changed since the last check; checking again.")

    start = time.perf_counter()
    check_image = functools.partial(image_problem, max_pixels=max_image_pixels, image_size=image_size)
    found = []  # (split, row, column, reason)
    num_proc = num_proc or 1
    checker = _ImageChecker(num_proc, check_image)
    # forkserver: the workers start from a clean process, not a fork of this one, whose threads (tokenizers,
    # loaders, torch) may hold locks that a forked child would wait on forever; that process imports this module
    # once, and each worker forks from it without importing torch again
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with context.Pool(num_proc) if num_proc > 1 else contextlib.nullcontext() as pool:
        checker.pool = pool
        for split, dataset in splits.items():
            columns = dataset.select_columns(list(dict.fromkeys([image_column, caption_column])))
            batches = columns.iter(batch_size=_ROWS_PER_BATCH)
            pairs = itertools.chain.from_iterable(zip(b[image_column], b[caption_column]) for b in batches)
            for row, (image, caption) in enumerate(pairs):
                reason = caption_problem(caption)
                if reason:
                    found.append((split, row, caption_column, reason))
                checker.add(image, (split, row))
        found += [(split, row, image_column, reason) for (split, row), reason in checker.finish()]
    # A split cut from the data as loaded (select, train_test_split) maps its rows back through `_indices`.
    indices = {split: dataset._indices for split, dataset in splits.items()}  # (looked up for bad rows only)
    problems = [
        Problem(split, row, column, reason, None if indices[split] is None else indices[split].column(0)[row].as_py())
        for split, row, column, reason in found
    ]
    order = {split: i for i, split in enumerate(splits)}
    problems.sort(key=lambda p: (order[p.split], p.row, p.column != image_column))
    rows = sum(len(dataset) for dataset in splits.values())
    logger.info(
        f"Preflight: checked {rows} rows of {names} ({len(checker.rows_of)} distinct images) in "
        f"{time.perf_counter() - start:.1f} s: {len(problems)} bad."
    )
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomically(
            str(cache_file),
            {
                "settings": settings,
                "rows_checked": rows,
                "distinct_images": len(checker.rows_of),
                "checked_at_ns": checker.started_ns,
                "files": checker.file_stats,
                "problems": [dataclasses.asdict(p) for p in problems],
            },
        )
    except OSError as error:
        logger.warning(
            f"Preflight: cannot write its cache {cache_file} ({error}); the next run checks again "
            "(--preflight_cache_dir sets a writable place)."
        )
    return problems, cache_file


def caption_problem(caption: Any) -> Optional[str]:
    """Why a caption cannot be used, or None."""
    if caption is None:
        return "no caption (empty cell or missing value)"
    if not isinstance(caption, str):
        return f"caption {caption!r} is not text"
    if not caption.strip():
        return f"empty caption {caption!r}"
    if caption.strip() in MISSING_VALUE_MARKERS:
        return f"caption {caption!r} is a missing-value marker, not a caption"
    return None


class _ImageChecker:
    """Decodes each distinct image (the same embedded bytes, or the same path) once."""

    def __init__(self, num_proc: int, check_image):
        self.num_proc = num_proc
        self.check_image = check_image
        self.rows_of: dict[tuple, list] = {}  # image key -> the (split, row) showing it
        self.file_stats: dict[str, Optional[list]] = {}  # path -> _file_identity (None: missing)
        self.started_ns = time.time_ns()
        self._pending: dict[tuple, Any] = {}  # key -> payload, not yet decoded
        self._failed: dict[tuple, str] = {}
        self.pool: Optional[multiprocessing.pool.Pool] = None  # the worker processes' (None: decode here)

    def add(self, value: Any, where: tuple) -> None:
        """Row `where` shows `value`: embedded bytes, or a file path (neither: no image at all)."""
        path = value.get("path") if isinstance(value, dict) else value
        if isinstance(value, dict) and value.get("bytes"):
            payload: Any = bytes(value["bytes"])
            key: tuple = ("bytes", hashlib.blake2b(payload, digest_size=16).digest())
        elif isinstance(path, (str, os.PathLike)) and os.fspath(path):
            payload = os.fspath(path)
            key = ("path", payload)
        else:
            key, payload = ("none",), None
        if key not in self.rows_of:
            if key[0] == "path":  # before its decode: the cache knows the file as the check read it
                self.file_stats[payload] = _file_identity(payload, self.started_ns)
            if payload is None:
                self._failed[key] = "no image (empty cell: neither embedded bytes nor a path)"
            else:
                self._pending[key] = payload
        self.rows_of.setdefault(key, []).append(where)
        if len(self._pending) >= _IMAGES_PER_ROUND:
            self._decode_pending()

    def finish(self) -> list[tuple[tuple, str]]:
        """((split, row), reason) for every row whose image failed."""
        self._decode_pending()
        return [(where, reason) for key, reason in self._failed.items() for where in self.rows_of[key]]

    def _decode_pending(self) -> None:
        payloads = list(self._pending.values())
        if self.pool is not None and payloads:
            chunksize = max(1, len(payloads) // (self.num_proc * 4))
            reasons: Iterable = self.pool.map(self.check_image, payloads, chunksize=chunksize)
        else:
            reasons = map(self.check_image, payloads)
        self._failed.update((key, reason) for key, reason in zip(self._pending, reasons) if reason)
        self._pending = {}


def _file_identity(path: str, checked_at_ns: int) -> Optional[list]:
    """What the cache knows a checked image file by (None: missing): [size, mtime_ns, ctime_ns, inode], and the
    digest of its content when modified within RACY_WINDOW_NS of the check's start (`checked_at_ns`)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    identity: list = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    if max(stat.st_mtime_ns, stat.st_ctime_ns) >= checked_at_ns - RACY_WINDOW_NS:
        try:
            identity.append(hashlib.blake2b(read_regular_file(path), digest_size=16).hexdigest())
        except OSError:
            pass  # not readable as a regular file: its check says why
    return identity


def image_problem(
    payload: bytes | str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, image_size: Optional[int] = None
) -> Optional[str]:
    """Why an image (encoded bytes, or a file path) cannot be used, or None when it decodes completely; one over
    the pixel budget (`pixel_budget_problem`, from the header) is refused without being decoded."""
    if isinstance(payload, str):
        label = f"image file {payload!r}"
        try:
            data = read_regular_file(payload)  # a directory, FIFO, device or socket is a bad row, never read
        except FileNotFoundError:
            return f"missing image file {payload!r}"
        except OSError as error:
            return f"cannot read {label}: {error.strerror or error}"
    else:
        data, label = payload, "embedded image"
    try:
        with Image.open(io.BytesIO(data)) as img:
            too_big = pixel_budget_problem(img.size, max_pixels, image_size)
            if too_big:
                return f"{label}: {too_big}"
            img.draft(None, _DRAFT_SIZE)  # JPEG: DCT-domain downscale (a truncated file still fails); others ignore it
            img.load()
            upright(img)  # reads the EXIF orientation, as every image pipeline does
    except UnidentifiedImageError:
        return f"cannot decode {label}: not in an image format Pillow reads"
    except Exception as error:  # PIL raises many types for bad data
        return f"cannot decode {label}: {error}"
    return None


def pixel_budget_problem(size: tuple[int, int], max_pixels: int, image_size: Optional[int] = None) -> Optional[str]:
    """Why an image of this (width, height) is over the budget, as decoded or resized before the crop, or None."""
    width, height = size
    if width * height > max_pixels:
        return f"{width}x{height} is {width * height:,} pixels, over the budget of {max_pixels:,} (--max_image_pixels)"
    if image_size and width > 0 and height > 0:
        new_w, new_h = resize_geometry(width, height, image_size)[:2]
        if new_w * new_h > max_pixels:
            return (
                f"{width}x{height} is resized to {new_w}x{new_h} before the centre crop, {new_w * new_h:,} pixels, "
                f"over the budget of {max_pixels:,} (--max_image_pixels; the aspect ratio is too extreme)"
            )
    return None

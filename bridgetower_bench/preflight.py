"""Bad input stops a run before step 1, not hours into it.

`check_splits` looks at every row of the splits a run uses (after --max_train_samples /
--max_eval_samples):

- the caption column must hold text, and every caption must be a non-empty string that is not a
  missing-value marker (NaN, NA, null, ...);
- every image must exist, fit the pixel budget (--max_image_pixels, both as decoded and as resized
  before the centre crop, so that no image's size or aspect ratio decides the run's memory) and decode
  completely (PIL `load()`: a truncated file fails).

Identical image bytes are decoded once (the New Yorker data shows each cartoon in many rows), and
JPEGs are decoded at reduced scale (PIL `draft`: the entropy decoder still reads every byte, so a
truncated file is still caught, but the inverse DCT does a fraction of the work). The distinct images
are checked in parallel by --preprocessing_num_workers processes.

The outcome is cached as a small json file in --preflight_cache_dir (default: see `data.cache_dir`),
keyed by the splits' fingerprints and the settings; it also records size, modification and change times and
inode of every image file the rows point to (and a digest of the content of files modified just before the
check), so a file that changed, was replaced or vanished since is checked again: the cache never vouches for
content it did not check. An unchanged data set is checked once. Only regular files are read: a directory,
FIFO, device or socket is a bad row (looked at before it is opened, so the check never blocks).
A cache that cannot be written is skipped with a warning.

Problems stop the run with one UserInputError listing them (split, row, column, reason);
--drop_bad_rows trains without those rows instead and logs which they were.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import multiprocessing
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import datasets
import PIL
from PIL import Image, UnidentifiedImageError

from bridgetower_bench.data import cache_dir as bench_cache_dir
from bridgetower_bench.images.images import resize_geometry, upright
from bridgetower_bench.output_dir.atomic_files import write_json_atomically
from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

PREFLIGHT_VERSION = 4  # 2: the pixel budget and missing-value markers; 3: the EXIF orientation is read too;
# 4: image files are known by size, mtime, ctime and inode (and content, when changed just before the check)
# A file modified less than this long before the check started may change again within the same tick of the
# filesystem's clock (coarse: milliseconds; seconds on some network filesystems) without its times changing:
# the cache then also records a digest of its content, compared whenever the cache is read.
RACY_WINDOW_NS = 2_000_000_000
# An image may hold at most this many pixels, decoded and resized before the centre crop. The `upstream`
# pipeline holds an image as float32 several times over while it resizes it: about 31 bytes a pixel
# (1.5 GB for a 48 MP photograph), in every loader worker at once. 50 MP admits the photographs of
# current cameras; Pillow's own limit (89 MP warns, 179 MP fails) would admit 5.5 GB for one image and
# does not see the aspect ratio (a 100000x10 strip is resized to 2940000x294 before the crop).
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
# What pandas' csv reader (and so upstream's data loading) takes for a missing value.
MISSING_VALUE_MARKERS = frozenset(
    {
        "#N/A",
        "#N/A N/A",
        "#NA",
        "-1.#IND",
        "-1.#QNAN",
        "-NaN",
        "-nan",
        "1.#IND",
        "1.#QNAN",
        "<NA>",
        "N/A",
        "NA",
        "NULL",
        "NaN",
        "None",
        "n/a",
        "nan",
        "null",
    }
)
MAX_LISTED = 20  # problems named in the error / log; the cache file holds them all
_DRAFT_SIZE = (64, 64)  # JPEGs decode at the smallest DCT scale still at least this big
_ROWS_PER_BATCH = 1024  # rows read from the data set at a time
_IMAGES_PER_ROUND = 256  # distinct images handed to the worker processes at a time
_TEXT_DTYPES = ("string", "large_string")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One unusable row: where it is and why.

    `row` counts rows of the split the run uses. When that split was cut from a bigger one (a data set
    with only a train split is split 60/20/20), `source_row` is the row in the data as loaded, which is
    what a user can find in their file.
    """

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


# ---------------------------------------------------------------------------------------------
# The check the scripts run
# ---------------------------------------------------------------------------------------------


def check_splits(
    splits: dict,
    image_column: str,
    caption_column: str,
    *,
    num_proc: Optional[int] = None,
    drop_bad_rows: bool = False,
    overwrite_cache: bool = False,
    cache_dir: Optional[str] = None,
    image_size: Optional[int] = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> dict:
    """The splits, checked: a UserInputError listing the bad rows, or (drop_bad_rows) the splits without them."""
    for split, dataset in splits.items():
        if len(dataset) == 0:
            raise UserInputError(f"split '{split}' has no rows")
        check_caption_column(dataset, caption_column, split)
    problems, cache_file = find_problems(
        splits,
        image_column,
        caption_column,
        num_proc=num_proc,
        overwrite_cache=overwrite_cache,
        cache_dir=cache_dir,
        image_size=image_size,
        max_image_pixels=max_image_pixels,
    )
    if not problems:
        return splits
    if not drop_bad_rows:
        raise UserInputError(
            describe_problems(
                problems, "found before training (pass --drop_bad_rows to train without them)", cache_file
            )
        )
    logger.warning(describe_problems(problems, "dropped (--drop_bad_rows)", cache_file))
    return drop_rows(splits, problems)


def check_caption_column(dataset, caption_column: str, split: str) -> None:
    """The caption column must hold text; a column of numbers, lists or images is refused as a whole."""
    feature = dataset.features[caption_column]
    if isinstance(feature, datasets.Value) and feature.dtype in _TEXT_DTYPES:
        return
    held = f"{feature.dtype} values" if isinstance(feature, datasets.Value) else f"{type(feature).__name__} values"
    raise UserInputError(f"--caption_column={caption_column} in split '{split}' holds {held}, not text")


def describe_problems(problems: list[Problem], what: str, cache_file: Optional[Path] = None) -> str:
    """'N bad rows <what>:' then up to MAX_LISTED of them, one per line."""
    lines = [f"{len(problems)} bad row{'s' if len(problems) != 1 else ''} {what}:"]
    lines += [f"  {problem}" for problem in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(
            f"  ... and {len(problems) - MAX_LISTED} more" + (f" (all listed in {cache_file})" if cache_file else "")
        )
    return "\n".join(lines)


def drop_rows(splits: dict, problems: list[Problem]) -> dict:
    """The splits without the rows named in `problems`, order kept."""
    bad_rows = defaultdict(set)
    for problem in problems:
        bad_rows[problem.split].add(problem.row)
    kept = {}
    for split, dataset in splits.items():
        if not bad_rows[split]:
            kept[split] = dataset
            continue
        rows = [row for row in range(len(dataset)) if row not in bad_rows[split]]
        if not rows:
            raise UserInputError(f"--drop_bad_rows: every row of split '{split}' is bad; nothing is left to use")
        kept[split] = dataset.select(rows)
    return kept


# ---------------------------------------------------------------------------------------------
# Finding the problems, once per data set
# ---------------------------------------------------------------------------------------------


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
    """Every bad row of `splits` (dict of split name -> datasets.Dataset), and the cache file holding them.

    cache_dir: where the outcome is cached (None: `data.cache_dir("preflight")`). image_size: the model's
    input size, for the pixel budget of the resized image (None: only the decoded size is budgeted).
    """
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
    cached = None if overwrite_cache else _read_cache(cache_file, settings)
    if cached is not None:
        logger.info(f"Preflight: the {cached['rows_checked']} rows of {names} were checked before ({cache_file}).")
        return [Problem(**p) for p in cached["problems"]], cache_file

    start = time.perf_counter()
    check_image = functools.partial(image_problem, max_pixels=max_image_pixels, image_size=image_size)
    problems, checker, rows = _scan(splits, image_column, caption_column, num_proc, check_image)
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


def _read_cache(cache_file: Path, settings: dict) -> Optional[dict]:
    """The cached outcome, unless absent, for other settings, or an image file changed since."""
    try:
        with open(cache_file) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        return None
    if cached.get("settings") != settings:
        return None
    checked_at_ns = cached.get("checked_at_ns", 0)
    if any(_file_identity(path, checked_at_ns) != identity for path, identity in cached.get("files", {}).items()):
        logger.info("Preflight: image files changed since the last check; checking again.")
        return None
    return cached


def _scan(splits: dict, image_column: str, caption_column: str, num_proc: Optional[int], check_image=None):
    """(problems sorted by split and row, the image checker, rows read)."""
    found = []  # (split, row, column, reason)
    rows = 0
    with _ImageChecker(num_proc, check_image) as checker:
        for split, dataset in splits.items():
            columns = dataset.select_columns(list(dict.fromkeys([image_column, caption_column])))
            row = 0
            for batch in columns.iter(batch_size=_ROWS_PER_BATCH):
                for image, caption in zip(batch[image_column], batch[caption_column]):
                    reason = caption_problem(caption)
                    if reason:
                        found.append((split, row, caption_column, reason))
                    checker.add(image, (split, row))
                    row += 1
            rows += row
        found += [(split, row, image_column, reason) for (split, row), reason in checker.finish()]
    source_rows = {split: _source_rows(dataset) for split, dataset in splits.items()}
    problems = [
        Problem(split, row, column, reason, source_rows[split][row] if source_rows[split] is not None else None)
        for split, row, column, reason in found
    ]
    order = {split: i for i, split in enumerate(splits)}
    problems.sort(key=lambda p: (order[p.split], p.row, p.column != image_column))
    return problems, checker, rows


def _source_rows(dataset) -> Optional[list]:
    """Row numbers in the data as loaded, when `dataset` is a shuffled selection of it (else None)."""
    indices = getattr(dataset, "_indices", None)  # the `datasets` indices mapping of select / train_test_split
    return indices.column(0).to_pylist() if indices is not None else None


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
    """Collects the image of every row; decodes each distinct image once, in worker processes.

    Distinct means identical embedded bytes (by blake2b digest) or the same file path.
    """

    def __init__(self, num_proc: Optional[int], check_image=None):
        self.num_proc = num_proc or 1
        self.check_image = check_image or image_problem
        self.rows_of: dict[tuple, list] = {}  # image key -> the (split, row) showing it
        self.file_stats: dict[str, Optional[list]] = {}  # path -> _file_identity (None: missing)
        self.started_ns = time.time_ns()
        self._pending: list[tuple[tuple, Any]] = []  # (key, payload) not yet decoded
        self._failed: dict[tuple, str] = {}
        self._pool = None

    def __enter__(self):
        if self.num_proc > 1:
            # forkserver: the workers start from a clean process, not a fork of this one, whose threads
            # (tokenizers, loaders, torch) may hold locks that a forked child would wait on forever
            self._pool = multiprocessing.get_context("forkserver").Pool(self.num_proc)
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()

    def add(self, value: Any, where: tuple) -> None:
        key, payload = self._identify(value)
        if key in self.rows_of:
            self.rows_of[key].append(where)
            return
        self.rows_of[key] = [where]
        if payload is None:
            self._failed[key] = "no image (empty cell: neither embedded bytes nor a path)"
            return
        self._pending.append((key, payload))
        if len(self._pending) >= _IMAGES_PER_ROUND:
            self._decode_pending()

    def finish(self) -> list[tuple[tuple, str]]:
        """((split, row), reason) for every row whose image failed."""
        self._decode_pending()
        return [(where, reason) for key, reason in self._failed.items() for where in self.rows_of[key]]

    def _identify(self, value: Any) -> tuple[tuple, Any]:
        """(key, payload): payload is the embedded bytes or a file path (None: no image at all)."""
        if isinstance(value, dict) and value.get("bytes"):
            data = bytes(value["bytes"])
            return ("bytes", hashlib.blake2b(data, digest_size=16).digest()), data
        path = value.get("path") if isinstance(value, dict) else value
        if isinstance(path, (str, os.PathLike)) and os.fspath(path):
            path = os.fspath(path)
            self.file_stats[path] = _file_identity(path, self.started_ns)
            return ("path", path), path
        return ("none",), None

    def _decode_pending(self) -> None:
        if not self._pending:
            return
        payloads = [payload for _, payload in self._pending]
        if self._pool is not None:
            chunksize = max(1, len(payloads) // (self.num_proc * 4))
            reasons = self._pool.map(self.check_image, payloads, chunksize=chunksize)
        else:
            reasons = [self.check_image(payload) for payload in payloads]
        for (key, _), reason in zip(self._pending, reasons):
            if reason:
                self._failed[key] = reason
        self._pending = []


def _file_identity(path: str, checked_at_ns: int) -> Optional[list]:
    """What the cache knows a checked image file by (None: missing): [size, mtime_ns, ctime_ns, inode], plus the
    blake2b digest of its content when it was modified within RACY_WINDOW_NS of the check's start
    (`checked_at_ns`). A write changes mtime and ctime; setting the mtime back changes the ctime; replacing the
    file changes the inode; and a change too quick for the clock to see changes the digest."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    identity = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    if max(stat.st_mtime_ns, stat.st_ctime_ns) >= checked_at_ns - RACY_WINDOW_NS:
        try:
            identity.append(hashlib.blake2b(read_regular_file(path), digest_size=16).hexdigest())
        except OSError:
            pass  # not readable as a regular file: its check says why
    return identity


def image_problem(
    payload: bytes | str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, image_size: Optional[int] = None
) -> Optional[str]:
    """Why an image (encoded bytes, or a file path) cannot be used, or None when it decodes completely.

    Its size is read from the header first: an image over the pixel budget, as decoded or (image_size
    given) as resized before the centre crop, is refused without being decoded.
    """
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
            img.draft(None, _DRAFT_SIZE)  # JPEG: DCT-domain downscale; other formats ignore it
            img.load()
            upright(img)  # reads the EXIF orientation, as every image pipeline does
    except UnidentifiedImageError:
        return f"cannot decode {label}: not in an image format Pillow reads"
    except Exception as error:  # PIL raises many types for bad data
        return f"cannot decode {label}: {error}"
    return None


def pixel_budget_problem(size: tuple[int, int], max_pixels: int, image_size: Optional[int] = None) -> Optional[str]:
    """Why an image of this (width, height) is over the budget, or None."""
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

"""Image files the HPU decoder reads: every distinct image of a data set written once as a baseline JPEG.

Habana's media pipeline reads JPEG files, where parquet data sets embed their images (docs/UPSTREAM.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import datasets
from PIL import Image

from bridgetower_bench.images.images import image_source, jpeg_orientation, to_rgb, upright
from bridgetower_bench.images.jpeg_headers import SOF_BASELINE, read_jpeg_header
from bridgetower_bench.output_dir.atomic_files import remove_abandoned, write_atomically
from bridgetower_bench.regular_files import read_regular_file


logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
_MANIFEST_VERSION = 3  # 2: grey JPEGs transcoded to RGB; 3: EXIF-rotated images written upright
_CHUNK_ROWS = 256  # rows read (and images held in memory) at a time while materialising


def is_decoder_ready_jpeg(data: bytes) -> bool:
    """Whether encoded bytes can go to the HPU decoder as they are: an upright colour (three-component) 8-bit
    baseline JPEG, the one kind Habana documents for its decoder; anything else is transcoded to RGB."""
    header = read_jpeg_header(data)
    if header is None or (header.marker, header.precision, header.components) != (SOF_BASELINE, 8, 3):
        return False
    return not header.has_exif or jpeg_orientation(data) in (None, 1)


def transcode_to_jpeg(data: bytes, label: str) -> bytes:
    """Decode any image PIL reads, turn it upright, convert it to RGB (``images.to_rgb``), encode a baseline JPEG."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as error:  # PIL raises many types for corrupt data
        raise ValueError(f"cannot decode the image of {label}: {error}") from error
    out = io.BytesIO()
    to_rgb(upright(img)).save(out, format="JPEG", quality=95)
    return out.getvalue()


def materialise_images(
    dataset, image_column: str, cache_dir: str, fingerprint: str, num_proc: Optional[int] = None
) -> list[str]:
    """Give every row of ``dataset`` a JPEG file the HPU decoder takes; return one path per row.

    One file per distinct image, ``<cache_dir>/<fingerprint>/<sha256 of the encoded image>.jpg`` (``.upright.jpg``
    when transcoded); a path value whose file the decoder takes is used where it is, once checked to exist.
    Idempotent and crash-safe: files are renamed into place and a manifest written last marks a finished build,
    which is then neither read nor written again; a killed build is completed, reusing the files it finished.
    ``num_proc`` threads share the work. In distributed runs call it on the main process first (concurrent
    calls are safe but duplicate the work).
    """
    if image_column not in dataset.column_names:
        raise ValueError(
            f"--image_column={image_column} is not a column of the data set; "
            f"available columns: {', '.join(dataset.column_names)}"
        )
    out_dir = os.path.abspath(os.path.join(cache_dir, fingerprint))  # the decoder opens files by path
    if (finished := _read_manifest(out_dir, image_column, len(dataset))) is not None:
        return finished
    os.makedirs(out_dir, exist_ok=True)
    remove_abandoned(out_dir)  # temporary files of builds killed on this host
    images = dataset.with_format(None).select_columns([image_column])  # no format or transform
    if isinstance(images.features[image_column], datasets.Image) and images.features[image_column].decode:
        images = images.cast_column(image_column, datasets.Image(decode=False))
    paths = _ImageStore(out_dir, image_column).store_all(images, num_proc)
    _write_manifest(out_dir, image_column, paths)
    return paths


class _ImageStore:
    """Writes the distinct images of one data set into one cache directory."""

    def __init__(self, out_dir: str, image_column: str):
        self.out_dir = out_dir
        self.image_column = image_column
        self.written = 0
        self._count_lock = threading.Lock()

    def store_all(self, images, num_proc: Optional[int]) -> list[str]:
        """Return one file path per row, writing each distinct image at most once."""
        path_of_key: dict[tuple, str] = {}
        row_keys: list[tuple] = []
        with ThreadPoolExecutor(max_workers=max(1, num_proc or 1)) as pool:
            for chunk in images.iter(batch_size=_CHUNK_ROWS):
                jobs: dict[tuple, Callable[[], str]] = {}
                for value in chunk[self.image_column]:
                    key, job = self._plan_row(value, len(row_keys))
                    if key not in path_of_key:
                        jobs.setdefault(key, job)
                    row_keys.append(key)
                path_of_key.update(zip(jobs, pool.map(lambda job: job(), jobs.values())))
        logger.info(
            "image cache %s: %d rows, %d distinct images, %d files written",
            self.out_dir,
            len(row_keys),
            len(path_of_key),
            self.written,
        )
        return [path_of_key[key] for key in row_keys]

    def _plan_row(self, value, row: int):
        """(dedup key, job returning the row's file path) for one image value."""
        where = f"--image_column={self.image_column}, row {row}"
        source = image_source(value)
        if source is None:
            raise ValueError(f"{where}: unsupported image value of type {type(value).__name__}")
        if source.data is not None:
            digest = hashlib.sha256(source.data).hexdigest()
            return ("sha256", digest), lambda: self._store(source.data, digest, f"{where} (embedded bytes)")
        if source.path is None:
            raise ValueError(f"{where}: the image has neither embedded bytes nor a path")
        given = os.fspath(source.path)
        if not os.path.isfile(given):
            what = "has no embedded bytes and its path" if source.from_dict else "image path"
            problem = "is not a regular file" if os.path.exists(given) else "does not exist"
            raise ValueError(f"{where}: {what} {given!r} {problem}")
        path = os.path.abspath(given)
        return ("file", os.path.realpath(path)), lambda: self._use_or_store_file(path, f"{where} ({given!r})")

    def _use_or_store_file(self, path: str, label: str) -> str:
        data = read_regular_file(path)  # (a FIFO or device swapped in since the check is refused, never read)
        return path if is_decoder_ready_jpeg(data) else self._store(data, hashlib.sha256(data).hexdigest(), label)

    def _store(self, data: bytes, digest: str, label: str) -> str:
        ready = is_decoder_ready_jpeg(data)
        # transcodes get their own names: a build before EXIF-rotated images were turned upright wrote some of them
        # as they were under the plain name; a file an earlier build wrote as it was (e.g. a grey JPEG) is redone
        target = os.path.join(self.out_dir, digest + (".jpg" if ready else ".upright.jpg"))
        if os.path.exists(target) and is_decoder_ready_jpeg(Path(target).read_bytes()):
            return target  # finished by an earlier (killed) build
        write_atomically(target, data if ready else transcode_to_jpeg(data, label), fsync=True)
        with self._count_lock:
            self.written += 1
        return target


def _write_manifest(out_dir: str, image_column: str, paths: list[str]) -> None:
    """Record a finished build: the distinct files (names inside ``out_dir`` or absolute) and each row's file."""
    files = list(dict.fromkeys(paths))
    index_of = {path: index for index, path in enumerate(files)}
    names = [os.path.basename(path) if os.path.dirname(path) == out_dir else path for path in files]
    rows = [index_of[path] for path in paths]
    manifest = {"version": _MANIFEST_VERSION, "image_column": image_column, "files": names, "rows": rows}
    write_atomically(os.path.join(out_dir, MANIFEST_NAME), json.dumps(manifest), fsync=True)


def _read_manifest(out_dir: str, image_column: str, num_rows: int) -> Optional[list[str]]:
    """The per-row paths of a finished build, or None when there is none or it no longer holds."""
    try:
        with open(os.path.join(out_dir, MANIFEST_NAME), encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("image cache %s: unreadable manifest (%s); rebuilding", out_dir, error)
        return None
    if (
        manifest.get("version") != _MANIFEST_VERSION
        or manifest.get("image_column") != image_column
        or len(manifest.get("rows", ())) != num_rows
    ):
        logger.warning("image cache %s: manifest is for other data; rebuilding", out_dir)
        return None
    files = [os.path.join(out_dir, name) for name in manifest["files"]]
    missing = [path for path in files if not os.path.isfile(path)]
    if missing:
        logger.warning("image cache %s: %d files are missing (e.g. %s); rebuilding", out_dir, len(missing), missing[0])
        return None
    return [files[index] for index in manifest["rows"]]

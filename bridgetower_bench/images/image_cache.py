"""Decode-once image cache: each distinct image decoded once by ``fast`` or ``fast-draft`` into a memory-mapped
uint8 file that loader workers share (docs/ARCHITECTURE.md, "The decode-once cache")."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterable, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
import torchvision
from PIL import ExifTags, Image
from tqdm import tqdm

from bridgetower_bench.images.images import check_pipeline, encoded_image_bytes, jpeg_decoder, make_image_transform
from bridgetower_bench.output_dir.atomic_files import atomic_path, remove_abandoned, write_atomically
from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 2  # 2: images turned upright by their EXIF orientation
CACHEABLE_PIPELINES = ("fast", "fast-draft")
DIGEST_SIZE = 16
PIXELS_FILE = "pixels.npy"
DIGESTS_FILE = "digests.npy"
MANIFEST_FILE = "manifest.json"


def image_digest(value: Any) -> bytes:
    """16-byte blake2b of the bytes the pipeline would decode for ``value`` (the same picture stored twice is one
    slot); of a PIL image, of its mode, size, transparency, EXIF orientation and pixels."""
    if isinstance(value, Image.Image):
        hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
        orientation = value.getexif().get(ExifTags.Base.Orientation)  # the pipeline turns the image by it
        hasher.update(repr((value.mode, value.size, value.info.get("transparency"), orientation)).encode())
        hasher.update(value.tobytes())
        return hasher.digest()
    data, _ = encoded_image_bytes(value)
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def cache_settings(pipeline: str, image_size: int, fingerprint: str) -> dict:
    """Everything that decides a cache's pixels (for ``fast-draft`` the JPEG decoder too: its DCT scales differ),
    plus the data set's fingerprint."""
    settings = {
        "format_version": CACHE_FORMAT_VERSION,
        "pipeline": pipeline,
        "image_size": image_size,
        "digest": f"blake2b-{DIGEST_SIZE * 8}",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "fingerprint": fingerprint,
    }
    if pipeline == "fast-draft":
        settings["jpeg_decoder"] = jpeg_decoder()
    return settings


def decoded_image_cache_dir(cache_dir: str | os.PathLike, pipeline: str, image_size: int, fingerprint: str) -> Path:
    """The directory a cache with these settings lives in: ``cache_dir/<pipeline>-<size>-<key>``."""
    settings = cache_settings(pipeline, image_size, fingerprint)
    key = hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=10).hexdigest()
    return Path(cache_dir) / f"{pipeline}-{image_size}-{key}"


class DecodedImageCache:
    """Image value -> cached uint8 (3, S, S) tensor, a drop-in for the pipeline's transform (which decodes a value
    not in the cache, counted in ``fallback_decodes``). Files mapped once per process, dropped when pickled."""

    def __init__(self, directory: str | os.PathLike, manifest: dict, *, built: bool):
        self.directory = Path(directory)
        self.manifest = manifest
        self.pipeline = manifest["pipeline"]
        self.image_size = manifest["image_size"]
        self.built = built  # True when this call decoded the images, False when it reused them
        self.fallback_decodes = 0
        self._transform = make_image_transform(self.pipeline, self.image_size, mean=(), std=())
        self._pixels: np.ndarray | None = None
        self._slots: dict[bytes, int] | None = None

    def __len__(self) -> int:
        return self.manifest["n_images"]

    def __call__(self, value: Any) -> torch.Tensor:
        slot = self.slot_of(value)
        if slot is None:
            if self.fallback_decodes == 0:
                logger.warning(
                    "An image is not in the decoded image cache %s; decoding it with the %s pipeline "
                    "(counted in fallback_decodes).",
                    self.directory,
                    self.pipeline,
                )
            self.fallback_decodes += 1
            return self._transform(value)
        if self._pixels is None:
            self._pixels = np.load(self.directory / PIXELS_FILE, mmap_mode="r")
        return torch.from_numpy(np.array(self._pixels[slot]))

    def slot_of(self, value: Any) -> int | None:
        """The cache slot holding ``value``'s pixels, or None when it is not cached."""
        if self._slots is None:
            digests = np.load(self.directory / DIGESTS_FILE)
            self._slots = {row.tobytes(): slot for slot, row in enumerate(digests)}
        return self._slots.get(image_digest(value))

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _pixels=None, _slots=None)

    def __repr__(self) -> str:
        return f"DecodedImageCache({str(self.directory)!r}, images={len(self)}, built={self.built})"


def open_decoded_image_cache(
    image_values: Sequence[Any],
    *,
    pipeline: str,
    image_size: int,
    cache_dir: str | os.PathLike,
    fingerprint: str,
    num_proc: int | None = None,
) -> DecodedImageCache:
    """The decode-once cache of ``image_values``, reused without looking at the images when its manifest matches
    the settings and ``fingerprint`` (the data's identity), else built by ``num_proc`` processes (None: this one)."""
    check_pipeline(pipeline)
    if pipeline not in CACHEABLE_PIPELINES:
        raise UserInputError(
            f"--image_pipeline={pipeline} cannot be cached: the decoded image cache (--cache_decoded_images) "
            f"stores uint8 pixels, which only --image_pipeline {' and '.join(CACHEABLE_PIPELINES)} produce"
        )
    if not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer; got {image_size!r}")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"the decoded image cache needs a non-empty fingerprint string; got {fingerprint!r}")
    if num_proc is not None and (not isinstance(num_proc, int) or num_proc < 1):
        raise ValueError(f"num_proc must be a positive integer or None; got {num_proc!r}")
    settings = cache_settings(pipeline, image_size, fingerprint)
    directory = decoded_image_cache_dir(cache_dir, pipeline, image_size, fingerprint)
    manifest = read_complete_manifest(directory, settings)
    if manifest is not None:
        logger.info("Reusing the decoded image cache %s (%d images).", directory, manifest["n_images"])
        return DecodedImageCache(directory, manifest, built=False)
    manifest = build_decoded_image_cache(image_values, directory, settings, num_proc=num_proc)
    return DecodedImageCache(directory, manifest, built=True)


def read_complete_manifest(directory: Path, settings: dict) -> dict | None:
    """The manifest of a finished cache built with exactly ``settings``; None otherwise (no directory, no
    manifest: an unfinished build, other settings, data files of another shape than it says)."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not manifest.get("complete"):
        return None
    if any(manifest.get(name) != value for name, value in settings.items()):
        logger.warning("The decoded image cache %s was built with other settings; rebuilding it.", directory)
        return None
    n_images, size = manifest.get("n_images"), settings["image_size"]
    try:
        pixels = np.load(directory / PIXELS_FILE, mmap_mode="r")
        digests = np.load(directory / DIGESTS_FILE, mmap_mode="r")
    except (OSError, ValueError):
        logger.warning("The decoded image cache %s is damaged; rebuilding it.", directory)
        return None
    if pixels.shape != (n_images, 3, size, size) or digests.shape != (n_images, DIGEST_SIZE):
        logger.warning("The decoded image cache %s does not match its manifest; rebuilding it.", directory)
        return None
    return manifest


def build_decoded_image_cache(
    image_values: Iterable[Any], directory: Path, settings: dict, *, num_proc: int | None = None
) -> dict:
    """Decode every distinct image of ``image_values`` once into ``directory``; return the manifest, written
    last (the data files under names private to this process, then renamed): a killed build leaves none."""
    started = time.perf_counter()
    slot_of: dict[bytes, int] = {}  # each distinct image's digest, in first-seen order -> its slot
    representatives: list[tuple[int, Any]] = []  # (row, value) of each slot's first value
    n_values = 0
    total = len(image_values) if isinstance(image_values, Sized) else None
    for row, value in enumerate(tqdm(image_values, total=total, desc="Hashing images", unit="img")):
        n_values += 1
        try:
            digest = image_digest(value)
        except ValueError as error:
            raise ValueError(f"image row {row}: {error}") from error
        if digest not in slot_of:
            slot_of[digest] = len(representatives)
            representatives.append((row, value))
    digests = list(slot_of)
    if not representatives:
        raise ValueError("there are no images to cache: the image column is empty")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST_FILE).unlink(missing_ok=True)  # the directory is not complete any more
    except OSError as error:
        raise OSError(
            f"cannot write the decoded image cache {directory} (--decoded_image_cache_dir): {error}"
        ) from error
    remove_abandoned(directory)  # temporary files of killed builds on this host, so they do not pile up
    size = settings["image_size"]
    # interrupted or failed: no half-written file is left behind
    with atomic_path(directory / PIXELS_FILE) as pixels_tmp, atomic_path(directory / DIGESTS_FILE) as digests_tmp:
        pixels = np.lib.format.open_memmap(pixels_tmp, mode="w+", dtype=np.uint8, shape=(len(digests), 3, size, size))
        del pixels  # created at full size; the decoders map it themselves
        reserve_space(pixels_tmp, directory)  # a write through the mapping into a full disk would be a SIGBUS
        _decode_into(Path(pixels_tmp), representatives, settings["pipeline"], size, num_proc)
        with open(digests_tmp, "wb") as handle:
            np.save(handle, np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), DIGEST_SIZE))
    manifest = dict(
        settings,
        n_images=len(digests),
        n_values=n_values,
        build_seconds=round(time.perf_counter() - started, 3),
        complete=True,
    )
    write_atomically(directory / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    logger.info("Built the decoded image cache %s: %d distinct images of %d.", directory, len(digests), n_values)
    return manifest


def reserve_space(path: str, directory: Path) -> None:
    """Allocate every block of the (sparse) file at `path` now, or raise OSError naming the cache and the free
    space: a page the filesystem cannot back, written through the mapping, would kill the process with SIGBUS."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        free = shutil.disk_usage(directory).free
        raise OSError(
            error.errno,
            f"cannot reserve {size / 2**20:.1f} MiB for the decoded image cache {directory} "
            f"({error.strerror}; {free / 2**20:.1f} MiB free there)",
        ) from error
    finally:
        os.close(fd)


def _decode_into(
    pixels_path: Path, representatives: list, pipeline: str, image_size: int, num_proc: int | None
) -> None:
    """Decode ``representatives`` (``(row, value)`` by slot) into the pixel file, in parallel."""
    tasks = list(enumerate(representatives))
    progress = tqdm(total=len(tasks), desc=f"Decoding images once ({pipeline}, {image_size} px)", unit="img")
    workers = min(num_proc or 1, len(tasks))
    if workers <= 1:
        _open_decoder(pixels_path, pipeline, image_size)
        try:
            for task in tasks:
                _decode_one(task)
                progress.update()
            _DECODER["pixels"].flush()
        finally:
            _DECODER.clear()
    else:
        chunksize = max(1, min(16, len(tasks) // (workers * 8)))
        # forkserver, as the preflight pool: a fork of this process could inherit a lock that one of its
        # threads (torch's, a tokenizer's, a loader's) held at the fork, and the worker would wait forever
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # (if this pool starts the server; else preflight's has torch)
        initargs = (pixels_path, pipeline, image_size, True)
        with context.Pool(workers, initializer=_open_decoder, initargs=initargs) as pool:
            for _ in pool.imap_unordered(_decode_one, tasks, chunksize=chunksize):
                progress.update()
    progress.close()


# Per-process decoder state: the pixel file mapped for writing and the pipeline's transform.
_DECODER: dict = {}


def _open_decoder(pixels_path: Path, pipeline: str, image_size: int, worker: bool = False) -> None:
    if worker:
        torch.set_num_threads(1)  # the processes are the parallelism
    _DECODER["pixels"] = np.load(pixels_path, mmap_mode="r+")
    _DECODER["transform"] = make_image_transform(pipeline, image_size, mean=(), std=())


def _decode_one(task: tuple[int, tuple[int, Any]]) -> int:
    slot, (row, value) = task
    try:
        _DECODER["pixels"][slot] = _DECODER["transform"](value).numpy()
    except ValueError as error:
        raise ValueError(f"image row {row}: {error}") from error
    return slot

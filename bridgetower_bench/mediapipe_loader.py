"""Gaudi media-pipeline loader: image materialisation, availability check, loader, trainer mixin.

With ``--mediapipe_dataloader`` the Gaudi script decodes, resizes and normalises images on the
HPU with Habana's media pipeline (``habana_frameworks.mediapipe``, pip package
habana-media-loader) instead of in CPU workers. The pipeline reads encoded JPEG *files*, so:

1. ``materialise_images`` writes every distinct image of a data set once as a JPEG file the HPU
   decoder takes (parquet data sets keep images as embedded bytes; upstream handed the decoder
   ``image["path"]``, which for those is not a file on disk).
2. ``attach_mediapipe_inputs`` stores the file list, token arrays and image geometry on the data
   set object handed to the trainer.
3. ``MediaPipeTrainerMixin`` makes the trainer build a ``MediaPipeDataLoader`` from its own
   sampler, sharded per rank, so the media pipeline sees the same batches as the PyTorch loader.
4. ``choose_loader`` decides which loader runs and says why, loudly: upstream silently fell back
   to the CPU loader, so a "mediapipe" benchmark might not have used it.

Nothing here imports Habana modules at import time; the pure-Python parts (materialisation,
``SamplerBatchReader``, the sampler sharding) run and are tested on any machine.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from PIL import Image
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler
from transformers.trainer_pt_utils import DistributedSamplerWithLoop, ShardSampler

from .atomic_files import remove_abandoned, write_atomically
from .data import cache_dir as bench_cache_dir
from .images import image_source, jpeg_orientation, read_regular_file, to_rgb, upright
from .jpeg_headers import SOF_BASELINE, read_jpeg_header


logger = logging.getLogger(__name__)

MEDIAPIPE_LOADER = "mediapipe"
TORCH_LOADER = "torch"
SUPPORTED_DEVICES = ("GAUDI2", "GAUDI3")

JPEG_QUALITY = 95
MANIFEST_NAME = "manifest.json"
_MANIFEST_VERSION = 3  # 2: grey JPEGs transcoded to RGB; 3: EXIF-rotated images written upright
_CHUNK_ROWS = 256  # rows read (and images held in memory) at a time while materialising
_INPUTS_ATTRIBUTE = "_bridgetower_mediapipe_inputs"


# ----------------------------------------------------------------------------------------
# Availability and the loader decision
# ----------------------------------------------------------------------------------------


def mediapipe_unavailable_reason() -> Optional[str]:
    """Why the media pipeline cannot run here, or None when it can.

    It can only on a Gaudi2 or Gaudi3 device with both ``habana_frameworks.mediapipe`` and
    ``habana_frameworks.torch`` importable (first-generation Gaudi has no HPU JPEG decoder).
    """
    reason = _import_failure("habana_frameworks.mediapipe", "the habana-media-loader package")
    if reason:
        return reason
    reason = _import_failure("habana_frameworks.torch.hpu", "Habana's PyTorch build")
    if reason:
        return reason
    try:
        import habana_frameworks.torch.hpu as hpu

        if not hpu.is_available():
            return "no HPU device is visible"
        device_name = str(hpu.get_device_name())
    except Exception as error:  # the Habana runtime raises assorted types when no device is usable
        return f"cannot query the HPU device: {type(error).__name__}: {error}"
    if not device_name.upper().startswith(SUPPORTED_DEVICES):
        return f"no Gaudi2/Gaudi3 device (found: {device_name})"
    try:
        _media_api()
    except Exception as error:
        return f"the media pipeline's modules cannot be loaded: {type(error).__name__}: {error}"
    return None


def _import_failure(module: str, distribution: str) -> Optional[str]:
    """None if ``module`` imports, else a one-line reason (native-library errors included)."""
    try:
        __import__(module)
    except ModuleNotFoundError as error:
        if error.name and module.startswith(error.name):
            return f"{module} is not installed (it comes with {distribution})"
        return f"{module} cannot be imported: {error}"
    except Exception as error:  # e.g. OSError from a missing native library
        return f"{module} cannot be imported: {type(error).__name__}: {error}"
    return None


def choose_loader(requested: bool) -> tuple[str, Optional[str]]:
    """Pick the loader for a run: returns (loader string for the saved metrics, reason or None).

    ``("mediapipe", None)`` when requested and available; ``("torch (media pipeline unavailable:
    <reason>)", reason)`` when requested but unavailable (the script logs one loud warning with the
    reason, and the metrics record that the PyTorch loader ran); ``("torch", None)`` otherwise.
    """
    if not requested:
        return TORCH_LOADER, None
    reason = mediapipe_unavailable_reason()
    if reason is None:
        return MEDIAPIPE_LOADER, None
    return f"{TORCH_LOADER} (media pipeline unavailable: {reason})", reason


# ----------------------------------------------------------------------------------------
# Materialising images as JPEG files the HPU decoder takes
# ----------------------------------------------------------------------------------------


def is_decoder_ready_jpeg(data: bytes) -> bool:
    """Whether encoded bytes can go to the HPU decoder as they are.

    Only upright colour baseline JPEGs (SOF0: 8-bit, Huffman, sequential, three YCbCr components)
    qualify, the one kind Habana documents for its decoder; grey (one-component), progressive,
    arithmetic-coded, 12-bit and CMYK/YCCK JPEGs, JPEGs with an EXIF orientation other than 1 (the
    decoder does not turn them), and every other format, are transcoded to RGB.
    """
    header = read_jpeg_header(data)
    ready = header is not None and header.marker == SOF_BASELINE and header.precision == 8 and header.components == 3
    return ready and (not header.has_exif or jpeg_orientation(data) in (None, 1))


def transcode_to_jpeg(data: bytes, label: str) -> bytes:
    """Decode any image PIL reads, turn it upright, convert it to RGB (``images.to_rgb``), encode a baseline JPEG."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as error:  # PIL raises many types for corrupt data
        raise ValueError(f"cannot decode the image of {label}: {error}") from error
    out = io.BytesIO()
    to_rgb(upright(img)).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def materialise_images(
    dataset, image_column: str, cache_dir: str, fingerprint: str, num_proc: Optional[int] = None
) -> list[str]:
    """Give every row of ``dataset`` a JPEG file the HPU decoder takes; return one path per row.

    Images become ``<cache_dir>/<fingerprint>/<sha256 of the encoded image>.jpg``, one file per
    distinct image (rows sharing an image share the path). Baseline JPEG bytes are written as they
    are; everything else is transcoded to RGB JPEG (quality 95). A path value whose file is such a
    JPEG is used where it is; a path is only read after checking that it exists.

    Idempotent and crash-safe: files are written to temporary names and renamed, and a manifest
    written last marks a finished build. With the manifest present nothing is read or written; a
    build that was killed (no manifest) is completed, reusing the files it finished.

    ``num_proc`` threads share the work (None: one). ``fingerprint`` names the data set's content
    (e.g. ``dataset._fingerprint``). In distributed runs call this on the main process first
    (``training_args.main_process_first()``); concurrent calls are safe but duplicate the work.
    """
    if image_column not in dataset.column_names:
        raise ValueError(
            f"--image_column={image_column} is not a column of the data set; "
            f"available columns: {', '.join(dataset.column_names)}"
        )
    if not fingerprint or os.sep in fingerprint or fingerprint in (".", ".."):
        raise ValueError(f"image cache fingerprint {fingerprint!r} must be a plain directory name")
    out_dir = os.path.abspath(os.path.join(cache_dir, fingerprint))  # the decoder opens files by path
    finished = _read_manifest(out_dir, image_column, len(dataset))
    if finished is not None:
        return finished

    os.makedirs(out_dir, exist_ok=True)
    remove_abandoned(out_dir)  # temporary files of builds killed on this host
    paths = _ImageStore(out_dir, image_column).store_all(_undecoded_images(dataset, image_column), num_proc)
    _write_manifest(out_dir, image_column, paths)
    return paths


def _undecoded_images(dataset, image_column: str):
    """The image column alone, without format/transform, with Image features left undecoded."""
    import datasets

    column = dataset.with_format(None).select_columns([image_column])
    feature = column.features[image_column]
    if isinstance(feature, datasets.Image) and feature.decode:
        column = column.cast_column(image_column, datasets.Image(decode=False))
    return column


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
        row = 0
        with ThreadPoolExecutor(max_workers=max(1, num_proc or 1)) as pool:
            for chunk in images.iter(batch_size=_CHUNK_ROWS):
                jobs = {}
                for value in chunk[self.image_column]:
                    key, job = self._plan_row(value, row)
                    if key not in path_of_key and key not in jobs:
                        jobs[key] = job
                    row_keys.append(key)
                    row += 1
                for key, path in zip(jobs, pool.map(lambda job: job(), jobs.values())):
                    path_of_key[key] = path
        logger.info(
            "image cache %s: %d rows, %d distinct images, %d files written",
            self.out_dir,
            len(row_keys),
            len(path_of_key),
            self.written,
        )
        return [path_of_key[key] for key in row_keys]

    def _plan_row(self, value: Any, row: int):
        """(dedup key, job returning the row's file path) for one image value."""
        where = f"--image_column={self.image_column}, row {row}"
        source = image_source(value)
        if source is None:
            raise ValueError(f"{where}: unsupported image value of type {type(value).__name__}")
        if source.data is not None:
            return self._plan_bytes(source.data, where)
        if source.path is None:
            raise ValueError(f"{where}: the image has neither embedded bytes nor a path")
        return self._plan_file(
            source.path, where, "has no embedded bytes and its path" if source.from_dict else "image path"
        )

    def _plan_bytes(self, data: bytes, where: str):
        digest = hashlib.sha256(data).hexdigest()
        return ("sha256", digest), lambda: self._store(data, digest, f"{where} (embedded bytes)")

    def _plan_file(self, path, where: str, what: str):
        given = os.fspath(path)
        if not os.path.isfile(given):
            raise ValueError(
                f"{where}: {what} {given!r} "
                + ("is not a regular file" if os.path.exists(given) else "does not exist")
            )
        path = os.path.abspath(given)
        return ("file", os.path.realpath(path)), lambda: self._use_or_store_file(path, f"{where} ({given!r})")

    def _use_or_store_file(self, path: str, label: str) -> str:
        data = read_regular_file(path)  # (a FIFO or device swapped in since the check is refused, never read)
        if is_decoder_ready_jpeg(data):
            return path
        return self._store(data, hashlib.sha256(data).hexdigest(), label)

    def _store(self, data: bytes, digest: str, label: str) -> str:
        ready = is_decoder_ready_jpeg(data)
        # transcodes get their own names: a build before EXIF-rotated images were turned upright
        # wrote some of them as they were, under the plain name
        target = os.path.join(self.out_dir, digest + (".jpg" if ready else ".upright.jpg"))
        if os.path.exists(target) and _holds_decoder_ready_jpeg(target):  # finished by an earlier (killed) build
            return target  # (one an earlier version wrote as it was, e.g. a grey JPEG, is written again)
        encoded = data if ready else transcode_to_jpeg(data, label)
        write_atomically(target, encoded, fsync=True)
        with self._count_lock:
            self.written += 1
        return target


def _holds_decoder_ready_jpeg(path: str) -> bool:
    with open(path, "rb") as handle:
        return is_decoder_ready_jpeg(handle.read())


def _write_manifest(out_dir: str, image_column: str, paths: Sequence[str]) -> None:
    """Record a finished build: the distinct files (names inside ``out_dir`` or absolute) and each row's file."""
    files: list[str] = []
    index_of: dict[str, int] = {}
    rows = []
    for path in paths:
        if path not in index_of:
            index_of[path] = len(files)
            inside = os.path.dirname(path) == out_dir
            files.append(os.path.basename(path) if inside else path)
        rows.append(index_of[path])
    manifest = {"version": _MANIFEST_VERSION, "image_column": image_column, "files": files, "rows": rows}
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


# ----------------------------------------------------------------------------------------
# What the loader needs from a data set
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaPipeInputs:
    """Per-data-set inputs of the media-pipeline loader (see ``attach_mediapipe_inputs``)."""

    file_paths: list[str]
    input_ids: np.ndarray  # int64 [rows, max_seq_length]
    attention_mask: np.ndarray  # int64 [rows, max_seq_length]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def attach_mediapipe_inputs(dataset, file_paths: Sequence[str], image_size: int, mean, std) -> MediaPipeInputs:
    """Store what ``MediaPipeTrainerMixin`` needs on ``dataset`` (the very object given to the trainer).

    ``file_paths`` comes from ``materialise_images``; the ``input_ids``/``attention_mask`` columns
    are read once into int64 arrays. ``mean``/``std`` are the image processor's (0..1 scale).
    """
    if len(dataset) == 0:
        raise ValueError("the media-pipeline loader needs a non-empty data set")
    if len(file_paths) != len(dataset):
        raise ValueError(f"{len(file_paths)} image files for a data set of {len(dataset)} rows")
    if not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    mean, std = _channel_triplet(mean, "mean"), _channel_triplet(std, "std")
    if min(std) <= 0:
        raise ValueError(f"image std must be positive, got {std}")
    input_ids, attention_mask = (_token_array(dataset, column) for column in ("input_ids", "attention_mask"))
    inputs = MediaPipeInputs(list(file_paths), input_ids, attention_mask, image_size, mean, std)
    setattr(dataset, _INPUTS_ATTRIBUTE, inputs)
    return inputs


def mediapipe_inputs_of(dataset) -> MediaPipeInputs:
    """The inputs ``attach_mediapipe_inputs`` stored on ``dataset``."""
    inputs = getattr(dataset, _INPUTS_ATTRIBUTE, None)
    if inputs is None:
        raise ValueError("this data set has no media-pipeline inputs: call attach_mediapipe_inputs() on it first")
    return inputs


def _channel_triplet(values, name: str) -> tuple[float, float, float]:
    values = tuple(float(v) for v in values)
    if len(values) != 3:
        raise ValueError(f"image {name} must have 3 values (R, G, B), got {values}")
    return values


def _token_array(dataset, column: str) -> np.ndarray:
    if column not in dataset.column_names:
        raise ValueError(f"the data set has no '{column}' column: tokenize the captions first")
    values = dataset.with_format("numpy", columns=[column])[:][column]
    if values.dtype == object or values.ndim != 2:
        raise ValueError(f"'{column}' rows differ in length: tokenize with padding='max_length'")
    return values.astype(np.int64, copy=False)


# ----------------------------------------------------------------------------------------
# Batches in the trainer's sampler order (the pure-Python part of the reader node)
# ----------------------------------------------------------------------------------------


class SamplerBatchReader:
    """Groups a sampler's indices into batches of (file paths, input_ids, attention_mask).

    Iterating yields ``(list[str], int64 [B, L], int64 [B, L])`` per batch in the sampler's order,
    so a ``DistributedSampler`` shards ranks and, after ``set_epoch``, reshuffles per epoch. The
    last partial batch is kept unless ``drop_last``.
    """

    def __init__(self, file_paths, input_ids, attention_mask, sampler, batch_size: int, drop_last: bool):
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
        self.input_ids = _as_token_matrix(input_ids, "input_ids")
        self.attention_mask = _as_token_matrix(attention_mask, "attention_mask")
        self.file_paths = list(file_paths)
        if not len(self.file_paths) == len(self.input_ids) == len(self.attention_mask):
            raise ValueError(
                f"{len(self.file_paths)} file paths, {len(self.input_ids)} input_ids rows and "
                f"{len(self.attention_mask)} attention_mask rows: they must match"
            )
        if self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(f"input_ids {self.input_ids.shape} and attention_mask {self.attention_mask.shape} differ")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler (a DistributedSampler seeds its shuffle with it)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        samples = len(self.sampler)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
        indices: list[int] = []
        for index in self.sampler:
            indices.append(int(index))
            if len(indices) == self.batch_size:
                yield self._batch(indices)
                indices = []
        if indices and not self.drop_last:
            yield self._batch(indices)

    def _batch(self, indices: list[int]):
        rows = np.asarray(indices, dtype=np.int64)
        return [self.file_paths[i] for i in indices], self.input_ids[rows], self.attention_mask[rows]


def _as_token_matrix(values, name: str) -> np.ndarray:
    try:
        matrix = np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a rectangular array of integers: {error}") from error
    if matrix.ndim != 2:
        raise ValueError(f"{name} must have shape [rows, max_seq_length], got {matrix.shape}")
    return matrix


# ----------------------------------------------------------------------------------------
# The media pipeline (Gaudi only)
# ----------------------------------------------------------------------------------------
#
# Habana API names relied on, all imported in _media_api() and nowhere else (the same ones
# optimum-habana's contrastive-image-text example uses with habana-media-loader):
#   habana_frameworks.mediapipe.mediapipe.MediaPipe(device, batch_size, prefetch_depth, pipe_name),
#       subclassed with definegraph();
#   habana_frameworks.mediapipe.fn.MediaExtReaderOp(impl, num_outputs, priv_params) with
#       operators.reader_nodes.reader_nodes.media_ext_reader_op_impl (__init__(params, fw_params),
#       __len__, __iter__, __next__, gen_output_info, get_largest_file, get_media_output_type)
#       and media_ext_reader_op_tensor_info(dtype, shape innermost-first, layout);
#   fn.ImageDecoder(device="hpu", output_format=imgtype.RGB_P, random_crop_type=
#       randomCropType.CENTER_CROP, resize=[w, h], resampling_mode=ftype.BICUBIC);
#   fn.MediaConst(data, shape, dtype); fn.CropMirrorNorm(crop_w, crop_h, crop_pos_x, crop_pos_y,
#       crop_d, dtype) taking (images, mean, inv_std) on the 0..255 scale;
#   media_types dtype.NDT/UINT32/FLOAT32, readerOutType.FILE_LIST;
#   plugins.iterator_pytorch.HPUGenericPytorchIterator(mediapipe=...): iter() restarts the
#       pipeline, next() returns the graph outputs as torch tensors on the HPU;
#   MediaPipe.del_iter() (stops the pipeline's worker, frees its device memory, releases the
#       device) and MediaPipe.close() (frees the compiled graph); both do nothing when repeated.
#
# Geometry: the decoder cannot resize each image to its own aspect-preserving size (a batch has
# one output shape), so it takes the centred square of side min(width, height) and resizes that to
# image_size x image_size with its bicubic filter. Upstream's PyTorch path resizes the shorter side
# to image_size first (longer side int(size * long / short)) and then centre-crops: the same image
# region up to under one output pixel of offset, but not bit-exact (different resampling kernel;
# torchvision antialiases in float). CropMirrorNorm's crop is then the whole image; it normalises.


def _media_api():
    """Import the Habana media-pipeline names this module relies on (Gaudi only)."""
    from types import SimpleNamespace

    from habana_frameworks.mediapipe import fn
    from habana_frameworks.mediapipe.media_types import dtype, ftype, imgtype, randomCropType, readerOutType
    from habana_frameworks.mediapipe.mediapipe import MediaPipe
    from habana_frameworks.mediapipe.operators.reader_nodes.reader_nodes import (
        media_ext_reader_op_impl,
        media_ext_reader_op_tensor_info,
    )
    from habana_frameworks.mediapipe.plugins.iterator_pytorch import HPUGenericPytorchIterator

    return SimpleNamespace(
        fn=fn,
        dtype=dtype,
        ftype=ftype,
        imgtype=imgtype,
        randomCropType=randomCropType,
        readerOutType=readerOutType,
        MediaPipe=MediaPipe,
        media_ext_reader_op_impl=media_ext_reader_op_impl,
        media_ext_reader_op_tensor_info=media_ext_reader_op_tensor_info,
        HPUGenericPytorchIterator=HPUGenericPytorchIterator,
    )


MAX_PREFETCH_DEPTH = 3  # Habana documents prefetch depths 1 to 3


def prefetch_depth_for(num_workers: int) -> int:
    """Media-pipeline prefetch depth for ``--dataloader_num_workers``.

    The pipeline has no worker processes: the host only lists file names, the device decodes. What
    workers buy the PyTorch loader, batches prepared ahead, is the pipeline's prefetch depth:
    ``num_workers + 1`` batches in flight, capped at 3, the deepest Habana documents. The published
    "workers=2 + mediapipe" run thus gets depth 3, the fixed depth upstream used.
    """
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"--dataloader_num_workers must be a non-negative integer, got {num_workers!r}")
    return min(num_workers + 1, MAX_PREFETCH_DEPTH)


def normalisation_constants(mean, std) -> tuple[np.ndarray, np.ndarray]:
    """CropMirrorNorm's (mean, inv_std) on the 0..255 scale: (x - m) * s == (x / 255 - mean) / std."""
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    return (mean * 255.0).astype(np.float32), (1.0 / (std * 255.0)).astype(np.float32)


def pad_batch_for_pipeline(paths, input_ids, attention_mask, batch_size: int):
    """A batch as the reader node hands it over: always ``batch_size`` rows.

    The pipeline's shapes are fixed, so a short last batch is padded by repeating its last file
    (and zero tokens); the loader trims the padding off the decoded images. Tokens travel as uint32
    like upstream's reader; the loader itself yields the exact int64 host arrays.
    """
    missing = batch_size - len(paths)
    files = list(paths) + [paths[-1]] * missing
    pad = ((0, missing), (0, 0))
    return (
        files,
        np.pad(input_ids.astype(np.uint32), pad),
        np.pad(attention_mask.astype(np.uint32), pad),
    )


class _EpochPlan:
    """The batches of the epoch being read, shared by a loader and its reader node."""

    def __init__(self):
        self.batches: list = []


# Reader nodes find their loader's plan by key: the pipeline may copy its params, a string survives.
_EPOCH_PLANS: weakref.WeakValueDictionary[str, _EpochPlan] = weakref.WeakValueDictionary()


def _reader_node_class(api):
    class SamplerReaderNode(api.media_ext_reader_op_impl):
        """Media reader node: hands the decoder the current epoch's files, batch by batch."""

        def __init__(self, params, fw_params):
            private = params["priv_params"]
            if private["plan_key"] not in _EPOCH_PLANS:
                raise RuntimeError("media reader node started without its loader (was the pipeline copied?)")
            self._plan = _EPOCH_PLANS[private["plan_key"]]
            self._num_batches = private["num_batches"]
            self._largest_file = private["largest_file"]
            self._seq_length = private["max_seq_length"]
            self._batch_size = fw_params.batch_size
            self._batches = iter(())

        def __len__(self):
            return self._num_batches

        def __iter__(self):
            self._batches = iter(self._plan.batches)
            return self

        def __next__(self):
            return pad_batch_for_pipeline(*next(self._batches), self._batch_size)

        def get_media_output_type(self):
            return api.readerOutType.FILE_LIST

        def get_largest_file(self):
            return self._largest_file

        def gen_output_info(self):
            files_shape = np.array([self._batch_size], dtype=np.uint32)
            tokens_shape = np.array([self._seq_length, self._batch_size], dtype=np.uint32)  # innermost first
            info = api.media_ext_reader_op_tensor_info
            return [
                info(api.dtype.NDT, files_shape, ""),
                info(api.dtype.UINT32, tokens_shape, ""),
                info(api.dtype.UINT32, tokens_shape, ""),
            ]

    return SamplerReaderNode


def _pipe_class(api):
    class BridgeTowerMediaPipe(api.MediaPipe):
        """read files -> HPU decode (centre square, resize) -> crop + normalise (CropMirrorNorm)."""

        def __init__(self, *, batch_size, prefetch_depth, pipe_name, reader_params, image_size, mean, std):
            super().__init__(
                device="legacy", batch_size=batch_size, prefetch_depth=prefetch_depth, pipe_name=pipe_name
            )
            fn = api.fn
            mean_255, inv_std_255 = normalisation_constants(mean, std)
            self._read = fn.MediaExtReaderOp(impl=_reader_node_class(api), num_outputs=3, priv_params=reader_params)
            self._decode = fn.ImageDecoder(
                device="hpu",
                output_format=api.imgtype.RGB_P,
                random_crop_type=api.randomCropType.CENTER_CROP,
                resize=[image_size, image_size],
                resampling_mode=api.ftype.BICUBIC,
            )
            self._mean = fn.MediaConst(data=mean_255, shape=[1, 1, 3], dtype=api.dtype.FLOAT32)
            self._inv_std = fn.MediaConst(data=inv_std_255, shape=[1, 1, 3], dtype=api.dtype.FLOAT32)
            self._normalise = fn.CropMirrorNorm(
                crop_w=image_size, crop_h=image_size, crop_pos_x=0.5, crop_pos_y=0.5, crop_d=0, dtype=api.dtype.FLOAT32
            )

        def definegraph(self):
            files, input_ids, attention_mask = self._read()
            images = self._normalise(self._decode(files), self._mean(), self._inv_std())
            return images, input_ids, attention_mask

    return BridgeTowerMediaPipe


class MediaPipeDataLoader(DataLoaderStateMixin):
    """Batches decoded and normalised on the HPU, in the order of ``sampler``.

    Yields ``{"pixel_values": float32 [B, 3, S, S] on the HPU, "input_ids", "attention_mask": int64
    [B, L], "return_loss": True}`` like the PyTorch collate. ``len()`` is the number of batches;
    ``set_epoch`` reaches the sampler. ``num_workers`` sets the prefetch depth (``prefetch_depth_for``).
    One pipeline per loader, built once and restarted each epoch; ``close()`` releases it (its
    device memory and decoder), as does dropping the loader or the end of the process.
    Like accelerate's own loaders it keeps the GradientState informed, so ``gather_for_metrics``
    drops the samples a sharded evaluation padded (``world_size`` = number of ranks).

    Only constructible where ``mediapipe_unavailable_reason()`` is None; ``dataset`` must carry
    ``attach_mediapipe_inputs``' inputs.
    """

    _instances = itertools.count()

    def __init__(
        self, dataset, sampler, batch_size: int, *, drop_last: bool = False, num_workers: int = 0, world_size: int = 1
    ):
        reason = mediapipe_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the media-pipeline loader cannot run here: {reason}")
        inputs = mediapipe_inputs_of(dataset)
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.prefetch_depth = prefetch_depth_for(num_workers)
        self._reader = SamplerBatchReader(
            inputs.file_paths, inputs.input_ids, inputs.attention_mask, sampler, batch_size, drop_last
        )
        # accelerate's DataLoaderStateMixin bookkeeping (read by begin()):
        self.gradient_state = GradientState()
        self._drop_last = drop_last
        self.total_batch_size = batch_size * world_size

        self._plan = _EpochPlan()
        plan_key = f"bridgetower-mediapipe-{next(self._instances)}"
        _EPOCH_PLANS[plan_key] = self._plan
        self._num_batches = len(self._reader)
        api = _media_api()
        pipe = _pipe_class(api)(
            batch_size=batch_size,
            prefetch_depth=self.prefetch_depth,
            pipe_name=plan_key,
            reader_params={
                "plan_key": plan_key,
                "num_batches": self._num_batches,
                "largest_file": max(set(inputs.file_paths), key=os.path.getsize),
                "max_seq_length": int(inputs.input_ids.shape[1]),
            },
            image_size=inputs.image_size,
            mean=inputs.mean,
            std=inputs.std,
        )
        self._iterator = api.HPUGenericPytorchIterator(mediapipe=pipe)
        self._release = weakref.finalize(self, _release_pipeline, pipe, plan_key)  # also runs at exit

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def close(self) -> None:
        """Release the pipeline's device memory and decoder; the loader cannot be iterated after."""
        self._release()

    def __len__(self) -> int:
        return self._num_batches

    def set_epoch(self, epoch: int) -> None:
        self._reader.set_epoch(epoch)

    def __iter__(self):
        if self.closed:
            raise RuntimeError("this media-pipeline loader was closed")
        batches = list(self._reader)  # the epoch's order, fixed before the pipeline starts reading it
        if len(batches) != self._num_batches:
            raise RuntimeError(f"the sampler gave {len(batches)} batches this epoch, {self._num_batches} expected")
        self._plan.batches = batches
        self.begin()
        try:
            iter(self._iterator)  # restarts the pipeline; its reader node now walks `batches`
            for number, (paths, input_ids, attention_mask) in enumerate(batches):
                self.end_of_dataloader = number == len(batches) - 1
                pixel_values = next(self._iterator)[0]
                if pixel_values.shape[0] != len(paths):  # drop the padding of a short last batch
                    pixel_values = pixel_values[: len(paths)]
                yield {
                    "pixel_values": pixel_values,
                    "input_ids": torch.from_numpy(input_ids),
                    "attention_mask": torch.from_numpy(attention_mask),
                    "return_loss": True,
                }
        finally:
            self.end()


def _release_pipeline(pipe, plan_key: str) -> None:
    """Stop a media pipeline and free what it holds on the device (the loader's finalizer)."""
    _EPOCH_PLANS.pop(plan_key, None)
    try:
        pipe.del_iter()
    finally:
        pipe.close()


# ----------------------------------------------------------------------------------------
# Trainer integration
# ----------------------------------------------------------------------------------------


class MediaPipeTrainerMixin:
    """Mixed in front of the script's trainer class: data loaders come from the media pipeline.

    ``class MediaPipeTrainer(MediaPipeTrainerMixin, BridgeTowerTrainer)``. Every data set given to
    the trainer must carry ``attach_mediapipe_inputs``' inputs. The batches follow the trainer's own
    samplers; on several ranks, where the trainer would let accelerate shard a plain sampler, the
    mixin shards the same way itself: training with a DistributedSampler (looping to full batches
    unless --dataloader_drop_last, like GaudiTrainer's padding), evaluation batch-round-robin like
    accelerate (transformers' ShardSampler), so ``gather_for_metrics`` trims the padding.

    Each data set gets one pipeline per role (training, evaluation), built on first use and reused:
    evaluating every N steps does not pile up pipelines. The training pipeline is released when
    ``train()`` returns, the others by ``release_media_pipelines()``, when the trainer is dropped,
    or at the end of the process.
    """

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        batch_size = getattr(self, "_train_batch_size", None) or self.args.train_batch_size
        sampler = self._mediapipe_train_sampler(self.train_dataset, batch_size)
        return self._mediapipe_loader("train", self.train_dataset, sampler, batch_size)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        return self._mediapipe_eval_loader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        return self._mediapipe_eval_loader(test_dataset)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # Resuming mid-epoch makes the trainer rebuild the loader with accelerate's
        # skip_first_batches, which only knows PyTorch DataLoaders.
        if resume_from_checkpoint not in (None, False) and not self.args.ignore_data_skip:
            logger.warning(
                "--mediapipe_dataloader cannot skip the batches already trained in the resumed epoch: "
                "that epoch restarts from its first batch (as with --ignore_data_skip)"
            )
            self.args.ignore_data_skip = True
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.release_media_pipelines(role="train")

    def release_media_pipelines(self, role: Optional[str] = None) -> None:
        """Release the media pipelines built so far (only ``role``'s: "train" or "eval", if given)."""
        loaders = self.__dict__.get("_media_pipeline_loaders", {})
        for key in [key for key in loaders if role in (None, key[0])]:
            loaders.pop(key).close()

    def _mediapipe_eval_loader(self, dataset):
        batch_size = self.args.eval_batch_size
        loader = self.__dict__.get("_media_pipeline_loaders", {}).get(("eval", id(dataset), batch_size))
        if loader is not None:  # (it holds the data set, so the id names that one) sequential: same batches again
            return loader
        return self._mediapipe_loader("eval", dataset, self._mediapipe_eval_sampler(dataset, batch_size), batch_size)

    def _mediapipe_loader(self, role, dataset, sampler, batch_size):
        loaders = self.__dict__.setdefault("_media_pipeline_loaders", {})
        key = (role, id(dataset), batch_size)
        if key in loaders:  # a data set given again (another train() call): its old pipeline goes first
            loaders.pop(key).close()
        loaders[key] = MediaPipeDataLoader(
            dataset,
            sampler,
            batch_size,
            drop_last=self.args.dataloader_drop_last,
            num_workers=self.args.dataloader_num_workers,
            world_size=self.args.world_size,
        )
        return loaders[key]

    def _mediapipe_train_sampler(self, dataset, batch_size):
        sampler = self._get_train_sampler()
        if self.args.world_size <= 1:
            return sampler if sampler is not None else SequentialSampler(dataset)
        shard = dict(
            num_replicas=self.args.world_size,
            rank=self.args.process_index,
            shuffle=_shuffles(sampler, self.args.world_size),
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
        )
        if self.args.dataloader_drop_last:
            return DistributedSampler(dataset, drop_last=True, **shard)
        return DistributedSamplerWithLoop(dataset, batch_size=batch_size, **shard)

    def _mediapipe_eval_sampler(self, dataset, batch_size):
        sampler = self._get_eval_sampler(dataset)
        if self.args.world_size <= 1:
            return sampler if sampler is not None else SequentialSampler(dataset)
        if _shuffles(sampler, self.args.world_size):
            raise ValueError("--mediapipe_dataloader expects a sequential evaluation sampler")
        return ShardSampler(
            dataset,
            batch_size=batch_size,
            drop_last=self.args.dataloader_drop_last,
            num_processes=self.args.world_size,
            process_index=self.args.process_index,
        )


def _shuffles(sampler, world_size: int) -> bool:
    """Whether the trainer's (rank-unaware) sampler shuffles; other kinds cannot be sharded here."""
    if isinstance(sampler, RandomSampler):
        return True
    if sampler is None or isinstance(sampler, SequentialSampler):
        return False
    raise ValueError(
        f"--mediapipe_dataloader on {world_size} devices shards random or sequential sampling only, "
        f"not {type(sampler).__name__} (drop --group_by_length)"
    )


def feed_media_pipeline(
    dataset, image_column: str, image_size: int, mean, std, num_proc=None, cache_dir=None
) -> MediaPipeInputs:
    """What the Gaudi script calls per split: image files on disk for the HPU decoder, then the loader's inputs."""
    cache_dir = bench_cache_dir("mediapipe_images", cache_dir)  # under $HF_HOME, else $XDG_CACHE_HOME, else ~/.cache
    paths = materialise_images(dataset, image_column, cache_dir, dataset._fingerprint, num_proc)
    return attach_mediapipe_inputs(dataset, paths, image_size, mean, std)

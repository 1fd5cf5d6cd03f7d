"""Decode and resize JPEG images on the training device (nvJPEG through torchvision), fed with encoded bytes.

The idea of NVIDIA DALI and Habana's media pipeline, built from plain PyTorch parts:

* **Loader workers** (``EncodedImageTransform`` in place of the image transform, ``collate_encoded`` as the
  collator) only read the encoded bytes. A JPEG the GPU decoder takes (baseline, extended or progressive,
  8-bit, 1 or 3 components) travels as its bytes; anything else (PNG, CMYK/YCCK JPEG, ...) is decoded and
  resized on the host by the ``fast`` pipeline, image by image, and travels as uint8 pixels. A batch packs
  all of it into one ``EncodedBatch`` object, which transformers' ``Trainer`` passes through untouched
  (it only moves tensors, lists and dicts to the device).
* **The trainer** (``DeviceDecodeTrainerMixin``) turns the ``EncodedBatch`` into uint8 ``pixel_values`` on
  the device with ``decode_batch``: one batched ``decode_jpeg`` call per chunk of images, then upstream's
  resize geometry with antialiased bicubic interpolation in float, rounded back to uint8, and the centre
  crop. ``TrainerExtensions`` then normalises them, as it does for the host ``fast`` pipeline.
* **Overlap** (CUDA): the next batch is read from the loader and decoded in a helper thread, on a side CUDA
  stream, while the current step runs; the step's stream waits on an event recorded after that batch's
  decode. torchvision's nvJPEG call blocks its caller until the decode is done, and with
  ``--dataloader_num_workers 0`` reading the rows is host work too, so the helper thread is what lets the
  training thread keep queueing the step's kernels meanwhile.

Every image the device decoder does not take is counted (``device_decode_stats``) and the count is logged
once per epoch and per evaluation, so a run that silently decoded on the host cannot pass for a device
decode run. On a CPU device the same code runs with torchvision's CPU ``decode_jpeg``, which is what the
tests exercise.

A correctness and speed check on real hardware: ``python -m bridgetower_bench.tools.device_decode_check``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from transformers import TrainerCallback

from bridgetower_bench.guards.resilience import ImageLoadError
from bridgetower_bench.images.images import (
    FastTransform,
    encoded_image_bytes,
    image_source,
    jpeg_orientation,
    resize_geometry,
    upright_tensor,
)
from bridgetower_bench.images.jpeg_headers import JPEG_MAGIC, read_jpeg_header


logger = logging.getLogger(__name__)

ENCODED_IMAGES_KEY = "encoded_images"
DEFAULT_CHUNK_SIZE = 64

# ----------------------------------------------------------------------------------------------------------
# Which images the GPU decoder takes: magic bytes and the JPEG frame header
# ----------------------------------------------------------------------------------------------------------

_OTHER_FORMATS = (
    (b"\x89PNG", "PNG image"),
    (b"GIF8", "GIF image"),
    (b"BM", "BMP image"),
    (b"II*\x00", "TIFF image"),
    (b"MM\x00*", "TIFF image"),
)
_DECODABLE_FRAMES = (0xC0, 0xC1, 0xC2)  # baseline, extended sequential, progressive: what nvJPEG decodes


def device_decoder_declines(data: bytes) -> Optional[str]:
    """None when the GPU JPEG decoder takes these bytes; otherwise why not (the fallback reason)."""
    if not data.startswith(JPEG_MAGIC):
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return "WebP image"
        return next((name for magic, name in _OTHER_FORMATS if data.startswith(magic)), "not a JPEG")
    frame = read_jpeg_header(data)
    if frame is None:
        return "JPEG without a readable frame header"
    if frame.marker not in _DECODABLE_FRAMES:
        return "lossless, hierarchical or arithmetic-coded JPEG"
    if frame.precision != 8:
        return f"{frame.precision}-bit JPEG"
    if frame.components == 4:
        return "CMYK/YCCK JPEG"
    if frame.components not in (1, 3):
        return f"JPEG with {frame.components} components"
    if frame.components == 3 and (frame.adobe_transform == 0 or frame.component_ids == b"RGB"):
        return "RGB-coded JPEG"  # colour stored without the YCbCr transform: leave it to the host's libjpeg
    return None


# ----------------------------------------------------------------------------------------------------------
# Loader side: one image -> EncodedImage; a batch -> EncodedBatch
# ----------------------------------------------------------------------------------------------------------


@dataclass
class EncodedImage:
    """One image as a loader worker ships it: JPEG bytes for the device, or pixels decoded on the host."""

    image_size: int
    jpeg: Optional[torch.Tensor] = None  # uint8, 1-D: the encoded file
    pixels: Optional[torch.Tensor] = None  # uint8 (3, S, S): the host `fast` pipeline's output
    fallback_reason: Optional[str] = None  # why the host decoded it
    orientation: Optional[int] = None  # the JPEG's EXIF orientation tag: the device turns the decoded image by it


class EncodedImageTransform:
    """Per-image transform for device decoding: ``value -> EncodedImage``. Picklable.

    Takes the same image values as the host pipelines (``{"bytes", "path"}`` dicts, paths, raw bytes, PIL
    images). Images the device decoder would decline are decoded here with the ``fast`` pipeline.
    """

    def __init__(self, image_size: int):
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
            raise ValueError(f"image_size must be a positive integer; got {image_size!r}")
        self.image_size = image_size
        self.host_transform = FastTransform(image_size)  # what make_image_transform("fast", ...) returns

    def __call__(self, value: Any) -> EncodedImage:
        if isinstance(value, Image.Image):
            return self._on_host(value, "already decoded (PIL image)")
        data, _ = encoded_image_bytes(value)
        reason = device_decoder_declines(data)
        if reason is not None:
            # Hand the host path the bytes already read, with the path kept for its error messages.
            return self._on_host({"bytes": data, "path": _path_of(value)}, reason)
        jpeg = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return EncodedImage(self.image_size, jpeg=jpeg, orientation=jpeg_orientation(data))

    def _on_host(self, value: Any, reason: str) -> EncodedImage:
        return EncodedImage(self.image_size, pixels=self.host_transform(value), fallback_reason=reason)


def _path_of(value: Any) -> Optional[str]:
    """The file path an image value names, if any (for error messages)."""
    source = image_source(value)
    return os.fspath(source.path) if source is not None and source.path else None


class EncodedBatch:
    """A batch of images for ``decode_batch``: all JPEG bytes in one tensor, plus the host-decoded pixels.

    One packed tensor (rather than one per image) keeps the hand-over from a worker process to one
    shared-memory block per batch. Deliberately neither a tensor, a mapping, a sequence, nor anything with
    a ``to`` method: the trainer and accelerate then leave it on the host as it is.
    """

    def __init__(
        self,
        size: int,
        image_size: int,
        jpeg_data: torch.Tensor,
        jpeg_lengths: list[int],
        jpeg_positions: list[int],
        host_pixels: torch.Tensor,
        host_positions: list[int],
        host_reasons: list[str],
        jpeg_orientations: Optional[list[Optional[int]]] = None,
    ):
        self.size = size
        self.image_size = image_size
        self.jpeg_data = jpeg_data
        self.jpeg_lengths = jpeg_lengths
        self.jpeg_positions = jpeg_positions
        self.host_pixels = host_pixels
        self.host_positions = host_positions
        self.host_reasons = host_reasons
        self.jpeg_orientations = jpeg_orientations or [None] * len(jpeg_lengths)

    @classmethod
    def pack(cls, images: Sequence[EncodedImage]) -> EncodedBatch:
        if not images:
            raise ValueError("cannot collate an empty batch of images")
        sizes = {image.image_size for image in images}
        if len(sizes) != 1:
            raise ValueError(f"images of one batch were prepared for different image sizes: {sorted(sizes)}")
        image_size = sizes.pop()
        jpegs = [(i, image.jpeg) for i, image in enumerate(images) if image.jpeg is not None]
        hosts = [(i, image) for i, image in enumerate(images) if image.jpeg is None]
        empty = torch.empty(0, dtype=torch.uint8)
        return cls(
            size=len(images),
            image_size=image_size,
            jpeg_data=torch.cat([data for _, data in jpegs]) if jpegs else empty,
            jpeg_lengths=[int(data.numel()) for _, data in jpegs],
            jpeg_positions=[i for i, _ in jpegs],
            host_pixels=torch.stack([image.pixels for _, image in hosts])
            if hosts
            else empty.view(0, 3, image_size, image_size),
            host_positions=[i for i, _ in hosts],
            host_reasons=[image.fallback_reason or "decoded on the host" for _, image in hosts],
            jpeg_orientations=[images[i].orientation for i, _ in jpegs],
        )

    def jpegs(self) -> list[torch.Tensor]:
        """The JPEG files as 1-D uint8 views into the packed tensor (contiguous, as decode_jpeg needs)."""
        return list(torch.split(self.jpeg_data, self.jpeg_lengths)) if self.jpeg_lengths else []

    def __repr__(self) -> str:
        return f"EncodedBatch({self.size} images: {len(self.jpeg_lengths)} JPEG for the device, {len(self.host_positions)} host-decoded)"


def collate_encoded(examples: list[dict]) -> dict:
    """Like ``data.collate_fn``, with the images packed into one ``EncodedBatch`` under ``"encoded_images"``."""
    images = [example["pixel_values"] for example in examples]
    for image in images:
        if not isinstance(image, EncodedImage):
            raise ValueError(
                f"collate_encoded needs images prepared by EncodedImageTransform; got {type(image).__name__} "
                "(was the data set's transform built with EncodedImageTransform?)"
            )
    return {
        ENCODED_IMAGES_KEY: EncodedBatch.pack(images),
        "input_ids": torch.tensor([example["input_ids"] for example in examples], dtype=torch.long),
        "attention_mask": torch.tensor([example["attention_mask"] for example in examples], dtype=torch.long),
        "return_loss": True,
    }


# ----------------------------------------------------------------------------------------------------------
# Device side: EncodedBatch -> uint8 (B, 3, S, S) on the device
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DecodeCounts:
    """How many images were decoded on the device, and how many on the host instead (and why)."""

    device_images: int = 0
    fallback_reasons: Counter = field(default_factory=Counter)

    @property
    def fallback_images(self) -> int:
        return sum(self.fallback_reasons.values())

    def add(self, other: DecodeCounts) -> None:
        self.device_images += other.device_images
        self.fallback_reasons.update(other.fallback_reasons)

    def metrics(self) -> dict:
        return {"device_decode_images": self.device_images, "device_decode_fallback_images": self.fallback_images}

    def describe(self) -> str:
        text = f"{self.device_images} images decoded on the device, {self.fallback_images} on the host"
        if self.fallback_reasons:
            text += " (" + ", ".join(f"{reason}: {n}" for reason, n in self.fallback_reasons.most_common()) + ")"
        return text


def resize_and_crop_on_device(pixels: torch.Tensor, image_size: int) -> torch.Tensor:
    """uint8 (3, H, W) -> uint8 (3, S, S) with upstream's geometry, on the tensor's device.

    Antialiased bicubic interpolation (upstream's filter) computed in float32 as two passes, width first,
    each rounded and clamped to uint8. That is the pass order and the intermediate rounding of the uint8
    kernel the host ``fast`` pipeline uses, so the two agree to about 0.005/255 on average; a single float
    pass would differ from ``fast`` by about 0.15/255 (as ``fast`` differs from upstream). Then the crop.
    """
    height, width = pixels.shape[-2:]
    new_w, new_h, top, left = resize_geometry(width, height, image_size)
    resized = pixels
    if new_w != width:
        resized = _bicubic_uint8(resized, (resized.shape[-2], new_w))
    if new_h != height:
        resized = _bicubic_uint8(resized, (new_h, new_w))
    return resized[:, top : top + image_size, left : left + image_size]


def _bicubic_uint8(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """One antialiased bicubic resize of a uint8 (C, H, W) tensor, in float, rounded back to uint8."""
    resized = F.interpolate(
        pixels.unsqueeze(0).float(), size=size, mode="bicubic", antialias=True, align_corners=False
    )
    return resized[0].round_().clamp_(0, 255).to(torch.uint8)


def _decode_chunk(jpegs: list[torch.Tensor], device: torch.device) -> list[Optional[torch.Tensor]]:
    """One batched decode_jpeg call; if it fails, the chunk again image by image (None: declined)."""
    try:
        return list(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        if len(jpegs) == 1:
            return [None]
        return [_decode_chunk([jpeg], device)[0] for jpeg in jpegs]


def _decode_on_host(host_transform: FastTransform, jpeg: torch.Tensor, position: int) -> torch.Tensor:
    """The host fallback for a JPEG the device decoder rejected; ImageLoadError if the host fails too."""
    try:
        return host_transform(jpeg.numpy().tobytes())
    except ValueError as error:
        raise ImageLoadError(f"image {position} of the batch: rejected by the device decoder, and {error}") from error


def decode_batch(
    encoded: EncodedBatch,
    device,
    image_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    counts: Optional[DecodeCounts] = None,
) -> torch.Tensor:
    """Decode, resize and crop a batch on ``device``: uint8 (B, 3, S, S), in the batch's order.

    JPEGs are decoded ``chunk_size`` at a time (one batched ``decode_jpeg`` call each), which bounds the
    device memory held by full-size decoded images. Each decoded JPEG is turned upright by its EXIF
    orientation (read by the loader workers) on the device. A JPEG the decoder rejects is decoded on the host
    with the ``fast`` pipeline instead. ``counts``, if given, is incremented with what ran where.
    """
    device = torch.device(device)
    if image_size != encoded.image_size:
        raise ValueError(f"the batch was prepared for image_size {encoded.image_size}, not {image_size}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1; got {chunk_size}")
    batch_counts = DecodeCounts()
    out = torch.empty((encoded.size, 3, image_size, image_size), dtype=torch.uint8, device=device)
    if encoded.host_positions:
        out[encoded.host_positions] = encoded.host_pixels.to(device)
        batch_counts.fallback_reasons.update(encoded.host_reasons)
    jpegs, positions, orientations = encoded.jpegs(), encoded.jpeg_positions, encoded.jpeg_orientations
    host_transform = None
    for start in range(0, len(jpegs), chunk_size):
        chunk = jpegs[start : start + chunk_size]
        chunk_positions = positions[start : start + chunk_size]
        chunk_orientations = orientations[start : start + chunk_size]
        for jpeg, position, orientation, decoded in zip(
            chunk, chunk_positions, chunk_orientations, _decode_chunk(chunk, device)
        ):
            if decoded is None:
                host_transform = host_transform or FastTransform(image_size)
                out[position] = _decode_on_host(host_transform, jpeg, position).to(device)
                batch_counts.fallback_reasons["rejected by the device decoder"] += 1
            else:
                # the decoder ignores EXIF; the host fallback above turns the image itself
                out[position] = resize_and_crop_on_device(upright_tensor(decoded, orientation), image_size)
                batch_counts.device_images += 1
    if counts is not None:
        counts.add(batch_counts)
    return out


# ----------------------------------------------------------------------------------------------------------
# Trainer side
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DecodedImages:
    """A batch decoded ahead of time: its pixels, the CUDA event that marks them ready, and its counts."""

    pixels: torch.Tensor
    ready: Optional[torch.cuda.Event]
    counts: DecodeCounts


class DecodeAhead:
    """Iterates an epoch's batches while the helper thread reads and decodes the batch after the one returned.

    The helper takes the next batch from the loader (with ``--dataloader_num_workers 0`` that is where the
    data set's rows are read and collated) and decodes it, while the training thread runs the step; the
    training thread only waits when the helper is not done yet, and that wait happens inside the trainer's
    timed fetch, so it counts as data wait. The loader is only ever touched by one thread at a time.
    """

    def __init__(
        self, source: Iterator[dict], helper: ThreadPoolExecutor, decode: Callable[[EncodedBatch], DecodedImages]
    ):
        self.source = source
        self.helper = helper
        self.decode = decode
        self.pending: Optional[Future] = None
        self.exhausted = False

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        pending, self.pending = self.pending, None  # a failed read is reported once
        current = pending.result() if pending is not None else self._read_and_decode()
        if current is None:  # the epoch is over
            raise StopIteration
        self.pending = self.helper.submit(self._read_and_decode)
        return current

    def close(self) -> None:
        """Let a batch read ahead for a step that never runs finish, so the loader is left alone afterwards."""
        if self.pending is not None and not self.pending.cancel():
            wait([self.pending])  # its result (or error) belongs to a step that will not run
        self.pending = None

    def _read_and_decode(self) -> Optional[dict]:
        """The next batch with its ``EncodedBatch`` decoded into ``DecodedImages``; None after the last one."""
        if self.exhausted:
            return None
        try:
            batch = dict(next(self.source))
        except StopIteration:
            self.exhausted = True
            return None
        encoded = batch.get(ENCODED_IMAGES_KEY)
        if isinstance(encoded, EncodedBatch):
            batch[ENCODED_IMAGES_KEY] = self.decode(encoded)
        return batch


class _DecodeReport(TrainerCallback):
    """Logs what was decoded where, once per epoch and once per evaluation or prediction."""

    def __init__(self, trainer: DeviceDecodeTrainerMixin):
        self.trainer = trainer

    def on_epoch_end(self, args, state, control, **kwargs):
        self.trainer._report_decode_counts("train", f"epoch {state.epoch:.2f}")

    def on_evaluate(self, args, state, control, **kwargs):
        self.trainer._report_decode_counts("eval", "evaluation")

    def on_predict(self, args, state, control, **kwargs):
        self.trainer._report_decode_counts("eval", "prediction")


class DeviceDecodeTrainerMixin:
    """Decodes ``EncodedBatch`` images on the training device. Mix in front of the script's trainer::

        class DeviceDecodeTrainer(DeviceDecodeTrainerMixin, BridgeTowerTrainer): ...

    ``_batch_on_device`` (what ``TrainerExtensions`` does to a batch in ``training_step`` and
    ``prediction_step``) first replaces the batch's ``EncodedBatch`` with uint8 ``pixel_values`` on
    ``args.device``, which ``TrainerExtensions`` then normalises exactly as it normalises the host ``fast``
    pipeline's uint8 batches.
    Training, evaluation and prediction all decode here. With ``decode_ahead`` (default: on CUDA devices),
    training batches are read and decoded one batch ahead in a helper thread, on a side CUDA stream.
    """

    def __init__(
        self, *args, decode_chunk_size: int = DEFAULT_CHUNK_SIZE, decode_ahead: Optional[bool] = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        if isinstance(decode_chunk_size, bool) or not isinstance(decode_chunk_size, int) or decode_chunk_size < 1:
            raise ValueError(f"decode_chunk_size must be a positive integer; got {decode_chunk_size!r}")
        self.decode_chunk_size = decode_chunk_size
        self.decode_ahead = self.args.device.type == "cuda" if decode_ahead is None else bool(decode_ahead)
        self._decode_totals = {"train": DecodeCounts(), "eval": DecodeCounts()}
        self._decode_unreported = {"train": DecodeCounts(), "eval": DecodeCounts()}
        self._decode_ahead_iterator: Optional[DecodeAhead] = None
        self._decode_thread: Optional[ThreadPoolExecutor] = None
        self._decode_stream = None
        self.add_callback(_DecodeReport(self))

    # results ---------------------------------------------------------------------------------------------
    def device_decode_stats(self, phase: str = "train") -> dict:
        """``{"device_decode_images": n, "device_decode_fallback_images": m}`` for ``train`` or ``eval``."""
        if phase not in self._decode_totals:
            raise ValueError(f"phase must be one of {sorted(self._decode_totals)}; got {phase!r}")
        return self._decode_totals[phase].metrics()

    def _report_decode_counts(self, phase: str, when: str) -> None:
        counts = self._decode_unreported[phase]
        if counts.device_images == 0 and counts.fallback_images == 0:
            return
        level = logging.WARNING if counts.fallback_images else logging.INFO
        logger.log(level, "device decode, %s: %s", when, counts.describe())
        self._decode_unreported[phase] = DecodeCounts()

    def _count(self, counts: DecodeCounts, phase: str) -> None:
        self._decode_totals[phase].add(counts)
        self._decode_unreported[phase].add(counts)

    # batches -> model inputs -----------------------------------------------------------------------------
    def _batch_on_device(self, inputs, training: bool):
        item = inputs.get(ENCODED_IMAGES_KEY) if isinstance(inputs, dict) else None
        if item is not None:
            inputs = {key: value for key, value in inputs.items() if key != ENCODED_IMAGES_KEY}
            inputs["pixel_values"] = self._pixels_of(item, "train" if training else "eval")
        return super()._batch_on_device(inputs, training)

    def _pixels_of(self, item, phase: str) -> torch.Tensor:
        if isinstance(item, DecodedImages):
            self._count(item.counts, phase)
            if item.ready is not None:  # decoded on the side stream: make this stream wait for it
                stream = torch.cuda.current_stream(item.pixels.device)
                stream.wait_event(item.ready)
                item.pixels.record_stream(stream)
            return item.pixels
        if isinstance(item, EncodedBatch):
            counts = DecodeCounts()
            pixels = decode_batch(item, self.args.device, item.image_size, self.decode_chunk_size, counts)
            self._count(counts, phase)
            return pixels
        raise TypeError(
            f"'{ENCODED_IMAGES_KEY}' holds {type(item).__name__}; expected an EncodedBatch (use collate_encoded)"
        )

    # one batch ahead, on a side stream -------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.decode_ahead:
            if self._decode_ahead_iterator is None or self._decode_ahead_iterator.source is not epoch_iterator:
                self._decode_ahead_iterator = DecodeAhead(
                    epoch_iterator, self._helper_thread(), self._decode_on_side_stream
                )
            epoch_iterator = self._decode_ahead_iterator
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _helper_thread(self) -> ThreadPoolExecutor:
        """The one thread that reads and decodes ahead; on CUDA its current device is this rank's device."""
        if self._decode_thread is None:
            device = self.args.device
            set_device = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
            self._decode_thread = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="device-decode", initializer=set_device[0], initargs=set_device[1]
            )
        return self._decode_thread

    def _decode_on_side_stream(self, encoded: EncodedBatch) -> DecodedImages:
        device = self.args.device
        counts = DecodeCounts()
        if device.type != "cuda":
            return DecodedImages(
                decode_batch(encoded, device, encoded.image_size, self.decode_chunk_size, counts), None, counts
            )
        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(device=device)
        # The current device and stream are per thread: set both in the thread that decodes.
        with torch.cuda.device(device), torch.cuda.stream(self._decode_stream):
            pixels = decode_batch(encoded, device, encoded.image_size, self.decode_chunk_size, counts)
            ready = torch.cuda.Event()
            ready.record(self._decode_stream)
        return DecodedImages(pixels, ready, counts)

    def train(self, *args, **kwargs):
        try:
            result = super().train(*args, **kwargs)
        finally:
            if self._decode_ahead_iterator is not None:  # drop a batch decoded ahead for a step that never ran
                self._decode_ahead_iterator.close()
                self._decode_ahead_iterator = None
        result.metrics.update(self.device_decode_stats("train"))  # saved with the train metrics
        return result

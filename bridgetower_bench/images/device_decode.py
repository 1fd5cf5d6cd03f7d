"""JPEG decoding on the training device (nvJPEG through torchvision), one batch ahead on a side stream
(docs/ARCHITECTURE.md, "Device decoding"; checked on a GPU by ``lab/device_decode_check.py``)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from transformers import TrainerCallback, TrainingArguments

from bridgetower_bench.guards.resilience import ImageLoadError
from bridgetower_bench.images.images import (
    FastTransform,
    encoded_image_bytes,
    image_source,
    jpeg_orientation,
    make_image_transform,
    resize_geometry,
    upright_tensor,
)
from bridgetower_bench.images.jpeg_headers import JPEG_MAGIC, read_jpeg_header


logger = logging.getLogger(__name__)

ENCODED_IMAGES_KEY = "encoded_images"
DEFAULT_CHUNK_SIZE = 64

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


@dataclass
class EncodedImage:
    """One image as a loader worker ships it: JPEG bytes for the device, or pixels decoded on the host."""

    image_size: int
    jpeg: Optional[torch.Tensor] = None  # uint8, 1-D: the encoded file
    pixels: Optional[torch.Tensor] = None  # uint8 (3, S, S): the host `fast` pipeline's output
    fallback_reason: Optional[str] = None  # why the host decoded it
    orientation: Optional[int] = None  # the JPEG's EXIF orientation tag: the device turns the decoded image by it


class EncodedImageTransform:
    """Per-image transform for device decoding, ``value -> EncodedImage``, for every value the host pipelines
    take; an image the device decoder would decline is decoded here by the ``fast`` pipeline. Picklable."""

    def __init__(self, image_size: int):
        self.host_transform = make_image_transform("fast", image_size, (), ())  # refuses an impossible size
        self.image_size = image_size

    def __call__(self, value: Any) -> EncodedImage:
        if isinstance(value, Image.Image):
            return self._on_host(value, "already decoded (PIL image)")
        data, _ = encoded_image_bytes(value)
        reason = device_decoder_declines(data)
        if reason is not None:  # the host path gets the bytes already read, and the path its messages name
            path = getattr(image_source(value), "path", None)
            return self._on_host({"bytes": data, "path": os.fspath(path) if path else None}, reason)
        jpeg = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return EncodedImage(self.image_size, jpeg=jpeg, orientation=jpeg_orientation(data))

    def _on_host(self, value: Any, reason: str) -> EncodedImage:
        return EncodedImage(self.image_size, pixels=self.host_transform(value), fallback_reason=reason)


@dataclass(eq=False, repr=False)
class EncodedBatch:
    """A batch for ``decode_batch``: its JPEGs in one tensor (one shared-memory block from a loader worker) and its
    host-decoded pixels; nothing the trainer or accelerate move (no tensor, mapping, sequence or ``to``)."""

    size: int
    image_size: int
    jpeg_data: torch.Tensor  # the JPEG files, one after the other
    jpeg_lengths: list[int]
    jpeg_positions: list[int]  # where in the batch each JPEG belongs
    host_pixels: torch.Tensor
    host_positions: list[int]
    host_reasons: list[str]
    jpeg_orientations: list[Optional[int]]

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
    jpegs = [i for i, image in enumerate(images) if image.jpeg is not None]
    hosts = [i for i, image in enumerate(images) if image.jpeg is None]
    size = images[0].image_size  # one EncodedImageTransform prepared them all
    encoded = EncodedBatch(
        size=len(images),
        image_size=size,
        jpeg_data=torch.cat([images[i].jpeg for i in jpegs]) if jpegs else torch.empty(0, dtype=torch.uint8),
        jpeg_lengths=[int(images[i].jpeg.numel()) for i in jpegs],
        jpeg_positions=jpegs,
        host_pixels=torch.stack([images[i].pixels for i in hosts])
        if hosts
        else torch.empty((0, 3, size, size), dtype=torch.uint8),
        host_positions=hosts,
        host_reasons=[images[i].fallback_reason or "decoded on the host" for i in hosts],
        jpeg_orientations=[images[i].orientation for i in jpegs],
    )
    return {
        ENCODED_IMAGES_KEY: encoded,
        "input_ids": torch.tensor([example["input_ids"] for example in examples], dtype=torch.long),
        "attention_mask": torch.tensor([example["attention_mask"] for example in examples], dtype=torch.long),
        "return_loss": True,
    }


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
    """uint8 (3, H, W) -> uint8 (3, S, S) with upstream's geometry, on the tensor's device: two float32 passes,
    width first, each rounded to uint8 as the host ``fast`` kernel does (0.005/255 from it; one pass: 0.15/255)."""
    height, width = pixels.shape[-2:]
    new_w, new_h, top, left = resize_geometry(width, height, image_size)
    if new_w != width:
        pixels = _bicubic_uint8(pixels, (height, new_w))
    if new_h != height:
        pixels = _bicubic_uint8(pixels, (new_h, new_w))
    return pixels[:, top : top + image_size, left : left + image_size]


def _bicubic_uint8(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """One antialiased bicubic resize of a uint8 (C, H, W) tensor, in float, rounded back to uint8."""
    resized = F.interpolate(pixels[None].float(), size, mode="bicubic", antialias=True, align_corners=False)
    return resized[0].round_().clamp_(0, 255).to(torch.uint8)


def _decode_chunk(jpegs: list[torch.Tensor], device: torch.device) -> list[Optional[torch.Tensor]]:
    """One batched decode_jpeg call; if it fails, the chunk again image by image (None: declined)."""
    try:
        return list(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        if len(jpegs) == 1:
            return [None]
        return [_decode_chunk([jpeg], device)[0] for jpeg in jpegs]


def decode_batch(
    encoded: EncodedBatch,
    device,
    image_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    counts: Optional[DecodeCounts] = None,
) -> torch.Tensor:
    """Decode, resize and crop a batch on ``device``: uint8 (B, 3, S, S), in the batch's order, counted in
    ``counts`` if given. ``chunk_size`` JPEGs per ``decode_jpeg`` call bound the device memory; a JPEG the
    decoder rejects is decoded by the host ``fast`` pipeline (``ImageLoadError`` when that fails too)."""
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
    jpegs, host_transform = encoded.jpegs(), None
    for start in range(0, len(jpegs), chunk_size):
        for index, decoded in enumerate(_decode_chunk(jpegs[start : start + chunk_size], device), start):
            position = encoded.jpeg_positions[index]
            if decoded is None:
                host_transform = host_transform or FastTransform(image_size)
                try:  # the host pipeline turns the image upright itself
                    out[position] = host_transform(jpegs[index].numpy().tobytes()).to(device)
                except ValueError as error:
                    raise ImageLoadError(
                        f"image {position} of the batch: rejected by the device decoder, and {error}"
                    ) from error
                batch_counts.fallback_reasons["rejected by the device decoder"] += 1
            else:
                upright = upright_tensor(decoded, encoded.jpeg_orientations[index])
                out[position] = resize_and_crop_on_device(upright, image_size)
                batch_counts.device_images += 1
    if counts is not None:
        counts.add(batch_counts)
    return out


@dataclass
class DecodedImages:
    """A batch decoded ahead of time: its pixels, the CUDA event that marks them ready, and its counts."""

    pixels: torch.Tensor
    ready: Optional[torch.cuda.Event]
    counts: DecodeCounts


class DecodeAhead:
    """An epoch's batches, the helper thread reading and decoding the one after the batch returned; the training
    thread waits for it inside the trainer's timed fetch (data wait). One thread at a time touches the loader."""

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
    """Mixed in front of the script's trainer: ``_batch_on_device`` replaces a batch's ``EncodedBatch`` with uint8
    ``pixel_values`` on ``args.device``. ``decode_ahead`` (default: on CUDA) reads and decodes training batches
    one ahead in a helper thread, on a side CUDA stream."""

    args: TrainingArguments  # the trainer's, as what follows this mixin in the trainer's classes
    add_callback: Callable[[TrainerCallback], None]

    def __init__(
        self, *args, decode_chunk_size: int = DEFAULT_CHUNK_SIZE, decode_ahead: Optional[bool] = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.decode_chunk_size = decode_chunk_size
        self.decode_ahead = self.args.device.type == "cuda" if decode_ahead is None else bool(decode_ahead)
        self._decode_totals = {"train": DecodeCounts(), "eval": DecodeCounts()}
        self._decode_unreported = {"train": DecodeCounts(), "eval": DecodeCounts()}
        self._decode_ahead_iterator: Optional[DecodeAhead] = None
        self._decode_thread: Optional[ThreadPoolExecutor] = None
        self._decode_stream: Optional[torch.cuda.Stream] = None
        self.add_callback(_DecodeReport(self))

    def device_decode_stats(self, phase: str = "train") -> dict:
        """``{"device_decode_images": n, "device_decode_fallback_images": m}`` for ``train`` or ``eval``."""
        return self._decode_totals[phase].metrics()

    def _report_decode_counts(self, phase: str, when: str) -> None:
        counts = self._decode_unreported[phase]
        if counts.device_images or counts.fallback_images:
            level = logging.WARNING if counts.fallback_images else logging.INFO
            logger.log(level, "device decode, %s: %s", when, counts.describe())
            self._decode_unreported[phase] = DecodeCounts()

    def _batch_on_device(self, inputs, training: bool):
        item = inputs.get(ENCODED_IMAGES_KEY) if isinstance(inputs, dict) else None
        if item is not None:
            inputs = {key: value for key, value in inputs.items() if key != ENCODED_IMAGES_KEY}
            inputs["pixel_values"] = self._pixels_of(item, "train" if training else "eval")
        return super()._batch_on_device(inputs, training)  # type: ignore[misc]  # trainer.TrainerExtensions'

    def _pixels_of(self, item: DecodedImages | EncodedBatch, phase: str) -> torch.Tensor:
        if isinstance(item, EncodedBatch):
            counts = DecodeCounts()
            pixels = decode_batch(item, self.args.device, item.image_size, self.decode_chunk_size, counts)
            item = DecodedImages(pixels, None, counts)
        self._decode_totals[phase].add(item.counts)
        self._decode_unreported[phase].add(item.counts)
        if item.ready is not None:  # decoded on the side stream: make this stream wait for it
            stream = torch.cuda.current_stream(item.pixels.device)
            stream.wait_event(item.ready)
            item.pixels.record_stream(stream)
        return item.pixels

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.decode_ahead:
            if self._decode_thread is None:  # the one thread that reads and decodes ahead, on this rank's device
                on_cuda = self.args.device.type == "cuda"
                self._decode_thread = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix="device-decode",
                    initializer=torch.cuda.set_device if on_cuda else None,
                    initargs=(self.args.device,) if on_cuda else (),
                )
            if self._decode_ahead_iterator is None or self._decode_ahead_iterator.source is not epoch_iterator:
                self._decode_ahead_iterator = DecodeAhead(
                    epoch_iterator, self._decode_thread, self._decode_on_side_stream
                )
            epoch_iterator = self._decode_ahead_iterator
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _decode_on_side_stream(self, encoded: EncodedBatch) -> DecodedImages:
        device, counts = self.args.device, DecodeCounts()
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

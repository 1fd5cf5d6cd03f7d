"""Device-side JPEG decoding (bridgetower_bench.images.device_decode), run on CPU.

On a CPU device decode_batch uses torchvision's CPU decode_jpeg and otherwise the code a GPU runs (routing,
chunking, resize and crop, the trainer mixin). What it must give is the host `fast` pipeline's pixels.
"""

import io
import pickle
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset
from transformers import Trainer

from bridgetower_bench.arguments import WarmupTrainingArguments
from bridgetower_bench.guards.resilience import ImageLoadError
from bridgetower_bench.images import device_decode
from bridgetower_bench.images.device_decode import (
    ENCODED_IMAGES_KEY,
    DecodeAhead,
    DecodeCounts,
    DeviceDecodeTrainerMixin,
    EncodedImageTransform,
    collate_encoded,
    decode_batch,
    device_decoder_declines,
)
from bridgetower_bench.images.images import FastTransform, normalize_on_device
from bridgetower_bench.tools.cartoons import draw_cartoon, jpeg_bytes
from bridgetower_bench.tools.fixtures import CLIP_MEAN, CLIP_STD
from bridgetower_bench.trainer import TrainerExtensions
from helpers import BOTH_ROUTES, DEVICES, assert_throughput_adds_up, encode, needs_cuda


# torchvision 0.29 deprecates its image decoders in favour of TorchCodec; device decoding stays on torchvision's
# decode_jpeg (nvJPEG) until a GPU can check the move.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
SIZE = 294  # BridgeTower's image size: the real geometry
# The fidelity bound of the image-pipeline issue: mean |difference| <= 0.5/255 in 0..1 pixel units
# (images normalised, then the difference read back in pixel units: divided by 1/std).
TOLERANCE = 0.5 / 255
# Largest single-pixel difference. On the CPU both paths decode with libjpeg-turbo and agree to 2 levels;
# nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's: 6 levels were seen on an H200
# (2026-11-29), with the mean still far inside TOLERANCE (0.02/255 on 193 cartoons).
MAX_LEVELS = {"cpu": 2, "cuda": 8}

# The decode tests also run on a GPU where there is one (nvJPEG instead of libjpeg-turbo): DEVICES.


def cartoon(width, height, seed=0):
    return draw_cartoon(np.random.default_rng(seed), width, height)[0]


def as_batch(values, image_size=SIZE):
    transform = EncodedImageTransform(image_size)
    examples = [{"pixel_values": transform(v), "input_ids": [i], "attention_mask": [1]} for i, v in enumerate(values)]
    return collate_encoded(examples)[ENCODED_IMAGES_KEY]


def host_fast(values, image_size=SIZE):
    return torch.stack([FastTransform(image_size)(v) for v in values])


def normalised_mean_difference(a, b):
    """Mean |difference| of the normalised images, in 0..1 pixel units (each channel times its std)."""
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    difference = normalize_on_device(a, CLIP_MEAN, CLIP_STD) - normalize_on_device(b, CLIP_MEAN, CLIP_STD)
    return (difference.abs() * std).mean().item()


# ---- Pixels: the device path gives the host `fast` pipeline's output ----


@pytest.mark.parametrize("device", DEVICES)
def test_cartoons_and_a_real_photograph_decode_to_the_fast_pipelines_pixels(device):
    # landscape, portrait, square, smaller than S (upscaled), width already S, odd crop offsets
    sizes = [(800, 650), (650, 800), (700, 700), (200, 150), (294, 400), (1001, 613)]
    values = [{"bytes": jpeg_bytes(cartoon(w, h, seed)), "path": None} for seed, (w, h) in enumerate(sizes)]
    batch = as_batch(values)
    assert len(batch.jpeg_positions) == len(values) and not batch.host_positions
    counts = DecodeCounts()
    got = decode_batch(batch, device, SIZE, counts=counts)
    assert got.device.type == device
    got = got.cpu()
    expected = host_fast(values)
    assert got.dtype == torch.uint8 and got.shape == (len(values), 3, SIZE, SIZE)
    assert normalised_mean_difference(got, expected) <= TOLERANCE
    assert (got.int() - expected.int()).abs().max().item() <= MAX_LEVELS[device]
    assert counts.metrics() == {"device_decode_images": len(values), "device_decode_fallback_images": 0}

    matplotlib = pytest.importorskip("matplotlib")
    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    if not path.exists():
        pytest.skip("matplotlib's sample photograph is not installed")
    photo = path.read_bytes()
    values = [photo, encode(Image.open(io.BytesIO(photo)), "JPEG", quality=90, progressive=True)]
    batch = as_batch(values)
    assert batch.jpeg_positions == [0, 1]  # baseline and progressive both go to the device decoder
    got = decode_batch(batch, device, SIZE).cpu()
    assert normalised_mean_difference(got, host_fast(values)) <= TOLERANCE, "a real photograph"


@pytest.mark.parametrize("device", DEVICES)
def test_exif_rotated_and_grey_jpegs_take_the_device_path_turned_upright_and_in_three_equal_channels(device):
    values = []
    for orientation in (3, 6, 8, 5):
        exif = Image.Exif()
        exif[0x0112] = orientation
        values.append(encode(cartoon(500, 380, orientation), "JPEG", exif=exif))
    batch = as_batch(values)
    assert batch.jpeg_positions == [0, 1, 2, 3]  # still decoded on the device, then transposed there
    got = decode_batch(batch, device, SIZE).cpu()
    assert normalised_mean_difference(got, host_fast(values)) <= TOLERANCE  # the host pipeline turns them upright
    grey = encode(cartoon(640, 480).convert("L"), "JPEG")
    batch = as_batch([grey])
    assert batch.jpeg_positions == [0]
    got = decode_batch(batch, device, SIZE).cpu()
    assert got.shape == (1, 3, SIZE, SIZE)
    assert torch.equal(got[0, 0], got[0, 1]) and torch.equal(got[0, 1], got[0, 2]), "grey: three equal channels"
    assert normalised_mean_difference(got, host_fast([grey])) <= TOLERANCE


def test_png_and_cmyk_jpeg_are_decoded_on_the_host_and_counted():
    art = cartoon(500, 400)
    rgba = art.convert("RGBA")
    rgba.putalpha(200)
    values = [jpeg_bytes(art), encode(rgba, "PNG"), encode(art.convert("CMYK"), "JPEG")]
    transform = EncodedImageTransform(SIZE)
    routed = [transform(v) for v in values]
    assert routed[0].jpeg is not None and routed[0].pixels is None
    assert [r.fallback_reason for r in routed[1:]] == ["PNG image", "CMYK/YCCK JPEG"]
    batch = as_batch(values)
    assert batch.jpeg_positions == [0] and batch.host_positions == [1, 2]
    counts = DecodeCounts()
    got = decode_batch(batch, "cpu", SIZE, counts=counts)
    expected = host_fast(values)
    assert torch.equal(got[1:], expected[1:])  # the host path is the fast pipeline itself
    assert normalised_mean_difference(got[:1], expected[:1]) <= TOLERANCE
    assert counts.metrics() == {"device_decode_images": 1, "device_decode_fallback_images": 2}
    assert counts.fallback_reasons == {"PNG image": 1, "CMYK/YCCK JPEG": 1}


def test_chunks_of_any_size_give_the_same_pixels():
    values = [jpeg_bytes(cartoon(300 + 40 * i, 260 + 30 * i, i)) for i in range(5)]
    values.insert(2, encode(cartoon(320, 300), "PNG"))
    batch = as_batch(values)
    whole = decode_batch(batch, "cpu", SIZE, chunk_size=64)
    for chunk_size in (1, 2):
        assert torch.equal(decode_batch(batch, "cpu", SIZE, chunk_size=chunk_size), whole)


def test_an_image_the_decoder_rejects_is_retried_alone_then_decoded_on_the_host(monkeypatch):
    values = [jpeg_bytes(cartoon(320 + 10 * i, 280, i)) for i in range(3)]
    rejected = torch.frombuffer(bytearray(values[1]), dtype=torch.uint8)
    real_decode = device_decode.decode_jpeg
    calls = []

    def picky_decode(jpegs, **kwargs):
        calls.append(len(jpegs))
        if any(torch.equal(j, rejected) for j in jpegs):
            raise RuntimeError("nvjpeg says no")
        return real_decode(jpegs, **kwargs)

    monkeypatch.setattr(device_decode, "decode_jpeg", picky_decode)
    counts = DecodeCounts()
    got = decode_batch(as_batch(values), "cpu", SIZE, counts=counts)
    assert calls == [3, 1, 1, 1]  # the chunk, then each of its images alone
    assert torch.equal(got[1], FastTransform(SIZE)(values[1]))
    assert normalised_mean_difference(got, host_fast(values)) <= TOLERANCE
    assert counts.device_images == 2 and counts.fallback_reasons == {"rejected by the device decoder": 1}


def test_bad_image_values_and_a_rejected_image_the_host_cannot_decode_either_raise_errors_naming_them(monkeypatch):
    transform = EncodedImageTransform(SIZE)
    with pytest.raises(ValueError, match="broken.jpg"):
        transform({"bytes": b"\xff\xd8\xff\xe0 not really a jpeg", "path": "broken.jpg"})
    with pytest.raises(ValueError, match="unsupported image value"):
        transform(42)
    with pytest.raises(ValueError, match="image_size"):
        EncodedImageTransform(0)
    with pytest.raises(ValueError, match="image_size 294, not 128"):
        decode_batch(as_batch([jpeg_bytes(cartoon(300, 300))]), "cpu", 128)

    good = jpeg_bytes(cartoon(320, 280))
    corrupt = good[:600] + bytes(64)  # a sound header, then nothing decodable

    def rejecting_decode(jpegs, **kwargs):
        raise RuntimeError("nvjpeg says no")

    monkeypatch.setattr(device_decode, "decode_jpeg", rejecting_decode)
    with pytest.raises(
        ImageLoadError, match="image 1 of the batch: rejected by the device decoder, and cannot decode"
    ):
        decode_batch(as_batch([good, corrupt]), "cpu", SIZE)


# ---- Which JPEGs the device decoder takes (frame headers built by hand) ----


def jpeg_header(marker=0xC0, precision=8, component_ids=b"\x01\x02\x03", adobe_transform=None):
    segments = b""
    if adobe_transform is not None:
        body = b"Adobe" + b"\x00\x64\x00\x00\x00\x00" + bytes([adobe_transform])
        segments += b"\xff\xee" + (len(body) + 2).to_bytes(2, "big") + body
    frame = bytes([precision]) + (480).to_bytes(2, "big") + (640).to_bytes(2, "big") + bytes([len(component_ids)])
    frame += b"".join(bytes([cid, 0x11, 0]) for cid in component_ids)
    return b"\xff\xd8" + segments + bytes([0xFF, marker]) + (len(frame) + 2).to_bytes(2, "big") + frame + b"\xff\xda"


@pytest.mark.parametrize(
    "data, reason",
    [
        (jpeg_header(), None),
        (jpeg_header(marker=0xC2, component_ids=b"\x01"), None),
        (jpeg_header(marker=0xC9), "lossless, hierarchical or arithmetic-coded JPEG"),
        (jpeg_header(marker=0xC3), "lossless, hierarchical or arithmetic-coded JPEG"),
        (jpeg_header(marker=0xC1, precision=12), "12-bit JPEG"),
        (jpeg_header(component_ids=b"\x01\x02\x03\x04"), "CMYK/YCCK JPEG"),
        (jpeg_header(component_ids=b"\x01\x02\x03\x04", adobe_transform=2), "CMYK/YCCK JPEG"),
        (jpeg_header(adobe_transform=0), "RGB-coded JPEG"),
        (jpeg_header(component_ids=b"RGB"), "RGB-coded JPEG"),
        (jpeg_header(adobe_transform=1), None),
        (jpeg_header()[:12], "JPEG without a readable frame header"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 16, "PNG image"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "WebP image"),
        (b"hello", "not a JPEG"),
    ],
)
def test_device_decoder_declines(data, reason):
    assert device_decoder_declines(data) == reason


# ---- The batch container ----


def test_encoded_batch_is_one_opaque_container_that_survives_pickling_and_other_images_are_refused():
    values = [jpeg_bytes(cartoon(300, 280, i)) for i in range(2)] + [encode(cartoon(300, 280), "PNG")]
    transform = EncodedImageTransform(SIZE)
    batch = collate_encoded(
        [{"pixel_values": transform(v), "input_ids": [i, 7], "attention_mask": [1, 1]} for i, v in enumerate(values)]
    )
    assert set(batch) == {ENCODED_IMAGES_KEY, "input_ids", "attention_mask", "return_loss"}
    assert batch["input_ids"].tolist() == [[0, 7], [1, 7], [2, 7]] and batch["return_loss"] is True
    packed = batch[ENCODED_IMAGES_KEY]
    # Trainer / accelerate move tensors, mappings, sequences and objects with `.to`: this is none of them.
    assert not isinstance(packed, (torch.Tensor, Mapping, list, tuple)) and not hasattr(packed, "to")
    assert packed.jpeg_data.dim() == 1 and packed.host_pixels.shape == (1, 3, SIZE, SIZE)
    copy = pickle.loads(pickle.dumps(packed))  # as a loader worker hands it over
    assert [bytes(j.numpy()) for j in copy.jpegs()] == values[:2]
    assert torch.equal(decode_batch(copy, "cpu", SIZE), decode_batch(packed, "cpu", SIZE))
    foreign = {"pixel_values": torch.zeros(3, 4, 4, dtype=torch.uint8), "input_ids": [1], "attention_mask": [1]}
    with pytest.raises(ValueError, match="EncodedImageTransform"):
        collate_encoded([foreign])


# ---- The trainer mixin: transformers Trainer + TrainerExtensions + DeviceDecodeTrainerMixin on CPU ----

SMALL = 32  # image size for the trainer tests: the geometry is covered above, speed matters here


class CaptionedImages(Dataset):
    """Small cartoons (one of them a PNG) with one token each: the token says which image it is."""

    def __init__(self, n=6):
        self.values = [jpeg_bytes(cartoon(90 + 7 * i, 70 + 5 * i, i)) for i in range(n)]
        self.values[3] = encode(cartoon(80, 100, 3), "PNG")
        self.transform = EncodedImageTransform(SMALL)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        return {"pixel_values": self.transform(self.values[i]), "input_ids": [i], "attention_mask": [1]}

    def expected_pixels(self):
        """What the host fast pipeline + normalize_on_device give, per image."""
        return normalize_on_device(host_fast(self.values, SMALL), CLIP_MEAN, CLIP_STD)


class RecordingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.seen = []  # (training?, token ids, pixel values)

    def forward(self, input_ids, attention_mask, pixel_values, return_loss=True):
        self.seen.append((self.training, input_ids[:, 0].tolist(), pixel_values.detach().cpu()))
        return {"loss": (self.weight * pixel_values.float().mean()).square().sum()}  # a scalar, as a model gives


class DeviceDecodeTrainer(DeviceDecodeTrainerMixin, TrainerExtensions, Trainer):
    pass


@BOTH_ROUTES
@pytest.mark.parametrize(  # decode_ahead None: on for CUDA
    "device, decode_ahead, workers",
    [("cpu", False, 0), ("cpu", True, 0), ("cpu", True, 1), pytest.param("cuda", None, 2, marks=needs_cuda)],
)
def test_trainer_feeds_the_model_normalised_fast_pixels_and_counts_fallbacks(tmp_path, device, decode_ahead, workers):
    data = CaptionedImages()
    model = RecordingModel()
    args = WarmupTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        per_device_eval_batch_size=4,
        max_steps=5,
        report_to="none",
        use_cpu=device == "cpu",
        save_strategy="no",
        logging_steps=100,
        dataloader_num_workers=workers,
        remove_unused_columns=False,
    )
    trainer = DeviceDecodeTrainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        data_collator=collate_encoded,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        loader="device_decode",
        image_pipeline="fast",
        decode_ahead=decode_ahead,
    )
    metrics = trainer.train().metrics  # 5 steps of 3 over 6 images: three epochs, so a new look-ahead each epoch
    trainer.evaluate()
    assert trainer.throughput.epoch_start_steps == [3, 5] and metrics["throughput_epoch_starts"] == 2
    assert trainer.args.device.type == device
    assert (trainer._decode_thread is not None) == (decode_ahead or device == "cuda")  # the look-ahead ran
    expected = data.expected_pixels()
    trained = [(ids, pixels) for training, ids, pixels in model.seen if training]
    evaluated = [(ids, pixels) for training, ids, pixels in model.seen if not training]
    assert len(trained) == 5 and sum(len(ids) for ids, _ in evaluated) == len(data)
    for ids, pixels in trained + evaluated:
        assert pixels.dtype == torch.float32 and pixels.shape == (len(ids), 3, SMALL, SMALL)
        difference = (pixels - expected[ids]).abs()
        assert (difference * torch.tensor(CLIP_STD).view(1, 3, 1, 1)).mean().item() <= TOLERANCE
        assert difference.max().item() <= MAX_LEVELS[device] / 255 / min(CLIP_STD) + 1e-5
    seen_png = sum(ids.count(3) for ids, _ in trained)
    stats = trainer.device_decode_stats()
    assert stats == {"device_decode_images": 15 - seen_png, "device_decode_fallback_images": seen_png}
    assert trainer.device_decode_stats("eval") == {"device_decode_images": 5, "device_decode_fallback_images": 1}


def test_decode_ahead_reads_in_the_helper_thread_keeps_order_raises_at_the_failing_batch_and_close_waits():
    readers = []

    def batches():
        for index in range(4):
            readers.append(threading.current_thread().name)
            if index == 2:
                raise ValueError("cannot decode image from 'row 2'")
            yield {"index": index, "encoded_images": f"encoded {index}"}

    helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-decode")
    ahead = DecodeAhead(batches(), helper, decode=lambda encoded: encoded)  # only EncodedBatch values are decoded
    assert next(ahead)["index"] == 0  # the first batch of an epoch is read by the caller
    assert next(ahead)["index"] == 1  # ... the next ones by the helper, one batch ahead
    with pytest.raises(ValueError, match="row 2"):  # the error of the batch read ahead surfaces when it is due
        next(ahead)
    with pytest.raises(StopIteration):
        next(ahead)
    assert readers[0] == threading.current_thread().name
    assert all(name.startswith("device-decode") for name in readers[1:]) and len(readers) == 3
    ahead.close()
    ahead = DecodeAhead(iter([{"index": i} for i in range(5)]), helper, decode=lambda encoded: encoded)
    next(ahead)
    pending = ahead.pending
    ahead.close()
    assert pending.done() and ahead.pending is None, "close() waits for the batch read ahead"
    helper.shutdown()


# ---- The data-free ceiling (gpu_ceiling.py), smoke-tested on CPU with the tiny model ----


def test_gpu_ceiling_trains_on_a_fixed_batch_saves_throughput_and_profiles_the_steps_after_the_warm_up(
    fixtures, tmp_path
):
    from gpu_ceiling import CEILING_LOADER, main

    common = ["--model_name_or_path", str(fixtures["model"]), "--use_cpu", "--per_device_train_batch_size", "2"]
    common += ["--max_steps", "3", "--throughput_warmup_steps", "1", "--max_seq_length", "16"]
    common += ["--report_to", "none", "--save_strategy", "no"]
    metrics = main(common + ["--output_dir", str(tmp_path), "--profile_steps", "2"])
    assert_throughput_adds_up(metrics, counted_steps=2, samples_per_step=2)
    assert metrics["loader"] == CEILING_LOADER
    assert (tmp_path / "train_results.json").exists()
    table = (tmp_path / "profile.txt").read_text()
    assert table.startswith("profiled 2 optimizer step(s) on cpu:")
    assert "aten::" in table and "Self CPU" in table  # the operators that took the time
    assert '"traceEvents"' in (tmp_path / "profile_trace.json").read_text()[:2000]
    with pytest.raises(ValueError, match="--max_steps"):
        main(["--model_name_or_path", str(fixtures["model"]), "--output_dir", str(tmp_path), "--use_cpu"])
    with pytest.raises(ValueError, match="--profile_steps 3 must be 0, or fit after the 1 warm-up steps"):
        main(common + ["--output_dir", str(tmp_path / "too_many"), "--profile_steps", "3"])

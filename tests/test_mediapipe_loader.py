"""The Gaudi media-pipeline loader's CPU-testable parts, plus its wiring against a fake Habana API.

The fake (``fake_habana``) has the API names mediapipe/graph.py documents; its "device" decodes a solid-colour
JPEG to its mean colour, so the tests can check that images, tokens and rows stay aligned and normalised right.
"""

import gc
import importlib.machinery
import importlib.util
import io
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from bridgetower_bench.images.images import to_rgb
from bridgetower_bench.images.jpeg_headers import read_jpeg_header
from bridgetower_bench.mediapipe.availability import choose_loader, mediapipe_unavailable_reason
from bridgetower_bench.mediapipe.dataloader import MediaPipeDataLoader, SamplerBatchReader
from bridgetower_bench.mediapipe.image_files import (
    _MANIFEST_VERSION,
    MANIFEST_NAME,
    _ImageStore,
    is_decoder_ready_jpeg,
    materialise_images,
)
from bridgetower_bench.mediapipe.inputs import attach_mediapipe_inputs
from bridgetower_bench.mediapipe.trainer import MediaPipeTrainerMixin
from helpers import dead_pid, encode, load_raw


SEQ_LEN = 4
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


# ---- helpers ----


def solid_jpeg(colour, size=(20, 14)) -> bytes:
    return encode(Image.new("RGB", size, colour), "JPEG", quality=95)


def image_dataset(values, **columns) -> datasets.Dataset:
    """A data set whose 'image' column holds {bytes, path} dicts (parquet style, undecoded)."""
    rows = [v if isinstance(v, dict) else {"bytes": v, "path": None} for v in values]
    features = {"image": datasets.Image(decode=False)}
    features.update({name: datasets.Sequence(datasets.Value("int32")) for name in columns})
    return datasets.Dataset.from_dict({"image": rows, **columns}, features=datasets.Features(features))


def make_reader(n=10, sampler=None, batch_size=4, drop_last=False):
    paths = [f"img{i}.jpg" for i in range(n)]
    ids = np.arange(n * SEQ_LEN).reshape(n, SEQ_LEN)
    mask = np.ones((n, SEQ_LEN), dtype=np.int32)
    return SamplerBatchReader(paths, ids, mask, sampler or SequentialSampler(range(n)), batch_size, drop_last)


def rows_of(batch):
    """Row numbers of a reader batch, checking that paths and tokens name the same rows."""
    paths, ids, mask = batch
    rows = [int(p[3:-4]) for p in paths]
    assert list(ids[:, 0] // SEQ_LEN) == rows
    return rows


def stats(directory):
    return {
        name: (s.st_ino, s.st_mtime_ns)
        for name in os.listdir(directory)
        for s in [os.stat(os.path.join(directory, name))]
    }


# ---- SamplerBatchReader ----


@pytest.mark.parametrize(
    "drop_last, expected", [(False, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]), (True, [[0, 1, 2, 3], [4, 5, 6, 7]])]
)
def test_reader_follows_sequential_sampler_and_keeps_or_drops_last_partial_batch(drop_last, expected):
    reader = make_reader(n=10, batch_size=4, drop_last=drop_last)
    batches = list(reader)
    assert [rows_of(b) for b in batches] == expected
    assert len(reader) == len(expected)
    for paths, ids, mask in batches:
        assert ids.dtype == np.int64 and mask.dtype == np.int64
        assert ids.shape == mask.shape == (len(paths), SEQ_LEN)


def test_reader_follows_random_sampler_order():
    def sampler():
        return RandomSampler(range(10), generator=torch.Generator().manual_seed(7))

    rows = [row for batch in make_reader(n=10, batch_size=3, sampler=sampler()) for row in rows_of(batch)]
    assert rows == list(sampler())
    assert rows != sorted(rows)


def test_reader_shards_with_distributed_sampler_and_reshuffles_per_epoch():
    def epoch_rows(rank, epoch):
        sampler = DistributedSampler(range(10), num_replicas=2, rank=rank, shuffle=True, seed=3)
        reader = make_reader(n=10, batch_size=2, sampler=sampler)
        reader.set_epoch(epoch)
        assert len(reader) == 3
        return [row for batch in reader for row in rows_of(batch)]

    for epoch in (0, 1):
        rank0, rank1 = epoch_rows(0, epoch), epoch_rows(1, epoch)
        assert not set(rank0) & set(rank1)
        assert sorted(rank0 + rank1) == list(range(10))
    assert epoch_rows(0, 0) != epoch_rows(0, 1)


def test_reader_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="must match"):
        SamplerBatchReader(["a.jpg"] * 3, np.zeros((4, 2)), np.zeros((4, 2)), SequentialSampler(range(3)), 2, False)
    with pytest.raises(ValueError, match="batch size"):
        make_reader(batch_size=0)


# ---- materialise_images ----


def test_embedded_bytes_become_one_file_per_distinct_image_and_baseline_colour_jpegs_are_copied_as_they_are(tmp_path):
    red, blue = solid_jpeg((200, 30, 30)), encode(Image.new("RGB", (16, 12), (30, 30, 200)), "JPEG", quality=90)
    # paths like the New Yorker parquet's: names that are not files on disk
    ds = image_dataset([{"bytes": b, "path": "cartoon.jpg"} for b in (red, blue, red, red, blue)])
    paths = materialise_images(ds, "image", str(tmp_path), "fp1")

    assert len(paths) == 5
    assert paths[0] == paths[2] == paths[3] != paths[1] == paths[4]
    assert sorted(os.listdir(tmp_path / "fp1")) == sorted(
        [os.path.basename(paths[0]), os.path.basename(paths[1]), MANIFEST_NAME]
    )
    assert Path(paths[0]).read_bytes() == red and Path(paths[1]).read_bytes() == blue


def test_the_published_revisions_embedded_images_become_the_decoders_files_byte_for_byte(fixtures, tmp_path):
    """The parquet revision holds each cartoon as JPEG bytes whose `path` is a bare name, no file: the synthetic data
    set has its layout (tests/published_artifacts.json), loaded as a run loads it."""
    from bridgetower_bench import data

    raw = load_raw(
        dataset_name=str(fixtures["dataset"]), dataset_config_name="matching", cache_dir=str(tmp_path / "hf")
    )
    test = data.prepare_image_column(raw["test"], "image", "test")
    paths = materialise_images(test, "image", str(tmp_path / "files"), "published-layout")
    for row, path in zip(test["image"], paths):
        assert not os.path.exists(row["path"]) and Path(path).read_bytes() == row["bytes"]
    assert len(set(paths)) == len(set(test["contest_number"])) < len(paths)  # one file per cartoon


def _cases():
    gradient = Image.linear_gradient("L").resize((16, 12))
    rgba = Image.new("RGBA", (16, 12), (255, 0, 0, 128))
    palette = Image.new("RGB", (16, 12), (0, 120, 240)).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    sixteen = Image.fromarray((np.arange(192).reshape(12, 16) * 300).astype(np.uint16))
    return {
        "png": encode(Image.new("RGB", (16, 12), (40, 90, 160)), "PNG"),
        "cmyk_jpeg": encode(Image.new("CMYK", (16, 12), (0, 128, 255, 0)), "JPEG"),
        "palette_png": encode(palette, "PNG"),
        "grey_png": encode(gradient, "PNG"),
        "rgba_png": encode(rgba, "PNG"),
        "16bit_png": encode(sixteen, "PNG"),
        "progressive_jpeg": encode(Image.new("RGB", (16, 12), (70, 70, 20)), "JPEG", progressive=True),
        "grey_baseline_jpeg": encode(gradient, "JPEG", quality=95),  # Habana documents colour JPEGs only
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_images_the_decoder_cannot_take_are_transcoded_to_rgb_jpeg(tmp_path, case):
    original = _cases()[case]
    assert not is_decoder_ready_jpeg(original)
    (path,) = materialise_images(image_dataset([original]), "image", str(tmp_path), "fp")

    written = Path(path).read_bytes()
    assert is_decoder_ready_jpeg(written)
    decoded = Image.open(io.BytesIO(written))
    assert decoded.format == "JPEG" and decoded.mode == "RGB"
    expected = np.asarray(to_rgb(Image.open(io.BytesIO(original))), dtype=np.float64)
    assert decoded.size == (expected.shape[1], expected.shape[0])
    assert np.abs(np.asarray(decoded, dtype=np.float64) - expected).mean() < 4


@pytest.mark.parametrize("as_path", [False, True])
def test_exif_rotated_jpegs_are_written_upright(tmp_path, as_path):
    exif = Image.Exif()
    exif[0x0112] = 6
    sideways = Image.fromarray(np.repeat(np.arange(20, dtype=np.uint8)[None, :] * 12, 12, axis=0)).convert("RGB")
    original = encode(sideways, "JPEG", quality=95, exif=exif)
    assert read_jpeg_header(original).marker == 0xC0  # baseline: only its orientation keeps it from the decoder
    assert not is_decoder_ready_jpeg(original)
    if as_path:
        (tmp_path / "photo.jpg").write_bytes(original)
        ds = datasets.Dataset.from_dict({"image": [str(tmp_path / "photo.jpg")]})
    else:
        ds = image_dataset([original])
    (path,) = materialise_images(ds, "image", str(tmp_path / "cache"), "fp")

    assert os.path.dirname(path) == str(tmp_path / "cache" / "fp")
    written = Path(path).read_bytes()
    assert is_decoder_ready_jpeg(written)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(original))), dtype=np.float64)
    decoded = np.asarray(Image.open(io.BytesIO(written)), dtype=np.float64)
    assert decoded.shape == expected.shape == (20, 12, 3)
    assert np.abs(decoded - expected).mean() < 3


def test_cache_of_the_previous_version_with_a_grey_jpeg_is_rebuilt_in_rgb(tmp_path):
    grey = encode(Image.linear_gradient("L").resize((16, 12)), "JPEG", quality=95)
    ds = image_dataset([grey, solid_jpeg((9, 80, 9))])
    first = materialise_images(ds, "image", str(tmp_path), "fp")
    # What the previous version left: the grey JPEG copied as it was, under a version-1 manifest.
    with open(first[0], "wb") as handle:
        handle.write(grey)
    manifest = tmp_path / "fp" / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace(f'"version": {_MANIFEST_VERSION}', '"version": 1'))

    again = materialise_images(ds, "image", str(tmp_path), "fp")
    assert again == first
    assert Image.open(again[0]).mode == "RGB" and is_decoder_ready_jpeg(open(again[0], "rb").read())


def test_path_values_use_existing_jpeg_files_in_place_and_an_unknown_column_is_a_clear_error(tmp_path):
    jpeg_file, png_file = tmp_path / "photo.jpg", tmp_path / "drawing.png"
    jpeg_file.write_bytes(solid_jpeg((1, 2, 3)))
    png_file.write_bytes(encode(Image.new("RGB", (8, 8), (9, 9, 9)), "PNG"))
    ds = datasets.Dataset.from_dict({"image_path": [str(jpeg_file), str(png_file), str(jpeg_file)]})
    paths = materialise_images(ds, "image_path", str(tmp_path / "cache"), "fp")

    assert paths[0] == paths[2] == str(jpeg_file)
    assert os.path.dirname(paths[1]) == str(tmp_path / "cache" / "fp")
    assert Image.open(paths[1]).format == "JPEG"
    with pytest.raises(ValueError, match="--image_column=picture"):
        materialise_images(ds, "picture", str(tmp_path / "cache"), "fp")


@pytest.mark.parametrize("string_column", [False, True])
def test_missing_image_file_names_row_and_path(tmp_path, string_column):
    missing = str(tmp_path / "nowhere" / "cartoon_17.jpg")
    if string_column:
        existing = tmp_path / "ok.jpg"
        existing.write_bytes(solid_jpeg((5, 5, 5)))
        ds = datasets.Dataset.from_dict({"image": [str(existing), str(existing), missing]})
    else:
        ds = image_dataset([solid_jpeg((5, 5, 5)), solid_jpeg((6, 6, 6)), {"bytes": None, "path": missing}])
    with pytest.raises(ValueError, match="row 2") as error:
        materialise_images(ds, "image", str(tmp_path / "cache"), "fp")
    assert missing in str(error.value)


def test_a_rerun_writes_nothing_and_a_killed_build_is_completed_without_redoing_finished_files(tmp_path, monkeypatch):
    images = [solid_jpeg((200, 0, 0)), encode(Image.new("RGBA", (8, 8), (0, 0, 255, 255)), "PNG")]
    ds = image_dataset(images)
    first = materialise_images(ds, "image", str(tmp_path), "fp")
    out_dir = tmp_path / "fp"
    before = stats(out_dir)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished cache was rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(_ImageStore, "store_all", must_not_run)
        assert materialise_images(ds, "image", str(tmp_path), "fp") == first
    assert stats(out_dir) == before, "a second run over a finished cache reads and writes nothing"
    # The state a build killed mid-way leaves: no manifest, one file not yet renamed into place.
    os.remove(out_dir / MANIFEST_NAME)
    os.remove(first[1])
    host = socket.gethostname()
    stale = out_dir / f"{os.path.basename(first[1])}.partial-{host}-{dead_pid()}.1a2b3c"
    stale.write_bytes(b"\xff\xd8\xff truncated")
    live = out_dir / f"other.jpg.partial-{host}-{os.getpid()}.a1b2c3"  # a concurrent writer's file
    live.write_bytes(b"in progress")
    survivor = stats(out_dir)[os.path.basename(first[0])]

    again = materialise_images(ds, "image", str(tmp_path), "fp")

    assert again == first
    assert stats(out_dir)[os.path.basename(first[0])] == survivor  # finished file not rewritten
    assert Image.open(first[1]).mode == "RGB"
    assert not stale.exists() and live.exists()
    assert (out_dir / MANIFEST_NAME).exists()


# ---- availability on this (non-Gaudi) machine ----


@pytest.mark.skipif(
    importlib.util.find_spec("habana_frameworks") is not None
    and importlib.util.find_spec("habana_frameworks.mediapipe") is not None,
    reason="Habana's media loader is installed here",
)
def test_unavailable_here_with_a_reason_and_torch_loader_recorded():
    # This machine has none of Habana's software: the first missing piece is named, with where it comes from.
    reason = "habana_frameworks.mediapipe is not installed (it comes with the habana-media-loader package)"
    assert mediapipe_unavailable_reason() == reason
    assert choose_loader(True) == ("torch (media pipeline unavailable: " + reason + ")", reason)
    assert choose_loader(False) == ("torch", None)
    with pytest.raises(RuntimeError, match="cannot run here"):
        MediaPipeDataLoader(object(), SequentialSampler(range(1)), 1)


# ---- a fake Habana stack, with the API names mediapipe/graph.py documents ----


class FakeOp:
    def __init__(self, kind, **kwargs):
        self.kind, self.kwargs = kind, kwargs

    def __call__(self, *inputs):
        if self.kind == "reader":
            return tuple(("reader", self, i) for i in range(self.kwargs["num_outputs"]))
        return ("op", self, inputs)


class FakeMediaPipe:
    """Records every pipeline built and its release: del_iter() (device memory) then close() (the graph)."""

    created = []

    def __init__(self, device, batch_size, prefetch_depth, pipe_name):
        self.settings = dict(device=device, batch_size=batch_size, prefetch_depth=prefetch_depth, pipe_name=pipe_name)
        self.calls = []
        FakeMediaPipe.created.append(self)

    def del_iter(self):
        self.calls.append("del_iter")

    def close(self):
        self.calls.append("close")

    @property
    def released(self):
        return self.calls[-2:] == ["del_iter", "close"]

    @classmethod
    def counts(cls):
        return len(cls.created), sum(pipe.released for pipe in cls.created)


class FakeIterator:
    """Builds the graph, runs the reader node, 'decodes' each solid-colour JPEG to its mean colour."""

    def __init__(self, mediapipe):
        self.batch_size = mediapipe.settings["batch_size"]
        self.outputs = mediapipe.definegraph()
        self.reader_op = next(node[1] for node in self.outputs if node[0] == "reader")
        kw = self.reader_op.kwargs
        self.reader = kw["impl"]({"priv_params": kw["priv_params"]}, SimpleNamespace(batch_size=self.batch_size))
        assert len(self.reader.gen_output_info()) == kw["num_outputs"]
        assert os.path.isfile(self.reader.get_largest_file())

    def __iter__(self):
        iter(self.reader)
        return self

    def __next__(self):
        produced = next(self.reader)
        assert len(produced[0]) == self.batch_size  # the pipeline's shapes are fixed
        assert produced[1].shape == (self.batch_size, SEQ_LEN) and produced[1].dtype == np.uint32
        return [torch.as_tensor(np.asarray(self._evaluate(node, produced), dtype=np.float32)) for node in self.outputs]

    def _evaluate(self, node, produced):
        if node[0] == "reader":
            return produced[node[2]]
        _, op, inputs = node
        args = [self._evaluate(i, produced) for i in inputs]
        if op.kind == "decode":
            assert op.kwargs["device"] == "hpu" and op.kwargs["random_crop_type"] == "CENTER_CROP"
            width, height = op.kwargs["resize"]
            colours = [np.asarray(Image.open(f).convert("RGB"), dtype=np.float64).mean(axis=(0, 1)) for f in args[0]]
            return np.stack([np.broadcast_to(c[:, None, None], (3, height, width)) for c in colours])
        if op.kind == "const":
            return np.asarray(op.kwargs["data"], dtype=np.float64).reshape(3, 1, 1)
        if op.kind == "cmn":
            images, mean, inv_std = args
            return (images - mean) * inv_std
        raise AssertionError(f"unexpected op {op.kind}")


def _install_module(monkeypatch, name, **attributes):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # libraries probe with find_spec()
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


@pytest.fixture
def fake_habana(monkeypatch):
    """Install a fake Habana stack; returns the fake hpu module (set .device_name to change the device)."""
    return install_fake_habana(monkeypatch)


def install_fake_habana(monkeypatch):
    FakeMediaPipe.created.clear()
    enum = lambda *names: SimpleNamespace(**{n: n for n in names})  # noqa: E731
    fn = SimpleNamespace(
        MediaExtReaderOp=lambda **kw: FakeOp("reader", **kw),
        ImageDecoder=lambda **kw: FakeOp("decode", **kw),
        MediaConst=lambda **kw: FakeOp("const", **kw),
        CropMirrorNorm=lambda **kw: FakeOp("cmn", **kw),
    )
    _install_module(monkeypatch, "habana_frameworks")
    _install_module(monkeypatch, "habana_frameworks.mediapipe", fn=fn)
    _install_module(
        monkeypatch,
        "habana_frameworks.mediapipe.media_types",
        dtype=enum("NDT", "UINT32", "FLOAT32"),
        ftype=enum("BICUBIC"),
        imgtype=enum("RGB_P"),
        randomCropType=enum("CENTER_CROP"),
        readerOutType=enum("FILE_LIST"),
    )
    _install_module(monkeypatch, "habana_frameworks.mediapipe.mediapipe", MediaPipe=FakeMediaPipe)
    _install_module(monkeypatch, "habana_frameworks.mediapipe.operators")
    _install_module(monkeypatch, "habana_frameworks.mediapipe.operators.reader_nodes")
    _install_module(
        monkeypatch,
        "habana_frameworks.mediapipe.operators.reader_nodes.reader_nodes",
        media_ext_reader_op_impl=type("media_ext_reader_op_impl", (), {}),
        media_ext_reader_op_tensor_info=lambda dtype, shape, layout: (dtype, tuple(shape), layout),
    )
    _install_module(monkeypatch, "habana_frameworks.mediapipe.plugins")
    _install_module(
        monkeypatch, "habana_frameworks.mediapipe.plugins.iterator_pytorch", HPUGenericPytorchIterator=FakeIterator
    )
    _install_module(monkeypatch, "habana_frameworks.torch")
    hpu = _install_module(monkeypatch, "habana_frameworks.torch.hpu", device_name="GAUDI2", visible=True)
    hpu.is_available = lambda: hpu.visible
    hpu.get_device_name = lambda: hpu.device_name
    return hpu


def test_available_only_on_gaudi2_and_gaudi3(fake_habana):
    for name in ("GAUDI2", "GAUDI3"):
        fake_habana.device_name = name
        assert mediapipe_unavailable_reason() is None
        assert choose_loader(True) == ("mediapipe", None)
    fake_habana.device_name = "GAUDI"
    assert mediapipe_unavailable_reason() == "no Gaudi2/Gaudi3 device (found: GAUDI)"
    fake_habana.visible = False
    assert "no HPU" in mediapipe_unavailable_reason()


COLOURS = [(250, 10, 10), (10, 250, 10), (10, 10, 250), (128, 128, 128), (250, 250, 10), (10, 250, 250), (0, 0, 0)]


def attached_dataset(tmp_path, image_size=8):
    ids = [[row * 100 + j for j in range(SEQ_LEN)] for row in range(len(COLOURS))]  # row r's tokens: r * 100 + j
    ds = image_dataset([solid_jpeg(c) for c in COLOURS], input_ids=ids, attention_mask=[[1] * SEQ_LEN] * len(COLOURS))
    paths = materialise_images(ds, "image", str(tmp_path), ds._fingerprint)
    attach_mediapipe_inputs(ds, paths, image_size, MEAN, STD)
    return ds


def rows_of_batch(batch):
    return [int(i) // 100 for i in batch["input_ids"][:, 0]]


def test_loader_needs_attached_padded_inputs_and_yields_normalised_images_aligned_with_tokens(fake_habana, tmp_path):
    with pytest.raises(ValueError, match="attach_mediapipe_inputs"):
        MediaPipeDataLoader(image_dataset([solid_jpeg((1, 1, 1))]), SequentialSampler(range(1)), 1)
    ragged = image_dataset([solid_jpeg((1, 1, 1))] * 2, input_ids=[[1, 2], [3]], attention_mask=[[1, 1], [1]])
    with pytest.raises(ValueError, match="padding='max_length'"):
        attach_mediapipe_inputs(ragged, ["a.jpg", "b.jpg"], 8, MEAN, STD)
    ds = attached_dataset(tmp_path, image_size=8)
    loader = MediaPipeDataLoader(ds, SequentialSampler(ds), 3, num_workers=2)

    for _epoch in range(2):
        batches = list(loader)
        assert len(batches) == len(loader) == 3
        assert [rows_of_batch(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
        for batch in batches:
            assert batch["return_loss"] is True
            assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.int64
            assert batch["pixel_values"].shape == (len(batch["input_ids"]), 3, 8, 8)
            for image, row in zip(batch["pixel_values"], rows_of_batch(batch)):
                expected = (torch.tensor(COLOURS[row]) / 255 - torch.tensor(MEAN)) / torch.tensor(STD)
                torch.testing.assert_close(image[:, 4, 4], expected.float(), atol=0.05, rtol=0)
    (pipe,) = FakeMediaPipe.created
    assert pipe.settings["prefetch_depth"] == 3 and pipe.settings["batch_size"] == 3


@pytest.mark.parametrize("workers, depth", [(0, 1), (1, 2), (2, 3), (3, 3), (16, 3)])
def test_prefetch_depth_follows_workers_within_habanas_documented_range(fake_habana, tmp_path, workers, depth):
    ds = attached_dataset(tmp_path)
    MediaPipeDataLoader(ds, SequentialSampler(ds), 3, num_workers=workers)
    (pipe,) = FakeMediaPipe.created
    assert pipe.settings["prefetch_depth"] == depth


def test_closed_or_dropped_loader_releases_its_pipeline_and_a_closed_one_refuses_to_iterate(fake_habana, tmp_path):
    ds = attached_dataset(tmp_path)
    loader = MediaPipeDataLoader(ds, SequentialSampler(ds), 3)
    assert len(list(loader)) == 3 and FakeMediaPipe.counts() == (1, 0)
    loader.close()
    loader.close()
    assert FakeMediaPipe.created[0].calls == ["del_iter", "close"]  # once, device memory first
    with pytest.raises(RuntimeError, match="closed"):
        list(loader)

    dropped = MediaPipeDataLoader(ds, SequentialSampler(ds), 3)
    list(dropped)
    del dropped
    gc.collect()
    assert FakeMediaPipe.counts() == (2, 2), "a dropped loader releases its pipeline"


def test_pipelines_left_open_are_released_at_process_exit(tmp_path):
    # A child process builds a loader with the fake stack and exits without closing it.
    child = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import pytest, test_mediapipe_loader as t
from torch.utils.data import SequentialSampler
t.FakeMediaPipe.close = lambda self: print("closed", self.settings["pipe_name"], "after", self.calls, flush=True)
patch = pytest.MonkeyPatch()
t.install_fake_habana(patch)
ds = t.attached_dataset(__import__("pathlib").Path({str(tmp_path)!r}))
loader = t.MediaPipeDataLoader(ds, SequentialSampler(ds), 3)
list(loader)
print("exiting", flush=True)
"""
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-2:] == ["exiting", "closed bridgetower-mediapipe-0 after ['del_iter']"]


class FakeTrainerBase:
    """What the mixin uses of transformers' Trainer (its training sampler, arguments and state)."""

    def __init__(self, args, train_dataset=None, eval_dataset=None):
        self.args, self.train_dataset, self.eval_dataset = args, train_dataset, eval_dataset
        self.state = SimpleNamespace(train_batch_size=None)

    def _get_train_sampler(self, train_dataset=None):
        return RandomSampler(train_dataset or self.train_dataset)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        return resume_from_checkpoint


class FakeTrainer(MediaPipeTrainerMixin, FakeTrainerBase):
    pass


def trainer_args(**overrides):
    args = dict(
        world_size=1,
        process_index=0,
        seed=42,
        data_seed=None,
        dataloader_drop_last=False,
        dataloader_num_workers=0,
        train_batch_size=3,
        eval_batch_size=3,
        auto_find_batch_size=False,
        ignore_data_skip=False,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def test_mixin_uses_the_trainers_sampler_on_one_device_and_shards_across_two_ranks(fake_habana, tmp_path):
    """One device: the trainer's sampler, and a resumed run restarts the epoch. Two ranks: full training batches,
    the same number of steps each, and an evaluation that gathers every row once."""
    ds = attached_dataset(tmp_path)
    trainer = FakeTrainer(trainer_args(), train_dataset=ds, eval_dataset=ds)
    train_rows = [row for b in trainer.get_train_dataloader() for row in rows_of_batch(b)]
    assert sorted(train_rows) == list(range(len(COLOURS)))
    eval_rows = [row for b in trainer.get_eval_dataloader() for row in rows_of_batch(b)]
    assert eval_rows == list(range(len(COLOURS)))
    assert trainer.train(resume_from_checkpoint="out/checkpoint-10") == "out/checkpoint-10"
    assert trainer.args.ignore_data_skip is True, "a resumed run restarts the epoch instead of skipping batches"

    per_rank, rounds = [], []
    for rank in (0, 1):
        trainer = FakeTrainer(trainer_args(world_size=2, process_index=rank), train_dataset=ds, eval_dataset=ds)
        loader = trainer.get_train_dataloader()
        loader.set_epoch(0)
        batches = list(loader)
        assert all(len(b["input_ids"]) == 3 for b in batches)
        per_rank.append([row for b in batches for row in rows_of_batch(b)])
        loader = trainer.get_eval_dataloader()
        seen = []
        for batch in loader:
            state = loader.gradient_state
            seen.append((rows_of_batch(batch), state.end_of_dataloader, state.remainder))
        rounds.append(seen)
    assert len(per_rank[0]) == len(per_rank[1])  # every rank runs the same number of steps
    assert set(per_rank[0]) | set(per_rank[1]) == set(range(len(COLOURS)))
    assert len(rounds[0]) == len(rounds[1])
    gathered = []
    for (rows0, end, remainder), (rows1, _, _) in zip(*rounds):
        together = rows0 + rows1  # what gather_for_metrics concatenates, rank by rank
        gathered += together[:remainder] if end and remainder > 0 else together
    assert gathered == list(range(len(COLOURS)))


class RowRecordingModel(torch.nn.Module):
    """A one-layer stand-in for BridgeTower that records which rows each batch held."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.rows_seen = []

    def forward(self, pixel_values, input_ids, attention_mask, return_loss=True):
        self.rows_seen.append([int(i) // 100 for i in input_ids[:, 0]])
        loss = self.linear(pixel_values.mean(dim=(2, 3))).pow(2).mean()
        return {"loss": loss, "logits": loss.reshape(1)}


def mediapipe_trainer(tmp_path, model, ds, extensions=False, **overrides):
    """transformers' Trainer with the MediaPipe mixin (and the kit's TrainerExtensions and arguments where
    `extensions`) on the CPU, batches of 3 (2 to evaluate), `ds` to train and evaluate on."""
    from transformers import Trainer, TrainingArguments

    from bridgetower_bench.arguments import WarmupTrainingArguments
    from bridgetower_bench.trainer import TrainerExtensions

    options = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=3,
        per_device_eval_batch_size=2,
        use_cpu=True,
        report_to=[],
        remove_unused_columns=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    args = (WarmupTrainingArguments if extensions else TrainingArguments)(**{**options, **overrides})
    bases = (MediaPipeTrainerMixin, TrainerExtensions, Trainer) if extensions else (MediaPipeTrainerMixin, Trainer)
    return type("MediaPipeTrainer", bases, {})(model=model, args=args, train_dataset=ds, eval_dataset=ds)


def test_real_trainer_trains_and_evaluates_through_the_mixin(fake_habana, tmp_path):
    model = RowRecordingModel()
    trainer = mediapipe_trainer(
        tmp_path, model, attached_dataset(tmp_path / "images"), num_train_epochs=2, dataloader_num_workers=2
    )
    assert trainer.train().global_step == 6
    epochs = [sorted(sum(model.rows_seen[i : i + 3], [])) for i in (0, 3)]
    assert epochs == [list(range(len(COLOURS)))] * 2

    model.rows_seen.clear()
    assert "eval_loss" in trainer.evaluate()
    assert model.rows_seen == [[0, 1], [2, 3], [4, 5], [6]]


def test_trainer_reuses_one_pipeline_per_data_set_and_releases_them(fake_habana, tmp_path):
    ds = attached_dataset(tmp_path / "images")
    test_ds = attached_dataset(tmp_path / "images")
    model = RowRecordingModel()
    trainer = mediapipe_trainer(tmp_path, model, ds, max_steps=6, eval_strategy="steps", eval_steps=2)
    trainer.train()  # evaluates at steps 2, 4 and 6
    assert FakeMediaPipe.counts() == (2, 1)  # one training pipeline, released when train() returned; one eval
    for _ in range(3):
        trainer.evaluate()
    trainer.predict(test_ds)
    trainer.predict(test_ds)
    assert FakeMediaPipe.counts() == (3, 1)  # + one for the test set, reused
    model.rows_seen.clear()
    trainer.evaluate()
    assert model.rows_seen == [[0, 1], [2, 3], [4, 5], [6]]  # a reused pipeline gives the whole set again

    trainer.release_media_pipelines()
    assert FakeMediaPipe.counts() == (3, 3)
    trainer.evaluate()  # a fresh one after the release
    assert FakeMediaPipe.counts() == (4, 3)
    del trainer
    gc.collect()
    assert FakeMediaPipe.counts() == (4, 4)


def test_each_epochs_pipeline_restart_is_waited_for_in_that_epochs_first_step(fake_habana, tmp_path, monkeypatch):
    restarted_after_step = []
    restart = FakeIterator.__iter__

    def slow_restart(self):  # the pipeline's restart at every epoch takes (at least) 0.2 s
        restarted_after_step.append(trainer.state.global_step)
        time.sleep(0.2)
        return restart(self)

    monkeypatch.setattr(FakeIterator, "__iter__", slow_restart)
    model, ds = RowRecordingModel(), attached_dataset(tmp_path / "images")
    trainer = mediapipe_trainer(tmp_path, model, ds, extensions=True, num_train_epochs=2, throughput_warmup_steps=1)
    metrics = trainer.train().metrics

    steps_per_epoch = -(-len(COLOURS) // 3)
    assert restarted_after_step == [0, steps_per_epoch]  # before step 1, and inside the next epoch's first step
    assert trainer.throughput.epoch_start_steps == [steps_per_epoch + 1]
    assert metrics["throughput_steps_per_epoch"] == steps_per_epoch and metrics["throughput_epoch_starts"] == 1
    assert metrics["data_wait_seconds_epoch_start"] == trainer.throughput.step_waits[steps_per_epoch + 1] >= 0.2

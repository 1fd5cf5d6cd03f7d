"""The decode-once image cache: build, reuse, invalidation, recovery, fallbacks, workers."""

import hashlib
import io
import json
import pickle
import socket
import time

import numpy as np
import PIL
import pytest
import torch
from PIL import Image, ImageOps

from bridgetower_bench.images import image_cache, images
from bridgetower_bench.images.image_cache import (
    MANIFEST_FILE,
    PIXELS_FILE,
    DecodedImageCache,
    decoded_image_cache_dir,
    open_decoded_image_cache,
)
from bridgetower_bench.images.images import make_image_transform
from helpers import dead_pid, encode, noise_jpeg


SIZE = 16


def jpeg(seed: int, width: int = 40, height: int = 36) -> bytes:
    return noise_jpeg(seed, (width, height))


@pytest.fixture
def image_values(tmp_path):
    """Rows as a data set holds them: embedded bytes, paths, path-only dicts; images repeat across rows.

    Five distinct images: three embedded (one large enough for fast-draft's DCT scaling),
    one PNG file, one JPEG file whose bytes also appear embedded in another row.
    """
    embedded = [jpeg(0), jpeg(1), jpeg(2, width=80, height=70)]
    folder = tmp_path / "images"
    folder.mkdir()
    png_path = folder / "picture.png"
    Image.new("RGBA", (30, 50), (200, 10, 10, 128)).save(png_path)
    jpeg_path = folder / "photo.jpg"
    jpeg_path.write_bytes(jpeg(3))
    rows = [{"bytes": data, "path": None} for data in embedded]
    rows += [str(png_path), {"bytes": None, "path": str(jpeg_path)}, {"bytes": jpeg(3), "path": "elsewhere.jpg"}]
    return rows + rows[::-1] + rows[:2]


def open_cache(values, cache_dir, pipeline="fast", image_size=SIZE, fingerprint="data-v1", num_proc=None):
    return open_decoded_image_cache(
        values,
        pipeline=pipeline,
        image_size=image_size,
        cache_dir=cache_dir,
        fingerprint=fingerprint,
        num_proc=num_proc,
    )


def pixels_mtime(cache: DecodedImageCache) -> int:
    return (cache.directory / PIXELS_FILE).stat().st_mtime_ns


@pytest.mark.parametrize("pipeline", ["fast", "fast-draft"])
def test_a_cache_equals_its_pipeline_records_its_build_and_is_reused(image_values, tmp_path, pipeline):
    started = time.perf_counter()
    cache = open_cache(image_values, tmp_path, pipeline=pipeline)
    elapsed = time.perf_counter() - started
    transform = make_image_transform(pipeline, SIZE, mean=(), std=())
    assert cache.built and len(cache) == 5
    assert cache.manifest["n_values"] == len(image_values)
    for value in image_values:
        cached = cache(value)
        assert cached.dtype == torch.uint8 and cached.shape == (3, SIZE, SIZE)
        assert torch.equal(cached, transform(value))
    assert cache.fallback_decodes == 0
    assert 0 <= cache.manifest["build_seconds"] <= round(elapsed, 3) + 0.001
    written = json.loads((cache.directory / MANIFEST_FILE).read_text())
    assert written["build_seconds"] == cache.manifest["build_seconds"]
    # the digest file holds the blake2b-128 of each distinct image's bytes, in slot order
    digests = np.load(cache.directory / image_cache.DIGESTS_FILE)
    embedded = [value["bytes"] for value in image_values[:3]]
    assert cache.manifest["digest"] == "blake2b-128" and digests.shape == (5, 16)
    assert [row.tobytes() for row in digests[:3]] == [hashlib.blake2b(b, digest_size=16).digest() for b in embedded]
    assert [cache.slot_of(value) for value in image_values[:6]] == [0, 1, 2, 3, 4, 4]

    built_at = pixels_mtime(cache)
    second = open_cache(image_values, tmp_path, pipeline=pipeline)
    assert not second.built
    assert second.directory == cache.directory and pixels_mtime(second) == built_at
    assert torch.equal(second(image_values[3]), cache(image_values[3]))


@pytest.mark.parametrize(
    "changed", [{"image_size": SIZE + 2}, {"image_size": 1}, {"pipeline": "fast-draft"}, {"fingerprint": "data-v2"}]
)
def test_other_settings_never_reuse_a_cache_and_one_pixel_images_are_allowed(image_values, tmp_path, changed):
    first = open_cache(image_values, tmp_path)
    other = open_cache(image_values, tmp_path, **changed)
    assert other.built and other.directory != first.directory
    assert other(image_values[0]).shape == (3, changed.get("image_size", SIZE), changed.get("image_size", SIZE))


def test_only_fast_draft_caches_depend_on_the_jpeg_decoder(image_values, tmp_path, monkeypatch):
    """fast pixels are identical with simplejpeg and without; fast-draft ones are not (other DCT scales)."""
    pytest.importorskip("simplejpeg")
    draft = open_cache(image_values, tmp_path, pipeline="fast-draft")
    assert draft.manifest["jpeg_decoder"].startswith("simplejpeg ")
    with_simplejpeg = {p: decoded_image_cache_dir(tmp_path, p, SIZE, "data-v1") for p in ("fast", "fast-draft")}
    monkeypatch.setattr(images, "simplejpeg", None)
    assert decoded_image_cache_dir(tmp_path, "fast", SIZE, "data-v1") == with_simplejpeg["fast"]
    assert decoded_image_cache_dir(tmp_path, "fast-draft", SIZE, "data-v1") != with_simplejpeg["fast-draft"]
    pil_draft = open_cache(image_values, tmp_path, pipeline="fast-draft")
    assert pil_draft.built and pil_draft.manifest["jpeg_decoder"] == f"Pillow {PIL.__version__}"


@pytest.mark.parametrize("key, value", [("torchvision", "0.0.1"), ("complete", False)])
def test_a_manifest_of_other_library_versions_or_of_an_unfinished_build_is_rebuilt(image_values, tmp_path, key, value):
    first = open_cache(image_values, tmp_path)
    manifest_path = first.directory / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest[key] = value
    manifest_path.write_text(json.dumps(manifest))
    assert open_cache(image_values, tmp_path).built
    assert json.loads(manifest_path.read_text())[key] != value


def test_a_build_interrupted_or_killed_outright_is_detected_cleaned_up_and_rebuilt(
    image_values, tmp_path, monkeypatch
):
    decode_one = image_cache._decode_one
    decoded = []

    def dies_after_two_images(task):
        if len(decoded) == 2:
            raise KeyboardInterrupt  # stands in for the process being killed
        decoded.append(task)
        return decode_one(task)

    monkeypatch.setattr(image_cache, "_decode_one", dies_after_two_images)
    with pytest.raises(KeyboardInterrupt):
        open_cache(image_values, tmp_path / "cache")
    monkeypatch.setattr(image_cache, "_decode_one", decode_one)
    (directory,) = (tmp_path / "cache").iterdir()
    assert not list(directory.iterdir())  # no manifest, and the half-written files are gone

    recovered = open_cache(image_values, tmp_path / "cache")
    assert recovered.built
    transform = make_image_transform("fast", SIZE, mean=(), std=())
    assert all(torch.equal(recovered(value), transform(value)) for value in image_values)

    abandoned = directory / f"{PIXELS_FILE}.partial-{socket.gethostname()}-{dead_pid()}.1a2b3c"
    abandoned.write_bytes(b"half a pixel file")
    (directory / MANIFEST_FILE).unlink()  # SIGKILL mid-build: no manifest either
    again = open_cache(image_values, tmp_path / "cache")
    assert again.built and not abandoned.exists()
    assert sorted(p.name for p in again.directory.iterdir()) == ["digests.npy", "manifest.json", "pixels.npy"]


@pytest.mark.parametrize("damage", ["truncated", "one image too few"])
def test_a_truncated_pixel_file_or_one_of_another_shape_than_the_manifest_is_rebuilt(image_values, tmp_path, damage):
    first = open_cache(image_values, tmp_path)
    path = first.directory / PIXELS_FILE
    pixels = np.load(path)
    if damage == "truncated":
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    else:
        np.save(path, pixels[:-1])  # whole and readable, its digests still right
    again = open_cache(image_values, tmp_path)
    assert again.built and np.load(again.directory / PIXELS_FILE).shape == pixels.shape
    assert torch.equal(again(image_values[0]), make_image_transform("fast", SIZE, (), ())(image_values[0]))


def test_unknown_image_falls_back_to_decoding_is_counted_and_the_first_one_warns_once(image_values, tmp_path, caplog):
    cache = open_cache(image_values, tmp_path)
    with caplog.at_level("WARNING", logger="bridgetower_bench.images.image_cache"):
        stranger = {"bytes": jpeg(98), "path": None}
        assert torch.equal(cache(stranger), make_image_transform("fast", SIZE, (), ())(stranger))
        assert cache.fallback_decodes == 1
        assert [r.getMessage() for r in caplog.records if "not in the decoded image cache" in r.getMessage()] != []
        caplog.clear()
        cache({"bytes": jpeg(99), "path": None})
    assert not [r for r in caplog.records if "not in the decoded image cache" in r.getMessage()]
    assert cache.fallback_decodes == 2


def test_broken_image_names_its_row(image_values, tmp_path):
    values = image_values[:3] + [{"bytes": b"\xff\xd8\xff garbage", "path": None}]
    with pytest.raises(ValueError, match="image row 3: cannot decode image from embedded bytes"):
        open_cache(values, tmp_path)
    with pytest.raises(ValueError, match="image row 1: cannot read image file"):
        open_cache([image_values[0], str(tmp_path / "missing.jpg")], tmp_path)


def test_data_loader_workers_get_the_same_tensors_and_a_pickled_cache_reopens_lazily(image_values, tmp_path):
    cache = open_cache(image_values, tmp_path)
    expected = torch.stack([make_image_transform("fast", SIZE, (), ())(value) for value in image_values])

    def collate(rows):  # runs in the worker processes
        return torch.stack([cache(value) for value in rows])

    loader = torch.utils.data.DataLoader(image_values, batch_size=4, num_workers=2, collate_fn=collate)
    assert torch.equal(torch.cat(list(loader)), expected)
    expected = cache(image_values[1])  # maps the file in this process
    payload = pickle.dumps(cache)
    assert len(payload) < 4096  # neither pixels nor index travel with it
    assert torch.equal(pickle.loads(payload)(image_values[1]), expected)


def test_exif_rotated_images_are_cached_upright(tmp_path, monkeypatch):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: a quarter turn makes it upright
    pixels = np.random.default_rng(5).integers(0, 256, (30, 44, 3), dtype=np.uint8)
    values = [{"bytes": encode(Image.fromarray(pixels), "JPEG", exif=exif), "path": None}]
    # a cache of the format before images were turned upright is not reused
    monkeypatch.setattr(image_cache, "CACHE_FORMAT_VERSION", 1)
    old = open_cache(values, tmp_path / "cache")
    monkeypatch.undo()
    cache = open_cache(values, tmp_path / "cache")
    assert cache.built and cache.directory != old.directory
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(values[0]["bytes"])))
    assert torch.equal(cache(values[0]), make_image_transform("fast", SIZE, mean=(), std=())(upright))


@pytest.mark.parametrize(
    "bad",
    [{"pipeline": "upstream"}, {"image_size": 0}, {"image_size": "16"}, {"num_proc": 0}, {"num_proc": "2"}]
    + [{"fingerprint": ""}, {"fingerprint": 7}, {"fingerprint": None}],
)
def test_upstream_impossible_sizes_worker_counts_and_fingerprints_are_refused(image_values, tmp_path, bad):
    ((name, _),) = bad.items()
    message = {
        "pipeline": "--image_pipeline=upstream",
        "fingerprint": "the decoded image cache needs a non-empty fingerprint string",
    }.get(name, f"{name} must be a positive integer")
    with pytest.raises(ValueError, match=message):
        open_cache(image_values, tmp_path / "cache", **bad)
    assert not (tmp_path / "cache").exists(), "refused before anything is written"


@pytest.mark.parametrize("num_proc", [None, 1])
def test_a_serial_build_leaves_the_process_thread_count_alone(image_values, tmp_path, num_proc):
    """Only the build's worker processes use one torch thread each; training after a serial build keeps its threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert open_cache(image_values, tmp_path, num_proc=num_proc).built
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n_images", [None, 3, 40])
def test_parallel_build_equals_serial_build(image_values, tmp_path, n_images):
    """Of the mixed rows; of barely more images than workers; of enough that the workers get several at a time."""
    values = image_values if n_images is None else [{"bytes": jpeg(i, 20, 18), "path": None} for i in range(n_images)]
    serial = open_cache(values, tmp_path / "serial")
    parallel = open_cache(values, tmp_path / "parallel", num_proc=2)
    assert len(parallel) == (n_images or 5)
    assert np.array_equal(np.load(serial.directory / PIXELS_FILE), np.load(parallel.directory / PIXELS_FILE))

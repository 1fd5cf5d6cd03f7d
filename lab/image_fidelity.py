"""The image pipelines' pixels beside upstream's, measured: what docs/UPSTREAM.md and the README state.

    python lab/image_fidelity.py [--images 24] [--image-size 294] [--json out.json]

Two measurements, in 1/255 of a pixel value (images compared before normalisation, in [0, 1] x 255):

1. `fast` against `upstream` (the default pipeline, upstream's pixels), on JPEGs of four kinds: synthetic
   line-art cartoons (`bridgetower_bench.tools.cartoons`) at their usual size (800 x 650), as thumbnails
   smaller than the 294-pixel crop (shrunk to 200 x 150 and 100 x 80) and just above it (shrunk to
   300 x 300 and 400 x 296: then hardly resized); photo-like images (`photo`: a 1/f spectrum, as natural images have, with
   a few slightly blurred objects); and line drawings (`line_drawing`: 1-2 pixel black strokes on white).
   Each image is compared as embedded bytes (upstream resizes the float pixels) and as a file path
   (upstream resizes the uint8 pixels, as `fast` does). Per set: the mean over the images of each image's
   mean absolute difference, the largest image mean, and the worst pixel. The cause, per set: `fast`
   against upstream's float filter run as torch's uint8 kernel runs it (`uint8_kernel_pixels`: the
   horizontal pass, its result rounded and clamped to 0..255, then the vertical pass, rounded and
   clamped). Near sharp edges the bicubic filter overshoots past black and white: upstream keeps the
   overshoot of embedded images (float pixels, unclamped), `fast` clamps it after each pass.
2. Images upstream reads differently from us, by design: an RGBA PNG whose transparent pixels are black
   underneath (as PNG encoders commonly store them), a palette PNG with a transparent entry, and a 16-bit
   grey PNG (black line art on white). Our `upstream` pipeline composites transparency on white, keeps
   a palette's colours and scales 16 bits to 8. Upstream, for an embedded image (`datasets` hands it a
   PIL image): converts 1-band images (palette, 16-bit) to grey through PIL's 8-bit grey, so 16-bit
   values clip to white, and passes 4-band images on; for a file path: `torchvision.io.read_image(path,
   ImageReadMode.RGB)`, which drops alpha and returns 16-bit PNGs as uint16, then resizes those in
   uint16, where the bicubic filter's overshoot past 0 or 65535 wraps around. Each is run through
   upstream's transform written out (`upstream_file_pixels`, `upstream_embedded_pixels`); the result is
   either the difference from ours or the error upstream ends with.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from bridgetower_bench.images.images import make_image_transform, pil_to_uint8_tensor, resize_geometry
from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.cartoons import draw_cartoon, jpeg_bytes


NORMAL_SIZE = (800, 650)  # the cartoons' usual size (image_bench's set)
SMALL_SIZES = ((200, 150), (100, 80))  # smaller than the 294-pixel crop: enlarged
ABOVE_CROP_SIZES = ((300, 300), (400, 296))  # the shorter side just above the crop: hardly resized
PHOTO_SIZES = ((800, 600), (300, 300))
UNNORMALISED = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


# ----------------------------------------------------------------------------------------
# Upstream's transform, written out
# ----------------------------------------------------------------------------------------


def _upstream_steps(image_size: int) -> torch.nn.Sequential:
    """Upstream's Transform (resize the shorter side, bicubic, antialiased; centre crop; to float), without Normalize."""
    from torchvision.transforms import CenterCrop, ConvertImageDtype, InterpolationMode, Resize

    return torch.nn.Sequential(
        Resize([image_size], interpolation=InterpolationMode.BICUBIC, antialias=True),
        CenterCrop(image_size),
        ConvertImageDtype(torch.float),
    )


def upstream_file_pixels(path: str, image_size: int) -> torch.Tensor:
    """Upstream's route for a path string: read_image in RGB mode (uint8, or uint16 for 16-bit PNGs), resized
    in that dtype, cropped, converted to float."""
    from torchvision.io import ImageReadMode, read_image

    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders; upstream calls them
        warnings.simplefilter("ignore")
        pixels = read_image(path, mode=ImageReadMode.RGB)
    return _upstream_steps(image_size)(pixels)


def upstream_embedded_pixels(img: Image.Image, image_size: int) -> torch.Tensor:
    """Upstream's route for a PIL image: 1-band images to grey x3 (through PIL's 8-bit "L"), to_tensor, float
    resize, crop. Upstream's Normalize (3 channel means) follows; a 4-band tensor fails there."""
    from torchvision.transforms import Normalize
    from torchvision.transforms.functional import to_grayscale, to_tensor

    if len(img.getbands()) == 1:
        img = to_grayscale(img, num_output_channels=3)
    pixels = _upstream_steps(image_size)(to_tensor(img))
    Normalize(*UNNORMALISED)(pixels)  # raises where upstream's does (the values stay unnormalised)
    return pixels


# ----------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------


def cartoon(width: int, height: int, seed: int) -> Image.Image:
    return draw_cartoon(np.random.default_rng(seed), width, height)[0].convert("RGB")


def cartoon_jpegs(size: tuple[int, int], count: int) -> list[bytes]:
    """`count` cartoons as JPEGs of `size`: drawn at that size when it is the usual one, else drawn at the usual
    size and shrunk (Lanczos) as a thumbnail is, keeping the fine detail that an enlargement shows most."""
    if size == NORMAL_SIZE:
        return [jpeg_bytes(cartoon(*size, seed=seed)) for seed in range(count)]
    return [jpeg_bytes(cartoon(*NORMAL_SIZE, seed=seed).resize(size, Image.LANCZOS)) for seed in range(count)]


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like image: colour noise with natural images' 1/f amplitude spectrum (smooth areas, texture at every
    scale), and a few objects whose edges are slightly blurred, as a lens leaves them."""
    rng = np.random.default_rng(seed)
    frequency = np.hypot(np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :])
    amplitude = 1 / np.maximum(frequency, 1 / max(width, height))
    shared = rng.standard_normal(frequency.shape) + 1j * rng.standard_normal(frequency.shape)
    channels = []
    for _ in range(3):  # colours correlated, as in photographs
        own = rng.standard_normal(frequency.shape) + 1j * rng.standard_normal(frequency.shape)
        field = np.fft.irfft2((shared + 0.5 * own) * amplitude, s=(height, width))
        channels.append(0.5 + 0.18 * (field - field.mean()) / field.std())
    img = Image.fromarray((np.clip(np.dstack(channels), 0, 1) * 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x, y = rng.integers(0, width), rng.integers(0, height)
        rx, ry = rng.integers(width // 20, width // 5), rng.integers(height // 20, height // 5)
        draw.ellipse((x - rx, y - ry, x + rx, y + ry), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return img.filter(ImageFilter.GaussianBlur(0.7))


def line_drawing(width: int, height: int, seed: int) -> Image.Image:
    """Black strokes of 1 or 2 pixels on white paper, drawn at the image's own size (a scan or an export)."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    for _ in range(60):
        x0, x1 = rng.integers(0, width, 2)
        y0, y1 = rng.integers(0, height, 2)
        draw.line([(int(x0), int(y0)), (int(x1), int(y1))], fill="black", width=int(rng.integers(1, 3)))
    return img


def image_sets(count: int) -> dict[str, list[bytes]]:
    """The JPEG sets `fast` is measured on against `upstream`, `count` images each."""
    sets = {
        f"cartoons {w}x{h}": cartoon_jpegs((w, h), count) for w, h in (NORMAL_SIZE, *SMALL_SIZES, *ABOVE_CROP_SIZES)
    }
    sets.update({f"photos {w}x{h}": [jpeg_bytes(photo(w, h, seed)) for seed in range(count)] for w, h in PHOTO_SIZES})
    sets.update(
        {
            f"line drawings {w}x{h}": [jpeg_bytes(line_drawing(w, h, seed)) for seed in range(count)]
            for w, h in (NORMAL_SIZE, ABOVE_CROP_SIZES[0])
        }
    )
    return sets


def modes_upstream_reads_differently(seed: int = 0) -> dict[str, Image.Image]:
    """An RGBA, a palette-with-transparency and a 16-bit grey image of one cartoon (400 x 300)."""
    img = cartoon(400, 300, seed)
    grey = np.asarray(img.convert("L"))
    paper = grey > 200  # the paper (everything but the ink) is what clip art leaves transparent
    rgba = np.dstack([np.asarray(img), np.full(grey.shape, 255, np.uint8)])
    rgba[paper] = 0  # transparent, and black underneath
    palette = img.quantize(16)
    index = np.asarray(palette).copy()
    index[paper] = 0
    palette_transparent = Image.fromarray(index, "P")
    palette_transparent.putpalette([0, 0, 0] + palette.getpalette()[3:])
    palette_transparent.info["transparency"] = 0
    ink_on_white = np.where(paper, 65535, grey.astype(np.uint16) * 257).astype(np.uint16)
    return {
        "RGBA PNG": Image.fromarray(rgba, "RGBA"),
        "palette PNG with transparency": palette_transparent,
        "16-bit grey PNG": Image.fromarray(ink_on_white),  # mode I;16
    }


def png_bytes(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "PNG", **({"transparency": img.info["transparency"]} if "transparency" in img.info else {}))
    return buffer.getvalue()


# ----------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------


def difference_per_255(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    ours = ours.float() / 255 if ours.dtype == torch.uint8 else ours
    return (ours - theirs).abs() * 255


def summary(differences: list[torch.Tensor]) -> dict[str, float]:
    means = [d.mean().item() for d in differences]
    return {
        "mean": float(np.mean(means)),
        "worst_image_mean": float(np.max(means)),
        "worst_pixel": float(max(d.max().item() for d in differences)),
        "images": len(differences),
    }


def uint8_kernel_pixels(data: bytes, image_size: int) -> torch.Tensor:
    """Upstream's float filter and geometry run as torch's uint8 kernel runs them: horizontal pass, rounded and
    clamped to 0..255, then vertical pass, rounded and clamped; cropped. Float in [0, 1]."""
    pixels = pil_to_uint8_tensor(Image.open(io.BytesIO(data)).convert("RGB")).float()[None]
    height, width = pixels.shape[-2:]
    new_w, new_h, top, left = resize_geometry(width, height, image_size)
    bicubic = torch.ops.aten._upsample_bicubic2d_aa
    pixels = bicubic(pixels, [height, new_w], False, 1.0, new_w / width).round().clamp(0, 255)
    pixels = bicubic(pixels, [new_h, new_w], False, new_h / height, 1.0).round().clamp(0, 255)
    return pixels[0, :, top : top + image_size, left : left + image_size] / 255


def fast_against_upstream(jpegs: list[bytes], image_size: int, directory: Path) -> dict[str, dict]:
    """`fast` beside `upstream` for the same values, embedded and as files; and beside upstream's filter run with
    the uint8 kernel's rounding and clamping after each pass (what is left once the cause is accounted for)."""
    fast = make_image_transform("fast", image_size, *UNNORMALISED)
    upstream = make_image_transform("upstream", image_size, *UNNORMALISED)
    embedded, files, explained = [], [], []
    for i, data in enumerate(jpegs):
        ours = fast(data)
        embedded.append(difference_per_255(ours, upstream(data)))
        explained.append(difference_per_255(ours, uint8_kernel_pixels(data, image_size)))
        path = directory / f"image-{i}.jpg"
        path.write_bytes(data)
        files.append(difference_per_255(fast(str(path)), upstream(str(path))))
    return {"embedded": summary(embedded), "files": summary(files), "vs_uint8_kernel": summary(explained)}


def _outcome(route: Callable[[], torch.Tensor], ours: torch.Tensor) -> dict[str, Any]:
    """The difference of ours from upstream's route, or the error upstream's route ends with."""
    try:
        theirs = route()
    except Exception as error:  # upstream's own failure, recorded as it reads
        return {"upstream": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    result = {
        "upstream": "trains",
        **summary([difference_per_255(ours, theirs)]),
        "upstream_mean_value_per_255": theirs.mean().item() * 255,
    }
    del result["images"], result["worst_image_mean"]
    return result


def sixteen_bit_wraps(path: str, image_size: int) -> int:
    """Pixels of upstream's uint16 resize that wrapped around: more than half the range from the same resize in float."""
    from torchvision.io import ImageReadMode, read_image
    from torchvision.transforms import InterpolationMode, Resize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pixels = read_image(path, mode=ImageReadMode.RGB)
    resize = Resize([image_size], interpolation=InterpolationMode.BICUBIC, antialias=True)
    in_uint16 = resize(pixels).to(torch.int32)
    in_float = resize(pixels.to(torch.int32).float()).round().clamp(0, 65535).to(torch.int32)
    return int(((in_uint16 - in_float).abs() > 32768).sum().item())


def modes_against_upstream(image_size: int, directory: Path) -> dict[str, dict]:
    """Our `upstream` pipeline beside upstream's routes for the images it reads differently."""
    ours = make_image_transform("upstream", image_size, *UNNORMALISED)
    results = {}
    for name, img in modes_upstream_reads_differently().items():
        data = png_bytes(img)
        path = directory / (name.replace(" ", "-") + ".png")
        path.write_bytes(data)
        file_result = _outcome(lambda: upstream_file_pixels(str(path), image_size), ours(str(path)))
        if img.mode.startswith("I"):
            file_result["wrapped_pixels"] = sixteen_bit_wraps(str(path), image_size)
        embedded = Image.open(io.BytesIO(data))
        results[name] = {
            "mode": embedded.mode,
            "file": file_result,
            "embedded": _outcome(lambda: upstream_embedded_pixels(embedded, image_size), ours(data)),
        }
    return results


def measure(images: int, image_size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="image_fidelity_") as temporary:
        directory = Path(temporary)
        sets = {}
        for index, (name, jpegs) in enumerate(image_sets(images).items()):
            (directory / str(index)).mkdir()
            sets[name] = fast_against_upstream(jpegs, image_size, directory / str(index))
        modes = modes_against_upstream(image_size, directory)
    return {
        "settings": {"images": images, "image_size": image_size, "units": "1/255 of a pixel value"},
        "environment": environment(),
        "fast_vs_upstream": sets,
        "modes_vs_upstream": modes,
    }


def environment() -> dict:
    import PIL
    import torchvision

    from bridgetower_bench.images.images import jpeg_decoder

    return {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "fast_jpeg_decoder": jpeg_decoder(),
    }


def format_report(report: dict) -> str:
    lines = [
        f"fast against upstream, {report['settings']['images']} JPEG(s) per set, /255 (vs_uint8_kernel: against "
        "upstream's filter rounded and clamped after each pass, as torch's uint8 kernel runs it)",
        f"{'set':<25} {'against':<15} {'mean':>6} {'worst image':>11} {'worst pixel':>11}",
    ]
    for name, routes in report["fast_vs_upstream"].items():
        for route, figures in routes.items():
            lines.append(
                f"{name:<25} {route:<15} {figures['mean']:>6.3f} {figures['worst_image_mean']:>11.3f} "
                f"{figures['worst_pixel']:>11.1f}"
            )
    lines += ["", "our upstream pipeline against upstream's, for images upstream reads differently, /255"]
    for name, result in report["modes_vs_upstream"].items():
        for route in ("file", "embedded"):
            outcome = result[route]
            text = (
                f"mean {outcome['mean']:.2f}, worst pixel {outcome['worst_pixel']:.0f}, upstream's mean value "
                f"{outcome['upstream_mean_value_per_255']:.1f}"
                if outcome["upstream"] == "trains"
                else f"upstream fails: {outcome['upstream']}"
            )
            if "wrapped_pixels" in outcome:
                text += f", {outcome['wrapped_pixels']} wrapped pixel value(s)"
            lines.append(f"{name} ({result['mode']}) as {route}: {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=24, help="cartoons per size (default 24)")
    parser.add_argument("--image-size", type=int, default=294, help="crop size (BridgeTower Large: 294)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    tool_paths.positive_counts(parser, args, "--images", "--image-size")
    if args.json is not None:  # a place it cannot write is refused before the minute of measuring
        tool_paths.output_file("--json", args.json)
    torch.set_num_threads(1)
    report = measure(args.images, args.image_size)
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    tool_paths.run(main)

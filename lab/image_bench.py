"""Micro-benchmark of the image pipelines, one core: speed and fidelity to upstream.

    python lab/image_bench.py [--images N] [--repeat R] [--image-size 294] [--json out.json]
                              [--without-simplejpeg]

For two image sets - synthetic line-art cartoons (``bridgetower_bench.tools.cartoons.draw_cartoon``,
800 x 650 JPEGs like the DESIGN notes' measurements) and real photographs shipped by installed
packages (matplotlib's ``grace_hopper.jpg``; scikit-learn's ``china.jpg`` and ``flower.jpg``
when it is installed) - it measures images/s on one core (``torch.set_num_threads(1)``) for
the ``upstream``, ``fast`` and ``fast-draft`` pipelines, a decoded-image-cache lookup, and
the decode-only rates of PIL and, when it is installed, ``simplejpeg`` (to RGBX, as ``fast``
uses it): the ceiling for any pipeline that decodes; ``fast`` is compared with that of the
decoder it uses (``--without-simplejpeg`` measures the fallback, PIL). Passes over the images are interleaved across methods and the
best pass of ``--repeat`` counts, which keeps figures comparable on a shared machine.
Fidelity is the mean and max absolute deviation of ``fast``/``fast-draft`` from
``upstream``, in 1/255 pixel units.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bridgetower_bench.images import images
from bridgetower_bench.images.image_cache import open_decoded_image_cache
from bridgetower_bench.images.images import jpeg_decoder, make_image_transform
from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.tools import tool_paths


CARTOON_SIZE = (800, 650)
# Targets from the project issue: speed as a multiple of upstream (or of the decode-only rate of
# the JPEG decoder fast uses), fidelity in /255.
TARGETS = {
    "fast_vs_upstream": 4.0,
    "fast_vs_decode": 0.60,
    "fast_mean_deviation": 0.5,
    "fast-draft_vs_upstream": 5.0,
    "cached_vs_upstream": 20.0,
}


# ----------------------------------------------------------------------------------------
# Image sets
# ----------------------------------------------------------------------------------------


def cartoon_jpegs(n_images: int, seed: int = 0) -> list[bytes]:
    """``n_images`` synthetic line-art cartoons as JPEG bytes."""
    from bridgetower_bench.tools.cartoons import draw_cartoon, jpeg_bytes

    rng = np.random.default_rng(seed)
    return [jpeg_bytes(draw_cartoon(rng, *CARTOON_SIZE)[0]) for _ in range(n_images)]


def packaged_photo_paths() -> list[Path]:
    """JPEG photographs that installed packages ship; missing ones are skipped."""
    candidates = []
    for package, folder, names in (
        ("matplotlib", "mpl-data/sample_data", ("grace_hopper.jpg",)),
        ("sklearn", "datasets/images", ("china.jpg", "flower.jpg")),
    ):
        spec = importlib.util.find_spec(package)  # locate without importing
        if spec is not None and spec.submodule_search_locations:
            root = Path(list(spec.submodule_search_locations)[0]) / folder
            candidates += [root / name for name in names]
    return [path for path in candidates if path.is_file()]


def image_sets(n_images: int) -> dict[str, list[bytes]]:
    sets = {"cartoons": cartoon_jpegs(n_images)}
    photos = [path.read_bytes() for path in packaged_photo_paths()]
    if photos:
        sets["photos"] = photos
    else:
        print("no packaged photographs found (matplotlib / scikit-learn): skipping the photo set", file=sys.stderr)
    return sets


# ----------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------


def decode_with_pil(row: dict) -> Image.Image:
    img = Image.open(io.BytesIO(row["bytes"]))
    img.load()
    return img


def decode_with_simplejpeg(row: dict) -> np.ndarray:
    return images.simplejpeg.decode_jpeg(row["bytes"], "RGBX")


def fast_decode_method() -> str:
    """The decode-only method that measures the JPEG decoder ``fast`` uses."""
    return "decode PIL" if images.simplejpeg is None else "decode simplejpeg"


def method_functions(image_size: int, cache: Callable) -> dict[str, Callable[[Any], Any]]:
    fidelity_free = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # the mean/std do not change the cost
    functions = {
        "upstream": make_image_transform("upstream", image_size, *fidelity_free),
        "fast": make_image_transform("fast", image_size, *fidelity_free),
        "fast-draft": make_image_transform("fast-draft", image_size, *fidelity_free),
        "cached": cache,
        "decode PIL": decode_with_pil,
    }
    if images.simplejpeg is not None:
        functions["decode simplejpeg"] = decode_with_simplejpeg
    return functions


def best_rates(functions: dict[str, Callable], values: list, repeat: int) -> dict[str, float]:
    """Images/s of each function: the best of ``repeat`` interleaved passes over ``values``."""
    best = {name: float("inf") for name in functions}
    for _ in range(repeat):
        for name, function in functions.items():
            started = time.perf_counter()
            for value in values:
                function(value)
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: len(values) / seconds for name, seconds in best.items()}


def deviations_from_upstream(pipeline: str, values: list, image_size: int) -> dict[str, float]:
    """Mean (over images) of the per-image mean, and the max, of |pipeline - upstream|, in /255.

    ``upstream`` against itself gives 0: the row that shows the comparison itself is sound."""
    unnormalised = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    upstream = make_image_transform("upstream", image_size, *unnormalised)
    candidate = make_image_transform(pipeline, image_size, *unnormalised)
    means, maxima = [], []
    for value in values:
        pixels = candidate(value)  # uint8 (fast pipelines) or float in [0, 1] (upstream, unnormalised)
        pixels = pixels.float() / 255 if pixels.dtype == torch.uint8 else pixels
        difference = (pixels - upstream(value)).abs() * 255
        means.append(difference.mean().item())
        maxima.append(difference.max().item())
    return {"mean": float(np.mean(means)), "max": float(np.max(maxima))}


def benchmark_set(values: list[bytes], image_size: int, repeat: int, cache_dir: Path) -> dict:
    """Rates, ratios and fidelity for one image set."""
    rows = [{"bytes": data, "path": None} for data in values]  # as a data set's image column holds them
    cache = open_decoded_image_cache(
        rows, pipeline="fast", image_size=image_size, cache_dir=cache_dir, fingerprint=f"bench-{len(rows)}"
    )
    rates = best_rates(method_functions(image_size, cache), rows, repeat)
    sizes = [Image.open(io.BytesIO(data)).size for data in values]
    return {
        "n_images": len(values),
        "n_drafted": sum(min(size) >= 2 * image_size for size in sizes),  # JPEGs fast-draft can downscale
        "mean_kbytes": round(float(np.mean([len(data) for data in values])) / 1000, 1),
        "sizes": sorted({f"{w}x{h}" for w, h in sizes}),
        "images_per_second": rates,
        "vs_upstream": {name: rate / rates["upstream"] for name, rate in rates.items()},
        "fast_decoder": fast_decode_method(),
        "fast_vs_decode": rates["fast"] / rates[fast_decode_method()],
        "deviation_from_upstream_per_255": {
            pipeline: deviations_from_upstream(pipeline, rows, image_size)
            for pipeline in ("upstream", "fast", "fast-draft")
        },
    }


def target_checks(result: dict) -> dict[str, dict]:
    """Each target with the measured figure and whether it is met."""
    measured = {
        "fast_vs_upstream": result["vs_upstream"]["fast"],
        "fast_vs_decode": result["fast_vs_decode"],
        "fast_mean_deviation": result["deviation_from_upstream_per_255"]["fast"]["mean"],
        "fast-draft_vs_upstream": result["vs_upstream"]["fast-draft"],
        "cached_vs_upstream": result["vs_upstream"]["cached"],
    }
    return {
        name: {
            "measured": value,
            "target": TARGETS[name],
            "met": value <= TARGETS[name] if name.endswith("deviation") else value >= TARGETS[name],
        }
        for name, value in measured.items()
    }


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


def format_table(results: dict[str, dict]) -> str:
    lines = [
        f"{'set':<9} {'method':<17} {'img/s/core':>10} {'x upstream':>10} {'mean dev/255':>12} {'max dev/255':>11}"
    ]
    for set_name, result in results.items():
        for method in result["images_per_second"]:
            deviation = result["deviation_from_upstream_per_255"].get(method)
            fidelity = f"{deviation['mean']:>12.3f} {deviation['max']:>11.1f}" if deviation else ""
            lines.append(
                f"{set_name:<9} {method:<17} {result['images_per_second'][method]:>10.1f} "
                f"{result['vs_upstream'][method]:>10.2f} {fidelity}".rstrip()
            )
        lines.append(
            f"{set_name:<9} {len(result['sizes'])} size(s) {', '.join(result['sizes'][:3])}; "
            f"{result['mean_kbytes']} KB/image; fast = {result['fast_vs_decode']:.0%} of {result['fast_decoder']}; "
            f"fast-draft downscaled {result['n_drafted']} of {result['n_images']} in the decoder"
        )
        for name, check in result["targets"].items():
            sign = "<=" if name.endswith("deviation") else ">="
            lines.append(
                f"{'':<9} target {name} {sign} {check['target']}: {check['measured']:.3f} "
                f"({'met' if check['met'] else 'MISSED'})"
            )
    return "\n".join(lines)


def environment() -> dict:
    import platform

    import PIL
    import torchvision

    return {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "fast_jpeg_decoder": jpeg_decoder(),
        "fast-draft_jpeg_decoder": jpeg_decoder(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16, help="synthetic cartoons to time (default 16)")
    parser.add_argument("--repeat", type=int, default=3, help="passes per method; the best counts (default 3)")
    parser.add_argument("--image-size", type=int, default=294, help="crop size (BridgeTower Large: 294)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--without-simplejpeg",
        action="store_true",
        help="measure the pipelines' fallback JPEG decoders (as if not installed)",
    )
    args = parser.parse_args(argv)
    tool_paths.positive_counts(parser, args, "--images", "--repeat", "--image-size")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.json is not None:
        tool_paths.output_file("--json", args.json)
    torch.set_num_threads(1)
    if args.without_simplejpeg:
        images.simplejpeg = None
    results = {}
    with tempfile.TemporaryDirectory(prefix="image_bench_cache_") as cache_dir:
        for set_name, values in image_sets(args.images).items():
            result = benchmark_set(values, args.image_size, args.repeat, Path(cache_dir))
            result["targets"] = target_checks(result)
            results[set_name] = result
    report = {
        "settings": {"images": args.images, "repeat": args.repeat, "image_size": args.image_size, "threads": 1},
        "environment": environment(),
        "sets": results,
    }
    print(format_table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    tool_paths.run(main)

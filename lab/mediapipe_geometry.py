"""How far the media pipeline's image geometry lands from upstream's, measured on CPU.

    python lab/mediapipe_geometry.py [--images N] [--image-size 294]

With ``--mediapipe_dataloader`` the HPU decoder is asked for the centred square of side
min(width, height), resized to S x S (``CENTER_CROP`` with ``resize=[S, S]``, see
``bridgetower_bench.mediapipe.graph``). Upstream's PyTorch path resizes the shorter side to S
(longer side truncated to an integer) and then crops the centre S x S. The two take nearly the
same region but sample it at slightly different positions and scales.

This emulates the decoder's geometry on the CPU: the same centred square, resized to S x S with
upstream's own filter (torchvision's antialiased float bicubic), so the figure isolates the
geometry; the HPU's resampling filter adds its own, unmeasured, difference. It prints the mean
(over images) of the per-image mean absolute deviation from the ``upstream`` pipeline's pixels,
and the largest single-pixel deviation, in 1/255 units, over the embedded fixture cartoons
(``bridgetower_bench.tools.fixtures``: synthetic line art, 500-1100 px a side).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torchvision.transforms import InterpolationMode, Resize
from torchvision.transforms.functional import to_tensor

from bridgetower_bench.images.images import load_image, make_image_transform


UNNORMALISED = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # mean, std that leave pixels on the 0..1 scale


def decoder_crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """The centred square the decoder's ``CENTER_CROP`` takes, as a PIL box (left, top, right, bottom).

    Habana does not document how it rounds an odd margin; half the margin rounded down is assumed
    (a half-pixel shift at most).
    """
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def emulate_decoder_geometry(value: Any, image_size: int) -> torch.Tensor:
    """(3, S, S) float pixels on the 0..1 scale: the centred square resized to S x S, upstream's filter."""
    img = load_image(value)
    square = to_tensor(img.crop(decoder_crop_box(*img.size)))
    return Resize([image_size, image_size], interpolation=InterpolationMode.BICUBIC, antialias=True)(square)


def geometry_deviation(values: Iterable[Any], image_size: int) -> dict:
    """Mean of the per-image mean |decoder geometry - upstream|, and the largest pixel's, in 1/255."""
    upstream = make_image_transform("upstream", image_size, *UNNORMALISED)
    means, maxima = [], []
    for value in values:
        difference = (emulate_decoder_geometry(value, image_size) - upstream(value)).abs() * 255
        means.append(difference.mean().item())
        maxima.append(difference.max().item())
    if not means:
        raise ValueError("no images to measure")
    return {
        "images": len(means),
        "mean_abs_deviation_per_255": float(np.mean(means)),
        "max_abs_deviation_per_255": float(np.max(maxima)),
    }


def fixture_images(limit: int) -> list:
    """Up to ``limit`` distinct images of the embedded fixture data set (all splits, in order)."""
    import datasets

    from bridgetower_bench.tools.fixtures import DATASET_CONFIG_NAME, SPLITS, ensure_default_fixtures

    path = str(ensure_default_fixtures()["dataset"])
    distinct = {}
    for split in SPLITS:
        dataset = datasets.load_dataset(path, DATASET_CONFIG_NAME, split=split)
        for row in dataset.cast_column("image", datasets.Image(decode=False))["image"]:
            distinct.setdefault(row["bytes"], row)
    return list(distinct.values())[:limit]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--images", type=int, default=72, help="How many distinct fixture images to measure (72 in all)."
    )
    parser.add_argument("--image-size", type=int, default=294, help="S, the model's input side (BridgeTower: 294).")
    args = parser.parse_args(argv)
    for flag in ("images", "image_size"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    result = geometry_deviation(fixture_images(args.images), args.image_size)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""Does the device decoder give the host `fast` pipeline's pixels, and how fast? A check for real hardware.

    python lab/device_decode_check.py IMAGES_OR_PARQUET... [--device cuda] [--image-size 294]

Decodes the images with the device loader's ``decode_batch`` and with the host ``fast`` pipeline, and prints
their pixel deviation and both speeds as json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch

from bridgetower_bench.images.device_decode import (
    ENCODED_IMAGES_KEY,
    DecodeCounts,
    EncodedImageTransform,
    collate_encoded,
    decode_batch,
)
from bridgetower_bench.images.images import FastTransform, normalize_on_device
from bridgetower_bench.measurement.throughput import synchronize_device
from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.fixtures import CLIP_MEAN, CLIP_STD
from bridgetower_bench.user_errors import UserInputError


def _image_values(paths: Sequence[str], column: str, limit: int) -> list:
    """Image values from image files and/or parquet files (a ``{"bytes", "path"}`` column)."""
    values = []
    for path in paths:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            table = pq.read_table(path, columns=[column])
            values.extend(table.column(column).to_pylist())
        else:
            values.append(path)
    if not values:
        raise ValueError("no images given")
    return values[:limit]


def compare_with_host(
    values: Sequence,
    device,
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 48,
    repeats: int = 3,
) -> dict:
    """Decode ``values`` with ``decode_batch`` and with the host ``fast`` pipeline; their deviation and speed."""
    device = torch.device(device)
    encode, host = EncodedImageTransform(image_size), FastTransform(image_size)
    started = time.perf_counter()
    try:
        expected = torch.stack([host(v) for v in values])
    except ValueError as error:  # an image the host cannot decode (empty, truncated), named by images.py
        raise UserInputError(f"images: {error}") from None
    host_seconds = time.perf_counter() - started
    batches = [
        collate_encoded(
            [{"pixel_values": encode(v), "input_ids": [0], "attention_mask": [1]} for v in values[i : i + batch_size]]
        )
        for i in range(0, len(values), batch_size)
    ]
    counts = DecodeCounts()

    def decode_all(count_into=None):
        return torch.cat([decode_batch(b[ENCODED_IMAGES_KEY], device, image_size, counts=count_into) for b in batches])

    got = decode_all(counts)  # also the warm-up (decoder and allocator start-up)
    synchronize_device(device)
    started = time.perf_counter()
    for _ in range(repeats):
        decode_all()
    synchronize_device(device)
    device_seconds = (time.perf_counter() - started) / repeats
    got = got.cpu()
    pixel_diff = (got.float() - expected.float()).abs()
    normalised_diff = (normalize_on_device(got, mean, std) - normalize_on_device(expected, mean, std)).abs()
    return {
        "images": len(values),
        "device": str(device),
        "mean_abs_diff_pixels_255": round(pixel_diff.mean().item(), 4),
        "max_abs_diff_pixels_255": int(pixel_diff.max().item()),
        "mean_abs_diff_normalised": round(normalised_diff.mean().item(), 5),
        "host_fast_images_per_s_one_core": round(len(values) / host_seconds, 1),
        "device_decode_images_per_s": round(len(values) / device_seconds, 1),
        "batch_size": batch_size,
        **counts.metrics(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="image files and/or parquet files with an image column")
    parser.add_argument("--column", default="image", help="image column of the parquet files")
    parser.add_argument("--limit", type=int, default=192, help="use at most this many images")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--image-size", type=int, default=294)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    tool_paths.positive_counts(parser, args, "--limit", "--image-size", "--batch-size")
    for path in args.images:
        tool_paths.input_file("images", path)
    if args.json:
        tool_paths.output_file("--json", args.json)
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)  # one core, like a loader worker
    result = compare_with_host(
        _image_values(args.images, args.column, args.limit),
        args.device,
        args.image_size,
        CLIP_MEAN,
        CLIP_STD,
        batch_size=args.batch_size,
    )
    print(json.dumps(result, indent=1))
    if args.json:
        write_atomically(args.json, json.dumps(result, indent=1))


if __name__ == "__main__":
    tool_paths.run(main)

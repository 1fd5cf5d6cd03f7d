"""Does a dataloader worker's own memory grow with the decode-once cache? A benchmark that prints figures.

    python lab/cache_memory_bench.py [--small 64] [--large 1024] [--workers 2] [--decode-processes N]

Builds two decoded-image caches (a small and a large one, distinct images), reads every entry through
a torch DataLoader with `--workers` worker processes, and reports each worker's own memory
(Private_Dirty: pages only this process has written, i.e. what it costs on top of the parent it was
forked from) and its file-backed resident pages (RssFile: the cache's pages, shared through the page
cache with every other process). The cache is memory-mapped, so only the shared, file-backed figure
should grow with the cache size. The caches are decoded by `--decode-processes` processes (default: as
many as `--workers`, as a training run decodes); 1 decodes in this process, without starting a pool.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bridgetower_bench.images.image_cache import open_decoded_image_cache
from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.cartoons import draw_cartoon, jpeg_bytes


def _status_kib(field: str, source: str = "status") -> int:
    with open(f"/proc/{os.getpid()}/{source}") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _CachedImages(Dataset):
    """Every cache entry once, the JPEG bytes read from a memory-mapped Arrow table as in training;
    each worker reports its memory with every item (the last one counts)."""

    def __init__(self, table, cache):
        self.table, self.cache = table, cache

    def __len__(self):
        return len(self.table)

    def __getitem__(self, index):
        pixels = self.cache(self.table[index]["image"])
        return int(pixels.sum()), os.getpid(), _status_kib("Private_Dirty", "smaps_rollup"), _status_kib("RssFile")


def worker_memory(n_images: int, workers: int, decode_processes: int, directory: str, image_size: int = 294) -> dict:
    rng = np.random.default_rng(n_images)
    values = [jpeg_bytes(draw_cartoon(rng, 640, 480)[0]) for _ in range(n_images)]
    cache = open_decoded_image_cache(
        values,
        pipeline="fast",
        image_size=image_size,
        cache_dir=directory,
        fingerprint=f"memory-bench-{n_images}",
        num_proc=decode_processes,
    )
    table_dir = os.path.join(directory, f"table-{n_images}")
    datasets.Dataset.from_dict({"image": values}).save_to_disk(table_dir)
    table = datasets.load_from_disk(table_dir)  # memory-mapped, like a training split
    del values
    last = {}
    for _, pid, anon, file_backed in DataLoader(_CachedImages(table, cache), batch_size=None, num_workers=workers):
        last[int(pid)] = (int(anon), int(file_backed))
    cache_mib = n_images * 3 * image_size * image_size / 2**20
    return {
        "images": n_images,
        "cache_mib": round(cache_mib, 1),
        "worker_private_mib": [round(a / 1024, 1) for a, _ in last.values()],
        "worker_file_backed_mib": [round(f / 1024, 1) for _, f in last.values()],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=64, help="distinct images in the small cache")
    parser.add_argument("--large", type=int, default=1024, help="distinct images in the large cache")
    parser.add_argument("--workers", type=int, default=2, help="dataloader worker processes")
    parser.add_argument(
        "--decode-processes", type=int, default=None, help="processes that decode the caches (default: --workers)"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    args.decode_processes = args.workers if args.decode_processes is None else args.decode_processes
    tool_paths.positive_counts(parser, args, "--small", "--large", "--workers", "--decode-processes")
    if args.json:
        tool_paths.output_file("--json", args.json)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        rows = [worker_memory(n, args.workers, args.decode_processes, directory) for n in (args.small, args.large)]
    print("| images | cache MiB | worker own MiB (Private_Dirty) | worker file-backed MiB (RssFile, shared) |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['images']} | {row['cache_mib']} | {row['worker_private_mib']} | {row['worker_file_backed_mib']} |"
        )
    growth = max(rows[1]["worker_private_mib"]) - max(rows[0]["worker_private_mib"])
    print(
        f"worker own-memory growth from {rows[0]['cache_mib']} to {rows[1]['cache_mib']} MiB of cache: {growth:+.1f} MiB per worker"
    )
    result = {"rows": rows, "worker_private_growth_mib": round(growth, 1)}
    if args.json:
        write_atomically(args.json, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    tool_paths.run(main)

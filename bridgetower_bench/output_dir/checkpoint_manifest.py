"""A checkpoint counts only when complete: `checkpoint-manifest.json` (every file's size and sha256), written
atomically, last, and checked against the files by `incomplete_reason` (docs/RUNS.md, "Its checkpoints are complete
or skipped")."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from bridgetower_bench.output_dir.atomic_files import PARTIAL_MARK, files_under, write_atomically


MANIFEST_NAME = "checkpoint-manifest.json"
MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def required_files(*, save_only_model: bool, world_size: int, save_on_each_node: bool = False) -> list:
    """The files a checkpoint must hold, as the Trainer and GaudiTrainer save them in `_save_checkpoint`; a tuple
    stands for "one of these". The Trainer resumes without an optimizer, scheduler or RNG state that is missing (a
    fresh one, and nothing said), so a checkpoint lacking one is not resumed from."""
    required = [MODEL_FILES, "config.json", "trainer_state.json", "training_args.bin"]
    if not save_only_model:
        required += [("optimizer.pt", "optimizer.bin"), "scheduler.pt"]
        if world_size <= 1:
            required.append("rng_state.pth")
        elif not save_on_each_node:  # (on each node's own disk, a node holds only its own ranks' states)
            required += [f"rng_state_{rank}.pth" for rank in range(world_size)]
    return required


def sha256(path: str) -> str:
    """The file's sha256, read in 1 MiB blocks (hashlib.file_digest is Python 3.11's; Habana's images run 3.10)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove(checkpoint: str) -> None:
    """Before a checkpoint directory is (re)written: it no longer counts until its new manifest is written."""
    path = os.path.join(checkpoint, MANIFEST_NAME)
    if os.path.exists(path):
        os.remove(path)


def write(checkpoint: str, required: list, manifest_name: str = MANIFEST_NAME, leave_out=()) -> Optional[str]:
    """List every file of checkpoint (but `leave_out`) with its size and sha256, atomically, last. Returns why it was
    not written (a required file is missing: the checkpoint does not count), or None. The published set's manifest
    too (run_directory.PUBLISHED_MANIFEST)."""
    names = [
        name
        for name in files_under(checkpoint)
        if name != manifest_name and name not in leave_out and PARTIAL_MARK not in os.path.basename(name)
    ]
    choices = [entry if isinstance(entry, tuple) else (entry,) for entry in required]
    present = set(names)
    absent = [" or ".join(entry) for entry in choices if not present.intersection(entry)]
    if absent:
        return f"it has no {', '.join(absent)}"
    paths = {name: os.path.join(checkpoint, name) for name in names}
    files = {name: {"bytes": os.path.getsize(path), "sha256": sha256(path)} for name, path in paths.items()}
    manifest = json.dumps({"files": files}, indent=4, sort_keys=True) + "\n"
    write_atomically(os.path.join(checkpoint, manifest_name), manifest, fsync=True)
    return None


def incomplete_reason(checkpoint: str, manifest_name: str = MANIFEST_NAME) -> Optional[str]:
    """Why checkpoint cannot be resumed from (a file missing, cut short or changed since it was saved), or None."""
    try:
        with open(os.path.join(checkpoint, manifest_name)) as f:
            files = json.load(f)["files"]
        expected = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"it has no {manifest_name} (its save did not finish)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {manifest_name} is unreadable"
    for name, (size, digest) in sorted(expected.items()):
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{name} has {actual} bytes, not the {size} saved"
        if sha256(path) != digest:
            return f"{name} is not the file saved (its sha256 differs)"
    return None

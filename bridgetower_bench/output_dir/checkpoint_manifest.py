"""A checkpoint counts only when it is complete: every file it should hold, each as it was saved.

After the trainer has saved a checkpoint (weights, config, optimizer, scheduler, RNG states, trainer state,
training arguments, and the run's recipe), `write` lists every file of the checkpoint directory with its size
and sha256 in `checkpoint-manifest.json`, written atomically, as the last thing: a checkpoint without a
manifest was cut short. `incomplete_reason` reads a checkpoint back against its manifest and says why it
cannot be resumed from (a file missing, shorter or longer, or changed since it was saved), or None.

Which files a checkpoint must hold (what transformers' Trainer and optimum-habana's GaudiTrainer save
in `_save_checkpoint` and read back in `_load_from_checkpoint`, `_load_optimizer_and_scheduler`,
`_load_rng_state`):
- the weights: `model.safetensors` (or `pytorch_model.bin`, or a sharded index with its shards), `config.json`;
- `trainer_state.json` (step, epoch, log history) and `training_args.bin`;
- unless `--save_only_model`: `optimizer.pt`, `scheduler.pt` and the RNG states, `rng_state.pth` for one
  process, `rng_state_<rank>.pth` for each process of a distributed run. The Trainer resumes without any of
  these when it is missing (a fresh optimizer, schedule or random stream, and nothing said), so a
  checkpoint lacking one is not resumed from;
- the run's recipe (`recipe.json`, see run_recipe.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from bridgetower_bench.output_dir.atomic_files import PARTIAL_MARK, write_atomically


MANIFEST_NAME = "checkpoint-manifest.json"
MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def required_files(*, save_only_model: bool, world_size: int, save_on_each_node: bool = False) -> list:
    """The files a checkpoint must hold; a tuple stands for "one of these"."""
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


def _files(checkpoint: str) -> list:
    """Every file under checkpoint (relative paths), but the manifest and temporary files of writers."""
    found = []
    for root, _, names in os.walk(checkpoint):
        for name in names:
            path = os.path.relpath(os.path.join(root, name), checkpoint)
            if path != MANIFEST_NAME and PARTIAL_MARK not in name:
                found.append(path)
    return sorted(found)


def missing(checkpoint: str, required: list) -> list:
    """The required entries (a name, or "a or b") that checkpoint does not hold."""
    present = set(_files(checkpoint))
    absent = []
    for entry in required:
        choices = entry if isinstance(entry, tuple) else (entry,)
        if not present.intersection(choices):
            absent.append(" or ".join(choices))
    return absent


def remove(checkpoint: str) -> None:
    """Before a checkpoint directory is (re)written: it no longer counts until its new manifest is written."""
    path = os.path.join(checkpoint, MANIFEST_NAME)
    if os.path.exists(path):
        os.remove(path)


def write(checkpoint: str, required: list) -> Optional[str]:
    """List every file of checkpoint with its size and sha256, atomically, last. Returns why it was not written
    (a required file is missing: the checkpoint does not count), or None."""
    absent = missing(checkpoint, required)
    if absent:
        return f"it has no {', '.join(absent)}"
    files = {}
    for name in _files(checkpoint):
        path = os.path.join(checkpoint, name)
        files[name] = {"bytes": os.path.getsize(path), "sha256": sha256(path)}
    write_atomically(
        os.path.join(checkpoint, MANIFEST_NAME),
        json.dumps({"files": files}, indent=4, sort_keys=True) + "\n",
        fsync=True,
    )
    return None


def incomplete_reason(checkpoint: str) -> Optional[str]:
    """Why checkpoint cannot be resumed from (a file missing, cut short or changed since it was saved), or None."""
    try:
        with open(os.path.join(checkpoint, MANIFEST_NAME)) as f:
            files = json.load(f)["files"]
        expected = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"it has no {MANIFEST_NAME} (its save did not finish)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST_NAME} is unreadable"
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

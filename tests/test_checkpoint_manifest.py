"""Checkpoints are complete or skipped: a checkpoint counts only when every file it should hold is there as saved.

The trainer lists each file of a checkpoint with its size and sha256, last (output_dir/checkpoint_manifest.py). A
resume passes over a checkpoint with a file missing, cut short or changed, names it and why, and resumes from the
newest complete one, to the weights of an uninterrupted run."""

import hashlib
import os
import shutil

import pytest
import torch

from bridgetower_bench.output_dir import checkpoint_manifest
from helpers import command, load_weights, read_json, resumed_at, run_killed_while_publishing, run_script


REQUIRED = checkpoint_manifest.required_files(save_only_model=False, world_size=1)


def saved_checkpoint(directory):
    directory.mkdir()
    for name in (
        "model.safetensors config.json trainer_state.json training_args.bin optimizer.pt scheduler.pt rng_state.pth"
    ).split():
        (directory / name).write_bytes(name.encode() * 100)
    assert checkpoint_manifest.write(str(directory), REQUIRED) is None
    return directory


def assert_same_weights(reference, out):
    expected, actual = load_weights(reference), load_weights(out)
    assert expected.keys() == actual.keys()
    differing = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not differing, f"{len(differing)} of {len(expected)} tensors differ from the uninterrupted run's"


def test_a_checkpoint_counts_only_with_every_file_as_saved(tmp_path):
    checkpoint = saved_checkpoint(tmp_path / "checkpoint-2")

    def reason():
        return checkpoint_manifest.incomplete_reason(str(checkpoint))

    assert reason() is None
    (checkpoint / "optimizer.pt").unlink()
    assert reason() == "optimizer.pt is missing"
    (checkpoint / "optimizer.pt").write_bytes(b"optimizer.pt" * 50)
    assert reason() == "optimizer.pt has 600 bytes, not the 1200 saved"
    (checkpoint / "optimizer.pt").write_bytes(b"optimizer.pT" * 100)  # same size, other content
    assert reason() == "optimizer.pt is not the file saved (its sha256 differs)"

    (checkpoint / checkpoint_manifest.MANIFEST_NAME).write_text('{"files": ')
    assert reason() == "its checkpoint-manifest.json is unreadable"
    checkpoint_manifest.remove(str(checkpoint))  # (what a save into this directory does first)
    assert reason() == "it has no checkpoint-manifest.json (its save did not finish)"

    # a save that left out a file the trainer needs to resume exactly writes no manifest: the checkpoint never counts
    (checkpoint / "rng_state.pth").unlink()
    assert checkpoint_manifest.write(str(checkpoint), REQUIRED) == "it has no rng_state.pth"
    assert reason() is not None
    distributed = checkpoint_manifest.required_files(save_only_model=False, world_size=2)
    assert "rng_state_0.pth" in distributed and "rng_state_1.pth" in distributed and "rng_state.pth" not in distributed
    assert "optimizer.pt" not in str(checkpoint_manifest.required_files(save_only_model=True, world_size=1))


# End to end: a damaged checkpoint is skipped, the earlier one resumed, bit for bit ---------------------------------


@pytest.fixture(scope="module")
def runs(fixtures, tmp_path_factory):
    """A 6-step run killed as it published its model, its checkpoint-6 taken away (as if killed during step 6):
    checkpoint-2 and checkpoint-4 are left, both in the first epoch. The uninterrupted run's weights: checkpoint-6's
    (saved after the last step, as the model it was publishing)."""
    root = tmp_path_factory.mktemp("checkpoints")
    reference, killed = root / "reference", root / "killed"
    run_killed_while_publishing("cuda", command(fixtures, killed, max_steps=6))
    (killed / "checkpoint-6").rename(reference)
    return {"reference": reference, "killed": killed}


def damage(path, how):
    if how == "removed":
        path.unlink()
    else:
        os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("how", ["removed", "truncated"])
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors"])
def test_a_damaged_checkpoint_is_skipped_and_the_earlier_one_resumed_to_the_uninterrupted_weights(
    name, how, runs, fixtures, tmp_path
):
    out = tmp_path / "run"
    shutil.copytree(runs["killed"], out)
    damage(out / "checkpoint-4" / name, how)

    resumed = run_script("cuda", command(fixtures, out, max_steps=6))
    assert_same_weights(runs["reference"], out)
    log = resumed.stdout + resumed.stderr
    assert (
        f"Not resuming from {out / 'checkpoint-4'}: {name} " + ("is missing" if how == "removed" else "has ") in log
    ), log[-3000:]
    assert f"resuming training at {out / 'checkpoint-2'}" in log and resumed_at(log, 2)
    log_history = read_json(out / "trainer_state.json")["log_history"]
    assert [e["step"] for e in log_history if "loss" in e] == list(range(1, 7))
    assert checkpoint_manifest.incomplete_reason(str(out / "checkpoint-4")) is None, "saved again, complete"


def test_with_no_complete_checkpoint_the_run_says_so_and_starts_afresh(runs, fixtures, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["killed"], out)
    damage(out / "checkpoint-4" / "optimizer.pt", "truncated")
    damage(out / "checkpoint-2" / "trainer_state.json", "truncated")

    resumed = run_script("cuda", command(fixtures, out, max_steps=6))
    log = resumed.stdout + resumed.stderr
    assert f"{out} holds no complete checkpoint, only incomplete ones (checkpoint-4: optimizer.pt has " in log
    assert "; checkpoint-2: trainer_state.json has " in log and "training starts afresh" in log
    assert "Continuing training" not in log and "Resuming training from checkpoint" not in log  # (4.x, 5.x)
    assert_same_weights(runs["reference"], out)


def test_gaudi_script_skips_a_checkpoint_whose_optimizer_state_is_cut_short(fixtures, tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "run"
    run_killed_while_publishing("gaudi", command(fixtures, out, "gaudi", max_steps=4))  # checkpoints 2 and 4 saved
    shutil.copytree(out / "checkpoint-4", reference)  # the uninterrupted run's weights, saved after its last step
    damage(out / "checkpoint-4" / "optimizer.pt", "truncated")

    resumed = run_script("gaudi", command(fixtures, out, "gaudi", max_steps=4))
    assert_same_weights(reference, out)
    log = resumed.stdout + resumed.stderr
    assert f"Not resuming from {out / 'checkpoint-4'}: optimizer.pt has " in log
    assert f"resuming training at {out / 'checkpoint-2'}" in log


def test_a_file_digest_needs_nothing_newer_than_python_3_10(tmp_path, monkeypatch):
    """Habana's images run Python 3.10, which has no hashlib.file_digest: the manifest's sha256 must not need it,
    and must be the file's sha256 also past one read block."""
    monkeypatch.delattr(hashlib, "file_digest", raising=False)
    data = bytes(range(256)) * 5000  # 1.28 MB: more than one block
    (tmp_path / "weights").write_bytes(data)
    assert checkpoint_manifest.sha256(str(tmp_path / "weights")) == hashlib.sha256(data).hexdigest()

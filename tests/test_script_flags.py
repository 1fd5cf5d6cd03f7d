"""Script flags that change what is trained or how images are loaded, run end to end on the embedded fixtures:
--freeze_vision_model / --freeze_text_model, --device_decode (on CPU), --cache_decoded_images on the Gaudi script,
--config_name, --tokenizer_name, --image_processor_name, --use_fast_tokenizer, --freeze_text_pooler, the sample limits.
Each run also checks its own throughput arithmetic and that its caches live under the tests' HF_HOME."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from bridgetower_bench.images import image_cache
from bridgetower_bench.tools.fixtures import MODEL_WEIGHTS
from helpers import CPU_FLAGS, assert_throughput_adds_up, base_args, load_weights, read_json, run_script


BATCH = 4


def tower_weights(weights: dict, tower: str) -> dict:
    prefix = f"bridgetower.{tower}."
    return {name: tensor for name, tensor in weights.items() if name.startswith(prefix)}


def check_throughput_arithmetic(train: dict, steps: int) -> None:
    """The throughput of the steps after the one warm-up step adds up, within the run's own time."""
    assert_throughput_adds_up(train, steps - 1, BATCH)
    assert train["throughput_counted_seconds"] < train["train_runtime"]


@pytest.mark.parametrize(
    "kind, frozen, trained", [("cuda", "vision_model", "text_model"), ("gaudi", "text_model", "vision_model")]
)
def test_a_frozen_tower_keeps_its_weights_and_the_other_one_learns(kind, frozen, trained, fixtures, tmp_path):
    out = tmp_path / "run"
    flag = {"vision_model": "--freeze_vision_model", "text_model": "--freeze_text_model"}[frozen]
    run_script(kind, base_args(fixtures, out, max_steps=2, save_steps=100) + ["--do_train", flag] + CPU_FLAGS[kind])
    before, after = load_weights(fixtures["model"]), load_weights(out)

    still = tower_weights(after, frozen)
    assert len(still) > 10
    assert [name for name, tensor in still.items() if not torch.equal(tensor, before[name])] == []
    moved = tower_weights(after, trained)
    changed = [name for name, tensor in moved.items() if not torch.equal(tensor, before[name])]
    assert len(changed) > len(moved) // 2, f"only {len(changed)} of {len(moved)} {trained} tensors changed"

    check_throughput_arithmetic(read_json(out / "train_results.json"), steps=2)
    # The preflight verdict went to the tests' own HF_HOME, not to the user's cache.
    home = Path(os.environ["HF_HOME"])
    assert not home.is_relative_to(Path("~/.cache").expanduser()) and list(
        (home / "bridgetower_bench" / "preflight").glob("*.json")
    )


def test_device_decode_flag_trains_on_cpu_and_records_the_loader_and_its_counts(fixtures, tmp_path):
    out = tmp_path / "run"
    result = run_script(
        "cuda", base_args(fixtures, out, max_steps=3) + ["--do_train", "--device_decode"] + CPU_FLAGS["cuda"]
    )
    train = read_json(out / "train_results.json")
    assert train["loader"] == "device_decode" and train["image_pipeline"] == "fast"
    # Every training image of the three steps went through the device decoder (the fixtures are baseline JPEGs).
    assert train["device_decode_images"] == 3 * BATCH and train["device_decode_fallback_images"] == 0
    assert "device decode, epoch" in result.stdout + result.stderr
    check_throughput_arithmetic(train, steps=3)


def test_gaudi_script_trains_from_the_decoded_image_cache(fixtures, tmp_path):
    """The first run builds the cache; a second run reuses it, and its pixels really come from the cache: blanked
    pixels change the loss."""
    cache_dir = tmp_path / "decoded"
    args = ["--do_train", "--image_pipeline", "fast", "--cache_decoded_images", "--decoded_image_cache_dir", cache_dir]
    args += CPU_FLAGS["gaudi"]
    first = run_script("gaudi", base_args(fixtures, tmp_path / "first", max_steps=2, save_steps=100) + args)
    assert "Built the decoded image cache" in first.stdout + first.stderr
    (built,) = cache_dir.iterdir()
    manifest = read_json(built / image_cache.MANIFEST_FILE)
    assert 1 <= manifest["n_images"] <= 16 and manifest["pipeline"] == "fast"  # the distinct images of 16 rows
    first_train = read_json(tmp_path / "first" / "train_results.json")
    assert first_train["image_pipeline"] == "fast" and first_train["loader"] == "torch"
    check_throughput_arithmetic(first_train, steps=2)

    pixels = np.load(built / image_cache.PIXELS_FILE, mmap_mode="r+")
    pixels[:] = 0
    pixels.flush()
    del pixels
    second = run_script("gaudi", base_args(fixtures, tmp_path / "second", max_steps=2, save_steps=100) + args)
    assert "Reusing the decoded image cache" in second.stdout + second.stderr
    second_train = read_json(tmp_path / "second" / "train_results.json")
    assert second_train["train_loss"] != pytest.approx(first_train["train_loss"], rel=1e-6, abs=0)


def test_naming_flags_load_what_they_name_the_pooler_flag_keeps_it_and_the_sample_limits_cut_the_splits(
    fixtures, tmp_path
):
    """--config_name, --tokenizer_name and --image_processor_name each name a copy of the model's file with one
    value changed: the run trains with (and publishes) the copy's. --freeze_text_pooler False keeps the pooler;
    --use_fast_tokenizer False loads the slow tokenizer, which saves no tokenizer.json (it needs a merges.txt, which
    the published model, and so the fixture, lacks: the copy gets one, from tokenizer.json's merges). The run they are
    compared with is cut by --max_train_samples and --max_eval_samples."""
    model = Path(fixtures["model"])
    changed = {
        "config_name": ("config.json", "initializer_factor", 0.5),
        "tokenizer_name": ("tokenizer_config.json", "model_max_length", 77),
        "image_processor_name": ("preprocessor_config.json", "image_mean", [0.25, 0.5, 0.75]),
    }
    flags = []
    for flag, (name, key, value) in changed.items():
        copy = tmp_path / flag
        copy.mkdir()
        for file in model.iterdir():
            if file.name != MODEL_WEIGHTS:
                (copy / file.name).write_bytes(file.read_bytes())
        (copy / name).write_text(
            json.dumps({**(read_json(model / name) if (model / name).exists() else {}), key: value})
        )
        flags += [f"--{flag}", str(copy)]
    merges = read_json(model / "tokenizer.json")["model"]["merges"]
    merges = "\n".join(m if isinstance(m, str) else " ".join(m) for m in merges)
    (tmp_path / "tokenizer_name" / "merges.txt").write_text(f"#version: 0.2\n{merges}\n")
    named, default = tmp_path / "named", tmp_path / "default"
    extra = ["--freeze_text_pooler", "False", "--use_fast_tokenizer", "False"]
    run_script("cuda", base_args(fixtures, named, max_steps=1) + ["--do_train", *flags, *extra] + CPU_FLAGS["cuda"])
    args = base_args(fixtures, default, max_train_samples=12, max_eval_samples=4) + ["--do_train", "--do_eval"]
    log = run_script("cuda", args + CPU_FLAGS["cuda"])
    shown = re.findall(r"Num examples = (\d+)", log.stdout + log.stderr)
    assert shown[0] == "12" and shown[-1] == "4", shown  # 12 training rows, 4 evaluation rows
    assert read_json(default / "trainer_state.json")["global_step"] == 3  # 12 rows in batches of 4
    for flag, (name, key, value) in changed.items():
        assert read_json(named / name)[key] == value != read_json(default / name).get(key), flag
    assert (default / "tokenizer.json").exists() and not (named / "tokenizer.json").exists()  # slow
    pooler = [name for name in load_weights(named) if ".text_model.pooler." in name]
    assert pooler and not [name for name in load_weights(default) if ".text_model.pooler." in name]

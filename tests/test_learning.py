"""The tiny model learns: a few hundred CPU steps of the real script on the synthetic cartoons
raise validation recall@1 far above its value at initialisation.

The fixtures differ from the defaults in four documented ways, each needed for a random-weight
model to learn in seconds rather than not at all (see make_tiny_model / make_synthetic_dataset):
no dropout (with it the image tower collapses and retrieval stays at chance), vision position
embeddings on the scale of the patch embeddings (so left/middle/right can be learned), small
cartoons with bold strokes (thin scan-sized strokes fade to grey at 112 px), and one row per
cartoon with many cartoons (no false negatives in a batch; no memorising a few hundred images).

Why the margin cannot be chance: with rows_per_cartoon=1 the validation split has N images and
N captions, so recall@1 in both directions is a count of hits out of 2N rankings. A model that
has learned nothing ranks at random; for N = 96 its i2t plus t2i hits average 2, and in 20,000
simulated random similarity matrices 10 or more hits occurred with frequency 4.5e-4 and 12 or
more with 5e-5. The test asks for at least MIN_EXTRA_HITS more hits after training than at
initialisation. Both directions are summed because each alone has half the hits and twice the
relative noise; a model that learned only one direction would still have to clear the bar.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from bridgetower_bench.fixtures import make_synthetic_dataset, make_tiny_model
from conftest import CPU_FLAGS, read_json, run_script

IMAGE_SIZE = 112
VALIDATION_CARTOONS = 96
TRAIN_CARTOONS = 1536
TRAIN_STEPS = 400
MIN_EXTRA_HITS = 12  # out of 2 * VALIDATION_CARTOONS rankings; see the module docstring


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    """A tiny model and a data set it can learn from in a few hundred CPU steps (about 10 s to build)."""
    root = tmp_path_factory.mktemp("learnable")
    model = make_tiny_model(root / "model", image_size=IMAGE_SIZE, dropout=0.0, vision_position_std=1.0)
    dataset = make_synthetic_dataset(
        root / "dataset", train_rows=TRAIN_CARTOONS, validation_rows=VALIDATION_CARTOONS, test_rows=1,
        rows_per_cartoon=1, seed=1, image_side_range=(160, 260), stroke_scale=2.0)
    return {"model": model, "dataset": dataset, "image_cache": root / "decoded-images"}


def script_args(learnable, output_dir, *extra):
    """The CUDA script on CPU, fast image pipeline with decoded images cached: only the model costs time."""
    args = {
        "model_name_or_path": learnable["model"],
        "dataset_name": learnable["dataset"],
        "dataset_config_name": "matching",
        "image_column": "image",
        "caption_column": "image_description",
        "output_dir": output_dir,
        "image_pipeline": "fast",
        "decoded_image_cache_dir": learnable["image_cache"],
        "max_seq_length": 24,  # the longest caption is 16 tokens
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 48,
        "learning_rate": 5e-4,
        "seed": 1,
        "logging_steps": 50,
        "save_strategy": "no",
        "report_to": "none",
        "dataloader_num_workers": 0,
    }
    flat = [f"--{key}={value}" for key, value in args.items()]
    return flat + ["--cache_decoded_images", "--do_eval", *extra] + CPU_FLAGS["cuda"]


def recall_at_1_hits(metrics: dict) -> int:
    """i2t plus t2i hits at rank 1 (each recall@1 times the N images = N captions of the split)."""
    assert metrics["eval_num_images"] == metrics["eval_num_captions"] == VALIDATION_CARTOONS
    total = (metrics["eval_i2t_recall@1"] + metrics["eval_t2i_recall@1"]) * VALIDATION_CARTOONS
    return round(total)


def test_a_few_hundred_cpu_steps_raise_validation_recall_at_1_beyond_chance(learnable, tmp_path):
    run_script("cuda", script_args(learnable, tmp_path / "init"))
    run_script("cuda", script_args(learnable, tmp_path / "trained", "--do_train", f"--max_steps={TRAIN_STEPS}"))
    before = read_json(tmp_path / "init" / "eval_results.json")
    after = read_json(tmp_path / "trained" / "eval_results.json")

    gained = recall_at_1_hits(after) - recall_at_1_hits(before)
    summary = {key: (round(before[key], 3), round(after[key], 3))
               for key in ("eval_i2t_recall@1", "eval_t2i_recall@1", "eval_i2t_mean_rank", "eval_t2i_mean_rank")}
    assert gained >= MIN_EXTRA_HITS, f"recall@1 hits gained {gained} < {MIN_EXTRA_HITS}; (before, after): {summary}"

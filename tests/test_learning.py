"""The tiny model learns: a few hundred CPU steps of the real script on the synthetic cartoons raise validation
recall@1 far above its value at initialisation.

The model has make_tiny_model's default shape (14-px patches, two layers per tower; the local preset's model,
DEFAULT_MODEL_OPTIONS, is coarser still, built for speed, not learning). The fixtures differ from the defaults in ways
documented in make_tiny_model and make_synthetic_dataset, each needed for a random-weight model to learn in a minute
rather than not at all:
- no dropout: with it the image tower collapses to one embedding and retrieval stays at chance;
- vision position embeddings 10x BridgeTower's initial scale: otherwise they are drowned by the patch embeddings of
  blank paper, and left/middle/right is learned very slowly;
- small cartoons (160-260 px) with bold strokes: scan-sized strokes fade to grey at 84 px;
- one row per cartoon and 1536 training cartoons: no false negatives within a batch, and nothing small enough to
  memorise.

Why the margin cannot be chance: with one row per cartoon the validation split has N images and N captions, so i2t and
t2i recall@1 together count hits among 2N rankings. A model that has learned nothing ranks at random: for N = 96 its
hits average 2, and among 20,000 simulated random 96 x 96 similarity matrices, 10 or more hits came up with frequency
4.5e-4 (12 or more: 5e-5). The test asks for MIN_EXTRA_HITS = 10 more hits after training than at initialisation. Both
directions are summed because each alone has half the hits and twice the relative noise. Measured with the seeds below:
2 hits at initialisation, 23 after training (20 with the upstream image pipeline); with four other model or data-order
seeds, 23 to 40 hits after 600 steps."""

import numpy as np
import pytest
import torch

from bridgetower_bench.tools import cartoons
from bridgetower_bench.tools.fixtures import MODEL_WEIGHTS, make_synthetic_dataset, make_tiny_model, script_arguments
from helpers import CPU_FLAGS, read_json, run_script


IMAGE_SIZE = 84  # 6 x 6 patches of 14 px: a third cheaper per step than 112 px, and learns as well
VALIDATION_CARTOONS = 96
TRAIN_CARTOONS = 1536
TRAIN_STEPS = 600
MIN_EXTRA_HITS = 10  # out of 2 * VALIDATION_CARTOONS rankings; see the module docstring


@pytest.fixture(scope="module")
def learnable_model(tmp_path_factory):
    """The tiny model with the options that let it learn (the module docstring)."""
    path = tmp_path_factory.mktemp("learnable") / "model"
    return make_tiny_model(path, image_size=IMAGE_SIZE, dropout=0.0, vision_position_scale=10)


@pytest.fixture(scope="module")
def learnable(learnable_model, tmp_path_factory):
    """The learnable model and a data set it can learn from in a few hundred CPU steps (about 10 s to build)."""
    root = tmp_path_factory.mktemp("learnable")
    rows = dict(train_rows=TRAIN_CARTOONS, validation_rows=VALIDATION_CARTOONS, test_rows=1, rows_per_cartoon=1)
    dataset = make_synthetic_dataset(root / "dataset", **rows, seed=1, image_side_range=(160, 260), stroke_scale=2.0)
    return {"model": learnable_model, "dataset": dataset, "image_cache": root / "decoded-images"}


def script_args(learnable, output_dir, *extra) -> list:
    """The CUDA script on CPU; fast image pipeline with decoded images cached, so steps cost only the model."""
    args = {
        **script_arguments(learnable),
        "output_dir": output_dir,
        "image_pipeline": "fast",
        "decoded_image_cache_dir": learnable["image_cache"],
        "max_seq_length": 24,  # the longest caption is 16 tokens
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 48,
        "learning_rate": 5e-4,  # 1e-3 is too high for the vision tower trained from scratch
        "seed": 1,
        "logging_steps": 50,
        "save_strategy": "no",
        "report_to": "none",
        "dataloader_num_workers": 0,
    }
    flat = [f"--{key}={value}" for key, value in args.items()]
    return flat + ["--cache_decoded_images", "--do_eval", *extra] + CPU_FLAGS["cuda"]


def recall_at_1_hits(metrics: dict) -> int:
    """i2t plus t2i hits at rank 1: each recall@1 times the split's N images (= N captions)."""
    assert metrics["eval_num_images"] == metrics["eval_num_captions"] == VALIDATION_CARTOONS
    return round((metrics["eval_i2t_recall@1"] + metrics["eval_t2i_recall@1"]) * VALIDATION_CARTOONS)


@pytest.mark.slow
def test_a_few_hundred_cpu_steps_raise_validation_recall_at_1_beyond_chance(learnable, tmp_path):
    run_script("cuda", script_args(learnable, tmp_path / "init"))
    run_script("cuda", script_args(learnable, tmp_path / "trained", "--do_train", f"--max_steps={TRAIN_STEPS}"))
    before = read_json(tmp_path / "init" / "validation_results.json")
    after = read_json(tmp_path / "trained" / "validation_results.json")

    gained = recall_at_1_hits(after) - recall_at_1_hits(before)
    figures = {
        key: (round(before[key], 3), round(after[key], 3))
        for key in ("eval_i2t_recall@1", "eval_t2i_recall@1", "eval_i2t_mean_rank", "eval_t2i_mean_rank")
    }
    assert gained >= MIN_EXTRA_HITS, (
        f"{gained} recall@1 hits gained, wanted {MIN_EXTRA_HITS}; (before, after): {figures}"
    )


# --- the fixture options this test relies on -------------------------------------------------------


def test_learnable_model_differs_from_the_default_only_in_dropout_and_vision_positions(learnable_model, tmp_path):
    from transformers import BridgeTowerConfig

    default = make_tiny_model(tmp_path / "default", image_size=IMAGE_SIZE)
    config, default_config = (BridgeTowerConfig.from_pretrained(d).text_config for d in (learnable_model, default))
    assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (0.0, 0.0)
    assert (default_config.hidden_dropout_prob, default_config.attention_probs_dropout_prob) == (0.1, 0.1)

    weights, default_weights = (torch.load(d / MODEL_WEIGHTS, weights_only=True) for d in (learnable_model, default))
    positions = "bridgetower.vision_model.visual.embeddings.position_embedding.weight"
    assert torch.allclose(weights[positions], 10 * default_weights[positions])
    assert [k for k in weights if not torch.equal(weights[k], default_weights[k])] == [positions]


def test_small_cartoons_stay_in_their_side_range_and_bold_strokes_lay_more_ink():
    rng = np.random.default_rng(0)
    sizes = [cartoons.sample_image_size(rng, (160, 260)) for _ in range(200)]
    assert all(160 <= side <= 260 for size in sizes for side in size)
    assert {w > h for w, h in sizes} == {True, False}  # landscape and portrait both occur

    scene = cartoons.Scene("park", "middle", (("house", 2),))

    def dark_pixels(stroke_scale):
        image = cartoons.render_scene(scene, np.random.default_rng(5), 220, 180, stroke_scale)
        return int((np.asarray(image.convert("L")) < 128).sum())

    assert dark_pixels(2.0) > 1.5 * dark_pixels(1.0)


@pytest.mark.parametrize(
    "make, options, named",
    [
        (make_synthetic_dataset, {"image_side_range": (32, 100)}, "image_side_range"),
        (make_synthetic_dataset, {"image_side_range": (300, 200)}, "image_side_range"),
        (make_synthetic_dataset, {"image_side_range": 200}, "image_side_range"),
        (make_synthetic_dataset, {"stroke_scale": 0}, "stroke_scale"),
        (make_tiny_model, {"dropout": 1.0}, "dropout"),
        (make_tiny_model, {"dropout": -0.1}, "dropout"),
        (make_tiny_model, {"vision_position_scale": 0}, "vision_position_scale"),
    ],
)
def test_bad_dataset_and_model_options_are_refused_by_name(tmp_path, make, options, named):
    rows = dict(train_rows=1, validation_rows=1, test_rows=1) if make is make_synthetic_dataset else {}
    with pytest.raises(ValueError, match=named):
        make(tmp_path, **rows, **options)

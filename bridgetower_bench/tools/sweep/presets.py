"""The runs' flags: the two presets (local: the embedded fixtures in the published run's epoch shape; blog: the
published command line), the device flags and variables, and --extra-args.

The local preset runs the embedded fixtures (bridgetower_bench.tools.fixtures: random-weight tiny BridgeTower,
synthetic New Yorker-shaped data) offline: per-device batch 8, captions padded to 32 tokens (the synthetic ones
have at most 16; upstream's default pads to 128), logging every 10 steps, no checkpoints. Its default shape
(`published`) is the published run's: the 192 training rows make 24 optimizer steps per epoch (published: about
9.8k rows / 384 per step, 25.5), and 53 steps with 3 warm-up put two epoch starts (steps 25 and 49) inside the 50
counted steps, so the loader's restart at each epoch is measured as it is in the published 5-epoch runs.
`within-epoch` runs 13 steps (3 warm-up + 10 counted) inside the first epoch: the steady state alone. The tiny
model takes BridgeTower's 294-px images but is cheap to train (one layer per tower, 42-px patches), so like the
published accelerator runs the local preset is bound by image loading, not by the model.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping

from bridgetower_bench import published
from bridgetower_bench.guards.execution_mode import LAZY_MODE_VARIABLE
from bridgetower_bench.redaction import redact_text


# Flags the sweep sets per run: --extra-args must not override them.
SWEEP_FLAGS = (
    "--output_dir",
    "--dataloader_num_workers",
    "--image_pipeline",
    "--mediapipe_dataloader",
    "--device_decode",
    "--dataloader_persistent_workers",
    "--dataloader_prefetch_factor",
)


def device_flags(script: str, device: str, gaudi_config: str, preset: str) -> list[str]:
    """Flags for the device the runs train on. On HPUs lazy mode, which needs PT_HPU_LAZY_MODE=1 (`mode_env`);
    the blog preset as upstream's CI: bf16 autocast from the Gaudi config (Habana/clip), --sdp_on_bf16."""
    if device == "cpu":
        return ["--use_cpu"] + (["--use_lazy_mode", "False"] if script == "gaudi" else [])
    if script == "gaudi":
        flags = ["--use_habana", "--use_lazy_mode"]
        if preset == "blog":
            return flags + ["--use_hpu_graphs_for_inference", "--gaudi_config_name", gaudi_config, "--sdp_on_bf16"]
        return flags + ["--gaudi_config_name", gaudi_config, "--bf16"]
    return ["--bf16"]


def mode_env(script: str, device: str) -> dict:
    """Environment variables a run needs for its execution mode: PT_HPU_LAZY_MODE=1 for the Gaudi script on HPUs
    (its flags ask for lazy mode; Habana's bridge runs eager without the variable)."""
    return {LAZY_MODE_VARIABLE: "1"} if script == "gaudi" and device == "hpu" else {}


def fixture_paths(build: bool) -> dict:
    """The local preset's model, data set and Gaudi config; built (once, cached) unless `build` is False."""
    from bridgetower_bench.tools import fixtures

    if build:
        return {k: str(v) for k, v in fixtures.ensure_default_fixtures().items()}
    root = fixtures.default_fixtures_root()
    return {
        "model": str(root / fixtures.MODEL_DIR_NAME),
        "dataset": str(root / fixtures.DATASET_DIR_NAME),
        "gaudi_config": str(root / fixtures.GAUDI_CONFIG_DIR_NAME),
    }


# The local preset's shapes. `published`: the published run's epochs, about 25 optimizer steps each (there
# about 9.8k rows / (48 x 8 devices) = 25.5; here the fixture's 192 training rows / 8 = 24), over a counted
# window that crosses two epoch boundaries (steps 25 and 49 begin epochs 2 and 3). `within-epoch`: 10
# counted steps inside the first epoch, the steady state alone.
LOCAL_BATCH = 8
LOCAL_WARMUP_STEPS = 3
SHAPES = ("published", "within-epoch")


def local_train_rows() -> int:
    from bridgetower_bench.tools import fixtures

    return int(fixtures.DEFAULT_DATASET_OPTIONS["train_rows"])


def local_shape(shape: str) -> dict:
    """Training rows, steps per epoch and total steps of a local-preset shape."""
    rows = local_train_rows()
    steps_per_epoch = -(-rows // LOCAL_BATCH)
    if shape == "within-epoch":
        return {"train_rows": rows, "steps_per_epoch": steps_per_epoch, "max_steps": LOCAL_WARMUP_STEPS + 10}
    # two full epochs after the warm-up, then the first two steps of the third epoch past the second boundary
    return {
        "train_rows": rows,
        "steps_per_epoch": steps_per_epoch,
        "max_steps": LOCAL_WARMUP_STEPS + 2 * steps_per_epoch + 2,
    }


def describe_shape(shape: str) -> str:
    """One line for the sweep's output and its results: what the counted window spans."""
    facts = local_shape(shape)
    counted = range(LOCAL_WARMUP_STEPS + 1, facts["max_steps"] + 1)
    starts = [step for step in counted if (step - 1) % facts["steps_per_epoch"] == 0]
    return (
        f"{shape}: {facts['train_rows']} training rows / batch {LOCAL_BATCH} = {facts['steps_per_epoch']} steps per epoch, "
        f"{facts['max_steps']} steps ({LOCAL_WARMUP_STEPS} warm-up), {len(starts)} epoch start(s) counted"
        + (f" (steps {', '.join(map(str, starts))})" if starts else "")
    )


def local_preset_args(paths: Mapping[str, str], eval_: bool, shape: str = "published") -> list[str]:
    """The local preset: small, in the published run's epoch shape (or one epoch's steady state, see
    `local_shape`), and bound by image loading as the published runs are (see the module docstring)."""
    from bridgetower_bench.tools.fixtures import script_flags

    facts = local_shape(shape)
    args = [
        *script_flags(paths),
        "--do_train",
        "--max_train_samples",
        str(facts["train_rows"]),
        "--per_device_train_batch_size",
        str(LOCAL_BATCH),
        "--max_seq_length",
        "32",
        "--max_steps",
        str(facts["max_steps"]),
        "--throughput_warmup_steps",
        str(LOCAL_WARMUP_STEPS),
        "--logging_steps",
        "10",
        "--remove_unused_columns",
        "False",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--overwrite_output_dir",
    ]
    if eval_:
        args += ["--do_eval", "--per_device_eval_batch_size", "8"]
    return args


def blog_preset_args() -> list[str]:
    """The published run's flags as upstream's CI runs them and the README publishes them (docs/PUBLISHED.md),
    less the device flags: the data set revision pinned (the parquet one: docs/PUBLISHED.md), no --do_predict. No checkpoints: they would only add
    write time inside the measured window; no trackers: they would start inside it."""
    return [
        "--model_name_or_path",
        published.MODEL,
        "--dataset_name",
        published.DATASET,
        "--dataset_config_name",
        published.DATASET_CONFIG,
        "--dataset_revision",
        published.DATASET_REVISION,
        "--image_column",
        published.IMAGE_COLUMN,
        "--caption_column",
        published.CAPTION_COLUMN,
        "--remove_unused_columns",
        "False",
        "--do_train",
        "--do_eval",
        "--per_device_train_batch_size",
        str(published.BATCH),
        "--per_device_eval_batch_size",
        "16",
        "--num_train_epochs",
        str(published.EPOCHS),
        "--learning_rate",
        "1e-5",
        "--throughput_warmup_steps",
        str(published.WARMUP_STEPS),
        "--logging_steps",
        "10",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--overwrite_output_dir",
    ]


def parse_extra_args(text: str) -> list[str]:
    try:
        extra = shlex.split(text or "")
    except ValueError as e:
        raise ValueError(f"--extra-args {redact_text(text)!r}: {e}") from None
    for arg in extra:
        name = arg.split("=", 1)[0].replace("-", "_")
        if any(name == flag.replace("-", "_") for flag in SWEEP_FLAGS):
            raise ValueError(
                f"--extra-args: {arg.split('=', 1)[0]} is set per run by the sweep; use the sweep's own flags instead"
            )
    return extra


SHAPE_FLAGS = (
    "--max_steps",
    "--num_train_epochs",
    "--max_train_samples",
    "--per_device_train_batch_size",
    "--throughput_warmup_steps",
    "--gradient_accumulation_steps",
)


def plan_shape(args: argparse.Namespace) -> str:
    """The shape line of a plan; --extra-args that change it make it say so (the runs then record the real one)."""
    if any(arg.split("=", 1)[0] in SHAPE_FLAGS for arg in parse_extra_args(args.extra_args)):
        return "shape set by --extra-args"
    return describe_shape(args.shape or "published") if args.preset == "local" else "the published run's 5 epochs"


def persistent_settings(args: argparse.Namespace) -> list[bool]:
    """--persistent-workers as booleans; by default both for the local preset, upstream's (no) for the blog one."""
    chosen = args.persistent_workers or (["no", "yes"] if args.preset == "local" else ["no"])
    return [choice == "yes" for choice in dict.fromkeys(chosen)]

"""A run directory knows its recipe (`recipe.json`): what made its model, and which reruns may reuse or resume it.

What the recipe holds, and what `plan_run` does with what --output_dir holds: docs/RUNS.md, "It knows its recipe".
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
from collections.abc import Callable
from importlib import metadata
from typing import NamedTuple, Optional

from bridgetower_bench.output_dir import checkpoint_manifest, run_directory
from bridgetower_bench.output_dir.atomic_files import read_json, write_json_atomically
from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

RECIPE_NAME = "recipe.json"


def _names(*groups: str) -> tuple:
    return tuple(name for group in groups for name in group.split())


# What changes the weights, and what does not, over both install routes' transformers lines (README). Every name
# listed is a field of one route's argument classes, in one list only (tests/test_run_recipe.py); a field in none
# of them (a later release's) is in the recipe, named in a warning (`describe`), until it is sorted here.
MODEL_ARGUMENTS = _names(
    # which weights, captions' tokens, mean/std; which weights train
    "model_name_or_path model_revision config_name tokenizer_name image_processor_name",
    "freeze_vision_model freeze_text_model freeze_text_pooler",
)
DATA_ARGUMENTS = _names(
    # what one caption and the train split hold
    "dataset_name dataset_config_name dataset_revision data_dir train_file validation_file image_column",
    "caption_column max_seq_length max_train_samples",
    # the pixels (the three paths round differently); which rows are trained on
    "image_pipeline mediapipe_dataloader device_decode drop_bad_rows max_image_pixels",
)
TRAINING_ARGUMENTS = _names(
    # how far and how fast
    "learning_rate num_train_epochs max_steps lr_scheduler_type lr_scheduler_kwargs warmup_ratio warmup_steps",
    # what one step sees (with the number of processes, recorded beside them)
    "per_device_train_batch_size gradient_accumulation_steps dataloader_drop_last group_by_length length_column_name",
    "average_tokens_across_devices auto_find_batch_size",
    # randomness and order: the order of the rows, dropout, the splits cut from train (transformers 5's
    # train_sampling_strategy: random, sequential, by length; dataloader_in_order False: batches as workers finish)
    "seed data_seed full_determinism train_sampling_strategy dataloader_in_order",
    # the optimizer and the loss
    "optim optim_args optim_target_modules adafactor adam_beta1 adam_beta2 adam_epsilon weight_decay max_grad_norm",
    "label_smoothing_factor neftune_noise_alpha",
    # the arithmetic: precision, fused or compiled kernels (the same function, other rounding)
    "bf16 fp16 fp16_opt_level half_precision_backend tf32 torch_compile torch_compile_backend torch_compile_mode",
    "torchdynamo use_liger_kernel liger_kernel_config attn_implementation compile_layers deepspeed fsdp fsdp_config",
    "fsdp_min_num_params fsdp_transformer_layer_cls_to_wrap parallelism_config gaudi_config_name sdp_on_bf16 fp8",
    "use_lazy_mode use_compiled_autograd use_regional_compilation distribution_strategy context_parallel_size",
    # with lazy mode, GaudiTrainer divides the micro-batches' losses by the accumulation steps instead of summing them
    "use_zero3_leaf_promotion pipelining_fwd_bwd",
    # a resume that does not skip the rows already trained trains on other rows; the final model is the best
    # checkpoint's rather than the last one's
    "ignore_data_skip load_best_model_at_end",
)
# With --load_best_model_at_end the evaluation picks the final model: what it measures and when is then part of it.
BEST_MODEL_ARGUMENTS = _names(
    "metric_for_best_model greater_is_better eval_strategy eval_steps eval_delay eval_on_start save_strategy",
    "save_steps per_device_eval_batch_size max_eval_samples eval_accumulation_steps",
)
# Everything else leaves the weights as they are.
NOT_IN_THE_RECIPE = _names(
    # where and what is written, logged, pushed; caches and credentials
    "output_dir overwrite_output_dir do_train do_eval do_predict logging_dir logging_strategy logging_first_step",
    "logging_steps logging_nan_inf_filter log_level log_level_replica log_on_each_node save_total_limit",
    "save_safetensors save_on_each_node save_only_model restore_callback_states_from_checkpoint",
    "resume_from_checkpoint run_name disable_tqdm report_to skip_memory_metrics include_tokens_per_second",
    "include_num_input_tokens_seen push_to_hub hub_model_id hub_strategy hub_token hub_private_repo hub_always_push",
    "hub_revision project trackio_space_id trackio_bucket_id trackio_static_space_id enable_jit_checkpoint",
    "push_to_hub_model_id push_to_hub_organization push_to_hub_token token cache_dir trust_remote_code",
    "use_fast_tokenizer overwrite_cache preprocessing_num_workers cache_decoded_images decoded_image_cache_dir",
    "preflight_cache_dir",
    # evaluation and prediction (unless --load_best_model_at_end: BEST_MODEL_ARGUMENTS)
    "prediction_loss_only per_gpu_eval_batch_size bf16_full_eval fp16_full_eval jit_mode_eval use_ipex",
    "include_inputs_for_metrics include_for_metrics eval_do_concat_batches batch_eval_metrics eval_use_gather_object",
    "use_legacy_prediction_loop label_names past_index remove_unused_columns use_hpu_graphs_for_inference",
    "disable_tensor_cache_hpu_graphs max_hpu_graphs ignore_eos",
    *BEST_MODEL_ARGUMENTS,
    # how batches are fetched and how processes talk (the same batches, the same sums; activation_checkpointing is
    # transformers 5's name for gradient_checkpointing: the same gradients, recomputed)
    "dataloader_num_workers dataloader_prefetch_factor dataloader_pin_memory dataloader_persistent_workers",
    "non_blocking_data_copy local_rank ddp_backend ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers",
    "ddp_timeout accelerator_config tpu_num_cores tpu_metrics_debug debug mp_parameters _n_gpu ray_scope",
    "per_gpu_train_batch_size no_cuda use_cpu use_mps_device use_habana torch_empty_cache_steps",
    "gradient_checkpointing gradient_checkpointing_kwargs activation_checkpointing activation_checkpointing_kwargs",
    "use_cache dataloader_multiprocessing_context ddp_static_graph use_hpu_graphs use_hpu_graphs_for_training",
    "compile_from_sec_iteration compile_dynamic cache_size_limit inline_inbuilt_nn_modules",
    "allow_unspec_int_on_nn_module minimize_memory",
    # attention kernels of other models (BridgeTower does not take Habana's fused attention)
    "flash_attention_recompute flash_attention_fast_softmax flash_attention_causal_mask flash_attention_fp8",
    # measuring: throughput and profiles (fp16_backend: a deprecated alias of half_precision_backend, in the recipe)
    "throughput_warmup_steps adjust_throughput profiling_warmup_steps profiling_steps profiling_warmup_steps_eval",
    "profiling_steps_eval profiling_record_shapes profiling_with_stack fp16_backend",
)

KNOWN_ARGUMENTS = frozenset(MODEL_ARGUMENTS + DATA_ARGUMENTS + TRAINING_ARGUMENTS + NOT_IN_THE_RECIPE)
_UNKNOWN = "not known to these scripts, so counted in the recipe"

# Image pipelines whose pixels depend on the JPEG decoder installed -> its name and version (`jpeg_decoder` in their
# recipe). Filled in by bridgetower_bench.images.images, which the scripts import before they plan a run: this
# package may not import it (the decode-once cache writes through this package).
PIXELS_FROM_THE_DECODER: dict[str, Callable[[], str]] = {}

# Entries of a recipe that are not flags, and how a refusal names them.
_LABELS = {
    "jpeg_decoder": "the JPEG decoder (--image_pipeline fast-draft's pixels depend on it)",
    "world_size": "the number of processes",
    "splits_cut_from_train": "the splits cut from train (--do_predict cuts a test split when the data set has none)",
    "scripts_version": "the scripts' version",
}
_PATHS = _names(
    "model_name_or_path config_name tokenizer_name image_processor_name dataset_name data_dir train_file",
    "validation_file deepspeed",
)


def _argument(name, value):
    """A value as JSON holds it (enums by their value, paths that exist by their real path)."""
    if name in _PATHS and isinstance(value, str) and os.path.exists(os.path.expanduser(value)):
        return os.path.realpath(os.path.expanduser(value))
    return json.loads(json.dumps(value.value if isinstance(value, enum.Enum) else value, default=str))


def _splits_cut_from_train(split_names, do_predict: bool) -> list:
    """The splits data.make_splits cuts from train: whichever of validation and test is missing, but test only
    with --do_predict (or when validation is missing too)."""
    if "train" not in split_names:
        return []
    absent = [s for s in ("validation", "test") if s not in split_names]
    return [s for s in absent if s == "validation" or do_predict or "validation" in absent]


def describe(model_args, data_args, training_args, dataset) -> dict:
    """The recipe of this command: every argument that changes the weights, the data's fingerprints, the version."""
    recipe = {}
    everything = (model_args, data_args, training_args)
    for arguments, names in zip(everything, (MODEL_ARGUMENTS, DATA_ARGUMENTS, TRAINING_ARGUMENTS)):
        for name in names:
            if hasattr(arguments, name):  # (each backend's arguments have only some of them: recorded when present)
                recipe[name] = _argument(name, getattr(arguments, name))
    unknown = {  # (a later release's arguments: in the recipe until sorted into the lists above)
        field.name: _argument(field.name, getattr(arguments, field.name))
        for arguments in everything
        for field in dataclasses.fields(arguments)
        if field.init and field.name not in KNOWN_ARGUMENTS
    }
    if unknown:
        logger.warning(f"Arguments {_UNKNOWN}: {', '.join('--' + name for name in sorted(unknown))}")
        recipe.update(unknown)
    if training_args.load_best_model_at_end:
        for name in BEST_MODEL_ARGUMENTS:
            source = data_args if hasattr(data_args, name) else training_args
            recipe[name] = _argument(name, getattr(source, name))
    # Arguments the trainer ignores beside others: not part of what made the model.
    if training_args.max_steps > 0:
        recipe["num_train_epochs"] = None  # (--max_steps decides how far)
    if training_args.warmup_steps > 0:
        recipe["warmup_ratio"] = None  # (--warmup_steps decides the warm-up)
    decoder = PIXELS_FROM_THE_DECODER.get(getattr(data_args, "image_pipeline", ""))
    if decoder is not None:
        recipe["jpeg_decoder"] = decoder()
    recipe["world_size"] = training_args.world_size
    recipe["splits_cut_from_train"] = _splits_cut_from_train(list(dataset), training_args.do_predict)
    for split, split_data in dataset.items():
        recipe[f"data_fingerprint_{split}"] = split_data._fingerprint
    try:
        recipe["scripts_version"] = metadata.version("bridgetower-bench")
    except metadata.PackageNotFoundError:
        recipe["scripts_version"] = "unknown"
    return recipe


def _name(key: str) -> str:
    if key.startswith("data_fingerprint_"):
        return f"the {key[len('data_fingerprint_') :]} split's data (datasets fingerprint)"
    if key in _LABELS:
        return _LABELS[key]
    if key.startswith("version_") and key[len("version_") :] in LIBRARIES:
        return f"{key[len('version_') :]}'s version"
    return f"--{key}" if key in KNOWN_ARGUMENTS else f"--{key} ({_UNKNOWN})"


_ABSENT = object()  # an entry a recipe does not hold


def _shown(value) -> str:
    if value is _ABSENT:
        return "absent"
    return "unset" if value is None else value if isinstance(value, str) else json.dumps(value)


def differences(recorded: Optional[dict], recipe: dict) -> str:
    """The differing entries, "--name old → new", comma-separated; for a run that recorded none, says so. An
    argument one install route has and the other lacks (README) counts as unset there: listed only with a value,
    or, when nothing else differs, as absent."""
    if recorded is None:
        return "its recipe was not recorded"
    keys = {**recorded, **recipe}
    changed = [key for key in keys if recorded.get(key) != recipe.get(key)]
    changed = changed or [key for key in keys if recorded.get(key, _ABSENT) != recipe.get(key, _ABSENT)]
    return ", ".join(
        f"{_name(key)} {_shown(recorded.get(key, _ABSENT))} → {_shown(recipe.get(key, _ABSENT))}" for key in changed
    )


def read(directory: str) -> Optional[dict]:
    recipe = read_json(os.path.join(directory, RECIPE_NAME))
    return recipe if isinstance(recipe, dict) else None


def write(directory: str, recipe: dict) -> None:
    write_json_atomically(os.path.join(directory, RECIPE_NAME), recipe)


# The libraries whose version every node of a job must share (a node with another build trains another model).
LIBRARIES = ("torch", "torchvision", "transformers", "accelerate", "datasets", "optimum-habana")


def job_recipe(recipe: dict) -> dict:
    """What every rank of a job must share: the recipe (the kit's version included) and the libraries' versions."""
    versions: dict[str, Optional[str]] = {}
    for name in LIBRARIES:
        try:
            versions[f"version_{name}"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[f"version_{name}"] = None
    return {**recipe, **versions}


def different_recipes(everyone: list) -> Optional[str]:
    """The ranks whose `job_recipe` is not rank 0's, each with the differing entries (rank 0's → theirs), or None."""
    first = everyone[0]
    differing = [
        f"rank {rank}: {differences(first, theirs)}" for rank, theirs in enumerate(everyone) if theirs != first
    ]
    return "; ".join(differing) or None


def refuse_unless_one_recipe(recipe: dict, training_args) -> None:
    """With several processes: every rank must run rank 0's recipe with the same kit and libraries, else every
    process stops in one line naming the ranks and the entries (two nodes given different flags would otherwise
    train one job with two learning rates, and `recipe.json` record rank 0's alone). A hash is compared on the
    device; the recipes themselves are gathered only when one differs."""
    import torch  # here only: the tools that check paths import this package and start without torch

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    mine = job_recipe(recipe)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=str).encode()).digest()
    hashed = torch.tensor(
        [int.from_bytes(digest[i : i + 3], "big") for i in (0, 3)], dtype=torch.int32, device=training_args.device
    )
    hashes = [torch.zeros_like(hashed) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(hashes, hashed)
    if all(torch.equal(h, hashes[0]) for h in hashes):
        return
    everyone: list[Optional[dict]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    raise UserInputError(
        f"the job's processes run different recipes ({different_recipes(everyone)}): give every node the same "
        "command, kit and libraries"
    )


class RunPlan(NamedTuple):
    recipe: dict
    trained_model: Optional[str]  # the directory whose trained model this run uses (not training again), or None
    resume_from: Optional[str]  # the checkpoint training resumes from, or None
    publish_from: Optional[str] = None  # the checkpoint at the recipe's last step published as it is, or None


def _published_model(output_dir: str) -> tuple[Optional[run_directory.PublishedModel], Optional[dict]]:
    """The trained model published in output_dir, or None, and its recipe."""
    model = run_directory.published_model(output_dir)
    return model, read(output_dir) if model is not None and RECIPE_NAME in model.files else None


def _damaged(output_dir: str, reason: str) -> str:
    return f"--output_dir={output_dir}: its trained model is not as it was published ({reason})"


def _refuse(output_dir: str, what: str, recorded: Optional[dict], recipe: dict):
    raise UserInputError(
        f"--output_dir={output_dir} holds {what} of another recipe ({differences(recorded, recipe)}): pass "
        "--overwrite_output_dir to train this recipe there afresh, or choose another --output_dir"
    )


def _evaluation_only(output_dir: str, recipe: dict, model_args, training_args) -> RunPlan:
    model, recorded = _published_model(output_dir)
    if model is None:
        return RunPlan(recipe, None, None)
    if model.damaged:
        raise UserInputError(
            f"{_damaged(output_dir, model.damaged)}: rerun its training command (it publishes the model again from "
            "the newest complete checkpoint of its recipe), or evaluate another model"
        )
    given = model_args.model_name_or_path
    itself = os.path.realpath(os.path.expanduser(given)) == os.path.realpath(output_dir)
    if not itself and not (
        recorded is not None
        and recorded.get("model_name_or_path") == _argument("model_name_or_path", given)
        and recorded.get("model_revision") == model_args.model_revision
    ):
        base = f"trained from {recorded['model_name_or_path']}" if recorded else "whose base model was not recorded"
        raise UserInputError(
            f"--output_dir={output_dir} holds a trained model ({base}); --model_name_or_path={given} names another "
            "model, whose results would replace the trained model's: choose another --output_dir, or pass "
            f"--model_name_or_path {output_dir} to evaluate the trained model"
        )
    not_given = "" if itself else f" (not {given}, the model it was trained from)"
    logger.warning(f"{output_dir} holds a trained model: evaluating it{not_given}")
    _say_results_left_missing(output_dir, model, training_args)
    return RunPlan(recipe, output_dir, None)


# The flags whose evaluation publishes each of the evaluations' results again (all_results.json: any, gathered
# again from the others: RunOutput.results)
_PUBLISHED_AGAIN_BY = {
    "validation_results.json": ("do_eval",),
    "test_results.json": ("do_predict",),
    "all_results.json": ("do_eval", "do_predict"),
}


def _say_results_left_missing(output_dir: str, model: run_directory.PublishedModel, training_args) -> None:
    """A warning for each of the evaluations' results gone from the published set that this run does not publish
    again, naming the flags that would."""
    for name in model.results_missing:
        flags = _PUBLISHED_AGAIN_BY.get(name, ())
        if not any(getattr(training_args, flag) for flag in flags):
            again = " or ".join(f"--{flag}" for flag in flags) or "the evaluation that wrote it"
            logger.warning(f"{output_dir}: {name} is missing from its results; rerun with {again} to publish it")


def _explicit_checkpoint(checkpoint: str, recipe: dict) -> RunPlan:
    if not os.path.isdir(checkpoint):
        what = "is not a directory" if os.path.exists(checkpoint) else "does not exist"
        raise UserInputError(f"--resume_from_checkpoint={checkpoint} {what}: give a checkpoint-N directory")
    reason = checkpoint_manifest.incomplete_reason(checkpoint)
    if reason is not None:
        raise UserInputError(
            f"--resume_from_checkpoint={checkpoint} is incomplete ({reason}): choose a complete checkpoint"
        )
    recorded = read(checkpoint)
    if recorded != recipe:
        raise UserInputError(
            f"--resume_from_checkpoint={checkpoint} was saved by another recipe ({differences(recorded, recipe)}): "
            "rerun with its arguments, or train afresh with --overwrite_output_dir or another --output_dir"
        )
    return _from_checkpoint(checkpoint, recipe)


def _from_checkpoint(checkpoint: str, recipe: dict) -> RunPlan:
    """Resume a complete checkpoint of this recipe; one at the recipe's last step (its trainer state's max_steps: the
    epochs' end too) is published as it is, the Trainer would train a step past it. With --load_best_model_at_end
    the model published is its best checkpoint's, as the Trainer ends."""
    state = read_json(os.path.join(checkpoint, "trainer_state.json")) or {}
    step, last = state.get("global_step"), state.get("max_steps")
    if not (isinstance(step, int) and isinstance(last, int) and step >= last > 0):
        logger.warning(
            f"Checkpoint detected, resuming training at {checkpoint}. Pass --overwrite_output_dir to start over."
        )
        return RunPlan(recipe, None, checkpoint)
    model = checkpoint
    if recipe.get("load_best_model_at_end") and state.get("best_model_checkpoint"):
        model = os.path.join(os.path.dirname(checkpoint), os.path.basename(state["best_model_checkpoint"]))
        reason = checkpoint_manifest.incomplete_reason(model) if os.path.isdir(model) else "it is not there"
        if reason is not None:
            raise UserInputError(
                f"{checkpoint} ends this recipe's training, but its best checkpoint, {model}, cannot be published "
                f"({reason}): pass --overwrite_output_dir to train it afresh"
            )
    best = "" if model == checkpoint else f" (the model of its best checkpoint, {os.path.basename(model)})"
    logger.warning(
        f"{checkpoint} ends this recipe's training (step {step} of {last}): publishing it again{best}, not training "
        "again. Pass --overwrite_output_dir to start over."
    )
    return RunPlan(recipe, model, None, checkpoint)


def plan_run(output_dir: str, model_args, data_args, training_args, dataset) -> RunPlan:
    """What this run does with --output_dir: reuse its model, resume a checkpoint, or start afresh (docs/RUNS.md)."""
    recipe = describe(model_args, data_args, training_args, dataset)
    refuse_unless_one_recipe(recipe, training_args)
    if not training_args.do_train:  # (evaluation alone into a directory holding a trained model evaluates it)
        return _evaluation_only(output_dir, recipe, model_args, training_args)
    if training_args.resume_from_checkpoint:
        return _explicit_checkpoint(training_args.resume_from_checkpoint, recipe)
    if training_args.overwrite_output_dir or not os.path.isdir(output_dir):
        return RunPlan(recipe, None, None)

    model, published = _published_model(output_dir)
    damaged = model.damaged if model is not None else None
    if model is not None and model.finished and published == recipe and not damaged:
        logger.warning(
            f"{output_dir} holds the model of this recipe, trained as far as asked: not training again "
            "(--overwrite_output_dir trains it afresh)"
        )
        _say_results_left_missing(output_dir, model, training_args)
        return RunPlan(recipe, output_dir, None)
    others = []  # the complete checkpoints of another recipe passed over, newest first, with their recipe

    def another_recipe(checkpoint: str) -> Optional[str]:
        recorded = read(checkpoint)
        if recorded == recipe:
            return None
        others.append((checkpoint, recorded))
        return f"saved by another recipe ({differences(recorded, recipe)})"

    checkpoint, skipped = run_directory.newest_complete_checkpoint(output_dir, another_recipe)
    if checkpoint is not None:
        for name, why in skipped:
            logger.warning(f"Not resuming from {name}: {why}")
        if damaged:
            logger.warning(f"{_damaged(output_dir, damaged)}: publishing it again from its checkpoints")
        elif model is not None and published != recipe:  # e.g. published by another version of the scripts
            logger.warning(
                f"{output_dir} holds a model of another recipe ({differences(published, recipe)}): this "
                "recipe's model, from its checkpoint, replaces it"
            )
        return _from_checkpoint(checkpoint, recipe)
    if damaged:
        raise UserInputError(
            f"{_damaged(output_dir, damaged)}, and no complete checkpoint of its recipe is there to publish again: "
            "pass --overwrite_output_dir to train it afresh"
        )
    if model is not None and published == recipe:  # (not finished: its trainer state stops short, or is gone)
        raise UserInputError(
            f"--output_dir={output_dir} holds this recipe's model, not trained to its last step, and no complete "
            "checkpoint of it to resume: pass --overwrite_output_dir to train it afresh"
        )
    if model is not None:
        _refuse(output_dir, "a model", published, recipe)
    if others:
        newest, recorded = others[0]
        _refuse(output_dir, f"checkpoints (the newest complete one: {os.path.basename(newest)})", recorded, recipe)
    if skipped:
        listed = "; ".join(f"{os.path.basename(name)}: {why}" for name, why in skipped)
        logger.warning(
            f"{output_dir} holds no complete checkpoint, only incomplete ones ({listed}): training starts afresh"
        )
    return RunPlan(recipe, None, None)

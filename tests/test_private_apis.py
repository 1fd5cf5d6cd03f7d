"""The private names of other libraries the kit relies on (docs/ARCHITECTURE.md, "Private APIs") still exist,
with the parameters the kit's overrides and calls pass. A failure names the library, the name and what changed:
read that library's new code, adapt the override or the call, and update the table of versions checked."""

import inspect
import re

import datasets
import torch
import transformers
from transformers import Trainer

from helpers import BOTH_ROUTES, optimum_habana


# Trainer methods the kit overrides (trainer.py, output_dir/trainer_output.py) or calls (also mediapipe/trainer.py) ->
# the parameters it relies on, in order. The same on transformers 4.55 (GaudiTrainer's too) and 5.x.
TRAINER_METHODS = {
    "_get_train_sampler": ["self", "train_dataset"],  # overridden; called by the media-pipeline loader
    "_save_checkpoint": ["self", "model", "trial"],  # overridden (recipe, manifest, rotation); called (image error)
}


def parameters(function) -> list:
    return list(inspect.signature(function).parameters)


def missing_or_changed(cls, expected: dict) -> list:
    problems = []
    for name, params in expected.items():
        function = getattr(cls, name, None)
        if function is None:
            problems.append(f"{cls.__module__}.{cls.__name__}.{name} no longer exists")
        elif parameters(function)[: len(params)] != params:
            problems.append(
                f"{cls.__name__}.{name}{inspect.signature(function)}: the kit relies on ({', '.join(params)})"
            )
    return problems


@BOTH_ROUTES
def test_the_trainer_module_still_skips_resumed_batches_through_accelerates_function():
    # trainer._resumed_epoch_keeps_its_order swaps transformers.trainer.skip_first_batches while training and
    # hands the new loader the epoch (`iteration`) of accelerate's loader it skips in
    import accelerate
    import accelerate.data_loader
    import transformers.trainer

    assert transformers.trainer.skip_first_batches is accelerate.skip_first_batches, (
        "transformers.trainer no longer calls accelerate.skip_first_batches by that name"
    )
    assert "self.iteration" in inspect.getsource(accelerate.data_loader.DataLoaderShard), (
        "accelerate's DataLoaderShard no longer counts its epochs in `iteration`"
    )


@BOTH_ROUTES
def test_the_training_loop_still_syncs_by_the_accumulation_steps_it_reads_each_micro_batch():
    # trainer._sync_the_last_micro_batch: on transformers 4.55 (and GaudiTrainer 1.21, its copy) a resumed epoch
    # counts its micro-batches from 0 and its last partial window never syncs; the trainer sets
    # args.gradient_accumulation_steps for that window's last micro-batch. transformers 5 counts the skipped ones.
    loops = [getattr(Trainer, "_run_epoch", Trainer._inner_training_loop)]
    if int(transformers.__version__.split(".")[0]) < 5:
        with optimum_habana() as habana:
            loops.append(habana.GaudiTrainer._inner_training_loop)
    sync = "do_sync_step = (step + 1) % args.gradient_accumulation_steps == 0 or (step + 1) == steps_in_epoch"
    for loop in loops:
        source = re.sub(r"\bself\.args\b", "args", inspect.getsource(loop))
        assert sync in source, (
            "the Trainer no longer decides a micro-batch's sync from args.gradient_accumulation_steps as it reads it"
        )
        counts_skipped = "step = steps_trained_in_current_epoch - 1" in source
        assert counts_skipped == (int(transformers.__version__.split(".")[0]) >= 5), (
            "the Trainer's count of a resumed epoch's micro-batches changed: mend it in trainer.py on the line whose "
            "count restarts at 0"
        )


@BOTH_ROUTES
def test_transformers_trainer_keeps_the_private_methods_save_model_and_save_total_limit_the_kit_relies_on():
    problems = missing_or_changed(Trainer, TRAINER_METHODS)
    assert not problems, "transformers changed private Trainer methods:\n" + "\n".join(problems)
    # output_dir/trainer_output.py: inside _save_checkpoint, save_model writes the checkpoint's weights (passed through in place);
    # the Trainer's own rotation and its end-of-training deletion read args.save_total_limit, which the kit
    # sets to None while training so that only its own rotation, over the checkpoints runs wrote, deletes
    source = inspect.getsource(Trainer._save_checkpoint)
    assert "self.save_model(" in source, "Trainer._save_checkpoint no longer saves the weights through save_model"
    rotation = inspect.getsource(Trainer._rotate_checkpoints) if "_rotate_checkpoints" in source else source  # 4.55
    assert "self.args.save_total_limit" in rotation, "the Trainer's rotation no longer reads args.save_total_limit"
    assert "self.args.save_total_limit == 1" in inspect.getsource(Trainer), (
        "the Trainer's end-of-training deletion no longer reads args.save_total_limit"
    )


def test_optimum_habana_keeps_the_gaudi_trainer_methods_and_the_runner_attributes_the_kit_relies_on():
    with optimum_habana():  # (behind the tests' Habana shim)
        from optimum.habana import GaudiTrainer
        from optimum.habana.distributed import DistributedRunner

        problems = missing_or_changed(GaudiTrainer, TRAINER_METHODS)
        runner = DistributedRunner(command_list=["train.py --flag 1"], world_size=1, use_mpi=False, master_port=29500)
        commands, interpreter = getattr(runner, "_commands", None), getattr(runner, "_interpreter", None)
        with_mpi = DistributedRunner(command_list=["train.py"], world_size=2, use_mpi=True, master_port=29601)
        variables = getattr(with_mpi, "_model_env_vars", None)
    assert not problems, "optimum-habana changed private GaudiTrainer methods:\n" + "\n".join(problems)
    # tools/launch_gaudi.py --dry_run prints runner._interpreter + each of runner._commands
    assert isinstance(commands, list) and any("train.py --flag 1" in c for c in commands), (
        f"optimum-habana's DistributedRunner._commands changed: {commands!r}"
    )
    assert isinstance(interpreter, str) and interpreter.strip(), (
        f"optimum-habana's DistributedRunner._interpreter changed: {interpreter!r}"
    )
    # ... preceded by runner._model_env_vars, the variables run() exports (MASTER_ADDR, MASTER_PORT with MPI)
    assert variables == {"MASTER_ADDR": "localhost", "MASTER_PORT": 29601}, (
        f"optimum-habana's DistributedRunner._model_env_vars changed: {variables!r}"
    )


def test_torch_still_has_the_antialiased_bicubic_kernel_with_explicit_scales():
    # images.resize_and_crop: torch.ops.aten._upsample_bicubic2d_aa(input, output_size, align_corners, scales_h, scales_w)
    op = getattr(torch.ops.aten, "_upsample_bicubic2d_aa", None)
    assert op is not None, "torch no longer has torch.ops.aten._upsample_bicubic2d_aa"
    arguments = [a.name for a in op.default._schema.arguments]
    assert arguments == ["self", "output_size", "align_corners", "scales_h", "scales_w"], (
        f"torch.ops.aten._upsample_bicubic2d_aa's arguments changed: {arguments}"
    )
    pixels = torch.arange(2 * 8 * 8, dtype=torch.uint8).reshape(1, 2, 8, 8)
    assert op(pixels, [3, 2], False, 0.5, 0.5).shape == (1, 2, 3, 2), (
        "output size and scales are no longer independent"
    )


@BOTH_ROUTES
def test_datasets_still_exposes_the_fingerprint_and_the_indices_mapping():
    # preflight, data, mediapipe_inputs: dataset._fingerprint names a data set's content in cache keys;
    # preflight: dataset._indices maps a selection's rows back to the rows as loaded
    dataset = datasets.Dataset.from_dict({"value": [10, 11, 12]})
    chosen = dataset.select([2, 0])
    assert isinstance(getattr(dataset, "_fingerprint", None), str), "datasets.Dataset no longer has _fingerprint"
    assert chosen._fingerprint != dataset._fingerprint
    indices = "datasets.Dataset._indices"
    assert getattr(dataset, "_indices", "missing") is None, f"{indices} changed (expected None unselected)"
    assert chosen._indices.column(0).to_pylist() == [2, 0], f"{indices} no longer maps a selection's rows"

"""A per-device batch the GPU cannot hold ends in one line at step 1, nothing published, saying what fits.

The arithmetic runs here; the trainer's two checks (the known need before the first forward pass, an out-of-memory
error in the first step) run in-process with the GPU's answers replaced (no GPU here)."""

import os
import types

import pytest
import torch

from bridgetower_bench import published as experiment
from bridgetower_bench.guards import gpu_memory as gm
from bridgetower_bench.user_errors import UserInputError, exit_on_user_error
from helpers import trainer_on


A100_40GB = ("NVIDIA A100-SXM4-40GB", 39.39)


def published(**changes):
    return gm.memory_need(**{**gm.PUBLISHED_RUN, **changes})


def large_on_meta():
    from transformers import BridgeTowerForContrastiveLearning

    from bridgetower_bench.tools.fixtures import bridgetower_config

    with torch.device("meta"):
        model = BridgeTowerForContrastiveLearning(bridgetower_config(large=True, vocab_size=50265))
    model.bridgetower.text_model.pooler = None  # as the scripts do (--freeze_text_pooler, the default)
    return model


def test_the_published_parameter_count_is_bridgetower_larges():
    model = large_on_meta()
    assert sum(p.numel() for p in model.parameters()) == experiment.TRAINED_PARAMETERS
    config, vision = model.config, model.config.vision_config
    text_layers = config.text_config.num_hidden_layers
    shape = (config.hidden_size, text_layers, vision.num_hidden_layers, config.num_hidden_layers)
    assert shape + (vision.image_size, vision.patch_size) == experiment.SHAPE


def test_the_parts_reproduce_the_measured_peak_and_say_which_gpus_hold_the_batch_and_what_the_others_run():
    need = published()
    assert need.fixed_gib == pytest.approx(16 * 865_612_289 / 2**30)  # weights, gradients, AdamW's two moments
    assert need.tensors_gib(48) == pytest.approx(64.47)  # the measured peak, at the measured batch
    assert need.per_sample_gib == pytest.approx((64.47 - need.fixed_gib) / 48)
    assert need.tensors_gib(24) == pytest.approx(need.fixed_gib + 24 * need.per_sample_gib)
    assert need.device_gib(48) == pytest.approx(64.47 * 1.1 + 1.0)
    frozen = published(trained=experiment.TRAINED_PARAMETERS // 2)
    assert frozen.fixed_gib < need.fixed_gib and frozen.per_sample_gib == need.per_sample_gib
    assert published(compiled=True).tensors_gib(48) == pytest.approx(54.7)
    # No figure for what was not measured: the first step decides.
    unmeasured = [{"attention": "sdpa"}, {"bf16": False}, {"sequence_length": 64}, {"gradient_checkpointing": True}]
    for change in [*unmeasured, {"shape": (64, 1, 1, 1, 294, 42)}]:
        assert published(**change) is None, change
    # which GPUs hold the published batch, and what the others should run
    for gib in (79.15, 80.0, 139.8):  # A100 / H100 80GB, H200
        assert need.fits(48, gib)
    assert not need.fits(48, 39.39) and not need.fits(48, 44.99)  # A100 40GB, L40S
    fits = lambda gib: lambda b: need.fits(b, gib)  # noqa: E731
    assert gm.same_global_batch(48, 1, fits(39.39)) == (16, 3)
    assert gm.same_global_batch(48, 1, fits(44.99)) == (24, 2)
    assert gm.same_global_batch(48, 2, fits(39.39)) == (16, 6)  # 96 samples per optimizer step, kept
    assert gm.same_global_batch(48, 1, fits(12.0)) is None  # not even one sample beside the optimizer state


def test_the_line_names_the_batch_the_device_the_need_and_what_keeps_the_global_batch():
    a100 = dict(device_name=A100_40GB[0], device_total_gib=A100_40GB[1])
    line = gm.does_not_fit_message(batch=48, accumulation=1, world_size=8, need=published(), **a100)
    assert "\n" not in line
    assert line == (
        "--per_device_train_batch_size 48 does not fit on NVIDIA A100-SXM4-40GB (39.4 GiB): BridgeTower Large (294 px, "
        "128 tokens, bf16) needs about 71.9 GiB per device at batch 48 (estimated from 64.5 GiB of tensors at batch 48, "
        "measured on one H200, plus the allocator's reserve and the CUDA context); --per_device_train_batch_size 16 "
        "--gradient_accumulation_steps 3 keeps the global batch of 384, about 34.1 GiB (each step's contrastive loss "
        "then sees 16 pairs, not 48)"
    )
    l4 = dict(device_name="NVIDIA L4", device_total_gib=22.0)
    unknown = gm.does_not_fit_message(batch=48, accumulation=1, world_size=1, need=None, reached_gib=21.7, **l4)
    assert "the first step ran out of memory after reaching 21.7 GiB" in unknown
    assert "--per_device_train_batch_size 24 --gradient_accumulation_steps 2 keeps the global batch of 48" in unknown


def test_the_check_before_step_1_refuses_the_published_batch_on_a_40gb_gpu():
    recipe = dict(bf16=True, attn_implementation="eager", compile_layers=None, gradient_checkpointing=False)
    batch = dict(per_device_train_batch_size=48, gradient_accumulation_steps=1, world_size=8)
    args = types.SimpleNamespace(device=torch.device("cuda", 0), **recipe, **batch)
    model = large_on_meta()
    refusal = r"^--per_device_train_batch_size 48 does not fit on NVIDIA A100-SXM4-40GB .*"
    refusal += r"--per_device_train_batch_size 16 --gradient_accumulation_steps 3 keeps the global batch of 384"
    with pytest.raises(gm.BatchDoesNotFit, match=refusal):
        gm.check_batch_fits(model, 128, args, memory=lambda device: A100_40GB)
    assert isinstance(gm.BatchDoesNotFit("x"), UserInputError)  # one line, exit status 2
    assert gm.check_batch_fits(model, 128, args, memory=lambda device: ("NVIDIA H100 80GB HBM3", 79.2)) is not None
    assert (
        gm.check_batch_fits(model, 64, args, memory=lambda device: pytest.fail("no figure: nothing to compare"))
        is None
    )


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        pixels = torch.rand(3, 294, 294, generator=torch.Generator().manual_seed(i))
        return {"pixel_values": pixels, "input_ids": [0, 100 + i, 2, 1], "attention_mask": [1, 1, 1, 0]}


def oom_trainer(fixtures, out, monkeypatch, fail_at_call):
    monkeypatch.setattr(gm, "on_gpu", lambda args: True)  # this CPU run plays a 40 GB GPU
    monkeypatch.setattr(gm, "device_memory", lambda device: A100_40GB)
    monkeypatch.setattr(gm, "_reached_gib", lambda error, device: 38.9)
    trainer = trainer_on(fixtures, Rows(), out, max_steps=3, save_strategy="steps", save_steps=1)
    forward, calls = trainer.model.forward, []

    def running_out(*a, **k):
        calls.append(1)
        if len(calls) == fail_at_call:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 39.39 GiB"
            )
        return forward(*a, **k)

    monkeypatch.setattr(trainer.model, "forward", running_out)
    return trainer


def test_running_out_of_memory_in_the_first_step_is_one_line_and_nothing_is_saved(
    fixtures, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    trainer = oom_trainer(fixtures, out, monkeypatch, fail_at_call=1)
    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(trainer.train)
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.endswith(
        "error: --per_device_train_batch_size 4 does not fit on NVIDIA A100-SXM4-40GB (39.4 GiB): the first step ran out "
        "of memory after reaching 38.9 GiB; --per_device_train_batch_size 2 --gradient_accumulation_steps 2 keeps the "
        "global batch of 4, half the batch: a first guess (each step's contrastive loss then sees 2 pairs, not 4)"
    )
    assert not out.exists() or os.listdir(out) == []  # no checkpoint, no model: nothing as if trained


def test_running_out_of_memory_after_the_first_step_keeps_torchs_error(fixtures, tmp_path, monkeypatch):
    trainer = oom_trainer(fixtures, tmp_path / "out", monkeypatch, fail_at_call=2)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    assert trainer.state.global_step == 1

"""A run that diverges stops: one line naming the step, its value and the last complete checkpoint, exit status 3,
nothing published; records never hold a bare NaN; runs that would train nothing are refused."""

import json
import math

import pytest
import torch

from bridgetower_bench import arguments
from bridgetower_bench.guards import divergence
from bridgetower_bench.user_errors import UserInputError
from helpers import CPU_FLAGS, DEVICES, ForkedRun, base_args, last_line, run_script


def strict_json(path):
    """Parse as JSON proper: NaN, Infinity and -Infinity are not JSON numbers."""

    def refuse(constant):
        raise ValueError(f"{path} holds a bare {constant}")

    with open(path) as f:
        return json.load(f, parse_constant=refuse)


# The scripts: --learning_rate 1e6 makes the loss NaN from step 2 -----------------------------------------------------


def test_a_diverging_run_stops_at_that_step_keeps_its_last_checkpoint_and_publishes_nothing(fixtures, tmp_path):
    out = tmp_path / "run"
    args = base_args(fixtures, out, learning_rate=1e6, max_steps=6, save_strategy="steps", save_steps=1)
    # (a process of its own, forked from this one: exit status 3 and one last line, no traceback, are what the user sees)
    result = ForkedRun("cuda", [*args, "--do_train", "--do_eval", *CPU_FLAGS["cuda"]], tmp_path).wait()
    assert result.returncode == divergence.DIVERGED_EXIT_STATUS == 3, result.stderr[-3000:]
    assert last_line(result) == (
        f"Training diverged at step 2 of 6 (loss NaN and gradient norm NaN): stopped, nothing published in {out}; the last "
        f"complete checkpoint is {out / 'checkpoint-1'}. Change the recipe (a lower --learning_rate, --max_grad_norm) and "
        "rerun with --overwrite_output_dir or another --output_dir."
    )
    assert "Traceback" not in result.stderr
    saved = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert saved == ["checkpoint-1"], "nothing after step 1"
    strict_json(out / "checkpoint-1" / "trainer_state.json")


def test_divergence_between_logging_steps_is_found_at_the_end_and_names_its_step(fixtures, tmp_path):
    """No step waits for the device to check: the first non-finite step is recorded on the device and read where the
    Trainer reads anyway (here only at the end: no logging step, no checkpoint). Nothing is published."""
    out = tmp_path / "run"
    args = base_args(fixtures, out, learning_rate=1e6, max_steps=4, logging_steps=100, save_strategy="no")
    result = run_script("gaudi", [*args, "--do_train", *CPU_FLAGS["gaudi"]], check=False)
    assert result.returncode == 3, result.stderr[-3000:]
    assert last_line(result).startswith(
        "Training diverged at step 2 of 4 (loss NaN and gradient norm NaN): stopped, "
        f"nothing published in {out}; no checkpoint was saved before it."
    )
    assert not out.exists() or not any(p.name.endswith((".safetensors", "_results.json")) for p in out.iterdir())


@pytest.mark.parametrize(
    "flag, advice",
    [
        ("--max_steps", "pass a positive --max_steps, or leave it out to train --num_train_epochs"),
        ("--num_train_epochs", "pass a positive --num_train_epochs (or a positive --max_steps)"),
    ],
)
def test_a_run_that_would_train_nothing_is_refused(flag, advice, fixtures, tmp_path):
    out = tmp_path / "run"
    result = run_script("cuda", [*base_args(fixtures, out), "--do_train", flag, "0", *CPU_FLAGS["cuda"]], check=False)
    assert result.returncode == 2
    assert last_line(result) == f"run_bridgetower_cuda.py: error: {flag}=0 with --do_train trains nothing: {advice}"
    assert not out.exists()


def test_max_steps_wins_over_zero_epochs_and_eval_only_needs_neither():
    from transformers import TrainingArguments

    for args in (dict(do_train=True, num_train_epochs=0, max_steps=3), dict(do_eval=True, max_steps=0)):
        arguments.check_arguments(_DataArgs(), TrainingArguments(output_dir="unused", report_to="none", **args))
    with pytest.raises(UserInputError):
        arguments.check_arguments(
            _DataArgs(), TrainingArguments(output_dir="unused", report_to="none", do_train=True, num_train_epochs=-1)
        )


class _DataArgs:
    """Data arguments left unset: only the training arguments are under test."""

    def __getattr__(self, name):
        return None


# The watch: the first non-finite step, kept on the device ------------------------------------------------------------


def test_the_first_non_finite_step_is_kept_with_its_values():
    watch = divergence.DivergenceWatch()
    watch.observe(1, torch.tensor(2.0), torch.tensor(0.5))
    watch.observe(2, torch.tensor(3.0), torch.tensor(0.7))
    assert watch.first_non_finite() is None and watch.check(9, "out", None) is None
    watch.observe(3, torch.tensor(4.0), torch.tensor(math.inf))  # the gradient norm overflowed first
    watch.observe(4, torch.tensor(math.nan), torch.tensor(math.nan))
    assert watch.first_non_finite() == (3, 4.0, math.inf)
    diverged = watch.check(9, "out", "out/checkpoint-2")
    assert diverged.code == 3
    assert diverged.message.startswith(
        "Training diverged at step 3 of 9 (gradient norm +Infinity): stopped, nothing "
        "published in out; the last complete checkpoint is out/checkpoint-2."
    )
    watch.reset()
    watch.observe(1, torch.tensor(1.0), torch.tensor(1.0))
    watch.observe(1, torch.tensor(1.0), torch.tensor(1.0))  # an epoch's end hands the same step again: counted once
    watch.observe(2, torch.tensor(1.0), torch.tensor(math.nan))
    assert watch.first_non_finite()[0] == 2
    watch.reset()
    watch.observe(5, torch.tensor(-math.inf), None)  # no clipping: no gradient norm
    assert watch.first_non_finite() == (5, -math.inf, 0.0)
    assert "(loss -Infinity)" in watch.check(9, "out", None).message


def test_ranks_agree_on_the_earliest_non_finite_step(monkeypatch):
    """Only one rank's loss went non-finite (step 7); another rank saw step 4 first: all stop naming step 4."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda value, op: value.fill_(min(value.item(), 4.0)))
    watch = divergence.DivergenceWatch()
    watch.observe(7, torch.tensor(math.nan), torch.tensor(1.0))
    assert watch.first_non_finite(world_size=2) == (4, None, None)
    message = watch.check(9, "out", None, world_size=2).message
    assert "at step 4 of 9 (a value on another process not finite)" in message
    watch.reset()
    watch.observe(1, torch.tensor(1.0), torch.tensor(1.0))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda value, op: None)  # every rank finite
    assert watch.first_non_finite(world_size=2) is None


@pytest.mark.parametrize("device", DEVICES)
def test_watching_a_step_never_waits_for_the_device(device):
    """On a GPU, a step's observation must not copy anything to the host (CUDA's sync debug mode raises if it does)."""
    watch = divergence.DivergenceWatch()
    loss, norm = torch.tensor(1.0, device=device), torch.tensor(2.0, device=device)
    watch.observe(1, loss, norm)  # (the first call allocates the record)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, 6):
            watch.observe(step, loss * step, norm / step)
        watch.observe(6, loss / 0.0, norm)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert watch.first_non_finite() == (6, math.inf, 2.0)


# Records: JSON proper ------------------------------------------------------------------------------------------------


def test_records_hold_null_where_a_number_is_not_finite(fixtures, tmp_path):
    from helpers import trainer_on

    out = tmp_path / "out"
    trainer = trainer_on(fixtures, None, out)
    trainer.log({"eval_loss": math.nan, "eval_i2t_mean_rank": math.inf, "epoch": 1.0})
    with trainer.publishing():
        trainer.save_metrics("validation", {"eval_loss": math.nan, "eval_t2i_recall@1": 0.5, "nested": [-math.inf]})
        trainer.save_state()
    validation = strict_json(out / "validation_results.json")
    written = {key: validation.pop(key) for key in ("eval_loss", "eval_t2i_recall@1", "nested")}
    assert written == {"eval_loss": None, "eval_t2i_recall@1": 0.5, "nested": [None]}
    assert validation["device_type"] == "cpu"  # the rest: the environment the record names
    assert strict_json(out / "all_results.json")["eval_loss"] is None
    state = strict_json(out / "trainer_state.json")
    assert state["log_history"][-1]["eval_loss"] is None and state["log_history"][-1]["eval_i2t_mean_rank"] is None

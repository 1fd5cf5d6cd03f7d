"""Resume bit for bit at any step of any epoch, in both scripts, with and without loader workers.

One uninterrupted run per configuration saves a checkpoint after each step a stop is made at (what a stop at that
step saves: SIGTERM saves the same checkpoint: the last test); each stop is then a rerun resumed from one of them,
which must end with the uninterrupted run's weights exactly and the same `train_loss` (the mean over every step, the
resumed ones included).

12 rows in batches of 4: 3 steps per epoch, 3 epochs, 9 steps. Stops mid-epoch in the first (step 2), the middle
(step 4) and the last epoch (step 8), and on an epoch boundary (step 6). One more run takes the user's path: SIGTERM
in the second epoch, then the same command again."""

import json
import re
import shutil
import signal

import pytest
import torch

from bridgetower_bench.output_dir import checkpoint_manifest
from helpers import BOTH_ROUTES, CPU_FLAGS, ForkedRun, base_args, load_weights, read_json, resumed_at, run_script


STEPS = 9
# The 9-step runs are stopped at even steps only: their uninterrupted runs save every second step.
EVEN_STOPS = dict(save_steps=2)


def command(fixtures, out, workers, **overrides):
    options = dict(max_train_samples=12, num_train_epochs=3, dataloader_num_workers=workers, seed=11)
    options |= dict(save_strategy="steps", save_steps=1)
    return base_args(fixtures, out, **{**options, **overrides}) + ["--do_train"]


def assert_ends_like(reference, out, stop, train_loss=True):
    """The resumed run in out ends with the weights (and the train_loss) of the uninterrupted one."""
    expected, actual = load_weights(reference), load_weights(out)
    assert expected.keys() == actual.keys()
    differing = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not differing, (
        f"stopped at step {stop}: {len(differing)} of {len(expected)} tensors differ from the uninterrupted run's"
    )
    if train_loss:
        assert read_json(out / "train_results.json")["train_loss"] == pytest.approx(
            read_json(reference / "train_results.json")["train_loss"], rel=1e-9
        ), "train_loss must average every step of the run"


def resume_to_the_end(reference, steps, fixtures, out, kind, workers, stop, **recipe):
    """Resume the uninterrupted run (of `steps` steps) in reference from its checkpoint at `stop`, into out."""
    assert read_json(reference / "trainer_state.json")["global_step"] == steps
    checkpoint = reference / f"checkpoint-{stop}"
    args = command(fixtures, out, workers, save_strategy="no", resume_from_checkpoint=checkpoint, **recipe)
    resumed = run_script(kind, args + CPU_FLAGS[kind])
    assert resumed_at(resumed.stdout + resumed.stderr, stop)
    assert read_json(out / "trainer_state.json")["global_step"] == steps
    assert_ends_like(reference, out, stop)


@pytest.fixture(scope="module")
def uninterrupted(fixtures, tmp_path_factory):
    """The uninterrupted run of a configuration (script, workers), made once: its directory."""
    made = {}

    def run(kind, workers, **recipe):
        key = (kind, workers, *sorted(recipe.items()))
        if key not in made:
            out = tmp_path_factory.mktemp(f"uninterrupted-{kind}-{workers}") / "run"
            run_script(kind, command(fixtures, out, workers, **recipe) + CPU_FLAGS[kind])
            made[key] = out
        return made[key]

    yield run
    for out in made.values():
        shutil.rmtree(out.parent, ignore_errors=True)


@pytest.mark.parametrize(
    "kind, workers, stop",
    [("cuda", 0, 2), ("cuda", 0, 4), ("cuda", 0, 6), ("cuda", 0, 8), ("cuda", 1, 2), ("cuda", 1, 4), ("cuda", 1, 8)]
    + [("gaudi", 0, 8), ("gaudi", 1, 4)],
)
def test_a_run_stopped_at_any_step_of_any_epoch_resumes_to_the_uninterrupted_weights(
    kind, workers, stop, fixtures, uninterrupted, tmp_path
):
    reference = uninterrupted(kind, workers, **EVEN_STOPS)
    resume_to_the_end(reference, STEPS, fixtures, tmp_path / "resumed", kind, workers, stop, **EVEN_STOPS)


# 20 rows in batches of 4, 4 micro-batches a step: windows of 4 and 1 in each of the 3 epochs, 6 steps.
ACCUMULATION = dict(max_train_samples=20, gradient_accumulation_steps=4)


@pytest.mark.parametrize(
    "kind, stop",
    [*(pytest.param("cuda", stop, marks=BOTH_ROUTES) for stop in (3, 5)), ("gaudi", 3), ("gaudi", 5)],
)
def test_a_run_stopped_before_an_epochs_partial_accumulation_window_resumes_to_the_uninterrupted_weights(
    kind, stop, fixtures, uninterrupted, tmp_path
):
    """Stopped after the first window of the middle (step 3) or the last epoch (step 5): the epoch's last
    micro-batch once got no step of its own on transformers 4.55 and GaudiTrainer 1.21 (their loop restarts its
    count of the epoch's micro-batches at the skipped ones), 5 steps instead of 6 and the weights 9e-4 away."""
    reference = uninterrupted(kind, 0, **ACCUMULATION)
    resume_to_the_end(reference, 6, fixtures, tmp_path / "resumed", kind, 0, stop, **ACCUMULATION)


def test_a_checkpoint_saved_while_a_resumed_epochs_last_window_is_mended_records_the_given_accumulation(
    fixtures, uninterrupted, tmp_path
):
    """36 rows, 4 micro-batches a step: windows of 4, 4 and 1, 3 steps. Resumed after step 1, the window of 1 is
    mended once step 2's window is trained: the loop reads args.gradient_accumulation_steps, 1 until that last
    micro-batch is trained, while step 2's checkpoint is saved. Its training_args.bin once recorded the 1; resumed
    from it, the run ends bit for bit as the uninterrupted one."""
    recipe = dict(max_train_samples=36, gradient_accumulation_steps=4, num_train_epochs=1)
    reference = uninterrupted("cuda", 0, **recipe)
    assert read_json(reference / "trainer_state.json")["global_step"] == 3
    resumed = tmp_path / "resumed"
    args = command(fixtures, resumed, 0, resume_from_checkpoint=reference / "checkpoint-1", **recipe)
    run_script("cuda", args + CPU_FLAGS["cuda"])
    saved = torch.load(resumed / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.gradient_accumulation_steps == 4
    assert checkpoint_manifest.incomplete_reason(str(resumed / "checkpoint-2")) is None
    assert_ends_like(reference, resumed, 1)
    resume_to_the_end(resumed, 3, fixtures, tmp_path / "again", "cuda", 0, 2, **recipe)


def test_a_checkpoint_without_the_loss_sum_still_resumes_and_says_what_train_loss_then_averages(
    fixtures, uninterrupted, tmp_path
):
    """A checkpoint saved before the loss sum was kept: same weights, a warning, and its later checkpoints keep the sum."""
    reference = uninterrupted("cuda", 0, **EVEN_STOPS)
    checkpoint = tmp_path / "checkpoint-8"
    shutil.copytree(reference / "checkpoint-8", checkpoint)
    state = read_json(checkpoint / "trainer_state.json")
    del state["stateful_callbacks"]["TrainingLossSum"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    checkpoint_manifest.write(str(checkpoint), [])  # complete as saved, the loss sum aside
    out = tmp_path / "resumed"
    resumed = run_script("cuda", command(fixtures, out, 0, resume_from_checkpoint=checkpoint) + CPU_FLAGS["cuda"])
    assert (
        "does not hold the loss sum of its steps: train_loss will average only the steps trained from now on"
        in resumed.stdout + resumed.stderr
    )
    assert_ends_like(reference, out, 8, train_loss=False)
    assert "TrainingLossSum" in read_json(out / "checkpoint-9" / "trainer_state.json")["stateful_callbacks"]


@BOTH_ROUTES
def test_sigterm_in_a_later_epoch_then_the_same_command_ends_with_the_uninterrupted_weights(
    fixtures, uninterrupted, tmp_path
):
    """The user's path: SIGTERM once step 5 (second epoch) is logged, exit 143 (128 + SIGTERM: the run did not
    finish, and says so to shells and schedulers), the same command resumes, bit for bit on CPU: the checkpoint
    holds model, optimizer, scheduler and RNG states, and the resumed steps see the same batches and dropout."""
    reference = uninterrupted("cuda", 0, **EVEN_STOPS)
    out = tmp_path / "run"
    run = ForkedRun("cuda", command(fixtures, out, 0, save_strategy="no") + CPU_FLAGS["cuda"], tmp_path)
    logged = 0
    for line in run.lines():
        logged += "'loss'" in line
        if logged == 5:  # step 5 of 9 logged: the second epoch's second step
            run.send_signal(signal.SIGTERM)
            break
    stopped = run.wait()
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    match = re.fullmatch(
        r"Training stopped by SIGTERM at step (\d+) of 9; checkpoint saved in (.*)\. Rerun the same "
        r"command \(without --overwrite_output_dir\) to resume from it\.",
        stopped.stderr.strip().splitlines()[-1],
    )
    assert match, stopped.stderr[-3000:]
    step = int(match.group(1))
    assert 5 <= step < 9 and match.group(2) == str(out / f"checkpoint-{step}")
    assert not (out / "model.safetensors").exists(), "an interrupted run saves a checkpoint, not a final model"

    resumed = run_script("cuda", command(fixtures, out, 0, save_strategy="no") + CPU_FLAGS["cuda"])
    assert resumed_at(resumed.stdout + resumed.stderr, step)
    state = read_json(out / "trainer_state.json")
    assert [e["step"] for e in state["log_history"] if "loss" in e] == list(range(1, STEPS + 1))
    assert_ends_like(reference, out, step)

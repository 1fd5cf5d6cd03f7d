"""A run directory knows its recipe: a rerun, resume or evaluation uses the model its command describes, or refuses.

The recipe (model, data fingerprints, every argument that changes the weights, seed, the scripts' version) is saved
with the model and with every checkpoint; a refusal names what differs."""

import dataclasses
import inspect
import json
import re
import shutil
import signal
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from bridgetower_bench.arguments import WarmupTrainingArguments
from bridgetower_bench.images import images
from bridgetower_bench.output_dir import checkpoint_manifest, run_directory, run_recipe
from helpers import (
    BOTH_ROUTES,
    CPU_FLAGS,
    SCRIPTS,
    ForkedRun,
    base_args,
    command,
    last_line,
    load_weights,
    noise_jpeg,
    optimum_habana,
    read_json,
    resumed_at,
    run_killed_while_publishing,
    run_script,
    script_module,
    write_csv,
)


def files(out, *names) -> dict:
    return {name: (out / name).read_bytes() for name in names}


# A finished run is reused only by its own recipe -------------------------------------------------------------


@pytest.mark.parametrize("kind", [pytest.param("cuda", marks=BOTH_ROUTES), "gaudi"])
def test_a_rerun_with_another_learning_rate_and_seed_into_a_finished_run_is_refused(kind, fixtures, tmp_path):
    out = tmp_path / "run"
    run_script(kind, command(fixtures, out, kind, "--do_eval"))
    kept = files(out, "model.safetensors", "all_results.json", "validation_results.json")

    rerun = run_script(kind, command(fixtures, out, kind, "--do_eval", learning_rate=2e-3, seed=8), check=False)
    assert rerun.returncode == 2 and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
    assert read_json(out / "recipe.json")["learning_rate"] == 1e-3  # (saved with the model)
    assert last_line(rerun) == (
        f"{SCRIPTS[kind]}: error: --output_dir={out} holds a model of another recipe (--learning_rate 0.001 → 0.002, "
        "--seed 7 → 8): pass --overwrite_output_dir to train this recipe there afresh, or choose another --output_dir"
    )
    assert "'loss'" not in rerun.stdout and files(out, *kept) == kept, "the finished run's files were changed"

    same = run_script(kind, command(fixtures, out, kind, "--do_eval"))  # its own recipe: reused, not trained again
    assert "not training again" in same.stdout + same.stderr and "'loss'" not in same.stdout
    assert (out / "model.safetensors").read_bytes() == kept["model.safetensors"]


def test_a_fast_draft_rerun_on_another_jpeg_decoder_is_refused_naming_it_and_a_fast_rerun_is_not(
    fixtures, tmp_path, monkeypatch
):
    """fast-draft's pixels depend on the JPEG decoder (its DCT scales): its recipe names it, as train_results.json
    does for both fast pipelines; fast's pixels do not, so neither does its recipe."""
    pytest.importorskip("simplejpeg")
    decoder, runs = images.jpeg_decoder(), {pipeline: tmp_path / pipeline for pipeline in ("fast-draft", "fast")}
    for pipeline, out in runs.items():
        run_script("cuda", command(fixtures, out, image_pipeline=pipeline))
        assert (
            read_json(out / "train_results.json")["jpeg_decoder"] == decoder == f"simplejpeg {version('simplejpeg')}"
        )
    assert read_json(runs["fast-draft"] / "recipe.json")["jpeg_decoder"] == decoder
    assert "jpeg_decoder" not in read_json(runs["fast"] / "recipe.json")

    monkeypatch.setattr(images, "simplejpeg", None)  # another install: Pillow decodes
    rerun = run_script("cuda", command(fixtures, runs["fast-draft"], image_pipeline="fast-draft"), check=False)
    assert rerun.returncode == 2 and last_line(rerun) == (
        f"{SCRIPTS['cuda']}: error: --output_dir={runs['fast-draft']} holds a model of another recipe (the JPEG "
        f"decoder (--image_pipeline fast-draft's pixels depend on it) {decoder} → Pillow {version('Pillow')}): pass "
        "--overwrite_output_dir to train this recipe there afresh, or choose another --output_dir"
    )
    same = run_script("cuda", command(fixtures, runs["fast"], image_pipeline="fast"))
    assert "not training again" in same.stdout + same.stderr and "'loss'" not in same.stdout


def edit_scripts_version(out):
    recipe = read_json(out / "recipe.json")
    (out / "recipe.json").write_text(json.dumps({**recipe, "scripts_version": "0.0.9"}))


def delete_model_and_last_checkpoint(out):
    (out / "model.safetensors").unlink()
    shutil.rmtree(out / "checkpoint-3")


@pytest.mark.parametrize("kind", [pytest.param("cuda", marks=BOTH_ROUTES), "gaudi"])
def test_a_finished_run_not_as_published_is_published_again_from_its_checkpoint_not_trained_past_its_last_step(
    kind, fixtures, tmp_path
):
    """Once resumed from its last checkpoint, the rerun trained step 4 of 3 (a new checkpoint-4, another train_loss):
    with a constant learning rate, the 4-step model published. Each way a published set can be damaged: published
    again from checkpoint-3 as it is, or (that one gone) step 3 trained again from checkpoint-2."""
    recipe = dict(max_steps=3, lr_scheduler_type="constant")
    original = tmp_path / "original"
    run_script(kind, command(fixtures, original, kind, **recipe))  # checkpoints 2 and 3, its model
    weights, train_loss = load_weights(original), read_json(original / "train_results.json")["train_loss"]
    ways = {
        "model.safetensors is missing": lambda out: (out / "model.safetensors").unlink(),
        "model.safetensors has ": lambda out: cut_short(out / "model.safetensors"),
        "recipe.json is missing": lambda out: (out / "recipe.json").unlink(),
        "recipe.json has ": edit_scripts_version,
        "checkpoint-2": delete_model_and_last_checkpoint,
    }
    for n, (said, damage) in enumerate(ways.items()):
        out = tmp_path / f"damaged-{n}"
        shutil.copytree(original, out)
        damage(out)
        rerun = run_script(kind, command(fixtures, out, kind, **recipe))
        log = rerun.stdout + rerun.stderr
        if said == "checkpoint-2":
            assert f"resuming training at {out / 'checkpoint-2'}" in log and resumed_at(log, 2), log[-3000:]
            assert read_json(out / "trainer_state.json")["log_history"][-2]["step"] == 3
        else:
            assert f"its trained model is not as it was published ({said}" in log, log[-3000:]
            assert f"{out / 'checkpoint-3'} ends this recipe's training (step 3 of 3): publishing it again" in log
            assert "'loss'" not in rerun.stdout, f"{said}: trained again"
            assert read_json(out / "train_results.json")["published_from"] == "checkpoint-3"
        assert not (out / "checkpoint-4").exists() and read_json(out / "trainer_state.json")["global_step"] == 3, said
        assert read_json(out / "train_results.json")["train_loss"] == pytest.approx(train_loss, rel=1e-9), said
        published = load_weights(out)
        assert published.keys() == weights.keys() and all(torch.equal(weights[k], published[k]) for k in weights)
        again = run_script(kind, command(fixtures, out, kind, **recipe))  # intact now: reused
        assert "trained as far as asked: not training again" in again.stdout + again.stderr, said


def test_a_rerun_on_data_changed_in_place_is_refused_naming_the_data(fixtures, tmp_path):
    rows = [(f"{i}.jpg", noise_jpeg(i), f"cartoon number {i}") for i in range(20)]
    train_file = write_csv(tmp_path / "data" / "train.csv", rows)
    out = tmp_path / "run"

    columns = dict(dataset_name=None, dataset_config_name=None, image_column="image_path", caption_column="caption")
    csv_command = command(fixtures, out, **columns) + ["--train_file", train_file]
    run_script("cuda", csv_command)
    write_csv(train_file, rows[:-1] + [(rows[-1][0], None, "a caption changed in place")])

    rerun = run_script("cuda", csv_command, check=False)
    assert rerun.returncode == 2, rerun.stderr[-3000:]
    before = read_json(out / "recipe.json")["data_fingerprint_train"]
    said = (
        f"{SCRIPTS['cuda']}: error: --output_dir={out} holds a model of another recipe (the train split's data "
        f"(datasets fingerprint) {before} → ",
        "): pass --overwrite_output_dir to train this recipe there afresh, or choose another --output_dir",
    )
    assert re.fullmatch(re.escape(said[0]) + r"[0-9a-f]+" + re.escape(said[1]), last_line(rerun)), last_line(rerun)


def test_a_new_recipe_stopped_by_sigterm_resumes_its_own_checkpoint_not_the_old_model(fixtures, tmp_path):
    """A finished run of recipe A; recipe B started over it with --overwrite_output_dir, stopped by SIGTERM; the
    rerun of B without --overwrite_output_dir (as the message says) resumes B's checkpoint, passing over A's newer
    ones, and publishes B's model: the weights of an uninterrupted run of B."""
    new = {"learning_rate": 2e-3, "max_steps": 6}
    reference = tmp_path / "reference"
    run_script("cuda", command(fixtures, reference, **new))

    out = tmp_path / "run"
    run_script("cuda", command(fixtures, out, max_steps=6))  # recipe A: checkpoints 2, 4, 6 and its model
    run = ForkedRun("cuda", command(fixtures, out, "cuda", "--overwrite_output_dir", **new), tmp_path)
    for line in run.lines():
        if "'loss'" in line:
            run.send_signal(signal.SIGTERM)
            break
    result = run.wait()
    stopped = result.stderr
    assert result.returncode == 128 + signal.SIGTERM, stopped[-3000:]
    step = int(re.search(r"Training stopped by SIGTERM at step (\d+) of 6", stopped).group(1))

    resumed = run_script("cuda", command(fixtures, out, **new))
    log = resumed.stdout + resumed.stderr
    assert "not training again" not in log
    assert f"Checkpoint detected, resuming training at {out / f'checkpoint-{step}'}" in log
    assert resumed_at(log, step)
    for older in range(step + 1, 7):
        if older % 2 == 0:  # recipe A's checkpoints the new run had not reached: named and passed over
            assert (
                f"Not resuming from {out / f'checkpoint-{older}'}: saved by another recipe (--learning_rate 0.001 → 0.002)"
                in log
            )
    assert read_json(out / "recipe.json")["learning_rate"] == 2e-3
    expected, actual = load_weights(reference), load_weights(out)
    assert all(torch.equal(expected[k], actual[k]) for k in expected), "the published model is not recipe B's"


@BOTH_ROUTES
def test_a_resume_with_another_seed_is_refused_and_the_checkpoints_kept(fixtures, tmp_path):
    out = tmp_path / "run"
    run_killed_while_publishing("cuda", command(fixtures, out, max_steps=4))  # checkpoints 2 and 4, no model
    kept = files(out / "checkpoint-4", "model.safetensors", "optimizer.pt")

    rerun = run_script("cuda", command(fixtures, out, max_steps=4, seed=8), check=False)
    assert rerun.returncode == 2 and "'loss'" not in rerun.stdout, rerun.stderr[-3000:]
    assert last_line(rerun) == (
        f"{SCRIPTS['cuda']}: error: --output_dir={out} holds checkpoints (the newest complete one: checkpoint-4) of "
        "another recipe (--seed 7 → 8): pass --overwrite_output_dir to train this recipe there afresh, or choose "
        "another --output_dir"
    )
    assert files(out / "checkpoint-4", *kept) == kept and not (out / "model.safetensors").exists()


# Evaluation alone into a trained run's directory -------------------------------------------------------------


def eval_only(fixtures, out, model):
    return base_args(fixtures, out, model_name_or_path=model) + ["--do_eval"] + CPU_FLAGS["cuda"]


@BOTH_ROUTES
def test_evaluation_alone_evaluates_the_trained_model_and_refuses_another(fixtures, tmp_path):
    out = tmp_path / "run"
    run_script("cuda", command(fixtures, out, "cuda", "--do_eval"))
    trained = read_json(out / "validation_results.json")["eval_loss"]
    weights = (out / "model.safetensors").read_bytes()
    (out / "validation_results.json").unlink()  # this evaluation writes them again
    again = run_script("cuda", eval_only(fixtures, out, fixtures["model"]))  # the base model named, as in training
    log = again.stdout + again.stderr
    assert f"loading weights file {out / 'model.safetensors'}" in log
    assert f"loading weights file {fixtures['model'] / 'model.safetensors'}" not in log
    assert f"{out} holds a trained model: evaluating it (not {fixtures['model']}" in log
    assert read_json(out / "validation_results.json")["eval_loss"] == trained
    all_results = read_json(out / "all_results.json")
    assert all_results["eval_loss"] == trained and "train_loss" in all_results
    # an evaluation alone names the versions it ran with, as a training's record does
    assert read_json(out / "validation_results.json")["version_transformers"] == transformers.__version__
    itself = run_script("cuda", eval_only(fixtures, out, out))  # the directory itself names the trained model too
    assert f"{out} holds a trained model: evaluating it\n" in itself.stdout + itself.stderr
    assert "the model it was trained from" not in itself.stdout + itself.stderr
    assert read_json(out / "validation_results.json")["eval_loss"] == trained

    other = tmp_path / "other-model"
    shutil.copytree(fixtures["model"], other)
    kept = files(out, "validation_results.json", "all_results.json")
    refused = run_script("cuda", eval_only(fixtures, out, other), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert last_line(refused) == (
        f"{SCRIPTS['cuda']}: error: --output_dir={out} holds a trained model (trained from {fixtures['model']}); "
        f"--model_name_or_path={other} names another model, whose results would replace the trained model's: choose "
        f"another --output_dir, or pass --model_name_or_path {out} to evaluate the trained model"
    )
    assert files(out, *kept) == kept and (out / "model.safetensors").read_bytes() == weights


# Which checkpoint a run resumes from (no training: the decision alone) ---------------------------------------


def parsed(name, values, **derived):
    """A stand-in for one parsed arguments dataclass: `values` its fields, `derived` attributes it computes (as
    TrainingArguments' world_size)."""
    instance = dataclasses.make_dataclass(name, list(values))(**values)
    vars(instance).update(derived)
    return instance


def arguments(out, **training):
    model = parsed("ModelArguments", {"model_name_or_path": "base-model", "model_revision": "main"})
    data = parsed("DataTrainingArguments", {"dataset_name": "cartoons", "max_train_samples": None})
    args = {
        "output_dir": str(out),
        "do_train": True,
        "do_eval": False,
        "do_predict": False,
        "overwrite_output_dir": False,
        "resume_from_checkpoint": None,
        "learning_rate": 1e-3,
        "seed": 7,
        "max_steps": 6,
        "warmup_steps": 0,
        "num_train_epochs": 3.0,
        "load_best_model_at_end": False,
        **training,
    }
    dataset = {"train": SimpleNamespace(_fingerprint="f00d"), "validation": SimpleNamespace(_fingerprint="beef")}
    return model, data, parsed("TrainingArguments", args, world_size=1), dataset


def plan(out, **training):
    return run_recipe.plan_run(str(out), *arguments(out, **training))


def save_checkpoint(out, step, recipe=None, complete=True, last_step=6):
    checkpoint = out / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    required = checkpoint_manifest.required_files(save_only_model=False, world_size=1)
    for name in [name if isinstance(name, str) else name[0] for name in required]:  # (a tuple: one of these)
        (checkpoint / name).write_text(f"{name} at step {step}")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": last_step}))
    if recipe is not None:
        run_recipe.write(str(checkpoint), recipe)
    run_directory.record_written(str(out), [checkpoint.name])
    if complete:
        assert checkpoint_manifest.write(str(checkpoint), required) is None
    return checkpoint


def test_training_resumes_from_the_newest_complete_checkpoint_of_its_recipe(tmp_path, caplog):
    out = tmp_path / "run"
    recipe = run_recipe.describe(*arguments(out))
    other = run_recipe.describe(*arguments(out, learning_rate=5e-4))
    save_checkpoint(out, 2, recipe)
    save_checkpoint(out, 4, recipe)
    save_checkpoint(out, 6, recipe, complete=False)  # killed while saving
    save_checkpoint(out, 8, other)
    with caplog.at_level("WARNING", logger="bridgetower_bench"):
        assert plan(out) == (recipe, None, str(out / "checkpoint-4"), None)
    assert (
        f"Not resuming from {out / 'checkpoint-8'}: saved by another recipe (--learning_rate 0.0005 → 0.001)"
        in caplog.text
    )
    assert (
        f"Not resuming from {out / 'checkpoint-6'}: it has no checkpoint-manifest.json (its save did not finish)"
        in caplog.text
    )
    assert f"resuming training at {out / 'checkpoint-4'}" in caplog.text

    # what a run does not train with decides nothing: more or fewer epochs than --max_steps allows, more workers
    assert plan(out, num_train_epochs=9.0, dataloader_num_workers=4).resume_from == str(out / "checkpoint-4")
    # --overwrite_output_dir starts afresh; a run that does not train resumes nothing
    assert plan(out, overwrite_output_dir=True).resume_from is None
    assert plan(out, do_train=False).resume_from is None
    # --resume_from_checkpoint: the user's choice, if complete and of this recipe
    assert plan(out, resume_from_checkpoint=str(out / "checkpoint-2")).resume_from == str(out / "checkpoint-2")
    with pytest.raises(
        ValueError,
        match=r"^--resume_from_checkpoint=.*checkpoint-8 was saved by another recipe "
        r"\(--learning_rate 0\.0005 → 0\.001\): rerun with its arguments",
    ):
        plan(out, resume_from_checkpoint=str(out / "checkpoint-8"))
    with pytest.raises(ValueError, match=r"^--resume_from_checkpoint=.*checkpoint-6 is incomplete \(it has no "):
        plan(out, resume_from_checkpoint=str(out / "checkpoint-6"))


def publish(out, recipe, step=6, last_step=None):
    """A trained model published in out as a run publishes it (recipe.json in its set), trained to `step` of
    `last_step` (by default its last)."""
    with run_directory.publication(str(out)) as staging:
        for name in ("model.safetensors", "config.json", "train_results.json"):
            (Path(staging) / name).write_text(name)
        state = {"global_step": step, "max_steps": last_step or step}
        (Path(staging) / "trainer_state.json").write_text(json.dumps(state))
        run_recipe.write(staging, recipe)


def test_this_recipes_model_short_of_its_last_step_resumes_its_checkpoint_or_is_refused_saying_so(tmp_path):
    """Once refused as "a model of another recipe ()", naming no difference."""
    out = tmp_path / "run"
    recipe = run_recipe.describe(*arguments(out))
    publish(out, recipe, step=3, last_step=6)
    with pytest.raises(ValueError) as refused:
        plan(out)
    assert str(refused.value) == (
        f"--output_dir={out} holds this recipe's model, not trained to its last step, and no complete checkpoint of "
        "it to resume: pass --overwrite_output_dir to train it afresh"
    )
    save_checkpoint(out, 3, recipe)
    assert plan(out) == (recipe, None, str(out / "checkpoint-3"), None)


def cut_short(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def changed(path):
    path.write_bytes(path.read_bytes().swapcase())  # the same size


@pytest.mark.parametrize(
    "name, damage, why",
    [
        ("model.safetensors", Path.unlink, "model.safetensors is missing"),
        ("model.safetensors", cut_short, "model.safetensors has 8 bytes, not the 17 saved"),
        ("model.safetensors", changed, "model.safetensors is not the file saved (its sha256 differs)"),
        ("recipe.json", changed, "recipe.json is not the file saved (its sha256 differs)"),
        ("model-manifest.json", Path.unlink, "model-manifest.json is missing"),
        ("train_results.json", Path.unlink, "train_results.json is missing"),
        ("train_results.json", changed, "train_results.json is not the file saved (its sha256 differs)"),
    ],
)
def test_a_published_model_not_as_published_is_published_again_from_its_checkpoint_or_refused_in_one_line(
    name, damage, why, tmp_path, caplog
):
    """A finished run whose model.safetensors was deleted, rerun with its command, once died in transformers'
    OSError though a complete checkpoint of its recipe was there; one cut short, in a SafetensorError traceback
    after "not training again"; one resumed from its last checkpoint trained a step past --max_steps."""
    out = tmp_path / "run"
    recipe = run_recipe.describe(*arguments(out))
    publish(out, recipe)
    assert plan(out) == (recipe, str(out), None, None)  # intact: reused
    damage(out / name)
    damaged = f"--output_dir={out}: its trained model is not as it was published ({why})"
    with pytest.raises(ValueError) as refused:
        plan(out)
    assert str(refused.value) == (
        f"{damaged}, and no complete checkpoint of its recipe is there to publish again: pass --overwrite_output_dir "
        "to train it afresh"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(damaged)}: rerun its training command"):
        plan(out, do_train=False)  # evaluation alone: not the base model's weights in its place
    save_checkpoint(out, 4, recipe)
    with caplog.at_level("WARNING", logger="bridgetower_bench"):
        assert plan(out) == (recipe, None, str(out / "checkpoint-4"), None)  # short of the last step: resumed
    assert f"{damaged}: publishing it again from its checkpoints" in caplog.text
    save_checkpoint(out, 6, recipe)
    with caplog.at_level("WARNING", logger="bridgetower_bench"):
        assert plan(out) == (recipe, str(out / "checkpoint-6"), None, str(out / "checkpoint-6"))  # not trained again
    assert f"{out / 'checkpoint-6'} ends this recipe's training (step 6 of 6): publishing it again, not" in caplog.text
    # --resume_from_checkpoint of the last one: the same; with --load_best_model_at_end, its best checkpoint's model
    assert plan(out, resume_from_checkpoint=str(out / "checkpoint-6")).publish_from == str(out / "checkpoint-6")


def test_the_evaluations_results_gone_from_a_finished_run_are_named_unless_the_rerun_publishes_them(tmp_path, caplog):
    out = tmp_path / "run"
    recipe = run_recipe.describe(*arguments(out))
    publish(out, recipe)
    with run_directory.publication(str(out)) as staging:
        for name in ("validation_results.json", "test_results.json", "all_results.json"):
            (Path(staging) / name).write_text("{}")
    for name in ("validation_results.json", "test_results.json", "all_results.json"):
        (out / name).unlink()
    said = {  # (in the published set's order)
        "all_results.json": "--do_eval or --do_predict",
        "test_results.json": "--do_predict",
        "validation_results.json": "--do_eval",
    }
    cases = [
        ({}, list(said)),
        ({"do_eval": True}, ["test_results.json"]),
        ({"do_train": False, "do_eval": True}, ["test_results.json"]),  # evaluation alone: the same
        ({"do_train": False, "do_predict": True}, ["validation_results.json"]),
    ]
    for flags, named in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="bridgetower_bench"):
            assert plan(out, **flags).trained_model == str(out)  # the model is intact: reused
        warned = [r.getMessage() for r in caplog.records if "missing from its results" in r.getMessage()]
        expected = [
            f"{out}: {name} is missing from its results; rerun with {said[name]} to publish it" for name in named
        ]
        assert warned == expected, flags


def test_a_last_checkpoint_with_load_best_model_at_end_publishes_its_best_checkpoints_model_or_refuses(tmp_path):
    out = tmp_path / "run"
    best = dict.fromkeys(run_recipe.BEST_MODEL_ARGUMENTS, None) | dict(load_best_model_at_end=True)
    recipe = run_recipe.describe(*arguments(out, **best))
    save_checkpoint(out, 4, recipe)
    last = save_checkpoint(out, 6, recipe)
    state = json.loads((last / "trainer_state.json").read_text())
    (last / "trainer_state.json").write_text(json.dumps({**state, "best_model_checkpoint": "/elsewhere/checkpoint-4"}))
    checkpoint_manifest.write(str(last), [])
    assert plan(out, **best) == (recipe, str(out / "checkpoint-4"), None, str(last))
    (out / "checkpoint-4" / "model.safetensors").unlink()
    with pytest.raises(ValueError) as refused:
        plan(out, **best)
    assert str(refused.value) == (
        f"{last} ends this recipe's training, but its best checkpoint, {out / 'checkpoint-4'}, cannot be published "
        "(model.safetensors is missing): pass --overwrite_output_dir to train it afresh"
    )


def test_a_model_of_another_version_replaced_by_a_resumed_checkpoint_is_said_so(tmp_path, caplog):
    out = tmp_path / "run"
    recipe = run_recipe.describe(*arguments(out))
    publish(out, {**recipe, "scripts_version": "0.0.9"})
    save_checkpoint(out, 4, recipe)
    with caplog.at_level("WARNING", logger="bridgetower_bench"):
        assert plan(out) == (recipe, None, str(out / "checkpoint-4"), None)
    assert (
        f"{out} holds a model of another recipe (the scripts' version 0.0.9 → {recipe['scripts_version']}): this "
        "recipe's model, from its checkpoint, replaces it"
    ) in caplog.text


def test_resuming_from_a_checkpoint_that_is_not_there_says_so(tmp_path):
    (tmp_path / "a-file").write_text("")
    for path, what in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "a-file", "is not a directory")):
        with pytest.raises(ValueError) as refused:
            plan(tmp_path / "run", resume_from_checkpoint=str(path))
        assert str(refused.value) == f"--resume_from_checkpoint={path} {what}: give a checkpoint-N directory"


def test_checkpoints_of_another_recipe_only_are_refused_and_incomplete_ones_only_are_named(tmp_path, caplog):
    out = tmp_path / "run"
    other = run_recipe.describe(*arguments(out, seed=3, max_steps=8))
    save_checkpoint(out, 2, other)
    with pytest.raises(ValueError) as refused:
        plan(out)
    assert str(refused.value) == (
        f"--output_dir={out} holds checkpoints (the newest complete one: checkpoint-2) of another recipe (--max_steps 8 → 6, "
        "--seed 3 → 7): pass --overwrite_output_dir to train this recipe there afresh, or choose another --output_dir"
    )

    fresh = tmp_path / "fresh"
    save_checkpoint(fresh, 2, None, complete=False)
    (fresh / "checkpoint-4").mkdir()
    run_directory.record_written(str(fresh), ["checkpoint-4"])
    with caplog.at_level("WARNING", logger="bridgetower_bench"):
        assert plan(fresh).resume_from is None
    assert (
        f"{fresh} holds no complete checkpoint, only incomplete ones (checkpoint-4: it has no checkpoint-manifest.json "
        "(its save did not finish); checkpoint-2: it has no checkpoint-manifest.json (its save did not finish)): "
        "training starts afresh"
    ) in caplog.text


# Every argument is decided: in the recipe or, on purpose, not ------------------------------------------------


def test_an_argument_these_scripts_do_not_know_is_in_the_recipe_and_named(tmp_path, caplog):
    """A field a later transformers release adds, which the lists do not sort yet, counts as changing the weights."""
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="bridgetower_bench"):
        recipe = run_recipe.describe(*arguments(out, later_release_knob=0.5))
    assert recipe["later_release_knob"] == 0.5
    assert "Arguments not known to these scripts, so counted in the recipe: --later_release_knob" in caplog.text
    save_checkpoint(out, 2, recipe)
    assert plan(out, later_release_knob=0.5).resume_from == str(out / "checkpoint-2")
    with pytest.raises(ValueError) as refused:
        plan(out, later_release_knob=0.7)
    assert str(refused.value) == (
        f"--output_dir={out} holds checkpoints (the newest complete one: checkpoint-2) of another recipe "
        "(--later_release_knob (not known to these scripts, so counted in the recipe) 0.5 → 0.7): pass "
        "--overwrite_output_dir to train this recipe there afresh, or choose another --output_dir"
    )


def test_a_run_of_the_other_install_route_is_refused_naming_only_the_entries_that_differ(tmp_path):
    """A checkpoint of the current route, continued on the pinned route: its reason once listed 16 entries, most
    "unset → unset" (arguments only transformers 5 has, unset there)."""
    out = tmp_path / "run"
    recipe = run_recipe.describe(*arguments(out))
    current_routes = {**dict.fromkeys(TRANSFORMERS_5_ONLY), "train_sampling_strategy": "random"}
    save_checkpoint(out, 2, {**recipe, **current_routes, "learning_rate": 2e-3})
    with pytest.raises(ValueError) as refused:
        plan(out)
    assert str(refused.value) == (
        f"--output_dir={out} holds checkpoints (the newest complete one: checkpoint-2) of another recipe "
        "(--learning_rate 0.002 → 0.001, --train_sampling_strategy random → absent): pass --overwrite_output_dir "
        "to train this recipe there afresh, or choose another --output_dir"
    )
    # nothing else differs: the arguments one route lacks, unset on the other, are named
    assert run_recipe.differences({**recipe, "use_cache": None}, recipe) == "--use_cache unset → absent"


# The fields transformers 5 added (the current install route): listed, though the pinned route has none of them.
TRANSFORMERS_5_ONLY = {
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "dataloader_in_order",
    "dataloader_multiprocessing_context",
    "ddp_static_graph",
    "enable_jit_checkpoint",
    "parallelism_config",
    "project",
    "trackio_bucket_id",
    "trackio_space_id",
    "trackio_static_space_id",
    "train_sampling_strategy",
    "use_cache",
}


# A field that a later release adds and no list names is not a failure: it is in the recipe and named in every run's
# warning (the test above) until it is sorted. A listed name that no longer exists is: the lists must not go stale.
@BOTH_ROUTES
def test_the_arguments_listed_as_transformers_5s_are_fields_of_that_line_only():
    cuda = script_module("cuda")
    classes = (cuda.ModelArguments, cuda.DataTrainingArguments, WarmupTrainingArguments)
    fields = {f.name for cls in classes for f in dataclasses.fields(cls) if f.init}
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert sorted(TRANSFORMERS_5_ONLY - fields) == [], "listed as transformers 5's, not a field of it: remove it"
    else:
        assert sorted(TRANSFORMERS_5_ONLY & fields) == [], "a field of the pinned route listed as transformers 5's"


def test_every_argument_listed_is_an_argument_of_a_script_and_in_the_recipe_or_out_of_it_not_both():
    gaudi, cuda = script_module("gaudi"), script_module("cuda")
    with optimum_habana() as habana:
        classes = (
            gaudi.ModelArguments,
            gaudi.DataTrainingArguments,
            cuda.DataTrainingArguments,
            habana.GaudiTrainingArguments,
            WarmupTrainingArguments,
        )
        fields = {f.name for cls in classes for f in dataclasses.fields(cls)}
    in_recipe = set(run_recipe.MODEL_ARGUMENTS) | set(run_recipe.DATA_ARGUMENTS) | set(run_recipe.TRAINING_ARGUMENTS)
    not_in = set(run_recipe.NOT_IN_THE_RECIPE)
    assert not in_recipe & not_in, "an argument is both in and out of the recipe"
    assert set(run_recipe.BEST_MODEL_ARGUMENTS) <= not_in
    assert sorted((in_recipe | not_in) - fields - TRANSFORMERS_5_ONLY) == [], "an argument listed that no script has"


# The arguments the backends' own step reads (what turns a batch into gradients) that leave the weights as they are.
STEP_READS_NOT_IN_THE_RECIPE = {
    "gradient_checkpointing": "the same gradients, recomputed (with fp8, the recomputation in fp8 as the forward)",
    "torch_empty_cache_steps": "frees the device's cached memory",
    "past_index": "feeds a model's memory states back (BridgeTower returns none)",
}


def _step_reads(trainer_class) -> set:
    """The fields of args that trainer_class's own training_step and compute_loss read."""
    source = "".join(
        inspect.getsource(trainer_class.__dict__[name])
        for name in ("training_step", "compute_loss")
        if name in trainer_class.__dict__
    )
    return set(re.findall(r"\bargs\.(\w+)", source))


def test_every_argument_the_backends_training_step_reads_is_in_the_recipe_or_known_to_leave_the_weights():
    """Once --pipelining_fwd_bwd was out of the recipe, though with lazy mode GaudiTrainer's training_step then
    divides the micro-batches' losses where it otherwise sums them: a resume across it was not refused."""
    with optimum_habana() as habana:
        trainers = (transformers.Trainer, habana.GaudiTrainer)
        fields = {f.name for f in dataclasses.fields(habana.GaudiTrainingArguments)}
        reads = {cls.__name__: _step_reads(cls) & fields for cls in trainers}
    assert "pipelining_fwd_bwd" in reads["GaudiTrainer"] and "optim" in reads["Trainer"]  # the reading works
    in_recipe = set(run_recipe.TRAINING_ARGUMENTS)
    unsorted = {name: sorted(read - in_recipe - set(STEP_READS_NOT_IN_THE_RECIPE)) for name, read in reads.items()}
    assert unsorted == {"Trainer": [], "GaudiTrainer": []}, "read by the backend's step: in the recipe, or say why not"


def test_ranks_of_one_job_with_another_recipe_or_library_are_named_with_what_differs():
    recipe = {"learning_rate": 1e-5, "seed": 42, "scripts_version": "0.1.0"}
    mine = run_recipe.job_recipe(recipe)
    assert mine["version_transformers"] == transformers.__version__ and mine["learning_rate"] == 1e-5
    assert run_recipe.different_recipes([mine, dict(mine), dict(mine)]) is None
    faster = {**mine, "learning_rate": 1e-3}
    newer = {**mine, "version_transformers": "9.9.9", "scripts_version": "0.2.0"}
    assert run_recipe.different_recipes([mine, faster, mine, newer]) == (
        "rank 1: --learning_rate 1e-05 → 0.001; "
        f"rank 3: the scripts' version 0.1.0 → 0.2.0, transformers's version {transformers.__version__} → 9.9.9"
    )

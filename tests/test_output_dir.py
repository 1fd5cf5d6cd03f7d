"""--output_dir under faults: one run at a time, nothing foreign touched or deleted, leftovers of killed writes
cleared, and the final set (model, config, processors, metrics, trainer state) published all-or-nothing at
every kill point; a signal after training never loses it, and rerunning completes the phases left."""

import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bridgetower_bench.output_dir import checkpoint_manifest, run_directory
from bridgetower_bench.tools.fixtures import script_flags
from bridgetower_bench.user_errors import UserInputError
from helpers import (
    BOTH_ROUTES,
    CPU_FLAGS,
    REPO,
    SCRIPTS,
    ForkedRun,
    base_args,
    command,
    dead_pid,
    last_line,
    load_weights,
    read_json,
    run_script,
    run_stopped_at,
    script_env,
    trainer_on,
    wait_for_child,
)
from stop_at_rename import stop_at


def claim_in_another_process(output_dir, hold=True):
    """A second process that claims output_dir: one that keeps it until killed (hold), or one that exits at once."""
    code = "import sys; from bridgetower_bench.output_dir import run_directory; run_directory.claim(sys.argv[1])"
    if hold:
        code += "; print('held', flush=True); sys.stdin.read()"
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(output_dir)],
        cwd=REPO,
        env=script_env(False),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None if hold else subprocess.PIPE,
        text=True,
    )
    if hold:
        assert process.stdout.readline().strip() == "held"
    return process


# The lock ----------------------------------------------------------------------------------------------------


def test_a_second_run_on_the_same_output_dir_is_refused_and_a_dead_holders_lock_is_taken_over(
    fixtures, tmp_path, caplog
):
    out = tmp_path / "out"
    holder = claim_in_another_process(out)
    in_use = f"--output_dir={out} is in use by another run (process {holder.pid} on host "
    try:
        with pytest.raises(run_directory.OutputDirInUse) as refused:
            run_directory.claim(str(out))
        assert str(refused.value).startswith(in_use)
        # The script refuses it in its last line, before training or writing anything.
        args = script_flags(fixtures, output_dir=out, max_steps=1, report_to="none")
        result = run_script("cuda", [*args, "--do_train", *CPU_FLAGS["cuda"]], check=False)
        assert result.returncode != 0
        assert in_use in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
        assert "'loss'" not in result.stdout and os.listdir(out) == [run_directory.LOCK_NAME]
        run_directory.claim(str(out), holder=False)  # another process of the same distributed job: no refusal
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="bridgetower_bench"):
        run_directory.claim(str(out))
    try:
        assert f"taking over the stale lock of process {holder.pid} on host " in caplog.text
        # The lock is ours now: another process is refused.
        other = claim_in_another_process(out, hold=False)
        _, stderr = other.communicate(timeout=300)
        assert other.returncode != 0 and f"process {os.getpid()} on host" in stderr
    finally:
        run_directory.release(str(out))
    assert os.listdir(out) == [], "a run that wrote nothing leaves the directory as it found it"


# What is ours: refuse foreign files, clear leftovers of killed writes ----------------------------------------


def test_foreign_files_are_refused_even_with_overwrite_output_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("ours")
    (out / "checkpoint-5").mkdir()
    run_directory.record_written(str(out), ["model.safetensors", "checkpoint-5"])
    assert run_directory.check_output_dir(str(out)) is None
    (out / "README.md").write_text("my notes")
    (out / "checkpoint-7").mkdir()
    with pytest.raises(
        ValueError,
        match=rf"^--output_dir={out} holds files this script did not write \(README\.md, "
        r"checkpoint-7\); it never overwrites or deletes them, with or without "
        r"--overwrite_output_dir",
    ):
        run_directory.check_output_dir(str(out))
    assert run_directory.check_output_dir(str(tmp_path / "absent")) is None


def test_the_checkpoint_walk_takes_the_newest_complete_one_its_caller_accepts_and_names_those_passed_over(tmp_path):
    out = tmp_path / "out"
    for step in (1, 2, 10, 12):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"w" * step)
        if step != 12:  # checkpoint-12's save did not finish
            assert checkpoint_manifest.write(str(out / f"checkpoint-{step}"), ["model.safetensors"]) is None
    (out / "checkpoint-20").write_text("a file")
    (out / "checkpoint-x").mkdir()
    steps = [str(out / f"checkpoint-{step}") for step in (1, 2, 10, 12)]
    assert run_directory.checkpoints(str(out)) == steps  # by step, not by name; directories only
    unfinished = (steps[3], "it has no checkpoint-manifest.json (its save did not finish)")
    assert run_directory.newest_complete_checkpoint(str(out)) == (steps[2], [unfinished])

    asked = []

    def refuse(checkpoint):
        asked.append(checkpoint)
        return "another recipe" if checkpoint == steps[2] else None

    taken = run_directory.newest_complete_checkpoint(str(out), refuse)
    assert taken == (steps[1], [unfinished, (steps[2], "another recipe")])
    assert asked == [steps[2], steps[1]]  # complete ones only, newest first, up to the one taken
    none_taken = run_directory.newest_complete_checkpoint(str(out), lambda checkpoint: "no")
    assert none_taken == (None, [unfinished, (steps[2], "no"), (steps[1], "no"), (steps[0], "no")])
    assert run_directory.newest_complete_checkpoint(str(tmp_path / "not_yet")) == (None, [])


def test_leftovers_of_killed_writers_are_removed_at_the_next_start_but_not_those_of_live_ones(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    run_directory.record_written(str(out), ["all_results.json"])
    host, dead, alive = socket.gethostname(), dead_pid(), os.getppid()
    kept = [
        f"all_results.json.partial-{host}-{alive}.aa11",  # a live writer's
        f"all_results.json.partial-other-{host}-{dead}.bb22",  # another node's, on a shared filesystem
        f"notes.txt.partial-{host}-{dead}.cc33",
        "notes.txt.partial-123",
    ]  # the user's own files
    removed_files = [f"all_results.json.partial-{host}-{dead}.dd44"]
    removed_dirs = [f".staging.partial-{host}-{dead}.ee55"]
    for name in kept + removed_files:
        (out / name).write_text('{"eval_lo')
    for staging in removed_dirs:
        (out / staging).mkdir()
        (out / staging / "config.json").write_text("{}")
    assert run_directory.foreign_entries(str(out)) == sorted(kept[2:])
    with caplog.at_level(logging.WARNING, logger="bridgetower_bench"):
        run_directory.claim(str(out))
    run_directory.release(str(out))
    assert sorted(os.listdir(out)) == sorted([run_directory.LOCK_NAME, run_directory.RECORD_NAME, *kept])
    assert f"removed what killed writes left: {', '.join(sorted(removed_files + removed_dirs))}" in caplog.text


# Publication: a kill at every step leaves one complete set ---------------------------------------------------


def _make_generation(trainer, generation):
    """Set number `generation`: every weight equal to it, its loss and step too."""
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.fill_(float(generation))
    trainer.state.global_step = generation


def _publish(trainer, processors, generation):
    """The script's step 9."""
    with trainer.publishing():
        trainer.save_model()
        trainer.save_processors(*processors)
        trainer.save_metrics("train", {"train_loss": float(generation)})
        trainer.save_state()


def _published_generation(out) -> int:
    """Which set output_dir holds, checking that every file of it belongs to that same set."""
    from transformers import AutoImageProcessor, AutoTokenizer, BridgeTowerForContrastiveLearning

    model = BridgeTowerForContrastiveLearning.from_pretrained(str(out))
    values = {float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).unique()}
    assert len(values) == 1, f"weights of two sets: {sorted(values)[:4]}"
    AutoTokenizer.from_pretrained(str(out))
    AutoImageProcessor.from_pretrained(str(out))
    generations = {
        "weights": values.pop() if len(values) == 1 else values,
        "train_results.json": read_json(out / "train_results.json")["train_loss"],
        "all_results.json": read_json(out / "all_results.json")["train_loss"],
        "trainer_state.json": read_json(out / "trainer_state.json")["global_step"],
    }
    if generations["weights"] == 1:  # set 1 was evaluated too
        generations["eval_results.json"] = read_json(out / "eval_results.json")["eval_loss"]
        generations["all_results.json (eval)"] = read_json(out / "all_results.json")["eval_loss"]
    else:
        assert not (out / "eval_results.json").exists() and "eval_loss" not in read_json(out / "all_results.json"), (
            "the previous model's eval results stayed next to the new model"
        )
    assert len(set(map(float, generations.values()))) == 1, f"a mix of two sets: {generations}"
    return int(generations["weights"])


def test_a_kill_at_every_rename_and_removal_of_the_final_save_leaves_one_complete_set(fixtures, tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer

    out, pristine = tmp_path / "out", tmp_path / "pristine"
    trainer = trainer_on(fixtures, None, out)
    processors = (
        AutoTokenizer.from_pretrained(fixtures["model"]),
        AutoImageProcessor.from_pretrained(fixtures["model"]),
    )
    _make_generation(trainer, 1)
    _publish(trainer, processors, generation=1)
    trainer.save_metrics("eval", {"eval_loss": 1.0})  # set 1's eval results: a new model replaces them
    shutil.copytree(out, pristine)
    assert _published_generation(out) == 1

    _make_generation(trainer, 2)
    outcomes = []
    for step in range(1, 60):
        pid = os.fork()
        if pid == 0:  # the child publishes set 2 and is killed just before its `step`-th rename or removal in out
            status = 3
            try:
                torch.set_num_threads(1)  # (the parent's OpenMP threads do not exist in a forked child)
                stop_at(out, lambda count, path: count == step, signal.SIGKILL)
                _publish(trainer, processors, generation=2)
                status = 0
            finally:
                os._exit(status)
        status = wait_for_child(pid, 120, "the publishing child")
        if os.WIFEXITED(status):
            assert os.WEXITSTATUS(status) == 0
            break  # `step` is past the last step: the publication ran to its end
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        # What the next start of either script does first, then a reader.
        run_directory.finish_publication(str(out))
        run_directory.remove_leftovers(str(out))
        outcomes.append(_published_generation(out))
        assert run_directory.foreign_entries(str(out)) == []
        assert not [n for n in os.listdir(out) if n.startswith((".staging", ".publishing")) or ".partial-" in n]
        shutil.rmtree(out)
        shutil.copytree(pristine, out)
    # Killed before the commit point (the rename onto .publishing): the old set; from it on: the new set, whatever
    # rename or removal it was killed at.
    assert len(outcomes) >= 12, outcomes
    commit = outcomes.index(2)
    assert outcomes == [1] * commit + [2] * (len(outcomes) - commit) and commit >= 1, outcomes
    assert _published_generation(out) == 2  # the publication that was not killed


def test_a_process_that_does_not_save_touches_nothing_not_even_the_saving_processs_publication(tmp_path, monkeypatch):
    # Under torchrun every rank enters the same publication blocks; only the one that saves (should_save) may write.
    out = tmp_path / "out"
    with run_directory.publication(str(out), publish=False) as staging:
        assert not os.path.exists(staging)
    assert not out.exists()

    # The saving rank has committed a set (renamed to .publishing/) and is moving its files into place ...
    with run_directory.publication(str(out)) as staging:
        with open(os.path.join(staging, "metrics.json"), "w") as f:
            f.write("{}")
    monkeypatch.setattr(run_directory, "finish_publication", lambda output_dir: None)
    with run_directory.publication(str(out)) as staging:
        with open(os.path.join(staging, "metrics.json"), "w") as f:
            f.write('{"second": true}')
    monkeypatch.undo()
    before = sorted(os.listdir(out))
    assert run_directory.PUBLISHING_NAME in before
    # ... while another rank passes through the same block: it neither finishes nor disturbs that move.
    with run_directory.publication(str(out), publish=False):
        pass
    assert sorted(os.listdir(out)) == before and read_json(out / "metrics.json") == {}
    run_directory.finish_publication(str(out))  # (what the saving rank does next)
    assert read_json(out / "metrics.json") == {"second": True}


# The scripts: a kill or signal during the final save, then rerunning the same command ------------------------


def script_command(kind, fixtures, out):
    flags = base_args(fixtures, out, max_steps=2, save_strategy="no", image_pipeline="fast")
    return [*flags, "--do_train", "--do_eval", *CPU_FLAGS[kind]]


def assert_rerun_only_evaluates(kind, args, out):
    pending = out / run_directory.PUBLISHING_NAME  # committed, not yet moved into place
    weights = load_weights(pending if (pending / "model.safetensors").exists() else out)
    rerun = run_script(kind, args)
    assert "'loss'" not in rerun.stdout, "the finished training was done again"
    assert "not training again" in rerun.stdout + rerun.stderr
    assert "eval_loss" in read_json(out / "validation_results.json")
    assert "train_loss" in read_json(out / "all_results.json")
    again = load_weights(out)
    assert all(torch.equal(weights[k], again[k]) for k in weights)


@BOTH_ROUTES
@pytest.mark.parametrize("at", [run_directory.PUBLISHING_NAME, "model.safetensors"])
def test_cuda_script_killed_during_the_final_save_reruns_to_a_finished_run(at, fixtures, tmp_path):
    """Killed at the rename onto .publishing: before the commit point (the staged set is discarded; with
    --save_strategy no the rerun trains again). At the move of model.safetensors into place: after it, some files
    moved (the rerun finishes the publication, then only evaluates)."""
    out = tmp_path / "out"
    args = script_command("cuda", fixtures, out)
    killed = run_stopped_at("cuda", args, "SIGKILL", at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    if at == run_directory.PUBLISHING_NAME:
        rerun = run_script("cuda", args)
        assert "'loss'" in rerun.stdout and read_json(out / "trainer_state.json")["global_step"] == 2
        assert "eval_loss" in read_json(out / "validation_results.json")
    else:
        assert_rerun_only_evaluates("cuda", args, out)
    assert not [n for n in os.listdir(out) if n.startswith((".staging", ".publishing"))]


def test_gaudi_script_signals_after_training_lose_nothing_and_reruns_complete_the_phases_left(fixtures, tmp_path):
    out = tmp_path / "out"
    args = script_command("gaudi", fixtures, out)
    # SIGTERM in the middle of the final save (the weights staged, the set not yet committed), --save_strategy no.
    stopped = run_stopped_at("gaudi", args, "SIGTERM", run_directory.PUBLISHING_NAME)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"Stopped by SIGTERM after saving completely what the run had done so far in {out}. Rerun the same command "
        "(without --overwrite_output_dir) to do the phases that are left."
    )
    assert read_json(out / "trainer_state.json")["global_step"] == 2 and not (out / "validation_results.json").exists()

    # SIGTERM during the final evaluation (or, if it is already over, while its results are saved).
    run = ForkedRun("gaudi", args, tmp_path, merged=True)
    for line in run.lines():
        if "Running Evaluation" in line:
            run.send_signal(signal.SIGTERM)
            break
    assert run.wait().returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)

    assert_rerun_only_evaluates("gaudi", args, out)


# A final name that is not a file; a final file gone ------------------------------------------------------------


def tree(out) -> dict:
    """Every entry under out: a regular file's bytes, anything else its kind (nothing is opened but regular files)."""
    entries = {}
    for root, directories, names in os.walk(out):
        for name in directories + names:
            path = Path(root, name)
            mode = path.lstat().st_mode
            entries[str(path.relative_to(out))] = path.read_bytes() if stat.S_ISREG(mode) else stat.S_IFMT(mode)
    return entries


def not_a_file(kind: str):
    """What puts a `kind` at a path: a directory holding a file, or a FIFO."""

    def directory(path):
        path.mkdir()
        (path / "notes.txt").write_text("mine")

    return {"directory": directory, "FIFO": os.mkfifo}[kind]


def refused_at(out, name, kind):
    return (
        f"--output_dir={out}: {name} is not a regular file: {kind}, where the run publishes a file; it never replaces "
        "one: move it away and rerun the same command"
    )


def test_a_publication_onto_a_name_that_is_not_a_file_is_refused_before_its_commit_point_or_waits_whole(tmp_path):
    out = tmp_path / "out"
    with run_directory.publication(str(out)) as staging:
        Path(staging, "a_results.json").write_text("1")
    cases = [
        ("b_results.json", not_a_file("FIFO"), "b_results.json is not a regular file: FIFO"),
        ("b_results.json", not_a_file("directory"), "b_results.json is not a regular file: directory"),
        ("sub", Path.touch, "sub/c.json is under a file, not in a directory"),
    ]
    for name, make, said in cases:
        make(out / name)
        before = tree(out)
        with pytest.raises(UserInputError) as refused:
            with run_directory.publication(str(out)) as staging:
                for published in ("a_results.json", "b_results.json", "sub/c.json"):
                    Path(staging, published).parent.mkdir(exist_ok=True)
                    Path(staging, published).write_text("2")
        assert str(refused.value).startswith(f"--output_dir={out}: {said}, where the run publishes a file")
        assert tree(out) == before, "something was replaced, or the staged set outlived the refusal"
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()

    # A set committed (.publishing), its move into place killed; a directory at one of its names meanwhile: refused,
    # nothing moved, the set waits whole until the directory is moved away.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_directory, "finish_publication", lambda output_dir: None)
        with run_directory.publication(str(out)) as staging:
            Path(staging, "a_results.json").write_text("3")
            Path(staging, "b_results.json").write_text("3")
    not_a_file("directory")(out / "b_results.json")
    before = tree(out)
    for check in (run_directory.check_output_dir, run_directory.finish_publication):  # step 3, then claim
        with pytest.raises(UserInputError, match=re.escape(refused_at(out, "b_results.json", "directory"))):
            check(str(out))
        assert tree(out) == before
    shutil.rmtree(out / "b_results.json")
    run_directory.finish_publication(str(out))
    assert [(out / n).read_text() for n in ("a_results.json", "b_results.json")] == ["3", "3"]
    assert run_directory.PUBLISHING_NAME not in os.listdir(out)


@pytest.mark.parametrize("kind", [pytest.param("cuda", marks=BOTH_ROUTES), "gaudi"])
def test_a_finished_run_refuses_what_is_not_a_file_at_its_names_and_publishes_its_lost_files_again(
    kind, fixtures, tmp_path
):
    """The same command again over a finished run: once, with a directory at model.safetensors, a traceback in the
    middle of its publication (config.json and three more replaced, .publishing left), and a deleted
    train_results.json went unnoticed."""
    out = tmp_path / "out"
    args = command(fixtures, out, kind, "--do_eval")
    run_script(kind, args)  # checkpoint-2 and the published set
    published = tree(out)
    for name, what in (("model.safetensors", "directory"), ("config.json", "FIFO"), ("all_results.json", "FIFO")):
        (out / name).unlink()
        not_a_file(what)(out / name)
        before = tree(out)
        rerun = run_script(kind, args, check=False)
        assert rerun.returncode == 2 and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
        assert last_line(rerun) == f"{SCRIPTS[kind]}: error: {refused_at(out, name, what)}"
        assert tree(out) == before, f"{name}: something changed"
        shutil.rmtree(out / name) if what == "directory" else (out / name).unlink()
        (out / name).write_bytes(published[name])

    # train_results.json gone: the model's set published again from the checkpoint of its last step
    (out / "train_results.json").unlink()
    rerun = run_script(kind, args)
    log = rerun.stdout + rerun.stderr
    assert "its trained model is not as it was published (train_results.json is missing)" in log, log[-3000:]
    assert "'loss'" not in rerun.stdout, "trained again"
    train_results = read_json(out / "train_results.json")
    trained = json.loads(published["train_results.json"])
    assert train_results["published_from"] == "checkpoint-2"
    assert train_results["train_loss"] == pytest.approx(trained["train_loss"], rel=1e-9)
    assert (out / "model.safetensors").read_bytes() == published["model.safetensors"]

    # the evaluation's results gone: published again by the rerun's evaluation, all_results.json gathered again
    (out / "validation_results.json").unlink()
    (out / "all_results.json").unlink()
    rerun = run_script(kind, args)
    assert "trained as far as asked: not training again" in rerun.stdout + rerun.stderr
    combined = read_json(out / "all_results.json")
    assert combined == {**train_results, **read_json(out / "validation_results.json")}
    assert "eval_loss" in combined and combined["published_from"] == "checkpoint-2"
    assert not [n for n in os.listdir(out) if n.startswith((".staging", ".publishing")) or ".partial-" in n]

"""Both scripts, end to end on CPU: the tiny model on the synthetic New Yorker-shaped data set.

The Gaudi script runs optimum-habana's real GaudiTrainer behind the Habana stand-ins (bridgetower_bench/tools/habana_standin).
"""

import contextlib
import io
import json
import math
import re
import shutil
import sys

import pytest
import torch

import helpers
from bridgetower_bench.tools.fixtures import script_arguments
from helpers import (
    BOTH_ROUTES,
    CPU_FLAGS,
    REPO,
    SCRIPTS,
    assert_throughput_adds_up,
    base_args,
    command,
    load_weights,
    read_json,
    resumed_at,
    run_killed_while_publishing,
    run_script,
    run_tool,
    script_module,
)


KINDS = ["gaudi", pytest.param("cuda", marks=BOTH_ROUTES)]


@pytest.mark.parametrize("kind", KINDS)
def test_train_eval_predict_save_and_resume(kind, fixtures, tmp_path):
    out = tmp_path / "run"
    # First run: 4 steps, a checkpoint every 2, killed as it publishes its model, and its checkpoint-4 lost (as if
    # killed during step 4). The rerun of the same recipe, without --overwrite_output_dir, must resume from
    # checkpoint-2 and finish at step 4.
    run_killed_while_publishing(kind, base_args(fixtures, out, max_steps=4) + ["--do_train"] + CPU_FLAGS[kind])
    assert (out / "checkpoint-2").is_dir() and not (out / "model.safetensors").exists()
    shutil.rmtree(out / "checkpoint-4")
    result = run_script(
        kind, base_args(fixtures, out, max_steps=4) + ["--do_train", "--do_eval", "--do_predict"] + CPU_FLAGS[kind]
    )
    log = result.stdout + result.stderr
    assert "resuming training at" in log and resumed_at(log, 2)
    state = read_json(out / "trainer_state.json")
    assert state["global_step"] == 4
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4], "each step trained exactly once"

    train = read_json(out / "train_results.json")
    assert train["loader"] == "torch" and train["image_pipeline"] == "upstream"
    assert train["attn_implementation"] == "eager" and train["compile_layers"] == "no"
    assert train["world_size"] == 1 and train["per_device_train_batch_size"] == 4
    assert_throughput_adds_up(train, counted_steps=1, samples_per_step=4)  # steps 3-4 trained here, step 3 warm-up
    # The environment the run names: the CPU, no Habana execution mode, no driver read, the host's memory.
    assert (train["backend"], train["execution_mode"], train["torch_compile"]) == ("cpu", "n/a", False)
    assert train["version_torch"] == torch.__version__ and train["version_cuda"] == torch.version.cuda
    assert train["version_intel_gaudi"] is None and train["driver_version"] is None
    assert train["device_name"].startswith("CPU ") and train["device_count"] == 1
    assert train["device_memory_bytes"] > 2**30
    assert re.search(r"^  driver_version +=  *n/a$", result.stdout, re.M), "printed as n/a, saved as null"
    assert not (out / "eval_results.json").exists()  # upstream's name for the validation metrics instead:
    for split, file in (("eval", "validation_results.json"), ("test", "test_results.json")):
        metrics = read_json(out / file)
        assert math.isfinite(metrics[f"{split}_loss"])
        for key in ("i2t_recall@1", "t2i_recall@1", "i2t_recall@10", "t2i_mean_rank"):
            assert f"{split}_{key}" in metrics

    # Weights changed, and everything needed to reload the fine-tuned model was saved.
    before, after = load_weights(fixtures["model"]), load_weights(out)
    changed = [k for k in after if k in before and not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    from transformers import AutoImageProcessor, AutoTokenizer, BridgeTowerForContrastiveLearning

    BridgeTowerForContrastiveLearning.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    AutoImageProcessor.from_pretrained(out)


@pytest.mark.parametrize("kind", KINDS)
def test_json_configuration_file(kind, fixtures, tmp_path):
    out = tmp_path / "run"
    config = dict(script_arguments(fixtures), output_dir=str(out), do_eval=True, report_to="none", use_cpu=True)
    config.update(per_device_eval_batch_size=4, max_eval_samples=8)
    if kind == "gaudi":
        config["use_lazy_mode"] = False
    path = tmp_path / "args.json"
    path.write_text(json.dumps(config))
    run_script(kind, [path])
    assert math.isfinite(read_json(out / "validation_results.json")["eval_loss"])


@pytest.mark.parametrize("kind", KINDS)
def test_help_lists_every_upstream_argument_with_its_default(kind):
    text = run_script(kind, ["--help"]).stdout
    # The option descriptions (not the usage summary), whitespace collapsed, for reading each '(default: ...)'.
    text = " ".join(text[text.index("options:") :].split())
    upstream = read_json(REPO / "tests" / "upstream_arguments.json")
    for group in ("model", "data"):
        for name, default in upstream[group].items():
            match = re.search(rf"--{name}[ \]].*?\(default: ([^)]*)\)", text)
            assert match, f"--{name} missing from {kind} --help"
            if default != "required":
                shown = {None: "None", True: "True", False: "False"}.get(default, str(default))
                assert match.group(1) == shown, f"--{name}: default {match.group(1)!r}, upstream {shown!r}"


GAUDI_ONLY = "--use_habana --use_lazy_mode --use_hpu_graphs_for_inference --gaudi_config_name Habana/clip".split()
GAUDI_ONLY += "--distribution_strategy fast_ddp --sdp_on_bf16 --mediapipe_dataloader".split()
ALL_NAMED = ", ".join(sorted(word for word in GAUDI_ONLY if word.startswith("--")))


@BOTH_ROUTES
@pytest.mark.parametrize(
    "flags, line",
    [  # every Gaudi-only flag named in one error; the parser's own error (one script: both use HfArgumentParser)
        (
            GAUDI_ONLY,
            f"{ALL_NAMED} are Gaudi-only (Habana HPU) and not supported by run_bridgetower_cuda.py; "
            "remove them, or run run_bridgetower.py on a Gaudi machine.",
        ),
        (
            ["--image_pipeline", "nope", *CPU_FLAGS["cuda"]],
            "argument --image_pipeline/--image-pipeline: invalid choice: 'nope' "
            "(choose from 'upstream', 'fast', 'fast-draft')",
        ),
    ],
    ids=["gaudi-only flags", "parser refusal"],
)
def test_a_refused_flag_ends_the_run_in_one_line_with_status_2(flags, line, fixtures, tmp_path):
    """One error line, exit status 2, no traceback, nothing written. (In this process: the refusal's process of its
    own is test_cuda_device's.)"""
    result = run_script("cuda", base_args(fixtures, tmp_path / "o") + ["--do_train", *flags], check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [l for l in result.stderr.splitlines() if ": error: " in l]
    assert errors == [f"{SCRIPTS['cuda']}: error: {line}"] == result.stderr.strip().splitlines()[-1:], result.stderr
    assert not (tmp_path / "o").exists()


def test_gaudi_script_takes_upstreams_ci_flags_and_records_a_mediapipe_request_on_cpu_as_the_torch_loader(
    fixtures, tmp_path
):
    """Upstream's CI runs this example with --sdp_on_bf16 and --trust_remote_code True (and a pinned revision);
    --mediapipe_dataloader cannot run on a CPU: one warning, and the loader that ran is recorded."""
    out = tmp_path / "run"
    result = run_script(
        "gaudi",
        base_args(fixtures, out, max_steps=1, save_steps=None, save_strategy="no", trust_remote_code=True)
        + ["--do_train", "--sdp_on_bf16", "--mediapipe_dataloader"]
        + CPU_FLAGS["gaudi"],
    )
    train = read_json(out / "train_results.json")
    assert math.isfinite(train["train_loss"])
    warnings = [l for l in (result.stdout + result.stderr).splitlines() if "media pipeline cannot run here" in l]
    assert len(warnings) == 1
    assert train["loader"].startswith("torch (media pipeline unavailable: ")


def test_cuda_script_mentions_no_habana_or_gaudi_symbol():
    """No import, name, attribute, argument or definition in the CUDA script refers to Habana or Gaudi."""
    import ast

    tree = ast.parse((REPO / "run_bridgetower_cuda.py").read_text())
    # Name.id, Attribute.attr, keyword / parameter .arg, definition / imported alias .name, ImportFrom.module
    fields = ("id", "attr", "arg", "name", "module")
    symbols = {getattr(node, field, None) for node in ast.walk(tree) for field in fields} - {None}
    # (our own guard that refuses Gaudi-only flags is named for what it does, not for Gaudi)
    assert sorted(s for s in symbols if re.search("habana|gaudi|hpu", s, re.I)) == []


def test_patch_check_passes():
    result = run_tool("make_cuda_script", ["--check"], process=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_loader_workers_forked_after_tokenizing_print_no_tokenizers_warning(fixtures, tmp_path):
    """Captions tokenized with tokenizers' threads, then the loader workers fork: tokenizers' warning (per worker)
    is nothing a user can act on. A fresh data-set cache, so that the captions are really tokenized here."""
    kind = "cuda"
    args = base_args(fixtures, tmp_path / "o", max_steps=2, dataloader_num_workers=2) + ["--do_train"]
    env = {"HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": None}
    result = run_script(kind, args + CPU_FLAGS[kind], process=True, env=env)
    assert "Running tokenizer on train dataset" in result.stderr, "the captions were not tokenized in this run"
    assert "huggingface/tokenizers" not in result.stdout + result.stderr


# A library logger's line: what GaudiTrainingArguments logs through optimum's logger on one process (--log_level info)
OPTIMUM_LINE = "average_tokens_across_devices is True but world size is 1"


@contextlib.contextmanager
def library_logging_unmade():
    """The libraries' own once-per-process logging handlers (helpers._library_logging_modules) not made yet for the
    block, as in a process where none of them has logged; put back afterwards."""
    saved = []
    for module in helpers._library_logging_modules():
        logger = module._get_library_root_logger()
        handler = vars(module)["_default_handler"]
        saved.append((module, handler, logger, logger.level, list(logger.handlers), logger.propagate))
        logger.removeHandler(handler)
        module._default_handler = None
    try:
        yield
    finally:
        for module, handler, logger, level, handlers, propagate in saved:
            module._default_handler = handler
            logger.setLevel(level)
            logger.handlers, logger.propagate = handlers, propagate


@pytest.mark.parametrize("kind", KINDS)
def test_a_library_logger_one_run_configured_logs_to_the_next_runs_output(kind, fixtures, tmp_path):
    """Two runs in this process: the libraries' logging (transformers', optimum's for Gaudi) is configured during
    the first, whose streams are then closed (as a forked run's files, or a test's capture); the second logs through
    those loggers to its own output, with no `Logging error` (a handler left on the first run's closed stream)."""
    script_module(kind)
    args = command(fixtures, tmp_path / "first", kind, max_steps=1, log_level="info")
    with library_logging_unmade():
        first = (io.StringIO(), io.StringIO())
        argv = [sys.executable, str(REPO / SCRIPTS[kind]), *map(str, args)]
        assert helpers._in_process(kind, argv, {}, streams=first).returncode == 0, first[1].getvalue()[-3000:]
        assert "loading configuration file" in first[1].getvalue()  # transformers' logger, configured in the run
        for stream in first:
            stream.close()
        second = run_script(kind, command(fixtures, tmp_path / "second", kind, max_steps=1, log_level="info"))
    assert "Logging error" not in second.stdout + second.stderr, second.stderr[-3000:]
    assert "loading configuration file" in second.stderr
    if kind == "gaudi":
        assert OPTIMUM_LINE in second.stderr


def test_a_library_handler_made_on_a_capture_closed_since_writes_to_the_runs_output(fixtures, tmp_path):
    """The libraries' handlers made while `sys.stderr` was a test's capture (`capsys`), closed since (as the Gaudi
    script's first import under `capsys` left optimum's): a later run logs through them to its own output, with no
    `Logging error` (the handlers' `flush`, bound to the closed capture's)."""
    script_module("gaudi")
    with library_logging_unmade():
        capture = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # (as `capsys`'s: once closed, no flush either)
        with contextlib.redirect_stderr(capture):
            for module in helpers._library_logging_modules():
                module.get_logger()  # (a library's first logger makes its handler, on the stderr of the moment)
        capture.close()
        result = run_script("gaudi", command(fixtures, tmp_path / "out", "gaudi", max_steps=1, log_level="info"))
    assert "Logging error" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert OPTIMUM_LINE in result.stderr

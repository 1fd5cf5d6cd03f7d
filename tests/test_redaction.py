"""Shareable records carry no credentials: the rule for names, each form a credential takes, and a real
sweep and a real run whose files are searched for fake tokens the runs provably received."""

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from bridgetower_bench import redaction
from bridgetower_bench.tools import bench
from bridgetower_bench.tools.fixtures import script_arguments
from bridgetower_bench.tools.sweep import commands as sweep_commands
from bridgetower_bench.tools.sweep import presets as sweep_presets
from helpers import REPO, run_script


# --------------------------------------------------------------------------------------------- the rule


CREDENTIAL_NAMES = (
    "--token --hub_token --push_to_hub_token --use_auth_token token api_key hf_api_key wandb_api_key --db_password "
    "--client-secret HF_TOKEN HUGGING_FACE_HUB_TOKEN WANDB_API_KEY AWS_SECRET_ACCESS_KEY --Hub-Token openai_apikey"
).split()
ORDINARY_NAMES = (
    "--tokenizer_name --max_tokens_per_batch --max_seq_length --pad_to_max_length --use_fast_tokenizer "
    "--include_tokens_per_second --keyboard HF_HOME --output_dir"
).split()


@pytest.mark.parametrize("name, secret", [(n, True) for n in CREDENTIAL_NAMES] + [(n, False) for n in ORDINARY_NAMES])
def test_credential_names_are_recognised_and_ordinary_flags_left_alone(name, secret):
    assert redaction.is_secret_name(name) is secret


def test_both_flag_forms_are_redacted_and_the_list_is_otherwise_unchanged():
    args = (
        "--token hf_A --hub_token=hf_B --use_auth_token --do_train --tokenizer_name tok --push_to_hub_token hf_C "
        "--max_seq_length 32 --client_secret="
    ).split()
    shown = (
        "--token REDACTED --hub_token=REDACTED --use_auth_token --do_train --tokenizer_name tok "
        "--push_to_hub_token REDACTED --max_seq_length 32 --client_secret=REDACTED"
    ).split()
    assert redaction.redact_args(args) == shown
    assert args[1] == "hf_A", "the caller's list (what the run gets) is not modified"
    assert redaction.secret_values(args) == {"hf_A", "hf_B", "hf_C"}


@pytest.mark.parametrize(
    "text, shown",
    [
        ("--token hf_abcdef --seed 'x", "--token REDACTED --seed 'x"),  # an unclosed quote: shlex cannot split it
        ("--seed 1 --hub_token='hf abc' --x", "--seed 1 --hub_token=REDACTED --x"),
        ('--token "hf_abc def', "--token REDACTED"),  # the open quote runs to the end
        (
            "--password=p@ss --tokenizer_name tok --max_seq_length 40",
            "--password=REDACTED --tokenizer_name tok --max_seq_length 40",
        ),
        ("--use_auth_token --seed 3", "--use_auth_token --seed 3"),
        # a credential inside stray quotes
        ("'--hub_token hf_abcdef", "'--hub_token REDACTED"),  # the flag inside a quote left open
        ('"--hub_token" hf_abcdef \'', '"--hub_token" REDACTED \''),  # the flag quoted, a stray quote after
        ('--hub_token ""hf_abcdef "', '--hub_token REDACTED "'),  # quoted and unquoted parts of one word
        ("--hub_token 'hf'_abc\"def", "--hub_token REDACTED"),
        ('"--hub_token"=hf_abcdef \'', '"--hub_token"=REDACTED \''),
        ("x '--seed 1 --hub_token=hf_abcdef", "x '--seed 1 --hub_token=REDACTED"),
        ('"--hub_token hf_abcdef" --seed 1', '"--hub_token REDACTED" --seed 1'),
    ],
)
def test_a_command_line_as_typed_is_redacted_quotes_and_all_even_stray_ones(text, shown):
    assert redaction.redact_text(text) == shown


def test_a_sweep_refusing_extra_args_it_cannot_split_does_not_print_their_token():
    """The refusal once echoed the text whole, token included, when its quotes did not close."""
    with pytest.raises(ValueError) as refused:
        sweep_presets.parse_extra_args("--token 'hf_abcdef --seed 1")
    assert str(refused.value) == "--extra-args '--token REDACTED': No closing quotation"


def test_a_json_configuration_is_copied_redacted_and_left_untouched():
    config = {"token": "hf_A", "model_name_or_path": "m", "nested": [{"wandb_api_key": "k123"}], "hub_token": None}
    before = json.dumps(config)
    expected = {**config, "token": "REDACTED", "nested": [{"wandb_api_key": "REDACTED"}]}  # hub_token None stays
    assert redaction.shareable(config, env={}) == expected
    assert json.dumps(config) == before
    assert redaction.secret_values(configs=[config]) == {"hf_A", "k123"}


def test_the_values_of_credential_environment_variables_are_scrubbed_and_no_others():
    env = dict(HF_TOKEN="hf_A", HUGGING_FACE_HUB_TOKEN="hf_B", WANDB_API_KEY="k123", HF_HOME="/home/h", PATH="/bin")
    assert redaction.secret_values(env=env) == {"hf_A", "hf_B", "k123"}
    assert redaction.shareable({"log": "saw hf_A, hf_B and k123 under /home/h"}, env=env) == {
        "log": "saw REDACTED, REDACTED and REDACTED under /home/h"
    }


def test_a_tool_record_is_made_shareable_in_one_call(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fromEnv1")
    record = {
        "command": ["python", "x.py", "--hub_token", "hf_B", "--api-key=k9999"],
        "env": {"HF_TOKEN": "hf_fromEnv1", "HABANA_VISIBLE_DEVICES": "all"},
        "message": "login with hf_fromEnv1 failed; --hub_token hf_B",
        "steps": [1, 2],
    }

    assert redaction.shareable(record, args=["--token", "hf_Arg12"]) == {
        "command": ["python", "x.py", "--hub_token", "REDACTED", "--api-key=REDACTED"],
        "env": {"HF_TOKEN": "REDACTED", "HABANA_VISIBLE_DEVICES": "all"},
        "message": "login with REDACTED failed; --hub_token REDACTED",
        "steps": [1, 2],
    }
    assert record["command"][3] == "hf_B", "the record itself is not modified"


def test_saved_training_arguments_lose_their_token_and_the_live_ones_keep_it(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), hub_token="hf_live", report_to="none")
    saved = redaction.without_secrets(args)
    assert saved.hub_token is None and args.hub_token == "hf_live" and saved.output_dir == args.output_dir
    assert redaction.without_secrets(saved) is saved, "nothing to blank: the same object"


# --------------------------------------------------------------------------------------------- real runs

# Stands in for the training script: records digests of what the process received (its arguments, its
# HF_TOKEN, and the credential fields the script's argument parser produced) in a file outside the
# sweep's output directory, then runs the real script in this process.
RECEIVER = """
import dataclasses, hashlib, json, os, runpy, sys
from transformers import HfArgumentParser

PROOF, REAL = {proof!r}, {real!r}
digest = lambda value: hashlib.sha256(str(value).encode()).hexdigest()
seen = {{"argv": [digest(a) for a in sys.argv[1:]], "HF_TOKEN": digest(os.environ.get("HF_TOKEN"))}}

def recording(parse):
    def parse_and_record(self, *args, **kwargs):
        parsed = parse(self, *args, **kwargs)
        for group in parsed:
            if dataclasses.is_dataclass(group):
                for name in ("token", "hub_token"):
                    if getattr(group, name, None):
                        seen[name] = digest(getattr(group, name))
        with open(PROOF, "w") as f:
            json.dump(seen, f)
        return parsed
    return parse_and_record

HfArgumentParser.parse_args_into_dataclasses = recording(HfArgumentParser.parse_args_into_dataclasses)
HfArgumentParser.parse_dict = recording(HfArgumentParser.parse_dict)
sys.argv[0] = REAL
runpy.run_path(REAL, run_name="__main__")
"""


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _files_containing(root: Path, secrets) -> list[str]:
    """Every file under `root` (and every member of a zip file, such as torch.save's) holding one of `secrets`."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        blobs = [(str(path.relative_to(root)), path.read_bytes())]
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                blobs += [(f"{path.relative_to(root)}:{name}", archive.read(name)) for name in archive.namelist()]
        found += [f"{name} holds {secret}" for name, blob in blobs for secret in secrets if secret.encode() in blob]
    return found


def test_a_sweep_writes_no_credential_while_the_run_receives_every_one(fixtures, tmp_path, monkeypatch):
    overridden, on_command_line = "hf_FAKEspaceForm0001", "hf_FAKEequalsForm0002"
    hub, in_env = "hf_FAKEhubToken0003", "hf_FAKEenvToken0004"
    proof = tmp_path / "received.json"
    receiver = tmp_path / "receiver.py"
    receiver.write_text(RECEIVER.format(proof=str(proof), real=str(bench.SCRIPTS["cuda"])))
    monkeypatch.setitem(bench.SCRIPTS, "cuda", receiver)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HF_TOKEN", in_env)
    out = tmp_path / "bench"

    # --token given twice (argparse keeps the last): both forms are on the command line the records show.
    extra = (
        f"--max_steps 2 --throughput_warmup_steps 1 --per_device_train_batch_size 2 --logging_steps 1 "
        f"--token {overridden} --token={on_command_line} --hub_token {hub}"
    )
    sweep = ["--workers", "0", "--image-pipelines", "upstream", "--devices", "0"]  # one run carries every case
    code = bench.main([*sweep, "--keep-weights", "--extra-args", extra, "--out", str(out)])

    results = json.loads((out / "results.json").read_text())
    row = results["runs"][0]
    assert code == 0 and row["status"] == "ok", row.get("error")
    received = json.loads(proof.read_text())
    assert _digest(overridden) in received["argv"] and _digest(f"--token={on_command_line}") in received["argv"]
    assert received["token"] == _digest(on_command_line), "the script parsed the real --token"
    assert received["hub_token"] == _digest(hub), "the script parsed the real --hub_token"
    assert received["HF_TOKEN"] == _digest(in_env), "the run's environment kept HF_TOKEN"

    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    run = f"runs/{row['run_id']}"
    assert {"results.json", "results.csv", "table.md", f"logs/{row['run_id']}.log"} <= written
    assert {f"{run}/train_results.json", f"{run}/training_args.bin"} <= written
    assert _files_containing(out, [overridden, on_command_line, hub, in_env]) == []
    assert "--token REDACTED --token=REDACTED --hub_token REDACTED" in row["command"]
    assert "REDACTED" in " ".join(results["bench"]["extra_args"])

    # Paths are named relative to the sweep's output directory (or the repository), never absolute.
    assert (row["log"], row["output_dir"]) == (f"logs/{row['run_id']}.log", f"runs/{row['run_id']}")
    assert (out / row["log"]).is_file() and (out / row["output_dir"] / "train_results.json").is_file()
    for name in ("results.json", "results.csv", "table.md", row["log"]):
        header = (out / name).read_text().split("\n\n", 1)[0] if name == row["log"] else (out / name).read_text()
        assert str(out) not in header and str(REPO) not in header, name
    assert f"--output_dir $OUT/runs/{row['run_id']} " in row["command"] and row["command"].startswith("python ")


# A run that prints what it received, then fails naming it: the worst case for the log and the error column.
ECHOING_SCRIPT = """
import os, sys
token = sys.argv[sys.argv.index("--token") + 1]
print("arguments:", sys.argv[1:], "HF_TOKEN:", os.environ.get("HF_TOKEN"), flush=True)
received = token == {token!r} and os.environ.get("HF_TOKEN") == {env!r}
raise SystemExit(f"ValueError: invalid token {{token}}" if received else 9)
"""


def test_what_a_run_prints_reaches_the_log_and_the_results_redacted(tmp_path, monkeypatch):
    token, in_env = "hf_FAKEprinted0007", "hf_FAKEprintedEnv0008"
    script = tmp_path / "echo.py"
    script.write_text(ECHOING_SCRIPT.format(token=token, env=in_env))
    monkeypatch.setenv("HF_TOKEN", in_env)
    variants = sweep_commands.expand_matrix([0], ["torch"], ["upstream"], repeats=1)
    local = dict(preset="local", script="cuda", device="cpu", nproc=1, base_args=[])
    plan = bench.Plan(**local, variants=variants, extra_args=["--token", token], script_path=script)
    out = tmp_path / "out"

    rows, _ = bench.run_sweep(plan, out, echo=lambda line: None)

    assert rows[0]["returncode"] == 1, "the run received the real --token and HF_TOKEN (9: it did not)"
    assert rows[0]["error"] == "ValueError: invalid token REDACTED"
    log = (out / rows[0]["log"]).read_text()
    assert "arguments:" in log and "HF_TOKEN: REDACTED" in log
    bench.render_all(out, rows, {"preset": "local", "model": "echo"})
    assert "invalid token REDACTED" in (out / "table.md").read_text()
    assert _files_containing(out, [token, in_env]) == []


def test_a_json_configuration_run_saves_no_credential_while_the_script_parses_it(fixtures, tmp_path, monkeypatch):
    token, hub = "hf_FAKEjsonToken0005", "hf_FAKEjsonHub0006"
    output_dir = tmp_path / "run"
    config = tmp_path / "args.json"
    values = dict(script_arguments(fixtures), do_train=True, max_steps=2, per_device_train_batch_size=2)
    values.update(remove_unused_columns=False, max_seq_length=32, save_strategy="no", report_to="none")
    values.update(use_cpu=True, use_lazy_mode=False, output_dir=str(output_dir), token=token, hub_token=hub)
    config.write_text(json.dumps(values))
    before = config.read_bytes()
    parsed = {}  # the credential fields the script's argument parser produced

    def recording(parse):
        def parse_and_record(self, *args, **kwargs):
            groups = parse(self, *args, **kwargs)
            for group in filter(dataclasses.is_dataclass, groups):
                given = {name: getattr(group, name, None) for name in ("token", "hub_token")}
                parsed.update({name: value for name, value in given.items() if value})
            return groups

        return parse_and_record

    for name in ("parse_args_into_dataclasses", "parse_dict"):
        monkeypatch.setattr(HfArgumentParser, name, recording(getattr(HfArgumentParser, name)))
    result = run_script("gaudi", [config], check=False)  # the Gaudi script, on CPU

    assert result.returncode == 0, result.stderr[-3000:]
    assert parsed == {"token": token, "hub_token": hub}
    assert (output_dir / "training_args.bin").is_file() and (output_dir / "train_results.json").is_file()
    assert token not in result.stdout + result.stderr and hub not in result.stdout + result.stderr, "nor in its output"
    assert _files_containing(output_dir, [token, hub]) == []
    assert config.read_bytes() == before, "the user's configuration file is never modified"


@pytest.mark.parametrize(
    "argv",
    [
        ["--extra-args", "'--hub_token hf_abcdef --seed 1"],  # shlex cannot split it: the text is echoed
        ["--extra-args", "--seed 1", "--hub_token", "hf_abcdef"],  # argparse's own refusal echoes the arguments
        ["--extra-args", "--seed 1", "--hub_token='hf_abcdef"],
    ],
)
def test_no_sweep_refusal_prints_a_credential(argv, capsys):
    with pytest.raises(SystemExit) as refused:
        bench.main(["--dry-run", *argv])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "hf_abcdef" not in err and "REDACTED" in err

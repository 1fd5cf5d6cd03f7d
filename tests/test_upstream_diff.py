"""The upstream diff tool, offline: on a small upstream-like file the test writes, and with a fake fetch."""

import hashlib
import io
import re

import pytest

from bridgetower_bench.tools import upstream_diff


UPSTREAM_LIKE = """\
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "model"})
    token: str = field(default=None, metadata={"help": "a token"})
    freeze_text_pooler: bool = field(default=False)
    only_upstream: int = 3


def main():
    # 1. Parse input arguments
    send_example_telemetry("run_bridgetower", model_args, data_args)
    # 2. Setup logging
    pass
    # 4. Load dataset
    text = item["bytes"].decode("ISO-8859-1")
    # 11. Write Training Stats and push to hub.
    pass
    # 13. Something new
    pass
"""


@pytest.fixture
def upstream_file(tmp_path):
    path = tmp_path / "run_bridgetower.py"
    path.write_text(UPSTREAM_LIKE)
    return path


def _steps(text: str) -> list[tuple[str, str]]:
    """(upstream step, our step) pairs of a step section, wrapped lines joined."""
    pairs, label = [], None
    for line in text.splitlines():
        match = re.match(r"^ *(upstream|ours|calls)  (.*)$", line)
        if match:
            label = match.group(1)
            pairs += [["", ""]] if label == "upstream" else []
        if label != "calls" and (match or line.startswith(" " * 10)):
            pairs[-1][label == "ours"] = f"{pairs[-1][label == 'ours']} {match.group(2) if match else line}".strip()
    return [tuple(pair) for pair in pairs]


def test_the_account_gives_each_step_argument_and_difference_with_its_reason(upstream_file, capsys):
    assert upstream_diff.main(["--upstream", str(upstream_file)]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= upstream_diff.WIDTH for line in out.splitlines()[1:])  # the first names --upstream
    assert "+++" not in out and "docs/UPSTREAM.md" in out.splitlines()[1] and "--full" in out.splitlines()[1]
    steps = dict(_steps(out.split("== Arguments")[0]))
    assert steps["1. Parse input arguments"] == (
        "1. Parse the arguments: flags, or a single .json file holding all of them."
    )  # the first sentence of our step's comment, not its first line
    assert steps["(none: ours only)"].startswith("11. Prediction: the same on the test split")
    assert steps["11. Write Training Stats and push to hub."] == "12. Model card."
    assert steps["13. Something new"] == "(no step of ours mapped)"
    arguments = out.split("== Arguments")[1].split("== Deliberate differences")[0]
    assert "--token (type differs): str = None -> Optional[str] = None, annotation only" in arguments
    assert "--image_pipeline (ours only): host image path" in arguments
    assert "--only_upstream (upstream only): int = 3 -> -; not in docs/UPSTREAM.md" in arguments
    assert "model_name_or_path" not in arguments
    rows = upstream_diff.markdown_table(upstream_diff.NOTES.read_text(), upstream_diff.DIFFERENCES_TABLE)
    lines = out.split("== Deliberate differences")[1].strip().splitlines()[3:]  # after the title and the summary
    assert len(lines) == len(rows) > 30
    for number, (line, (label, *_, why)) in enumerate(zip(lines, rows), 1):
        prefix = f"{number:>4}. {label.replace('`', '')} ["
        assert line.startswith(prefix), line
        reason = line.split("]: ", 1)[1].removesuffix("...")  # cut at a word where the clause does not fit
        assert reason and reason in why.replace("`", "")


def _places(out: str) -> dict[str, str]:
    """Each deliberate difference's label -> where the account says its upstream side is."""
    lines = out.split("== Deliberate differences")[1].splitlines()
    return dict(re.match(r" *\d+\. (.*) \[(.*?)\]: ", line).groups() for line in lines if re.match(r" *\d+\. ", line))


def test_each_difference_is_looked_for_in_the_given_file_and_one_edited_line_shows(upstream_file, capsys):
    rows = upstream_diff.markdown_table(upstream_diff.NOTES.read_text(), upstream_diff.DIFFERENCES_TABLE)
    ours_only = {label for label, upstream, *_ in rows if upstream == "—"}
    assert {label for label, *_ in rows} - ours_only == set(upstream_diff.UPSTREAM_SIDE), (
        "each row of docs/UPSTREAM.md's differences table needs its upstream side in UPSTREAM_SIDE, by its label"
    )
    assert upstream_diff.main(["--upstream", str(upstream_file)]) == 0
    places = _places(capsys.readouterr().out)
    assert places["telemetry"] == "line 15" and places["embedded image bytes"] == "line 19"
    assert places["--do_predict"] == places["evaluation metrics"] == "still absent"  # no .predict(, no compute_metrics
    assert places["splits"] == places["image modes"] == "not in this file"
    assert places["lazy mode"] == "in GaudiTrainingArguments" and places["image pipelines"] == "ours only"

    edited = upstream_file.read_text().replace("    send_example_telemetry(", "    # send_example_telemetry(")
    edited = edited.replace("    # 4. Load dataset\n", "    # 4. Load dataset\n    trainer.predict(test_dataset)\n")
    upstream_file.write_text(edited)
    assert upstream_diff.main(["--upstream", str(upstream_file)]) == 0
    out = capsys.readouterr().out
    changed = {label: place for label, place in _places(out).items() if place != places[label]}
    assert changed == {
        "telemetry": "not in this file",
        "--do_predict": "not in this file",
        "embedded image bytes": "line 20",
    }
    found = sum(place.startswith("line") or place == "still absent" for place in places.values())
    missing = list(places.values()).count("not in this file")
    summary = " ".join(out.split("Upstream's side of each: ")[1].split(".\n")[0].split())
    assert summary.startswith(f"{found - 2} found in the given file, {missing + 2} not in this file, "), summary


def test_the_reasons_are_read_from_the_notes(upstream_file, tmp_path, monkeypatch, capsys):
    notes = upstream_diff.NOTES.read_text().replace("| pointless copy |", "| a reason written for this test |")
    monkeypatch.setattr(upstream_diff, "NOTES", tmp_path / "UPSTREAM.md")
    upstream_diff.NOTES.write_text(notes.replace("`--image_pipeline {", "`--image_pipelines {"))
    assert upstream_diff.main(["--upstream", str(upstream_file)]) == 0
    out = capsys.readouterr().out
    assert "embedded image bytes [line 19]: a reason written for this test" in out
    assert "--image_pipeline (ours only): not in docs/UPSTREAM.md" in out
    upstream_diff.NOTES.write_text(notes.replace("## Differences from the upstream example", "## Other"))
    assert upstream_diff.main(["--upstream", str(upstream_file)]) == 2
    assert "no section '## Differences from the upstream example'" in capsys.readouterr().err


def test_full_report_compares_arguments_diffs_and_maps_steps_and_one_section_comes_alone(upstream_file, capsys):
    assert upstream_diff.main(["--upstream", str(upstream_file), "--full"]) == 0
    out = capsys.readouterr().out
    digest = hashlib.sha256(UPSTREAM_LIKE.encode()).hexdigest()
    assert f"sha256 {digest[:12]}..., not the pinned file" in out
    rows = {
        line.split()[0]: line for line in out.splitlines() if line and not line.startswith(("=", "-", "+", "@", " "))
    }
    assert rows["model_name_or_path"].split()[1:] == ["str", "=", "(required)", "str", "=", "(required)", "same"]
    assert rows["token"].endswith("type differs")  # str = None there, Optional[str] = None here
    assert rows["freeze_text_pooler"].endswith("default differs")  # False there, True (upstream's real default) here
    assert rows["only_upstream"].endswith("upstream only") and rows["image_pipeline"].endswith("ours only")
    assert f"--- {upstream_file}" in out and "+++ ours/run_bridgetower.py" in out
    assert "-    only_upstream: int = 3" in out
    steps = out.split("== Where upstream's steps live now")[1]
    assert "1. Parse input arguments" in steps and "arguments.parse_arguments" in steps
    assert "4. Load dataset" in steps and "data.load_raw_datasets" in steps
    assert ("11. Write Training Stats and push to hub.", "12. Model card.") in _steps(steps)
    # one section alone
    assert upstream_diff.main(["--upstream", str(upstream_file), "--section", "steps"]) == 0
    out = capsys.readouterr().out
    assert "== Where upstream's steps live now" in out and "== Arguments" not in out and "== Unified diff" not in out
    assert "calls  guards.execution_mode.check_lazy_mode_variable, arguments.parse_arguments," in out


def test_fetch_checks_the_pinned_hash(monkeypatch):
    content = UPSTREAM_LIKE.encode()
    # (BytesIO is a context manager, as urlopen's answer is)
    monkeypatch.setattr(upstream_diff.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(content))
    assert upstream_diff.fetch_upstream(sha256=hashlib.sha256(content).hexdigest()) == UPSTREAM_LIKE
    with pytest.raises(ValueError, match="not the pinned"):
        upstream_diff.fetch_upstream()  # the fake content is not the pinned file


def test_errors_are_one_line_with_status_2(tmp_path, monkeypatch, capsys):
    assert upstream_diff.main(["--upstream", str(tmp_path / "missing.py")]) == 2
    assert "--upstream" in capsys.readouterr().err
    (tmp_path / "broken.py").write_text("def (:\n")
    assert upstream_diff.main(["--upstream", str(tmp_path / "broken.py")]) == 2
    assert "not Python source" in capsys.readouterr().err

    def offline(url, timeout):
        raise OSError("no network")

    monkeypatch.setattr(upstream_diff.urllib.request, "urlopen", offline)
    assert upstream_diff.main([]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass --upstream PATH" in err

"""The upstream diff tool, offline: on a small upstream-like file the test writes, and with a fake fetch."""

import hashlib
import io

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
    pass
    # 2. Setup logging
    pass
    # 4. Load dataset
    pass
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


def test_report_compares_arguments_diffs_and_maps_steps(upstream_file, capsys):
    assert upstream_diff.main(["--upstream", str(upstream_file)]) == 0
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
    line_11 = next(line for line in steps.splitlines() if line.startswith("11."))
    assert "12. Model card." in line_11
    assert "(no step of ours mapped)" in next(line for line in steps.splitlines() if line.startswith("13."))


def test_one_section(upstream_file, capsys):
    assert upstream_diff.main(["--upstream", str(upstream_file), "--section", "steps"]) == 0
    out = capsys.readouterr().out
    assert "== Where upstream's steps live now" in out and "== Arguments" not in out and "== Unified diff" not in out


class _Response(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fetch_checks_the_pinned_hash(monkeypatch):
    content = UPSTREAM_LIKE.encode()
    monkeypatch.setattr(upstream_diff.urllib.request, "urlopen", lambda url, timeout: _Response(content))
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

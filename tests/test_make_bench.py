"""`make bench` and `make test` inside Habana's container refuse to build a venv with PyPI's torch, and say what to run."""

import os
import shutil
import subprocess

import pytest

from helpers import REPO


GUARD = REPO / "scripts" / "refuse_in_habana_container.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("hl-smi") is not None,
    reason="needs make, and a machine that is not a Gaudi node",
)


def fake_hl_smi(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "hl-smi"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize(
    "goal, advice",
    [
        ("bench", "PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.bench"),
        ("test", "PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.gaudi_check"),
    ],
)
def test_make_bench_and_make_test_refuse_inside_a_habana_container_before_building_anything(tmp_path, goal, advice):
    venv, venv_current = tmp_path / "venv", tmp_path / "venv-current"
    result = subprocess.run(
        ["make", "-C", str(REPO), goal, f"VENV={venv}", f"VENV_CURRENT={venv_current}"],
        env=fake_hl_smi(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"make {goal}: this looks like a Habana Gaudi machine (hl-smi is on PATH)" in result.stderr
    assert "pip install -r requirements-gaudi.txt" in result.stderr and advice in result.stderr
    assert not venv.exists() and not venv_current.exists(), "no venv (and no PyPI torch) may be installed there"


def test_the_guard_lets_other_machines_through():
    result = subprocess.run(
        ["sh", str(GUARD)], env={**os.environ, "PYTHON": "python3"}, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stderr == ""

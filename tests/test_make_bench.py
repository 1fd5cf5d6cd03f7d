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


@pytest.mark.parametrize(
    "goal, advice",
    [
        ("bench", "PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.bench"),
        ("test", "PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.gaudi_check"),
    ],
)
def test_make_bench_and_make_test_refuse_inside_a_habana_container_before_building_anything(tmp_path, goal, advice):
    hl_smi = tmp_path / "bin" / "hl-smi"  # a stand-in on PATH, as in Habana's container
    hl_smi.parent.mkdir()
    hl_smi.write_text("#!/bin/sh\nexit 0\n")
    hl_smi.chmod(0o755)
    venv, venv_current = tmp_path / "venv", tmp_path / "venv-current"
    argv = ["make", "-C", str(REPO), goal, f"VENV={venv}", f"VENV_CURRENT={venv_current}"]
    env = {**os.environ, "PATH": f"{hl_smi.parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"make {goal}: this looks like a Habana Gaudi machine (hl-smi is on PATH)" in result.stderr
    assert "pip install -r requirements-gaudi.txt" in result.stderr and advice in result.stderr
    assert not venv.exists() and not venv_current.exists(), "no venv (and no PyPI torch) may be installed there"


def test_the_guard_lets_other_machines_through():
    env = {**os.environ, "PYTHON": "python3"}
    result = subprocess.run(["sh", str(GUARD)], env=env, capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""

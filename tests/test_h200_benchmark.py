"""scripts/h200_benchmark.sh as a process: where it stops, and that it leaves nothing running behind it.

The interpreter is a stand-in (`PYTHON=`): it records each call, answers the self-check with a chosen status and,
where the script would build fixtures or run the GPU tests, sleeps, so that the script can be stopped right there.
"""

import os
import signal
import subprocess
import time

import psutil
import pytest

from helpers import REPO


SCRIPT = str(REPO / "scripts" / "h200_benchmark.sh")

STAND_IN = """#!/bin/bash
echo "$*" >> "$CALLS"
case "$1 $2" in
    "- ") cat > /dev/null; exit 0 ;;  # the preflight's imports
    "-m bridgetower_bench.tools.nvidia_check") echo "nvidia_check: no usable NVIDIA GPU (stand-in)"; exit "$CHECK_STATUS" ;;
    "-m pytest" | "-m bridgetower_bench.tools.fixtures") echo $$ >> "$SLEEPERS"; exec sleep 300 ;;
esac
exit 1
"""


@pytest.fixture
def start(tmp_path):
    """Starts the script with the stand-in; afterwards, whatever the test left running is killed."""
    scripts = []

    def started(**settings) -> subprocess.Popen:
        scripts.append(_start(tmp_path, **settings))
        return scripts[-1]

    yield started
    sleepers = tmp_path / "sleepers"
    left = sleepers.read_text().split() if sleepers.exists() else []
    for pid in [script.pid for script in scripts] + [int(pid) for pid in left]:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def _start(tmp_path, **settings) -> subprocess.Popen:
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": str(python), "WHEELS": ""}
    env |= {"OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "CALLS": str(tmp_path / "calls")}
    env |= {"SLEEPERS": str(tmp_path / "sleepers"), **settings}
    return subprocess.Popen(
        ["bash", SCRIPT], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("status", [1, 2])
def test_a_self_check_that_does_not_pass_ends_the_script_with_its_status(start, tmp_path, status):
    script = start(CHECK_STATUS=str(status))
    out, _ = script.communicate(timeout=60)
    assert script.returncode == status, out
    assert (
        out.strip().splitlines()[-1].endswith(f"the self-check did not pass (exit status {status}): nothing else runs")
    )
    assert (tmp_path / "out" / "nvidia_check_exit.txt").read_text() == f"exit status {status}\n"
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [call.split()[:2] for call in calls] == [["-"], ["-m", "bridgetower_bench.tools.nvidia_check"]]


@pytest.mark.parametrize(
    "first_contact, sleepers",
    [
        ("1", 1),  # smoke mode goes on after the self-check's "no GPU" (2): stopped while it builds the fixtures
        ("0", 3),  # stopped while the GPU tests run in the background beside the two fixture builds
    ],
)
def test_stopped_the_script_stops_what_it_started(start, tmp_path, first_contact, sleepers):
    script = start(SMOKE="1", FIRST_CONTACT=first_contact, CHECK_STATUS="2")
    started = tmp_path / "sleepers"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(started.read_text().split() if started.exists() else []) < sleepers:
        time.sleep(0.05)
    pids = [int(pid) for pid in started.read_text().split()]
    assert len(pids) == sleepers and all(map(running, pids))
    script.send_signal(signal.SIGTERM)  # the script only, not its process group: it must pass the signal on
    out, _ = script.communicate(timeout=30)
    assert script.returncode == 128 + signal.SIGTERM, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(running, pids)):
        time.sleep(0.05)
    assert not any(map(running, pids)), "processes the script started outlived it"
    if first_contact == "0":
        assert any(call.startswith("-m pytest") for call in (tmp_path / "calls").read_text().splitlines())

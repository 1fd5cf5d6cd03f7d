"""The tests' preloaded interpreter (tests/preloaded_python.py) must run a script exactly as a fresh `python`
would: same output, exit status, death by signal, environment and arguments, and the code on disk at the
time of the run. Otherwise a test passing through it could pass where the real command fails."""

import os
import signal
import subprocess
import sys
import time

import pytest

import preloaded_python
from conftest import script_env

PROBE = '''
import os, sys
print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("marker", os.environ.get("PROBE_MARKER"))
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("stdin", repr(sys.stdin.read()))
import helper_module
print("helper", helper_module.VALUE)
print("to stderr", file=sys.stderr)
action = sys.argv[1]
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "raise":
    raise RuntimeError("boom")
if action == "signal":
    sys.stdout.flush()
    os.kill(os.getpid(), 15)
if action == "interrupt":
    raise KeyboardInterrupt
if action == "message":
    sys.exit("a message for the user")
'''


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "helper_module.py").write_text("VALUE = 1\n")
    env = {**script_env(gaudi=False), "PROBE_MARKER": "seen"}
    return tmp_path / "probe.py", env


def both(command, cwd, env):
    fresh = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    preloaded = preloaded_python.run(command, cwd=cwd, env=env, timeout=120)
    return fresh, preloaded


def without_paths(text: str) -> str:
    """Tracebacks name the interpreter's own frames (runpy) in the preloaded run; compare the rest."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("  File") and "runpy" not in line)


@pytest.mark.parametrize("action", [["exit", "0"], ["exit", "3"], ["raise"], ["signal"], ["interrupt"], ["message"]],
                         ids=["exit-0", "exit-3", "exception", "sigterm", "ctrl-c", "exit-message"])
def test_a_run_ends_as_a_fresh_python_would(probe, tmp_path, action):
    script, env = probe
    fresh, preloaded = both([sys.executable, str(script), *action], tmp_path, env)
    assert preloaded.returncode == fresh.returncode
    assert preloaded.stdout == fresh.stdout
    assert "marker seen" in preloaded.stdout and "path0 True" in preloaded.stdout and "stdin ''" in preloaded.stdout
    assert without_paths(preloaded.stderr) == without_paths(fresh.stderr)


def test_each_run_imports_the_code_on_disk_at_that_time(probe, tmp_path):
    script, env = probe
    first = preloaded_python.run([sys.executable, str(script), "exit", "0"], cwd=tmp_path, env=env)
    (tmp_path / "helper_module.py").write_text("VALUE = 2\n")
    second = preloaded_python.run([sys.executable, str(script), "exit", "0"], cwd=tmp_path, env=env)
    assert "helper 1" in first.stdout and "helper 2" in second.stdout


def test_modules_run_with_dash_m_as_python_does(tmp_path):
    env = script_env(gaudi=False)
    command = [sys.executable, "-m", "bridgetower_bench.tools.compare", str(tmp_path / "missing")]
    fresh, preloaded = both(command, tmp_path, env)
    assert (preloaded.returncode, preloaded.stdout, preloaded.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode != 0 and "missing" in fresh.stdout + fresh.stderr


def test_libraries_were_imported_under_the_runs_own_environment(tmp_path):
    """huggingface_hub reads HF_HOME once, when it is imported: a run with another HF_HOME must not inherit the
    value of an interpreter that imported it under the first one."""
    (tmp_path / "home.py").write_text("import sys, huggingface_hub.constants as c; print('torch' in sys.modules, c.HF_HOME)\n")
    env = script_env(gaudi=False)
    for home in (env["HF_HOME"], str(tmp_path / "elsewhere"), env["HF_HOME"]):
        result = preloaded_python.run([sys.executable, str(tmp_path / "home.py")], cwd=tmp_path, env={**env, "HF_HOME": home})
        assert result.stdout.split() == ["True", home]  # preloaded, and with this run's HF_HOME


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_past_its_time_limit_is_stopped_with_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    (tmp_path / "hang.py").write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded_python.run([sys.executable, str(tmp_path / "hang.py")], cwd=tmp_path, env=script_env(gaudi=False), timeout=5)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not running(grandchild):
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, signal.SIGKILL)
        pytest.fail("the run's own child outlived the time limit")

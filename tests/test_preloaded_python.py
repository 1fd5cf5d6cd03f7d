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


PROBE = """
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
"""


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "helper_module.py").write_text("VALUE = 1\n")
    env = {**script_env(gaudi=False), "PROBE_MARKER": "seen"}
    return tmp_path / "probe.py", env


def both(command, cwd, env):
    fresh = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    preloaded = preloaded_python.run(command, cwd=cwd, env=env, timeout=120)
    return fresh, preloaded


def without_paths(text: str) -> str:
    """Tracebacks name the interpreter's own frames (runpy) in the preloaded run; compare the rest."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("  File") and "runpy" not in line)


@pytest.mark.parametrize(
    "action",
    [["exit", "0"], ["exit", "3"], ["raise"], ["signal"], ["interrupt"], ["message"]],
    ids=["exit-0", "exit-3", "exception", "sigterm", "ctrl-c", "exit-message"],
)
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
    (tmp_path / "home.py").write_text(
        "import sys, huggingface_hub.constants as c; print('torch' in sys.modules, c.HF_HOME)\n"
    )
    env = script_env(gaudi=False)
    for home in (env["HF_HOME"], str(tmp_path / "elsewhere"), env["HF_HOME"]):
        result = preloaded_python.run(
            [sys.executable, str(tmp_path / "home.py")], cwd=tmp_path, env={**env, "HF_HOME": home}
        )
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
        "time.sleep(600)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded_python.run(
            [sys.executable, str(tmp_path / "hang.py")], cwd=tmp_path, env=script_env(gaudi=False), timeout=5
        )
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not running(grandchild):
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, signal.SIGKILL)
        pytest.fail("the run's own child outlived the time limit")


# ---------------------------------------------------------------------------------------------
# Popen: a run the test watches, signals and waits for (the signal tests, the benchmark sweep)
# ---------------------------------------------------------------------------------------------

TALKER = """
import os, signal, sys, time
print("pid", os.getpid(), "group", os.getpgid(0), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "handler":
    def stop(number, frame):
        print("stopping on", number, flush=True)
        sys.exit(128 + number)
    signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
if sys.argv[1] != "quick":
    time.sleep(60)
"""


@pytest.fixture
def talker(tmp_path):
    (tmp_path / "talker.py").write_text(TALKER)
    return [sys.executable, str(tmp_path / "talker.py")], script_env(gaudi=False)


def watch_and_stop(popen, command, env, cwd, mode, sig, **streams):
    """Start `command` with `popen`, read lines up to "ready", send `sig`, collect the rest and the status."""
    process = popen(command + [mode], cwd=cwd, env=env, stdout=subprocess.PIPE, start_new_session=True, **streams)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.strip() in ("ready", b"ready"):
            break
    pid = process.pid
    with open(f"/proc/{pid}/status") as f:
        masks = {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k in ("SigBlk", "SigIgn", "SigCgt")}
    process.send_signal(sig)
    try:
        rest, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{type(process).__name__} run did not end on {sig!r}; child signal masks: {masks}; "
            f"ours: blocked={sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))} "
            f"handler={signal.getsignal(signal.SIGINT)}"
        ) from None
    return process, pid, lines + [rest], process.returncode


@pytest.mark.parametrize(
    "mode, sig",
    [("plain", signal.SIGTERM), ("handler", signal.SIGTERM), ("plain", signal.SIGINT)],
    ids=["sigterm", "sigterm-handled", "ctrl-c"],
)
def test_a_watched_run_is_stopped_by_a_signal_as_a_fresh_python_would_be(ctrl_c_raises, talker, tmp_path, mode, sig):
    command, env = talker
    endings = []
    for popen in (subprocess.Popen, preloaded_python.Popen):
        process, pid, lines, returncode = watch_and_stop(
            popen, command, env, tmp_path, mode, sig, stderr=subprocess.STDOUT, text=True
        )
        output = "".join(lines)
        assert f"pid {pid} group {pid}\n" in output, "its own process group: the sweep stops it with killpg"
        # (a traceback's frames are left out: where the signal lands, in print or in sleep, is a matter of timing)
        endings.append((returncode, [line for line in output.splitlines() if not line.startswith(("pid", " "))]))
    assert isinstance(process, preloaded_python._Run), "the second run went through the preloaded server"
    assert endings[1] == endings[0]


def test_a_watched_run_appends_to_the_callers_log_file_and_reads_bytes(talker, tmp_path):
    command, env = talker
    with open(tmp_path / "log", "wb") as log:
        log.write(b"$ header\n")
        log.flush()
        process = preloaded_python.Popen(
            command + ["quick"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        assert isinstance(process, preloaded_python._Run)
        assert process.wait(timeout=60) == 0 and process.poll() == 0
    text = (tmp_path / "log").read_text()
    assert text.startswith("$ header\npid ") and "to stderr\n" in text and text.endswith("ready\n")

    process = preloaded_python.Popen(
        command + ["quick"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert [line.split()[0] for line in process.stdout] == [b"pid", b"ready"]
    assert process.wait() == 0


def test_a_watched_run_past_its_wait_is_still_running_and_can_be_killed_with_its_group(talker, tmp_path):
    command, env = talker
    process = preloaded_python.Popen(command + ["plain"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().startswith("pid")
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.5)
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    process.stdout.close()


def test_a_second_run_while_the_first_is_watched_starts_a_fresh_python(talker, tmp_path):
    command, env = talker
    first = preloaded_python.Popen(command + ["plain"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    second = preloaded_python.Popen(command + ["quick"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    assert isinstance(first, preloaded_python._Run) and isinstance(second, subprocess.Popen)
    assert second.communicate(timeout=120)[0].endswith("ready\n") and second.returncode == 0
    first.kill()
    first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    # The server is free again once the first run has ended.
    third = preloaded_python.Popen(command + ["quick"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    assert isinstance(third, preloaded_python._Run) and third.communicate(timeout=60)[0].endswith("ready\n")

"""`python <script> <args>` and `python -m <module> <args>` for the tests, without paying the start-up each time.

Starting the scripts costs seconds of imports (torch, transformers, datasets, optimum-habana) before their
first line runs, and the suite starts them dozens of times. A server process here imports those libraries
once, then forks one child per run. The child is a process of its own, as a fresh `python` would be: it gets
the run's arguments, working directory, environment and output files, imports the package and the script
from disk (so what it runs is the code in the working tree, mutated or not), runs the script as `__main__`,
then the exit handlers, and exits with the script's status. A run whose environment differs from the
server's in anything read while the libraries are imported (paths, Hub and cache settings, threads), or
that is not a plain script or module run, goes to a real subprocess instead, so no test sees the difference.

    result = run([sys.executable, "run_bridgetower_cuda.py", ...], cwd=..., env=..., timeout=600)

returns a `subprocess.CompletedProcess` (text stdout and stderr) like `subprocess.run(..., capture_output=True,
text=True)`; a run past `timeout` is killed with its process group and raises `subprocess.TimeoutExpired`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

# Variables that the libraries read while they are imported: a run that sets any of them differently from
# the server starts a fresh interpreter.
_READ_AT_IMPORT = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "PYTORCH", "OMP_",
                   "MKL", "OPENBLAS", "CUDA", "XDG_", "TOKENIZERS", "HABANA", "PT_", "LD_", "PATH", "HOME",
                   "COVERAGE", "TMPDIR")

# What the server imports before forking: the scripts' heavy dependencies, never the package under test.
_PRELOAD = """
import datasets, numpy, PIL.Image, torch, torchvision, transformers
from transformers import AutoImageProcessor, AutoTokenizer, HfArgumentParser, Trainer, TrainingArguments
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerForContrastiveLearning
"""
_PRELOAD_GAUDI = "from optimum.habana import GaudiConfig, GaudiTrainer, GaudiTrainingArguments\n"


def _read_at_import(key: str) -> bool:
    return key.upper().startswith(_READ_AT_IMPORT)


# ---------------------------------------------------------------------------------------------
# The server (runs in its own process: `python preloaded_python.py <reply fd>`)
# ---------------------------------------------------------------------------------------------


def _child(request: dict) -> None:
    """In the forked child: become `python <argv>` and never return."""
    import atexit
    import random
    import runpy
    import traceback

    status = 1
    try:
        os.setsid()  # its own process group, so that a timeout stops the run and whatever it started
        streams = ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                   (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        for fd, path, flags in streams:  # (fd 0 was the server's request pipe)
            target = os.open(path, flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stdin = open(os.devnull)
        for name in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(name, signal.default_int_handler if name == signal.SIGINT else signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # a fresh interpreter's generators are seeded from the OS, not copied from the server
        import numpy

        numpy.random.seed()
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as stop:
        if stop.code is None:
            status = 0
        elif isinstance(stop.code, int):
            status = stop.code
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        status = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if status < 0:  # ended by a signal, as an uncaught KeyboardInterrupt ends python
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        os._exit(status & 0xFF)


def _serve(reply_fd: int) -> None:
    replies = os.fdopen(reply_fd, "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, wait_status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(wait_status)}) + "\n")


# ---------------------------------------------------------------------------------------------
# The client (in the test process)
# ---------------------------------------------------------------------------------------------


class _Server:
    def __init__(self, env: dict, gaudi: bool):
        self.env = dict(env)
        read_replies, write_replies = os.pipe()
        code = _PRELOAD + (_PRELOAD_GAUDI if gaudi else "")
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"{code}\nimport sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
             "import preloaded_python; del sys.path[0]; preloaded_python._serve(int(sys.argv[1]))", str(write_replies)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=self.env, text=True, pass_fds=(write_replies,),
        )
        os.close(write_replies)
        self.replies = os.fdopen(read_replies)
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, argv: list, cwd: str, env: dict, timeout: float | None) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(prefix="preloaded-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = json.loads(self.replies.readline())["pid"]
            finished: list = []
            reader = threading.Thread(target=lambda: finished.append(self.replies.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            timed_out = reader.is_alive()
            if timed_out:
                for kill in (os.killpg, os.kill):  # the run's process group; the run itself if it left its group
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                reader.join()
            returncode = json.loads(finished[0])["returncode"]
            with open(out, errors="replace") as f:
                stdout = f.read()
            with open(err, errors="replace") as f:
                stderr = f.read()
        command = [sys.executable, *argv]
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)


_servers: dict = {}
_MAX_SERVERS = 4  # one per import-time environment in use (the two scripts' and the tools'); others run fresh


def _server_for(env: dict) -> _Server | None:
    """A live server whose import-time environment is `env`'s (started on first use), or None."""
    key = tuple(sorted((k, v) for k, v in env.items() if _read_at_import(k)))
    server = _servers.get(key)
    if server is not None and server.alive():
        return server
    if server is None and len(_servers) >= _MAX_SERVERS:
        return None
    server = _servers[key] = _Server(env, gaudi="habana_shim" in env.get("PYTHONPATH", ""))
    return server


def run(command: list, cwd, env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout), faster."""
    env = dict(os.environ if env is None else env)
    command = [str(part) for part in command]
    plain = len(command) >= 2 and command[0] == sys.executable and (command[1] == "-m" or command[1].endswith(".py"))
    if not plain or os.environ.get("BRIDGETOWER_TESTS_FRESH_PYTHON") == "1":
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    server = _server_for(env)
    if server is None:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return server.run(command[1:], cwd, env, timeout)


def stop_servers() -> None:
    for server in _servers.values():
        if server.alive():
            server.process.stdin.close()
            server.process.wait(timeout=30)
    _servers.clear()


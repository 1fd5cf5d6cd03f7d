"""`python <script> <args>` and `python -m <module> <args>` for the tests, without paying the start-up each time.

Starting the scripts costs seconds of imports (torch, transformers, datasets, optimum-habana) before their
first line runs, and the suite starts them dozens of times. A server process here imports those libraries
once, then forks one child per run. The child is a process of its own, as a fresh `python` would be: it gets
the run's arguments, working directory, environment and output files, imports the package and the script
from disk (so what it runs is the code in the working tree, mutated or not), runs the script as `__main__`,
then the exit handlers, and exits with the script's status. Each environment that differs in anything read
while the libraries are imported (paths, Hub and cache settings, threads) has a server of its own (at most
_MAX_SERVERS, the least recently used stopped first); a run that is not a plain script or module run, or
that finds its server busy, starts a real subprocess instead, so no test sees the difference.

    result = run([sys.executable, "run_bridgetower_cuda.py", ...], cwd=..., env=..., timeout=600)

returns a `subprocess.CompletedProcess` (text stdout and stderr) like `subprocess.run(..., capture_output=True,
text=True)`; a run past `timeout` is killed with its process group and raises `subprocess.TimeoutExpired`.

    process = Popen([sys.executable, "run_bridgetower_cuda.py", ...], cwd=..., env=..., stdout=subprocess.PIPE)

starts a run the test then watches and signals, like `subprocess.Popen` (for the tests that stop a run at a
given line, and for the benchmark sweep's runs: see `preloaded_sweep` in conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading


# Variables that the libraries read while they are imported: a run that sets any of them differently from
# the server starts a fresh interpreter.
_READ_AT_IMPORT = (
    "PYTHON",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "DATASETS",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL",
    "OPENBLAS",
    "CUDA",
    "XDG_",
    "TOKENIZERS",
    "HABANA",
    "PT_",
    "LD_",
    "PATH",
    "HOME",
    "COVERAGE",
    "TMPDIR",
)

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


def _standard_stream(fd: int, like, unbuffered: bool):
    """sys.stdout or sys.stderr as python itself makes them: buffered in blocks (stderr: in lines), or written
    through with PYTHONUNBUFFERED; the encoding and error handler of the server's own, started in the same
    environment."""
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw),
        encoding=like.encoding,
        errors=like.errors,
        write_through=unbuffered,
        line_buffering=not unbuffered and (raw.isatty() or fd == 2),
    )


def _child(request: dict, stdout: int, stderr: int) -> None:
    """In the forked child: become `python <argv>` and never return."""
    import atexit
    import random
    import runpy
    import traceback

    status = 1
    try:
        # Its own process group (the server sets it too, before it hands out the pid), so that a timeout or a
        # sweep's stop reaches the run and whatever it started.
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for source, fd in ((devnull, 0), (stdout, 1), (stderr, 2)):  # (fd 0 was the server's request pipe)
            os.dup2(source, fd)
        for source in {devnull, stdout, stderr}:
            os.close(source)
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
        sys.stdout = sys.__stdout__ = _standard_stream(1, sys.__stdout__, unbuffered)
        sys.stderr = sys.__stderr__ = _standard_stream(2, sys.__stderr__, unbuffered)
        sys.stdin = sys.__stdin__ = open(os.devnull)
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


def _open_output(output: dict) -> int:
    """The run's stdout or stderr: a file (emptied, or appended to) or a named pipe the client reads."""
    return os.open(output["path"], os.O_WRONLY | os.O_CREAT | (os.O_APPEND if output["append"] else os.O_TRUNC), 0o644)


def _serve(reply_fd: int) -> None:
    replies = os.fdopen(reply_fd, "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        try:  # (a named pipe's writing end opens once the client has opened its reading end)
            stdout = _open_output(request["stdout"])
            stderr = stdout if request["stderr"] is None else _open_output(request["stderr"])
        except OSError as error:
            replies.write(json.dumps({"error": str(error)}) + "\n")
            continue
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request, stdout, stderr)
        for fd in {stdout, stderr}:
            os.close(fd)
        try:
            os.setpgid(pid, pid)  # as the child does: the group exists before anybody can signal it
        except OSError:
            pass  # the child got there first (or has already ended)
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
            [
                sys.executable,
                "-c",
                f"{code}\nimport sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                "import preloaded_python; del sys.path[0]; preloaded_python._serve(int(sys.argv[1]))",
                str(write_replies),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=self.env,
            text=True,
            pass_fds=(write_replies,),
        )
        os.close(write_replies)
        self.replies = os.fdopen(read_replies)
        self.lock = threading.Lock()  # one run at a time; held from the request to the run's end

    def alive(self) -> bool:
        return self.process.poll() is None

    def request(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise RuntimeError("the preloaded interpreter's server has ended")
        return json.loads(line)


class _Run:
    """A run started through a server, with the part of subprocess.Popen's interface that tests and the benchmark
    sweep use: args, pid, stdout (when it is PIPE), returncode, poll, wait, communicate, send_signal, terminate,
    kill. The caller holds `server.lock`; the run releases it when it ends."""

    def __init__(
        self, server: _Server, argv: list, cwd, env: dict, stdout: dict | None, stderr: dict | None, text: bool
    ):
        self.args = [sys.executable, *argv]
        self.returncode = None
        self.stdout = None
        self.stderr = None
        self._server = server
        self._tmp = tempfile.mkdtemp(prefix="preloaded-popen-")
        try:
            if stdout is None:  # PIPE
                stdout = {"path": os.path.join(self._tmp, "stdout"), "append": True}
                os.mkfifo(stdout["path"])
                pipe = stdout["path"]
            else:
                pipe = None
            server.request({"argv": argv, "cwd": str(cwd), "env": env, "stdout": stdout, "stderr": stderr})
            if pipe:
                self.stdout = open(pipe, "r" if text else "rb")  # opens as the server opens the writing end
            reply = server.reply()
            if "error" in reply:
                raise OSError(reply["error"])
            self.pid = reply["pid"]
        except BaseException:
            if self.stdout is not None:
                self.stdout.close()
            shutil.rmtree(self._tmp, ignore_errors=True)
            server.lock.release()
            raise
        self._end = threading.Thread(target=self._wait_for_the_end, daemon=True)
        self._end.start()

    def _wait_for_the_end(self) -> None:
        try:
            self.returncode = self._server.reply()["returncode"]
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._server.lock.release()

    def poll(self):
        return self.returncode if not self._end.is_alive() else None

    def wait(self, timeout: float | None = None) -> int:
        self._end.join(timeout)
        if self._end.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        if input is not None:
            raise ValueError("a preloaded run reads nothing from stdin")
        output: list = []
        if self.stdout is not None and not self.stdout.closed:
            reader = threading.Thread(target=lambda: output.append(self.stdout.read()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.stdout.close()
        self.wait(timeout)
        return (output[0] if output else None), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.stdout is not None:
            self.stdout.close()
        self.wait()


_servers: dict = {}
_MAX_SERVERS = 4  # one per import-time environment in use (the two scripts', the tools', a sweep's runs)


def _server_for(command: list, env: dict) -> _Server | None:
    """A live server for `command` under `env` (started on first use): None where the run must be a fresh python
    (not a plain script or module run, every server busy, or asked for with BRIDGETOWER_TESTS_FRESH_PYTHON=1)."""
    plain = len(command) >= 2 and command[0] == sys.executable and (command[1] == "-m" or command[1].endswith(".py"))
    if not plain or os.environ.get("BRIDGETOWER_TESTS_FRESH_PYTHON") == "1":
        return None
    key = tuple(sorted((k, v) for k, v in env.items() if _read_at_import(k)))
    server = _servers.pop(key, None)
    if server is not None and server.alive():
        _servers[key] = server  # (the most recently used last)
        return server
    if len(_servers) >= _MAX_SERVERS:  # make room: stop the least recently used server that is not running anything
        idle = next((k for k, s in _servers.items() if s.lock.acquire(blocking=False)), None)
        if idle is None:
            return None
        _stop(_servers.pop(idle))
    server = _servers[key] = _Server(env, gaudi="habana_shim" in env.get("PYTHONPATH", ""))
    return server


def run(command: list, cwd, env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout), faster."""
    env = dict(os.environ if env is None else env)
    command = [str(part) for part in command]
    server = _server_for(command, env)
    if server is None:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="preloaded-run-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        server.lock.acquire()
        process = _Run(
            server, command[1:], cwd, env, {"path": out, "append": False}, {"path": err, "append": False}, True
        )
        try:
            process.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            for kill in (os.killpg, os.kill):  # the run's process group; the run itself if it left its group
                try:
                    kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
        with open(out, errors="replace") as f:
            stdout = f.read()
        with open(err, errors="replace") as f:
            stderr = f.read()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _output_of(stream, default_fd: int) -> dict | None | bool:
    """What a Popen stdout/stderr argument means for a server run: a file spec, None for PIPE, False if unsupported."""
    if stream is subprocess.PIPE:
        return None
    if stream is subprocess.DEVNULL:
        return {"path": os.devnull, "append": True}
    fd = default_fd if stream is None else stream if isinstance(stream, int) and stream >= 0 else None
    if fd is None and hasattr(stream, "fileno"):
        fd = stream.fileno()
    if fd is None:
        return False
    try:
        kind = os.fstat(fd).st_mode
    except OSError:
        return False
    if not (stat.S_ISREG(kind) or stat.S_ISFIFO(kind) or stat.S_ISCHR(kind)):
        return False  # a socket, say: the server could not open it by its path
    # The server opens the same file again, in append mode (as the run would write after what is there).
    return {"path": f"/proc/{os.getpid()}/fd/{fd}", "append": True}


def Popen(
    command: list,
    cwd=None,
    env: dict | None = None,
    stdout=None,
    stderr=None,
    text: bool = False,
    start_new_session: bool = False,
    **options,
):
    """subprocess.Popen for a plain `python <script>` or `python -m <module>` run, through a preloaded server.

    stdout: PIPE, DEVNULL, None (the caller's) or an open file; stderr: the same but PIPE, or STDOUT. The run
    is always in a process group of its own (as with start_new_session=True) and reads nothing from stdin.
    Anything else (other options, stderr=PIPE, a server busy with another run) starts a real subprocess.Popen.
    """

    def real():
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=stderr,
            text=text,
            start_new_session=start_new_session,
            **options,
        )

    run_env = dict(os.environ if env is None else env)
    argv = [str(part) for part in command]
    out = _output_of(stdout, 1)
    err = None if stderr is subprocess.STDOUT else False if stderr is subprocess.PIPE else _output_of(stderr, 2)
    server = _server_for(argv, run_env)
    if options or out is False or err is False or server is None or not server.lock.acquire(blocking=False):
        return real()
    return _Run(server, argv[1:], os.getcwd() if cwd is None else cwd, run_env, out, err, text)


def _stop(server: _Server) -> None:
    if server.alive():
        server.process.stdin.close()
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still waiting for a run that a failed test left behind
            server.process.kill()
            server.process.wait()


def stop_servers() -> None:
    for server in _servers.values():
        _stop(server)
    _servers.clear()

"""What the test modules share besides fixtures: paths, the two scripts' runs, data builders, assertions.

A script run is its `main()` in the test's own process (`run_script`, as the Hugging Face examples' tests run
theirs), everything global it changes put back afterwards (`_as_in_a_process`); a tool runs here through runpy
(`run_tool`). Where the process itself is the subject (its exit, a launcher, a fresh interpreter's start), a real
subprocess (`process=True`); a run stopped by a signal, a fork of this process (`ForkedRun`, `run_stopped_at`), as
is a call that would kill its process (`run_forked`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from bridgetower_bench.tools import tool_paths
from stop_at_rename import stop_at


REPO = Path(__file__).resolve().parent.parent
SHIM = tool_paths.HABANA_STANDIN  # the Gaudi script's stand-ins for Habana's software (their README.md)
DATASETS_CACHE = Path(os.environ.get("BRIDGETOWER_TEST_DATASETS_CACHE", str(REPO / ".cache" / "hf_datasets")))

SCRIPTS = {"gaudi": "run_bridgetower.py", "cuda": "run_bridgetower_cuda.py"}
# Flags each script needs to run on CPU. The Gaudi script runs optimum-habana's GaudiTrainer without an HPU.
CPU_FLAGS = {"gaudi": ["--use_cpu", "--use_lazy_mode", "False"], "cuda": ["--use_cpu"]}

# Tests parametrised over DEVICES also run on a GPU where there is one (`pytest -k cuda` on the benchmark
# machine, as scripts/h200_benchmark.sh does); CI has none and skips them.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

# `make test` runs the tests marked both_routes a second time on the current install route (.venv-current: today's
# transformers, accelerate, datasets; no optimum-habana). There the Gaudi script cannot run: its runs skip.
BOTH_ROUTES = pytest.mark.both_routes


def pinned(package: str, requirements: str) -> str:
    """The version `requirements` (or a file it includes with -r) pins `package` to (`==`): the tests' one reader
    of the pins, so that a version bump is an edit of the requirements files alone."""
    from packaging.requirements import Requirement

    for line in (REPO / requirements).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            with contextlib.suppress(LookupError):
                return pinned(package, line[3:].strip())
        elif line and not line.startswith("-"):
            requirement = Requirement(line)
            if requirement.name == package:
                exact = [spec.version for spec in requirement.specifier if spec.operator == "=="]
                if len(exact) != 1:
                    raise LookupError(f"{requirements} does not pin {package} to one version: {line}")
                return exact[0]
    raise LookupError(f"{requirements} does not list {package}")


def _needs_optimum_habana(kind: str) -> None:
    if kind != "gaudi":
        return
    try:
        importlib.metadata.version("optimum-habana")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the Gaudi script needs optimum-habana, which this install route does not have")


# Running the scripts -----------------------------------------------------------------------------------------


def run_environment() -> dict:
    """A script run's variables: offline, the shared data-set cache, no GPU, one intra-op thread (small machines)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(DATASETS_CACHE),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def script_env(gaudi: bool) -> dict:
    """A script subprocess's: run_environment(), the repo importable, unbuffered, the Gaudi script's Habana shim."""
    env = {**os.environ, **run_environment(), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {**env, **tool_paths.habana_standin_env(env)} if gaudi else env


def run_script(
    kind: str,
    args: list,
    check: bool = True,
    timeout: int = 600,
    process: bool = False,
    env: dict | None = None,
    refused: bool = False,
) -> subprocess.CompletedProcess:
    """`python <script> <args>`: main() in this process, or with process=True a subprocess. `env`: variables to set
    (None: unset). refused=True: the run must stop before argument parsing (a refusal of the flags or environment),
    which would end it with REFUSAL_MISSED, so that a Gaudi run with --use_habana can run here too."""
    _needs_optimum_habana(kind)
    cmd = [sys.executable, str(REPO / SCRIPTS[kind])] + [str(a) for a in args]
    if process:
        variables = _with(script_env(kind == "gaudi"), env or {})
        result = subprocess.run(cmd, cwd=REPO, env=variables, capture_output=True, text=True, timeout=timeout)
    else:
        result = _in_process(kind, cmd, env or {}, refused)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def resumed_at(log: str, step: int) -> bool:
    """Whether the Trainer logged resuming at global step `step`: transformers 4.x's line, or 5.x's."""
    pattern = rf"(Continuing training from|Resuming training from checkpoint with epoch \d+ and) global step {step}$"
    return re.search(pattern, log, re.M) is not None


def _with(environ: dict, changes: dict) -> dict:
    """`environ` with `changes` applied: a value of None unsets the variable."""
    environ = {**environ, **{k: v for k, v in changes.items() if v is not None}}
    return {k: v for k, v in environ.items() if changes.get(k, "") is not None}


def run_stopped_at(kind: str, args: list, signame: str, name: str) -> subprocess.CompletedProcess:
    """The script in a `ForkedRun`, sent `signame` just before its first rename or removal of a path named `name` in
    --output_dir (tests/stop_at_rename.py; `.publishing` is the final publication's commit point)."""
    output_dir = args[args.index("--output_dir") + 1]

    def stop():
        stop_at(output_dir, lambda count, path: os.path.basename(path) == name, getattr(signal, signame))

    return ForkedRun(kind, args, Path(output_dir).parent, before=stop).wait()


class ForkedRun:
    """`python <script> <args>` as a fork of this process: a real process (pid, signals, exit status) without an
    interpreter's start and imports, main() run as `run_script` runs it. stdout and stderr go to files in `logs`
    (`lines` follows stdout; `merged`: stderr in it too). `before`: called in the child first. `new_session`: the
    child leads its own process group (with its loader workers), for `os.killpg(run.pid, ...)`."""

    def __init__(self, kind: str, args: list, logs, before=None, merged: bool = False, new_session: bool = False):
        _needs_optimum_habana(kind)
        self.args = [sys.executable, str(REPO / SCRIPTS[kind])] + [str(a) for a in args]
        logs = Path(tempfile.mkdtemp(prefix="forked-", dir=logs))
        self.stdout_path, self.stderr_path = logs / "stdout.txt", logs / "stderr.txt"
        self.stdout_path.touch(), self.stderr_path.touch()  # (`lines` opens one before the child writes)
        self.returncode = None
        sys.stdout.flush(), sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into the test
            status = 1
            try:
                if new_session:
                    os.setsid()
                with open(self.stdout_path, "w", buffering=1) as out, open(self.stderr_path, "w", buffering=1) as err:
                    try:
                        if before is not None:
                            before()
                        streams = (out, out if merged else err)
                        status = _in_process(kind, self.args, {}, streams=streams, ending=True).returncode
                    except BaseException:  # (the test's own code failed, not the run: its traceback for the test)
                        traceback.print_exc(file=err)
            finally:
                os._exit(status)

    def lines(self, timeout: float = 300):
        """stdout's lines as the run writes them, until it ends (then the rest of the file); killed after `timeout` s."""
        deadline = time.monotonic() + timeout
        with open(self.stdout_path) as f:
            line = ""  # a line read before its end was written is completed by the next reads
            while time.monotonic() < deadline:
                line += f.readline()
                if line.endswith("\n"):
                    yield line
                    line = ""
                elif self.poll() is not None:
                    yield from (line + f.read()).splitlines(keepends=True)
                    return
                else:
                    time.sleep(0.05)
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        raise AssertionError(f"{self.args} wrote no line for {timeout} s")

    def send_signal(self, signum) -> None:
        os.kill(self.pid, signum)

    def poll(self):
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        if self.poll() is None:
            self.returncode = os.waitstatus_to_exitcode(wait_for_child(self.pid, timeout, " ".join(self.args)))
        return subprocess.CompletedProcess(
            self.args, self.returncode, self.stdout_path.read_text(), self.stderr_path.read_text()
        )


def run_forked(function, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """function(*args) in a process forked from this one: what kills a process (SIGBUS, memory exhausted, a block)
    ends that one, not the test's, without a fresh interpreter's start and imports. Back: its exit status (1 and
    the traceback on an exception), what it returned as JSON (stdout), its stderr with the log records of warnings
    and above; killed, and an AssertionError, if it runs `timeout` s."""
    logs = Path(tempfile.mkdtemp(prefix="forked-"))
    paths = {name: logs / f"{name}.txt" for name in ("stdout", "stderr")}
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        status = 1
        try:
            with open(paths["stdout"], "w") as out, open(paths["stderr"], "w", buffering=1) as err:
                os.dup2(err.fileno(), 2)  # (what libraries write below Python, too)
                sys.stderr = err
                root = logging.getLogger()
                root.handlers, root.level = [logging.StreamHandler(err)], logging.WARNING
                try:
                    json.dump(function(*args), out)
                    status = 0
                except BaseException:
                    traceback.print_exc(file=err)
        finally:
            os._exit(status)
    try:
        status = os.waitstatus_to_exitcode(wait_for_child(pid, timeout, f"{function.__name__}{args}"))
        return subprocess.CompletedProcess([function.__name__, *args], status, *map(Path.read_text, paths.values()))
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)
        logs.rmdir()


def wait_for_child(pid: int, seconds: float, what: str) -> int:
    """The wait status of child process `pid`; killed, and an AssertionError naming `what`, if it runs `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"{what} hung for {seconds} s")


_modules: dict = {}
# (module, name, optimum-habana's value, the library's own value) for each library name importing optimum.habana
# replaces (accelerate's `convert_model`, `TERecipeKwargs`): optimum-habana's apply during Gaudi runs only.
_GAUDI_PATCHES: list = []
_PATCHABLE = ("accelerate", "transformers", "torch", "datasets")


def _library_names() -> dict:
    names = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] in _PATCHABLE and module is not None:
            for name, value in list(getattr(module, "__dict__", {}).items()):
                names[(module_name, name)] = value
    return names


def script_module(kind: str):
    """The script imported once per test session, under a private name (not `__main__`)."""
    _needs_optimum_habana(kind)
    if kind not in _modules:
        if kind == "gaudi":
            if "optimum.habana" in sys.modules:  # (a test imported it here: keep optimum-habana in a subprocess)
                raise RuntimeError("optimum.habana was imported before the Gaudi script: its changes cannot be undone")
            script_module("cuda")  # the libraries both scripts use imported first, as they are before optimum.habana
            before = _library_names()
        # (the libraries' handlers the import makes on this test's stderr are unmade: each run makes its own)
        with _gaudi_imports() if kind == "gaudi" else contextlib.nullcontext(), _library_handlers_put_back():
            spec = importlib.util.spec_from_file_location(f"_bridgetower_script_{kind}", REPO / SCRIPTS[kind])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        if kind == "gaudi":
            for (module_name, name), value in _library_names().items():
                if (module_name, name) in before and before[(module_name, name)] is not value:
                    _GAUDI_PATCHES.append((sys.modules[module_name], name, value, before[(module_name, name)]))
            _gaudi_patches(applied=False)
        _modules[kind] = module
        _libraries_out_of_garbage_collection(after=SCRIPTS[kind])
    return _modules[kind]


_FROZEN_AFTER: set = set()


def _libraries_out_of_garbage_collection(after: str) -> None:
    """Everything alive now (once per `after`: the libraries, just imported) left out of garbage collection for the
    rest of the process (`gc.freeze`). They are no garbage, yet every full collection walked them: accelerate's
    `free_memory` collects at each `train()` (1.5 s of a 6 s run here, half a million objects), and Python's own
    full collections do now and then. Only what is garbage at this moment is never freed: a few objects."""
    if after not in _FROZEN_AFTER:
        _FROZEN_AFTER.add(after)
        gc.freeze()


def _gaudi_patches(applied: bool) -> None:
    for module, name, gaudi, own in _GAUDI_PATCHES:
        setattr(module, name, gaudi if applied else own)


@contextlib.contextmanager
def _gaudi_imports():
    """script_env(gaudi=True) for an import or a run here: the shim's `habana_frameworks` and `pip` (on PATH)."""
    sys.path.insert(0, str(SHIM))
    standin = tool_paths.habana_standin_env(os.environ)
    before = {name: os.environ.get(name) for name in ("PATH", tool_paths.STANDIN_VERSION)}
    os.environ.update({name: standin[name] for name in before})
    _gaudi_patches(applied=True)
    try:
        yield
    finally:
        _gaudi_patches(applied=False)
        for name, value in before.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
        sys.path.remove(str(SHIM))
        # The shim's modules go with it, so that nothing after the run finds `habana_frameworks` importable.
        for name in [n for n in sys.modules if n == "habana_frameworks" or n.startswith("habana_frameworks.")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        _forget_hpu_probes()


def _forget_hpu_probes() -> None:
    """The libraries' cached answers to "is there an HPU?", asked again by the next run."""
    import accelerate.utils.imports
    import transformers.utils.import_utils

    for module in (accelerate.utils.imports, transformers.utils.import_utils):
        for name in ("is_hpu_available", "is_torch_hpu_available"):
            probe = getattr(module, name, None)
            if hasattr(probe, "cache_clear"):
                probe.cache_clear()


def _reset_accelerate() -> None:
    """accelerate's process-wide state, as transformers' own tests reset it between Trainers."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


def _library_logging_modules() -> list:
    """Loaded logging modules of libraries with one `_default_handler` per process, made on the stderr of their first
    `get_logger` (transformers', optimum's): read through `__dict__` (a lazy module's look-up would import)."""
    names = ("_default_handler", "_configure_library_root_logger", "_get_library_root_logger")
    return [m for m in list(sys.modules.values()) if all(n in getattr(m, "__dict__", {}) for n in names)]


@contextlib.contextmanager
def _library_handlers_put_back():
    """A library's own handler made in the block unmade afterwards, so that none outlives the stream it was made
    with (a run's capture, a test's `capsys`): the next `get_logger` makes one on the stderr of that moment."""
    before = {m.__name__: vars(m)["_default_handler"] for m in _library_logging_modules()}
    try:
        yield
    finally:
        for module in _library_logging_modules():
            made = vars(module)["_default_handler"]
            if made is not None and made is not before.get(module.__name__):
                module._get_library_root_logger().removeHandler(made)
                module._default_handler = before.get(module.__name__)


_NO_FLUSH = object()  # (a handler without a `flush` of its own: StreamHandler's, which flushes its stream)


@contextlib.contextmanager
def logging_put_back():
    """Loggers, their handlers (stream, `flush`, formatter, level) and the libraries' own handlers put back after the
    block; in it the root logger has no handler, so that a script's `logging.basicConfig` writes to its capture."""
    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    saved = {id(lg): (lg, lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers}
    own = [vars(m)["_default_handler"] for m in _library_logging_modules()]
    handlers = {
        id(h): (h, vars(h).get("stream"), vars(h).get("flush", _NO_FLUSH), h.formatter, h.level)
        for h in [h for lg in loggers for h in lg.handlers] + [h for h in own if h is not None]
    }
    root = logging.getLogger()
    root.handlers = []
    root.setLevel(logging.WARNING)
    try:
        with _library_handlers_put_back():
            yield
    finally:
        for logger in list(logging.Logger.manager.loggerDict.values()):
            if isinstance(logger, logging.Logger) and id(logger) not in saved:  # made by the run
                logger.handlers, logger.level, logger.propagate = [], logging.NOTSET, True
        for logger, level, kept, propagate, disabled in saved.values():
            logger.setLevel(level)
            logger.handlers, logger.propagate, logger.disabled = kept, propagate, disabled
        for handler, stream, flush, formatter, level in handlers.values():
            if stream is not None:
                handler.stream = stream
            if flush is _NO_FLUSH:
                vars(handler).pop("flush", None)
            else:
                handler.flush = flush
            handler.formatter, handler.level = formatter, level


def _library_handlers_to(stream) -> None:
    """The libraries' once-per-process handlers (made now where unmade, as a fresh process's import makes them) to
    this run's capture, their `flush` too (transformers' and optimum's bind it to the stderr they were made with)."""
    for module in _library_logging_modules():
        if vars(module)["_default_handler"] is None:
            module._configure_library_root_logger()
    own = [vars(m)["_default_handler"] for m in _library_logging_modules()]
    for handler in [h for lg in logging.Logger.manager.loggerDict.values() for h in getattr(lg, "handlers", [])] + own:
        if type(handler) is logging.StreamHandler:
            handler.stream = stream
            if "flush" in vars(handler):
                handler.flush = stream.flush


def _process_warning_filters() -> None:
    """Python's default warning filters, the script's module as `__main__`, warnings printed (not recorded by pytest)."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__|_bridgetower_script_")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category, append=True)
    warnings.showwarning = warnings._showwarning_orig


REFUSAL_MISSED = "the run got past its refusal to argument parsing"


def _refusal_missed(*args, **kwargs):
    raise AssertionError(REFUSAL_MISSED)


@contextlib.contextmanager
def _as_in_a_process(changes: dict, cwd, gaudi: bool = False, streams=None, ending: bool = False):
    """This process as a fresh `python` with the run's environment in `cwd`; yields the run's (stdout, stderr). Put back
    afterwards: argv, sys.path, environ, cwd, signal handlers, logging, warnings, torch's threads, determinism and
    random generators (Python's, numpy's), accelerate's state, the run's output directory locks. `streams`: where
    to write instead. `ending`: the process ends after the run (`ForkedRun`): its signal handlers stay, as in
    `python` (a second Ctrl-C while it exits is then ignored, not raised in the put-back)."""
    import datasets.config

    from bridgetower_bench.output_dir import run_directory

    stdout, stderr = streams or (io.StringIO(), io.StringIO())
    environ, cwd_before, argv_before, path_before = dict(os.environ), os.getcwd(), sys.argv, list(sys.path)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    generators = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cache_paths = {
        name: getattr(datasets.config, name)
        for name in ("HF_DATASETS_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH")
    }
    env = _with({**os.environ, **run_environment()}, changes)
    _reset_accelerate()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(logging_put_back())
            stack.enter_context(warnings.catch_warnings())
            _process_warning_filters()
            stack.enter_context(contextlib.redirect_stdout(stdout))
            stack.enter_context(contextlib.redirect_stderr(stderr))
            os.environ.clear()
            os.environ.update(env)
            if gaudi:
                stack.enter_context(_gaudi_imports())
            # what `datasets` reads from HF_DATASETS_CACHE when it is imported
            cache = Path(env.get("HF_DATASETS_CACHE", DATASETS_CACHE))
            datasets.config.HF_DATASETS_CACHE = cache
            datasets.config.DOWNLOADED_DATASETS_PATH = cache / datasets.config.DOWNLOADED_DATASETS_DIR
            datasets.config.EXTRACTED_DATASETS_PATH = (
                cache / datasets.config.DOWNLOADED_DATASETS_DIR / datasets.config.EXTRACTED_DATASETS_DIR
            )
            torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _library_handlers_to(stderr)
            os.chdir(cwd)
            try:
                yield stdout, stderr
            finally:
                run_directory.release_all()  # what the process's exit does (atexit)
    finally:
        os.chdir(cwd_before)
        sys.argv, sys.path[:] = argv_before, path_before
        os.environ.clear()
        os.environ.update(environ)
        for name, value in cache_paths.items():
            setattr(datasets.config, name, value)
        if not ending:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(generators[0])
        np.random.set_state(generators[1])
        random.setstate(generators[2])
        _reset_accelerate()


def _exit_status(run) -> int:
    """run()'s exit status as `python` gives it: SystemExit's (a message printed: 1), 1 and a traceback on another
    exception, 0 when it returns."""
    try:
        run()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _in_process(
    kind: str, argv: list, changes: dict, refused: bool = False, streams=None, ending: bool = False
) -> subprocess.CompletedProcess:
    """The script's main() with `argv`, in this process, as `python <argv>` would run it (_as_in_a_process)."""
    from bridgetower_bench import arguments

    habana = kind == "gaudi" and any(a.startswith("--use_habana") for a in argv) and "--use_cpu" not in argv
    if habana and not refused:
        # GaudiTrainingArguments would call optimum-habana's adapt_transformers_to_gaudi(), which replaces
        # transformers' model code for the rest of the process
        raise ValueError("a Gaudi-script run with --use_habana and no --use_cpu needs process=True or refused=True")
    module = script_module(kind)
    with _as_in_a_process(changes, REPO, kind == "gaudi", streams, ending) as (stdout, stderr):
        with mock.patch.object(arguments, "parse_arguments", _refusal_missed) if refused else contextlib.nullcontext():
            sys.argv = list(argv[1:])
            # the script's `if __name__ == "__main__":` line
            returncode = _exit_status(lambda: module.exit_on_user_error(module.main))
    if streams is not None:  # (the output is in them)
        return subprocess.CompletedProcess(argv, returncode)
    return subprocess.CompletedProcess(argv, returncode, stdout.getvalue(), stderr.getvalue())


def run_tool(
    tool: str, args: list, cwd=REPO, process: bool = False, gaudi: bool = False
) -> subprocess.CompletedProcess:
    """`python -m bridgetower_bench.tools.<tool> <args>` (or `python lab/<tool>.py`) in `cwd` with the run environment
    (and the Habana shim where `gaudi`): here through runpy, as `__main__`, put back after; or process=True."""
    module, script = f"bridgetower_bench.tools.{tool}", REPO / "lab" / f"{tool}.py"
    command = [str(script)] if script.exists() else ["-m", module]
    argv = [sys.executable, *command, *map(str, args)]
    if process:
        return subprocess.run(argv, cwd=cwd, env=script_env(gaudi), capture_output=True, text=True, timeout=600)
    if gaudi:
        script_module("gaudi")  # optimum.habana imported through the Gaudi script, its changes undone after
    with _as_in_a_process({}, cwd, gaudi) as (stdout, stderr):
        if script.exists():
            sys.argv = argv[1:]
            returncode = _exit_status(lambda: runpy.run_path(str(script), run_name="__main__"))
        else:
            # (a tool the tests imported runs afresh as __main__, as `-m` runs it; runpy warns of that)
            warnings.filterwarnings("ignore", "'bridgetower_bench.tools.", RuntimeWarning)
            sys.argv = [module, *argv[3:]]
            returncode = _exit_status(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    return subprocess.CompletedProcess(argv, returncode, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def optimum_habana():
    """optimum.habana here for the block, as the Gaudi script's runs have it: imported through the Gaudi script once
    (script_module), so that what its import changes in other libraries is undone after the block."""
    script_module("gaudi")
    with _gaudi_imports(), _library_handlers_put_back():
        yield importlib.import_module("optimum.habana")


def run_cuda_script(args) -> tuple[int, str]:
    """The CUDA script in this process: (exit status, stderr)."""
    result = run_script("cuda", args, check=False)
    return result.returncode, result.stderr


# Arguments and results of the scripts' runs ------------------------------------------------------------------


def base_args(fixtures, output_dir, **overrides):
    """Flags of a short run of the tiny model on the synthetic data set; overrides set or (None) drop a flag."""
    from bridgetower_bench.tools.fixtures import script_flags

    args = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_train_samples": 16,
        "max_eval_samples": 8,
        "num_train_epochs": 1,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_steps": 2,
        "report_to": "none",
        "seed": 7,
        "throughput_warmup_steps": 1,
        "dataloader_num_workers": 0,
    }
    return script_flags(fixtures, **{**args, **overrides})


def command(fixtures, out, kind="cuda", *extra, **overrides):
    """Train the tiny model: 32 rows in batches of 4 (8 steps an epoch), a checkpoint every 2 steps."""
    args = {"max_train_samples": 32, "max_steps": 2, **overrides}
    return base_args(fixtures, out, **args) + ["--do_train", *extra] + CPU_FLAGS[kind]


def load_weights(directory):
    """A model directory's weights: model.safetensors (what the runs save), else pytorch_model.bin (the published
    model's kind, and so the fixture's)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        return load_file(str(directory / "model.safetensors"))
    return torch.load(directory / "pytorch_model.bin", weights_only=True)


def run_killed_while_publishing(kind, args):
    """A training run SIGKILLed just before its final publication commits: its checkpoints saved, no model published."""
    from bridgetower_bench.output_dir import run_directory

    result = run_stopped_at(kind, args, "SIGKILL", run_directory.PUBLISHING_NAME)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def once_per_session(tmp_path_factory, name: str, make) -> dict:
    """`make(folder)`'s records (JSON), made once in the pytest session however many pytest-xdist workers ask (a
    module-scoped fixture runs once per worker): the first to hold the lock makes them in `name`, a folder of the
    session's temporary directory, which the workers' own are in; the others wait for it and read them."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    base = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, records = base / name, base / f"{name}.json"
    with FileLock(base / f"{name}.lock"):
        if not records.exists():
            shutil.rmtree(folder, ignore_errors=True)  # (an attempt that failed)
            folder.mkdir()
            records.write_text(json.dumps(make(folder)))
    return read_json(records)


def last_line(result) -> str:
    """The last line a finished process wrote to stderr: where a refusal stands."""
    return result.stderr.strip().splitlines()[-1]


def load_raw(**given):
    """data.load_raw_datasets of what the caller names; no data set, file, configuration, cache or token else."""
    from bridgetower_bench import data

    names = ("dataset_name", "dataset_config_name", "data_dir", "train_file", "validation_file", "cache_dir", "token")
    return data.load_raw_datasets(**{**dict.fromkeys(names), "dataset_revision": "main", **given})


def all_strings(value):
    """Every string in a JSON value, however deep (a record's paths and texts, to check what it gives away)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from all_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from all_strings(item)
    elif isinstance(value, str):
        yield value


def assert_throughput_adds_up(metrics: dict, counted_steps: int, samples_per_step: int) -> None:
    """Saved throughput is counted samples over counted seconds for the steps the flags imply, and the data-wait
    shares are the seconds waited in that window (more than "samples/s > 0")."""
    assert metrics["throughput_counted_steps"] == counted_steps
    assert metrics["throughput_counted_samples"] == counted_steps * samples_per_step
    seconds = metrics["throughput_counted_seconds"]
    assert seconds > 0
    assert metrics["train_samples_per_second"] == pytest.approx(counted_steps * samples_per_step / seconds)
    waited = metrics["data_wait_seconds_epoch_start"] + metrics["data_wait_seconds_steady"]
    assert 0 <= waited <= seconds
    assert metrics["data_wait_fraction"] == pytest.approx(waited / seconds)


# Images, data sets, processes --------------------------------------------------------------------------------


def encode(img, fmt: str, **options) -> bytes:
    """A PIL image saved to bytes in `fmt` ("JPEG", "PNG", ...)."""
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise_jpeg(seed: int, size=(48, 40), quality: int = 75) -> bytes:
    """A JPEG of random pixels, `size` = (width, height): the same bytes for the same seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", quality=quality)


def jpeg_bytes(seed: int, size=(96, 64)) -> bytes:
    return noise_jpeg(seed, size, quality=90)


def embedded(images, captions):
    """A data set of embedded images ({"bytes", "path"} cells) and their captions."""
    import datasets

    features = datasets.Features({"image": datasets.Image(decode=False), "caption": datasets.Value("string")})
    rows = {"image": [{"bytes": b, "path": None} for b in images], "caption": captions}
    return datasets.Dataset.from_dict(rows, features=features)


def write_csv(path, rows):
    """rows: (image file name, image bytes or None to leave the file missing, caption); images beside the csv."""
    (path.parent / "images").mkdir(parents=True, exist_ok=True)
    lines = ["image_path,caption"]
    for name, image, caption in rows:
        if image is not None:
            (path.parent / "images" / name).write_bytes(image)
        lines.append(f"{path.parent / 'images' / name},{caption}")
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_contrastive_model():
    """A BridgeTowerForContrastiveLearning of one layer each, 28-pixel images, seeded weights, in eval mode."""
    from transformers import BridgeTowerConfig, BridgeTowerForContrastiveLearning

    layer = dict(hidden_size=64, num_hidden_layers=1)  # one layer of 64 in each tower and in the cross-modal part
    text = dict(layer, num_attention_heads=1, intermediate_size=64, vocab_size=50, max_position_embeddings=24)
    config = BridgeTowerConfig(
        text_config=text,
        vision_config=dict(layer, image_size=28, patch_size=14),
        **layer,
        num_attention_heads=1,
        contrastive_hidden_size=16,
        logit_scale_init_value=2.6592,
    )
    torch.manual_seed(0)
    return BridgeTowerForContrastiveLearning(config).eval()


def dead_pid() -> int:
    """The id of a process that has exited (what a killed writer leaves behind)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def ended(pid, within_s: float = 5.0) -> bool:
    """Whether process `pid` has ended within `within_s` seconds (a zombie counts: its parent gone, it waits for
    init to reap it)."""
    stat = Path(f"/proc/{int(pid)}/stat")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rpartition(")")[2].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


# Trainers, models and data sets built in the test process ----------------------------------------------------


# The training arguments of the trainers built here: on the CPU, the main process loading, nothing saved or reported.
_ON_THE_CPU = dict(use_cpu=True, dataloader_num_workers=0, save_strategy="no", report_to="none")


def trainer_on(fixtures, ds, out, callbacks=(), **overrides):
    """A TrainerExtensions trainer of the tiny fixture model on `ds`, on the CPU (2 steps of 4 unless overridden)."""
    from transformers import BridgeTowerForContrastiveLearning

    from bridgetower_bench import data
    from bridgetower_bench.arguments import WarmupTrainingArguments

    options = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=2,
        seed=3,
        remove_unused_columns=False,
        disable_tqdm=True,
        **_ON_THE_CPU,
    )
    options.update(overrides)
    model = BridgeTowerForContrastiveLearning.from_pretrained(fixtures["model"])
    return extended_trainer_class()(
        model=model,
        args=WarmupTrainingArguments(**options),
        train_dataset=ds,
        eval_dataset=ds,
        data_collator=data.collate_fn,
        image_mean=(0.5,) * 3,
        image_std=(0.5,) * 3,
        callbacks=list(callbacks),
    )


class SlowData(torch.utils.data.Dataset):
    """Each sample takes `delay` seconds to load: the loader is the bottleneck."""

    def __init__(self, n, delay):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return {"input_ids": torch.tensor([i % 7]), "pixel_values": torch.full((3, 2, 2), i % 255, dtype=torch.uint8)}


class SlowModel(torch.nn.Module):
    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.seen_pixels = []

    def forward(self, input_ids, pixel_values):
        time.sleep(self.delay)
        self.seen_pixels.append(pixel_values.detach().clone())
        return {"loss": (self.weight * pixel_values.float().mean()).sum()}


def extended_trainer_class():
    """transformers' Trainer with the kit's TrainerExtensions, as both scripts' trainers have them."""
    from transformers import Trainer

    from bridgetower_bench.trainer import TrainerExtensions

    _libraries_out_of_garbage_collection(after="Trainer")

    class ExtendedTrainer(TrainerExtensions, Trainer):
        pass

    return ExtendedTrainer


def slow_trainer(out, trainer_class=None, args=(), **trainer_options):
    """An extended Trainer of SlowModel (30 ms a forward) on 12 rows of SlowData (10 ms a row), on the CPU: 6 steps
    of 2, the first 2 a warm-up. `args` overrides WarmupTrainingArguments' fields, `trainer_options` the Trainer's."""
    from bridgetower_bench.arguments import WarmupTrainingArguments

    options = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=6,
        throughput_warmup_steps=2,
        logging_steps=100,
        **_ON_THE_CPU,
    )
    options.update(args)
    trainer_options = {
        "model": SlowModel(delay=0.03),
        "train_dataset": SlowData(12, delay=0.01),
        "image_mean": (0.5,) * 3,
        "image_std": (0.25,) * 3,
        **trainer_options,
    }
    return (trainer_class or extended_trainer_class())(args=WarmupTrainingArguments(**options), **trainer_options)


def ranks_by_sorting(image_embeds, text_embeds, groups):
    """(image->text rank of each distinct image's best caption, text->image rank of each caption's image), 1-based."""
    groups = list(groups)
    distinct = list(dict.fromkeys(groups))
    image_of = {g: image_embeds[groups.index(g)] for g in distinct}  # rows of one picture embed it alike

    def unit(v):
        return v / np.linalg.norm(v)

    captions = [unit(t) for t in text_embeds]
    i2t = []
    for g in distinct:
        order = sorted(range(len(captions)), key=lambda c: -float(captions[c] @ unit(image_of[g])))
        i2t.append(1 + next(position for position, c in enumerate(order) if groups[c] == g))
    t2i = []
    for c, caption in enumerate(captions):
        order = sorted(distinct, key=lambda g: -float(caption @ unit(image_of[g])))
        t2i.append(1 + order.index(groups[c]))
    return np.array(i2t), np.array(t2i)

"""Shared test set-up: offline Hugging Face libraries, the embedded fixtures, and running the two scripts."""

import atexit
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import preloaded_python


REPO = Path(__file__).resolve().parent.parent
SHIM = REPO / "tests" / "habana_shim"

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_EVALUATE_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' own HF_HOME, so that no cached preflight verdict or decoded image of the user's (nor of an earlier
# test session) hides a regression; the preflight and decoded-image caches follow it, and script subprocesses
# inherit it. The data sets stay cached under HF_DATASETS_CACHE (see script_env).
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="bridgetower-tests-hf-home-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)


def script_env(gaudi: bool) -> dict:
    """Environment for a script subprocess: offline, the repo importable, and the Habana shim for the Gaudi script."""
    env = dict(os.environ)
    env.update(
        {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    )
    env["HF_DATASETS_CACHE"] = env.get("BRIDGETOWER_TEST_DATASETS_CACHE", str(REPO / ".cache" / "hf_datasets"))
    paths = [str(REPO)] + ([str(SHIM)] if gaudi else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    if gaudi:
        env["PATH"] = str(SHIM / "bin") + os.pathsep + env.get("PATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    # The machines running the tests are small and shared: one intra-op thread avoids oversubscription.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# Tests parametrised over DEVICES also run on a GPU where there is one (`pytest -k cuda` on the benchmark
# machine, as scripts/h200_benchmark.sh does); CI has none and skips them.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

SCRIPTS = {"gaudi": "run_bridgetower.py", "cuda": "run_bridgetower_cuda.py"}
# Flags each script needs to run on CPU. The Gaudi script runs optimum-habana's GaudiTrainer without an HPU.
CPU_FLAGS = {"gaudi": ["--use_cpu", "--use_lazy_mode", "False"], "cuda": ["--use_cpu"]}


def run_script(kind: str, args: list, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python <script> <args>` in the repository (through a preloaded interpreter: tests/preloaded_python.py)."""
    cmd = [sys.executable, str(REPO / SCRIPTS[kind])] + [str(a) for a in args]
    result = preloaded_python.run(cmd, cwd=REPO, env=script_env(kind == "gaudi"), timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def run_stopped_at(kind: str, args: list, signame: str, name: str) -> subprocess.CompletedProcess:
    """Run the script, sending it `signame` just before its first rename or removal of a path named `name` in
    --output_dir (tests/stop_at_rename.py): `.publishing` is the final publication's commit point."""
    cmd = [sys.executable, str(REPO / "tests" / "stop_at_rename.py"), signame, name, str(REPO / SCRIPTS[kind])]
    return preloaded_python.run(cmd + [str(a) for a in args], cwd=REPO, env=script_env(kind == "gaudi"), timeout=600)


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def assert_throughput_adds_up(metrics: dict, counted_steps: int, samples_per_step: int) -> None:
    """A run's saved throughput is its counted samples over its counted seconds, for the steps the flags imply,
    and its data-wait shares are the seconds it waited over that same window (more than "samples/s > 0")."""
    assert metrics["throughput_counted_steps"] == counted_steps
    assert metrics["throughput_counted_samples"] == counted_steps * samples_per_step
    seconds = metrics["throughput_counted_seconds"]
    assert seconds > 0
    assert metrics["train_samples_per_second"] == pytest.approx(counted_steps * samples_per_step / seconds)
    waited = metrics["data_wait_seconds_epoch_start"] + metrics["data_wait_seconds_steady"]
    assert 0 <= waited <= seconds
    assert metrics["data_wait_fraction"] == pytest.approx(waited / seconds)


def encode(img, fmt: str, **options) -> bytes:
    """A PIL image saved to bytes in `fmt` ("JPEG", "PNG", ...)."""
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise_jpeg(seed: int, size=(48, 40), quality: int = 75) -> bytes:
    """A JPEG of random pixels, `size` = (width, height): the same bytes for the same seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", quality=quality)


def dead_pid() -> int:
    """The id of a process that has exited (what a killed writer leaves behind)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture(autouse=True)
def signal_handlers_as_they_were():
    """Each test starts with the Ctrl-C and SIGTERM handlers the previous one found: a test that sets its own, or
    that leaves a `trainer.catching_signals()` block without closing it, would otherwise hand them to the next
    test in its worker, where a Ctrl-C might then be caught instead of raised."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here and in the processes the test starts, as in a terminal: a worker
    process may have inherited SIGINT as ignored (under `make coverage` the pytest workers do; so does anything
    a non-interactive shell starts in the background) or blocked, and either stays so in every child python."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (put back by signal_handlers_as_they_were)
    blocked = signal.SIGINT in signal.pthread_sigmask(
        signal.SIG_UNBLOCK, [signal.SIGINT]
    )  # a blocked one is inherited too
    yield
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])


@pytest.fixture
def preloaded_sweep(monkeypatch):
    """The benchmark sweep (bench.run_sweep) starts its runs through the preloaded interpreter: same commands,
    environments and logs, without the seconds of imports per run (tests/preloaded_python.py). The runs are the
    preloaded server's children, not the sweep's, so the sweep's parent-death signal (a child-side option that
    would make them real subprocesses) is left out here; tests/test_bench.py tests it with real subprocesses."""
    from bridgetower_bench.tools import bench

    def popen(command, *args, preexec_fn=None, **options):
        return preloaded_python.Popen(command, *args, **options)

    monkeypatch.setattr(bench, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "Popen": popen}))


@pytest.fixture(scope="session")
def fixtures():
    """The embedded default fixtures (tiny model, synthetic New Yorker-shaped data, Gaudi config), built once."""
    from bridgetower_bench.tools.fixtures import ensure_default_fixtures

    return ensure_default_fixtures()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`), the longest tests first (those marked slow), so that no worker starts one
    while the others run out of work. A plain pytest run keeps the order it was given (tests/mutate.py's fastest first)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # (set in each xdist worker, where the collection happens)
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (a stable sort: the rest keep their order)


def pytest_sessionfinish(session, exitstatus):
    preloaded_python.stop_servers()

"""Shared test set-up: offline Hugging Face libraries, the embedded fixtures, signal handlers between tests.

The helpers the test modules share (running the scripts, data builders, assertions) are in tests/helpers.py."""

import atexit
import gc
import os
import shutil
import signal
import tempfile

import pytest


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_EVALUATE_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' own HF_HOME, so that no cached preflight verdict or decoded image of the user's or of an earlier
# session hides a regression (the data sets stay cached under HF_DATASETS_CACHE, helpers.run_environment).
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="bridgetower-tests-hf-home-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)


def pytest_configure(config):
    """The property-based tests' hypothesis profile: the same generated cases on every run (a fixed seed), no example
    database written into the tree, no per-example deadline (a shared machine's pauses); each test sets its
    max_examples. hypothesis is a test requirement of the pinned route only (the current route's pass runs none)."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("bridgetower", derandomize=True, database=None, deadline=None, print_blob=False)
    settings.load_profile("bridgetower")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """No garbage collection while the test modules are imported: torch, transformers and datasets make half a million
    objects, none of them garbage, which each full collection walked; what collection made is then left out of garbage
    collection (`gc.freeze`), as a script's process does. Measured: a worker's collection 15-16 s before, 9-10 after."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


@pytest.fixture(autouse=True)
def signal_handlers_as_they_were():
    """Each test starts with the Ctrl-C and SIGTERM handlers the previous one found: one that sets its own (or leaves
    a `trainer.catching_signals()` block open) would otherwise hand them on, and the next one's Ctrl-C be caught."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here and in the processes the test starts, as in a terminal: a worker may have
    inherited SIGINT ignored (`make coverage`'s do, as does a non-interactive shell's background job) or blocked,
    and either stays so in every child python."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (put back by signal_handlers_as_they_were)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # (inherited too)
    yield
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])


@pytest.fixture(scope="session")
def fixtures():
    """The embedded default fixtures (tiny model, synthetic New Yorker-shaped data, Gaudi config), built once."""
    from bridgetower_bench.tools.fixtures import ensure_default_fixtures

    return ensure_default_fixtures()


@pytest.fixture
def no_fixture_builds(monkeypatch):
    """The self-checks' fixtures named, not built: their paths under the folder asked for."""
    from bridgetower_bench.tools import fixtures

    kinds = ("model", "dataset", "gaudi_config")
    monkeypatch.setattr(fixtures, "ensure_default_fixtures", lambda root: {k: root / k for k in kinds})
    monkeypatch.setattr(fixtures, "build_fixture", lambda root, kind, **options: root / "bridgetower-large-random")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`), the slow tests first, so that no worker starts one while the others run out
    of work. A plain pytest run keeps the order it was given."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # (set in each xdist worker, where the collection happens)
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (a stable sort: the rest keep their order)

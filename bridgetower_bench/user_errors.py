"""How the scripts end on bad input (one line, exit status 2: argparse's convention) and on a run stopped at once;
what their processes, and the tools', leave out of garbage collection."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
from collections.abc import Callable


class UserInputError(ValueError):
    """Bad input (a flag, a data file, a row, a column), named by the message; a ValueError for those that catch it."""


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run main(): a UserInputError becomes `<script>: error: <message>`, exit status 2; a KeyboardInterrupt one line,
    128 + the signal. Leaves the process group first, but when stopped at once (a collective may be pending)."""
    try:
        main()
    except UserInputError as error:
        sys.stderr.flush()
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
        _leave_the_process_group(2)
        sys.exit(2)
    except KeyboardInterrupt as error:
        signum = getattr(error, "signum", signal.SIGINT)  # resilience.StoppedAtOnce names a second SIGTERM
        _ignore_stop_signals()
        said = (
            f"Stopped at once by {signal.Signals(signum).name}: what was being saved is incomplete and is never used. "
            "Rerun the same command (without --overwrite_output_dir) to go on from the newest complete checkpoint."
        )
        sys.stderr.flush()
        print(said, file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    except SystemExit as exiting:
        if exiting.code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # stopped by a signal, its line printed
            _ignore_stop_signals()
        _leave_the_process_group(exiting.code)
        raise
    _leave_the_process_group(0)


def freeze_imports() -> None:
    """A program's entry, before its main(): everything alive now (the libraries just imported: torch, transformers
    and datasets make half a million objects, none of them garbage) is left out of garbage collection for the rest
    of the process (`gc.freeze`), and collection, which the scripts turn off while they import, runs from here on.
    Otherwise every full collection walks them all: each import's growth, accelerate's `free_memory` at each
    `train()`, Python's own now and then (inside a run's throughput window too), several at the interpreter's exit.
    Once per process: a later freeze would keep whatever is garbage by then forever."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
    gc.enable()


def _leave_the_process_group(code) -> None:
    """Left to the interpreter's exit while another rank is gone, the group's threads can abort it (exit status 134).
    Gloo's can even once it is destroyed (`<no Python frame>`: 2 of 124 CPU runs of two processes, none of 90 since):
    such a process ends here, its exit handlers run and its output flushed, without the interpreter's teardown,
    with the status `sys.exit(code)` gives (a message: printed, 1)."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return
    gloo = distributed.get_backend() == "gloo"
    distributed.destroy_process_group()
    if gloo:
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _ignore_stop_signals() -> None:
    """The run is ending on a signal: one more (a Ctrl-C pressed twice) must not interrupt its exit."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)

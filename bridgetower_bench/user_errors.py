"""How the scripts end on bad input: one line, exit status 2, no traceback (argparse's convention).

Code that refuses a flag, file, row or column raises `UserInputError` with a message naming it.
`exit_on_user_error(main)` runs a script's main(): a UserInputError ends the process with
`<script>: error: <message>` on stderr and exit status 2. A run stopped at once by SIGINT or SIGTERM (a
Ctrl-C before or after training, a second signal during it: `KeyboardInterrupt`) ends in one line too, exit
status 128 + the signal; once a run ends on a signal, further signals are ignored while it exits. Every
other exception is a bug or an environment failure and keeps its traceback. A process of a distributed run
leaves its process group before it exits, but when stopped at once (a collective may still be pending).

UserInputError is a ValueError, so callers that catch ValueError (and tests) keep working.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


class UserInputError(ValueError):
    """Bad input from the user (a flag, a data file, a row, a column). The message names it."""


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run main(); a UserInputError becomes `<script>: error: <message>` on stderr and exit status 2."""
    try:
        main()
    except UserInputError as error:
        sys.stderr.flush()
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
        _leave_the_process_group()
        sys.exit(2)
    except KeyboardInterrupt as error:
        signum = getattr(error, "signum", signal.SIGINT)  # resilience.StoppedAtOnce names a second SIGTERM
        _ignore_stop_signals()
        sys.stderr.flush()
        print(
            f"Stopped at once by {signal.Signals(signum).name}: what was being saved is incomplete and is never "
            "used. Rerun the same command (without --overwrite_output_dir) to go on from the newest complete "
            "checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(128 + signum)
    except SystemExit as exiting:
        if exiting.code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # stopped by a signal, its line printed
            _ignore_stop_signals()
        _leave_the_process_group()
        raise
    _leave_the_process_group()


def _leave_the_process_group() -> None:
    """A process of a distributed run ends without the process group's threads: left to the interpreter's exit
    while another rank, or the node keeping the job's store, is already gone, they can abort the process
    ("terminate called without an active exception", exit status 134) in place of its own status."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


def _ignore_stop_signals() -> None:
    """The run is ending on a signal: one more (a Ctrl-C pressed twice) must not interrupt its exit."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)

"""How the scripts end on bad input: one line, exit status 2, no traceback (argparse's convention).

Code that refuses a flag, file, row or column raises `UserInputError` with a message naming it.
`exit_on_user_error(main)` runs a script's main(): a UserInputError ends the process with
`<script>: error: <message>` on stderr and exit status 2. Every other exception is a bug or an
environment failure and keeps its traceback.

UserInputError is a ValueError, so callers that catch ValueError (and tests) keep working.
"""

from __future__ import annotations

import os
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
        sys.exit(2)

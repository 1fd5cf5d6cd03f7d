"""The tools' paths: a bad one ends a tool in one line, exit status 2, as bad input ends the scripts.

Each tool checks the paths it was given right after parsing its arguments, before any work (a benchmark
that ran for minutes must not fail at the end on its --json path):

- `output_file(flag, path)`: a file to write: absent or a regular file (never a directory, device, FIFO
  or socket, which the tools' atomic writes would rename over), and its directory exists or can be created
  in a writable place;
- `output_dir(flag, path)`: a directory to write into: a directory or creatable, in a writable place;
- `input_file(flag, path)` / `input_dir(flag, path)`: must exist as a regular file / a directory.

Each raises a UserInputError naming the flag and the path. `positive_counts(parser, args, *flags)`: the
tools' counts and sizes (images, workers, batch size) must be at least 1, else argparse's own error;
`positive_number(flag, text, what)`: a bound or a factor, finite and above 0, else a UserInputError. `run(main)` runs a tool's main() from its
`__main__` block: a UserInputError, or an OSError naming a file (a path that went bad while the tool ran,
a full disk), ends the tool with `<tool>: error: <message>` on stderr and exit status 2; main()'s integer
result is the exit status.

The kit's own files are found here too, one way from a checkout and from an installed package: the package sits in
the kit's directory (`KIT`) beside the two training scripts (`SCRIPTS`), as the README installs it (`pip install -e
.`); `kit_script(kind)` refuses in one line where a copy of the package alone has no scripts beside it. The stand-ins
for Habana's software that run the Gaudi script on a machine without it ship with the tools (`HABANA_STANDIN`,
`habana_standin_env`; habana_standin/README.md).
"""

from __future__ import annotations

import errno
import math
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path

from bridgetower_bench.output_dir.disk_space import describe_bytes, free_bytes
from bridgetower_bench.output_dir.run_directory import uncreatable
from bridgetower_bench.redaction import redact_text
from bridgetower_bench.regular_files import not_regular_reason
from bridgetower_bench.user_errors import UserInputError, freeze_imports


KIT = Path(__file__).resolve().parents[2]
SCRIPTS = {"gaudi": KIT / "run_bridgetower.py", "cuda": KIT / "run_bridgetower_cuda.py"}
HABANA_STANDIN = Path(__file__).resolve().parent / "habana_standin"
# The variable the stand-in's `pip` answers optimum-habana's version check with (habana_standin/README.md).
STANDIN_VERSION = "HABANA_STANDIN_SOFTWARE_VERSION"


def kit_script(kind: str) -> Path:
    """The training script of `kind` ("gaudi" or "cuda") beside the package; a UserInputError where it is not."""
    script = SCRIPTS[kind]
    if not script.is_file():
        raise UserInputError(
            f"{script.name} is not beside the package in {KIT}: the tools run the scripts from the kit's own "
            "directory; install the kit from it with `pip install -e .` (README)"
        )
    return script


def habana_standin_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a process needs on top of `environ` to run the Gaudi script without Habana's software: the stand-ins'
    `habana_frameworks` first on PYTHONPATH, their `pip` first on PATH, and the Intel Gaudi software version that
    `pip` reports: the installed habana-pyhlml's (Habana's own package, pinned to the line optimum-habana targets)."""
    try:
        version = metadata.version("habana-pyhlml")
    except metadata.PackageNotFoundError:
        raise UserInputError(
            "the Gaudi script runs here without Habana's software only with habana-pyhlml installed (its version is "
            "the Intel Gaudi software's the stand-ins report): pip install -r requirements-gaudi.txt"
        ) from None
    pythonpath = [str(HABANA_STANDIN)] + [p for p in [environ.get("PYTHONPATH")] if p]
    return {
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "PATH": os.pathsep.join([str(HABANA_STANDIN / "bin"), environ.get("PATH", "")]),
        STANDIN_VERSION: version,
    }


def _writable_place(flag: str, path: str, what: str) -> None:
    """The nearest existing ancestor of `path` must be a directory this process may write into."""
    where = uncreatable(path)
    if where and where.not_a_directory:
        raise UserInputError(f"{flag}={path}: cannot create the {what}: {where.ancestor} is a file, not a directory")
    if where:
        raise UserInputError(f"{flag}={path}: cannot create the {what}: {where.ancestor} is not writable")


def output_file(flag: str, path) -> None:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise UserInputError(f"{flag}={path} is a directory; give a file name to write")
    if os.path.exists(path):
        reason = not_regular_reason(os.stat(path).st_mode)
        if reason:
            raise UserInputError(f"{flag}={path}: {reason}; give the name of a regular file to write")
        if not os.access(path, os.W_OK):
            raise UserInputError(f"{flag}={path} is not writable")
        return
    _writable_place(flag, path, "file")


def output_dir(flag: str, path) -> None:
    path = os.fspath(path)
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise UserInputError(f"{flag}={path} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserInputError(f"{flag}={path} is not writable")
        return
    _writable_place(flag, path, "directory")


def input_file(flag: str, path) -> None:
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise UserInputError(f"{flag}={path}: {error.strerror}") from None
    reason = not_regular_reason(mode)
    if reason:
        raise UserInputError(f"{flag}={path}: {reason}")


def input_dir(flag: str, path) -> None:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UserInputError(f"{flag}={path}: no such directory")
    if not os.path.isdir(path):
        raise UserInputError(f"{flag}={path} is not a directory")


def positive_counts(parser, args, *flags: str) -> None:
    """parser.error (usage, one error line, exit status 2) for the first of these integer flags below 1."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < 1:
            parser.error(f"{flag} must be at least 1; got {value}")


def positive_number(flag: str, text, what: str) -> float:
    """`text` as a number, finite and above 0 (`nan`, `inf`, 0 and below refused: UserInputError saying `what`)."""
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:
        raise UserInputError(f"{flag} {text}: {what}")
    return number


def run(main: Callable[[], object]) -> None:
    """Run a tool's main() and exit with its status (an int result; 0 otherwise), bad paths in one line."""
    prog = Path(str(sys.modules[main.__module__].__file__)).stem  # `python -m` or `python lab/NAME.py` alike
    freeze_imports()  # (what the tool's imports made: torch's, where it has them)
    try:
        status = main()
    except UserInputError as error:
        _fail(prog, str(error))
    except OSError as error:
        if error.filename is None:
            raise
        detail = error.strerror or str(error)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            detail += f" ({describe_bytes(free_bytes(error.filename))} free there)"
        _fail(prog, f"{error.filename}: {detail}")
    sys.exit(status if isinstance(status, int) else 0)


def _fail(prog: str, message: str) -> None:
    sys.stdout.flush()
    print(f"{prog}: error: {redact_text(message)}", file=sys.stderr, flush=True)
    sys.exit(2)

"""Habana's execution mode: the one a Gaudi run asks for, whether the environment gives it, the one that ran.

Habana's PyTorch bridge picks its mode once, when it loads, from the environment variable
`PT_HPU_LAZY_MODE`: `1` is lazy mode (what upstream's CI measured), `0` eager mode (with or without
`torch.compile`). Since Intel Gaudi software 1.21 the bridge runs eager when the variable is unset.
optimum-habana 1.21.2 reads the same variable with a default of "1": with `--use_lazy_mode` (its default)
and the variable unset it logs "Enabled lazy mode" while the bridge runs eager; it refuses eager mode
without compile only while the variable is not `0`, and asserts that compile ("Dynamo") and lazy mode
exclude each other only when `--torch_compile_backend` or `--torch_compile_mode` turns compile on.

`check_lazy_mode_variable` refuses, in one line and before the arguments are turned into
`GaudiTrainingArguments` (whose set-up loads the bridge), a Gaudi run whose variable does not select the
mode its flags ask for; `mode_that_ran` says which mode the bridge really runs, for the run's record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Optional

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


LAZY_MODE_VARIABLE = "PT_HPU_LAZY_MODE"
LAZY, EAGER, EAGER_COMPILE, NOT_ON_GAUDI = "lazy", "eager", "eager+compile", "n/a"


def asked_mode(use_lazy_mode: bool, torch_compile: bool) -> str:
    """The mode a Gaudi run's flags ask for."""
    if use_lazy_mode:
        return LAZY
    return EAGER_COMPILE if torch_compile else EAGER


def refusal(use_habana: bool, use_lazy_mode: bool, torch_compile: bool, value: Optional[str]) -> Optional[str]:
    """Why a run with these flags cannot start with `PT_HPU_LAZY_MODE` at `value` (None: unset), or None."""
    if not use_habana:  # CPU runs of the Gaudi script (--use_cpu --use_lazy_mode False) load no bridge
        return None
    if use_lazy_mode and torch_compile:
        return (
            f"--use_lazy_mode (the default) with --torch_compile: lazy mode and torch.compile exclude each other on "
            f"Gaudi; for compile pass --use_lazy_mode False and set {LAZY_MODE_VARIABLE}=0, for lazy mode drop the compile flags"
        )
    wanted = "1" if use_lazy_mode else "0"
    if value == wanted:
        return None
    found = "unset" if value is None else repr(value)
    if use_lazy_mode:
        return (
            f"--use_habana with --use_lazy_mode (lazy mode, the default) needs {LAZY_MODE_VARIABLE}=1 in the environment, "
            f"and it is {found} (Habana's bridge would not run lazy mode): rerun as {LAZY_MODE_VARIABLE}=1 python ..."
        )
    if torch_compile:
        return (
            f"--use_habana with --use_lazy_mode False --torch_compile (eager+compile mode) needs {LAZY_MODE_VARIABLE}=0 "
            f"in the environment, and it is {found}: rerun as {LAZY_MODE_VARIABLE}=0 python ..."
        )
    return (
        f"--use_habana with --use_lazy_mode False and no --torch_compile (eager mode) needs {LAZY_MODE_VARIABLE}=0 in the "
        f"environment, and it is {found}: rerun as {LAZY_MODE_VARIABLE}=0 python ... (or drop --use_lazy_mode False and "
        f"set {LAZY_MODE_VARIABLE}=1 for lazy mode)"
    )


def _asked_flags(parser, argv: list[str]) -> Optional[dict]:
    """use_habana, use_lazy_mode and compile as the arguments give them, read without building the dataclasses."""
    if len(argv) == 2 and argv[1].endswith(
        ".json"
    ):  # a configuration file: its values go to the dataclasses as they are
        try:
            values = json.loads(read_regular_file(argv[1]))  # a FIFO is not waited on
        except (OSError, ValueError):
            return None  # the arguments' own parsing says what is wrong with the file
        if not isinstance(values, dict):
            return None
    else:
        values = vars(parser.parse_known_args(args=argv[1:])[0])
    return {
        "use_habana": bool(values.get("use_habana", False)),
        "use_lazy_mode": bool(values.get("use_lazy_mode", True)),  # GaudiTrainingArguments' default
        # TrainingArguments turns compile on when a compile backend or mode is given
        "torch_compile": any(
            values.get(name) for name in ("torch_compile", "torch_compile_backend", "torch_compile_mode")
        ),
    }


def check_lazy_mode_variable(parser, argv: list[str], environ: Mapping[str, str] = os.environ) -> None:
    """Refuse (UserInputError: one line, exit status 2) a Gaudi run whose PT_HPU_LAZY_MODE does not select the
    mode its flags ask for. Call it before `parser` builds the arguments: their set-up loads Habana's bridge."""
    flags = _asked_flags(parser, argv)
    if flags is None:
        return
    reason = refusal(
        flags["use_habana"], flags["use_lazy_mode"], flags["torch_compile"], environ.get(LAZY_MODE_VARIABLE)
    )
    if reason:
        raise UserInputError(reason)


def mode_that_ran(device_type: str, torch_compile: bool) -> str:
    """The mode Habana's bridge runs, as it reports it (`habana_frameworks.torch.utils.internal.is_lazy()`):
    lazy, eager or eager+compile; `n/a` off an HPU; `unknown` where the bridge cannot say."""
    if device_type != "hpu":
        return NOT_ON_GAUDI
    try:
        from habana_frameworks.torch.utils.internal import is_lazy  # only on Gaudi machines
    except ImportError:
        return "unknown"
    return LAZY if is_lazy() else asked_mode(False, torch_compile)

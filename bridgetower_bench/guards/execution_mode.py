"""Habana's execution mode: the Gaudi run's refusal of a `PT_HPU_LAZY_MODE` that does not select the mode its flags
ask for (the bridge reads it once, when it loads), and the mode the bridge ran (docs/UPSTREAM.md, docs/RUNS.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Optional

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


LAZY_MODE_VARIABLE = "PT_HPU_LAZY_MODE"
LAZY, EAGER, EAGER_COMPILE, NOT_ON_GAUDI = "lazy", "eager", "eager+compile", "n/a"


def refusal(use_habana: bool, use_lazy_mode: bool, torch_compile: bool, value: Optional[str]) -> Optional[str]:
    """Why a run with these flags cannot start with `PT_HPU_LAZY_MODE` at `value` (None: unset), or None."""
    if not use_habana:  # CPU runs of the Gaudi script (--use_cpu --use_lazy_mode False) load no bridge
        return None
    if use_lazy_mode and torch_compile:  # (optimum-habana asserts it only for a compile backend or mode)
        return (
            f"--use_lazy_mode (the default) with --torch_compile: lazy mode and torch.compile exclude each other on "
            f"Gaudi; for compile pass --use_lazy_mode False and set {LAZY_MODE_VARIABLE}=0, for lazy mode drop the compile flags"
        )
    if value == ("1" if use_lazy_mode else "0"):
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


def check_lazy_mode_variable(parser, argv: list[str], environ: Mapping[str, str] = os.environ) -> None:
    """Refuse (UserInputError: one line, exit status 2) a Gaudi run whose PT_HPU_LAZY_MODE does not select the
    mode its flags ask for. Call it before `parser` builds the arguments: their set-up loads Habana's bridge."""
    if len(argv) == 2 and argv[1].endswith(".json"):
        try:
            values = json.loads(read_regular_file(argv[1]))  # as the dataclasses get them; a FIFO is not waited on
        except (OSError, ValueError):
            return  # the arguments' own parsing says what is wrong with the file
        if not isinstance(values, dict):
            return
    else:
        values = vars(parser.parse_known_args(args=argv[1:])[0])
    reason = refusal(
        bool(values.get("use_habana")),
        bool(values.get("use_lazy_mode", True)),  # GaudiTrainingArguments' default
        # TrainingArguments turns compile on when a compile backend or mode is given
        any(values.get(name) for name in ("torch_compile", "torch_compile_backend", "torch_compile_mode")),
        environ.get(LAZY_MODE_VARIABLE),
    )
    if reason:
        raise UserInputError(reason)


def mode_that_ran(device_type: str, torch_compile: bool) -> str:
    """The mode Habana's bridge reports running (`is_lazy()`); `n/a` off an HPU, `unknown` where it cannot say."""
    if device_type != "hpu":
        return NOT_ON_GAUDI
    try:
        from habana_frameworks.torch.utils.internal import is_lazy  # only on Gaudi machines
    except ImportError:
        return "unknown"
    return LAZY if is_lazy() else (EAGER_COMPILE if torch_compile else EAGER)

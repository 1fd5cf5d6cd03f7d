"""Is Habana's software here? Asked before importing optimum-habana, whose version check ends in a traceback
without it: the PyTorch bridge is looked for, not imported (that would load it)."""

from __future__ import annotations

import importlib.util

from bridgetower_bench.user_errors import UserInputError


def habana_software_present() -> bool:
    try:
        return importlib.util.find_spec("habana_frameworks.torch") is not None
    except (ImportError, ValueError):  # no habana_frameworks package, or a broken one
        return False


def require_habana_software() -> None:
    """One line (UserInputError) where Habana's software is missing, before optimum-habana's own check fails."""
    if not habana_software_present():
        raise UserInputError(
            "Habana's software is missing: Intel Gaudi's PyTorch bridge (habana_frameworks.torch) is not installed here; "
            "run inside Habana's PyTorch container (README, Gaudi section), or run_bridgetower_cuda.py on NVIDIA GPUs or the CPU"
        )

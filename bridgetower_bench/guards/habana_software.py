"""Is Habana's software here? The Gaudi entry points ask before importing optimum-habana.

Importing `optimum.habana` (1.21.2) runs a version check that reads `pip list` for habana-torch-plugin and,
outside Habana's PyTorch container, ends in an IndexError traceback. Habana's PyTorch bridge
(`habana_frameworks.torch`, the package the plugin installs) is what the kit looks for instead: found
without importing it (importing it loads the bridge).
"""

from __future__ import annotations

import importlib.util

from bridgetower_bench.user_errors import UserInputError


MISSING = (
    "Habana's software is missing: Intel Gaudi's PyTorch bridge (habana_frameworks.torch) is not installed here; "
    "run inside Habana's PyTorch container (README, Gaudi section), or run_bridgetower_cuda.py on NVIDIA GPUs or the CPU"
)


def habana_software_present() -> bool:
    try:
        return importlib.util.find_spec("habana_frameworks.torch") is not None
    except (ImportError, ValueError):  # no habana_frameworks package, or a broken one
        return False


def require_habana_software() -> None:
    """One line (UserInputError) where Habana's software is missing, before optimum-habana's own check fails."""
    if not habana_software_present():
        raise UserInputError(MISSING)

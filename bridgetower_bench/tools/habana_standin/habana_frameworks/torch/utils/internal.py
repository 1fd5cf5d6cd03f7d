"""Habana stand-in for habana_frameworks.torch.utils.internal: see habana_standin/README.md."""

import os


def is_lazy():
    """Lazy mode only with PT_HPU_LAZY_MODE=1, as Habana's bridge decides since Intel Gaudi software 1.21
    (it reads the variable when it loads; this stand-in reads it at each call)."""
    return os.environ.get("PT_HPU_LAZY_MODE") == "1"

"""Command-line tools (run with `python -m bridgetower_bench.tools.NAME`): they may import the runtime modules,
never the reverse. The modules the commands import are not commands: `python -m` runs any module, and this package
is imported before the one it runs, so run as a command such a module ends here in one line, exit status 2."""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional


def module_run_by_python_m() -> Optional[str]:
    """The module of this package `python -m` is about to run, or None (imported otherwise)."""
    if sys.argv[:1] != ["-m"]:  # (runpy's mark while it looks for the module to run)
        return None
    argv = list(getattr(sys, "orig_argv", ()))
    name = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return name if name.startswith(f"{__name__}.") else None


def is_a_command(name: str) -> bool:
    """Whether module `name` runs as one (it has a `__main__` block); a name that is no module is Python's to say."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return True
    origin = spec.origin if spec is not None and spec.has_location else None
    if origin is None or not origin.endswith(".py"):
        return True  # (no such module, or not Python source: Python says so)
    with open(origin, encoding="utf-8") as f:
        return 'if __name__ == "__main__":' in f.read()


def refuse_a_module_that_is_not_a_command() -> None:
    name = module_run_by_python_m()
    if name is not None and not is_a_command(name):
        print(
            f"python -m {name}: error: a module the kit's commands import, not a command (the commands: "
            'docs/ARCHITECTURE.md, "Tools wing")',
            file=sys.stderr,
        )
        sys.exit(2)


refuse_a_module_that_is_not_a_command()

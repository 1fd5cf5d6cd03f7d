"""The package's two wings (docs/ARCHITECTURE.md): the runtime modules the scripts import never import the
command-line tools, and no package module imports the tests."""

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "bridgetower_bench"
TOOLS = PACKAGE / "tools"
RUNTIME_MODULES = sorted(p for p in PACKAGE.rglob("*.py") if TOOLS not in p.parents)
PACKAGE_MODULES = sorted(PACKAGE.rglob("*.py"))
SCRIPTS = [REPO / "run_bridgetower.py", REPO / "run_bridgetower_cuda.py"]


def imported_modules(path: Path, source: str = None) -> list[str]:
    """Absolute dotted names of everything `path` imports (relative imports resolved against its package)."""
    tree = ast.parse(source if source is not None else path.read_text(), filename=str(path))
    package = list(path.relative_to(REPO).parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]  # `from . import tools`
    return names


def test_the_checker_resolves_every_spelling_of_an_import():
    """Relative imports at both depths, `from . import x` and plain imports all come out as absolute names."""
    runtime = imported_modules(PACKAGE / "any.py", "from .tools import bench\nfrom . import tools\nimport bridgetower_bench.tools.compare\n")
    assert {"bridgetower_bench.tools", "bridgetower_bench.tools.bench", "bridgetower_bench.tools.compare"} <= set(runtime)
    tool = imported_modules(TOOLS / "any.py", "from ..atomic_files import process_alive\nfrom .fixtures import CLIP_MEAN\n")
    assert "bridgetower_bench.atomic_files.process_alive" in tool and "bridgetower_bench.tools.fixtures" in tool


@pytest.mark.parametrize("path", RUNTIME_MODULES + SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_runtime_code_never_imports_the_tools(path):
    offending = [n for n in imported_modules(path) if n == "bridgetower_bench.tools" or n.startswith("bridgetower_bench.tools.")]
    assert not offending, f"{path.relative_to(REPO)} imports the tools wing: {offending}"


@pytest.mark.parametrize("path", PACKAGE_MODULES + SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_package_module_imports_the_tests(path):
    offending = [n for n in imported_modules(path) if n == "tests" or n.startswith(("tests.", "conftest", "habana_shim"))]
    assert not offending, f"{path.relative_to(REPO)} imports test code: {offending}"

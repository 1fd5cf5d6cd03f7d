"""The package's two wings (docs/ARCHITECTURE.md): the runtime modules the scripts import never import the command-line
tools, and no package module imports the tests.

Inside the package, import-linter's contracts (pyproject.toml, `lint-imports`, run by `make test`) state both rules,
and that no two modules of one package import each other, however indirectly; here: that they break when the rules are
broken, and the same rules for the two scripts, which are not part of a package import-linter can analyse."""

import ast
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

from bridgetower_bench.tools import tool_paths
from helpers import REPO


SCRIPTS = [REPO / "run_bridgetower.py", REPO / "run_bridgetower_cuda.py"]


def imported_modules(path: Path) -> list[str]:
    """Dotted names of everything a script imports (`from a import b` gives `a` and `a.b`)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_never_import_the_tools_or_the_tests(path):
    tools_or_tests = ("bridgetower_bench.tools.", "tests", "conftest", "helpers")
    offending = [n for n in imported_modules(path) if n == "bridgetower_bench.tools" or n.startswith(tools_or_tests)]
    assert not offending, f"{path.name} imports the tools wing or test code: {offending}"


def test_the_type_checker_reads_the_package_and_the_scripts_and_ignores_only_single_lines_saying_why():
    import tomllib

    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert {"bridgetower_bench", *(path.name for path in SCRIPTS)} <= set(mypy["files"])
    assert not any(section.get("ignore_errors") for section in [mypy, *mypy.get("overrides", [])])
    for path in SCRIPTS + sorted((REPO / "bridgetower_bench").rglob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            assert "# mypy:" not in line, f"{path}:{number}"  # (inline configuration: e.g. ignore-errors)
            if "type: ignore" in line:  # on a line of code, with an error code, the reason after it or just above
                code, _, ignore = line.partition("# type: ignore")
                said = ignore.partition("]")[2].startswith("  # ") or lines[number - 2].lstrip().startswith("#")
                assert code.strip() and ignore.startswith("[") and said, f"{path}:{number}: {line}"


def mypy_follows(module: str, overrides: list) -> bool:
    """Whether mypy reads `module` under pyproject.toml's overrides: a section naming it exactly wins, else the
    longest `pattern.*` that matches (mypy's precedence)."""

    def rank(pattern: str) -> int:
        if pattern == module:
            return 10_000
        stem = pattern.removesuffix(".*")
        return len(stem) if pattern.endswith(".*") and (module == stem or module.startswith(stem + ".")) else -1

    matching = [(rank(p), section) for section in overrides for p in section["module"] if rank(p) >= 0]
    return not matching or max(matching, key=lambda pair: pair[0])[1].get("follow_imports") != "skip"


def test_nothing_the_package_or_the_scripts_import_is_a_module_the_type_checker_skips():
    import tomllib

    overrides = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    assert not mypy_follows("transformers.models.clip.modeling_clip", overrides)  # (the skip is in force)
    assert mypy_follows("transformers.models.bridgetower.modeling_bridgetower", overrides)
    package = sorted((REPO / "bridgetower_bench").rglob("*.py"))
    skipped = {f"{path.name}: {name}" for path in SCRIPTS + package for name in imported_modules(path)}
    skipped = {entry for entry in skipped if not mypy_follows(entry.split(": ")[1], overrides)}
    assert not skipped, f"imported, yet skipped by mypy (pyproject.toml's follow_imports): {sorted(skipped)}"


def package_copy(tmp_path: Path) -> Path:
    """The package and its contracts copied under tmp_path, to break on purpose."""
    shutil.copytree(
        REPO / "bridgetower_bench", tmp_path / "bridgetower_bench", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path / "bridgetower_bench"


def broken_contracts(root: Path) -> tuple[list[str], str]:
    """lint-imports over the copy under root: the lines naming broken contracts, and its whole report."""
    code = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"
    lint = [sys.executable, "-c", code, "--no-cache"]
    result = subprocess.run(lint, cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if line.endswith("BROKEN")], result.stdout


def test_the_import_contracts_break_when_a_runtime_module_imports_the_tools_or_a_module_imports_the_tests(tmp_path):
    package = package_copy(tmp_path)
    assert broken_contracts(tmp_path)[0] == []
    with open(package / "redaction.py", "a") as f:
        f.write("\nfrom . import tools\n")
    with open(package / "data.py", "a") as f:
        f.write("\nimport helpers\n")
    broken, report = broken_contracts(tmp_path)
    assert len(broken) == 3, report  # the runtime importing the tools is also a circle: the tools import the runtime
    assert "bridgetower_bench.redaction -> bridgetower_bench.tools" in report, report
    assert "bridgetower_bench.data -> helpers" in report, report


def test_the_import_contracts_break_on_an_import_circle_between_two_tools(tmp_path):
    package = package_copy(tmp_path)
    with open(package / "tools" / "sweep" / "cost_report.py", "a") as f:
        f.write("\nfrom .. import bench\n")  # bench imports cost_report
    broken, report = broken_contracts(tmp_path)
    assert broken == ["No import circles between the modules (or packages) of one package BROKEN"], report
    assert "No cycles are allowed in bridgetower_bench.tools." in report


def test_the_package_never_names_the_tests_directory_and_ships_what_it_puts_on_a_path():
    """No path into tests/ in the package's code (a string, not a comment): what the product needs it ships, as
    the Habana stand-ins, which pyproject.toml's package data carries (they are files, not the package's modules)."""
    naming_tests = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in (REPO / "bridgetower_bench").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if node.value == "tests" or node.value.startswith(("tests/", "tests" + os.sep))
    ]
    assert not naming_tests, f"the package names the tests' directory: {naming_tests}"
    shipped = read_configuration(REPO / "pyproject.toml")["tool"]["setuptools"]["package-data"]
    standin = [p for p in tool_paths.HABANA_STANDIN.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert {"README.md", "pip", "internal.py"} <= {p.name for p in standin}
    package = REPO / "bridgetower_bench"
    globbed = {
        package / f
        for pattern in shipped["bridgetower_bench"]
        for f in glob.glob(pattern, root_dir=package, recursive=True)
    }
    assert not set(standin) - globbed, "not shipped as package data"
    assert os.access(tool_paths.HABANA_STANDIN / "bin" / "pip", os.X_OK)

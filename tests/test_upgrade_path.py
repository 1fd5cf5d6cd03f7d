"""The upgrade path holds: every version the kit pins has one home, the requirements files (published facts:
bridgetower_bench/published.py; upstream's example: tools/upstream_diff.py), and everything else reads it.

A pinned version (`==`, or a `>=A.B,<A.B+1` line) written anywhere in the kit's code, scripts or configuration is a
copy that a bump leaves behind: the scan below fails naming the file and line. The docs may quote versions (the
README's install notes, measured results with the versions they ran): a bump rereads them by the checklist in
docs/DEVELOPMENT.md, and only the upstream commit they name is checked here against its home."""

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from setuptools.config.pyprojecttoml import read_configuration

from bridgetower_bench.tools import tool_paths, upstream_diff
from helpers import BOTH_ROUTES, REPO


# Where the kit keeps code, scripts and configuration; the homes of the versions are not scanned.
SCANNED = ("bridgetower_bench", "lab", "scripts", "tests", "patches")
SUFFIXES = {".py", ".sh", ".toml", ".sbatch", ".patch", ".json", ""}  # "": Makefile, the stand-ins' pip
HOMES = {REPO / "bridgetower_bench" / "published.py"}


def pinned_versions() -> dict[str, str]:
    """{version as written: 'package in file'} for every exact pin and every one-line range of the requirements files;
    a range's line (A.B) stands for every A.B.N."""
    pins = {}
    for path in sorted(REPO.glob("requirements*.txt")):
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            requirement = Requirement(line)
            specs = {spec.operator: Version(spec.version) for spec in requirement.specifier}
            if "==" in specs:
                pins.setdefault(specs["=="].public, f"{requirement.name} in {path.name}")
            elif ">=" in specs and "<" in specs and specs["<"].release[:1] == specs[">="].release[:1]:
                major, minor = specs[">="].release[:2]
                if specs["<"].release[:2] == (major, minor + 1):
                    pins.setdefault(f"{major}.{minor}", f"{requirement.name}'s line in {path.name}")
    return pins


def kit_files():
    yield from (p for p in REPO.iterdir() if p.is_file() and (p.suffix in {".py", ".toml"} or p.name == "Makefile"))
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts and path not in HOMES:
                yield path


def test_no_pinned_version_is_written_outside_its_home():
    pins = pinned_versions()
    assert {"transformers in requirements.txt", "optimum-habana in requirements-gaudi.txt"} <= set(pins.values())
    assert "habana-pyhlml's line in requirements-gaudi.txt" in pins.values()
    # A release (A.B.C, or a build of it: +cu130), a line's release (A.B.N) or a release's line named as such (A.B line).
    lines_named = {version.rsplit(".", 1)[0]: version for version in pins if version.count(".") == 2}

    def pinned(token: str) -> str | None:
        number, _, line = token.partition(" ")
        if line:
            return lines_named.get(number)
        prefixes = [".".join(number.split(".")[:n]) for n in range(2, number.count(".") + 1)]  # (proper ones)
        return number if number in pins else next((p for p in prefixes if p in pins and p.count(".") == 1), None)

    copies = [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)} ({pins[version]})"
        for path in kit_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for match in re.finditer(r"(?<![\w.])\d+(?:\.\d+)+(?: line\b)?", line)
        if (version := pinned(match.group(0)))
    ]
    assert not copies, "pinned versions written outside the requirements files:\n" + "\n".join(copies)


def test_the_docs_name_the_upstream_commit_its_home_pins():
    commit = upstream_diff.UPSTREAM_COMMIT
    assert upstream_diff.UPSTREAM_URL.count(commit) == 1
    named = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in re.finditer(r"optimum-habana/(?:blob|tree|raw)/([0-9a-f]{7,40})|commit `?([0-9a-f]{7,40})", text):
            named.setdefault(match.group(1) or match.group(2), []).append(path.name)
        named.update({c: named.get(c, []) + [path.name] for c in re.findall(r"\bat ([0-9a-f]{8})\b", text)})
    assert named, "the docs name no upstream commit"
    others = {sha: where for sha, where in named.items() if not commit.startswith(sha)}
    assert not others, f"the docs name another upstream commit than tools/upstream_diff.py's {commit}: {others}"


def requirement_lines(name: str) -> list[Requirement]:
    lines = [line.split("#", 1)[0].strip() for line in (REPO / name).read_text().splitlines()]
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def declared() -> dict[str, Requirement]:
    dependencies = read_configuration(REPO / "pyproject.toml")["project"]["dependencies"]
    return {canonicalize_name(Requirement(line).name): Requirement(line) for line in dependencies}


# Imported by the package but not declared in pyproject.toml, and why.
NOT_DECLARED = {
    "torch": "left to accelerate's and torchvision's requirements (pyproject.toml says why)",
    "optimum": "the Gaudi script's (requirements-gaudi.txt)",
    "habana_frameworks": "Habana's software, in its images",
    "deepspeed": "Habana's build, in its images (launch_gaudi across nodes)",
    "pyhlml": "the HPU's energy counter, optional",
    "pynvml": "the GPU's energy counter, optional",
}


@BOTH_ROUTES
def test_pyproject_declares_what_the_package_imports_with_bounds_every_route_meets():
    """`pip install -e .` alone gives a package that imports: every module the package and the CUDA script import as
    they load comes with a declared dependency (or one of theirs), and every other it imports is declared or named in
    NOT_DECLARED; the install routes' pins lie within pyproject's bounds, their bounds are pyproject's own."""
    needed = declared()
    for route in ("requirements.txt", "requirements-cuda.txt", "requirements-cuda-current.txt"):
        for listed in requirement_lines(route):
            requirement = needed.get(canonicalize_name(listed.name))
            exact = [spec.version for spec in listed.specifier if spec.operator == "=="]
            if requirement is not None and exact:
                assert requirement.specifier.contains(Version(exact[0]).public), f"{route}: {listed} ({requirement})"
            elif requirement is not None:
                assert listed.specifier == requirement.specifier, f"{route}: {listed} is not {requirement}"

    brought, todo = set(), list(needed)  # what installing them brings (installed metadata, extras left out)
    while todo:
        name = todo.pop()
        if name not in brought:
            brought.add(name)
            for line in metadata.requires(name) or []:
                requirement = Requirement(line)
                if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                    todo.append(canonicalize_name(requirement.name))
    providers = metadata.packages_distributions()

    def installed_by(module: str, names: set) -> bool:
        return bool({canonicalize_name(d) for d in providers.get(module, [])} & names)

    files = [p for p in (REPO / "bridgetower_bench").rglob("*.py") if tool_paths.HABANA_STANDIN not in p.parents]
    files.append(REPO / "run_bridgetower_cuda.py")
    third_party = {
        module: path.relative_to(REPO)
        for path in files
        for module in imported(path)
        if module not in sys.stdlib_module_names and module != "bridgetower_bench"
    }
    undeclared = {
        m: str(p) for m, p in third_party.items() if not installed_by(m, set(needed)) and m not in NOT_DECLARED
    }
    assert not undeclared, f"imported, but neither declared in pyproject.toml nor in NOT_DECLARED: {undeclared}"
    at_load = {m for path in files for m in imported(path, at_load=True)} & set(third_party)
    assert "torch" in at_load and installed_by("torch", brought), "accelerate or torchvision brings torch"
    unavailable = sorted(m for m in at_load if (m in NOT_DECLARED and m != "torch") or not installed_by(m, brought))
    assert not unavailable, f"imported as the package loads, but no declared dependency installs it: {unavailable}"


def imported(path: Path, at_load: bool = False) -> set[str]:
    """The top-level names a module imports; `at_load`: only as it loads (its module-level statements, not those in a
    `try` that handles ImportError, an `if` or a function)."""
    names = set()
    tree = ast.parse(path.read_text())
    for node in tree.body if at_load else ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names

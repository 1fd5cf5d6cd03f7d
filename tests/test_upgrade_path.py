"""The upgrade path holds: every version the kit pins has one home, the requirements files (published facts:
bridgetower_bench/published.py; upstream's example: tools/upstream_diff.py), and everything else reads it.

A pinned version (`==`, or a `>=A.B,<A.B+1` line) written anywhere in the kit's code, scripts or configuration is a
copy that a bump leaves behind: the scan below fails naming the file and line. The docs may quote versions (the
README's install notes, measured results with the versions they ran): a bump rereads them by the checklist in
docs/DEVELOPMENT.md, and only the upstream commit they name is checked here against its home."""

import re

from packaging.requirements import Requirement
from packaging.version import Version

from bridgetower_bench.tools import upstream_diff
from helpers import REPO


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

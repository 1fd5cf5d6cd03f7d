"""Diff the Gaudi script against upstream's example: arguments, the unified diff, where each step went.

    python -m bridgetower_bench.tools.upstream_diff                 # fetches upstream at the pinned commit
    python -m bridgetower_bench.tools.upstream_diff --upstream run_bridgetower.py   # a local copy instead

Upstream is optimum-habana's ``examples/contrastive-image-text/run_bridgetower.py``. Fetched, it is
taken from GitHub at ``UPSTREAM_COMMIT`` and must have ``UPSTREAM_SHA256``; a local copy is compared as
it is (its hash is printed, with whether it is the pinned file). Neither file is imported: the argument
dataclasses are read with ``ast``, so nothing of upstream runs. Three sections:

* ``arguments``: every field of both scripts' argument dataclasses, with its type and default;
* ``diff``: the unified diff from upstream's file to ours;
* ``steps``: upstream's numbered steps (``# N. ...`` comments), each with the step of our script that
  does its work and the package functions that step calls.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import re
import sys
import urllib.request
from pathlib import Path

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.tools import tool_paths


UPSTREAM_COMMIT = "1d8504c6c7666a19d71968dba50976dceaf7c6b6"
UPSTREAM_URL = (
    "https://raw.githubusercontent.com/huggingface/optimum-habana/"
    f"{UPSTREAM_COMMIT}/examples/contrastive-image-text/run_bridgetower.py"
)
UPSTREAM_SHA256 = "10ae69f6342119d98c9434f0921805b0923a99e69d775311e2a5c57a9c81ab28"
OUR_SCRIPT = Path(__file__).resolve().parents[2] / "run_bridgetower.py"
PACKAGE = "bridgetower_bench"
SECTIONS = ("arguments", "diff", "steps")

# Upstream's step (at the pinned commit) -> the step of our script that does its work. Our script keeps
# upstream's order and numbers; prediction on the test split is our step 11, so upstream's last step (the
# model card and the hub) is our step 12.
OUR_STEP_OF_UPSTREAM_STEP = {n: n for n in range(1, 11)} | {11: 12}

_STEP_COMMENT = re.compile(r"^\s*# (\d+)\. (.*)$")


# ------------------------------------------------------------------------------------------------
# Reading the two files
# ------------------------------------------------------------------------------------------------


def fetch_upstream(url: str = UPSTREAM_URL, sha256: str = UPSTREAM_SHA256, timeout: float = 30.0) -> str:
    """Upstream's example from ``url``; ``ValueError`` when it cannot be fetched or its sha256 differs."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            content = response.read()
    except OSError as error:
        raise ValueError(f"cannot fetch {url}: {error} (without a network, pass --upstream PATH)") from error
    digest = hashlib.sha256(content).hexdigest()
    if digest != sha256:
        raise ValueError(f"{url} has sha256 {digest}, not the pinned {sha256}")
    return content.decode("utf-8")


def read_source(path: str | Path, flag: str) -> str:
    try:
        return read_regular_file(path).decode(
            "utf-8"
        )  # a FIFO refused, not waited on; newlines kept as they are: the hash is the file's
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{flag} {str(path)!r}: cannot read it ({getattr(error, 'strerror', None) or error})"
        ) from error


def parse_source(source: str, label: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as error:
        raise ValueError(f"{label}: not Python source (line {error.lineno}: {error.msg})") from error


# ------------------------------------------------------------------------------------------------
# (a) arguments
# ------------------------------------------------------------------------------------------------


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass"
    )


def _default_of(value: ast.expr | None) -> str:
    """A field's default as source text: ``field(default=...)`` unwrapped, ``(required)`` when there is none."""
    if value is None:
        return "(required)"
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
        for keyword in value.keywords:
            if keyword.arg == "default":
                return ast.unparse(keyword.value)
            if keyword.arg == "default_factory":
                return f"{ast.unparse(keyword.value)}()"
        return "(required)"
    return ast.unparse(value)


def argument_fields(tree: ast.Module) -> dict[str, tuple[str, str, str]]:
    """Field name -> (dataclass, type, default) over the module's top-level dataclasses, in source order."""
    fields: dict[str, tuple[str, str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or not any(map(_is_dataclass_decorator, node.decorator_list)):
            continue
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                fields[statement.target.id] = (
                    node.name,
                    ast.unparse(statement.annotation),
                    _default_of(statement.value),
                )
    return fields


def compare_arguments(upstream: dict, ours: dict) -> list[tuple[str, str, str, str]]:
    """Rows (name, upstream "type = default", ours "type = default", verdict), upstream's order first."""
    rows = []
    for name in list(upstream) + [n for n in ours if n not in upstream]:
        theirs, mine = upstream.get(name), ours.get(name)
        if theirs is None:
            verdict = "ours only"
        elif mine is None:
            verdict = "upstream only"
        else:
            differences = [what for what, i in (("type", 1), ("default", 2)) if theirs[i] != mine[i]]
            verdict = (
                " and ".join(differences) + (" differs" if len(differences) == 1 else " differ")
                if differences
                else "same"
            )
        rows.append((name, _describe(theirs), _describe(mine), verdict))
    return rows


def _describe(entry: tuple[str, str, str] | None) -> str:
    return "-" if entry is None else f"{entry[1]} = {entry[2]}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, tuple("-" * w for w in widths), *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


# ------------------------------------------------------------------------------------------------
# (c) steps
# ------------------------------------------------------------------------------------------------


def numbered_steps(source: str) -> list[tuple[int, str, int]]:
    """(number, title, line) of every ``# N. title`` comment, in order."""
    steps = []
    for line_number, line in enumerate(source.splitlines(), start=1):
        match = _STEP_COMMENT.match(line)
        if match:
            steps.append((int(match.group(1)), match.group(2).strip(), line_number))
    return steps


def package_calls_by_step(tree: ast.Module, source: str) -> dict[int, list[str]]:
    """Our step number -> the package functions called in it (``module.function``), in order of first call."""
    modules, functions = {}, {}  # local name -> package module; local name -> "module.function"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            for alias in node.names:
                local = alias.asname or alias.name
                if node.module == PACKAGE:
                    modules[local] = alias.name
                else:
                    functions[local] = f"{node.module.split('.', 1)[1]}.{alias.name}"
    steps = numbered_steps(source)
    found = []  # (line, step, name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = node.func
        if isinstance(called, ast.Attribute) and isinstance(called.value, ast.Name) and called.value.id in modules:
            name = f"{modules[called.value.id]}.{called.attr}"
        elif isinstance(called, ast.Name) and called.id in functions:
            name = functions[called.id]
        else:
            continue
        step = _step_at(steps, node.lineno)
        if step is not None:
            found.append((node.lineno, step, name))
    calls: dict[int, list[str]] = {number: [] for number, _, _ in steps}
    for _, step, name in sorted(found):
        if name not in calls[step]:
            calls[step].append(name)
    return calls


def _step_at(steps: list[tuple[int, str, int]], line: int) -> int | None:
    current = None
    for number, _, start in steps:
        if start > line:
            break
        current = number
    return current


def step_map(upstream_source: str, our_source: str, our_tree: ast.Module) -> list[tuple[str, str, str]]:
    """Rows (upstream step, our step, package functions it calls)."""
    our_titles = {number: title for number, title, _ in numbered_steps(our_source)}
    calls = package_calls_by_step(our_tree, our_source)
    rows = []
    for number, title, _ in numbered_steps(upstream_source):
        ours = OUR_STEP_OF_UPSTREAM_STEP.get(number)
        if ours is None or ours not in our_titles:
            rows.append((f"{number}. {title}", "(no step of ours mapped)", ""))
            continue
        rows.append((f"{number}. {title}", f"{ours}. {our_titles[ours]}", ", ".join(calls.get(ours, [])) or "-"))
    return rows


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def report(upstream_source: str, our_source: str, upstream_label: str, our_label: str, sections=SECTIONS) -> str:
    upstream_tree = parse_source(upstream_source, upstream_label)
    our_tree = parse_source(our_source, our_label)
    parts = []
    if "arguments" in sections:
        rows = compare_arguments(argument_fields(upstream_tree), argument_fields(our_tree))
        differing = sum(verdict != "same" for *_, verdict in rows)
        parts += [
            f"== Arguments ({len(rows)} fields, {differing} not the same)",
            "",
            _table(("argument", "upstream", "ours", ""), rows),
            "",
        ]
    if "diff" in sections:
        diff = difflib.unified_diff(
            upstream_source.splitlines(keepends=True),
            our_source.splitlines(keepends=True),
            fromfile=upstream_label,
            tofile=our_label,
        )
        parts += ["== Unified diff, upstream -> ours", "", "".join(diff).rstrip("\n"), ""]
    if "steps" in sections:
        parts += [
            "== Where upstream's steps live now",
            "",
            _table(
                ("upstream step", "our step", "package functions called there"),
                step_map(upstream_source, our_source, our_tree),
            ),
            "",
        ]
    return "\n".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bridgetower_bench.tools.upstream_diff", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--upstream",
        default=None,
        help=f"upstream's run_bridgetower.py (default: fetch it at commit {UPSTREAM_COMMIT[:12]}, hash checked)",
    )
    parser.add_argument(
        "--ours", default=str(OUR_SCRIPT), help="our Gaudi script (default: this checkout's run_bridgetower.py)"
    )
    parser.add_argument("--section", choices=SECTIONS + ("all",), default="all", help="print one section only")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.upstream is None:
            upstream_source, upstream_label = fetch_upstream(), f"upstream@{UPSTREAM_COMMIT[:12]}/run_bridgetower.py"
        else:
            upstream_source, upstream_label = read_source(args.upstream, "--upstream"), args.upstream
        our_source = read_source(args.ours, "--ours")
        sections = SECTIONS if args.section == "all" else (args.section,)
        text = report(upstream_source, our_source, upstream_label, "ours/run_bridgetower.py", sections)
    except ValueError as error:
        print(f"upstream_diff: {error}", file=sys.stderr)
        return 2
    if args.upstream is not None:
        digest = hashlib.sha256(upstream_source.encode("utf-8")).hexdigest()
        pinned = "the pinned file" if digest == UPSTREAM_SHA256 else f"not the pinned file ({UPSTREAM_SHA256[:12]}...)"
        print(f"upstream: {args.upstream}, sha256 {digest[:12]}..., {pinned}\n")
    print(text)
    return 0


if __name__ == "__main__":
    tool_paths.run(main)

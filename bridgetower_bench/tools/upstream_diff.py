"""Compare the Gaudi script with upstream's example: a short account by default, the full diff with --full.

    python -m bridgetower_bench.tools.upstream_diff                 # fetches upstream at the pinned commit
    python -m bridgetower_bench.tools.upstream_diff --upstream run_bridgetower.py   # a local copy instead
    python -m bridgetower_bench.tools.upstream_diff --full          # the argument table, the unified diff, ...

Upstream is optimum-habana's ``examples/contrastive-image-text/run_bridgetower.py``. Fetched, it is
taken from GitHub at ``UPSTREAM_COMMIT`` and must have ``UPSTREAM_SHA256``; a local copy is compared as
it is (its hash is printed, with whether it is the pinned file). Neither file is imported: the argument
dataclasses are read with ``ast``, so nothing of upstream runs.

The account, in lines of at most ``WIDTH`` characters: each upstream step (``# N. ...`` comments) beside
the step of ours that does its work, our prediction step included; each argument that differs, with its
reason; each deliberate difference with its reason and where its upstream side is in the given file (the
line of the code it is about, found by ``UPSTREAM_SIDE``, or "not in this file": a newer upstream may have
changed it, so its reason may no longer apply), or that it lies in upstream's libraries, or that it is ours
only. The reasons are read from docs/UPSTREAM.md (its "Flags this port adds" and "Differences from the
upstream example" tables), their one home. ``--full``
(or ``--section``) prints instead every field of both scripts' argument dataclasses, the unified diff
from upstream's file to ours, and the package functions each of our steps calls.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import io
import re
import sys
import textwrap
import tokenize
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.tools import tool_paths


UPSTREAM_COMMIT = "1d8504c6c7666a19d71968dba50976dceaf7c6b6"
UPSTREAM_URL = (
    "https://raw.githubusercontent.com/huggingface/optimum-habana/"
    f"{UPSTREAM_COMMIT}/examples/contrastive-image-text/run_bridgetower.py"
)
UPSTREAM_SHA256 = "10ae69f6342119d98c9434f0921805b0923a99e69d775311e2a5c57a9c81ab28"
OUR_SCRIPT = tool_paths.SCRIPTS["gaudi"]
NOTES = tool_paths.KIT / "docs" / "UPSTREAM.md"
NOTES_LABEL = "docs/UPSTREAM.md"
FLAGS_TABLE, DIFFERENCES_TABLE = "## Flags this port adds", "## Differences from the upstream example"
PACKAGE = "bridgetower_bench"
SECTIONS = ("arguments", "diff", "steps")
WIDTH = 100  # the account's lines fit a terminal; --full's diff keeps the sources' lines as they are

# Upstream's step (at the pinned commit) -> the step of our script that does its work. Our script keeps
# upstream's order and numbers; prediction on the test split is our step 11, so upstream's last step (the
# model card and the hub) is our step 12.
OUR_STEP_OF_UPSTREAM_STEP = {n: n for n in range(1, 11)} | {11: 12}


@dataclass(frozen=True)
class Side:
    """Where a difference's upstream side is: code in upstream's file that ``pattern`` finds (or, with
    ``absent``, code the file must not have), else ``elsewhere``: a library's behaviour, not a line of the file."""

    pattern: str = ""
    absent: bool = False
    elsewhere: str = ""


def has(pattern: str) -> Side:
    return Side(pattern)


def lacks(pattern: str) -> Side:
    return Side(pattern, absent=True)


def elsewhere(where: str) -> Side:
    return Side(elsewhere=where)


# Each row of docs/UPSTREAM.md's differences table (by its first cell) -> its upstream side (rows whose upstream
# cell is "—" are ours only). The patterns are regular expressions over upstream's whole file (so ``\s*`` spans
# lines); at the pinned commit every one is found (``tests/test_upstream_diff.py`` keeps each row covered).
UPSTREAM_SIDE = {
    "image modes": has(r"len\(image_or_path\.getbands\(\)\) == 1"),
    "alpha, palettes, 16 bits in files": has(r"read_image\([^)]*ImageReadMode\.RGB"),
    "EXIF orientation": has(r"read_image\("),
    "embedded image bytes": has(r"ISO-8859-1|[Ll]atin-?1"),
    "splits": has(r"if \"test\" not in dataset"),
    "data files": has(r"assert extension in"),
    "csv missing-value markers": has(r"load_dataset\(\s*extension,"),
    "image size": has(r"Image\.open\("),
    "column names": has(r"image_column not in column_names"),
    "`--do_predict`": lacks(r"\.predict\("),
    "`--config_name`": lacks(r"model_args\.config_name"),
    "`--use_fast_tokenizer False`": has(r"use_fast=model_args\.use_fast_tokenizer"),
    "`--trust_remote_code`": has(r"load_dataset\([^)]*trust_remote_code="),
    "`--freeze_vision_model`, `--freeze_text_model`": has(r"_freeze_params\(model\.vision_model\)"),
    "`--gaudi_config_name`": has(r"GaudiConfig\.from_pretrained\(\s*training_args\.gaudi_config_name"),
    "lazy mode": elsewhere("GaudiTrainingArguments"),
    "`--remove_unused_columns`": lacks(r"remove_unused_columns\s*="),
    "media pipeline on parquet data": has(r"datasets\.Image\(decode=False\)"),
    "media pipeline fallback": elsewhere("habana_dataloader_trainer.py"),
    "model card tags": has(r"kwargs\[\"dataset_tags\"\] = data_args\.dataset_name"),
    "media pipeline geometry": elsewhere("the media pipeline"),
    "telemetry": has(r"send_example_telemetry\("),
    "garbage collection": lacks(r"gc\.freeze\("),
    "throughput figures": has(r"save_metrics\(\"train\", train_result\.metrics\)"),
    "evaluation metrics": lacks(r"compute_metrics"),
    "NVIDIA trainer defaults": elsewhere("Trainer"),
    "`--attn_implementation`": lacks(r"attn_implementation"),
    "`hub_token` in `training_args.bin`": elsewhere("Trainer"),
    "files in output_dir": has(r"not training_args\.overwrite_output_dir"),
    "reruns and resumes": has(r"checkpoint = last_checkpoint"),
    "no usable GPU": elsewhere("Trainer"),
    "batch too big for the GPU": elsewhere("torch, Trainer"),
    "persistent workers without workers": elsewhere("DataLoader"),
    "captions, columns, `--max_seq_length`": has(r"captions = list\(examples\[caption_column\]\)"),
}
NOT_HERE, STILL_ABSENT, OURS_ONLY, NO_CHECK = "not in this file", "still absent", "ours only", "no check recorded"


def without_comments(source: str) -> str:
    """``source`` with each comment blanked out, every other character where it was (a commented-out call is gone)."""
    lines = source.splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            (row, start), (_, end) = token.start, token.end
            lines[row - 1] = lines[row - 1][:start] + " " * (end - start) + lines[row - 1][end:]
    return "".join(lines)


def upstream_side(label: str, upstream_cell: str, upstream_code: str) -> str:
    """Where the row's upstream side is in ``upstream_code`` (upstream's file ``without_comments``): "line N" (or
    ``STILL_ABSENT`` for code upstream lacks), ``NOT_HERE``, "in" the library or file of upstream's it lies in,
    ``OURS_ONLY`` or ``NO_CHECK``."""
    if upstream_cell in ("—", "-", ""):
        return OURS_ONLY
    side = UPSTREAM_SIDE.get(label)
    if side is None:
        return NO_CHECK
    if side.elsewhere:
        return f"in {side.elsewhere}"
    match = re.search(side.pattern, upstream_code)
    if side.absent:
        return STILL_ABSENT if match is None else NOT_HERE
    return NOT_HERE if match is None else f"line {upstream_code.count(chr(10), 0, match.start()) + 1}"


_STEP_COMMENT = re.compile(r"^\s*# (\d+)\. (.*)$")
_STEP_CONTINUED = re.compile(r"^\s*#   +(\S.*)$")  # our steps' comments go on, indented, over several lines
_CLAUSE_END = re.compile(r"[.;:](?=\s)|\s\(")


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


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, tuple("-" * w for w in widths), *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


# ------------------------------------------------------------------------------------------------
# (c) steps
# ------------------------------------------------------------------------------------------------


def numbered_steps(source: str) -> list[tuple[int, str, int]]:
    """(number, title, line) of every ``# N. title`` comment, its indented continuation lines joined, in order."""
    steps, lines = [], source.splitlines()
    for line_number, line in enumerate(lines, start=1):
        match = _STEP_COMMENT.match(line)
        if match:
            title = [match.group(2).strip()]
            for following in lines[line_number:]:
                continued = _STEP_CONTINUED.match(following)
                if not continued:
                    break
                title.append(continued.group(1).strip())
            steps.append((int(match.group(1)), " ".join(title), line_number))
    return steps


def first_sentence(text: str) -> str:
    match = re.match(r"(.*?\.)(\s|$)", text)
    return match.group(1) if match else text


def shorten(text: str, room: int) -> str | None:
    """``text``'s first clause (to its first ``.``, ``;``, ``:`` or `` (``), without backticks, or its part up to a
    comma when the clause does not fit in ``room`` characters; None when not even that fits."""
    text = text.replace("`", "").strip()
    match = _CLAUSE_END.search(text)
    clause = (text[: match.start()] if match else text).rstrip(".")
    if len(clause) <= room:
        return clause
    cut = clause.rfind(", ", 0, room + 1)
    return clause[:cut] if cut > 0 else None


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


def step_map(upstream_source: str, our_source: str, our_tree: ast.Module) -> list[tuple[str, str, list[str]]]:
    """Rows (upstream step, our step, package functions it calls) for every step of both scripts, in our order;
    upstream's steps with no step of ours at the end."""
    our_steps = {number: first_sentence(title) for number, title, _ in numbered_steps(our_source)}
    calls = package_calls_by_step(our_tree, our_source)
    upstream_of: dict[int, list[str]] = {}
    unmapped: list[tuple[str, str, list[str]]] = []
    for number, title, _ in numbered_steps(upstream_source):
        ours = OUR_STEP_OF_UPSTREAM_STEP.get(number)
        if ours in our_steps:
            upstream_of.setdefault(ours, []).append(f"{number}. {title}")
        else:
            unmapped.append((f"{number}. {title}", "(no step of ours mapped)", []))
    rows = [
        (" / ".join(upstream_of.get(number, ["(none: ours only)"])), f"{number}. {title}", calls.get(number, []))
        for number, title in our_steps.items()
    ]
    return rows + unmapped


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=f"{label:>8}  ", subsequent_indent=" " * 10)


def render_steps(rows: list[tuple[str, str, list[str]]], with_calls: bool) -> list[str]:
    lines = []
    for upstream, ours, calls in rows:
        lines += _wrapped("upstream", upstream) + _wrapped("ours", ours)
        if with_calls:
            lines += _wrapped("calls", ", ".join(calls) or "-")
    return lines


# ------------------------------------------------------------------------------------------------
# The account: each difference with its reason, read from docs/UPSTREAM.md
# ------------------------------------------------------------------------------------------------


def markdown_table(notes: str, heading: str) -> list[list[str]]:
    """The cells of each row of the first table under ``heading`` (its header and rule left out)."""
    lines = notes.splitlines()
    if heading not in lines:
        raise ValueError(f"{NOTES_LABEL}: no section {heading!r}")
    rows = []
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
        elif rows:
            break
    if len(rows) < 3:
        raise ValueError(f"{NOTES_LABEL}: no table under {heading!r}")
    return rows[2:]


def argument_lines(rows, flags: dict[str, str], differences: list[list[str]]) -> list[str]:
    """One line per argument that differs: what differs, and why (a row of the notes, or what the flag does)."""
    lines = []
    for name, theirs, mine, verdict in rows:
        if verdict == "same":
            continue
        prefix = f"  --{name} ({verdict}): "
        room = WIDTH - len(prefix)
        row = next((i for i, cells in enumerate(differences, 1) if f"`--{name}`" in " ".join(cells[:2])), None)
        if row is not None:
            reason = f"difference {row}: " + (shorten(differences[row - 1][-1], room - 15) or "")
        elif f"--{name}" in flags:
            reason = shorten(flags[f"--{name}"], room) or f"{NOTES_LABEL}, {FLAGS_TABLE[3:]}"
        elif verdict == "type differs" and theirs.endswith(" = None") and mine == f"Optional[{theirs[:-7]}] = None":
            reason = f"{theirs} -> {mine}, annotation only"
        else:
            reason = ("" if verdict == "ours only" else f"{theirs} -> {mine}; ") + f"not in {NOTES_LABEL}"
        lines.append((prefix + reason).rstrip(": "))
    return lines


def difference_lines(differences: list[list[str]], upstream_source: str) -> list[str]:
    """A summary, then one line per row of the notes' differences table: its number, what differs, where its
    upstream side is in ``upstream_source`` (``upstream_side``), and why."""
    lines, places, code = [], [], without_comments(upstream_source)
    for number, (label, upstream, *_, why) in enumerate(differences, 1):
        place = upstream_side(label, upstream, code)
        places.append(place)
        prefix = f"{number:>4}. {label.replace('`', '')} [{place}]: "
        room = WIDTH - len(prefix)
        lines.append(
            prefix + (shorten(why, room) or textwrap.shorten(shorten(why, len(why)) or why, room, placeholder="..."))
        )
    found = sum(place.startswith("line ") or place == STILL_ABSENT for place in places)
    summary = [f"{found} found in the given file", f"{places.count(NOT_HERE)} {NOT_HERE}"]
    summary += [f"{sum(place.startswith('in ') for place in places)} in upstream's libraries or other files"]
    summary += [f"{places.count(place)} {place}" for place in (OURS_ONLY, NO_CHECK) if place in places]
    return textwrap.wrap(f"Upstream's side of each: {', '.join(summary)}.", WIDTH) + lines


def account(upstream_source: str, our_source: str, notes: str, upstream_label: str, our_label: str) -> str:
    upstream_tree = parse_source(upstream_source, upstream_label)
    our_tree = parse_source(our_source, our_label)
    flags = {
        flag: row[-1] for row in markdown_table(notes, FLAGS_TABLE) for flag in re.findall(r"`(--[a-z0-9_]+)", row[0])
    }
    differences = markdown_table(notes, DIFFERENCES_TABLE)
    rows = compare_arguments(argument_fields(upstream_tree), argument_fields(our_tree))
    upstream_count = sum(theirs != "-" for _, theirs, _, _ in rows)
    same = sum(verdict == "same" for *_, verdict in rows)
    return "\n".join(
        [
            f"Reasons in full: {NOTES_LABEL}. Every argument, the unified diff, the functions called: --full.",
            "",
            "== Steps: upstream's, and where each lives now",
            *render_steps(step_map(upstream_source, our_source, our_tree), with_calls=False),
            "",
            f"== Arguments: {same} of upstream's {upstream_count} the same; the others, and ours only",
            *argument_lines(rows, flags, differences),
            "",
            f'== Deliberate differences ({NOTES_LABEL}, "{DIFFERENCES_TABLE[3:]}", row by row)',
            *difference_lines(differences, upstream_source),
            "",
        ]
    )


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
        steps = step_map(upstream_source, our_source, our_tree)
        parts += [
            "== Where upstream's steps live now, and the package functions called there",
            "",
            *render_steps(steps, True),
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
    parser.add_argument(
        "--full", action="store_true", help="every argument, the unified diff, the functions each step calls"
    )
    parser.add_argument("--section", choices=SECTIONS, default=None, help="one part of --full only")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.upstream is None:
            upstream_source, upstream_label = fetch_upstream(), f"upstream@{UPSTREAM_COMMIT[:12]}/run_bridgetower.py"
        else:
            upstream_source, upstream_label = read_source(args.upstream, "--upstream"), args.upstream
        our_source = read_source(args.ours, "--ours")
        if args.full or args.section:
            sections = (args.section,) if args.section else SECTIONS
            text = report(upstream_source, our_source, upstream_label, "ours/run_bridgetower.py", sections)
        else:
            notes = read_source(NOTES, NOTES_LABEL)
            text = account(upstream_source, our_source, notes, upstream_label, "ours/run_bridgetower.py")
    except ValueError as error:
        print(f"upstream_diff: {error}", file=sys.stderr)
        return 2
    if args.upstream is not None:
        digest = hashlib.sha256(upstream_source.encode("utf-8")).hexdigest()
        pinned = "the pinned file" if digest == UPSTREAM_SHA256 else f"not the pinned file ({UPSTREAM_SHA256[:12]}...)"
        print(f"upstream: {args.upstream}, sha256 {digest[:12]}..., {pinned}")
    print(text.rstrip("\n"))
    return 0


if __name__ == "__main__":
    tool_paths.run(main)

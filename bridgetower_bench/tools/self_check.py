"""The self-checks' shared core: `tools/gaudi_check.py` and `tools/nvidia_check.py` are each a table of
what their backend checks (a `Backend`: the device probe, the stack's rows, the Hub's rows, the training steps,
the record's device facts); this module runs one: the command line they share, the steps (each a subprocess with its log,
skipped when too few devices are visible, judged on the run's own `train_results.json`), one table, and one
shareable JSON record (paths relative to the output directory, no credentials).

Exit status: 0 when every check and step passed (warnings allowed), 1 when one failed, 2 when the probe
finds no device of the backend (one line, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from bridgetower_bench.guards.execution_mode import NOT_ON_GAUDI
from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.redaction import shareable
from bridgetower_bench.tools import tool_paths


REPO = tool_paths.KIT  # the kit's directory: the scripts, the requirements files (tool_paths)
OK, WARNING, FAILED, SKIPPED = "ok", "warning", "failed", "skipped"
NO_DEVICE_EXIT = 2


# ----------------------------------------------------------------------------------------
# What was found and what happened
# ----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: a stack check or a training step."""

    name: str
    result: str  # ok / warning / failed / skipped
    detail: str = ""
    seconds: Optional[float] = None
    samples_per_second: Optional[float] = None
    loader: Optional[str] = None
    execution_mode: Optional[str] = None  # what the step's train_results.json says the bridge ran
    log: Optional[str] = None  # relative to the output directory
    command: Optional[list] = None  # paths relative to the output directory


@dataclass
class Step:
    """One training run of the check: its command, where it writes, and the loader it must use."""

    name: str
    command: list
    run_dir: Path  # the script's --output_dir
    log: Path
    expected_loader: str
    needs_devices: int = 1
    expected_mode: str = NOT_ON_GAUDI  # the execution mode train_results.json must record
    env: dict = field(default_factory=dict)  # set for the step's processes


@dataclass
class Ran:
    """What a step runner reports: the exit status, and a note to show (e.g. how it ran)."""

    returncode: int
    note: str = ""


@dataclass
class Backend:
    """What one self-check checks. `devices` is what `probe` found (with a `count`)."""

    tool: str  # "gaudi_check": the prefix of its lines, its record's name
    devices: str  # "HPUs": what a skipped step needs more of
    absent: str  # "not a Gaudi node": the one line's start when the probe finds no device
    probe: Callable[[], Any]  # the devices found, or why there are none (one line)
    stack_rows: Callable[[Any], list[Row]]
    plan_steps: Callable[[dict, Path, argparse.Namespace, Any], list[Step]]  # (fixtures, output_dir, args, devices)
    record_facts: Callable[[Any], dict]  # the record's entries on the devices
    judge_step: Optional[Callable[[Step, Ran, float, Path], Row]] = None  # default: `judge`
    hub_rows: Callable[[], list[Row]] = list  # the published command's Hub names (`tools/hub_check.py`)


def ask_child(function: str, devices: str, env: Optional[dict] = None) -> dict | str:
    """What `function` ("module:name", returning a JSON-able dict or a one-line reason) answers in a child
    python, so that this process never opens a device its training steps need; or why the query failed."""
    module, name = function.split(":")
    code = f"import json; from {module} import {name}; print(json.dumps({name}()))"
    try:
        child = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600, env=env
        )
    except subprocess.TimeoutExpired:
        return f"the {devices} query did not answer within 600 s"
    lines = child.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        error = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the {devices} query failed (exit status {child.returncode}): {error}"


# ----------------------------------------------------------------------------------------
# 1. The stack
# ----------------------------------------------------------------------------------------


def pinned_requirements(files: tuple, repo: Path = REPO) -> list[str]:
    """The requirement lines of `files` (comments and -r lines left out)."""
    lines = []
    for name in files:
        path = repo / name
        if path.is_file():
            for line in path.read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line and not line.startswith("-"):
                    lines.append(line)
    return lines


def requirement_row(line: str, install: str, installed: Callable[[str], str] = metadata.version) -> Row:
    """One pinned package: installed at a version its pin allows? (`install`: the file to install it from)"""
    from packaging.requirements import Requirement

    requirement = Requirement(line)
    pin = str(requirement.specifier) or "any version"
    try:
        version = installed(requirement.name)
    except metadata.PackageNotFoundError:
        return Row(requirement.name, FAILED, f"not installed (pinned: {pin}); pip install -r {install}")
    if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
        return Row(requirement.name, WARNING, f"{version}, pinned: {pin}")
    return Row(requirement.name, OK, f"{version}" + (f" (pinned: {pin})" if requirement.specifier else ""))


# ----------------------------------------------------------------------------------------
# 2. Training steps
# ----------------------------------------------------------------------------------------


def script_flags(
    fixtures: dict,
    run_dir: Path,
    max_steps: int,
    *,
    batch: int = 4,
    rows: int = 64,
    evaluate: bool = True,
    warmup: int = 1,
) -> list[str]:
    """A script's flags for a short run on the fixtures, the same for both checks."""
    from bridgetower_bench.tools.fixtures import script_flags as fixture_flags

    return [
        *fixture_flags(fixtures),
        "--output_dir",
        str(run_dir),
        "--overwrite_output_dir",
        "--do_train",
        *(["--do_eval"] if evaluate else []),
        "--max_steps",
        str(max_steps),
        "--max_train_samples",
        str(rows),
        "--max_eval_samples",
        "16",
        "--per_device_train_batch_size",
        str(batch),
        "--per_device_eval_batch_size",
        "4",
        "--throughput_warmup_steps",
        str(warmup),
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "2",
    ]


def run_command(step: Step, timeout: float, tool: str) -> Ran:
    """The real runner: the step's command as a subprocess, all its output into its log file."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1", **step.env)
    with open(step.log, "w") as log:
        try:
            return Ran(
                subprocess.run(
                    step.command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
                ).returncode
            )
        except subprocess.TimeoutExpired:
            log.write(f"\n{tool}: timed out after {timeout:.0f} s\n")
            return Ran(124)


def last_error_line(log: Path) -> str:
    """The line that says what went wrong: the last one naming an error, else the last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    errors = [line for line in lines if re.search(r"error|exception|timed out|killed", line, re.IGNORECASE)]
    return (errors or lines or ["no output"])[-1][:300]


def judge(step: Step, ran: Ran, seconds: float, output_dir: Path) -> Row:
    """A step's row: failed unless it exited 0, saved its results, and ran the expected loader and mode."""
    row = Row(
        step.name,
        FAILED,
        seconds=round(seconds, 1),
        log=relative(step.log, output_dir),
        command=[f"{name}={value}" for name, value in step.env.items()]
        + [relative(part, output_dir) for part in step.command],
    )
    results_file = step.run_dir / "train_results.json"
    if ran.returncode != 0:
        row.detail = f"exit status {ran.returncode}: {last_error_line(step.log)}"
        return row
    try:
        results = json.loads(results_file.read_text())
    except (OSError, ValueError) as error:
        row.detail = f"no readable train_results.json ({type(error).__name__})"
        return row
    row.loader = results.get("loader")
    row.samples_per_second = results.get("train_samples_per_second")
    row.execution_mode = results.get("execution_mode")
    if row.loader != step.expected_loader:
        row.detail = f"the {step.expected_loader} loader did not run; the run says: {row.loader}"
        return row
    if row.execution_mode != step.expected_mode:
        row.detail = f"asked for {step.expected_mode} mode, but the bridge ran: {row.execution_mode}"
        return row
    row.result, row.detail = OK, ran.note
    return row


def relative(part, output_dir: Path) -> str:
    """A command-line word for the record: paths relative to the output directory (the fixtures are
    there too), the repository's own files relative to it, the interpreter as `python`."""
    text = str(part)
    if text == sys.executable:
        return "python"
    if os.path.isabs(text):
        for root in (output_dir, REPO):
            if Path(text).is_relative_to(root):
                return os.path.relpath(text, root)
        return "<outside the output directory>"
    return text


def run_steps(backend: Backend, steps: list[Step], count: int, output_dir: Path, runner: Callable[[Step], Ran]):
    """Each step the `count` visible devices allow, judged by the backend."""
    rows = []
    for step in steps:
        if count < step.needs_devices:
            rows.append(Row(step.name, SKIPPED, f"needs {step.needs_devices} {backend.devices}, {count} visible"))
            continue
        step.log.parent.mkdir(parents=True, exist_ok=True)
        (step.run_dir / "train_results.json").unlink(missing_ok=True)  # an earlier check's must not count
        print(f"{backend.tool}: running {step.name} (log: {step.log})", flush=True)
        started = time.perf_counter()
        ran = runner(step)
        rows.append((backend.judge_step or judge)(step, ran, time.perf_counter() - started, output_dir))
    return rows


# ----------------------------------------------------------------------------------------
# The table and the record
# ----------------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    header = ("check / step", "result", "seconds", "samples/s", "loader", "mode", "detail")
    return columns(
        header,
        [
            (
                row.name,
                row.result,
                "" if row.seconds is None else f"{row.seconds:.1f}",
                "" if row.samples_per_second is None else f"{row.samples_per_second:.1f}",
                short_loader(row.loader),
                row.execution_mode or "",
                row.detail,
            )
            for row in rows
        ],
    )


def columns(header: tuple, lines: list[tuple]) -> str:
    """A table of text cells in aligned columns (the last one, the detail, left ragged)."""
    cells = [header, *lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header) - 1)]
    return (
        "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in cells
        ).rstrip()
        + "\n"
    )


def short_loader(loader: Optional[str]) -> str:
    """The table's loader cell: a fallback's reason is left to the detail column."""
    if not loader:
        return ""
    return loader.split(" (", 1)[0] + (" (fallback)" if " (" in loader else "")


def record(tool: str, facts: dict, stack: list[Row], steps: list[Row], output_dir: Path) -> dict:
    """The record (the devices' `facts` after the time); paths in it made relative (the home directory as ~)."""
    prefixes = [
        (f"{output_dir}{os.sep}", ""),
        (str(output_dir), "."),
        (f"{REPO}{os.sep}", ""),
        (str(Path.home()), "~"),
    ]

    def scrub(value):
        if isinstance(value, str):
            for prefix, replacement in prefixes:
                value = value.replace(prefix, replacement)
            return value
        if isinstance(value, list):
            return [scrub(item) for item in value]
        if isinstance(value, dict):
            return {key: scrub(item) for key, item in value.items()}
        return value

    return scrub(
        {
            "tool": f"python -m bridgetower_bench.tools.{tool}",
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **facts,
            "passed": not any(row.result == FAILED for row in stack + steps),
            "stack": [asdict(row) for row in stack],
            "steps": [asdict(row) for row in steps],
        }
    )


# ----------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------


def argument_parser(tool: str, description: str, max_steps_help: str, timeout: float) -> argparse.ArgumentParser:
    """The flags both checks take."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bridgetower_bench.tools.{tool}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output_dir", type=Path, default=Path(tool), help="Where the runs, logs and record go.")
    parser.add_argument(
        "--json", type=Path, default=None, help=f"The record's path (default: <output_dir>/{tool}.json)."
    )
    parser.add_argument("--max_steps", type=int, default=5, help=max_steps_help)
    parser.add_argument("--timeout", type=float, default=timeout, help="Seconds allowed per training run.")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, writes: bool = True):
    """Refuse what no check can use; the paths it `writes` are checked before any work."""
    if args.max_steps <= 0:
        parser.error(f"--max_steps={args.max_steps}: must be positive")
    if args.timeout <= 0:
        parser.error(f"--timeout={args.timeout}: must be positive")
    if writes:
        tool_paths.output_dir("--output_dir", args.output_dir)
        if args.json is not None:
            tool_paths.output_file("--json", args.json)
    return args


def run_check(backend: Backend, args: argparse.Namespace, argv, runner: Optional[Callable[[Step], Ran]] = None) -> int:
    """The check: probe, stack, steps, table, record; returns the exit status."""
    devices = backend.probe()
    if isinstance(devices, str):
        print(f"{backend.tool}: {backend.absent}: {devices}; nothing checked.")
        return NO_DEVICE_EXIT
    output_dir = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = (args.json or output_dir / f"{backend.tool}.json").resolve()
    if runner is None:
        runner = lambda step: run_command(step, args.timeout, backend.tool)  # noqa: E731

    stack = backend.stack_rows(devices) + backend.hub_rows()
    from bridgetower_bench.tools.fixtures import ensure_default_fixtures

    fixtures = ensure_default_fixtures(output_dir / "fixtures")  # inside the output directory: the record names them
    steps = run_steps(
        backend, backend.plan_steps(fixtures, output_dir, args, devices), devices.count, output_dir, runner
    )
    print()
    print(format_table(stack + steps), end="")
    # a shareable record: credential values (HF_TOKEN and the like, e.g. echoed in an error line) scrubbed
    report = record(backend.tool, backend.record_facts(devices), stack, steps, output_dir)
    report = shareable(report, args=list(sys.argv[1:] if argv is None else argv))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(json_path, json.dumps(report, indent=2) + "\n")
    print(f"record: {json_path} ({'passed' if report['passed'] else 'FAILED'}; attach it to a bug report)")
    return 0 if report["passed"] else 1

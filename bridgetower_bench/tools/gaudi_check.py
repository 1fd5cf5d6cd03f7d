"""First-run self-check of a Gaudi node: is the software what this kit expects, and does training run?

    PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.gaudi_check [--output_dir gaudi_check] [--json PATH] [--max_steps 5]

1. The stack, read only (nothing is ever installed): Habana's PyTorch (``habana_frameworks``) and
   the HPUs it sees; the Intel Gaudi software version (``habana-torch-plugin``, read the way
   optimum-habana reads it) against the version the installed optimum-habana was validated with;
   every package requirements.txt and requirements-gaudi.txt pin (optimum-habana, transformers,
   accelerate, ...) against its pin; torch, which comes with Habana's image and is never pinned.
2. A few training steps on the embedded fixtures (``bridgetower_bench.tools.fixtures``: tiny
   random-weight BridgeTower, synthetic New Yorker-shaped data, local copy of the Habana/clip Gaudi
   config), each ending with a short evaluation, in lazy mode (``PT_HPU_LAZY_MODE=1``, set for every step)
   with HPU graphs for inference; a step passes only when its ``train_results.json`` says the bridge
   really ran lazy mode. One HPU with the PyTorch loader; one HPU with ``--mediapipe_dataloader``, which only passes
   when the run's ``train_results.json`` says the media pipeline really ran (not the fallback to
   the PyTorch loader); and, when 8 HPUs are visible, the 8-device launcher
   (``bridgetower_bench.tools.launch_gaudi --use_mpi``) with the PyTorch loader.

It prints one table (check or step, result, seconds, samples/s, loader and execution mode that ran,
detail: the version found or the error's last line) and writes it as JSON (``--json``, default
``<output_dir>/gaudi_check.json``) to attach to a bug report. The record holds the environment
(backend, execution mode, torch and Intel Gaudi software versions, driver, HPU name, count and
memory), versions, results and command lines with paths relative to the output directory; of the
environment variables only the one that selects the execution mode; no tokens. Each step's full output is in ``<output_dir>/<step>/log.txt``; the fixtures are built once
in ``<output_dir>/fixtures``.

Exit status: 0 when every check and step passed (version warnings allowed), 1 when one failed,
2 off Gaudi (no Habana PyTorch or no HPU visible), said in one line.
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
from typing import Optional

from ..atomic_files import write_atomically
from ..execution_mode import LAZY, LAZY_MODE_VARIABLE
from ..redaction import shareable
from . import tool_paths


REPO = Path(__file__).resolve().parents[2]
GAUDI_SCRIPT = REPO / "run_bridgetower.py"
REQUIREMENT_FILES = ("requirements.txt", "requirements-gaudi.txt")
LAUNCHER_HPUS = 8
OK, WARNING, FAILED, SKIPPED = "ok", "warning", "failed", "skipped"
NOT_ON_GAUDI_EXIT = 2
# Every step runs lazy mode, as upstream's CI: Habana's bridge reads this when it loads (the HPU probe runs with it too).
STEP_ENVIRONMENT = {LAZY_MODE_VARIABLE: "1"}
ENVIRONMENT_KEYS = (
    "backend",
    "execution_mode",
    "torch_compile",
    "version_torch",
    "version_cuda",
    "version_intel_gaudi",
    "driver_version",
    "device_name",
    "device_count",
    "device_memory_bytes",
)


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
class Hpus:
    count: int
    name: str
    media_pipeline: Optional[str] = None  # why --mediapipe_dataloader cannot start, None when it can
    environment: Optional[dict] = (
        None  # bridgetower_bench.run_record.environment of the first HPU, as the probe saw it
    )


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


def probe_hpus() -> Hpus | str:
    """The visible HPUs, or why this is not a Gaudi node (one line), asked in a child process."""
    answer = ask_child(
        "bridgetower_bench.tools.gaudi_check:hpus_here", "HPU", env=dict(os.environ, **STEP_ENVIRONMENT)
    )
    return answer if isinstance(answer, str) else Hpus(**answer)


def hpus_here() -> dict | str:
    """What ``probe_hpus`` reports, found in this process: HPU count and kind, media pipeline, or why not."""
    try:
        import habana_frameworks.torch.hpu as hpu
    except ModuleNotFoundError:
        return "habana_frameworks is not installed (run this inside Habana's PyTorch container on a Gaudi node)"
    except Exception as error:  # e.g. a missing native library
        return f"habana_frameworks cannot be imported: {type(error).__name__}: {error}"
    try:
        if not hpu.is_available():
            return "no HPU is visible"
        count, name = int(hpu.device_count()), str(hpu.get_device_name())
    except Exception as error:  # the Habana runtime raises assorted types when no device is usable
        return f"cannot query the HPUs: {type(error).__name__}: {error}"
    from ..mediapipe_availability import mediapipe_unavailable_reason
    from ..run_record import environment

    try:
        import torch

        found = environment(torch.device("hpu"))
    except Exception as error:  # the record's fields are a report, never a reason to stop
        found = {"error": f"{type(error).__name__}: {error}"}
    return {"count": count, "name": name, "media_pipeline": mediapipe_unavailable_reason(), "environment": found}


# ----------------------------------------------------------------------------------------
# 1. The stack
# ----------------------------------------------------------------------------------------


def major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def compare_gaudi_software(found: Optional[str], validated: str, optimum_habana: str) -> Row:
    """The Intel Gaudi software version against the one optimum-habana was validated with (major.minor)."""
    name = "Intel Gaudi software"
    if not found:
        return Row(
            name,
            WARNING,
            f"habana-torch-plugin not found by `pip list`; optimum-habana {optimum_habana} was validated with {validated}",
        )
    if major_minor(found) != major_minor(validated):
        return Row(
            name,
            WARNING,
            f"{found}, but optimum-habana {optimum_habana} was validated with {validated}: expect surprises",
        )
    return Row(name, OK, f"{found} (optimum-habana {optimum_habana} validated with {validated})")


def gaudi_software_row() -> Row:
    try:
        from optimum.habana.utils import misc  # importing optimum.habana runs its own version check
        from optimum.habana.version import __version__ as optimum_habana
    except Exception as error:
        return Row(
            "Intel Gaudi software", FAILED, f"optimum-habana cannot be imported: {type(error).__name__}: {error}"
        )
    try:
        found = str(misc.get_habana_frameworks_version())
    except Exception:  # no habana-torch-plugin line in `pip list`
        found = None
    return compare_gaudi_software(found, str(misc.CURRENTLY_VALIDATED_SYNAPSE_VERSION), optimum_habana)


def driver_row() -> Row:
    """The Gaudi driver's version as `hl-smi` reports it (optimum-habana compares it the same way)."""
    try:
        from optimum.habana.utils import misc

        driver = misc.get_driver_version()
        validated = str(misc.CURRENTLY_VALIDATED_SYNAPSE_VERSION)
    except Exception as error:
        return Row("Gaudi driver", WARNING, f"cannot be read: {type(error).__name__}: {error}")
    if driver is None:
        return Row("Gaudi driver", WARNING, "`hl-smi` did not run: the driver version is unknown")
    if major_minor(str(driver)) != major_minor(validated):
        return Row("Gaudi driver", WARNING, f"{driver}, but the Intel Gaudi software {validated} is the validated one")
    return Row("Gaudi driver", OK, str(driver))


def pinned_requirements(repo: Path = REPO, files: tuple = REQUIREMENT_FILES) -> list[str]:
    """The requirement lines of `files` (requirements.txt and requirements-gaudi.txt; comments and -r lines left out)."""
    lines = []
    for name in files:
        path = repo / name
        if path.is_file():
            for line in path.read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line and not line.startswith("-"):
                    lines.append(line)
    return lines


def requirement_row(
    line: str, installed: Callable[[str], str] = metadata.version, install: str = "requirements-gaudi.txt"
) -> Row:
    """One pinned package: installed at a version its pin allows?"""
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


def stack_rows(hpus: Hpus) -> list[Row]:
    memory = (hpus.environment or {}).get("device_memory_bytes")
    each = f", {memory / 2**30:.1f} GiB each" if memory else ""
    rows = [Row("habana_frameworks / HPUs", OK, f"{hpus.count} x {hpus.name}{each}")]
    rows += [gaudi_software_row(), driver_row()]
    try:
        import torch

        rows.append(Row("torch", OK, f"{torch.__version__} (the image's own; never pinned or installed here)"))
    except Exception as error:
        rows.append(Row("torch", FAILED, f"cannot be imported: {type(error).__name__}: {error}"))
    rows.append(media_pipeline_row(hpus))
    rows += [requirement_row(line) for line in pinned_requirements()]
    return rows


def media_pipeline_row(hpus: Hpus) -> Row:
    """Whether --mediapipe_dataloader can start here (its step then shows whether it runs)."""
    if hpus.media_pipeline:
        return Row("media pipeline", WARNING, f"cannot start: {hpus.media_pipeline}")
    try:
        return Row("media pipeline", OK, f"habana-media-loader {metadata.version('habana-media-loader')}")
    except metadata.PackageNotFoundError:
        return Row("media pipeline", OK, "habana_frameworks.mediapipe importable")


# ----------------------------------------------------------------------------------------
# 2. Training steps
# ----------------------------------------------------------------------------------------


@dataclass
class Step:
    """One training run of the check: its command, where it writes, and the loader it must use."""

    name: str
    command: list
    run_dir: Path  # the script's --output_dir
    log: Path
    expected_loader: str
    needs_hpus: int = 1
    expected_mode: str = LAZY  # the execution mode the step asks for (--use_lazy_mode with PT_HPU_LAZY_MODE=1)
    env: dict = field(default_factory=lambda: dict(STEP_ENVIRONMENT))  # set for the step's processes


@dataclass
class Ran:
    """What a step runner reports: the exit status, and a note to show (e.g. how it ran)."""

    returncode: int
    note: str = ""


def run_command(step: Step, timeout: float, tool: str = "gaudi_check") -> Ran:
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


def script_flags(fixtures: dict, run_dir: Path, max_steps: int) -> list[str]:
    """The Gaudi script's flags for a short run on the fixtures: lazy mode, HPU graphs for inference."""
    return [
        "--model_name_or_path",
        str(fixtures["model"]),
        "--dataset_name",
        str(fixtures["dataset"]),
        "--dataset_config_name",
        "matching",
        "--image_column",
        "image",
        "--caption_column",
        "image_description",
        "--output_dir",
        str(run_dir),
        "--overwrite_output_dir",
        "--do_train",
        "--do_eval",
        "--max_steps",
        str(max_steps),
        "--max_train_samples",
        "64",
        "--max_eval_samples",
        "16",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--throughput_warmup_steps",
        "1",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "2",
        "--use_habana",
        "--use_lazy_mode",
        "--use_hpu_graphs_for_inference",
        "--gaudi_config_name",
        str(fixtures["gaudi_config"]),
    ]


def plan_steps(fixtures: dict, output_dir: Path, max_steps: int) -> list[Step]:
    def step(name, expected_loader, extra=(), launcher=(), needs_hpus=1):
        run_dir = output_dir / name / "run"
        command = [*launcher, str(GAUDI_SCRIPT), *script_flags(fixtures, run_dir, max_steps), *extra]
        if not launcher:
            command.insert(0, sys.executable)
        return Step(name, command, run_dir, output_dir / name / "log.txt", expected_loader, needs_hpus)

    from ..mediapipe_availability import MEDIAPIPE_LOADER, TORCH_LOADER

    launcher = [
        sys.executable,
        "-m",
        "bridgetower_bench.tools.launch_gaudi",
        "--world_size",
        str(LAUNCHER_HPUS),
        "--use_mpi",
    ]
    return [
        step("1hpu-pytorch-loader", TORCH_LOADER),
        step("1hpu-media-pipeline", MEDIAPIPE_LOADER, extra=["--mediapipe_dataloader"]),
        step(f"{LAUNCHER_HPUS}hpu-launcher", TORCH_LOADER, launcher=launcher, needs_hpus=LAUNCHER_HPUS),
    ]


def last_error_line(log: Path) -> str:
    """The line that says what went wrong: the last one naming an error, else the last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    errors = [line for line in lines if re.search(r"error|exception|timed out|killed", line, re.IGNORECASE)]
    return (errors or lines or ["no output"])[-1][:300]


def judge(step: Step, ran: Ran, seconds: float, output_dir: Path) -> Row:
    """A step's row: failed unless it exited 0, saved its results, and ran the expected loader."""
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


def run_steps(
    steps: list[Step],
    hpus: Hpus,
    output_dir: Path,
    runner: Callable[[Step], Ran],
    *,
    devices: str = "HPUs",
    tool: str = "gaudi_check",
    judge_step: Callable[[Step, Ran, float, Path], Row] = judge,
) -> list[Row]:
    """Each step the devices allow (`hpus.count`, named `devices`), judged by `judge_step`; nvidia_check's too."""
    rows = []
    for step in steps:
        if hpus.count < step.needs_hpus:
            rows.append(Row(step.name, SKIPPED, f"needs {step.needs_hpus} {devices}, {hpus.count} visible"))
            continue
        step.log.parent.mkdir(parents=True, exist_ok=True)
        (step.run_dir / "train_results.json").unlink(missing_ok=True)  # an earlier check's must not count
        print(f"{tool}: running {step.name} (log: {step.log})", flush=True)
        started = time.perf_counter()
        ran = runner(step)
        rows.append(judge_step(step, ran, time.perf_counter() - started, output_dir))
    return rows


# ----------------------------------------------------------------------------------------
# The table and the record
# ----------------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    header = ("check / step", "result", "seconds", "samples/s", "loader", "mode", "detail")
    cells = [header] + [
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
    ]
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


def record(hpus: Optional[Hpus], stack: list[Row], steps: list[Row], output_dir: Path) -> dict:
    """The shareable record; paths in error lines are made relative too (the home directory as ~)."""
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
            "tool": "python -m bridgetower_bench.tools.gaudi_check",
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hpus": asdict(hpus) if hpus else None,
            "environment": environment_record(hpus) if hpus else None,
            "passed": not any(row.result == FAILED for row in stack + steps),
            "stack": [asdict(row) for row in stack],
            "steps": [asdict(row) for row in steps],
        }
    )


def environment_record(hpus: Hpus) -> dict:
    """The node's environment for the record (ENVIRONMENT_KEYS; None where the probe could not say), with the
    variable every step runs under."""
    found = {key: None for key in ENVIRONMENT_KEYS}
    found.update({"backend": "gaudi", "device_name": hpus.name, "device_count": hpus.count})
    found.update(hpus.environment or {})
    found["step_environment"] = dict(STEP_ENVIRONMENT)
    return found


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bridgetower_bench.tools.gaudi_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output_dir", type=Path, default=Path("gaudi_check"), help="Where the runs, logs and record go."
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="The record's path (default: <output_dir>/gaudi_check.json)."
    )
    parser.add_argument("--max_steps", type=int, default=5, help="Optimizer steps per training run.")
    parser.add_argument("--timeout", type=float, default=1200, help="Seconds allowed per training run.")
    args = parser.parse_args(argv)
    if args.max_steps <= 0:
        parser.error(f"--max_steps={args.max_steps}: must be positive")
    if args.timeout <= 0:
        parser.error(f"--timeout={args.timeout}: must be positive")
    tool_paths.output_dir("--output_dir", args.output_dir)
    if args.json is not None:
        tool_paths.output_file("--json", args.json)
    return args


def main(
    argv=None, *, probe: Callable[[], Hpus | str] = probe_hpus, runner: Optional[Callable[[Step], Ran]] = None
) -> int:
    """Run the check; returns the exit status. ``probe`` and ``runner`` are replaceable for tests."""
    args = parse_args(argv)
    hpus = probe()
    if isinstance(hpus, str):
        print(f"gaudi_check: not a Gaudi node: {hpus}; nothing checked.")
        return NOT_ON_GAUDI_EXIT
    output_dir = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = (args.json or output_dir / "gaudi_check.json").resolve()
    if runner is None:
        runner = lambda step: run_command(step, args.timeout)  # noqa: E731

    stack = stack_rows(hpus)
    from .fixtures import ensure_default_fixtures

    fixtures = ensure_default_fixtures(output_dir / "fixtures")  # inside the output directory: the record names them
    steps = run_steps(plan_steps(fixtures, output_dir, args.max_steps), hpus, output_dir, runner)
    print()
    print(format_table(stack + steps), end="")
    # a shareable record: credential values (HF_TOKEN and the like, e.g. echoed in an error line) scrubbed
    report = shareable(record(hpus, stack, steps, output_dir), args=list(sys.argv[1:] if argv is None else argv))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(json_path, json.dumps(report, indent=2) + "\n")
    print(f"record: {json_path} ({'passed' if report['passed'] else 'FAILED'}; attach it to a bug report)")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    tool_paths.run(main)

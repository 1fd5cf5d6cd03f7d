"""A run's row of the results: what was asked, what the run recorded (train_results.json and the evaluation's
files) and whether it worked; the progress line that shows it.
"""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path
from typing import Any, Optional

from bridgetower_bench.retrieval import summarise_quality
from bridgetower_bench.tools.sweep.bench_report import FAILED, INTERRUPTED, OK, configuration_label
from bridgetower_bench.tools.sweep.commands import Plan, Variant


# A run's training figures as train_results.json holds them: in results.csv and copied into each run's row.
RUN_FIGURES = (
    "throughput_warmup_steps",
    "throughput_counted_steps",
    "throughput_counted_samples",
    "throughput_steps_per_epoch",
    "throughput_epoch_starts",
    "train_samples_per_second",
    "train_samples_per_second_per_device",
    "data_wait_fraction",
    "data_wait_fraction_epoch_start",
    "data_wait_fraction_steady",
    "data_wait_seconds_epoch_start",
    "data_wait_seconds_steady",
    "train_loss",
)
# The device a run recorded (bridgetower_bench.measurement.run_record): in its row and in results.csv.
DEVICE_KEYS = (
    "device_name",
    "device_type",
    "backend",
    "execution_mode",
    "torch_compile",
    "device_count",
    "device_memory_bytes",
    "driver_version",
    "cpu_threads",  # threads per training process (torch's, OMP_NUM_THREADS): the scaling curve compares them
)
# Keys copied from train_results.json into a run's row.
TRAIN_KEYS = (
    *DEVICE_KEYS,
    "world_size",
    "per_device_train_batch_size",
    "loader",
    "image_pipeline",
    "jpeg_decoder",
    *RUN_FIGURES,
    "per_node",  # a run across nodes: each node's figures (a JSON list in results.csv)
)


_ERROR_LINE = re.compile(
    r"\b[A-Za-z_][\w.]*(Error|Exception)\b|\berror:|Killed|Traceback|^Training (diverged|stopped)\b"
)


def last_error_line(log_text: str) -> str:
    """The line that best says why a run failed: the last exception or argparse error, else the last line.

    torchrun's own ChildFailedError summary is skipped: the child's exception above it says more.
    """
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.search(line) and "ChildFailedError" not in line and not line.startswith("Traceback"):
            return line[:300]
    return lines[-1][:300] if lines else ""


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _relative(path: Path, out: Path) -> str:
    """`path` as records name it: relative to the sweep's output directory when inside it."""
    try:
        return str(path.relative_to(out))
    except ValueError:
        return str(path)


def collect_row(
    plan: Plan,
    variant: Variant,
    returncode: Optional[int],
    run_dir: Path,
    log_path: Path,
    command: list[str],
    wall_seconds: float,
    out: Optional[Path] = None,
    reason: str = "",
) -> dict:
    """One results row: what was asked, what the run recorded, and whether it worked (failed with `reason` where
    one is given: the sweep knows why the run did not start).

    Paths are relative to `out` (default: the directory above the runs' directory) and the command is
    shown as `shareable_command` shows it."""
    out = out or run_dir.parent.parent
    row: dict[str, Any] = {
        "run_id": variant.run_id,
        "script": plan.script,
        "preset": plan.preset,
        "requested_loader": variant.loader,
        "image_pipeline": variant.image_pipeline,
        "workers": variant.workers,
        "persistent_workers": variant.persistent_workers,
        "prefetch_factor": variant.prefetch_factor,
        "repeat": variant.repeat,
        "world_size": plan.processes(variant),
        "nodes": variant.nodes or 1,
        "device_name": plan.expected_device_name,
        "device_type": plan.device,
        "loader": None,
        "returncode": returncode,
        "wall_seconds": round(wall_seconds, 1),
        "log": _relative(log_path, out),
        "output_dir": _relative(run_dir, out),
        "command": plan.shown_command(command, out, variant),
    }
    train = read_json(run_dir / "train_results.json")
    row.update({k: train[k] for k in TRAIN_KEYS if k in train})
    row.update({k: v for k, v in train.items() if k.startswith(("version_", "device_decode_", "energy_"))})
    # recall@k, mean rank, loss
    row.update(summarise_quality(read_json(run_dir / "validation_results.json"), "eval"))
    row.update(summarise_quality(read_json(run_dir / "test_results.json"), "test"))

    # A diverged run's figures (NaN, Infinity): never a result, and never bare NaN in results.json.
    non_finite = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
    row.update(dict.fromkeys(non_finite))

    row["status"], row["error"] = (
        (FAILED, reason) if reason else _status(returncode, log_path, train, non_finite, row["output_dir"])
    )
    return row


def _status(
    returncode: Optional[int], log_path: Path, train: dict, non_finite: dict, output_dir: str
) -> tuple[str, str]:
    """A run's status and why it failed (or was interrupted): its exit, its log's last error, its recorded figures."""
    if returncode is None:
        return INTERRUPTED, "stopped by Ctrl-C"
    if returncode != 0:
        log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
        error = last_error_line(log_text.split("\n", 2)[-1])  # skip the "$ command" line
        if returncode < 0:
            error = f"killed by signal {signal.Signals(-returncode).name}" + (f"; {error}" if error else "")
        return FAILED, error or f"exited {returncode} and printed nothing"
    if "train_samples_per_second" not in train:
        return FAILED, f"exited 0 but {output_dir}/train_results.json has no train_samples_per_second"
    if non_finite:
        return FAILED, "exited 0 but its results are not finite: " + ", ".join(
            f"{k}={v}" for k, v in sorted(non_finite.items())
        )
    return OK, ""


def describe_row(row: dict) -> str:
    """One progress line with a run's figures (or its error)."""
    label = configuration_label(
        row["workers"],
        row["requested_loader"],
        row["image_pipeline"],
        row.get("persistent_workers", False),
        row.get("prefetch_factor"),
    )
    if row["status"] == OK:
        text = (
            f"{label}: {row['train_samples_per_second']:.2f} samples/s "
            f"({row['train_samples_per_second_per_device']:.2f}/device), "
            f"data wait {100 * row.get('data_wait_fraction', 0):.0f}%"
        )
        if row.get("throughput_epoch_starts"):
            text += (
                f" ({100 * row['data_wait_fraction_epoch_start']:.0f}% at {row['throughput_epoch_starts']} epoch start(s), "
                f"{100 * row['data_wait_fraction_steady']:.0f}% steady)"
            )
        text += f", loader {row['loader']}"
        if "eval_i2t_recall@1" in row:
            text += f", eval i2t R@1 {row['eval_i2t_recall@1']:.3f}"
        return text + f", {row['wall_seconds']:.0f} s"
    if row["status"] == INTERRUPTED:
        return f"{label}: interrupted after {row['wall_seconds']:.0f} s"
    return f"{label}: FAILED (return code {row['returncode']}) after {row['wall_seconds']:.0f} s: {row['error']}  [log: {row['log']}]"

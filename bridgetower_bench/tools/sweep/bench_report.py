"""The benchmark sweep's report: its cells and table.md.

`summarise(rows)` turns the sweep's rows (results.json) into cells, which `render_table` writes as table.md;
published_report.py, chart_report.py and scaling_report.py write vs_published.md, chart.png and the scaling
section and chart from the same cells (report.py's `render_all` adds the cost and energy sections of
cost_report.py). Cells are the median over repeats of one configuration on one device.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bridgetower_bench.mediapipe.availability import TORCH_LOADER
from bridgetower_bench.tools.sweep.stack_versions import versions_note


OK, FAILED, INTERRUPTED = "ok", "failed", "interrupted"


def configuration_label(
    workers: int,
    loader: str = TORCH_LOADER,
    image_pipeline: str = "upstream",
    persistent_workers: bool = False,
    prefetch_factor: Optional[int] = None,
) -> str:
    """The column heading of a configuration, in the published wording ("workers=2 + mediapipe");
    settings the published runs left at their defaults follow in brackets ("workers=2 (persistent)")."""
    label = f"workers={workers}"
    loader_settings = (["persistent"] if persistent_workers else []) + (
        [f"prefetch {prefetch_factor}"] if prefetch_factor else []
    )
    if loader_settings:
        label += f" ({', '.join(loader_settings)})"
    if loader != TORCH_LOADER:
        label += f" + {loader}"
    if image_pipeline != "upstream":
        label += f", {image_pipeline} images"
    return label


# ---------------------------------------------------------------------------------------------
# Summaries: one cell per (device, configuration), medians over repeats
# ---------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """The repeats of one configuration on one device."""

    node: list[float] = field(default_factory=list)  # samples/s of the whole node, per finished repeat
    per_device: list[float] = field(default_factory=list)
    data_wait: list[float] = field(default_factory=list)
    epoch_start_runs: list[dict] = field(
        default_factory=list
    )  # the data-wait split of runs that counted an epoch start
    recall: list[float] = field(default_factory=list)  # eval i2t recall@1, when evaluated
    failed: int = 0
    recorded_loaders: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # the finished runs themselves (energy, device type)

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.node) if self.node else None

    @property
    def median_per_device(self) -> Optional[float]:
        return statistics.median(self.per_device) if self.per_device else None


@dataclass
class Summary:
    """Rows (devices) x columns (configurations) of cells, with each device's speedup baseline."""

    devices: list[str]
    columns: list[str]
    cells: dict  # (device, column) -> Cell
    baselines: dict  # device -> column its speedups are against (absent: no workers=0 run finished)
    failures: list[Mapping]
    repeats: int
    notes: dict  # facts shared by all rows: warm-up, counted steps, batch sizes
    environments: dict = field(default_factory=dict)  # device -> ENVIRONMENT_COLUMNS' cells, from the runs' records


# The environment each run recorded (train_results.json, bridgetower_bench.measurement.run_record.environment): heading, key.
ENVIRONMENT_COLUMNS = (
    ("backend", "backend"),
    ("execution mode", "execution_mode"),
    ("torch.compile", "torch_compile"),
    ("torch", "version_torch"),
    ("CUDA", "version_cuda"),
    ("Intel Gaudi software", "version_intel_gaudi"),
    ("transformers", "version_transformers"),
    ("accelerate", "version_accelerate"),
    ("datasets", "version_datasets"),
    ("driver", "driver_version"),
    ("devices visible", "device_count"),
    ("memory per device", "device_memory_bytes"),
)


def _environment_cells(rows: Sequence[Mapping]) -> list[str]:
    """One device's environment: each field's values over its finished runs ("/" between differing ones, "-" for none)."""
    cells = []
    for _, key in ENVIRONMENT_COLUMNS:
        values = list(dict.fromkeys(row[key] for row in rows if row.get(key) is not None))
        if key == "device_memory_bytes":
            values = [f"{int(v) / 2**30:.1f} GiB" for v in values]
        cells.append("/".join(str(v) for v in values) or "-")
    return cells


def device_label(row: Mapping) -> str:
    """The device and how many: "H100 x8", or across nodes "H100 2 nodes x8" (rows without `nodes`: one node)."""
    n, nodes = row.get("world_size") or 1, row.get("nodes") or 1
    name = row.get("device_name") or row.get("device_type") or "unknown device"
    return f"{name} x{n}" if nodes == 1 else f"{name} {nodes} nodes x{n // nodes}"


def size_label(size: tuple[int, int]) -> str:
    """A point of the scaling curve: its devices, and across nodes how ("4 (2 nodes x 2)")."""
    devices, nodes = size
    return str(devices) if nodes == 1 else f"{devices} ({nodes} nodes x {devices // nodes})"


def summarise(rows: Sequence[Mapping]) -> Summary:
    """Group finished and failed runs into cells; interrupted runs are left out."""
    rows = [r for r in rows if r.get("status") in (OK, FAILED)]
    columns, cells = _columns(rows, _group(rows))
    devices = list(dict.fromkeys(device_label(r) for r in rows))
    baselines = {d: b for d in devices if (b := _baseline_column(d, columns, cells))}
    ok_rows = [r for r in rows if r["status"] == OK]
    notes: dict[str, object] = {
        key: sorted({r[key] for r in ok_rows if r.get(key) is not None})
        for key in (
            "throughput_warmup_steps",
            "throughput_counted_steps",
            "per_device_train_batch_size",
            "world_size",
            "throughput_steps_per_epoch",
            "throughput_epoch_starts",
        )
    }
    notes["versions"] = versions_note(ok_rows)
    repeats = max((r.get("repeat", 1) for r in rows), default=0)
    environments = {d: _environment_cells([r for r in ok_rows if device_label(r) == d]) for d in devices}
    return Summary(
        devices, columns, cells, baselines, [r for r in rows if r["status"] == FAILED], repeats, notes, environments
    )


def _group(rows: Sequence[Mapping]) -> dict:
    """The finished and failed runs by (device, (loader asked for, image pipeline, workers, persistent, prefetch)),
    each group a Cell."""
    groups: dict = {}
    for row in rows:
        config = (
            row["requested_loader"],
            row["image_pipeline"],
            row["workers"],
            bool(row.get("persistent_workers")),
            row.get("prefetch_factor") or None,
        )
        cell = groups.setdefault((device_label(row), config), Cell())
        if row["status"] == OK:
            cell.node.append(float(row["train_samples_per_second"]))
            cell.per_device.append(
                float(row.get("train_samples_per_second_per_device", row["train_samples_per_second"]))
            )
            if row.get("data_wait_fraction") is not None:
                cell.data_wait.append(float(row["data_wait_fraction"]))
            if row.get("throughput_epoch_starts"):
                cell.epoch_start_runs.append(_wait_split(row))
            if row.get("eval_i2t_recall@1") is not None:
                cell.recall.append(float(row["eval_i2t_recall@1"]))
            cell.recorded_loaders.append(str(row.get("loader")))
            cell.rows.append(row)
        else:
            cell.failed += 1
    return groups


def _columns(rows: Sequence[Mapping], groups: Mapping) -> tuple[list[str], dict]:
    """The columns: image pipelines in the order they ran, the PyTorch loader first, then by workers; and the
    cells by (device, column)."""
    pipelines = list(dict.fromkeys(r["image_pipeline"] for r in rows))
    configs = sorted(
        {config for _, config in groups},
        key=lambda c: (pipelines.index(c[1]), c[0] != TORCH_LOADER, c[0], c[2], c[3], c[4] or 0),
    )
    columns, cells = [], {}
    for config in configs:
        for (device, cfg), cell in groups.items():
            if cfg == config:
                column = _column_label(config, cell)
                if column not in columns:
                    columns.append(column)
                cells[(device, column)] = cell
    return columns, cells


def _column_label(config: tuple, cell: Cell) -> str:
    """A configuration's heading, naming the loader its runs recorded, never only the one asked for:
    a "mediapipe" run that fell back to the PyTorch loader shows the string it saved."""
    loader, pipeline, workers, persistent, prefetch = config
    recorded = sorted(set(cell.recorded_loaders))
    shown = loader if recorded in ([], [loader]) else f"{' / '.join(recorded)} (asked: {loader})"
    return configuration_label(workers, shown, pipeline, persistent, prefetch)


def _wait_split(row: Mapping) -> dict:
    """A run's data wait at epoch starts beside the rest: shares of the counted time, seconds, and per step."""
    starts = int(row["throughput_epoch_starts"])
    other_steps = max(1, int(row.get("throughput_counted_steps") or 0) - starts)
    return {
        "share_epoch_start": float(row.get("data_wait_fraction_epoch_start") or 0.0),
        "share_steady": float(row.get("data_wait_fraction_steady") or 0.0),
        "seconds_epoch_start": float(row.get("data_wait_seconds_epoch_start") or 0.0),
        "ms_per_epoch_start": 1000 * float(row.get("data_wait_seconds_epoch_start") or 0.0) / starts,
        "ms_per_steady_step": 1000 * float(row.get("data_wait_seconds_steady") or 0.0) / other_steps,
        "epoch_starts": starts,
    }


def _baseline_column(device: str, columns: Sequence[str], cells: Mapping) -> Optional[str]:
    """workers=0 with the PyTorch loader and upstream images, else the first workers=0 PyTorch column."""
    candidates = [
        c
        for c in columns
        if c.startswith("workers=0") and " + " not in c and cells.get((device, c)) and cells[(device, c)].median
    ]
    if "workers=0" in candidates:
        return "workers=0"
    return candidates[0] if candidates else None


def speedup(summary: Summary, device: str, column: str) -> Optional[float]:
    """Median samples/s of a cell divided by the median of its device's baseline cell."""
    baseline = summary.baselines.get(device)
    cell = summary.cells.get((device, column))
    if not baseline or cell is None or cell.median is None:
        return None
    return cell.median / summary.cells[(device, baseline)].median


def _fmt(value: Optional[float]) -> str:
    """samples/s as published (one decimal), with one more below 10 so small CPU figures keep two digits."""
    if value is None:
        return "-"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|"] + [line(row) for row in rows])


def cell_text(summary: Summary, device: str, column: str) -> str:
    """ "samples/s (xspeedup)", with failures counted, or "failed" / "-"."""
    cell = summary.cells.get((device, column))
    if cell is None:
        return "-"
    if cell.median is None:
        return "failed" if cell.failed == 1 else f"failed x{cell.failed}"
    text = _fmt(cell.median)
    ratio = speedup(summary, device, column)
    if ratio is not None:
        text += f" (x{ratio:.2f})"
    if cell.failed:
        text += f" [{cell.failed} failed]"
    return text


def render_table(summary: Summary) -> str:
    """table.md: the published post's layout, plus data-wait and failure notes."""
    if not summary.devices:
        return "# BridgeTower fine-tuning throughput\n\nNo run finished.\n"
    header = ["device"] + summary.columns
    body = [[device] + [cell_text(summary, device, c) for c in summary.columns] for device in summary.devices]
    parts = ["# BridgeTower fine-tuning throughput (samples/s, whole node)", "", _markdown_table(header, body), ""]
    parts.append(_notes(summary))
    parts += _environment_section(summary)
    parts += _data_wait_section(summary, header)
    parts += _epoch_start_section(summary)
    parts += _spread_section(summary, header)
    parts += _recall_section(summary, header)
    parts += _failures_section(summary)
    return "\n".join(parts) + "\n"


def _environment_section(summary: Summary) -> list[str]:
    """table.md's environment of each device, as the runs recorded it."""
    if not summary.environments:
        return []
    return [
        "",
        "## Environment (as the runs recorded it)",
        "",
        _markdown_table(
            ["device"] + [heading for heading, _ in ENVIRONMENT_COLUMNS],
            [[device] + cells for device, cells in summary.environments.items()],
        ),
    ]


def _data_wait_section(summary: Summary, header: list[str]) -> list[str]:
    """table.md's data wait of each cell (median)."""
    wait_rows = []
    for device in summary.devices:
        wait = []
        for column in summary.columns:
            cell = summary.cells.get((device, column))
            wait.append(f"{100 * statistics.median(cell.data_wait):.0f}%" if cell and cell.data_wait else "-")
        wait_rows.append([device] + wait)
    return ["", "## Time the training loop waited for data (median)", "", _markdown_table(header, wait_rows)]


def _epoch_start_section(summary: Summary) -> list[str]:
    """table.md's data wait at epoch starts beside the steady state, where runs counted epoch starts."""
    split_rows = []
    for device in summary.devices:
        for column in summary.columns:
            cell = summary.cells.get((device, column))
            if cell and cell.epoch_start_runs:
                split_rows.append([device, column] + _split_cells(cell.epoch_start_runs))
    if not split_rows:
        return []
    return [
        "",
        "## Data wait at epoch starts beside the steady state (median)",
        "",
        "Epoch-start steps: the first optimizer step of every epoch after the first, inside the counted window; "
        "steady: every other counted step. Shares are of the whole counted time (they add up to the data wait "
        "above); per step: mean wait of one such step; ratio: epoch-start share / steady share.",
        "",
        _markdown_table(
            [
                "device",
                "configuration",
                "epoch starts counted",
                "wait at epoch starts",
                "steady wait",
                "ratio",
                "seconds lost at epoch starts",
                "per epoch-start step",
                "per steady step",
            ],
            split_rows,
        ),
    ]


def _spread_section(summary: Summary, header: list[str]) -> list[str]:
    """table.md's spread over repeats, where a cell has several finished runs."""
    if not any(len(cell.node) > 1 for cell in summary.cells.values()):
        return []
    spread_rows = [
        [device] + [_spread(summary.cells.get((device, c))) for c in summary.columns] for device in summary.devices
    ]
    return [
        "",
        "## Spread over repeats (min-max samples/s, number of finished runs)",
        "",
        _markdown_table(header, spread_rows),
    ]


def _recall_section(summary: Summary, header: list[str]) -> list[str]:
    """table.md's eval recall@1, where the runs evaluated."""
    if not any(cell.recall for cell in summary.cells.values()):
        return []
    recall_rows = [
        [device]
        + [
            f"{statistics.median(summary.cells[(device, c)].recall):.3f}"
            if (device, c) in summary.cells and summary.cells[(device, c)].recall
            else "-"
            for c in summary.columns
        ]
        for device in summary.devices
    ]
    return [
        "",
        "## Retrieval quality: eval image->text recall@1 (median)",
        "",
        _markdown_table(header, recall_rows),
    ]


def _failures_section(summary: Summary) -> list[str]:
    """table.md's failed runs, each with its error and log."""
    if not summary.failures:
        return []
    return ["", "## Failed runs", ""] + [
        f"- {r['run_id']} (return code {r['returncode']}): {r['error']} — log: {r['log']}" for r in summary.failures
    ]


def _split_cells(runs: Sequence[dict]) -> list[str]:
    def median(key):
        return statistics.median(run[key] for run in runs)

    share_start, share_steady = median("share_epoch_start"), median("share_steady")
    ratios = [run["share_epoch_start"] / run["share_steady"] for run in runs if run["share_steady"] > 0]
    return [
        "/".join(str(n) for n in sorted({run["epoch_starts"] for run in runs})),
        f"{100 * share_start:.1f}%",
        f"{100 * share_steady:.1f}%",
        f"x{statistics.median(ratios):.2f}" if ratios else "-",
        f"{median('seconds_epoch_start'):.2f} s",
        f"{median('ms_per_epoch_start'):.0f} ms",
        f"{median('ms_per_steady_step'):.0f} ms",
    ]


def _spread(cell: Optional[Cell]) -> str:
    if cell is None or not cell.node:
        return "-"
    return f"{_fmt(min(cell.node))}-{_fmt(max(cell.node))} (n={len(cell.node)})"


def _notes(summary: Summary) -> str:
    notes = summary.notes

    def facts(key):
        return ", ".join(str(v) for v in notes.get(key, [])) or "?"

    lines = [
        f"Steady-state samples/s of all devices of a row together ({facts('world_size')}), after {facts('throughput_warmup_steps')} "
        f"warm-up step(s), over {facts('throughput_counted_steps')} counted step(s); per-device batch "
        f"{facts('per_device_train_batch_size')}; median of up to {summary.repeats} repeat(s).",
    ]
    if notes.get("throughput_steps_per_epoch"):
        lines.append(
            f"Shape: {facts('throughput_steps_per_epoch')} optimizer steps per epoch; "
            f"{facts('throughput_epoch_starts')} epoch start(s) inside the counted window."
        )
    for device, baseline in summary.baselines.items():
        lines.append(f"(xN): speedup against `{baseline}` on {device}.")
    if notes.get("versions"):
        lines.append(f"**{notes['versions']}**")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot, drawing to files only (the Agg backend): every chart of the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Write a chart of the report (laid out, 120 dpi) and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)

"""The benchmark sweep's report: tables, the comparison with the published figures, and the chart.

`summarise(rows)` turns the sweep's rows (results.json) into cells, which `render_table`,
`render_vs_published` and `render_chart` write as table.md, vs_published.md and chart.png (report.py's
`render_all` adds the cost and energy sections of cost_report.py). Cells are the median over repeats
of one configuration on one device.
"""

from __future__ import annotations

import math
import re
import statistics
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bridgetower_bench import published
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
    rows: list[Mapping] = field(default_factory=list)  # the finished runs themselves (energy, device type)

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
    failures: list[dict]
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
        values = list(dict.fromkeys(row.get(key) for row in rows if row.get(key) is not None))
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
    groups: dict = {}  # (device, (loader asked for, image pipeline, workers)) -> Cell
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

    # Columns: image pipelines in the order they ran, the PyTorch loader first, then by workers.
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

    devices = list(dict.fromkeys(device_label(r) for r in rows))
    baselines = {d: b for d in devices if (b := _baseline_column(d, columns, cells))}
    ok_rows = [r for r in rows if r["status"] == OK]
    notes = {
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


def render_vs_published(summary: Summary, meta: Mapping) -> str:
    """vs_published.md: our cells beside the published figures (docs/PUBLISHED.md), whole node and per device (published = node / devices)."""
    header, node_rows, device_rows, speedup_rows = _beside_published(summary)
    parts = [
        "# This run beside the published figures",
        "",
        _recipe_table(summary, meta),
        "",
        _verdict(summary, meta) + (f" Shape of these runs: {meta['shape']}." if meta.get("shape") else ""),
        "",
        "## Whole node, samples/s",
        "",
        _markdown_table(header, node_rows),
        "",
        f"## Per device, samples/s (published: node / {published.DEVICES})",
        "",
        _markdown_table(header, device_rows),
        "",
        "## Speedup against workers=0 of the same device",
        "",
        _markdown_table(header, speedup_rows),
        "",
        "n/a: not published for that device; -: not run (or no run finished).",
        "",
        f"## Upstream's CI baselines (optimum-habana 1.21 line, {published.DEVICES} devices)",
        "",
        _markdown_table(
            ["device", "samples/s (node)", "samples/s per device"],
            [[d, _fmt(v), _fmt(v / published.DEVICES)] for d, v in published.CI_BASELINES.items()],
        ),
        "",
        f"Its command adds `{published.CI_EXTRA_FLAGS}` to the published flags and leaves out `--do_predict`.",
    ]
    return "\n".join(parts) + "\n"


def _beside_published(summary: Summary) -> tuple[list[str], list[list[str]], list[list[str]], list[list[str]]]:
    """vs_published.md's three tables: the header, then the rows of whole-node samples/s, per-device samples/s and
    speedups, our devices beside the published ones."""
    rows_order = list(summary.columns) + [c for c in published.CONFIGS if c not in summary.columns]
    published_devices = list(published.THROUGHPUT)
    ours = summary.devices

    def node_value(device, column):
        cell = summary.cells.get((device, column))
        return cell.median if cell else None

    def per_device_value(device, column):
        cell = summary.cells.get((device, column))
        return cell.median_per_device if cell else None

    def published_value(device, column, per_device):
        value = published.THROUGHPUT[device].get(column)
        if value is None:
            return "n/a" if column in published.CONFIGS else "-"
        return _fmt(value / published.DEVICES if per_device else value)

    def published_speedup(device, column):
        value, base = published.THROUGHPUT[device].get(column), published.THROUGHPUT[device]["workers=0"]
        return f"x{value / base:.2f}" if value is not None else ("n/a" if column in published.CONFIGS else "-")

    header = ["configuration"] + [f"{d} (this run)" for d in ours] + [f"{d} (published)" for d in published_devices]
    node_rows = [
        [c] + [_fmt(node_value(d, c)) for d in ours] + [published_value(d, c, False) for d in published_devices]
        for c in rows_order
    ]
    device_rows = [
        [c] + [_fmt(per_device_value(d, c)) for d in ours] + [published_value(d, c, True) for d in published_devices]
        for c in rows_order
    ]
    speedup_rows = [
        [c]
        + [f"x{s:.2f}" if (s := speedup(summary, d, c)) is not None else "-" for d in ours]
        + [published_speedup(d, c) for d in published_devices]
        for c in rows_order
    ]
    return header, node_rows, device_rows, speedup_rows


def _verdict(summary: Summary, meta: Mapping) -> str:
    """How this run's figures compare with the published ones: directly, per device, or by their speedups."""
    world_sizes = summary.notes.get("world_size", [])
    if meta.get("preset") != "blog":
        return "Not the published recipe (a different model, data or scale): compare the speedups, not the samples/s."
    if world_sizes == [published.DEVICES]:
        return "The published recipe at the published scale: the numbers compare directly."
    return (
        f"The published recipe on {', '.join(map(str, world_sizes)) or '?'} device(s) instead of "
        f"{published.DEVICES}: compare the per-device figures."
    )


def _recipe_table(summary: Summary, meta: Mapping) -> str:
    """This run's model, devices, batch and shape beside the published run's."""
    return _markdown_table(
        ["", "this run", "published"],
        [
            [
                "model",
                meta.get("model", "?"),
                f"{published.MODEL} ({published.TRAINED_PARAMETERS / 1e6:.0f} M parameters)",
            ],
            [
                "devices",
                ", ".join(str(n) for n in summary.notes.get("world_size", [])) or "?",
                str(published.DEVICES),
            ],
            [
                "per-device batch",
                ", ".join(str(n) for n in summary.notes.get("per_device_train_batch_size", [])) or "?",
                str(published.BATCH),
            ],
            [
                "warm-up steps",
                ", ".join(str(n) for n in summary.notes.get("throughput_warmup_steps", [])) or "?",
                str(published.WARMUP_STEPS),
            ],
            [
                "optimizer steps per epoch",
                ", ".join(str(n) for n in summary.notes.get("throughput_steps_per_epoch", [])) or "?",
                f"about {math.ceil(published.TRAIN_ROWS / (published.BATCH * published.DEVICES))} (about "
                f"{published.TRAIN_ROWS / 1000:g}k rows / {published.BATCH} x {published.DEVICES}, the last batch partial)",
            ],
            [
                "epoch starts counted",
                ", ".join(str(n) for n in summary.notes.get("throughput_epoch_starts", [])) or "?",
                f"{published.EPOCHS - 1} ({published.EPOCHS} epochs)",
            ],
        ],
    )


_WORKERS_HEADING = re.compile(r"^(workers=\d+)(.*)$")


def chart_groups(summary: Summary) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The chart's layout: x groups are worker counts; one bar series per device and loader/image setting.

    Returns the group labels ("workers=0", ...) and the series as (legend label, device, column suffix),
    where a cell is summary.cells[(device, group + suffix)].
    """
    groups, suffixes = [], []
    for column in summary.columns:
        match = _WORKERS_HEADING.match(column)
        group, suffix = match.groups() if match else (column, "")  # a heading of another form: a group of its own
        if group not in groups:
            groups.append(group)
        if suffix not in suffixes:
            suffixes.append(suffix)
    series = []
    for device in summary.devices:
        for suffix in suffixes:
            if any((device, g + suffix) in summary.cells for g in groups):
                setting = suffix.lstrip(" ,") or "upstream images"
                label = setting if len(summary.devices) == 1 else f"{device}: {setting}"
                series.append((label, device, suffix))
    return groups, series


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


def render_chart(summary: Summary, path: Path) -> None:
    """chart.png: bars grouped by worker count, one bar per device and loader/image setting, labelled with
    samples/s and the speedup against the device's workers=0 baseline."""
    plt = pyplot()
    groups, series = chart_groups(summary)
    groups = groups or ["(no runs)"]
    series = series or [("(no runs)", "", "")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * len(series) + 2), 4.5))
    for i, (label, device, suffix) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        cells = [summary.cells.get((device, g + suffix)) for g in groups]
        bars = ax.bar(xs, [cell.median if cell and cell.median else 0.0 for cell in cells], width, label=label)
        for bar, group, cell in zip(bars, groups, cells):
            if cell is None:
                continue
            ratio = speedup(summary, device, group + suffix)
            text = (
                "failed"
                if cell.median is None
                else f"{cell.median:.3g}" + (f"\nx{ratio:.2f}" if ratio is not None else "")
            )
            ax.annotate(
                text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
            )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([textwrap.fill(g, 28) for g in groups], fontsize=9)
    ax.set_ylabel("samples/s (whole node)")
    ax.set_title("BridgeTower contrastive fine-tuning throughput")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# The scaling curve: one configuration on several device counts (bench --devices)
# ---------------------------------------------------------------------------------------------


def scaling_curves(summary: Summary) -> list[tuple[str, str, list[tuple[tuple[int, int], Cell]]]]:
    """(configuration, device name, [((devices, nodes), cell), ...] by device count, one node first) for every
    configuration that finished on more than one size (devices, nodes) of one device."""
    points: dict = {}
    for (_, column), cell in summary.cells.items():
        if cell.rows:
            row = cell.rows[0]
            name = row.get("device_name") or row.get("device_type") or "unknown device"
            size = (int(row.get("world_size") or 1), int(row.get("nodes") or 1))
            points.setdefault((column, name), []).append((size, cell))
    return [
        (column, name, sorted(cells, key=lambda p: p[0])) for (column, name), cells in points.items() if len(cells) > 1
    ]


def efficiency(cells: Sequence[tuple[tuple[int, int], Cell]], size: tuple[int, int]) -> Optional[float]:
    """Samples/s per device at `size` (devices, nodes) over that on one device (None without a one-device run)."""
    one = dict(cells).get((1, 1))
    this = dict(cells)[size].median_per_device
    return this / one.median_per_device if one is not None and this is not None and one.median_per_device else None


# A run's machine was busy when other programs kept more than this share of its cores busy, on average, during the
# run (its row's other_cpu_cores of cpu_count): their CPU time was taken from the run's, or its loader workers'.
BUSY_SHARE = 0.1
# Why a point's efficiency is no result (the table's note): the flag, and what it means.
EFFICIENCY_FLAGS = {
    "threads differ": "a CPU run of this point and its one-device run trained with different threads per process "
    "(cpu_threads in results.csv), so their speeds per device do not compare",
    "busy machine": f"while this point or its one-device run trained, other programs kept more than "
    f"{BUSY_SHARE:.0%} of the machine's cores busy (other_cpu_cores of cpu_count in results.csv), so the runs "
    "shared the CPU with them",
    "above 100%": "more devices cannot add more per device than the first: the one-device run was held back "
    "(a busier machine, fewer threads), and the ratio (scaling_efficiency in results.csv) says nothing of scaling",
}


def busy_machine(row: Mapping) -> bool:
    """Whether other programs kept more than BUSY_SHARE of the run's machine busy during the run."""
    other, cores = row.get("other_cpu_cores"), row.get("cpu_count")
    return other is not None and bool(cores) and other > BUSY_SHARE * cores


def efficiency_flags(cells: Sequence[tuple[tuple[int, int], Cell]], size: tuple[int, int]) -> list[str]:
    """The EFFICIENCY_FLAGS that make the efficiency at `size` (devices, nodes) no result: its runs' and the
    one-device runs' threads (CPU runs), machine, and the ratio itself."""
    one = dict(cells).get((1, 1))
    rows = [*dict(cells)[size].rows, *(one.rows if one is not None else [])]
    threads = {r["cpu_threads"] for r in rows if r.get("device_type") == "cpu" and r.get("cpu_threads") is not None}
    ratio = efficiency(cells, size)
    flags = {
        "threads differ": len(threads) > 1,
        "busy machine": any(busy_machine(r) for r in rows),
        "above 100%": ratio is not None and round(100 * ratio) > 100,
    }
    return [flag for flag, raised in flags.items() if raised]


def efficiency_text(cells: Sequence[tuple[tuple[int, int], Cell]], size: tuple[int, int]) -> str:
    """The efficiency at `size` as the table and chart show it: "90%", "-" without a one-device run, or where it is
    no result, why ("n/a: busy machine")."""
    flags, ratio = efficiency_flags(cells, size), efficiency(cells, size)
    return f"n/a: {', '.join(flags)}" if flags else f"{100 * ratio:.0f}%" if ratio else "-"


def add_scaling_efficiency(summary: Summary) -> None:
    """Each finished run of a curve (its results row, in place) gets `scaling_efficiency`: its samples/s per
    device over the median of the same configuration on one device."""
    for _, _, cells in scaling_curves(summary):
        one = dict(cells).get((1, 1))
        for _, cell in cells if one is not None and one.median_per_device else []:
            for row, speed in zip(cell.rows, cell.per_device):
                row["scaling_efficiency"] = round(speed / one.median_per_device, 4)


def render_scaling(summary: Summary) -> str:
    """table.md's scaling section: per configuration and device count, samples/s per device, the scaling
    efficiency against one device, the whole job's samples/s, the data wait and (priced rows) USD per 1M
    samples; "" when no configuration ran on two device counts."""
    curves = scaling_curves(summary)
    if not curves:
        return ""
    priced = any(r.get("usd_per_1m_samples") is not None for _, _, cells in curves for _, c in cells for r in c.rows)
    header = ["configuration", "device", "devices", "samples/s per device", "scaling efficiency", "samples/s (all)"]
    header += ["data wait"] + (["USD per 1M samples"] if priced else [])
    body, flags = [], set()
    for column, name, cells in curves:
        for size, cell in cells:
            flags.update(efficiency_flags(cells, size))
            wait = f"{100 * statistics.median(cell.data_wait):.0f}%" if cell.data_wait else "-"
            nodes = [r["per_node"] for r in cell.rows if r.get("per_node")]  # a run across nodes: each node's wait
            if nodes:
                each = [statistics.median(n["data_wait_fraction"] for n in repeats) for repeats in zip(*nodes)]
                wait += " (nodes: " + " / ".join(f"{100 * w:.0f}%" for w in each) + ")"
            costs = [r["usd_per_1m_samples"] for r in cell.rows if r.get("usd_per_1m_samples") is not None]
            line = [
                column,
                name,
                size_label(size),
                _fmt(cell.median_per_device),
                efficiency_text(cells, size),
            ]
            line += [_fmt(cell.median), wait] + (
                [f"{statistics.median(costs):.2f}" if costs else "-"] if priced else []
            )
            body.append(line)
    return "\n".join(
        [
            "",
            "## Scaling: the same recipe on more devices (median over repeats)",
            "",
            _markdown_table(header, body),
            "",
            "Scaling efficiency: samples/s per device over that on one device (100%: every added device adds as "
            "much as the first). The data wait is rank 0's share of the counted window spent waiting for its "
            "loader; across nodes, each node's (the mean over its ranks) follows. Every device of a run trains the same per-device batch, so the global batch grows with the "
            "devices.",
            *[f'\n"n/a: {flag}": {meaning}.' for flag, meaning in EFFICIENCY_FLAGS.items() if flag in flags],
            "",
        ]
    )


def render_scaling_chart(summary: Summary, path: Path) -> bool:
    """chart_scaling.png: samples/s per device against the device count, one line per configuration (and another,
    dashed, for its points across nodes, each named "2 nodes x 8"), each point labelled with its scaling
    efficiency; False (nothing written) without a curve."""
    curves = scaling_curves(summary)
    if not curves:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for column, name, cells in curves:
        per_node = {devices // nodes for (devices, nodes), _ in cells if nodes > 1}
        for across in (False, True):  # across nodes: from the one-node point of one node's devices
            points = [
                (size, c.median_per_device)
                for size, c in cells
                if c.median_per_device and (size[1] == 1 if not across else size[1] > 1 or size[0] in per_node)
            ]
            if not points:
                continue
            label = textwrap.fill(f"{name}: {column}" + (", across nodes" if across else ""), 60)
            xs, ys = [devices for (devices, _), _ in points], [y for _, y in points]
            ax.plot(xs, ys, marker="s" if across else "o", linestyle="--" if across else "-", label=label)
            for (devices, nodes), y in points:
                shown = efficiency_text(cells, (devices, nodes))
                texts = ([f"{nodes} nodes x {devices // nodes}"] if across else []) + ([shown] if shown != "-" else [])
                if texts and (nodes > 1) == across:  # the shared one-node point: labelled once
                    ax.annotate(
                        ": ".join(texts),
                        (devices, y),
                        textcoords="offset points",
                        xytext=(0, 6),
                        ha="center",
                        fontsize=8,
                    )
    devices = sorted({size[0] for _, _, cells in curves for size, _ in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices)
    ax.set_xticklabels([str(n) for n in devices])
    ax.set_xlabel("devices")
    ax.set_ylabel("samples/s per device")
    ax.set_ylim(bottom=0)
    ax.set_title("Scaling (labels: efficiency against one device)")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True

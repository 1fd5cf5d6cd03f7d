"""The scaling curve: one configuration on several device counts (bench --devices).

table.md's scaling section, each run's `scaling_efficiency`, the flags that make an efficiency no result, and
chart_scaling.png, from the cells of bench_report.py's `summarise`.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from bridgetower_bench.tools.sweep.bench_report import (
    Cell,
    Summary,
    _fmt,
    _markdown_table,
    pyplot,
    save_figure,
    size_label,
)


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
    if other is None or not cores:
        return False
    return other > BUSY_SHARE * cores


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
        if one is None or not one.median_per_device:
            continue
        for _, cell in cells:
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
    counts = sorted({size[0] for _, _, cells in curves for size, _ in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(n) for n in counts])
    ax.set_xlabel("devices")
    ax.set_ylabel("samples/s per device")
    ax.set_ylim(bottom=0)
    ax.set_title("Scaling (labels: efficiency against one device)")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True

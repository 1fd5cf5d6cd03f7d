"""chart.png: the sweep's cells as bars, grouped by worker count, one bar per device and loader/image setting."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from bridgetower_bench.tools.sweep.bench_report import Summary, pyplot, save_figure, speedup


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

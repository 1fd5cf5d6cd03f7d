"""The sweep's report: table.md, vs_published.md and the charts, from the *_report.py modules beside this one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.tools.sweep import cost_report
from bridgetower_bench.tools.sweep.bench_report import render_table, summarise
from bridgetower_bench.tools.sweep.chart_report import render_chart
from bridgetower_bench.tools.sweep.published_report import render_vs_published
from bridgetower_bench.tools.sweep.scaling_report import render_scaling, render_scaling_chart


def render_all(out: Path, rows: Sequence[Mapping], meta: Mapping) -> str:
    """Write the report: table.md, vs_published.md and chart.png (bench_report.py), and where there are
    prices (`meta["prices"]`) or energy figures their sections and chart_cost.png (cost_report.py);
    return the table text."""
    summary = summarise(rows)
    cost_table, cost_vs_published, _ = cost_report.render(out, summary, meta)
    table = render_table(summary) + render_scaling(summary) + cost_table
    write_atomically(out / "table.md", table)
    write_atomically(out / "vs_published.md", render_vs_published(summary, meta) + cost_vs_published)
    render_chart(summary, out / "chart.png")
    render_scaling_chart(summary, out / "chart_scaling.png")
    return table

"""The sweep's report on cost and energy: sections of table.md and vs_published.md, and chart_cost.png.

Cost needs the user's prices (tools/cost.py); energy needs a counter the runs read (bridgetower_bench/measurement/energy.py).
Without either, nothing here adds a line or a file. Figures are taken at each cell's median samples/s, as
the throughput tables show it; energy is the median over the cell's runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from bridgetower_bench import published
from bridgetower_bench.measurement.energy import NOT_MEASURED
from bridgetower_bench.tools.sweep.bench_report import Summary, _markdown_table, pyplot, save_figure
from bridgetower_bench.tools.sweep.cost import (
    PUBLISHED_PRICE_NAMES,
    Price,
    Prices,
    usd_per_million_samples,
    usd_published_experiment,
)


def usd(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3g}"


# ---------------------------------------------------------------------------------------------
# Cells: cost at the median speed, energy as measured
# ---------------------------------------------------------------------------------------------


def cell_price(summary: Summary, device: str, prices: Prices) -> Optional[Price]:
    """The price of a device row of this sweep (from the type and name its runs recorded)."""
    for (row_device, _), cell in summary.cells.items():
        if row_device == device and cell.rows:
            first = cell.rows[0]
            return prices.for_device(first.get("device_type"), first.get("device_name"))
    return None


def _devices(summary: Summary, device: str) -> int:
    for (row_device, _), cell in summary.cells.items():
        if row_device == device and cell.rows:
            return int(cell.rows[0].get("world_size") or 1)
    return 1


def cell_cost(summary: Summary, device: str, column: str, prices: Prices) -> Optional[tuple[float, float]]:
    """(USD per 1M training samples, USD of the published run) at the cell's median samples/s."""
    cell, price = summary.cells.get((device, column)), cell_price(summary, device, prices)
    if cell is None or not cell.median or price is None:
        return None
    devices = _devices(summary, device)
    return (
        usd_per_million_samples(price.usd_per_hour, devices, cell.median),
        usd_published_experiment(price.usd_per_hour, devices, cell.median),
    )


def cell_energy(summary: Summary, device: str, column: str) -> Optional[dict]:
    """Median joules per sample and watts per device of the cell's measured runs, their sources; or the reasons."""
    cell = summary.cells.get((device, column))
    if cell is None or not any("energy_source" in row for row in cell.rows):
        return None
    measured = [
        row
        for row in cell.rows
        if row.get("energy_source") not in (None, NOT_MEASURED) and row.get("energy_joules_per_sample") is not None
    ]
    if not measured:
        return {"reasons": sorted({str(row.get("energy_reason") or "no reason recorded") for row in cell.rows})}
    return {
        "joules_per_sample": statistics.median(float(r["energy_joules_per_sample"]) for r in measured),
        "watts_per_device": statistics.median(float(r["energy_watts_per_device"]) for r in measured),
        "sources": sorted({str(r["energy_source"]) for r in measured}),
        "runs": len(measured),
    }


def _any_energy(summary: Summary) -> bool:
    return any("energy_source" in row for cell in summary.cells.values() for row in cell.rows)


# ---------------------------------------------------------------------------------------------
# table.md
# ---------------------------------------------------------------------------------------------


def render_table_sections(summary: Summary, prices: Prices) -> str:
    """The cost section (with prices) and the energy section (when the runs recorded energy), or ""."""
    parts = []
    if prices:
        parts += _cost_section(summary, prices)
    if _any_energy(summary):
        parts += _energy_section(summary)
    return "\n".join(parts) + ("\n" if parts else "")


def _cost_section(summary: Summary, prices: Prices) -> list[str]:
    """table.md's cost of each cell at the prices given, per 1M samples and for the published run."""
    priced = [(device, price) for device in summary.devices if (price := cell_price(summary, device, prices))]
    rows = [
        [device, f"{price.device}: {price.usd_per_hour:g} USD/h"]
        + [
            f"{usd(c[0])} per 1M; {usd(c[1])} run" if (c := cell_cost(summary, device, column, prices)) else "-"
            for column in summary.columns
        ]
        for device, price in priced
    ]
    parts = [
        "",
        "## Cost at the prices given (USD, at the median samples/s)",
        "",
        f"Per 1M training samples, then the published run ({published.EXPERIMENT} = "
        f"{published.SAMPLES:,} samples) on the row's devices, at steady-state speed (no warm-up, "
        f"start-up or evaluation). Prices: {prices.describe()}.",
        "",
    ]
    parts.append(
        _markdown_table(["device", "price"] + summary.columns, rows)
        if rows
        else "No device of this sweep has a price."
    )
    unpriced = [device for device in summary.devices if device not in dict(priced)]
    if unpriced and rows:
        parts += ["", f"No price given for: {', '.join(unpriced)}."]
    return parts


def _energy_section(summary: Summary) -> list[str]:
    """table.md's energy of each cell over the counted window, and why a device's was not measured."""
    parts = [
        "",
        "## Energy over the counted window (median)",
        "",
        "Joules per training sample and average watts per device, read from the device's counter over exactly the "
        "steps samples/s counts (bridgetower_bench/measurement/energy.py): `nvml-energy` (NVIDIA board counter), "
        "`hlml-power-sampled` (Gaudi power, sampled), `rapl` (CPU packages: the whole CPU, loader workers and "
        "every other process on it included).",
        "",
    ]
    rows: list[list[str]] = []
    reasons: dict[str, list[str]] = {}  # device -> why its energy was not measured
    for device in summary.devices:
        cells = []
        for column in summary.columns:
            energy = cell_energy(summary, device, column)
            if energy is None:
                cells.append("-")
            elif "reasons" in energy:
                cells.append(NOT_MEASURED)
                known = reasons.setdefault(device, [])
                known += [reason for reason in energy["reasons"] if reason not in known]
            else:
                cells.append(
                    f"{energy['joules_per_sample']:.3g} J/sample, {energy['watts_per_device']:.3g} W per device "
                    f"({', '.join(energy['sources'])})"
                )
        rows.append([device] + cells)
    parts.append(_markdown_table(["device"] + summary.columns, rows))
    for device, device_reasons in reasons.items():
        parts += ["", f"Not measured on {device}: {'; '.join(device_reasons)}."]
    return parts


# ---------------------------------------------------------------------------------------------
# vs_published.md
# ---------------------------------------------------------------------------------------------


def published_costs(prices: Prices) -> list[dict]:
    """Every priced published figure: the post's configurations and upstream's CI baselines, 8 devices each."""
    found = []
    for device, figures in list(published.THROUGHPUT.items()) + [
        (d, {"upstream CI": v}) for d, v in published.CI_BASELINES.items()
    ]:
        price = prices.for_published(device)
        if price is None:
            continue
        for configuration, node in figures.items():
            found.append(
                {
                    "device": device,
                    "name": PUBLISHED_PRICE_NAMES.get(device, device),
                    "configuration": configuration,
                    "samples_per_second": node,
                    "per_device": node / published.DEVICES,
                    "price": price,
                    "usd_per_1m_samples": usd_per_million_samples(price.usd_per_hour, published.DEVICES, node),
                    "usd_published_experiment": usd_published_experiment(price.usd_per_hour, published.DEVICES, node),
                }
            )
    return found


def render_vs_published_section(summary: Summary, prices: Prices) -> str:
    """vs_published.md's cost section: this sweep's priced devices beside the priced published ones."""
    if not prices:
        return ""
    tables = _beside_published_costs(summary, prices)
    parts = [
        "",
        "## Cost at the prices given (USD)",
        "",
        f"Prices: {prices.describe()}. This run: its median samples/s on its own devices; published: the post's "
        f"whole-node samples/s on {published.DEVICES} devices. Steady-state speed: no warm-up, start-up or evaluation.",
        "",
        "### Per 1M training samples",
        "",
        tables[0],
        "",
        f"### The published run ({published.EXPERIMENT} = {published.SAMPLES:,} samples)",
        "",
        tables[1],
    ]
    return "\n".join(parts + _ci_baselines_costs(prices)) + "\n"


def _beside_published_costs(summary: Summary, prices: Prices) -> list[str]:
    """vs_published.md's two cost tables, USD per 1M samples and for the published run: our priced devices beside
    the priced published ones, one row per configuration."""
    ours = [d for d in summary.devices if cell_price(summary, d, prices)]
    priced = [d for d in published.THROUGHPUT if prices.for_published(d)]
    rows_order = list(summary.columns) + [c for c in published.CONFIGS if c not in summary.columns]
    header = ["configuration"] + [f"{d} (this run)" for d in ours] + [f"{d} (published)" for d in priced]

    def published_cell(device, column, index):
        node = published.THROUGHPUT[device].get(column)
        if node is None:
            return "n/a" if column in published.CONFIGS else "-"
        price = prices.for_published(device).usd_per_hour
        return usd(
            (
                usd_per_million_samples(price, published.DEVICES, node),
                usd_published_experiment(price, published.DEVICES, node),
            )[index]
        )

    def our_cell(device, column, index):
        cost = cell_cost(summary, device, column, prices)
        return usd(cost[index]) if cost else "-"

    tables = []
    for index in (0, 1):
        tables.append(
            _markdown_table(
                header,
                [
                    [c] + [our_cell(d, c, index) for d in ours] + [published_cell(d, c, index) for d in priced]
                    for c in rows_order
                ],
            )
        )
    return tables


def _ci_baselines_costs(prices: Prices) -> list[str]:
    """vs_published.md's cost of upstream's CI baselines at the prices given, or nothing where none is priced."""
    ci = [c for c in published_costs(prices) if c["configuration"] == "upstream CI"]
    if not ci:
        return []
    return [
        "",
        "### Upstream's CI baselines",
        "",
        _markdown_table(
            ["device", "USD per 1M samples", "USD, published run"],
            [[c["device"], usd(c["usd_per_1m_samples"]), usd(c["usd_published_experiment"])] for c in ci],
        ),
    ]


# ---------------------------------------------------------------------------------------------
# chart_cost.png
# ---------------------------------------------------------------------------------------------


def cost_chart_points(summary: Summary, prices: Prices) -> dict:
    """The chart's points per panel: {"usd": [...], "energy": [...]}, each point a dict with x (samples/s per
    device), y, label, device and `published`. A panel without points is absent."""
    panels: dict = {}
    for device in summary.devices:
        for column in summary.columns:
            cell = summary.cells.get((device, column))
            if cell is None or not cell.median_per_device:
                continue
            if prices and (cost := cell_cost(summary, device, column, prices)):
                panels.setdefault("usd", []).append(
                    {"x": cell.median_per_device, "y": cost[0], "label": column, "device": device, "published": False}
                )
            energy = cell_energy(summary, device, column)
            if energy and "joules_per_sample" in energy:
                panels.setdefault("energy", []).append(
                    {
                        "x": cell.median_per_device,
                        "y": energy["joules_per_sample"],
                        "label": column,
                        "device": device,
                        "published": False,
                    }
                )
    if prices:
        for c in published_costs(prices):
            panels.setdefault("usd", []).append(
                {
                    "x": c["per_device"],
                    "y": c["usd_per_1m_samples"],
                    "label": c["configuration"],
                    "device": f"{c['name']} x{published.DEVICES} (published)",
                    "published": True,
                }
            )
    return panels


PANEL_TITLES = {"usd": "USD per 1M training samples", "energy": "joules per training sample (measured)"}


def render_cost_chart(summary: Summary, prices: Prices, path: Path) -> bool:
    """chart_cost.png: samples/s per device (x) against USD per 1M samples and/or joules per sample (y, lower is
    better), one point per configuration and device, the published rows as stars. False (no file): nothing to draw."""
    panels = cost_chart_points(summary, prices)
    if not panels:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.5), squeeze=False)
    every_device = list(dict.fromkeys(p["device"] for points in panels.values() for p in points))
    colours = {d: f"C{i % 10}" for i, d in enumerate(every_device)}  # one colour per device in both panels
    for ax, (panel, points) in zip(axes[0], panels.items()):
        devices = list(dict.fromkeys(p["device"] for p in points))
        for device in devices:
            mine = [p for p in points if p["device"] == device]
            is_published = mine[0]["published"]
            ax.scatter(
                [p["x"] for p in mine],
                [p["y"] for p in mine],
                color=colours[device],
                label=device,
                marker="*" if is_published else "o",
                s=140 if is_published else 45,
                edgecolors="black" if is_published else "none",
                zorder=3,
            )
            for p in mine:
                ax.annotate(p["label"], (p["x"], p["y"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        for axis, values in (("x", [p["x"] for p in points]), ("y", [p["y"] for p in points])):
            if min(values) > 0 and max(values) / min(values) > 20:
                (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
        ax.set_xlabel("samples/s per device (higher is faster)")
        ax.set_ylabel(PANEL_TITLES[panel] + " (lower is cheaper)")
        ax.set_title(PANEL_TITLES[panel])
        ax.grid(True, alpha=0.3)
        ax.margins(0.15)
        ax.legend(fontsize=7)
    any_published = any(p["published"] for points in panels.values() for p in points)
    fig.suptitle(
        "BridgeTower fine-tuning: speed against cost" + (" (stars: the published runs)" if any_published else "")
    )
    save_figure(fig, path)
    return True


def render(out: Path, summary: Summary, meta: Mapping) -> tuple[str, str, bool]:
    """(table.md sections, vs_published.md section, whether chart_cost.png was written) for `meta["prices"]`."""
    prices = meta.get("prices") or Prices()
    wrote_chart = render_cost_chart(summary, prices, out / "chart_cost.png")
    return render_table_sections(summary, prices), render_vs_published_section(summary, prices), wrote_chart

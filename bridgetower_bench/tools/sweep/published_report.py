"""vs_published.md: this sweep's cells beside the published figures (docs/PUBLISHED.md).

Its own page, apart from table.md (bench_report.py), so that what is compared with the post, and how, reads in one
place; cost_report.py adds the cost section.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from bridgetower_bench import published
from bridgetower_bench.tools.sweep.bench_report import Summary, _fmt, _markdown_table, speedup


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
        f"## Upstream's CI baselines ({published.CI_RELEASE_LINE}, {published.DEVICES} devices)",
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

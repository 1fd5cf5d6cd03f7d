"""Compare training runs side by side: throughput next to retrieval quality.

    python -m bridgetower_bench.tools.compare runs/a runs/b
    python -m bridgetower_bench.tools.compare --group upstream=runs/u1,runs/u2,runs/u3 \\
        --group fast=runs/f1,runs/f2,runs/f3 --json comparison.json

Each DIR is a run's output directory holding all_results.json and/or train_results.json,
validation_results.json, test_results.json. A group is the same configuration repeated under different
seeds; for groups the tool prints mean, standard deviation and min-max, and says for every
quality metric whether the difference between groups is larger than the run-to-run spread.

With --price DEVICE=USD_PER_HOUR (repeatable) or --prices FILE (tools/cost.py), each run also gets USD per
1M training samples and the cost of the published run, and the published figures of the priced published
devices are listed at the same prices. Energy figures the runs recorded (energy_*) are shown beside speed,
and so are the transformers, accelerate and datasets versions each run ran: the report opens with a warning
when they are not the same in every run (tools/stack_versions.py). Gaudi runs record the Gaudi configuration they
trained with (bf16 autocast, its op lists, fused ops, the keys GaudiConfig ignored: bridgetower_bench/
gaudi_configuration.py): the report opens with a warning when runs put side by side differ in it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from bridgetower_bench import published
from bridgetower_bench.gaudi_configuration import RECORD_KEYS as GAUDI_CONFIG_KEYS
from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.sweep.cost import Prices, add_price_arguments, cost_fields, prices_from_args, refuse
from bridgetower_bench.tools.sweep.stack_versions import STACK_KEYS, differing_versions, versions_note
from bridgetower_bench.user_errors import UserInputError


RESULT_FILES = ("all_results.json", "train_results.json", "validation_results.json", "test_results.json")

THROUGHPUT_KEYS = (
    "train_samples_per_second",
    "train_samples_per_second_per_device",
    "data_wait_fraction",
    "data_wait_fraction_epoch_start",
    "data_wait_fraction_steady",
    "world_size",
    "nodes",
    "per_device_train_batch_size",
    "loader",
    "image_pipeline",
    "device_name",
    *STACK_KEYS,
    *GAUDI_CONFIG_KEYS,
    "energy_source",
    "energy_reason",
    "energy_joules_per_sample",
    "energy_watts_per_device",
    "usd_per_device_hour",
    "usd_per_1m_samples",
    "usd_published_experiment",
)

SPREAD_RULE = (
    "A difference between two groups is 'within spread' when |mean_a - mean_b| <= the larger "
    "min-max range (max - min) of the two groups' repeats; groups with a single run have no range. "
    "The range is used rather than a standard deviation because a few seeds per configuration "
    "give it without assuming a distribution, and it errs on the side of calling a difference noise."
)

_QUALITY_KEY = re.compile(
    r"^(?P<split>eval|test)_(?:(?P<loss>loss)|(?P<dir>i2t|t2i)_(?:recall@(?P<k>\d+)|(?P<rank>mean_rank)))$"
)


# ---------------------------------------------------------------------------------- reading


def load_run(run_dir: str | os.PathLike) -> dict:
    """All metrics of one run directory, merged from its results files.

    all_results.json is read first; the per-split files, when present, override it.
    """
    path = Path(run_dir)
    if not path.exists():
        raise ValueError(f"run directory not found: {run_dir}")
    if not path.is_dir():
        raise ValueError(f"not a directory: {run_dir}")
    merged: dict = {}
    found = False
    for name in RESULT_FILES:
        file = path / name
        if not file.is_file():
            continue
        found = True
        try:
            content = json.loads(file.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}: not valid JSON ({error})") from error
        if not isinstance(content, dict):
            raise ValueError(f"{file}: expected a JSON object of metrics, found {type(content).__name__}")
        merged.update(content)
    if not found:
        raise ValueError(f"no results in {run_dir}: expected one of {', '.join(RESULT_FILES)}")
    if "world_size" in merged:  # a training run: a run across nodes lists each node's figures in per_node
        per_node = merged.get("per_node")
        merged.setdefault("nodes", len(per_node) if isinstance(per_node, list) and per_node else 1)
    return merged


def gaudi_config_note(records: Iterable[Mapping]) -> Optional[str]:
    """One sentence when Gaudi runs trained with different Gaudi configurations, else None."""
    differing = differing_versions(records, GAUDI_CONFIG_KEYS)
    if not differing:
        return None
    return (
        f"Not like for like: these runs trained with different Gaudi configurations ({'; '.join(differing)}); "
        "see each run's gaudi_* fields."
    )


def parse_group(text: str) -> tuple[str, list[str]]:
    """``NAME=DIR1,DIR2`` -> (NAME, [DIR1, DIR2])."""
    name, sep, dirs_text = text.partition("=")
    dirs = [d.strip() for d in dirs_text.split(",") if d.strip()]
    if not sep or not name.strip() or not dirs:
        raise ValueError(f"--group {text!r}: expected NAME=DIR1,DIR2,...")
    return name.strip(), dirs


# ---------------------------------------------------------------------------------- metrics


def quality_keys(present: Iterable[str]) -> list[str]:
    """The quality metrics among ``present``, in reading order: train loss, then per split
    loss, i2t recalls by k, t2i recalls by k, mean ranks."""
    present = set(present)
    matched = {key: match for key in present if (match := _QUALITY_KEY.match(key))}

    def order(key: str) -> tuple:
        match = matched[key]
        split = 0 if match["split"] == "eval" else 1
        if match["loss"]:
            return (split, 0, 0, 0)
        direction = 0 if match["dir"] == "i2t" else 1
        if match["k"]:
            return (split, 1, direction, int(match["k"]))
        return (split, 2, direction, 0)

    split_keys = sorted(matched, key=order)
    return (["train_loss"] if "train_loss" in present else []) + split_keys


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def group_stats(values: Sequence[Any]) -> dict | None:
    """mean, std (sample; None for one run), min, max and n of the numeric values; None if none."""
    numbers = [float(v) for v in values if _is_number(v)]
    if not numbers:
        return None
    return {
        "mean": statistics.fmean(numbers),
        "std": statistics.stdev(numbers) if len(numbers) > 1 else None,
        "min": min(numbers),
        "max": max(numbers),
        "n": len(numbers),
    }


def compare_to_baseline(baseline: dict | None, other: dict | None) -> dict | None:
    """Difference of group means and whether it is within the run-to-run spread (see SPREAD_RULE)."""
    if baseline is None or other is None:
        return None
    ranges = [s["max"] - s["min"] for s in (baseline, other) if s["n"] > 1]
    difference = other["mean"] - baseline["mean"]
    if not ranges:
        verdict, spread = "unknown: one run per group", None
    else:
        spread = max(ranges)
        verdict = "within spread" if abs(difference) <= spread else "outside spread"
    return {"difference": difference, "spread": spread, "verdict": verdict}


# ---------------------------------------------------------------------------------- formatting


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _format_stats(stats: dict | None, texts: list[str]) -> str:
    if stats is None:
        return " / ".join(_format(text) for text in texts) if texts else "-"
    if stats["n"] == 1:
        return f"{_format(stats['mean'])} (n=1)"
    return (
        f"{_format(stats['mean'])} ± {_format(stats['std'])} "
        f"({_format(stats['min'])}–{_format(stats['max'])}, n={stats['n']})"
    )


def _unique_labels(dirs: Sequence[str]) -> list[str]:
    """Short column names: the directory's name, or the path as given when names collide."""
    names = [Path(d).name or str(d) for d in dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, dirs)]


# ---------------------------------------------------------------------------------- report


def build_report(
    run_dirs: Sequence[str], groups: Mapping[str, Sequence[str]], prices: Optional[Prices] = None
) -> dict:
    """Everything the tables show, as plain data (also what ``--json`` writes)."""
    all_dirs = list(dict.fromkeys(list(run_dirs) + [d for dirs in groups.values() for d in dirs]))
    if not all_dirs:
        raise ValueError("nothing to compare: give run directories and/or --group NAME=DIR1,DIR2")
    metrics_by_dir = {d: load_run(d) for d in all_dirs}
    prices = prices or Prices()
    if prices:  # every price must match a run or a published device
        prices.check(
            [(m.get("device_type"), m.get("device_name")) for m in metrics_by_dir.values()], "the runs compared"
        )
        for metrics in metrics_by_dir.values():
            metrics.update(cost_fields(metrics, prices))
    present = {key for metrics in metrics_by_dir.values() for key in metrics}
    throughput = [k for k in THROUGHPUT_KEYS if k in present]
    quality = quality_keys(present)

    runs = {
        label: {"dir": d, "metrics": {k: metrics_by_dir[d].get(k) for k in throughput + quality}}
        for label, d in zip(_unique_labels(all_dirs), all_dirs)
    }
    report: dict[str, Any] = {
        "throughput_keys": throughput,
        "quality_keys": quality,
        "runs": runs,
        "groups": {},
        "comparisons": [],
        "rule": SPREAD_RULE,
        "versions_note": versions_note(metrics_by_dir.values()),
        "gaudi_config_note": gaudi_config_note(metrics_by_dir.values()),
    }
    if prices:
        from bridgetower_bench.tools.sweep.cost_report import published_costs

        report["prices"] = [{"device": p.device, "usd_per_device_hour": p.usd_per_hour} for p in prices.entries]
        report["published_costs"] = [
            {k: (v.device if k == "price" else v) for k, v in c.items()} for c in published_costs(prices)
        ]
    for name, dirs in groups.items():
        stats, texts = {}, {}
        for key in throughput + quality:
            values = [metrics_by_dir[d].get(key) for d in dirs]
            stats[key] = group_stats(values)
            texts[key] = sorted({str(v) for v in values if isinstance(v, str)})
        report["groups"][name] = {"dirs": list(dirs), "stats": stats, "texts": texts}

    names = list(groups)
    for other in names[1:]:
        for key in quality:
            result = compare_to_baseline(
                report["groups"][names[0]]["stats"][key], report["groups"][other]["stats"][key]
            )
            if result is not None:
                report["comparisons"].append({"metric": key, "baseline": names[0], "group": other, **result})
    return report


def _speedups(report: dict) -> str:
    """One line: each group's mean samples/s relative to the baseline group's (empty if unknown)."""
    groups = report["groups"]
    names = list(groups)
    baseline = groups[names[0]]["stats"].get("train_samples_per_second")
    if len(names) < 2 or not baseline or baseline["mean"] <= 0:
        return ""
    parts = []
    for name in names[1:]:
        stats = groups[name]["stats"].get("train_samples_per_second")
        if stats:
            parts.append(f"{name} x{stats['mean'] / baseline['mean']:.2f}")
    return f"\n\nSpeed-up vs {names[0]} (mean train_samples_per_second): " + ", ".join(parts) if parts else ""


def render_markdown(report: dict) -> str:
    """The report as markdown: runs side by side, then group statistics and the verdicts."""
    labels = list(report["runs"])
    sections = [f"**{report[note]}**" for note in ("versions_note", "gaudi_config_note") if report.get(note)]
    for title, keys in (("Throughput", report["throughput_keys"]), ("Quality", report["quality_keys"])):
        if keys:
            rows = [[key] + [_format(report["runs"][label]["metrics"][key]) for label in labels] for key in keys]
            sections.append(f"## {title}: runs\n\n" + _table(["metric"] + labels, rows))

    groups = report["groups"]
    if groups:
        names = list(groups)
        keys = report["throughput_keys"] + report["quality_keys"]
        rows = [
            [key] + [_format_stats(groups[n]["stats"][key], groups[n]["texts"][key]) for n in names] for key in keys
        ]
        members = "; ".join(f"{n}: {', '.join(groups[n]['dirs'])}" for n in names)
        sections.append(
            "## Groups: mean ± std (min–max, n)\n\n"
            + _table(["metric"] + names, rows)
            + f"\n\nMembers - {members}"
            + _speedups(report)
        )
    if report.get("published_costs"):
        from bridgetower_bench.tools.sweep.cost_report import usd

        rows = [
            [
                c["device"],
                c["configuration"],
                _format(c["samples_per_second"]),
                usd(c["usd_per_1m_samples"]),
                usd(c["usd_published_experiment"]),
            ]
            for c in report["published_costs"]
        ]
        sections.append(
            f"## Published figures at these prices ({published.DEVICES} devices)\n\n"
            + _table(
                [
                    "device",
                    "configuration",
                    "samples/s",
                    "USD per 1M samples",
                    f"USD, published run ({published.EXPERIMENT})",
                ],
                rows,
            )
        )
    if report["comparisons"]:
        rows = [
            [
                c["metric"],
                f"{c['group']} vs {c['baseline']}",
                f"{c['difference']:+.4g}",
                _format(c["spread"]),
                c["verdict"],
            ]
            for c in report["comparisons"]
        ]
        sections.append(
            "## Quality: difference vs run-to-run spread\n\n"
            + _table(["metric", "groups", "Δ mean", "spread", "verdict"], rows)
            + f"\n\n{SPREAD_RULE}"
        )
    return "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------------------------- command line


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bridgetower_bench.tools.compare",
        description="Print a markdown table of training runs side by side: throughput "
        "(samples/s, data-wait share, loader, image pipeline) and retrieval quality "
        "(eval/test recall@k, mean ranks, losses).",
        epilog=SPREAD_RULE + " The first --group is the baseline the others are compared with.",
    )
    parser.add_argument("dirs", nargs="*", metavar="DIR", help="run output directories")
    parser.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="NAME=DIR1,DIR2",
        help="repeats of one configuration (different seeds); give the flag once per group",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the comparison as JSON to this file")
    add_price_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.json:
        tool_paths.output_file("--json", args.json)
    try:
        groups: dict = {}
        for text in args.group:
            name, dirs = parse_group(text)
            if name in groups:
                raise ValueError(f"--group {name!r} is given twice")
            groups[name] = dirs
        prices = prices_from_args(args.price, args.prices)
        report = build_report(args.dirs, groups, prices)
    except UserInputError as error:
        refuse(parser.prog, error)
    except ValueError as error:
        parser.error(str(error))
    sys.stdout.write(render_markdown(report))
    if args.json:
        write_atomically(
            args.json, json.dumps(relative_dirs(report, Path(args.json).resolve().parent), indent=2) + "\n"
        )
    return 0


def relative_dirs(report: Any, base: Path) -> Any:
    """`report` as the JSON file shows it: run directories inside `base` (the file's own directory) named
    relative to it, so that a shared comparison does not expose the machine's layout; others as given."""
    dirs = {d for run in report["runs"].values() for d in [run["dir"]]} | {
        d for g in report["groups"].values() for d in g["dirs"]
    }
    shown = {}
    for d in dirs:
        try:
            shown[d] = str(Path(d).resolve().relative_to(base))
        except ValueError:
            shown[d] = d

    def walk(value):
        if isinstance(value, dict):
            return {shown.get(k, k): walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return shown.get(value, value) if isinstance(value, str) else value

    return walk(report)


if __name__ == "__main__":
    tool_paths.run(main)

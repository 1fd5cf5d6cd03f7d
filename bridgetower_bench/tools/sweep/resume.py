"""One sweep per --out, resumed: the records it rewrites after every run (results.json with its settings, results.csv),
read back by a rerun that keeps the finished rows and makes only the missing runs; other settings refused; its lock.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Optional

from filelock import FileLock, Timeout

from bridgetower_bench.output_dir import run_directory
from bridgetower_bench.output_dir.atomic_files import atomic_path, write_atomically, write_json_atomically
from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.tools.hosts import same_node_key
from bridgetower_bench.tools.sweep.bench_report import OK, summarise
from bridgetower_bench.tools.sweep.commands import Plan, Variant, shareable_args
from bridgetower_bench.tools.sweep.cost import COST_COLUMNS, cost_fields
from bridgetower_bench.tools.sweep.rows import DEVICE_KEYS, RUN_FIGURES, read_json
from bridgetower_bench.tools.sweep.scaling_report import add_scaling_efficiency
from bridgetower_bench.user_errors import UserInputError


# results.csv columns, in this order; any other keys (all software versions, eval metrics) follow, sorted.
CSV_COLUMNS = (
    "run_id",
    "status",
    "returncode",
    "error",
    *DEVICE_KEYS,
    "script",
    "preset",
    "world_size",
    "nodes",
    "per_device_train_batch_size",
    "requested_loader",
    "loader",
    "image_pipeline",
    "jpeg_decoder",
    "workers",
    "persistent_workers",
    "prefetch_factor",
    "repeat",
    *RUN_FIGURES,
    "version_torch",
    "version_cuda",
    "version_intel_gaudi",
    "version_transformers",
    "version_accelerate",
    "version_datasets",
    "wall_seconds",
    "other_cpu_cores",  # other programs' CPU use during the run, in cores (the scaling section flags a busy machine)
    "cpu_count",
    "log",
    "output_dir",
    "command",
)
# Columns that follow CSV_COLUMNS when some row has them (no price, no cost column; no energy record, none of these).
OPTIONAL_COLUMNS = (
    "scaling_efficiency",
    "energy_source",
    "energy_reason",
    "energy_joules_per_sample",
    "energy_watts_per_device",
) + COST_COLUMNS

SWEEP_LOCK = ".bench.lock"  # filelock's lock file: held for the whole sweep
SWEEP_HOLDER = ".bench-holder.json"  # who holds it (pid, host, since), for the refusal's message

# What a finished row measured, besides its own variant: a rerun into the same --out must keep all of
# them, or its rows would not compare with the kept ones. (settings key, how the user names it)
MEASURED_SETTINGS = (
    ("preset", "--preset"),
    ("script", "--script"),
    ("device", "device"),
    ("device_name", "device model"),
    ("nproc", "--nproc"),
    ("shape", "--shape"),
    ("extra_args", "--extra-args"),
    ("base_args", "the runs' arguments"),
    ("hosts", "--hostfile"),
)


@contextmanager
def sweep_lock(out: Path) -> Iterator[None]:
    """Hold --out for this sweep (filelock; released when the sweep ends, by the kernel if it is killed).

    A second sweep into the same --out is refused naming the holder.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserInputError(f"--out {out}: cannot make the directory ({error.strerror or error})") from None
    lock = FileLock(str(out / SWEEP_LOCK), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        holder = read_json(out / SWEEP_HOLDER)
        who = (
            f"process {holder['pid']} on host {holder['host']}, since {holder['since']}"
            if {"pid", "host", "since"} <= set(holder)
            else "a process that left no details"
        )
        raise UserInputError(
            f"--out {out} is in use by another sweep ({who}): wait for it to end, or choose another --out"
        ) from None
    try:
        write_json_atomically(
            out / SWEEP_HOLDER,
            {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")},
        )
        yield
    finally:
        try:
            (out / SWEEP_HOLDER).unlink()
        except OSError:
            pass
        lock.release()


def plan_settings(plan: Plan, out: Path) -> dict:
    """The settings of `MEASURED_SETTINGS`, as results.json records them."""
    return {
        "preset": plan.preset,
        "shape": plan.shape,
        "script": plan.script,
        "device": plan.device,
        "device_name": plan.expected_device_name,
        "nproc": plan.nproc,
        "base_args": shareable_args(plan.base_args, out),
        "extra_args": shareable_args(plan.extra_args, out),
        "hosts": plan.hosts or None,  # the nodes a run across nodes takes its first ones from
    }


def _show(value) -> str:
    if isinstance(value, list):
        return f'"{shlex.join(value)}"'
    return str(value) if value not in ("", None) else "(none)"


def _nodes(value: object) -> object:
    """A --hostfile setting as its nodes compare (`hosts.same_node_key`); as recorded where it is not a list of names."""
    if isinstance(value, list) and all(isinstance(host, str) for host in value):
        return [same_node_key(host) for host in value]
    return value


def setting_differences(earlier: Mapping, now: Mapping) -> list[str]:
    """ "<setting> <old> → <new>" for every measured setting that differs (settings an earlier sweep did not
    record, or a device model unknown to a dry run, are not compared)."""
    differences = []
    for key, name in MEASURED_SETTINGS:
        if key not in earlier or earlier[key] in ("", None) or now.get(key) in ("", None) or earlier[key] == now[key]:
            continue
        old, new = earlier[key], now[key]
        if key == "hosts" and _nodes(old) == _nodes(new):
            continue  # the same nodes written otherwise (a name's case or trailing dot, an address's form, a user)
        if key == "base_args" and ("--do_eval" in old) != ("--do_eval" in new):
            differences.append(
                f"--eval {'on' if '--do_eval' in old else 'off'} → {'on' if '--do_eval' in new else 'off'}"
            )
            continue
        if key == "base_args":  # long: name only the arguments that changed
            old, new = [a for a in old if a not in new], [a for a in new if a not in old]
        differences.append(f"{name} {_show(old)} → {_show(new)}")
    return differences


def read_earlier_sweep(out: Path) -> tuple[dict, list[dict], list[Variant]]:
    """What an earlier sweep into `out` recorded in results.json: its settings, rows and variants (all empty if none)."""
    path = out / "results.json"
    if not path.exists():
        return {}, [], []
    try:
        document = json.loads(read_regular_file(path))
        settings, rows = document.get("bench", {}), document["runs"]
        known = {f.name for f in fields(Variant)}
        variants = [
            Variant(**{k: v for k, v in entry.items() if k in known}) for entry in settings.get("variants", [])
        ]
        if not (isinstance(rows, list) and all(isinstance(r, dict) and "run_id" in r for r in rows)):
            raise ValueError("its runs are not a list of rows")
        for row in rows:
            row.setdefault("nodes", 1)  # rows of sweeps before --nodes: one node
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserInputError(
            f"--out {out}: {path.name} cannot be read as a sweep's results ({e}); "
            "move it away to start afresh, or choose another --out"
        ) from None
    return settings, rows, variants


def plan_resume(plan: Plan, out: Path) -> tuple[dict, list[Variant], list[Variant]]:
    """(kept rows by run_id, every variant of the merged matrix, the variants still to run).

    Rows of runs that finished ("ok") are kept; the plan's runs without one (never run, failed, interrupted)
    are to run. Variants of the earlier sweep that this plan leaves out keep their rows. A plan whose
    measured settings differ from the earlier sweep's is refused, naming each setting (old → new).
    """
    settings, rows, variants = read_earlier_sweep(out)
    differences = setting_differences(settings, plan_settings(plan, out))
    if differences:
        raise UserInputError(
            f"--out {out} holds runs made with other settings ({'; '.join(differences)}): "
            "their rows would not compare with new ones; use the same settings or another --out"
        )
    kept = {row["run_id"]: row for row in rows}
    merged = list(dict.fromkeys(variants + list(plan.variants)))
    to_run = [v for v in plan.variants if kept.get(v.run_id, {}).get("status") != OK]
    return kept, merged, to_run


def refuse_held_run_dirs(variants: Sequence[Variant], out: Path) -> None:
    """A run directory a live process holds (a run a killed sweep left, or anyone's) is never touched: refuse."""
    for variant in variants:
        holder = run_directory.held_by(str(out / "runs" / variant.run_id))
        if holder:
            raise UserInputError(
                f"--out {out}: runs/{variant.run_id} is in use by a live run ({holder}); "
                "wait for it to end or stop it, then rerun"
            )


def write_results(out: Path, plan: Plan, rows: list[dict], variants: Optional[Sequence[Variant]] = None) -> None:
    """results.json (the plan's settings, the matrix and every row) and results.csv (every row), replaced atomically;
    with prices, each row gets its cost columns first."""
    for row in rows:
        row.update(cost_fields(row, plan.prices))
    if len({row.get("world_size") for row in rows}) > 1:  # a scaling curve (--devices)
        add_scaling_efficiency(summarise(rows))
    document = {
        "bench": {
            **plan_settings(plan, out),
            "env": plan.mode_env,
            "variants": [asdict(v) for v in (variants or plan.variants)],
            **({"prices": {p.device: p.usd_per_hour for p in plan.prices.entries}} if plan.prices else {}),
        },
        "runs": rows,
    }
    write_atomically(out / "results.json", json.dumps(document, indent=2, default=str) + "\n")
    present = {k for row in rows for k in row}
    columns = list(CSV_COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in present]
    columns += sorted(present - set(columns))
    with atomic_path(out / "results.csv") as temporary:
        with open(temporary, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()} for row in rows)

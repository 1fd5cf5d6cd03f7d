"""The benchmark sweep: run a training script over a matrix of loader settings and tabulate throughput.

    python -m bridgetower_bench.tools.bench                       # local preset: tiny model, synthetic data, 11 runs, ~2.5 min on 2 CPU cores
    python -m bridgetower_bench.tools.bench --preset blog         # the published run: BridgeTower Large, New Yorker, 8 devices
    python -m bridgetower_bench.tools.bench --workers 0 2 --image-pipelines upstream fast --repeats 3 --eval
    python -m bridgetower_bench.tools.bench --dry-run             # print the commands only

Every run is one subprocess of run_bridgetower.py (Gaudi) or run_bridgetower_cuda.py (NVIDIA/CPU)
with its own output directory; its figures come from the train_results.json the script saves
(steady-state samples/s after the warm-up steps, data-wait fraction, the loader that really ran).

Matrix: every --image-pipelines x --workers with the PyTorch loader, plus every other --loaders
entry (mediapipe on Gaudi, device_decode on NVIDIA) at --loader-workers (default: the largest
--workers value, as in the published "workers=2 + mediapipe" column), times --repeats. Runs that
have loader workers are also made with each --persistent-workers setting (default: without and with
for the local preset; without, upstream's default, for the blog preset) and each --prefetch-factors
value. Repeats are the outer loop, so slow drift of the machine spreads over all configurations.
The scaling curve (--devices 1,2,4,8): the matrix's first configuration runs again on each other count of
--devices, same flags and per-device batch. By default the CUDA script's local preset on a CPU of 2 cores or
more measures 1 and 2 processes (one extra run); elsewhere there is no curve unless asked for (--devices 0:
none). Across nodes (--hostfile FILE --nodes 1,2,4): the first configuration also runs on FILE's first N nodes,
--nproc devices each; docs/RUNS.md says what such a run needs.

Written to --out (default bench_out/<timestamp>):
    logs/<run>.log       each run's command line and full output
    hostfiles/<run>      a Gaudi run across nodes: the nodes it was given
    runs/<run>/          each run's output directory (weights deleted unless --keep-weights)
    results.json / .csv  one row per run, rewritten after every run (Ctrl-C keeps the finished rows),
                         with the settings the rows were measured with
    table.md             samples/s per device (rows) and configuration (columns), the published layout;
                         the data wait, and its split between epoch-start steps and the steady state
    vs_published.md      the same figures beside the published ones (whole node and per device)
    chart.png            bar chart of table.md
    chart_scaling.png    samples/s per device against the device count, labelled with the scaling efficiency
    chart_cost.png       samples/s per device against USD per 1M samples (with --price/--prices) and joules per
                         sample (where the runs measured energy), the published rows marked
No price is built in (--price DEVICE=USD_PER_HOUR, --prices FILE: docs/COST.md); energy per sample comes from the
device's counter where one exists (NVML, HLML, RAPL), else the rows say `not measured` and why. Credential values
are replaced by REDACTED in the records, and paths are written relative to --out (`$OUT/...` in commands) or to
the repository.

Rerunning into the same --out resumes: finished rows are kept and only the missing runs are made; settings that
would change what a kept row measured are refused (exit status 2). One sweep at a time per --out; its runs die
with it. docs/RUNS.md ("The benchmark sweep's output directory"): the details.

Presets. `local` (default) runs the embedded fixtures offline on whatever device is present, in the published
run's epoch shape (`--shape published`: two epoch starts counted) or inside one epoch (`--shape within-epoch`);
CPU figures on a shared machine are noisy: use --repeats and read the data-wait columns. `blog` is the published
command line as upstream's CI runs it (docs/PUBLISHED.md). Without an HPU or NVIDIA GPU only the local preset
runs, on the CPU; a driver torch cannot use is refused, never benchmarked as a CPU. `--device cpu` runs on the
CPU on purpose.

`--extra-args` is appended to every run's command line, so it overrides preset values
(`--extra-args "--max_steps 30"`); a single flag without a space must be written
`--extra-args=--flag` so that argparse does not take it for one of ours.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import NoReturn, Optional

from bridgetower_bench.redaction import redact_args, redact_text
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.sweep.bench_report import OK
from bridgetower_bench.tools.sweep.commands import (
    DEFAULT_LOCAL_PIPELINES,
    LOADERS,
    REMOTE_MARGIN,
    SCRIPTS,
    Plan,
    shareable_args,
)
from bridgetower_bench.tools.sweep.cost import add_price_arguments, prices_from_args, refuse
from bridgetower_bench.tools.sweep.plan import local_device_name, make_plan
from bridgetower_bench.tools.sweep.presets import SHAPES
from bridgetower_bench.tools.sweep.report import render_all
from bridgetower_bench.tools.sweep.resume import plan_resume
from bridgetower_bench.tools.sweep.run import run_sweep
from bridgetower_bench.user_errors import UserInputError


def device_counts(text: str) -> list[int]:
    """--devices 1,2,4,8 (or --nodes 1,2) as a list; 0 alone: no curve."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: counts separated by commas, e.g. 1,2,4,8") from None
    return [] if counts == [0] else counts


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (`unrecognized arguments: --hub_token ...`) with credential values redacted."""

    def error(self, message: str) -> NoReturn:
        super().error(redact_text(message))


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m bridgetower_bench.tools.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        choices=("local", "blog"),
        default="local",
        help="local: embedded tiny fixtures (default); blog: the published run.",
    )
    parser.add_argument(
        "--script",
        choices=("auto", "cuda", "gaudi"),
        default="auto",
        help="auto: the Gaudi script when an HPU is present, else the CUDA/CPU script.",
    )
    _add_matrix_arguments(parser)
    _add_device_arguments(parser)
    parser.add_argument("--repeats", type=int, default=1, help="Runs of every configuration; tables show the median.")
    parser.add_argument(
        "--eval", action="store_true", help="Also evaluate (--do_eval): retrieval recall lands in the results."
    )
    parser.add_argument(
        "--extra-args", default="", help='Flags appended to every run, e.g. "--max_steps 30 --seed 1".'
    )
    parser.add_argument("--out", type=Path, default=None, help="Output directory (default: bench_out/<timestamp>).")
    parser.add_argument(
        "--keep-weights", action="store_true", help="Keep each run's saved model (deleted by default)."
    )
    parser.add_argument("--dry-run", action="store_true", help="Print the commands and exit.")
    add_price_arguments(parser)
    return parser


def _add_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the matrix: workers, loaders, image pipelines, persistent workers, prefetch factors, shape."""
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1, 2], help="dataloader_num_workers settings (default: 0 1 2)."
    )
    parser.add_argument(
        "--loaders",
        nargs="+",
        default=None,
        help=f"Loaders: {', '.join(LOADERS)} (default: torch, plus mediapipe on an HPU or device_decode on a GPU).",
    )
    parser.add_argument(
        "--loader-workers",
        type=int,
        nargs="+",
        default=None,
        help="Worker settings for loaders other than torch (default: the largest --workers).",
    )
    parser.add_argument(
        "--image-pipelines",
        nargs="+",
        default=None,
        help=f"Host image pipelines (default: {' '.join(DEFAULT_LOCAL_PIPELINES)} for the local preset, upstream for blog).",
    )
    parser.add_argument(
        "--persistent-workers",
        nargs="+",
        choices=("no", "yes"),
        default=None,
        help="Loader workers restarted every epoch (no, upstream's default) or kept (yes); runs with "
        "workers only. Default: no yes for the local preset, no for the blog preset.",
    )
    parser.add_argument(
        "--prefetch-factors",
        type=int,
        nargs="+",
        default=None,
        help="--dataloader_prefetch_factor settings, batches each worker loads ahead (default: PyTorch's, 2).",
    )
    parser.add_argument(
        "--shape",
        choices=SHAPES,
        default=None,
        help="Local preset: published (default; ~25 steps per epoch, two epoch starts counted) or "
        "within-epoch (10 counted steps inside the first epoch).",
    )


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the devices and nodes a run takes: --device, --nproc, the scaling curve, the hostfile."""
    parser.add_argument(
        "--device",
        choices=("auto", "cpu"),
        default="auto",
        help="auto (default): the HPU or NVIDIA GPU here (the local preset runs on the CPU only where the machine "
        "shows no accelerator; a driver torch cannot use is refused); cpu: train on the CPU on purpose.",
    )
    parser.add_argument("--nproc", type=int, default=None, help="Devices per run (default: 1; 8 for --preset blog).")
    parser.add_argument(
        "--devices",
        type=device_counts,
        default=None,
        help="The scaling curve: the matrix's first configuration also on these device counts, e.g. 1,2,4,8 "
        "(default: 1,2 for the local preset on a CPU of 2 cores or more; none otherwise; 0: none).",
    )
    parser.add_argument(
        "--nodes",
        type=device_counts,
        default=None,
        help="The curve across nodes: the first configuration also on these node counts of --nproc devices each, "
        "e.g. 1,2,4 (1: the matrix here; more: the first nodes of --hostfile).",
    )
    parser.add_argument(
        "--hostfile", default=None, help="With --nodes: the nodes, one `HOST slots=N` line each (DeepSpeed's format)."
    )
    parser.add_argument(
        "--remote-shell",
        type=shlex.split,
        default="ssh -tt",
        help="How a CUDA run across nodes starts on each node: this command, the host, then the shell line to run "
        "there (default: ssh -tt; the terminal makes a closed connection hang up the node's processes).",
    )
    parser.add_argument("--rdzv-port", default=29500, help="Port of a CUDA run's c10d rendezvous on the first node.")
    parser.add_argument(
        "--remote-start-timeout",
        default=60,
        help="Seconds each node of a CUDA run across nodes has to print its first line, or the run is stopped and "
        "its row failed (default: 60; ssh reaches a cluster node in seconds, a slow login in tens of seconds).",
    )
    parser.add_argument(
        "--remote-margin",
        default=REMOTE_MARGIN,
        help="A run across nodes is stopped, its row failed naming the nodes (or the Gaudi launcher) still running, "
        "after --remote-start-timeout plus this many times its configuration's run on one node (default: "
        f"{REMOTE_MARGIN:g}: the same samples on more devices, slower only by the nodes' start and the network).",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    # Building the fixtures tokenizes with tokenizers' threads; each run's fork would then print its warning.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:  # malformed prices are refused first; one that matches no device once the plan knows the device
        prices = prices_from_args(args.price, args.prices)
    except UserInputError as e:
        refuse(parser.prog, e)
    try:
        margin = tool_paths.positive_number("--remote-margin", args.remote_margin, "a factor above 0, e.g. 3")
        if not args.remote_shell:
            raise UserInputError("--remote-shell is empty: give the command that reaches a node, e.g. 'ssh -tt'")
    except UserInputError as e:
        return _refuse(parser, e)
    if args.out is not None:
        tool_paths.output_dir("--out", args.out)
    try:
        plan = make_plan(args, build_fixtures=not args.dry_run)
    except UserInputError as e:  # no usable accelerator: one line
        return _refuse(parser, e)
    except ValueError as e:
        parser.error(str(e))
    try:  # a price naming no device of this sweep and no published one is refused before anything runs
        prices.check([(plan.device, plan.expected_device_name or local_device_name(plan.device))], "this sweep")
    except UserInputError as e:
        refuse(parser.prog, e)
    plan.prices, plan.remote_margin = prices, margin
    out = (args.out or Path("bench_out") / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()

    print(_plan_line(plan))
    if args.dry_run:
        return _dry_run(parser, plan, out)
    if plan.env.get("PATH", "").startswith(str(tool_paths.HABANA_STANDIN)):
        print(
            f"note: no Habana software here; the Gaudi script runs on CPU with the stand-ins in {tool_paths.HABANA_STANDIN}"
        )

    # A plain `kill` stops the sweep like Ctrl-C does: the running subprocess is stopped, finished rows stay.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        rows, interrupted = run_sweep(plan, out, keep_weights=args.keep_weights)
    except UserInputError as e:  # --out in use, or holding runs of other settings
        return _refuse(parser, e)
    finally:
        signal.signal(signal.SIGTERM, previous)
    _report(out, rows, plan)
    if interrupted:
        print("interrupted: the rows above are the runs that finished")
        return 130
    planned = {v.run_id for v in plan.variants}
    return 0 if all(r["status"] == OK for r in rows if r["run_id"] in planned) else 1


def _plan_line(plan: Plan) -> str:
    """The sweep's first line: its runs, the script, the device, the scaling curve and the nodes, the shape."""
    curve = sorted({plan.processes(v) for v in plan.variants if v.devices})
    nodes = sorted({v.nodes for v in plan.variants if v.nodes})
    return (
        f"{len(plan.variants)} run(s) of {SCRIPTS[plan.script].name} on {plan.device} x{plan.nproc}"
        + (f" (scaling curve: also x{', x'.join(map(str, curve))})" if curve else "")
        + (f" (across nodes: {', '.join(map(str, nodes))} nodes x{plan.nproc})" if nodes else "")
        + f" ({plan.preset} preset, {plan.shape})"
    )


def _dry_run(parser: argparse.ArgumentParser, plan: Plan, out: Path) -> int:
    """--dry-run: what a sweep into `out` would run now, what it has no finished row of (a CUDA run across nodes:
    each node's command)."""
    try:
        to_run = plan_resume(plan, out)[2]
    except UserInputError as e:
        return _refuse(parser, e)
    if len(to_run) < len(plan.variants):
        print(f"{len(plan.variants) - len(to_run)} of them already finished in {out}: not run again")
    for variant in to_run:  # a CUDA run across nodes: each node's command
        command = redact_args(plan.command(variant, out / "runs" / variant.run_id))
        for started in plan.node_commands(variant, command):
            print(" ".join([f"{name}={value}" for name, value in plan.mode_env.items()] + [shlex.join(started)]))
    return 0


def _report(out: Path, rows: list[dict], plan: Plan) -> None:
    """The report written (table.md, vs_published.md, the charts); the table and the records' paths printed."""
    meta = {
        "preset": plan.preset,
        "shape": plan.shape,
        "model": _flag_value(shareable_args(plan.base_args + plan.extra_args, out), "--model_name_or_path"),
        "prices": plan.prices,
    }
    table = render_all(out, rows, meta)
    print()
    print(table)
    charts = [out / name for name in ("chart.png", "chart_scaling.png", "chart_cost.png") if (out / name).exists()]
    print(
        f"results: {out / 'results.json'}, {out / 'results.csv'}, {out / 'table.md'}, {out / 'vs_published.md'}, "
        + ", ".join(map(str, charts))
    )


def _refuse(parser: argparse.ArgumentParser, error: UserInputError) -> int:
    """A refusal in one line (no usage text), exit status 2."""
    print(f"{parser.prog}: error: {redact_text(str(error))}", file=sys.stderr)
    return 2


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    """The last value given to `flag` (the one argparse keeps)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


if __name__ == "__main__":
    tool_paths.run(main)

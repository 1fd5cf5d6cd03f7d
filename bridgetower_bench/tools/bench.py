"""The benchmark sweep: run a training script over a matrix of loader settings and tabulate throughput.

    python -m bridgetower_bench.tools.bench                       # local preset: tiny model, synthetic data, ~1.5 min on 2 idle CPU cores
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
The scaling curve (--devices 1,2,4,8): the matrix runs on --nproc devices, and its first configuration runs
again on each other count of --devices, same flags and per-device batch (so the global batch, and the steps
per epoch, change with the count), in every repeat. By default the CUDA script's local preset on a CPU of 2
cores or more measures 1 and 2 processes (one extra run); elsewhere there is no curve unless asked for
(--devices 0: none).
Across nodes (--hostfile FILE --nodes 1,2,4): the first configuration also runs on each --nodes count N above 1
(1 is the matrix, made here), on FILE's first N nodes (DeepSpeed's `HOST slots=N` lines, read as launch_gaudi
reads them; rank 0's node first), --nproc devices each, in every repeat. The Gaudi script: one launch_gaudi
--hostfile over those nodes (written to hostfiles/<run>; DeepSpeed's launcher reaches them with pdsh over ssh).
The CUDA script: launch_cuda on each node (--nnodes N, c10d rendezvous at FIRST_HOST:--rdzv-port, --rdzv_id
<run>), each through --remote-shell: `ssh -tt HOST 'cd <kit> && <the run's variables> <python> -m ...'`; the run
fails if any node's command fails, and its log holds every node's output as it comes, each line prefixed
`[node I]`. Every node needs the kit and its Python at the paths they have here, and --out must be on a
filesystem every node mounts at the same path: rank 0's node writes the run's train_results.json, which the
sweep reads. Stopping a run (or the sweep's end) reaches another node's processes through the closed
connection: ssh -tt's terminal hangs them up (a remote shell without a terminal leaves them running). Rows
record `nodes` beside world_size (1 in rows of earlier sweeps); table.md and chart_scaling.png name such points
("2 nodes x 8"). docs/RUNS.md: what a run across nodes needs and what was not run here.

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
                         (table.md's scaling section; each curve row's scaling_efficiency in results.json/.csv)
    chart_cost.png       samples/s per device against USD per 1M samples (with --price/--prices) and joules per
                         sample (where the runs measured energy), the published rows marked
With --price DEVICE=USD_PER_HOUR (repeatable) or --prices FILE, every row gets USD per 1M training samples and
the cost of the published run, and vs_published.md prices the published rows too (tools/cost.py: how a
DEVICE matches rows). No price is built in. Energy (joules per sample, watts per device) is read by the runs
from the device's counter where one exists (NVML, HLML, RAPL), else the rows say `not measured` and why.
These records are made to be shared: credential values (--token, --hub_token, HF_TOKEN, ...; see
bridgetower_bench.redaction) are replaced by REDACTED in the commands and in the runs' output, and
paths are written relative to --out (`$OUT/...` in commands) or to the repository.

Rerunning into the same --out resumes: rows of runs that finished are kept, and only the matrix's runs
without one (never made, failed, interrupted) are made, also when the rerun widens the matrix (more
--workers, --image-pipelines, --repeats, ...); rows the rerun's matrix leaves out stay in the records.
Settings that would change what a kept row measured (--preset, --script, --shape, --nproc, --eval,
--extra-args, the device and its model, the hostfile's nodes) are refused in one line naming each (old → new), exit status 2;
use another --out. One sweep at a time per --out (a lock; a second one is refused naming the holder). The
runs die with the sweep: each gets SIGTERM (a training run checkpoints at its next step and exits) when
the sweep ends in any way, SIGKILL included (Linux: a parent-death signal; each run keeps a process group
of its own so that Ctrl-C reaches the sweep alone and the sweep can stop a run with all its processes).
A run directory that a live process holds (its lock) is never touched: the sweep refuses instead.

Presets. `local` (default) runs the embedded fixtures (bridgetower_bench.tools.fixtures: random-weight
tiny BridgeTower, synthetic New Yorker-shaped data) offline on whatever device is present: per-device
batch 8, captions padded to 32 tokens (the synthetic ones have at most 16; upstream's default pads to
128), logging every 10 steps, no checkpoints. Its default shape (`--shape published`) is the published
run's: the 192 training rows make 24 optimizer steps per epoch (published: about 9.8k rows / 384 per
step, 25.5), and 53 steps with 3 warm-up put two epoch starts (steps 25 and 49) inside the 50 counted
steps, so the loader's restart at each epoch is measured as it is in the published 5-epoch runs.
`--shape within-epoch` runs 13 steps (3 warm-up + 10 counted) inside the first epoch: the steady state
alone. The tiny model takes BridgeTower's 294-px images but is cheap to train (one layer per tower, 42-px
patches), so like the published accelerator runs the local preset is bound by image loading, not by the
model. CPU figures on a shared machine are noisy: use --repeats and read the data-wait columns. `blog`
is the published command line as upstream's CI runs it (docs/PUBLISHED.md), flag for flag the README's published
commands: data set revision pinned, no --do_predict, no trackers (--report_to none); on Gaudi bf16 autocast from
Habana/clip and --sdp_on_bf16. Gaudi runs on HPUs run lazy mode (--use_lazy_mode) with PT_HPU_LAZY_MODE=1 set for
them, shown in front of every command the sweep prints or records.

Device. The runs train on this machine's HPUs (the Gaudi script) or NVIDIA GPUs (the CUDA script). Without
either, the local preset runs on the CPU; anything else is refused in one line (exit status 2) rather than
benchmarked on the CPU: the blog preset, a --script that does not train on the accelerator here, a Gaudi or
NVIDIA driver that torch cannot use (saying why). `--device cpu` runs on the CPU on purpose.

`--extra-args` is appended to every run's command line, so it overrides preset values
(`--extra-args "--max_steps 30"`); a single flag without a space must be written
`--extra-args=--flag` so that argparse does not take it for one of ours.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Optional

from filelock import FileLock, Timeout

from bridgetower_bench import published
from bridgetower_bench.guards.execution_mode import LAZY_MODE_VARIABLE
from bridgetower_bench.guards.habana_software import habana_software_present
from bridgetower_bench.mediapipe.availability import TORCH_LOADER
from bridgetower_bench.output_dir import run_directory
from bridgetower_bench.output_dir.atomic_files import atomic_path, write_atomically, write_json_atomically
from bridgetower_bench.redaction import redact_args, redact_text, scrub, secret_values
from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.retrieval import summarise_quality
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.hosts import hostfile_nodes, machine, port
from bridgetower_bench.tools.sweep import cost_report
from bridgetower_bench.tools.sweep.bench_report import (
    FAILED,
    INTERRUPTED,
    OK,
    add_scaling_efficiency,
    configuration_label,
    render_chart,
    render_scaling,
    render_scaling_chart,
    render_table,
    render_vs_published,
    summarise,
)
from bridgetower_bench.tools.sweep.cost import (
    COST_COLUMNS,
    Prices,
    add_price_arguments,
    cost_fields,
    prices_from_args,
    refuse,
)
from bridgetower_bench.user_errors import UserInputError


REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"gaudi": REPO / "run_bridgetower.py", "cuda": REPO / "run_bridgetower_cuda.py"}
# Stand-ins for the two Habana entry points optimum-habana touches; the Gaudi script needs them on a
# machine without Habana's software (tests/habana_shim/README.md).
HABANA_SHIM = REPO / "tests" / "habana_shim"

# The flag each loader adds, and the only script that has it (None: both).
LOADERS = {
    TORCH_LOADER: ([], None),
    "mediapipe": (["--mediapipe_dataloader"], "gaudi"),
    "device_decode": (["--device_decode"], "cuda"),
}
# The hardware loader of each accelerator, swept by default next to the PyTorch loader.
NATIVE_LOADER = {"hpu": "mediapipe", "cuda": "device_decode"}
# The local preset's image pipelines: upstream's transform (the reproduction) beside ours (the improvement).
DEFAULT_LOCAL_PIPELINES = ("upstream", "fast")
# Flags the sweep sets per run: --extra-args must not override them.
SWEEP_FLAGS = (
    "--output_dir",
    "--dataloader_num_workers",
    "--image_pipeline",
    "--mediapipe_dataloader",
    "--device_decode",
    "--dataloader_persistent_workers",
    "--dataloader_prefetch_factor",
)
# Loaders whose batches come from PyTorch DataLoader workers, so that persistent workers and the prefetch
# factor apply (the media pipeline has no such workers).
WORKER_LOADERS = (TORCH_LOADER, "device_decode")

# A run's training figures as train_results.json holds them: in results.csv and copied into each run's row.
RUN_FIGURES = (
    "throughput_warmup_steps",
    "throughput_counted_steps",
    "throughput_counted_samples",
    "throughput_steps_per_epoch",
    "throughput_epoch_starts",
    "train_samples_per_second",
    "train_samples_per_second_per_device",
    "data_wait_fraction",
    "data_wait_fraction_epoch_start",
    "data_wait_fraction_steady",
    "data_wait_seconds_epoch_start",
    "data_wait_seconds_steady",
    "train_loss",
)
# results.csv columns, in this order; any other keys (all software versions, eval metrics) follow, sorted.
CSV_COLUMNS = (
    "run_id",
    "status",
    "returncode",
    "error",
    "device_name",
    "device_type",
    "backend",
    "execution_mode",
    "torch_compile",
    "device_count",
    "device_memory_bytes",
    "driver_version",
    "script",
    "preset",
    "world_size",
    "nodes",
    "per_device_train_batch_size",
    "requested_loader",
    "loader",
    "image_pipeline",
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
# Keys copied from train_results.json into a run's row.
TRAIN_KEYS = (
    "device_name",
    "device_type",
    "backend",
    "execution_mode",
    "torch_compile",
    "device_count",
    "device_memory_bytes",
    "driver_version",
    "world_size",
    "per_device_train_batch_size",
    "loader",
    "image_pipeline",
    *RUN_FIGURES,
    "per_node",  # a run across nodes: each node's figures (a JSON list in results.csv)
)


# ---------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One run of the sweep: a loader setting and the repeat it belongs to."""

    workers: int
    loader: str = TORCH_LOADER
    image_pipeline: str = "upstream"
    repeat: int = 1
    persistent_workers: bool = False  # --dataloader_persistent_workers: the loader's workers live across epochs
    prefetch_factor: Optional[int] = None  # --dataloader_prefetch_factor (None: PyTorch's default, 2)
    devices: Optional[int] = None  # a point of the scaling curve (--devices); None: the sweep's --nproc
    nodes: Optional[int] = None  # a point of the curve across nodes (--nodes), of --nproc devices each; None: one

    @property
    def run_id(self) -> str:
        """A file-system-safe name, unique within a sweep."""
        name = f"w{self.workers}{'p' if self.persistent_workers else ''}"
        name += f"{f'-prefetch{self.prefetch_factor}' if self.prefetch_factor else ''}-{self.loader}-{self.image_pipeline}-r{self.repeat}"
        name += f"-x{self.devices}" if self.devices else ""
        name += f"-nodes{self.nodes}" if self.nodes else ""
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)

    @property
    def label(self) -> str:
        label = configuration_label(
            self.workers, self.loader, self.image_pipeline, self.persistent_workers, self.prefetch_factor
        )
        return (
            label
            + (f" on {self.devices} device(s)" if self.devices else "")
            + (f" on {self.nodes} nodes" if self.nodes else "")
        )


def expand_matrix(
    workers: Sequence[int],
    loaders: Sequence[str],
    image_pipelines: Sequence[str],
    repeats: int,
    loader_workers: Optional[Sequence[int]] = None,
    persistent: Sequence[bool] = (False,),
    prefetch_factors: Sequence[Optional[int]] = (None,),
) -> list[Variant]:
    """All runs, repeat by repeat: the PyTorch loader at every `workers` setting with every image pipeline; other
    loaders (they decode on the device, so the host pipeline hardly matters) at `loader_workers`, with the first.

    Where a loader has PyTorch workers (`workers` > 0, not the media pipeline), every `persistent` and
    `prefetch_factors` setting is run; elsewhere they mean nothing and the run is made once, without them.
    """
    loader_workers = list(loader_workers) if loader_workers else [max(workers)]
    variants = []
    for repeat in range(1, repeats + 1):
        for pipeline in image_pipelines:
            for loader in loaders:
                if loader != TORCH_LOADER and pipeline != image_pipelines[0]:
                    continue
                for w in workers if loader == TORCH_LOADER else loader_workers:
                    has_workers = w > 0 and loader in WORKER_LOADERS
                    settings = (
                        [(p, f) for p in persistent for f in prefetch_factors] if has_workers else [(False, None)]
                    )
                    for keep, prefetch in dict.fromkeys(settings):
                        variants.append(
                            Variant(
                                workers=w,
                                loader=loader,
                                image_pipeline=pipeline,
                                repeat=repeat,
                                persistent_workers=keep,
                                prefetch_factor=prefetch,
                            )
                        )
    return variants


def scaling_points(
    variants: Sequence[Variant], devices: Sequence[int], nproc: int, nodes: Sequence[int] = ()
) -> list[Variant]:
    """The scaling curve's other sizes: the matrix's first configuration on each of `devices` but `nproc` (the
    matrix itself runs on `nproc`), then on each of `nodes` above 1 (of `nproc` devices each), in every repeat."""
    first = variants[0]
    return [
        point
        for repeat in sorted({v.repeat for v in variants})
        for point in [replace(first, repeat=repeat, devices=n) for n in dict.fromkeys(devices) if n != nproc]
        + [replace(first, repeat=repeat, nodes=n) for n in dict.fromkeys(nodes) if n > 1]
    ]


# ---------------------------------------------------------------------------------------------
# The plan: which script, which device, which flags
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Everything needed to run the sweep; `commands()` is what --dry-run prints."""

    preset: str
    script: str  # "cuda" or "gaudi"
    device: str  # where the runs train: "hpu", "cuda" or "cpu"
    nproc: int
    variants: list[Variant]
    base_args: list[str]  # preset and device flags, shared by every run
    extra_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)  # environment overrides for the runs
    script_path: Optional[Path] = None  # default: SCRIPTS[script]
    shape: str = ""  # what the counted window spans (describe_shape)
    expected_device_name: str = ""  # for rows of runs that failed before recording theirs
    mode_env: dict = field(
        default_factory=dict
    )  # variables the runs need on top of the flags: shown with every command

    def shown_command(self, command: list[str], out: Path, variant: Optional[Variant] = None) -> str:
        """A run's command as records show it (`shareable_command`), preceded by the variables it needs; a CUDA run
        across nodes: one line per node, `REMOTE_SHELL HOST` and what that node runs from the kit's directory."""
        shown = " ".join(
            [f"{name}={value}" for name, value in self.mode_env.items()] + [shareable_command(command, out)]
        )
        remote = [shareable_command([*self.remote_shell, host], out) for host in self.remote_hosts(variant)]
        return "\n".join(f"{node} {shown}" for node in remote) or shown

    prices: Prices = field(default_factory=Prices)  # --price / --prices: the cost columns of the results
    hosts: list[str] = field(default_factory=list)  # --hostfile's nodes in its order (the first keeps rank 0's end)
    remote_shell: list[str] = field(default_factory=lambda: ["ssh", "-tt"])  # --remote-shell
    rdzv_port: int = 29500  # --rdzv-port

    def command(self, variant: Variant, output_dir: Path) -> list[str]:
        script = str(self.script_path or SCRIPTS[self.script])
        per_run = [
            "--output_dir",
            str(output_dir),
            "--dataloader_num_workers",
            str(variant.workers),
            "--image_pipeline",
            variant.image_pipeline,
        ] + LOADERS[variant.loader][0]
        if variant.persistent_workers:
            per_run += ["--dataloader_persistent_workers", "True"]
        if variant.prefetch_factor:
            per_run += ["--dataloader_prefetch_factor", str(variant.prefetch_factor)]
        start = (
            self.across_nodes(variant, output_dir) if variant.nodes else launcher(self.script, self.processes(variant))
        )
        return start + [script] + self.base_args + per_run + self.extra_args

    def processes(self, variant: Variant) -> int:
        """The run's world size."""
        return (variant.devices or self.nproc) * (variant.nodes or 1)

    def across_nodes(self, variant: Variant, output_dir: Path) -> list[str]:
        """The launcher of a run on the hostfile's first `variant.nodes` nodes, --nproc devices each. Gaudi: one
        launch_gaudi over a hostfile of those nodes (`hostfile_path`; DeepSpeed's launcher reaches them); CUDA: the
        launch_cuda that each node runs (`node_commands`), meeting at the first node's c10d rendezvous."""
        launch = [sys.executable, "-m", f"bridgetower_bench.tools.launch_{self.script}"]
        if self.script == "gaudi":
            hostfile = ["--hostfile", str(hostfile_path(output_dir)), "--num_nodes", str(variant.nodes)]
            return launch + hostfile + ["--world_size", str(self.processes(variant))]
        endpoint = f"{machine(self.hosts[0])}:{self.rdzv_port}"
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", variant.run_id]
        return launch + ["--nnodes", str(variant.nodes), "--nproc_per_node", str(self.nproc)] + rendezvous

    def remote_hosts(self, variant: Optional[Variant]) -> list[str]:
        """The nodes a run reaches through --remote-shell: a CUDA run's across nodes; none otherwise."""
        return self.hosts[: variant.nodes] if variant and variant.nodes and self.script == "cuda" else []

    def node_commands(self, variant: Variant, command: list[str]) -> list[list[str]]:
        """What a run starts: `command` here, or on each of `remote_hosts` through --remote-shell, from the kit's
        directory (the same path on every node) with the variables the run needs (`node_env`)."""
        env = [f"{name}={shlex.quote(value)}" for name, value in self.node_env(variant).items()]
        line = " ".join([f"cd {shlex.quote(str(REPO))} &&", *env, shlex.join(command)])
        return [[*self.remote_shell, host, line] for host in self.remote_hosts(variant)] or [command]

    def node_env(self, variant: Optional[Variant] = None) -> dict:
        """The variables a run needs on top of the environment it starts in."""
        env = dict(self.env)
        if self.device == "cpu" and variant is not None and "OMP_NUM_THREADS" not in os.environ:
            # On a CPU the loader workers and the training processes share the cores: give training the
            # cores the workers leave (at least one), or every step fights the workers for them.
            cores = os.cpu_count() or 1
            env["OMP_NUM_THREADS"] = str(max(1, (cores - variant.workers) // (variant.devices or self.nproc)))
        return env

    def run_env(self, variant: Optional[Variant] = None) -> dict:
        return {**os.environ, **self.node_env(variant)}


def hostfile_path(output_dir: Path) -> Path:
    """A Gaudi run's hostfile across nodes, beside its output directory (runs/<run>): hostfiles/<run>."""
    return output_dir.parent.parent / "hostfiles" / output_dir.name


def launcher(script: str, nproc: int) -> list[str]:
    """How to start `nproc` training processes: plain python, torchrun through launch_cuda (CUDA) or the Gaudi MPI
    launcher."""
    if nproc == 1:
        return [sys.executable]
    if script == "cuda":  # torchrun (the kit's launcher over it), run from this interpreter: the same environment
        return [
            sys.executable,
            "-m",
            "bridgetower_bench.tools.launch_cuda",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
        ]
    return [sys.executable, "-m", "bridgetower_bench.tools.launch_gaudi", "--world_size", str(nproc), "--use_mpi"]


CPU_ON_PURPOSE = "--device cpu runs the sweep on the CPU on purpose"


def detect_accelerator() -> str:
    """ "hpu" when Habana's PyTorch bridge is importable and sees an HPU, else "cuda" with a GPU, else "cpu" where this
    machine shows no accelerator. A Gaudi or NVIDIA driver that torch cannot use is refused (UserInputError), so that
    a broken install is never benchmarked as a CPU."""
    try:
        import habana_frameworks.torch.hpu as hthpu  # only on Gaudi machines

        if hthpu.is_available():
            return "hpu"
    except Exception:  # absent, or present without a device: both mean no HPU
        pass
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if shutil.which("hl-smi") or os.path.isdir("/sys/module/habanalabs"):
        raise UserInputError(
            "no usable HPU: a Gaudi driver is here (hl-smi or the habanalabs module) but Habana's PyTorch bridge "
            f"(habana_frameworks.torch) does not import or sees no HPU; run inside Habana's container (README), or {CPU_ON_PURPOSE}"
        )
    from bridgetower_bench.guards.cuda_device import ask_driver, driver_libraries, why_no_cuda

    driver = ask_driver()
    if driver_libraries() or (driver is not None and driver.version):
        raise UserInputError(f"no usable NVIDIA GPU: {why_no_cuda()}; fix that, or {CPU_ON_PURPOSE}")
    return "cpu"


def local_device_name(device: str) -> str:
    """The device name the scripts would record (run_record.device_name), for runs that failed early."""
    try:
        import torch

        from bridgetower_bench.measurement.run_record import device_name

        return device_name(torch.device({"hpu": "hpu", "cuda": "cuda:0"}.get(device, "cpu")))
    except Exception:
        return {"hpu": "HPU", "cuda": "GPU"}.get(device, "CPU")


def device_flags(script: str, device: str, gaudi_config: str, preset: str) -> list[str]:
    """Flags for the device the runs train on. On HPUs lazy mode, which needs PT_HPU_LAZY_MODE=1 (`mode_env`);
    the blog preset as upstream's CI: bf16 autocast from the Gaudi config (Habana/clip), --sdp_on_bf16."""
    if device == "cpu":
        return ["--use_cpu"] + (["--use_lazy_mode", "False"] if script == "gaudi" else [])
    if script == "gaudi":
        flags = ["--use_habana", "--use_lazy_mode"]
        if preset == "blog":
            return flags + ["--use_hpu_graphs_for_inference", "--gaudi_config_name", gaudi_config, "--sdp_on_bf16"]
        return flags + ["--gaudi_config_name", gaudi_config, "--bf16"]
    return ["--bf16"]


def mode_env(script: str, device: str) -> dict:
    """Environment variables a run needs for its execution mode: PT_HPU_LAZY_MODE=1 for the Gaudi script on HPUs
    (its flags ask for lazy mode; Habana's bridge runs eager without the variable)."""
    return {LAZY_MODE_VARIABLE: "1"} if script == "gaudi" and device == "hpu" else {}


def fixture_paths(build: bool) -> dict:
    """The local preset's model, data set and Gaudi config; built (once, cached) unless `build` is False."""
    from bridgetower_bench.tools import fixtures

    if build:
        return {k: str(v) for k, v in fixtures.ensure_default_fixtures().items()}
    root = fixtures.default_fixtures_root()
    return {
        "model": str(root / fixtures.MODEL_DIR_NAME),
        "dataset": str(root / fixtures.DATASET_DIR_NAME),
        "gaudi_config": str(root / fixtures.GAUDI_CONFIG_DIR_NAME),
    }


# The local preset's shapes. `published`: the published run's epochs, about 25 optimizer steps each (there
# about 9.8k rows / (48 x 8 devices) = 25.5; here the fixture's 192 training rows / 8 = 24), over a counted
# window that crosses two epoch boundaries (steps 25 and 49 begin epochs 2 and 3). `within-epoch`: 10
# counted steps inside the first epoch, the steady state alone.
LOCAL_BATCH = 8
LOCAL_WARMUP_STEPS = 3
SHAPES = ("published", "within-epoch")


def local_train_rows() -> int:
    from bridgetower_bench.tools import fixtures

    return int(fixtures.DEFAULT_DATASET_OPTIONS["train_rows"])


def local_shape(shape: str) -> dict:
    """Training rows, steps per epoch and total steps of a local-preset shape."""
    rows = local_train_rows()
    steps_per_epoch = -(-rows // LOCAL_BATCH)
    if shape == "within-epoch":
        return {"train_rows": rows, "steps_per_epoch": steps_per_epoch, "max_steps": LOCAL_WARMUP_STEPS + 10}
    # two full epochs after the warm-up, then the first two steps of the third epoch past the second boundary
    return {
        "train_rows": rows,
        "steps_per_epoch": steps_per_epoch,
        "max_steps": LOCAL_WARMUP_STEPS + 2 * steps_per_epoch + 2,
    }


def describe_shape(shape: str) -> str:
    """One line for the sweep's output and its results: what the counted window spans."""
    facts = local_shape(shape)
    counted = range(LOCAL_WARMUP_STEPS + 1, facts["max_steps"] + 1)
    starts = [step for step in counted if (step - 1) % facts["steps_per_epoch"] == 0]
    return (
        f"{shape}: {facts['train_rows']} training rows / batch {LOCAL_BATCH} = {facts['steps_per_epoch']} steps per epoch, "
        f"{facts['max_steps']} steps ({LOCAL_WARMUP_STEPS} warm-up), {len(starts)} epoch start(s) counted"
        + (f" (steps {', '.join(map(str, starts))})" if starts else "")
    )


def local_preset_args(paths: Mapping[str, str], eval_: bool, shape: str = "published") -> list[str]:
    """The local preset: small, in the published run's epoch shape (or one epoch's steady state, see
    `local_shape`), and bound by image loading as the published runs are (see the module docstring)."""
    from bridgetower_bench.tools.fixtures import script_flags

    facts = local_shape(shape)
    args = [
        *script_flags(paths),
        "--do_train",
        "--max_train_samples",
        str(facts["train_rows"]),
        "--per_device_train_batch_size",
        str(LOCAL_BATCH),
        "--max_seq_length",
        "32",
        "--max_steps",
        str(facts["max_steps"]),
        "--throughput_warmup_steps",
        str(LOCAL_WARMUP_STEPS),
        "--logging_steps",
        "10",
        "--remove_unused_columns",
        "False",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--overwrite_output_dir",
    ]
    if eval_:
        args += ["--do_eval", "--per_device_eval_batch_size", "8"]
    return args


def blog_preset_args() -> list[str]:
    """The published run's flags as upstream's CI runs them and the README publishes them (docs/PUBLISHED.md),
    less the device flags: the data set revision pinned, no --do_predict. No checkpoints: they would only add
    write time inside the measured window; no trackers: they would start inside it."""
    return [
        "--model_name_or_path",
        published.MODEL,
        "--dataset_name",
        published.DATASET,
        "--dataset_config_name",
        published.DATASET_CONFIG,
        "--dataset_revision",
        published.DATASET_REVISION,
        "--trust_remote_code",
        "True",
        "--image_column",
        published.IMAGE_COLUMN,
        "--caption_column",
        published.CAPTION_COLUMN,
        "--remove_unused_columns",
        "False",
        "--do_train",
        "--do_eval",
        "--per_device_train_batch_size",
        str(published.BATCH),
        "--per_device_eval_batch_size",
        "16",
        "--num_train_epochs",
        str(published.EPOCHS),
        "--learning_rate",
        "1e-5",
        "--throughput_warmup_steps",
        str(published.WARMUP_STEPS),
        "--logging_steps",
        "10",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--overwrite_output_dir",
    ]


def parse_extra_args(text: str) -> list[str]:
    try:
        extra = shlex.split(text or "")
    except ValueError as e:
        raise ValueError(f"--extra-args {redact_text(text)!r}: {e}") from None
    for arg in extra:
        name = arg.split("=", 1)[0].replace("-", "_")
        if any(name == flag.replace("-", "_") for flag in SWEEP_FLAGS):
            raise ValueError(
                f"--extra-args: {arg.split('=', 1)[0]} is set per run by the sweep; use the sweep's own flags instead"
            )
    return extra


SHAPE_FLAGS = (
    "--max_steps",
    "--num_train_epochs",
    "--max_train_samples",
    "--per_device_train_batch_size",
    "--throughput_warmup_steps",
    "--gradient_accumulation_steps",
)


def plan_shape(args: argparse.Namespace) -> str:
    """The shape line of a plan; --extra-args that change it make it say so (the runs then record the real one)."""
    if any(arg.split("=", 1)[0] in SHAPE_FLAGS for arg in parse_extra_args(args.extra_args)):
        return "shape set by --extra-args"
    return describe_shape(args.shape or "published") if args.preset == "local" else "the published run's 5 epochs"


def persistent_settings(args: argparse.Namespace) -> list[bool]:
    """--persistent-workers as booleans; by default both for the local preset, upstream's (no) for the blog one."""
    chosen = args.persistent_workers or (["no", "yes"] if args.preset == "local" else ["no"])
    return [choice == "yes" for choice in dict.fromkeys(chosen)]


def device_counts(text: str) -> list[int]:
    """--devices 1,2,4,8 (or --nodes 1,2) as a list; 0 alone: no curve."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: counts separated by commas, e.g. 1,2,4,8") from None
    return [] if counts == [0] else counts


def default_devices(preset: str, script: str, device: str, nproc: int) -> list[int]:
    """The CUDA script's local preset on a CPU of 2 cores or more measures the curve at 1 and 2 processes (one
    extra run, of the first configuration); elsewhere there is no curve unless --devices asks for it."""
    local_cpu = preset == "local" and script == "cuda" and device == "cpu" and nproc == 1
    return [1, 2] if local_cpu and (os.cpu_count() or 1) >= 2 else []


def node_counts(args: argparse.Namespace, script: str, device: str, nproc: int) -> tuple[list[str], list[int]]:
    """--hostfile's hosts and the --nodes counts above 1 (the curve across nodes), or UserInputError."""
    counts = args.nodes or []
    args.rdzv_port = port(args.rdzv_port, "--rdzv-port")
    several = sorted({n for n in counts if n > 1})
    if any(n < 1 for n in counts):
        raise UserInputError(f"--nodes {','.join(map(str, counts))}: node counts must be 1 or more")
    if args.hostfile is None:
        if several:
            raise UserInputError(
                f"--nodes {several[-1]}: several nodes need --hostfile (one `HOST slots=N` line each)"
            )
        return [], []
    if not several:
        raise UserInputError(f"--hostfile {args.hostfile}: --nodes names no count above 1 (e.g. --nodes 1,2)")
    if script == "gaudi" and device != "hpu":
        raise UserInputError(
            f"--nodes {several[-1]}: the Gaudi script runs several processes only on HPUs (none here)"
        )
    hosts = hostfile_nodes(args.hostfile, gaudi=script == "gaudi")
    if several[-1] > len(hosts):
        raise UserInputError(f"--nodes {several[-1]}: --hostfile {args.hostfile} gives {len(hosts)} node(s)")
    for host, slots in list(hosts.items())[: several[-1]]:
        if slots < nproc:
            raise UserInputError(f"--hostfile {args.hostfile}: {host} has slots={slots}, fewer than --nproc {nproc}")
    return list(hosts), several


def make_plan(args: argparse.Namespace, accelerator: Optional[str] = None, build_fixtures: bool = True) -> Plan:
    """Check the command line and turn it into a Plan. `accelerator` overrides detection (tests, dry runs)."""
    if any(w < 0 for w in args.workers):
        raise ValueError(f"--workers {' '.join(map(str, args.workers))}: worker counts must be 0 or more")
    if args.loader_workers and any(w < 0 for w in args.loader_workers):
        raise ValueError("--loader-workers: worker counts must be 0 or more")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: must be 1 or more")
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: must be 1 or more")
    if args.devices is not None and any(n < 1 for n in args.devices):
        raise ValueError(f"--devices {','.join(map(str, args.devices))}: device counts must be 1 or more")

    # The local preset shows the reproduction and the improvement side by side; the published run, upstream's images.
    image_pipelines = args.image_pipelines or (
        list(DEFAULT_LOCAL_PIPELINES) if args.preset == "local" else ["upstream"]
    )
    if args.shape is not None and args.preset != "local":
        raise ValueError(
            f"--shape {args.shape}: only the local preset has shapes (--preset blog runs the published 5 epochs)"
        )
    if args.prefetch_factors and any(f < 1 for f in args.prefetch_factors):
        raise ValueError(f"--prefetch-factors {' '.join(map(str, args.prefetch_factors))}: must be 1 or more")

    if args.device != "cpu":
        accelerator = accelerator or detect_accelerator()
    script = args.script if args.script != "auto" else ("gaudi" if accelerator == "hpu" else "cuda")
    native = {"gaudi": "hpu", "cuda": "cuda"}[script]
    device = native if accelerator == native and args.device != "cpu" else "cpu"
    if device == "cpu" and args.device != "cpu":  # only the local preset, on a machine with no accelerator at all
        if accelerator != "cpu":
            raise UserInputError(
                f"--script {script}: {SCRIPTS[script].name} does not train on this machine's {dict(hpu='HPUs', cuda='GPUs')[accelerator]}; {CPU_ON_PURPOSE}"
            )
        if args.preset == "blog":
            raise UserInputError(
                f"--preset blog: no HPU or NVIDIA GPU here (the published run trains on {published.DEVICES} of them); {CPU_ON_PURPOSE}"
            )
    nproc = args.nproc if args.nproc is not None else (published.DEVICES if args.preset == "blog" else 1)
    devices = args.devices if args.devices is not None else default_devices(args.preset, script, device, nproc)
    for flag, n in [("--nproc", nproc)] + [("--devices", n) for n in devices]:
        if script == "gaudi" and n > 1 and device != "hpu":
            raise ValueError(f"{flag} {n}: the Gaudi script runs several processes only on HPUs (none here)")
        if device == "cuda" and n > 1:
            import torch

            if 0 < torch.cuda.device_count() < n:
                raise ValueError(f"{flag} {n}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    hosts, nodes = node_counts(args, script, device, nproc)

    loaders = args.loaders or [TORCH_LOADER] + ([NATIVE_LOADER[device]] if device in NATIVE_LOADER else [])
    for loader in loaders:
        if loader not in LOADERS:
            raise ValueError(f"--loaders {loader}: unknown loader (known: {', '.join(LOADERS)})")
        only_on = LOADERS[loader][1]
        if only_on is not None and only_on != script:
            raise ValueError(
                f"--loaders {loader}: only {SCRIPTS[only_on].name} has it; this sweep runs {SCRIPTS[script].name}"
            )

    if args.preset == "local":
        paths = fixture_paths(build=build_fixtures)
        base = local_preset_args(paths, args.eval, args.shape or "published")
        gaudi_config = paths["gaudi_config"]
    else:
        base = blog_preset_args()
        gaudi_config = "Habana/clip"
    base += device_flags(script, device, gaudi_config, args.preset)

    env = {
        "PYTHONUNBUFFERED": "1",  # logs stream into logs/<run>.log as they happen
        "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),  # quiet with loader workers
    }
    if args.preset == "local":  # everything is on disk: never wait for the Hub
        env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update(mode_env(script, device))
    if script == "gaudi" and device == "cpu" and not habana_software_present():
        env["PYTHONPATH"] = os.pathsep.join([str(HABANA_SHIM), env["PYTHONPATH"]])
        env["PATH"] = os.pathsep.join([str(HABANA_SHIM / "bin"), os.environ.get("PATH", "")])

    matrix = expand_matrix(
        args.workers,
        loaders,
        image_pipelines,
        args.repeats,
        args.loader_workers,
        persistent=persistent_settings(args),
        prefetch_factors=args.prefetch_factors or [None],
    )
    return Plan(
        preset=args.preset,
        script=script,
        device=device,
        nproc=nproc,
        variants=matrix + scaling_points(matrix, devices, nproc, nodes),
        shape=plan_shape(args),
        base_args=base,
        extra_args=parse_extra_args(args.extra_args),
        env=env,
        expected_device_name=local_device_name(device) if not args.dry_run else "",
        mode_env=mode_env(script, device),
        hosts=hosts,
        remote_shell=args.remote_shell,
        rdzv_port=args.rdzv_port,
    )


# ---------------------------------------------------------------------------------------------
# Running one configuration
# ---------------------------------------------------------------------------------------------

_ERROR_LINE = re.compile(
    r"\b[A-Za-z_][\w.]*(Error|Exception)\b|\berror:|Killed|Traceback|^Training (diverged|stopped)\b"
)


def last_error_line(log_text: str) -> str:
    """The line that best says why a run failed: the last exception or argparse error, else the last line.

    torchrun's own ChildFailedError summary is skipped: the child's exception above it says more.
    """
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.search(line) and "ChildFailedError" not in line and not line.startswith("Traceback"):
            return line[:300]
    return lines[-1][:300] if lines else ""


def _stop(procs: Sequence[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Stop a run's processes and every process they started (each its own process group): SIGINT, then SIGTERM,
    then SIGKILL, each to the groups still there."""
    left = list(procs)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        for proc in list(left):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                left.remove(proc)
        deadline = time.monotonic() + grace_s
        for proc in list(left):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                left.remove(proc)
            except subprocess.TimeoutExpired:
                continue
        if not left:
            return


# prctl(2) option: the signal this process gets when the thread that started it ends (Linux).
PR_SET_PDEATHSIG = 1
# What a run gets when the sweep dies: SIGTERM, as from a plain `kill` (a training run saves a checkpoint at
# its next step and exits; torchrun and mpirun pass it to their ranks, which SIGKILL would orphan).
PARENT_DEATH_SIGNAL = signal.SIGTERM


def dies_with_this_process() -> dict:
    """Popen options that make the child get PARENT_DEATH_SIGNAL when this process ends, however it ends.

    Linux only (prctl PR_SET_PDEATHSIG, set in the child between fork and exec); elsewhere no options. If
    this process ended before the child set it, the child signals itself at once. The kernel sends it when
    the thread that started the child ends: start runs from a thread that lives as long as the sweep.
    """
    if not sys.platform.startswith("linux"):
        return {}
    libc = ctypes.CDLL(None, use_errno=True)  # looked up before the fork: the child only calls it
    prctl, parent = libc.prctl, os.getpid()

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

    return {"preexec_fn": set_parent_death_signal}


def run_process(
    commands: Sequence[list[str]],
    env: dict,
    log_path: Path,
    shown_command: Optional[str] = None,
    secrets: frozenset = frozenset(),
) -> int:
    """Run `commands` together (one, or one per node of a run across nodes) with their output in `log_path`;
    return the first non-zero exit status in their order, else 0. Ctrl-C stops them (and their children) and is
    re-raised.

    The log starts with `shown_command`'s lines (default: the commands), each after `$ `. Several commands'
    output lines are prefixed `[node I] ` (I: the command's place, from 0). With `secrets` or several commands,
    the output passes through the sweep line by line, each secret replaced by a placeholder on its way to the log.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    several = len(commands) > 1
    piped = bool(secrets) or several
    with open(log_path, "wb") as log:
        shown = shown_command.splitlines() if shown_command else [shlex.join(command) for command in commands]
        log.write(("".join(f"$ {line}\n" for line in shown) + "\n").encode())
        log.flush()
        # Its own session: the terminal's Ctrl-C reaches only us, and `_stop` signals the run's whole process
        # group (launcher, ranks, loader workers) without signalling us. Being outside our group, the run gets
        # a parent-death signal instead: if we are killed (even by SIGKILL) it is stopped too. No stdin: a
        # remote shell would read the terminal (ssh -tt would make it raw, and Ctrl-C would no longer reach us).
        procs = [
            subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if piped else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **dies_with_this_process(),
            )
            for command in commands
        ]
        lock = threading.Lock()
        copies = [
            threading.Thread(
                target=_copy_lines,
                args=(proc.stdout, log, lock, f"[node {i}] ".encode() if several else b"", secrets),
                daemon=True,
            )
            for i, proc in enumerate(procs)
            if piped
        ]
        for copy in copies:
            copy.start()
        try:
            statuses = [proc.wait() for proc in procs]
            for copy in copies:
                copy.join()
        except BaseException:
            _stop(procs)
            for copy in copies:  # a process outside the run's groups (torchrun's ranks) may keep a pipe open
                copy.join(timeout=10)
            raise
        return next((status for status in statuses if status), 0)


def _copy_lines(stream, log, lock: threading.Lock, prefix: bytes, secrets: frozenset) -> None:
    """A run's output into its log, line by line: secrets scrubbed, a terminal's line ends (ssh -tt) made plain."""
    for line in stream:
        with lock:
            try:
                log.write(prefix + scrub(line.replace(b"\r\n", b"\n"), secrets))
                log.flush()
            except ValueError:  # the log is closed: the run was stopped and the sweep has moved on
                return


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _discard_weights(run_dir: Path) -> None:
    """Delete saved weights and checkpoints of a finished run: the metrics are what the sweep keeps."""
    if not run_dir.is_dir():
        return
    for path in run_dir.iterdir():
        if path.is_dir() and path.name.startswith("checkpoint-"):
            shutil.rmtree(path)
        elif path.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            path.unlink()


def _relative(path: Path, out: Path) -> str:
    """`path` as records name it: relative to the sweep's output directory when inside it."""
    try:
        return str(path.relative_to(out))
    except ValueError:
        return str(path)


def shareable_args(args: Sequence[str], out: Path) -> list[str]:
    """Arguments as the records (results, log headers) show them: credential values redacted, the
    interpreter as `python`, paths inside the sweep's output directory as `$OUT/...` and paths inside
    the repository relative to it (the runs' working directory), so that a shared record exposes
    neither secrets nor the machine's layout. The runs themselves get the real arguments."""
    shown = []
    for arg in redact_args(args):
        if arg == sys.executable:
            shown.append("python")
            continue
        for root, name in ((out, "$OUT/"), (REPO, "")):
            arg = arg.replace(str(root) + os.sep, name)
            flag, eq, value = arg.rpartition("=")
            if value == str(root):  # the directory itself, alone or as --flag=<root>
                arg = flag + eq + (name.rstrip("/") or ".")
        shown.append(arg)
    return shown


def shareable_command(command: Sequence[str], out: Path) -> str:
    """`shareable_args` as one shell line: run from the repository root with OUT set to the sweep's directory."""

    def quote(arg: str) -> str:
        head, placeholder, tail = arg.partition("$OUT")
        return "".join([shlex.quote(head) if head else "", placeholder, shlex.quote(tail) if tail else ""])

    return " ".join(quote(arg) for arg in shareable_args(command, out))


def collect_row(
    plan: Plan,
    variant: Variant,
    returncode: Optional[int],
    run_dir: Path,
    log_path: Path,
    command: list[str],
    wall_seconds: float,
    out: Optional[Path] = None,
) -> dict:
    """One results row: what was asked, what the run recorded, and whether it worked.

    Paths are relative to `out` (default: the directory above the runs' directory) and the command is
    shown as `shareable_command` shows it."""
    out = out or run_dir.parent.parent
    row = {
        "run_id": variant.run_id,
        "script": plan.script,
        "preset": plan.preset,
        "requested_loader": variant.loader,
        "image_pipeline": variant.image_pipeline,
        "workers": variant.workers,
        "persistent_workers": variant.persistent_workers,
        "prefetch_factor": variant.prefetch_factor,
        "repeat": variant.repeat,
        "world_size": plan.processes(variant),
        "nodes": variant.nodes or 1,
        "device_name": plan.expected_device_name,
        "device_type": plan.device,
        "loader": None,
        "returncode": returncode,
        "wall_seconds": round(wall_seconds, 1),
        "log": _relative(log_path, out),
        "output_dir": _relative(run_dir, out),
        "command": plan.shown_command(command, out, variant),
    }
    train = _read_json(run_dir / "train_results.json")
    row.update({k: train[k] for k in TRAIN_KEYS if k in train})
    row.update({k: v for k, v in train.items() if k.startswith(("version_", "device_decode_", "energy_"))})
    # recall@k, mean rank, loss
    row.update(summarise_quality(_read_json(run_dir / "validation_results.json"), "eval"))
    row.update(summarise_quality(_read_json(run_dir / "test_results.json"), "test"))

    # A diverged run's figures (NaN, Infinity): never a result, and never bare NaN in results.json.
    non_finite = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
    row.update(dict.fromkeys(non_finite))

    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if returncode is None:
        row["status"], row["error"] = INTERRUPTED, "stopped by Ctrl-C"
    elif returncode != 0:
        row["status"] = FAILED
        row["error"] = last_error_line(log_text.split("\n", 2)[-1])  # skip the "$ command" line
        if returncode < 0:
            row["error"] = f"killed by signal {signal.Signals(-returncode).name}" + (
                f"; {row['error']}" if row["error"] else ""
            )
    elif "train_samples_per_second" not in train:
        row["status"], row["error"] = (
            FAILED,
            f"exited 0 but {row['output_dir']}/train_results.json has no train_samples_per_second",
        )
    elif non_finite:
        row["status"] = FAILED
        row["error"] = "exited 0 but its results are not finite: " + ", ".join(
            f"{k}={v}" for k, v in sorted(non_finite.items())
        )
    else:
        row["status"], row["error"] = OK, ""
    return row


def describe_row(row: dict) -> str:
    """One progress line with a run's figures (or its error)."""
    label = configuration_label(
        row["workers"],
        row["requested_loader"],
        row["image_pipeline"],
        row.get("persistent_workers", False),
        row.get("prefetch_factor"),
    )
    if row["status"] == OK:
        text = (
            f"{label}: {row['train_samples_per_second']:.2f} samples/s "
            f"({row['train_samples_per_second_per_device']:.2f}/device), "
            f"data wait {100 * row.get('data_wait_fraction', 0):.0f}%"
        )
        if row.get("throughput_epoch_starts"):
            text += (
                f" ({100 * row['data_wait_fraction_epoch_start']:.0f}% at {row['throughput_epoch_starts']} epoch start(s), "
                f"{100 * row['data_wait_fraction_steady']:.0f}% steady)"
            )
        text += f", loader {row['loader']}"
        if "eval_i2t_recall@1" in row:
            text += f", eval i2t R@1 {row['eval_i2t_recall@1']:.3f}"
        return text + f", {row['wall_seconds']:.0f} s"
    if row["status"] == INTERRUPTED:
        return f"{label}: interrupted after {row['wall_seconds']:.0f} s"
    return f"{label}: FAILED (return code {row['returncode']}) after {row['wall_seconds']:.0f} s: {row['error']}  [log: {row['log']}]"


# ---------------------------------------------------------------------------------------------
# One sweep per --out, resumed: finished rows are kept, only the missing runs are made
# ---------------------------------------------------------------------------------------------

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
        holder = _read_json(out / SWEEP_HOLDER)
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


def setting_differences(earlier: Mapping, now: Mapping) -> list[str]:
    """ "<setting> <old> → <new>" for every measured setting that differs (settings an earlier sweep did not
    record, or a device model unknown to a dry run, are not compared)."""
    differences = []
    for key, name in MEASURED_SETTINGS:
        if key not in earlier or earlier[key] in ("", None) or now.get(key) in ("", None) or earlier[key] == now[key]:
            continue
        old, new = earlier[key], now[key]
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


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def run_sweep(
    plan: Plan, out: Path, keep_weights: bool = False, echo: Callable[[str], None] = print
) -> tuple[list[dict], bool]:
    """Run every variant that `out` has no finished row of, in order; results.json/csv are rewritten after each
    run and keep the earlier sweeps' rows. Holds --out's lock throughout. Returns (every row, interrupted)."""
    with sweep_lock(out):
        kept, variants, to_run = plan_resume(plan, out)
        refuse_held_run_dirs(to_run, out)
        rows = dict(kept)
        finished = sum(1 for v in plan.variants if v not in to_run)
        if finished:
            echo(f"{finished} of {len(plan.variants)} run(s) already finished in {out} (kept); {len(to_run)} to run")
        interrupted = False
        for i, variant in enumerate(to_run, 1):
            rows[variant.run_id] = run_variant(plan, variant, out, keep_weights, f"[{i}/{len(to_run)}]", echo)
            write_results(out, plan, _in_order(rows, variants), variants)
            if rows[variant.run_id]["status"] == INTERRUPTED:
                interrupted = True
                break
        if not to_run:
            write_results(out, plan, _in_order(rows, variants), variants)
        return _in_order(rows, variants), interrupted


def _in_order(rows: Mapping[str, dict], variants: Sequence[Variant]) -> list[dict]:
    """The rows in the matrix's order (rows of variants no longer known, last)."""
    order = {v.run_id: i for i, v in enumerate(variants)}
    return sorted(rows.values(), key=lambda row: order.get(row["run_id"], len(order)))


def run_variant(
    plan: Plan, variant: Variant, out: Path, keep_weights: bool, progress: str, echo: Callable[[str], None]
) -> dict:
    """Make one run and return its row (status "interrupted" when Ctrl-C or SIGTERM stopped it)."""
    run_dir, log_path = out / "runs" / variant.run_id, out / "logs" / f"{variant.run_id}.log"
    command = plan.command(variant, run_dir)
    echo(f"{progress} start  {variant.label}, repeat {variant.repeat} (log: {log_path})")
    refuse_held_run_dirs([variant], out)  # claimed since the sweep started: leave it alone
    if run_dir.exists():  # left by an unfinished run of an earlier sweep: its results must not pass for this run's
        shutil.rmtree(run_dir)
    if variant.nodes and plan.script == "gaudi":  # launch_gaudi's nodes: the hostfile's first, --nproc HPUs each
        hostfile = hostfile_path(run_dir)
        hostfile.parent.mkdir(exist_ok=True)
        write_atomically(hostfile, "".join(f"{host} slots={plan.nproc}\n" for host in plan.hosts[: variant.nodes]))
    started = time.perf_counter()
    try:
        env = plan.run_env(variant)
        returncode: Optional[int] = run_process(
            plan.node_commands(variant, command),
            env,
            log_path,
            plan.shown_command(command, out, variant),
            frozenset(secret_values(command, env)),
        )
    except KeyboardInterrupt:
        returncode = None
    row = collect_row(plan, variant, returncode, run_dir, log_path, command, time.perf_counter() - started, out)
    if not keep_weights:
        _discard_weights(run_dir)
    echo(f"{progress} {'done' if row['status'] == OK else row['status']:6} {describe_row(row)}")
    return row


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


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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


def render_all(out: Path, rows: Sequence[Mapping], meta: Mapping) -> str:
    """Write the report: table.md, vs_published.md and chart.png (tools/bench_report.py), and where there are
    prices (`meta["prices"]`) or energy figures their sections and chart_cost.png (tools/cost_report.py);
    return the table text."""
    summary = summarise(rows)
    cost_table, cost_vs_published, _ = cost_report.render(out, summary, meta)
    table = render_table(summary) + render_scaling(summary) + cost_table
    write_atomically(out / "table.md", table)
    write_atomically(out / "vs_published.md", render_vs_published(summary, meta) + cost_vs_published)
    render_chart(summary, out / "chart.png")
    render_scaling_chart(summary, out / "chart_scaling.png")
    return table


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    # Building the fixtures tokenizes with tokenizers' threads; each run's fork would then print its warning.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:  # malformed prices are refused first; one that matches no device once the plan knows the device
        prices = prices_from_args(args.price, args.prices)
    except UserInputError as e:
        refuse(parser.prog, e)
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
    plan.prices = prices
    out = (args.out or Path("bench_out") / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()

    curve = sorted({plan.processes(v) for v in plan.variants if v.devices})
    nodes = sorted({v.nodes for v in plan.variants if v.nodes})
    print(
        f"{len(plan.variants)} run(s) of {SCRIPTS[plan.script].name} on {plan.device} x{plan.nproc}"
        + (f" (scaling curve: also x{', x'.join(map(str, curve))})" if curve else "")
        + (f" (across nodes: {', '.join(map(str, nodes))} nodes x{plan.nproc})" if nodes else "")
        + f" ({args.preset} preset, {plan.shape})"
    )
    if args.dry_run:  # what a sweep into --out would run now: what it has no finished row of
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
    if plan.env.get("PATH", "").startswith(str(HABANA_SHIM)):
        print(f"note: no Habana software here; the Gaudi script runs on CPU with the stand-ins in {HABANA_SHIM}")

    # A plain `kill` stops the sweep like Ctrl-C does: the running subprocess is stopped, finished rows stay.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        rows, interrupted = run_sweep(plan, out, keep_weights=args.keep_weights)
    except UserInputError as e:  # --out in use, or holding runs of other settings
        return _refuse(parser, e)
    finally:
        signal.signal(signal.SIGTERM, previous)
    meta = {
        "preset": args.preset,
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
    if interrupted:
        print("interrupted: the rows above are the runs that finished")
        return 130
    planned = {v.run_id for v in plan.variants}
    return 0 if all(r["status"] == OK for r in rows if r["run_id"] in planned) else 1


def _refuse(parser: argparse.ArgumentParser, error: UserInputError) -> int:
    """A refusal in one line (no usage text), exit status 2."""
    print(f"{parser.prog}: error: {error}", file=sys.stderr)
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

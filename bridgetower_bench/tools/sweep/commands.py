"""What a sweep runs: its matrix of variants (loader settings, repeats, the scaling curve's points) and the Plan
that turns each variant into a command line, its launcher and its environment; commands as the records show them.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from bridgetower_bench.mediapipe.availability import TORCH_LOADER
from bridgetower_bench.redaction import redact_args
from bridgetower_bench.tools.hosts import rendezvous_endpoint
from bridgetower_bench.tools.sweep.bench_report import configuration_label
from bridgetower_bench.tools.sweep.cost import Prices
from bridgetower_bench.tools.tool_paths import KIT, SCRIPTS, kit_script


REPO = KIT  # the runs' working directory: the kit's, where the scripts are (tool_paths)

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
# Loaders whose batches come from PyTorch DataLoader workers, so that persistent workers and the prefetch
# factor apply (the media pipeline has no such workers).
WORKER_LOADERS = (TORCH_LOADER, "device_decode")
# --remote-margin: a CUDA run across nodes is stopped after --remote-start-timeout plus this many times its
# configuration's time on one node. It trains the same samples on N times the devices (or, with --max_steps, the
# same steps), so it is slower only by each node's start and the network's share of each step; three times leaves
# room for a network as slow as the step itself and a busy node, and ends a hang within three runs' time.
REMOTE_MARGIN = 3.0


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
    remote_start_timeout: float = 60.0  # --remote-start-timeout: seconds for each node's first line
    remote_margin: float = REMOTE_MARGIN  # --remote-margin: a run across nodes' bound, in its one-node run's time

    def __post_init__(self):
        if self.script_path is None:
            kit_script(self.script)  # a copy of the package alone: refused in one line before any run

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
        endpoint = rendezvous_endpoint(self.hosts[0], self.rdzv_port, "--hostfile")  # (checked by the plan)
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", variant.run_id]
        return launch + ["--nnodes", str(variant.nodes), "--nproc_per_node", str(self.nproc)] + rendezvous

    def alone(self, variant: Variant) -> list[Variant]:
        """The runs of `variant`'s configuration on one node, in every repeat (the one-node side of its curve)."""
        key = replace(variant, nodes=None, repeat=1)
        return [v for v in self.variants if replace(v, repeat=1) == key]

    def remote_hosts(self, variant: Optional[Variant]) -> list[str]:
        """The nodes a run reaches through --remote-shell: a CUDA run's across nodes; none otherwise."""
        return self.hosts[: variant.nodes] if variant and variant.nodes and self.script == "cuda" else []

    def node_commands(self, variant: Variant, command: list[str]) -> list[list[str]]:
        """What a run starts: `command` here, or on each of `remote_hosts` through --remote-shell, from the kit's
        directory (the same path on every node) with the variables the run needs (`node_env`)."""
        env = [f"{name}={shlex.quote(value)}" for name, value in self.node_env(variant).items()]
        # A line as soon as the node's shell runs: what --remote-start-timeout waits for (the launch may print
        # nothing until every node has joined its rendezvous).
        line = " ".join(
            [f"cd {shlex.quote(str(REPO))} && echo node started: $(uname -n) &&", *env, shlex.join(command)]
        )
        return [[*self.remote_shell, host, line] for host in self.remote_hosts(variant)] or [command]

    def node_env(self, variant: Optional[Variant] = None) -> dict:
        """The variables a run needs on top of the environment it starts in."""
        env = dict(self.env)
        if self.device == "cpu" and variant is not None and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.cpu_threads(variant))
        return env

    def cpu_threads(self, variant: Variant) -> int:
        """A CPU run's threads per training process: the cores its loader workers leave (at least one), shared by
        the most processes any run of the plan starts on one machine, whatever this run's count. So the scaling
        curve's one-device run trains with the threads of each process of its other points (its efficiency
        compares like with like), and the matrix's rows with the same divisor (a process of workers=0 gets as many
        threads on the matrix as on the curve)."""
        most = max((v.devices or self.nproc) for v in self.variants)
        return max(1, ((os.cpu_count() or 1) - variant.workers) // most)

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

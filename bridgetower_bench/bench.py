"""The benchmark sweep: run a training script over a matrix of loader settings and tabulate throughput.

    python -m bridgetower_bench.bench                       # local preset: tiny model, synthetic data, ~1 min on 2 CPU cores
    python -m bridgetower_bench.bench --preset blog         # the published run: BridgeTower Large, New Yorker, 8 devices
    python -m bridgetower_bench.bench --workers 0 2 --image-pipelines upstream fast --repeats 3 --eval
    python -m bridgetower_bench.bench --dry-run             # print the commands only

Every run is one subprocess of run_bridgetower.py (Gaudi) or run_bridgetower_cuda.py (NVIDIA/CPU)
with its own output directory; its figures come from the train_results.json the script saves
(steady-state samples/s after the warm-up steps, data-wait fraction, the loader that really ran).

Matrix: every --image-pipelines x --workers with the PyTorch loader, plus every other --loaders
entry (mediapipe on Gaudi, device_decode on NVIDIA) at --loader-workers (default: the largest
--workers value, as in the published "workers=2 + mediapipe" column), times --repeats. Repeats
are the outer loop, so slow drift of the machine spreads over all configurations.

Written to --out (default bench_out/<timestamp>):
    logs/<run>.log       each run's command line and full output
    runs/<run>/          each run's output directory (weights deleted unless --keep-weights)
    results.json / .csv  one row per run, rewritten after every run (Ctrl-C keeps the finished rows)
    table.md             samples/s per device (rows) and configuration (columns), the published layout
    vs_published.md      the same figures beside the published ones (whole node and per device)
    chart.png            bar chart of table.md

Presets. `local` (default) runs the embedded fixtures (bridgetower_bench.fixtures: random-weight
tiny BridgeTower, synthetic New Yorker-shaped data) offline on whatever device is present: per-device
batch 8, captions padded to 32 tokens (the synthetic ones have at most 16; upstream's default pads to
128), 3 warm-up steps + 10 counted steps (13 in all; the 192-row train split is 24 steps, so no
epoch boundary falls inside the window), logging every 10 steps, no checkpoints. The tiny model takes
BridgeTower's 294-px images but is cheap to train (one layer per tower, 42-px patches), so like the
published accelerator runs the local preset is bound by image loading, not by the model. On the shared
2-core development machine a run took about 8 s and the default sweep under a minute: CPU figures are
noisy there, so use --repeats and read the data-wait column. `blog` is the published
command line (the blog post's).

`--extra-args` is appended to every run's command line, so it overrides preset values
(`--extra-args "--max_steps 30"`); a single flag without a space must be written
`--extra-args=--flag` so that argparse does not take it for one of ours.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from .retrieval import summarise_quality

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"gaudi": REPO / "run_bridgetower.py", "cuda": REPO / "run_bridgetower_cuda.py"}
# Stand-ins for the two Habana entry points optimum-habana touches; the Gaudi script needs them on a
# machine without Habana's software (tests/habana_shim/README.md).
HABANA_SHIM = REPO / "tests" / "habana_shim"

TORCH_LOADER = "torch"
# The flag each loader adds, and the only script that has it (None: both).
LOADERS = {
    TORCH_LOADER: ([], None),
    "mediapipe": (["--mediapipe_dataloader"], "gaudi"),
    "device_decode": (["--device_decode"], "cuda"),
}
# The hardware loader of each accelerator, swept by default next to the PyTorch loader.
NATIVE_LOADER = {"hpu": "mediapipe", "cuda": "device_decode"}
# Flags the sweep sets per run: --extra-args must not override them.
SWEEP_FLAGS = ("--output_dir", "--dataloader_num_workers", "--image_pipeline", "--mediapipe_dataloader", "--device_decode")

BLOG_MODEL = "BridgeTower/bridgetower-large-itm-mlm-itc"
BLOG_DATASET = "jmhessel/newyorker_caption_contest"
DATASET_CONFIG = "matching"

# The blog post's whole-node (8 devices) throughput, samples/s.
PUBLISHED_DEVICES = 8
PUBLISHED_BATCH = 48
PUBLISHED = {
    "Gaudi2 HPU": {"workers=0": 601.5, "workers=1": 747.4, "workers=2": 768.7, "workers=2 + mediapipe": 847.7},
    "H100 GPU": {"workers=0": 336.5, "workers=1": 580.1, "workers=2": 602.1},
    "A100 80GB GPU": {"workers=0": 227.5, "workers=1": 339.7, "workers=2": 345.4},
}
PUBLISHED_CONFIGS = ("workers=0", "workers=1", "workers=2", "workers=2 + mediapipe")
# Upstream's CI baselines for this example on the optimum-habana 1.21 line, 8 devices, samples/s: the blog's
# flags plus a pinned data set revision, --trust_remote_code True and --sdp_on_bf16, without --do_predict.
CI_BASELINES = {"Gaudi2 HPU": 904.93, "Gaudi3 HPU": 783.481}
CI_EXTRA_FLAGS = "--dataset_revision 3c6c4f6c0ff7e902833d3afa5f8f3875c2b036e6 --trust_remote_code True --sdp_on_bf16"

# results.csv columns, in this order; any other keys (all software versions, eval metrics) follow, sorted.
CSV_COLUMNS = (
    "run_id", "status", "returncode", "error", "device_name", "device_type", "script", "preset",
    "world_size", "per_device_train_batch_size", "requested_loader", "loader", "image_pipeline", "workers",
    "repeat", "throughput_warmup_steps", "throughput_counted_steps", "throughput_counted_samples",
    "train_samples_per_second", "train_samples_per_second_per_device", "data_wait_fraction", "train_loss",
    "version_torch", "version_transformers", "wall_seconds", "log", "output_dir", "command",
)
# Keys copied from train_results.json into a run's row.
TRAIN_KEYS = (
    "device_name", "device_type", "world_size", "per_device_train_batch_size", "loader", "image_pipeline",
    "throughput_warmup_steps", "throughput_counted_steps", "throughput_counted_samples",
    "train_samples_per_second", "train_samples_per_second_per_device", "data_wait_fraction", "train_loss",
)

OK, FAILED, INTERRUPTED = "ok", "failed", "interrupted"


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

    @property
    def run_id(self) -> str:
        """A file-system-safe name, unique within a sweep."""
        name = f"w{self.workers}-{self.loader}-{self.image_pipeline}-r{self.repeat}"
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)


def expand_matrix(
    workers: Sequence[int],
    loaders: Sequence[str],
    image_pipelines: Sequence[str],
    repeats: int,
    loader_workers: Optional[Sequence[int]] = None,
) -> list[Variant]:
    """All runs, repeat by repeat: the PyTorch loader at every `workers` setting, other loaders at `loader_workers`."""
    loader_workers = list(loader_workers) if loader_workers else [max(workers)]
    variants = []
    for repeat in range(1, repeats + 1):
        for pipeline in image_pipelines:
            for loader in loaders:
                for w in workers if loader == TORCH_LOADER else loader_workers:
                    variants.append(Variant(workers=w, loader=loader, image_pipeline=pipeline, repeat=repeat))
    return variants


def configuration_label(workers: int, loader: str = TORCH_LOADER, image_pipeline: str = "upstream") -> str:
    """The column heading of a configuration, in the published wording ("workers=2 + mediapipe")."""
    label = f"workers={workers}"
    if loader != TORCH_LOADER:
        label += f" + {loader}"
    if image_pipeline != "upstream":
        label += f", {image_pipeline} images"
    return label


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
    expected_device_name: str = ""  # for rows of runs that failed before recording theirs

    def command(self, variant: Variant, output_dir: Path) -> list[str]:
        script = str(self.script_path or SCRIPTS[self.script])
        per_run = [
            "--output_dir", str(output_dir),
            "--dataloader_num_workers", str(variant.workers),
            "--image_pipeline", variant.image_pipeline,
        ] + LOADERS[variant.loader][0]
        return launcher(self.script, self.nproc) + [script] + self.base_args + per_run + self.extra_args

    def run_env(self, variant: Optional["Variant"] = None) -> dict:
        env = dict(os.environ)
        env.update(self.env)
        if self.device == "cpu" and variant is not None and "OMP_NUM_THREADS" not in os.environ:
            # On a CPU the loader workers and the training process share the cores: give training the
            # cores the workers leave (at least one), or every step fights the workers for them.
            cores = os.cpu_count() or 1
            env["OMP_NUM_THREADS"] = str(max(1, (cores - variant.workers) // self.nproc))
        return env


def launcher(script: str, nproc: int) -> list[str]:
    """How to start `nproc` training processes: plain python, torchrun (CUDA) or the Gaudi MPI launcher."""
    if nproc == 1:
        return [sys.executable]
    if script == "cuda":  # torchrun, run from this interpreter so the same environment is used
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [sys.executable, "-m", "bridgetower_bench.launch_gaudi", "--world_size", str(nproc), "--use_mpi"]


def detect_accelerator() -> str:
    """"hpu" when Habana's PyTorch bridge is importable and sees an HPU, else "cuda" with a GPU, else "cpu"."""
    try:
        import habana_frameworks.torch.hpu as hthpu  # only on Gaudi machines

        if hthpu.is_available():
            return "hpu"
    except Exception:  # absent, or present without a device: both mean no HPU
        pass
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _habana_installed() -> bool:
    try:
        import habana_frameworks.torch  # noqa: F401

        return True
    except Exception:
        return False


def local_device_name(device: str) -> str:
    """The device name the scripts would record (run_record.device_name), for runs that failed early."""
    try:
        import torch

        from .run_record import device_name

        return device_name(torch.device({"hpu": "hpu", "cuda": "cuda:0"}.get(device, "cpu")))
    except Exception:
        return {"hpu": "HPU", "cuda": "GPU"}.get(device, "CPU")


def device_flags(script: str, device: str, gaudi_config: str, preset: str) -> list[str]:
    """Flags for the device the runs train on."""
    if device == "cpu":
        return ["--use_cpu"] + (["--use_lazy_mode", "False"] if script == "gaudi" else [])
    if script == "gaudi":
        flags = ["--use_habana", "--use_lazy_mode"]
        if preset == "blog":
            flags.append("--use_hpu_graphs_for_inference")
        return flags + ["--gaudi_config_name", gaudi_config, "--bf16"]
    return ["--bf16"]


def fixture_paths(build: bool) -> dict:
    """The local preset's model, data set and Gaudi config; built (once, cached) unless `build` is False."""
    from . import fixtures

    if build:
        return {k: str(v) for k, v in fixtures.ensure_default_fixtures().items()}
    root = fixtures.default_fixtures_root()
    return {
        "model": str(root / fixtures.MODEL_DIR_NAME),
        "dataset": str(root / fixtures.DATASET_DIR_NAME),
        "gaudi_config": str(root / fixtures.GAUDI_CONFIG_DIR_NAME),
    }


def local_preset_args(paths: Mapping[str, str], eval_: bool) -> list[str]:
    """The local preset: small, but a real steady-state window (10 counted steps of batch 8), and
    bound by image loading as the published runs are (see the module docstring)."""
    args = [
        "--model_name_or_path", paths["model"],
        "--dataset_name", paths["dataset"],
        "--dataset_config_name", DATASET_CONFIG,
        "--image_column", "image",
        "--caption_column", "image_description",
        "--do_train",
        "--per_device_train_batch_size", "8",
        "--max_seq_length", "32",
        "--max_steps", "13",
        "--throughput_warmup_steps", "3",
        "--logging_steps", "10",
        "--remove_unused_columns", "False",
        "--save_strategy", "no",
        "--report_to", "none",
        "--overwrite_output_dir",
    ]
    if eval_:
        args += ["--do_eval", "--per_device_eval_batch_size", "8"]
    return args


def blog_preset_args() -> list[str]:
    """The published run's flags (the blog post's), less the device flags. No checkpoints: they would
    only add write time inside the measured window."""
    return [
        "--model_name_or_path", BLOG_MODEL,
        "--dataset_name", BLOG_DATASET,
        "--dataset_config_name", DATASET_CONFIG,
        "--image_column", "image",
        "--caption_column", "image_description",
        "--remove_unused_columns", "False",
        "--do_train", "--do_eval", "--do_predict",
        "--per_device_train_batch_size", str(PUBLISHED_BATCH),
        "--per_device_eval_batch_size", "16",
        "--num_train_epochs", "5",
        "--learning_rate", "1e-5",
        "--throughput_warmup_steps", "3",
        "--logging_steps", "10",
        "--save_strategy", "no",
        "--report_to", "none",
        "--overwrite_output_dir",
    ]


def parse_extra_args(text: str) -> list[str]:
    try:
        extra = shlex.split(text or "")
    except ValueError as e:
        raise ValueError(f"--extra-args {text!r}: {e}") from None
    for arg in extra:
        name = arg.split("=", 1)[0].replace("-", "_")
        if any(name == flag.replace("-", "_") for flag in SWEEP_FLAGS):
            raise ValueError(f"--extra-args: {arg.split('=', 1)[0]} is set per run by the sweep; use the sweep's own flags instead")
    return extra


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
    if not args.image_pipelines:
        raise ValueError("--image-pipelines: give at least one pipeline")

    accelerator = accelerator or detect_accelerator()
    script = args.script if args.script != "auto" else ("gaudi" if accelerator == "hpu" else "cuda")
    native = {"gaudi": "hpu", "cuda": "cuda"}[script]
    device = native if accelerator == native else "cpu"  # e.g. the CUDA script on a machine without a GPU
    nproc = args.nproc if args.nproc is not None else (PUBLISHED_DEVICES if args.preset == "blog" else 1)
    if script == "gaudi" and nproc > 1 and device != "hpu":
        raise ValueError(f"--nproc {nproc}: the Gaudi script runs several processes only on HPUs (none here)")
    if device == "cuda" and nproc > 1:
        import torch

        if 0 < torch.cuda.device_count() < nproc:
            raise ValueError(f"--nproc {nproc}: this machine has {torch.cuda.device_count()} CUDA device(s)")

    loaders = args.loaders or [TORCH_LOADER] + ([NATIVE_LOADER[device]] if device in NATIVE_LOADER else [])
    for loader in loaders:
        if loader not in LOADERS:
            raise ValueError(f"--loaders {loader}: unknown loader (known: {', '.join(LOADERS)})")
        only_on = LOADERS[loader][1]
        if only_on is not None and only_on != script:
            raise ValueError(f"--loaders {loader}: only {SCRIPTS[only_on].name} has it; this sweep runs {SCRIPTS[script].name}")

    if args.preset == "local":
        paths = fixture_paths(build=build_fixtures)
        base = local_preset_args(paths, args.eval)
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
    if script == "gaudi" and device == "cpu" and not _habana_installed():
        env["PYTHONPATH"] = os.pathsep.join([str(HABANA_SHIM), env["PYTHONPATH"]])
        env["PATH"] = os.pathsep.join([str(HABANA_SHIM / "bin"), os.environ.get("PATH", "")])

    return Plan(
        preset=args.preset,
        script=script,
        device=device,
        nproc=nproc,
        variants=expand_matrix(args.workers, loaders, args.image_pipelines, args.repeats, args.loader_workers),
        base_args=base,
        extra_args=parse_extra_args(args.extra_args),
        env=env,
        expected_device_name=local_device_name(device) if not args.dry_run else "",
    )


# ---------------------------------------------------------------------------------------------
# Running one configuration
# ---------------------------------------------------------------------------------------------

_ERROR_LINE = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception)\b|\berror:|Killed|Traceback")


def last_error_line(log_text: str) -> str:
    """The line that best says why a run failed: the last exception or argparse error, else the last line.

    torchrun's own ChildFailedError summary is skipped: the child's exception above it says more.
    """
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.search(line) and "ChildFailedError" not in line and not line.startswith("Traceback"):
            return line[:300]
    return lines[-1][:300] if lines else ""


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a run and every process it started (its own process group): SIGINT, then SIGTERM, then SIGKILL."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_process(command: list[str], env: dict, log_path: Path) -> int:
    """Run `command` with its output in `log_path`; Ctrl-C stops it (and its children) and is re-raised."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n\n")
        log.flush()
        # Its own session: the terminal's Ctrl-C reaches only us, and we stop the whole group cleanly.
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            _stop(proc)
            raise


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


def collect_row(plan: Plan, variant: Variant, returncode: Optional[int], run_dir: Path, log_path: Path,
                command: list[str], wall_seconds: float) -> dict:
    """One results row: what was asked, what the run recorded, and whether it worked."""
    row = {
        "run_id": variant.run_id,
        "script": plan.script,
        "preset": plan.preset,
        "requested_loader": variant.loader,
        "image_pipeline": variant.image_pipeline,
        "workers": variant.workers,
        "repeat": variant.repeat,
        "world_size": plan.nproc,
        "device_name": plan.expected_device_name,
        "device_type": plan.device,
        "loader": None,
        "returncode": returncode,
        "wall_seconds": round(wall_seconds, 1),
        "log": str(log_path),
        "output_dir": str(run_dir),
        "command": shlex.join(command),
    }
    train = _read_json(run_dir / "train_results.json")
    row.update({k: train[k] for k in TRAIN_KEYS if k in train})
    row.update({k: v for k, v in train.items() if k.startswith(("version_", "device_decode_"))})
    # recall@k, mean rank, loss; validation metrics were saved as eval_results.json by earlier versions
    validation = _read_json(run_dir / "validation_results.json") or _read_json(run_dir / "eval_results.json")
    row.update(summarise_quality(validation, "eval"))
    row.update(summarise_quality(_read_json(run_dir / "test_results.json"), "test"))

    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if returncode is None:
        row["status"], row["error"] = INTERRUPTED, "stopped by Ctrl-C"
    elif returncode != 0:
        row["status"] = FAILED
        row["error"] = last_error_line(log_text.split("\n", 2)[-1])  # skip the "$ command" line
        if returncode < 0:
            row["error"] = f"killed by signal {signal.Signals(-returncode).name}" + (f"; {row['error']}" if row["error"] else "")
    elif "train_samples_per_second" not in train:
        row["status"], row["error"] = FAILED, f"exited 0 but {run_dir / 'train_results.json'} has no train_samples_per_second"
    else:
        row["status"], row["error"] = OK, ""
    return row


def describe_row(row: dict) -> str:
    """One progress line with a run's figures (or its error)."""
    label = configuration_label(row["workers"], row["requested_loader"], row["image_pipeline"])
    if row["status"] == OK:
        text = (f"{label}: {row['train_samples_per_second']:.2f} samples/s "
                f"({row['train_samples_per_second_per_device']:.2f}/device), "
                f"data wait {100 * row.get('data_wait_fraction', 0):.0f}%, loader {row['loader']}")
        if "eval_i2t_recall@1" in row:
            text += f", eval i2t R@1 {row['eval_i2t_recall@1']:.3f}"
        return text + f", {row['wall_seconds']:.0f} s"
    if row["status"] == INTERRUPTED:
        return f"{label}: interrupted after {row['wall_seconds']:.0f} s"
    return f"{label}: FAILED (return code {row['returncode']}) after {row['wall_seconds']:.0f} s: {row['error']}  [log: {row['log']}]"


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def run_sweep(plan: Plan, out: Path, keep_weights: bool = False, echo: Callable[[str], None] = print) -> tuple[list[dict], bool]:
    """Run every variant in order; results are rewritten after each run. Returns (rows, interrupted)."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    total = len(plan.variants)
    for i, variant in enumerate(plan.variants, 1):
        run_dir, log_path = out / "runs" / variant.run_id, out / "logs" / f"{variant.run_id}.log"
        command = plan.command(variant, run_dir)
        label = configuration_label(variant.workers, variant.loader, variant.image_pipeline)
        echo(f"[{i}/{total}] start  {label}, repeat {variant.repeat} (log: {log_path})")
        if run_dir.exists():  # left by an earlier sweep into the same --out: its results must not pass for this run's
            shutil.rmtree(run_dir)
        started = time.perf_counter()
        try:
            returncode: Optional[int] = run_process(command, plan.run_env(variant), log_path)
        except KeyboardInterrupt:
            returncode = None
        row = collect_row(plan, variant, returncode, run_dir, log_path, command, time.perf_counter() - started)
        rows.append(row)
        if not keep_weights:
            _discard_weights(run_dir)
        write_results(out, plan, rows)
        echo(f"[{i}/{total}] {'done' if row['status'] == OK else row['status']:6} {describe_row(row)}")
        if returncode is None:
            return rows, True
    return rows, False


def write_results(out: Path, plan: Plan, rows: list[dict]) -> None:
    """results.json (the plan and every row) and results.csv (every row), replaced atomically."""
    document = {
        "bench": {
            "preset": plan.preset, "script": plan.script, "device": plan.device, "nproc": plan.nproc,
            "base_args": plan.base_args, "extra_args": plan.extra_args,
            "variants": [asdict(v) for v in plan.variants],
        },
        "runs": rows,
    }
    _write_atomically(out / "results.json", json.dumps(document, indent=2, default=str) + "\n")
    columns = list(CSV_COLUMNS) + sorted({k for row in rows for k in row} - set(CSV_COLUMNS))
    tmp = out / "results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, out / "results.csv")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Summaries: one cell per (device, configuration), medians over repeats
# ---------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """The repeats of one configuration on one device."""

    node: list[float] = field(default_factory=list)  # samples/s of the whole node, per finished repeat
    per_device: list[float] = field(default_factory=list)
    data_wait: list[float] = field(default_factory=list)
    recall: list[float] = field(default_factory=list)  # eval i2t recall@1, when evaluated
    failed: int = 0
    recorded_loaders: list[str] = field(default_factory=list)

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.node) if self.node else None

    @property
    def median_per_device(self) -> Optional[float]:
        return statistics.median(self.per_device) if self.per_device else None


@dataclass
class Summary:
    """Rows (devices) x columns (configurations) of cells, with each device's speedup baseline."""

    devices: list[str]
    columns: list[str]
    cells: dict  # (device, column) -> Cell
    baselines: dict  # device -> column its speedups are against (absent: no workers=0 run finished)
    failures: list[dict]
    repeats: int
    notes: dict  # facts shared by all rows: warm-up, counted steps, batch sizes


def device_label(row: Mapping) -> str:
    n = row.get("world_size") or 1
    return f"{row.get('device_name') or row.get('device_type') or 'unknown device'} x{n}"


def summarise(rows: Sequence[Mapping]) -> Summary:
    """Group finished and failed runs into cells; interrupted runs are left out."""
    rows = [r for r in rows if r.get("status") in (OK, FAILED)]
    groups: dict = {}  # (device, (loader asked for, image pipeline, workers)) -> Cell
    for row in rows:
        config = (row["requested_loader"], row["image_pipeline"], row["workers"])
        cell = groups.setdefault((device_label(row), config), Cell())
        if row["status"] == OK:
            cell.node.append(float(row["train_samples_per_second"]))
            cell.per_device.append(float(row.get("train_samples_per_second_per_device", row["train_samples_per_second"])))
            if row.get("data_wait_fraction") is not None:
                cell.data_wait.append(float(row["data_wait_fraction"]))
            if row.get("eval_i2t_recall@1") is not None:
                cell.recall.append(float(row["eval_i2t_recall@1"]))
            cell.recorded_loaders.append(str(row.get("loader")))
        else:
            cell.failed += 1

    # Columns: image pipelines in the order they ran, the PyTorch loader first, then by workers.
    pipelines = list(dict.fromkeys(r["image_pipeline"] for r in rows))
    configs = sorted({config for _, config in groups}, key=lambda c: (pipelines.index(c[1]), c[0] != TORCH_LOADER, c[0], c[2]))
    columns, cells = [], {}
    for config in configs:
        for (device, cfg), cell in groups.items():
            if cfg == config:
                column = _column_label(config, cell)
                if column not in columns:
                    columns.append(column)
                cells[(device, column)] = cell

    devices = list(dict.fromkeys(device_label(r) for r in rows))
    baselines = {d: b for d in devices if (b := _baseline_column(d, columns, cells))}
    ok_rows = [r for r in rows if r["status"] == OK]
    notes = {
        key: sorted({r[key] for r in ok_rows if r.get(key) is not None})
        for key in ("throughput_warmup_steps", "throughput_counted_steps", "per_device_train_batch_size", "world_size")
    }
    repeats = max((r.get("repeat", 1) for r in rows), default=0)
    return Summary(devices, columns, cells, baselines, [r for r in rows if r["status"] == FAILED], repeats, notes)


def _column_label(config: tuple, cell: Cell) -> str:
    """A configuration's heading, naming the loader its runs recorded, never only the one asked for:
    a "mediapipe" run that fell back to the PyTorch loader shows the string it saved."""
    loader, pipeline, workers = config
    recorded = sorted(set(cell.recorded_loaders))
    shown = loader if recorded in ([], [loader]) else f"{' / '.join(recorded)} (asked: {loader})"
    return configuration_label(workers, shown, pipeline)


def _baseline_column(device: str, columns: Sequence[str], cells: Mapping) -> Optional[str]:
    """workers=0 with the PyTorch loader and upstream images, else the first workers=0 PyTorch column."""
    candidates = [c for c in columns if c.startswith("workers=0") and " + " not in c and cells.get((device, c)) and cells[(device, c)].median]
    if "workers=0" in candidates:
        return "workers=0"
    return candidates[0] if candidates else None


def speedup(summary: Summary, device: str, column: str) -> Optional[float]:
    """Median samples/s of a cell divided by the median of its device's baseline cell."""
    baseline = summary.baselines.get(device)
    cell = summary.cells.get((device, column))
    if not baseline or cell is None or cell.median is None:
        return None
    return cell.median / summary.cells[(device, baseline)].median


def _fmt(value: Optional[float]) -> str:
    """samples/s as published (one decimal), with one more below 10 so small CPU figures keep two digits."""
    if value is None:
        return "-"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|"] + [line(row) for row in rows])


def cell_text(summary: Summary, device: str, column: str) -> str:
    """"samples/s (xspeedup)", with failures counted, or "failed" / "-"."""
    cell = summary.cells.get((device, column))
    if cell is None:
        return "-"
    if cell.median is None:
        return "failed" if cell.failed == 1 else f"failed x{cell.failed}"
    text = _fmt(cell.median)
    ratio = speedup(summary, device, column)
    if ratio is not None:
        text += f" (x{ratio:.2f})"
    if cell.failed:
        text += f" [{cell.failed} failed]"
    return text


def render_table(summary: Summary) -> str:
    """table.md: the published post's layout, plus data-wait and failure notes."""
    if not summary.devices:
        return "# BridgeTower fine-tuning throughput\n\nNo run finished.\n"
    header = ["device"] + summary.columns
    body = [[device] + [cell_text(summary, device, c) for c in summary.columns] for device in summary.devices]
    parts = ["# BridgeTower fine-tuning throughput (samples/s, whole node)", "", _markdown_table(header, body), ""]
    parts.append(_notes(summary))

    wait_rows = []
    for device in summary.devices:
        wait = []
        for column in summary.columns:
            cell = summary.cells.get((device, column))
            wait.append(f"{100 * statistics.median(cell.data_wait):.0f}%" if cell and cell.data_wait else "-")
        wait_rows.append([device] + wait)
    parts += ["", "## Time the training loop waited for data (median)", "", _markdown_table(header, wait_rows)]

    if any(len(cell.node) > 1 for cell in summary.cells.values()):
        spread_rows = [[device] + [_spread(summary.cells.get((device, c))) for c in summary.columns] for device in summary.devices]
        parts += ["", "## Spread over repeats (min-max samples/s, number of finished runs)", "", _markdown_table(header, spread_rows)]

    if any(cell.recall for cell in summary.cells.values()):
        recall_rows = [[device] + [f"{statistics.median(summary.cells[(device, c)].recall):.3f}"
                                   if (device, c) in summary.cells and summary.cells[(device, c)].recall else "-"
                                   for c in summary.columns] for device in summary.devices]
        parts += ["", "## Retrieval quality: eval image->text recall@1 (median)", "", _markdown_table(header, recall_rows)]

    if summary.failures:
        parts += ["", "## Failed runs", ""]
        parts += [f"- {r['run_id']} (return code {r['returncode']}): {r['error']} — log: {r['log']}" for r in summary.failures]
    return "\n".join(parts) + "\n"


def _spread(cell: Optional[Cell]) -> str:
    if cell is None or not cell.node:
        return "-"
    return f"{_fmt(min(cell.node))}-{_fmt(max(cell.node))} (n={len(cell.node)})"


def _notes(summary: Summary) -> str:
    notes = summary.notes

    def facts(key):
        return ", ".join(str(v) for v in notes.get(key, [])) or "?"

    lines = [
        f"Steady-state samples/s of all devices of a row together ({facts('world_size')}), after {facts('throughput_warmup_steps')} "
        f"warm-up step(s), over {facts('throughput_counted_steps')} counted step(s); per-device batch "
        f"{facts('per_device_train_batch_size')}; median of up to {summary.repeats} repeat(s).",
    ]
    for device, baseline in summary.baselines.items():
        lines.append(f"(xN): speedup against `{baseline}` on {device}.")
    return "\n".join(lines)


def render_vs_published(summary: Summary, meta: Mapping) -> str:
    """vs_published.md: our cells beside the published figures, whole node and per device (published = node / 8).

    Upstream's CI baselines follow, as a reference for the Gaudi rows.
    """
    rows_order = list(summary.columns) + [c for c in PUBLISHED_CONFIGS if c not in summary.columns]
    published_devices = list(PUBLISHED)
    ours = summary.devices

    def node_value(device, column):
        cell = summary.cells.get((device, column))
        return cell.median if cell else None

    def per_device_value(device, column):
        cell = summary.cells.get((device, column))
        return cell.median_per_device if cell else None

    def published_value(device, column, per_device):
        value = PUBLISHED[device].get(column)
        if value is None:
            return "n/a" if column in PUBLISHED_CONFIGS else "-"
        return _fmt(value / PUBLISHED_DEVICES if per_device else value)

    def published_speedup(device, column):
        value, base = PUBLISHED[device].get(column), PUBLISHED[device]["workers=0"]
        return f"x{value / base:.2f}" if value is not None else ("n/a" if column in PUBLISHED_CONFIGS else "-")

    header = ["configuration"] + [f"{d} (this run)" for d in ours] + [f"{d} (published)" for d in published_devices]
    node_rows = [[c] + [_fmt(node_value(d, c)) for d in ours] + [published_value(d, c, False) for d in published_devices] for c in rows_order]
    device_rows = [[c] + [_fmt(per_device_value(d, c)) for d in ours] + [published_value(d, c, True) for d in published_devices] for c in rows_order]
    speedup_rows = [[c] + [f"x{s:.2f}" if (s := speedup(summary, d, c)) is not None else "-" for d in ours]
                    + [published_speedup(d, c) for d in published_devices] for c in rows_order]

    model = meta.get("model", "?")
    world_sizes = summary.notes.get("world_size", [])
    if meta.get("preset") != "blog":
        verdict = "Not the published recipe (a different model, data or scale): compare the speedups, not the samples/s."
    elif world_sizes == [PUBLISHED_DEVICES]:
        verdict = "The published recipe at the published scale: the numbers compare directly."
    else:
        verdict = (f"The published recipe on {', '.join(map(str, world_sizes)) or '?'} device(s) instead of "
                   f"{PUBLISHED_DEVICES}: compare the per-device figures.")
    parts = [
        "# This run beside the published figures",
        "",
        _markdown_table(["", "this run", "published"], [
            ["model", model, f"{BLOG_MODEL} (866 M parameters)"],
            ["devices", ", ".join(str(n) for n in summary.notes.get("world_size", [])) or "?", str(PUBLISHED_DEVICES)],
            ["per-device batch", ", ".join(str(n) for n in summary.notes.get("per_device_train_batch_size", [])) or "?", str(PUBLISHED_BATCH)],
            ["warm-up steps", ", ".join(str(n) for n in summary.notes.get("throughput_warmup_steps", [])) or "?", "3"],
        ]),
        "",
        verdict,
        "",
        "## Whole node, samples/s",
        "",
        _markdown_table(header, node_rows),
        "",
        f"## Per device, samples/s (published: node / {PUBLISHED_DEVICES})",
        "",
        _markdown_table(header, device_rows),
        "",
        "## Speedup against workers=0 of the same device",
        "",
        _markdown_table(header, speedup_rows),
        "",
        "n/a: not published for that device; -: not run (or no run finished).",
        "",
        f"## Upstream's CI baselines (optimum-habana 1.21 line, {PUBLISHED_DEVICES} devices)",
        "",
        _markdown_table(["device", "samples/s (node)", "samples/s per device"],
                        [[d, _fmt(v), _fmt(v / PUBLISHED_DEVICES)] for d, v in CI_BASELINES.items()]),
        "",
        f"Its command adds `{CI_EXTRA_FLAGS}` to the published flags and leaves out `--do_predict`.",
    ]
    return "\n".join(parts) + "\n"


def render_chart(summary: Summary, path: Path) -> None:
    """chart.png: grouped bars, one group per configuration, one bar per device, labelled with samples/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns, devices = summary.columns or ["(no runs)"], summary.devices or ["(no device)"]
    width = 0.8 / len(devices)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(columns) + 2), 4.5))
    for i, device in enumerate(devices):
        xs = [j + (i - (len(devices) - 1) / 2) * width for j in range(len(columns))]
        cells = [summary.cells.get((device, c)) for c in columns]
        bars = ax.bar(xs, [cell.median if cell and cell.median else 0.0 for cell in cells], width, label=device)
        for bar, column, cell in zip(bars, columns, cells):
            if cell is None:
                continue
            ratio = speedup(summary, device, column)
            text = "failed" if cell.median is None else f"{cell.median:.3g}" + (f"\nx{ratio:.2f}" if ratio is not None else "")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels([textwrap.fill(c, 28) for c in columns], fontsize=8)
    ax.set_ylabel("samples/s (whole node)")
    ax.set_title("BridgeTower contrastive fine-tuning throughput")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_all(out: Path, rows: Sequence[Mapping], meta: Mapping) -> str:
    """Write table.md, vs_published.md and chart.png; return the table text."""
    summary = summarise(rows)
    table = render_table(summary)
    _write_atomically(out / "table.md", table)
    _write_atomically(out / "vs_published.md", render_vs_published(summary, meta))
    render_chart(summary, out / "chart.png")
    return table


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bridgetower_bench.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=("local", "blog"), default="local", help="local: embedded tiny fixtures (default); blog: the published run.")
    parser.add_argument("--script", choices=("auto", "cuda", "gaudi"), default="auto",
                        help="auto: the Gaudi script when an HPU is present, else the CUDA/CPU script.")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="dataloader_num_workers settings (default: 0 1 2).")
    parser.add_argument("--loaders", nargs="+", default=None,
                        help=f"Loaders: {', '.join(LOADERS)} (default: torch, plus mediapipe on an HPU or device_decode on a GPU).")
    parser.add_argument("--loader-workers", type=int, nargs="+", default=None,
                        help="Worker settings for loaders other than torch (default: the largest --workers).")
    parser.add_argument("--image-pipelines", nargs="+", default=["upstream"], help="Host image pipelines (default: upstream).")
    parser.add_argument("--nproc", type=int, default=None, help="Devices per run (default: 1; 8 for --preset blog).")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of every configuration; tables show the median.")
    parser.add_argument("--eval", action="store_true", help="Also evaluate (--do_eval): retrieval recall lands in the results.")
    parser.add_argument("--extra-args", default="", help="Flags appended to every run, e.g. \"--max_steps 30 --seed 1\".")
    parser.add_argument("--out", type=Path, default=None, help="Output directory (default: bench_out/<timestamp>).")
    parser.add_argument("--keep-weights", action="store_true", help="Keep each run's saved model (deleted by default).")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands and exit.")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args, build_fixtures=not args.dry_run)
    except ValueError as e:
        parser.error(str(e))
    out = (args.out or Path("bench_out") / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()

    print(f"{len(plan.variants)} run(s) of {SCRIPTS[plan.script].name} on {plan.device} x{plan.nproc} ({args.preset} preset)")
    if args.dry_run:
        for variant in plan.variants:
            print(shlex.join(plan.command(variant, out / "runs" / variant.run_id)))
        return 0
    if plan.env.get("PATH", "").startswith(str(HABANA_SHIM)):
        print(f"note: no Habana software here; the Gaudi script runs on CPU with the stand-ins in {HABANA_SHIM}")

    # A plain `kill` stops the sweep like Ctrl-C does: the running subprocess is stopped, finished rows stay.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        rows, interrupted = run_sweep(plan, out, keep_weights=args.keep_weights)
    finally:
        signal.signal(signal.SIGTERM, previous)
    meta = {"preset": args.preset, "model": _flag_value(plan.base_args + plan.extra_args, "--model_name_or_path")}
    table = render_all(out, rows, meta)
    print()
    print(table)
    print(f"results: {out / 'results.json'}, {out / 'results.csv'}, {out / 'table.md'}, {out / 'vs_published.md'}, {out / 'chart.png'}")
    if interrupted:
        print("interrupted: the rows above are the runs that finished")
        return 130
    return 0 if all(r["status"] == OK for r in rows) else 1


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
    sys.exit(main())

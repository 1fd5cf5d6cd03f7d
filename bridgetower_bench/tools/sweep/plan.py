"""The sweep's command line checked and turned into a Plan: the device the runs train on (an accelerator that torch
cannot use is refused, never benchmarked as a CPU), the script, the loaders, the scaling curve, the nodes.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Optional

from bridgetower_bench import published
from bridgetower_bench.guards.habana_software import habana_software_present
from bridgetower_bench.mediapipe.availability import TORCH_LOADER
from bridgetower_bench.tools.hosts import hostfile_flag, hostfile_nodes, port, rendezvous_endpoint
from bridgetower_bench.tools.sweep.commands import (
    DEFAULT_LOCAL_PIPELINES,
    LOADERS,
    NATIVE_LOADER,
    REPO,
    SCRIPTS,
    Plan,
    expand_matrix,
    scaling_points,
)
from bridgetower_bench.tools.sweep.presets import (
    blog_preset_args,
    device_flags,
    fixture_paths,
    local_preset_args,
    mode_env,
    parse_extra_args,
    persistent_settings,
    plan_shape,
)
from bridgetower_bench.tools.tool_paths import habana_standin_env, positive_number
from bridgetower_bench.user_errors import UserInputError


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


def default_devices(preset: str, script: str, device: str, nproc: int) -> list[int]:
    """The CUDA script's local preset on a CPU of 2 cores or more measures the curve at 1 and 2 processes (one
    extra run, of the first configuration); elsewhere there is no curve unless --devices asks for it."""
    local_cpu = preset == "local" and script == "cuda" and device == "cpu" and nproc == 1
    return [1, 2] if local_cpu and (os.cpu_count() or 1) >= 2 else []


def node_counts(args: argparse.Namespace, script: str, device: str, nproc: int) -> tuple[list[str], list[int]]:
    """--hostfile's hosts and the --nodes counts above 1 (the curve across nodes), or UserInputError."""
    counts = args.nodes or []
    args.rdzv_port = port(args.rdzv_port, "--rdzv-port")
    args.remote_start_timeout = positive_number(
        "--remote-start-timeout", args.remote_start_timeout, "a number of seconds above 0, e.g. 60"
    )
    several = sorted({n for n in counts if n > 1})
    if any(n < 1 for n in counts):
        raise UserInputError(f"--nodes {','.join(map(str, counts))}: node counts must be 1 or more")
    if args.hostfile is None:
        if several:
            raise UserInputError(
                f"--nodes {several[-1]}: several nodes need --hostfile (one `HOST slots=N` line each)"
            )
        return [], []
    named = hostfile_flag(args.hostfile)
    if not several:
        raise UserInputError(f"{named}: --nodes names no count above 1 (e.g. --nodes 1,2)")
    if script == "gaudi" and device != "hpu":
        raise UserInputError(
            f"--nodes {several[-1]}: the Gaudi script runs several processes only on HPUs (none here)"
        )
    hosts = hostfile_nodes(args.hostfile, gaudi=script == "gaudi")
    if script == "cuda":  # the first node keeps the c10d rendezvous, whose address torch takes without a zone id
        rendezvous_endpoint(next(iter(hosts)), args.rdzv_port, f"{named}: the first node")
    if several[-1] > len(hosts):
        raise UserInputError(f"--nodes {several[-1]}: {named} gives {len(hosts)} node(s)")
    for host, slots in list(hosts.items())[: several[-1]]:
        if slots < nproc:
            raise UserInputError(f"{named}: {host} has slots={slots}, fewer than --nproc {nproc}")
    return list(hosts), several


def make_plan(args: argparse.Namespace, accelerator: Optional[str] = None, build_fixtures: bool = True) -> Plan:
    """Check the command line and turn it into a Plan. `accelerator` overrides detection (tests, dry runs)."""
    _check_counts(args)
    script, device = _script_and_device(args, accelerator)
    nproc = args.nproc if args.nproc is not None else (published.DEVICES if args.preset == "blog" else 1)
    devices = args.devices if args.devices is not None else default_devices(args.preset, script, device, nproc)
    _check_process_counts(script, device, [("--nproc", nproc)] + [("--devices", n) for n in devices])
    hosts, nodes = node_counts(args, script, device, nproc)
    loaders = _loaders(args, script, device)
    base = _base_args(args, script, device, build_fixtures)
    # The local preset shows the reproduction and the improvement side by side; the published run, upstream's images.
    image_pipelines = args.image_pipelines or (
        list(DEFAULT_LOCAL_PIPELINES) if args.preset == "local" else ["upstream"]
    )
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
        env=_run_env(args.preset, script, device),
        expected_device_name=local_device_name(device) if not args.dry_run else "",
        mode_env=mode_env(script, device),
        hosts=hosts,
        remote_shell=args.remote_shell,
        rdzv_port=args.rdzv_port,
        remote_start_timeout=args.remote_start_timeout,
    )


def _check_counts(args: argparse.Namespace) -> None:
    """The counts and the shape on the command line, each refused (ValueError) where it means nothing."""
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
    if args.shape is not None and args.preset != "local":
        raise ValueError(
            f"--shape {args.shape}: only the local preset has shapes (--preset blog runs the published 5 epochs)"
        )
    if args.prefetch_factors and any(f < 1 for f in args.prefetch_factors):
        raise ValueError(f"--prefetch-factors {' '.join(map(str, args.prefetch_factors))}: must be 1 or more")


def _script_and_device(args: argparse.Namespace, accelerator: Optional[str]) -> tuple[str, str]:
    """The script the runs start and the device they train on ("hpu", "cuda" or "cpu"); UserInputError where they
    would fall back on the CPU without --device cpu but for the local preset on a machine without an accelerator."""
    if args.device != "cpu":
        accelerator = accelerator or detect_accelerator()
    script = args.script if args.script != "auto" else ("gaudi" if accelerator == "hpu" else "cuda")
    native = {"gaudi": "hpu", "cuda": "cuda"}[script]
    device = native if accelerator == native and args.device != "cpu" else "cpu"
    if device == "cpu" and args.device != "cpu":  # only the local preset, on a machine with no accelerator at all
        if accelerator in ("hpu", "cuda"):  # (detect_accelerator's other answer: "cpu")
            raise UserInputError(
                f"--script {script}: {SCRIPTS[script].name} does not train on this machine's {dict(hpu='HPUs', cuda='GPUs')[accelerator]}; {CPU_ON_PURPOSE}"
            )
        if args.preset == "blog":
            raise UserInputError(
                f"--preset blog: no HPU or NVIDIA GPU here (the published run trains on {published.DEVICES} of them); {CPU_ON_PURPOSE}"
            )
    return script, device


def _check_process_counts(script: str, device: str, counts: list[tuple[str, int]]) -> None:
    """Each (flag, process count) that this device cannot run is refused (ValueError)."""
    for flag, n in counts:
        if script == "gaudi" and n > 1 and device != "hpu":
            raise ValueError(f"{flag} {n}: the Gaudi script runs several processes only on HPUs (none here)")
        if device == "cuda" and n > 1:
            import torch

            if 0 < torch.cuda.device_count() < n:
                raise ValueError(f"{flag} {n}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _loaders(args: argparse.Namespace, script: str, device: str) -> list[str]:
    """--loaders (default: the PyTorch loader and the device's own), each one the script has."""
    loaders = args.loaders or [TORCH_LOADER] + ([NATIVE_LOADER[device]] if device in NATIVE_LOADER else [])
    for loader in loaders:
        if loader not in LOADERS:
            raise ValueError(f"--loaders {loader}: unknown loader (known: {', '.join(LOADERS)})")
        only_on = LOADERS[loader][1]
        if only_on is not None and only_on != script:
            raise ValueError(
                f"--loaders {loader}: only {SCRIPTS[only_on].name} has it; this sweep runs {SCRIPTS[script].name}"
            )
    return loaders


def _base_args(args: argparse.Namespace, script: str, device: str, build_fixtures: bool) -> list[str]:
    """The preset's flags and the device's, shared by every run."""
    if args.preset == "local":
        paths = fixture_paths(build=build_fixtures)
        base = local_preset_args(paths, args.eval, args.shape or "published")
        gaudi_config = paths["gaudi_config"]
    else:
        base = blog_preset_args()
        gaudi_config = published.GAUDI_CONFIG
    base += device_flags(script, device, gaudi_config, args.preset)
    return base


def _run_env(preset: str, script: str, device: str) -> dict:
    """The variables every run gets on top of the sweep's environment."""
    env = {
        "PYTHONUNBUFFERED": "1",  # logs stream into logs/<run>.log as they happen
        "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),  # quiet with loader workers
    }
    if preset == "local":  # everything is on disk: never wait for the Hub
        env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update(mode_env(script, device))
    if script == "gaudi" and device == "cpu" and not habana_software_present():
        env.update(habana_standin_env({**os.environ, **env}))  # (tools/habana_standin/README.md)
    return env

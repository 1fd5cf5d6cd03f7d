"""First-run self-check of an NVIDIA GPU machine: is the software what this kit expects, and does training run?

    python -m bridgetower_bench.tools.nvidia_check [--output_dir nvidia_check] [--json PATH] [--max_steps 5]
    python -m bridgetower_bench.tools.nvidia_check --memory 40 48 80    # the published batch on GPUs of that many GiB

The counterpart of ``gaudi_check`` (same table, same record, same exit statuses):

1. The stack, read only (nothing is ever installed): torch and the CUDA version it is built for, the
   driver (NVML or nvidia-smi) against the one that build needs, the visible GPUs and their memory,
   bf16 support, whether the published per-device batch (48, BridgeTower Large) fits each GPU
   (``bridgetower_bench.gpu_memory``: the measured peak, or the batch and gradient accumulation that keep
   the global batch), JPEG decoding on the GPU (``torchvision.io.decode_jpeg`` on the device, against the
   host's pixels), and every package requirements.txt and the install route's file pin
   (requirements-cuda.txt, or requirements-cuda12.txt for a torch built for CUDA 12).
2. Training: a few steps on the embedded fixtures (tiny random-weight BridgeTower, synthetic New
   Yorker-shaped data) on one GPU with the PyTorch loader and with ``--device_decode`` (passes only when
   the run says the device decoder ran), then under torchrun on every visible GPU; last, one step of
   the real BridgeTower Large configuration at random weights (``fixtures --large``) at the published
   per-device batch, bf16, with its peak memory.

It prints one table and writes it as JSON (``--json``, default ``<output_dir>/nvidia_check.json``) to
attach to a bug report: versions, results and command lines with paths relative to the output directory;
no environment variables, no tokens. Each step's output is in ``<output_dir>/<step>/log.txt``.

Exit status: 0 when every check and step passed (warnings allowed), 1 when one failed, 2 without a usable
NVIDIA GPU, said in one line with the reason (driver, CUDA_VISIBLE_DEVICES, no driver at all).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from .. import published
from ..atomic_files import write_atomically
from ..execution_mode import NOT_ON_GAUDI
from ..redaction import shareable
from . import gaudi_check, tool_paths
from .gaudi_check import (
    FAILED,
    OK,
    REPO,
    WARNING,
    Ran,
    Row,
    Step,
    format_table,
    judge,
    last_error_line,
    pinned_requirements,
    record,
    requirement_row,
    run_command,
)


CUDA_SCRIPT = REPO / "run_bridgetower_cuda.py"
NO_GPU_EXIT = 2


@dataclass
class Gpus:
    """What the probe found: the visible GPUs and the torch that sees them."""

    count: int
    names: list
    memory_gib: list
    torch: str
    cuda: str
    bf16: bool
    driver: Optional[str] = None
    driver_source: Optional[str] = None
    capabilities: list = field(default_factory=list)
    jpeg: str = ""  # "ok: ..." or why GPU JPEG decoding failed


def probe_gpus() -> Gpus | str:
    """The visible GPUs, or why there is no usable one (one line), asked in a child process."""
    answer = gaudi_check.ask_child("bridgetower_bench.tools.nvidia_check:gpus_here", "GPU")
    return answer if isinstance(answer, str) else Gpus(**answer)


def gpus_here() -> dict | str:
    """What ``probe_gpus`` reports, found in this process."""
    try:
        import torch
    except Exception as error:
        return f"torch cannot be imported: {type(error).__name__}: {error}"
    from ..cuda_device import ask_driver, why_no_cuda

    reason = why_no_cuda()
    if reason:
        return reason
    count = torch.cuda.device_count()
    properties = [torch.cuda.get_device_properties(i) for i in range(count)]
    driver = ask_driver()
    return {
        "count": count,
        "names": [p.name for p in properties],
        "memory_gib": [round(p.total_memory / 2**30, 2) for p in properties],
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "bf16": bool(torch.cuda.is_bf16_supported()),
        "driver": driver.version if driver else None,
        "driver_source": driver.source if driver else None,
        "capabilities": [f"{p.major}.{p.minor}" for p in properties],
        "jpeg": jpeg_on_gpu(),
    }


def jpeg_on_gpu() -> str:
    """Decode a small JPEG on the GPU (nvJPEG through torchvision) and on the host: "ok: ..." or the error."""
    try:
        import torch
        from torchvision.io import decode_jpeg, encode_jpeg

        y, x = torch.meshgrid(torch.arange(48), torch.arange(64), indexing="ij")
        image = torch.stack([x * 4, y * 5, (x + y) * 2]).to(torch.uint8)
        data = encode_jpeg(image, quality=90)
        host = decode_jpeg(data)
        device = decode_jpeg(data, device="cuda").cpu()
        if device.shape != host.shape:
            return f"failed: the GPU decoded {tuple(device.shape)}, the host {tuple(host.shape)}"
        diff = (device.int() - host.int()).abs().max().item()
        return f"ok: 64x48 JPEG decoded on the GPU, max difference from the host's pixels {diff}/255"
    except Exception as error:
        return f"failed: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[
            :300
        ]


# ----------------------------------------------------------------------------------------
# 1. The stack
# ----------------------------------------------------------------------------------------


def route_file(cuda: str) -> str:
    """The requirements file of the install route a torch built for CUDA `cuda` comes from."""
    from ..cuda_device import CUDA12_REQUIREMENTS

    return CUDA12_REQUIREMENTS if cuda.split(".")[0] == "12" else "requirements-cuda.txt"


def driver_row(gpus: Gpus) -> Row:
    from ..cuda_device import driver_needs, driver_too_old

    needs = driver_needs(gpus.torch, gpus.cuda)
    if not gpus.driver:
        return Row("NVIDIA driver", WARNING, f"version unknown (no NVML bindings answered, nor nvidia-smi); {needs}")
    if driver_too_old(gpus.driver, gpus.cuda):
        return Row("NVIDIA driver", FAILED, f"{gpus.driver}, too old: {needs}")
    return Row("NVIDIA driver", OK, f"{gpus.driver} (from {gpus.driver_source}); {needs}")


def gpus_row(gpus: Gpus) -> Row:
    kinds = {}
    for name, memory, capability in zip(gpus.names, gpus.memory_gib, gpus.capabilities or [""] * gpus.count):
        kinds.setdefault((name, memory, capability), 0)
        kinds[(name, memory, capability)] += 1
    detail = ", ".join(
        f"{n} x {name} ({memory:.1f} GiB{', compute capability ' + cap if cap else ''})"
        for (name, memory, cap), n in kinds.items()
    )
    return Row("GPUs", OK, detail)


def memory_row(gpus: Gpus) -> Row:
    """Does the published per-device batch fit the smallest visible GPU (known need, estimated)?"""
    from .. import gpu_memory

    need = published_need()
    smallest = min(gpus.memory_gib)
    if need.fits(published.BATCH, smallest):
        return Row(
            "published batch memory",
            OK,
            f"per-device batch {published.BATCH} needs about "
            f"{need.device_gib(published.BATCH):.1f} of {smallest:.1f} GiB (estimated; the last step measures it)",
        )
    line = gpu_memory.does_not_fit_message(
        batch=published.BATCH,
        accumulation=1,
        world_size=gpus.count,
        device_name=gpus.names[gpus.memory_gib.index(smallest)],
        device_total_gib=smallest,
        need=need,
    )
    return Row("published batch memory", WARNING, line)


def published_need():
    from .. import gpu_memory

    return gpu_memory.memory_need(
        shape=published.SHAPE,
        sequence_length=published.SEQUENCE,
        bf16=True,
        attention="eager",
        compiled=False,
        gradient_checkpointing=False,
        parameters=published.TRAINED_PARAMETERS,
        trained=published.TRAINED_PARAMETERS,
    )


def stack_rows(gpus: Gpus, installed: Optional[Callable[[str], str]] = None) -> list[Row]:
    route = route_file(gpus.cuda)
    rows = [
        gpus_row(gpus),
        driver_row(gpus),
        Row("torch build", OK, f"{gpus.torch} (built for CUDA {gpus.cuda}; route: {route})"),
    ]
    rows.append(
        Row(
            "bf16",
            OK if gpus.bf16 else FAILED,
            "supported"
            if gpus.bf16
            else "not supported on this GPU: the published recipe trains in bf16 (A100 or newer)",
        )
    )
    rows.append(memory_row(gpus))
    rows.append(
        Row(
            "GPU JPEG decoding",
            OK if gpus.jpeg.startswith("ok") else WARNING,
            gpus.jpeg.removeprefix("ok: ")
            if gpus.jpeg.startswith("ok")
            else f"{gpus.jpeg}; --device_decode then decodes on the host",
        )
    )
    extra = {} if installed is None else {"installed": installed}
    rows += [
        requirement_row(line, install=route, **extra)
        for line in pinned_requirements(files=("requirements.txt", route))
    ]
    return rows


# ----------------------------------------------------------------------------------------
# 2. Training steps
# ----------------------------------------------------------------------------------------


def script_flags(
    model: Path, dataset: Path, run_dir: Path, max_steps: int, batch: int = 4, rows: int = 64, evaluate: bool = True
) -> list[str]:
    """The CUDA script's flags for a short bf16 run on the fixtures."""
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(dataset),
        "--dataset_config_name",
        "matching",
        "--image_column",
        "image",
        "--caption_column",
        "image_description",
        "--output_dir",
        str(run_dir),
        "--overwrite_output_dir",
        "--do_train",
        *(["--do_eval"] if evaluate else []),
        "--max_steps",
        str(max_steps),
        "--max_train_samples",
        str(rows),
        "--max_eval_samples",
        "16",
        "--per_device_train_batch_size",
        str(batch),
        "--per_device_eval_batch_size",
        "4",
        "--throughput_warmup_steps",
        "1" if max_steps > 1 else "0",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "2",
        "--bf16",
    ]


def plan_steps(fixtures: dict, large_model: Path, output_dir: Path, max_steps: int, gpus: int) -> list[Step]:
    def step(name, expected_loader, flags, launcher=(), needs=1):
        command = [*(launcher or [sys.executable]), str(CUDA_SCRIPT), *flags]
        return Step(
            name,
            command,
            output_dir / name / "run",
            output_dir / name / "log.txt",
            expected_loader,
            needs,
            expected_mode=NOT_ON_GAUDI,
            env={},
        )  # no Habana execution mode on a GPU

    def tiny(name):
        return script_flags(fixtures["model"], fixtures["dataset"], output_dir / name / "run", max_steps)

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus)]
    large = script_flags(
        large_model,
        fixtures["dataset"],
        output_dir / "large-1step" / "run",
        1,
        batch=published.BATCH,
        rows=2 * published.BATCH,
        evaluate=False,
    )
    return [
        step("1gpu-pytorch-loader", "torch", tiny("1gpu-pytorch-loader")),
        step(
            "1gpu-device-decode",
            "device_decode",
            tiny("1gpu-device-decode") + ["--image_pipeline", "fast", "--device_decode"],
        ),
        step(f"{gpus}gpu-torchrun", "torch", tiny(f"{gpus}gpu-torchrun"), launcher=torchrun, needs=gpus),
        step("large-1step", "torch", large),
    ]


def judge_step(step: Step, ran: Ran, seconds: float, output_dir: Path) -> Row:
    """gaudi_check's verdict; the Large step also shows its peak memory, and a batch that does not fit is a warning."""
    row = judge(step, ran, seconds, output_dir)
    if step.name != "large-1step":
        return row
    if ran.returncode == 2 and "does not fit" in last_error_line(step.log):
        row.result, row.detail = WARNING, last_error_line(step.log).split("error: ", 1)[-1]
        return row
    if row.result == OK:
        results = json.loads((step.run_dir / "train_results.json").read_text())
        peak = results.get("peak_gpu_memory_gb")
        row.detail = (
            f"peak {peak} GiB of tensors at per-device batch {published.BATCH}" if peak is not None else ""
        ) + (f"; {ran.note}" if ran.note else "")
    return row


def run_steps(steps: list[Step], gpus: Gpus, output_dir: Path, runner: Callable[[Step], Ran]) -> list[Row]:
    return gaudi_check.run_steps(
        steps, gpus, output_dir, runner, devices="GPUs", tool="nvidia_check", judge_step=judge_step
    )


# ----------------------------------------------------------------------------------------
# The memory plan without a GPU, and the command line
# ----------------------------------------------------------------------------------------


def memory_plan(sizes_gib: list[float]) -> str:
    """For GPUs of these sizes: does the published per-device batch fit, else which batch x accumulation does."""
    from .. import gpu_memory

    need = published_need()
    lines = [
        f"BridgeTower Large, 294 px, 128 tokens, bf16: about {need.fixed_gib:.1f} GiB + {need.per_sample_gib:.2f} GiB "
        f"per sample of tensors (estimated from {need.measured.peak_gib} GiB at batch {need.measured.batch}, "
        f"{need.measured.where}), +{gpu_memory.ALLOCATOR_RESERVE:.0%} allocator reserve, "
        f"+{gpu_memory.CUDA_CONTEXT_GIB:.0f} GiB CUDA context"
    ]
    for size in sizes_gib:
        if need.fits(published.BATCH, size):
            lines.append(
                f"{size:g} GiB: per-device batch {published.BATCH} fits (about {need.device_gib(published.BATCH):.1f} GiB)"
            )
            continue
        smaller = gpu_memory.same_global_batch(published.BATCH, 1, lambda b: need.fits(b, size))
        lines.append(
            f"{size:g} GiB: per-device batch {published.BATCH} does not fit (about {need.device_gib(published.BATCH):.1f} GiB); "
            + (
                f"--per_device_train_batch_size {smaller[0]} --gradient_accumulation_steps {smaller[1]} "
                f"(about {need.device_gib(smaller[0]):.1f} GiB)"
                if smaller
                else "not even batch 1 fits"
            )
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bridgetower_bench.tools.nvidia_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output_dir", type=Path, default=Path("nvidia_check"), help="Where the runs, logs and record go."
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="The record's path (default: <output_dir>/nvidia_check.json)."
    )
    parser.add_argument("--max_steps", type=int, default=5, help="Optimizer steps per run on the tiny fixtures.")
    parser.add_argument("--timeout", type=float, default=900, help="Seconds allowed per training run.")
    parser.add_argument(
        "--large_model",
        type=Path,
        default=None,
        help="A BridgeTower Large directory to train one step (default: built with random weights under <output_dir>/fixtures).",
    )
    parser.add_argument(
        "--memory",
        type=float,
        nargs="+",
        metavar="GIB",
        help="Only print whether the published per-device batch fits GPUs of these sizes (no GPU needed).",
    )
    args = parser.parse_args(argv)
    if args.max_steps <= 0:
        parser.error(f"--max_steps={args.max_steps}: must be positive")
    if args.timeout <= 0:
        parser.error(f"--timeout={args.timeout}: must be positive")
    if args.memory and min(args.memory) <= 0:
        parser.error("--memory: sizes must be positive")
    if not args.memory:  # (--memory writes nothing)
        tool_paths.output_dir("--output_dir", args.output_dir)
        if args.json is not None:
            tool_paths.output_file("--json", args.json)
    return args


def main(
    argv=None,
    *,
    probe: Callable[[], Gpus | str] = probe_gpus,
    runner: Optional[Callable[[Step], Ran]] = None,
    installed: Optional[Callable[[str], str]] = None,
) -> int:
    """Run the check; returns the exit status. ``probe``, ``runner`` and ``installed`` are replaceable for tests."""
    args = parse_args(argv)
    if args.memory:
        print(memory_plan(args.memory))
        return 0
    gpus = probe()
    if isinstance(gpus, str):
        print(f"nvidia_check: no usable NVIDIA GPU: {gpus}; nothing checked.")
        return NO_GPU_EXIT
    output_dir = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = (args.json or output_dir / "nvidia_check.json").resolve()
    if runner is None:
        runner = lambda step: run_command(step, args.timeout, tool="nvidia_check")  # noqa: E731

    stack = stack_rows(gpus, installed)
    from .fixtures import build_fixture, ensure_default_fixtures

    fixtures = ensure_default_fixtures(output_dir / "fixtures")  # inside the output directory: the record names them
    large = (
        args.large_model.resolve()
        if args.large_model
        else build_fixture(output_dir / "fixtures", "model", seed=0, image_size=294, large=True)
    )
    steps = run_steps(plan_steps(fixtures, large, output_dir, args.max_steps, gpus.count), gpus, output_dir, runner)
    print()
    print(format_table(stack + steps), end="")
    report = record(None, stack, steps, output_dir)
    report.pop("hpus", None)
    report.update(tool="python -m bridgetower_bench.tools.nvidia_check", gpus=asdict(gpus))
    report = shareable(report, args=list(sys.argv[1:] if argv is None else argv))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(json_path, json.dumps(report, indent=2) + "\n")
    print(f"record: {json_path} ({'passed' if report['passed'] else 'FAILED'}; attach it to a bug report)")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    tool_paths.run(main)

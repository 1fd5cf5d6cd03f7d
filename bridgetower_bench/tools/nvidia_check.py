"""First-run self-check of an NVIDIA GPU machine: is the software what this kit expects, and does training run?

    python -m bridgetower_bench.tools.nvidia_check [--output_dir nvidia_check] [--json PATH] [--max_steps 5]
    python -m bridgetower_bench.tools.nvidia_check --memory 40 48 80    # the published batch on GPUs of that many GiB

The counterpart of ``gaudi_check`` (same table, same record, same exit statuses):

1. The stack, read only (nothing is ever installed): torch and the CUDA version it is built for, the
   driver (NVML or nvidia-smi) against the one that build needs, the visible GPUs and their memory,
   bf16 support, whether the published per-device batch (48, BridgeTower Large) fits each GPU
   (``bridgetower_bench.guards.gpu_memory``: the measured peak, or the batch and gradient accumulation that keep
   the global batch), JPEG decoding on the GPU (``torchvision.io.decode_jpeg`` on the device, against the
   host's pixels), and every package the install route pins: requirements.txt and requirements-cuda.txt (or
   requirements-cuda12.txt for a torch built for CUDA 12), or, where today's transformers is installed,
   requirements-cuda-current.txt. Where the Hub answers, the published command's Hub names
   (``tools/hub_check.py``: the data set revision and the model); offline, "not checked".
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

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

from packaging.requirements import Requirement

from bridgetower_bench import published
from bridgetower_bench.guards import gpu_memory
from bridgetower_bench.tools import hub_check, self_check, tool_paths
from bridgetower_bench.tools.self_check import FAILED, OK, REPO, WARNING, Ran, Row, Step


CUDA_SCRIPT = REPO / "run_bridgetower_cuda.py"


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
    answer = self_check.ask_child("bridgetower_bench.tools.nvidia_check:gpus_here", "GPU")
    return answer if isinstance(answer, str) else Gpus(**answer)


def gpus_here() -> dict | str:
    """What ``probe_gpus`` reports, found in this process."""
    try:
        import torch
    except Exception as error:
        return f"torch cannot be imported: {type(error).__name__}: {error}"
    from bridgetower_bench.guards.cuda_device import ask_driver, why_no_cuda

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


CURRENT_ROUTE = "requirements-cuda-current.txt"  # today's Hugging Face line: one file, the whole stack


def route_files(cuda: str, installed: Callable[[str], str] = metadata.version) -> tuple[str, ...]:
    """The requirement files of the install route this environment comes from: the current route's when the
    installed transformers is the one it pins, else requirements.txt and the file of a torch built for CUDA
    `cuda` (requirements-cuda.txt, or requirements-cuda12.txt for CUDA 12)."""
    from bridgetower_bench.guards.cuda_device import CUDA12_REQUIREMENTS

    pinned = [line for line in self_check.pinned_requirements((CURRENT_ROUTE,)) if line.startswith("transformers")]
    try:
        if pinned and Requirement(pinned[0]).specifier.contains(installed("transformers"), prereleases=True):
            return (CURRENT_ROUTE,)
    except metadata.PackageNotFoundError:
        pass
    return ("requirements.txt", CUDA12_REQUIREMENTS if cuda.split(".")[0] == "12" else "requirements-cuda.txt")


def driver_row(gpus: Gpus) -> Row:
    from bridgetower_bench.guards.cuda_device import driver_needs, driver_too_old

    needs = driver_needs(gpus.torch, gpus.cuda)
    if not gpus.driver:
        return Row("NVIDIA driver", WARNING, f"version unknown (no NVML bindings answered, nor nvidia-smi); {needs}")
    if driver_too_old(gpus.driver, gpus.cuda):
        return Row("NVIDIA driver", FAILED, f"{gpus.driver}, too old: {needs}")
    return Row("NVIDIA driver", OK, f"{gpus.driver} (from {gpus.driver_source}); {needs}")


def gpus_row(gpus: Gpus) -> Row:
    kinds: dict[tuple[str, float, str], int] = {}  # (name, GiB, capability) -> how many
    for name, memory, capability in zip(gpus.names, gpus.memory_gib, gpus.capabilities or [""] * gpus.count):
        kinds.setdefault((name, memory, capability), 0)
        kinds[(name, memory, capability)] += 1
    detail = ", ".join(
        f"{n} x {name} ({memory:.1f} GiB{', compute capability ' + cap if cap else ''})"
        for (name, memory, cap), n in kinds.items()
    )
    return Row("GPUs", OK, detail)


def published_need() -> gpu_memory.MemoryNeed:
    """The published run's memory need (its shape is the one measured: never unknown)."""
    need = gpu_memory.memory_need(**gpu_memory.PUBLISHED_RUN)
    if need is None:
        raise RuntimeError("no measured memory peak of the published run's shape (guards/gpu_memory.MEASURED_PEAKS)")
    return need


def memory_row(gpus: Gpus) -> Row:
    """Does the published per-device batch fit the smallest visible GPU (known need, estimated)?"""
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


def stack_rows(gpus: Gpus, installed: Optional[Callable[[str], str]] = None) -> list[Row]:
    files = route_files(gpus.cuda, **({} if installed is None else {"installed": installed}))
    route = files[-1]
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
        self_check.requirement_row(line, install=route, **extra) for line in self_check.pinned_requirements(files)
    ]
    return rows


# ----------------------------------------------------------------------------------------
# 2. Training steps
# ----------------------------------------------------------------------------------------


def plan_steps(fixtures: dict, output_dir: Path, args, gpus: Gpus) -> list[Step]:
    def step(name, expected_loader, flags, launcher=(), needs=1):
        command = [*(launcher or [sys.executable]), str(CUDA_SCRIPT), *flags]
        return Step(name, command, output_dir / name / "run", output_dir / name / "log.txt", expected_loader, needs)

    def tiny(name):
        warmup = 1 if args.max_steps > 1 else 0
        return [*self_check.script_flags(fixtures, output_dir / name / "run", args.max_steps, warmup=warmup), "--bf16"]

    from bridgetower_bench.tools.fixtures import build_fixture

    large_model = (
        args.large_model.resolve()
        if args.large_model
        else build_fixture(output_dir / "fixtures", "model", seed=0, image_size=294, large=True)
    )
    large = self_check.script_flags(
        {**fixtures, "model": large_model},
        output_dir / "large-1step" / "run",
        1,
        batch=published.BATCH,
        rows=2 * published.BATCH,
        evaluate=False,
        warmup=0,
    ) + ["--bf16"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus.count)]
    return [
        step("1gpu-pytorch-loader", "torch", tiny("1gpu-pytorch-loader")),
        step(
            "1gpu-device-decode",
            "device_decode",
            tiny("1gpu-device-decode") + ["--image_pipeline", "fast", "--device_decode"],
        ),
        step(
            f"{gpus.count}gpu-torchrun",
            "torch",
            tiny(f"{gpus.count}gpu-torchrun"),
            launcher=torchrun,
            needs=gpus.count,
        ),
        step("large-1step", "torch", large),
    ]


def judge_step(step: Step, ran: Ran, seconds: float, output_dir: Path) -> Row:
    """The shared verdict; the Large step also shows its peak memory, and a batch that does not fit is a warning."""
    row = self_check.judge(step, ran, seconds, output_dir)
    if step.name != "large-1step":
        return row
    if ran.returncode == 2 and "does not fit" in self_check.last_error_line(step.log):
        row.result, row.detail = WARNING, self_check.last_error_line(step.log).split("error: ", 1)[-1]
        return row
    if row.result == OK:
        results = json.loads((step.run_dir / "train_results.json").read_text())
        peak = results.get("peak_gpu_memory_gb")
        row.detail = (
            f"peak {peak} GiB of tensors at per-device batch {published.BATCH}" if peak is not None else ""
        ) + (f"; {ran.note}" if ran.note else "")
    return row


# ----------------------------------------------------------------------------------------
# The memory plan without a GPU, and the command line
# ----------------------------------------------------------------------------------------


def memory_plan(sizes_gib: list[float]) -> str:
    """For GPUs of these sizes: does the published per-device batch fit, else which batch x accumulation does."""
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


def parse_args(argv=None):
    parser = self_check.argument_parser(
        "nvidia_check", __doc__, "Optimizer steps per run on the tiny fixtures.", timeout=900
    )
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
    if args.memory and min(args.memory) <= 0:
        parser.error("--memory: sizes must be positive")
    return self_check.check_arguments(parser, args, writes=not args.memory)  # (--memory writes nothing)


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
    backend = self_check.Backend(
        tool="nvidia_check",
        devices="GPUs",
        absent="no usable NVIDIA GPU",
        probe=probe,
        stack_rows=lambda gpus: stack_rows(gpus, installed),
        plan_steps=plan_steps,
        record_facts=lambda gpus: {"environment": None, "gpus": asdict(gpus)},
        judge_step=judge_step,
        hub_rows=hub_check.rows,
    )
    return self_check.run_check(backend, args, argv, runner)


if __name__ == "__main__":
    tool_paths.run(main)

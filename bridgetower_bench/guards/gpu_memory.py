"""Does the per-device batch fit the GPU? Known for the published shape only, estimated from its measured peak
(docs/RESULTS.md, "Memory of the published recipe"); other shapes and settings are left to their first step."""

from __future__ import annotations

import re
from collections import namedtuple
from dataclasses import dataclass
from typing import Optional

from bridgetower_bench import published
from bridgetower_bench.user_errors import UserInputError


GIB = 2**30
FIXED_BYTES_TRAINED = 16  # fp32 weight + gradient + AdamW's exp_avg and exp_avg_sq
FIXED_BYTES_FROZEN = 4  # fp32 weight
ALLOCATOR_RESERVE = 0.10  # estimate: memory the caching allocator holds beyond the tensors
CUDA_CONTEXT_GIB = 1.0  # estimate: the CUDA context and libraries, outside torch's allocator


MeasuredPeak = namedtuple("MeasuredPeak", "batch peak_gib where")
# Measured peaks of the published shape, by (attention implementation, layers compiled).
MEASURED_PEAKS = {
    ("eager", False): MeasuredPeak(48, 64.47, "measured on one H200"),
    ("eager", True): MeasuredPeak(48, 54.7, "measured on one H200 with --compile_layers inductor"),
}
# The published run as `memory_need` takes it: bf16, eager attention, nothing compiled, every parameter trained.
PUBLISHED_RUN = dict(
    shape=published.SHAPE,
    sequence_length=published.SEQUENCE,
    bf16=True,
    attention="eager",
    compiled=False,
    gradient_checkpointing=False,
    parameters=published.TRAINED_PARAMETERS,
    trained=published.TRAINED_PARAMETERS,
)


class BatchDoesNotFit(UserInputError):
    """The per-device batch cannot fit the GPU. The message says what would."""


@dataclass(frozen=True)
class MemoryNeed:
    """Peak tensor memory of one device as fixed + per-sample parts (GiB), from a measured peak."""

    fixed_gib: float
    per_sample_gib: float
    measured: MeasuredPeak

    def tensors_gib(self, batch: int) -> float:
        return self.fixed_gib + self.per_sample_gib * batch

    def device_gib(self, batch: int) -> float:
        """What the device must hold: the tensors, the allocator's reserve and the CUDA context."""
        return self.tensors_gib(batch) * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT_GIB

    def fits(self, batch: int, device_total_gib: float) -> bool:
        return self.device_gib(batch) <= device_total_gib


def memory_need(
    *, shape, sequence_length, bf16, attention, compiled, gradient_checkpointing, parameters, trained
) -> Optional[MemoryNeed]:
    """The need of a run (PUBLISHED_RUN's keys) of the published shape, from its measured peak; else None."""
    measured = MEASURED_PEAKS.get((attention, bool(compiled)))
    facts = (tuple(shape), sequence_length, bool(bf16), bool(gradient_checkpointing))
    if measured is None or facts != (published.SHAPE, published.SEQUENCE, True, False):
        return None
    # the rest of the peak (activations, bf16 copies, workspaces) counts per sample: overstates smaller batches
    per_sample = (measured.peak_gib - FIXED_BYTES_TRAINED * published.TRAINED_PARAMETERS / GIB) / measured.batch
    fixed = (FIXED_BYTES_TRAINED * trained + FIXED_BYTES_FROZEN * (parameters - trained)) / GIB
    return MemoryNeed(fixed, per_sample, measured)


def same_global_batch(batch: int, accumulation: int, fits) -> Optional[tuple[int, int]]:
    """The largest smaller per-device batch that `fits`, with the accumulation that keeps batch x accumulation."""
    samples = batch * accumulation
    for smaller in range(batch - 1, 0, -1):
        if samples % smaller == 0 and fits(smaller):
            return smaller, samples // smaller
    return None


def does_not_fit_message(
    batch, accumulation, world_size, device_name, device_total_gib, need, reached_gib=None
) -> str:
    """The one line: the batch asked, the device (GiB), the need (or None: the GiB reached when the first step ran
    out of memory), and what keeps the global batch."""
    asked = f"--per_device_train_batch_size {batch}" + (
        f" with --gradient_accumulation_steps {accumulation}" if accumulation > 1 else ""
    )
    line = f"{asked} does not fit on {device_name} ({device_total_gib:.1f} GiB): "
    if need is not None:
        line += (
            f"BridgeTower Large (294 px, 128 tokens, bf16) needs about {need.device_gib(batch):.1f} GiB per device at batch "
            f"{batch} (estimated from {need.measured.peak_gib:.1f} GiB of tensors at batch {need.measured.batch}, "
            f"{need.measured.where}, plus the allocator's reserve and the CUDA context)"
        )
        smaller = same_global_batch(batch, accumulation, lambda b: need.fits(b, device_total_gib))
    else:
        line += "the first step ran out of memory" + (f" after reaching {reached_gib:.1f} GiB" if reached_gib else "")
        smaller = same_global_batch(batch, accumulation, lambda b: b <= batch // 2)
    global_batch = batch * accumulation * world_size
    if smaller is None:
        return line + "; not even a per-device batch of 1 fits: use a GPU with more memory"
    b, a = smaller
    estimate = f", about {need.device_gib(b):.1f} GiB" if need is not None else ", half the batch: a first guess"
    return (
        line + f"; --per_device_train_batch_size {b} --gradient_accumulation_steps {a} keeps the global batch of "
        f"{global_batch}{estimate} (each step's contrastive loss then sees {b} pairs, not {batch})"
    )


def on_gpu(args) -> bool:
    return args.device.type == "cuda"


def device_memory(device) -> tuple[str, float]:
    """The GPU's name and total memory (GiB)."""
    import torch

    properties = torch.cuda.get_device_properties(device)
    return properties.name, properties.total_memory / GIB


def check_batch_fits(model, sequence_length: int, args, memory=None) -> Optional[MemoryNeed]:
    """Step 1 on a GPU: raise BatchDoesNotFit when the known need exceeds the device; return the need (or None)."""
    c, t, v = model.config, model.config.text_config, model.config.vision_config
    shape = (c.hidden_size, t.num_hidden_layers, v.num_hidden_layers, c.num_hidden_layers, v.image_size, v.patch_size)
    need = memory_need(
        shape=shape,
        sequence_length=sequence_length,
        bf16=bool(args.bf16),
        attention=getattr(args, "attn_implementation", "eager") or "eager",
        compiled=bool(getattr(args, "compile_layers", None)),
        gradient_checkpointing=bool(args.gradient_checkpointing),
        parameters=sum(p.numel() for p in model.parameters()),
        trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
    )
    if need is None:
        return None
    name, total = (memory or device_memory)(args.device)
    if not need.fits(args.per_device_train_batch_size, total):
        raise _does_not_fit(args, name, total, need)
    return need


def _does_not_fit(args, device_name: str, device_total_gib: float, need, reached_gib=None) -> BatchDoesNotFit:
    batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return BatchDoesNotFit(
        does_not_fit_message(batch, accumulation, args.world_size, device_name, device_total_gib, need, reached_gib)
    )


def out_of_memory_at_first_step(error: BaseException, args, need: Optional[MemoryNeed]) -> BatchDoesNotFit:
    """The one-line error for an out-of-memory error raised before the first optimizer step ended."""
    return _does_not_fit(args, *device_memory(args.device), need, _reached_gib(error, args.device))


def _reached_gib(error: BaseException, device) -> Optional[float]:
    """Tensor memory when it ran out: the peak so far plus the allocation that failed (from torch's message)."""
    try:
        import torch

        peak = torch.cuda.max_memory_allocated(device) / GIB
    except Exception:
        return None
    tried = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB)", str(error))
    if tried:
        peak += float(tried.group(1)) / (1 if tried.group(2) == "GiB" else 1024)
    return peak

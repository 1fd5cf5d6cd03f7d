"""Does the per-device batch fit the GPU? Checked at step 1, before the first forward pass, and again if
the first step runs out of memory: either way the run ends in one line (exit status 2), nothing published,
naming the batch asked, the device's memory, the need, and the per-device batch and gradient accumulation
that keep the experiment's global batch.

The need is known for the published model only: BridgeTower Large (hidden size 1024, 24 text and 24 vision
layers, 6 cross-modal ones), 294-px images in 14-px patches, captions of 128 tokens, bf16 autocast, every
parameter trained, no gradient checkpointing. For that shape:

- measured: a peak of 64.47 GiB of tensors (torch.cuda.max_memory_allocated) at per-device batch 48, on one
  H200, eager attention (and 54.7 GiB with each repeated layer compiled, `--compile_layers inductor`), both
  with fused AdamW, the Trainer's choice then (the CUDA script now takes `adamw_torch`, not yet measured);
- estimated, fixed part: 16 bytes per parameter (fp32 weights, gradients and AdamW's two moments): 12.9 GiB
  for the 865.6 M parameters trained; a frozen parameter counts 4 bytes (its weights only);
- estimated, per sample: the rest of the measured peak over the 48 samples, 1.07 GiB. Activations grow in
  proportion to the batch; whatever else the peak holds (bf16 copies of the weights, workspaces) is counted
  per sample too, which overstates the need of smaller batches slightly (the suggestion errs on the safe side);
- estimated, beyond the tensors: 10 % for the caching allocator's reserve and 1 GiB for the CUDA context.

Other shapes or settings (another model, sequence length or image size, fp32, sdpa attention, gradient
checkpointing) have no figure here: their first step decides, and running out of memory there gives the
same one line, with the peak reached before it ran out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from bridgetower_bench import published
from bridgetower_bench.user_errors import UserInputError


GIB = 2**30
FIXED_BYTES_TRAINED = 16  # fp32 weight + gradient + AdamW's exp_avg and exp_avg_sq
FIXED_BYTES_FROZEN = 4  # fp32 weight
ALLOCATOR_RESERVE = 0.10  # estimate: memory the caching allocator holds beyond the tensors
CUDA_CONTEXT_GIB = 1.0  # estimate: the CUDA context and libraries, outside torch's allocator


@dataclass(frozen=True)
class MeasuredPeak:
    batch: int
    peak_gib: float
    where: str


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


def fixed_gib(parameters: int, trained: int) -> float:
    return (FIXED_BYTES_TRAINED * trained + FIXED_BYTES_FROZEN * (parameters - trained)) / GIB


def memory_need(
    *,
    shape: tuple,
    sequence_length: int,
    bf16: bool,
    attention: str,
    compiled: bool,
    gradient_checkpointing: bool,
    parameters: int,
    trained: int,
) -> Optional[MemoryNeed]:
    """The need of a run of the published shape, from its measured peak; None when no figure applies."""
    measured = MEASURED_PEAKS.get((attention, bool(compiled)))
    if (
        measured is None
        or tuple(shape) != published.SHAPE
        or sequence_length != published.SEQUENCE
        or not bf16
        or gradient_checkpointing
    ):
        return None
    published_fixed = fixed_gib(published.TRAINED_PARAMETERS, published.TRAINED_PARAMETERS)
    per_sample = (measured.peak_gib - published_fixed) / measured.batch
    return MemoryNeed(fixed_gib(parameters, trained), per_sample, measured)


def same_global_batch(batch: int, accumulation: int, fits) -> Optional[tuple[int, int]]:
    """The largest smaller per-device batch that `fits`, with the accumulation that keeps batch x accumulation."""
    samples = batch * accumulation
    for smaller in range(batch - 1, 0, -1):
        if samples % smaller == 0 and fits(smaller):
            return smaller, samples // smaller
    return None


def does_not_fit_message(
    *,
    batch: int,
    accumulation: int,
    world_size: int,
    device_name: str,
    device_total_gib: float,
    need: Optional[MemoryNeed],
    reached_gib: Optional[float] = None,
) -> str:
    """The one line: what was asked, the device, the need, and what keeps the global batch."""
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
    """Does this run train on an NVIDIA GPU (the only device whose memory is checked here)?"""
    return args.device.type == "cuda"


def device_memory(device) -> tuple[str, float]:
    """The GPU's name and total memory in GiB."""
    import torch

    properties = torch.cuda.get_device_properties(device)
    return properties.name, properties.total_memory / GIB


def run_need(model, sequence_length: int, args) -> Optional[MemoryNeed]:
    """The need of this run (model, the batch's sequence length, the training arguments), or None."""
    config = model.config
    shape = (
        config.hidden_size,
        config.text_config.num_hidden_layers,
        config.vision_config.num_hidden_layers,
        config.num_hidden_layers,
        config.vision_config.image_size,
        config.vision_config.patch_size,
    )
    parameters = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return memory_need(
        shape=shape,
        sequence_length=sequence_length,
        bf16=bool(args.bf16),
        attention=getattr(args, "attn_implementation", "eager") or "eager",
        compiled=bool(getattr(args, "compile_layers", None)),
        gradient_checkpointing=bool(args.gradient_checkpointing),
        parameters=parameters,
        trained=trained,
    )


def check_batch_fits(model, sequence_length: int, args, memory=None) -> Optional[MemoryNeed]:
    """Step 1 on a GPU: raise BatchDoesNotFit when the known need exceeds the device; return the need (or None)."""
    need = run_need(model, sequence_length, args)
    if need is None:
        return None
    name, total = (memory or device_memory)(args.device)
    if not need.fits(args.per_device_train_batch_size, total):
        raise _does_not_fit(args, name, total, need)
    return need


def _does_not_fit(args, device_name: str, device_total_gib: float, need, reached_gib=None) -> BatchDoesNotFit:
    """The run's batch, accumulation and processes, on this device, as the one-line error."""
    return BatchDoesNotFit(
        does_not_fit_message(
            batch=args.per_device_train_batch_size,
            accumulation=args.gradient_accumulation_steps,
            world_size=args.world_size,
            device_name=device_name,
            device_total_gib=device_total_gib,
            need=need,
            reached_gib=reached_gib,
        )
    )


def out_of_memory_at_first_step(
    error: BaseException, args, need: Optional[MemoryNeed], memory=None, reached: Optional[float] = None
) -> BatchDoesNotFit:
    """The one-line error for an out-of-memory error raised before the first optimizer step ended."""
    name, total = (memory or device_memory)(args.device)
    if reached is None:
        reached = _reached_gib(error, args.device)
    return _does_not_fit(args, name, total, need, reached)


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

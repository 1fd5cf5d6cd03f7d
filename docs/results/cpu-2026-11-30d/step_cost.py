"""What one BridgeTower Large training step at batch 48 should cost, counted on a CPU (no GPU needed).

1. Matrix products: FLOPs of forward + backward (torch.utils.flop_counter, on the meta device).
2. Everything else: bytes read and written by every other operator (casts, adds, muls, copies, layer
   norms, softmax, dropout ...), counted under CPU bf16 autocast at batch 2 and 4 and extrapolated to 48.
3. The host's share: operators per step and the time this CPU takes to issue them, with tensors so small
   that running them costs next to nothing (hidden size 64, Large's 24 + 24 + 6 layers, 1 thread).
   It leaves out the optimizer, the gradient clipping and the Trainer's own work.

    python docs/results/cpu-2026-11-30d/step_cost.py      (2-3 minutes here, 15 GB of memory at its peak)
"""

import collections
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerForContrastiveLearning


sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bridgetower_bench.tools.fixtures import bridgetower_config  # noqa: E402


BATCH, TOKENS, IMAGE = 48, 128, 294
MATRIX_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward"}
NO_TRAFFIC = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "as_strided",
    "detach",
    "alias",
    "split",
    "split_with_sizes",
    "unbind",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "_local_scalar_dense",
    "lift_fresh",
}


class OperatorTally(TorchDispatchMode):
    """Per operator: how often it ran and the bytes of its tensor inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls[name] += 1
        if name not in NO_TRAFFIC:
            tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, torch.Tensor)]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def model_and_batch(config, batch, device="cpu", tokens=TOKENS):
    with torch.device(device):
        model = BridgeTowerForContrastiveLearning(config).train()
        model.bridgetower.text_model.pooler = None  # as the scripts do
        size = config.vision_config.image_size
        inputs = dict(
            pixel_values=torch.randn(batch, 3, size, size),
            return_loss=True,
            input_ids=torch.randint(5, config.text_config.vocab_size, (batch, tokens)),
            attention_mask=torch.ones(batch, tokens, dtype=torch.long),
        )
    return model, inputs


def train_step(model, inputs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def main():
    torch.manual_seed(0)
    large = bridgetower_config(large=True, vocab_size=8192)

    model, inputs = model_and_batch(large, BATCH, device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        model(**inputs).loss.backward()
    tflop = counter.get_total_flops() / 1e12
    print(
        f"1. matrix products: {tflop:.1f} TFLOP per step ({tflop / BATCH:.2f} per sample), "
        f"{tflop / 790 * 1000:.0f} ms at 790 TFLOP/s"
    )

    model, _ = model_and_batch(large, 1)
    tallies = {}
    for batch in (2, 4):
        _, inputs = model_and_batch(large, batch)
        train_step(model, inputs)
        with OperatorTally() as tallies[batch]:
            train_step(model, inputs)
    small, big = tallies[2], tallies[4]
    at_batch = {
        name: small.bytes[name] + (big.bytes[name] - small.bytes[name]) / 2 * (BATCH - 2)
        for name in big.bytes
        if name not in MATRIX_OPS
    }
    total = sum(at_batch.values())
    print(
        f"2. other operators: {total / 1e9:.0f} GB read + written per step at batch {BATCH}, "
        f"{total / 4.0e12 * 1000:.0f} ms at 4 TB/s; the largest:"
    )
    for name, value in sorted(at_batch.items(), key=lambda item: -item[1])[:10]:
        print(f"     {name:28s} {value / 1e9:6.1f} GB  ({big.calls[name]} calls)")

    torch.set_num_threads(1)
    tiny = bridgetower_config(large=True, vocab_size=8192)
    for sub in (tiny, tiny.text_config, tiny.vision_config):
        sub.hidden_size = 64
    tiny.num_attention_heads = tiny.text_config.num_attention_heads = 1
    tiny.text_config.intermediate_size = 128
    tiny.vision_config.image_size = 28
    model, inputs = model_and_batch(tiny, 2, tokens=8)
    for _ in range(3):
        train_step(model, inputs)
    started, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        train_step(model, inputs)
    host_ms = (time.perf_counter() - started) / repeats * 1000
    with OperatorTally() as tally:
        train_step(model, inputs)
    operators = sum(count for name, count in tally.calls.items() if name not in NO_TRAFFIC)
    print(
        f"3. host: {operators} operators per forward + backward (views left out); this CPU issues them "
        f"in {host_ms:.0f} ms (1 thread, hidden size 64, 2 x 8 tokens, 2 x 4 patches)"
    )


if __name__ == "__main__":
    main()

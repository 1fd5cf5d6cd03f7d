"""The data-free ceiling with every repeated layer of BridgeTower compiled in place (torch.compile).

A one-off measurement beside scripts/h200_benchmark.sh, not a training option of the scripts. It takes
exactly the arguments of ``python -m bridgetower_bench.gpu_ceiling`` and compiles, before training, each
module of every ``ModuleList`` whose members share one class (the vision blocks, the text layers, the
cross-modal layers and the link towers) with ``Module.compile()``: in place, so parameter names, saving
and accelerate's bf16 autocast wrapper are untouched, and each layer class is compiled once and reused.
(accelerate 1.10.1's own regional compilation does not take effect on a bf16 model; see the header of
scripts/h200_benchmark.sh.) The first steps compile: keep ``--throughput_warmup_steps`` at 5 or more.

    python scripts/compiled_ceiling_check.py --model_name_or_path DIR --output_dir OUT --bf16 \\
        --per_device_train_batch_size 48 --max_steps 15 --throughput_warmup_steps 5 --report_to none
"""

import torch

from bridgetower_bench import gpu_ceiling

_load_model = gpu_ceiling.BridgeTowerForContrastiveLearning.from_pretrained


def load_with_compiled_layers(*args, **kwargs):
    model = _load_model(*args, **kwargs)
    compiled = 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            for layer in module:
                layer.compile()
                compiled += 1
    print(f"compiled in place: {compiled} layers", flush=True)
    return model


if __name__ == "__main__":
    gpu_ceiling.BridgeTowerForContrastiveLearning.from_pretrained = load_with_compiled_layers
    gpu_ceiling.main()

"""Compile BridgeTower's repeated layers in place with torch.compile (the CUDA script's --compile_layers).

BridgeTower is stacks of identical layers: 24 vision blocks, 24 text layers, 2 x 6 cross-modal layers
and their link towers. ``compile_repeated_layers`` calls ``Module.compile`` on every member of every
``ModuleList`` whose members share one class, so each layer class is traced once and its compiled code
reused by its siblings (about 40 s for BridgeTower Large on an H200, where a whole-model compile had not
finished after 170 s), and the model stays the same object: parameter names, checkpoints and
accelerate's bf16 autocast wrapper are untouched. What it buys is fusion of the element-wise work
between the matrix products (layer norms, QuickGELU, dropout, the eager attention's mask and softmax).

Why not the Trainer's own ``--torch_compile``: it compiles the whole model (slow to compile, and a graph
break anywhere costs the rest), and accelerate 1.10.1's regional variant
(``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1``) leaves a bf16 model uncompiled, because the autocast
wrapper it installs first stays bound to the uncompiled model.
"""

from __future__ import annotations

import logging

import torch

from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)


def repeated_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The members of every ModuleList of two or more blocks of one class, in model order.

    Blocks: modules made of modules (a lone LayerNorm or Linear has nothing to fuse).
    """
    layers = []
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) > 1
            and len({type(m) for m in module}) == 1
            and next(module[0].children(), None) is not None
        ):
            layers.extend(module)
    return layers


def compile_repeated_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile each repeated layer of ``model`` in place with ``backend``; returns how many were compiled."""
    if backend not in torch.compiler.list_backends(exclude_tags=()):
        known = ", ".join(torch.compiler.list_backends())
        raise UserInputError(f"--compile_layers {backend!r}: not a torch.compile backend here (known: {known})")
    layers = repeated_layers(model)
    for layer in layers:
        layer.compile(backend=backend)
    logger.info(
        "--compile_layers %s: %d repeated layers compiled in place (on their first call)", backend, len(layers)
    )
    return len(layers)

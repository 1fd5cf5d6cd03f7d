"""``--compile_layers``: BridgeTower's repeated layers compiled in place, fusing the element-wise work between matmuls.

``Module.compile`` traces each layer class once, its code reused by its siblings; the model stays the same object
(parameter names, checkpoints, accelerate's bf16 autocast wrapper kept). Why not ``--torch_compile``: docs/RESULTS.md.
"""

from __future__ import annotations

import logging

import torch

from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)


def repeated_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The members of every ModuleList of two or more blocks (modules of modules) of one class, in model order."""
    layers: list[torch.nn.Module] = []
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

"""BridgeTower's text and cross-modal attention through torch's fused ``scaled_dot_product_attention``.

transformers gives this BERT-style attention (48 of the Large model's 72 attention blocks; the vision tower's
24 already run through SDPA) only an eager implementation: score matrix, mask, softmax, dropout and weighted sum
as separate operations, the scores written out in float32 under bf16 autocast, forwards and backwards. 4.55 runs
the cross-modal layers' cross-attention through `BridgeTowerSelfAttention` too; 5.x gives it a class of its own,
`BridgeTowerCrossAttention` (and refuses `attn_implementation="sdpa"` for BridgeTower). Only the kernel changes
(and with it the dropout's draws and the rounding); the config still says "eager", so a saved checkpoint loads
anywhere.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers.models.bridgetower import modeling_bridgetower
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerSelfAttention

from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


def _fused(module, hidden_states, source, attention_mask):
    """The eager attention's function in one call: `source` gives the keys and values (the hidden states
    themselves, or the other modality's for cross-attention)."""
    batch_size, length, _ = hidden_states.shape

    def split_heads(x):
        return x.view(batch_size, -1, module.num_attention_heads, module.attention_head_size).transpose(1, 2)

    query = split_heads(module.query(hidden_states))
    key, value = split_heads(module.key(source)), split_heads(module.value(source))
    if attention_mask is not None:  # additive, 0 or float32's minimum (-inf once in bf16): weight 0 either way
        attention_mask = attention_mask.to(query.dtype)
    context = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=module.dropout.p if module.training else 0.0
    )
    return context.transpose(1, 2).reshape(batch_size, length, module.all_head_size), None


def _asks_for_more(module, options: dict) -> bool:
    """Attention weights, a head mask, a cache or relative positions asked for: only eager gives them."""
    asked = any(value is not None and value is not False for name, value in options.items())
    return asked or getattr(module, "position_embedding_type", "absolute") != "absolute"


class SdpaBridgeTowerSelfAttention(BridgeTowerSelfAttention):
    """Fused in the common case, else transformers' own forward. The keywords are each line's (4.55: head_mask,
    encoder_hidden_states, past_key_value, output_attentions, cache_position; 5.x: cache and attention kwargs). 5.x
    asks for attention weights through hooks, unseen here: they come back None, as under its own SDPA."""

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        options = {
            name: value for name, value in kwargs.items() if name not in ("encoder_hidden_states", "cache_position")
        }
        if args or _asks_for_more(self, options):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        source = kwargs.get("encoder_hidden_states")
        return _fused(self, hidden_states, hidden_states if source is None else source, attention_mask)


SDPA_CLASSES = {BridgeTowerSelfAttention: SdpaBridgeTowerSelfAttention}

if hasattr(modeling_bridgetower, "BridgeTowerCrossAttention"):  # transformers 5.x
    # (the class exists from transformers 5.0 on: not on the pinned route that the type checker reads)
    class SdpaBridgeTowerCrossAttention(modeling_bridgetower.BridgeTowerCrossAttention):  # type: ignore[name-defined]
        """5.x's cross-attention: fused in the common case, else transformers' own forward."""

        def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
            if args or _asks_for_more(self, kwargs):
                return super().forward(hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
            return _fused(self, hidden_states, encoder_hidden_states, attention_mask)

    SDPA_CLASSES[modeling_bridgetower.BridgeTowerCrossAttention] = SdpaBridgeTowerCrossAttention


def use_attention(model: torch.nn.Module, implementation: str) -> int:
    """Run every text and cross-modal attention module in ``model`` with "eager" (transformers' own, upstream's) or
    "sdpa" (the same weights, additive mask, dropout probability and scale); returns how many changed. Parameters
    are never touched."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise UserInputError(
            f"--attn_implementation {implementation!r}: choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )
    changed = 0
    for module in model.modules():
        for eager, sdpa in SDPA_CLASSES.items():
            target = sdpa if implementation == "sdpa" else eager
            if isinstance(module, eager) and type(module) is not target:
                module.__class__ = target
                changed += 1
    if changed:
        logger.info("--attn_implementation %s: %d text and cross-modal attention modules", implementation, changed)
    return changed

"""BridgeTower's text and cross-modal attention through torch's fused ``scaled_dot_product_attention``.

transformers 4.55 gives this BERT-style attention (48 of the Large model's 72 attention blocks; the vision tower's
24 already run through SDPA) only an eager implementation: score matrix, mask, softmax, dropout and weighted sum
as separate operations, the scores written out in float32 under bf16 autocast, forwards and backwards. Only the
kernel changes (and with it the dropout's draws and the rounding); the config still says "eager", so a saved
checkpoint loads anywhere.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerSelfAttention

from bridgetower_bench.user_errors import UserInputError


logger = logging.getLogger(__name__)

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


class SdpaBridgeTowerSelfAttention(BridgeTowerSelfAttention):
    """Fused in the common case; attention weights asked for, head masks, relative positions or a cache run eager."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        head_mask=None,
        encoder_hidden_states=None,
        past_key_value=None,
        output_attentions=False,
        cache_position=None,
    ):
        if (
            output_attentions
            or head_mask is not None
            or past_key_value is not None
            or self.position_embedding_type != "absolute"
        ):
            return super().forward(
                hidden_states,
                attention_mask,
                head_mask,
                encoder_hidden_states,
                past_key_value,
                output_attentions,
                cache_position,
            )
        batch_size, length, _ = hidden_states.shape
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states

        def split_heads(x):
            return x.view(batch_size, -1, self.num_attention_heads, self.attention_head_size).transpose(1, 2)

        query = split_heads(self.query(hidden_states))
        key = split_heads(self.key(source))
        value = split_heads(self.value(source))
        if attention_mask is not None:  # additive, 0 or float32's minimum (-inf once in bf16): weight 0 either way
            attention_mask = attention_mask.to(query.dtype)
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=self.dropout.p if self.training else 0.0
        )
        return context.transpose(1, 2).reshape(batch_size, length, self.all_head_size), None


def use_attention(model: torch.nn.Module, implementation: str) -> int:
    """Run every BridgeTowerSelfAttention in ``model`` with "eager" (transformers' own, upstream's) or "sdpa" (the same
    weights, additive mask, dropout probability and scale); returns how many changed. Parameters are never touched."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise UserInputError(
            f"--attn_implementation {implementation!r}: choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )
    target = SdpaBridgeTowerSelfAttention if implementation == "sdpa" else BridgeTowerSelfAttention
    changed = 0
    for module in model.modules():
        if isinstance(module, BridgeTowerSelfAttention) and type(module) is not target:
            module.__class__ = target
            changed += 1
    if changed:
        logger.info("--attn_implementation %s: %d text and cross-modal attention modules", implementation, changed)
    return changed

"""--attn_implementation sdpa: the same function as transformers' eager attention, in one fused call.

The tests parametrised by device also run on a GPU (`pytest tests/test_attention.py -k cuda`, which
scripts/h200_benchmark.sh does): there SDPA picks a fused CUDA kernel, here the CPU one."""

import pytest
import torch
from transformers.models.bridgetower.modeling_bridgetower import (
    BridgeTowerForContrastiveLearning,
    BridgeTowerSelfAttention,
)

from bridgetower_bench.modeling.attention import SdpaBridgeTowerSelfAttention, use_attention
from bridgetower_bench.tools import fixtures as fixture_builders
from helpers import BOTH_ROUTES, CPU_FLAGS, DEVICES, assert_throughput_adds_up, base_args, read_json, run_script


def tiny_model(dropout=0.0, device="cpu"):
    torch.manual_seed(0)
    config = fixture_builders.bridgetower_config(
        large=False, vocab_size=200, image_size=56, patch_size=14, layers=2, dropout=dropout
    )
    return BridgeTowerForContrastiveLearning(config).to(device)


def batch(size=4, length=12, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 200, (size, length), generator=generator)
    attention_mask = torch.ones(size, length, dtype=torch.long)
    attention_mask[1, 5:] = 0  # padded captions: their padding must be masked out in every attention
    attention_mask[2, 9:] = 0
    pixel_values = torch.randn(size, 3, 56, 56, generator=generator)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    output = model(**inputs, return_loss=True)
    output.loss.backward()
    return output, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@BOTH_ROUTES
@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_trains_exactly_like_eager_with_padded_captions(device):
    model, inputs = tiny_model(device=device), batch(device=device)
    model.train()
    eager, eager_grads = loss_and_grads(model, inputs)
    assert use_attention(model, "sdpa") == 10  # 2 text layers + 2 x 2 cross-modal layers x (self, cross)
    sdpa, sdpa_grads = loss_and_grads(model, inputs)
    assert torch.allclose(sdpa.loss, eager.loss, atol=1e-6)
    for key in ("text_embeds", "image_embeds", "cross_embeds"):
        assert torch.allclose(getattr(sdpa, key), getattr(eager, key), atol=1e-5), key
    assert sdpa_grads.keys() == eager_grads.keys()
    for name, grad in sdpa_grads.items():
        assert torch.allclose(grad, eager_grads[name], atol=1e-5, rtol=1e-4), name

    # Padding is masked: changing the padded tokens' ids changes nothing (it would, were the mask dropped).
    altered = dict(inputs, input_ids=inputs["input_ids"].clone())
    altered["input_ids"][1, 5:] = 7
    with torch.no_grad():
        again = model(**altered, return_loss=True)
    assert torch.allclose(again.text_embeds, sdpa.text_embeds, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_under_bf16_autocast_stays_close_to_eager_and_finite(device):
    model, inputs = tiny_model(device=device), batch(device=device)
    model.eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        eager = model(**inputs, return_loss=True)
        use_attention(model, "sdpa")
        sdpa = model(**inputs, return_loss=True)
    assert torch.isfinite(sdpa.cross_embeds).all() and torch.isfinite(sdpa.loss)
    assert (sdpa.cross_embeds.float() - eager.cross_embeds.float()).abs().max() < 0.05
    assert abs(sdpa.loss.item() - eager.loss.item()) < 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_attention_dropout_applies_in_training_and_not_in_evaluation(device):
    model, inputs = tiny_model(device=device), batch(device=device)
    for module in model.modules():  # dropout on the attention weights only, none elsewhere
        if isinstance(module, BridgeTowerSelfAttention):
            module.dropout.p = 0.3
    use_attention(model, "sdpa")
    model.train()
    with torch.no_grad():
        first, second = (model(**inputs).cross_embeds for _ in range(2))
    assert not torch.allclose(first, second), "attention dropout must be active while training"
    model.eval()
    with torch.no_grad():
        sdpa = model(**inputs).cross_embeds
        use_attention(model, "eager")
        eager = model(**inputs).cross_embeds
    assert torch.allclose(sdpa, eager, atol=1e-5)


def test_attention_weights_requested_fall_back_to_eager():
    model, inputs = tiny_model(), batch()
    model.eval()
    use_attention(model, "sdpa")
    with torch.no_grad():
        output = model(**inputs, output_attentions=True)
    weights = output.attentions
    assert weights is not None and len(weights) > 0
    text_layer_weights = weights[0][0]  # first text layer, (batch, heads, tokens, tokens)
    assert torch.allclose(text_layer_weights.sum(-1), torch.ones(()), atol=1e-5)
    assert text_layer_weights[1, :, :, 5:].abs().max() == 0  # the padded keys get no weight


@BOTH_ROUTES
def test_switching_touches_no_parameter_and_checkpoints_stay_eager(tmp_path):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    use_attention(model, "sdpa")
    assert all(
        type(m) is SdpaBridgeTowerSelfAttention for m in model.modules() if isinstance(m, BridgeTowerSelfAttention)
    )
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    model.save_pretrained(tmp_path)
    reloaded = BridgeTowerForContrastiveLearning.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation == "eager"
    assert use_attention(model, "eager") == 10 and use_attention(model, "eager") == 0
    with pytest.raises(ValueError, match="--attn_implementation 'flash'"):
        use_attention(model, "flash")


def test_gaudi_script_trains_with_sdpa_attention(fixtures, tmp_path):
    out = tmp_path / "run"
    args = base_args(fixtures, out, max_steps=2, save_steps=None, save_strategy="no")
    result = run_script("gaudi", [*args, "--do_train", "--attn_implementation", "sdpa", *CPU_FLAGS["gaudi"]])
    assert "--attn_implementation sdpa: 5 text and cross-modal attention modules" in result.stdout + result.stderr
    assert_throughput_adds_up(read_json(out / "train_results.json"), counted_steps=1, samples_per_step=4)

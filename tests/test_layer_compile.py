"""--compile_layers (CUDA script) and the ceiling's same option: every repeated layer compiled in place.

The tests compile with torch.compile's "eager" backend (Dynamo's tracing and guards, no code generation), which checks
the wiring in seconds; "inductor", the option users pass, generates kernels and takes minutes on these CPUs."""

import math

import pytest
import torch
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerForContrastiveLearning

from bridgetower_bench.modeling.layer_compile import compile_repeated_layers, repeated_layers
from bridgetower_bench.tools import fixtures as fixture_builders
from helpers import BOTH_ROUTES, assert_throughput_adds_up, base_args, read_json, run_script


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory):
    """The tiny model with two layers per stack (the default fixture has one: nothing would repeat)."""
    out = tmp_path_factory.mktemp("two_layer_model")
    fixture_builders.make_tiny_model(out, image_size=56, patch_size=14, layers=2, dropout=0.0)
    return out


def test_the_repeated_layers_are_the_towers_and_cross_modal_stacks_and_a_bad_backend_is_refused(two_layer_model):
    model = BridgeTowerForContrastiveLearning.from_pretrained(two_layer_model)
    kinds = sorted({type(layer).__name__ for layer in repeated_layers(model)})
    assert kinds == ["BridgeTowerBertCrossLayer", "BridgeTowerResidualAttention", "BridgeTowerTextLayer"]
    # 2 vision blocks + 2 text layers + 2 x 2 cross-modal layers (the single link tower repeats nothing)
    assert len(repeated_layers(model)) == 8
    with pytest.raises(ValueError, match="--compile_layers 'inductorr': not a torch.compile backend"):
        compile_repeated_layers(model, backend="inductorr")


def test_compiled_layers_train_like_the_plain_model_and_keep_their_names(two_layer_model):
    model = BridgeTowerForContrastiveLearning.from_pretrained(two_layer_model)
    model.train()
    generator = torch.Generator().manual_seed(3)
    ids, pixels = torch.randint(5, 100, (4, 10), generator=generator), torch.randn(4, 3, 56, 56, generator=generator)
    inputs = dict(
        input_ids=ids, attention_mask=torch.ones(4, 10, dtype=torch.long), pixel_values=pixels, return_loss=True
    )
    names = [name for name, _ in model.named_parameters()]

    plain = model(**inputs).loss
    plain.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    assert compile_repeated_layers(model, backend="eager") == 8
    compiled = model(**inputs).loss
    compiled.backward()
    assert all(layer._compiled_call_impl is not None for layer in repeated_layers(model))
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints keep their keys
    assert torch.allclose(compiled, plain, atol=1e-6)
    for name, grad in plain_grads.items():
        assert torch.allclose(model.get_parameter(name).grad, grad, atol=1e-6), name


@BOTH_ROUTES
def test_cuda_script_trains_with_sdpa_and_compiled_layers(fixtures, two_layer_model, tmp_path):
    out = tmp_path / "run"
    args = base_args(
        fixtures, out, model_name_or_path=two_layer_model, max_steps=2, save_steps=None, save_strategy="no"
    ) + ["--do_train", "--use_cpu", "--attn_implementation", "sdpa", "--compile_layers", "eager"]
    result = run_script("cuda", args)
    log = result.stdout + result.stderr
    assert "--attn_implementation sdpa: 10 text and cross-modal attention modules" in log
    assert "--compile_layers eager: 8 repeated layers compiled in place" in log
    train = read_json(out / "train_results.json")
    assert math.isfinite(train["train_loss"])
    assert_throughput_adds_up(train, counted_steps=1, samples_per_step=4)
    assert train["attn_implementation"] == "sdpa" and train["compile_layers"] == "eager"  # saved with the figures
    assert train["logging_nan_inf_filter"] is False  # GaudiTrainingArguments' default, which both scripts take

    both = run_script(
        "cuda", [str(tmp_path / "other") if a == str(out) else a for a in args] + ["--torch_compile"], check=False
    )
    assert both.returncode != 0
    assert "--compile_layers and --torch_compile both compile the model: pass one of them" in both.stderr


def test_the_ceiling_takes_the_same_speed_options(two_layer_model, tmp_path, caplog):
    from gpu_ceiling import main

    torch._dynamo.reset()
    argv = ["--model_name_or_path", str(two_layer_model), "--output_dir", str(tmp_path), "--use_cpu"]
    argv += "--per_device_train_batch_size 2 --max_steps 2 --throughput_warmup_steps 1 --max_seq_length 16".split()
    argv += "--report_to none --save_strategy no --attn_implementation sdpa --compile_layers eager".split()
    with caplog.at_level("INFO", logger="bridgetower_bench"):
        metrics = main([*argv, "--logging_nan_inf_filter", "False"])
    assert "--attn_implementation sdpa: 10 text and cross-modal attention modules" in caplog.text
    assert "--compile_layers eager: 8 repeated layers compiled in place" in caplog.text
    assert_throughput_adds_up(metrics, counted_steps=1, samples_per_step=2)
    assert metrics["logging_nan_inf_filter"] is False  # the H200 script's "nosync" part, saved with the figures

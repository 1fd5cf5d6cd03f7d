"""Same flags, same training: the CUDA/CPU script takes GaudiTrainingArguments' recipe defaults."""

import dataclasses

import pytest
from transformers import TrainingArguments

from bridgetower_bench.arguments import GAUDI_RECIPE_DEFAULTS, WarmupTrainingArguments
from helpers import CPU_FLAGS, base_args, load_weights, optimum_habana, read_json, run_script


# Differing defaults deliberately left to each device (see bridgetower_bench/trainer.py).
LEFT_TO_THE_DEVICE = {"half_precision_backend", "ddp_bucket_cap_mb", "ddp_find_unused_parameters"}


def defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def test_every_gaudi_default_that_differs_is_decided_and_the_recipe_ones_are_taken():
    with optimum_habana() as habana:
        gaudi = defaults(habana.GaudiTrainingArguments)
    base, ours = defaults(TrainingArguments), defaults(WarmupTrainingArguments)
    differing = sorted(name for name in base if name in gaudi and base[name] != gaudi[name])
    assert set(differing) == set(GAUDI_RECIPE_DEFAULTS) | LEFT_TO_THE_DEVICE, "a default changed upstream: decide it"
    for name in GAUDI_RECIPE_DEFAULTS:
        assert ours[name] == gaudi[name], name


@pytest.mark.parametrize(
    "recipe",
    [
        [],
        # GaudiTrainer sums the micro-batches' losses (optimum-habana divides only with lazy mode and
        # --pipelining_fwd_bwd); the CUDA script must train the same experiment. Without clipping, a loss
        # divided by the accumulation steps would move the weights by a third as much.
        ["--gradient_accumulation_steps", "3", "--max_grad_norm", "0"],
        ["--gradient_accumulation_steps", "2", "--num_train_epochs", "2", "--max_steps", "-1"],
    ],
    ids=["plain", "accumulation-3-no-clipping", "accumulation-2-two-epochs"],
)
def test_both_scripts_end_with_the_same_weights_from_the_same_flags(fixtures, tmp_path, recipe):
    weights, losses = {}, {}
    for kind in ("gaudi", "cuda"):
        out = tmp_path / kind
        # 14 rows in batches of 4: the epoch ends with a short batch unless drawn up to whole batches as on Gaudi
        run_script(
            kind,
            base_args(fixtures, out, max_steps=6, max_train_samples=14) + ["--do_train"] + recipe + CPU_FLAGS[kind],
        )
        weights[kind] = load_weights(out)
        losses[kind] = read_json(out / "train_results.json")["train_loss"]
    assert weights["gaudi"].keys() == weights["cuda"].keys()
    worst = max(
        (weights["gaudi"][k].float() - weights["cuda"][k].float()).abs().max().item() for k in weights["gaudi"]
    )
    # both run torch's AdamW on CPU: the same computation; a fused optimizer would differ by rounding only
    assert worst <= 1e-6, f"largest weight difference {worst}"
    assert losses["cuda"] == pytest.approx(losses["gaudi"], rel=1e-6)


def test_summed_accumulation_sums_the_micro_batches_where_trainer_averages_them(tmp_path):
    """SummedAccumulation on a bare Trainer: the gradient of an accumulated step is the sum of its micro-batches'
    (GaudiTrainer's), and so is the logged loss; transformers' Trainer takes their mean."""
    import torch
    from transformers import Trainer, TrainerCallback

    from bridgetower_bench.trainer import SummedAccumulation

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return {"loss": (self.w * x).sum()}  # d loss / d w = x

    class Gradients(TrainerCallback):  # notes each step's gradient in `seen`, the run's own list
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.append(model.w.grad.item())

    rows = [{"x": torch.tensor([float(i + 1)])} for i in range(4)]
    steps = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=2, max_grad_norm=0)
    off = dict(learning_rate=0.0, report_to="none", use_cpu=True, save_strategy="no")
    args = TrainingArguments(output_dir=str(tmp_path), **steps, **off)
    found = {}
    for name, cls in {"Trainer": Trainer, "summed": type("Summed", (SummedAccumulation, Trainer), {})}.items():
        seen = []
        loss = cls(model=Scale(), args=args, train_dataset=rows, callbacks=[Gradients()]).train().metrics["train_loss"]
        found[name] = (sorted(seen), loss)
    # the 4 rows x = 1..4 in two steps of two: the pairs' sums are 10 in all, their means 5
    assert sum(found["summed"][0]) == 10 and found["summed"][1] == 5.0
    assert sum(found["Trainer"][0]) == 5 and found["Trainer"][1] == 2.5

"""Retrieval metrics through the Trainer's evaluation, compared with recall@k and ranks computed directly from the
model's embeddings by sorting (no code shared with bridgetower_bench.retrieval)."""

import numpy as np
import pytest
import torch

from bridgetower_bench.retrieval import EVAL_IGNORE_KEYS, make_compute_metrics
from helpers import ranks_by_sorting, tiny_contrastive_model


KS = (1, 2, 3)


def test_trainer_evaluation_recalls_equal_those_sorted_from_the_embeddings(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_contrastive_model()
    groups = [0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7]
    torch.manual_seed(1)
    pictures = torch.randn(8, 3, 28, 28)
    rows = [
        {
            "pixel_values": pictures[g],
            "input_ids": torch.randint(3, 50, (8,)),
            "attention_mask": torch.ones(8, dtype=torch.long),
        }
        for g in groups
    ]

    def collate(batch):
        return {**{key: torch.stack([row[key] for row in batch]) for key in batch[0]}, "return_loss": True}

    args = TrainingArguments(
        str(tmp_path),
        per_device_eval_batch_size=5,
        remove_unused_columns=False,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        eval_dataset=rows,
        data_collator=collate,
        compute_metrics=make_compute_metrics(groups, ks=KS),
    )
    metrics = trainer.evaluate(ignore_keys=EVAL_IGNORE_KEYS)

    with torch.no_grad():
        direct = model(**collate(rows))
    i2t, t2i = ranks_by_sorting(direct.image_embeds.numpy(), direct.text_embeds.numpy(), groups)
    assert metrics["eval_num_images"] == 8 and metrics["eval_num_captions"] == 12
    for k in KS:
        assert metrics[f"eval_i2t_recall@{k}"] == pytest.approx(np.mean(i2t <= k))
        assert metrics[f"eval_t2i_recall@{k}"] == pytest.approx(np.mean(t2i <= k))
    assert metrics["eval_i2t_mean_rank"] == pytest.approx(i2t.mean())
    assert metrics["eval_t2i_mean_rank"] == pytest.approx(t2i.mean())
    assert 1 < t2i.mean() < 8 and 1 < i2t.mean() < 12  # neither perfect nor collapsed: the comparison says something

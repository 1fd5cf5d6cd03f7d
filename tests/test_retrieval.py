"""Retrieval quality metrics: exact recalls on hand-built embeddings, grouping, chunking, glue."""

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from bridgetower_bench.retrieval import (
    EVAL_IGNORE_KEYS,
    METRIC_DIR,
    image_group_ids,
    load_retrieval_metric,
    make_compute_metrics,
    retrieval_metrics,
    summarise_quality,
)
from helpers import encode, ranks_by_sorting, tiny_contrastive_model


# Four images along the axes of R^4; five unit-length captions whose coordinates are their
# cosine similarities to the four images. Captions 0 and 1 both describe image 0.
HAND_IMAGES = np.eye(4, dtype=np.float32)[[0, 0, 1, 2, 3]]
HAND_TEXTS = np.array(
    [
        [1.00, 0.00, 0.00, 0.00],  # image 0, exact            -> image 0 ranks 1st
        [0.28, 0.96, 0.00, 0.00],  # image 0, looks like img 1 -> image 0 ranks 2nd
        [0.60, 0.80, 0.00, 0.00],  # image 1                   -> ranks 1st
        [0.80, 0.00, 0.60, 0.00],  # image 2, img 0 ahead      -> ranks 2nd
        [0.64, 0.60, 0.00, 0.48],  # image 3, img 0, 1 ahead   -> ranks 3rd
    ],
    dtype=np.float32,
)
HAND_GROUPS = [0, 0, 1, 2, 3]
EXPECTED_IMAGE_VALUES = "expected a {'bytes', 'path'} dict, bytes, a path or a PIL image"


def whole(message: str) -> str:
    """pytest.raises' `match` for exactly this message."""
    return f"^{re.escape(message)}$"


# Image -> text, reading the columns: image 0's best caption (#0) is 1st; image 1's caption
# (#2, 0.8) is behind caption #1 (0.96); images 2 and 3 find theirs first. Ranks 1, 2, 1, 1.
# Text -> image ranks: 1, 2, 1, 2, 3.


def test_hand_built_embeddings_give_known_recalls_and_ranks_as_plain_python_values():
    metrics = retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS, ks=(1, 2, 3))

    assert metrics == pytest.approx(
        {
            "i2t_recall@1": 0.75,
            "i2t_recall@2": 1.0,
            "i2t_recall@3": 1.0,
            "t2i_recall@1": 0.4,
            "t2i_recall@2": 0.8,
            "t2i_recall@3": 1.0,
            "i2t_mean_rank": 1.25,
            "t2i_mean_rank": 1.8,
            "num_images": 4,
            "num_captions": 5,
        }
    )
    defaults = retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS)
    recalls = [f"{direction}_recall@{k}" for direction in ("i2t", "t2i") for k in (1, 5, 10)]
    assert list(defaults) == recalls + ["i2t_mean_rank", "t2i_mean_rank", "num_images", "num_captions"]
    assert defaults["t2i_recall@1"] == pytest.approx(0.4)
    assert defaults["t2i_recall@5"] == 1.0  # only four images to rank
    assert all(type(value) in (float, int) for value in defaults.values())


def test_vector_length_tensor_types_and_group_labels_leave_the_figures_unchanged():
    expected = retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS, ks=(1, 2, 3))
    rng = np.random.default_rng(0)
    scaled_images = HAND_IMAGES * rng.uniform(0.1, 10, size=(5, 1)).astype(np.float32)
    scaled_texts = HAND_TEXTS * rng.uniform(0.1, 10, size=(5, 1)).astype(np.float32)
    # cosine similarity: vector length ignored; torch tensors (bfloat16 too) accepted
    from_torch = retrieval_metrics(
        torch.from_numpy(scaled_images).to(torch.bfloat16),
        torch.from_numpy(scaled_texts),
        torch.tensor(HAND_GROUPS),
        ks=(1, 2, 3),
    )
    assert from_torch == pytest.approx(expected)
    # group ids are labels, not positions
    assert retrieval_metrics(HAND_IMAGES, HAND_TEXTS, [70, 70, -3, 12, 5], ks=(1, 2, 3)) == expected


def test_rows_of_the_same_image_count_as_one_image_and_ties_count_against_the_model():
    # Image A has three captions that all match it exactly, image B one.
    images = np.array([[1, 0], [1, 0], [1, 0], [0, 1]], dtype=np.float32)
    metrics = retrieval_metrics(images, images.copy(), ["A", "A", "A", "B"])
    assert metrics["num_images"] == 2 and metrics["num_captions"] == 4
    # Copies of image A are not competitors of A: every caption finds its image first.
    assert metrics["t2i_recall@1"] == 1.0 and metrics["t2i_mean_rank"] == 1.0
    # Image A's other captions are correct answers too, not wrong captions ranked ahead.
    assert metrics["i2t_recall@1"] == 1.0 and metrics["i2t_mean_rank"] == 1.0

    # A collapsed model: every embedding equal. It must score the worst ranks, not recall 1.
    same = np.ones((4, 8), dtype=np.float32)
    metrics = retrieval_metrics(same, same, [0, 0, 1, 2], ks=(1,))
    assert metrics["t2i_recall@1"] == 0.0 and metrics["t2i_mean_rank"] == 3.0
    # Image 0 has 2 wrong captions ahead (rank 3); images 1 and 2 have 3 (rank 4).
    assert metrics["i2t_recall@1"] == 0.0
    assert metrics["i2t_mean_rank"] == pytest.approx((3 + 4 + 4) / 3)


def test_chunked_equals_unchunked_and_matches_ranks_by_sorting():
    rng = np.random.default_rng(1)
    groups = rng.integers(0, 40, size=97).tolist()
    distinct_images = rng.normal(size=(40, 16)).astype(np.float32)
    images = distinct_images[groups]
    texts = (images + rng.normal(scale=1.5, size=images.shape)).astype(np.float32)

    whole = retrieval_metrics(images, texts, groups, chunk_size=10_000)
    for chunk_size in (1, 7, 32):
        assert retrieval_metrics(images, texts, groups, chunk_size=chunk_size) == whole

    i2t, t2i = ranks_by_sorting(images, texts, groups)  # the reference: shares no code with the package
    assert whole["num_images"] == len(set(groups))
    assert whole["i2t_mean_rank"] == pytest.approx(i2t.mean())
    assert whole["t2i_mean_rank"] == pytest.approx(t2i.mean())
    for k in (1, 5, 10):
        assert whole[f"i2t_recall@{k}"] == pytest.approx(np.mean(i2t <= k))
        assert whole[f"t2i_recall@{k}"] == pytest.approx(np.mean(t2i <= k))
    assert 0 < whole["t2i_recall@1"] < whole["t2i_recall@10"] < 1  # the data is not trivial


@pytest.mark.parametrize(
    "images, texts, groups, message",
    [
        (np.ones((3, 4)), np.ones((2, 4)), [0, 1, 2], "image_embeds has 3 rows but text_embeds has 2"),
        (np.ones((3, 4)), np.ones((3, 5)), [0, 1, 2], "image and text embeddings differ in size: 4 vs 5"),
        (
            np.ones((3, 4)),
            np.ones((3, 4)),
            [0, 1],
            "image_group_ids must hold one id per row: got shape (2,) for 3 rows",
        ),
        (np.ones(4), np.ones(4), [0], "image_embeds must be 2-D (rows x embedding size), got shape (4,)"),
        (np.zeros((0, 4)), np.zeros((0, 4)), [], "retrieval metrics need at least one (image, caption) row, got none"),
        (
            np.ones((2, 4)),
            np.array([[1, 1, 1, 1], [1, np.nan, 1, 1]]),
            [0, 1],
            "text_embeds has a NaN or infinite value in row 1",
        ),
    ],
)
def test_bad_inputs_are_rejected_with_a_reason(images, texts, groups, message):
    with pytest.raises(ValueError, match=whole(message)):
        retrieval_metrics(images, texts, groups)


def test_bad_ks_and_chunk_size_are_rejected():
    for ks in ((1, 0), (), (True,), (1, 2.0)):
        with pytest.raises(ValueError, match=whole(f"ks must be positive integers, got {ks!r}")):
            retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS, ks=ks)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=whole(f"chunk_size must be a positive integer, got {bad!r}")):
            retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS, chunk_size=bad)


# ---------------------------------------------------------------------------- image_group_ids


def _png_bytes(color):
    return encode(Image.new("RGB", (4, 4), color), "PNG")


def test_image_group_ids_match_identical_bytes_in_first_appearance_order():
    red, blue, green = _png_bytes("red"), _png_bytes("blue"), _png_bytes("green")
    values = [
        {"bytes": blue, "path": "a.png"},
        {"bytes": red, "path": "b.png"},
        {"bytes": blue, "path": "c.png"},  # same bytes, other name: same image
        {"bytes": None, "path": "/data/x.jpg"},
        "/data/x.jpg",
        green,
        {"bytes": green, "path": None},
        {"bytes": red, "path": "b.png"},
    ]

    ids = image_group_ids(values)

    assert ids.dtype.kind == "i"
    assert ids.tolist() == [0, 1, 0, 2, 2, 3, 3, 1]


def test_image_group_ids_compare_pil_images_by_pixels_and_read_an_undecoded_datasets_column():
    values = [
        Image.new("RGB", (3, 3), "red"),
        Image.new("RGB", (3, 3), "red"),
        Image.new("RGB", (3, 3), "blue"),
        Image.new("L", (3, 3), 76),
    ]
    assert image_group_ids(values).tolist() == [0, 0, 1, 2]

    import datasets

    split = datasets.Dataset.from_dict(
        {"image": [{"bytes": _png_bytes(c), "path": None} for c in ("red", "red", "blue")]},
        features=datasets.Features({"image": datasets.Image()}),
    )
    column = split.cast_column("image", datasets.Image(decode=False))["image"]
    assert image_group_ids(column).tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    "values, message",
    [
        ([b"x", {"bytes": None, "path": None}], "image value in row 1 is a dict with neither bytes nor a path"),
        ([b"x", b"y", 3.5], f"image value in row 2 has unsupported type float; {EXPECTED_IMAGE_VALUES}"),
        ([None], f"image value in row 0 has unsupported type NoneType; {EXPECTED_IMAGE_VALUES}"),
        (
            [np.zeros((2, 2), dtype=np.uint8)],
            f"image value in row 0 has unsupported type ndarray; {EXPECTED_IMAGE_VALUES}",
        ),
    ],
)
def test_image_group_ids_reject_unusable_values(values, message):
    with pytest.raises(ValueError, match=whole(message)):
        image_group_ids(values)


# ------------------------------------------------------------------------ trainer and evaluate


def _eval_prediction(predictions):
    return SimpleNamespace(predictions=predictions, label_ids=())


def test_compute_metrics_reads_text_then_image_embeddings_trims_padding_and_takes_a_plain_tuple():
    compute_metrics = make_compute_metrics(HAND_GROUPS, ks=(1, 2, 3))
    padding = np.full((3, 4), 9.0, dtype=np.float32)  # rows a distributed sampler repeated
    predictions = (np.concatenate([HAND_TEXTS, padding]), np.concatenate([HAND_IMAGES, padding]))

    metrics = compute_metrics(_eval_prediction(predictions))

    assert metrics == retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS, ks=(1, 2, 3))
    # a one-row split, given as a plain (predictions, label_ids) tuple
    embeds = np.array([[1.0, 0.0, 0.0]], dtype=np.float32)
    metrics = make_compute_metrics([7])(((embeds, embeds), ()))
    assert metrics["num_images"] == 1 and metrics["num_captions"] == 1
    assert metrics["i2t_recall@1"] == 1.0 and metrics["t2i_mean_rank"] == 1.0


def test_compute_metrics_refuses_bad_group_ids_too_few_rows_and_wrong_prediction_layout():
    for ids, shape in (([[0, 1], [1, 2]], "(2, 2)"), ([], "(0,)")):
        with pytest.raises(
            ValueError, match=whole(f"image_group_ids must be a non-empty 1-D sequence, got shape {shape}")
        ):
            make_compute_metrics(ids)
    compute_metrics = make_compute_metrics(HAND_GROUPS)

    not_covered = (
        "has 4 rows but the eval split has 5 rows; the predictions do not cover the split (a dropped last batch, "
        "or group ids computed for a different split)"
    )
    with pytest.raises(ValueError, match=whole(f"text_embeds {not_covered}")):
        compute_metrics(_eval_prediction((HAND_TEXTS[:4], HAND_IMAGES[:4])))
    with pytest.raises(ValueError, match=whole(f"image_embeds {not_covered}")):
        compute_metrics(_eval_prediction((HAND_TEXTS, HAND_IMAGES[:4])))
    layout = (
        "retrieval metrics expect predictions = (text_embeds, image_embeds), got {}; evaluate with "
        "ignore_keys=['logits', 'cross_embeds', 'hidden_states', 'attentions'] and eval_do_concat_batches=True"
    )
    with pytest.raises(ValueError, match=whole(layout.format("shape (5, 4)"))):
        compute_metrics(_eval_prediction(HAND_TEXTS))
    with pytest.raises(ValueError, match=whole(layout.format("a tuple of 3"))):
        compute_metrics(_eval_prediction((HAND_TEXTS, HAND_IMAGES, HAND_IMAGES)))


def test_trainer_evaluate_with_the_ignore_keys_reports_the_recalls_sorted_from_the_embeddings(tmp_path):
    # The Trainer's evaluation against recall@k and ranks computed directly from the model's embeddings by sorting
    # (helpers.ranks_by_sorting shares no code with bridgetower_bench.retrieval); batches of 5 over 12 rows.
    from transformers import Trainer, TrainingArguments

    model = tiny_contrastive_model()
    groups = [0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7]
    torch.manual_seed(1)
    pictures = torch.randn(8, 3, 28, 28)
    rows = [
        dict(
            pixel_values=pictures[g],
            input_ids=torch.randint(3, 50, (8,)),
            attention_mask=torch.ones(8, dtype=torch.long),
        )
        for g in groups
    ]

    def collate(batch):
        return {**{key: torch.stack([row[key] for row in batch]) for key in batch[0]}, "return_loss": True}

    seen = {}
    compute_metrics = make_compute_metrics(groups, ks=(1, 2, 3))

    def spying_compute_metrics(eval_pred):
        seen["predictions"] = eval_pred.predictions
        return compute_metrics(eval_pred)

    options = dict(per_device_eval_batch_size=5, remove_unused_columns=False, report_to=[], use_cpu=True)
    args = TrainingArguments(str(tmp_path), **options, disable_tqdm=True)
    trainer = Trainer(
        model=model, args=args, eval_dataset=rows, data_collator=collate, compute_metrics=spying_compute_metrics
    )
    metrics = trainer.evaluate(ignore_keys=EVAL_IGNORE_KEYS)

    with torch.no_grad():
        direct = model(**collate(rows))
    text_embeds, image_embeds = seen["predictions"]
    np.testing.assert_allclose(text_embeds, direct.text_embeds.numpy(), atol=1e-5)
    np.testing.assert_allclose(image_embeds, direct.image_embeds.numpy(), atol=1e-5)
    i2t, t2i = ranks_by_sorting(direct.image_embeds.numpy(), direct.text_embeds.numpy(), groups)
    assert metrics["eval_num_images"] == 8 and metrics["eval_num_captions"] == 12
    for k in (1, 2, 3):
        assert metrics[f"eval_i2t_recall@{k}"] == pytest.approx(np.mean(i2t <= k))
        assert metrics[f"eval_t2i_recall@{k}"] == pytest.approx(np.mean(t2i <= k))
    assert metrics["eval_i2t_mean_rank"] == pytest.approx(i2t.mean())
    assert metrics["eval_t2i_mean_rank"] == pytest.approx(t2i.mean())
    assert 1 < t2i.mean() < 8 and 1 < i2t.mean() < 12  # neither perfect nor collapsed: the comparison says something
    assert "eval_loss" in metrics


def test_evaluate_module_loads_offline_from_folder_and_file_and_accumulates_batches():
    import evaluate

    inputs = dict(image_embeds=HAND_IMAGES.tolist(), text_embeds=HAND_TEXTS.tolist(), image_group_ids=HAND_GROUPS)
    expected = retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS, ks=(1, 2, 3))
    assert load_retrieval_metric().compute(**inputs, ks=(1, 2, 3)) == pytest.approx(expected), "from the package"
    from_file = evaluate.load(str(METRIC_DIR / "retrieval_recall.py")).compute(**inputs, ks=(1, 2, 3))
    assert from_file == pytest.approx(expected), "from the file"

    metric = load_retrieval_metric()
    for start in (0, 2, 4):
        metric.add_batch(**{key: value[start : start + 2] for key, value in inputs.items()})
    assert metric.compute() == pytest.approx(retrieval_metrics(HAND_IMAGES, HAND_TEXTS, HAND_GROUPS))


def test_summarise_quality_picks_the_quality_figures_of_one_split():
    metrics = {
        "eval_loss": 1.2,
        "eval_i2t_recall@1": 0.5,
        "eval_t2i_mean_rank": 3.0,
        "eval_runtime": 9.0,
        "eval_num_images": 4,
        "test_i2t_recall@1": 0.4,
        "train_samples_per_second": 100.0,
    }

    assert summarise_quality(metrics, "eval") == {
        "eval_i2t_recall@1": 0.5,
        "eval_t2i_mean_rank": 3.0,
        "eval_loss": 1.2,
    }
    assert summarise_quality(metrics, "test_") == {"test_i2t_recall@1": 0.4}
    assert summarise_quality({"i2t_recall@5": 0.9, "loss": 2.0}, None) == {"i2t_recall@5": 0.9, "loss": 2.0}

"""Image <-> text retrieval quality: recall@k and mean rank on an evaluation split.

A throughput benchmark only means something if the faster configuration still learns the same
model. This module measures that: every row of an eval split is one (image, caption) pair, the
model embeds both sides, and we ask how often the right partner is among the k most similar
items.

Rows that show the same image (the New Yorker data set repeats each cartoon in many rows) are
one image with several correct captions, so image->text retrieval is scored per unique image
and text->image retrieval ranks the unique images, never duplicates of the right answer.

Ties are counted against the model: an item ranks behind every wrong item that scores at least
as high. A collapsed model (all embeddings equal) therefore scores the worst rank, not recall 1.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


DEFAULT_KS = (1, 5, 10)
METRIC_DIR = Path(__file__).resolve().parent / "metrics" / "retrieval_recall"


# --------------------------------------------------------------------------------------------
# Recall@k and mean rank
# --------------------------------------------------------------------------------------------


def _as_matrix(values: Any, name: str) -> np.ndarray:
    """A 2-D float32 numpy copy of a numpy array, torch tensor or nested list."""
    if hasattr(values, "detach"):  # torch tensor, on any device and in any float dtype
        values = values.detach().float().cpu().numpy()
    matrix = np.asarray(values, dtype=np.float32)
    if matrix.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows x embedding size), got shape {matrix.shape}")
    if not np.isfinite(matrix).all():
        bad_row = int(np.nonzero(~np.isfinite(matrix).all(axis=1))[0][0])
        raise ValueError(f"{name} has a NaN or infinite value in row {bad_row}")
    return matrix


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 so that a dot product is the cosine similarity."""
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.maximum(norms, 1e-12)


def _check_ks(ks: Iterable[int]) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks!r}")
    return tuple(int(k) for k in ks)


def _dense_groups(group_ids: Any, num_rows: int) -> np.ndarray:
    """Group ids renumbered 0..M-1 in order of first appearance (one number per unique image)."""
    ids = np.asarray(group_ids)
    if ids.ndim != 1 or len(ids) != num_rows:
        raise ValueError(f"image_group_ids must hold one id per row: got shape {ids.shape} for {num_rows} rows")
    _, first_rows, inverse = np.unique(ids, return_index=True, return_inverse=True)
    # np.unique numbers groups in sorted order; renumber them by first appearance instead.
    order_of_first_appearance = np.argsort(first_rows, kind="stable")
    rank_of_group = np.empty_like(order_of_first_appearance)
    rank_of_group[order_of_first_appearance] = np.arange(len(first_rows))
    return rank_of_group[inverse.reshape(-1)]


def _group_image_embeddings(unit_images: np.ndarray, groups: np.ndarray, num_groups: int) -> np.ndarray:
    """One unit vector per unique image: the mean of its rows' image embeddings.

    Rows of the same image carry the same embedding up to numerical noise (batch composition,
    reduced precision); averaging uses all of them instead of picking one at random.
    """
    sums = np.zeros((num_groups, unit_images.shape[1]), dtype=np.float64)
    np.add.at(sums, groups, unit_images)
    return _unit_rows(sums.astype(np.float32))


def _text_to_image_ranks(unit_texts, unit_group_images, groups, chunk_size) -> np.ndarray:
    """For each caption, the 1-based rank of its image among all unique images."""
    ranks = np.empty(len(unit_texts), dtype=np.int64)
    for start in range(0, len(unit_texts), chunk_size):
        stop = min(start + chunk_size, len(unit_texts))
        scores = unit_texts[start:stop] @ unit_group_images.T  # (chunk, images)
        correct = scores[np.arange(stop - start), groups[start:stop]]
        # The correct image scores >= itself, so this count is 1 + wrong images tied or ahead.
        ranks[start:stop] = (scores >= correct[:, None]).sum(axis=1)
    return ranks


def _image_to_text_ranks(unit_group_images, unit_texts, groups, chunk_size) -> np.ndarray:
    """For each unique image, the 1-based rank of its best caption among all captions."""
    num_groups = len(unit_group_images)
    ranks = np.empty(num_groups, dtype=np.int64)
    for start in range(0, num_groups, chunk_size):
        stop = min(start + chunk_size, num_groups)
        scores = unit_group_images[start:stop] @ unit_texts.T  # (chunk, captions)
        is_correct = groups[None, :] == np.arange(start, stop)[:, None]
        best_correct = np.where(is_correct, scores, -np.inf).max(axis=1)
        wrong_ahead = ((scores >= best_correct[:, None]) & ~is_correct).sum(axis=1)
        ranks[start:stop] = wrong_ahead + 1
    return ranks


def retrieval_metrics(
    image_embeds: Any,
    text_embeds: Any,
    image_group_ids: Any,
    ks: Sequence[int] = DEFAULT_KS,
    chunk_size: int = 1024,
) -> dict:
    """Recall@k both ways and mean ranks for one eval split.

    Row i of ``image_embeds`` / ``text_embeds`` is the i-th (image, caption) pair; rows with
    equal ``image_group_ids`` show the same image. Similarity is cosine.

    Returns plain Python numbers:
    ``i2t_recall@k`` - share of unique images with at least one of their captions in the top k
    of all captions; ``t2i_recall@k`` - share of captions whose image is in the top k of the
    unique images; ``i2t_mean_rank`` / ``t2i_mean_rank`` - mean 1-based rank of the best correct
    item; ``num_images`` / ``num_captions``.

    Memory stays at ``chunk_size`` x (number of captions) scores: the similarity matrix is
    computed a block of rows at a time.
    """
    images = _as_matrix(image_embeds, "image_embeds")
    texts = _as_matrix(text_embeds, "text_embeds")
    if len(images) != len(texts):
        raise ValueError(f"image_embeds has {len(images)} rows but text_embeds has {len(texts)}")
    if len(images) == 0:
        raise ValueError("retrieval metrics need at least one (image, caption) row, got none")
    if images.shape[1] != texts.shape[1]:
        raise ValueError(f"image and text embeddings differ in size: {images.shape[1]} vs {texts.shape[1]}")
    ks = _check_ks(ks)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")

    groups = _dense_groups(image_group_ids, len(images))
    num_groups = int(groups.max()) + 1
    unit_texts = _unit_rows(texts)
    unit_group_images = _group_image_embeddings(_unit_rows(images), groups, num_groups)

    i2t_ranks = _image_to_text_ranks(unit_group_images, unit_texts, groups, chunk_size)
    t2i_ranks = _text_to_image_ranks(unit_texts, unit_group_images, groups, chunk_size)

    metrics: dict = {}
    for k in ks:
        metrics[f"i2t_recall@{k}"] = float(np.mean(i2t_ranks <= k))
    for k in ks:
        metrics[f"t2i_recall@{k}"] = float(np.mean(t2i_ranks <= k))
    metrics["i2t_mean_rank"] = float(np.mean(i2t_ranks))
    metrics["t2i_mean_rank"] = float(np.mean(t2i_ranks))
    metrics["num_images"] = num_groups
    metrics["num_captions"] = len(texts)
    return metrics


# --------------------------------------------------------------------------------------------
# Which rows show the same image
# --------------------------------------------------------------------------------------------


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _image_identity(value: Any, row: int) -> tuple:
    """A hashable key that is equal for two values showing the same image.

    Embedded bytes are compared by content hash (fast, and the same cartoon stored twice still
    matches); a value with only a path is identified by that path; a decoded PIL image by its
    pixels.
    """
    if isinstance(value, Mapping):
        data = value.get("bytes")
        if data is not None:
            return ("bytes", _digest(bytes(data)))
        path = value.get("path")
        if path:
            return ("path", os.fspath(path))
        raise ValueError(f"image value in row {row} is a dict with neither bytes nor a path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ("bytes", _digest(bytes(value)))
    if isinstance(value, (str, os.PathLike)):
        return ("path", os.fspath(value))
    if hasattr(value, "tobytes") and hasattr(value, "mode") and hasattr(value, "size"):  # PIL image
        return ("pixels", value.mode, tuple(value.size), _digest(value.tobytes()))
    raise ValueError(
        f"image value in row {row} has unsupported type {type(value).__name__}; "
        "expected a {'bytes', 'path'} dict, bytes, a path or a PIL image"
    )


def image_group_ids(values: Iterable[Any]) -> np.ndarray:
    """One int id per image value; identical images share an id, numbered by first appearance.

    For a ``datasets`` split, pass the image column read without decoding
    (``split.cast_column(col, datasets.Image(decode=False))[col]``) so that only bytes are
    hashed.
    """
    ids_by_identity: dict = {}
    ids = []
    for row, value in enumerate(values):
        identity = _image_identity(value, row)
        ids.append(ids_by_identity.setdefault(identity, len(ids_by_identity)))
    return np.asarray(ids, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Trainer and `evaluate` glue
# --------------------------------------------------------------------------------------------

# BridgeTowerForContrastiveLearning returns loss, logits, text_embeds, image_embeds,
# cross_embeds, hidden_states (always: its forward forces output_hidden_states=True) and, when
# asked, attentions. Ignoring these keys leaves the predictions tuple (text_embeds, image_embeds).
EVAL_IGNORE_KEYS = ["logits", "cross_embeds", "hidden_states", "attentions"]


def make_compute_metrics(image_group_ids: Any, ks: Sequence[int] = DEFAULT_KS, chunk_size: int = 1024) -> Callable:
    """A ``compute_metrics`` for transformers' Trainer that scores retrieval on one eval split.

    The trainer must run evaluation with ``ignore_keys=EVAL_IGNORE_KEYS`` so that
    ``eval_pred.predictions`` is ``(text_embeds, image_embeds)`` in data set order.
    ``image_group_ids`` holds one id per row of that split. Extra trailing rows (padding some
    distributed samplers add) are dropped; missing rows are an error.

    The Trainer only calls ``compute_metrics`` when it has labels; this model has none, and it
    counts as having them (an empty tuple) only when the eval batches carry ``return_loss=True``.
    """
    group_ids = np.asarray(image_group_ids)
    if group_ids.ndim != 1 or len(group_ids) == 0:
        raise ValueError(f"image_group_ids must be a non-empty 1-D sequence, got shape {group_ids.shape}")
    ks = _check_ks(ks)

    def compute_metrics(eval_pred) -> dict:
        predictions = getattr(eval_pred, "predictions", None)
        if predictions is None and isinstance(eval_pred, (tuple, list)):
            predictions = eval_pred[0]
        if not isinstance(predictions, (tuple, list)) or len(predictions) != 2:
            shape = getattr(predictions, "shape", None)
            found = f"a tuple of {len(predictions)}" if isinstance(predictions, (tuple, list)) else f"shape {shape}"
            raise ValueError(
                "retrieval metrics expect predictions = (text_embeds, image_embeds), got "
                f"{found}; evaluate with ignore_keys={EVAL_IGNORE_KEYS} and eval_do_concat_batches=True"
            )
        text_embeds, image_embeds = (np.asarray(p) for p in predictions)
        expected = len(group_ids)
        for name, embeds in (("text_embeds", text_embeds), ("image_embeds", image_embeds)):
            if len(embeds) < expected:
                raise ValueError(
                    f"{name} has {len(embeds)} rows but the eval split has {expected} rows; the "
                    "predictions do not cover the split (a dropped last batch, or group ids "
                    "computed for a different split)"
                )
        return retrieval_metrics(
            image_embeds[:expected], text_embeds[:expected], group_ids, ks=ks, chunk_size=chunk_size
        )

    return compute_metrics


def load_retrieval_metric(**kwargs):
    """The ``retrieval_recall`` evaluate module, loaded from this package's folder (no hub access)."""
    import evaluate

    return evaluate.load(str(METRIC_DIR), **kwargs)


QUALITY_KEYS = tuple(
    [f"i2t_recall@{k}" for k in DEFAULT_KS]
    + [f"t2i_recall@{k}" for k in DEFAULT_KS]
    + ["i2t_mean_rank", "t2i_mean_rank", "loss"]
)


def summarise_quality(metrics: Mapping[str, Any], prefix: str | None = "eval") -> dict:
    """The quality figures of a metrics dict (recalls, mean ranks, loss), keys kept as found.

    ``prefix`` is the split prefix the trainer added (``"eval"``, ``"test"``; a trailing ``_``
    is optional; ``None`` or ``""`` for unprefixed keys). Missing keys are left out.
    """
    head = f"{prefix.rstrip('_')}_" if prefix else ""
    picked = {}
    for key in QUALITY_KEYS:
        full_key = head + key
        if full_key in metrics:
            picked[full_key] = metrics[full_key]
    return picked

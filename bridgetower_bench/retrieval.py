"""Image <-> text retrieval quality on an evaluation split: recall@k and mean rank, repeated images and ties
counted as bridgetower_bench/metrics/retrieval_recall/README.md says."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


DEFAULT_KS = (1, 5, 10)
METRIC_DIR = Path(__file__).resolve().parent / "metrics" / "retrieval_recall"


def _as_matrix(values: Any, name: str) -> np.ndarray:
    """A 2-D float32 numpy copy of a numpy array, torch tensor (any device or float dtype) or nested list."""
    if hasattr(values, "detach"):
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
    return matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)


def _check_ks(ks: Iterable[int]) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks!r}")
    return tuple(int(k) for k in ks)


def _ranks(queries: np.ndarray, items: np.ndarray, correct: Callable, chunk_size: int) -> np.ndarray:
    """For each query row, the 1-based rank of its best correct item: 1 + the wrong items scoring at least as high.
    ``correct(start, stop)``: which items are correct for queries start..stop-1, a (queries, items) bool matrix."""
    ranks = np.empty(len(queries), dtype=np.int64)
    for start in range(0, len(queries), chunk_size):
        stop = min(start + chunk_size, len(queries))
        scores = queries[start:stop] @ items.T
        is_correct = correct(start, stop)
        best_correct = np.where(is_correct, scores, -np.inf).max(axis=1)
        ranks[start:stop] = ((scores >= best_correct[:, None]) & ~is_correct).sum(axis=1) + 1
    return ranks


def retrieval_metrics(
    image_embeds: Any, text_embeds: Any, image_group_ids: Any, ks: Sequence[int] = DEFAULT_KS, chunk_size: int = 1024
) -> dict:
    """Recall@k both ways, mean ranks and counts, plain Python numbers (metrics/retrieval_recall/README.md): row i
    of the embeddings is the i-th (image, caption) pair, rows of equal ``image_group_ids`` show the same image."""
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

    ids = np.asarray(image_group_ids)
    if ids.ndim != 1 or len(ids) != len(images):
        raise ValueError(f"image_group_ids must hold one id per row: got shape {ids.shape} for {len(images)} rows")
    _, first_rows, inverse = np.unique(ids, return_index=True, return_inverse=True)
    groups = np.argsort(np.argsort(first_rows))[inverse]  # 0..M-1 by first appearance, one per unique image
    num_groups = len(first_rows)
    unit_texts = _unit_rows(texts)
    # One unit vector per unique image, the mean of its rows' (equal up to numerical noise: all of them count).
    sums = np.zeros((num_groups, images.shape[1]), dtype=np.float64)
    np.add.at(sums, groups, _unit_rows(images))
    unit_group_images = _unit_rows(sums.astype(np.float32))

    image_ids = np.arange(num_groups)
    ranks = {  # for each unique image its best caption among all captions; for each caption its image
        "i2t": _ranks(unit_group_images, unit_texts, lambda a, b: image_ids[a:b, None] == groups, chunk_size),
        "t2i": _ranks(unit_texts, unit_group_images, lambda a, b: groups[a:b, None] == image_ids, chunk_size),
    }
    metrics = {f"{way}_recall@{k}": float(np.mean(ranks[way] <= k)) for way in ranks for k in ks}
    metrics.update({f"{way}_mean_rank": float(np.mean(ranks[way])) for way in ranks})
    return {**metrics, "num_images": num_groups, "num_captions": len(texts)}


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _image_identity(value: Any, row: int) -> tuple:
    """A key equal for values showing the same image: bytes by content hash, a path alone by itself, PIL by pixels."""
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
    """One int id per image value (pass a column undecoded), identical images sharing it, by first appearance."""
    ids: dict = {}  # identity -> id
    return np.fromiter((ids.setdefault(_image_identity(v, row), len(ids)) for row, v in enumerate(values)), np.int64)


# BridgeTowerForContrastiveLearning's outputs but loss, text_embeds and image_embeds: the predictions are the two.
EVAL_IGNORE_KEYS = ["logits", "cross_embeds", "hidden_states", "attentions"]


def make_compute_metrics(image_group_ids: Any, ks: Sequence[int] = DEFAULT_KS, chunk_size: int = 1024) -> Callable:
    """A Trainer ``compute_metrics`` for the eval split of ``image_group_ids`` (padding rows dropped), called only
    with labels: this model has them only when the eval batches carry ``return_loss=True``."""
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
                    f"{name} has {len(embeds)} rows but the eval split has {expected} rows; the predictions do not "
                    "cover the split (a dropped last batch, or group ids computed for a different split)"
                )
        return retrieval_metrics(
            image_embeds[:expected], text_embeds[:expected], group_ids, ks=ks, chunk_size=chunk_size
        )

    return compute_metrics


def load_retrieval_metric(**kwargs):
    """The ``retrieval_recall`` evaluate module, loaded from this package's folder (no hub access)."""
    import evaluate

    return evaluate.load(str(METRIC_DIR), **kwargs)


_RECALL_KEYS = [f"{way}_recall@{k}" for way in ("i2t", "t2i") for k in DEFAULT_KS]
QUALITY_KEYS = (*_RECALL_KEYS, "i2t_mean_rank", "t2i_mean_rank", "loss")


def summarise_quality(metrics: Mapping[str, Any], prefix: str | None = "eval") -> dict:
    """The recalls, mean ranks and loss found in `metrics` under the split's `prefix` ("eval", "test_", None)."""
    head = f"{prefix.rstrip('_')}_" if prefix else ""
    return {head + key: metrics[head + key] for key in QUALITY_KEYS if head + key in metrics}

"""What the media-pipeline loader needs from a data set, stored on the data set handed to the trainer.

``feed_media_pipeline``, called by the Gaudi script per split, writes the split's image files
(``mediapipe_image_files``) and then ``attach_mediapipe_inputs`` stores the file list, the token arrays
and the image geometry on the data set object, where ``MediaPipeDataLoader`` finds them
(``mediapipe_inputs_of``). Pure Python: runs, and is tested, on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bridgetower_bench.data import cache_dir as bench_cache_dir
from bridgetower_bench.mediapipe.image_files import materialise_images


_INPUTS_ATTRIBUTE = "_bridgetower_mediapipe_inputs"


@dataclass(frozen=True)
class MediaPipeInputs:
    """Per-data-set inputs of the media-pipeline loader (see ``attach_mediapipe_inputs``)."""

    file_paths: list[str]
    input_ids: np.ndarray  # int64 [rows, max_seq_length]
    attention_mask: np.ndarray  # int64 [rows, max_seq_length]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def attach_mediapipe_inputs(dataset, file_paths: Sequence[str], image_size: int, mean, std) -> MediaPipeInputs:
    """Store what ``MediaPipeTrainerMixin`` needs on ``dataset`` (the very object given to the trainer).

    ``file_paths`` comes from ``materialise_images``; the ``input_ids``/``attention_mask`` columns
    are read once into int64 arrays. ``mean``/``std`` are the image processor's (0..1 scale).
    """
    if len(dataset) == 0:
        raise ValueError("the media-pipeline loader needs a non-empty data set")
    if len(file_paths) != len(dataset):
        raise ValueError(f"{len(file_paths)} image files for a data set of {len(dataset)} rows")
    if not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    mean, std = _channel_triplet(mean, "mean"), _channel_triplet(std, "std")
    if min(std) <= 0:
        raise ValueError(f"image std must be positive, got {std}")
    input_ids, attention_mask = (_token_array(dataset, column) for column in ("input_ids", "attention_mask"))
    inputs = MediaPipeInputs(list(file_paths), input_ids, attention_mask, image_size, mean, std)
    setattr(dataset, _INPUTS_ATTRIBUTE, inputs)
    return inputs


def mediapipe_inputs_of(dataset) -> MediaPipeInputs:
    """The inputs ``attach_mediapipe_inputs`` stored on ``dataset``."""
    inputs = getattr(dataset, _INPUTS_ATTRIBUTE, None)
    if inputs is None:
        raise ValueError("this data set has no media-pipeline inputs: call attach_mediapipe_inputs() on it first")
    return inputs


def _channel_triplet(values, name: str) -> tuple[float, float, float]:
    values = tuple(float(v) for v in values)
    if len(values) != 3:
        raise ValueError(f"image {name} must have 3 values (R, G, B), got {values}")
    return values


def _token_array(dataset, column: str) -> np.ndarray:
    if column not in dataset.column_names:
        raise ValueError(f"the data set has no '{column}' column: tokenize the captions first")
    values = dataset.with_format("numpy", columns=[column])[:][column]
    if values.dtype == object or values.ndim != 2:
        raise ValueError(f"'{column}' rows differ in length: tokenize with padding='max_length'")
    return values.astype(np.int64, copy=False)


def feed_media_pipeline(
    dataset, image_column: str, image_size: int, mean, std, num_proc=None, cache_dir=None
) -> MediaPipeInputs:
    """What the Gaudi script calls per split: image files on disk for the HPU decoder, then the loader's inputs."""
    cache_dir = bench_cache_dir("mediapipe_images", cache_dir)  # under $HF_HOME, else $XDG_CACHE_HOME, else ~/.cache
    paths = materialise_images(dataset, image_column, cache_dir, dataset._fingerprint, num_proc)
    return attach_mediapipe_inputs(dataset, paths, image_size, mean, std)

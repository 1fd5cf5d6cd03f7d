"""What the media-pipeline loader needs from a data set, stored on the data set handed to the trainer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bridgetower_bench.data import cache_dir
from bridgetower_bench.mediapipe.image_files import materialise_images


_INPUTS_ATTRIBUTE = "_bridgetower_mediapipe_inputs"


@dataclass(frozen=True)
class MediaPipeInputs:
    file_paths: list[str]  # one per row
    input_ids: np.ndarray  # int64 [rows, max_seq_length]
    attention_mask: np.ndarray  # int64 [rows, max_seq_length]
    image_size: int
    mean: tuple[float, float, float]  # the image processor's (0..1 scale)
    std: tuple[float, float, float]


def attach_mediapipe_inputs(dataset, file_paths, image_size: int, mean, std) -> MediaPipeInputs:
    """Store the loader's inputs on ``dataset``, the very object given to the trainer (tokens read once)."""
    tokens = []
    for column in ("input_ids", "attention_mask"):
        values = dataset.with_format("numpy", columns=[column])[:][column]
        if values.dtype == object or values.ndim != 2:
            raise ValueError(f"'{column}' rows differ in length: tokenize with padding='max_length'")
        tokens.append(values.astype(np.int64, copy=False))
    inputs = MediaPipeInputs(list(file_paths), tokens[0], tokens[1], image_size, tuple(mean), tuple(std))
    setattr(dataset, _INPUTS_ATTRIBUTE, inputs)
    return inputs


def mediapipe_inputs_of(dataset) -> MediaPipeInputs:
    inputs = getattr(dataset, _INPUTS_ATTRIBUTE, None)
    if inputs is None:
        raise ValueError("this data set has no media-pipeline inputs: call attach_mediapipe_inputs() on it first")
    return inputs


def feed_media_pipeline(dataset, image_column: str, image_size: int, mean, std, num_proc=None) -> MediaPipeInputs:
    """The Gaudi script's call per split: image files on disk for the HPU decoder, then the loader's inputs."""
    paths = materialise_images(dataset, image_column, cache_dir("mediapipe_images"), dataset._fingerprint, num_proc)
    return attach_mediapipe_inputs(dataset, paths, image_size, mean, std)

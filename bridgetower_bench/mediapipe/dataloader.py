"""The media-pipeline loader: batches decoded and normalised on the HPU, in the trainer's sampler order.

``SamplerBatchReader`` groups the sampler's indices into batches of file paths and tokens (pure Python,
tested on any machine); ``MediaPipeDataLoader`` plans each epoch's batches with it, runs them through
the media pipeline (``mediapipe_graph``) and yields them as the PyTorch collate does.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Iterator

import numpy as np
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState

from bridgetower_bench.mediapipe.availability import mediapipe_unavailable_reason
from bridgetower_bench.mediapipe.graph import EpochPlan, build_pipeline, media_api, release_pipeline
from bridgetower_bench.mediapipe.inputs import mediapipe_inputs_of


class SamplerBatchReader:
    """Groups a sampler's indices into batches of (file paths, input_ids, attention_mask).

    Iterating yields ``(list[str], int64 [B, L], int64 [B, L])`` per batch in the sampler's order,
    so a ``DistributedSampler`` shards ranks and, after ``set_epoch``, reshuffles per epoch. The
    last partial batch is kept unless ``drop_last``.
    """

    def __init__(self, file_paths, input_ids, attention_mask, sampler, batch_size: int, drop_last: bool):
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
        self.input_ids = _as_token_matrix(input_ids, "input_ids")
        self.attention_mask = _as_token_matrix(attention_mask, "attention_mask")
        self.file_paths = list(file_paths)
        if not len(self.file_paths) == len(self.input_ids) == len(self.attention_mask):
            raise ValueError(
                f"{len(self.file_paths)} file paths, {len(self.input_ids)} input_ids rows and "
                f"{len(self.attention_mask)} attention_mask rows: they must match"
            )
        if self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(f"input_ids {self.input_ids.shape} and attention_mask {self.attention_mask.shape} differ")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler (a DistributedSampler seeds its shuffle with it)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        samples = len(self.sampler)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
        indices: list[int] = []
        for index in self.sampler:
            indices.append(int(index))
            if len(indices) == self.batch_size:
                yield self._batch(indices)
                indices = []
        if indices and not self.drop_last:
            yield self._batch(indices)

    def _batch(self, indices: list[int]):
        rows = np.asarray(indices, dtype=np.int64)
        return [self.file_paths[i] for i in indices], self.input_ids[rows], self.attention_mask[rows]


def _as_token_matrix(values, name: str) -> np.ndarray:
    try:
        matrix = np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a rectangular array of integers: {error}") from error
    if matrix.ndim != 2:
        raise ValueError(f"{name} must have shape [rows, max_seq_length], got {matrix.shape}")
    return matrix


MAX_PREFETCH_DEPTH = 3  # Habana documents prefetch depths 1 to 3


def prefetch_depth_for(num_workers: int) -> int:
    """Media-pipeline prefetch depth for ``--dataloader_num_workers``.

    The pipeline has no worker processes: the host only lists file names, the device decodes. What
    workers buy the PyTorch loader, batches prepared ahead, is the pipeline's prefetch depth:
    ``num_workers + 1`` batches in flight, capped at 3, the deepest Habana documents. The published
    "workers=2 + mediapipe" run thus gets depth 3, the fixed depth upstream used.
    """
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"--dataloader_num_workers must be a non-negative integer, got {num_workers!r}")
    return min(num_workers + 1, MAX_PREFETCH_DEPTH)


class MediaPipeDataLoader(DataLoaderStateMixin):
    """Batches decoded and normalised on the HPU, in the order of ``sampler``.

    Yields ``{"pixel_values": float32 [B, 3, S, S] on the HPU, "input_ids", "attention_mask": int64
    [B, L], "return_loss": True}`` like the PyTorch collate. ``len()`` is the number of batches;
    ``set_epoch`` reaches the sampler. ``num_workers`` sets the prefetch depth (``prefetch_depth_for``).
    One pipeline per loader, built once and restarted each epoch; ``close()`` releases it (its
    device memory and decoder), as does dropping the loader or the end of the process.
    Like accelerate's own loaders it keeps the GradientState informed, so ``gather_for_metrics``
    drops the samples a sharded evaluation padded (``world_size`` = number of ranks).

    Only constructible where ``mediapipe_unavailable_reason()`` is None; ``dataset`` must carry
    ``attach_mediapipe_inputs``' inputs.
    """

    _instances = itertools.count()

    def __init__(
        self, dataset, sampler, batch_size: int, *, drop_last: bool = False, num_workers: int = 0, world_size: int = 1
    ):
        reason = mediapipe_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the media-pipeline loader cannot run here: {reason}")
        inputs = mediapipe_inputs_of(dataset)
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.prefetch_depth = prefetch_depth_for(num_workers)
        self._reader = SamplerBatchReader(
            inputs.file_paths, inputs.input_ids, inputs.attention_mask, sampler, batch_size, drop_last
        )
        # accelerate's DataLoaderStateMixin bookkeeping (read by begin()):
        self.gradient_state = GradientState()
        self._drop_last = drop_last
        self.total_batch_size = batch_size * world_size

        self._plan = EpochPlan()
        plan_key = f"bridgetower-mediapipe-{next(self._instances)}"
        self._num_batches = len(self._reader)
        api = media_api()
        pipe = build_pipeline(
            api,
            self._plan,
            plan_key,
            batch_size=batch_size,
            prefetch_depth=self.prefetch_depth,
            num_batches=self._num_batches,
            largest_file=max(set(inputs.file_paths), key=os.path.getsize),
            max_seq_length=int(inputs.input_ids.shape[1]),
            image_size=inputs.image_size,
            mean=inputs.mean,
            std=inputs.std,
        )
        self._iterator = api.HPUGenericPytorchIterator(mediapipe=pipe)
        self._release = weakref.finalize(self, release_pipeline, pipe, plan_key)  # also runs at exit

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def close(self) -> None:
        """Release the pipeline's device memory and decoder; the loader cannot be iterated after."""
        self._release()

    def __len__(self) -> int:
        return self._num_batches

    def set_epoch(self, epoch: int) -> None:
        self._reader.set_epoch(epoch)

    def __iter__(self):
        if self.closed:
            raise RuntimeError("this media-pipeline loader was closed")
        batches = list(self._reader)  # the epoch's order, fixed before the pipeline starts reading it
        if len(batches) != self._num_batches:
            raise RuntimeError(f"the sampler gave {len(batches)} batches this epoch, {self._num_batches} expected")
        self._plan.batches = batches
        self.begin()
        try:
            iter(self._iterator)  # restarts the pipeline; its reader node now walks `batches`
            for number, (paths, input_ids, attention_mask) in enumerate(batches):
                self.end_of_dataloader = number == len(batches) - 1
                pixel_values = next(self._iterator)[0]
                if pixel_values.shape[0] != len(paths):  # drop the padding of a short last batch
                    pixel_values = pixel_values[: len(paths)]
                yield {
                    "pixel_values": pixel_values,
                    "input_ids": torch.from_numpy(input_ids),
                    "attention_mask": torch.from_numpy(attention_mask),
                    "return_loss": True,
                }
        finally:
            self.end()

"""The media-pipeline loader: batches decoded and normalised on the HPU, in the trainer's sampler order."""

from __future__ import annotations

import itertools
import weakref
from types import SimpleNamespace

import numpy as np
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from torch.utils.data import BatchSampler

from bridgetower_bench.mediapipe.availability import mediapipe_unavailable_reason
from bridgetower_bench.mediapipe.graph import build_pipeline, media_api, release_pipeline
from bridgetower_bench.mediapipe.inputs import mediapipe_inputs_of


class SamplerBatchReader:
    """A sampler's indices in batches of (file paths, input_ids, attention_mask: int64 [B, L]), in its order.

    A ``DistributedSampler`` shards the ranks and, after ``set_epoch``, reshuffles per epoch; the last partial
    batch is kept unless ``drop_last``.
    """

    def __init__(self, file_paths, input_ids, attention_mask, sampler, batch_size: int, drop_last: bool):
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
        self.file_paths = list(file_paths)
        self.input_ids = np.asarray(input_ids, dtype=np.int64)
        self.attention_mask = np.asarray(attention_mask, dtype=np.int64)
        if not len(self.file_paths) == len(self.input_ids) == len(self.attention_mask):
            raise ValueError(
                f"{len(self.file_paths)} file paths, {len(self.input_ids)} input_ids rows and "
                f"{len(self.attention_mask)} attention_mask rows: they must match"
            )
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(BatchSampler(self.sampler, self.batch_size, self.drop_last))

    def __iter__(self):
        for rows in BatchSampler(self.sampler, self.batch_size, self.drop_last):
            rows = [int(index) for index in rows]
            yield [self.file_paths[i] for i in rows], self.input_ids[rows], self.attention_mask[rows]


class MediaPipeDataLoader(DataLoaderStateMixin):
    """Batches decoded and normalised on the HPU, in the order of ``sampler``, as the PyTorch collate yields them.

    ``{"pixel_values": float32 [B, 3, S, S] on the HPU, "input_ids", "attention_mask": int64 [B, L], "return_loss":
    True}``. Like accelerate's loaders it keeps the GradientState informed, so ``gather_for_metrics`` drops the
    samples a sharded evaluation padded (``world_size``: the number of ranks). Only constructible where
    ``mediapipe_unavailable_reason()`` is None, on a data set carrying ``attach_mediapipe_inputs``' inputs.
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
        self._reader = SamplerBatchReader(
            inputs.file_paths, inputs.input_ids, inputs.attention_mask, sampler, batch_size, drop_last
        )
        # accelerate's DataLoaderStateMixin bookkeeping (read by begin()):
        self.gradient_state = GradientState()
        self._drop_last = drop_last
        self.total_batch_size = batch_size * world_size

        self._plan = SimpleNamespace(batches=[])  # the epoch's batches, walked by the pipeline's reader node
        self._num_batches = len(self._reader)
        api = media_api()
        # The pipeline has no worker processes: what workers buy the PyTorch loader, batches prepared ahead, is its
        # prefetch depth, capped at 3, the deepest Habana documents (the published "workers=2 + mediapipe" run thus
        # gets upstream's fixed depth 3).
        prefetch_depth = min(num_workers + 1, 3)
        pipe_name = f"bridgetower-mediapipe-{next(self._instances)}"
        pipe = build_pipeline(api, self._plan, pipe_name, inputs, batch_size, prefetch_depth, self._num_batches)
        self._iterator = api.iterator(mediapipe=pipe)
        self._release = weakref.finalize(self, release_pipeline, pipe)  # also runs at exit

    def close(self) -> None:
        """Release the pipeline's device memory and decoder; the loader cannot be iterated after."""
        self._release()

    def __len__(self) -> int:
        return self._num_batches

    def set_epoch(self, epoch: int) -> None:
        self._reader.set_epoch(epoch)

    def __iter__(self):
        if not self._release.alive:
            raise RuntimeError("this media-pipeline loader was closed")
        batches = list(self._reader)  # the epoch's order, fixed before the pipeline starts reading it
        self._plan.batches = batches
        self.begin()
        try:
            iter(self._iterator)  # restarts the pipeline; its reader node now walks `batches`
            for number, (paths, input_ids, attention_mask) in enumerate(batches):
                self.end_of_dataloader = number == len(batches) - 1
                yield {
                    "pixel_values": next(self._iterator)[0][: len(paths)],  # a short last batch's padding dropped
                    "input_ids": torch.from_numpy(input_ids),
                    "attention_mask": torch.from_numpy(attention_mask),
                    "return_loss": True,
                }
        finally:
            self.end()

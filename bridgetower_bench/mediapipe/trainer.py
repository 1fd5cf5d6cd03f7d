"""The trainer mixin that makes a trainer's data loaders come from the media pipeline.

``MediaPipeTrainerMixin`` makes the trainer build a ``MediaPipeDataLoader`` from its own sampler, sharded
per rank, so the media pipeline sees the same batches as the PyTorch loader.
"""

from __future__ import annotations

import logging
from typing import Optional

from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler
from transformers.trainer_pt_utils import DistributedSamplerWithLoop, ShardSampler

from bridgetower_bench.mediapipe.dataloader import MediaPipeDataLoader


logger = logging.getLogger(__name__)


class MediaPipeTrainerMixin:
    """Mixed in front of the script's trainer class: data loaders come from the media pipeline.

    ``class MediaPipeTrainer(MediaPipeTrainerMixin, BridgeTowerTrainer)``. Every data set given to
    the trainer must carry ``attach_mediapipe_inputs``' inputs. Training batches follow the trainer's own
    sampler, evaluation the data set's order; on several ranks, where the trainer would let accelerate shard a plain sampler, the
    mixin shards the same way itself: training with a DistributedSampler (looping to full batches
    unless --dataloader_drop_last, like GaudiTrainer's padding), evaluation batch-round-robin like
    accelerate (transformers' ShardSampler), so ``gather_for_metrics`` trims the padding.

    Each data set gets one pipeline per role (training, evaluation), built on first use and reused:
    evaluating every N steps does not pile up pipelines. The training pipeline is released when
    ``train()`` returns, the others by ``release_media_pipelines()``, when the trainer is dropped,
    or at the end of the process.
    """

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        # (the batch --auto_find_batch_size settled on is the state's by the time the trainer asks for a loader)
        batch_size = self.state.train_batch_size if self.args.auto_find_batch_size else self.args.train_batch_size
        sampler = self._mediapipe_train_sampler(self.train_dataset, batch_size)
        return self._mediapipe_loader("train", self.train_dataset, sampler, batch_size)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        return self._mediapipe_eval_loader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        return self._mediapipe_eval_loader(test_dataset)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # Resuming mid-epoch makes the trainer rebuild the loader with accelerate's
        # skip_first_batches, which only knows PyTorch DataLoaders.
        if resume_from_checkpoint not in (None, False) and not self.args.ignore_data_skip:
            logger.warning(
                "--mediapipe_dataloader cannot skip the batches already trained in the resumed epoch: "
                "that epoch restarts from its first batch (as with --ignore_data_skip)"
            )
            self.args.ignore_data_skip = True
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.release_media_pipelines(role="train")

    def release_media_pipelines(self, role: Optional[str] = None) -> None:
        """Release the media pipelines built so far (only ``role``'s: "train" or "eval", if given)."""
        loaders = self.__dict__.get("_media_pipeline_loaders", {})
        for key in [key for key in loaders if role in (None, key[0])]:
            loaders.pop(key).close()

    def _mediapipe_eval_loader(self, dataset):
        batch_size = self.args.eval_batch_size
        loader = self.__dict__.get("_media_pipeline_loaders", {}).get(("eval", id(dataset), batch_size))
        if loader is not None:  # (it holds the data set, so the id names that one) sequential: same batches again
            return loader
        return self._mediapipe_loader("eval", dataset, self._mediapipe_eval_sampler(dataset, batch_size), batch_size)

    def _mediapipe_loader(self, role, dataset, sampler, batch_size):
        loaders = self.__dict__.setdefault("_media_pipeline_loaders", {})
        key = (role, id(dataset), batch_size)
        if key in loaders:  # a data set given again (another train() call): its old pipeline goes first
            loaders.pop(key).close()
        loaders[key] = MediaPipeDataLoader(
            dataset,
            sampler,
            batch_size,
            drop_last=self.args.dataloader_drop_last,
            num_workers=self.args.dataloader_num_workers,
            world_size=self.args.world_size,
        )
        return loaders[key]

    def _mediapipe_train_sampler(self, dataset, batch_size):
        sampler = self._get_train_sampler()
        if self.args.world_size <= 1:
            return sampler if sampler is not None else SequentialSampler(dataset)
        shard = dict(
            num_replicas=self.args.world_size,
            rank=self.args.process_index,
            shuffle=_shuffles(sampler, self.args.world_size),
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
        )
        if self.args.dataloader_drop_last:
            return DistributedSampler(dataset, drop_last=True, **shard)
        return DistributedSamplerWithLoop(dataset, batch_size=batch_size, **shard)

    def _mediapipe_eval_sampler(self, dataset, batch_size):
        """The data set in order (the Trainer's evaluation order), sharded over the ranks as accelerate would."""
        if self.args.world_size <= 1:
            return SequentialSampler(dataset)
        return ShardSampler(
            dataset,
            batch_size=batch_size,
            drop_last=self.args.dataloader_drop_last,
            num_processes=self.args.world_size,
            process_index=self.args.process_index,
        )


def _shuffles(sampler, world_size: int) -> bool:
    """Whether the trainer's (rank-unaware) sampler shuffles; other kinds cannot be sharded here."""
    if isinstance(sampler, RandomSampler):
        return True
    if sampler is None or isinstance(sampler, SequentialSampler):
        return False
    raise ValueError(
        f"--mediapipe_dataloader on {world_size} devices shards random or sequential sampling only, "
        f"not {type(sampler).__name__} (drop --group_by_length)"
    )

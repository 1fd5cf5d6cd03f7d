"""``MediaPipeTrainerMixin``: a trainer whose data loaders come from the media pipeline."""

from __future__ import annotations

import logging
from typing import Optional

from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler
from transformers.trainer_pt_utils import DistributedSamplerWithLoop, ShardSampler

from bridgetower_bench.mediapipe.dataloader import MediaPipeDataLoader


logger = logging.getLogger(__name__)


class MediaPipeTrainerMixin:
    """Mixed in front of the script's trainer; every data set it is given carries ``attach_mediapipe_inputs``' inputs.

    Training follows the trainer's own sampler, evaluation the data set's order. On several ranks the mixin shards
    as accelerate would a plain sampler: training with a DistributedSampler (looping to full batches unless
    --dataloader_drop_last, like GaudiTrainer's padding), evaluation batch-round-robin (ShardSampler), so that
    ``gather_for_metrics`` trims the padding. One pipeline per data set and role, built on first use and reused
    (evaluating every N steps piles none up); the training one is released when ``train()`` returns, the others by
    ``release_media_pipelines()``, when the trainer is dropped, or at the end of the process.
    """

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args, dataset = self.args, self.train_dataset
        # (the batch --auto_find_batch_size settled on is the state's by the time the trainer asks for a loader)
        batch_size = self.state.train_batch_size if args.auto_find_batch_size else args.train_batch_size
        sampler = self._get_train_sampler()
        if args.world_size <= 1:
            sampler = sampler if sampler is not None else SequentialSampler(dataset)
        elif sampler is not None and not isinstance(sampler, (RandomSampler, SequentialSampler)):
            raise ValueError(
                f"--mediapipe_dataloader on {args.world_size} devices shards random or sequential sampling only, "
                f"not {type(sampler).__name__} (drop --group_by_length)"
            )
        else:
            shard = dict(
                num_replicas=args.world_size,
                rank=args.process_index,
                shuffle=isinstance(sampler, RandomSampler),
                seed=args.data_seed if args.data_seed is not None else args.seed,
            )
            if args.dataloader_drop_last:
                sampler = DistributedSampler(dataset, drop_last=True, **shard)
            else:
                sampler = DistributedSamplerWithLoop(dataset, batch_size=batch_size, **shard)
        return self._mediapipe_loader("train", dataset, batch_size, sampler)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        return self._mediapipe_loader("eval", eval_dataset, self.args.eval_batch_size)

    def get_test_dataloader(self, test_dataset):
        return self._mediapipe_loader("eval", test_dataset, self.args.eval_batch_size)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # Resuming mid-epoch makes the trainer rebuild the loader with accelerate's skip_first_batches, which only
        # knows PyTorch DataLoaders.
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

    def _mediapipe_loader(self, role, dataset, batch_size, sampler=None):
        """``sampler`` None: evaluation, the data set in order, sharded over the ranks as accelerate would."""
        loaders = self.__dict__.setdefault("_media_pipeline_loaders", {})
        key = (role, id(dataset), batch_size)  # (a loader holds its data set, so the id names that one)
        if key in loaders and role == "eval":  # sequential: the same batches again
            return loaders[key]
        if key in loaders:  # a data set given again (another train() call): its old pipeline goes first
            loaders.pop(key).close()
        if sampler is None and self.args.world_size <= 1:
            sampler = SequentialSampler(dataset)
        elif sampler is None:
            sampler = ShardSampler(
                dataset,
                batch_size=batch_size,
                drop_last=self.args.dataloader_drop_last,
                num_processes=self.args.world_size,
                process_index=self.args.process_index,
            )
        loaders[key] = MediaPipeDataLoader(
            dataset,
            sampler,
            batch_size,
            drop_last=self.args.dataloader_drop_last,
            num_workers=self.args.dataloader_num_workers,
            world_size=self.args.world_size,
        )
        return loaders[key]

"""What both scripts add to their trainer (GaudiTrainer on Gaudi, Trainer on NVIDIA/CPU).

`TrainerExtensions` is mixed in front of the backend's trainer class:

    class BridgeTowerTrainer(TrainerExtensions, GaudiTrainer): ...   # run_bridgetower.py
    class BridgeTowerTrainer(TrainerExtensions, Trainer): ...        # run_bridgetower_cuda.py (the patch)

It
- normalises uint8 pixel batches on the training device, after the host-to-device copy
  (timm's PrefetchLoader idea: workers ship 4x fewer bytes and do no float math);
- times every fetch of a batch, for `data_wait_fraction`;
- reports steady-state throughput after `throughput_warmup_steps` (see throughput.py) and records
  which loader and image pipeline actually ran, next to the train metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
import torch
from transformers import TrainingArguments

from .images import normalize_on_device
from .run_record import describe_run
from .throughput import ThroughputCallback


@dataclass
class WarmupTrainingArguments(TrainingArguments):
    """TrainingArguments plus GaudiTrainingArguments' `throughput_warmup_steps`, for the CUDA/CPU script."""

    throughput_warmup_steps: int = field(
        default=0,
        metadata={"help": "Number of first optimizer steps left out of the throughput figures (as on Gaudi)."},
    )


class TrainerExtensions:
    def __init__(self, *args, image_mean=None, image_std=None, loader: str = "torch", image_pipeline: str = "upstream", **kwargs):
        super().__init__(*args, **kwargs)
        self.image_mean = tuple(image_mean) if image_mean is not None else None
        self.image_std = tuple(image_std) if image_std is not None else None
        self.run_facts = {"loader": loader, "image_pipeline": image_pipeline}
        self.throughput = ThroughputCallback(
            warmup_steps=getattr(self.args, "throughput_warmup_steps", 0) or 0,
            world_size=self.args.world_size,
        )
        self.add_callback(self.throughput)

    # uint8 -> normalised float, on the device ---------------------------------------------------------
    def _prepare_inputs(self, inputs):
        inputs = super()._prepare_inputs(inputs)
        pixel_values = inputs.get("pixel_values")
        if pixel_values is not None and pixel_values.dtype == torch.uint8:
            if self.image_mean is None or self.image_std is None:
                raise RuntimeError("uint8 pixel batches need the trainer's image_mean and image_std")
            inputs["pixel_values"] = normalize_on_device(pixel_values, self.image_mean, self.image_std)
        return inputs

    # data-wait timing: Trainer fetches through get_batch_samples, GaudiTrainer through
    # get_batch_samples_transformers; only the one the base class uses is ever called.
    def _timed_fetch(self, fetch, *args, **kwargs):
        start = time.perf_counter()
        batches, num_items = fetch(*args, **kwargs)
        seconds = time.perf_counter() - start
        self.throughput.record_fetch(seconds, sum(_batch_size(b) for b in batches))
        return batches, num_items

    def get_batch_samples(self, *args, **kwargs):
        return self._timed_fetch(super().get_batch_samples, *args, **kwargs)

    def get_batch_samples_transformers(self, *args, **kwargs):
        return self._timed_fetch(super().get_batch_samples_transformers, *args, **kwargs)

    # results -------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        steady = self.throughput.metrics()
        if steady and "train_samples_per_second" in result.metrics:
            # Keep the trainer's own figure for reference; ours has the same meaning on every backend.
            result.metrics["trainer_train_samples_per_second"] = result.metrics["train_samples_per_second"]
        result.metrics.update(steady)
        result.metrics["per_device_train_batch_size"] = self.args.per_device_train_batch_size
        result.metrics.update(self.run_facts)
        result.metrics.update(describe_run(self.args))
        return result


def _batch_size(batch) -> int:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return int(ids.shape[0]) if ids is not None else 0

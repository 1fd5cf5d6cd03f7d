"""The data-free ceiling: BridgeTower training steps fed one fixed batch that already sits on the device.

The same model, the same ``TrainingArguments`` (bf16, optimizer, max_grad_norm, ...) and the same
``Trainer`` + ``TrainerExtensions`` as run_bridgetower_cuda.py, but no data loading: every step trains
on one batch of uint8 pixels and token ids made on the device once (normalised each step, as the fast
pipelines' batches are). Its samples/s is what the benchmark's runs would reach if loading cost nothing;
a run's samples/s over it is that run's loading efficiency. Throughput is counted exactly as in the
runs (after ``--throughput_warmup_steps``) and saved as ``train_results.json`` in ``--output_dir``.

    python lab/gpu_ceiling.py --model_name_or_path DIR --output_dir OUT --bf16 \\
        --per_device_train_batch_size 48 --max_steps 13 --throughput_warmup_steps 3 --report_to none
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset
from transformers import AutoImageProcessor, HfArgumentParser, Trainer, set_seed
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerForContrastiveLearning

from bridgetower_bench.arguments import WarmupTrainingArguments
from bridgetower_bench.modeling.attention import use_attention
from bridgetower_bench.modeling.layer_compile import compile_repeated_layers
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.trainer import TrainerExtensions
from step_profile import StepProfiler


logger = logging.getLogger(__name__)

CEILING_LOADER = "none (fixed batch on the device)"


@dataclass
class CeilingArguments:
    model_name_or_path: str = field(metadata={"help": "Model directory (as for run_bridgetower_cuda.py)."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per caption, as the runs pad them."})
    freeze_text_pooler: bool = field(
        default=True, metadata={"help": "Remove the unused text pooler, as the script does by default."}
    )
    profile_steps: int = field(
        default=0,
        metadata={
            "help": "Profile this many optimizer steps after the warm-up "
            "(torch.profiler): profile.txt and profile_trace.json in --output_dir; the profiled steps run slower, so "
            "take samples/s from a run without it. 0: no profile."
        },
    )


class _StepTokens(Dataset):
    """One tiny item per sample the run will consume: it only paces the trainer's epochs and steps."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return index


def _collate_step_tokens(indices):
    return {"sample_indices": torch.tensor(indices)}


class FixedBatchMixin:
    """Hands the training loop ``fixed_batch`` for every batch it draws from the (token) loader."""

    def __init__(self, *args, fixed_batch: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.fixed_batch = fixed_batch

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = []
        for _ in range(num_batches):
            if next(epoch_iterator, None) is None:
                break
            batches.append(self.fixed_batch)
        return batches, None


class CeilingTrainer(TrainerExtensions, FixedBatchMixin, Trainer):
    """TrainerExtensions outermost, so its fetch timing and sample count see the fixed batches."""


def make_fixed_batch(config, batch_size: int, max_seq_length: int, device, seed: int = 0) -> dict:
    """Random uint8 pixels and token ids shaped like a real batch, created on ``device``."""
    generator = torch.Generator().manual_seed(seed)
    size = config.vision_config.image_size
    vocab = config.text_config.vocab_size
    pixels = torch.randint(0, 256, (batch_size, 3, size, size), generator=generator, dtype=torch.uint8)
    input_ids = torch.randint(5, vocab, (batch_size, max_seq_length), generator=generator)
    return {
        "pixel_values": pixels.to(device),
        "input_ids": input_ids.to(device),
        "attention_mask": torch.ones_like(input_ids).to(device),
        "return_loss": True,
    }


def run_ceiling(ceiling_args: CeilingArguments, training_args: WarmupTrainingArguments) -> dict:
    """Train ``max_steps`` steps on a fixed on-device batch; return the train metrics (also saved)."""
    if training_args.max_steps is None or training_args.max_steps <= 0:
        raise ValueError(
            "--max_steps must be a positive number of steps: the ceiling has no data set to count epochs over"
        )
    if ceiling_args.max_seq_length < 1:
        raise ValueError(f"--max_seq_length must be positive; got {ceiling_args.max_seq_length}")
    if ceiling_args.profile_steps < 0 or (
        ceiling_args.profile_steps
        and training_args.throughput_warmup_steps + ceiling_args.profile_steps > training_args.max_steps
    ):
        raise ValueError(
            f"--profile_steps {ceiling_args.profile_steps} must be 0, or fit after the "
            f"{training_args.throughput_warmup_steps} warm-up steps within --max_steps {training_args.max_steps}"
        )
    set_seed(training_args.seed)
    image_processor = AutoImageProcessor.from_pretrained(ceiling_args.model_name_or_path)
    model = BridgeTowerForContrastiveLearning.from_pretrained(ceiling_args.model_name_or_path)
    use_attention(model, training_args.attn_implementation)  # the script's speed options, as it applies them
    if training_args.compile_layers:
        compile_repeated_layers(model, backend=training_args.compile_layers)
    if ceiling_args.freeze_text_pooler:
        model.bridgetower.text_model.pooler = None
    training_args.remove_unused_columns = False  # the token items are not model inputs
    samples_needed = (
        training_args.max_steps
        * training_args.gradient_accumulation_steps
        * training_args.per_device_train_batch_size
        * training_args.world_size
    )
    trainer = CeilingTrainer(
        model=model,
        args=training_args,
        train_dataset=_StepTokens(samples_needed),
        data_collator=_collate_step_tokens,
        fixed_batch=make_fixed_batch(
            model.config,
            training_args.per_device_train_batch_size,
            ceiling_args.max_seq_length,
            training_args.device,
            training_args.seed,
        ),
        image_mean=image_processor.image_mean,
        image_std=image_processor.image_std,
        loader=CEILING_LOADER,
        image_pipeline="none",
    )
    profiler = None
    if ceiling_args.profile_steps:
        profiler = StepProfiler(
            training_args.throughput_warmup_steps, ceiling_args.profile_steps, training_args.output_dir
        )
        trainer.add_callback(profiler)
    with trainer.catching_signals():  # a signal after the last step waits until the metrics are saved
        metrics = trainer.train().metrics
        if profiler is not None and profiler.written:
            logger.info("step profile written to %s", profiler.written)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
    return metrics


def main(argv=None) -> dict:
    parser = HfArgumentParser((CeilingArguments, WarmupTrainingArguments))
    ceiling_args, training_args = parser.parse_args_into_dataclasses(args=argv if argv is not None else sys.argv[1:])
    if ceiling_args.model_name_or_path.startswith((".", "/", "~")):  # a path, not a Hub model id
        tool_paths.input_dir("--model_name_or_path", os.path.expanduser(ceiling_args.model_name_or_path))
    tool_paths.output_dir("--output_dir", training_args.output_dir)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        level=logging.INFO,
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    return run_ceiling(ceiling_args, training_args)


if __name__ == "__main__":
    tool_paths.run(main)

"""What both scripts add to their trainer (GaudiTrainer on Gaudi, Trainer on NVIDIA/CPU).

`TrainerExtensions` is mixed in front of the backend's trainer class:

    class BridgeTowerTrainer(TrainerExtensions, GaudiTrainer): ...   # run_bridgetower.py
    class BridgeTowerTrainer(TrainerExtensions, Trainer): ...        # run_bridgetower_cuda.py (the patch)

It
- normalises uint8 pixel batches on the training device, after the host-to-device copy
  (timm's PrefetchLoader idea: workers ship 4x fewer bytes and do no float math);
- times every fetch of a batch, for `data_wait_fraction`;
- on one device, draws each epoch up to whole batches as GaudiTrainer does, so both scripts train on
  the same batches;
- reports steady-state throughput after `throughput_warmup_steps` (see throughput.py) and records
  which loader and image pipeline actually ran, next to the train metrics;
- stops cleanly (resilience.py): on SIGTERM/SIGINT, or on an image that fails to load mid-run, it
  saves a checkpoint and ends with one clear message; rerunning the same command resumes;
- publishes the final model, its processors, metrics and trainer state as one set (run_directory.py):
  after any kill output_dir holds the previous set or the new one, never a mix; SIGTERM/SIGINT after
  the last step waits until the set is published, then ends the run;
- records the checkpoints it writes, and rotation deletes only those; a full disk while saving one ends the
  run in one line, the partial checkpoint removed (disk_space.py);
- blanks credentials (--hub_token) in the training_args.bin saved with the weights.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch.utils.data import RandomSampler
from transformers import TrainingArguments
from transformers.training_args import OptimizerNames, ParallelMode

from .atomic_files import atomic_path
from .attention import ATTENTION_IMPLEMENTATIONS
from .images import normalize_on_device
from . import disk_space, run_directory
from .redaction import without_secrets
from .resilience import ImageLoadError, StopOnSignal, last_complete_checkpoint, report_and_exit
from .run_record import describe_run
from .throughput import ThroughputCallback


def _gaudi_default(name: str, default):
    """A TrainingArguments field (its help and type) with GaudiTrainingArguments' default instead of its own."""
    return field(default=default, metadata=TrainingArguments.__dataclass_fields__[name].metadata)


# GaudiTrainingArguments' defaults that differ from TrainingArguments' and that the CUDA/CPU script takes, so
# that the same flags train the same recipe on both backends. The other differing defaults are left to the
# device: `half_precision_backend` ("hpu_amp" there: bf16 autocast on each device), `ddp_bucket_cap_mb`
# (230 MB buckets there, tuned for Habana's collectives: how gradients are grouped, not what they are) and
# `ddp_find_unused_parameters` (False there; torch's DDP stops with an error when a parameter gets no gradient,
# as some of BridgeTower's do in this task, so the Trainer's own choice stays: the same gradients either way).
GAUDI_RECIPE_DEFAULTS = {
    "adam_epsilon": 1e-6,  # TrainingArguments: 1e-8
    "optim": "adamw_torch",  # TrainingArguments: adamw_torch_fused with torch >= 2.8 (the same AdamW, other rounding)
    "logging_nan_inf_filter": False,  # TrainingArguments: True, which reads every step's loss on the host
}


@dataclass
class WarmupTrainingArguments(TrainingArguments):
    """TrainingArguments plus what the CUDA/CPU script trains with beyond them, with Gaudi's recipe defaults.

    `throughput_warmup_steps` and `attn_implementation` are GaudiTrainingArguments' own (same names and
    defaults); `compile_layers` is this script's alone. The fields of ``GAUDI_RECIPE_DEFAULTS`` default to
    GaudiTrainingArguments' values, so a command means the same training on both scripts.
    """

    adam_epsilon: float = _gaudi_default("adam_epsilon", GAUDI_RECIPE_DEFAULTS["adam_epsilon"])
    optim: Union[OptimizerNames, str] = _gaudi_default("optim", GAUDI_RECIPE_DEFAULTS["optim"])
    logging_nan_inf_filter: bool = _gaudi_default("logging_nan_inf_filter", GAUDI_RECIPE_DEFAULTS["logging_nan_inf_filter"])

    throughput_warmup_steps: int = field(
        default=0,
        metadata={"help": "Number of first optimizer steps left out of the throughput figures (as on Gaudi)."},
    )
    attn_implementation: str = field(
        default="eager",
        metadata={"help": "Text and cross-modal attention: eager (transformers' code, as upstream) or sdpa (the same function in one fused torch call).",
                  "choices": ATTENTION_IMPLEMENTATIONS},
    )
    compile_layers: Optional[str] = field(
        default=None,
        metadata={"help": "Compile each repeated layer in place with this torch.compile backend (inductor); instead of --torch_compile."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.compile_layers and self.torch_compile:
            raise ValueError("--compile_layers and --torch_compile both compile the model: pass one of them")


class TrainerExtensions:
    def __init__(self, *args, image_mean=None, image_std=None, loader: str = "torch", image_pipeline: str = "upstream", **kwargs):
        super().__init__(*args, **kwargs)
        self.image_mean = tuple(image_mean) if image_mean is not None else None
        self.image_std = tuple(image_std) if image_std is not None else None
        self.run_facts = {
            "loader": loader,
            "image_pipeline": image_pipeline,
            "attn_implementation": getattr(self.args, "attn_implementation", "eager"),
            "compile_layers": getattr(self.args, "compile_layers", None) or "no",
            "logging_nan_inf_filter": bool(self.args.logging_nan_inf_filter),  # True: the host waits every step
        }
        self.throughput = ThroughputCallback(
            warmup_steps=getattr(self.args, "throughput_warmup_steps", 0) or 0,
            world_size=self.args.world_size,
        )
        self.add_callback(self.throughput)
        self.stop_on_signal = StopOnSignal()
        self.add_callback(self.stop_on_signal)
        self._staging = None  # inside `publishing()`: where the files being published are saved
        self._publishing_model = False

    # the same batches on both backends ----------------------------------------------------------------
    def _get_train_sampler(self, *args, **kwargs):
        """On one device, an epoch is drawn up to a whole number of batches, as GaudiTrainer draws it.

        GaudiTrainer (lazy mode wants one batch shape) samples ``ceil(n / batch) * batch`` rows per epoch
        without replacement: a permutation of all rows, then the first rows of a second one. Trainer
        ends the epoch with a short batch instead, so without this the two scripts would train on
        different batches from the end of the first epoch on. GaudiTrainer's own sampler passes
        through unchanged.
        """
        sampler = super()._get_train_sampler(*args, **kwargs)
        batch = self.args.per_device_train_batch_size
        if (
            type(sampler) is RandomSampler
            and not sampler.replacement
            and not self.args.dataloader_drop_last
            and self.args.parallel_mode != ParallelMode.DISTRIBUTED
            and sampler.num_samples % batch
        ):
            rounded_up = sampler.num_samples + batch - sampler.num_samples % batch
            return RandomSampler(sampler.data_source, num_samples=rounded_up, generator=sampler.generator)
        return sampler

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
        # The signal handlers stay installed after a finished training: a signal then waits until the final
        # model is published (`publishing`), so that no signal can lose a finished training.
        self.stop_on_signal.install()
        try:
            result = super().train(*args, **kwargs)
        except ImageLoadError as error:
            self.stop_on_signal.restore()
            raise self._checkpoint_after_image_error(error) from None
        except BaseException:
            self.stop_on_signal.restore()
            raise
        interrupted = self.stop_on_signal.interruption(self.state, self.args.output_dir)
        if interrupted is not None:
            self.stop_on_signal.restore()
            self._end_the_run(interrupted)
        self.stop_on_signal.training_done = True
        steady = self.throughput.metrics()
        if steady and "train_samples_per_second" in result.metrics:
            # Keep the trainer's own figure for reference; ours has the same meaning on every backend.
            result.metrics["trainer_train_samples_per_second"] = result.metrics["train_samples_per_second"]
        result.metrics.update(steady)
        result.metrics["per_device_train_batch_size"] = self.args.per_device_train_batch_size
        result.metrics.update(self.run_facts)
        result.metrics.update(describe_run(self.args))
        return result

    # stopping cleanly -----------------------------------------------------------------------------------
    def _checkpoint_after_image_error(self, error: ImageLoadError) -> ImageLoadError:
        """Save a checkpoint of the last completed step; return the one-line error the run stops with.

        The failing batch is fetched before its step starts, so model and optimizer are exactly at
        `global_step`. With several processes nothing is saved here: the other ranks wait in a collective
        this rank will never join, so the run stops and resumes from its last regular checkpoint.
        """
        step = self.state.global_step
        if self.args.world_size > 1 or step == 0:
            return ImageLoadError(
                f"{error.reason} (training stopped before step {step + 1}; no checkpoint saved). Restore the image, "
                "or rerun with --drop_bad_rows to leave its rows out."
            )
        self._save_checkpoint(self.model, trial=None)
        checkpoint = os.path.join(self.args.output_dir, f"checkpoint-{step}")
        return ImageLoadError(
            f"{error.reason} (training stopped after step {step}; checkpoint saved in {checkpoint}). Restore the image, "
            "or pass --drop_bad_rows to leave its rows out, and rerun the same command to resume."
        )

    def evaluate(self, *args, **kwargs):
        with _one_line_image_errors():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with _one_line_image_errors():
            return super().predict(*args, **kwargs)

    # publication: the final files appear as one set --------------------------------------------------
    @contextmanager
    def publishing(self):
        """Everything saved inside this block appears in output_dir together, or not at all.

        save_model, save_processors, save_metrics and save_state write into the block's staging directory;
        called outside a block, each is a publication of its own. SIGTERM/SIGINT wait until the set is
        published (so do signals since the last training step); the run then ends with exit status 128 +
        signal number, everything it did saved.
        """
        if self._staging is not None:  # nested: part of the enclosing publication
            yield self._staging
            return
        self.stop_on_signal.install()
        try:
            with run_directory.publication(self.args.output_dir, publish=self.args.should_save) as staging:
                self._staging = staging
                yield staging
        finally:
            self._staging, self._publishing_model = None, False
            self.stop_on_signal.restore()
        stopped = self.stop_on_signal.stopped_after_saving(self.args.output_dir)
        if stopped is not None:
            self._end_the_run(stopped)

    def _end_the_run(self, interrupted) -> None:
        """Exit with 128 + signal once every rank is here, i.e. once the process that saves has saved.

        Launchers (torchrun, mpirun) tear the job down as soon as one rank exits, killing the others after a
        grace period: a rank with nothing to save must not leave while the saving one still writes its
        checkpoint or publishes the final set. (After training, transformers' Trainer happens to gather the
        ranks' FLOP counts, which waits too; this does not rely on it.)
        """
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
        report_and_exit(interrupted, self.is_world_process_zero())

    def save_model(self, output_dir=None, _internal_call: bool = False):
        """The final model and its config, published with the rest of the set (see `publishing`).

        Checkpoints (`_internal_call`) are written in place: one counts only once its trainer_state.json,
        written last, is readable (resilience.last_complete_checkpoint).
        """
        if _internal_call:
            return super().save_model(output_dir, _internal_call=True)
        if output_dir is not None and os.path.realpath(output_dir) != os.path.realpath(self.args.output_dir):
            with run_directory.publication(output_dir, publish=self.args.should_save) as staging:
                super().save_model(staging, _internal_call=True)
        else:
            with self.publishing() as staging:
                self._publishing_model = True
                super().save_model(staging, _internal_call=True)  # (True: no push from the staging directory)
                run_directory.fault_point()
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir=None, state_dict=None):
        """As the backend's _save (final model and checkpoints), but the training_args.bin saved next to
        the weights holds no credential (--hub_token and the like are blanked in the saved copy; the
        run keeps the real value for pushing)."""
        super()._save(output_dir, state_dict=state_dict)
        saved = without_secrets(self.args)
        path = os.path.join(output_dir if output_dir is not None else self.args.output_dir, "training_args.bin")
        if saved is not self.args and os.path.exists(path):
            with atomic_path(path) as temporary:
                torch.save(saved, temporary)

    def save_processors(self, *processors) -> None:
        """save_pretrained() each of `processors` (tokenizer, image processor) into output_dir, with the set."""
        with self.publishing() as staging:
            if self.args.should_save:
                for processor in processors:
                    processor.save_pretrained(staging)
                run_directory.fault_point()

    def save_metrics(self, split, metrics, combined=True):
        """As Trainer.save_metrics ({split}_results.json, merged into all_results.json), published with the set.

        A new model's all_results.json starts afresh: the previous model's eval/test results do not describe it.
        """
        with self.publishing() as staging:
            if not self.is_world_process_zero():
                return
            with open(os.path.join(staging, f"{split}_results.json"), "w") as f:
                json.dump(metrics, f, indent=4, sort_keys=True)
            if combined:  # merged into this set's all_results.json, else the published one (unless replaced)
                path = os.path.join(staging, "all_results.json")
                if not os.path.exists(path) and not self._publishing_model:
                    path = os.path.join(self.args.output_dir, "all_results.json")
                combined_metrics = {}
                if os.path.exists(path):
                    with open(path) as f:
                        combined_metrics = json.load(f)
                with open(os.path.join(staging, "all_results.json"), "w") as f:
                    json.dump({**combined_metrics, **metrics}, f, indent=4, sort_keys=True)
            run_directory.fault_point()

    def save_state(self):
        with self.publishing() as staging:
            if self.is_world_process_zero():
                self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
                run_directory.fault_point()

    # ownership: what this run writes into output_dir is recorded first ---------------------------------
    def _save_checkpoint(self, model, trial):
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        with disk_space.removed_when_disk_full(checkpoint, "a checkpoint", after=lambda: _resume_from(run_dir)):
            if self.args.should_save:
                run_directory.record_written(run_dir, [os.path.basename(checkpoint)])
            return super()._save_checkpoint(model, trial)

    def _sorted_checkpoints(self, output_dir=None, *args, **kwargs):
        """Rotation (save_total_limit) and best-model bookkeeping see only the checkpoints runs of ours wrote."""
        found = super()._sorted_checkpoints(output_dir, *args, **kwargs)
        ours = set(run_directory.read_record(output_dir or self.args.output_dir)["written"])
        return [path for path in found if os.path.basename(path) in ours]

    def create_model_card(self, *args, **kwargs):
        if self.is_world_process_zero():
            run_directory.record_written(self.args.output_dir, ["README.md"])
        return super().create_model_card(*args, **kwargs)


def _resume_from(output_dir: str) -> str:
    """What a run stopped by a full disk can resume from, for its one-line message."""
    last = last_complete_checkpoint(output_dir)
    if last is None:
        return "; no complete checkpoint is left to resume from"
    return f"; the last complete checkpoint, {last}, is intact: free some space and rerun the same command to resume"


@contextmanager
def _one_line_image_errors():
    """An ImageLoadError re-raised from a DataLoader worker carries the worker's traceback: keep its message only."""
    try:
        yield
    except ImageLoadError as error:
        raise ImageLoadError(error.reason) from None


def _batch_size(batch) -> int:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return int(ids.shape[0]) if ids is not None else 0

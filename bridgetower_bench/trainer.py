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
- reports steady-state throughput after `throughput_warmup_steps` (see throughput.py), the device's
  energy over the same window where a counter exists (energy.py), and records
  which loader and image pipeline actually ran, next to the train metrics;
- on a GPU, checks at step 1 that the per-device batch fits, and turns running out of memory in the first
  step into one line saying which batch and accumulation would fit (gpu_memory.py);
- stops cleanly (resilience.py): on SIGTERM/SIGINT, or on an image that fails to load mid-run, it
  saves a checkpoint and ends with one clear message; rerunning the same command resumes;
- publishes the final model, its processors, metrics and trainer state as one set (run_directory.py):
  after any kill output_dir holds the previous set or the new one, never a mix; SIGTERM/SIGINT after
  the last step waits until the set is published, then ends the run (inside `catching_signals`, which
  gives the caller's handlers back when it ends);
- records the checkpoints it writes, and rotation deletes only those; each checkpoint holds the run's recipe
  and counts only once its manifest (every file, size and sha256) is written, last (checkpoint_manifest.py);
  the final model is published with the recipe (run_recipe.py); a full disk while saving one ends the run in
  one line, the partial checkpoint removed (disk_space.py);
- stops a run whose loss or gradient norm is not finite (divergence.py), before anything is saved or
  published; writes records with null where a number is not finite;
- keeps the sum of the training losses in every checkpoint, so that a resumed run's `train_loss` is the
  mean over all its steps;
- resumes an epoch stopped midway in the order that epoch was drawn (`_resumed_epoch_keeps_its_order`).
- blanks credentials (--hub_token) in the training_args.bin saved with the weights.

It reaches the Trainer through its public extension points (callbacks and their control flags, `train`,
`training_step`, `prediction_step`, `log`, `save_model`, `push_to_hub`) and two private methods, the same on
transformers 4.55 (and GaudiTrainer) and 5.x: `_get_train_sampler` and `_save_checkpoint` (docs/ARCHITECTURE.md,
"Private APIs of other libraries").
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from typing import Optional

import accelerate
import torch
from torch.utils.data import RandomSampler
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.training_args import ParallelMode

from bridgetower_bench.guards import divergence, gpu_memory
from bridgetower_bench.guards.resilience import ImageLoadError, StopOnSignal, report_and_exit
from bridgetower_bench.images.images import normalize_on_device
from bridgetower_bench.measurement.energy import EnergyMeter
from bridgetower_bench.measurement.run_record import describe_run
from bridgetower_bench.measurement.throughput import ThroughputCallback, node_line
from bridgetower_bench.output_dir import checkpoint_manifest, disk_space, run_directory, run_recipe
from bridgetower_bench.output_dir.atomic_files import atomic_path
from bridgetower_bench.redaction import without_secrets


logger = logging.getLogger(__name__)


class TrainerExtensions:
    def __init__(
        self,
        *args,
        image_mean=None,
        image_std=None,
        loader: str = "torch",
        image_pipeline: str = "upstream",
        recipe: Optional[dict] = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.recipe = (
            recipe  # what makes this run's model (run_recipe.describe): saved with the model and every checkpoint
        )
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
            energy=EnergyMeter.for_device(self.args.device, self.args.world_size),
            gather=lambda tensor: self.accelerator.gather(tensor),
        )
        self.add_callback(self.throughput)
        self.stop_on_signal = StopOnSignal()
        self.add_callback(self.stop_on_signal)
        self.divergence = divergence.DivergenceWatch()
        self.add_callback(TrainingLossSum())
        self.add_callback(_AfterEachStep(self))  # last: it sees what the other callbacks decided
        self._save_total_limit = self.args.save_total_limit  # the run's; the Trainer's own rotation is off (`train`)
        self._losses = None  # the loss summed since the last logging step, as the Trainer sums it (a device tensor)
        self._logged_losses = 0.0  # the losses of the logged steps, resumed ones included (the Trainer's sum)
        self._resumed_loss_sum = None  # the losses of the steps resumed from, when the checkpoint holds them
        self._last_logged_step = 0
        self._grad_norm = None  # the last optimizer step's gradient norm, before clipping (a device tensor)
        self._checkpoint_being_saved = None  # inside `_save_checkpoint`: its directory
        self._holding_pushes = False  # a push waits until the set being saved is published (`save_model`)
        self._staging = None  # inside `publishing()`: where the files being published are saved
        self._catching_signals = False  # inside `catching_signals()`: a finished training waits for its publication
        self._publishing_model = False
        self._first_step = None  # global step at this train() call's first training step
        self._memory_need = None  # the known memory need of this run's batch on a GPU (gpu_memory.py)

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

    # every optimizer step: divergence, and the loss not yet logged ----------------------------------------
    def _training_begins(self, state) -> None:
        """The resumed checkpoint's state is loaded: the losses so far start the sum, as the Trainer's count."""
        self._last_logged_step = state.global_step
        self._resumed_loss_sum = TrainingLossSum.saved_in(state)
        self._logged_losses = self._resumed_loss_sum or 0.0

    def _after_step(self, control) -> None:
        """After every optimizer step (and at each epoch's end), once the callbacks decided what follows.

        The step's loss and gradient norm are recorded on the device (no host wait). Before the Trainer reads
        them anyway, to log, or saves a checkpoint or evaluates, a non-finite step ends the run: no log line,
        checkpoint or evaluation ever holds a diverged model's numbers.
        """
        self.divergence.observe(self.state.global_step, self._losses, self._grad_norm)
        if control.should_log or control.should_save or control.should_evaluate:
            self._stop_if_diverged()
        if control.should_log and self.state.global_step > self._last_logged_step:
            # as the Trainer does at a logging step: the mean over the ranks joins the logged sum
            self._logged_losses += self.accelerator.gather(self._losses).mean().item()
            self._losses = torch.zeros_like(self._losses)
            self._last_logged_step = self.state.global_step

    def _stop_if_diverged(self) -> None:
        diverged = self.divergence.check(
            self.state.max_steps,
            self.args.output_dir,
            lambda: _last_complete_checkpoint_if_any(self.args.output_dir, self.recipe),
            world_size=self.args.world_size,
        )
        if diverged is not None:
            for callback in self.callback_handler.callbacks:  # the progress bar ends before the line, not after it
                if getattr(callback, "training_bar", None) is not None:
                    callback.training_bar.close()
                    callback.training_bar = None
            divergence.report(diverged, self.is_world_process_zero())

    def _training_loss_sum(self) -> float:
        """The sum of the losses of every step trained so far, resumed steps included (a host read)."""
        return self._logged_losses + float(self._losses.item())

    # uint8 -> normalised float, on the device ---------------------------------------------------------
    def _batch_on_device(self, inputs, training: bool):
        """The batch as the model takes it (for a training step or not): uint8 pixels copied to the device, then
        normalised there."""
        pixel_values = inputs.get("pixel_values") if isinstance(inputs, dict) else None
        if pixel_values is not None and pixel_values.dtype == torch.uint8:
            if self.image_mean is None or self.image_std is None:
                raise RuntimeError("uint8 pixel batches need the trainer's image_mean and image_std")
            pixels = pixel_values.to(self.args.device)
            inputs = {**inputs, "pixel_values": normalize_on_device(pixels, self.image_mean, self.image_std)}
        return inputs

    def prediction_step(self, model, inputs, *args, **kwargs):
        return super().prediction_step(model, self._batch_on_device(inputs, training=False), *args, **kwargs)

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

    # the batch fits the GPU, or one line ---------------------------------------------------------------
    def training_step(self, model, inputs, *args, **kwargs):
        if self._first_step is None:  # step 1 of this train() call, before its first forward pass
            self._first_step = self.state.global_step
            ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
            if gpu_memory.on_gpu(self.args) and ids is not None:
                self._memory_need = gpu_memory.check_batch_fits(self.model, int(ids.shape[-1]), self.args)
        loss = super().training_step(model, self._batch_on_device(inputs, training=True), *args, **kwargs)
        # The loss summed as the Trainer sums it (its --logging_nan_inf_filter included): the divergence watch's
        # and the checkpoints' loss sum
        if self.args.logging_nan_inf_filter and not torch.isfinite(loss):
            self._losses = self._losses + self._losses / (1 + self.state.global_step - self._last_logged_step)
        else:
            self._losses = self._losses + loss
        if self.accelerator.sync_gradients and self.args.max_grad_norm and self.args.max_grad_norm > 0:
            # the last micro-batch of the step: its gradients, before the Trainer clips them, give the step's norm
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        return loss

    def _out_of_memory_at_first_step(self, error: BaseException):
        """The one-line error for running out of GPU memory before this call's first optimizer step ended, else None."""
        if not gpu_memory.on_gpu(self.args) or self._first_step not in (None, self.state.global_step):
            return None
        return gpu_memory.out_of_memory_at_first_step(error, self.args, self._memory_need)

    # results -------------------------------------------------------------------------------------------
    @contextmanager
    def catching_signals(self):
        """SIGTERM/SIGINT caught from train() to the end of the final publication, the caller's handlers back after.

        During training a signal stops it at the next step with a checkpoint (`train`); after the last step it
        waits until the set being published is complete (`publishing`), so that no signal can lose a finished
        training. The handlers are put back when the block ends, whether or not a publication ended it.
        """
        if self._catching_signals:  # nested: the enclosing block catches them
            yield
            return
        self.stop_on_signal.install()
        self._catching_signals = True
        try:
            yield
        finally:
            self._catching_signals = False
            self.stop_on_signal.restore()

    def train(self, *args, **kwargs):
        # Inside `catching_signals` the handlers stay installed after a finished training: a signal then waits
        # until the final model is published. Called on its own, train() gives the caller's handlers back when
        # it returns, and with them a signal that arrived after the last step.
        self.stop_on_signal.install()
        self._first_step = None
        self.divergence.reset()
        self._losses, self._grad_norm = torch.zeros((), device=self.args.device), None
        # Rotation (--save_total_limit) is this trainer's, over the checkpoints runs wrote, once each manifest is
        # written (`_save_checkpoint`): the Trainer's own, which would delete any checkpoint-N, sees no limit.
        self.args.save_total_limit = None
        try:
            with _resumed_epoch_keeps_its_order(type(self)):
                result = super().train(*args, **kwargs)
            self._stop_if_diverged()  # the steps since the last check: nothing trained that diverged is published
        except ImageLoadError as error:
            self.stop_on_signal.restore()
            raise self._checkpoint_after_image_error(error) from None
        except torch.OutOfMemoryError as error:
            self.stop_on_signal.restore()
            one_line = self._out_of_memory_at_first_step(error)
            if one_line is None:
                raise
            raise one_line from None
        except BaseException:
            self.stop_on_signal.restore()
            raise
        finally:
            self.args.save_total_limit = self._save_total_limit
        best = self.state.best_model_checkpoint
        if self.args.should_save and best is not None and self._save_total_limit == 1:  # as the Trainer ends
            _delete_checkpoints(self._written_checkpoints(), keep=[best])
        interrupted = self.stop_on_signal.interruption(self.state, self.args.output_dir)
        if interrupted is not None:
            self.stop_on_signal.restore()
            self._end_the_run(interrupted)
        self.stop_on_signal.training_done = True
        if not self._catching_signals:
            self._hand_signals_back()
        result.metrics.update(self.throughput.metrics())  # one samples/s: ours, the same on every backend
        result.metrics["per_device_train_batch_size"] = self.args.per_device_train_batch_size
        result.metrics.update(self.run_facts)
        result.metrics.update(describe_run(self.args))
        return result

    def log_metrics(self, split, metrics):
        """The trainer's printed metrics, with the record's facts that do not apply here (None) shown as n/a, and
        each node's figures (a job on several nodes) on a line of their own."""
        shown = {key: "n/a" if value is None else value for key, value in metrics.items() if key != "per_node"}
        shown.update(node_line(node) for node in metrics.get("per_node", ()))
        return super().log_metrics(split, shown)

    # stopping cleanly -----------------------------------------------------------------------------------
    def _checkpoint_after_image_error(self, error: ImageLoadError) -> ImageLoadError:
        """Save a checkpoint of the last completed step; return the one-line error the run stops with.

        The failing batch is fetched before its step starts, so model and optimizer are exactly at
        `global_step`. With several processes nothing is saved here: the other ranks wait in a collective
        this rank will never join, so the run stops and resumes from its last regular checkpoint.
        """
        step = self.state.global_step
        if self.args.world_size == 1:
            self._stop_if_diverged()  # (no checkpoint of a diverged model; with several ranks none is saved here)
        if self.args.world_size > 1 or step == 0:
            return ImageLoadError(
                f"{error.reason} (training stopped before step {step + 1}; no checkpoint saved). Restore the image, "
                "or rerun with --drop_bad_rows to leave its rows out."
            )
        self._save_checkpoint(self.model, trial=None)
        checkpoint = os.path.join(self.args.output_dir, f"checkpoint-{step}")
        # Not "--drop_bad_rows and resume": a checkpoint resumed on other rows is another recipe (run_recipe.py)
        return ImageLoadError(
            f"{error.reason} (training stopped after step {step}; checkpoint saved in {checkpoint}). Restore the image "
            "and rerun the same command to resume, or rerun with --drop_bad_rows --overwrite_output_dir to train "
            "afresh without its rows."
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

    def _hand_signals_back(self) -> None:
        """Put the caller's handlers back; a signal caught since the last step goes to them now."""
        received = self.stop_on_signal.received
        self.stop_on_signal.restore()
        if received is not None:
            signal.raise_signal(received)

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

    def save_model(self, output_dir=None, *args, **kwargs):
        """The final model and its config, published with the rest of the set (see `publishing`), with its recipe.

        A checkpoint's weights (`_save_checkpoint`) are written in place: one counts only once its manifest,
        written last, matches every file.
        """
        if self._checkpoint_being_saved is not None:
            return super().save_model(output_dir, *args, **kwargs)
        held, self._holding_pushes = self._holding_pushes, True  # no push from a staging directory
        try:
            if output_dir is not None and os.path.realpath(output_dir) != os.path.realpath(self.args.output_dir):
                with run_directory.publication(output_dir, publish=self.args.should_save) as staging:
                    super().save_model(staging)
                    self._save_training_args(staging)
            else:
                with self.publishing() as staging:
                    self._publishing_model = True
                    super().save_model(staging)
                    self._save_training_args(staging)
                    if self.recipe is not None and self.args.should_save:
                        run_recipe.write(staging, self.recipe)
        finally:
            self._holding_pushes = held
        if self.args.push_to_hub and not held:  # (held: a push saving the model before it uploads)
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, *args, **kwargs):
        if self._holding_pushes:  # saving into a staging directory, or a push that saves the model first
            return None
        self._holding_pushes = True
        try:
            return super().push_to_hub(*args, **kwargs)
        finally:
            self._holding_pushes = False

    def _save_training_args(self, directory: str) -> None:
        """The training_args.bin the Trainer saved next to the weights, as the run's arguments are: no credential
        (--hub_token and the like are blanked in the saved copy; the run keeps the real value for pushing), and
        the run's --save_total_limit (the Trainer's own rotation is off while training)."""
        saved = without_secrets(self.args)
        if saved.save_total_limit != self._save_total_limit:
            saved = copy.copy(saved)
            saved.save_total_limit = self._save_total_limit
        path = os.path.join(directory, "training_args.bin")
        if saved is not self.args and self.args.should_save and os.path.exists(path):
            with atomic_path(path) as temporary:
                torch.save(saved, temporary)

    def save_processors(self, *processors) -> None:
        """save_pretrained() each of `processors` (tokenizer, image processor) into output_dir, with the set."""
        with self.publishing() as staging:
            if self.args.should_save:
                for processor in processors:
                    processor.save_pretrained(staging)

    def save_metrics(self, split, metrics, combined=True):
        """As Trainer.save_metrics ({split}_results.json, merged into all_results.json), published with the set.

        A new model's all_results.json starts afresh: the previous model's eval/test results do not describe it.
        Every record names the environment and versions it ran with (an evaluation alone too).
        """
        with self.publishing() as staging:
            if not self.is_world_process_zero():
                return
            if "device_type" not in metrics:  # (the train metrics hold it already: `train`)
                metrics = {**describe_run(self.args), **metrics}
            metrics = divergence.finite_or_none(metrics)  # (null, never a bare NaN: not JSON)
            with open(os.path.join(staging, f"{split}_results.json"), "w") as f:
                json.dump(metrics, f, indent=4, sort_keys=True, allow_nan=False)
            if combined:  # merged into this set's all_results.json, else the published one (unless replaced)
                path = os.path.join(staging, "all_results.json")
                if not os.path.exists(path) and not self._publishing_model:
                    path = os.path.join(self.args.output_dir, "all_results.json")
                combined_metrics = {}
                if os.path.exists(path):
                    with open(path) as f:
                        combined_metrics = json.load(f)
                with open(os.path.join(staging, "all_results.json"), "w") as f:
                    json.dump(
                        divergence.finite_or_none({**combined_metrics, **metrics}),
                        f,
                        indent=4,
                        sort_keys=True,
                        allow_nan=False,
                    )

    def save_state(self):
        with self.publishing() as staging:
            if self.is_world_process_zero():
                self._finite_state()
                self.state.save_to_json(os.path.join(staging, "trainer_state.json"))

    def log(self, logs, *args, **kwargs):
        """As Trainer.log, with null for a non-finite number (an evaluation of a broken model): the log history
        goes into trainer_state.json, which must stay JSON.

        The end of a resumed training (`train_loss` in the train metrics, the dict `train()` returns) averages
        every step of the run: the Trainer's sum starts at the resume, the checkpoint's sum adds the steps before.
        That summary loses the Trainer's own samples and steps per second (warm-up included): the run reports
        one throughput, the kit's (`train`), on every backend.
        """
        if "train_loss" in logs and self._resumed_loss_sum is not None:
            logs["train_loss"] = self._training_loss_sum() / max(self.state.global_step, 0.001)
        if "train_runtime" in logs:
            logs.pop("train_samples_per_second", None)
            logs.pop("train_steps_per_second", None)
        return super().log(divergence.finite_or_none(logs), *args, **kwargs)

    def _finite_state(self) -> None:
        """The trainer state's numbers that reach trainer_state.json, finite or null."""
        self.state.log_history = divergence.finite_or_none(self.state.log_history)
        self.state.best_metric = divergence.finite_or_none(self.state.best_metric)

    # ownership: what this run writes into output_dir is recorded first ---------------------------------
    def _save_checkpoint(self, model, trial):
        """As the backend's, then the recipe and, last, the manifest: the checkpoint counts from then on; then
        rotation (--save_total_limit) over the checkpoints runs wrote."""
        run_dir = self.args.output_dir
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            run_directory.record_written(run_dir, [os.path.basename(checkpoint)])
            checkpoint_manifest.remove(checkpoint)  # (a directory of the same name being written again)
        # (found anew: with --restore_callback_states_from_checkpoint the Trainer replaces it when resuming)
        loss_sum = next(
            callback for callback in self.callback_handler.callbacks if isinstance(callback, TrainingLossSum)
        )
        loss_sum.loss_sum = self._training_loss_sum()
        # (a state resumed from a checkpoint without it has no entry, which the Trainer's save expects)
        self.state.stateful_callbacks.setdefault(type(loss_sum).__name__, loss_sum.state())
        self._finite_state()
        with disk_space.removed_when_disk_full(
            checkpoint, "a checkpoint", after=lambda: _resume_from(run_dir, self.recipe)
        ):
            self._checkpoint_being_saved = checkpoint
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._checkpoint_being_saved = None
            if self.args.world_size > 1 and torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank's RNG state is saved
            if not self.args.should_save:
                return
            self._save_training_args(checkpoint)
            if self.recipe is not None:
                run_recipe.write(checkpoint, self.recipe)
            required = checkpoint_manifest.required_files(
                save_only_model=self.args.save_only_model,
                world_size=self.args.world_size,
                save_on_each_node=self.args.save_on_each_node,
            )
            if self.recipe is not None:
                required.append(run_recipe.RECIPE_NAME)
            problem = checkpoint_manifest.write(checkpoint, required)
            if problem is not None:  # (the older checkpoints are kept: this one cannot replace them)
                logger.warning(f"{checkpoint} does not count for resuming: {problem}")
                return
        self._rotate_checkpoints_written()

    def _written_checkpoints(self) -> list[str]:
        """The checkpoints in output_dir that runs of these scripts wrote, by step."""
        written = set(run_directory.read_record(self.args.output_dir)["written"])
        return [path for path in run_directory.checkpoints(self.args.output_dir) if os.path.basename(path) in written]

    def _rotate_checkpoints_written(self) -> None:
        """--save_total_limit as the Trainer keeps it (the newest, and the best one before it), over ours only."""
        limit, best = self._save_total_limit, self.state.best_model_checkpoint
        checkpoints = self._written_checkpoints()
        if not limit or limit <= 0 or len(checkpoints) <= limit:
            return
        best = os.path.join(self.args.output_dir, os.path.basename(best)) if best is not None else None
        if best in checkpoints[:-1]:  # kept second to last, so that the newest stays to resume from
            checkpoints.remove(best)
            checkpoints.insert(len(checkpoints) - 1, best)
            limit = max(limit, 2)
        _delete_checkpoints(checkpoints[: len(checkpoints) - limit])

    def create_model_card(self, *args, **kwargs):
        if self.is_world_process_zero():
            run_directory.record_written(self.args.output_dir, ["README.md"])
        return super().create_model_card(*args, **kwargs)


class TrainingLossSum(TrainerCallback, ExportableState):
    """The sum of every step's training loss, kept in each checkpoint's trainer_state.json.

    The Trainer's `train_loss` is its running loss sum over the steps, but a resumed run's sum starts at 0 at
    the resume: the mean would count only the steps after it. The trainer writes the sum into this callback
    before each checkpoint (`loss_sum`, saved as its state); a resumed training starts its sum from it
    (`saved_in`), so `train_loss` is the mean over all steps of the run. A checkpoint without it (an earlier
    version's) resumes as before, with a warning.
    """

    def __init__(self, loss_sum: float = 0.0):
        self.loss_sum = float(loss_sum)

    def state(self) -> dict:
        return {"args": {"loss_sum": self.loss_sum}, "attributes": {}}

    @classmethod
    def saved_in(cls, state) -> Optional[float]:
        """The loss sum the resumed checkpoint's state holds; None for a fresh start or a checkpoint without it."""
        if state.global_step == 0:
            return None
        saved = state.stateful_callbacks.get(cls.__name__)
        saved = saved[0] if isinstance(saved, list) and saved else saved
        if not isinstance(saved, dict) or "loss_sum" not in saved.get("args", {}):
            logger.warning(
                "the checkpoint resumed does not hold the loss sum of its steps: train_loss will average "
                "only the steps trained from now on"
            )
            return None
        return float(saved["args"]["loss_sum"])


class _AfterEachStep(TrainerCallback):
    """The trainer's own callback, added last: at the end of each optimizer step and epoch, what the callbacks
    decided (log, save, evaluate) is known and not yet done."""

    def __init__(self, trainer: TrainerExtensions):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._training_begins(state)

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._after_step(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.trainer._after_step(control)


@contextmanager
def _resumed_epoch_keeps_its_order(trainer_class):
    """While training: accelerate's skip_first_batches, as the Trainer calls it, keeping the epoch.

    Resumed mid-epoch, transformers 4.55 (and GaudiTrainer) sets the epoch on its data loader (the sampler
    draws epoch e's order from the seed + e), then skips the batches already trained with
    `skip_first_batches`, which builds a new loader whose epoch counter starts at 0; at its first batch that
    loader sets the sampler's epoch to 0 again. A run resumed in its second or later epoch then trained on the
    first epoch's order. Here the new loader takes the epoch of the one it skips in: the same order as an
    uninterrupted run. Nothing else changes: an uninterrupted run never skips batches. (Swapped only in the
    modules of this trainer's own classes, only while this trainer trains. transformers 5.x sets the epoch on
    the skipping loader itself, after `get_resumed_dataloader`: there the swap changes nothing.)
    """
    original = accelerate.skip_first_batches

    def skip_first_batches(dataloader, num_batches=0):
        skipping = original(dataloader, num_batches)
        if hasattr(dataloader, "iteration") and hasattr(skipping, "iteration"):
            skipping.iteration = dataloader.iteration  # the epoch set_epoch gave the loader it skips in
        return skipping

    modules = {sys.modules[cls.__module__] for cls in trainer_class.__mro__ if cls.__module__ in sys.modules}
    swapped = [module for module in modules if getattr(module, "skip_first_batches", None) is original]
    for module in swapped:
        module.skip_first_batches = skip_first_batches
    try:
        yield
    finally:
        for module in swapped:
            module.skip_first_batches = original


def _delete_checkpoints(checkpoints: list[str], keep=()) -> None:
    for checkpoint in checkpoints:
        if not any(os.path.exists(kept) and os.path.samefile(checkpoint, kept) for kept in keep):
            logger.info(f"Deleting older checkpoint [{checkpoint}] due to args.save_total_limit")
            shutil.rmtree(checkpoint, ignore_errors=True)


def _last_complete_checkpoint_if_any(output_dir: str, recipe=None):
    """The newest complete checkpoint in output_dir (of `recipe`, when given), or None (also when output_dir does
    not exist yet)."""

    def another_recipe(checkpoint: str) -> Optional[str]:
        return None if run_recipe.read(checkpoint) == recipe else "saved by another recipe"

    return run_directory.newest_complete_checkpoint(output_dir, None if recipe is None else another_recipe)[0]


def _resume_from(output_dir: str, recipe=None) -> str:
    """What a run stopped by a full disk can resume from, for its one-line message."""
    last = _last_complete_checkpoint_if_any(output_dir, recipe)
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


class SummedAccumulation:
    """Gradient accumulation as GaudiTrainer does it, for the CUDA script's Trainer: the micro-batches' losses are
    summed, not divided by the accumulation steps first. optimum-habana 1.21.2's `training_step` divides only
    with lazy mode and `--pipelining_fwd_bwd` (a Gaudi-only flag the CUDA script refuses); transformers'
    divides by `current_gradient_accumulation_steps`, which this step sees as 1. Same gradients, same clipping,
    same logged loss (the sum of a step's micro-batch losses) on both backends."""

    def training_step(self, model, inputs, *args, **kwargs):
        steps, self.current_gradient_accumulation_steps = self.current_gradient_accumulation_steps, 1
        try:
            return super().training_step(model, inputs, *args, **kwargs)
        finally:
            self.current_gradient_accumulation_steps = steps

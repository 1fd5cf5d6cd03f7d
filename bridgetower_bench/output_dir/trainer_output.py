"""`TrainerOutput`, the trainer's way into --output_dir, mixed in behind `trainer.TrainerExtensions`: the saves the
Trainer makes (the final set, each checkpoint, the model card, a push) handed to `RunOutput`, and a run stopped by a
signal ended once what it saved is published. What it asks of the trainer (trainer.py): `stop_on_signal` and
`catching_signals()` (the signals caught), `_stop_if_diverged()`, `_loss_sum_into_state()` and
`_loss_sum_saved_in(state)` (the loss summed over every step, kept in each checkpoint)."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Optional

import torch
import transformers
from transformers import TrainerState

from bridgetower_bench.guards import divergence
from bridgetower_bench.guards.resilience import ImageLoadError, StopOnSignal, report_and_exit
from bridgetower_bench.measurement.run_record import describe_run
from bridgetower_bench.output_dir.run_output import RunOutput


# Mixed in front of a Trainer (transformers' or GaudiTrainer): the type checker reads it as one.
if TYPE_CHECKING:
    _Trainer = transformers.Trainer
else:
    _Trainer = object


class TrainerOutput(_Trainer):
    # what it asks of the trainer (trainer.TrainerExtensions): declared for the type checker only
    stop_on_signal: StopOnSignal
    catching_signals: Callable[[], AbstractContextManager]
    _stop_if_diverged: Callable[[], None]
    _loss_sum_saved_in: Callable[[TrainerState], Optional[float]]

    def __init__(self, *args, recipe=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_output = RunOutput(self.args, recipe)  # everything written into output_dir goes through it
        self._holding_pushes = False  # a push waits until the set being saved is published (`save_model`)

    def publish_checkpoint(self, checkpoint: str, *processors) -> dict:
        """Publish, not training again, the run the checkpoint at the recipe's last step ends (run_recipe.RunPlan's
        publish_from): the model this trainer was given (loaded from it, or from its best checkpoint), its state, and
        the trained run's train_loss from the loss sum it holds. Returns the train metrics."""
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        loss_sum = self._loss_sum_saved_in(self.state)
        metrics = {
            "train_loss": None if loss_sum is None else loss_sum / max(self.state.global_step, 0.001),
            "epoch": self.state.epoch,
            "total_flos": self.state.total_flos,
            "published_from": os.path.basename(checkpoint),
        }
        with self.catching_signals(), self.publishing():
            self.save_model()
            self.save_processors(*processors)
            self.save_metrics("train", metrics)
            self.save_state()
        return metrics

    def _checkpoint_after_image_error(self, error: ImageLoadError) -> ImageLoadError:
        """The one-line error the run stops with, after a checkpoint of the last completed step (the failing batch
        is fetched before its step starts); none with several processes, whose other ranks wait in a collective."""
        step = self.state.global_step
        if self.args.world_size == 1:
            self._stop_if_diverged()  # (no checkpoint of a diverged model; with several ranks none is saved here)
        if self.args.world_size > 1 or step == 0:
            return ImageLoadError(
                f"{error.reason} (training stopped before step {step + 1}; no checkpoint saved). Restore the image, "
                "or rerun with --drop_bad_rows to leave its rows out."
            )
        self._save_checkpoint(self.model, trial=None)
        assert self.args.output_dir is not None  # (TrainingArguments gives it a default)
        checkpoint = os.path.join(self.args.output_dir, f"checkpoint-{step}")
        # Not "--drop_bad_rows and resume": a checkpoint resumed on other rows is another recipe (run_recipe.py)
        return ImageLoadError(
            f"{error.reason} (training stopped after step {step}; checkpoint saved in {checkpoint}). Restore the image "
            "and rerun the same command to resume, or rerun with --drop_bad_rows --overwrite_output_dir to train "
            "afresh without its rows."
        )

    @contextmanager
    def publishing(self):
        """What save_model, save_processors, save_metrics and save_state save inside it appears in output_dir as one
        set, or not at all (each alone outside one); a signal meanwhile ends the run once the set is published."""
        if self.run_output.staging is not None:  # nested: part of the enclosing publication
            yield self.run_output.staging
            return
        self.stop_on_signal.install()
        try:
            with self.run_output.published() as staging:
                yield staging
        finally:
            self.stop_on_signal.restore()
        self._end_the_run(self.stop_on_signal.stopped_after_saving(self.args.output_dir))

    def _end_the_run(self, interrupted) -> None:
        """Stopped by a signal: exit with 128 + signal once every rank is here (launchers end a job at one exit)."""
        if interrupted is None:
            return
        self.stop_on_signal.restore()
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
        report_and_exit(interrupted, self.is_world_process_zero())

    def save_model(self, output_dir=None, *args, **kwargs):
        """The final model, published with the set and its recipe; a checkpoint's weights are written in place."""
        if self.run_output.checkpoint_being_saved is not None:
            return super().save_model(output_dir, *args, **kwargs)
        held, self._holding_pushes = self._holding_pushes, True  # no push from a staging directory
        try:
            with self.run_output.final_model(output_dir, self.publishing) as staging:
                super().save_model(staging)
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

    def save_processors(self, *processors) -> None:
        """Each of `processors` (tokenizer, image processor) saved with the set."""
        with self.publishing() as staging:
            if self.args.should_save:
                for processor in processors:
                    processor.save_pretrained(staging)

    def save_metrics(self, split, metrics, combined=True):
        """As Trainer.save_metrics, published with the set; a new model's all_results.json starts afresh."""
        with self.publishing():
            if not self.is_world_process_zero():
                return
            if "device_type" not in metrics:  # (the train metrics hold it already: `train`)
                metrics = {**describe_run(self.args), **metrics}
            self.run_output.results(split, metrics, combined)

    def save_state(self):
        with self.publishing() as staging:
            if self.is_world_process_zero():
                self._finite_state()
                self.state.save_to_json(os.path.join(staging, "trainer_state.json"))

    def _finite_state(self) -> None:
        self.state.log_history = divergence.finite_or_none(self.state.log_history)
        self.state.best_metric = divergence.finite_or_none(self.state.best_metric)

    def _save_checkpoint(self, model, trial):
        """As the backend's, the loss sum in its state, inside the run directory's checkpoint (`RunOutput.checkpoint`:
        recorded first; the recipe and, last, the manifest; then rotation over the checkpoints runs wrote)."""
        self._loss_sum_into_state()
        self._finite_state()
        with self.run_output.checkpoint(self.state):
            super()._save_checkpoint(model, trial)

    def create_model_card(self, *args, **kwargs):
        if self.is_world_process_zero():
            self.run_output.model_card()
        return super().create_model_card(*args, **kwargs)

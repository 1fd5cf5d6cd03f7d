"""`TrainerExtensions`, mixed in front of both scripts' trainers, and `SummedAccumulation`: what they add and the
Trainer names they reach (public ones, but `_get_train_sampler` here and `_save_checkpoint` in its saves,
output_dir/trainer_output.py), docs/ARCHITECTURE.md ("Runtime wing", "Private APIs of other libraries")."""

from __future__ import annotations

import logging
import signal
import sys
import time
from contextlib import contextmanager
from typing import Optional

import accelerate
import torch
import transformers
from torch.utils.data import RandomSampler
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from bridgetower_bench import gaudi_configuration
from bridgetower_bench.guards import divergence, gpu_memory
from bridgetower_bench.guards.resilience import ImageLoadError, StopOnSignal
from bridgetower_bench.images.images import jpeg_decoder, normalize_on_device
from bridgetower_bench.measurement.energy import EnergyMeter
from bridgetower_bench.measurement.run_record import describe_run
from bridgetower_bench.measurement.throughput import ThroughputCallback, node_line
from bridgetower_bench.output_dir.trainer_output import TrainerOutput


logger = logging.getLogger(__name__)


class TrainerExtensions(TrainerOutput):
    """What the kit adds to the backend's trainer; its saves into --output_dir: `TrainerOutput` (a `recipe=` given
    to the trainer goes there)."""

    _losses: torch.Tensor  # set by `train()`
    _grad_norm: Optional[torch.Tensor]

    def __init__(
        self,
        *args,
        image_mean=None,
        image_std=None,
        loader="torch",
        image_pipeline="upstream",
        gaudi_config_file=None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.image_mean = tuple(image_mean) if image_mean is not None else None
        self.image_std = tuple(image_std) if image_std is not None else None
        self.run_facts = {
            "loader": loader,
            "image_pipeline": image_pipeline,
            # the host pipelines' JPEG decoder (upstream's decodes as upstream does; the HPU decodes the media pipeline's)
            "jpeg_decoder": None if image_pipeline == "upstream" or loader == "mediapipe" else jpeg_decoder(),
            "attn_implementation": getattr(self.args, "attn_implementation", "eager"),
            "compile_layers": getattr(self.args, "compile_layers", None) or "no",
            "logging_nan_inf_filter": bool(self.args.logging_nan_inf_filter),  # True: the host waits every step
        }
        if hasattr(self, "gaudi_config"):  # GaudiTrainer: the Gaudi configuration as it decided to use it
            gaudi = gaudi_configuration.effective(
                self.gaudi_config, gaudi_config_file or {}, self.use_hpu_amp or self.use_cpu_amp, self.args.use_habana
            )
            logger.warning(gaudi_configuration.describe(gaudi))
            self.run_facts.update(gaudi)
        self.throughput = ThroughputCallback(
            warmup_steps=getattr(self.args, "throughput_warmup_steps", 0) or 0,
            world_size=self.args.world_size,
            energy=EnergyMeter.for_device(self.args.device, self.args.world_size),
            gather=lambda tensor: self.accelerator.gather(tensor),
        )
        self.stop_on_signal = StopOnSignal()
        self.divergence = divergence.DivergenceWatch()
        for callback in (self.throughput, self.stop_on_signal, TrainingLossSum(), _AfterEachStep(self)):
            self.add_callback(callback)  # _AfterEachStep last: it sees what the other callbacks decided
        self._resumed_loss_sum = None  # the losses of the steps resumed from, when the checkpoint holds them
        self._catching_signals = False  # inside `catching_signals()`: a finished training waits for its publication
        self._memory_need = None  # the known memory need of this run's batch on a GPU (gpu_memory.py)
        # in a resumed epoch whose last window `_sync_the_last_micro_batch` mends: [micro-batches left, the size of
        # its last window, --gradient_accumulation_steps]
        self._resumed_epoch = None

    def _get_train_sampler(self, *args, **kwargs):
        """On one device, an epoch drawn up to whole batches as GaudiTrainer draws it: both scripts train on the same."""
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

    def _training_begins(self, state) -> None:
        """The resumed checkpoint's state is loaded: the losses so far (the logged sum) start ours, as the Trainer's."""
        self._last_logged_step = state.global_step
        self._resumed_loss_sum = TrainingLossSum.saved_in(state)
        self._logged_losses = self._resumed_loss_sum or 0.0

    def _after_step(self, control) -> None:
        """Once the callbacks decided what follows a step: a non-finite one ends the run before anything logs it."""
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
            self.state.max_steps, self.args.output_dir, self.run_output.last_complete, world_size=self.args.world_size
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

    def _batch_on_device(self, inputs, training: bool):
        """uint8 pixels copied to the device, then normalised there (the loader ships 4x fewer bytes, no float math)."""
        pixel_values = inputs.get("pixel_values") if isinstance(inputs, dict) else None
        if pixel_values is not None and pixel_values.dtype == torch.uint8:
            if self.image_mean is None or self.image_std is None:
                raise RuntimeError("uint8 pixel batches need the trainer's image_mean and image_std")
            pixels = pixel_values.to(self.args.device)
            inputs = {**inputs, "pixel_values": normalize_on_device(pixels, self.image_mean, self.image_std)}
        return inputs

    def prediction_step(self, model, inputs, *args, **kwargs):
        return super().prediction_step(model, self._batch_on_device(inputs, training=False), *args, **kwargs)

    # data-wait timing: Trainer fetches through get_batch_samples, GaudiTrainer through get_batch_samples_transformers
    def _timed_fetch(self, fetch, *args, **kwargs):
        start = time.perf_counter()
        batches, num_items = fetch(*args, **kwargs)
        seconds = time.perf_counter() - start
        ids = [batch.get("input_ids") if isinstance(batch, dict) else None for batch in batches]
        self.throughput.record_fetch(seconds, sum(int(i.shape[0]) for i in ids if i is not None))
        if self._resumed_epoch is not None and self._resumed_epoch[0] == len(batches) == 1:
            self._sync_the_last_micro_batch()  # (the resumed epoch holds nothing but it)
        return batches, num_items

    def get_batch_samples(self, *args, **kwargs):
        return self._timed_fetch(super().get_batch_samples, *args, **kwargs)

    def get_batch_samples_transformers(self, *args, **kwargs):
        return self._timed_fetch(super().get_batch_samples_transformers, *args, **kwargs)

    def training_step(self, model, inputs, *args, **kwargs):
        if self._first_step is None:  # step 1 of this train() call, before its first forward pass: the batch fits
            self._first_step = self.state.global_step
            ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
            if gpu_memory.on_gpu(self.args) and ids is not None:
                self._memory_need = gpu_memory.check_batch_fits(self.model, int(ids.shape[-1]), self.args)
        loss = super().training_step(model, self._batch_on_device(inputs, training=True), *args, **kwargs)
        self._micro_batch_trained()
        # the loss summed as the Trainer sums it (--logging_nan_inf_filter included), for divergence and checkpoints
        if self.args.logging_nan_inf_filter and not torch.isfinite(loss):
            self._losses = self._losses + self._losses / (1 + self.state.global_step - self._last_logged_step)
        else:
            self._losses = self._losses + loss
        if self.accelerator.sync_gradients and self.args.max_grad_norm and self.args.max_grad_norm > 0:
            # the last micro-batch of the step: its gradients, before the Trainer clips them, give the step's norm
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        return loss

    def _skipped_into_epoch(self, in_epoch: int, skipped: int) -> None:
        """A resumed epoch skips its first `skipped` of `in_epoch` micro-batches. transformers 4.55's and
        GaudiTrainer 1.21's loop then counts the rest from 0 while it still syncs the epoch's last, partial
        window only at micro-batch `in_epoch`: it never does, and that window's gradient joins the next epoch's
        first step. `_sync_the_last_micro_batch` mends it; transformers 5 counts the skipped ones."""
        ga = self.args.gradient_accumulation_steps
        if int(transformers.__version__.split(".")[0]) < 5 and in_epoch % ga and skipped < in_epoch:
            self._resumed_epoch = [in_epoch - skipped, in_epoch % ga, ga]

    def _sync_the_last_micro_batch(self) -> None:
        """Before the resumed epoch's last micro-batch, number `left` of the loop's count: the loop syncs a
        micro-batch whose count is a multiple of args.gradient_accumulation_steps (read afresh each micro-batch)
        and begins a step at one whose count before it is. `left` syncs it without beginning a step inside the
        window; 1 for a window of that micro-batch alone, which begins its step. Put back once it is trained."""
        left, last_window, _ = self._resumed_epoch
        self.args.gradient_accumulation_steps = 1 if last_window == 1 else left

    def _micro_batch_trained(self) -> None:
        if self._resumed_epoch is None:
            return
        self._resumed_epoch[0] -= 1
        if self._resumed_epoch[0] == 1:
            self._sync_the_last_micro_batch()
        elif self._resumed_epoch[0] <= 0:
            self._resumed_epoch_ended()

    def _resumed_epoch_ended(self) -> None:
        if self._resumed_epoch is not None:
            self.args.gradient_accumulation_steps = self._resumed_epoch[2]
            self._resumed_epoch = None

    @contextmanager
    def catching_signals(self):
        """SIGTERM/SIGINT caught from train() to the end of the final publication, the caller's handlers back after."""
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
        self.stop_on_signal.install()
        self._first_step = None  # global step at this call's first training step
        self.divergence.reset()
        # on the device (`training_step`): the loss summed since the last logging step, as the Trainer sums it, and
        # the last step's gradient norm before clipping (the logged sum: `_training_begins`)
        self._losses, self._grad_norm = torch.zeros((), device=self.args.device), None
        with self.run_output.training():
            try:
                with _resumed_epoch_keeps_its_order(type(self), self._skipped_into_epoch):
                    result = super().train(*args, **kwargs)
                self._stop_if_diverged()  # the steps since the last check: nothing trained that diverged is published
            except BaseException as error:
                self._resumed_epoch_ended()
                self.stop_on_signal.restore()
                if isinstance(error, ImageLoadError):
                    raise self._checkpoint_after_image_error(error) from None
                if isinstance(error, torch.OutOfMemoryError) and gpu_memory.on_gpu(self.args):
                    if self._first_step in (None, self.state.global_step):  # before this call's first step ended
                        raise gpu_memory.out_of_memory_at_first_step(error, self.args, self._memory_need) from None
                raise
        self.run_output.trained(self.state.best_model_checkpoint)
        self._end_the_run(self.stop_on_signal.interruption(self.state, self.args.output_dir))
        self.stop_on_signal.training_done = True
        if not self._catching_signals:  # the caller's handlers back, with a signal caught since the last step
            received = self.stop_on_signal.received
            self.stop_on_signal.restore()
            if received is not None:
                signal.raise_signal(received)
        result.metrics.update(self.throughput.metrics())  # one samples/s: ours, the same on every backend
        result.metrics["per_device_train_batch_size"] = self.args.per_device_train_batch_size
        result.metrics.update(self.run_facts)
        result.metrics.update(describe_run(self.args))
        return result

    def log_metrics(self, split, metrics):
        """As the Trainer prints them, None as n/a and each node's figures (several nodes) on a line of their own."""
        shown = {key: "n/a" if value is None else value for key, value in metrics.items() if key != "per_node"}
        shown.update(node_line(node) for node in metrics.get("per_node", ()))
        return super().log_metrics(split, shown)

    def evaluate(self, *args, **kwargs):
        with _one_line_image_errors():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with _one_line_image_errors():
            return super().predict(*args, **kwargs)

    def log(self, logs, *args, **kwargs):
        """As Trainer.log, non-finite numbers as null (trainer_state.json stays JSON); a resumed run's `train_loss`
        over every step; the Trainer's own samples and steps per second (warm-up included) left to the kit's."""
        if "train_loss" in logs and self._resumed_loss_sum is not None:
            logs["train_loss"] = self._training_loss_sum() / max(self.state.global_step, 0.001)
        if "train_runtime" in logs:
            logs.pop("train_samples_per_second", None)
            logs.pop("train_steps_per_second", None)
        return super().log(divergence.finite_or_none(logs), *args, **kwargs)

    def _loss_sum_into_state(self) -> None:
        """Before a checkpoint is saved (`TrainerOutput._save_checkpoint`): the loss sum so far into its state."""
        # (found anew: with --restore_callback_states_from_checkpoint the Trainer replaces it when resuming)
        loss_sum = next(c for c in self.callback_handler.callbacks if isinstance(c, TrainingLossSum))
        loss_sum.loss_sum = self._training_loss_sum()
        # (a state resumed from a checkpoint without it has no entry, which the Trainer's save expects; a dict once
        # TrainerState is built, whatever transformers' annotation says)
        self.state.stateful_callbacks.setdefault(type(loss_sum).__name__, loss_sum.state())  # type: ignore[attr-defined]

    @staticmethod
    def _loss_sum_saved_in(state) -> Optional[float]:
        return TrainingLossSum.saved_in(state)


class TrainingLossSum(TrainerCallback, ExportableState):
    """The sum of every step's training loss, kept in each checkpoint's trainer_state.json: the Trainer's own sum
    starts at 0 when a run resumes."""

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
    """Added last: at each step's and epoch's end, what the callbacks decided is known and not yet done."""

    def __init__(self, trainer: TrainerExtensions):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._training_begins(state)

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._after_step(control)

    on_epoch_end = on_step_end


@contextmanager
def _resumed_epoch_keeps_its_order(trainer_class, skipped_into_epoch):
    """While training, in the modules of the trainer's classes: accelerate's skip_first_batches handing the new
    loader the epoch of the one it skips in (why: docs/ARCHITECTURE.md, "Private APIs of other libraries"), and
    telling `skipped_into_epoch(micro-batches in the epoch, skipped)`."""
    original = accelerate.skip_first_batches

    def skip_first_batches(dataloader, num_batches=0):
        if hasattr(dataloader, "__len__"):
            skipped_into_epoch(len(dataloader), num_batches)
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


@contextmanager
def _one_line_image_errors():
    """An ImageLoadError re-raised from a DataLoader worker carries the worker's traceback: keep its message only."""
    try:
        yield
    except ImageLoadError as error:
        raise ImageLoadError(error.reason) from None


class SummedAccumulation:
    """The CUDA script's gradient accumulation as GaudiTrainer's (optimum-habana 1.21): the micro-batches' losses summed."""

    def training_step(self, model, inputs, *args, **kwargs):
        steps, self.current_gradient_accumulation_steps = self.current_gradient_accumulation_steps, 1
        try:
            return super().training_step(model, inputs, *args, **kwargs)
        finally:
            self.current_gradient_accumulation_steps = steps

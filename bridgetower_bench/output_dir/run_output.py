"""`RunOutput`: what a training run writes into --output_dir, at the moments the trainer (trainer.py) names: while
it trains, each checkpoint saved, when training ends, the final set published; and the checkpoint a run stopped by
a divergence or a full disk can resume from (docs/ARCHITECTURE.md, "`--output_dir`, from step 1 to the
publication")."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Optional

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from bridgetower_bench.guards.divergence import finite_or_none
from bridgetower_bench.output_dir import checkpoint_manifest, disk_space, run_directory, run_recipe
from bridgetower_bench.output_dir.atomic_files import atomic_path, read_json
from bridgetower_bench.redaction import without_secrets


logger = logging.getLogger(__name__)


# The arguments the kit changes while a run trains, kept as given in RunOutput's attributes of the same names
_AS_GIVEN = ("save_total_limit", "gradient_accumulation_steps")


class RunOutput:
    """The trainer's one way into --output_dir. `args`: the trainer's TrainingArguments; `recipe`: what makes this
    run's model (run_recipe.describe), saved with it and every checkpoint, or None."""

    def __init__(self, args, recipe: Optional[dict] = None):
        self.args = args
        self.recipe = recipe
        self.save_total_limit = args.save_total_limit  # the run's; the Trainer's own rotation is off (`training`)
        # the run's; the trainer mends it for a resumed epoch's last accumulation window (trainer.py)
        self.gradient_accumulation_steps = args.gradient_accumulation_steps
        self.staging: Optional[str] = None  # inside `published()`: where the files being published are saved
        self.checkpoint_being_saved: Optional[str] = None  # inside `checkpoint()`: its directory
        self._publishing_model = False  # the set being published holds a new model (`final_model`)

    @contextmanager
    def training(self) -> Iterator[None]:
        """While train() runs: the Trainer's rotation and end-of-training deletion off (ours follows each manifest)."""
        self.args.save_total_limit = None
        try:
            yield
        finally:
            self.args.save_total_limit = self.save_total_limit

    def trained(self, best_checkpoint: Optional[str]) -> None:
        """Training ended: with --save_total_limit 1, only the best checkpoint is kept, as the Trainer ends."""
        if self.args.should_save and best_checkpoint is not None and self.save_total_limit == 1:
            _delete_checkpoints(self._written_checkpoints(), keep=[best_checkpoint])

    @contextmanager
    def checkpoint(self, state) -> Iterator[str]:
        """Around the backend's save of the checkpoint of `state.global_step` (its directory yielded): its name recorded
        before it is written; then the run's training arguments, the recipe and, last, the manifest: the checkpoint
        counts from then on; then rotation (--save_total_limit) over the checkpoints runs wrote. A full disk meanwhile
        removes it and ends the run in one line naming what is left to resume from."""
        checkpoint = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if self.args.should_save:
            run_directory.record_written(self.args.output_dir, [os.path.basename(checkpoint)])
            checkpoint_manifest.remove(checkpoint)  # (a directory of the same name being written again)
        with disk_space.removed_when_disk_full(checkpoint, "a checkpoint", after=self._resume_from):
            self.checkpoint_being_saved = checkpoint
            try:
                yield checkpoint
            finally:
                self.checkpoint_being_saved = None
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
        self._rotate(state.best_model_checkpoint)

    @contextmanager
    def published(self) -> Iterator[str]:
        """The final set: what is saved into the staging directory yielded (also `staging` meanwhile) appears in
        output_dir together, or not at all."""
        try:
            with run_directory.publication(self.args.output_dir, publish=self.args.should_save) as staging:
                self.staging = staging
                yield staging
        finally:
            self.staging, self._publishing_model = None, False

    @contextmanager
    def final_model(
        self, output_dir: Optional[str], publishing: Callable[[], AbstractContextManager]
    ) -> Iterator[str]:
        """Where save_model(output_dir) saves a model outside a checkpoint (yielded): a staging directory of the run's
        set (`publishing()`, the trainer's way into `published()`), published with the recipe; another directory's
        set is published on its own. Either holds the run's training arguments."""
        elsewhere = output_dir is not None and os.path.realpath(output_dir) != os.path.realpath(self.args.output_dir)
        publication = None
        if output_dir is not None and elsewhere:
            publication = run_directory.publication(output_dir, publish=self.args.should_save)
        with publication or publishing() as staging:
            yield staging
            self._save_training_args(staging)
            if not elsewhere:
                self._publishing_model = True
                if self.recipe is not None and self.args.should_save:
                    run_recipe.write(staging, self.recipe)

    def results(self, split: str, metrics: dict, combined: bool = True) -> None:
        """`<split>_results.json` into the set being published; with `combined`, merged into this set's
        all_results.json, else the published one (a new model's starts afresh; a published one gone is gathered
        again from the published results of training, validation and test)."""
        staging = self.staging
        assert staging is not None  # (inside `published()`)
        _write_json(os.path.join(staging, f"{split}_results.json"), metrics)
        if combined:
            combined_metrics = read_json(os.path.join(staging, "all_results.json"))
            if combined_metrics is None and not self._publishing_model:
                combined_metrics = self._published_results()
            _write_json(os.path.join(staging, "all_results.json"), {**(combined_metrics or {}), **metrics})

    def _published_results(self) -> dict:
        """The published all_results.json; when it is gone, what the published results of each split hold."""
        published = os.path.join(self.args.output_dir, "{}_results.json")
        combined = read_json(published.format("all"))
        if combined is None:
            splits = ("train", "validation", "test")
            combined = {
                key: value for split in splits for key, value in read_json(published.format(split), {}).items()
            }
        return combined

    def model_card(self) -> None:
        """Before the model card (README.md) is written: it counts among what runs wrote."""
        run_directory.record_written(self.args.output_dir, ["README.md"])

    def last_complete(self) -> Optional[str]:
        """The newest complete checkpoint in output_dir (of this run's recipe, when it has one), or None."""

        def another_recipe(checkpoint: str) -> Optional[str]:
            return None if run_recipe.read(checkpoint) == self.recipe else "saved by another recipe"

        refuse = None if self.recipe is None else another_recipe
        return run_directory.newest_complete_checkpoint(self.args.output_dir, refuse)[0]

    def _resume_from(self) -> str:
        """What a run stopped by a full disk can resume from, for its one-line message."""
        last = self.last_complete()
        if last is None:
            return "; no complete checkpoint is left to resume from"
        return (
            f"; the last complete checkpoint, {last}, is intact: free some space and rerun the same command to resume"
        )

    def _save_training_args(self, directory: str) -> None:
        """The training_args.bin beside the weights as the run's: the values given of those changed while it trains
        (`_AS_GIVEN`), no credential."""
        saved = without_secrets(self.args)
        if any(getattr(saved, name) != getattr(self, name) for name in _AS_GIVEN):
            saved = copy.copy(saved)
            for name in _AS_GIVEN:
                setattr(saved, name, getattr(self, name))
        path = os.path.join(directory, "training_args.bin")
        if saved is not self.args and self.args.should_save and os.path.exists(path):
            with atomic_path(path) as temporary:
                torch.save(saved, temporary)

    def _written_checkpoints(self) -> list[str]:
        written = set(run_directory.read_record(self.args.output_dir)["written"])
        return [path for path in run_directory.checkpoints(self.args.output_dir) if os.path.basename(path) in written]

    def _rotate(self, best: Optional[str]) -> None:
        """--save_total_limit as the Trainer keeps it (the newest, and the best one before it), over ours only."""
        limit = self.save_total_limit
        checkpoints = self._written_checkpoints()
        if not limit or limit <= 0 or len(checkpoints) <= limit:
            return
        best = os.path.join(self.args.output_dir, os.path.basename(best)) if best is not None else None
        if best in checkpoints[:-1]:  # kept second to last, so that the newest stays to resume from
            checkpoints.remove(best)
            checkpoints.insert(len(checkpoints) - 1, best)
            limit = max(limit, 2)
        _delete_checkpoints(checkpoints[: len(checkpoints) - limit])


def _delete_checkpoints(checkpoints: list[str], keep=()) -> None:
    for checkpoint in checkpoints:
        if not any(os.path.exists(kept) and os.path.samefile(checkpoint, kept) for kept in keep):
            logger.info(f"Deleting older checkpoint [{checkpoint}] due to args.save_total_limit")
            shutil.rmtree(checkpoint, ignore_errors=True)


def _write_json(path: str, record: dict) -> None:
    """`record` as JSON, null for a non-finite number (never a bare NaN: not JSON)."""
    with open(path, "w") as f:
        json.dump(finite_or_none(record), f, indent=4, sort_keys=True, allow_nan=False)

#!/usr/bin/env python
"""Fine-tune BridgeTower with a contrastive image-text loss on Habana Gaudi.

Our port of the optimum-habana contrastive-image-text example, step for step in upstream's order.
run_bridgetower.py (Habana Gaudi) is the source; run_bridgetower_cuda.py (NVIDIA GPUs and CPU) is
generated from it by patches/. The machinery both share lives in the bridgetower_bench package;
README.md lists every place where we deliberately behave differently from upstream.
"""

import gc


if __name__ == "__main__":
    gc.disable()  # no collection while the libraries load: half a million objects and no garbage (see the end)

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import datasets
import transformers
from transformers import AutoImageProcessor, AutoTokenizer, HfArgumentParser
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerForContrastiveLearning

from bridgetower_bench import arguments, data, preflight
from bridgetower_bench.guards.execution_mode import check_lazy_mode_variable
from bridgetower_bench.guards.habana_software import require_habana_software
from bridgetower_bench.images.images import IMAGE_PIPELINES, make_image_transform
from bridgetower_bench.mediapipe.availability import choose_loader
from bridgetower_bench.mediapipe.inputs import feed_media_pipeline
from bridgetower_bench.mediapipe.trainer import MediaPipeTrainerMixin
from bridgetower_bench.modeling.attention import use_attention
from bridgetower_bench.output_dir import run_directory, run_recipe
from bridgetower_bench.retrieval import EVAL_IGNORE_KEYS, image_group_ids, make_compute_metrics
from bridgetower_bench.trainer import TrainerExtensions
from bridgetower_bench.user_errors import UserInputError, exit_on_user_error, freeze_imports


# optimum-habana's import ends in a traceback outside Habana's software: one line instead (exit status 2).
exit_on_user_error(require_habana_software)
from optimum.habana import GaudiConfig, GaudiTrainer, GaudiTrainingArguments  # noqa: E402
from optimum.habana.utils import set_seed  # noqa: E402


logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model, tokenizer and image processor to fine-tune, and which parts to freeze."""

    model_name_or_path: str = field(metadata={"help": "Model directory or Hugging Face Hub model id."})
    config_name: Optional[str] = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer name or path, if not the model's."}
    )
    image_processor_name: Optional[str] = field(
        default=None, metadata={"help": "Image processor name or path, if not the model's."}
    )
    cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Where downloaded models and data sets are cached."}
    )
    model_revision: str = field(default="main", metadata={"help": "Model version: branch, tag or commit id."})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (tokenizers-backed) tokenizer."})
    token: Optional[str] = field(default=None, metadata={"help": "Hugging Face token for private models or data."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow code from the Hub to run (trusted repositories only)."}
    )
    freeze_vision_model: bool = field(default=False, metadata={"help": "Freeze the vision tower."})
    freeze_text_model: bool = field(default=False, metadata={"help": "Freeze the text tower."})
    freeze_text_pooler: bool = field(default=True, metadata={"help": "Remove the (unused) text pooler."})


@dataclass
class DataTrainingArguments:
    """Which data to train and evaluate on, and how images reach the model."""

    dataset_name: Optional[str] = field(default=None, metadata={"help": "Data set: Hub name or local directory."})
    dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "Data set configuration (e.g. matching)."}
    )
    dataset_revision: str = field(default="main", metadata={"help": "Data set version: branch, tag or commit id."})
    data_dir: Optional[str] = field(default=None, metadata={"help": "data_dir passed to datasets.load_dataset."})
    image_column: Optional[str] = field(
        default="image_path", metadata={"help": "Column with images or image file paths."}
    )
    caption_column: Optional[str] = field(default="caption", metadata={"help": "Column with the captions."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Training data: a csv, json or jsonl file."})
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Validation data: a csv, json or jsonl file."}
    )
    max_seq_length: Optional[int] = field(
        default=128, metadata={"help": "Captions are padded or truncated to this many tokens (at least 1)."}
    )
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Use only this many training rows."})
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "Use only this many validation and test rows."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Redo the tokenization and the image check instead of using their caches."}
    )
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "Processes for preprocessing."})
    mediapipe_dataloader: bool = field(
        default=False,
        metadata={
            "help": "Gaudi only: decode and resize images on the HPU (media pipeline); it prefetches --dataloader_num_workers + 1 batches, at most 3."
        },
    )
    image_pipeline: str = field(
        default="upstream",
        metadata={
            "help": "Host image path: upstream (exact reproduction), fast (uint8, same pixels), fast-draft (JPEG DCT downscale).",
            "choices": IMAGE_PIPELINES,
        },
    )
    cache_decoded_images: bool = field(
        default=False,
        metadata={"help": "Decode and resize each distinct image once, into a memory-mapped cache (fast pipelines)."},
    )
    decoded_image_cache_dir: Optional[str] = field(
        default=None,
        metadata={
            "help": "Where --cache_decoded_images keeps its cache (default bridgetower_bench/decoded_images under $HF_HOME, else $XDG_CACHE_HOME, else ~/.cache)."
        },
    )
    preflight_cache_dir: Optional[str] = field(
        default=None,
        metadata={
            "help": "Where the image and caption check keeps its outcome (default bridgetower_bench/preflight under $HF_HOME, else $XDG_CACHE_HOME, else ~/.cache)."
        },
    )
    max_image_pixels: int = field(
        default=preflight.DEFAULT_MAX_IMAGE_PIXELS,
        metadata={
            "help": "Pixel budget of one image, as decoded and as resized before the centre crop; a bigger image is a bad row. The upstream pipeline needs about 31 bytes a pixel."
        },
    )
    drop_bad_rows: bool = field(
        default=False,
        metadata={
            "help": "Train without rows whose image is missing, undecodable or over --max_image_pixels or whose caption is empty (found before training), instead of stopping."
        },
    )

    def __post_init__(self):
        arguments.check_data_arguments(self.dataset_name, self.train_file, self.validation_file)


class BridgeTowerTrainer(TrainerExtensions, GaudiTrainer):
    """The backend's trainer plus device-side normalisation, data-wait timing and steady-state throughput."""


class MediaPipeBridgeTowerTrainer(MediaPipeTrainerMixin, BridgeTowerTrainer):
    """Feeds training and evaluation from Habana's media pipeline instead of a PyTorch DataLoader."""


def main():
    # 1. Parse the arguments: flags, or a single .json file holding all of them. Values no run can use
    #    (a batch size of 0, an --output_dir that is a file, ...) are refused before anything is written.
    #    On Gaudi, PT_HPU_LAZY_MODE must select the execution mode the flags ask for before the HPU is set up.
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, GaudiTrainingArguments))
    check_lazy_mode_variable(parser, sys.argv)
    model_args, data_args, training_args = arguments.parse_arguments(parser, sys.argv)
    arguments.check_arguments(data_args, training_args)

    # 2. Logging.
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.getLogger("bridgetower_bench").setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()

    # Gaudi configuration (fused AdamW, fused gradient clipping, autocast); GaudiConfig's defaults without one. Its
    # file is read as a dict first (as from_pretrained does): the trainer names the keys GaudiConfig ignores.
    gaudi_config, gaudi_config_file = GaudiConfig(), {}
    if training_args.gaudi_config_name:
        gaudi_config_file, _ = GaudiConfig.get_config_dict(
            training_args.gaudi_config_name,
            cache_dir=model_args.cache_dir,
            revision=model_args.model_revision,
            token=model_args.token,
        )
        gaudi_config = GaudiConfig.from_dict(gaudi_config_file)
    logger.warning(
        f"Process rank: {training_args.local_rank}, device: {training_args.device}, "
        f"distributed training: {training_args.parallel_mode.value == 'distributed'}, "
        f"mixed-precision training: {training_args.bf16 or gaudi_config.use_torch_autocast}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    # 3. Claim output_dir: one run at a time (a lock), files of anyone else never overwritten or deleted. A
    #    publication a killed run committed is finished, its leftovers cleared.
    run_directory.check_output_dir(training_args.output_dir)
    with training_args.main_process_first(desc="claiming --output_dir", local=False):
        run_directory.claim(training_args.output_dir, holder=training_args.process_index == 0)
    run_directory.refuse_unless_shared(training_args.output_dir, training_args.device)  # one directory for all nodes

    # 4. Load the data set: a Hub name or local directory, or csv / json / jsonl files.
    dataset = data.load_raw_datasets(
        dataset_name=data_args.dataset_name,
        dataset_config_name=data_args.dataset_config_name,
        dataset_revision=data_args.dataset_revision,
        data_dir=data_args.data_dir,
        train_file=data_args.train_file,
        validation_file=data_args.validation_file,
        cache_dir=model_args.cache_dir,
        token=model_args.token,
        image_column=data_args.image_column,
    )
    # What makes this run's model (model, data fingerprints, every argument that changes the weights, seed, version)
    # against what output_dir holds: a published model of this recipe, trained as far as asked, is not trained
    # again; training resumes from the newest complete checkpoint of this recipe; another recipe is refused. An
    # evaluation alone evaluates the model trained there.
    run = run_recipe.plan_run(training_args.output_dir, model_args, data_args, training_args, dataset)

    # 5. Load the pretrained model, tokenizer and image processor (only its mean and std are used).
    tokenizer_name = model_args.tokenizer_name or model_args.model_name_or_path
    with arguments.slow_tokenizer_refusal(model_args.use_fast_tokenizer, tokenizer_name):
        tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_name,
            cache_dir=model_args.cache_dir,
            use_fast=model_args.use_fast_tokenizer,
            token=model_args.token,
            trust_remote_code=model_args.trust_remote_code,
        )
    image_processor = AutoImageProcessor.from_pretrained(
        model_args.image_processor_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    model = BridgeTowerForContrastiveLearning.from_pretrained(
        run.trained_model or model_args.model_name_or_path,
        config=model_args.config_name,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    config = model.config
    arguments.check_max_seq_length(data_args.max_seq_length, config, tokenizer)
    use_attention(model, training_args.attn_implementation)  # eager (upstream) or sdpa: the same function, fused

    if model_args.freeze_text_pooler:
        model.bridgetower.text_model.pooler = None
    towers = model.bridgetower  # (upstream's model.vision_model / model.text_model do not exist)
    for frozen, tower in (
        (model_args.freeze_vision_model, towers.vision_model),
        (model_args.freeze_text_model, towers.text_model),
    ):
        if frozen:
            tower.requires_grad_(False)

    set_seed(training_args.seed)

    # Keep the splits that exist; split only what is missing off train, with the run's seed (no test split
    # is carved off train without --do_predict).
    dataset = data.make_splits(dataset, training_args.seed, need_test=training_args.do_predict)
    wanted = [
        s
        for s, on in (
            ("train", training_args.do_train),
            ("validation", training_args.do_eval),
            ("test", training_args.do_predict),
        )
        if on
    ]
    if not wanted:
        logger.info("There is nothing to do. Please pass --do_train, --do_eval and/or --do_predict.")
        return
    for split in wanted:
        if split not in dataset:
            raise UserInputError(f"the data set has no '{split}' split (it has: {', '.join(dataset)})")
    column_names = dataset[wanted[0]].column_names

    # 6. The image and caption columns.
    image_column = data.resolve_column(column_names, data_args.image_column, "--image_column", 0)
    caption_column = data.resolve_column(column_names, data_args.caption_column, "--caption_column", 1)

    # 7. Preprocessing: tokenize captions once, up front; transform images lazily, batch by batch.
    splits = {}
    for split in wanted:
        limit = data_args.max_train_samples if split == "train" else data_args.max_eval_samples
        split_data = dataset[split]
        if limit is not None:
            split_data = split_data.select(range(min(len(split_data), limit)))
        splits[split] = data.prepare_image_column(split_data, image_column, split)
    # Bad data stops the run here, before step 1: missing, undecodable, truncated or oversized images, empty captions
    # (or, with --drop_bad_rows, their rows are left out). Checked once per data set, then cached.
    with training_args.main_process_first(desc="checking images and captions"):
        splits = preflight.check_splits(
            splits,
            image_column,
            caption_column,
            num_proc=data_args.preprocessing_num_workers,
            drop_bad_rows=data_args.drop_bad_rows,
            overwrite_cache=data_args.overwrite_cache,
            cache_dir=data_args.preflight_cache_dir,
            image_size=config.vision_config.image_size,
            max_image_pixels=data_args.max_image_pixels,
        )
    for split, split_data in splits.items():
        splits[split] = data.tokenize_split(
            split_data,
            tokenizer,
            image_column=image_column,
            caption_column=caption_column,
            max_seq_length=data_args.max_seq_length,
            num_proc=data_args.preprocessing_num_workers,
            overwrite_cache=data_args.overwrite_cache,
            split=split,
        )
    # Rows showing the same image count as one image in the retrieval metrics.
    image_groups = {
        split: image_group_ids(split_data[image_column]) for split, split_data in splits.items() if split != "train"
    }
    image_size = config.vision_config.image_size
    image_transform = make_image_transform(
        data_args.image_pipeline, image_size, image_processor.image_mean, image_processor.image_std
    )
    if data_args.cache_decoded_images:  # built once, by the first process; the others open it
        with training_args.main_process_first(desc="decoding each distinct image once into the cache"):
            image_transform = data.decoded_image_cache(splits, image_column, data_args, image_size, image_transform)
    for split, split_data in splits.items():
        split_data.set_transform(data.BatchTransform(image_column, image_transform, split))

    # Choose the loader. The media pipeline needs a Gaudi2/Gaudi3 and Habana's media stack; without them
    # the run says so once and records that the PyTorch loader ran.
    loader, unavailable = choose_loader(data_args.mediapipe_dataloader)
    if unavailable:
        logger.warning(
            f"--mediapipe_dataloader: the media pipeline cannot run here ({unavailable}); using the PyTorch loader"
        )
    if loader == "mediapipe":  # the HPU decoder reads files: embedded images are written out once (rank 0)
        with training_args.main_process_first(desc="writing image files for the media pipeline"):
            for split_data in splits.values():
                feed_media_pipeline(
                    split_data,
                    image_column,
                    image_size,
                    image_processor.image_mean,
                    image_processor.image_std,
                    data_args.preprocessing_num_workers,
                )
    trainer_cls = MediaPipeBridgeTowerTrainer if loader == "mediapipe" else BridgeTowerTrainer

    # 8. The trainer. Our images and captions live in columns the model does not take: keep them.
    if training_args.remove_unused_columns:
        logger.info("Setting --remove_unused_columns=False: the per-batch transform needs the image column.")
        training_args.remove_unused_columns = False
    trainer = trainer_cls(
        model=model,
        gaudi_config=gaudi_config,
        gaudi_config_file=gaudi_config_file,
        args=training_args,
        train_dataset=splits.get("train"),
        eval_dataset=splits.get("validation"),
        data_collator=data.collate_fn,
        image_mean=image_processor.image_mean,
        image_std=image_processor.image_std,
        loader=loader,
        image_pipeline=data_args.image_pipeline,
        recipe=run.recipe,
    )

    # 9. Training. The model, processors, metrics, state and recipe are published as one set: all or nothing.
    #    SIGTERM/SIGINT stop training with a checkpoint; after the last step they wait until the set is published.
    if training_args.do_train and not run.trained_model:
        with trainer.catching_signals():
            train_result = trainer.train(resume_from_checkpoint=run.resume_from)
            trainer.log_metrics("train", train_result.metrics)
            with trainer.publishing():
                trainer.save_model()
                trainer.save_processors(tokenizer, image_processor)
                trainer.save_metrics("train", train_result.metrics)
                trainer.save_state()
    elif run.publish_from:  # the recipe's training ended in this checkpoint: published as it is
        trainer.log_metrics("train", trainer.publish_checkpoint(run.publish_from, tokenizer, image_processor))

    # 10. Evaluation: contrastive loss plus image<->text retrieval recall on the validation split.
    if training_args.do_eval:
        trainer.compute_metrics = make_compute_metrics(image_groups["validation"])
        metrics = trainer.evaluate(ignore_keys=EVAL_IGNORE_KEYS)
        trainer.log_metrics("validation", metrics)
        trainer.save_metrics("validation", metrics)  # validation_results.json, keys prefixed eval_ (as upstream)

    # 11. Prediction: the same on the test split (upstream accepted --do_predict and ignored it).
    if training_args.do_predict:
        trainer.compute_metrics = make_compute_metrics(image_groups["test"])
        metrics = trainer.predict(splits["test"], ignore_keys=EVAL_IGNORE_KEYS, metric_key_prefix="test").metrics
        trainer.log_metrics("test", metrics)
        trainer.save_metrics("test", metrics)

    # 12. Model card.
    finetuned_from = None if os.path.isdir(model_args.model_name_or_path) else model_args.model_name_or_path
    kwargs = {"finetuned_from": finetuned_from, "tasks": "contrastive-image-text-modeling"}
    if data_args.dataset_name is not None and not os.path.isdir(data_args.dataset_name):
        kwargs["dataset_tags"] = data_args.dataset_name
        kwargs["dataset"] = " ".join(filter(None, (data_args.dataset_name, data_args.dataset_config_name)))
        if data_args.dataset_config_name is not None:
            kwargs["dataset_args"] = data_args.dataset_config_name
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    elif training_args.should_save:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    freeze_imports()  # what the imports made is never collected; collection runs from here on
    exit_on_user_error(main)  # bad input ends in one line and exit status 2; anything else keeps its traceback

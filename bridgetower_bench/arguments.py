"""Step 1 of both scripts: the arguments parsed and checked before anything is loaded or written, and the CUDA
script's TrainingArguments (docs/ARCHITECTURE.md, "Runtime wing")."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import transformers
from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from bridgetower_bench.data import data_file_builder
from bridgetower_bench.modeling.attention import ATTENTION_IMPLEMENTATIONS
from bridgetower_bench.output_dir import run_directory
from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


# TrainingArguments flags of the pinned transformers that transformers 5 dropped: how 5.x spells what they did
# (None: no counterpart). --warmup_ratio and --overwrite_output_dir are not here: WarmupTrainingArguments keeps them.
DROPPED_IN_TRANSFORMERS_5 = {
    "no_cuda": "--use_cpu",
    "per_gpu_train_batch_size": "--per_device_train_batch_size",
    "per_gpu_eval_batch_size": "--per_device_eval_batch_size",
    "push_to_hub_model_id": "--hub_model_id",
    "push_to_hub_organization": "--hub_model_id ORGANIZATION/NAME",
    "push_to_hub_token": "--hub_token",
    "include_inputs_for_metrics": "--include_for_metrics inputs",
    "group_by_length": "--train_sampling_strategy group_by_length",
    "adafactor": "--optim adafactor",
    "torchdynamo": "--torch_compile_backend",
    **dict.fromkeys(
        "fp16_backend fp16_opt_level fsdp_min_num_params fsdp_transformer_layer_cls_to_wrap half_precision_backend "
        "include_tokens_per_second jit_mode_eval logging_dir mp_parameters past_index ray_scope save_safetensors "
        "tpu_metrics_debug tpu_num_cores use_ipex use_legacy_prediction_loop use_mps_device".split()
    ),
}


def refuse_dropped_flags(parser, names) -> None:
    """One line for the first of `names` (flags or JSON keys, without dashes) that the parser does not take and the
    installed transformers dropped, naming its spelling there."""
    known = {f.name for dtype in parser.dataclass_types for f in dataclasses.fields(dtype) if f.init}
    for name in names:
        if name in DROPPED_IN_TRANSFORMERS_5 and name not in known:
            spelling = DROPPED_IN_TRANSFORMERS_5[name]
            raise UserInputError(
                f"--{name}: transformers {transformers.__version__} dropped it"
                + (f"; use {spelling}" if spelling else ", with no counterpart")
            )


def parse_arguments(parser, argv: list[str]) -> tuple:
    """The dataclasses from the flags or one .json file; what their __post_init__ refuses is a UserInputError."""
    try:
        if len(argv) == 2 and argv[1].endswith(".json"):
            return parse_json_arguments(parser, argv[1])
        refuse_dropped_flags(parser, [arg[2:].split("=", 1)[0] for arg in argv[1:] if arg.startswith("--")])
        return parser.parse_args_into_dataclasses(args=argv[1:])
    except UserInputError:
        raise
    except ValueError as error:  # one line, though the message may span several
        raise UserInputError(" ".join(str(error).split())) from None


def check_arguments(data_args, training_args) -> None:
    """Refuse, before anything is loaded or written, values no run can use."""
    at_least = [
        ("--max_seq_length", data_args.max_seq_length, 1),
        ("--max_train_samples", data_args.max_train_samples, 1),
        ("--max_eval_samples", data_args.max_eval_samples, 1),
        ("--preprocessing_num_workers", data_args.preprocessing_num_workers, 1),
        ("--max_image_pixels", data_args.max_image_pixels, 1),
        ("--per_device_train_batch_size", training_args.per_device_train_batch_size, 1),
        ("--per_device_eval_batch_size", training_args.per_device_eval_batch_size, 1),
        ("--gradient_accumulation_steps", training_args.gradient_accumulation_steps, 1),
        ("--dataloader_num_workers", training_args.dataloader_num_workers, 0),
    ]
    for flag, value, minimum in at_least:
        if value is not None and value < minimum:
            raise UserInputError(
                f"{flag}={value}: must be {'positive' if minimum == 1 else 'at least ' + str(minimum)}"
            )
    if training_args.do_train and training_args.max_steps == 0:
        raise UserInputError(
            "--max_steps=0 with --do_train trains nothing: pass a positive --max_steps, or leave it "
            "out to train --num_train_epochs"
        )
    if training_args.do_train and training_args.max_steps < 0 and training_args.num_train_epochs <= 0:
        raise UserInputError(
            f"--num_train_epochs={training_args.num_train_epochs:g} with --do_train trains nothing: "
            "pass a positive --num_train_epochs (or a positive --max_steps)"
        )
    if getattr(training_args, "dataloader_persistent_workers", False) and training_args.dataloader_num_workers == 0:
        raise UserInputError(
            "--dataloader_persistent_workers=True needs --dataloader_num_workers of 1 or more "
            "(with 0 the main process loads, and there are no workers to keep)"
        )
    run_directory.check_output_dir_path(training_args.output_dir)
    check_numbers(data_args, training_args)


def check_numbers(*argument_sets) -> None:
    """Numbers no run can use, whatever the flag or key: a float not finite (nan or inf would reach the optimizer
    or the schedule only after the model loaded), an integer beyond 64 bits, a seed numpy cannot take."""
    seed_max = 2**32 - 1  # numpy's legacy seeding, which transformers' set_seed calls, takes 0 .. 2**32 - 1
    for values in argument_sets:
        for name, value in vars(values).items():
            if name.startswith("_"):  # (set by the arguments class itself, not a flag)
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise UserInputError(f"--{name}={value}: must be a finite number")
            if isinstance(value, int) and not isinstance(value, bool):
                if name in ("seed", "data_seed") and not 0 <= value <= seed_max:
                    raise UserInputError(f"--{name}={value}: a seed must be between 0 and {seed_max}")
                if abs(value) > 2**63 - 1:
                    raise UserInputError(f"--{name}={value}: beyond the 64-bit integers a run can use")


def check_data_arguments(dataset_name: str | None, train_file: str | None, validation_file: str | None) -> None:
    """Upstream's checks on the data flags, as clear errors instead of asserts."""
    if dataset_name is None and train_file is None and validation_file is None:
        raise UserInputError("Need either --dataset_name or --train_file / --validation_file.")
    builders = {
        data_file_builder(p, f) for p, f in ((train_file, "--train_file"), (validation_file, "--validation_file")) if p
    }
    if len(builders) > 1:
        raise UserInputError(
            f"--train_file={train_file} and --validation_file={validation_file} must have the same format (csv or json)."
        )


def check_max_seq_length(max_seq_length: int, config, tokenizer=None) -> None:
    """--max_seq_length must fit the text model's positions (RoBERTa keeps 2 for its padding offset) and leave
    room for a caption token beside the tokenizer's special tokens (with fewer, it cannot truncate)."""
    if tokenizer is not None:
        needed = tokenizer.num_special_tokens_to_add() + 1
        if max_seq_length < needed:
            raise UserInputError(
                f"--max_seq_length={max_seq_length} leaves no room for a caption: the tokenizer adds "
                f"{needed - 1} special tokens; use at least {needed}"
            )
    text = config.text_config
    usable = text.max_position_embeddings - (2 if text.pad_token_id is not None else 0)
    if max_seq_length > usable:
        raise UserInputError(f"--max_seq_length={max_seq_length} is larger than the model's {usable} text positions")


@contextmanager
def slow_tokenizer_refusal(use_fast_tokenizer: bool, name: str) -> Iterator[None]:
    """Loading the tokenizer: with --use_fast_tokenizer False, a slow (Python) tokenizer the model has no files for is
    refused in one line. BridgeTower's Hub repository has tokenizer.json and vocab.json but no merges.txt: transformers
    4.x cannot build RoBERTa's slow tokenizer from them, fails inside it, then asks for protobuf (5.x builds it)."""
    try:
        yield
    except (TypeError, ValueError, ImportError) as error:
        if use_fast_tokenizer:
            raise
        cause: BaseException = error
        while cause.__context__ is not None:  # the first failure, not what transformers tried after it
            cause = cause.__context__
        said = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
        raise UserInputError(
            f"--use_fast_tokenizer False: transformers {transformers.__version__} cannot build a slow tokenizer "
            f"from {name} ({type(cause).__name__}: {said}); leave the flag out to use its fast tokenizer"
        ) from None


# GaudiTrainingArguments' defaults that differ from TrainingArguments' and that the CUDA/CPU script takes, so that
# the same flags train the same recipe; the others are left to each device (docs/UPSTREAM.md).
GAUDI_RECIPE_DEFAULTS = {"adam_epsilon": 1e-6, "optim": "adamw_torch", "logging_nan_inf_filter": False}


def _gaudi_default(name: str):
    """A TrainingArguments field (its help and type) with GaudiTrainingArguments' default instead of its own."""
    return dataclasses.field(
        default=GAUDI_RECIPE_DEFAULTS[name], metadata=TrainingArguments.__dataclass_fields__[name].metadata
    )


@dataclass
class WarmupTrainingArguments(TrainingArguments):
    """TrainingArguments with GaudiTrainingArguments' recipe defaults, plus its `throughput_warmup_steps` and
    `attn_implementation` (same names and defaults) and this script's `compile_layers`."""

    adam_epsilon: float = _gaudi_default("adam_epsilon")
    optim: Union[OptimizerNames, str] = _gaudi_default("optim")
    logging_nan_inf_filter: bool = _gaudi_default("logging_nan_inf_filter")

    throughput_warmup_steps: int = dataclasses.field(
        default=0,
        metadata={"help": "Number of first optimizer steps left out of the throughput figures (as on Gaudi)."},
    )
    attn_implementation: str = dataclasses.field(
        default="eager",
        metadata={
            "help": "Text and cross-modal attention: eager (transformers' code, as upstream) or sdpa (the same function in one fused torch call).",
            "choices": ATTENTION_IMPLEMENTATIONS,
        },
    )
    compile_layers: Optional[str] = dataclasses.field(
        default=None,
        metadata={
            "help": "Compile each repeated layer in place with this torch.compile backend (inductor); instead of --torch_compile."
        },
    )
    # Gone from TrainingArguments in transformers 5 (which takes a ratio as --warmup_steps below 1, the same
    # schedule): declared here, the flag keeps its meaning on both install routes, --warmup_steps above 0 winning.
    if "warmup_ratio" not in TrainingArguments.__dataclass_fields__:
        warmup_ratio: float = dataclasses.field(
            default=0.0, metadata={"help": "Linear warm-up over this fraction of the training steps (0 to 1)."}
        )

        def get_warmup_steps(self, num_training_steps: int) -> int:
            if self.warmup_steps == 0 and self.warmup_ratio > 0:
                return math.ceil(num_training_steps * self.warmup_ratio)
            return super().get_warmup_steps(num_training_steps)

    # Gone from TrainingArguments in transformers 5: declared here, the flag keeps its meaning on both install routes.
    if "overwrite_output_dir" not in TrainingArguments.__dataclass_fields__:
        overwrite_output_dir: bool = dataclasses.field(
            default=False,
            metadata={
                "help": "Train afresh in --output_dir instead of resuming its newest checkpoint or reusing its trained model."
            },
        )

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.warmup_ratio <= 1:  # as the pinned transformers refuses it
            raise ValueError(f"--warmup_ratio={self.warmup_ratio}: must lie between 0 and 1")
        if self.compile_layers and self.torch_compile:
            raise ValueError("--compile_layers and --torch_compile both compile the model: pass one of them")

    @property
    def device(self):
        """The training device; the CPU as plain `cpu`: with several processes accelerate names it `cpu:<index>`,
        where `torch.load` cannot restore the optimizer.pt of a checkpoint the run resumes from."""
        device = super().device
        return torch.device("cpu") if device.type == "cpu" else device


def parse_json_arguments(parser, json_file: str) -> tuple:
    """HfArgumentParser.parse_json_file, with one clear line for an unreadable file, unknown keys, or a value not
    of its field's type (`parse_dict` stores JSON values as they are: "false" would be a true boolean)."""
    path = os.path.abspath(json_file)
    try:
        config = json.loads(read_regular_file(path))  # a FIFO is refused, not waited on
    except OSError as error:
        raise UserInputError(f"{path}: cannot read the configuration file ({error.strerror or error})") from None
    except ValueError as error:
        raise UserInputError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise UserInputError(f"{path}: a configuration file holds one JSON object mapping argument names to values")
    known = {f.name for dtype in parser.dataclass_types for f in dataclasses.fields(dtype) if f.init}
    refuse_dropped_flags(parser, config)
    unknown = sorted(set(config) - known)
    if unknown:
        raise UserInputError(
            f"{path}: unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            "(see --help for the arguments this script takes)"
        )
    for dtype in parser.dataclass_types:
        hints = typing.get_type_hints(dtype)
        for field in dataclasses.fields(dtype):
            if not field.init or field.name not in config:
                continue
            value, expected = config[field.name], hints[field.name]
            if value is None and field.name == "output_dir":  # TrainingArguments would take ./trainer_output
                raise UserInputError(
                    f'{path}: "output_dir" is null, expected a path (null would write the run into ./trainer_output)'
                )
            wanted, fits = _json_type(expected)
            choices = field.metadata.get("choices")
            if not fits(value) or (choices is not None and value is not None and value not in choices):
                wanted = f"one of {', '.join(map(str, choices))}" if choices is not None else wanted
                shown = json.dumps(value)  # as written, shortened, and what it is: '"2" (a string)'
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                if value is not None:
                    shown += f" ({_JSON_KINDS.get(type(value), 'an object')})"
                raise UserInputError(f'{path}: "{field.name}" is {shown}, expected {wanted}')
    return parser.parse_dict(config)


_JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}
_PLURALS = {"a string": "strings", "an integer": "integers", "a number": "numbers"}
_SCALARS = {
    type(None): ("null", lambda v: v is None),
    bool: ("a boolean (true or false)", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _json_type(hint: Any) -> tuple[str, Callable[[Any], bool]]:
    """A (resolved) type hint in JSON's words, and whether a JSON value is of it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return _SCALARS[hint]
    if origin in (typing.Union, types.UnionType):
        parts = [_json_type(a) for a in args]
        enums = [fits for a, (_, fits) in zip(args, parts) if isinstance(a, type) and issubclass(a, enum.Enum)]
        words = " or ".join(w for a, (w, _) in zip(args, parts) if not (a is str and enums))
        if enums and str in args:  # Union[SomeEnum, str]: a string must be a member's value
            return words, lambda v: any(f(v) for f in enums) if isinstance(v, str) else any(f(v) for _, f in parts)
        return words, lambda v: any(f(v) for _, f in parts)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(json.dumps, args)), lambda v: v in args
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        if not args:
            return "a list", lambda v: isinstance(v, list)
        item, fits = _json_type(args[0])
        return f"a list of {_PLURALS.get(item, item)}", lambda v: isinstance(v, list) and all(map(fits, v))
    if origin is dict or hint is dict:
        fits = _json_type(args[1])[1] if args else lambda v: True
        return "an object", lambda v: isinstance(v, dict) and all(map(fits, v.values()))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in hint), lambda v: any(v == m.value for m in hint)
    return getattr(hint, "__name__", str(hint)), lambda v: True  # Any, or a type JSON has no form for

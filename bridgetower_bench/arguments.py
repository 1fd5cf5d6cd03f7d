"""Step 1 of both scripts: the arguments, parsed and checked before anything is loaded or written.

- `parse_arguments` reads the flags, or a single .json configuration file: an unreadable file, unknown keys
  or a value of the wrong type (`check_json_types`) are refused in one line naming the file and the key.
- `check_arguments` refuses values no run can use (counts below their minimum, a run that would train
  nothing, persistent workers without workers, an --output_dir that cannot be one: run_directory), and
  numbers no run can use whatever their flag (`check_numbers`: not finite, beyond 64 bits, a seed numpy
  cannot take).
- `check_data_arguments` (from the scripts' DataTrainingArguments) refuses data flags upstream asserted on;
  `check_max_seq_length`, once the model and tokenizer are loaded, a --max_seq_length they cannot take.
- `WarmupTrainingArguments`: the CUDA script's TrainingArguments, with GaudiTrainingArguments' recipe defaults
  and the flags both scripts take on every transformers line the kit installs (`--overwrite_output_dir`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from bridgetower_bench.data import data_file_builder
from bridgetower_bench.modeling.attention import ATTENTION_IMPLEMENTATIONS
from bridgetower_bench.output_dir import run_directory
from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


# ---------------------------------------------------------------------------------------------
# Parsing, then the values no run can use
# ---------------------------------------------------------------------------------------------


def parse_arguments(parser, argv: list[str]) -> tuple:
    """Step 1: the argument dataclasses from the command line, or from its single .json configuration file.

    A value an arguments class refuses (its __post_init__ raises ValueError) is a UserInputError.
    """
    try:
        if len(argv) == 2 and argv[1].endswith(".json"):
            return parse_json_arguments(parser, argv[1])
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


_INT64_MAX = 2**63 - 1
_SEED_MAX = 2**32 - 1  # numpy's legacy seeding, which transformers' set_seed calls, takes 0 .. 2**32 - 1


def check_numbers(*argument_sets) -> None:
    """Numbers no run can use, whatever the flag or configuration key: a float that is not finite (nan or inf
    would reach the optimizer or the schedule only after the model loaded), an integer beyond 64 bits, a
    seed numpy cannot take."""
    for values in argument_sets:
        for name, value in vars(values).items():
            if name.startswith("_"):  # (set by the arguments class itself, not a flag)
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise UserInputError(f"--{name}={value}: must be a finite number")
            if isinstance(value, int) and not isinstance(value, bool):
                if name in ("seed", "data_seed") and not 0 <= value <= _SEED_MAX:
                    raise UserInputError(f"--{name}={value}: a seed must be between 0 and {_SEED_MAX}")
                if abs(value) > _INT64_MAX:
                    raise UserInputError(f"--{name}={value}: beyond the 64-bit integers a run can use")


def check_data_arguments(
    dataset_name: Optional[str], train_file: Optional[str], validation_file: Optional[str]
) -> None:
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
    """--max_seq_length must fit the text model's position embeddings (RoBERTa keeps 2 for its padding offset)
    and leave room for at least one caption token beside the tokenizer's special tokens (with fewer, the
    tokenizer cannot truncate and the captions come out longer than asked)."""
    if tokenizer is not None:
        needed = tokenizer.num_special_tokens_to_add() + 1
        if max_seq_length < needed:
            raise UserInputError(
                f"--max_seq_length={max_seq_length} leaves no room for a caption: the tokenizer adds "
                f"{needed - 1} special tokens; use at least {needed}"
            )
    positions = getattr(config.text_config, "max_position_embeddings", None)
    if positions is None:
        return
    usable = positions - 2 if getattr(config.text_config, "pad_token_id", None) is not None else positions
    if max_seq_length > usable:
        raise UserInputError(f"--max_seq_length={max_seq_length} is larger than the model's {usable} text positions")


# ---------------------------------------------------------------------------------------------
# The CUDA script's training arguments
# ---------------------------------------------------------------------------------------------


def _gaudi_default(name: str, default):
    """A TrainingArguments field (its help and type) with GaudiTrainingArguments' default instead of its own."""
    return dataclasses.field(default=default, metadata=TrainingArguments.__dataclass_fields__[name].metadata)


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
    `overwrite_output_dir` left TrainingArguments in transformers 5: declared here where it is gone, so that
    the flag keeps its meaning on both install routes (run_recipe.plan_run reads it).
    """

    adam_epsilon: float = _gaudi_default("adam_epsilon", GAUDI_RECIPE_DEFAULTS["adam_epsilon"])
    optim: Union[OptimizerNames, str] = _gaudi_default("optim", GAUDI_RECIPE_DEFAULTS["optim"])
    logging_nan_inf_filter: bool = _gaudi_default(
        "logging_nan_inf_filter", GAUDI_RECIPE_DEFAULTS["logging_nan_inf_filter"]
    )

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
    if "overwrite_output_dir" not in TrainingArguments.__dataclass_fields__:  # gone from TrainingArguments in 5.x
        overwrite_output_dir: bool = dataclasses.field(
            default=False,
            metadata={
                "help": "Train afresh in --output_dir instead of resuming its newest checkpoint or reusing its trained model."
            },
        )

    def __post_init__(self):
        super().__post_init__()
        if self.compile_layers and self.torch_compile:
            raise ValueError("--compile_layers and --torch_compile both compile the model: pass one of them")

    @property
    def device(self):
        """The training device; the CPU as one device. With several processes accelerate names it `cpu:<index>`, a
        location `torch.load` cannot restore to, and the Trainer loads a checkpoint's optimizer.pt there when
        it resumes: plain `cpu` lets a run of several CPU processes resume."""
        device = super().device
        return torch.device("cpu") if device.type == "cpu" else device


# ---------------------------------------------------------------------------------------------
# A single .json configuration file
# ---------------------------------------------------------------------------------------------


def parse_json_arguments(parser, json_file: str) -> tuple:
    """HfArgumentParser.parse_json_file, with one clear line for an unreadable file or unknown keys."""
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
    unknown = sorted(set(config) - known)
    if unknown:
        raise UserInputError(
            f"{path}: unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            "(see --help for the arguments this script takes)"
        )
    check_json_types(parser, config, path)
    return parser.parse_dict(config)


# Fields whose declared type admits null though a null would not mean what it says: TrainingArguments turns
# an output_dir of None into ./trainer_output, in whatever the working directory is.
_NULL_REFUSED = {"output_dir": "null would write the run into ./trainer_output"}


def check_json_types(parser, config: dict, path: str) -> None:
    """Every value of a configuration file has the type its dataclass field declares, or a UserInputError naming
    key, value and expected type. The flags' parser converts text to each field's type; `parse_dict` stores
    JSON values as they are, so "false" would be a true boolean and "2" a string where a number belongs."""
    for dtype in parser.dataclass_types:
        hints = typing.get_type_hints(dtype)
        for field in dataclasses.fields(dtype):
            if not field.init or field.name not in config:
                continue
            value, expected = config[field.name], hints[field.name]
            if value is None and field.name in _NULL_REFUSED:
                raise UserInputError(f'{path}: "{field.name}" is null, expected a path ({_NULL_REFUSED[field.name]})')
            choices = field.metadata.get("choices")
            if not _json_value_fits(value, expected) or (
                choices is not None and value is not None and value not in choices
            ):
                wanted = f"one of {', '.join(map(str, choices))}" if choices is not None else _describe_type(expected)
                raise UserInputError(f'{path}: "{field.name}" is {_show_json(value)}, expected {wanted}')


def _json_value_fits(value: Any, expected: Any) -> bool:
    """Whether a JSON value is of the (resolved) type hint `expected`."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return True
    if expected is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums and str in args and isinstance(value, str):  # Union[SomeEnum, str]: the str is a member's value
            return any(_json_value_fits(value, e) for e in enums)
        return any(_json_value_fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, set, frozenset) or expected in (list, tuple):
        return (
            isinstance(value, list) and all(_json_value_fits(v, args[0]) for v in value)
            if args
            else isinstance(value, list)
        )
    if origin is dict or expected is dict:
        return isinstance(value, dict) and (not args or all(_json_value_fits(v, args[1]) for v in value.values()))
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return any(value == member.value for member in expected)
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    return True  # a type JSON has no form for: left to the dataclass


def _describe_type(expected: Any) -> str:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        shown = [a for a in args if not (a is str and enums)]
        return " or ".join(_describe_type(a) for a in shown)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(json.dumps, args))
    if origin in (list, tuple, set, frozenset) or expected in (list, tuple):
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict or expected is dict:
        return "an object"
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return "one of " + ", ".join(str(member.value) for member in expected)
    return {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string"}.get(
        expected, getattr(expected, "__name__", str(expected))
    )


def _plural(expected: Any) -> str:
    described = _describe_type(expected)
    return {"a string": "strings", "an integer": "integers", "a number": "numbers"}.get(described, described)


def _describe_json(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _show_json(value: Any) -> str:
    """A JSON value as written, shortened, and what it is: '"2" (a string)'."""
    text = json.dumps(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return text if value is None else f"{text} ({_describe_json(value)})"

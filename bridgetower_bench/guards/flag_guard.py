"""The CUDA script's refusal of Gaudi-only flags (a pasted Gaudi command line): one error naming them all, not
argparse's "unrecognized arguments" or a silently ignored flag."""

from __future__ import annotations

import json

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


# Every field of GaudiTrainingArguments that the CUDA script's WarmupTrainingArguments lacks, and the data flag of
# the media pipeline (tests/test_guards.py compares them with the pinned optimum-habana's)
HPU_ONLY_FLAGS = (
    "use_habana",
    "use_lazy_mode",
    "use_hpu_graphs",
    "use_hpu_graphs_for_inference",
    "use_hpu_graphs_for_training",
    "disable_tensor_cache_hpu_graphs",
    "max_hpu_graphs",
    "gaudi_config_name",
    "distribution_strategy",
    "context_parallel_size",
    "sdp_on_bf16",
    "fp8",
    "pipelining_fwd_bwd",
    "non_blocking_data_copy",
    "minimize_memory",
    "ignore_eos",
    "adjust_throughput",
    "use_compiled_autograd",
    "use_regional_compilation",
    "use_zero3_leaf_promotion",
    "compile_from_sec_iteration",
    "compile_dynamic",
    "cache_size_limit",
    "inline_inbuilt_nn_modules",
    "allow_unspec_int_on_nn_module",
    "flash_attention_recompute",
    "flash_attention_fast_softmax",
    "flash_attention_causal_mask",
    "flash_attention_fp8",
    "profiling_warmup_steps",
    "profiling_steps",
    "profiling_warmup_steps_eval",
    "profiling_steps_eval",
    "profiling_record_shapes",
    "profiling_with_stack",
    "mediapipe_dataloader",
)


def hpu_only_flags_in(argv: list[str]) -> list[str]:
    """The Gaudi-only flags in a command line (or in its single .json configuration file). A configuration file
    that cannot be read, or holds no JSON object, names none: the argument parser that follows refuses it."""
    if len(argv) == 2 and argv[1].endswith(".json"):
        try:
            config = json.loads(read_regular_file(argv[1]))  # a FIFO is not waited on
        except (OSError, ValueError):
            return []
        names = list(config) if isinstance(config, dict) else []
    else:
        names = [a[2:].split("=", 1)[0] for a in argv[1:] if a.startswith("--")]
    return sorted({f"--{n}" for n in (name.replace("-", "_") for name in names) if n in HPU_ONLY_FLAGS})


def refuse_unsupported_flags(argv: list[str]) -> None:
    if flags := hpu_only_flags_in(argv):
        raise UserInputError(
            f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} Gaudi-only "
            "(Habana HPU) and not supported by run_bridgetower_cuda.py; remove "
            f"{'it' if len(flags) == 1 else 'them'}, or run run_bridgetower.py on a Gaudi machine."
        )

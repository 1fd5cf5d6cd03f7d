"""The CUDA script's refusal of Gaudi-only flags (a pasted Gaudi command line): one error naming them all, not
argparse's "unrecognized arguments" or a silently ignored flag."""

from __future__ import annotations

import json

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


HPU_ONLY_FLAGS = (
    "use_habana",
    "use_lazy_mode",
    "use_hpu_graphs",
    "use_hpu_graphs_for_inference",
    "use_hpu_graphs_for_training",
    "gaudi_config_name",
    "distribution_strategy",
    "sdp_on_bf16",
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

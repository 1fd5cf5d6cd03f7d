"""The CUDA/CPU script's answer to flags that only mean something on Habana Gaudi.

Users paste the published Gaudi command line onto GPU machines. Instead of argparse's generic
"unrecognized arguments" (or, worse, a silently ignored `--mediapipe_dataloader`), they get one
error naming every Gaudi-only flag they passed.
"""

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
    """The Gaudi-only flags in a command line (or in its single .json configuration file).

    A configuration file that cannot be read, or holds no JSON object, names none here: the argument
    parser that follows refuses it with its own one-line error.
    """
    if len(argv) == 2 and argv[1].endswith(".json"):
        try:
            config = json.loads(read_regular_file(argv[1]))  # a FIFO is not waited on
        except (OSError, ValueError):
            return []
        names = list(config) if isinstance(config, dict) else []
    else:
        names = [a[2:].split("=", 1)[0] for a in argv[1:] if a.startswith("--")]
    names = [n.replace("-", "_") for n in names]
    return sorted({f"--{n}" for n in names if n in HPU_ONLY_FLAGS})


def refuse_unsupported_flags(argv: list[str]) -> None:
    flags = hpu_only_flags_in(argv)
    if flags:
        raise UserInputError(
            f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} Gaudi-only "
            "(Habana HPU) and not supported by run_bridgetower_cuda.py; remove "
            f"{'it' if len(flags) == 1 else 'them'}, or run run_bridgetower.py on a Gaudi machine."
        )

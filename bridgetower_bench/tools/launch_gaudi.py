"""Launch run_bridgetower.py on several HPUs of one Gaudi node (the published runs use 8, with MPI).

    PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.launch_gaudi --world_size 8 --use_mpi \\
        run_bridgetower.py --output_dir runs/test --model_name_or_path ... (script flags)

Built on optimum-habana's DistributedRunner, which writes the mpirun (or torch.distributed)
command line for the node's sockets and cores. `--dry_run` prints that command, preceded by the variables the
launch exports for it (MASTER_ADDR and MASTER_PORT with --use_mpi), and exits. Without Habana's software it
stops in one line (exit status 2) before optimum-habana is imported.
The processes it starts run lazy mode, as upstream's CI: PT_HPU_LAZY_MODE=1 is set for them unless
the variable is already set (PT_HPU_LAZY_MODE=0 with the script's `--use_lazy_mode False` for eager mode).
"""

from __future__ import annotations

import argparse
import os
import shlex

from ..execution_mode import LAZY_MODE_VARIABLE
from ..habana_software import require_habana_software
from . import tool_paths


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_size", type=int, default=1, help="Number of HPUs on this node (1 to 8).")
    parser.add_argument(
        "--use_mpi", action="store_true", help="Start one process per HPU with mpirun (as the published runs)."
    )
    parser.add_argument("--master_port", type=int, default=29500, help="Port of the rank-0 process.")
    parser.add_argument("--dry_run", action="store_true", help="Print the command that would run, and exit.")
    parser.add_argument("training_script", help="The script to run, e.g. run_bridgetower.py.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="The script's own flags.")
    args = parser.parse_args(argv)
    if not 1 <= args.world_size <= 8:
        parser.error(f"--world_size={args.world_size}: a Gaudi node has 1 to 8 HPUs")
    if not os.path.isfile(args.training_script):
        parser.error(f"training_script {args.training_script}: no such file")
    return args


def children_mode_variable(environ=os.environ) -> str:
    """PT_HPU_LAZY_MODE for the processes launched: as set, else 1 (lazy mode, upstream's CI's)."""
    return environ.get(LAZY_MODE_VARIABLE) or "1"


def main(argv=None) -> int:
    args = parse_args(argv)
    require_habana_software()
    os.environ[LAZY_MODE_VARIABLE] = children_mode_variable()  # read by Habana's bridge when each process loads it
    from optimum.habana.distributed import DistributedRunner  # imported late: it needs Habana's software

    command = " ".join(shlex.quote(a) for a in [args.training_script, *args.training_script_args])
    runner = DistributedRunner(
        command_list=[command], world_size=args.world_size, use_mpi=args.use_mpi, master_port=args.master_port
    )
    if args.dry_run:  # what run() would start, with the variables it sets for it
        variables = {LAZY_MODE_VARIABLE: os.environ[LAZY_MODE_VARIABLE], **runner._model_env_vars}
        shown = " ".join(f"{name}={shlex.quote(str(value))}" for name, value in variables.items())
        for line in runner._commands:
            print(f"{shown} {runner._interpreter}{line}")
        return 0
    return runner.run() or 0


if __name__ == "__main__":
    tool_paths.run(main)

"""Launch run_bridgetower_cuda.py on several GPUs: torchrun (torch.distributed.run) with one-line endings.

    python -m bridgetower_bench.tools.launch_cuda --nproc_per_node 8 run_bridgetower_cuda.py \\
        --output_dir runs/test --model_name_or_path ... (script flags)

The options are torchrun's, read by torchrun's own parser (`--standalone`, `--nnodes`, `--rdzv_backend c10d`,
`--rdzv_endpoint`, `--rdzv_id`, `--rdzv_conf`, ...); the launch is torchrun's `run`. Four things differ from
`torchrun`:
- the script's refusals that need nothing loaded (no usable GPU without `--use_cpu`, Gaudi-only flags) are
  made once, here, before any process starts: the script's one line and exit status 2, as from one process;
- processes that fail end the launch with one line (how many, and the first one's exit status) instead of
  torchrun's ChildFailedError traceback, and the launch exits with that status (2 for bad input, 3 for a
  divergence, 128 + N for signal N): what the script gives in one process;
- a signal to the launcher (SIGTERM, SIGINT, SIGHUP: a scheduler's, Ctrl-C) is passed to the processes by
  torchrun, which waits `--shutdown_timeout` (default 30 s) for them to exit before killing them; the launch
  then ends with one line and 128 + the signal's number, instead of torchrun's SignalException traceback;
- a job whose nodes never all meet (the rendezvous times out) or that loses the node keeping the rendezvous
  ends with one line naming the endpoint, exit status 1, instead of the elastic agent's traceback. A job that
  ends in failure (a rank stopped by a signal is one) has no exit barrier in torchrun: the node keeping the
  rendezvous may end before another node's processes have exited, and that node then ends with this line.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from torch.distributed import DistNetworkError
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)

from bridgetower_bench.guards.cuda_device import refuse_without_gpu
from bridgetower_bench.guards.flag_guard import refuse_unsupported_flags
from bridgetower_bench.tools.hosts import endpoint, host, port
from bridgetower_bench.user_errors import UserInputError


PROG = "launch_cuda"


def refusal(script_argv: list[str]) -> Optional[str]:
    """The script's own line for a command it refuses before loading anything, else None."""
    try:
        refuse_unsupported_flags(script_argv)
        refuse_without_gpu(script_argv)
    except UserInputError as error:
        return f"{os.path.basename(script_argv[0])}: error: {error}"
    return None


def address_refusal(args) -> Optional[str]:
    """One line for a rendezvous endpoint, master address or port that is not a host and a port, else None."""
    try:
        if args.rdzv_endpoint:
            endpoint(args.rdzv_endpoint, "--rdzv_endpoint")
        host(args.master_addr, "--master_addr")
        port(args.master_port, "--master_port")
    except UserInputError as error:
        return f"{PROG}: error: {error}"
    return None


def first_status(failure: ChildFailedError) -> int:
    """The exit status of the first process that failed (torchrun stops the others), a killed one's as the shell
    gives it (128 + signal)."""
    code = failure.get_first_failure()[1].exitcode
    return code if code >= 0 else 128 - code


def rendezvous_failure(args, error: Exception) -> str:
    """One line for a job that could not start, or lost its rendezvous, on this node."""
    where = f"the rendezvous {args.rdzv_id!r} at {args.rdzv_endpoint or 'this node'}"
    if isinstance(error, RendezvousTimeoutError):
        return f"{PROG}: {where}: not every one of the job's {args.nnodes} node(s) joined in time (join_timeout)"
    if isinstance(error, (RendezvousConnectionError, DistNetworkError)):
        return f"{PROG}: {where} was lost: its store does not answer (the node keeping it has ended or is unreachable)"
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"{PROG}: {where} failed: {reason}"


def main(argv: Optional[list[str]] = None) -> int:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    line = address_refusal(args) or refusal([args.training_script, *args.training_script_args])
    if line:
        print(line, file=sys.stderr, flush=True)
        return 2
    try:
        torchrun.run(args)
    except ChildFailedError as failure:
        rank, status = failure.get_first_failure()[0], first_status(failure)
        print(
            f"{PROG}: {os.path.basename(args.training_script)} failed in {len(failure.failures)} of "
            f"{args.nproc_per_node} process(es), first in rank {rank}: exit status {status}",
            file=sys.stderr,
            flush=True,
        )
        return status
    except (RendezvousError, DistNetworkError) as error:
        print(rendezvous_failure(args, error), file=sys.stderr, flush=True)
        return 1
    except SignalException as stop:  # torchrun has sent it to the processes and waited for them (or killed them)
        name = stop.sigval.name
        print(
            f"{PROG}: stopped by {name}: every process got {name} and torchrun's --shutdown_timeout to save and exit",
            file=sys.stderr,
            flush=True,
        )
        return 128 + stop.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())

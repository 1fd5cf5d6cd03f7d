"""Launch run_bridgetower_cuda.py on several GPUs: torchrun (torch.distributed.run) with one-line endings.

    python -m bridgetower_bench.tools.launch_cuda --nproc_per_node 8 run_bridgetower_cuda.py \\
        --output_dir runs/test --model_name_or_path ... (script flags)

The options are torchrun's, read by torchrun's own parser (`--standalone`, `--nnodes`, `--rdzv_backend c10d`,
`--rdzv_endpoint`, `--rdzv_id`, `--rdzv_conf`, ...); the launch is torchrun's `run`. Four things differ from
`torchrun`:
- hosts, ports and endpoints that do not follow the kit's grammar (tools/hosts.py: an IPv6 endpoint as
  `[ADDRESS]:PORT`, whole numbers in the digits 0-9), and the script's refusals that need nothing loaded (no usable
  GPU without `--use_cpu`, Gaudi-only flags), are refused once, here, before any process starts: one line and exit
  status 2, as from one process;
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

import argparse
import errno
import os
import re
import socket
import sys
import threading
import time
from typing import Optional

import psutil
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
from bridgetower_bench.tools.hosts import endpoint, endpoint_text, excerpt, host, port
from bridgetower_bench.user_errors import UserInputError, freeze_imports


PROG = "launch_cuda"


def refusal(script_argv: list[str]) -> Optional[str]:
    """The script's own line for a command it refuses before loading anything, else None."""
    try:
        refuse_unsupported_flags(script_argv)
        refuse_without_gpu(script_argv)
    except UserInputError as error:
        return f"{os.path.basename(script_argv[0])}: error: {error}"
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's options, read by torchrun's parser, its whole numbers (--master_port among them) in the digits 0-9
    only (Python's int() also takes a sign, spaces, '_' and other scripts' digits), a bad value refused as
    UserInputError."""
    parser = torchrun.get_args_parser()
    parser.register("type", int, digits)  # the converter argparse looks up for `type=int`
    parser.exit_on_error = False  # a value refused: ArgumentError, made one line by main
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as error:
        raise UserInputError(str(error)) from None


def digits(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text):
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a whole number in the digits 0-9")
    return int(text)


def address_refusal(args) -> Optional[str]:
    """One line for a rendezvous endpoint, master address or port that is not of the kit's grammar (tools/hosts.py),
    else None; the endpoint and address are then what torchrun gets, bracket-free but for an endpoint's IPv6 host."""
    try:
        if args.rdzv_endpoint:
            args.rdzv_endpoint = endpoint_text(*endpoint(args.rdzv_endpoint, "--rdzv_endpoint"))
        args.master_addr = host(args.master_addr, "--master_addr", zone=False)
        if args.master_port is not None:
            port(args.master_port, "--master_port")
    except UserInputError as error:
        return f"{PROG}: error: {error}"
    return None


RESOLVE_SECONDS = 10  # the bound on looking up the endpoint's host before any wait starts


def rendezvous_settings(args) -> tuple[int, int]:
    """The job's most nodes and the longest this node waits for them: torchrun's join_timeout (default 600 s, a
    cluster's nodes starting minutes apart) plus its store's read_timeout (default 60 s), as --rdzv_conf sets them."""
    conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)
    try:
        seconds = sum(
            int(float(conf.get(name, default))) for name, default in (("join_timeout", 600), ("read_timeout", 60))
        )
        nodes = torchrun.parse_min_max_nnodes(args.nnodes)[1]
    except ValueError:
        raise UserInputError(
            f"--nnodes {args.nnodes} / --rdzv_conf {args.rdzv_conf}: a node count (N or MIN:MAX) and timeouts in seconds"
        ) from None
    return nodes, seconds


def endpoint_problem(args) -> Optional[str]:
    """One line when the c10d endpoint cannot keep a rendezvous: its host does not resolve within
    RESOLVE_SECONDS, or its port on this machine is held by a program other than a torchrun of this user."""
    name, number = endpoint(args.rdzv_endpoint, "--rdzv_endpoint")
    number = number or 29400  # torchrun's default c10d port
    found: list = []
    lookup = threading.Thread(target=lambda: found.append(_addresses(name, number)), daemon=True)
    lookup.start()
    lookup.join(RESOLVE_SECONDS)
    if not found or isinstance(found[0], str):
        reason = found[0] if found else f"no answer in {RESOLVE_SECONDS} s"
        return f"{PROG}: error: --rdzv_endpoint {args.rdzv_endpoint}: {name} does not resolve ({reason})"
    for family, address in found[0]:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, number))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    continue  # not an address of this machine: the node keeping the rendezvous is another one
                holder = _listener(number)
                if holder is not None:
                    return (
                        f"{PROG}: error: --rdzv_endpoint {args.rdzv_endpoint}: port {number} is taken by "
                        f"{holder}, not a rendezvous: choose a free port"
                    )
    return None


def _addresses(name: str, number: int):
    try:
        return {(info[0], info[4][0]) for info in socket.getaddrinfo(name, number, type=socket.SOCK_STREAM)}
    except OSError as error:
        return error.strerror or str(error)


def _listener(number: int) -> Optional[str]:
    """`program (pid N)` listening on the TCP port, unless it is torchrun (launch_cuda) or cannot be seen."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:  # (a system that shows other processes' sockets to root only: not known, not refused)
        return None
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == number and connection.pid:
            try:
                command = " ".join(psutil.Process(connection.pid).cmdline())
                name = psutil.Process(connection.pid).name()
            except psutil.Error:
                return None
            if "torch.distributed.run" in command or "launch_cuda" in command or "torchrun" in command:
                return None
            return f"{name} (pid {connection.pid})"
    return None


def watch_the_rendezvous(args, nodes: int, seconds: int) -> None:
    """Say where this node waits and for how long at most; end the launch in one line if no process has started
    by then (a store that never answers would keep torchrun waiting for ever)."""
    where = f"the rendezvous {args.rdzv_id!r} at {args.rdzv_endpoint}"
    print(
        f"{PROG}: this node waits at {where} for the job's {nodes} nodes, at most {seconds} s "
        "(--rdzv_conf join_timeout=S,read_timeout=S)",
        file=sys.stderr,
        flush=True,
    )

    def watch():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if psutil.Process().children():  # the rendezvous formed: torchrun started this node's processes
                return
            time.sleep(1)
        print(f"{PROG}: {where} did not form in {seconds} s: ending this node", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


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
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UserInputError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 2
    line = address_refusal(args) or refusal([args.training_script, *args.training_script_args])
    if not line and args.rdzv_backend == "c10d" and args.rdzv_endpoint and not args.standalone:
        line = endpoint_problem(args)
    try:
        nodes, seconds = rendezvous_settings(args)
    except UserInputError as error:
        line = line or f"{PROG}: error: {error}"
    if line:
        print(line, file=sys.stderr, flush=True)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every process's threads, whatever the processes per node
    if nodes > 1 and not args.standalone:
        watch_the_rendezvous(args, nodes, seconds)
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
    freeze_imports()  # (torch's objects, for the launcher's whole wait)
    sys.exit(main())

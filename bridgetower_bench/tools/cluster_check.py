"""Check every node of a several-node job in seconds, before the long run, from where the job is started:

    python -m bridgetower_bench.tools.cluster_check --hostfile hostfile --output_dir /shared/runs
    python -m bridgetower_bench.tools.cluster_check --nodes gpu-a,gpu-b --output_dir /shared/runs --rdzv-port 29500

Each node is reached as the launchers reach it: `--remote-shell` (default `ssh`; on Gaudi, where DeepSpeed's
launcher reaches each node's container through ~/.ssh/config, the same) with the host and one shell line, which
runs this module from this kit's directory with this interpreter (the same paths on every node), every word
quoted. Two calls per node, all nodes at once, each bounded by `--timeout` (the call's process group is ended with
it, and the node's own process ends itself at the bound):

1. the node's report (JSON): the kit (its version and a hash of the scripts and the package), the versions of
   the libraries every rank of a job must share (`run_recipe.LIBRARIES`), beside them DeepSpeed and pdsh (what
   starts several Gaudi nodes: needed on each with `--backend hccl`) and the Intel Gaudi software (Habana's
   PyTorch plugin and the driver, "absent" where not installed), the devices (GPUs, HPUs, CPU cores),
   and `--output_dir`: there, and a token file written into it; on the first node, whether the rendezvous port
   is free;
2. the rendezvous, once every node answered: each node reads every node's token (one directory, shared), joins
   a TCP store at the first node's port, then one all_reduce of ones across the nodes (one process per node,
   `--backend`) must sum to the node count.

One table, a row per node and check (kit and libraries compared with the first node, devices with the
hostfile's slots), and a shareable JSON record (`--json`, default `<output_dir>/cluster_check.json`, which runs
leave there). Exit status: 0 when every row passed, 1 when one failed, 2 on bad input (one line, nothing started),
130 on Ctrl-C (at once: every call ended, the tokens removed). The tokens are named after this process
(`run_directory.CHECK_TOKEN`): a run ignores them, and removes those of a check that was killed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Optional

from bridgetower_bench.output_dir.atomic_files import remove_abandoned, temp_path, write_atomically
from bridgetower_bench.output_dir.run_directory import CHECK_RECORD, CHECK_TOKEN, is_check_token
from bridgetower_bench.output_dir.run_recipe import LIBRARIES, job_recipe
from bridgetower_bench.redaction import shareable
from bridgetower_bench.tools import hosts, self_check, tool_paths
from bridgetower_bench.tools.self_check import FAILED, OK, REPO, SKIPPED, Row
from bridgetower_bench.tools.sweep.run import dies_with_this_process
from bridgetower_bench.user_errors import UserInputError


TOOL = "cluster_check"
KIT_FILES = ("run_bridgetower.py", "run_bridgetower_cuda.py", "pyproject.toml")
BACKEND_DEVICES = {"nccl": "gpus", "hccl": "hpus"}  # what a node needs `slots` of for the backend
NODE_SHARE = 0.8  # of --timeout, for a node's own waits: it says why before the caller's bound ends the call


@dataclass
class Answer:
    """What one remote call gave: its JSON lines merged, why it failed ('' when it did not), how long it took."""

    values: dict
    problem: str
    seconds: float


# ----------------------------------------------------------------------------------------
# On each node
# ----------------------------------------------------------------------------------------


def say(**values) -> None:
    print(json.dumps(values), flush=True)


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def kit() -> dict:
    """This kit's version and a hash of what a run executes (the scripts, the package's modules)."""
    digest = hashlib.sha256()
    for path in [REPO / name for name in KIT_FILES] + sorted((REPO / "bridgetower_bench").rglob("*.py")):
        if path.is_file():
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    return {"path": str(REPO), "version": version and version[1], "hash": digest.hexdigest()[:16]}


def devices() -> dict:
    """The GPUs torch sees, the HPUs Habana's PyTorch sees, and the usable CPU cores. torch is imported (seconds)
    only where a driver lists a GPU or Habana's PyTorch is installed: elsewhere neither sees a device."""
    found = {"gpus": 0, "hpus": 0, "cpus": len(os.sched_getaffinity(0))}
    try:
        if os.path.isdir("/proc/driver/nvidia/gpus"):
            import torch

            found["gpus"] = torch.cuda.device_count()
        if importlib.util.find_spec("habana_frameworks") is not None:
            import habana_frameworks.torch.hpu as hpu

            found["hpus"] = int(hpu.device_count())
    except Exception:  # no torch (the libraries row says so), or a runtime that cannot be queried (0 devices)
        pass
    return found


def launchers() -> dict:
    """What starts several Gaudi nodes (docs/RUNS.md, "Several Gaudi nodes"): DeepSpeed, whose module every node
    runs (`python -m deepspeed.launcher.launch`), its version or None; pdsh, on PATH or not."""
    return {"deepspeed": installed("deepspeed"), "pdsh": shutil.which("pdsh") is not None}


def gaudi_software() -> dict:
    """Intel Gaudi software here: Habana's PyTorch plugin's version and the driver's (as `hl-smi` says it,
    read by optimum-habana's helper), None where absent."""
    driver = None
    if shutil.which("hl-smi") is not None:  # (the record's reader imports torch: only where there is a driver)
        from bridgetower_bench.measurement.run_record import gaudi_driver_version

        driver = gaudi_driver_version()
    return {"habana-torch-plugin": installed("habana-torch-plugin"), "driver": driver}


def installed(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def token_file(output_dir: str, token: str, index: int) -> Path:
    """Node `index`'s token file: `token` is a temporary name's tail of the check's host and process (`new_token`)."""
    return Path(output_dir) / f"{CHECK_TOKEN}-{index}{token}"


def new_token() -> str:
    return temp_path("")


def remove_tokens(output_dir: str, token: str) -> None:
    """The tokens this machine sees (those of a node-local directory stay on that node, until a run or check there)."""
    for path in Path(output_dir).glob(f"{CHECK_TOKEN}-*{token}"):
        path.unlink(missing_ok=True)


def output_dir_problem(output_dir: str, token: str, index: int) -> str:
    """'' once this node wrote its token into `output_dir`; else why not."""
    if not os.path.isdir(output_dir):
        return f"{output_dir}: {'not a directory' if os.path.exists(output_dir) else 'no such directory'} here"
    try:
        token_file(output_dir, token, index).write_text(token)
    except OSError as error:
        return f"{output_dir}: cannot write into it: {error.strerror or error}"
    return ""


def port_problem(port: int) -> str:
    """'' when this node can listen on `port`, as the rendezvous' store will; else why not."""
    try:
        socket.create_server(("", port)).close()
    except OSError as error:
        return f"port {port} cannot be listened on here: {error.strerror or error}"
    return ""


def node_report(args) -> None:
    values = {
        "kit": kit(),
        "libraries": {key.removeprefix("version_"): version for key, version in job_recipe({}).items()},
        "launchers": launchers(),
        "gaudi_software": gaudi_software(),
        "devices": devices(),
        "output_dir_problem": output_dir_problem(args.output_dir, args.token, args.index),
    }
    if args.check_port:
        values["port_problem"] = port_problem(args.rdzv_port)
    say(**values)


def node_rendezvous(args) -> None:
    """Read every node's token, join the store at the first node, all_reduce ones: a JSON line after each."""
    deadline = time.monotonic() + NODE_SHARE * args.timeout
    say(unread=[i for i in range(args.world) if not token_readable(args.output_dir, args.token, i)])
    import torch
    import torch.distributed as dist

    def left() -> timedelta:
        return timedelta(seconds=max(1.0, deadline - time.monotonic()))

    try:
        store = dist.TCPStore(args.master, args.rdzv_port, args.world, args.index == 0, timeout=left())
    except Exception as error:  # the store's errors: refused, timed out, address in use
        say(store=one_line(error))
        return
    say(store="")
    try:
        device = torch.device("cpu")
        if args.backend == "nccl":
            torch.cuda.set_device(0)
            device = torch.device("cuda", 0)
        elif args.backend == "hccl":
            import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers the hccl backend)

            device = torch.device("hpu")
        dist.init_process_group(args.backend, store=store, rank=args.index, world_size=args.world, timeout=left())
        total = torch.ones(1, device=device)
        dist.all_reduce(total)
        say(sum=total.item())
    except Exception as error:
        say(sum=one_line(error))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def token_readable(output_dir: str, token: str, index: int) -> bool:
    try:
        return token_file(output_dir, token, index).read_text() == token
    except OSError:
        return False


# ----------------------------------------------------------------------------------------
# Where the job is started
# ----------------------------------------------------------------------------------------


def start(shell: list[str], host: str, flags: list[str]) -> subprocess.Popen:
    """This module with `flags` on `host` through the remote shell, from the kit's directory. Its own session: no
    terminal for ssh to prompt on, and a process group that `end` ends whole; it gets SIGTERM if this process dies."""
    command = shlex.join([sys.executable, "-m", f"bridgetower_bench.tools.{TOOL}", *flags])
    line = f"cd {shlex.quote(str(REPO))} && {command}"
    return subprocess.Popen(
        [*shell, host, line],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **dies_with_this_process(),
    )


def end(process: subprocess.Popen) -> None:
    """SIGKILL to the call's whole process group: the remote shell and whatever it left behind there."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def answer(process: subprocess.Popen, timeout: float, started: float) -> Answer:
    """A call's answer within `timeout` seconds of `started`; its process group ended either way."""
    try:
        out, err = process.communicate(timeout=max(0.0, started + timeout - time.monotonic()))
        problem = "" if process.returncode == 0 else f"exit status {process.returncode}"
    except subprocess.TimeoutExpired:
        end(process)
        try:
            out, err = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a process outside its group keeps the pipes open
            out, err = "", ""
        problem = f"no answer within {timeout:g} s (--timeout)"
    finally:
        end(process)  # a child the node's shell left in the background
    values = {}
    for text in out.splitlines():
        try:
            line = json.loads(text)
        except ValueError:  # a banner or a warning
            continue
        if isinstance(line, dict):
            values.update(line)
    if problem and not problem.startswith("no answer"):
        problem += f": {(err.strip().splitlines() or ['no output'])[-1][:300]}"
    return Answer(values, problem, time.monotonic() - started)


def ask_all(args, nodes: dict[str, Optional[int]], flags) -> list[Answer]:
    """Each node's answer to `flags(index)`, all nodes at once; on Ctrl-C every call is ended at once."""
    started = time.monotonic()
    calls = [start(args.remote_shell, host, flags(index)) for index, host in enumerate(nodes)]
    with ThreadPoolExecutor(len(calls)) as pool:
        try:
            waits = [pool.submit(answer, call, args.timeout, started) for call in calls]
            return [wait.result() for wait in waits]
        except BaseException:
            for call in calls:
                end(call)
            raise


def common_flags(args, index: int) -> list[str]:
    return [
        *("--output_dir", str(args.output_dir), "--token", args.token, "--index", str(index)),
        *("--rdzv-port", str(args.rdzv_port), "--timeout", str(args.timeout)),
    ]


def report_rows(host: str, slots: Optional[int], answer: Answer, first: dict, backend: str) -> list[Row]:
    """One node's rows from its report: reached, kit and libraries (as on the `first` node), devices (for the
    backend and the hostfile's slots), output_dir (and, on the first node, the rendezvous port)."""
    seconds = round(answer.seconds, 1)
    found = answer.values
    if "kit" not in found:
        return [Row(f"{host}: reached", FAILED, answer.problem or "no report line", seconds)]
    rows = [Row(f"{host}: reached", OK, f"through the remote shell, {found['kit']['path']}", seconds)]
    kit, theirs = found["kit"], first["kit"]
    if (kit["version"], kit["hash"]) != (theirs["version"], theirs["hash"]):
        detail = f"{kit['version']} ({kit['hash']}), the first node has {theirs['version']} ({theirs['hash']})"
        rows.append(Row(f"{host}: kit", FAILED, detail))
    else:
        rows.append(Row(f"{host}: kit", OK, f"{kit['version']} ({kit['hash']})"))
    versions = found["libraries"]
    differ = [
        f"{name} {versions.get(name) or 'not installed'}, the first node has {first['libraries'].get(name) or 'none'}"
        for name in LIBRARIES
        if versions.get(name) != first["libraries"].get(name)
    ]
    same = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
    rows.append(Row(f"{host}: libraries", FAILED if differ else OK, "; ".join(differ) or same))
    rows += [launchers_row(host, found["launchers"], backend), gaudi_software_row(host, found, first)]
    count = found["devices"]
    detail = f"{count['gpus']} GPUs, {count['hpus']} HPUs, {count['cpus']} CPU cores"
    short = too_few_devices(found, slots, backend)
    rows.append(Row(f"{host}: devices", FAILED if short else OK, f"{detail}: {short}" if short else detail))
    problem = found["output_dir_problem"]
    rows.append(Row(f"{host}: output_dir", FAILED if problem else OK, problem or "writable, its token written"))
    if "port_problem" in found:
        problem = found["port_problem"]
        rows.append(Row(f"{host}: rendezvous port", FAILED if problem else OK, problem or "free here"))
    return rows


def launchers_row(host: str, found: dict, backend: str) -> Row:
    """DeepSpeed and pdsh on the node: needed on every node for hccl (several Gaudi nodes start through DeepSpeed's
    launcher, which reaches them with pdsh), reported for the other backends."""
    detail = f"deepspeed {found['deepspeed'] or 'absent'}, pdsh {'present' if found['pdsh'] else 'absent'}"
    if backend == "hccl" and not (found["deepspeed"] and found["pdsh"]):
        return Row(f"{host}: deepspeed, pdsh", FAILED, f"{detail}: several Gaudi nodes start through both")
    return Row(f"{host}: deepspeed, pdsh", OK, detail)


def gaudi_software_row(host: str, found: dict, first: dict) -> Row:
    """Habana's PyTorch plugin and the Gaudi driver, each as on the first node."""
    mine, theirs = found["gaudi_software"], first["gaudi_software"]
    detail = ", ".join(f"{name} {mine[name] or 'absent'}" for name in ("habana-torch-plugin", "driver"))
    differ = [f"the first node has {name} {theirs[name] or 'absent'}" for name in mine if mine[name] != theirs[name]]
    return Row(
        f"{host}: Intel Gaudi software",
        FAILED if differ else OK,
        f"{detail}; {', '.join(differ)}" if differ else detail,
    )


def too_few_devices(found: dict, slots: Optional[int], backend: str) -> str:
    """Why a node lacks the devices the backend needs (one a slot, at least one), or ''."""
    kind = BACKEND_DEVICES.get(backend)
    if kind is None or found["devices"][kind] >= (slots or 1):
        return ""
    count = slots or 1
    return f"{backend} needs {count} {kind[:-1].upper()}{'s' * (count > 1)}" + (f" (slots={slots})" if slots else "")


def rendezvous_rows(args, nodes: dict, answers: list[Answer], endpoint: str) -> tuple[list[list[Row]], Row]:
    """What the second call showed: each node's view of every node's token and of the store; the all_reduce."""
    rows, sums = [], []
    names = list(nodes)
    for host, answer in zip(names, answers):
        found = answer.values
        unread = ", ".join(f"node {i} ({names[i]})" for i in found.get("unread", []))
        shared = f"cannot read the token of {unread}: not one directory" if unread else ""
        if "unread" not in found:
            shared = answer.problem or "no answer"
        store = found.get("store", answer.problem or "no answer")
        sums.append((host, found.get("sum", store or answer.problem or "no answer")))
        rows.append(
            [
                Row(f"{host}: output_dir shared", FAILED if shared else OK, shared or f"read all {len(names)} tokens"),
                Row(f"{host}: rendezvous", FAILED if store else OK, store or f"joined the store at {endpoint}"),
            ]
        )
    wrong = [(host, total) for host, total in sums if total != len(nodes)]
    detail = f"{args.backend} all_reduce of ones on {len(nodes)} node(s): sum {len(nodes)}"
    if wrong:
        host, total = wrong[0]
        detail = f"{host}: {total if isinstance(total, str) else f'sum {total:g}, not {len(nodes)}'}"
    seconds = round(max(answer.seconds for answer in answers), 1)
    return rows, Row("all nodes: collective", FAILED if wrong else OK, detail, seconds)


def not_tried(args, nodes: dict, reports: list[Answer]) -> str:
    """Why the rendezvous cannot run (the rows say more), or ''."""
    if any("kit" not in answer.values for answer in reports):
        return "a node did not answer"
    if reports[0].values.get("port_problem"):
        return "the rendezvous port is not free"
    if any(too_few_devices(answer.values, slots, args.backend) for slots, answer in zip(nodes.values(), reports)):
        return f"a node lacks the devices {args.backend} needs"
    return ""


def check(args, nodes: dict) -> tuple[list[Row], Row, list[Answer]]:
    """The two calls to every node; (the nodes' rows, node by node; the collective's row; the reports)."""
    reports = ask_all(
        args, nodes, lambda i: ["--node-report", *common_flags(args, i), *(["--check-port"] if i == 0 else [])]
    )
    first = next((answer.values for answer in reports if "kit" in answer.values), {})  # the first that answered
    if args.backend is None:  # the first node's devices choose
        found = reports[0].values.get("devices", {})
        args.backend = "hccl" if found.get("hpus") else "nccl" if found.get("gpus") else "gloo"
    rows = [report_rows(host, nodes[host], answer, first, args.backend) for host, answer in zip(nodes, reports)]
    master = hosts.machine(next(iter(nodes)))
    why = not_tried(args, nodes, reports)
    if why:
        return sum(rows, []), Row("all nodes: collective", SKIPPED, f"not tried: {why}"), reports
    world = ["--world", str(len(nodes)), "--master", master, "--backend", args.backend]
    answers = ask_all(args, nodes, lambda i: ["--node-rendezvous", *common_flags(args, i), *world])
    shared, collective = rendezvous_rows(args, nodes, answers, hosts.endpoint_text(master, args.rdzv_port))
    return sum((mine + theirs for mine, theirs in zip(rows, shared)), []), collective, reports


def nodes_of(args) -> dict[str, Optional[int]]:
    """The nodes in order, with their hostfile slots (None from --nodes)."""
    if args.hostfile is not None:
        counted = hosts.hostfile_nodes(args.hostfile, gaudi=False)
        for host, slots in counted.items():
            if slots < 1:
                raise UserInputError(
                    f"{hosts.hostfile_flag(args.hostfile)}: {host} slots={slots}: a node has 1 slot or more"
                )
        return dict(counted)
    nodes: dict[str, Optional[int]] = {}
    seen = set()
    for text in args.nodes.split(","):
        name = hosts.host(text.strip(), "--nodes", user=True)
        if hosts.same_node_key(name) in seen:
            raise UserInputError(f"--nodes: {name} is given twice")
        seen.add(hosts.same_node_key(name))
        nodes[name] = None
    return nodes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog=f"python -m bridgetower_bench.tools.{TOOL}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hostfile", help="The nodes: one `HOST slots=N` line each (DeepSpeed's format).")
    where.add_argument("--nodes", help="The nodes: HOST,HOST,... (the first keeps the rendezvous).")
    parser.add_argument(
        "--output_dir",
        help="The run's shared output directory, or the one that will hold it: every node must see one directory.",
    )
    parser.add_argument("--remote-shell", type=shlex.split, default="ssh", help="How each node is reached.")
    parser.add_argument("--rdzv-port", "--master_port", default="29500", help="The first node's rendezvous port.")
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl", "hccl"),
        default=None,
        help="Default: hccl, nccl or gloo, as the first node's devices.",
    )
    parser.add_argument("--timeout", default="30", help="Seconds allowed for each call to a node (default: 30).")
    parser.add_argument("--json", type=Path, help=f"The record's path (default: <output_dir>/{CHECK_RECORD}).")
    for flag in ("--node-report", "--node-rendezvous", "--check-port"):  # what a node is asked
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in ("--token", "--master"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--index", "--world"):
        parser.add_argument(flag, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.timeout = tool_paths.positive_number("--timeout", args.timeout, "a number of seconds above 0, e.g. 30")
    args.rdzv_port = hosts.port(args.rdzv_port, "--rdzv-port")
    if args.node_report or args.node_rendezvous:
        return args
    if args.hostfile is None and args.nodes is None:
        parser.error("give the nodes: --hostfile FILE or --nodes HOST,HOST,...")
    if args.output_dir is None:
        parser.error("give --output_dir: the shared directory every node must see")
    if not args.output_dir.strip():
        raise UserInputError(f"--output_dir={args.output_dir!r} is empty: give the run's shared output directory")
    args.output_dir = os.path.abspath(args.output_dir)
    if args.json is None and Path(args.output_dir) == REPO:
        raise UserInputError(
            f"--output_dir={args.output_dir}: the kit's own directory; give the run's (e.g. runs/NAME), "
            "or --json PATH for the record"
        )
    args.json = args.json or Path(args.output_dir) / CHECK_RECORD
    tool_paths.output_file("--json", args.json)
    if not args.remote_shell or shutil.which(args.remote_shell[0]) is None:
        raise UserInputError(f"--remote-shell: {shlex.join(args.remote_shell) or 'empty'}: no such command here")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.node_report or args.node_rendezvous:
        # A node's process ends itself at the caller's bound: a remote shell without a terminal leaves it running
        # when the caller ends the call (SIGALRM's default action, which no Python handler replaces).
        signal.alarm(math.ceil(args.timeout))
        (node_report if args.node_report else node_rendezvous)(args)
        return 0
    nodes = nodes_of(args)
    args.token = new_token()
    if os.path.isdir(args.output_dir):  # tokens of checks that were killed on this host
        remove_abandoned(args.output_dir, only=is_check_token)
    print(f"{TOOL}: asking {len(nodes)} node(s) through {shlex.join(args.remote_shell)}, {args.timeout:g} s each call")
    try:
        try:
            rows, collective, reports = check(args, nodes)
        finally:
            remove_tokens(args.output_dir, args.token)
    except KeyboardInterrupt:
        print(f"{TOOL}: stopped by Ctrl-C: every node's call ended, its tokens removed", file=sys.stderr)
        return 130
    print()
    cells = [
        (row.name, row.result, "" if row.seconds is None else f"{row.seconds:.1f}", row.detail)
        for row in [*rows, collective]
    ]
    print(self_check.columns(("node: check", "result", "seconds", "detail"), cells), end="")
    facts = {
        "nodes": {host: answer.values for host, answer in zip(nodes, reports)},
        "backend": args.backend,
        "rdzv_port": args.rdzv_port,
    }
    record = self_check.record(TOOL, facts, rows, [collective], Path(args.output_dir))
    record = shareable(record, args=list(sys.argv[1:] if argv is None else argv))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(args.json, json.dumps(record, indent=2) + "\n")
    print(f"record: {args.json} ({'passed' if record['passed'] else 'FAILED'})")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    tool_paths.run(main)

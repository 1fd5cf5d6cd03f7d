"""Running the sweep: every variant still to run, one subprocess (or one per node) each, supervised: its output
into its log (secrets scrubbed), stopped with all its processes on Ctrl-C, and dying with the sweep; a run across
nodes within its bounds (each node's first line, the whole run).
"""

from __future__ import annotations

import ctypes
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Optional

import psutil

from bridgetower_bench.output_dir.atomic_files import write_atomically
from bridgetower_bench.redaction import scrub, secret_values
from bridgetower_bench.tools.sweep.bench_report import INTERRUPTED, OK
from bridgetower_bench.tools.sweep.commands import REPO, Plan, Variant, hostfile_path
from bridgetower_bench.tools.sweep.resume import plan_resume, refuse_held_run_dirs, sweep_lock, write_results
from bridgetower_bench.tools.sweep.rows import collect_row, describe_row


def run_sweep(
    plan: Plan, out: Path, keep_weights: bool = False, echo: Callable[[str], None] = print
) -> tuple[list[dict], bool]:
    """Run every variant that `out` has no finished row of, in order; results.json/csv are rewritten after each
    run and keep the earlier sweeps' rows. Holds --out's lock throughout. Returns (every row, interrupted)."""
    with sweep_lock(out):
        kept, variants, to_run = plan_resume(plan, out)
        refuse_held_run_dirs(to_run, out)
        rows = dict(kept)
        finished = sum(1 for v in plan.variants if v not in to_run)
        if finished:
            echo(f"{finished} of {len(plan.variants)} run(s) already finished in {out} (kept); {len(to_run)} to run")
        interrupted = False
        for i, variant in enumerate(to_run, 1):
            alone = [rows.get(v.run_id) for v in plan.alone(variant)] if variant.nodes else []
            times = [row["wall_seconds"] for row in alone if row and row["status"] == OK and row.get("wall_seconds")]
            rows[variant.run_id] = run_variant(
                plan, variant, out, keep_weights, f"[{i}/{len(to_run)}]", echo, max(times, default=None)
            )
            write_results(out, plan, _in_order(rows, variants), variants)
            if rows[variant.run_id]["status"] == INTERRUPTED:
                interrupted = True
                break
        if not to_run:
            write_results(out, plan, _in_order(rows, variants), variants)
        return _in_order(rows, variants), interrupted


def _in_order(rows: Mapping[str, dict], variants: Sequence[Variant]) -> list[dict]:
    """The rows in the matrix's order (rows of variants no longer known, last)."""
    order = {v.run_id: i for i, v in enumerate(variants)}
    return sorted(rows.values(), key=lambda row: order.get(row["run_id"], len(order)))


def run_variant(
    plan: Plan,
    variant: Variant,
    out: Path,
    keep_weights: bool,
    progress: str,
    echo: Callable[[str], None],
    one_node_seconds: Optional[float] = None,
) -> dict:
    """Make one run and return its row (status "interrupted" when Ctrl-C or SIGTERM stopped it). A run across nodes
    (through the remote shell, or DeepSpeed's launcher for the Gaudi script) is bounded by `one_node_seconds`, its
    configuration's time on one node (`remote_bound`)."""
    run_dir, log_path = out / "runs" / variant.run_id, out / "logs" / f"{variant.run_id}.log"
    command = plan.command(variant, run_dir)
    echo(f"{progress} start  {variant.label}, repeat {variant.repeat} (log: {log_path})")
    remote = plan.remote_hosts(variant)
    bound = remote_bound(plan, one_node_seconds) if variant.nodes else None
    refuse_held_run_dirs([variant], out)  # claimed since the sweep started: leave it alone
    if run_dir.exists():  # left by an unfinished run of an earlier sweep: its results must not pass for this run's
        shutil.rmtree(run_dir)
    if variant.nodes and plan.script == "gaudi":  # launch_gaudi's nodes: the hostfile's first, --nproc HPUs each
        hostfile = hostfile_path(run_dir)
        hostfile.parent.mkdir(exist_ok=True)
        write_atomically(hostfile, "".join(f"{host} slots={plan.nproc}\n" for host in plan.hosts[: variant.nodes]))
    started, cpu_before, reason = time.perf_counter(), cpu_seconds(), ""
    try:
        if variant.nodes and bound is None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text(f"bench: {NOT_BOUNDED}\n")
            raise RemoteRunStopped(NOT_BOUNDED, None)
        if bound:
            echo(f"{progress} wait   at most {bound[1]} for its {variant.nodes} nodes")
        env = plan.run_env(variant)
        returncode: Optional[int] = run_process(
            plan.node_commands(variant, command),
            env,
            log_path,
            plan.shown_command(command, out, variant),
            frozenset(secret_values(command, env)),
            remote,
            plan.remote_start_timeout,
            bound,
        )
    except RemoteRunStopped as e:
        returncode, reason = e.status, str(e)
    except KeyboardInterrupt:
        returncode = None
    wall = time.perf_counter() - started
    row = collect_row(plan, variant, returncode, run_dir, log_path, command, wall, out, reason)
    row.update(other_cpu_cores=other_cpu_cores(cpu_before, cpu_seconds(), wall), cpu_count=os.cpu_count())
    if not keep_weights:
        _discard_weights(run_dir)
    echo(f"{progress} {'done' if row['status'] == OK else row['status']:6} {describe_row(row)}")
    return row


NOT_BOUNDED = (
    "not started: no run of its configuration on one node finished, and that run's time bounds a run across nodes "
    "(--remote-margin)"
)


def remote_bound(plan: Plan, one_node_seconds: Optional[float]) -> Optional[tuple[float, str]]:
    """A run across nodes' bound in seconds from its start, and how it was reckoned; None without a one-node time."""
    if one_node_seconds is None:
        return None
    seconds = plan.remote_start_timeout + plan.remote_margin * one_node_seconds
    return seconds, (
        f"{seconds:.0f} s (--remote-start-timeout {plan.remote_start_timeout:g} s + --remote-margin "
        f"{plan.remote_margin:g} x {one_node_seconds:g} s, its configuration's run on one node)"
    )


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, those of this process and of its children that ended)."""
    times = psutil.cpu_times()
    # Linux counts guest time inside user time; idle and I/O wait are no work.
    idle = sum(getattr(times, name, 0.0) for name in ("idle", "iowait", "guest", "guest_nice"))
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(times) - idle, sum(usage.ru_utime + usage.ru_stime for usage in own)


def other_cpu_cores(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """The cores other programs kept busy, on average, between two `cpu_seconds` readings `wall` seconds apart:
    the machine's busy time less the sweep's and its run's (a run's processes that outlive it are not counted)."""
    busy, own = (b - a for a, b in zip(before, after))
    return round(max(0.0, busy - own) / wall, 2) if wall > 0 else 0.0


def _discard_weights(run_dir: Path) -> None:
    """Delete saved weights and checkpoints of a finished run: the metrics are what the sweep keeps."""
    if not run_dir.is_dir():
        return
    for path in run_dir.iterdir():
        if path.is_dir() and path.name.startswith("checkpoint-"):
            shutil.rmtree(path)
        elif path.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            path.unlink()


def _stop(procs: Sequence[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Stop a run's processes and every process they started (each its own process group): SIGINT, then SIGTERM,
    then SIGKILL, each to the groups whose first process is still there; then SIGKILL to every group, for what
    outlived its first process (a shell's background child ignores SIGINT)."""
    left = list(procs)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        for proc in list(left):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                left.remove(proc)
        deadline = time.monotonic() + grace_s
        for proc in list(left):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                left.remove(proc)
            except subprocess.TimeoutExpired:
                continue
        if not left:
            break
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# prctl(2) option: the signal this process gets when the thread that started it ends (Linux).
PR_SET_PDEATHSIG = 1
# What a run gets when the sweep dies: SIGTERM, as from a plain `kill` (a training run saves a checkpoint at
# its next step and exits; torchrun and mpirun pass it to their ranks, which SIGKILL would orphan).
PARENT_DEATH_SIGNAL = signal.SIGTERM


def dies_with_this_process() -> dict:
    """Popen options that make the child get PARENT_DEATH_SIGNAL when this process ends, however it ends.

    Linux only (prctl PR_SET_PDEATHSIG, set in the child between fork and exec); elsewhere no options. If
    this process ended before the child set it, the child signals itself at once. The kernel sends it when
    the thread that started the child ends: start runs from a thread that lives as long as the sweep.
    """
    if not sys.platform.startswith("linux"):
        return {}
    libc = ctypes.CDLL(None, use_errno=True)  # looked up before the fork: the child only calls it
    prctl, parent = libc.prctl, os.getpid()

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

    return {"preexec_fn": set_parent_death_signal}


class RemoteRunStopped(Exception):
    """A node of a run across nodes ended or stayed silent before its first line, or a node still ran at the run's
    bound; the run was stopped."""

    def __init__(self, reason: str, status: Optional[int]):
        super().__init__(reason)
        self.status = status


def run_process(
    commands: Sequence[list[str]],
    env: dict,
    log_path: Path,
    shown_command: Optional[str] = None,
    secrets: frozenset = frozenset(),
    hosts: Sequence[str] = (),
    start_timeout: float = 60.0,
    bound: Optional[tuple[float, str]] = None,
) -> int:
    """Run `commands` together (one, or one per node of a run across nodes) with their output in `log_path`;
    return the first non-zero exit status in their order, else 0. Ctrl-C stops them (and their children) and is
    re-raised. With `hosts` (commands[i] is a remote shell to hosts[i]), each command must print a line within
    `start_timeout` seconds and before it exits. With `bound` (seconds from the start, and how it was reckoned), all
    must end within it, or the run is stopped, as by Ctrl-C, and RemoteRunStopped raised.

    The log starts with `shown_command`'s lines (default: the commands), each after `$ `. Several commands'
    output lines are prefixed `[node I] ` (I: the command's place, from 0). With `secrets`, `hosts` or several
    commands, the output passes through the sweep line by line, each secret replaced by a placeholder on its way
    to the log.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    several = len(commands) > 1
    piped = bool(secrets) or several or bool(hosts)
    with open(log_path, "wb") as log:
        shown = shown_command.splitlines() if shown_command else [shlex.join(command) for command in commands]
        log.write(("".join(f"$ {line}\n" for line in shown) + "\n").encode())
        log.flush()
        procs = [_start(command, env, subprocess.PIPE if piped else log) for command in commands]
        lock, first_lines = threading.Lock(), [threading.Event() for _ in procs]
        copies = [
            threading.Thread(
                target=_copy_lines,
                args=(proc.stdout, log, lock, f"[node {i}] ".encode() if several else b"", secrets, first_line),
                daemon=True,
            )
            for i, (proc, first_line) in enumerate(zip(procs, first_lines))
            if piped
        ]
        for copy in copies:
            copy.start()
        started = time.monotonic()
        try:
            if hosts:
                not_started = _wait_for_first_lines(procs, copies, first_lines, commands, hosts, start_timeout)
                if not_started:
                    raise RemoteRunStopped(*not_started)
            if bound:
                names = [f"node {i} ({host})" for i, host in enumerate(hosts)] or ["its launcher"] * len(procs)
                _wait_within(procs, names, started + bound[0], bound[1])
            statuses = [proc.wait() for proc in procs]
            for copy in copies:
                copy.join()
        except BaseException as e:
            _stop(procs)
            for copy in copies:  # a process outside the run's groups (torchrun's ranks) may keep a pipe open
                copy.join(timeout=10)
            if isinstance(e, RemoteRunStopped):
                with lock:
                    log.write(f"\nbench: {e}\n".encode())
                e.status = e.status or next((proc.returncode for proc in procs if proc.returncode), 0)
            raise
        return next((status for status in statuses if status), 0)


def _wait_for_first_lines(
    procs: Sequence[subprocess.Popen],
    copies: Sequence[threading.Thread],
    first_lines: Sequence[threading.Event],
    commands: Sequence[list[str]],
    hosts: Sequence[str],
    timeout: float,
) -> Optional[tuple[str, int]]:
    """Wait, `timeout` seconds at most, for each remote command's first line of output; None once every one has
    printed, else (why the run did not start, the exit status of the node that ended)."""
    shell = Path(commands[0][0]).name
    deadline = time.monotonic() + timeout
    while True:
        silent = [i for i, first_line in enumerate(first_lines) if not first_line.is_set()]
        if not silent:
            return None
        for i in silent:  # ended, and its output too, without a line
            if procs[i].poll() is not None and not copies[i].is_alive() and not first_lines[i].is_set():
                status = procs[i].returncode
                return f"node {i} ({hosts[i]}): {shell} exited {status} before the run started", status
        if time.monotonic() >= deadline:
            nodes = ", ".join(f"node {i} ({hosts[i]})" for i in silent)
            return f"{nodes} printed nothing within --remote-start-timeout {timeout:g} s: the run was stopped", 0
        first_lines[silent[0]].wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))


def _wait_within(procs: Sequence[subprocess.Popen], names: Sequence[str], deadline: float, bound: str) -> None:
    """Wait for every command until `deadline` (time.monotonic()); RemoteRunStopped naming (`names`: each command's)
    those still running at it and the `bound`."""
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            nodes = ", ".join(name for name, p in zip(names, procs) if p.poll() is None)
            raise RemoteRunStopped(f"{nodes} still running at the run's bound, {bound}: the run was stopped", 0)


def _start(command: list[str], env: dict, stdout) -> subprocess.Popen:
    """Start one of a run's commands from the repository root, its output (stderr too) into `stdout`.

    Its own session: the terminal's Ctrl-C reaches only us, and `_stop` signals the run's whole process
    group (launcher, ranks, loader workers) without signalling us. Being outside our group, the run gets
    a parent-death signal instead: if we are killed (even by SIGKILL) it is stopped too. No stdin: a
    remote shell would read the terminal (ssh -tt would make it raw, and Ctrl-C would no longer reach us).
    """
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **dies_with_this_process(),
    )


def _copy_lines(
    stream, log, lock: threading.Lock, prefix: bytes, secrets: frozenset, first_line: threading.Event
) -> None:
    """A run's output into its log, line by line: secrets scrubbed, a terminal's line ends (ssh -tt) made plain;
    `first_line` set once a line has come."""
    for line in stream:
        first_line.set()
        with lock:
            try:
                log.write(prefix + scrub(line.replace(b"\r\n", b"\n"), secrets))
                log.flush()
            except ValueError:  # the log is closed: the run was stopped and the sweep has moved on
                return

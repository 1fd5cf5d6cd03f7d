"""More than one process: the CUDA script under torchrun on CPU (gloo), as two nodes of one process each (two
launch_cuda agents on this machine meeting through c10d) or one node of two. Each rank trains on its own rows
(together: every row once), the metrics are reported and written once (rank 0), and the sample counts add up to
what one process sees. A signal to one rank stops all of them at the same step, with a complete checkpoint, before
any of them exits."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed import run as torchrun
from transformers import HfArgumentParser

from bridgetower_bench.arguments import WarmupTrainingArguments
from bridgetower_bench.output_dir import checkpoint_manifest
from bridgetower_bench.published import DATASET_REVISION
from bridgetower_bench.tools.fixtures import script_arguments
from helpers import (
    CPU_FLAGS,
    REPO,
    SCRIPTS,
    base_args,
    load_weights,
    once_per_session,
    read_json,
    run_script,
    run_tool,
    script_env,
    script_module,
)


ROWS, STEPS, WARMUP = 16, 4, 1


def args(fixtures, output_dir, per_device_batch, **overrides):
    values = {
        **script_arguments(fixtures),
        "output_dir": output_dir,
        "per_device_train_batch_size": per_device_batch,
        "max_train_samples": ROWS,
        "max_steps": STEPS,
        "throughput_warmup_steps": WARMUP,
        "logging_steps": 1,
        "report_to": "none",
        "seed": 7,
        "save_strategy": "no",
        "dataloader_num_workers": 0,
        **overrides,
    }
    flags = [item for key, value in values.items() for item in (f"--{key}", str(value))]
    return flags + ["--do_train"] + CPU_FLAGS["cuda"]


# Runs the script unchanged, but each rank records which rows of the training set its DataLoader fetched; rank 1
# alone sends itself SIGTERM while fetching its third batch (step 2 or 3); rank 0 saves checkpoints slowly (as on a
# network filesystem); and each rank notes when it leaves the script.
SIGNALLING_WRAPPER = """
import atexit, json, os, runpy, signal, sys, time
import datasets, transformers

rank, fetched = os.environ["RANK"], []
original_fetch = datasets.Dataset.__getitems__

def fetch(self, keys):
    fetched.append([int(k) for k in keys])
    if rank == "1" and len(fetched) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return original_fetch(self, keys)

datasets.Dataset.__getitems__ = fetch
if rank == "0":
    original_save = transformers.Trainer._save_optimizer_and_scheduler

    def slow_save(self, output_dir):
        time.sleep(3)
        return original_save(self, output_dir)

    transformers.Trainer._save_optimizer_and_scheduler = slow_save

@atexit.register  # (a distributed CPU run ends through its exit handlers, without the interpreter's teardown)
def note_rows_and_exit_time():
    with open(os.path.join(os.environ["EXIT_TIMES_DIR"], "rows" + rank), "w") as f:
        json.dump([row for batch in fetched for row in batch], f)
    with open(os.path.join(os.environ["EXIT_TIMES_DIR"], "rank" + rank), "w") as f:
        f.write(repr(time.time()))

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# The README's multi-GPU command: tools/launch_cuda.py, torchrun with one-line endings -------------------------


def one_node(processes, *script_and_flags):
    """launch_cuda on this machine alone (`--standalone`) with `processes` processes."""
    launch = [sys.executable, "-m", "bridgetower_bench.tools.launch_cuda", "--standalone", "--nproc_per_node"]
    return launch + [str(processes)] + [str(a) for a in script_and_flags]


def run(command, env=None, timeout=600):
    """`command` run to its end in the repository, its output captured; script_env() hides every GPU."""
    return run_together([command], env, timeout)[0]


def run_together(commands, env=None, timeout=600):
    """Each of `commands` as `run` runs it, all started at once: their results, in order."""
    env = env or script_env(gaudi=False)
    options = dict(cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes = [subprocess.Popen(command, **options) for command in commands]
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]  # (a process may wait on a full pipe meanwhile)
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(processes, outputs)]
    finally:
        for process in processes:
            process.kill()  # (one that timed out; the others have ended)
            process.wait()


def test_launch_cuda_refuses_a_run_without_a_usable_gpu_once_in_one_line(fixtures, tmp_path):
    # CUDA_VISIBLE_DEVICES is empty in script_env: the no-GPU refusal on any machine
    result = run(one_node(2, REPO / SCRIPTS["cuda"], *base_args(fixtures, tmp_path / "out"), "--do_train"))
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
    [line] = result.stderr.splitlines()
    assert line.startswith("run_bridgetower_cuda.py: error: no usable NVIDIA GPU: ")  # why: as this machine says
    assert line.endswith("pass --use_cpu to train on the CPU on purpose.") and not (tmp_path / "out").exists()


def test_launch_cuda_ends_failed_processes_in_one_line_with_their_status(tmp_path):
    # A stand-in that refuses its flags as the scripts do (one line, status 2), without their imports' seconds.
    script = tmp_path / "refusing.py"
    script.write_text(
        "import sys\nprint('refusing.py: error: argument --learning_rate', file=sys.stderr)\nsys.exit(2)\n"
    )
    result = run(one_node(2, script, "--use_cpu", "--learning_rate", "abc"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert "refusing.py: error: argument --learning_rate" in result.stderr  # from each process
    assert re.fullmatch(
        r"launch_cuda: refusing.py failed in [12] of 2 process\(es\), first in rank [01]: exit status 2",
        result.stderr.splitlines()[-1],
    ), result.stderr[-3000:]


def test_a_signal_to_launch_cuda_reaches_the_processes_which_checkpoint_and_it_ends_in_one_line(fixtures, tmp_path):
    """A scheduler signals the launcher (one task per node): once ended in torchrun's SignalException traceback."""
    out = tmp_path / "out"
    command = one_node(1, REPO / SCRIPTS["cuda"], *args(fixtures, out, per_device_batch=2, max_steps=10000))
    with open(tmp_path / "log", "w") as log:
        launcher = subprocess.Popen(
            command, cwd=REPO, env=script_env(gaudi=False), stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 300
        while "'loss'" not in (tmp_path / "log").read_text():
            assert time.monotonic() < deadline and launcher.poll() is None, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=120)
    text = (tmp_path / "log").read_text()
    assert code == 143 and "Traceback" not in text, text[-3000:]
    assert text.splitlines()[-1] == (
        "launch_cuda: stopped by SIGTERM: every process got SIGTERM and torchrun's --shutdown_timeout to save and exit"
    )
    [checkpoint] = out.glob("checkpoint-*")  # the rank stopped at its next step, with a complete checkpoint
    assert f"Training stopped by SIGTERM at step {checkpoint.name.split('-')[1]} of 10000" in text
    assert checkpoint_manifest.incomplete_reason(str(checkpoint)) is None


# Several nodes, torchrun's way: two launch_cuda agents on this machine meet through c10d, one process each -----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(port, job, node_rank, *script_and_flags, **rdzv_conf):
    command = [sys.executable, "-m", "bridgetower_bench.tools.launch_cuda", "--nnodes", "2", "--nproc_per_node", "1"]
    command += ["--node_rank", str(node_rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"]
    conf = ",".join(f"{k}={v}" for k, v in rdzv_conf.items())
    command += ["--rdzv_id", job] + ([f"--rdzv_conf={conf}"] if conf else [])
    return command + [str(a) for a in script_and_flags]


def job_commands(port, job, per_node):
    """The two nodes' launchers (`per_node`: each node's script and flags): node 0 keeps the rendezvous, node 1
    joins it (torchrun's c10d option `is_host`; without it, the first to bind the port would keep it), so that they
    may start at once."""
    return [node_command(port, job, node, *per_node[node], is_host=int(node == 0)) for node in (0, 1)]


def start_nodes(commands, logs, env):
    """The nodes' launchers, started together, each in a session of its own with its output in a file."""
    return [
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        for command, log in zip(commands, logs)
    ]


def two_nodes(tmp_path, job, script_and_flags, env=None, logs="node"):
    """The job's two nodes (`script_and_flags`: both nodes', or a pair, one per node) run to their end, their output
    in tmp_path/<logs><node>.log: (exit statuses, outputs, the rendezvous port)."""
    port, files = free_port(), [tmp_path / f"{logs}{node}.log" for node in (0, 1)]
    per_node = script_and_flags if isinstance(script_and_flags, tuple) else (script_and_flags,) * 2
    commands = job_commands(port, job, per_node)
    codes = [node.wait(timeout=600) for node in start_nodes(commands, files, env or script_env(gaudi=False))]
    return codes, [log.read_text() for log in files], port


def assert_each_node_ended(codes, text, script, status, job, port):
    """Node 0 (it keeps the rendezvous: `job_commands`) ends with its process's exit status in one line. So does
    node 1, or, torchrun having no exit barrier for a failed job, node 0 may end before node 1's process has
    exited: node 1 then loses the rendezvous, exit status 1, saying so."""
    ended = rf"launch_cuda: {script} failed in 1 of 1 process\(es\), first in rank [01]: exit status {status}"
    lost = (
        f"launch_cuda: the rendezvous '{job}' at 127.0.0.1:{port} was lost: its store does not answer (the node "
        "keeping it has ended or is unreachable)"
    )
    ends = [(code, log.splitlines()[-1]) for code, log in zip(codes, text)]
    assert codes[0] == status and re.fullmatch(ended, ends[0][1]), text[0][-3000:]
    assert (codes[1] == status and re.fullmatch(ended, ends[1][1])) or ends[1] == (1, lost), text[1][-3000:]


def test_an_output_dir_that_is_not_shared_by_the_nodes_is_refused_on_every_node_in_one_line(fixtures, tmp_path):
    # Node-local disks: the same path on each node names two directories; here, two paths on one machine.
    per_node = tuple(
        [REPO / SCRIPTS["cuda"], *args(fixtures, tmp_path / f"disk{n}", 2, ddp_backend="gloo")] for n in (0, 1)
    )
    codes, text, port = two_nodes(tmp_path, "local-disks", per_node)
    assert_each_node_ended(codes, text, "run_bridgetower_cuda.py", 2, "local-disks", port)
    for node, log in enumerate(text):
        assert "Traceback" not in log, log[-3000:]
        assert re.search(
            rf"run_bridgetower_cuda.py: error: --output_dir=\S+/disk{node} is not one directory for the whole job: "
            r"rank\(s\) 1 do not see the lock rank 0 took there \(a disk of their own node\?\); put it on a "
            "filesystem every node mounts at the same path",
            log,
        ), log[-3000:]
    assert not list((tmp_path / "disk0").glob("checkpoint-*")), "nothing saved"
    assert not (tmp_path / "disk0" / "model.safetensors").exists(), "nothing published"


# Rank 1 of the job is given another learning rate (as a node started with other flags would be).
OTHER_FLAGS_WRAPPER = """
import os, runpy, sys
sys.argv = sys.argv[1:] + (["--learning_rate", "1e-3"] if os.environ["RANK"] == "1" else [])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_processes_of_one_job_given_another_recipe_are_stopped_in_one_line_naming_it(fixtures, tmp_path):
    wrapper = tmp_path / "other_flags.py"
    wrapper.write_text(OTHER_FLAGS_WRAPPER)
    flags = args(fixtures, tmp_path / "out", per_device_batch=2, ddp_backend="gloo")
    result = run(one_node(2, wrapper, REPO / SCRIPTS["cuda"], *flags))
    assert result.returncode == 2, result.stderr[-3000:]
    said = (
        "run_bridgetower_cuda.py: error: the job's processes run different recipes (rank 1: --learning_rate 5e-05 → "
        "0.001): give every node the same command, kit and libraries"
    )
    # each process's one line (two processes writing to one pipe at once may run their lines together)
    assert result.stderr.count(said) == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out" / "recipe.json").exists()


def test_a_node_killed_mid_run_ends_the_other_node_within_seconds_in_one_line(fixtures, tmp_path):
    flags = args(fixtures, tmp_path / "run", per_device_batch=2, ddp_backend="gloo", max_steps=10000)
    port, logs = free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"]
    commands = job_commands(port, "killed", ([REPO / SCRIPTS["cuda"], *flags],) * 2)
    survivor, victim = start_nodes(commands, logs, script_env(gaudi=False))
    try:
        deadline = time.monotonic() + 400
        while not any("'loss'" in log.read_text() for log in logs):  # training under way (rank 0 logs)
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            assert victim.poll() is None and survivor.poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        # The node dies: its launcher and every process it started (they run in sessions of their own).
        tree = [victim.pid] + [p.pid for p in psutil.Process(victim.pid).children(recursive=True)]
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = survivor.wait(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        for node in (survivor, victim):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    log = logs[0].read_text()
    assert code != 0 and took < 60, log[-3000:]
    # gloo sees the peer's connection closed; the surviving rank fails and its node's launcher ends in one line.
    assert re.fullmatch(
        r"launch_cuda: run_bridgetower_cuda.py failed in 1 of 1 process\(es\), first in rank [01]: exit status \d+",
        log.splitlines()[-1],
    ), log[-3000:]


LISTENER = "import socket, sys, time; s = socket.create_server(('127.0.0.1', int(sys.argv[1]))); print(1, flush=True)"
LISTENER += "; time.sleep(120)"


def listening(port: int, *name: str) -> subprocess.Popen:
    """A program that holds the port and never answers (its command line ends with `name`)."""
    holder = subprocess.Popen([sys.executable, "-c", LISTENER, str(port), *name], stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()  # listening
    return holder


def never_started(tmp_path):
    """A script the node's launcher must end before it starts it."""
    script = tmp_path / "never_started.py"
    script.write_text("raise SystemExit('started')\n")
    return script


def test_a_node_that_never_joins_or_a_store_that_never_answers_ends_the_node_after_its_bound_in_one_line(tmp_path):
    # A node alone at its rendezvous; and at a listener that looks like a torchrun to the port check (its command
    # line says so) but never answers: torchrun's own timeouts do not end such a wait; the launcher's bound (join +
    # read timeouts) does. Both at once, with the shortest bounds torchrun takes (whole seconds).
    script, port = never_started(tmp_path), free_port()
    holder = listening(port, "torchrun-lookalike")
    alone_port = free_port()
    try:
        started = time.monotonic()
        alone, mute = run_together(
            [
                node_command(alone_port, "alone", 0, script, "--use_cpu", join_timeout=1),
                node_command(port, "mute", 0, script, "--use_cpu", join_timeout=1, read_timeout=1),
            ],
            timeout=120,
        )
        took = time.monotonic() - started
    finally:
        holder.kill()
    assert alone.returncode == 1 and "Traceback" not in alone.stderr, alone.stderr[-3000:]
    assert (
        f"launch_cuda: this node waits at the rendezvous 'alone' at 127.0.0.1:{alone_port} for the job's 2 nodes, at "
        "most 61 s (--rdzv_conf join_timeout=S,read_timeout=S)"
    ) in alone.stderr.splitlines()
    assert alone.stderr.splitlines()[-1] == (
        f"launch_cuda: the rendezvous 'alone' at 127.0.0.1:{alone_port}: not every one of the job's 2 node(s) joined "
        "in time (join_timeout)"
    )
    assert mute.returncode == 1 and "Traceback" not in mute.stderr, mute.stderr[-3000:]
    assert mute.stderr.splitlines()[-1] == (
        f"launch_cuda: the rendezvous 'mute' at 127.0.0.1:{port} did not form in 2 s: ending this node"
    )
    assert took < 60, took


def test_a_rendezvous_port_held_by_another_program_or_a_host_that_does_not_resolve_is_refused_at_once(tmp_path):
    # refused before anything starts: the launcher in this process (helpers.run_tool), as tests/test_hosts.py's
    def refused(command):
        return run_tool("launch_cuda", command[command.index("bridgetower_bench.tools.launch_cuda") + 1 :])

    script, port = never_started(tmp_path), free_port()
    holder = listening(port)
    try:
        taken = refused(node_command(port, "taken", 0, script, "--use_cpu"))
    finally:
        holder.kill()
    assert taken.returncode == 2 and taken.stderr.splitlines() == [
        f"launch_cuda: error: --rdzv_endpoint 127.0.0.1:{port}: port {port} is taken by "
        f"{os.path.basename(sys.executable)} (pid {holder.pid}), not a "
        "rendezvous: choose a free port"
    ], taken.stderr
    command = node_command(port, "nowhere", 0, script, "--use_cpu")
    command[command.index("--rdzv_endpoint") + 1] = "no-such-node.invalid:29500"
    nowhere = refused(command)
    assert nowhere.returncode == 2 and len(nowhere.stderr.splitlines()) == 1, nowhere.stderr
    assert nowhere.stderr.startswith(
        "launch_cuda: error: --rdzv_endpoint no-such-node.invalid:29500: no-such-node.invalid does not resolve ("
    )


# Without OMP_NUM_THREADS, torchrun sets one thread per process only with several processes per node and accelerate
# gives a lone process every core: CPU kernels then reduce in another order. launch_cuda sets one.
def without_threads_set() -> dict:
    return {key: value for key, value in script_env(gaudi=False).items() if key != "OMP_NUM_THREADS"}


def job_flags(fixtures, out):
    """The two-node job's flags: 12 steps (3 epochs) of 2 rows per process; no checkpoint but the signal's."""
    return args(fixtures, out, 2, ddp_backend="gloo", save_steps=100, max_steps=12, save_strategy="steps")


@pytest.fixture(scope="module")
def stopped_and_resumed(fixtures, tmp_path_factory):
    """One two-node job (once for the session: helpers.once_per_session), without OMP_NUM_THREADS: stopped by a
    signal to rank 1 (its nodes' logs node<N>.log), then the same command resumes it to its end (resumed<N>.log).
    Its records: the folder (its output in run/, a copy of it as the stop left it in stopped/, the ranks' rows and
    exit times in exits/), each phase's exit statuses, logs and rendezvous port."""

    def job(folder):
        wrapper = folder / "signal_rank1.py"
        wrapper.write_text(SIGNALLING_WRAPPER)  # rank 1 (on whichever node c10d put it) gets SIGTERM at step 2 or 3
        (folder / "exits").mkdir()
        flags = job_flags(fixtures, folder / "run")
        env = {**without_threads_set(), "EXIT_TIMES_DIR": str(folder / "exits")}
        stopped = two_nodes(folder, "stopped", [wrapper, REPO / SCRIPTS["cuda"], *flags], env)
        shutil.copytree(folder / "run", folder / "stopped")  # its output as the stop left it (times kept)
        # The same command on both nodes (without the signalling wrapper)
        resumed = two_nodes(folder, "resumed", [REPO / SCRIPTS["cuda"], *flags], env, logs="resumed")
        return {"folder": str(folder), "stopped": stopped, "resumed": resumed}

    return once_per_session(tmp_path_factory, "two-node-job", job)


def test_two_nodes_make_one_run_that_a_signal_on_one_node_stops_at_one_step_and_the_same_command_finishes(
    fixtures, stopped_and_resumed, tmp_path
):
    folder = Path(stopped_and_resumed["folder"])
    out, stopped, exits = folder / "run", folder / "stopped", folder / "exits"
    codes, text, port = stopped_and_resumed["stopped"]
    assert_each_node_ended(codes, text, "signal_rank1.py", 143, "stopped", port)  # stopped as by SIGTERM
    # Only rank 1 got the signal; rank 0 learnt of it at step 10, the first exchange after it, and both stopped.
    received = "SIGTERM received: training stops and saves a checkpoint after the current step"
    assert sum(log.count(received) for log in text) == 1, text
    assert sum("Training stopped by SIGTERM at step 10 of 12" in log for log in text) == 1  # rank 0's node says it
    assert [p.name for p in stopped.glob("checkpoint-*")] == ["checkpoint-10"]
    checkpoint = stopped / "checkpoint-10"
    assert read_json(checkpoint / "trainer_state.json")["global_step"] == 10
    # The checkpoint counts: both ranks' random states are in its manifest, written last.
    assert checkpoint_manifest.incomplete_reason(str(checkpoint)) is None
    manifest = checkpoint / checkpoint_manifest.MANIFEST_NAME
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(read_json(manifest)["files"])
    # Rank 1 had nothing to save, yet left only once rank 0's checkpoint was complete (its manifest is written
    # last): had it left first, its launcher would have torn the job down in the middle of rank 0's save.
    assert float((exits / "rank1").read_text()) >= manifest.stat().st_mtime
    # Each epoch (4 steps; 10 were trained): disjoint shards across the two nodes' ranks, every row once.
    ranks = [json.loads((exits / f"rows{r}").read_text()) for r in (0, 1)]
    per_epoch = ROWS // 2
    for epoch in (0, 1):
        shards = [rows[epoch * per_epoch : (epoch + 1) * per_epoch] for rows in ranks]
        assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == list(range(ROWS))

    # The same command on both nodes (without the signalling wrapper) resumed from it and finished the run.
    codes, text, _ = stopped_and_resumed["resumed"]
    assert codes == [0, 0], text[0][-3000:] + text[1][-3000:]
    assert sum(f"resuming training at {out / 'checkpoint-10'}" in log for log in text) == 2  # each node's rank
    assert read_json(out / "trainer_state.json")["global_step"] == 12
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.partial-*"))  # one published model

    # One run: the metrics reported once, for the whole job; the samples add up (this call's 2 steps, 1 warm-up).
    assert sum(t.count("***** train metrics *****") for t in text) == 1
    metrics = read_json(out / "train_results.json")
    assert metrics["world_size"] == 2 and metrics["throughput_counted_steps"] == 2 - WARMUP
    assert metrics["throughput_counted_samples"] + WARMUP * 2 * 2 == 2 * 2 * 2
    # Each node's own figures beside the job's: one process each, its samples over its own window.
    nodes = metrics["per_node"]
    assert [(n["node"], n["processes"]) for n in nodes] == [(0, 1), (1, 1)]
    for node in nodes:
        assert 0 < node["train_samples_per_second"] and 0 <= node["data_wait_fraction"] <= 1
        assert "energy_joules" not in node  # RAPL is not read with several processes on one CPU
    printed = [line.split() for t in text for line in t.splitlines() if line.lstrip().startswith("node ")]
    assert [words[:5] for words in printed] == [["node", node, "=", "1", "process(es),"] for node in ("0", "1")]

    # One process with the same global batch counts the same samples (no per-node figures: one node).
    one_flags = args(fixtures, tmp_path / "one", per_device_batch=4)
    run_script("cuda", one_flags)
    one = read_json(tmp_path / "one" / "train_results.json")
    assert "per_node" not in one
    assert one["throughput_counted_samples"] + WARMUP * 4 == STEPS * 4 == ROWS


# The README's line: `accelerate launch --multi_gpu` is torchrun underneath (here two CPU processes: --use_cpu).
def accelerate_launch(port: int) -> list:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1"]
    return command + ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]


@pytest.fixture(scope="module")
def accelerate_job(fixtures, tmp_path_factory):
    """One job of the two-node job's flags on one node of two processes, started by `accelerate launch --multi_gpu`
    without OMP_NUM_THREADS (once for the session: helpers.once_per_session); and beside it, accelerate's --cpu
    with a script that says its rank. Their exit statuses and output; the job's output in run/."""

    def job(folder):
        counted = folder / "counted.py"
        counted.write_text("import os\nprint('a process of rank', os.environ.get('RANK'))\n")
        script = [REPO / SCRIPTS["cuda"], *job_flags(fixtures, folder / "run")]
        multi_gpu = [str(word) for word in [*accelerate_launch(free_port()), "--multi_gpu", *script]]
        on_cpu = [*accelerate_launch(free_port()), "--cpu", str(counted)]
        results = run_together([multi_gpu, on_cpu], env=without_threads_set())
        return {"folder": str(folder), "results": [[r.returncode, r.stdout, r.stderr] for r in results]}

    return once_per_session(tmp_path_factory, "accelerate-job", job)


def test_one_node_of_two_processes_and_two_nodes_of_one_train_the_same_weights_with_the_same_threads(
    stopped_and_resumed, accelerate_job
):
    # The two nodes' job (stopped at step 10 and resumed: a resume ends with the uninterrupted run's weights), and
    # the same flags on one node of two processes (accelerate's launch, torchrun underneath as under launch_cuda)
    codes, text, _ = stopped_and_resumed["resumed"]
    assert codes == [0, 0], "".join(log[-3000:] for log in text)
    [code, _, stderr], _ = accelerate_job["results"]
    assert code == 0, stderr[-3000:]
    nodes, one = Path(stopped_and_resumed["folder"]) / "run", Path(accelerate_job["folder"]) / "run"
    for directory in (nodes, one):
        assert read_json(directory / "train_results.json")["cpu_threads"] == 1, directory
    nodes_weights, one_weights = load_weights(nodes), load_weights(one)
    assert nodes_weights.keys() == one_weights.keys()
    differ = [name for name in nodes_weights if not torch.equal(nodes_weights[name], one_weights[name])]
    assert not differ, f"two nodes of one (stopped and resumed) and one node of two differ in {differ}"


def test_accelerate_launch_multi_gpu_runs_the_cuda_script_as_one_job_of_its_processes(accelerate_job):
    [code, stdout, stderr], [alone_code, alone_stdout, alone_stderr] = accelerate_job["results"]
    out = Path(accelerate_job["folder"]) / "run"
    assert code == 0, stderr[-3000:]
    assert stdout.count("***** train metrics *****") == 1  # one run, reported once (rank 0)
    metrics = read_json(out / "train_results.json")
    assert (metrics["world_size"], metrics["cpu_threads"]) == (2, 1)
    assert read_json(out / "trainer_state.json")["global_step"] == 12 and (out / "model.safetensors").is_file()
    # Its --cpu alone starts one process, whatever --num_processes says (several CPU processes need its mpirun).
    assert alone_code == 0 and alone_stdout.splitlines() == ["a process of rank None"], alone_stderr[-3000:]


SBATCH = REPO / "scripts" / "multinode_cuda.sbatch"


def test_the_readmes_multi_node_commands_and_the_sbatch_file_run_the_published_command_by_c10d_rendezvous(tmp_path):
    # The README's two multi-node commands: torchrun's c10d rendezvous by hand and under Slurm.
    readme = (REPO / "README.md").read_text().replace("\\\n", " ")
    commands = [
        shlex.split(line, comments=True) for line in readme.splitlines() if re.search(r"launch_cuda\s+--nnodes", line)
    ]
    assert len(commands) == 2, commands
    for words in commands:
        options = torchrun.parse_args(words[words.index("bridgetower_bench.tools.launch_cuda") + 1 :])
        assert (options.nnodes, options.nproc_per_node, options.rdzv_backend) == ("2", "8", "c10d")
        assert options.rdzv_id != "none" and options.rdzv_endpoint.endswith(":29500")
        assert options.training_script == SCRIPTS["cuda"] and "--output_dir" in options.training_script_args
    slurm = commands[1]
    assert slurm[:5] == ["srun", "--nodes", "2", "--ntasks-per-node", "1"]  # one launcher per node
    assert slurm[5:7] == ["--cpus-per-task", "$SLURM_CPUS_PER_TASK"]  # srun no longer inherits it (Slurm 22.05)
    assert options.rdzv_id == "$SLURM_JOB_ID" and options.rdzv_endpoint == "$HEAD:29500"

    # The sbatch file: the published command once per node, with its CPUs and GPUs.
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0  # bash's syntax check
    # sbatch reads the `#SBATCH` lines before the first command
    head = SBATCH.read_text().split("\nset -euo pipefail\n")[0].splitlines()
    assert all(line.startswith("#") for line in head)
    directives = dict(line[len("#SBATCH ") :].partition("=")[::2] for line in head if line.startswith("#SBATCH --"))
    assert (directives["--nodes"], directives["--ntasks-per-node"]) == ("2", "1")  # one launch_cuda per node
    assert int(directives["--cpus-per-task"]) >= int(directives["--gpus-per-node"])  # a core per rank at least
    # The script as Slurm runs it, with stand-ins for scontrol and srun: srun records the words it is given; scontrol
    # writes the job's 64 node names one line at a time (a reader that closes the pipe after the first would end it
    # by SIGPIPE: exit status 141 under `pipefail`).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[ "$*" = "show hostnames gpu-[a-b,1-62]" ] || exit 3\n'
        "echo gpu-a; echo gpu-b; for i in $(seq 62); do echo gpu-$i; done\n"
    )
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "srun.txt"}\n')
    for program in ("scontrol", "srun"):
        (bin_dir / program).chmod(0o755)
    slurm = {"SLURM_JOB_NODELIST": "gpu-[a-b,1-62]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    slurm["SLURM_CPUS_PER_TASK"] = directives["--cpus-per-task"]  # as sbatch sets it from the directive
    slurm["SLURM_GPUS_PER_NODE"] = directives["--gpus-per-node"]  # as sbatch sets it from the directive

    def sbatch(**variables) -> subprocess.CompletedProcess:
        (tmp_path / "srun.txt").unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OUTPUT_DIR"))}
        env.update(slurm, **variables, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    for _ in range(40):  # the first node, however scontrol's writes and the script's reads interleave
        ran = sbatch()
        assert ran.returncode == 0, ran.stderr
    words = (tmp_path / "srun.txt").read_text().splitlines()
    python = words.index(".venv/bin/python")
    assert words[:python] == [
        *("--nodes", "2", "--ntasks-per-node", "1"),
        *("--cpus-per-task", directives["--cpus-per-task"]),  # given again: srun no longer inherits it (22.05)
        "--kill-on-bad-exit=1",
    ]
    assert words[python + 1 : python + 3] == ["-m", "bridgetower_bench.tools.launch_cuda"]
    options = torchrun.parse_args(words[python + 3 :])
    assert (options.nnodes, options.nproc_per_node) == ("2", directives["--gpus-per-node"])  # a rank per GPU
    assert (options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id) == ("c10d", "gpu-a:29500", "4242")
    assert options.training_script == SCRIPTS["cuda"]
    # The README's published 8-GPU command's flags, --output_dir in the submission directory (the nodes share it)
    (published,) = [
        line for line in readme.splitlines() if "launch_cuda --nproc_per_node 8 run_bridgetower_cuda" in line
    ]
    published = shlex.split(published)
    published = published[published.index(SCRIPTS["cuda"]) + 1 :]
    flags = options.training_script_args
    at = published.index("--output_dir")
    assert flags[at : at + 2] == ["--output_dir", f"{tmp_path}/runs/cuda-x2"]
    assert flags[:at] + flags[at + 2 :] == published[:at] + published[at + 2 :]
    # the data set revision the kit publishes (a revision `datasets` 4 and later load), no --trust_remote_code
    assert flags[flags.index("--dataset_revision") + 1] == DATASET_REVISION and "--trust_remote_code" not in flags
    script = script_module("cuda")
    parser = HfArgumentParser((script.ModelArguments, script.DataTrainingArguments, WarmupTrainingArguments))
    parser.parse_args(flags)  # every flag is one of the CUDA script's, with a value of its type (else SystemExit)
    # The GPUs per node are the job's: those allocated on the node, else the count --gpus-per-node asked for.
    for variables, count in [({"SLURM_GPUS_ON_NODE": "4"}, "4"), ({"SLURM_GPUS_PER_NODE": "h100:2"}, "2")]:
        assert sbatch(**variables).returncode == 0
        words = (tmp_path / "srun.txt").read_text().splitlines()
        assert words[words.index("--nproc_per_node") + 1] == count, variables
    for unknown in ("", "a100:2,v100:2", "0"):  # refused in one line, nothing started
        ran = sbatch(SLURM_GPUS_PER_NODE=unknown)
        assert (ran.returncode, ran.stdout) == (2, "") and not (tmp_path / "srun.txt").exists()
        assert ran.stderr == (
            f"multinode_cuda.sbatch: no GPU count per node in SLURM_GPUS_ON_NODE='' or SLURM_GPUS_PER_NODE='{unknown}': "
            "submit with --gpus-per-node=N\n"
        )

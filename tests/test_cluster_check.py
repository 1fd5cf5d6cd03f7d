"""The cluster check on local "nodes" (127.0.0.1, localhost, 127.0.0.2) reached through a stand-in remote shell
that runs the node's line on this machine, as tests/test_bench.py's sweep across nodes does."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from bridgetower_bench.output_dir import run_directory
from bridgetower_bench.tools import cluster_check
from helpers import REPO, ended, run_forked, run_tool, script_env


# Stands in for ssh: notes the host, then runs the line here, unless the file HOST.does beside it says `fail` (as
# ssh fails), `hang` (its pid in `shell`, a child's in `sleeping`), `detach` (leave a child in the background, its
# pid added to `detached`, then run the line), or `differ`: see another directory as --output_dir (a disk of its
# own at the same path, as far as the node can tell) and report another transformers version (its line rewritten).
REMOTE_SHELL = r"""#!/bin/bash
here="$(dirname "$0")"
echo "$1" >> "$here/hosts"
does="$(cat "$here/$1.does" 2>/dev/null)"
case "$does" in
fail) echo "ssh: connect to host $1 port 22: Connection refused" >&2; exit 255 ;;
hang) echo $$ > "$here/shell"; sleep 60 & echo $! > "$here/sleeping"; wait ;;
detach) sleep 60 > /dev/null 2>&1 & echo $! >> "$here/detached" ;;
differ)
    bash -c "${2//"$here/shared "/"$here/elsewhere "}" | sed 's/"transformers": "[^"]*"/"transformers": "0.0.1"/'
    exit "${PIPESTATUS[0]}" ;;
esac
exec bash -c "$2"
"""


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The flags of a check through the stand-in shell of a shared tmp directory, on a free port."""
    shell = tmp_path / "remote_shell"
    shell.write_text(REMOTE_SHELL)
    shell.chmod(0o755)
    (tmp_path / "shared").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the "nodes" share this machine's cores
    flags = ["--remote-shell", str(shell), "--output_dir", str(tmp_path / "shared"), "--rdzv-port", str(port)]
    return tmp_path, [*flags, "--json", str(tmp_path / "record.json")], port


def rows_of(tmp_path, printed: str) -> dict:
    """The record's rows, each in the printed table: {"node: check": (result, detail)}."""
    record = json.loads((tmp_path / "record.json").read_text())
    rows = {row["name"]: (row["result"], row["detail"]) for row in record["stack"] + record["steps"]}
    table = printed.splitlines()
    for name, (result, detail) in rows.items():
        assert any(line.startswith(f"{name}  ") and f" {result} " in line and line.endswith(detail) for line in table)
    return rows


def test_two_nodes_that_agree_pass_and_their_all_reduce_sums_two(cluster, capsys):
    tmp_path, flags, port = cluster
    assert cluster_check.main(["--nodes", "127.0.0.1,localhost", *flags]) == 0
    rows = rows_of(tmp_path, capsys.readouterr().out)
    checks = ("reached", "kit", "libraries", "deepspeed, pdsh", "Intel Gaudi software", "devices", "output_dir")
    checks += ("output_dir shared", "rendezvous")
    once = {"127.0.0.1: rendezvous port", "all nodes: collective"}
    assert set(rows) == {f"{host}: {check}" for host in ("127.0.0.1", "localhost") for check in checks} | once
    assert {result for result, _ in rows.values()} == {"ok"}, rows
    assert rows["localhost: output_dir shared"][1] == "read all 2 tokens"
    assert rows["localhost: rendezvous"][1] == f"joined the store at 127.0.0.1:{port}"
    # (no DeepSpeed, pdsh or Intel Gaudi software here: said, and needed by hccl only)
    assert rows["localhost: deepspeed, pdsh"][1] == "deepspeed absent, pdsh absent"
    assert rows["localhost: Intel Gaudi software"][1] == "habana-torch-plugin absent, driver absent"
    assert rows["all nodes: collective"][1].endswith("gloo all_reduce of ones on 2 node(s): sum 2")
    assert (tmp_path / "hosts").read_text().split().count("localhost") == 2  # the report, the rendezvous
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["passed"] and record["backend"] == "gloo" and list(record["nodes"]) == ["127.0.0.1", "localhost"]
    assert os.listdir(tmp_path / "shared") == []  # the tokens removed


def test_a_node_with_its_own_directory_and_transformers_fails_naming_both(cluster, capsys):
    tmp_path, flags, _ = cluster
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "localhost.does").write_text("differ")
    assert cluster_check.main(["--nodes", "127.0.0.1,localhost", *flags]) == 1
    rows = rows_of(tmp_path, capsys.readouterr().out)
    mine = json.loads((tmp_path / "record.json").read_text())["nodes"]["127.0.0.1"]["libraries"]["transformers"]
    assert rows["localhost: libraries"] == ("failed", f"transformers 0.0.1, the first node has {mine}")
    assert rows["127.0.0.1: libraries"][0] == rows["localhost: kit"][0] == "ok"
    # each wrote its token where it sees the directory, and neither reads the other's
    assert rows["localhost: output_dir"][0] == "ok"
    assert rows["localhost: output_dir shared"] == (
        "failed",
        "cannot read the token of node 0 (127.0.0.1): not one directory",
    )
    assert rows["127.0.0.1: output_dir shared"][1].startswith("cannot read the token of node 1 (localhost)")
    assert rows["all nodes: collective"][0] == "ok"  # the network is fine all the same


def test_several_gaudi_nodes_need_deepspeed_and_pdsh_on_each_and_one_intel_gaudi_software():
    ready = {"deepspeed": "0.16.1+hpu.synapse.v1.23.0", "pdsh": True}
    assert cluster_check.launchers_row("gaudi-b", ready, "hccl") == cluster_check.Row(
        "gaudi-b: deepspeed, pdsh", "ok", "deepspeed 0.16.1+hpu.synapse.v1.23.0, pdsh present"
    )
    no_pdsh = cluster_check.launchers_row("gaudi-b", {**ready, "pdsh": False}, "hccl")
    assert (no_pdsh.result, no_pdsh.detail) == (
        "failed",
        "deepspeed 0.16.1+hpu.synapse.v1.23.0, pdsh absent: several Gaudi nodes start through both",
    )
    assert cluster_check.launchers_row("gpu-b", {"deepspeed": None, "pdsh": False}, "nccl").result == "ok"

    first = {"gaudi_software": {"habana-torch-plugin": "1.30.0.123", "driver": "1.30.0"}}
    older = {"gaudi_software": {"habana-torch-plugin": "1.23.0.695", "driver": "1.30.0"}}
    assert cluster_check.gaudi_software_row("gaudi-a", first, first).detail == (
        "habana-torch-plugin 1.30.0.123, driver 1.30.0"
    )
    row = cluster_check.gaudi_software_row("gaudi-b", older, first)
    assert (row.result, row.detail) == (
        "failed",
        "habana-torch-plugin 1.23.0.695, driver 1.30.0; the first node has habana-torch-plugin 1.30.0.123",
    )


def test_a_node_the_shell_cannot_reach_and_a_taken_port_fail_in_their_rows(cluster, capsys):
    tmp_path, flags, port = cluster
    (tmp_path / "127.0.0.2.does").write_text("fail")
    with socket.create_server(("", port)):  # another job's rendezvous
        assert cluster_check.main(["--nodes", "127.0.0.1,127.0.0.2", *flags]) == 1
    rows = rows_of(tmp_path, capsys.readouterr().out)
    assert rows["127.0.0.2: reached"] == (
        "failed",
        "exit status 255: ssh: connect to host 127.0.0.2 port 22: Connection refused",
    )
    assert rows["127.0.0.1: rendezvous port"][1].startswith(f"port {port} cannot be listened on here: ")
    assert rows["all nodes: collective"] == ("skipped", "not tried: a node did not answer")
    assert "127.0.0.2: kit" not in rows


def test_a_hostfiles_slots_need_the_backends_devices_on_every_node(cluster, capsys):
    tmp_path, flags, _ = cluster
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=2\nlocalhost slots=1\n")
    assert cluster_check.main(["--hostfile", str(tmp_path / "hostfile"), *flags, "--backend", "nccl"]) == 1
    rows = rows_of(tmp_path, capsys.readouterr().out)
    cores = len(os.sched_getaffinity(0))
    assert rows["127.0.0.1: devices"] == ("failed", f"0 GPUs, 0 HPUs, {cores} CPU cores: nccl needs 2 GPUs (slots=2)")
    assert rows["localhost: devices"] == ("failed", f"0 GPUs, 0 HPUs, {cores} CPU cores: nccl needs 1 GPU (slots=1)")
    assert rows["all nodes: collective"] == ("skipped", "not tried: a node lacks the devices nccl needs")


def test_a_node_that_does_not_answer_fails_at_the_bound_with_everything_it_started(cluster, capsys):
    tmp_path, flags, _ = cluster
    (tmp_path / "localhost.does").write_text("hang")
    started = time.monotonic()
    code = cluster_check.main(["--nodes", "127.0.0.1,localhost", *flags, "--timeout", "2.5"])
    assert code == 1 and time.monotonic() - started < 15
    rows = rows_of(tmp_path, capsys.readouterr().out)
    assert rows["localhost: reached"] == ("failed", "no answer within 2.5 s (--timeout)")
    assert rows["all nodes: collective"] == ("skipped", "not tried: a node did not answer")
    assert ended((tmp_path / "sleeping").read_text()), "the hanging node's process outlived the bound"


def node_side_that_blocks(argv) -> int:
    """The node's side of a call (`--node-report`) whose probe never returns, as in a fresh interpreter: SIGALRM at
    its default action."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    cluster_check.node_report = lambda args: time.sleep(120)
    return cluster_check.main(argv)


def test_a_nodes_side_that_blocks_ends_itself_at_the_callers_bound():
    # A remote shell without a terminal leaves the node's process running when the caller ends the call (above);
    # the process ends itself, by SIGALRM, at --timeout rounded up to whole seconds.
    started = time.monotonic()
    result = run_forked(node_side_that_blocks, ["--node-report", "--timeout", "1.2"], timeout=60)
    took = time.monotonic() - started
    assert result.returncode == -signal.SIGALRM and 2 <= took < 30, (result, took)


def test_a_child_a_nodes_shell_leaves_in_the_background_ends_with_the_call(cluster, capsys):
    tmp_path, flags, _ = cluster
    (tmp_path / "localhost.does").write_text("detach")
    assert cluster_check.main(["--nodes", "localhost", *flags]) == 0
    detached = (tmp_path / "detached").read_text().split()
    assert len(detached) == 2  # the report's call and the rendezvous'
    assert all(ended(pid) for pid in detached), "a node's background child outlived its call"


def start_check(tmp_path, flags) -> subprocess.Popen:
    """The check as a process of its own (a signal to it is the subject), once the hanging node's shell has begun
    to hang and the first node's token is written."""
    check = subprocess.Popen(
        [sys.executable, "-m", "bridgetower_bench.tools.cluster_check", "--nodes", "127.0.0.1,localhost", *flags],
        cwd=REPO,
        env=script_env(False),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120  # a loaded machine starts Python slowly
    while not (list((tmp_path / "shared").glob(".cluster_check-0.*")) and (tmp_path / "sleeping").exists()):
        assert time.monotonic() < deadline and check.poll() is None, check.communicate()
        time.sleep(0.05)
    return check


def test_ctrl_c_ends_the_check_at_once_with_its_calls_and_tokens(cluster, ctrl_c_raises):
    tmp_path, flags, _ = cluster
    (tmp_path / "localhost.does").write_text("hang")
    check = start_check(tmp_path, [*flags, "--timeout", "300"])
    check.send_signal(signal.SIGINT)
    out, err = check.communicate(timeout=30)  # not the 300 s bound
    assert (check.returncode, err) == (
        130,
        "cluster_check: stopped by Ctrl-C: every node's call ended, its tokens removed\n",
    )
    assert os.listdir(tmp_path / "shared") == [] and not (tmp_path / "record.json").exists()
    assert ended((tmp_path / "shell").read_text()) and ended((tmp_path / "sleeping").read_text())


def test_after_sigkill_of_the_check_its_shells_end_and_a_run_ignores_then_removes_its_token(cluster):
    tmp_path, flags, _ = cluster
    (tmp_path / "localhost.does").write_text("hang")
    check = start_check(tmp_path, [*flags, "--timeout", "300"])
    check.kill()
    check.communicate()
    try:
        assert ended((tmp_path / "shell").read_text()), (
            "the remote shell outlived the check"
        )  # its parent-death signal
        shared = str(tmp_path / "shared")
        [token] = os.listdir(shared)
        run_directory.check_output_dir(shared)  # a training run takes the directory all the same
        run_directory.claim(shared)  # and removes the token of a check that died on this host
        run_directory.release(shared)
        assert not os.path.exists(os.path.join(shared, token)) and os.listdir(shared) == []
    finally:
        os.kill(int((tmp_path / "sleeping").read_text()), signal.SIGKILL)  # the shell's child: no process outlives it


def test_without_json_the_record_goes_into_the_runs_directory_which_a_run_then_takes(cluster, capsys):
    tmp_path, flags, _ = cluster
    flags = flags[: flags.index("--json")]
    assert cluster_check.main(["--nodes", "127.0.0.1", *flags]) == 0
    shared = tmp_path / "shared"
    assert capsys.readouterr().out.endswith(f"record: {shared / 'cluster_check.json'} (passed)\n")
    assert os.listdir(shared) == ["cluster_check.json"] and not (REPO / "cluster_check.json").exists()
    run_directory.check_output_dir(str(shared))  # the record is no file a run refuses
    # the kit's own directory is no run's: the record is not written into it
    refused = run_tool("cluster_check", ["--nodes", "127.0.0.1", *flags, "--output_dir", str(REPO)])
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        f"cluster_check: error: --output_dir={REPO}: the kit's own directory; give the run's (e.g. runs/NAME), "
        "or --json PATH for the record"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hostfile", "{tmp}/missing"], "--hostfile {tmp}/missing: No such file or directory"),
        (["--nodes", "127.0.0.1,a;b"], "--nodes: 'a;b' has ';', which no host name or IP address has"),
        (["--nodes", "localhost,LOCALHOST"], "--nodes: LOCALHOST is given twice"),
        (["--nodes", "localhost", "--rdzv-port", "70000"], "--rdzv-port: '70000' is not a port (1 to 65535)"),
        *[
            (["--nodes", "localhost", "--timeout", bound], f"--timeout {bound}: a number of seconds above 0, e.g. 30")
            for bound in ("nan", "inf", "0", "-1")
        ],
        (
            ["--nodes", "localhost", "--output_dir", ""],
            "--output_dir='' is empty: give the run's shared output directory",
        ),
        (["--hostfile", "{tmp}/slots0"], "--hostfile {tmp}/slots0: localhost slots=0: a node has 1 slot or more"),
        (["--hostfile", "slots\n0"], "--hostfile 'slots\\n0': localhost slots=0: a node has 1 slot or more"),
        (
            ["--nodes", "localhost", "--remote-shell", "no-such-shell"],
            "--remote-shell: no-such-shell: no such command here",
        ),
    ],
)
def test_bad_input_ends_in_one_line_and_starts_nothing(cluster, args, message):
    tmp_path, flags, _ = cluster
    for name in ("slots0", "slots\n0"):  # (the second named in its refusal escaped, on one line)
        (tmp_path / name).write_text("127.0.0.1 slots=1\nlocalhost slots=0\n")
    result = run_tool("cluster_check", [*flags, *(arg.format(tmp=tmp_path) for arg in args)], cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"cluster_check: error: {message.format(tmp=tmp_path)}"
    ]
    assert not (tmp_path / "hosts").exists() and not (tmp_path / "record.json").exists()

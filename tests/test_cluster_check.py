"""The cluster check on local "nodes" (127.0.0.1, localhost, 127.0.0.2) reached through a stand-in remote shell
that runs the node's line on this machine, as tests/test_bench.py's sweep across nodes does."""

import json
import os
import socket
import time
from pathlib import Path

import pytest

from bridgetower_bench.tools import cluster_check
from helpers import run_tool


# Stands in for ssh: notes the host, then runs the line here, unless the file HOST.does beside it says `fail` (as
# ssh fails), `hang`, or `differ`: see another directory as --output_dir (a disk of its own at the same path, as
# far as the node can tell) and report another transformers version (its report line rewritten).
REMOTE_SHELL = r"""#!/bin/bash
here="$(dirname "$0")"
echo "$1" >> "$here/hosts"
does="$(cat "$here/$1.does" 2>/dev/null)"
case "$does" in
fail) echo "ssh: connect to host $1 port 22: Connection refused" >&2; exit 255 ;;
hang) sleep 60 & echo $! > "$here/sleeping"; wait ;;
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

    first = {"gaudi_software": {"habana-torch-plugin": "1.24.0.123", "driver": "1.24.0"}}
    older = {"gaudi_software": {"habana-torch-plugin": "1.23.0.695", "driver": "1.24.0"}}
    assert cluster_check.gaudi_software_row("gaudi-a", first, first).detail == (
        "habana-torch-plugin 1.24.0.123, driver 1.24.0"
    )
    row = cluster_check.gaudi_software_row("gaudi-b", older, first)
    assert (row.result, row.detail) == (
        "failed",
        "habana-torch-plugin 1.23.0.695, driver 1.24.0; the first node has habana-torch-plugin 1.24.0.123",
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
    sleeping = Path(f"/proc/{(tmp_path / 'sleeping').read_text().strip()}/stat")
    for _ in range(50):  # ended (a zombie until its new parent reaps it)
        if not sleeping.exists() or sleeping.read_text().rpartition(")")[2].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the hanging node's process outlived the bound")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hostfile", "{tmp}/missing"], "--hostfile {tmp}/missing: No such file or directory"),
        (["--nodes", "127.0.0.1,a;b"], "--nodes: 'a;b' has ';', which no host name or IP address has"),
        (["--nodes", "localhost,LOCALHOST"], "--nodes: LOCALHOST is given twice"),
        (["--nodes", "localhost", "--rdzv-port", "70000"], "--rdzv-port: '70000' is not a port (1 to 65535)"),
        (
            ["--nodes", "localhost", "--remote-shell", "no-such-shell"],
            "--remote-shell: no-such-shell: no such command here",
        ),
    ],
)
def test_bad_input_ends_in_one_line_and_starts_nothing(cluster, args, message):
    tmp_path, flags, _ = cluster
    result = run_tool("cluster_check", [*flags, *(arg.format(tmp=tmp_path) for arg in args)], cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"cluster_check: error: {message.format(tmp=tmp_path)}"
    ]
    assert not (tmp_path / "hosts").exists() and not (tmp_path / "record.json").exists()

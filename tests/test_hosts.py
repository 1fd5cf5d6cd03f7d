"""Hosts and ports that reach other machines (tools/hosts.py): a host is a host, in every launcher and the sweep."""

import os

import pytest

from bridgetower_bench.tools import bench, hosts
from bridgetower_bench.tools.sweep import plan as sweep_plan
from bridgetower_bench.user_errors import UserInputError
from helpers import run_tool


MACHINES = ["gaudi-a", "GAUDI-A.example.com", "gpu-a.", "10.0.0.7", "fe80::1", "[fe80::1]"]


@pytest.mark.parametrize("text", [*MACHINES, "root@gaudi-a", "ubuntu@10.0.0.7"])
def test_names_and_addresses_are_hosts(text):
    assert hosts.host(text, "here") == text


@pytest.mark.parametrize(
    "text, problem",
    [
        ("gaudi-a;touch${IFS}X", "has ';'"),
        ("gaudi-a touch", "has ' '"),
        ("$(reboot)", "has '$'"),
        ("gaudi-a`id`", "has '`'"),
        ("gaudi-a|x", "has '|'"),
        ("-oProxyCommand=touch X", "starts with '-'"),
        ("-gaudi-a", "starts with '-'"),
        ("\ufeffgaudi-a", "byte-order mark"),
        ("gaudi\x00a", "has '\\x00'"),
        ("gäudi-a", "has 'ä'"),
        ("", "is empty"),
        ("gaudi-a-", "is not a host name"),
        ("gaudi..a", "is not a host name"),
        ("999.1.1.1", "is not a host name"),
        ("a" * 64, "is not a host name"),
        ("-x@gaudi-a", "starts with '-'"),
        ("x y@gaudi-a", "user part"),
        ("@gaudi-a", "user part"),
    ],
)
def test_anything_else_is_refused_naming_where_it_was_read(text, problem):
    with pytest.raises(UserInputError) as refused:
        hosts.host(text, "--hostfile h, line 3")
    assert str(refused.value).startswith(f"--hostfile h, line 3: {text!r} ")
    assert problem in str(refused.value)


@pytest.mark.parametrize(
    "text, expected",
    [("gpu-a:29500", ("gpu-a", 29500)), ("gpu-a", ("gpu-a", None)), ("[::1]:29400", ("::1", 29400))],
)
def test_endpoints_are_a_host_and_a_port(text, expected):
    assert hosts.endpoint(text, "--rdzv_endpoint") == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("127.0.0.1:70000", "'70000' is not a port (1 to 65535)"),
        ("127.0.0.1:0", "'0' is not a port"),
        ("127.0.0.1:-5", "'-5' is not a port"),
        ("127.0.0.1:", "'' is not a port"),
        ("gpu-a;id:29500", "'gpu-a;id' has ';'"),
        ("[::1]x", "is not HOST[:PORT]"),
    ],
)
def test_bad_endpoints_are_refused(text, message):
    with pytest.raises(UserInputError, match=r"^--rdzv_endpoint: ") as refused:
        hosts.endpoint(text, "--rdzv_endpoint")
    assert message in str(refused.value)


def test_a_rendezvous_address_is_the_machine_without_its_user():
    assert hosts.machine("ubuntu@gpu-a") == "gpu-a"
    assert hosts.machine("root@fe80:0::1") == "[fe80::1]"
    assert hosts.machine("10.0.0.7") == "10.0.0.7"


@pytest.mark.parametrize(
    "data, message",
    [
        (
            b"\xef\xbb\xbfgaudi-a slots=8\n",
            "line 1: '\\ufeffgaudi-a' starts with a byte-order mark: save the file as UTF-8 without one",
        ),
        (b"gaudi-a slots=8\ngau\x00di-b slots=8\n", "line 2: a NUL byte (a hostfile is text)"),
        (b"gaudi-a slots=8\ngaudi-\xff slots=8\n", "line 2: not UTF-8 text"),
        (b"gaudi-a slots=8\nGAUDI-A slots=8\n", "line 2: GAUDI-A is the node of line 1 again"),
        (b"gaudi-a. slots=8\ngaudi-a slots=8\n", "line 2: gaudi-a is the node of line 1 again"),
        (b"root@gaudi-a slots=8\ngaudi-a slots=8\n", "line 2: gaudi-a is the node of line 1 again"),
        (
            b"10.0.0.7 slots=8\nfe80::1 slots=8\nfe80:0:0::1 slots=8\n",
            "line 3: fe80:0:0::1 is the node of line 2 again",
        ),
        (
            b"gaudi-a;touch${IFS}X slots=8\n",
            "line 1: 'gaudi-a;touch${IFS}X' has ';', which no host name or IP address has",
        ),
    ],
)
def test_a_hostfile_is_refused_naming_its_line(tmp_path, data, message):
    (tmp_path / "hostfile").write_bytes(data)
    with pytest.raises(UserInputError) as refused:
        hosts.hostfile_nodes(str(tmp_path / "hostfile"))
    assert str(refused.value) == f"--hostfile {tmp_path / 'hostfile'}, {message}"


def test_a_hostfile_keeps_its_order_and_its_spelling(tmp_path):
    (tmp_path / "hostfile").write_text("ubuntu@gpu-b slots=8\r\n\n10.0.0.7 slots=4\n")
    assert hosts.hostfile_nodes(str(tmp_path / "hostfile"), gaudi=False) == {"ubuntu@gpu-b": 8, "10.0.0.7": 4}


# Through the commands: refused in one line, exit status 2, nothing planned or started ---------------------------


@pytest.fixture
def gaudi_node(tmp_path, monkeypatch):
    """A working directory with the Gaudi script's name and stand-ins for DeepSpeed's launcher and pdsh."""
    (tmp_path / "bin").mkdir()
    for program in ("deepspeed", "pdsh"):
        (tmp_path / "bin" / program).write_text("#!/bin/sh\ntouch started\n")
        (tmp_path / "bin" / program).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "run_bridgetower.py").write_text("")
    return tmp_path


@pytest.mark.parametrize(
    "hostfile, flags, message",
    [
        ("gaudi-a;touch${IFS}X slots=8\ngaudi-b slots=8\n", [], "line 1: 'gaudi-a;touch${IFS}X' has ';'"),
        ("-oProxyCommand=touch${IFS}X slots=8\n", [], "line 1: '-oProxyCommand=touch${IFS}X' starts with '-'"),
        ("gaudi-a slots=8\nGAUDI-A slots=8\n", [], "line 2: GAUDI-A is the node of line 1 again"),
        ("gaudi-a slots=8\n", ["--master_port", "70000"], "--master_port: '70000' is not a port (1 to 65535)"),
        ("gaudi-a slots=8\n", ["--master_port", "-5"], "--master_port: '-5' is not a port (1 to 65535)"),
    ],
)
@pytest.mark.parametrize("dry_run", [["--dry_run"], []], ids=["dry-run", "launch"])
def test_the_gaudi_launcher_refuses_what_is_no_host_or_port(gaudi_node, hostfile, flags, message, dry_run):
    (gaudi_node / "hostfile").write_text(hostfile)
    args = ["--hostfile", "hostfile", *flags, *dry_run, "run_bridgetower.py", "--use_habana"]
    result = run_tool("launch_gaudi", args, cwd=gaudi_node, gaudi=True)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr
    assert not (gaudi_node / "X").exists() and not (gaudi_node / "started").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rdzv_endpoint", "127.0.0.1:70000"], "--rdzv_endpoint: '70000' is not a port (1 to 65535)"),
        (["--rdzv_endpoint", "gpu-a;touch${IFS}X:29500"], "--rdzv_endpoint: 'gpu-a;touch${IFS}X' has ';'"),
        (["--rdzv_endpoint=-oProxyCommand=x"], "--rdzv_endpoint: '-oProxyCommand=x' starts with '-'"),
        (["--master_addr", "a b"], "--master_addr: 'a b' has ' '"),
        (["--rdzv_conf", "join_timeout=soon"], "--nnodes 2 / --rdzv_conf join_timeout=soon: a node count"),
    ],
)
def test_the_cuda_launcher_refuses_what_is_no_host_or_port(tmp_path, argv, message):
    args = ["--nnodes", "2", "--rdzv_backend", "c10d", *argv, "run_bridgetower_cuda.py", "--use_cpu"]
    result = run_tool("launch_cuda", args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"launch_cuda: error: {message}")


@pytest.mark.parametrize(
    "argv, hostfile, message",
    [
        ([], "-oProxyCommand=touch${IFS}X slots=1\ngpu-b slots=1\n", "line 1: '-oProxyCommand=touch${IFS}X' starts"),
        ([], "gpu-a slots=1\ngpu-a&&id slots=1\n", "line 2: 'gpu-a&&id' has '&'"),
        (["--rdzv-port", "70000"], "gpu-a slots=1\ngpu-b slots=1\n", "--rdzv-port: '70000' is not a port"),
    ],
)
def test_the_sweep_refuses_what_is_no_host_or_port(tmp_path, monkeypatch, capsys, argv, hostfile, message):
    monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: "cpu")
    (tmp_path / "hostfile").write_text(hostfile)
    argv = ["--nodes", "1,2", "--hostfile", str(tmp_path / "hostfile"), *argv, "--out", str(tmp_path / "out")]
    try:
        status = bench.main(argv)
    except SystemExit as stop:  # argparse's refusal of a flag's value
        status = stop.code
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert message in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "X").exists()

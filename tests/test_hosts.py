"""Hosts and ports that reach other machines (tools/hosts.py): a host is a host, in every launcher and the sweep."""

import os
import subprocess
import sys
import tempfile

import pytest

from bridgetower_bench.tools import bench, hosts
from bridgetower_bench.tools.sweep import plan as sweep_plan
from bridgetower_bench.user_errors import UserInputError
from helpers import REPO, run_tool


@pytest.mark.parametrize(
    "text, user, passed_on",
    [
        ("gaudi-a", False, "gaudi-a"),
        ("GAUDI-A.example.com", False, "GAUDI-A.example.com"),
        ("gpu-a.", False, "gpu-a."),
        ("10.0.0.7", False, "10.0.0.7"),
        ("fe80::1", False, "fe80::1"),
        ("[fe80::1]", False, "fe80::1"),  # bracket-free wherever the kit passes it on
        ("fe80::1%eth0", False, "fe80::1%eth0"),
        ("[fe80::1%enp0s31f6.100]", False, "fe80::1%enp0s31f6.100"),
        ("root@gaudi-a", True, "root@gaudi-a"),
        ("ubuntu@[fe80::1%ib_0]", True, "ubuntu@fe80::1%ib_0"),
    ],
)
def test_names_and_addresses_are_hosts_passed_on_without_brackets(text, user, passed_on):
    assert hosts.host(text, "here", user=user) == passed_on


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
        ("gaudi-\u0661", "has '\u0661'"),  # a digit, of another script
        ("", "is empty"),
        ("gaudi-a-", "is not a host name"),
        ("gaudi..a", "is not a host name"),
        ("gaudi_a", "is not a host name"),
        ("999.1.1.1", "is not a host name"),
        ("a" * 64, "is not a host name"),
        ("[gaudi-a]", "is not a host name"),  # brackets hold an IPv6 address only
        ("[10.0.0.7]", "is not a host name"),
        ("10.0.0.7%eth0", "is not a host name"),
        # the zone id of an IPv6 address: an interface name, nothing else (issue 55's cases first)
        ("fe80::1%$(touch${IFS}PWNED)", "has '$'"),
        ("fe80::1%x;touch${IFS}PWNED", "has ';'"),
        ("[fe80::1%a b]", "has ' '"),
        ("fe80::1%a\nb", "has '\\n'"),
        ("fe80::1%", "is not a host name"),
        ("fe80::1%abcdefghijklmnop", "zone id that is not an interface name"),
        ("root@gaudi-a", "has 'user@', which only a node the kit reaches by ssh takes"),
    ],
)
def test_anything_else_is_refused_naming_where_it_was_read(text, problem):
    with pytest.raises(UserInputError) as refused:
        hosts.host(text, "--hostfile h, line 3")
    assert str(refused.value).startswith(f"--hostfile h, line 3: {hosts.excerpt(text)} ")
    assert problem in str(refused.value)


@pytest.mark.parametrize(
    "text, problem",
    [("-x@gaudi-a", "starts with '-'"), ("x y@gaudi-a", "user part"), ("@gaudi-a", "user part")],
)
def test_a_user_part_is_a_user_name(text, problem):
    with pytest.raises(UserInputError, match=problem):
        hosts.host(text, "--nodes", user=True)


def test_a_refusal_quotes_a_short_escaped_excerpt_of_a_long_value():
    with pytest.raises(UserInputError) as refused:
        hosts.host("gaudi-a;" + "\n" * 10_000_000, "--nodes")
    message = str(refused.value)
    assert message.startswith("--nodes: 'gaudi-a;\\n\\n") and "... (10000008 characters) has ';'" in message
    assert len(message) < 200 and "\n" not in message


@pytest.mark.parametrize("text", ["1", "22", "29500", "65535", 29500])
def test_a_port_is_1_to_65535_in_ascii_digits(text):
    assert hosts.port(text, "--master_port") == int(text)


@pytest.mark.parametrize(
    "text", ["0", "65536", "70000", "-5", "+80", " 80", "80 ", "8_0", "080", "\u0668\u0660", "８０", "", "0x50", True]
)
def test_anything_else_is_no_port(text):
    with pytest.raises(UserInputError, match=r"^--master_port: .* is not a port \(1 to 65535\)"):
        hosts.port(text, "--master_port")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("gpu-a:29500", ("gpu-a", 29500)),
        ("gpu-a", ("gpu-a", None)),
        ("10.0.0.7:1", ("10.0.0.7", 1)),
        ("[::1]:29400", ("::1", 29400)),
        ("[::1]", ("::1", None)),
    ],
)
def test_endpoints_are_a_host_and_a_port(text, expected):
    assert hosts.endpoint(text, "--rdzv_endpoint") == expected
    assert hosts.endpoint_text(*expected) == text  # as torch reads it: an IPv6 address in brackets


@pytest.mark.parametrize(
    "text, message",
    [
        ("127.0.0.1:70000", "'70000' is not a port (1 to 65535)"),
        ("127.0.0.1:0", "'0' is not a port"),
        ("127.0.0.1:-5", "'-5' is not a port"),
        ("127.0.0.1:", "'' is not a port"),
        ("gpu-a;id:29500", "'gpu-a;id' has ';'"),
        ("[::1]x", "is not HOST[:PORT]"),
        # issue 55's: torch loops for ever on the first, and raises a traceback on the others
        ("::1", "'::1' is not HOST[:PORT] (an IPv6 address in brackets: [ADDRESS]:PORT)"),
        ("fe80::1%eth0", "is not HOST[:PORT]"),
        ("[fe80::1%eth0]:29500", "has a zone id ('%...'), which torch's rendezvous does not take"),
        ("127.0.0.1:+29691", "'+29691' is not a port"),
        ("127.0.0.1: 29693", "' 29693' is not a port"),
        ("127.0.0.1:\u0662\u0669\u0666\u0669\u0663", "is not a port"),
        ("ubuntu@gpu-a:29500", "has 'user@'"),
    ],
)
def test_bad_endpoints_are_refused(text, message):
    with pytest.raises(UserInputError, match=r"^--rdzv_endpoint: ") as refused:
        hosts.endpoint(text, "--rdzv_endpoint")
    assert message in str(refused.value)


def test_a_rendezvous_address_is_the_machine_without_its_user_or_brackets():
    assert hosts.machine("ubuntu@gpu-a") == "gpu-a"
    assert hosts.machine("root@[fe80:0::1]") == "fe80:0::1"
    assert hosts.machine("10.0.0.7") == "10.0.0.7"
    assert hosts.rendezvous_endpoint("root@fe80::1", 29500, "--hostfile h") == "[fe80::1]:29500"
    with pytest.raises(UserInputError, match="^--hostfile h: 'fe80::1%eth0' has a zone id"):
        hosts.rendezvous_endpoint("fe80::1%eth0", 29500, "--hostfile h")


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
        (b"[fe80::1] slots=8\nfe80::1 slots=8\n", "line 2: fe80::1 is the node of line 1 again"),
        (
            b"10.0.0.7 slots=8\nfe80::1 slots=8\nfe80:0:0::1 slots=8\n",
            "line 3: fe80:0:0::1 is the node of line 2 again",
        ),
        (
            b"gaudi-a;touch${IFS}X slots=8\n",
            "line 1: 'gaudi-a;touch${IFS}X' has ';', which no host name or IP address has",
        ),
        (b"fe80::1%$(touch${IFS}PWNED) slots=8\n", "line 1: 'fe80::1%$(touch${IFS}PWNED)' has '$'"),
        (b"root@gaudi-a slots=8\n", "line 1: 'root@gaudi-a' has 'user@'"),  # DeepSpeed's master address
        (b"gaudi-a slots=\xd9\xa8\n", "line 1: 'gaudi-a slots=\u0668' is not `HOST slots=N`"),
        (b"gaudi-a\xc2\xa0slots=8\n", "line 1: 'gaudi-a\\xa0slots=8' is not `HOST slots=N`"),
        (b"gaudi-a slots=8 # rack 2\n", "line 1: 'gaudi-a slots=8 # rack 2' is not `HOST slots=N`"),
        # (named: a test id holding the data would be as long)
        pytest.param(
            b"gaudi-a slots=8\n" + b"x" * 600 + b" slots=8\n", "line 2: longer than 512 bytes", id="long-line"
        ),
        pytest.param(
            b"gaudi-a slots=8\n" + b"#" * (1 << 20), "larger than a hostfile's 1 MiB: not read", id="over-1-MiB"
        ),
    ],
)
def test_a_hostfile_is_refused_naming_its_line(tmp_path, data, message):
    (tmp_path / "hostfile").write_bytes(data)
    with pytest.raises(UserInputError) as refused:
        hosts.hostfile_nodes(str(tmp_path / "hostfile"))
    assert str(refused.value).startswith(f"--hostfile {tmp_path / 'hostfile'}")
    assert str(refused.value).endswith(message) or f"{tmp_path / 'hostfile'}, {message}" in str(refused.value)
    assert "\n" not in str(refused.value) and "xxxxxxxx" not in str(refused.value)


def test_a_hostfile_keeps_its_order_and_its_spelling_but_for_brackets(tmp_path):
    (tmp_path / "hostfile").write_text("ubuntu@gpu-b slots=8\r\n\n10.0.0.7 slots=4\n[fe80::1%eth0]\tslots=2\n")
    nodes = hosts.hostfile_nodes(str(tmp_path / "hostfile"), gaudi=False)
    assert nodes == {"ubuntu@gpu-b": 8, "10.0.0.7": 4, "fe80::1%eth0": 2}


def test_a_hostfile_path_that_is_no_line_of_text_is_named_as_an_excerpt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError) as refused:
        hosts.hostfile_nodes("h\nx")
    assert str(refused.value) == "--hostfile 'h\\nx': No such file or directory"


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
        ("gaudi-a slots=8\n", ["--master_port", "+29500"], "--master_port: '+29500' is not a port (1 to 65535)"),
        # issue 55's: optimum-habana's runner put the first host unquoted into its bash line, which ran `touch`
        ("fe80::1%$(touch${IFS}X) slots=8\ngaudi-b slots=8\n", [], "line 1: 'fe80::1%$(touch${IFS}X)' has '$'"),
        ("fe80::1%x;touch${IFS}X slots=8\n", [], "line 1: 'fe80::1%x;touch${IFS}X' has ';'"),
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


@pytest.mark.parametrize("name", ["h;touch ${IFS}X", "my hosts", "$(touch X)", "-h"])
def test_the_gaudi_launcher_hands_deepspeed_its_own_copy_of_the_checked_nodes_whatever_the_hostfiles_name(
    gaudi_node, name
):
    # issue 55's: optimum-habana's runner put the hostfile's path unquoted into its bash line, which ran `touch`
    (gaudi_node / "bin" / "deepspeed").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > started\ncat "$2" > copy\n')
    (gaudi_node / name).write_text("[fe80::1%eth0] slots=8\ngaudi-b slots=8\n")
    result = run_tool("launch_gaudi", ["--hostfile", f"./{name}", "run_bridgetower.py"], cwd=gaudi_node, gaudi=True)
    assert result.returncode == 0, result.stderr[-2000:]
    words = (gaudi_node / "started").read_text().splitlines()
    assert words[0] == "--hostfile" and words[2:] == [
        *("--master_addr", "fe80::1%eth0", "--no_local_rank", "--master_port", "29500", "run_bridgetower.py"),
    ]
    assert (gaudi_node / "copy").read_text() == "fe80::1%eth0 slots=8\ngaudi-b slots=8\n"
    assert not os.path.exists(words[1]) and not (gaudi_node / "X").exists()


@pytest.mark.parametrize(
    "where, message",
    [
        ("cwd", "the working directory '"),
        ("TMPDIR", "the temporary folder (TMPDIR) '"),
    ],
)
def test_the_gaudi_launcher_refuses_a_folder_deepspeed_would_put_unquoted_into_a_shell_line(
    gaudi_node, monkeypatch, where, message
):
    odd = gaudi_node / "a b;touch X"
    odd.mkdir()
    cwd = gaudi_node
    if where == "cwd":
        for name in ("run_bridgetower.py", "hostfile"):
            (odd / name).write_text("gaudi-a slots=8\n")
        cwd = odd
    else:
        (gaudi_node / "hostfile").write_text("gaudi-a slots=8\n")
        monkeypatch.setattr(tempfile, "tempdir", str(odd))  # as TMPDIR=DIR chooses it
    result = run_tool("launch_gaudi", ["--hostfile", "hostfile", "run_bridgetower.py"], cwd=cwd, gaudi=True)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"launch_gaudi: error: {message}")
    assert "DeepSpeed's launcher puts it unquoted into a shell line" in result.stderr
    assert not (gaudi_node / "started").exists() and not (gaudi_node / "X").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rdzv_endpoint", "127.0.0.1:70000"], "--rdzv_endpoint: '70000' is not a port (1 to 65535)"),
        (["--rdzv_endpoint", "gpu-a;touch${IFS}X:29500"], "--rdzv_endpoint: 'gpu-a;touch${IFS}X' has ';'"),
        (["--rdzv_endpoint=-oProxyCommand=x"], "--rdzv_endpoint: '-oProxyCommand=x' starts with '-'"),
        (["--master_addr", "a b"], "--master_addr: 'a b' has ' '"),
        # issue 55's: torch loops for ever on the first, raises a traceback on the others
        (["--rdzv_endpoint", "::1"], "--rdzv_endpoint: '::1' is not HOST[:PORT] (an IPv6 address in brackets"),
        (["--rdzv_endpoint", "fe80::1%eth0"], "--rdzv_endpoint: 'fe80::1%eth0' is not HOST[:PORT]"),
        (["--rdzv_endpoint", "127.0.0.1:+29691"], "--rdzv_endpoint: '+29691' is not a port"),
        (["--rdzv_endpoint", "127.0.0.1: 29693"], "--rdzv_endpoint: ' 29693' is not a port"),
        (["--rdzv_endpoint", "127.0.0.1:\u0662\u0669"], "--rdzv_endpoint: '\u0662\u0669' is not a port"),
        (["--master_addr", "fe80::1%x;id"], "--master_addr: 'fe80::1%x;id' has ';'"),
        (["--master_addr", "[fe80::1%a b]"], "--master_addr: '[fe80::1%a b]' has ' '"),
        (["--master_port", "+29500"], "argument --master-port/--master_port: '+29500' is not a whole number"),
        (["--rdzv_conf", "join_timeout=soon"], "--nnodes 2 / --rdzv_conf join_timeout=soon: a node count"),
    ],
)
def test_the_cuda_launcher_refuses_what_is_no_host_or_port(tmp_path, argv, message):
    args = ["--nnodes", "2", "--rdzv_backend", "c10d", *argv, "run_bridgetower_cuda.py", "--use_cpu"]
    result = run_tool("launch_cuda", args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"launch_cuda: error: {message}")


def test_the_sbatch_files_head_node_reaches_launch_cudas_grammar(tmp_path):
    # Slurm's names of the job's nodes: the first keeps the rendezvous. A stand-in srun starts launch_cuda here.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf \"%s\\n\" '$(touch X);gpu-a' gpu-b\n")
    srun = f'#!/bin/sh\nwhile [ "$1" != .venv/bin/python ]; do shift; done\nshift\nexec {sys.executable} "$@"\n'
    (bin_dir / "srun").write_text(srun)
    for program in ("scontrol", "srun"):
        (bin_dir / program).chmod(0o755)
    slurm = {
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_PER_TASK": "8",
        "SLURM_GPUS_ON_NODE": "8",
    }
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    sbatch = REPO / "scripts" / "multinode_cuda.sbatch"
    ran = subprocess.run(["bash", str(sbatch)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2 and ran.stderr.splitlines() == [
        "launch_cuda: error: --rdzv_endpoint: '$(touch X);gpu-a' has '$', which no host name or IP address has"
    ]
    assert not (tmp_path / "X").exists()


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

"""Hosts, ports, endpoints, hostfile lines and hostfile paths from generated text (hypothesis, tests/conftest.py's
profile: a fixed seed, no database): each is refused in one line, or what the kit plans to run holds exactly the
intended words, split as a shell splits them. The cases of issue 55 are kept as explicit examples."""

import contextlib
import io
import ipaddress
import os
import re
import shlex
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from bridgetower_bench.tools import bench, hosts, launch_cuda
from bridgetower_bench.tools.sweep import plan as sweep_plan
from bridgetower_bench.user_errors import UserInputError
from helpers import run_tool


# Text a shell reads as code, and what sits next to hosts: the alphabet of the targeted strategies.
SHELL = "$`;|&()<>{}*?!#~\\'\" \t\n\r="
NEAR_HOSTS = "abzAZ019-._:%[]@"
ODD = "\ufeff\x00\u0661\u0668\uff10\u00a0\u2028ä"
HOSTISH = st.text(alphabet=st.sampled_from(list(SHELL + NEAR_HOSTS + ODD)), max_size=30)
# Hosts of the grammar, as users write them (brackets, zone ids, users): the kit must pass these on intact
LABEL = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9-]{0,8}[A-Za-z0-9])?", fullmatch=True)
DNS_NAMES = (
    st.lists(LABEL, min_size=1, max_size=3).map(".".join).filter(lambda name: not name.split(".")[-1].isdigit())
)
ZONES = st.from_regex(r"%[A-Za-z0-9_.-]{1,15}", fullmatch=True)
IPV6 = st.tuples(st.ip_addresses(v=6).map(str), st.one_of(st.just(""), ZONES), st.booleans()).map(
    lambda parts: f"[{parts[0]}{parts[1]}]" if parts[2] else parts[0] + parts[1]
)
USERS = st.one_of(st.just(""), st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,8}@", fullmatch=True))
MACHINES = st.one_of(DNS_NAMES, st.ip_addresses(v=4).map(str), IPV6)
VALID = st.tuples(USERS, MACHINES).map("".join)
VALID_ENDPOINTS = st.tuples(
    st.one_of(DNS_NAMES, st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map("[{}]".format)),
    st.one_of(st.just(""), st.integers(1, 65535).map(":{}".format)),
).map("".join)
BASES = ["gaudi-a", "gpu-a.example.com", "10.0.0.7", "fe80::1", "[fe80::1]", "::1", "root@gaudi-a", "-gaudi-a"]
# a valid-looking host, maybe a zone, then anything of the targeted alphabet
DECORATED = st.tuples(st.sampled_from(BASES), st.sampled_from(["", "%", "%eth0"]), HOSTISH).map("".join)
TEXTS = st.one_of(VALID, st.text(max_size=80), HOSTISH, DECORATED)  # (hypothesis favours the first)
PORTS = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.sampled_from(list("0123456789+-_ .\u0660\u0661\u0669\uff11")), max_size=7),
    st.integers(-5, 70000).map(str),
)
ENDPOINTS = st.one_of(
    VALID_ENDPOINTS,
    st.text(max_size=60),
    st.tuples(TEXTS, st.sampled_from([":", "", "]:", "::"]), PORTS).map("".join),
    st.tuples(st.just("["), TEXTS, st.sampled_from(["]", "]:", ""]), PORTS).map("".join),
)
CODE = ("$(", "`", ";", "|", "&", "\n", "\r")


def assert_refused_in_one_line(message: str, where: str) -> None:
    """A refusal: one printable line (a value is quoted escaped), short, naming where the value was read (a file's
    line too)."""
    assert re.match(rf"{re.escape(where)}(, line [0-9]+)?: ", message), message
    assert message.isprintable() and len(message) < 400, message


def assert_one_word(value: str) -> None:
    """A value a shell line holds as one word with nothing read as code, quoted or not: shlex leaves it alone."""
    assert shlex.quote(value) == value and shlex.split(value) == [value], value
    assert not value.startswith("-") and not any(code in value for code in CODE), value


def assert_a_host(value: str, user: bool) -> None:
    """`value` is a host of the grammar, bracket-free: a DNS name or an address, `user@` only where allowed."""
    assert_one_word(value)
    login, at, name = value.rpartition("@")
    assert user or not at
    assert "[" not in value and "]" not in value
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        assert hosts.is_dns_name(name), value
    else:
        assert ip.version == 6 or "%" not in name


# Hosts, ports, endpoints --------------------------------------------------------------------------------------


@settings(max_examples=300)
@given(text=TEXTS, user=st.booleans(), zone=st.booleans())
@example(text="fe80::1%$(touch${IFS}PWNED)", user=False, zone=True)
@example(text="fe80::1%x;touch${IFS}PWNED", user=False, zone=True)
@example(text="[fe80::1%a b]", user=True, zone=True)
@example(text="fe80::1%a\nb", user=True, zone=True)
@example(text="fe80::1%x;id", user=False, zone=False)
@example(text="-oProxyCommand=touch${IFS}X", user=True, zone=True)
def test_a_host_is_refused_in_one_line_or_is_one_shell_word(text, user, zone):
    try:
        value = hosts.host(text, "--nodes", user=user, zone=zone)
    except UserInputError as refused:
        assert_refused_in_one_line(str(refused), "--nodes")
        return event("refused")
    assert_a_host(value, user)
    assert zone or "%" not in value
    assert hosts.host(value, "--nodes", user=user, zone=zone) == value  # what is passed on passes again
    event("passed on")


@settings(max_examples=300)
@given(text=PORTS)
@example(text="+29691")
@example(text=" 29693")
@example(text="\u0662\u0669\u0666\u0669\u0663")  # Arabic-Indic digits
@example(text="29_500")
def test_a_port_is_refused_in_one_line_or_is_its_own_ascii_digits(text):
    try:
        number = hosts.port(text, "--master_port")
    except UserInputError as refused:
        assert_refused_in_one_line(str(refused), "--master_port")
        return event("refused")
    assert 1 <= number <= 65535 and str(number) == text
    event("passed on")


@settings(max_examples=300)
@given(text=ENDPOINTS)
@example(text="::1")  # torch reads host ':' and port 1, and waits for ever
@example(text="fe80::1%eth0")
@example(text="[fe80::1%eth0]:29500")
@example(text="127.0.0.1:+29691")
@example(text="127.0.0.1: 29693")
@example(text="127.0.0.1:\u0662\u0669\u0666\u0669\u0663")
@example(text="[::1]:29400")
def test_an_endpoint_is_refused_in_one_line_or_torch_reads_the_host_and_port_the_kit_checked(text):
    try:
        name, number = hosts.endpoint(text, "--rdzv_endpoint")
    except UserInputError as refused:
        assert_refused_in_one_line(str(refused), "--rdzv_endpoint")
        return event("refused")
    assert_a_host(name, user=False)
    assert "%" not in name  # torch's rendezvous takes no zone id
    joined = hosts.endpoint_text(name, number)
    assert_one_word(joined.replace("[", "").replace("]", ""))  # (brackets: shell lines quote it, shlex.join)
    assert parse_rendezvous_endpoint(joined, 29400) == (name, 29400 if number is None else number)
    event("passed on")


# Hostfile lines ---------------------------------------------------------------------------------------------------

SLOTS = st.one_of(st.integers(1, 8).map(str), st.integers(0, 12).map(str), PORTS)
SEPARATORS = st.sampled_from([" ", " ", "\t", "  ", "\u00a0", ""])
LINE = st.tuples(TEXTS, SEPARATORS, st.just("slots="), SLOTS).map("".join)
GOOD_LINE = st.tuples(VALID, st.just(" slots="), st.integers(1, 8).map(str)).map("".join)
GAUDI_LINE = st.tuples(MACHINES, st.just(" slots="), st.integers(1, 8).map(str)).map("".join)  # (no user)
# mostly lines of the grammar (what passes must pass on intact), some hostile or odd
HOSTFILES = st.lists(
    st.one_of(GOOD_LINE, GOOD_LINE, GOOD_LINE, LINE, st.sampled_from(["", "gaudi-b slots=8", "# rack 2"])),
    min_size=1,
    max_size=4,
)


def mostly(good_lines, least: int):
    """Hostfiles of `least` to 3 good lines, and maybe one line of any text among them (the planned lines are
    checked only where the whole file passes)."""

    def with_odd_line(drawn):
        lines, odd, at = drawn
        return lines if odd is None else [*lines[:at], odd, *lines[at:]]

    good = st.lists(good_lines, min_size=least, max_size=3)
    return st.tuples(good, st.one_of(st.none(), LINE), st.integers(0, 3)).map(with_odd_line)


def write_hostfile(folder: Path, name: str, lines: list[str]) -> Path:
    path = folder / name
    path.write_bytes("\n".join(lines).encode(errors="surrogatepass"))
    return path


@settings(max_examples=150)
@given(lines=HOSTFILES, gaudi=st.booleans())
@example(lines=["fe80::1%$(touch${IFS}PWNED) slots=8", "gaudi-b slots=8"], gaudi=True)
@example(lines=["fe80::1%x;touch${IFS}PWNED slots=8"], gaudi=True)
@example(lines=["gaudi-a slots=8 ; touch PWNED"], gaudi=True)
def test_a_hostfile_is_refused_in_one_line_naming_its_line_or_gives_hosts(lines, gaudi):
    with tempfile.TemporaryDirectory() as folder:
        path = write_hostfile(Path(folder), "hostfile", lines)
        try:
            nodes = hosts.hostfile_nodes(str(path), gaudi=gaudi)
        except UserInputError as refused:
            assert_refused_in_one_line(str(refused), f"--hostfile {path}")
            return event("refused")
    assert nodes
    for name, slots in nodes.items():
        assert_a_host(name, user=not gaudi)
        assert f"{name} slots={slots}" in [" ".join(line.replace("[", "").replace("]", "").split()) for line in lines]
    event("passed on")


# Through the commands that plan lines: launch_gaudi --dry_run, the sweep's dry run, launch_cuda -------------------

# A hostfile's file name: any text a file name can be
FILE_NAMES = st.one_of(
    st.text(alphabet=st.sampled_from(list(SHELL.replace("\n", "") + "abc-.%")), min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
).filter(lambda name: "/" not in name and "\0" not in name and name not in (".", "..") and len(name.encode()) < 200)


@pytest.fixture(scope="module")
def gaudi_stand_ins(tmp_path_factory):
    """A working directory with the Gaudi script's name and stand-ins for DeepSpeed's launcher and pdsh on PATH."""
    folder = tmp_path_factory.mktemp("gaudi_node")
    (folder / "bin").mkdir()
    for program in ("deepspeed", "pdsh"):
        (folder / "bin" / program).write_text("#!/bin/sh\ntouch started\nexit 9\n")
        (folder / "bin" / program).chmod(0o755)
    (folder / "run_bridgetower.py").write_text("")
    return folder


def intended_node_lines(first: str, script: list[str]) -> tuple[list[str], list[str]]:
    return (
        ["--master_addr", first, "--no_local_rank", "--master_port", "29500", *script],
        [f"--master_addr={first}", "--master_port=29500", "--no_local_rank", *script],
    )


def shell_tokens(line: str) -> list[str]:
    """The words and control operators of a shell line, as a POSIX shell splits it."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=FILE_NAMES, lines=mostly(GAUDI_LINE, 1))
@example(name="h;touch ${IFS}PWNED", lines=["gaudi-a slots=8", "gaudi-b slots=8"])  # issue 55's
@example(name="my hosts", lines=["gaudi-a slots=8", "gaudi-b slots=8"])
@example(name="$(touch PWNED)", lines=["[fe80::1%eth0] slots=8"])
@example(name="hostfile", lines=["fe80::1%$(touch${IFS}PWNED) slots=8", "gaudi-b slots=8"])
@example(name="hostfile", lines=["fe80::1%x;touch${IFS}PWNED slots=8"])
def test_launch_gaudis_dry_run_is_refused_in_one_line_or_plans_exactly_the_intended_words(
    gaudi_stand_ins, monkeypatch, name, lines
):
    monkeypatch.setenv("PATH", f"{gaudi_stand_ins / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(gaudi_stand_ins / "home"))
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    with tempfile.TemporaryDirectory(dir=gaudi_stand_ins) as folder:
        path = write_hostfile(Path(folder), name, lines)
        script = ["run_bridgetower.py", "--use_habana"]
        result = run_tool("launch_gaudi", ["--hostfile", path, "--dry_run", *script], cwd=gaudi_stand_ins, gaudi=True)
        if result.returncode != 0:
            assert result.returncode == 2 and result.stdout == "", result.stderr
            assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("launch_gaudi: error: ")
            return event("refused")
        nodes = hosts.hostfile_nodes(str(path))
    first = next(iter(nodes))
    local, remote = intended_node_lines(first, script)
    printed = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert len(printed) == 1 + len(nodes), result.stdout
    # this node: optimum-habana's runner's bash line, with the launcher's copy of the checked nodes as the hostfile
    words = shlex.split(printed[0])
    assert words[:3] == ["PT_HPU_LAZY_MODE=1", "deepspeed", "--hostfile"] and words[4:] == local
    assert_one_word(words[3])
    assert Path(words[3]).name == "hostfile" and Path(words[3]).parent.name.startswith("launch_gaudi-")
    # each node: the line pdsh runs there
    for node, line in enumerate(printed[1:]):
        tokens = shell_tokens(line)
        start = tokens.index("deepspeed.launcher.launch")
        assert tokens[start + 1].startswith("--world_info=") and tokens[start + 2] == f"--node_rank={node}"
        assert tokens[start + 3 :] == remote, line
        assert tokens[tokens.index("cd") + 1 : tokens.index("cd") + 3] == [str(gaudi_stand_ins), ";"]
    assert not (gaudi_stand_ins / "PWNED").exists() and not (gaudi_stand_ins / "started").exists()
    event("planned")


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=mostly(GOOD_LINE, 2), port=st.one_of(st.integers(1, 65535).map(str), PORTS))
@example(lines=["ubuntu@[::1] slots=1", "gpu-b slots=1"], port="29500")  # ssh gets `::1`, torch `[::1]:29500`
@example(lines=["[fe80::1%eth0] slots=1", "gpu-b slots=1"], port="29500")
@example(lines=["gpu-a slots=1", "fe80::1%$(touch${IFS}PWNED) slots=1"], port="29500")
@example(lines=["gpu-a slots=1", "gpu-b slots=1"], port="+29500")
def test_the_sweeps_dry_run_across_nodes_is_refused_in_one_line_or_reaches_each_node_with_its_words(
    monkeypatch, lines, port
):
    monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: "cpu")
    with tempfile.TemporaryDirectory() as folder:
        path = write_hostfile(Path(folder), "hostfile", lines)
        argv = ["--dry-run", "--workers", "0", "--image-pipelines", "upstream", "--devices", "0"]
        argv += ["--nodes", "1,2", "--hostfile", str(path), f"--rdzv-port={port}", "--out", f"{folder}/out"]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = bench.main(argv)
            except SystemExit as stop:
                status = stop.code
        if status != 0:
            assert status == 2 and out.getvalue() == "" and len(err.getvalue().splitlines()) == 1, err.getvalue()
            return event("refused")
        nodes = list(hosts.hostfile_nodes(str(path), gaudi=False))[:2]
    name, number = hosts.machine(nodes[0]), int(port)
    node_lines = [shlex.split(line) for line in out.getvalue().splitlines() if line.startswith("ssh ")]
    assert [words[:3] for words in node_lines] == [["ssh", "-tt", node] for node in nodes]
    for words in node_lines:
        assert len(words) == 4
        line = shell_tokens(words[3])
        endpoint = line[line.index("--rdzv_endpoint") + 1]
        assert endpoint == hosts.endpoint_text(name, number)
        assert parse_rendezvous_endpoint(endpoint, 29400) == (name, number)
    event("planned")


@pytest.fixture(scope="module")
def torchrun_planned():
    """launch_cuda's main() up to torchrun's run, which records the options it is given instead of starting."""
    planned = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torchrun, "run", planned.append)
        patch.setenv("OMP_NUM_THREADS", "1")
        yield planned


@settings(max_examples=150)
@given(
    flag=st.sampled_from(["--rdzv_endpoint", "--master_addr", "--master_port"]),
    value=st.one_of(ENDPOINTS, TEXTS, PORTS),
)
@example(flag="--rdzv_endpoint", value="::1")
@example(flag="--rdzv_endpoint", value="fe80::1%eth0")
@example(flag="--rdzv_endpoint", value="127.0.0.1:+29691")
@example(flag="--rdzv_endpoint", value="127.0.0.1: 29693")
@example(flag="--rdzv_endpoint", value="127.0.0.1:\u0662\u0669\u0666\u0669\u0663")
@example(flag="--master_addr", value="fe80::1%x;id")
@example(flag="--master_addr", value="[fe80::1%a b]")
@example(flag="--master_port", value="+29500")
@example(flag="--master_port", value="\u0662\u0669\u0665\u0660\u0660")
@example(flag="--master_addr", value="[::1]")
def test_launch_cuda_refuses_in_one_line_or_hands_torchrun_the_checked_host_and_port(torchrun_planned, flag, value):
    torchrun_planned.clear()
    argv = ["--nnodes", "1", "--rdzv_backend", "static", f"{flag}={value}", "run_bridgetower_cuda.py", "--use_cpu"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = launch_cuda.main(argv)
    if status != 0:
        assert status == 2 and not torchrun_planned
        assert len(err.getvalue().splitlines()) == 1 and err.getvalue().startswith("launch_cuda: error: ")
        return event("refused")
    [args] = torchrun_planned
    args.master_port = 29500 if args.master_port is None else args.master_port  # (torchrun's run sets it so)
    given_endpoint = torchrun.get_rdzv_endpoint(args)
    name, number = parse_rendezvous_endpoint(given_endpoint, 0)
    if flag == "--rdzv_endpoint" and value:  # (empty: torchrun's default, the master address and port)
        assert (name, number or None) == hosts.endpoint(value, flag)
        assert args.rdzv_endpoint == hosts.endpoint_text(name, number or None)
    elif flag == "--master_addr":
        assert name == args.master_addr == hosts.host(value, flag) and number == 29500
    elif flag == "--master_port":
        assert number == int(value) and str(number) == value
    assert_one_word(given_endpoint.replace("[", "").replace("]", ""))
    assert_a_host(name, user=False)
    event("planned")

"""The tools that produce the README's figures, run tiny: the image-pipeline micro-benchmark, the decoded-image
cache's memory benchmark, and the Gaudi launcher's --dry_run."""

import base64
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

import bridgetower_bench.tools as tools_package
import image_bench
from bridgetower_bench.tools import launch_gaudi
from helpers import REPO, run_tool, script_env


# The tools that run no model: they check paths, tables and JSON, or start and watch other processes.
NO_MODEL_TOOLS = (
    "bench cluster_check compare fixtures gaudi_check launch_gaudi make_cuda_script nvidia_check upstream_diff "
    "sweep.bench_report sweep.cost sweep.cost_report"
)


def test_the_tools_that_run_no_model_start_without_torch_transformers_or_datasets():
    # a refusal, a table or a dry run in a fraction of a second, not after seconds of imports (a fresh interpreter)
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint(*sys.modules)"
    tools = [f"bridgetower_bench.tools.{name}" for name in NO_MODEL_TOOLS.split()]
    argv = [sys.executable, "-c", code, *tools]
    result = subprocess.run(argv, cwd=REPO, env=script_env(False), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = {name.split(".")[0] for name in result.stdout.split()}
    assert not loaded & {"torch", "torchvision", "transformers", "datasets"}, loaded


def test_a_module_the_commands_import_run_as_a_command_says_so_in_one_line(monkeypatch):
    """Once `python -m bridgetower_bench.tools.cartoons /bad/path` and six more exited 0, silently."""
    argv = [sys.executable, "-m", "bridgetower_bench.tools.cartoons", "/bad/path"]
    result = subprocess.run(argv, cwd=REPO, env=script_env(False), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr[-3000:]
    said = (
        'error: a module the kit\'s commands import, not a command (the commands: docs/ARCHITECTURE.md, "Tools wing")'
    )
    assert result.stderr == f"python -m bridgetower_bench.tools.cartoons: {said}\n"
    # Which modules are commands, as python -m is about to run them (the package is imported first)
    tools = REPO / "bridgetower_bench" / "tools"
    modules = {str(p.relative_to(tools).with_suffix("")).replace(os.sep, ".") for p in tools.rglob("[!_]*.py")}
    refused = set()
    for name in modules | {"sweep", "no_such_tool"}:
        monkeypatch.setattr(sys, "argv", ["-m", "/bad/path"])
        monkeypatch.setattr(sys, "orig_argv", ["python", "-X", "dev", "-m", f"bridgetower_bench.tools.{name}"])
        try:
            tools_package.refuse_a_module_that_is_not_a_command()
        except SystemExit as exiting:
            assert exiting.code == 2
            refused.add(name)
    commands = "bench cluster_check compare fixtures gaudi_check launch_cuda launch_gaudi make_cuda_script "
    commands += "nvidia_check upstream_diff"
    assert refused == modules - set(commands.split()) | {"sweep"}  # (no_such_tool: Python's own "No module named")
    assert {"cartoons", "hosts", "self_check", "tool_paths", "sweep.run"} <= refused
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest"])  # not a module of the tools: nothing said
    tools_package.refuse_a_module_that_is_not_a_command()


def test_image_bench_reports_rates_ratios_and_fidelity(tmp_path):
    result = run_tool("image_bench", ["--images", 2, "--repeat", 1, "--json", tmp_path / "bench.json"])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["settings"] == {"images": 2, "repeat": 1, "image_size": 294, "threads": 1}
    assert "cartoons" in report["sets"] and report["sets"]["cartoons"]["n_images"] == 2
    assert report["sets"]["cartoons"]["sizes"] == ["800x650"]
    printed = result.stdout.splitlines()
    for name, figures in report["sets"].items():
        rates = figures["images_per_second"]
        assert {"upstream", "fast", "fast-draft", "cached", "decode PIL"} <= set(rates)
        assert all(math.isfinite(rate) and rate > 0 for rate in rates.values())
        for method, rate in rates.items():
            assert figures["vs_upstream"][method] == pytest.approx(rate / rates["upstream"])
        assert figures["fast_vs_decode"] == pytest.approx(rates["fast"] / rates[figures["fast_decoder"]])

        deviation = figures["deviation_from_upstream_per_255"]
        assert deviation["upstream"] == {"mean": 0.0, "max": 0.0}  # the comparison itself is sound
        # fast rounds to uint8 where upstream keeps floats: a deviation, but a small one.
        assert 0 < deviation["fast"]["mean"] <= image_bench.TARGETS["fast_mean_deviation"]
        assert deviation["fast"]["max"] < 32
        assert deviation["fast-draft"]["mean"] >= 0

        for target, check in figures["targets"].items():
            assert check["target"] == image_bench.TARGETS[target]
            measured, goal = check["measured"], check["target"]
            assert check["met"] == (measured <= goal if target.endswith("deviation") else measured >= goal)
        assert figures["targets"]["fast_mean_deviation"]["measured"] == deviation["fast"]["mean"]

        # The printed table shows the same figures.
        upstream_row = next(line for line in printed if re.match(rf"{name}\s+upstream\s", line))
        assert upstream_row.split()[2:] == [f"{rates['upstream']:.1f}", "1.00", "0.000", "0.0"]
        fast_row = next(line for line in printed if re.match(rf"{name}\s+fast\s", line))
        assert fast_row.split()[-2:] == [f"{deviation['fast']['mean']:.3f}", f"{deviation['fast']['max']:.1f}"]


def test_cache_memory_bench_reports_each_workers_memory(tmp_path):
    # a process of its own: the benchmark measures its own and its workers' memory
    args = ["--small", 2, "--large", 6, "--workers", 2, "--decode-processes", 1, "--json", tmp_path / "memory.json"]
    result = run_tool("cache_memory_bench", args, process=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "memory.json").read_text())
    small, large = report["rows"]
    assert (small["images"], large["images"]) == (2, 6)
    assert large["cache_mib"] == pytest.approx(3 * small["cache_mib"], abs=0.1)  # 3 x 294 x 294 bytes an image
    for row in (small, large):
        assert len(row["worker_private_mib"]) == 2 and len(row["worker_file_backed_mib"]) == 2  # one per worker
        assert all(mib > 0 for mib in row["worker_private_mib"] + row["worker_file_backed_mib"])
    assert report["worker_private_growth_mib"] == pytest.approx(
        max(large["worker_private_mib"]) - max(small["worker_private_mib"]), abs=0.05
    )
    assert (
        f"| 6 | {large['cache_mib']} | {large['worker_private_mib']} | {large['worker_file_backed_mib']} |"
        in result.stdout
    )
    assert f"{report['worker_private_growth_mib']:+.1f} MiB per worker" in result.stdout


def test_gaudi_launchers_dry_run_prints_the_published_mpirun_command_and_the_variables_it_exports(tmp_path):
    model = "--model_name_or_path BridgeTower/bridgetower-large-itm-mlm-itc --do_train --use_habana --use_lazy_mode"
    script_args = ["--output_dir", tmp_path / "out", *model.split()]
    args = ["--world_size", 8, "--use_mpi", "--dry_run", "run_bridgetower.py", *script_args]
    result = run_tool("launch_gaudi", args, gaudi=True)
    assert result.returncode == 0, result.stderr[-3000:]
    command = result.stdout.strip().splitlines()[-1]
    flags = " ".join(map(str, script_args))
    assert re.fullmatch(
        rf"PT_HPU_LAZY_MODE=1 MASTER_ADDR=localhost MASTER_PORT=29500 mpirun -n 8 --bind-to core --map-by socket:PE=\d+ --rank-by slot --report-bindings --allow-run-as-root "
        rf"{re.escape(sys.executable)} run_bridgetower.py {re.escape(flags)}",
        command,
    ), command
    assert not (tmp_path / "out").exists(), "a dry run starts nothing"

    args = ["--world_size", 2, "--use_mpi", "--master_port", 29600, "--dry_run", "run_bridgetower.py", "--seed", 3]
    command = run_tool("launch_gaudi", args, gaudi=True).stdout.strip().splitlines()[-1]
    assert command.startswith("PT_HPU_LAZY_MODE=1 MASTER_ADDR=localhost MASTER_PORT=29600 mpirun -n 2 "), command
    single = run_tool("launch_gaudi", ["--dry_run", "run_bridgetower.py"], gaudi=True).stdout.strip().splitlines()[-1]
    assert single == f"PT_HPU_LAZY_MODE=1 {sys.executable} run_bridgetower.py", "one HPU: no variables but the mode"


def test_gaudi_launcher_runs_its_processes_in_lazy_mode_unless_told_otherwise():
    # "1" where unset or empty (Habana's bridge would run eager mode without it); "0": eager, asked for by the user
    modes = [
        launch_gaudi.children_mode_variable(env) for env in ({}, {"PT_HPU_LAZY_MODE": ""}, {"PT_HPU_LAZY_MODE": "0"})
    ]
    assert modes == ["1", "1", "0"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world_size", 9, "run_bridgetower.py"], "--world_size=9: a Gaudi node has 1 to 8 HPUs"),
        (["--world_size", 2, "no_such_script.py"], "training_script no_such_script.py: no such file"),
    ],
)
def test_gaudi_launcher_refuses_what_cannot_run_in_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        launch_gaudi.parse_args(list(map(str, args)))
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """In tmp_path: a two-node hostfile, stand-ins for DeepSpeed's launcher and pdsh on PATH, no `.deepspeed_env`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("deepspeed", "pdsh"):
        (bin_dir / program).write_text("#!/bin/sh\nexit 99\n")
        (bin_dir / program).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    (tmp_path / "run_bridgetower.py").write_text("")
    (tmp_path / "hostfile").write_text("gaudi-a slots=8\n\ngaudi-b slots=8\n")
    return tmp_path


def launch_on_nodes(directory, *flags, script_args=("--output_dir", "runs/two", "--use_habana", "--use_lazy_mode")):
    args = ["--hostfile", "hostfile", *flags, "--dry_run", "run_bridgetower.py", *script_args]
    return run_tool("launch_gaudi", args, cwd=directory, gaudi=True)


def test_gaudi_launcher_dry_run_prints_each_node_command_and_the_mode_every_node_gets(two_nodes, monkeypatch):
    result = launch_on_nodes(two_nodes, "--num_nodes", 2, "--world_size", 16)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()[-8:]
    script = "run_bridgetower.py --output_dir runs/two --use_habana --use_lazy_mode"
    assert lines[0] == "# on this node: DS_ENV_FILE=<a temporary file: PT_HPU_LAZY_MODE=1>"
    # optimum-habana's runner: DeepSpeed's launcher, the first host as rank 0's address
    words = shlex.split(lines[1])  # the hostfile: the launcher's copy of the checked nodes (tests/test_hosts.py)
    assert words[:3] + words[4:] == [
        *("PT_HPU_LAZY_MODE=1", "deepspeed", "--hostfile", "--master_addr", "gaudi-a", "--no_local_rank"),
        *("--master_port", "29500", *shlex.split(script)),
    ]
    assert os.path.basename(words[3]) == "hostfile" and os.path.basename(os.path.dirname(words[3])) != two_nodes.name
    # no DeepSpeed importable here (the stand-in is only a program on PATH): only the environment file's lines
    assert result.stdout.strip().splitlines()[-9].startswith("# DeepSpeed cannot be imported by this Python: ")
    world = base64.urlsafe_b64encode(json.dumps({"gaudi-a": list(range(8)), "gaudi-b": list(range(8))}).encode())
    for node, (host, ranks) in enumerate([("gaudi-a", "0-7"), ("gaudi-b", "8-15")]):
        header, command, processes = lines[2 + 3 * node : 5 + 3 * node]
        assert header == f"# node {node}: {host}, ranks {ranks}, started by pdsh over ssh"
        assert command.startswith("export PT_HPU_LAZY_MODE=1; cd ")  # DeepSpeed would not pass it on its own
        assert command.endswith(
            f"; cd {two_nodes}; {sys.executable} -u -m deepspeed.launcher.launch --world_info={world.decode()} "
            f"--node_rank={node} --master_addr=gaudi-a --master_port=29500 --no_local_rank {script}"
        ), command
        first, last = map(int, ranks.split("-"))
        assert processes == (
            f"#   its processes: PT_HPU_LAZY_MODE=1 MASTER_ADDR=gaudi-a MASTER_PORT=29500 WORLD_SIZE=16 "
            f"RANK={first}..{last} LOCAL_RANK=0..7"
        )
    assert not (two_nodes / "runs").exists(), "a dry run starts nothing"

    # the user's .deepspeed_env and the eager mode asked for reach the nodes
    (two_nodes / ".deepspeed_env").write_text("HCCL_SOCKET_IFNAME=eth1\n")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    result = launch_on_nodes(two_nodes, script_args=["--use_habana", "--use_lazy_mode", "False"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DS_ENV_FILE=<a temporary file: HCCL_SOCKET_IFNAME=eth1; PT_HPU_LAZY_MODE=0>" in result.stdout
    node_commands = [line for line in result.stdout.splitlines() if "deepspeed.launcher.launch" in line]
    assert len(node_commands) == 2
    assert all("export HCCL_SOCKET_IFNAME=eth1; export PT_HPU_LAZY_MODE=0; cd " in c for c in node_commands)


# A stand-in for the installed DeepSpeed: the public names its launcher reads, as HabanaAI/DeepSpeed's release
# branches define them (runner.EXPORT_ENVS, runner.EXCLUDE_ENVS, accelerator.get_accelerator().export_envs()).
STAND_IN_DEEPSPEED = {
    "__init__.py": "",
    "launcher/__init__.py": "",
    "launcher/runner.py": (
        "EXPORT_ENVS = ['MLFLOW', 'PYTHON', 'MV2', 'UCX']\n"
        "EXCLUDE_ENVS = {'AISC_JOB_NAME': ['NCCL_IB_HCA', 'UCX_NET_DEVICES']}\n"
    ),
    "accelerator/__init__.py": (
        "import os\n\n\nclass Accelerator:\n    def export_envs(self):\n"
        "        return os.environ['STAND_IN_EXPORT_ENVS'].split()\n\n\n"
        "def get_accelerator():\n    return Accelerator()\n"
    ),
}


@pytest.mark.parametrize(
    "accelerator_prefixes, held_back, forwarded, not_forwarded",
    [
        ("", False, ["UCX_NET_DEVICES=mlx5_0:1", "MV2_X=1"], ["NCCL_SOCKET_IFNAME"]),  # Habana's: HPU lists none
        ("NCCL", False, ["NCCL_SOCKET_IFNAME=ib0", "UCX_NET_DEVICES=mlx5_0:1"], []),  # a CUDA accelerator's
        ("", True, ["MV2_X=1"], ["UCX_NET_DEVICES", "NCCL_SOCKET_IFNAME"]),  # EXCLUDE_ENVS: its key is set
    ],
    ids=["hpu", "cuda", "held-back"],
)
def test_gaudi_launchers_dry_run_forwards_the_variables_the_installed_deepspeed_forwards(
    two_nodes, monkeypatch, accelerator_prefixes, held_back, forwarded, not_forwarded
):
    package = two_nodes / "site" / "deepspeed"
    for name, text in STAND_IN_DEEPSPEED.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(two_nodes / "site"))
    monkeypatch.syspath_prepend(two_nodes / "site")  # the stand-in, imported afresh in this process
    monkeypatch.setenv("STAND_IN_EXPORT_ENVS", accelerator_prefixes)
    for name, value in [("NCCL_SOCKET_IFNAME", "ib0"), ("UCX_NET_DEVICES", "mlx5_0:1"), ("MV2_X", "1")]:
        monkeypatch.setenv(name, value)
    if held_back:
        monkeypatch.setenv("AISC_JOB_NAME", "job")
    args = ["--hostfile", "hostfile", "--dry_run", "run_bridgetower.py", "--use_habana"]
    try:
        result = run_tool("launch_gaudi", args, cwd=two_nodes, gaudi=True)
    finally:  # no other test sees this stand-in
        for name in [name for name in sys.modules if name.split(".")[0] == "deepspeed"]:
            del sys.modules[name]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DeepSpeed cannot be imported" not in result.stdout
    node_commands = [line for line in result.stdout.splitlines() if "deepspeed.launcher.launch" in line]
    assert len(node_commands) == 2
    for command in node_commands:
        exported = dict(
            part.removeprefix("export ").split("=", 1) for part in command.split("; ") if "export " in part
        )
        assert exported["PYTHONPATH"].split(os.pathsep)[0] == str(two_nodes)  # DeepSpeed's runner prepends it
        assert exported["PT_HPU_LAZY_MODE"] == "1"  # from the environment file, whatever DeepSpeed forwards
        for variable in forwarded:
            assert variable.split("=", 1) in [list(item) for item in exported.items()], (variable, command)
        assert not set(not_forwarded) & set(exported), command


DIRECTORY = object()  # (a file that is a directory)


@pytest.mark.parametrize(
    "files, flags, message",
    [
        ({}, ["--num_nodes", 3], "--num_nodes=3: --hostfile hostfile gives 2 nodes"),
        (
            {"my\nhosts": "gaudi-a slots=8\ngaudi-b slots=8\n"},  # its name escaped: the refusal stays one line
            ["--hostfile", "my\nhosts", "--num_nodes", 3],
            "--num_nodes=3: --hostfile 'my\\nhosts' gives 2 nodes",
        ),
        ({}, ["--world_size", 8], "--world_size=8: --hostfile hostfile gives 16 HPUs (gaudi-a: 8, gaudi-b: 8)"),
        ({}, ["--use_mpi"], "--use_mpi with --hostfile: several nodes are started by DeepSpeed's launcher"),
        ("gaudi-a slots=8\n# rack 2\n", [], "--hostfile hostfile, line 2: '# rack 2' is not `HOST slots=N`"),
        ("gaudi-a slots=9\n", [], "--hostfile hostfile, line 1: slots=9: a Gaudi node has 1 to 8 HPUs"),
        ("\n\n", [], "--hostfile hostfile: no `HOST slots=N` line"),
        ({"hostfile": None}, [], "--hostfile hostfile: No such file or directory"),
        ({"hostfile": DIRECTORY}, [], "--hostfile hostfile: "),
        (
            {".deepspeed_env": "PT_HPU_LAZY_MODE=0\n"},  # eager on the nodes, lazy asked for here
            [],
            "./.deepspeed_env sends PT_HPU_LAZY_MODE=0 to the nodes and this launch runs PT_HPU_LAZY_MODE=1",
        ),
        (
            {".deepspeed_env": "# for the nodes\nHF_HOME=/shared/hf\nexport HCCL_SOCKET_IFNAME\n"},
            [],
            "./.deepspeed_env, line 3: 'export HCCL_SOCKET_IFNAME' is not NAME=value, and DeepSpeed's launcher reads",
        ),
        ({"bin/pdsh": None}, [], "--hostfile needs `pdsh` (what DeepSpeed's launcher reaches the nodes with) on PATH"),
        ({"bin/pdsh": None, "bin/deepspeed": None}, [], "--hostfile needs `deepspeed` (DeepSpeed's launcher) on PATH"),
    ],
)
def test_gaudi_launcher_refuses_a_hostfile_it_cannot_read_or_use_or_flags_that_disagree_in_one_line(
    two_nodes, files, flags, message
):
    files = {"hostfile": files} if isinstance(files, str) else files  # (a hostfile's text, or files by name)
    for name, text in files.items():  # None: no such file
        (two_nodes / name).unlink(missing_ok=True)
        if text is DIRECTORY:
            (two_nodes / name).mkdir()
        elif text is not None:
            (two_nodes / name).write_text(text)
    result = launch_on_nodes(two_nodes, *flags)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr.strip().splitlines()[-1], result.stderr
    assert "Traceback" not in result.stderr


def test_gaudi_launcher_starts_deepspeeds_launcher_with_the_mode_in_its_environment_file(two_nodes):
    # the stand-in `deepspeed` records what the real one would read: its arguments and the DS_ENV_FILE it is given
    (two_nodes / "bin" / "deepspeed").write_text(
        '#!/bin/sh\necho "$@" > started.txt\ncat "$DS_ENV_FILE" > nodes_env.txt\ncat "$2" > hostfile_read.txt\nexit 3\n'
    )
    # blank and comment lines, which DeepSpeed's runner cannot read (it splits each line at its first "="), left out
    (two_nodes / ".deepspeed_env").write_text("# shared caches\n\nHF_HOME=/shared/hf\n  # the end\n")
    args = ["--hostfile", "hostfile", "run_bridgetower.py", "--use_habana"]
    result = run_tool("launch_gaudi", args, cwd=two_nodes, gaudi=True)
    assert result.returncode == 3, result.stderr[-3000:]  # the launcher's status is the job's
    words = (two_nodes / "started.txt").read_text().split()
    assert words[:1] + words[2:] == [
        *("--hostfile", "--master_addr", "gaudi-a", "--no_local_rank", "--master_port", "29500"),
        *("run_bridgetower.py", "--use_habana"),
    ]
    # DeepSpeed reads the launcher's copy of the checked nodes (tests/test_hosts.py), removed after the launch
    assert (two_nodes / "hostfile_read.txt").read_text() == "gaudi-a slots=8\ngaudi-b slots=8\n"
    assert not os.path.exists(words[1])
    assert (two_nodes / "nodes_env.txt").read_text() == "HF_HOME=/shared/hf\nPT_HPU_LAZY_MODE=1\n"
    assert "DS_ENV_FILE" not in os.environ


# Outside Habana's software: every Gaudi entry point but the self-check says so in one line ------------------

HABANA_MISSING = (
    "error: Habana's software is missing: Intel Gaudi's PyTorch bridge (habana_frameworks.torch) is not installed "
    "here; run inside Habana's PyTorch container (README, Gaudi section), or run_bridgetower_cuda.py on NVIDIA GPUs "
    "or the CPU"
)


@pytest.mark.parametrize("dry_run", [["--dry_run"], []], ids=["dry-run", "launch"])
def test_gaudi_launcher_without_habanas_software_says_so_in_one_line(dry_run, tmp_path):
    args = ["--world_size", 8, "--use_mpi", "--master_port", 29600, *dry_run, "run_bridgetower.py"]
    args += ["--output_dir", tmp_path]
    result = run_tool("launch_gaudi", args)  # no shim: habana_frameworks cannot be found
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"launch_gaudi: {HABANA_MISSING}"]


def test_the_gaudi_script_without_habanas_software_says_so_in_one_line(tmp_path):
    argv = [sys.executable, str(REPO / "run_bridgetower.py"), "--output_dir", str(tmp_path / "out")]
    env = script_env(gaudi=False)  # the repository importable, the shim not: a machine without Habana's software
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"run_bridgetower.py: {HABANA_MISSING}"]
    assert not (tmp_path / "out").exists()

"""The tools that produce the README's figures, run tiny: the image-pipeline micro-benchmark, the decoded-image
cache's memory benchmark, and the Gaudi launcher's --dry_run."""

import json
import math
import re
import subprocess
import sys

import pytest

from bridgetower_bench.tools import image_bench
from helpers import REPO, run_tool, script_env


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
        assert {"upstream", "fast", "fast-draft", "cached", "decode PIL", "decode_jpeg"} <= set(rates)
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
            met = (
                check["measured"] <= check["target"]
                if target.endswith("deviation")
                else check["measured"] >= check["target"]
            )
            assert check["met"] == met
        assert figures["targets"]["fast_mean_deviation"]["measured"] == deviation["fast"]["mean"]

        # The printed table shows the same figures.
        upstream_row = next(line for line in printed if re.match(rf"{name}\s+upstream\s", line))
        assert upstream_row.split()[2:] == [f"{rates['upstream']:.1f}", "1.00", "0.000", "0.0"]
        fast_row = next(line for line in printed if re.match(rf"{name}\s+fast\s", line))
        assert fast_row.split()[-2:] == [f"{deviation['fast']['mean']:.3f}", f"{deviation['fast']['max']:.1f}"]


def test_cache_memory_bench_reports_each_workers_memory(tmp_path):
    # a process of its own: the benchmark measures its own and its workers' memory
    args = ["--small", 2, "--large", 6, "--workers", 2, "--json", tmp_path / "memory.json"]
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


def test_gaudi_launcher_dry_run_prints_the_mpirun_command_of_the_published_runs(tmp_path):
    script_args = [
        "--output_dir",
        tmp_path / "out",
        "--model_name_or_path",
        "BridgeTower/bridgetower-large-itm-mlm-itc",
        "--do_train",
        "--use_habana",
        "--use_lazy_mode",
    ]
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


def test_gaudi_launcher_runs_its_processes_in_lazy_mode_unless_told_otherwise():
    from bridgetower_bench.tools import launch_gaudi

    assert launch_gaudi.children_mode_variable({}) == "1"  # Habana's bridge would run eager mode without it
    assert launch_gaudi.children_mode_variable({"PT_HPU_LAZY_MODE": ""}) == "1"
    assert launch_gaudi.children_mode_variable({"PT_HPU_LAZY_MODE": "0"}) == "0"  # eager, asked for by the user


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world_size", 9, "run_bridgetower.py"], "--world_size=9: a Gaudi node has 1 to 8 HPUs"),
        (["--world_size", 2, "no_such_script.py"], "training_script no_such_script.py: no such file"),
    ],
)
def test_gaudi_launcher_refuses_what_cannot_run_in_one_line(args, message, capsys):
    from bridgetower_bench.tools import launch_gaudi

    with pytest.raises(SystemExit) as stop:
        launch_gaudi.parse_args(list(map(str, args)))
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


# Outside Habana's software: every Gaudi entry point but the self-check says so in one line ------------------

HABANA_MISSING = (
    "error: Habana's software is missing: Intel Gaudi's PyTorch bridge (habana_frameworks.torch) is not installed "
    "here; run inside Habana's PyTorch container (README, Gaudi section), or run_bridgetower_cuda.py on NVIDIA GPUs "
    "or the CPU"
)


@pytest.mark.parametrize("dry_run", [["--dry_run"], []], ids=["dry-run", "launch"])
def test_gaudi_launcher_without_habanas_software_says_so_in_one_line(dry_run, tmp_path):
    args = [
        "--world_size",
        8,
        "--use_mpi",
        "--master_port",
        29600,
        *dry_run,
        "run_bridgetower.py",
        "--output_dir",
        tmp_path,
    ]
    result = run_tool("launch_gaudi", args)  # no shim: habana_frameworks cannot be found
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"launch_gaudi: {HABANA_MISSING}"]


def test_gaudi_launchers_dry_run_shows_the_variables_the_launch_exports(tmp_path):
    args = ["--world_size", 2, "--use_mpi", "--master_port", 29600, "--dry_run", "run_bridgetower.py", "--seed", 3]
    command = run_tool("launch_gaudi", args, gaudi=True).stdout.strip().splitlines()[-1]
    assert command.startswith("PT_HPU_LAZY_MODE=1 MASTER_ADDR=localhost MASTER_PORT=29600 mpirun -n 2 "), command
    single = run_tool("launch_gaudi", ["--dry_run", "run_bridgetower.py"], gaudi=True).stdout.strip().splitlines()[-1]
    assert single == f"PT_HPU_LAZY_MODE=1 {sys.executable} run_bridgetower.py", "one HPU: no variables but the mode"


def test_the_gaudi_script_without_habanas_software_says_so_in_one_line(tmp_path):
    env = script_env(
        gaudi=False
    )  # the repository importable, the shim not: what a machine without Habana's software has
    result = subprocess.run(
        [sys.executable, str(REPO / "run_bridgetower.py"), "--output_dir", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"run_bridgetower.py: {HABANA_MISSING}"]
    assert not (tmp_path / "out").exists()

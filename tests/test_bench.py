"""The benchmark sweep: a real sweep on CPU, failures and Ctrl-C that do not lose rows, the tables' arithmetic."""

import csv
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version

import pytest
from PIL import Image

from bridgetower_bench import published
from bridgetower_bench.tools import bench, tool_paths
from bridgetower_bench.tools.sweep import bench_report, chart_report, published_report, scaling_report
from bridgetower_bench.tools.sweep import commands as sweep_commands
from bridgetower_bench.tools.sweep import plan as sweep_plan
from bridgetower_bench.tools.sweep import presets as sweep_presets
from bridgetower_bench.tools.sweep import resume as sweep_resume
from bridgetower_bench.tools.sweep import rows as sweep_rows
from bridgetower_bench.tools.sweep import run as sweep_run
from bridgetower_bench.user_errors import UserInputError
from helpers import REPO, ended, run_tool


# A small but real sweep: 5 steps of batch 2 over 4 training rows, the first one warm-up: epochs of 2 steps,
# so steps 3 and 5 begin epochs inside the counted window.
TINY_RUN = (
    "--max_train_samples 4 --max_steps 5 --throughput_warmup_steps 1 --per_device_train_batch_size 2 "
    "--logging_steps 1 --max_eval_samples 8"
)

# Stands in for ssh: notes the host it was asked for, then runs the node's shell line on this machine.
REMOTE_SHELL = """#!/bin/sh
echo "$1" >> "$(dirname "$0")/hosts"
exec bash -c "$2"
"""


def hostfile(tmp_path, text="gpu-a slots=2\n\ngpu-b slots=2\n"):
    (tmp_path / "hostfile").write_text(text)
    return str(tmp_path / "hostfile")


def test_local_sweep_runs_the_script_and_writes_every_output(fixtures, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU, even on a GPU machine
    out, remote_shell = tmp_path / "bench", tmp_path / "remote_shell"
    remote_shell.write_text(REMOTE_SHELL)
    remote_shell.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Two "nodes", both this machine: two launch_cuda meet at 127.0.0.1's c10d rendezvous, over gloo. They share its
    # cores, where each node would give its process all of them (measured: 2 s per step instead of 0.1 s).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nodes = ["--nodes", "1,2", "--hostfile", hostfile(tmp_path, "127.0.0.1 slots=1\nlocalhost slots=1\n")]
    nodes += ["--remote-shell", str(remote_shell), "--rdzv-port", str(port)]

    argv = ["--workers", "0", "--image-pipelines", "upstream", "--eval", "--extra-args", TINY_RUN, "--out", str(out)]
    code = bench.main([*argv, "--devices", "1,2", *nodes])

    printed = capsys.readouterr().out
    assert code == 0, printed
    runs = json.loads((out / "results.json").read_text())["runs"]
    # (the loader settings' dimensions: test_persistent_workers_are_a_dimension_where_there_are_workers)
    assert [(r["workers"], r["persistent_workers"], r["world_size"], r["status"]) for r in runs] == [
        (0, False, 1, "ok"),
        (0, False, 2, "ok"),  # the scaling curve: the first configuration again, on two processes (torchrun, gloo)
        (0, False, 2, "ok"),  # and across nodes: on two nodes of one process each
    ]
    curve, across = runs[-2:]
    del runs[-2:]
    assert curve["run_id"] == runs[0]["run_id"] + "-x2" and "--nproc_per_node 2" in curve["command"]
    for point in (curve, across):
        assert point["scaling_efficiency"] == pytest.approx(
            point["train_samples_per_second_per_device"] / runs[0]["train_samples_per_second_per_device"], abs=1e-4
        )
    assert (curve["nodes"], across["nodes"], across["run_id"]) == (1, 2, runs[0]["run_id"] + "-nodes2")
    assert [node["processes"] for node in across["per_node"]] == [1, 1] and "per_node" not in curve  # each node's
    assert (tmp_path / "hosts").read_text().split() == ["127.0.0.1", "localhost"]
    assert f"--rdzv_endpoint 127.0.0.1:{port} --rdzv_id {across['run_id']}" in across["command"]
    log = (out / across["log"]).read_text()  # each node's command, then their output line by line
    assert [line.split()[:3] for line in log.splitlines()[:2]] == [
        ["$", str(remote_shell), host] for host in ("127.0.0.1", "localhost")
    ]
    assert "\n[node 0] " in log and "\n[node 1] " in log
    for row in runs:
        assert row["loader"] == "torch" and row["image_pipeline"] == "upstream" and row["script"] == "cuda"
        assert row["device_name"].startswith("CPU") and row["world_size"] == 1
        assert row["per_device_train_batch_size"] == 2
        assert row["throughput_warmup_steps"] == 1 and row["throughput_counted_steps"] == 4
        assert row["throughput_steps_per_epoch"] == 2 and row["throughput_epoch_starts"] == 2
        # The figure the tables show: the run's 4 counted steps of 2 samples over the seconds it counted.
        train = json.loads((out / row["output_dir"] / "train_results.json").read_text())
        assert train["throughput_counted_samples"] == row["throughput_counted_samples"] == 4 * 2
        assert row["train_samples_per_second"] == pytest.approx(8 / train["throughput_counted_seconds"], rel=1e-9)
        assert row["data_wait_fraction"] == train["data_wait_fraction"] < 1
        evaluation = json.loads((out / row["output_dir"] / "validation_results.json").read_text())
        assert row["eval_i2t_recall@1"] == evaluation["eval_i2t_recall@1"]
        assert row["eval_loss"] == evaluation["eval_loss"]
        assert f"{row['train_samples_per_second']:.2f} samples/s" in printed
        assert row["data_wait_fraction_epoch_start"] + row["data_wait_fraction_steady"] == pytest.approx(
            row["data_wait_fraction"]
        )
        assert row["data_wait_seconds_epoch_start"] > 0
        assert row["version_torch"] and row["version_transformers"]
        assert (row["version_accelerate"], row["version_datasets"]) == (version("accelerate"), version("datasets"))
        # The environment the run names: a CPU run of the CUDA/CPU script, no Habana mode, no driver read.
        environment = (row["backend"], row["execution_mode"], row["torch_compile"], row["device_count"])
        assert environment == ("cpu", "n/a", False, 1)
        assert row["device_memory_bytes"] > 2**30
        assert row["driver_version"] is None and row["version_intel_gaudi"] is None
        assert (out / "logs" / f"{row['run_id']}.log").read_text().startswith("$ ")
        assert not list((out / "runs" / row["run_id"]).glob("*.safetensors")), "weights are deleted by default"

    with open(out / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    shapes = [(r["workers"], r["world_size"], r["nodes"]) for r in csv_rows]
    assert shapes == [("0", "1", "1"), ("0", "2", "1"), ("0", "2", "2")]
    assert csv_rows[0]["scaling_efficiency"] == "1.0" and float(csv_rows[2]["scaling_efficiency"]) > 0
    assert json.loads(csv_rows[2]["per_node"]) == across["per_node"] and csv_rows[1]["per_node"] == ""
    assert float(csv_rows[0]["train_samples_per_second"]) == pytest.approx(runs[0]["train_samples_per_second"])

    table = (out / "table.md").read_text()
    assert "| device | workers=0 |" in table and "(x1.00)" in table
    gib = f"{runs[0]['device_memory_bytes'] / 2**30:.1f} GiB"
    assert (
        f"| {runs[0]['device_name']} x1 | cpu | n/a | False | {runs[0]['version_torch']} | {runs[0]['version_cuda'] or '-'} "
        f"| - | {runs[0]['version_transformers']} | {runs[0]['version_accelerate']} | {runs[0]['version_datasets']} "
        f"| - | 1 | {gib} |"
    ) in table.split("## Environment (as the runs recorded it)")[1]
    # (2 processes of the same per-device batch take the 4 rows in 1 step: 4 epoch starts among their 4 counted steps)
    assert "Shape: 1, 2 optimizer steps per epoch; 2, 4 epoch start(s) inside the counted window." in table
    assert "Not like for like" not in table  # one interpreter ran every row
    assert "## Data wait at epoch starts beside the steady state (median)" in table
    split = table.split("## Data wait at epoch starts beside the steady state (median)")[1].split("##")[0]
    assert "| workers=0 | 2 | " in split, "2 epoch starts counted, side by side with the steady wait"
    assert table in printed, "the table is printed at the end"
    assert "## Retrieval quality: eval image->text recall@1" in table
    scaling = table.split("## Scaling: the same recipe on more devices")[1].split("##")[0]
    # Every run trained with the threads asked for, and measured how busy other programs kept the machine.
    assert {(r["cpu_threads"], r["cpu_count"]) for r in runs + [curve, across]} == {(1, os.cpu_count())}
    assert all(r["other_cpu_cores"] >= 0 for r in runs + [curve, across]) and csv_rows[0]["cpu_threads"] == "1"
    assert f"| workers=0 | {runs[0]['device_name']} | 1 | " in scaling
    assert f"| {efficiency_cell(runs[0], runs[0])} |" in scaling.split(f"{runs[0]['device_name']} | 1 | ")[1]
    assert f"| {efficiency_cell(curve, runs[0])} |" in scaling.split(f"{runs[0]['device_name']} | 2 | ")[1]
    across_line = scaling.split(f"| workers=0 | {runs[0]['device_name']} | 2 (2 nodes x 1) | ")[1].split("\n")[0]
    assert f"| {efficiency_cell(across, runs[0])} |" in across_line
    flagged = any(efficiency_cell(r, runs[0]).startswith("n/a") for r in (runs[0], curve, across))
    assert ('\n"n/a: ' in scaling) == flagged  # a flagged cell is explained under the table
    each = " / ".join(f"{100 * node['data_wait_fraction']:.0f}%" for node in across["per_node"])
    assert f"% (nodes: {each}) |" in across_line  # the job's data wait, then each node's
    assert f"| {runs[0]['device_name']} 2 nodes x1 | " in table  # a row of its own, beside the one-node x2
    vs_published = (out / "vs_published.md").read_text()
    assert "Gaudi2 HPU (published)" in vs_published
    for record in ("results.json", "results.csv", "table.md", "vs_published.md"):  # shareable: no machine paths
        assert str(REPO) not in (out / record).read_text() and str(out) not in (out / record).read_text(), record
    for name in ("chart.png", "chart_scaling.png"):
        with Image.open(out / name) as chart:
            assert chart.size[0] > 100 and chart.size[1] > 100
    assert printed.count("start  workers=") == 3 and "samples/s" in printed and "at 2 epoch start(s)" in printed


def efficiency_cell(point, one):
    """What the scaling section shows for `point` against the one-device run `one`, from their rows' figures."""
    busy = any(r["other_cpu_cores"] > 0.1 * r["cpu_count"] for r in (point, one))
    flags = ["busy machine"] * busy + ["above 100%"] * (round(100 * point["scaling_efficiency"]) > 100)
    return f"n/a: {', '.join(flags)}" if flags else f"{100 * point['scaling_efficiency']:.0f}%"


# Failures and Ctrl-C, with a stand-in training script (fast, and it can fail on demand) ----------------------

STAND_IN = """
import argparse, json, os, signal, sys, time
p = argparse.ArgumentParser()
p.add_argument("--output_dir")
p.add_argument("--dataloader_num_workers", type=int)
p.add_argument("--image_pipeline", choices=["upstream", "fast"])
a = p.parse_args()
if os.environ.get("STAND_IN_STARTS"):  # one line per run started, for the tests that count them
    open(os.environ["STAND_IN_STARTS"], "a").write(os.path.basename(a.output_dir) + "\\n")
os.makedirs(a.output_dir, exist_ok=True)
if os.environ.get("STAND_IN_FAIL"):
    sys.exit(3)
if a.dataloader_num_workers == 7:  # hangs until stopped
    open(os.path.join(a.output_dir, "pid"), "w").write(str(os.getpid()))
    time.sleep(120)
if a.dataloader_num_workers == 8:
    sys.exit(0)  # "succeeds" without results
if a.dataloader_num_workers == 9:
    os.kill(os.getpid(), signal.SIGKILL)
sps = 10.0 * (1 + a.dataloader_num_workers)
open(os.path.join(a.output_dir, "model.safetensors"), "w").write("weights")
json.dump({"train_samples_per_second": sps, "train_samples_per_second_per_device": sps,
           "throughput_warmup_steps": 1, "throughput_counted_steps": 2, "world_size": 1,
           "per_device_train_batch_size": 2, "data_wait_fraction": 0.5, "loader": "torch",
           "image_pipeline": a.image_pipeline, "device_name": "CPU stand-in", "device_type": "cpu",
           "jpeg_decoder": None if a.image_pipeline == "upstream" else "stand-in decoder 1.0",
           "train_loss": float("nan") if a.dataloader_num_workers == 5 else 0.5,  # 5: diverged, yet exit 0
           "version_torch": "0"}, open(os.path.join(a.output_dir, "train_results.json"), "w"))
if a.dataloader_num_workers == 3:  # validation metrics, under the scripts' name
    json.dump({"eval_loss": 0.3}, open(os.path.join(a.output_dir, "validation_results.json"), "w"))
"""


def stand_in_plan(tmp_path, workers, image_pipelines=("upstream",), repeats=1):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return bench.Plan(
        preset="local",
        script="cuda",
        device="cpu",
        nproc=1,
        variants=sweep_commands.expand_matrix(list(workers), ["torch"], list(image_pipelines), repeats=repeats),
        base_args=[],
        script_path=script,
        expected_device_name="CPU stand-in",
        env={"STAND_IN_STARTS": str(tmp_path / "starts.txt")},
    )


def starts(tmp_path):
    """The runs the stand-in started since the last call, by run id."""
    path = tmp_path / "starts.txt"
    started = path.read_text().split() if path.exists() else []
    path.unlink(missing_ok=True)
    return started


def saved_rows(out):
    """results.json's rows; bare NaN or Infinity (not JSON) fail the test."""

    def refuse(constant):
        raise AssertionError(f"results.json holds bare {constant}")

    return json.loads((out / "results.json").read_text(), parse_constant=refuse)["runs"]


def wait_for(path, timeout_s=300):  # a loaded machine starts Python slowly
    deadline = time.time() + timeout_s
    while not (path.exists() and path.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    return path.read_text()


def test_failed_or_diverged_runs_are_failed_rows_the_sweep_goes_on_and_validation_metrics_are_read(tmp_path):
    plan = stand_in_plan(tmp_path, workers=[0, 8, 9], image_pipelines=["no-such-pipeline", "upstream"])
    out = tmp_path / "out"
    lines = []

    rows, interrupted = bench.run_sweep(plan, out, echo=lines.append)

    assert not interrupted
    status = {(r["image_pipeline"], r["workers"]): r for r in rows}
    for w in (0, 8, 9):
        bad = status[("no-such-pipeline", w)]
        assert bad["status"] == "failed" and bad["returncode"] == 2
        assert "invalid choice: 'no-such-pipeline'" in bad["error"]
    assert status[("upstream", 0)]["status"] == "ok", "runs after a failure still run"
    assert status[("upstream", 8)]["status"] == "failed"
    assert "no train_samples_per_second" in status[("upstream", 8)]["error"]
    assert status[("upstream", 9)]["error"].startswith("killed by signal SIGKILL")
    assert any("FAILED (return code 2)" in line and "invalid choice" in line for line in lines)
    assert [r["status"] for r in saved_rows(out)] == [r["status"] for r in rows]
    assert not (out / "runs" / status[("upstream", 0)]["run_id"] / "model.safetensors").exists()

    table = bench.render_all(out, rows, {"preset": "local", "model": "stand-in"})
    assert "| CPU stand-in x1 | failed | failed | failed | 10.0 (x1.00) | failed | failed |" in table
    assert "## Failed runs" in table and "invalid choice" in table
    with Image.open(out / "chart.png") as chart:
        chart.load()

    # validation metrics are read, and a diverged run is a failed row whatever its exit status
    rows, _ = bench.run_sweep(stand_in_plan(tmp_path, workers=[5, 3, 4]), tmp_path / "more", echo=lambda line: None)

    assert [(r["workers"], r.get("eval_loss")) for r in rows[1:]] == [(3, 0.3), (4, None)]
    assert [r["status"] for r in rows] == ["failed", "ok", "ok"], "runs after a diverged one still run"
    assert rows[0]["error"] == "exited 0 but its results are not finite: train_loss=nan"
    assert rows[0]["train_loss"] is None
    assert saved_rows(tmp_path / "more") == rows


def test_ctrl_c_stops_the_running_script_keeps_finished_rows_and_a_rerun_runs_it_again(ctrl_c_raises, tmp_path):
    plan = stand_in_plan(tmp_path, workers=[0, 7, 1])
    out = tmp_path / "out"
    pid_file = out / "runs" / plan.variants[1].run_id / "pid"
    threading.Thread(
        target=lambda: (wait_for(pid_file), signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)),
        daemon=True,
    ).start()
    rows, interrupted = bench.run_sweep(plan, out, echo=lambda line: None)

    assert interrupted
    assert [r["status"] for r in rows] == ["ok", "interrupted"], "the run after Ctrl-C never starts"
    assert [r["status"] for r in saved_rows(out)] == ["ok", "interrupted"]
    with pytest.raises(ProcessLookupError):
        bench.os.kill(int(pid_file.read_text()), 0)
    assert starts(tmp_path) == ["w0-torch-upstream-r1", "w7-torch-upstream-r1"]

    plan.env["STAND_IN_FAIL"] = "1"  # the rerun of workers=7 fails at once instead of hanging
    rows, interrupted = bench.run_sweep(plan, out, echo=lambda line: None)
    assert starts(tmp_path) == ["w7-torch-upstream-r1", "w1-torch-upstream-r1"], "the interrupted run is made again"
    assert not interrupted and [r["status"] for r in rows] == ["ok", "failed", "failed"]


# Reruns into the same --out: finished rows kept, settings checked, one sweep at a time, children owned -------


def test_a_rerun_keeps_finished_rows_runs_only_what_is_missing_and_never_reports_an_unrecorded_runs_figures(
    tmp_path,
):
    out, lines = tmp_path / "out", []
    first, _ = bench.run_sweep(stand_in_plan(tmp_path, workers=[0, 8, 1]), out, echo=lines.append)
    assert starts(tmp_path) == ["w0-torch-upstream-r1", "w8-torch-upstream-r1", "w1-torch-upstream-r1"]
    assert [r["status"] for r in first] == ["ok", "failed", "ok"]

    again, _ = bench.run_sweep(stand_in_plan(tmp_path, workers=[0, 8, 1]), out, echo=lines.append)
    assert starts(tmp_path) == ["w8-torch-upstream-r1"], "only the failed run is made again"
    assert again[0] == first[0] and again[2] == first[2], "finished rows are kept as they were"
    assert "2 of 3 run(s) already finished" in lines[-3]

    # More workers, another pipeline, a second repeat: only the new runs are made.
    wider = stand_in_plan(tmp_path, workers=[0, 8, 1, 2], image_pipelines=["upstream", "fast"], repeats=2)
    rows, interrupted = bench.run_sweep(wider, out, echo=lines.append)
    started = starts(tmp_path)
    assert not interrupted and len(started) == len(wider.variants) - 2
    assert "w0-torch-upstream-r1" not in started and "w1-torch-upstream-r1" not in started
    assert {"w2-torch-upstream-r1", "w0-torch-fast-r1", "w0-torch-upstream-r2"} <= set(started)
    assert [r["run_id"] for r in rows] == [v.run_id for v in wider.variants]
    assert rows[0] == first[0] and saved_rows(out) == rows
    decoders = {r["image_pipeline"]: r["jpeg_decoder"] for r in rows if r["status"] == "ok"}
    assert decoders == {"upstream": None, "fast": "stand-in decoder 1.0"}  # the run's, in its row
    with open(out / "results.csv") as f:
        assert {row["jpeg_decoder"] for row in csv.DictReader(f) if row["status"] == "ok"} == {"", decoders["fast"]}
    assert json.loads((out / "results.json").read_text())["bench"]["variants"] == [
        dataclasses.asdict(v) for v in wider.variants
    ]

    # A narrower rerun runs nothing new and drops no row.
    narrow_plan = stand_in_plan(tmp_path, workers=[0])
    narrow, _ = bench.run_sweep(narrow_plan, out, echo=lines.append)
    assert starts(tmp_path) == [] and narrow == saved_rows(out) and len(narrow) == len(wider.variants)

    (out / "results.json").unlink()  # the sweep was killed after the run finished, before its row
    narrow_plan.env["STAND_IN_FAIL"] = "1"
    [unrecorded], _ = bench.run_sweep(narrow_plan, out, echo=lines.append)
    assert first[0]["train_samples_per_second"] == 10.0
    assert unrecorded["status"] == "failed" and "train_samples_per_second" not in unrecorded
    assert unrecorded["error"] == "exited 3 and printed nothing"  # a failed row always says why


@pytest.mark.parametrize(
    "change, message",
    [
        ({"preset": "blog"}, "(--preset local → blog)"),
        ({"extra_args": ["--seed", "2"]}, '(--extra-args "--seed 1" → "--seed 2")'),
        ({"extra_args": []}, '(--extra-args "--seed 1" → "")'),
        ({"nproc": 2}, "(--nproc 1 → 2)"),
        ({"hosts": ["gpu-a", "gpu-c"]}, '(--hostfile "gpu-a gpu-b" → "gpu-a gpu-c")'),
        ({"shape": "within-epoch"}, "(--shape published → within-epoch)"),
        ({"base_args": ["--do_eval"]}, "(--eval off → on)"),
        ({"base_args": ["--max_seq_length", "64"]}, '(the runs\' arguments "" → "--max_seq_length 64")'),
        ({"script": "gaudi", "device": "hpu"}, "(--script cuda → gaudi; device cpu → hpu)"),
    ],
)
def test_a_rerun_that_would_change_what_finished_rows_measured_is_refused(tmp_path, change, message):
    plan = stand_in_plan(tmp_path, workers=[0])
    plan.extra_args, plan.shape, plan.hosts = ["--seed", "1"], "published", ["gpu-a", "gpu-b"]
    bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)
    before = (tmp_path / "out" / "results.json").read_text()
    starts(tmp_path)
    for name, value in change.items():
        setattr(plan, name, value)

    with pytest.raises(bench.UserInputError) as refused:
        bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)

    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert starts(tmp_path) == [] and (tmp_path / "out" / "results.json").read_text() == before


def test_a_rerun_given_the_same_nodes_written_otherwise_keeps_the_finished_rows(tmp_path):
    plan = stand_in_plan(tmp_path, workers=[0])
    plan.hosts = ["gpu-a", "fd00::2"]
    first, _ = bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)
    assert starts(tmp_path) == ["w0-torch-upstream-r1"]
    plan.hosts = ["GPU-A.", "alice@fd00:0:0::2"]  # a name's case and trailing dot, an address's form, a user
    again, _ = bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)
    assert starts(tmp_path) == [] and again == first


def test_the_command_line_refuses_other_settings_in_one_line_and_dry_runs_show_only_missing_runs(tmp_path, capsys):
    out = tmp_path / "out"
    seed = ["--image-pipelines", "fast", "--extra-args", "--seed 1"]
    plan = bench.make_plan(bench.make_parser().parse_args(["--workers", "0", "1", *seed]), build_fixtures=False)
    plan.expected_device_name = ""  # as a dry run plans it
    out.mkdir()
    sweep_resume.write_results(out, plan, [{"run_id": plan.variants[0].run_id, "status": "ok"}])

    # --devices 0: no scaling curve, whatever this machine has
    assert bench.main(["--dry-run", "--workers", "0", "1", "2", *seed, "--out", str(out), "--devices", "0"]) == 0
    printed = capsys.readouterr().out
    assert "1 of them already finished" in printed
    assert "--dataloader_num_workers 0" not in printed and printed.count("--dataloader_num_workers 2") == 2

    code = bench.main(["--workers", "0", "--image-pipelines", "fast", "--extra-args", "--seed 2", "--out", str(out)])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1
    assert error.startswith("python -m bridgetower_bench.tools.bench: error: --out ")
    assert '(--extra-args "--seed 1" → "--seed 2")' in error


HOLD_RUN_DIRECTORY = """
import sys, time
sys.path.insert(0, {repo!r})
from bridgetower_bench.output_dir import run_directory
run_directory.claim(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def test_an_out_in_use_by_another_sweep_holding_no_readable_sweep_or_a_file_is_refused_naming_it(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    plan = stand_in_plan(tmp_path, workers=[0])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.json").write_text('{"runs": [')  # not a sweep's results: never overwritten
    with pytest.raises(bench.UserInputError, match=r"--out .*other: results.json cannot be read as a sweep's results"):
        bench.run_sweep(plan, tmp_path / "other", echo=lambda line: None)
    assert (tmp_path / "other" / "results.json").read_text() == '{"runs": ['
    (tmp_path / "a-file").write_text("")
    with pytest.raises(bench.UserInputError, match=r"--out .*a-file: cannot make the directory"):
        bench.run_sweep(plan, tmp_path / "a-file", echo=lambda line: None)
    assert starts(tmp_path) == []

    monkeypatch.setattr(bench, "make_plan", lambda args, **kw: plan)

    with sweep_resume.sweep_lock(out):  # a sweep running (flock: a second open of the file is refused, in any process)
        code = bench.main(["--out", str(out)])

    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1
    assert f"--out {out} is in use by another sweep (process {os.getpid()} on host " in error
    assert starts(tmp_path) == [] and not (out / "results.json").exists()
    [freed] = bench.run_sweep(plan, out, echo=lambda line: None)[0]
    assert freed["status"] == "ok", "a sweep that ended left it free"


def test_a_rerun_never_touches_a_run_directory_a_live_process_holds(tmp_path):
    plan = stand_in_plan(tmp_path, workers=[0, 1])
    held = tmp_path / "out" / "runs" / plan.variants[1].run_id
    (tmp_path / "hold.py").write_text(HOLD_RUN_DIRECTORY.format(repo=str(sweep_commands.REPO)))
    holder = subprocess.Popen([sys.executable, tmp_path / "hold.py", held], stdout=subprocess.PIPE, text=True)
    try:  # a live process holding the run directory's lock, as a training run does
        assert holder.stdout.readline() == "held\n"
        (held / "train_results.json").write_text("{}")  # what the live run is writing
        refusal = rf"runs/{plan.variants[1].run_id} is in use by a live run \(process {holder.pid} on host "
        with pytest.raises(bench.UserInputError, match=refusal):
            bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)
        assert (held / "train_results.json").read_text() == "{}" and starts(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()


SWEEP_OF_ONE = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from bridgetower_bench.tools import bench, tool_paths
from bridgetower_bench.tools.sweep import commands as sweep_commands
plan = bench.Plan(preset="local", script="cuda", device="cpu", nproc=1, variants=[sweep_commands.Variant(7)], base_args=[],
                  script_path=Path(sys.argv[1]))
bench.run_sweep(plan, Path(sys.argv[2]))
"""


def _running(pid):
    """Whether a process runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_sigkill_of_the_sweep_stops_its_run(tmp_path):
    driver = tmp_path / "sweep_of_one.py"
    driver.write_text(SWEEP_OF_ONE.format(repo=str(sweep_commands.REPO)))
    script = stand_in_plan(tmp_path, workers=[7]).script_path
    argv = [sys.executable, str(driver), str(script), str(tmp_path / "out")]
    sweep = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    run = int(wait_for(tmp_path / "out" / "runs" / sweep_commands.Variant(7).run_id / "pid"))
    try:
        assert _running(run)
        sweep.kill()
        sweep.wait()
        deadline = time.time() + 10
        while _running(run) and time.time() < deadline:
            time.sleep(0.05)
        assert not _running(run), "the run outlived the sweep"
    finally:
        if _running(run):
            os.kill(run, signal.SIGKILL)


# Tables and their arithmetic, on hand-made rows --------------------------------------------------------------


def row(
    sps, workers, loader="torch", asked=None, status="ok", device="Gaudi2", world_size=8, repeat=1, pipeline="upstream"
):
    return {
        "run_id": f"w{workers}-{asked or loader}-r{repeat}",
        "status": status,
        "returncode": 0 if status == "ok" else 1,
        "error": "" if status == "ok" else "RuntimeError: boom",
        "log": "x.log",
        "device_name": device,
        "world_size": world_size,
        "requested_loader": asked or loader,
        "loader": loader if status == "ok" else None,
        "image_pipeline": pipeline,
        "workers": workers,
        "repeat": repeat,
        "train_samples_per_second": sps,
        "train_samples_per_second_per_device": None if sps is None else sps / world_size,
        "data_wait_fraction": 0.25,
        "throughput_warmup_steps": 3,
        "throughput_counted_steps": 10,
        "per_device_train_batch_size": 48,
    }


FALLBACK = "torch (media pipeline unavailable: no habana_frameworks)"
HAND_MADE = [
    row(100.0, 0),
    row(140.0, 1),
    row(160.0, 1, repeat=2),
    row(130.0, 1, repeat=3),  # median 140
    row(200.0, 2),
    row(None, 2, status="failed", repeat=2),
    row(210.0, 2, loader=FALLBACK, asked="mediapipe"),
    row(50.0, 1, device="H100", world_size=1),  # no workers=0 run: no speedups on this device
    row(None, 2, status="interrupted", device="Nowhere"),  # interrupted runs are left out
]


def test_table_and_vs_published_have_median_and_speedup_per_device_and_never_claim_an_unused_loader():
    summary = bench_report.summarise(HAND_MADE)
    fallback_column = f"workers=2 + {FALLBACK} (asked: mediapipe)"

    assert summary.devices == ["Gaudi2 x8", "H100 x1"]
    assert summary.columns == ["workers=0", "workers=1", "workers=2", fallback_column]
    assert bench_report.speedup(summary, "Gaudi2 x8", "workers=1") == pytest.approx(1.40)
    assert bench_report.speedup(summary, "Gaudi2 x8", fallback_column) == pytest.approx(2.10)
    assert bench_report.speedup(summary, "H100 x1", "workers=1") is None

    table = bench_report.render_table(summary)
    assert f"| device | workers=0 | workers=1 | workers=2 | {fallback_column} |" in table
    assert "| Gaudi2 x8 | 100.0 (x1.00) | 140.0 (x1.40) | 200.0 (x2.00) [1 failed] | 210.0 (x2.10) |" in table
    assert "| H100 x1 | - | 50.0 | - | - |" in table
    assert "+ mediapipe" not in table
    assert (
        "after 3 warm-up step(s), over 10 counted step(s); per-device batch 48; median of up to 3 repeat(s)" in table
    )
    assert "| Gaudi2 x8 | 100.0-100.0 (n=1) | 130.0-160.0 (n=3) | 200.0-200.0 (n=1) | 210.0-210.0 (n=1) |" in table

    # vs_published lines up node, per-device and speedup figures
    text = published_report.render_vs_published(summary, {"preset": "blog", "model": published.MODEL})
    header = "| configuration | Gaudi2 x8 (this run) | H100 x1 (this run) | Gaudi2 HPU (published) | H100 GPU (published) | A100 80GB GPU (published) |"
    assert text.count(header) == 3
    node, per_device, speedups = text.split(header)[1:]
    assert "| workers=0 | 100.0 | - | 601.5 | 336.5 | 227.5 |" in node
    assert "| workers=2 + mediapipe | - | - | 847.7 | n/a | n/a |" in node, "our fallback run is not the mediapipe row"
    assert "| workers=1 | 17.5 | 50.0 | 93.4 | 72.5 | 42.5 |" in per_device  # 140/8; published node / 8
    assert "| workers=2 | x2.00 | - | x1.28 | x1.79 | x1.52 |" in speedups  # the post's workers 0->2 claims
    assert "The published recipe on 1, 8 device(s) instead of 8: compare the per-device figures." in text
    assert "| Gaudi2 HPU | 904.9 | 113.1 |" in text and "| Gaudi3 HPU | 783.5 | 97.9 |" in text  # upstream's CI


def test_the_table_names_other_library_versions_and_tabulates_the_epoch_start_wait_beside_the_steady_wait():
    rows = [
        dict(row(100.0, 0), version_transformers="4.50.0", version_accelerate="1.5.0", version_datasets="4.9.0"),
        dict(row(140.0, 1), version_transformers="5.0.0", version_accelerate="1.8.0", version_datasets="4.9.0"),
        dict(row(None, 2, status="failed"), version_transformers="6.0.0"),  # (a failed row measured nothing)
    ]
    table = bench_report.render_table(bench_report.summarise(rows))
    assert (
        "**Not like for like: these runs ran different library versions (transformers 4.50.0 / 5.0.0; "
        "accelerate 1.5.0 / 1.8.0); see each run's version_* fields.**"
    ) in table
    assert "| Gaudi2 x8 | - | - | - | - | - | - | 4.50.0/5.0.0 | 1.5.0/1.8.0 | 4.9.0 | - |" in table
    same = [{**r, "version_transformers": "4.50.0", "version_accelerate": "1.5.0"} for r in rows]
    assert "Not like for like" not in bench_report.render_table(bench_report.summarise(same))

    # the wait at epoch starts, beside the steady wait, per configuration
    def split_row(workers, persistent, start_seconds, steady_seconds, repeat=1):
        counted_seconds = 10.0  # 50 counted steps, 2 of them epoch starts
        return {
            **row(80.0, workers, device="CPU", world_size=1, repeat=repeat),
            "persistent_workers": persistent,
            "throughput_counted_steps": 50,
            "throughput_steps_per_epoch": 24,
            "throughput_epoch_starts": 2,
            "data_wait_seconds_epoch_start": start_seconds,
            "data_wait_seconds_steady": steady_seconds,
            "data_wait_fraction_epoch_start": start_seconds / counted_seconds,
            "data_wait_fraction_steady": steady_seconds / counted_seconds,
        }

    rows = [
        split_row(2, False, 1.2, 0.96),
        split_row(2, False, 1.6, 0.96, repeat=2),
        split_row(2, True, 0.1, 0.48),
        {**row(90.0, 0, device="CPU", world_size=1), "throughput_epoch_starts": 0},
    ]  # no boundary counted: no split
    table = bench_report.render_table(bench_report.summarise(rows))

    assert "| device | workers=0 | workers=2 | workers=2 (persistent) |" in table
    assert "Shape: 24 optimizer steps per epoch; 0, 2 epoch start(s) inside the counted window." in table
    split = table.split("## Data wait at epoch starts beside the steady state (median)")[1]
    # medians over the two repeats: 1.4 s at epoch starts (14 % of 10 s, 700 ms per start), 0.96 s over 48 steps (20 ms each)
    assert "| CPU x1 | workers=2 | 2 | 14.0% | 9.6% | x1.46 | 1.40 s | 700 ms | 20 ms |" in split
    assert "| CPU x1 | workers=2 (persistent) | 2 | 1.0% | 4.8% | x0.21 | 0.10 s | 50 ms | 10 ms |" in split
    assert "| CPU x1 | workers=0 |" not in split


# Command lines and bad input ---------------------------------------------------------------------------------


GAUDI = ["--script", "gaudi"]


def plan_for(argv, accelerator):
    return bench.make_plan(bench.make_parser().parse_args(argv), accelerator=accelerator, build_fixtures=False)


def readme_command(section: str, marker: str) -> list[str]:
    """The words of the README's command that contains `marker`, in the given section (continuation lines joined)."""
    text = (sweep_commands.REPO / "README.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if marker in command:
                return shlex.split(command, comments=True)
    raise AssertionError(f"no command with {marker} in the README's {section} section")


def as_flags(words: list[str]) -> dict:
    """--flag value / --flag=value / bare --flag (True) as one mapping, so that spellings compare equal."""
    flags, i = {}, 0
    while i < len(words):
        name, eq, value = words[i].partition("=")
        if eq:
            flags[name] = value
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            flags[name] = words[i + 1]
            i += 1
        else:
            flags[name] = "True"
        i += 1
    return flags


def test_blog_preset_on_gaudi_is_the_readmes_published_command_on_eight_hpus(tmp_path):
    plan = plan_for(["--preset", "blog"], accelerator="hpu")

    labels = [bench_report.configuration_label(v.workers, v.loader) for v in plan.variants]
    assert labels == ["workers=0", "workers=1", "workers=2", "workers=2 + mediapipe"]
    assert not any(v.persistent_workers for v in plan.variants)  # upstream's loader settings: the published table
    command = plan.command(plan.variants[-1], tmp_path / "run")
    launcher = ["-m", "bridgetower_bench.tools.launch_gaudi", "--world_size", "8", "--use_mpi"]
    assert command[:7] == [sys.executable, *launcher, str(bench.SCRIPTS["gaudi"])]
    text = " ".join(command)
    for flags in (
        "--model_name_or_path BridgeTower/bridgetower-large-itm-mlm-itc",
        "--dataset_name jmhessel/newyorker_caption_contest --dataset_config_name matching",
        "--per_device_train_batch_size 48",
        "--num_train_epochs 5",
        "--learning_rate 1e-5",
        "--throughput_warmup_steps 3",
        "--do_train --do_eval",
        "--report_to none",
        "--use_habana --use_lazy_mode --use_hpu_graphs_for_inference --gaudi_config_name Habana/clip --sdp_on_bf16",
        "--dataloader_num_workers 2",
        "--mediapipe_dataloader",
    ):
        assert flags in text
    assert "--do_predict" not in text and "--bf16" not in command  # as upstream's CI: autocast from Habana/clip
    # Lazy mode needs the variable in the runs' environment; every command the sweep shows carries it.
    assert plan.mode_env == {"PT_HPU_LAZY_MODE": "1"} and plan.run_env(plan.variants[-1])["PT_HPU_LAZY_MODE"] == "1"
    assert plan.shown_command(command, tmp_path).startswith(
        "PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.launch_gaudi "
    )
    assert "PT_HPU_LAZY_MODE" not in plan_for(["--preset", "blog"], accelerator="cuda").run_env()
    assert plan_for(["--preset", "blog"], accelerator="cuda").mode_env == {}

    # The mediapipe run is the README's published Gaudi command, flag for flag.
    words = readme_command("Gaudi2 / Gaudi3 on Intel Developer Cloud", "launch_gaudi")
    assert words[0] == "PT_HPU_LAZY_MODE=1", "the published command runs lazy mode"
    script_at = words.index("run_bridgetower.py")
    assert words[1:script_at] == ["python", *launcher]
    published = as_flags(words[script_at + 1 :])
    assert plan.variants[-1].loader == "mediapipe" and command[1:6] == words[2:script_at]
    swept = as_flags(command[command.index(str(bench.SCRIPTS["gaudi"])) + 1 :])
    for flags in (published, swept):
        flags.pop("--output_dir")
    assert swept.pop("--image_pipeline") == "upstream"  # the default: upstream's images, as published
    assert swept == published


def test_local_preset_pads_captions_to_32_tokens_and_truncates_none_of_the_synthetic_ones(fixtures, tmp_path):
    from datasets import load_dataset
    from transformers import AutoTokenizer

    local = plan_for([], accelerator="cpu")
    command = " ".join(local.command(sweep_commands.Variant(0, "torch", "upstream", 1), tmp_path))
    assert "--per_device_train_batch_size 8 --max_seq_length 32" in command
    tokenizer = AutoTokenizer.from_pretrained(fixtures["model"])
    data = load_dataset(str(fixtures["dataset"]), "matching", cache_dir=str(tmp_path / "hf-cache"))
    captions = [caption for split in data.values() for caption in split["image_description"]]
    longest = max(len(ids) for ids in tokenizer(captions)["input_ids"])
    assert 8 < longest <= 32


def test_cuda_runs_use_torchrun_and_cpu_runs_use_cpu_flags(tmp_path):
    local = plan_for([], accelerator="cpu")  # the local preset on a machine without an accelerator: the CPU
    assert local.device == "cpu" and "--use_cpu" in local.base_args
    assert "--use_cpu" not in plan_for([], accelerator="cuda").base_args
    gpu = plan_for(["--nproc", "2", "--extra-args", "--seed 3"], accelerator="cuda")
    command = gpu.command(gpu.variants[0], tmp_path / "run")
    torchrun = ["-m", "bridgetower_bench.tools.launch_cuda", "--standalone", "--nproc_per_node", "2"]
    assert command[:6] == [sys.executable, *torchrun]
    assert "--bf16" in command and "--use_cpu" not in command and command[-2:] == ["--seed", "3"]
    expected = [("torch", "upstream")] * 5 + [("device_decode", "upstream")] * 2 + [("torch", "fast")] * 5
    assert [(v.loader, v.image_pipeline) for v in gpu.variants] == expected, (
        "the local preset sets upstream's images beside ours, with and without persistent workers; the device loader runs with the first"
    )
    assert {v.image_pipeline for v in plan_for(["--preset", "blog"], accelerator="cuda").variants} == {"upstream"}

    gaudi_on_cpu = plan_for(["--script", "gaudi", "--workers", "0"], accelerator="cpu")
    command = " ".join(gaudi_on_cpu.command(gaudi_on_cpu.variants[0], tmp_path / "run"))
    assert "run_bridgetower.py" in command and "--use_cpu --use_lazy_mode False" in command
    assert "--use_habana" not in command and [v.loader for v in gaudi_on_cpu.variants] == ["torch", "torch"]
    # without Habana's software: the stand-ins shipped with the tools, never the tests' directory
    standin = tool_paths.HABANA_STANDIN
    assert standin.is_relative_to(sweep_commands.REPO / "bridgetower_bench") and (standin / "bin" / "pip").is_file()
    env = gaudi_on_cpu.run_env(gaudi_on_cpu.variants[0])
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(standin) and env["PATH"].startswith(str(standin / "bin"))
    assert str(sweep_commands.REPO / "tests") not in env["PYTHONPATH"] + env["PATH"]


def test_a_package_without_its_scripts_beside_it_is_refused_in_one_line(tmp_path, monkeypatch):
    """A copy of the package alone (installed without the kit's directory): the sweep says where the scripts go."""
    monkeypatch.setitem(tool_paths.SCRIPTS, "cuda", tmp_path / "run_bridgetower_cuda.py")
    result = run_tool("bench", ["--dry-run", "--out", tmp_path / "out"])
    assert result.returncode == 2 and not (tmp_path / "out").exists(), result.stderr
    assert result.stderr == (
        f"python -m bridgetower_bench.tools.bench: error: run_bridgetower_cuda.py is not beside the package in "
        f"{tool_paths.KIT}: the tools run the "
        "scripts from the kit's own directory; install the kit from it with `pip install -e .` (README)\n"
    )


@pytest.mark.parametrize(
    "argv, accelerator, message",
    [
        (["--loaders", "torch", "mediapipe"], "cpu", "--loaders mediapipe: only run_bridgetower.py has it"),
        ([*GAUDI, "--loaders", "device_decode"], "hpu", "--loaders device_decode: only run_bridgetower_cuda.py"),
        (["--loaders", "dali"], "cpu", "--loaders dali: unknown loader"),
        (["--workers", "0", "-1"], "cpu", "--workers 0 -1: worker counts must be 0 or more"),
        (["--repeats", "0"], "cpu", "--repeats 0"),
        ([*GAUDI, "--nproc", "8"], "cpu", "--nproc 8: the Gaudi script runs several processes only on HPUs"),
        (["--extra-args", "--output_dir /tmp/x"], "cpu", "--extra-args: --output_dir is set per run by the sweep"),
        (["--extra-args", "--seed '3"], "cpu", "--extra-args .*No closing quotation"),
        (
            ["--extra-args=--dataloader_persistent_workers"],
            "cpu",
            "--extra-args: --dataloader_persistent_workers is set per run",
        ),
        (["--preset", "blog", "--shape", "within-epoch"], "cpu", "--shape within-epoch: only the local preset"),
        (["--prefetch-factors", "0"], "cpu", "--prefetch-factors 0: must be 1 or more"),
        ([*GAUDI, "--devices", "1,2"], "cpu", "--devices 2: the Gaudi script runs several processes only on HPUs"),
        (["--devices", "0,2"], "cpu", "--devices 0,2: device counts must be 1 or more"),
    ],
)
def test_bad_command_lines_are_refused_with_the_flag_named(argv, accelerator, message):
    with pytest.raises(ValueError, match=message):
        plan_for(argv, accelerator)


def test_chart_groups_bars_by_worker_count_with_one_series_per_setting():
    rows = [
        row(10.0 + w, w, device="CPU", world_size=1, pipeline=pipeline)
        for pipeline in ("upstream", "fast")
        for w in (0, 1, 2)
    ]
    rows.append(row(12.0, 2, loader="device_decode", device="CPU", world_size=1))

    groups, series = chart_report.chart_groups(bench_report.summarise(rows))

    assert groups == ["workers=0", "workers=1", "workers=2"]
    assert [label for label, _, _ in series] == ["upstream images", "+ device_decode", "fast images"]
    assert [suffix for _, _, suffix in series] == ["", " + device_decode", ", fast images"]


def test_local_preset_counts_two_epoch_starts_at_the_published_steps_per_epoch(tmp_path):
    def shape(argv):
        command = plan_for(argv, accelerator="cpu").command(sweep_commands.Variant(2), tmp_path)
        flags = "--max_train_samples --per_device_train_batch_size --max_steps --throughput_warmup_steps".split()
        value = {flag: int(command[command.index(flag) + 1]) for flag in flags}
        steps_per_epoch = -(-value["--max_train_samples"] // value["--per_device_train_batch_size"])
        counted = range(value["--throughput_warmup_steps"] + 1, value["--max_steps"] + 1)
        return steps_per_epoch, [step for step in counted if (step - 1) % steps_per_epoch == 0]

    steps_per_epoch, epoch_starts = shape([])
    assert 24 <= steps_per_epoch <= 26, "the published run: about 9.8k rows / 384 per step"
    assert len(epoch_starts) >= 2 and epoch_starts[0] == steps_per_epoch + 1
    assert sweep_presets.local_train_rows() >= steps_per_epoch * 8, "the fixture has the rows the preset asks for"
    assert shape(["--shape", "within-epoch"])[1] == [], "the short variant stays inside the first epoch"
    assert "2 epoch start(s) counted (steps 25, 49)" in sweep_presets.describe_shape("published")


def test_persistent_workers_are_a_dimension_where_there_are_workers(tmp_path):
    labels = ["workers=0", "workers=1", "workers=1 (persistent)", "workers=2", "workers=2 (persistent)"]
    plan = plan_for(["--image-pipelines", "fast", "--devices", "0"], accelerator="cpu")
    assert [v.label for v in plan.variants] == [f"{label}, fast images" for label in labels]
    for variant in plan.variants:
        command = plan.command(variant, tmp_path / variant.run_id)
        assert ("--dataloader_persistent_workers" in command) == variant.persistent_workers
    assert len({v.run_id for v in plan.variants}) == len(plan.variants)

    argv = "--workers 0 2 --persistent-workers yes --prefetch-factors 4 --image-pipelines upstream".split()
    chosen = plan_for(argv, accelerator="cuda")
    assert [v.label for v in chosen.variants] == [
        "workers=0",
        "workers=2 (persistent, prefetch 4)",
        "workers=2 (persistent, prefetch 4) + device_decode",
    ]
    command = " ".join(chosen.command(chosen.variants[1], tmp_path / "run"))
    assert "--dataloader_persistent_workers True --dataloader_prefetch_factor 4" in command
    assert "--dataloader_persistent_workers" not in chosen.command(chosen.variants[0], tmp_path / "run")

    with_mediapipe = plan_for(["--preset", "blog", "--persistent-workers", "no", "yes"], accelerator="hpu")
    assert [v.label for v in with_mediapipe.variants] == [*labels, "workers=2 + mediapipe"]


def test_last_error_line_prefers_the_child_exception_over_launcher_noise_and_a_divergence_over_earlier_errors():
    child = "[rank0]: ValueError: --image_column foo not found"
    noise = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n====="
    log = f'step 1\nTraceback (most recent call last):\n  File "x.py", line 3\n{child}\n{noise}'
    assert sweep_rows.last_error_line(log) == child
    assert sweep_rows.last_error_line("all fine\nlast words\n") == "last words"
    diverged = "Training diverged at step 2 of 6 (loss NaN): stopped, nothing published in runs/a"
    warning = "UserWarning: some library's RuntimeError fallback\n{'loss': nan, 'epoch': 1.0}"
    log = f"{warning}\n{diverged}\nsome shutdown chatter"
    assert sweep_rows.last_error_line(log).startswith("Training diverged at step 2 of 6")


# The sweep never turns a GPU or Gaudi run into a CPU run unless --device cpu asks ---------------------------


@pytest.mark.parametrize(
    "argv, accelerator, message",
    [
        (["--preset", "blog"], "cpu", r"--preset blog: no HPU or NVIDIA GPU here .*; --device cpu runs the sweep"),
        (["--script", "cuda"], "hpu", r"--script cuda: run_bridgetower_cuda.py does not train on this machine's HPUs"),
        (["--script", "gaudi"], "cuda", r"--script gaudi: run_bridgetower.py does not train on this machine's GPUs"),
    ],
)
def test_the_sweep_refuses_to_turn_an_accelerator_run_into_a_cpu_run(argv, accelerator, message):
    with pytest.raises(UserInputError, match=message):
        plan_for(argv, accelerator)
    on_purpose = plan_for(argv + ["--device", "cpu", "--nproc", "1"], accelerator)
    assert on_purpose.device == "cpu" and "--use_cpu" in on_purpose.base_args


def test_a_driver_torch_cannot_use_is_refused_not_benchmarked_as_a_cpu(monkeypatch):
    import torch

    from bridgetower_bench.guards import cuda_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sweep_plan.shutil, "which", lambda name: "/usr/bin/hl-smi" if name == "hl-smi" else None)
    with pytest.raises(
        UserInputError, match=r"no usable HPU: a Gaudi driver is here .* run inside Habana's container"
    ):
        sweep_plan.detect_accelerator()

    monkeypatch.setattr(sweep_plan.shutil, "which", lambda name: None)
    monkeypatch.setattr(bench.os.path, "isdir", lambda path: False)
    monkeypatch.setattr(cuda_device, "driver_libraries", lambda: ["cuda", "nvidia-ml"])
    monkeypatch.setattr(
        cuda_device, "ask_driver", lambda: cuda_device.DriverAnswer("nvidia-smi", version="470.82.01", gpus=8)
    )
    with pytest.raises(UserInputError, match=r"no usable NVIDIA GPU: the NVIDIA driver is 470.82.01, too old"):
        sweep_plan.detect_accelerator()

    monkeypatch.setattr(cuda_device, "driver_libraries", lambda: [])
    monkeypatch.setattr(cuda_device, "ask_driver", lambda: None)
    assert sweep_plan.detect_accelerator() == "cpu"


def test_without_an_accelerator_a_dry_run_prints_the_commands_runs_nothing_and_forks_no_tokenizers_warning(
    tmp_path, monkeypatch, capsys
):
    # Building the fixtures starts tokenizers' threads: each run the sweep forks would print tokenizers' warning unless
    # TOKENIZERS_PARALLELISM is set in the sweep's own process by then. A setting of the user's is kept.
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: "cpu")
    assert bench.main(["--dry-run", "--workers", "0", "2", "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("run_bridgetower") >= 3 and "--dataloader_num_workers 2" in printed
    assert "--dataloader_persistent_workers True" in printed and "2 epoch start(s) counted" in printed
    assert not (tmp_path / "out").exists()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert bench.main(["--dry-run", "--workers", "0"]) == 0
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    capsys.readouterr()

    assert bench.main(["--preset", "blog", "--dry-run"]) == 2  # no accelerator here: refused in one line
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "python -m bridgetower_bench.tools.bench: error: --preset blog: no HPU or NVIDIA GPU here (the published run "
        "trains on 8 of them); --device cpu runs the sweep on the CPU on purpose"
    ]


# The scaling curve (--devices) -------------------------------------------------------------------------------


def test_the_scaling_curve_runs_the_first_configuration_again_and_cpu_runs_leave_the_loader_workers_their_cores(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    local = plan_for([], accelerator="cpu")  # make bench on a 2-core machine without accelerator: 1 and 2 processes
    matrix, [curve] = local.variants[:-1], local.variants[-1:]
    assert all(v.devices is None for v in matrix) and curve == dataclasses.replace(matrix[0], devices=2)
    command = local.command(curve, tmp_path / "run")
    assert command[2:6] == ["bridgetower_bench.tools.launch_cuda", "--standalone", "--nproc_per_node", "2"]
    # Every run of the local preset on 2 cores trains with 1 thread (the 2-process point's), the baseline included
    assert {local.run_env(v)["OMP_NUM_THREADS"] for v in local.variants} == {"1"}
    assert curve.run_id == matrix[0].run_id + "-x2"

    monkeypatch.setattr(bench.os, "cpu_count", lambda: 1)
    assert all(v.devices is None for v in plan_for([], accelerator="cpu").variants)  # one core: no curve
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    assert all(v.devices is None for v in plan_for(["--devices", "0"], accelerator="cpu").variants)
    assert all(v.devices is None for v in plan_for([], accelerator="cuda").variants)  # GPUs: only when asked

    blog = plan_for(["--preset", "blog", "--devices", "1,2,4,8", "--repeats", "2"], accelerator="cuda")
    points = [(v.devices, v.repeat) for v in blog.variants if v.devices]
    assert points == [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]  # 8 is the matrix itself (--nproc 8)
    assert blog.command(blog.variants[-3], tmp_path / "run")[:2] == [sys.executable, str(bench.SCRIPTS["cuda"])]

    monkeypatch.setattr(bench.os, "cpu_count", lambda: 8)
    plan = plan_for(["--workers", "0", "2", "--image-pipelines", "fast"], accelerator="cpu")
    threads = [plan.run_env(v)["OMP_NUM_THREADS"] for v in plan.variants]
    # workers 0, 2, 2 (persistent), then the curve's 2 processes of workers 0: every run's cores shared by the 2
    # processes of its largest point, so the curve's one-process run trains with the threads of each of its two
    assert threads == ["4", "3", "3", "4"]
    alone = plan_for(["--workers", "0", "2", "--image-pipelines", "fast", "--devices", "0"], accelerator="cpu")
    assert [alone.run_env(v)["OMP_NUM_THREADS"] for v in alone.variants] == ["8", "6", "6"]  # no curve: 1 process
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting wins
    assert plan.run_env(plan.variants[1])["OMP_NUM_THREADS"] == "3"


def test_the_scaling_section_gives_per_device_speed_efficiency_data_wait_and_cost_and_flags_odd_points(tmp_path):
    rows = [row(10.0, 0, device="H100", world_size=1), row(18.0, 0, device="H100", world_size=2)]
    rows += [row(30.0, 0, device="H100", world_size=4), row(50.0, 1, device="H100", world_size=1)]
    for r, usd in zip(rows, (1.0, 1.1, 1.3, 0.2)):
        r["usd_per_1m_samples"] = usd
    summary = bench_report.summarise(rows)
    scaling_report.add_scaling_efficiency(summary)
    assert [r.get("scaling_efficiency") for r in rows] == [1.0, 0.9, 0.75, None]  # workers=1: one size, no curve

    section = scaling_report.render_scaling(summary)
    assert (
        "| configuration | device | devices | samples/s per device | scaling efficiency | samples/s (all) |" in section
    )
    assert "| workers=0 | H100 | 1 | 10.0 | 100% | 10.0 | 25% | 1.00 |" in section
    assert "| workers=0 | H100 | 2 | 9.00 | 90% | 18.0 | 25% | 1.10 |" in section
    assert "| workers=0 | H100 | 4 | 7.50 | 75% | 30.0 | 25% | 1.30 |" in section
    assert "workers=1" not in section
    assert scaling_report.render_scaling_chart(summary, tmp_path / "chart_scaling.png")
    assert (tmp_path / "chart_scaling.png").stat().st_size > 1000

    alone = bench_report.summarise(rows[3:])
    assert scaling_report.render_scaling(alone) == ""
    assert not scaling_report.render_scaling_chart(alone, tmp_path / "x.png")

    # a point above 100%, of a busy machine or of other threads is flagged, not shown
    def cpu_row(sps, world_size, threads=1):
        return dict(row(sps, 0, device="CPU", world_size=world_size), device_type="cpu", cpu_threads=threads)

    quiet = {"other_cpu_cores": 0.1, "cpu_count": 2}  # others kept 5% of the 2 cores busy: not a busy machine
    rows = [{**cpu_row(1.0, 1), **quiet}, {**cpu_row(16.58, 2), **quiet}]  # 829%, the measured point
    section = scaling_report.render_scaling(bench_report.summarise(rows))
    assert "| workers=0 | CPU | 1 | 1.00 | 100% |" in section
    assert "| workers=0 | CPU | 2 | 8.29 | n/a: above 100% |" in section and "829%" not in section
    assert '"n/a: above 100%": more devices cannot add more per device' in section and "busy machine" not in section

    rows[0].update(other_cpu_cores=0.5, cpu_threads=2)  # the baseline: others took a quarter of the machine, 2 threads
    rows[1].update(train_samples_per_second=1.8, train_samples_per_second_per_device=0.9)  # 90%: plausible, no result
    section = scaling_report.render_scaling(bench_report.summarise(rows))
    assert "| workers=0 | CPU | 1 | 1.00 | n/a: busy machine |" in section
    assert "| workers=0 | CPU | 2 | 0.90 | n/a: threads differ, busy machine |" in section
    assert '"n/a: busy machine": while this point or its one-device run trained' in section
    assert '"n/a: threads differ"' in section and "above 100%" not in section
    assert scaling_report.render_scaling_chart(bench_report.summarise(rows), tmp_path / "chart_scaling.png")

    for r in rows:  # GPU runs: their CPU threads are no measure of them (torchrun gives each rank 1)
        r.update(device_type="cuda", other_cpu_cores=0.15)  # 0.15 of 2 cores: not above 10%
    assert "| workers=0 | CPU | 2 | 0.90 | 90% |" in scaling_report.render_scaling(bench_report.summarise(rows))
    assert "n/a" not in scaling_report.render_scaling(bench_report.summarise(rows))


# The curve across nodes (--hostfile, --nodes) ----------------------------------------------------------------

TWO_NODES = ["--nodes", "2", "--hostfile", "{hostfile}"]


@pytest.mark.parametrize(
    "argv, text, message",
    [
        (["--nodes", "1,2"], None, "--nodes 2: several nodes need --hostfile"),
        (["--remote-start-timeout", "0"], None, "--remote-start-timeout 0: a number of seconds above 0"),
        (["--remote-margin", "nan"], None, "--remote-margin nan: a factor above 0, e.g. 3"),
        (
            ["--remote-shell", ""],
            None,
            "--remote-shell is empty: give the command that reaches a node, e.g. 'ssh -tt'",
        ),
        (["--nodes", "1,3", "--hostfile", "{hostfile}"], None, "--nodes 3: --hostfile {hostfile} gives 2 node(s)"),
        (["--nodes", "1", "--hostfile", "{hostfile}"], None, "--hostfile {hostfile}: --nodes names no count above 1"),
        ([*TWO_NODES, "--nproc", "3"], None, "--hostfile {hostfile}: gpu-a has slots=2, fewer than --nproc 3"),
        (TWO_NODES, "gpu-a slots=2\n# rack 2\n", "--hostfile {hostfile}, line 2: '# rack 2' is not `HOST slots=N`"),
        ([*TWO_NODES, *GAUDI], None, "--nodes 2: the Gaudi script runs several processes only on HPUs"),
    ],
)
def test_a_curve_across_nodes_the_hostfile_cannot_give_is_refused_in_one_line(
    argv, text, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: "cpu")
    path = hostfile(tmp_path, *([text] if text else []))
    argv = [arg.format(hostfile=path) for arg in argv]
    assert bench.main(argv + ["--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"python -m bridgetower_bench.tools.bench: error: {message.format(hostfile=path)}")
    assert not (tmp_path / "out").exists()


def test_a_hostfile_path_with_a_line_break_is_named_escaped_in_the_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: "cpu")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my\nhosts").write_text("gpu-a slots=2\ngpu-b slots=2\n")
    for argv in (["--nodes", "1"], ["--nodes", "1,3"], ["--nodes", "2", "--nproc", "3"]):
        assert bench.main([*argv, "--hostfile", "my\nhosts", "--out", str(tmp_path / "out")]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and "--hostfile 'my\\nhosts'" in err, err


def test_a_dry_run_across_nodes_prints_each_nodes_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: "cpu")
    out, nodes = tmp_path / "out", ["--nodes", "1,2", "--hostfile", hostfile(tmp_path)]
    argv = ["--dry-run", "--workers", "0", "--image-pipelines", "upstream", "--devices", "0", "--out", str(out)]
    assert bench.main(argv + nodes + ["--extra-args", "--hub_token hf_secret_value"]) == 0
    printed = capsys.readouterr().out
    run = "w0-torch-upstream-r1-nodes2"
    assert "(across nodes: 2 nodes x1)" in printed and "hf_secret_value" not in printed
    node_lines = [shlex.split(line) for line in printed.splitlines() if line.startswith("ssh ")]
    assert [words[:3] for words in node_lines] == [["ssh", "-tt", "gpu-a"], ["ssh", "-tt", "gpu-b"]]
    for words in node_lines:  # one shell line per node: from the kit's directory, with the run's variables
        line = shlex.split(words[3])
        assert line[:3] == ["cd", str(sweep_commands.REPO), "&&"] and "HF_HUB_OFFLINE=1" in line
        start = line.index(sys.executable)
        assert line[start + 1 : start + 13] == [
            *("-m", "bridgetower_bench.tools.launch_cuda", "--nnodes", "2", "--nproc_per_node", "1"),
            *("--rdzv_backend", "c10d", "--rdzv_endpoint", "gpu-a:29500", "--rdzv_id", run),
        ]
        assert line[start + 13] == str(bench.SCRIPTS["cuda"]) and str(out / "runs" / run) in line

    monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: "hpu")
    assert bench.main(argv + nodes + ["--nproc", "2"]) == 0
    launches = [line for line in capsys.readouterr().out.splitlines() if "launch_gaudi --hostfile" in line]
    assert len(launches) == 1 and launches[0].startswith(  # one launch: DeepSpeed's launcher reaches the nodes
        f"PT_HPU_LAZY_MODE=1 {sys.executable} -m bridgetower_bench.tools.launch_gaudi --hostfile {out}/hostfiles/"
        f"{run} --num_nodes 2 --world_size 4 {bench.SCRIPTS['gaudi']} "
    )
    assert not out.exists(), "a dry run writes nothing, not even the hostfile"


def test_a_gaudi_run_across_nodes_gets_a_hostfile_of_its_first_nodes_and_old_rows_count_one_node(tmp_path):
    plan = stand_in_plan(tmp_path, workers=[0])
    plan.script, plan.device, plan.nproc, plan.hosts = "gaudi", "hpu", 2, ["gaudi-a", "gaudi-b", "gaudi-c"]
    (tmp_path / "out").mkdir()
    # a row of a sweep before --nodes (its time bounds the run across nodes)
    earlier = dict(row(10.0, 0, world_size=2), run_id=plan.variants[0].run_id, wall_seconds=60.0)
    sweep_resume.write_results(tmp_path / "out", plan, [earlier])
    plan.variants.append(dataclasses.replace(plan.variants[0], nodes=2))

    old, across = bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)[0]

    assert old == {**earlier, "nodes": 1}
    hostfile = tmp_path / "out" / "hostfiles" / "w0-torch-upstream-r1-nodes2"
    assert hostfile.read_text() == "gaudi-a slots=2\ngaudi-b slots=2\n"  # launch_gaudi: --world_size is their slots
    assert (across["nodes"], across["world_size"], across["status"]) == (2, 4, "failed")  # no DeepSpeed here
    # launch_gaudi took the hostfile: it checks --num_nodes and --world_size against it before looking for DeepSpeed
    assert across["error"].startswith("launch_gaudi.py: error: ")
    assert not any(f"{flag}=" in across["error"] for flag in ("--num_nodes", "--world_size")), across["error"]
    assert across["command"].startswith(
        "python -m bridgetower_bench.tools.launch_gaudi --hostfile $OUT/hostfiles/w0-torch-upstream-r1-nodes2 "
        "--num_nodes 2 --world_size 4 "
    )
    with open(tmp_path / "out" / "results.csv") as f:
        assert [r["nodes"] for r in csv.DictReader(f)] == ["1", "2"]


def test_a_gaudi_run_across_nodes_whose_launch_hangs_ends_at_the_bound(tmp_path, monkeypatch):
    # DeepSpeed's launcher reaches the nodes: one local process for the whole run, bounded as a CUDA run's nodes are
    plan = across_nodes_plan(tmp_path, [], script="gaudi", device="hpu")
    hanging = tmp_path / "hanging"  # a launch stuck at a node that never answers, its child ignoring SIGINT
    hanging.write_text(f"#!/bin/bash\necho launched\nsleep 600 & echo $! $$ >> {tmp_path}/pids; wait\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(plan, "node_commands", lambda variant, command: [[str(hanging)]])
    lines = []

    started = time.monotonic()
    kept, across = bench.run_sweep(plan, tmp_path / "out", echo=lines.append)[0]

    assert time.monotonic() - started < 20  # 3 s, then the stop
    bound = "3 s (--remote-start-timeout 1 s + --remote-margin 2 x 1 s, its configuration's run on one node)"
    assert f"[1/1] wait   at most {bound} for its 2 nodes" in lines
    assert (kept["status"], across["status"]) == ("ok", "failed")
    assert across["error"] == f"its launcher still running at the run's bound, {bound}: the run was stopped"
    assert all(map(ended, (tmp_path / "pids").read_text().split())), "the launch or its child outlived the run"


def across_nodes_plan(tmp_path, remote_shell: list, one_node_seconds=1.0, **settings):
    """A stand-in plan of its first configuration on one node (kept from an earlier sweep, done in
    `one_node_seconds`), then on nodes gpu-a and gpu-b through `remote_shell`: a first line within 1 s, the whole run
    within 1 + 2 x `one_node_seconds` s. `settings`: other Plan fields (set before the kept row is recorded)."""
    plan = dataclasses.replace(stand_in_plan(tmp_path, workers=[0]), **settings)
    plan.hosts, plan.remote_shell, plan.remote_start_timeout, plan.remote_margin = (
        ["gpu-a", "gpu-b"],
        remote_shell,
        1,
        2,
    )
    if one_node_seconds is not None:
        (tmp_path / "out").mkdir()
        alone = dict(row(10.0, 0, world_size=1), run_id=plan.variants[0].run_id, wall_seconds=one_node_seconds)
        sweep_resume.write_results(tmp_path / "out", plan, [alone])
    plan.variants.append(dataclasses.replace(plan.variants[0], nodes=2))
    return plan


@pytest.mark.parametrize(
    "shell, reason",
    [
        ("silent", "node 0 (gpu-a), node 1 (gpu-b) printed nothing within --remote-start-timeout 1 s"),
        ("false", "node 0 (gpu-a): false exited 1 before the run started"),
    ],
)
def test_a_remote_shell_that_never_starts_the_run_fails_its_row_with_the_reason(tmp_path, shell, reason):
    # A remote shell that hangs before the node's line runs (connecting, prompting); `false` fails at once on gpu-a
    # and hangs on gpu-b: of two nodes that fail together, either may be seen to end first.
    remote = tmp_path / shell
    fails = '[ "$1" = gpu-a ] && exit 1\n' if shell == "false" else ""
    remote.write_text(f"#!/bin/sh\n{fails}echo $$ >> {tmp_path}/pids\nexec sleep 600\n")
    remote.chmod(0o755)
    plan = across_nodes_plan(tmp_path, [str(remote)])
    if shell == "false":  # (a start bound that a loaded machine's slow start never reaches first)
        plan.remote_start_timeout = 60

    started = time.monotonic()
    across = bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)[0][-1]

    assert time.monotonic() - started < 20  # the bound, or gpu-a's exit, then the stop's SIGINT
    assert (across["status"], across["nodes"]) == ("failed", 2) and across["error"].startswith(reason)
    assert (tmp_path / "out" / across["log"]).read_text().endswith(f"bench: {across['error']}\n")
    assert not starts(tmp_path), "no training started"
    pids = tmp_path / "pids"  # the shells still waiting were stopped (gpu-b's may be stopped before its `echo`)
    for pid in map(int, pids.read_text().split() if shell == "silent" or pids.exists() else []):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_node_that_hangs_after_its_first_line_ends_its_run_at_the_bound_with_all_its_processes(tmp_path):
    # gpu-a's run ends at once; gpu-b's prints its first line, then waits on a child that ignores SIGINT (a
    # non-interactive shell's background job does), as a rank stuck in a collective would
    hanging = tmp_path / "hanging"
    hanging.write_text(
        "#!/bin/bash\necho node started: $1\n[ $1 = gpu-a ] && exit 0\n"
        f"sleep 600 & echo $! $$ >> {tmp_path}/pids; wait\n"
    )
    hanging.chmod(0o755)
    plan, lines = across_nodes_plan(tmp_path, [str(hanging)]), []

    started = time.monotonic()
    alone, across = bench.run_sweep(plan, tmp_path / "out", echo=lines.append)[0]

    assert time.monotonic() - started < 20  # 3 s, then the stop
    bound = "3 s (--remote-start-timeout 1 s + --remote-margin 2 x 1 s, its configuration's run on one node)"
    assert f"[1/1] wait   at most {bound} for its 2 nodes" in lines  # said when the wait starts
    assert (alone["status"], across["status"]) == ("ok", "failed")
    assert across["error"] == f"node 1 (gpu-b) still running at the run's bound, {bound}: the run was stopped"
    assert (tmp_path / "out" / across["log"]).read_text().endswith(f"bench: {across['error']}\n")
    assert all(map(ended, (tmp_path / "pids").read_text().split())), "the shell or its child outlived the run"


def test_a_run_across_nodes_without_a_finished_one_node_run_to_bound_it_is_not_started(tmp_path):
    plan = across_nodes_plan(tmp_path, ["false"], one_node_seconds=None)
    plan.variants = plan.variants[1:]  # the point alone: no run of its configuration on one node
    [across] = bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)[0]
    assert (across["status"], across["error"]) == ("failed", sweep_run.NOT_BOUNDED)
    assert across["error"].startswith("not started: no run of its configuration on one node finished")
    assert (tmp_path / "out" / across["log"]).read_text() == f"bench: {sweep_run.NOT_BOUNDED}\n"

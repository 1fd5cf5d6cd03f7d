"""The benchmark sweep: a real sweep on CPU, failures and Ctrl-C that do not lose rows, the tables' arithmetic."""

import csv
import json
import signal
import sys
import threading
import time

import pytest
from PIL import Image

from bridgetower_bench.tools import bench, bench_report

# A small but real sweep: 5 steps of batch 2 over 4 training rows, the first one warm-up: epochs of 2 steps,
# so steps 3 and 5 begin epochs inside the counted window.
TINY_RUN = ("--max_train_samples 4 --max_steps 5 --throughput_warmup_steps 1 --per_device_train_batch_size 2 "
            "--logging_steps 1 --max_eval_samples 8")


def test_local_sweep_runs_the_script_and_writes_every_output(fixtures, preloaded_sweep, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU, even on a GPU machine
    out = tmp_path / "bench"

    code = bench.main(["--workers", "0", "1", "--image-pipelines", "upstream", "--eval", "--extra-args", TINY_RUN, "--out", str(out)])

    printed = capsys.readouterr().out
    assert code == 0, printed
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["workers"], r["persistent_workers"], r["status"]) for r in runs] == [(0, False, "ok"), (1, False, "ok"), (1, True, "ok")]
    assert "--dataloader_persistent_workers True" in runs[2]["command"] and "--dataloader_persistent_workers" not in runs[1]["command"]
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
        assert row["eval_i2t_recall@1"] == evaluation["eval_i2t_recall@1"] and row["eval_loss"] == evaluation["eval_loss"]
        assert f"{row['train_samples_per_second']:.2f} samples/s" in printed
        assert row["data_wait_fraction_epoch_start"] + row["data_wait_fraction_steady"] == pytest.approx(row["data_wait_fraction"])
        assert row["data_wait_seconds_epoch_start"] > 0
        assert row["version_torch"] and row["version_transformers"]
        assert (out / "logs" / f"{row['run_id']}.log").read_text().startswith("$ ")
        assert not list((out / "runs" / row["run_id"]).glob("*.safetensors")), "weights are deleted by default"

    with open(out / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["workers"] for r in csv_rows] == ["0", "1", "1"]
    assert float(csv_rows[1]["train_samples_per_second"]) == pytest.approx(runs[1]["train_samples_per_second"])

    table = (out / "table.md").read_text()
    assert "| device | workers=0 | workers=1 | workers=1 (persistent) |" in table and "(x1.00)" in table
    assert "Shape: 2 optimizer steps per epoch; 2 epoch start(s) inside the counted window." in table
    assert "## Data wait at epoch starts beside the steady state (median)" in table
    split = table.split("## Data wait at epoch starts beside the steady state (median)")[1].split("##")[0]
    for label in ("workers=0", "workers=1", "workers=1 (persistent)"):
        assert f"| {label} | 2 | " in split, f"{label}: 2 epoch starts counted, side by side with the steady wait"
    assert table in printed, "the table is printed at the end"
    assert "## Retrieval quality: eval image->text recall@1" in table
    assert "Gaudi2 HPU (published)" in (out / "vs_published.md").read_text()
    with Image.open(out / "chart.png") as chart:
        assert chart.size[0] > 100 and chart.size[1] > 100
    assert printed.count("start  workers=") == 3 and "samples/s" in printed and "at 2 epoch start(s)" in printed


# ---------------------------------------------------------------------------------------------
# Failures and Ctrl-C, with a stand-in training script (fast, and it can fail on demand)
# ---------------------------------------------------------------------------------------------

STAND_IN = '''
import argparse, json, os, signal, sys, time
p = argparse.ArgumentParser()
p.add_argument("--output_dir")
p.add_argument("--dataloader_num_workers", type=int)
p.add_argument("--image_pipeline", choices=["upstream", "fast"])
a = p.parse_args()
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
           "version_torch": "0"}, open(os.path.join(a.output_dir, "train_results.json"), "w"))
if a.dataloader_num_workers == 3:  # validation metrics, under the scripts' name
    json.dump({"eval_loss": 0.3}, open(os.path.join(a.output_dir, "validation_results.json"), "w"))
'''


def stand_in_plan(tmp_path, workers, image_pipelines=("upstream",)):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return bench.Plan(
        preset="local", script="cuda", device="cpu", nproc=1,
        variants=bench.expand_matrix(list(workers), ["torch"], list(image_pipelines), repeats=1),
        base_args=[], script_path=script, expected_device_name="CPU stand-in",
    )


def test_failed_configurations_are_reported_and_the_sweep_goes_on(tmp_path):
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
    assert status[("upstream", 8)]["status"] == "failed" and "no train_samples_per_second" in status[("upstream", 8)]["error"]
    assert status[("upstream", 9)]["error"].startswith("killed by signal SIGKILL")
    assert any("FAILED (return code 2)" in line and "invalid choice" in line for line in lines)
    saved = json.loads((out / "results.json").read_text())["runs"]
    assert [r["status"] for r in saved] == [r["status"] for r in rows]
    assert not (out / "runs" / status[("upstream", 0)]["run_id"] / "model.safetensors").exists()

    table = bench_report.render_all(out, rows, {"preset": "local", "model": "stand-in"})
    assert "| CPU stand-in x1 | failed | failed | failed | 10.0 (x1.00) | failed | failed |" in table
    assert "## Failed runs" in table and "invalid choice" in table
    with Image.open(out / "chart.png") as chart:
        chart.load()


def test_validation_metrics_are_read_from_the_scripts_validation_results(tmp_path):
    rows, _ = bench.run_sweep(stand_in_plan(tmp_path, workers=[3, 4]), tmp_path / "out", echo=lambda line: None)
    assert [(r["workers"], r.get("eval_loss")) for r in rows] == [(3, 0.3), (4, None)]


def test_a_rerun_into_the_same_output_never_reports_the_earlier_runs_figures(tmp_path):
    plan = stand_in_plan(tmp_path, workers=[1])
    first, _ = bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)
    plan.env = {"STAND_IN_FAIL": "1"}

    second, _ = bench.run_sweep(plan, tmp_path / "out", echo=lambda line: None)

    assert first[0]["train_samples_per_second"] == 20.0
    assert second[0]["status"] == "failed" and "train_samples_per_second" not in second[0]


def test_ctrl_c_stops_the_running_script_and_keeps_finished_rows(ctrl_c_raises, tmp_path):
    plan = stand_in_plan(tmp_path, workers=[0, 7, 1])
    out = tmp_path / "out"
    pid_file = out / "runs" / plan.variants[1].run_id / "pid"

    def press_ctrl_c():
        deadline = time.time() + 300  # a loaded machine starts Python slowly
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    rows, interrupted = bench.run_sweep(plan, out, echo=lambda line: None)

    assert interrupted
    assert [r["status"] for r in rows] == ["ok", "interrupted"], "the run after Ctrl-C never starts"
    assert [r["status"] for r in json.loads((out / "results.json").read_text())["runs"]] == ["ok", "interrupted"]
    with pytest.raises(ProcessLookupError):
        bench.os.kill(int(pid_file.read_text()), 0)


# ---------------------------------------------------------------------------------------------
# Tables and their arithmetic, on hand-made rows
# ---------------------------------------------------------------------------------------------


def row(sps, workers, loader="torch", requested=None, status="ok", device="Gaudi2", world_size=8, repeat=1, pipeline="upstream"):
    return {
        "run_id": f"w{workers}-{requested or loader}-r{repeat}", "status": status, "returncode": 0 if status == "ok" else 1,
        "error": "" if status == "ok" else "RuntimeError: boom", "log": "x.log",
        "device_name": device, "world_size": world_size, "requested_loader": requested or loader,
        "loader": loader if status == "ok" else None, "image_pipeline": pipeline, "workers": workers, "repeat": repeat,
        "train_samples_per_second": sps, "train_samples_per_second_per_device": None if sps is None else sps / world_size,
        "data_wait_fraction": 0.25, "throughput_warmup_steps": 3, "throughput_counted_steps": 10,
        "per_device_train_batch_size": 48,
    }


FALLBACK = "torch (media pipeline unavailable: no habana_frameworks)"
HAND_MADE = [
    row(100.0, 0),
    row(140.0, 1), row(160.0, 1, repeat=2), row(130.0, 1, repeat=3),  # median 140
    row(200.0, 2), row(None, 2, status="failed", repeat=2),
    row(210.0, 2, loader=FALLBACK, requested="mediapipe"),
    row(50.0, 1, device="H100", world_size=1),  # no workers=0 run: no speedups on this device
    row(None, 2, status="interrupted", device="Nowhere"),  # interrupted runs are left out
]


def test_table_has_median_and_speedup_per_device_and_never_claims_an_unused_loader():
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
    assert "after 3 warm-up step(s), over 10 counted step(s); per-device batch 48; median of up to 3 repeat(s)" in table
    assert "| Gaudi2 x8 | 100.0-100.0 (n=1) | 130.0-160.0 (n=3) | 200.0-200.0 (n=1) | 210.0-210.0 (n=1) |" in table


def test_vs_published_lines_up_node_per_device_and_speedups():
    text = bench_report.render_vs_published(bench_report.summarise(HAND_MADE), {"preset": "blog", "model": bench.BLOG_MODEL})

    header = "| configuration | Gaudi2 x8 (this run) | H100 x1 (this run) | Gaudi2 HPU (published) | H100 GPU (published) | A100 80GB GPU (published) |"
    assert text.count(header) == 3
    node, per_device, speedups = text.split(header)[1:]
    assert "| workers=0 | 100.0 | - | 601.5 | 336.5 | 227.5 |" in node
    assert "| workers=2 + mediapipe | - | - | 847.7 | n/a | n/a |" in node, "our fallback run is not the mediapipe row"
    assert "| workers=1 | 17.5 | 50.0 | 93.4 | 72.5 | 42.5 |" in per_device  # 140/8; published node / 8
    assert "| workers=2 | x2.00 | - | x1.28 | x1.79 | x1.52 |" in speedups  # the post's workers 0->2 claims
    assert "The published recipe on 1, 8 device(s) instead of 8: compare the per-device figures." in text
    assert "| Gaudi2 HPU | 904.9 | 113.1 |" in text and "| Gaudi3 HPU | 783.5 | 97.9 |" in text  # upstream's CI


def test_epoch_start_wait_is_tabulated_beside_the_steady_wait_per_configuration():
    def split_row(workers, persistent, start_seconds, steady_seconds, repeat=1):
        counted_seconds = 10.0  # 50 counted steps, 2 of them epoch starts
        return {**row(80.0, workers, device="CPU", world_size=1, repeat=repeat), "persistent_workers": persistent,
                "throughput_counted_steps": 50, "throughput_steps_per_epoch": 24, "throughput_epoch_starts": 2,
                "data_wait_seconds_epoch_start": start_seconds, "data_wait_seconds_steady": steady_seconds,
                "data_wait_fraction_epoch_start": start_seconds / counted_seconds,
                "data_wait_fraction_steady": steady_seconds / counted_seconds}

    rows = [split_row(2, False, 1.2, 0.96), split_row(2, False, 1.6, 0.96, repeat=2), split_row(2, True, 0.1, 0.48),
            {**row(90.0, 0, device="CPU", world_size=1), "throughput_epoch_starts": 0}]  # no boundary counted: no split
    table = bench_report.render_table(bench_report.summarise(rows))

    assert "| device | workers=0 | workers=2 | workers=2 (persistent) |" in table
    assert "Shape: 24 optimizer steps per epoch; 0, 2 epoch start(s) inside the counted window." in table
    split = table.split("## Data wait at epoch starts beside the steady state (median)")[1]
    # medians over the two repeats: 1.4 s at epoch starts (14 % of 10 s, 700 ms per start), 0.96 s over 48 steps (20 ms each)
    assert "| CPU x1 | workers=2 | 2 | 14.0% | 9.6% | x1.46 | 1.40 s | 700 ms | 20 ms |" in split
    assert "| CPU x1 | workers=2 (persistent) | 2 | 1.0% | 4.8% | x0.21 | 0.10 s | 50 ms | 10 ms |" in split
    assert "| CPU x1 | workers=0 |" not in split


# ---------------------------------------------------------------------------------------------
# Command lines and bad input
# ---------------------------------------------------------------------------------------------


def plan_for(argv, accelerator):
    return bench.make_plan(bench.make_parser().parse_args(argv), accelerator=accelerator, build_fixtures=False)


def test_blog_preset_on_gaudi_is_the_published_command_on_eight_hpus(tmp_path):
    plan = plan_for(["--preset", "blog"], accelerator="hpu")

    labels = [bench.configuration_label(v.workers, v.loader) for v in plan.variants]
    assert labels == ["workers=0", "workers=1", "workers=2", "workers=2 + mediapipe"]
    command = plan.command(plan.variants[-1], tmp_path / "run")
    assert command[:7] == [sys.executable, "-m", "bridgetower_bench.tools.launch_gaudi", "--world_size", "8", "--use_mpi",
                           str(bench.SCRIPTS["gaudi"])]
    text = " ".join(command)
    for flags in ("--model_name_or_path BridgeTower/bridgetower-large-itm-mlm-itc",
                  "--dataset_name jmhessel/newyorker_caption_contest --dataset_config_name matching",
                  "--per_device_train_batch_size 48", "--num_train_epochs 5", "--learning_rate 1e-5",
                  "--throughput_warmup_steps 3", "--do_train --do_eval --do_predict",
                  "--use_habana --use_lazy_mode --use_hpu_graphs_for_inference --gaudi_config_name Habana/clip --bf16",
                  "--dataloader_num_workers 2", "--mediapipe_dataloader"):
        assert flags in text


def test_local_preset_pads_captions_to_32_tokens_and_truncates_none_of_the_synthetic_ones(fixtures, tmp_path):
    from datasets import load_dataset
    from transformers import AutoTokenizer

    command = " ".join(plan_for([], accelerator="cpu").command(bench.Variant(0, "torch", "upstream", 1), tmp_path))
    assert "--per_device_train_batch_size 8 --max_seq_length 32" in command
    tokenizer = AutoTokenizer.from_pretrained(fixtures["model"])
    data = load_dataset(str(fixtures["dataset"]), "matching", cache_dir=str(tmp_path / "hf-cache"))
    longest = max(len(ids) for split in data.values() for ids in tokenizer(list(split["image_description"]))["input_ids"])
    assert 8 < longest <= 32


def test_cuda_runs_use_torchrun_and_cpu_runs_use_cpu_flags(tmp_path):
    gpu = plan_for(["--nproc", "2", "--extra-args", "--seed 3"], accelerator="cuda")
    command = gpu.command(gpu.variants[0], tmp_path / "run")
    assert command[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    assert "--bf16" in command and "--use_cpu" not in command and command[-2:] == ["--seed", "3"]
    assert [(v.loader, v.image_pipeline) for v in gpu.variants] == [("torch", "upstream")] * 5 + [
        ("device_decode", "upstream")] * 2 + [("torch", "fast")] * 5, \
        "the local preset sets upstream's images beside ours, with and without persistent workers; the device loader runs with the first"
    assert {v.image_pipeline for v in plan_for(["--preset", "blog"], accelerator="cuda").variants} == {"upstream"}

    gaudi_on_cpu = plan_for(["--script", "gaudi", "--workers", "0"], accelerator="cpu")
    command = " ".join(gaudi_on_cpu.command(gaudi_on_cpu.variants[0], tmp_path / "run"))
    assert "run_bridgetower.py" in command and "--use_cpu --use_lazy_mode False" in command
    assert "--use_habana" not in command and [v.loader for v in gaudi_on_cpu.variants] == ["torch", "torch"]


@pytest.mark.parametrize("argv, accelerator, message", [
    (["--loaders", "torch", "mediapipe"], "cpu", "--loaders mediapipe: only run_bridgetower.py has it"),
    (["--script", "gaudi", "--loaders", "device_decode"], "hpu", "--loaders device_decode: only run_bridgetower_cuda.py"),
    (["--loaders", "dali"], "cpu", "--loaders dali: unknown loader"),
    (["--workers", "0", "-1"], "cpu", "--workers 0 -1: worker counts must be 0 or more"),
    (["--repeats", "0"], "cpu", "--repeats 0"),
    (["--script", "gaudi", "--nproc", "8"], "cpu", "--nproc 8: the Gaudi script runs several processes only on HPUs"),
    (["--extra-args", "--output_dir /tmp/x"], "cpu", "--extra-args: --output_dir is set per run by the sweep"),
    (["--extra-args", "--seed '3"], "cpu", "--extra-args .*No closing quotation"),
    (["--extra-args=--dataloader_persistent_workers"], "cpu", "--extra-args: --dataloader_persistent_workers is set per run"),
    (["--preset", "blog", "--shape", "within-epoch"], "cpu", "--shape within-epoch: only the local preset"),
    (["--prefetch-factors", "0"], "cpu", "--prefetch-factors 0: must be 1 or more"),
])
def test_bad_command_lines_are_refused_with_the_flag_named(argv, accelerator, message):
    with pytest.raises(ValueError, match=message):
        plan_for(argv, accelerator)


def test_chart_groups_bars_by_worker_count_with_one_series_per_setting():
    rows = [{"status": "ok", "requested_loader": loader, "image_pipeline": pipeline, "workers": w, "repeat": 1,
             "train_samples_per_second": 10.0 + w, "loader": loader, "device_name": "CPU", "world_size": 1}
            for pipeline in ("upstream", "fast") for w in (0, 1, 2) for loader in ("torch",)]
    rows.append({**rows[-1], "requested_loader": "device_decode", "loader": "device_decode", "image_pipeline": "upstream"})

    groups, series = bench_report.chart_groups(bench_report.summarise(rows))

    assert groups == ["workers=0", "workers=1", "workers=2"]
    assert [label for label, _, _ in series] == ["upstream images", "+ device_decode", "fast images"]
    assert [suffix for _, _, suffix in series] == ["", " + device_decode", ", fast images"]


def test_local_preset_counts_two_epoch_starts_at_the_published_steps_per_epoch(tmp_path):
    def shape(argv):
        command = plan_for(argv, accelerator="cpu").command(bench.Variant(2), tmp_path)
        value = {flag: int(command[command.index(flag) + 1]) for flag in
                 ("--max_train_samples", "--per_device_train_batch_size", "--max_steps", "--throughput_warmup_steps")}
        steps_per_epoch = -(-value["--max_train_samples"] // value["--per_device_train_batch_size"])
        counted = range(value["--throughput_warmup_steps"] + 1, value["--max_steps"] + 1)
        return steps_per_epoch, [step for step in counted if (step - 1) % steps_per_epoch == 0]

    steps_per_epoch, epoch_starts = shape([])
    assert 24 <= steps_per_epoch <= 26, "the published run: about 9.8k rows / 384 per step"
    assert len(epoch_starts) >= 2 and epoch_starts[0] == steps_per_epoch + 1
    assert bench.local_train_rows() >= steps_per_epoch * 8, "the fixture has the rows the preset asks for"
    assert shape(["--shape", "within-epoch"])[1] == [], "the short variant stays inside the first epoch"
    assert "2 epoch start(s) counted (steps 25, 49)" in bench.describe_shape("published")


def test_persistent_workers_are_a_dimension_where_there_are_workers(tmp_path):
    plan = plan_for(["--image-pipelines", "fast"], accelerator="cpu")
    assert [v.label for v in plan.variants] == [
        "workers=0, fast images", "workers=1, fast images", "workers=1 (persistent), fast images",
        "workers=2, fast images", "workers=2 (persistent), fast images"]
    for variant in plan.variants:
        command = plan.command(variant, tmp_path / variant.run_id)
        assert ("--dataloader_persistent_workers" in command) == variant.persistent_workers
    assert len({v.run_id for v in plan.variants}) == len(plan.variants)

    chosen = plan_for(["--workers", "0", "2", "--persistent-workers", "yes", "--prefetch-factors", "4",
                       "--image-pipelines", "upstream"], accelerator="cuda")
    assert [v.label for v in chosen.variants] == ["workers=0", "workers=2 (persistent, prefetch 4)",
                                                  "workers=2 (persistent, prefetch 4) + device_decode"]
    command = " ".join(chosen.command(chosen.variants[1], tmp_path / "run"))
    assert "--dataloader_persistent_workers True --dataloader_prefetch_factor 4" in command
    assert "--dataloader_persistent_workers" not in chosen.command(chosen.variants[0], tmp_path / "run")

    gaudi = plan_for(["--preset", "blog"], accelerator="hpu")  # upstream's loader settings: the published table
    assert not any(v.persistent_workers for v in gaudi.variants)
    with_mediapipe = plan_for(["--preset", "blog", "--persistent-workers", "no", "yes"], accelerator="hpu")
    assert [v.label for v in with_mediapipe.variants] == [
        "workers=0", "workers=1", "workers=1 (persistent)", "workers=2", "workers=2 (persistent)", "workers=2 + mediapipe"]


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    assert bench.main(["--dry-run", "--workers", "0", "2", "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("run_bridgetower") >= 3 and "--dataloader_num_workers 2" in printed
    assert "--dataloader_persistent_workers True" in printed and "2 epoch start(s) counted" in printed
    assert not (tmp_path / "out").exists()


def test_last_error_line_prefers_the_child_exception_over_launcher_noise():
    log = "\n".join([
        "step 1", "Traceback (most recent call last):", '  File "x.py", line 3', "[rank0]: ValueError: --image_column foo not found",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "=====",
    ])
    assert bench.last_error_line(log) == "[rank0]: ValueError: --image_column foo not found"
    assert bench.last_error_line("all fine\nlast words\n") == "last words"


def test_cpu_runs_leave_the_loader_workers_their_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 8)
    plan = plan_for(["--workers", "0", "2", "--image-pipelines", "fast"], accelerator="cpu")
    threads = [plan.run_env(v)["OMP_NUM_THREADS"] for v in plan.variants]
    assert threads == ["8", "6", "6"]  # workers 0, 2, 2 (persistent)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting wins
    assert plan.run_env(plan.variants[1])["OMP_NUM_THREADS"] == "3"

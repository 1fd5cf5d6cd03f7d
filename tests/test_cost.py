"""Prices per device-hour on the sweep and on compare: parsed or refused in one line, matched to rows, turned into
USD per 1M samples and the published run's cost (checked against hand-computed figures), absent without prices;
energy columns as the runs record them."""

import csv
import json
import os
import re
import shlex

import pytest
from PIL import Image

from bridgetower_bench.tools import bench, compare
from bridgetower_bench.tools.sweep import bench_report, cost, cost_report
from bridgetower_bench.tools.sweep import commands as sweep_commands
from bridgetower_bench.tools.sweep import plan as sweep_plan
from bridgetower_bench.user_errors import UserInputError


def prices(*texts, file=None):
    return cost.prices_from_args(list(texts), file)


def write_run(directory, **metrics):
    """A run directory holding `metrics` as its train_results.json."""
    directory.mkdir()
    (directory / "train_results.json").write_text(json.dumps(metrics))


# --- parsing and refusing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, message",
    [
        ("TPU=3", "--price TPU=3: unknown device 'TPU': it matches no row (this sweep: cpu (CPU"),
        ("cpu=-0.5", "--price cpu=-0.5: a price must be 0 or more, got -0.5"),
        ("cpu=ten", "--price cpu=ten: 'ten' is not a number (USD per device-hour)"),
        ("cpu=nan", "--price cpu=nan: 'nan' is not a finite number"),
        ("cpu", "--price cpu: expected DEVICE=USD_PER_HOUR (e.g. --price H100=2.50)"),
        ("=0.1", "--price =0.1: the device is empty"),
        ("cpu=", "--price cpu=: the price is missing"),
    ],
)
def test_a_malformed_price_is_refused_in_one_line_before_the_sweep_runs(flag, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--dry-run", "--workers", "0", "--price", flag])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"python -m bridgetower_bench.tools.bench: error: {message}")
    assert captured.err.count("\n") == 1, "one line, no usage, no traceback"
    assert "run(s) of" not in captured.out, "refused before anything is planned or run"


def test_prices_files_json_and_csv_and_a_device_priced_twice(tmp_path):
    assert prices("cpu=0").for_device("cpu", "CPU").usd_per_hour == 0.0, "a machine of your own: free is a price"
    with pytest.raises(UserInputError, match=r"--price h100=3: 'h100' is priced twice \(also --price H100=2.5\)"):
        prices("H100=2.5", "h100=3")
    (tmp_path / "p.json").write_text('{"H100": 2.5, "cpu": "0.10"}')
    (tmp_path / "p.csv").write_text("device,usd_per_hour\nGaudi2,1.2\nA100 80GB, 1.8\n")
    from_json, from_csv = prices(file=str(tmp_path / "p.json")), prices("cpu=1", file=str(tmp_path / "p.csv"))
    assert [(p.device, p.usd_per_hour) for p in from_json.entries] == [("H100", 2.5), ("cpu", 0.1)]
    assert [(p.device, p.usd_per_hour) for p in from_csv.entries] == [
        ("cpu", 1.0),
        ("Gaudi2", 1.2),
        ("A100 80GB", 1.8),
    ]

    (tmp_path / "bad.csv").write_text("device,usd_per_hour\nGaudi2,1.2\nH100,-2\n")
    (tmp_path / "cols.csv").write_text("name,price\nH100,2\n")
    (tmp_path / "one-col.csv").write_text("device,price\nH100,2\n")
    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "list.json").write_text("[2.5]")
    (tmp_path / "bool.json").write_text('{"H100": true}')
    (tmp_path / "short.csv").write_text("device,usd_per_hour\nH100\n")
    (tmp_path / "p.txt").write_text("H100=2")
    for name, message in [
        ("bad.csv", r"--prices .*bad.csv line 3: a price must be 0 or more, got -2"),
        ("cols.csv", r"expected the columns device,usd_per_hour \(found: name,price\)"),
        ("one-col.csv", r"expected the columns device,usd_per_hour \(found: device,price\)"),
        ("dir.json", r"dir.json: cannot be read \(not a regular file: directory\)"),
        ("fifo.json", r"fifo.json: cannot be read \(not a regular file: FIFO\)"),  # read without waiting
        ("list.json", r'expected a JSON object \{"DEVICE": USD_PER_HOUR, ...\}, found list'),
        ("p.txt", "expected a .json or .csv file"),
        ("missing.json", "no such file"),
        ("bool.json", "key 'H100': 'True' is not a number"),
        ("short.csv", "line 2: the price is missing"),
    ]:
        with pytest.raises(UserInputError, match=message):
            prices(file=str(tmp_path / name))


# --- matching rows ----------------------------------------------------------------------------------------------


def test_a_price_matches_the_device_type_or_part_of_the_name_the_most_specific_winning():
    given = prices("cuda=4", "H100=2.5", "H100 80GB=2.75", "Gaudi2=1.2", "a100=1.5")
    assert given.for_device("cuda", "NVIDIA H200").device == "cuda"
    assert given.for_device("cuda", "NVIDIA H100 80GB HBM3").device == "H100 80GB", "a longer name beats a shorter one"
    assert given.for_device("cuda", "NVIDIA H100 PCIe").device == "H100", "a name beats the type"
    assert given.for_device("cpu", "CPU AMD EPYC") is None
    assert prices("cuda=1", "N=2").for_device("cuda", "NVIDIA H200").device == "N", (
        "even a one-letter name beats the type"
    )
    # published rows: by name only; the type of this machine's GPUs prices none of them
    assert given.for_published("H100 GPU").device == "H100"
    assert given.for_published("A100 80GB GPU").device == "a100"
    assert prices("cuda=4").for_published("H100 GPU") is None
    assert prices("hpu=1").for_published("Gaudi2 HPU") is None

    with pytest.raises(
        UserInputError, match="--price H100=2 and --price HBM3=3: both match NVIDIA H100 80GB HBM3 equally"
    ):
        prices("H100=2", "HBM3=3").check([("cuda", "NVIDIA H100 80GB HBM3")], "this sweep")
    prices("A100=1").check([("cpu", "CPU X")], "this sweep")  # a published device only: accepted


# --- arithmetic -------------------------------------------------------------------------------------------------


def h100_row(devices, speed):
    return dict(
        device_type="cuda", device_name="NVIDIA H100 80GB HBM3", world_size=devices, train_samples_per_second=speed
    )


def test_cost_columns_of_hand_computed_rows():
    given = prices("H100=2.5", "cpu=0.10")
    # 8 H100s at 2.50 USD/h each, 602.1 samples/s together: 20 USD/h for 602.1 x 3600 = 2,167,560 samples/h.
    h100 = cost.cost_fields(h100_row(8, 602.1), given)
    assert h100["price_device"] == "H100" and h100["usd_per_device_hour"] == 2.5
    assert h100["usd_per_1m_samples"] == pytest.approx(20 / 2_167_560 * 1e6)  # 9.2270
    assert h100["usd_per_1m_samples"] == pytest.approx(9.22696, abs=1e-5)
    # the published run: 5 epochs x 9,800 rows = 49,000 samples, 81.4 s at that speed, 20 USD/h
    assert h100["usd_published_experiment"] == pytest.approx(49_000 / 602.1 / 3600 * 20)
    assert h100["usd_published_experiment"] == pytest.approx(0.45212, abs=1e-5)
    # one CPU at 0.10 USD/h and 20 samples/s: 72,000 samples per 0.10 USD
    cpu = cost.cost_fields(
        {"device_type": "cpu", "device_name": "CPU AMD EPYC", "world_size": 1, "train_samples_per_second": 20.0}, given
    )
    assert cpu["usd_per_1m_samples"] == pytest.approx(1.388889, abs=1e-6)
    assert cpu["usd_published_experiment"] == pytest.approx(0.0680556, abs=1e-7)
    # a run across nodes: each node's devices over its own samples (a node that counted none: no cost)
    nodes = [{"node": 0, "processes": 8, "train_samples_per_second": 602.1}, {"node": 1, "processes": 8}]
    across = cost.cost_fields({**h100_row(16, 1204.2), "per_node": nodes}, given)
    assert across["per_node"][0]["usd_per_1m_samples"] == pytest.approx(h100["usd_per_1m_samples"])
    assert across["per_node"][1] == nodes[1] and across["usd_per_1m_samples"] == pytest.approx(
        h100["usd_per_1m_samples"]
    )
    # a row without world_size is one device; a slow one (under 1 sample/s) is still priced
    slow = cost.cost_fields({"device_type": "cpu", "train_samples_per_second": 0.5}, given)
    assert slow["usd_per_1m_samples"] == pytest.approx(0.1 / (0.5 * 3600) * 1e6)
    # a failed run (no speed, or none measured) keeps its price and gets no cost; an unpriced device and no prices: no column
    priced_only = {"price_device": "cpu", "usd_per_device_hour": 0.1}
    assert cost.cost_fields({"device_type": "cpu", "device_name": "CPU"}, given) == priced_only
    assert cost.cost_fields({"device_type": "cpu", "train_samples_per_second": 0.0}, given) == priced_only
    assert (
        cost.cost_fields({"device_type": "hpu", "device_name": "GAUDI2", "train_samples_per_second": 5.0}, given) == {}
    )
    assert cost.cost_fields({"device_type": "cpu", "train_samples_per_second": 5.0}, prices()) == {}


def test_published_rows_at_the_users_prices():
    costs = {
        (c["device"], c["configuration"]): c
        for c in cost_report.published_costs(prices("Gaudi2=1.2", "A100 80GB=1.8"))
    }
    assert set(d for d, _ in costs) == {"Gaudi2 HPU", "A100 80GB GPU"}
    # Gaudi2 with the media pipeline: 847.7 samples/s on 8 HPUs at 1.20 USD each per hour
    mediapipe, upstream = costs[("Gaudi2 HPU", "workers=2 + mediapipe")], costs[("Gaudi2 HPU", "upstream CI")]
    assert mediapipe["usd_per_1m_samples"] == pytest.approx(9.6 / (847.7 * 3600) * 1e6)
    assert upstream["usd_published_experiment"] == pytest.approx(49_000 * 9.6 / (904.93 * 3600))
    a100 = costs[("A100 80GB GPU", "workers=2")]
    assert a100["usd_per_1m_samples"] == pytest.approx(11.581, abs=1e-3)  # 14.40 USD/h for 345.4 x 3600 samples


# --- the sweep's records ----------------------------------------------------------------------------------------

STAND_IN = """
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--output_dir")
p.add_argument("--dataloader_num_workers", type=int)
p.add_argument("--image_pipeline")
a = p.parse_args()
os.makedirs(a.output_dir, exist_ok=True)
sps = 10.0 * (1 + a.dataloader_num_workers)
energy = ({"energy_source": "not measured", "energy_reason": "no RAPL (/sys/class/powercap has no intel-rapl domain)"}
          if os.environ.get("NO_COUNTER") else
          {"energy_source": "rapl", "energy_joules_per_sample": 3.0 / (1 + a.dataloader_num_workers),
           "energy_watts_per_device": 30.0, "energy_joules": 300.0, "energy_seconds": 10.0, "energy_devices_measured": 1})
json.dump({"train_samples_per_second": sps, "train_samples_per_second_per_device": sps, "world_size": 1,
           "throughput_warmup_steps": 1, "throughput_counted_steps": 2, "per_device_train_batch_size": 2,
           "loader": "torch", "image_pipeline": a.image_pipeline, "device_name": "CPU stand-in", "device_type": "cpu",
           **energy}, open(os.path.join(a.output_dir, "train_results.json"), "w"))
"""


def sweep(tmp_path, given, env=None):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    plan = bench.Plan(
        preset="local",
        script="cuda",
        device="cpu",
        nproc=1,
        base_args=[],
        script_path=script,
        variants=sweep_commands.expand_matrix([0, 1], ["torch"], ["upstream"], repeats=1),
        expected_device_name="CPU stand-in",
        prices=given,
        env=env or {},
    )
    out = tmp_path / "out"
    rows, _ = bench.run_sweep(plan, out, echo=lambda line: None)
    bench.render_all(out, rows, {"preset": "local", "model": "stand-in", "prices": given})
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    return out, json.loads((out / "results.json").read_text())["runs"], table


def test_with_a_price_every_record_has_the_cost_and_the_chart_is_drawn(tmp_path):
    out, runs, csv_rows = sweep(tmp_path, prices("cpu=0.10", "H100=2.5"))

    assert json.loads((out / "results.json").read_text())["bench"]["prices"] == {"cpu": 0.1, "H100": 2.5}

    assert [r["usd_per_1m_samples"] for r in runs] == pytest.approx([0.1 / (10 * 3600) * 1e6, 0.1 / (20 * 3600) * 1e6])
    assert [r["usd_published_experiment"] for r in runs] == pytest.approx(
        [0.1 * 49_000 / (10 * 3600), 0.1 * 49_000 / (20 * 3600)]
    )
    assert float(csv_rows[1]["usd_per_1m_samples"]) == pytest.approx(runs[1]["usd_per_1m_samples"])
    assert csv_rows[0]["price_device"] == "cpu" and csv_rows[0]["energy_source"] == "rapl"
    table = (out / "table.md").read_text()
    assert "| CPU stand-in x1 | cpu: 0.1 USD/h | 2.78 per 1M; 0.136 run | 1.39 per 1M; 0.0681 run |" in table
    assert "then the published run (5 epochs x about 9,800 rows = 49,000 samples) on the row's devices" in table
    assert "| CPU stand-in x1 | 3 J/sample, 30 W per device (rapl) | 1.5 J/sample, 30 W per device (rapl) |" in table
    published = (out / "vs_published.md").read_text().split("## Cost at the prices given (USD)")[1]
    assert "| workers=2 | - | 9.23 |" in published  # H100 at workers=2: 2.5 x 8 / (602.1 x 3600) x 1e6
    with Image.open(out / "chart_cost.png") as chart:
        assert chart.size[0] > chart.size[1] > 100, "two panels: USD and joules"
    points = cost_report.cost_chart_points(bench_report.summarise(runs), prices("cpu=0.10", "H100=2.5"))
    assert [(p["x"], p["published"]) for p in points["usd"][:2]] == [(10.0, False), (20.0, False)]
    assert any(p["published"] and p["device"] == "H100 x8 (published)" for p in points["usd"])
    assert [p["y"] for p in points["energy"]] == [3.0, 1.5]


def test_without_prices_there_is_no_cost_column_and_a_run_without_counter_says_why(tmp_path):
    out, runs, csv_rows = sweep(tmp_path, prices(), env={"NO_COUNTER": "1"})

    assert not any(key.startswith("usd_") or key == "price_device" for row in runs for key in row)
    assert not any(key.startswith("usd_") or key == "price_device" for key in csv_rows[0]), "absent, not zero"
    assert "prices" not in json.loads((out / "results.json").read_text())["bench"]
    assert csv_rows[0]["energy_source"] == "not measured"
    assert csv_rows[0]["energy_reason"] == "no RAPL (/sys/class/powercap has no intel-rapl domain)"
    table = (out / "table.md").read_text()
    assert "Cost" not in table and "Cost" not in (out / "vs_published.md").read_text()
    assert "| CPU stand-in x1 | not measured | not measured |" in table
    assert "Not measured on CPU stand-in x1: no RAPL (/sys/class/powercap has no intel-rapl domain)." in table
    assert not (out / "chart_cost.png").exists(), "nothing to draw: no price, no energy figure"


def test_compare_adds_the_cost_of_each_run_and_the_published_rows_at_the_same_prices_and_refuses_a_stray_price(
    tmp_path, capsys
):
    energy = {"energy_source": "nvml-energy", "energy_joules_per_sample": 4.0, "energy_watts_per_device": 20.0}
    for name, speed in (("slow", 10.0), ("fast", 40.0)):
        device = {"world_size": 2, "device_type": "cuda", "device_name": "NVIDIA H200"}
        write_run(tmp_path / name, train_samples_per_second=speed, **device, **energy)
    prices_given = ["--price", "H200=3.6", "--price", "Gaudi2=1.2", "--json", str(tmp_path / "c.json")]
    assert compare.main([str(tmp_path / "slow"), str(tmp_path / "fast"), *prices_given]) == 0
    printed = capsys.readouterr().out
    # 2 GPUs at 3.60 USD/h: 7.20 USD/h for 36,000 (slow) or 144,000 (fast) samples per hour
    assert "| usd_per_1m_samples | 200 | 50 |" in printed
    assert "| usd_published_experiment | 9.8 | 2.45 |" in printed
    assert "| energy_joules_per_sample | 4 | 4 |" in printed
    assert "| energy_source | nvml-energy | nvml-energy |" in printed
    assert "| Gaudi2 HPU | workers=2 + mediapipe | 847.7 | 3.15 | 0.154 |" in printed
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["runs"]["fast"]["metrics"]["usd_per_1m_samples"] == pytest.approx(50.0)

    compare.main([str(tmp_path / "slow")])
    assert "usd_" not in capsys.readouterr().out

    # a price for no run and no published device
    with pytest.raises(SystemExit) as exit_info:
        compare.main([str(tmp_path / "slow"), "--price", "TPU=1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "python -m bridgetower_bench.tools.compare: error: --price TPU=1: unknown device 'TPU': it matches no row "
        "(the runs compared: cuda (NVIDIA H200)) and no published device (Gaudi2, H100, A100 80GB, Gaudi3); "
        "a DEVICE is a device type or part of a device name\n"
    )


def test_the_readmes_pricing_examples_run_on_the_machine_they_name(monkeypatch, capsys):
    # The README's sweep commands with --price, each with the machine its comment says it runs on.
    text = (sweep_commands.REPO / "README.md").read_text().replace("\\\n", " ")
    examples = [
        (shlex.split(line.split("#", 1)[0])[3:], line.split("#", 1)[1])
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
        if "tools.bench" in line and "--price" in line
    ]
    assert len(examples) == 2
    machines = {"without GPU or HPU": "cpu", "NVIDIA": "cuda", "Gaudi": "hpu"}
    for argv, comment in examples:
        named = [kind for words, kind in machines.items() if words in comment]
        assert named, f"the README's example {' '.join(argv)} does not say where it runs: {comment!r}"
        monkeypatch.setattr(sweep_plan, "detect_accelerator", lambda: named[0])
        assert bench.main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
        assert f" on {named[0]} x" in capsys.readouterr().out

"""Comparing run directories: tables, group statistics, the spread verdict, and clear errors."""

import json

import pytest

from bridgetower_bench.tools import compare


def _write_run(root, name, files):
    """A run directory holding the given {file name: metrics dict} results files."""
    run_dir = root / name
    run_dir.mkdir()
    for file_name, metrics in files.items():
        (run_dir / file_name).write_text(json.dumps(metrics))
    return str(run_dir)


def _run(root, name, samples_per_second, recall, loader="torch"):
    """A typical finished run: train figures, eval and test retrieval metrics in separate files."""
    train = dict(train_samples_per_second=samples_per_second, data_wait_fraction=0.25, loader=loader)
    train.update(image_pipeline="fast", train_loss=0.9)
    evaluation = {"eval_loss": 1.5, "eval_i2t_recall@1": recall, "eval_t2i_recall@1": recall / 2}
    evaluation.update(eval_i2t_mean_rank=4.0, eval_runtime=3.0)
    results = {"train_results.json": train, "validation_results.json": evaluation}
    return _write_run(root, name, {**results, "test_results.json": {"test_i2t_recall@10": 0.8}})


def test_load_run_merges_results_files_with_per_split_files_winning_and_names_what_is_missing(tmp_path):
    files = {"all_results.json": {"train_samples_per_second": 10.0, "eval_loss": 9.9}}
    run_dir = _write_run(tmp_path, "run", {**files, "validation_results.json": {"eval_loss": 1.0}})
    assert compare.load_run(run_dir) == {"train_samples_per_second": 10.0, "eval_loss": 1.0}

    (tmp_path / "empty").mkdir()
    _write_run(tmp_path, "broken", {"validation_results.json": {}})
    (tmp_path / "broken" / "validation_results.json").write_text("{not json")
    _write_run(tmp_path, "listy", {"train_results.json": [1, 2]})
    with pytest.raises(ValueError, match="run directory not found: .*nowhere"):
        compare.load_run(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no results in .*empty: expected one of all_results.json"):
        compare.load_run(tmp_path / "empty")
    with pytest.raises(ValueError, match="validation_results.json: not valid JSON"):
        compare.load_run(tmp_path / "broken")
    with pytest.raises(ValueError, match="train_results.json: expected a JSON object"):
        compare.load_run(tmp_path / "listy")


def test_cli_prints_runs_side_by_side_and_names_a_missing_directory(tmp_path, capsys):
    upstream = _run(tmp_path, "upstream", 601.5, 0.3)
    fast = _run(tmp_path, "fast", 768.7, 0.32, loader="torch (media pipeline unavailable: no|module)")

    assert compare.main([upstream, fast]) == 0
    out = capsys.readouterr().out

    assert "| metric | upstream | fast |" in out
    assert "| train_samples_per_second | 601.5 | 768.7 |" in out
    assert "| eval_i2t_recall@1 | 0.3 | 0.32 |" in out
    assert "| test_i2t_recall@10 | 0.8 | 0.8 |" in out
    assert "| loader | torch | torch (media pipeline unavailable: no\\|module) |" in out
    assert "eval_runtime" not in out  # neither a throughput nor a quality figure
    order = ["train_loss", "eval_loss", "eval_i2t_recall@1", "eval_i2t_mean_rank", "test_i2t_recall@10"]
    assert sorted(order, key=out.index) == order, out

    with pytest.raises(SystemExit) as exit_info:
        compare.main([upstream, str(tmp_path / "typo_dir")])
    assert exit_info.value.code == 2
    assert "run directory not found:" in capsys.readouterr().err


def test_the_same_world_size_on_one_node_or_across_two_is_told_apart(tmp_path, capsys):
    node = {"processes": 8, "train_samples_per_second": 400.0, "data_wait_fraction": 0.1}
    one = _write_run(tmp_path, "one", {"train_results.json": {"train_samples_per_second": 900.0, "world_size": 16}})
    two_nodes = {"train_samples_per_second": 800.0, "world_size": 16, "per_node": [node, node]}
    two = _write_run(tmp_path, "two", {"train_results.json": two_nodes})
    assert compare.main([one, two]) == 0
    out = capsys.readouterr().out
    assert "| world_size | 16 | 16 |" in out and "| nodes | 1 | 2 |" in out


@pytest.mark.parametrize("flag", ["noequals", "=a,b", "name=", "name=,"])
def test_malformed_group_flag_is_refused(flag, capsys):
    with pytest.raises(SystemExit):
        compare.main(["--group", flag])

    assert "expected NAME=DIR1,DIR2" in capsys.readouterr().err


def test_quality_keys_order_and_discovery():
    present = (
        "test_t2i_recall@5 eval_t2i_mean_rank eval_i2t_recall@10 eval_i2t_recall@2 eval_loss train_loss eval_runtime "
        "eval_t2i_recall@1 train_samples_per_second"
    ).split()
    ordered = "train_loss eval_loss eval_i2t_recall@2 eval_i2t_recall@10 eval_t2i_recall@1 eval_t2i_mean_rank"
    assert compare.quality_keys(present) == [*ordered.split(), "test_t2i_recall@5"]


def test_group_stats_and_spread_verdicts():
    baseline = compare.group_stats([0.30, 0.34, 0.32])
    assert baseline["mean"] == pytest.approx(0.32)
    assert baseline["std"] == pytest.approx(0.02)
    assert (baseline["min"], baseline["max"], baseline["n"]) == (0.30, 0.34, 3)

    close = compare.compare_to_baseline(baseline, compare.group_stats([0.35, 0.36]))
    assert close["difference"] == pytest.approx(0.035)
    assert close["spread"] == pytest.approx(0.04) and close["verdict"] == "within spread"

    far = compare.compare_to_baseline(baseline, compare.group_stats([0.40, 0.41]))
    assert far["verdict"] == "outside spread"

    singles = compare.compare_to_baseline(compare.group_stats([0.3]), compare.group_stats([0.5]))
    assert singles["verdict"].startswith("unknown") and singles["spread"] is None

    assert compare.group_stats(["torch", None]) is None


def test_groups_print_mean_spread_and_verdict_and_write_json(tmp_path, capsys):
    upstream = [_run(tmp_path, f"u{seed}", sps, r) for seed, sps, r in ((1, 600.0, 0.30), (2, 604.0, 0.34))]
    fast = [_run(tmp_path, f"f{seed}", sps, r) for seed, sps, r in ((1, 760.0, 0.33), (2, 770.0, 0.45))]
    out_json = tmp_path / "comparison.json"

    compare.main(
        ["--group", "upstream=" + ",".join(upstream), "--group", "fast=" + ",".join(fast), "--json", str(out_json)]
    )
    out = capsys.readouterr().out

    assert "| metric | upstream | fast |" in out
    assert "| eval_i2t_recall@1 | 0.32 ± 0.02828 (0.3–0.34, n=2) | 0.39 ± 0.08485 (0.33–0.45, n=2) |" in out
    # Difference 0.07 against the larger range 0.12: noise. t2i halves both: 0.035 vs 0.06.
    assert "| eval_i2t_recall@1 | fast vs upstream | +0.07 | 0.12 | within spread |" in out
    assert "Speed-up vs upstream (mean train_samples_per_second): fast x1.27" in out
    assert "larger min-max range" in out

    report = json.loads(out_json.read_text())
    assert set(report["runs"]) == {"u1", "u2", "f1", "f2"}
    # Directories beside the JSON file are named relative to it: a shared file shows no machine paths.
    assert report["groups"]["fast"]["dirs"] == ["f1", "f2"] and report["runs"]["u1"]["dir"] == "u1"
    assert str(tmp_path) not in out_json.read_text()
    assert report["groups"]["fast"]["stats"]["train_samples_per_second"]["mean"] == pytest.approx(765.0)
    by_metric = {c["metric"]: c for c in report["comparisons"]}
    assert by_metric["eval_t2i_recall@1"]["verdict"] == "within spread"
    assert set(by_metric) == set(
        "train_loss eval_loss eval_i2t_recall@1 eval_t2i_recall@1 eval_i2t_mean_rank test_i2t_recall@10".split()
    )


def test_a_difference_larger_than_the_spread_is_flagged(tmp_path, capsys):
    a = [_run(tmp_path, f"a{i}", 100.0, r) for i, r in enumerate((0.30, 0.31))]
    b = [_run(tmp_path, f"b{i}", 100.0, r) for i, r in enumerate((0.20, 0.22))]

    compare.main(["--group", "a=" + ",".join(a), "--group", "b=" + ",".join(b)])

    assert "| eval_i2t_recall@1 | b vs a | -0.095 | 0.02 | outside spread |" in capsys.readouterr().out


def test_same_directory_names_in_different_places_stay_apart(tmp_path, capsys):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "hpu").mkdir()
    first = _run(tmp_path / "gpu", "seed1", 300.0, 0.3)
    second = _run(tmp_path / "hpu", "seed1", 800.0, 0.3)

    compare.main([first, second])

    assert f"| metric | {first} | {second} |" in capsys.readouterr().out


def test_runs_of_different_library_versions_are_shown_and_said_to_differ(tmp_path, capsys):
    def run(name, transformers, accelerate):
        versions = dict(version_transformers=transformers, version_accelerate=accelerate, version_datasets="4.9.0")
        return _write_run(tmp_path, name, {"train_results.json": {"train_samples_per_second": 600.0, **versions}})

    pinned, current = run("pinned", "4.50.0", "1.5.0"), run("current", "5.0.0", "1.8.0")
    assert compare.main([pinned, current, "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    note = (
        "Not like for like: these runs ran different library versions (transformers 4.50.0 / 5.0.0; "
        "accelerate 1.5.0 / 1.8.0); see each run's version_* fields."
    )
    assert out.startswith(f"**{note}**")
    assert "| version_transformers | 4.50.0 | 5.0.0 |" in out and "| version_datasets | 4.9.0 | 4.9.0 |" in out
    assert json.loads((tmp_path / "c.json").read_text())["versions_note"] == note

    assert compare.main([pinned, pinned]) == 0
    assert "Not like for like" not in capsys.readouterr().out


def test_json_named_by_a_symbolic_link_is_written_where_it_points(tmp_path, capsys):
    run = _run(tmp_path, "r1", 600.0, 0.3)
    (tmp_path / "shared").mkdir()
    target, link = tmp_path / "shared" / "comparison.json", tmp_path / "comparison.json"
    target.write_text("old\n")
    link.symlink_to(target)
    assert compare.main([run, "--json", str(link)]) == 0
    assert link.is_symlink() and set(json.loads(target.read_text())["runs"]) == {"r1"}

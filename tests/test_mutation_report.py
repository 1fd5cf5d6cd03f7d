"""tests/mutation_report.py, the report `make mutate` prints after mutmut, on a small made-up set of mutmut results
(mutmut's per-module `.meta` files and its diffs); no mutmut run here."""

import io
import json

import pytest

import mutation_report


DIFFS = {
    "bridgetower_bench.measurement.throughput.x_rate__mutmut_1": [
        "-    return steps / seconds",
        "+    return steps * seconds",
    ],
    "bridgetower_bench.measurement.throughput.x_rate__mutmut_2": ["-    if seconds <= 0:", "+    if seconds < 0:"],
    "bridgetower_bench.measurement.throughput.x_rate__mutmut_3": ["-    chunk = 1024", "+    chunk = 1025"],
    "bridgetower_bench.measurement.throughput.x_fmt__mutmut_1": [
        '-    return f"{x:.2f}"',
        '+    return f"XX{x:.2f}XX"',
    ],
    "bridgetower_bench.measurement.throughput.x_fmt__mutmut_2": ["-    return round(x, 2)", "+    return round(x, 3)"],
    "bridgetower_bench.measurement.throughput.x_fmt__mutmut_3": ["-    flush=True,", "+    flush=False,"],
    "bridgetower_bench.metrics.timing.x_lap__mutmut_1": ["-    return a - b", "+    return a + b"],
}
EXIT_CODES = {
    "throughput": {
        "bridgetower_bench.measurement.throughput.x_rate__mutmut_1": 1,  # killed
        "bridgetower_bench.measurement.throughput.x_rate__mutmut_2": 0,  # survived, not explained
        "bridgetower_bench.measurement.throughput.x_rate__mutmut_3": 0,  # survived, a recorded equivalent
        "bridgetower_bench.measurement.throughput.x_fmt__mutmut_1": 36,  # past the time limit: killed
        "bridgetower_bench.measurement.throughput.x_fmt__mutmut_2": 33,  # no test reached it, a recorded equivalent
        "bridgetower_bench.measurement.throughput.x_fmt__mutmut_3": 1,  # killed although recorded as equivalent
    },
    "metrics/timing": {"bridgetower_bench.metrics.timing.x_lap__mutmut_1": None},  # not run yet
}
EQUIVALENTS = """# a comment
throughput
- chunk = 1024
+ chunk = 1025
reason: only a chunk size

throughput
- return round(x, 2)
+ return round(x, 3)
reason: a figure nobody reads back

throughput
- flush=True,
+ flush=False,
reason: stderr is line-buffered
"""


def fake_diff(mutant):
    source = mutant.source
    return "\n".join([f"--- {source}", f"+++ {source}", "@@ -1,3 +1,3 @@", " def f():", *DIFFS[mutant.name]])


@pytest.fixture
def results(tmp_path):
    for module, codes in EXIT_CODES.items():
        meta = tmp_path / "mutants" / "bridgetower_bench" / f"{module}.py.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {}}))
    return mutation_report.read_results(tmp_path / "mutants")


def run_report(results, tmp_path, equivalents_text, modules=()):
    path = tmp_path / "equivalents.txt"
    path.write_text(equivalents_text)
    out = io.StringIO()
    status = mutation_report.report(results, mutation_report.read_equivalents(path), list(modules), fake_diff, out)
    return status, out.getvalue()


def table_row(output, module):
    [row] = [line for line in output.splitlines() if line.startswith(f"| {module} |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_counts_per_module_with_equivalents_matched_by_the_changed_lines(results, tmp_path):
    status, output = run_report(results, tmp_path, EQUIVALENTS, modules=["throughput", "metrics.timing"])
    # module, mutants, killed, survived, equivalent, no tests, not checked, other, score
    assert table_row(output, "throughput") == ["throughput", "6", "3", "2", "2", "1", "0", "0", "75.0 %"]
    assert table_row(output, "metrics.timing") == ["metrics.timing", "1", "0", "0", "0", "0", "1", "0", "-"]
    assert table_row(output, "all")[1:8] == ["7", "3", "2", "2", "1", "1", "0"]
    assert status == 1  # one survivor no entry explains


def test_an_unexplained_survivor_is_shown_with_its_diff_and_a_ready_entry(results, tmp_path):
    status, output = run_report(results, tmp_path, EQUIVALENTS, modules=["throughput"])
    assert "survived: bridgetower_bench.measurement.throughput.x_rate__mutmut_2" in output
    assert "+    if seconds < 0:" in output
    assert "    throughput\n    - if seconds <= 0:\n    + if seconds < 0:\n    reason: " in output
    assert "x_rate__mutmut_3" not in output  # the recorded equivalent is only counted
    assert "1 survivor(s) left" in output


def test_the_ready_entry_once_recorded_explains_the_survivor(results, tmp_path):
    entry = "throughput\n- if seconds <= 0:\n+ if seconds < 0:\nreason: seconds is never 0 here\n"
    status, output = run_report(results, tmp_path, EQUIVALENTS + "\n" + entry, modules=["throughput"])
    assert status == 0
    assert table_row(output, "throughput")[4] == "3"
    assert "survivor(s) left" not in output


def test_stale_entries_are_reported(results, tmp_path):
    gone = "throughput\n- return 1\n+ return 2\nreason: no such mutant any more\n"
    status, output = run_report(results, tmp_path, EQUIVALENTS + "\n" + gone, modules=["throughput"])
    assert (
        "killed although recorded as equivalent (line 12): bridgetower_bench.measurement.throughput.x_fmt__mutmut_3"
        in output
    )
    assert "no mutant makes this change (line 17):\nthroughput\n- return 1\n+ return 2" in output


def test_without_modules_only_the_modules_mutmut_checked(results, tmp_path):
    status, output = run_report(results, tmp_path, EQUIVALENTS)
    assert table_row(output, "throughput")[1] == "6"
    assert "metrics.timing" not in output


def test_a_module_without_results_is_named(results, tmp_path):
    status, output = run_report(results, tmp_path, EQUIVALENTS, modules=["throughput", "imagez"])
    assert status == 2
    assert "no mutmut results for: imagez" in output


def test_a_malformed_entry_names_its_line(tmp_path):
    path = tmp_path / "equivalents.txt"
    path.write_text("# x\nthroughput\n- a = 1\n+ a = 2\nreason: r\n\nimages\n- b = 1\n+ b = 2\n")
    with pytest.raises(SystemExit, match=r"equivalents.txt:7: an entry is a module"):
        mutation_report.read_equivalents(path)


def test_the_recorded_equivalents_parse():
    entries = mutation_report.read_equivalents()
    assert entries and all(e.reason and (e.removed or e.added) for e in entries)
    assert len({(e.module, e.removed, e.added) for e in entries}) == len(entries)

"""Mutation testing: put one small bug at a time into the modules users' results depend on, run the tests that
could notice it, and count the bugs the tests catch. Not part of `make test`.

    python tests/mutate.py                          # every module below
    python tests/mutate.py --module throughput      # one module
    python tests/mutate.py --sample 20 --seed 1     # at most 20 mutants per module, drawn with the seed

Each mutant is one change of one operator or constant, found by walking the module's syntax tree:
comparisons (`<` / `<=`, `==` / `!=`, `in` / `not in`, `is` / `is not`), arithmetic (`+` / `-`, `*` / `/`),
`and` / `or`, a dropped `not`, an integer constant plus one, `True` / `False` swapped. It is written into a
copy of the repository (the working tree is never touched).

Which tests run: first the module's test files run once under coverage, each test in a coverage context of
its own, scripts and workers it starts included (coverage's subprocess patch). A mutant then runs, with
`-x` and fastest first, only the tests that executed one of its lines: a line executed at import or in a
fixture brings in every test that may share it, and a mutant whose lines no test executes at all survives
as "not covered" without running anything. The runs are forked from a server process that has imported
the libraries (torch, transformers, datasets) once and never the repository's own modules. A failing run
kills the mutant; a run past its time limit (60 s + 3 x the tests' own time) does too, once a fresh,
unforked pytest run confirms it (the whole process group is stopped, so a mutant's endless loop in a
script dies with it).

Survivors are printed with a ready line for `tests/mutation_equivalents.txt`: read each, and either add a
test that catches it or, when no behaviour a user could observe changes, record it there with the reason.
The score printed is killed / (mutants - equivalent); equivalents are listed apart, and not run unless
`--run-equivalents` asks (a module-level constant's mutant runs every test of the module: minutes each).
"""

from __future__ import annotations

import argparse
import ast
import base64
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent

# module (under bridgetower_bench/) -> the test files that guard it
# (fast files first: the tests run with -x, so a mutant a fast file catches costs only that file)
TARGETS = {
    "images.py": ["tests/test_images.py"],
    "image_cache.py": ["tests/test_guards.py", "tests/test_image_cache.py"],
    "preflight.py": ["tests/test_preflight_cases.py", "tests/test_reliability.py", "tests/test_user_input.py"],
    "data.py": ["tests/test_data.py"],
    "resilience.py": ["tests/test_reliability.py"],
    "atomic_files.py": ["tests/test_atomic_files.py"],
    "throughput.py": ["tests/test_throughput_edges.py", "tests/test_throughput.py"],
    "retrieval.py": ["tests/test_retrieval.py", "tests/test_retrieval_direct.py"],
    "flag_guard.py": ["tests/test_guards.py", "tests/test_scripts.py", "tests/test_user_input.py"],
    "tools/make_cuda_script.py": ["tests/test_make_cuda_script.py"],
    "energy.py": ["tests/test_energy.py"],
    "tools/cost.py": ["tests/test_cost.py"],
}

_COMPARE_SWAPS = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}
_BOOLOP_SWAPS = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int  # the index-th mutation site of the module, in tree-walk order
    line: int
    end_line: int
    change: str
    text: str  # the mutated line, stripped: with the change and occurrence, what names the mutant across edits
    occurrence: int  # how many earlier mutants of the module have the same text and change


def _sites(tree: ast.AST):
    """(node, description, apply) for every place one mutation can go, in a fixed order."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE_SWAPS:
                    new = _COMPARE_SWAPS[type(op)]
                    yield (
                        node,
                        f"{type(op).__name__} -> {new.__name__}",
                        (lambda n=node, i=i, new=new: n.ops.__setitem__(i, new())),
                    )
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
            new = _BINOP_SWAPS[type(node.op)]
            yield (
                node,
                f"{type(node.op).__name__} -> {new.__name__}",
                (lambda n=node, new=new: setattr(n, "op", new())),
            )
        elif isinstance(node, ast.BoolOp):
            new = _BOOLOP_SWAPS[type(node.op)]
            yield (
                node,
                f"{type(node.op).__name__} -> {new.__name__}",
                (lambda n=node, new=new: setattr(n, "op", new())),
            )
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield (
                node,
                "not x -> x",
                (
                    lambda n=node: (
                        setattr(n, "op", ast.UAdd()),
                        setattr(n, "operand", ast.Call(ast.Name("bool", ast.Load()), [n.operand], [])),
                    )
                ),
            )
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            if isinstance(node.value, bool):
                yield node, f"{node.value} -> {not node.value}", (lambda n=node: setattr(n, "value", not n.value))
            elif isinstance(node.value, int):
                yield node, f"{node.value} -> {node.value + 1}", (lambda n=node: setattr(n, "value", n.value + 1))


def mutants_of(module: str) -> list[Mutant]:
    source = (REPO / "bridgetower_bench" / module).read_text()
    lines = source.splitlines()
    mutants, seen = [], {}
    for i, (node, change, _) in enumerate(_sites(ast.parse(source))):
        text = lines[node.lineno - 1].strip()
        occurrence = seen[(text, change)] = seen.get((text, change), -1) + 1
        mutants.append(Mutant(module, i, node.lineno, node.end_lineno or node.lineno, change, text, occurrence))
    return mutants


def mutated_source(mutant: Mutant) -> str:
    tree = ast.parse((REPO / "bridgetower_bench" / mutant.module).read_text())
    for i, (_, _, apply) in enumerate(_sites(tree)):
        if i == mutant.index:
            apply()
            return ast.unparse(ast.fix_missing_locations(tree))
    raise IndexError(mutant)


def copy_repository(into: Path) -> Path:
    """The files the tests need, without .git, .venv and caches."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", ".cache", "__pycache__", "bench_out", "*.egg-info", "runs", "mutants*"
    )
    shutil.copytree(REPO, into, ignore=ignore)
    return into


def test_env(copy: Path) -> dict:
    # No bytecode is written: a mutant of the same size written in the same second as the last one would
    # otherwise be run from the last one's stale .pyc.
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": str(copy),
        "PYTHONDONTWRITEBYTECODE": "1",
        "BRIDGETOWER_BENCH_FIXTURES": os.environ.get("BRIDGETOWER_BENCH_FIXTURES", str(REPO / ".cache" / "fixtures")),
    }


def _stop_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever of the test run's session is left: scripts, loader workers
    except ProcessLookupError:
        pass


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    """One fresh pytest process (the baseline, and the check of a forked run that timed out)."""
    started = time.perf_counter()
    # In a session of its own: past the time limit, the scripts and loader workers the tests started are
    # stopped with pytest (killing pytest alone would leave a mutant's endless loop running in a script).
    with open(copy / "mutate-tests.log", "w") as log:  # the last run's output, shown when the unmutated tests fail
        tests_run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=test_env(copy),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = tests_run.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        _stop_group(tests_run.pid)
        tests_run.wait()
    seconds = time.perf_counter() - started
    if returncode is None:
        return "timeout", seconds
    return ("passed" if returncode == 0 else "failed"), seconds


# --- Which tests execute which line: one run of the test files under coverage ----------------------------------
# A pytest plugin (loaded with `-p mutate` in that run only) names the coverage context after the running test,
# `<node id>|setup`, `|call` or `|teardown`; a script or worker a test starts inherits `<node id>|sub` as its
# static context through coverage's subprocess patch. Lines run while the test files are imported get `collect`.

_DURATIONS: dict[str, float] = {}


def _switch_context(context: str) -> None:
    import coverage

    current = coverage.Coverage.current()
    if current is None:
        return
    current.switch_context(context)
    config = os.environ.get("COVERAGE_PROCESS_CONFIG")
    if config:  # what a subprocess started from now on measures under
        data = json.loads(base64.b64decode(config))
        data["context"] = context.rsplit("|", 1)[0] + "|sub" if "|" in context else context
        os.environ["COVERAGE_PROCESS_CONFIG"] = base64.b64encode(json.dumps(data).encode()).decode()


def pytest_collection(session):
    _switch_context("collect")


def pytest_runtest_setup(item):
    _switch_context(f"{item.nodeid}|setup")


def pytest_runtest_call(item):
    _switch_context(f"{item.nodeid}|call")


def pytest_runtest_teardown(item):
    _switch_context(f"{item.nodeid}|teardown")


def pytest_runtest_logreport(report):
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    _switch_context("finish")
    # The libraries the tests imported (not the repository's own modules), for the forking test server.
    copy = str(Path(session.config.rootpath).resolve())
    libraries = [
        name
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in _PRELOAD_PACKAGES and not str(getattr(module, "__file__", "") or "").startswith(copy)
    ]
    out = os.environ.get("MUTATE_COVERAGE_INFO")
    if out:
        Path(out).write_text(
            json.dumps({"durations": _DURATIONS, "libraries": libraries, "exitstatus": int(exitstatus)})
        )


@dataclass
class Coverage:
    """For one module: line -> contexts that ran it, and how long each test took."""

    contexts: dict[int, set[str]]
    durations: dict[str, float]


def measure_coverage(copy: Path, tests: list[str], workdir: Path) -> tuple[str, dict, float]:
    """Run the test files once under coverage (subprocesses included); returns status, info and seconds."""
    rc = workdir / "coveragerc"
    rc.write_text(
        f"[run]\ndata_file = {workdir / 'coverage'}\nsource = {copy / 'bridgetower_bench'}\n"
        "patch = subprocess, fork, _exit\nparallel = true\nconcurrency = thread, multiprocessing\n"
    )
    info_path = workdir / "info.json"
    env = {
        **test_env(copy),
        "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "tests")]),
        "MUTATE_COVERAGE_INFO": str(info_path),
    }
    started = time.perf_counter()
    with open(copy / "mutate-tests.log", "w") as log:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coverage",
                "run",
                f"--rcfile={rc}",
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "mutate",
                *tests,
            ],
            cwd=copy,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        returncode = run.wait()
        _stop_group(run.pid)
    seconds = time.perf_counter() - started
    if returncode != 0 or not info_path.exists():
        return "failed", {}, seconds
    subprocess.run(
        [sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=copy, env=env, check=True
    )
    return "passed", json.loads(info_path.read_text()), seconds


def coverage_of(workdir: Path, source: Path, durations: dict) -> Coverage:
    import coverage

    data = coverage.CoverageData(basename=str(workdir / "coverage"))
    data.read()
    contexts = {line: set(found) for line, found in data.contexts_by_lineno(str(source)).items()}
    return Coverage(contexts, durations)


def select_tests(mutant: Mutant, cov: Coverage, files: list[str]) -> list[str] | None:
    """The tests to run for a mutant, fastest first; None when no test executes its lines at all."""
    contexts = set().union(*(cov.contexts.get(line, set()) for line in range(mutant.line, mutant.end_line + 1)))
    if not contexts:
        return None
    mine = [nodeid for nodeid in cov.durations if nodeid.split("::")[0] in files]
    chosen: set[str] = set()
    for context in contexts:
        nodeid, _, phase = context.rpartition("|")
        if nodeid not in cov.durations or phase not in ("call", "sub", "setup", "teardown"):
            chosen.update(mine)  # run at import or outside any test: every test of the module's files may see it
        elif phase in ("setup", "teardown"):  # a fixture: every test of that file may share it
            chosen.update(n for n in mine if n.split("::")[0] == nodeid.split("::")[0])
        elif nodeid.split("::")[0] in files:
            chosen.add(nodeid)
    return sorted(chosen, key=lambda n: (cov.durations[n], n))


# --- A server that imports the libraries once and forks one pytest run per mutant -----------------------------
# Starting pytest costs ~10 s here (torch, transformers, datasets); forked from a process that has them
# imported, a run starts in ~1 s. The server never imports the repository's own modules, so each forked run
# imports the mutated module from disk, as a fresh process would. A run that times out is checked again in a
# fresh process, so that nothing a fork could leave behind counts a mutant as killed.

_PRELOAD_PACKAGES = {
    "torch",
    "torchvision",
    "numpy",
    "PIL",
    "transformers",
    "datasets",
    "pyarrow",
    "pandas",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
    "sklearn",
    "scipy",
    "pytest",
    "_pytest",
    "pluggy",
    "accelerate",
    "fsspec",
    "tqdm",
    "yaml",
    "filelock",
    "requests",
}


def serve(libraries: list[str]) -> None:
    import importlib

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for name in libraries:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a library that does not import here is imported by the run itself
            pass
    replies.write("ready\n")
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.setsid()
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            code = 3
            try:
                import pytest

                code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *request["tests"]]))
                import atexit

                atexit._run_exitfuncs()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        status = "timeout"
        while time.perf_counter() - started < request["timeout"]:
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                status = "passed" if os.waitstatus_to_exitcode(wait_status) == 0 else "failed"
                break
            time.sleep(0.05)
        _stop_group(pid)
        if status == "timeout":
            os.waitpid(pid, 0)
        replies.write(json.dumps({"status": status, "seconds": time.perf_counter() - started}) + "\n")


class TestServer:
    def __init__(self, copy: Path, libraries: list[str]):
        self.copy = copy
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", json.dumps(libraries)],
            cwd=copy,
            env=test_env(copy),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the test server did not start")

    def run(self, tests: list[str], timeout: float) -> tuple[str, float]:
        self.process.stdin.write(
            json.dumps({"tests": tests, "timeout": timeout, "log": str(self.copy / "mutate-tests.log")}) + "\n"
        )
        reply = json.loads(self.process.stdout.readline())
        return reply["status"], reply["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# --- Mutants judged equivalent -------------------------------------------------------------------------------

EQUIVALENTS = REPO / "tests" / "mutation_equivalents.txt"


def mutant_key(mutant: Mutant) -> tuple[str, str, str, int]:
    return (mutant.module, mutant.change, mutant.occurrence, mutant.text)


def read_equivalents(path: Path = EQUIVALENTS) -> dict[tuple, str]:
    """`module | change | occurrence | reason | mutated line's text`, one a line; # starts a comment."""
    found = {}
    for number, line in enumerate(path.read_text().splitlines(), 1) if path.exists() else []:
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split(" | ", 4)
        if len(fields) != 5 or not fields[2].strip().isdigit():
            raise SystemExit(f"{path.name}:{number}: expected 'module | change | occurrence | reason | line text'")
        module, change, occurrence, reason, text = (f.strip() for f in fields)
        found[(module, change, int(occurrence), text)] = reason
    return found


def equivalent_entry(mutant: Mutant) -> str:
    return f"{mutant.module} | {mutant.change} | {mutant.occurrence} | <why no user can tell> | {mutant.text}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--module",
        action="append",
        choices=[m.removesuffix(".py").replace("tools/", "") for m in TARGETS],
        help="only this module (repeatable)",
    )
    parser.add_argument("--sample", type=int, default=None, help="at most this many mutants per module")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every mutant's outcome here")
    parser.add_argument(
        "--retry",
        type=Path,
        default=None,
        help="a --json file of an earlier run: its killed mutants count as killed again without running"
        " (after tests were only added), the others run",
    )
    parser.add_argument(
        "--run-equivalents",
        action="store_true",
        help="run the mutants listed in tests/mutation_equivalents.txt too, to confirm they survive",
    )
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(json.loads(args.serve))
        return 0
    chosen = [m for m in TARGETS if not args.module or m.removesuffix(".py").replace("tools/", "") in args.module]
    equivalents = read_equivalents()
    started = time.perf_counter()
    killed_before = set()
    if args.retry:
        ordinal: dict = {}
        for row in json.loads(args.retry.read_text()):
            at = (row["module"], row["line"], row["change"])
            ordinal[at] = ordinal.get(at, -1) + 1
            if row["killed"]:
                killed_before.add((*at, ordinal[at]))

    outcomes = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        copy = copy_repository(Path(tmp) / "repo")
        files = list(dict.fromkeys(f for module in chosen for f in TARGETS[module]))
        status, info, seconds = measure_coverage(copy, files, Path(tmp))
        if status != "passed":
            output = (copy / "mutate-tests.log").read_text(errors="replace").strip().splitlines()
            print(f"the tests fail without any mutant ({' '.join(files)}):", *output[-15:], sep="\n  ")
            return 1
        print(f"{' '.join(files)}: {len(info['durations'])} tests, {seconds:.0f} s under coverage", flush=True)
        server = TestServer(copy, info["libraries"])
        try:
            for module in chosen:
                tests = TARGETS[module]
                target = copy / "bridgetower_bench" / module
                original = target.read_text()
                cov = coverage_of(Path(tmp), target, info["durations"])
                everything = [
                    n for n in sorted(info["durations"], key=info["durations"].get) if n.split("::")[0] in tests
                ]
                status, baseline = server.run(everything, timeout=3600)
                if status != "passed":
                    output = (copy / "mutate-tests.log").read_text(errors="replace").strip().splitlines()
                    print(
                        f"{module}: its tests fail in a forked run without any mutant; skipped:",
                        *output[-15:],
                        sep="\n  ",
                    )
                    continue
                mutants = mutants_of(module)
                if args.sample is not None and len(mutants) > args.sample:
                    mutants = sorted(random.Random(args.seed).sample(mutants, args.sample), key=lambda m: m.index)
                print(
                    f"{module}: {len(mutants)} mutants, its {len(everything)} tests take {baseline:.0f} s", flush=True
                )
                ordinal = {}
                for mutant in mutants:
                    selected = select_tests(mutant, cov, tests)
                    reason = equivalents.pop(mutant_key(mutant), None)
                    at = (module, mutant.line, mutant.change)
                    ordinal[at] = ordinal.get(at, -1) + 1
                    if (*at, ordinal[at]) in killed_before:
                        status, seconds = "killed earlier", 0.0
                    elif reason and not args.run_equivalents:
                        status, seconds = "equivalent, not run", 0.0
                    elif selected is None:
                        status, seconds = "not covered", 0.0
                    else:
                        target.write_text(mutated_source(mutant))
                        limit = 60 + 3 * sum(info["durations"][n] for n in selected)
                        status, seconds = server.run(selected, timeout=limit)
                        if status == "timeout":  # confirmed in a fresh process: a fork must not kill a mutant
                            status, more = run_tests(copy, selected, timeout=limit + 30)
                            seconds += more
                        target.write_text(original)
                    killed = status in ("failed", "timeout", "killed earlier")
                    outcomes.append(
                        {
                            "module": module,
                            "line": mutant.line,
                            "change": mutant.change,
                            "occurrence": mutant.occurrence,
                            "text": mutant.text,
                            "status": status,
                            "killed": killed,
                            "equivalent": reason if not killed else None,
                            "tests": len(selected or []),
                            "seconds": round(seconds, 1),
                        }
                    )
                    if args.json:  # as it goes: a run stopped early keeps what it found
                        args.json.write_text(json.dumps(outcomes, indent=1) + "\n")
                    if killed and reason:
                        print(
                            f"  killed although listed as equivalent: bridgetower_bench/{module}:{mutant.line} {mutant.change}"
                        )
                    elif not killed and reason:
                        print(
                            f"  equivalent: bridgetower_bench/{module}:{mutant.line} {mutant.change} ({reason})",
                            flush=True,
                        )
                    elif not killed:
                        print(
                            f"  survived ({status}): bridgetower_bench/{module}:{mutant.line} {mutant.change}\n"
                            f"    {equivalent_entry(mutant)}",
                            flush=True,
                        )
        finally:
            server.close()

    stale = [key for key in equivalents if key[0] in chosen and args.sample is None]
    for key in stale:
        print(f"listed as equivalent but no such mutant: {' | '.join(map(str, key))}")
    print("\n| module | mutants | equivalent | killed | score |\n|---|---|---|---|---|")
    for module in chosen:
        rows = [o for o in outcomes if o["module"] == module]
        if rows:
            killed, equivalent = sum(o["killed"] for o in rows), sum(bool(o["equivalent"]) for o in rows)
            print(
                f"| {module} | {len(rows)} | {equivalent} | {killed} | {100 * killed / max(1, len(rows) - equivalent):.0f} % |"
            )
    total, killed = len(outcomes), sum(o["killed"] for o in outcomes)
    equivalent = sum(bool(o["equivalent"]) for o in outcomes)
    if total:
        print(f"| all | {total} | {equivalent} | {killed} | {100 * killed / max(1, total - equivalent):.0f} % |")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

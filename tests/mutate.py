"""Mutation testing: put one small bug at a time into the modules users' results depend on, run their tests,
and count the bugs the tests catch. Not part of `make test` (it runs the tests once per mutant).

    python tests/mutate.py                          # every module below (slow: tens of minutes)
    python tests/mutate.py --module throughput      # one module
    python tests/mutate.py --sample 20 --seed 1     # at most 20 mutants per module, drawn with the seed

Each mutant is one change of one operator or constant, found by walking the module's syntax tree:
comparisons (`<` / `<=`, `==` / `!=`, `in` / `not in`, `is` / `is not`), arithmetic (`+` / `-`, `*` / `/`),
`and` / `or`, a dropped `not`, an integer constant plus one, `True` / `False` swapped. It is written into a
copy of the repository (the working tree is never touched), and the module's test files run there with
`-x`; a failing run kills the mutant, a run past the time limit counts as killed too (an infinite loop is
caught). Survivors are listed with their line: read each, and either add a test that catches it or judge it
equivalent (no behaviour a user could see changes). The score printed is killed / all mutants; the README
quotes it with the survivors judged.
"""

from __future__ import annotations

import argparse
import ast
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
}

_COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                  ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}
_BOOLOP_SWAPS = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int  # the index-th mutation site of the module, in tree-walk order
    line: int
    change: str


def _sites(tree: ast.AST):
    """(node, description, apply) for every place one mutation can go, in a fixed order."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE_SWAPS:
                    new = _COMPARE_SWAPS[type(op)]
                    yield node, f"{type(op).__name__} -> {new.__name__}", (lambda n=node, i=i, new=new: n.ops.__setitem__(i, new()))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
            new = _BINOP_SWAPS[type(node.op)]
            yield node, f"{type(node.op).__name__} -> {new.__name__}", (lambda n=node, new=new: setattr(n, "op", new()))
        elif isinstance(node, ast.BoolOp):
            new = _BOOLOP_SWAPS[type(node.op)]
            yield node, f"{type(node.op).__name__} -> {new.__name__}", (lambda n=node, new=new: setattr(n, "op", new()))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "not x -> x", (lambda n=node: (setattr(n, "op", ast.UAdd()), setattr(n, "operand", ast.Call(
                ast.Name("bool", ast.Load()), [n.operand], []))))
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            if isinstance(node.value, bool):
                yield node, f"{node.value} -> {not node.value}", (lambda n=node: setattr(n, "value", not n.value))
            elif isinstance(node.value, int):
                yield node, f"{node.value} -> {node.value + 1}", (lambda n=node: setattr(n, "value", n.value + 1))


def mutants_of(module: str) -> list[Mutant]:
    tree = ast.parse((REPO / "bridgetower_bench" / module).read_text())
    return [Mutant(module, i, node.lineno, change) for i, (node, change, _) in enumerate(_sites(tree))]


def mutated_source(mutant: Mutant) -> str:
    tree = ast.parse((REPO / "bridgetower_bench" / mutant.module).read_text())
    for i, (_, _, apply) in enumerate(_sites(tree)):
        if i == mutant.index:
            apply()
            return ast.unparse(ast.fix_missing_locations(tree))
    raise IndexError(mutant)


def copy_repository(into: Path) -> Path:
    """The files the tests need, without .git, .venv and caches."""
    ignore = shutil.ignore_patterns(".git", ".venv", ".cache", "__pycache__", "bench_out", "*.egg-info", "runs", "mutants*")
    shutil.copytree(REPO, into, ignore=ignore)
    return into


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(copy),
           "BRIDGETOWER_BENCH_FIXTURES": os.environ.get("BRIDGETOWER_BENCH_FIXTURES", str(REPO / ".cache" / "fixtures"))}
    started = time.perf_counter()
    # In a session of its own: past the time limit, the scripts and loader workers the tests started are
    # stopped with pytest (killing pytest alone would leave a mutant's endless loop running in a script).
    log = open(copy / "mutate-tests.log", "w")  # the last run's output, shown when the unmutated tests fail
    tests_run = subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=copy,
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        returncode = tests_run.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        returncode = None
    try:
        os.killpg(tests_run.pid, signal.SIGKILL)  # whatever of the session is left
    except ProcessLookupError:
        pass
    tests_run.wait()
    log.close()
    seconds = time.perf_counter() - started
    if returncode is None:
        return "timeout", seconds
    return ("passed" if returncode == 0 else "failed"), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", action="append", choices=[m.removesuffix(".py").replace("tools/", "") for m in TARGETS],
                        help="only this module (repeatable)")
    parser.add_argument("--sample", type=int, default=None, help="at most this many mutants per module")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every mutant's outcome here")
    args = parser.parse_args(argv)
    chosen = [m for m in TARGETS if not args.module or m.removesuffix(".py").replace("tools/", "") in args.module]

    outcomes = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        copy = copy_repository(Path(tmp) / "repo")
        for module in chosen:
            tests = TARGETS[module]
            target = copy / "bridgetower_bench" / module
            original = target.read_text()
            status, baseline = run_tests(copy, tests, timeout=3600)
            if status != "passed":
                output = (copy / "mutate-tests.log").read_text(errors="replace").strip().splitlines()
                print(f"{module}: its tests fail without any mutant ({' '.join(tests)}); skipped:", *output[-15:], sep="\n  ")
                continue
            mutants = mutants_of(module)
            if args.sample is not None and len(mutants) > args.sample:
                mutants = sorted(random.Random(args.seed).sample(mutants, args.sample), key=lambda m: m.index)
            print(f"{module}: {len(mutants)} mutants, tests take {baseline:.0f} s", flush=True)
            for mutant in mutants:
                target.write_text(mutated_source(mutant))
                status, seconds = run_tests(copy, tests, timeout=max(60.0, 3 * baseline))
                target.write_text(original)
                killed = status in ("failed", "timeout")
                outcomes.append({"module": module, "line": mutant.line, "change": mutant.change, "status": status,
                                 "killed": killed, "seconds": round(seconds, 1)})
                if not killed:
                    print(f"  survived: bridgetower_bench/{module}:{mutant.line} {mutant.change}", flush=True)

    print("\n| module | mutants | killed | score |\n|---|---|---|---|")
    for module in chosen:
        rows = [o for o in outcomes if o["module"] == module]
        if rows:
            killed = sum(o["killed"] for o in rows)
            print(f"| {module} | {len(rows)} | {killed} | {100 * killed / len(rows):.0f} % |")
    total, killed = len(outcomes), sum(o["killed"] for o in outcomes)
    if total:
        print(f"| all | {total} | {killed} | {100 * killed / total:.0f} % |")
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

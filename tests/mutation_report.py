"""The report `make mutate` prints after `mutmut run`: per module of the runtime package, the mutants mutmut made,
how many the tests killed, how many survived, and how many of the survivors are recorded equivalents. Every other
survivor is printed with its diff and a ready entry for `tests/mutation_equivalents.txt`.

    python tests/mutation_report.py                      # every module that has results in mutants/
    python tests/mutation_report.py measurement.throughput images.images    # these modules only (names as in `make mutate MODULES=`)

A recorded equivalent matches a surviving mutant by its module and the text of the lines the mutant's diff removes
and adds (stripped), not by mutmut's mutant number, which changes whenever the function does. Exit status 1 when
a survivor is left that no entry explains, 0 otherwise. The results come from mutmut's files under `mutants/`
(one `.meta` file per module: mutant name -> exit code) and its diff of each survivor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mutmut.stats import status_by_exit_code


REPO = Path(__file__).resolve().parent.parent
PACKAGE = "bridgetower_bench"
EQUIVALENTS = Path(__file__).resolve().parent / "mutation_equivalents.txt"

# mutmut's own reading of its exit codes, counted here as: killed (a test failed, or the tests ran past the time
# limit), survived (every test the mutant's function reached passed), no tests (none reached it), not checked
REPORTED = {
    "killed": "killed",
    "timeout": "killed",
    "survived": "survived",
    "no tests": "no tests",
    "not checked": "not checked",
}


@dataclass(frozen=True)
class Equivalent:
    module: str
    removed: tuple[str, ...]
    added: tuple[str, ...]
    reason: str
    line: int  # in the equivalents file

    def entry(self) -> str:
        changed = [f"- {text}" for text in self.removed] + [f"+ {text}" for text in self.added]
        return "\n".join([self.module, *changed, f"reason: {self.reason}"])


@dataclass
class Mutant:
    name: str
    module: str
    source: str  # the mutated file, relative to the repository
    exit_code: int | None

    @property
    def status(self) -> str:
        # other: skipped, suspicious, interrupted, segfault (mutmut's own `mutmut results` names which)
        return REPORTED.get(status_by_exit_code[self.exit_code], "other")


def read_equivalents(path: Path = EQUIVALENTS) -> list[Equivalent]:
    """Blocks separated by blank lines: a module, the lines a mutant removes (`- `) and adds (`+ `), `reason: ...`."""
    entries, block = [], []
    for number, raw in enumerate([*path.read_text().splitlines(), ""], start=1):
        line = raw.rstrip()
        if line.startswith("#"):
            continue
        if line:
            block.append((number, line))
            continue
        if not block:
            continue
        first, module = block[0]
        removed = tuple(text[1:].strip() for _, text in block[1:] if text.startswith("-"))
        added = tuple(text[1:].strip() for _, text in block[1:] if text.startswith("+"))
        reasons = [text.removeprefix("reason:").strip() for _, text in block[1:] if text.startswith("reason:")]
        rest = [n for n, text in block[1:] if not text.startswith(("-", "+", "reason:"))]
        if rest or len(reasons) != 1 or not reasons[0] or not (removed or added) or " " in module:
            raise SystemExit(
                f"{path.name}:{first}: an entry is a module, its '- ' and '+ ' lines and one 'reason: ' line"
                + (f" (line {rest[0]} is none of these)" if rest else "")
            )
        entries.append(Equivalent(module, removed, added, reasons[0], first))
        block = []
    return entries


def read_results(mutants_dir: Path) -> list[Mutant]:
    """Every mutant mutmut made of the package, with its exit code (None: not run yet)."""
    mutants = []
    for meta in sorted((mutants_dir / PACKAGE).rglob("*.py.meta")):
        source = meta.relative_to(mutants_dir).as_posix().removesuffix(".meta")
        module = source.removeprefix(PACKAGE + "/").removesuffix(".py").replace("/", ".")
        for name, exit_code in json.loads(meta.read_text())["exit_code_by_key"].items():
            mutants.append(Mutant(name, module, source, exit_code))
    return mutants


def changed_lines(diff: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The stripped text of the lines a unified diff removes and adds (file headers left out)."""
    lines = diff.splitlines()
    removed = tuple(line[1:].strip() for line in lines if line.startswith("-") and not line.startswith("---"))
    added = tuple(line[1:].strip() for line in lines if line.startswith("+") and not line.startswith("+++"))
    return removed, added


def mutmut_diff(mutant: Mutant) -> str:
    """mutmut's diff of one mutant (what `mutmut show NAME` prints), read from mutants/ of the repository."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    return get_diff_for_mutant(mutant.name, path=mutant.source)


def report(
    mutants: list[Mutant],
    equivalents: list[Equivalent],
    modules: list[str],
    diff_of: Callable[[Mutant], str],
    out=sys.stdout,
) -> int:
    """Prints the table and the unexplained survivors; returns the exit status."""
    if modules:
        unknown = sorted(set(modules) - {m.module for m in mutants})
        if unknown:
            print(f"no mutmut results for: {' '.join(unknown)} (run `make mutate MODULES=...` first)", file=out)
            return 2
        chosen = [m for m in mutants if m.module in modules]
    else:  # the modules mutmut has checked at least one mutant of
        checked = {m.module for m in mutants if m.exit_code is not None}
        chosen = [m for m in mutants if m.module in checked]
    by_change = {(e.module, e.removed, e.added): e for e in equivalents}
    with_entries = {e.module for e in equivalents}
    matched: dict[Equivalent, list[Mutant]] = {}
    unexplained: list[tuple[Mutant, str]] = []
    rows: dict[str, dict[str, int]] = {}
    for mutant in chosen:
        row = rows.setdefault(
            mutant.module,
            dict.fromkeys(["mutants", "killed", "survived", "equivalent", "no tests", "not checked", "other"], 0),
        )
        row["mutants"] += 1
        status = mutant.status
        row[status] += 1
        if mutant.exit_code is None:
            continue
        # a killed mutant's diff only to tell whether an entry is stale, and only where the module has entries
        if status in ("survived", "no tests") or (status == "killed" and mutant.module in with_entries):
            diff = diff_of(mutant)
            entry = by_change.get((mutant.module, *changed_lines(diff)))
            if entry is not None:
                matched.setdefault(entry, []).append(mutant)
            if status == "killed":
                continue
            if entry is not None:
                row["equivalent"] += 1
            else:
                unexplained.append((mutant, diff))

    columns = ["mutants", "killed", "survived", "equivalent", "no tests", "not checked", "other"]
    print(f"\n| module | {' | '.join(columns)} | score |", file=out)
    print("|---" * (len(columns) + 2) + "|", file=out)
    totals = dict.fromkeys(columns, 0)
    for module in sorted(rows):
        print(_row(module, rows[module], columns), file=out)
        for column in columns:
            totals[column] += rows[module][column]
    if len(rows) > 1:
        print(_row("all", totals, columns), file=out)
    print(
        "(survived and no tests include the equivalents; score: killed / (mutants - equivalent - not checked))",
        file=out,
    )

    for entry, killers in matched.items():
        killed = [m.name for m in killers if m.status == "killed"]
        if killed:
            print(f"\nkilled although recorded as equivalent (line {entry.line}): {', '.join(killed)}", file=out)
    reported = set(rows)
    for entry in equivalents:
        if entry.module in reported and entry not in matched and not rows[entry.module]["not checked"]:
            print(f"\nrecorded as equivalent, but no mutant makes this change (line {entry.line}):", file=out)
            print(entry.entry(), file=out)

    for mutant, diff in unexplained:
        removed, added = changed_lines(diff)
        ready = Equivalent(mutant.module, removed, added, "WHY NO USER CAN TELL THE DIFFERENCE", 0)
        print(f"\n{mutant.status}: {mutant.name}\n{diff}\n  as an equivalent, if it is one:", file=out)
        print("\n".join("    " + line for line in ready.entry().splitlines()), file=out)
    if unexplained:
        print(
            f"\n{len(unexplained)} survivor(s) left: write a test that catches each, or, when no behaviour a user"
            f" could observe changes, record it in {EQUIVALENTS.relative_to(REPO)} with the reason",
            file=out,
        )
        return 1
    return 0


def _row(module: str, row: dict[str, int], columns: list[str]) -> str:
    scored = row["mutants"] - row["equivalent"] - row["not checked"]
    score = f"{100 * row['killed'] / scored:.1f} %" if scored else "-"
    return f"| {module} | {' | '.join(str(row[c]) for c in columns)} | {score} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="modules of the package, as in `make mutate MODULES=...`")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # mutmut reads its results relative to the repository
    mutants = read_results(REPO / "mutants")
    if not mutants:
        print("no mutmut results under mutants/: run `make mutate` first", file=sys.stderr)
        return 2
    return report(mutants, read_equivalents(), args.modules, mutmut_diff)


if __name__ == "__main__":
    sys.exit(main())

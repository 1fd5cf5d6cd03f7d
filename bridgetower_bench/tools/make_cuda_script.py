"""Generate run_bridgetower_cuda.py from run_bridgetower.py and the numbered patches in patches/.

    python -m bridgetower_bench.tools.make_cuda_script             # (re)write run_bridgetower_cuda.py
    python -m bridgetower_bench.tools.make_cuda_script --check     # exit 1 if the committed file differs
    python -m bridgetower_bench.tools.make_cuda_script --refresh   # rewrite patches whose hunks moved
    python -m bridgetower_bench.tools.make_cuda_script --format    # ruff on every stage, the patches re-expressed

The patches are ordinary unified diffs, applied in file-name order with `patch --fuzz=0` (GNU patch),
each to the output of the previous one, starting from the Gaudi script. Every hunk must apply exactly
where its line numbers say: a hunk that needs fuzz or lands at an offset stops the tool (exit 1, naming
the patch), since such a hunk can land in the wrong place without a word. After an edit of the Gaudi
script moved lines, `--refresh` rewrites each moved patch as the diff between consecutive stages (read
the rewritten patches before committing them). `--format` (`make format`) runs ruff's fixes and formatter
on every stage, the Gaudi script first, and rewrites each patch as the diff between consecutive formatted
stages: formatting the two scripts alone would leave the patches' context behind. To change a patch: edit
run_bridgetower_cuda.py in a scratch copy, then `diff -u` against the previous stage.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bridgetower_bench.tools.tool_paths import KIT


REPO = KIT
GAUDI_SCRIPT = "run_bridgetower.py"
CUDA_SCRIPT = "run_bridgetower_cuda.py"
# GNU patch's words for a hunk that landed away from where its header says (with --fuzz=0, a hunk that
# needs fuzz fails outright)
_MOVED = re.compile(r"^Hunk #\d+ succeeded at \d+ \(offset (-?\d+) lines?\)", re.MULTILINE)


def patch_files(repo: Path = REPO) -> list[Path]:
    return sorted((repo / "patches").glob("*.patch"))


def _apply(patch: Path, source: Path, out: Path, repo: Path) -> str:
    """Apply one patch without fuzz; patch's report, or exit 1 naming the patch when a hunk fails."""
    result = subprocess.run(
        [
            "patch",
            "--fuzz=0",
            "--forward",
            "--no-backup-if-mismatch",
            "-r",
            "-",
            "-o",
            str(out),
            str(source),
            str(patch),
        ],
        capture_output=True,
        text=True,
    )
    report = "".join(
        line for line in (result.stdout + result.stderr).splitlines(True) if not line.startswith("patching file ")
    )
    if result.returncode != 0:
        raise SystemExit(f"error: {patch.relative_to(repo)} does not apply:\n{report}")
    return report


def generate(repo: Path = REPO, refresh: bool = False) -> str:
    """The CUDA script's text: the Gaudi script with every patch applied in order, each hunk exactly in place.

    With `refresh`, a patch whose hunks only moved (offsets) is rewritten as the diff between its two stages.
    """
    if shutil.which("patch") is None:
        raise SystemExit("error: GNU `patch` is needed (apt-get install patch)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / CUDA_SCRIPT
        work.write_text((repo / GAUDI_SCRIPT).read_text())
        for patch in patch_files(repo):
            out = Path(tmp) / "next.py"
            report = _apply(patch, work, out, repo)
            moved = _MOVED.search(report)
            if moved and refresh:
                before, after = work.read_text().splitlines(True), out.read_text().splitlines(True)
                patch.write_text("".join(difflib.unified_diff(before, after, CUDA_SCRIPT, CUDA_SCRIPT)))
                print(f"refreshed {patch.relative_to(repo)}")
            elif moved:
                raise SystemExit(
                    f"error: {patch.relative_to(repo)} applies only at an offset of {moved.group(1)} lines; "
                    f"its hunks must land exactly where they say (--refresh rewrites moved patches):\n{report}"
                )
            out.replace(work)
        return work.read_text()


def stages(repo: Path = REPO) -> list[str]:
    """The Gaudi script, then its text after each patch in turn (the last one is the CUDA script)."""
    texts = [(repo / GAUDI_SCRIPT).read_text()]
    with tempfile.TemporaryDirectory() as tmp:
        work, out = Path(tmp) / CUDA_SCRIPT, Path(tmp) / "next.py"
        for patch in patch_files(repo):
            work.write_text(texts[-1])
            _apply(patch, work, out, repo)
            texts.append(out.read_text())
    return texts


def ruff(text: str, repo: Path = REPO) -> str:
    """`text` after ruff's fixes and formatter, with the repository's configuration."""
    for command in (["check", "--fix", "--quiet", "--exit-zero"], ["format", "--quiet"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "--stdin-filename", CUDA_SCRIPT, "-"],
            input=text,
            capture_output=True,
            text=True,
            cwd=repo,
        )
        if result.returncode != 0:
            raise SystemExit(f"error: ruff {command[0]} failed on a stage of {CUDA_SCRIPT}:\n{result.stderr}")
        text = result.stdout
    return text


def format_stages(repo: Path = REPO) -> None:
    """Format every stage; write the Gaudi script, each patch between consecutive stages (`diff -u`, as the
    patches are written by hand), and the CUDA script."""
    formatted = [ruff(text, repo) for text in stages(repo)]
    with tempfile.TemporaryDirectory() as tmp:
        before, after = Path(tmp) / "before.py", Path(tmp) / "after.py"
        for patch, old, new in zip(patch_files(repo), formatted, formatted[1:]):
            before.write_text(old)
            after.write_text(new)
            labels = ["--label", CUDA_SCRIPT, "--label", CUDA_SCRIPT]
            diff = subprocess.run(["diff", "-u", *labels, str(before), str(after)], capture_output=True, text=True)
            if diff.returncode > 1:
                raise SystemExit(f"error: diff failed for {patch.relative_to(repo)}:\n{diff.stderr}")
            patch.write_text(diff.stdout)
    (repo / GAUDI_SCRIPT).write_text(formatted[0])
    (repo / CUDA_SCRIPT).write_text(formatted[-1])


def main(argv=None, repo: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if run_bridgetower_cuda.py is out of date")
    mode.add_argument("--refresh", action="store_true", help="rewrite the patches whose hunks moved, then the script")
    mode.add_argument(
        "--format", action="store_true", help="ruff on the Gaudi script and every stage; patches rewritten"
    )
    args = parser.parse_args(argv)
    if args.format:
        format_stages(repo)
        print(f"formatted {GAUDI_SCRIPT}, {len(patch_files(repo))} patches and {CUDA_SCRIPT}")
        return 0
    expected = generate(repo, refresh=args.refresh)
    target = repo / CUDA_SCRIPT
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != expected:
            sys.stdout.writelines(
                difflib.unified_diff(
                    current.splitlines(True),
                    expected.splitlines(True),
                    f"{CUDA_SCRIPT} (committed)",
                    f"{CUDA_SCRIPT} (generated)",
                )
            )
            print(
                f"\n{CUDA_SCRIPT} differs from {GAUDI_SCRIPT} + patches/: run python -m bridgetower_bench.tools.make_cuda_script"
            )
            return 1
        print(f"{CUDA_SCRIPT} equals {GAUDI_SCRIPT} + {len(patch_files(repo))} patches")
        return 0
    target.write_text(expected)
    print(f"wrote {target} from {GAUDI_SCRIPT} + {len(patch_files(repo))} patches")
    return 0


if __name__ == "__main__":
    sys.exit(main())

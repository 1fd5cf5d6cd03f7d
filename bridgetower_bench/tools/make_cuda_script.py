"""Generate run_bridgetower_cuda.py from run_bridgetower.py and the numbered patches in patches/.

    python -m bridgetower_bench.tools.make_cuda_script           # (re)write run_bridgetower_cuda.py
    python -m bridgetower_bench.tools.make_cuda_script --check   # exit 1 if the committed file differs

The patches are ordinary unified diffs, applied in file-name order with `patch` (GNU patch),
each to the output of the previous one, starting from the Gaudi script. To change a patch:
edit run_bridgetower_cuda.py in a scratch copy, then `diff -u` against the previous stage.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GAUDI_SCRIPT = "run_bridgetower.py"
CUDA_SCRIPT = "run_bridgetower_cuda.py"


def patch_files(repo: Path = REPO) -> list[Path]:
    return sorted((repo / "patches").glob("*.patch"))


def generate(repo: Path = REPO) -> str:
    """The CUDA script's text: the Gaudi script with every patch applied in order."""
    if shutil.which("patch") is None:
        raise SystemExit("error: GNU `patch` is needed (apt-get install patch)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / CUDA_SCRIPT
        work.write_text((repo / GAUDI_SCRIPT).read_text())
        for patch in patch_files(repo):
            out = Path(tmp) / "next.py"
            result = subprocess.run(
                ["patch", "--quiet", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "-r", "-", "-o", str(out), str(work), str(patch)],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise SystemExit(f"error: {patch.relative_to(repo)} does not apply:\n{result.stdout}{result.stderr}")
            out.replace(work)
        return work.read_text()


def main(argv=None, repo: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if run_bridgetower_cuda.py is out of date")
    args = parser.parse_args(argv)
    expected = generate(repo)
    target = repo / CUDA_SCRIPT
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != expected:
            sys.stdout.writelines(
                difflib.unified_diff(current.splitlines(True), expected.splitlines(True), f"{CUDA_SCRIPT} (committed)", f"{CUDA_SCRIPT} (generated)")
            )
            print(f"\n{CUDA_SCRIPT} differs from {GAUDI_SCRIPT} + patches/: run python -m bridgetower_bench.tools.make_cuda_script")
            return 1
        print(f"{CUDA_SCRIPT} equals {GAUDI_SCRIPT} + {len(patch_files(repo))} patches")
        return 0
    target.write_text(expected)
    print(f"wrote {target} from {GAUDI_SCRIPT} + {len(patch_files(repo))} patches")
    return 0


if __name__ == "__main__":
    sys.exit(main())

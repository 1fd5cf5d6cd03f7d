"""The drift check between the Gaudi script, the patches and the committed CUDA script fails when they disagree."""

import difflib
import re
import shutil

import pytest

from bridgetower_bench.tools import make_cuda_script
from helpers import REPO


@pytest.fixture
def copy(tmp_path):
    for name in ("run_bridgetower.py", "run_bridgetower_cuda.py"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "patches", tmp_path / "patches")
    return tmp_path


def edit(path, old, new):
    """Replace the first `old` in the file at path with `new`."""
    text = path.read_text()
    assert old in text, f"{path.name} no longer holds {old!r}"
    path.write_text(text.replace(old, new, 1))


def test_the_committed_cuda_script_is_the_generated_one_and_a_hand_edit_fails_the_check_with_the_diff(copy, capsys):
    assert make_cuda_script.main(["--check"], repo=copy) == 0, "the committed script is not the generated one"
    edit(copy / "run_bridgetower_cuda.py", "set_seed(training_args.seed)", "set_seed(training_args.seed + 1)")
    assert make_cuda_script.main(["--check"], repo=copy) == 1
    printed = capsys.readouterr().out.splitlines()
    assert "-    set_seed(training_args.seed + 1)" in printed and "+    set_seed(training_args.seed)" in printed


def test_a_gaudi_change_the_cuda_script_lacks_fails_the_check_and_regenerating_mends_it(copy, capsys):
    edit(copy / "run_bridgetower.py", "# 2. Logging.", "# 2. Logging (changed on the Gaudi side).")
    assert make_cuda_script.main(["--check"], repo=copy) == 1
    assert make_cuda_script.main([], repo=copy) == 0
    assert "# 2. Logging (changed on the Gaudi side)." in (copy / "run_bridgetower_cuda.py").read_text()
    assert make_cuda_script.main(["--check"], repo=copy) == 0


def test_a_patch_that_no_longer_applies_is_named_with_the_hunks_that_failed(copy):
    imports = "from optimum.habana import GaudiConfig, GaudiTrainer, GaudiTrainingArguments"
    edit(
        copy / "run_bridgetower.py", imports, imports.replace("GaudiConfig, GaudiTrainer", "GaudiTrainer, GaudiConfig")
    )
    with pytest.raises(SystemExit, match="patches/01-trainer-classes.patch does not apply") as stopped:
        make_cuda_script.main(["--check"], repo=copy)
    # patch's own words, as text on a line of their own
    assert re.search(r"^\d+ out of \d+ hunks? FAILED$", str(stopped.value), re.MULTILINE), str(stopped.value)


def test_the_check_without_a_repository_argument_checks_this_repository(capsys):
    # What `python -m bridgetower_bench.tools.make_cuda_script --check` does: it reads nothing outside this checkout.
    assert make_cuda_script.REPO == REPO
    assert make_cuda_script.main(["--check"]) == 0
    assert "run_bridgetower_cuda.py equals run_bridgetower.py + " in capsys.readouterr().out


def test_a_patch_whose_hunk_lands_one_line_away_is_refused_by_name(copy):
    # GNU patch would apply it "at an offset"; a hunk that moves can land in the wrong place without a word.
    edit(copy / "patches" / "05-compile-layers.patch", "@@ -29,6 +29,7 @@", "@@ -30,6 +30,7 @@")
    with pytest.raises(SystemExit, match=r"patches/05-compile-layers.patch applies only at an offset of -1 lines"):
        make_cuda_script.main(["--check"], repo=copy)


def test_a_patch_that_needs_fuzz_is_refused_by_name(copy):
    # One context line no longer matches: patch's default fuzz would still apply the hunk, --fuzz=0 does not.
    patch, context = copy / "patches" / "05-compile-layers.patch", " from bridgetower_bench.{} import"
    edit(patch, context.format("images.device_decode"), context.format("device_decode_elsewhere"))
    with pytest.raises(SystemExit, match="patches/05-compile-layers.patch does not apply"):
        make_cuda_script.main(["--check"], repo=copy)


def test_refresh_rewrites_the_patches_a_gaudi_edit_moved_and_the_check_passes_again(copy, capsys):
    edit(copy / "run_bridgetower.py", "# 2. Logging.", "# 2. Logging.\n# (a line added on the Gaudi side)")
    with pytest.raises(SystemExit, match="applies only at an offset of 1 lines"):
        make_cuda_script.main(["--check"], repo=copy)

    assert make_cuda_script.main(["--refresh"], repo=copy) == 0
    assert "refreshed patches/" in capsys.readouterr().out
    assert make_cuda_script.main(["--check"], repo=copy) == 0
    assert "# (a line added on the Gaudi side)" in (copy / "run_bridgetower_cuda.py").read_text()


def test_a_further_numbered_patch_is_applied_after_the_others(copy, capsys):
    cuda = copy / "run_bridgetower_cuda.py"
    before = cuda.read_text()
    after = before.replace("# 2. Logging.", "# 2. Logging (a further patch).", 1)
    count = len(list((copy / "patches").glob("*.patch"))) + 1
    (copy / "patches" / "99-further.patch").write_text(
        "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), cuda.name, cuda.name))
    )

    assert make_cuda_script.main(["--check"], repo=copy) == 1
    assert make_cuda_script.main([], repo=copy) == 0
    assert f"+ {count} patches" in capsys.readouterr().out
    assert cuda.read_text() == after


def test_format_runs_ruff_on_every_stage_and_rewrites_the_patches_to_match(copy):
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")  # ruff's configuration
    files = [
        copy / "run_bridgetower.py",
        copy / "run_bridgetower_cuda.py",
        *sorted((copy / "patches").glob("*.patch")),
    ]
    tidy = {path: path.read_text() for path in files}
    gaudi = copy / "run_bridgetower.py"
    untidy = tidy[gaudi].replace("import logging\nimport os\n", "import os\nimport logging\n", 1)
    untidy = untidy.replace("    set_seed(training_args.seed)\n", "    set_seed( training_args.seed )\n", 1)
    assert untidy.count("set_seed( training_args.seed )") == 1 and "import os\nimport logging\n" in untidy
    gaudi.write_text(untidy)
    assert make_cuda_script.main(["--check"], repo=copy) == 1  # the generated script no longer matches

    assert make_cuda_script.main(["--format"], repo=copy) == 0
    assert {path: path.read_text() for path in files} == tidy  # every stage formatted: the committed files again
    assert make_cuda_script.main(["--check"], repo=copy) == 0

"""The NVIDIA install routes agree: the same torch / torchvision pair and common requirements, each CUDA 12 build from
the index its label names, every requirements file the README names exists, and the driver the README states for each
route is the one the CUDA script's refusal checks. The current route (today's transformers line) differs from the
pinned one in the Hugging Face libraries only, and the published command, --overwrite_output_dir included, means the
same on whichever route runs these tests (`make test` runs the both_routes tests on each)."""

import os
import re
import subprocess

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from bridgetower_bench.arguments import WarmupTrainingArguments, parse_arguments
from bridgetower_bench.guards import cuda_device
from bridgetower_bench.tools.sweep import presets as sweep_presets
from bridgetower_bench.user_errors import UserInputError
from helpers import BOTH_ROUTES, REPO, run_script


ROUTES = {"requirements-cuda.txt": None, "requirements-cuda12.txt": "cu126"}  # file -> CUDA label of its torch build


def read(name):
    """(-r includes, index options, {package: Requirement}) of one requirements file."""
    includes, indexes, pins = [], [], {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            includes.append(line[3:].strip())
        elif line.startswith("--"):
            indexes.append(line)
        else:
            requirement = Requirement(line)
            pins[requirement.name] = requirement
    return includes, indexes, pins


def exact(requirement):
    (spec,) = requirement.specifier
    assert spec.operator == "==", requirement
    return Version(spec.version)


def test_every_route_pins_the_same_torch_and_torchvision_on_the_common_requirements_and_the_readme_names_it():
    pairs = {}
    for name, label in ROUTES.items():
        includes, indexes, pins = read(name)
        assert includes == ["requirements.txt"], name
        # everything else comes from the common file, but for NVML's bindings (the energy counter), on both routes
        assert set(pins) == {"torch", "torchvision", "nvidia-ml-py"}, name
        assert str(pins["nvidia-ml-py"]) == str(read("requirements-cuda.txt")[2]["nvidia-ml-py"]), name
        torch, vision = exact(pins["torch"]), exact(pins["torchvision"])
        assert torch.local == vision.local == label, name  # both from the same build
        pairs[name] = (torch.public, vision.public)
        if label is None:
            assert indexes == [], name  # PyPI's default wheels
        else:
            assert indexes == [f"--extra-index-url https://download.pytorch.org/whl/{label}"], name
    assert len(set(pairs.values())) == 1, pairs
    common = read("requirements.txt")[2]
    assert "torch" not in common and "torchvision" not in common  # Gaudi images keep their own torch
    assert read("requirements-test.txt")[0] == ["requirements-cuda.txt", "requirements-gaudi.txt"]

    # the README names each route and its driver
    readme = (REPO / "README.md").read_text()
    named = set(re.findall(r"requirements[\w-]*\.txt", readme))
    assert set(ROUTES) <= named
    for name in named:
        assert (REPO / name).is_file(), f"README names {name}, which does not exist"
    assert cuda_device.CUDA12_REQUIREMENTS in ROUTES
    # The drivers the README states are the ones the refusal compares with.
    assert cuda_device.driver_floor("13.0") == "580" and "R580 or newer" in readme
    assert cuda_device.driver_floor("12.6") == "525.60.13" and "525.60.13" in readme
    assert cuda_device.TOOLKIT_DRIVER["13.0"] in readme


HUGGING_FACE = {"transformers", "tokenizers", "huggingface-hub", "datasets", "evaluate", "accelerate"}


def lines(name):
    """The requirement lines of one file, normalised (comments, -r and index options left out)."""
    return {str(Requirement(line)) for line in (REPO / name).read_text().splitlines() if re.match(r"[A-Za-z]", line)}


def test_the_current_route_differs_from_the_pinned_one_in_the_hugging_face_libraries_only():
    current = lines("requirements-cuda-current.txt")
    pinned = lines("requirements.txt") | lines("requirements-cuda.txt")
    differing = {canonicalize_name(Requirement(line).name) for line in current ^ pinned}
    assert {"transformers", "accelerate", "datasets"} <= differing <= HUGGING_FACE, "only transformers' stack differs"
    stack = {canonicalize_name(Requirement(line).name): Requirement(line) for line in current}
    for name in ("transformers", "accelerate", "datasets", "evaluate"):
        assert exact(stack[name]) >= exact(read("requirements.txt")[2][name]), name  # pinned, and not older
    assert "optimum-habana" not in stack  # the Gaudi script stays on the pinned route
    includes, _, test_pins = read("requirements-test-current.txt")
    assert includes == ["requirements-cuda-current.txt"]
    assert {str(r) for r in test_pins.values()} <= lines("requirements-test.txt")  # the same pytest


@BOTH_ROUTES
def test_overwrite_output_dir_warmup_ratio_and_the_flags_this_route_dropped_on_this_route(tmp_path):
    """--overwrite_output_dir is a flag, --warmup_ratio warms up alike, a dropped flag is refused naming its spelling."""
    import torch
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    parser = HfArgumentParser(WarmupTrainingArguments)
    (given,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--overwrite_output_dir"])
    (default,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert given.overwrite_output_dir is True and default.overwrite_output_dir is False, "--overwrite_output_dir"

    common = ["--output_dir", str(tmp_path), "--use_cpu", "--learning_rate", "1"]
    for flags, warm_up in ((["--warmup_ratio", "0.3"], 3), (["--warmup_ratio", "0.3", "--warmup_steps", "2"], 2)):
        (args,) = parser.parse_args_into_dataclasses(common + flags)
        trainer = Trainer(model=torch.nn.Linear(1, 1), args=args)
        trainer.create_optimizer_and_scheduler(num_training_steps=7)  # 0.3 x 7 = 2.1: 3 steps, as ceil gives
        rates = [trainer.lr_scheduler.lr_lambdas[0](step) for step in range(warm_up + 2)]
        assert rates[warm_up] == 1 > rates[warm_up - 1] and rates[warm_up + 1] < 1, flags
    with pytest.raises(UserInputError, match="--warmup_ratio=1.5: must lie between 0 and 1|warmup_ratio must lie"):
        parse_arguments(parser, ["script", *common, "--warmup_ratio", "1.5"])

    argv = ["script", "--output_dir", str(tmp_path), "--no_cuda"]
    if "no_cuda" in TrainingArguments.__dataclass_fields__:  # the pinned route still has it
        assert parse_arguments(parser, argv)[0].use_cpu
        return
    with pytest.raises(UserInputError, match=r"^--no_cuda: transformers 5\.\S+ dropped it; use --use_cpu$"):
        parse_arguments(parser, argv)
    config = tmp_path / "args.json"
    config.write_text('{"output_dir": "out", "logging_dir": "logs"}')
    with pytest.raises(UserInputError, match=r"^--logging_dir: transformers \S+ dropped it, with no counterpart$"):
        parse_arguments(parser, ["script", str(config)])


def published_command(fixtures, out):
    """The published flags as the sweep runs them (`bench --preset blog`: the README's command less the device
    flags), --overwrite_output_dir included, scaled to the tiny fixtures on the CPU."""
    args = sweep_presets.blog_preset_args()
    at = args.index("--dataset_revision")
    del args[at : at + 2]  # (a data set in a local directory has no revisions)
    scaled = {
        "--model_name_or_path": fixtures["model"],
        "--dataset_name": fixtures["dataset"],
        "--num_train_epochs": 1,
    }
    scaled |= {"--per_device_train_batch_size": 4, "--per_device_eval_batch_size": 4}
    for flag, value in scaled.items():
        args[args.index(flag) + 1] = str(value)
    assert "--overwrite_output_dir" in args
    return args + ["--output_dir", out, "--max_train_samples", "8", "--max_eval_samples", "4", "--use_cpu"]


@BOTH_ROUTES
def test_the_published_command_trains_afresh_with_overwrite_output_dir_and_reuses_the_model_without(
    fixtures, tmp_path
):
    out = tmp_path / "run"
    command = published_command(fixtures, out)
    for _ in range(2):  # the second run trains again: --overwrite_output_dir
        log = run_script("cuda", command)
        assert "***** Running training *****" in log.stdout + log.stderr
        assert "not training again" not in log.stdout + log.stderr
    reuse = run_script("cuda", [a for a in command if a != "--overwrite_output_dir"])
    assert "holds the model of this recipe, trained as far as asked: not training again" in reuse.stdout + reuse.stderr
    assert "***** Running training *****" not in reuse.stdout + reuse.stderr


def fake_python(path, answer: str):
    """An interpreter that records how it was called and fails, as one without the kit's requirements would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{answer} $*" >> "$CALLS"\nexit 1\n')
    path.chmod(0o755)


def test_the_gpu_benchmark_runs_the_kits_environment_not_a_bare_python3(tmp_path):
    # The README's NVIDIA install makes .venv without activating it; `bash scripts/h200_benchmark.sh` from the
    # repository root must use it (here a stand-in that fails at once, before any device time is spent).
    root = tmp_path / "kit"
    fake_python(root / ".venv" / "bin" / "python", "venv")
    fake_python(tmp_path / "bin" / "python3", "python3")
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    env = {"PATH": path, "CALLS": str(tmp_path / "calls"), "WHEELS": "", "HOME": str(tmp_path)}
    env |= {"OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")}
    script = str(REPO / "scripts" / "h200_benchmark.sh")
    result = subprocess.run(["bash", script], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stdout.strip().splitlines()[-1] == (
        f"preflight failed: {root}/.venv/bin/python lacks the kit's requirements (README, NVIDIA: the .venv install; "
        "or PYTHON=...)"
    )
    assert (tmp_path / "calls").read_text() == "venv -\n", "only the kit's .venv ran"

    (tmp_path / "calls").unlink()
    (root / ".venv" / "bin" / "python").unlink()  # no .venv: python3 from PATH, and the same one line
    result = subprocess.run(["bash", script], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip().splitlines()[-1].startswith("preflight failed: python3 lacks the kit's requirements")
    assert (tmp_path / "calls").read_text() == "python3 -\n"

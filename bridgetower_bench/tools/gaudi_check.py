"""First-run self-check of a Gaudi node: is the software what this kit expects, and does training run?

    PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.gaudi_check [--output_dir gaudi_check] [--json PATH] [--max_steps 5]

1. The stack, read only (nothing is ever installed): Habana's PyTorch (``habana_frameworks``) and
   the HPUs it sees; the Intel Gaudi software version (``habana-torch-plugin``, read the way
   optimum-habana reads it) against the version the installed optimum-habana was validated with;
   every package requirements.txt and requirements-gaudi.txt pin (optimum-habana, transformers,
   accelerate, ...) against its pin; torch, which comes with Habana's image and is never pinned. Where the
   Hub answers, the published command's Hub names (``tools/hub_check.py``: the data set revision, the model,
   and ``Habana/clip``'s keys against the installed ``GaudiConfig``, bf16 autocast on); offline, "not checked".
2. A few training steps on the embedded fixtures (``bridgetower_bench.tools.fixtures``: tiny
   random-weight BridgeTower, synthetic New Yorker-shaped data, local copy of the Habana/clip Gaudi
   config), each ending with a short evaluation, in lazy mode (``PT_HPU_LAZY_MODE=1``, set for every step)
   with HPU graphs for inference; a step passes only when its ``train_results.json`` says the bridge
   really ran lazy mode. One HPU with the PyTorch loader; one HPU with ``--mediapipe_dataloader``, which only passes
   when the run's ``train_results.json`` says the media pipeline really ran (not the fallback to
   the PyTorch loader); and, when 8 HPUs are visible, the 8-device launcher
   (``bridgetower_bench.tools.launch_gaudi --use_mpi``) with the PyTorch loader.

It prints one table (check or step, result, seconds, samples/s, loader and execution mode that ran,
detail: the version found or the error's last line) and writes it as JSON (``--json``, default
``<output_dir>/gaudi_check.json``) to attach to a bug report. The record holds the environment
(backend, execution mode, torch and Intel Gaudi software versions, driver, HPU name, count and
memory), versions, results and command lines with paths relative to the output directory; of the
environment variables only the one that selects the execution mode; no tokens. Each step's full output is in ``<output_dir>/<step>/log.txt``; the fixtures are built once
in ``<output_dir>/fixtures``.

Exit status: 0 when every check and step passed (version warnings allowed), 1 when one failed,
2 off Gaudi (no Habana PyTorch or no HPU visible), said in one line.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Optional

from bridgetower_bench.guards.execution_mode import LAZY, LAZY_MODE_VARIABLE
from bridgetower_bench.tools import hub_check, self_check, tool_paths
from bridgetower_bench.tools.self_check import FAILED, OK, REPO, WARNING, Row


GAUDI_SCRIPT = REPO / "run_bridgetower.py"
REQUIREMENT_FILES = ("requirements.txt", "requirements-gaudi.txt")
LAUNCHER_HPUS = 8
# Every step runs lazy mode, as upstream's CI: Habana's bridge reads this when it loads (the HPU probe runs with it too).
STEP_ENVIRONMENT = {LAZY_MODE_VARIABLE: "1"}
ENVIRONMENT_KEYS = (
    "backend",
    "execution_mode",
    "torch_compile",
    "version_torch",
    "version_cuda",
    "version_intel_gaudi",
    "driver_version",
    "device_name",
    "device_count",
    "device_memory_bytes",
)


@dataclass
class Hpus:
    count: int
    name: str
    media_pipeline: Optional[str] = None  # why --mediapipe_dataloader cannot start, None when it can
    environment: Optional[dict] = (
        None  # bridgetower_bench.measurement.run_record.environment of the first HPU, as the probe saw it
    )


@dataclass
class Step(self_check.Step):
    """A Gaudi step: lazy mode asked for, with the variable that selects it."""

    expected_mode: str = LAZY  # (--use_lazy_mode with PT_HPU_LAZY_MODE=1)
    env: dict = field(default_factory=lambda: dict(STEP_ENVIRONMENT))


def probe_hpus() -> Hpus | str:
    """The visible HPUs, or why this is not a Gaudi node (one line), asked in a child process."""
    answer = self_check.ask_child(
        "bridgetower_bench.tools.gaudi_check:hpus_here", "HPU", env=dict(os.environ, **STEP_ENVIRONMENT)
    )
    return answer if isinstance(answer, str) else Hpus(**answer)


def hpus_here() -> dict | str:
    """What ``probe_hpus`` reports, found in this process: HPU count and kind, media pipeline, or why not."""
    try:
        import habana_frameworks.torch.hpu as hpu
    except ModuleNotFoundError:
        return "habana_frameworks is not installed (run this inside Habana's PyTorch container on a Gaudi node)"
    except Exception as error:  # e.g. a missing native library
        return f"habana_frameworks cannot be imported: {type(error).__name__}: {error}"
    try:
        if not hpu.is_available():
            return "no HPU is visible"
        count, name = int(hpu.device_count()), str(hpu.get_device_name())
    except Exception as error:  # the Habana runtime raises assorted types when no device is usable
        return f"cannot query the HPUs: {type(error).__name__}: {error}"
    from bridgetower_bench.measurement.run_record import environment
    from bridgetower_bench.mediapipe.availability import mediapipe_unavailable_reason

    try:
        import torch

        found = environment(torch.device("hpu"))
    except Exception as error:  # the record's fields are a report, never a reason to stop
        found = {"error": f"{type(error).__name__}: {error}"}
    return {"count": count, "name": name, "media_pipeline": mediapipe_unavailable_reason(), "environment": found}


# ----------------------------------------------------------------------------------------
# 1. The stack
# ----------------------------------------------------------------------------------------


def major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def compare_gaudi_software(found: Optional[str], validated: str, optimum_habana: str) -> Row:
    """The Intel Gaudi software version against the one optimum-habana was validated with (major.minor)."""
    name = "Intel Gaudi software"
    if not found:
        return Row(
            name,
            WARNING,
            f"habana-torch-plugin not found by `pip list`; optimum-habana {optimum_habana} was validated with {validated}",
        )
    if major_minor(found) != major_minor(validated):
        return Row(
            name,
            WARNING,
            f"{found}, but optimum-habana {optimum_habana} was validated with {validated}: expect surprises",
        )
    return Row(name, OK, f"{found} (optimum-habana {optimum_habana} validated with {validated})")


def gaudi_software_row() -> Row:
    try:
        from optimum.habana.utils import misc  # importing optimum.habana runs its own version check
        from optimum.habana.version import __version__ as optimum_habana
    except Exception as error:
        return Row(
            "Intel Gaudi software", FAILED, f"optimum-habana cannot be imported: {type(error).__name__}: {error}"
        )
    try:
        found = str(misc.get_habana_frameworks_version())
    except Exception:  # no habana-torch-plugin line in `pip list`
        found = None
    return compare_gaudi_software(found, str(misc.CURRENTLY_VALIDATED_SYNAPSE_VERSION), optimum_habana)


def driver_row() -> Row:
    """The Gaudi driver's version as `hl-smi` reports it (optimum-habana compares it the same way)."""
    try:
        from optimum.habana.utils import misc

        driver = misc.get_driver_version()
        validated = str(misc.CURRENTLY_VALIDATED_SYNAPSE_VERSION)
    except Exception as error:
        return Row("Gaudi driver", WARNING, f"cannot be read: {type(error).__name__}: {error}")
    if driver is None:
        return Row("Gaudi driver", WARNING, "`hl-smi` did not run: the driver version is unknown")
    if major_minor(str(driver)) != major_minor(validated):
        return Row("Gaudi driver", WARNING, f"{driver}, but the Intel Gaudi software {validated} is the validated one")
    return Row("Gaudi driver", OK, str(driver))


def stack_rows(hpus: Hpus) -> list[Row]:
    memory = (hpus.environment or {}).get("device_memory_bytes")
    each = f", {memory / 2**30:.1f} GiB each" if memory else ""
    rows = [Row("habana_frameworks / HPUs", OK, f"{hpus.count} x {hpus.name}{each}")]
    rows += [gaudi_software_row(), driver_row()]
    try:
        import torch

        rows.append(Row("torch", OK, f"{torch.__version__} (the image's own; never pinned or installed here)"))
    except Exception as error:
        rows.append(Row("torch", FAILED, f"cannot be imported: {type(error).__name__}: {error}"))
    rows.append(media_pipeline_row(hpus))
    rows += [
        self_check.requirement_row(line, install="requirements-gaudi.txt")
        for line in self_check.pinned_requirements(REQUIREMENT_FILES)
    ]
    return rows


def media_pipeline_row(hpus: Hpus) -> Row:
    """Whether --mediapipe_dataloader can start here (its step then shows whether it runs)."""
    if hpus.media_pipeline:
        return Row("media pipeline", WARNING, f"cannot start: {hpus.media_pipeline}")
    try:
        return Row("media pipeline", OK, f"habana-media-loader {metadata.version('habana-media-loader')}")
    except metadata.PackageNotFoundError:
        return Row("media pipeline", OK, "habana_frameworks.mediapipe importable")


# ----------------------------------------------------------------------------------------
# 2. Training steps, and the record
# ----------------------------------------------------------------------------------------


def plan_steps(fixtures: dict, output_dir, args, hpus: Hpus) -> list[self_check.Step]:
    def step(name, expected_loader, extra=(), launcher=(), needs=1):
        run_dir = output_dir / name / "run"
        flags = self_check.script_flags(fixtures, run_dir, args.max_steps)
        command = [*(launcher or [sys.executable]), str(GAUDI_SCRIPT), *flags, *hpu_flags(fixtures), *extra]
        return Step(name, command, run_dir, output_dir / name / "log.txt", expected_loader, needs)

    from bridgetower_bench.mediapipe.availability import MEDIAPIPE_LOADER, TORCH_LOADER

    launcher = [
        sys.executable,
        "-m",
        "bridgetower_bench.tools.launch_gaudi",
        "--world_size",
        str(LAUNCHER_HPUS),
        "--use_mpi",
    ]
    return [
        step("1hpu-pytorch-loader", TORCH_LOADER),
        step("1hpu-media-pipeline", MEDIAPIPE_LOADER, extra=["--mediapipe_dataloader"]),
        step(f"{LAUNCHER_HPUS}hpu-launcher", TORCH_LOADER, launcher=launcher, needs=LAUNCHER_HPUS),
    ]


def hpu_flags(fixtures: dict) -> list[str]:
    """The Gaudi script's own flags of each step: lazy mode, HPU graphs for inference."""
    return [
        "--use_habana",
        "--use_lazy_mode",
        "--use_hpu_graphs_for_inference",
        "--gaudi_config_name",
        str(fixtures["gaudi_config"]),
    ]


def environment_record(hpus: Hpus) -> dict:
    """The node's environment for the record (ENVIRONMENT_KEYS; None where the probe could not say), with the
    variable every step runs under."""
    found: dict[str, object] = dict.fromkeys(ENVIRONMENT_KEYS)
    found.update({"backend": "gaudi", "device_name": hpus.name, "device_count": hpus.count})
    found.update(hpus.environment or {})
    found["step_environment"] = dict(STEP_ENVIRONMENT)
    return found


def parse_args(argv=None):
    parser = self_check.argument_parser("gaudi_check", __doc__, "Optimizer steps per training run.", timeout=1200)
    return self_check.check_arguments(parser, parser.parse_args(argv))


def main(argv=None, *, probe: Callable[[], Hpus | str] = probe_hpus, runner: Optional[Callable] = None) -> int:
    """Run the check; returns the exit status. ``probe`` and ``runner`` are replaceable for tests."""
    backend = self_check.Backend(
        tool="gaudi_check",
        devices="HPUs",
        absent="not a Gaudi node",
        probe=probe,
        stack_rows=stack_rows,
        plan_steps=plan_steps,
        record_facts=lambda hpus: {"hpus": asdict(hpus), "environment": environment_record(hpus)},
        hub_rows=lambda: hub_check.rows(gaudi_config=True),
    )
    return self_check.run_check(backend, parse_args(argv), argv, runner)


if __name__ == "__main__":
    tool_paths.run(main)

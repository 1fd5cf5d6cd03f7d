"""Steady-state throughput, the data wait and the device's energy (energy.py) over the steps after the warm-up, for
a process, its job and each of the job's nodes (the figures: docs/ARCHITECTURE.md, "Saved metrics")."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import zlib
from collections.abc import Mapping
from typing import Optional

import torch
from transformers import TrainerCallback

from bridgetower_bench.measurement.energy import EnergyMeter


logger = logging.getLogger(__name__)


class ThroughputCallback(TrainerCallback):
    def __init__(
        self, warmup_steps=0, world_size=1, clock=time.perf_counter, synchronize=None, energy=None, gather=None
    ):
        self.warmup_steps = max(0, int(warmup_steps))
        self.energy: Optional[EnergyMeter] = energy
        self.gather = gather  # several processes: every rank's tensor, in rank order, along the first dimension
        self.device: Optional[torch.device] = None
        self.world_size = world_size
        self.clock = clock
        self.synchronize = synchronize or synchronize_device
        self._reset(first_step=0)

    def _reset(self, first_step: int) -> None:
        self.first_step = first_step  # global step when this train() call began (non-zero after a resume)
        self.window_start: Optional[float] = None
        self.train_start: Optional[float] = None
        self.last_step_end: Optional[float] = None
        self.last_step = first_step
        self.counted_samples = 0  # this rank's samples fetched for counted steps
        self.all_samples = 0
        self.wait_seconds = 0.0
        self.all_wait_seconds = 0.0
        self.steps_per_epoch: Optional[int] = None
        self.epochs_begun = 0
        self.step_waits: dict[int, float] = {}  # global step -> seconds blocked on the loader for it
        self.epoch_start_steps: list[int] = []  # global steps that began an epoch (after this call's first)
        self._step_wait = 0.0
        self._step_is_epoch_start = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._reset(first_step=state.global_step)
        self.device = args.device
        if self.energy is not None:
            self.energy.prepare()
        self.train_start = self.clock()
        if self.warmup_steps == 0:
            self.window_start = self.train_start
            if self.energy is not None:
                self.energy.start()
        loader = kwargs.get("train_dataloader")
        try:
            self.steps_per_epoch = max(len(loader) // max(1, getattr(args, "gradient_accumulation_steps", 1)), 1)
        except TypeError:  # no loader given, or one without a length
            self.steps_per_epoch = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epochs_begun += 1
        self._step_is_epoch_start = self.epochs_begun > 1  # the first one is the start of training

    def on_step_end(self, args, state, control, **kwargs):
        self.step_waits[state.global_step] = self._step_wait
        if self._step_is_epoch_start:
            self.epoch_start_steps.append(state.global_step)
        self._step_wait, self._step_is_epoch_start = 0.0, False
        window_starts = state.global_step - self.first_step == self.warmup_steps
        last_step = bool(state.max_steps) and state.global_step >= state.max_steps
        if window_starts or last_step:  # the clock reads when the device is done, not when the host queued the step
            self.synchronize(args.device)
        now = self.clock()
        self.last_step, self.last_step_end = state.global_step, now
        if window_starts:
            self.window_start = now
        if self.energy is not None:
            if window_starts:
                self.energy.start()
            elif last_step:
                self.energy.stop()
            elif self.window_start is not None:
                self.energy.poll()

    def record_fetch(self, seconds: float, num_samples: int) -> None:
        self._step_wait += seconds
        self.all_wait_seconds += seconds
        self.all_samples += num_samples
        if self.window_start is not None:
            self.wait_seconds += seconds
            self.counted_samples += num_samples

    def metrics(self) -> dict:
        """Figures for train_results.json: this process's samples/s times the world size, the job's energy (every
        rank's when each measured), each node's. Falls back to every step (and says so) when warm-up covers them all."""
        steps_run = self.last_step - self.first_step
        counted = steps_run > self.warmup_steps
        if self.last_step_end is None or steps_run == 0:
            return {}
        if counted:
            start, samples, wait = self.window_start, self.counted_samples, self.wait_seconds
        else:
            logger.warning(
                "throughput_warmup_steps=%d covers all %d steps of this run: throughput counts every step instead",
                self.warmup_steps,
                steps_run,
            )
            start, samples, wait = self.train_start, self.all_samples, self.all_wait_seconds
        warmup = self.warmup_steps if counted else 0
        assert start is not None  # (set at the first step)
        elapsed = max(self.last_step_end - start, 1e-9)
        energy = {}
        if self.energy is not None and counted:  # this process's device over this process's samples
            energy = self.energy.metrics(samples=samples, seconds=elapsed)
        elif self.energy is not None:
            energy = self.energy.not_measured("the warm-up covers every step: no counted window")
        shares = self._every_rank(samples, elapsed, wait)
        if len(shares) > 1 and "energy_joules" in energy and not any(math.isnan(joules) for *_, joules in shares):
            energy.update(job_energy(shares))
        node_samples = samples * self.world_size
        first_counted = self.first_step + warmup + 1
        epoch_starts = [step for step in self.epoch_start_steps if step >= first_counted]
        epoch_start_wait = sum(self.step_waits.get(step, 0.0) for step in epoch_starts)
        steady_wait = max(0.0, wait - epoch_start_wait)
        return {
            "train_samples_per_second": node_samples / elapsed,
            "train_samples_per_second_per_device": node_samples / elapsed / self.world_size,
            "throughput_warmup_steps": warmup,
            "throughput_counted_steps": steps_run - warmup,
            "throughput_counted_samples": node_samples,
            "throughput_counted_seconds": elapsed,
            "data_wait_fraction": min(1.0, wait / elapsed),
            "throughput_epoch_starts": len(epoch_starts),
            "data_wait_seconds_epoch_start": epoch_start_wait,
            "data_wait_fraction_epoch_start": min(1.0, epoch_start_wait / elapsed),
            "data_wait_seconds_steady": steady_wait,
            "data_wait_fraction_steady": min(1.0, steady_wait / elapsed),
            **({"throughput_steps_per_epoch": self.steps_per_epoch} if self.steps_per_epoch else {}),
            "world_size": self.world_size,
            **energy,
            **per_node(shares),
        }

    def _every_rank(self, samples: int, seconds: float, wait: float) -> list[list[float]]:
        """[node, samples, seconds, data wait, joules (nan: none)] of every rank, in rank order (float32 numbers,
        which every device's collectives carry: exact for node numbers and sample counts below 2**24)."""
        joules = self.energy.joules if self.energy is not None and self.energy.joules is not None else math.nan
        mine = [this_node(), samples, seconds, wait, joules]
        if self.gather is None or self.world_size <= 1:
            return [mine]
        share = torch.tensor([mine], dtype=torch.float32, device=self.device)
        return self.gather(share).cpu().tolist()


def this_node(environ: Mapping[str, str] = os.environ) -> int:
    """A number for the node this process runs on: the launcher's node rank, else one made from the host name."""
    for name in ("GROUP_RANK", "CROSS_RANK"):
        if environ.get(name, "").strip().isdigit():
            return int(environ[name])
    return zlib.crc32(socket.gethostname().encode()) & 0xFFFFFF  # (24 bits: exact in float32)


def job_energy(shares: list[list[float]]) -> dict:
    """The job's energy fields from every rank's joules over its own samples and window."""
    joules, samples = sum(s[4] for s in shares), sum(s[1] for s in shares)
    record = {
        "energy_joules": joules,
        "energy_devices_measured": len(shares),
        "energy_watts_per_device": sum(s[4] / s[2] for s in shares) / len(shares),
    }
    if samples > 0:
        record["energy_joules_per_sample"] = joules / samples
    return record


def per_node(shares: list[list[float]]) -> dict:
    """{"per_node": [...]} for a job on several nodes (each node's figures), else nothing."""
    nodes: dict[float, list[list[float]]] = {}
    for share in shares:
        nodes.setdefault(share[0], []).append(share)
    if len(nodes) < 2:
        return {}
    figures = []
    for index, ranks in enumerate(nodes.values()):
        samples, longest = sum(r[1] for r in ranks), max(r[2] for r in ranks)
        node = {
            "node": index,
            "processes": len(ranks),
            "train_samples_per_second": samples / longest,
            "data_wait_fraction": min(1.0, sum(r[3] / r[2] for r in ranks) / len(ranks)),
        }
        if not any(math.isnan(r[4]) for r in ranks):
            node["energy_joules"] = sum(r[4] for r in ranks)
        figures.append(node)
    return {"per_node": figures}


def node_line(node: dict) -> tuple[str, str]:
    """One node's figures as the printed metrics show them: ("node N", "what it did")."""
    energy = f", {node['energy_joules']:.1f} J" if "energy_joules" in node else ""
    return f"node {node['node']}", (
        f"{node['processes']} process(es), {node['train_samples_per_second']:.2f} samples/s, "
        f"data wait {node['data_wait_fraction']:.1%}{energy}"
    )


def synchronize_device(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":  # hpu (habana_frameworks registers torch.hpu), xpu, mps
        synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
        if synchronize is not None:
            synchronize()

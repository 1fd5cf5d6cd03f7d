"""Throughput edge cases the training loop meets: a run of a single step, and waiting for devices other than
CUDA (Gaudi's HPU) before the clock is read."""

import types

import pytest
import torch

from bridgetower_bench import throughput


CPU = types.SimpleNamespace(device=torch.device("cpu"))


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_single_step_run_still_reports_its_throughput(warmup):
    clock = types.SimpleNamespace(now=100.0)
    callback = throughput.ThroughputCallback(
        warmup_steps=warmup, clock=lambda: clock.now, synchronize=lambda device: None
    )
    state = types.SimpleNamespace(global_step=0, max_steps=1)
    callback.on_train_begin(CPU, state, None)
    clock.now += 0.5
    callback.record_fetch(0.5, 4)
    clock.now += 2.0
    state.global_step = 1
    callback.on_step_end(CPU, state, None)
    metrics = callback.metrics()
    # One step of 2.5 s (0.5 s of it waiting for the batch) and 4 samples; warm-up that covers every step falls
    # back to counting every step.
    assert metrics["throughput_counted_steps"] == 1 and metrics["throughput_warmup_steps"] == 0
    assert metrics["train_samples_per_second"] == pytest.approx(4 / 2.5)
    assert metrics["data_wait_fraction"] == pytest.approx(0.5 / 2.5)


def test_no_step_no_figures():
    callback = throughput.ThroughputCallback(warmup_steps=0, clock=lambda: 100.0, synchronize=lambda device: None)
    assert callback.metrics() == {}


def test_the_clock_waits_for_an_hpu_and_skips_backends_without_synchronize(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "hpu", types.SimpleNamespace(synchronize=lambda: calls.append("hpu")), raising=False)
    throughput.synchronize_device(torch.device("cpu"))
    assert calls == []
    throughput.synchronize_device(types.SimpleNamespace(type="hpu"))
    assert calls == ["hpu"]
    # A backend without synchronize (or none at all) is not waited for, and is no error.
    monkeypatch.setattr(torch, "hpu", types.SimpleNamespace(), raising=False)
    throughput.synchronize_device(types.SimpleNamespace(type="hpu"))
    throughput.synchronize_device(types.SimpleNamespace(type="no_such_backend"))

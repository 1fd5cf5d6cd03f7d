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


def test_a_fetch_longer_than_the_window_counts_as_all_of_it_and_the_node_is_named():
    """A batch fetched across the window's start (the loader reads ahead) can wait longer than the window
    lasts: the shares stop at the whole window. Two processes: node figures, and the world size they used."""
    clock = types.SimpleNamespace(now=0.0)
    callback = throughput.ThroughputCallback(
        warmup_steps=1, world_size=2, clock=lambda: clock.now, synchronize=lambda device: None
    )
    state = types.SimpleNamespace(global_step=0, max_steps=2)
    callback.on_train_begin(CPU, state, None)
    clock.now, state.global_step = 1.0, 1
    callback.on_step_end(CPU, state, None)  # the window opens at t=1
    callback.record_fetch(3.0, 4)  # waited since before the window opened
    clock.now, state.global_step = 2.0, 2
    callback.on_step_end(CPU, state, None)
    metrics = callback.metrics()
    assert metrics["data_wait_fraction"] == 1.0 and metrics["data_wait_fraction_steady"] == 1.0
    assert metrics["data_wait_fraction_epoch_start"] == 0.0
    assert metrics["world_size"] == 2 and metrics["throughput_counted_samples"] == 8
    assert metrics["train_samples_per_second"] == pytest.approx(8.0)
    assert metrics["train_samples_per_second_per_device"] == pytest.approx(4.0)

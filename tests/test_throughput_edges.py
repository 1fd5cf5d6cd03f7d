"""Throughput edge cases the training loop meets: a run of a single step, and waiting for devices other than
CUDA (Gaudi's HPU) before the clock is read."""

import types

import pytest
import torch

from bridgetower_bench.measurement import throughput


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


def run_two_epochs(fetches_per_step, steps_per_epoch=None, warmup=1):
    """A callback through two epochs of two optimizer steps each, every step's fetches waiting 0.25 s each (the
    long ones: the first fetch of the second epoch, 3 s, longer than the whole counted window), one second a step
    on a stand-in clock; the loader of `steps_per_epoch` batches given to on_train_begin, or none."""
    clock = types.SimpleNamespace(now=0.0)
    callback = throughput.ThroughputCallback(warmup_steps=warmup, clock=lambda: clock.now, synchronize=lambda d: None)
    state = types.SimpleNamespace(global_step=0, max_steps=4)
    loader = None if steps_per_epoch is None else [None] * steps_per_epoch
    callback.on_train_begin(CPU, state, None, train_dataloader=loader)
    for epoch in range(2):
        callback.on_epoch_begin(CPU, state, None)
        for step in range(2):
            for fetch in range(fetches_per_step):
                callback.record_fetch(3.0 if (epoch, step, fetch) == (1, 0, 0) else 0.25, 2)
            clock.now += 1.0
            state.global_step += 1
            callback.on_step_end(CPU, state, None)
    return callback.metrics()


def test_every_fetch_of_an_epochs_first_step_counts_in_its_wait():
    """With gradient accumulation a step fetches several batches: the epoch start's wait is all of them."""
    metrics = run_two_epochs(fetches_per_step=2)
    assert metrics["throughput_epoch_starts"] == 1
    assert metrics["data_wait_seconds_epoch_start"] == pytest.approx(3.0 + 0.25)
    # the counted window is 3 s (steps 2-4): waits past it stop at the whole window
    assert metrics["data_wait_fraction_epoch_start"] == 1.0


def test_the_steps_per_epoch_are_reported_only_when_the_loader_has_a_length():
    assert run_two_epochs(fetches_per_step=1, steps_per_epoch=2)["throughput_steps_per_epoch"] == 2
    assert "throughput_steps_per_epoch" not in run_two_epochs(fetches_per_step=1)


def test_a_warm_up_covering_every_step_says_so(caplog):
    with caplog.at_level("WARNING", logger="bridgetower_bench.measurement.throughput"):
        metrics = run_two_epochs(fetches_per_step=1, warmup=4)
    assert metrics["throughput_counted_steps"] == 4 and metrics["throughput_warmup_steps"] == 0
    assert caplog.messages == [
        "throughput_warmup_steps=4 covers all 4 steps of this run: throughput counts every step instead"
    ]


def test_the_clock_waits_for_the_cuda_device_it_reads_and_never_for_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.cpu, "synchronize", lambda device=None: calls.append(("cpu", device)))
    throughput.synchronize_device(torch.device("cuda", 1))
    throughput.synchronize_device(torch.device("cpu"))
    assert calls == [("cuda", torch.device("cuda", 1))]

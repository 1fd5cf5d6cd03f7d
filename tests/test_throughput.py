"""Steady-state throughput and data_wait_fraction, checked by arithmetic rather than by this machine's speed."""

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerCallback

from bridgetower_bench.measurement.throughput import ThroughputCallback, synchronize_device
from bridgetower_bench.trainer import TrainerExtensions
from helpers import SlowData, SlowModel, slow_trainer


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


CPU_ARGS = SimpleNamespace(device=torch.device("cpu"))


def simulate(callback, clock, steps, warmup_seconds, step_seconds, wait_seconds, batch=4, first_step=0, epoch=None):
    """Trainer events for `steps` optimizer steps after `first_step`, each waiting `wait_seconds` (or step k
    `wait_seconds(k)`) for its batch; with `epoch` (the loader's length), an epoch begins every `epoch` steps."""
    state = SimpleNamespace(global_step=first_step, max_steps=first_step + steps)
    callback.on_train_begin(CPU_ARGS, state, None, train_dataloader=epoch and [None] * epoch)
    for step in range(first_step + 1, first_step + steps + 1):
        if epoch and (step - 1) % epoch == 0:
            callback.on_epoch_begin(CPU_ARGS, state, None)
        wait = wait_seconds(step) if callable(wait_seconds) else wait_seconds
        clock.now += wait
        callback.record_fetch(wait, batch)
        clock.now += warmup_seconds if step - first_step <= callback.warmup_steps else step_seconds
        state.global_step = step
        callback.on_step_end(CPU_ARGS, state, None)


def test_warmup_steps_are_left_out_of_samples_per_second_and_a_run_inside_one_epoch_has_no_epoch_start_wait():
    clock = FakeClock()
    callback = ThroughputCallback(warmup_steps=3, world_size=8, clock=clock)
    simulate(callback, clock, steps=13, warmup_seconds=30.0, step_seconds=0.75, wait_seconds=0.25, batch=48)
    metrics = callback.metrics()
    # 10 counted steps of 1 s each (0.25 s waiting + 0.75 s computing), 48 samples per device, 8 devices.
    assert metrics["throughput_counted_steps"] == 10
    assert metrics["throughput_counted_samples"] == 10 * 48 * 8
    assert metrics["train_samples_per_second"] == pytest.approx(10 * 48 * 8 / 10.0)
    assert metrics["train_samples_per_second_per_device"] == pytest.approx(48.0)
    assert metrics["data_wait_fraction"] == pytest.approx(0.25)
    assert metrics["throughput_warmup_steps"] == 3
    assert metrics["throughput_epoch_starts"] == 0 and metrics["data_wait_seconds_epoch_start"] == 0.0
    assert metrics["data_wait_fraction_steady"] == pytest.approx(metrics["data_wait_fraction"])


# (steps, seconds of a warm-up step, of another step, of waiting in each; batch; the step it starts after) ->
# (counted steps, warm-up steps reported, samples/s, data wait fraction)
@pytest.mark.parametrize(
    "warmup, run, expected",
    [
        pytest.param(10, (4, 1.0, 1.0, 1.0, 3, 0), (4, 0, 12 / 8.0, 0.5), id="warmup-longer-than-the-run-counts-all"),
        pytest.param(None, (3, 1.0, 1.0, 0.0, 4, 0), (3, 0, 12 / 3.0, 0.0), id="no-warmup-by-default"),
        pytest.param(-2, (3, 1.0, 1.0, 0.0, 4, 0), (3, 0, 12 / 3.0, 0.0), id="a-negative-warmup-is-none"),
        pytest.param(2, (3, 10.0, 1.0, 0.0, 4, 0), (1, 2, 4 / 1.0, 0.0), id="one-step-after-the-warmup-is-a-window"),
        pytest.param(0, (1, 2.0, 2.0, 0.5, 4, 0), (1, 0, 4 / 2.5, 0.5 / 2.5), id="a-single-step-run"),
        pytest.param(1, (1, 2.0, 2.0, 0.5, 4, 0), (1, 0, 4 / 2.5, 0.5 / 2.5), id="a-single-step-run-all-warmup"),
        pytest.param(1, (5, 9.0, 2.0, 0.0, 2, 20), (4, 1, 8 / 8.0, 0.0), id="a-resumed-run-counts-from-its-resume"),
    ],
)
def test_the_counted_window_of_short_resumed_and_warmup_free_runs(warmup, run, expected):
    clock = FakeClock()
    callback = ThroughputCallback(clock=clock, **({} if warmup is None else {"warmup_steps": warmup}))
    steps, warmup_seconds, step_seconds, wait_seconds, batch, first_step = run
    simulate(callback, clock, steps, warmup_seconds, step_seconds, wait_seconds, batch=batch, first_step=first_step)
    metrics = callback.metrics()
    counted, warmup_reported, samples_per_second, wait_fraction = expected
    assert metrics["throughput_counted_steps"] == counted and metrics["throughput_warmup_steps"] == warmup_reported
    assert metrics["train_samples_per_second"] == pytest.approx(samples_per_second)
    assert metrics["data_wait_fraction"] == pytest.approx(wait_fraction)


def test_window_ends_wait_for_the_device_and_no_other_step_does():
    # Host time 0.5 s per step, but the device is 2 s behind at any moment: without waiting, the window
    # would read 10 steps in 5 s. Waiting at its start and end counts the device's time: 10 steps in 5 s
    # plus the final backlog (the start's backlog is drained before the window opens).
    clock, synced_at = FakeClock(), []

    def host_ahead_of_device(device):  # the device still has 2 s of queued work whenever the host asks it to catch up
        synced_at.append(clock.now)
        clock.now += 2.0

    callback = ThroughputCallback(warmup_steps=3, clock=clock, synchronize=host_ahead_of_device)
    simulate(callback, clock, steps=13, warmup_seconds=1.0, step_seconds=0.5, wait_seconds=0.0, batch=4)
    assert len(synced_at) == 2  # end of warm-up, last step: no per-step synchronisation
    metrics = callback.metrics()
    assert metrics["throughput_counted_seconds"] == pytest.approx(10 * 0.5 + 2.0)
    assert metrics["train_samples_per_second"] == pytest.approx(40 / 7.0)


# --- the same figures from a real transformers Trainer with an artificial per-step delay ----------------


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.times[state.global_step] = time.perf_counter()


def test_real_trainer_reports_samples_over_the_counted_steps_time(tmp_path):
    model = SlowModel(delay=0.03)
    steps, after = StepTimes(), StepTimes()  # the step ends' clock just before the kit's callback, and just after
    trainer = slow_trainer(tmp_path, model=model, callbacks=[steps], loader="torch", image_pipeline="fast")
    trainer.add_callback(after)
    metrics = trainer.train().metrics
    window = metrics["throughput_counted_seconds"]
    assert metrics["throughput_counted_steps"] == 4 and metrics["throughput_counted_samples"] == 8
    assert metrics["train_samples_per_second"] == pytest.approx(8 / window)
    # the window: from the end of step 2 (the warm-up) to the end of step 6, as the clock read between the two
    assert steps.times[6] - after.times[2] <= window <= after.times[6] - steps.times[2]
    # one samples/s figure in what the run prints and saves, not the Trainer's (warm-up included) beside it
    assert [key for key in metrics if "samples_per_second" in key] == [
        "train_samples_per_second",
        "train_samples_per_second_per_device",
    ]
    summary = trainer.state.log_history[-1]  # the Trainer's end-of-training line, as printed
    assert "train_runtime" in summary and not [key for key in summary if "per_second" in key]
    # No workers, so loading and computing take turns. accelerate's loader reads one batch ahead: the fetches
    # of counted steps 3-5 load batches 4-6 (2 x 10 ms of sleep each), step 6's finds the end. With the 4
    # counted forwards of 30 ms, at least 60 ms of the window is waiting and 120 ms is not, however slow the machine.
    waited = metrics["data_wait_fraction"] * window
    assert waited >= 3 * 2 * 0.010
    assert window - waited >= 4 * 0.030
    assert metrics["data_wait_seconds_epoch_start"] + metrics["data_wait_seconds_steady"] == pytest.approx(waited)
    assert metrics["loader"] == "torch" and metrics["image_pipeline"] == "fast"
    # uint8 pixels (sample i holds the value i) reached the model normalised on the device: (x / 255 - 0.5) / 0.25
    first = model.seen_pixels[0]
    assert first.dtype == torch.float32
    recovered = (first * 0.25 + 0.5) * 255
    assert torch.allclose(recovered, recovered.round(), atol=1e-3)
    assert set(recovered.round().int().unique().tolist()) <= set(range(12))


# --- epoch starts: the first step of every epoch after the first, accounted for apart ---------------------


def test_epoch_start_steps_are_the_first_step_of_each_later_epoch_inside_the_window():
    # 5 steps per epoch, 3 warm-up steps, 14 steps: epochs begin at steps 1, 6 and 11; step 1 starts training
    # (and is warm-up anyway), so 6 and 11 are the counted epoch starts. They wait 2 s, every other step 0.5 s.
    clock = FakeClock()
    callback = ThroughputCallback(warmup_steps=3, clock=clock)
    simulate(callback, clock, 14, 1.0, 1.0, wait_seconds=lambda k: 2.0 if k in (1, 6, 11) else 0.5, epoch=5)
    metrics = callback.metrics()

    assert callback.epoch_start_steps == [6, 11]
    assert metrics["throughput_steps_per_epoch"] == 5 and metrics["throughput_epoch_starts"] == 2
    # 11 counted steps (4..14): 2 epoch starts of 3 s (2 s waiting), 9 others of 1.5 s (0.5 s waiting): 19.5 s.
    assert metrics["throughput_counted_seconds"] == pytest.approx(19.5)
    assert metrics["data_wait_seconds_epoch_start"] == pytest.approx(4.0)
    assert metrics["data_wait_seconds_steady"] == pytest.approx(4.5)
    assert metrics["data_wait_fraction_epoch_start"] == pytest.approx(4.0 / 19.5)
    assert metrics["data_wait_fraction_steady"] == pytest.approx(4.5 / 19.5)
    assert metrics["data_wait_fraction_epoch_start"] + metrics["data_wait_fraction_steady"] == pytest.approx(
        metrics["data_wait_fraction"]
    )


class SlowEpochStarts(torch.utils.data.Sampler):
    """Sequential order; every new pass (epoch) first sleeps `delay` seconds, as new loader workers start."""

    def __init__(self, n, delay):
        self.n, self.delay, self.passes = n, delay, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        self.passes += 1
        time.sleep(self.delay)
        return iter(range(self.n))


class EpochStartTrainer(TrainerExtensions, Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return self.slow_sampler


def test_real_trainer_puts_the_wait_of_each_epoch_start_on_that_epochs_first_step(tmp_path):
    # 8 rows, batch 2: 4 steps per epoch; 11 steps with 2 warm-up: epochs begin at steps 1, 5 and 9.
    trainer = slow_trainer(
        tmp_path,
        EpochStartTrainer,
        args={"max_steps": 11},
        model=SlowModel(delay=0.0),
        train_dataset=SlowData(8, delay=0.0),
    )
    trainer.slow_sampler = SlowEpochStarts(8, delay=0.3)
    metrics = trainer.train().metrics
    recorded = trainer.throughput

    assert trainer.slow_sampler.passes == 3
    assert recorded.epoch_start_steps == [5, 9]
    assert metrics["throughput_steps_per_epoch"] == 4 and metrics["throughput_epoch_starts"] == 2
    assert all(recorded.step_waits[step] >= 0.3 for step in (1, 5, 9))  # each pass's sleep landed on its first step
    counted = [step for step in recorded.step_waits if step > 2]
    assert metrics["data_wait_seconds_epoch_start"] == pytest.approx(recorded.step_waits[5] + recorded.step_waits[9])
    assert metrics["data_wait_seconds_steady"] == pytest.approx(
        sum(recorded.step_waits[step] for step in counted if step not in (5, 9)), abs=1e-9
    )
    assert metrics["data_wait_seconds_epoch_start"] > metrics["data_wait_seconds_steady"]


@pytest.mark.parametrize(
    "warmup, steps, epoch_starts",
    [
        (3, 8, [3, 5, 7]),  # the epoch start at step 3 is warm-up: not counted
        (2, 6, [3, 5]),  # the epoch start at step 3 is the window's first step: counted
    ],
)
def test_only_epoch_starts_after_the_warmup_are_counted(warmup, steps, epoch_starts):
    clock = FakeClock()
    callback = ThroughputCallback(warmup_steps=warmup, clock=clock)
    simulate(callback, clock, steps, 1.0, 1.0, wait_seconds=lambda k: 1.0 if k % 2 else 0.0, epoch=2)
    metrics = callback.metrics()
    assert callback.epoch_start_steps == epoch_starts
    assert metrics["throughput_epoch_starts"] == 2  # steps 5 and 7, or 3 and 5
    assert (
        metrics["data_wait_seconds_epoch_start"] == pytest.approx(2.0) and metrics["data_wait_seconds_steady"] == 0.0
    )


@pytest.mark.parametrize("batches, accumulation, steps", [(5, 2, 2), (1, 1, 1), (1, 4, 1), (6, 3, 2)])
def test_steps_per_epoch_are_optimizer_steps(batches, accumulation, steps):
    callback = ThroughputCallback(clock=FakeClock())
    args = SimpleNamespace(device=torch.device("cpu"), gradient_accumulation_steps=accumulation)
    callback.on_train_begin(
        args, SimpleNamespace(global_step=0, max_steps=10), None, train_dataloader=[None] * batches
    )
    assert callback.steps_per_epoch == steps and isinstance(callback.steps_per_epoch, int)


def test_a_job_on_two_nodes_reports_every_devices_energy_and_each_nodes_figures(monkeypatch):
    """Four ranks on two nodes: this process is rank 0; the gather brings the three others' shares."""
    from bridgetower_bench.measurement.energy import EnergyMeter

    class Counter:
        source, joules = "test-counter", 0.0
        start = poll = lambda self: None

        def stop(self):
            return 40.0  # rank 0's device: 40 J over its 10 s window

    monkeypatch.setenv("GROUP_RANK", "0")
    others = torch.tensor([[0, 40, 10.0, 5.0, 60.0], [1, 40, 8.0, 0.0, 30.0], [1, 40, 10.0, 1.0, 30.0]])
    clock = FakeClock()
    callback = ThroughputCallback(
        warmup_steps=1,
        world_size=4,
        clock=clock,
        energy=EnergyMeter(Counter),
        gather=lambda mine: torch.cat([mine, others]),
    )
    simulate(callback, clock, steps=11, warmup_seconds=5.0, step_seconds=0.5, wait_seconds=0.5, batch=4)
    metrics = callback.metrics()
    # The job: rank 0's samples/s and data wait (as with one process), every device's energy.
    assert metrics["train_samples_per_second"] == pytest.approx(4 * 40 / 10.0)
    assert metrics["data_wait_fraction"] == pytest.approx(0.5)
    assert metrics["energy_joules"] == pytest.approx(160.0) and metrics["energy_devices_measured"] == 4
    assert metrics["energy_joules_per_sample"] == pytest.approx(160.0 / 160)
    assert metrics["energy_watts_per_device"] == pytest.approx((4.0 + 6.0 + 3.75 + 3.0) / 4)
    # Each node: its ranks' samples over its longest window, their mean data wait, their joules.
    fields = ("node", "processes", "train_samples_per_second", "data_wait_fraction", "energy_joules")
    assert metrics["per_node"] == [
        dict(zip(fields, (0, 2, 8.0, 0.5, 100.0))),
        dict(zip(fields, (1, 2, 8.0, 0.05, 60.0))),
    ]
    # A rank without a counter: the job's energy stays the one of the device that measured it, no node's joules.
    others[2, 4] = float("nan")
    metrics = callback.metrics()
    assert metrics["energy_joules"] == pytest.approx(40.0) and metrics["energy_devices_measured"] == 1
    assert all("energy_joules" not in node for node in metrics["per_node"][1:])
    assert metrics["per_node"][0]["energy_joules"] == 100.0


def test_a_process_is_on_the_launchers_node_rank_else_on_its_host(monkeypatch):
    from bridgetower_bench.measurement.throughput import this_node

    assert this_node({"GROUP_RANK": "3"}) == 3 and this_node({"CROSS_RANK": "1"}) == 1
    hosts = {}
    for host in ("gaudi-node-7", "gaudi-node-8"):
        monkeypatch.setattr("socket.gethostname", lambda: host)
        hosts[host] = this_node({})
        assert this_node({"GROUP_RANK": ""}) == hosts[host] < 2**24  # the same host, the same number
    assert hosts["gaudi-node-7"] != hosts["gaudi-node-8"]


def test_no_step_no_figures():
    callback = ThroughputCallback(warmup_steps=0, clock=lambda: 100.0, synchronize=lambda device: None)
    assert callback.metrics() == {}


def test_the_clock_waits_for_the_cuda_device_it_reads_or_an_hpu_never_for_the_cpu_or_a_backend_without_synchronize(
    monkeypatch,
):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.cpu, "synchronize", lambda device=None: calls.append(("cpu", device)))
    monkeypatch.setattr(torch, "hpu", SimpleNamespace(synchronize=lambda: calls.append("hpu")), raising=False)
    synchronize_device(torch.device("cuda", 1))
    synchronize_device(torch.device("cpu"))
    synchronize_device(SimpleNamespace(type="hpu"))
    assert calls == [("cuda", torch.device("cuda", 1)), "hpu"]
    # A backend without synchronize (or none at all) is not waited for, and is no error.
    monkeypatch.setattr(torch, "hpu", SimpleNamespace(), raising=False)
    synchronize_device(SimpleNamespace(type="hpu"))
    synchronize_device(SimpleNamespace(type="no_such_backend"))


def test_a_fetch_longer_than_the_window_counts_as_all_of_it_and_the_node_is_named():
    """A batch fetched across the window's start (the loader reads ahead) can wait longer than the window
    lasts: the shares stop at the whole window. Two processes: node figures, and the world size they used."""
    clock = SimpleNamespace(now=0.0)
    callback = ThroughputCallback(
        warmup_steps=1, world_size=2, clock=lambda: clock.now, synchronize=lambda device: None
    )
    state = SimpleNamespace(global_step=0, max_steps=2)
    callback.on_train_begin(CPU_ARGS, state, None)
    clock.now, state.global_step = 1.0, 1
    callback.on_step_end(CPU_ARGS, state, None)  # the window opens at t=1
    callback.record_fetch(3.0, 4)  # waited since before the window opened
    clock.now, state.global_step = 2.0, 2
    callback.on_step_end(CPU_ARGS, state, None)
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
    clock = SimpleNamespace(now=0.0)
    callback = ThroughputCallback(warmup_steps=warmup, clock=lambda: clock.now, synchronize=lambda d: None)
    state = SimpleNamespace(global_step=0, max_steps=4)
    loader = None if steps_per_epoch is None else [None] * steps_per_epoch
    callback.on_train_begin(CPU_ARGS, state, None, train_dataloader=loader)
    for epoch in range(2):
        callback.on_epoch_begin(CPU_ARGS, state, None)
        for step in range(2):
            for fetch in range(fetches_per_step):
                callback.record_fetch(3.0 if (epoch, step, fetch) == (1, 0, 0) else 0.25, 2)
            clock.now += 1.0
            state.global_step += 1
            callback.on_step_end(CPU_ARGS, state, None)
    return callback.metrics()


def test_every_fetch_of_an_epochs_first_step_counts_in_its_wait_and_steps_per_epoch_need_a_loader_length():
    # With gradient accumulation a step fetches several batches: the epoch start's wait is all of them.
    metrics = run_two_epochs(fetches_per_step=2)
    assert metrics["throughput_epoch_starts"] == 1
    assert metrics["data_wait_seconds_epoch_start"] == pytest.approx(3.0 + 0.25)
    # the counted window is 3 s (steps 2-4): waits past it stop at the whole window
    assert metrics["data_wait_fraction_epoch_start"] == 1.0
    assert "throughput_steps_per_epoch" not in metrics, "no loader given: no length"
    assert run_two_epochs(fetches_per_step=1, steps_per_epoch=2)["throughput_steps_per_epoch"] == 2


def test_a_warm_up_covering_every_step_says_so(caplog):
    with caplog.at_level("WARNING", logger="bridgetower_bench.measurement.throughput"):
        metrics = run_two_epochs(fetches_per_step=1, warmup=4)
    assert metrics["throughput_counted_steps"] == 4 and metrics["throughput_warmup_steps"] == 0
    assert caplog.messages == [
        "throughput_warmup_steps=4 covers all 4 steps of this run: throughput counts every step instead"
    ]

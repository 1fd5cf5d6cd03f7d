"""Energy over the throughput window: each reader against a counter trace the test controls, standing in for
NVML, HLML and RAPL at the one call (or file) each reads; the `not measured` paths and their reasons."""

import sys
import time
from types import ModuleType, SimpleNamespace

import pytest
import torch

from bridgetower_bench.measurement import energy
from bridgetower_bench.measurement.energy import (
    EnergyMeter,
    HlmlPowerSampler,
    NotMeasured,
    RaplCounter,
    integrate_power,
)
from bridgetower_bench.measurement.throughput import ThroughputCallback
from helpers import slow_trainer


CPU_ARGS = SimpleNamespace(device=torch.device("cpu"))


# --- NVML: the board's millijoule counter ------------------------------------------------------------------


def fake_nvml(monkeypatch, trace, supported=True):
    """A `pynvml` whose energy counter returns the next value of `trace` (millijoules) at each call."""
    module = ModuleType("pynvml")
    readings = iter(trace)
    module.calls = []

    def energy_of(handle):
        module.calls.append(handle)
        if not supported:
            raise RuntimeError("Not Supported")
        return next(readings)

    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByUUID = lambda uuid: f"handle of {uuid}"
    module.nvmlDeviceGetTotalEnergyConsumption = energy_of
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(energy, "_cuda_uuid", lambda device: "GPU-0000")
    return module


def measured(meter, warmup, steps, batch=2, step_seconds=1.0, poll=None, max_steps=None, **options):
    """The metrics of a ThroughputCallback (`options` its own) measuring `meter` through the Trainer's events for
    `steps` optimizer steps of `step_seconds` each (of `max_steps`, by default all) on a stand-in clock;
    `poll(step)` runs before each step end."""
    clock = SimpleNamespace(now=100.0)
    callback = ThroughputCallback(warmup_steps=warmup, clock=lambda: clock.now, energy=meter, **options)
    state = SimpleNamespace(global_step=0, max_steps=max_steps or steps)
    callback.on_train_begin(CPU_ARGS, state, None)
    for step in range(1, steps + 1):
        callback.record_fetch(0.0, batch)
        clock.now += step_seconds
        state.global_step = step
        if poll:
            poll(step)
        callback.on_step_end(CPU_ARGS, state, None)
    return callback.metrics()


def test_nvml_energy_is_the_counter_difference_read_after_the_device_caught_up_at_the_windows_ends(monkeypatch):
    # Readings: when the meter opens (before the window), at the end of warm-up step 2, at the last step.
    nvml, events = fake_nvml(monkeypatch, [1_000_000, 1_050_000, 1_850_000]), []
    read = nvml.nvmlDeviceGetTotalEnergyConsumption
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda handle: events.append("read") or read(handle)
    meter = EnergyMeter.for_device(torch.device("cuda", 0))

    metrics = measured(meter, 2, steps=10, batch=8, step_seconds=0.5, synchronize=lambda device: events.append("sync"))

    assert len(nvml.calls) == 3, "read when opened, at the window's start and at its end: no reading per step"
    assert events == ["read", "sync", "read", "sync", "read"], "the device caught up before each end's reading"
    # 800 J over 8 counted steps of 0.5 s and 8 samples each
    assert metrics["energy_source"] == "nvml-energy"
    assert metrics["energy_joules"] == pytest.approx(800.0)
    assert metrics["energy_joules_per_sample"] == pytest.approx(800.0 / 64)
    assert metrics["energy_watts_per_device"] == pytest.approx(800.0 / 4.0)
    assert metrics["energy_seconds"] == pytest.approx(metrics["throughput_counted_seconds"])


def test_a_gpu_without_an_energy_counter_or_without_nvidia_ml_py_is_not_measured_and_says_why(monkeypatch):
    fake_nvml(monkeypatch, [], supported=False)
    metrics = measured(EnergyMeter.for_device(torch.device("cuda", 0)), 1, steps=3, synchronize=lambda device: None)
    assert metrics["energy_source"] == "not measured"
    assert metrics["energy_reason"] == "NVML has no energy counter for this GPU: Not Supported"
    assert metrics["train_samples_per_second"] == pytest.approx(2.0), "training and its figures go on"
    assert "energy_joules_per_sample" not in metrics

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    meter = EnergyMeter.for_device(torch.device("cuda", 0))
    meter.prepare()
    meter.start()
    meter.stop()
    assert meter.metrics(samples=10, seconds=1.0) == {
        "energy_source": "not measured",
        "energy_reason": "no NVML (nvidia-ml-py not installed)",
    }


@pytest.mark.parametrize(
    "torch_uuid, nvml_uuid",
    [
        ("6f1c0d3e-0000-4000-8000-000000000002", "GPU-6f1c0d3e-0000-4000-8000-000000000002"),
        ("MIG-6f1c0d3e-0000-4000-8000-000000000002", "MIG-6f1c0d3e-0000-4000-8000-000000000002"),
    ],
)
def test_nvml_reads_the_gpu_torch_trains_on_by_its_uuid_not_its_index(monkeypatch, torch_uuid, nvml_uuid):
    # CUDA_VISIBLE_DEVICES in UUID form renumbers the GPUs for torch: torch's device 1 is not NVML's device 1,
    # and no integer index can be read from that list. The UUID torch reports is the one name both agree on.
    asked = []
    nvml = ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: pytest.fail("the GPU was looked up by index")
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: asked.append(uuid) or "handle"
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda handle: 5_000
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaaaaaa-0000-4000-8000-000000000001,GPU-6f1c0d3e")
    uuids = {1: torch_uuid}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=uuids[device.index]))

    counter = energy.NvmlEnergyCounter.open(torch.device("cuda", 1))

    assert asked == [nvml_uuid]
    assert (counter.handle, counter.reading) == ("handle", 5.0)


# --- HLML: power in milliwatts, sampled ------------------------------------------------------------------------


def test_hlml_power_samples_are_integrated_over_the_window_by_the_test_or_the_samplers_thread():
    clock = SimpleNamespace(now=100.0)
    power_mw = iter([100_000, 300_000, 300_000, 200_000])
    sampler = HlmlPowerSampler(lambda: next(power_mw), interval=3600, clock=lambda: clock.now)  # the test samples

    sampler.start()  # t=100: 100 W
    clock.now += 1.0
    sampler.sample()  # t=101: 300 W
    clock.now += 2.0
    sampler.sample()  # t=103: 300 W
    clock.now += 1.0
    joules = sampler.stop()  # t=104: 200 W

    # trapezoids: 1 s x 200 W + 2 s x 300 W + 1 s x 250 W
    assert joules == pytest.approx(200 + 600 + 250)
    assert integrate_power([(0.0, 50.0)]) == 0.0

    sampler = HlmlPowerSampler(lambda: 250_000, interval=0.01)  # its own thread, while training runs
    sampler.start()
    time.sleep(0.2)
    joules = sampler.stop()
    seconds = sampler.samples[-1][0] - sampler.samples[0][0]
    assert len(sampler.samples) > 5, "the background thread samples between the two ends"
    assert joules == pytest.approx(250.0 * seconds)


def fake_hlml(monkeypatch, modules=(0, 1, 2, 3), power_mw=400_000):
    module = ModuleType("pyhlml")
    module.hlmlInit = lambda: None
    module.hlmlDeviceGetCount = lambda: len(modules)
    module.hlmlDeviceGetHandleByIndex = lambda i: f"hpu{i}"
    module.hlmlDeviceGetModuleID = lambda handle: modules[int(handle[3:])]
    module.read = []
    module.hlmlDeviceGetPowerUsage = lambda handle: module.read.append(handle) or power_mw
    monkeypatch.setitem(sys.modules, "pyhlml", module)
    return module


def test_hlml_samples_the_hpu_of_this_process_by_module_id_or_says_why_not(monkeypatch):
    hlml = fake_hlml(monkeypatch, modules=(3, 2, 1, 0))
    sampler = HlmlPowerSampler.open({"OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    sampler.sample()
    assert set(hlml.read) == {"hpu2"}, "module ID 1 is the third device HLML lists here"
    assert energy.hpu_module_id({"HLS_MODULE_ID": "5", "LOCAL_RANK": "1"}) == 5
    assert energy.hpu_module_id({"HABANA_VISIBLE_MODULES": "4,5,6,7", "LOCAL_RANK": "2"}) == 6
    assert energy.hpu_module_id({"HABANA_VISIBLE_MODULES": "6"}) == 6

    with pytest.raises(NotMeasured, match="single process takes the first free HPU.*set HLS_MODULE_ID"):
        energy.hpu_module_id({})
    fake_hlml(monkeypatch, modules=(0, 1))
    with pytest.raises(NotMeasured, match="HLML lists no HPU with module ID 7"):
        HlmlPowerSampler.open({"HLS_MODULE_ID": "7"})
    monkeypatch.setitem(sys.modules, "pyhlml", None)
    with pytest.raises(NotMeasured, match=r"^no HLML \(habana-pyhlml not installed\)$"):
        HlmlPowerSampler.open({"LOCAL_RANK": "0"})


# --- RAPL: package counters in microjoules, with wrap-around --------------------------------------------------


class FakePowercap:
    """/sys/class/powercap with the domains the test sets; `set(domain, uj)` moves a counter."""

    def __init__(self, root, domains):
        self.root = root
        for name, (label, top) in domains.items():
            directory = root / name
            directory.mkdir(parents=True)
            (directory / "name").write_text(label + "\n")
            (directory / "max_energy_range_uj").write_text(f"{top}\n")
            (directory / "energy_uj").write_text("0\n")

    def set(self, domain, microjoules):
        (self.root / domain / "energy_uj").write_text(f"{microjoules}\n")


def test_rapl_sums_the_packages_and_counts_across_a_wrap(tmp_path):
    top = 262_143_328_850
    powercap = FakePowercap(
        tmp_path,
        {
            "intel-rapl:0": ("package-0", top),
            "intel-rapl:1": ("package-1", top),
            "intel-rapl:0:0": ("core", top),  # a sub-domain: inside package-0 already
            "intel-rapl:2": ("psys", top),  # the platform: it contains the packages
        },
    )
    powercap.set("intel-rapl:0", top - 5_000_000)
    powercap.set("intel-rapl:1", 1_000_000)
    counter = RaplCounter.open(str(tmp_path))
    assert counter.names == ["package-0", "package-1"]

    counter.start()
    powercap.set("intel-rapl:0", 3_000_000)  # wrapped: 5 J to the top, then 3 J
    powercap.set("intel-rapl:1", 11_000_000)  # 10 J
    powercap.set("intel-rapl:0:0", 99_000_000)
    counter.poll()
    powercap.set("intel-rapl:0", top - 1_000_000)  # 259 kJ more, just below the top: no wrap
    powercap.set("intel-rapl:1", 12_000_000)  # 1 J
    joules = counter.stop()

    assert joules == pytest.approx(5 + 3 + 10 + (top - 1_000_000 - 3_000_000) / 1e6 + 1)
    assert counter.total_uj == 5_000_000 + 3_000_000 + 10_000_000 + (top - 4_000_000) + 1_000_000, "to the microjoule"
    counter.start()
    assert counter.stop() == 0.0, "a counter that did not move: no energy, not a wrap"


def test_rapl_over_the_throughput_window_polls_every_counted_step(tmp_path, monkeypatch):
    top = 100_000_000  # 100 J: it wraps inside the window
    powercap = FakePowercap(tmp_path, {"intel-rapl:0": ("package-0", top)})
    monkeypatch.setattr(energy, "POWERCAP_ROOT", str(tmp_path))

    # 30 J per step from step 0 on: the counter passes its 100 J top three times over the 8 counted steps
    def burn(step):
        powercap.set("intel-rapl:0", (step * 30_000_000) % top)

    metrics = measured(EnergyMeter.for_device(torch.device("cpu")), 2, steps=10, batch=4, poll=burn)

    assert metrics["energy_source"] == "rapl" and metrics["energy_domains"] == "package-0"
    assert metrics["energy_joules"] == pytest.approx(8 * 30.0)
    assert metrics["energy_joules_per_sample"] == pytest.approx(30.0 / 4)
    assert metrics["energy_watts_per_device"] == pytest.approx(30.0)


def test_rapl_not_measured_paths(tmp_path, monkeypatch):
    with pytest.raises(NotMeasured, match=r"^no RAPL \(.* has no intel-rapl domain\)$"):
        RaplCounter.open(str(tmp_path))
    FakePowercap(tmp_path, {"intel-rapl:0": ("package-0", 10**9)})
    real_open = open

    def denied(path, *args, **kwargs):
        if str(path).endswith("energy_uj"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(NotMeasured, match=r"^RAPL not readable: permission denied$"):
        RaplCounter.open(str(tmp_path))
    monkeypatch.undo()
    (tmp_path / "intel-rapl:0" / "name").unlink()
    with pytest.raises(NotMeasured, match=r"^RAPL not readable: No such file or directory$"):
        RaplCounter.open(str(tmp_path))
    with pytest.raises(NotMeasured, match="RAPL counts the whole CPU, shared here by 2 training processes"):
        energy.open_source(torch.device("cpu"), world_size=2)
    with pytest.raises(NotMeasured, match="no energy counter known for mps devices"):
        energy.open_source(SimpleNamespace(type="mps"), world_size=1)


# --- the meter around the window -----------------------------------------------------------------------------


class Counter:
    source = "test-counter"

    def __init__(self, fail_at=None):
        self.value, self.fail_at = 0.0, fail_at

    def start(self):
        self._start = self.value

    def poll(self):
        if self.fail_at == "poll":
            raise OSError("device gone")

    def stop(self):
        return self.value - self._start

    def burn(self, joules):
        self.value += joules


@pytest.mark.parametrize(
    "counter, warmup, steps, max_steps, reason",
    [
        (Counter, 10, 4, None, "the warm-up covers every step: no counted window"),
        (lambda: Counter(fail_at="poll"), 1, 5, None, "energy reading failed: OSError('device gone')"),
        (Counter, 1, 4, 10, "the counted window did not end at the run's last step"),  # stopped after 4 of 10 steps
    ],
)
def test_a_window_that_cannot_be_measured_says_why_and_never_stops_training(counter, warmup, steps, max_steps, reason):
    metrics = measured(EnergyMeter(counter), warmup, steps=steps, max_steps=max_steps)
    assert metrics["energy_source"] == "not measured" and metrics["energy_reason"] == reason
    assert metrics["train_samples_per_second"] == pytest.approx(2.0)


def test_the_figures_per_sample_and_per_second_a_second_stop_changes_nothing_and_a_window_must_open():
    counter = Counter()
    meter = EnergyMeter(lambda: counter)
    meter.prepare()
    meter.start()
    counter.value += 12.0
    meter.stop()
    counter.value += 100.0
    meter.stop()  # the window closed once: later readings are not its energy
    assert meter.metrics(samples=1, seconds=4.0) == {
        "energy_source": "test-counter",
        "energy_joules": 12.0,
        "energy_seconds": 4.0,
        "energy_devices_measured": 1,
        "energy_watts_per_device": 3.0,
        "energy_joules_per_sample": 12.0,
    }
    assert "energy_joules_per_sample" not in meter.metrics(samples=0, seconds=4.0)
    assert EnergyMeter(Counter).metrics(samples=4, seconds=1.0)["energy_reason"] == "the counted window never opened"


def test_the_power_sampler_never_keeps_a_dying_run_alive():
    import subprocess

    code = (
        "from bridgetower_bench.measurement.energy import HlmlPowerSampler\n"
        "sampler = HlmlPowerSampler(lambda: 1000, interval=0.01)\n"
        "sampler.start()\n"
        "raise SystemExit(3)  # a run that dies inside the window, stop() never called\n"
    )
    result = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert result.returncode == 3


def test_without_warmup_the_window_and_its_energy_start_with_training():
    counter = Counter()
    metrics = measured(EnergyMeter(lambda: counter), 0, steps=3, batch=1, poll=lambda step: counter.burn(7.0))
    assert metrics["energy_joules"] == pytest.approx(21.0)


# --- a real Trainer: the trainer extensions measure the training device over the counted window ------------------


class PowerMeter:
    """A counter that accumulates 50 W of wall-clock time: its joules / seconds must come out as 50 W."""

    source = "test-50-watts"

    def start(self):
        self._start = time.perf_counter()

    def poll(self):
        pass

    def stop(self):
        return 50.0 * (time.perf_counter() - self._start)


def test_the_trainer_records_the_energy_of_its_device_over_the_counted_window(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(
        energy, "open_source", lambda device, world_size=1: opened.append((device.type, world_size)) or PowerMeter()
    )

    metrics = slow_trainer(tmp_path).train().metrics

    assert opened == [("cpu", 1)]
    assert metrics["energy_source"] == "test-50-watts"
    assert metrics["energy_watts_per_device"] == pytest.approx(50.0, rel=0.02), "read at the window's two ends"
    assert metrics["energy_joules_per_sample"] == pytest.approx(metrics["energy_joules"] / 8)
    assert metrics["energy_seconds"] == metrics["throughput_counted_seconds"]


def test_the_trainer_records_why_energy_was_not_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(energy, "POWERCAP_ROOT", str(tmp_path / "no-powercap"))
    metrics = slow_trainer(tmp_path).train().metrics
    assert metrics["energy_source"] == "not measured"
    assert metrics["energy_reason"] == f"no RAPL ({tmp_path / 'no-powercap'} has no intel-rapl domain)"
    assert "energy_joules_per_sample" not in metrics

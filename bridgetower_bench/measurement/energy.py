"""The device's energy over the throughput window, read from its own counter (measured, never estimated), one
reader per source; a library a reader needs is optional, imported when a run trains on its backend. Why not zeus:
docs/ARCHITECTURE.md, "Written here, though a package exists"."""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional


logger = logging.getLogger(__name__)

NOT_MEASURED = "not measured"
POWERCAP_ROOT = "/sys/class/powercap"


class NotMeasured(Exception):
    """No counter for this run; the message says why (it goes into `energy_reason`)."""


class NvmlEnergyCounter:
    """NVIDIA: NVML's millijoule counter of one GPU (since the driver loaded; no wrap), read at the window's ends."""

    source = "nvml-energy"

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle

    @classmethod
    def open(cls, device) -> NvmlEnergyCounter:
        try:
            import pynvml  # nvidia-ml-py: optional, listed in requirements-cuda.txt
        except ImportError:
            raise NotMeasured("no NVML (nvidia-ml-py not installed)") from None
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByUUID(_cuda_uuid(device))
        except Exception as error:  # NVMLError and its subclasses (no driver, unknown UUID, ...)
            raise NotMeasured(f"NVML cannot open the GPU: {error}") from None
        counter = cls(pynvml, handle)
        counter.read()  # a GPU older than Volta (or a MIG slice) answers "Not Supported" here, before the window
        return counter

    def read(self) -> float:
        try:
            millijoules = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception as error:
            raise NotMeasured(f"NVML has no energy counter for this GPU: {error}") from None
        self.reading = millijoules / 1000.0
        return self.reading

    def start(self) -> None:
        self._start = self.read()

    def stop(self) -> float:
        return self.read() - self._start


def _cuda_uuid(device) -> str:
    """The UUID NVML knows the training GPU by (CUDA_VISIBLE_DEVICES may renumber it for torch)."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


class HlmlPowerSampler:
    """Gaudi: one HPU's power (mW) sampled by a thread every `interval` s over the window, integrated."""

    source = "hlml-power-sampled"

    def __init__(self, read_milliwatts: Callable[[], float], interval=0.05, clock=time.perf_counter):
        self.read_milliwatts, self.interval, self.clock = read_milliwatts, interval, clock
        self.samples: list[tuple[float, float]] = []  # (seconds, watts)
        self._stop_event = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None

    @classmethod
    def open(cls, environ: Mapping[str, str] = os.environ) -> HlmlPowerSampler:
        try:
            import pyhlml  # habana-pyhlml: optional, listed in requirements-gaudi.txt
        except ImportError:
            raise NotMeasured("no HLML (habana-pyhlml not installed)") from None
        module = hpu_module_id(environ)
        try:
            pyhlml.hlmlInit()
            handles = [pyhlml.hlmlDeviceGetHandleByIndex(i) for i in range(pyhlml.hlmlDeviceGetCount())]
            matching = [h for h in handles if pyhlml.hlmlDeviceGetModuleID(h) == module]
        except Exception as error:  # HLMLError, or the library file missing
            raise NotMeasured(f"HLML cannot open the HPUs: {error}") from None
        if not matching:
            raise NotMeasured(f"HLML lists no HPU with module ID {module}")
        sampler = cls(lambda: pyhlml.hlmlDeviceGetPowerUsage(matching[0]))
        sampler.sample()  # fails here, before the window, where the device has no power reading
        sampler.samples.clear()
        return sampler

    def sample(self) -> None:
        try:
            watts = self.read_milliwatts() / 1000.0
        except Exception as error:
            raise NotMeasured(f"HLML power reading failed: {error}") from None
        self.samples.append((self.clock(), watts))

    def _run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.sample()
            except NotMeasured as error:
                self.error = str(error)
                return

    def start(self) -> None:
        self.samples.clear()
        self.error = None
        self.sample()
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._run, name="hlml-power-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> float:
        self._stop_event.set()
        assert self._thread is not None  # (stop follows start)
        self._thread.join()
        if self.error:
            raise NotMeasured(self.error)
        self.sample()
        return integrate_power(self.samples)


def integrate_power(samples: list[tuple[float, float]]) -> float:
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(samples, samples[1:]))


def hpu_module_id(environ: Mapping[str, str]) -> int:
    """The module ID of the HPU this process trains on, as Habana's bridge assigns it: HLS_MODULE_ID; else
    the local rank's entry of HABANA_VISIBLE_MODULES; else the local rank (MPI or torchrun). A single process
    with neither takes the first free HPU, which nothing here can name."""
    if environ.get("HLS_MODULE_ID", "").strip():
        return int(environ["HLS_MODULE_ID"])
    local_rank = environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or environ.get("LOCAL_RANK")
    visible = [m.strip() for m in environ.get("HABANA_VISIBLE_MODULES", "").split(",") if m.strip()]
    if visible and (local_rank is not None or len(visible) == 1):
        return int(visible[int(local_rank or 0)])
    if local_rank is not None:
        return int(local_rank)
    raise NotMeasured(
        "a single process takes the first free HPU, whose module ID is unknown here; "
        "set HLS_MODULE_ID (or HABANA_VISIBLE_MODULES) to the module it should use"
    )


class RaplCounter:
    """CPU: every RAPL package domain's counter, read at every step end too, so that no wrap-around is missed."""

    source = "rapl"

    def __init__(self, domains: list[str]):
        self.domains = domains  # directories such as /sys/class/powercap/intel-rapl:0
        self.ranges = [int(_read_text(os.path.join(d, "max_energy_range_uj"))) for d in domains]
        self.names = [_read_text(os.path.join(d, "name")) for d in domains]

    @classmethod
    def open(cls, root: Optional[str] = None) -> RaplCounter:
        root = root or POWERCAP_ROOT
        # Top-level domains only (intel-rapl:N, not their sub-domains intel-rapl:N:M, which they contain), and of
        # those the packages: a "psys" platform domain would count the packages a second time.
        tops = sorted(d for d in glob.glob(os.path.join(root, "intel-rapl:*")) if os.path.basename(d).count(":") == 1)
        if not tops:
            raise NotMeasured(f"no RAPL ({root} has no intel-rapl domain)")
        try:
            packages = [d for d in tops if _read_text(os.path.join(d, "name")).startswith("package")]
            if not packages:
                raise NotMeasured(f"no RAPL package domain under {root}")
            counter = cls(packages)
            counter.start()
        except PermissionError:
            raise NotMeasured("RAPL not readable: permission denied") from None
        except OSError as error:
            raise NotMeasured(f"RAPL not readable: {error.strerror or error}") from None
        return counter

    def _read_raw(self) -> list[int]:
        try:
            return [int(_read_text(os.path.join(d, "energy_uj"))) for d in self.domains]
        except PermissionError:
            raise NotMeasured("RAPL not readable: permission denied") from None
        except (OSError, ValueError) as error:
            raise NotMeasured(f"RAPL reading failed: {error}") from None

    def start(self) -> None:
        self._last = self._read_raw()
        self.total_uj = 0

    def poll(self) -> None:
        """Add what each counter moved since the last reading; a counter below its last value has wrapped."""
        raw = self._read_raw()
        for last, now, top in zip(self._last, raw, self.ranges):
            self.total_uj += now - last if now >= last else top - last + now
        self._last = raw

    def stop(self) -> float:
        self.poll()
        return self.total_uj / 1e6


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def open_source(device, world_size: int):
    """The energy reader for the device this process trains on; NotMeasured (with the reason) when there is none."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        return NvmlEnergyCounter.open(device)
    if kind == "hpu":
        return HlmlPowerSampler.open()
    if kind == "cpu":
        if world_size > 1:
            raise NotMeasured(f"RAPL counts the whole CPU, shared here by {world_size} training processes")
        return RaplCounter.open()
    raise NotMeasured(f"no energy counter known for {kind} devices")


class EnergyMeter:
    """Energy of the throughput window, driven by throughput.py (a reader's `poll` optional); never stops training:
    a failing reader becomes a `not measured` reason."""

    def __init__(self, open_reader: Callable[[], object]):
        self.open_reader = open_reader
        self.reader: Any = None  # open_reader's: start(), stop() -> joules, poll() where it has one
        self.reason: Optional[str] = None
        self.joules: Optional[float] = None
        self.running = False  # between start() and stop()

    @classmethod
    def for_device(cls, device, world_size: int = 1) -> EnergyMeter:
        return cls(lambda: open_source(device, world_size))

    def prepare(self) -> None:
        """Find the counter (outside the window: loading a library takes time); once per train() call."""
        self.reader, self.reason, self.joules, self.running = None, None, None, False
        try:
            self.reader = self.open_reader()
        except NotMeasured as error:
            self.reason = str(error)
        except Exception as error:  # an unexpected library failure must not stop training
            self.reason = f"energy reader failed to start: {error!r}"
        if self.reason:
            logger.info("energy not measured: %s", self.reason)

    def _guard(self, action: Callable[[], object]):
        try:
            return action()
        except Exception as error:
            self.reason = str(error) if isinstance(error, NotMeasured) else f"energy reading failed: {error!r}"
            self.reader, self.running = None, False
            return None

    def start(self) -> None:
        if self.reader is not None:
            self._guard(self.reader.start)
            self.running = self.reader is not None

    def poll(self) -> None:
        if self.running and hasattr(self.reader, "poll"):
            self._guard(self.reader.poll)

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.joules = self._guard(self.reader.stop)

    def not_measured(self, reason: str) -> dict:
        """The record of a run without a figure: the reader's own reason first (no counter), else `reason`."""
        return {"energy_source": NOT_MEASURED, "energy_reason": self.reason or reason}

    def metrics(self, samples: int, seconds: float) -> dict:
        """Fields for train_results.json: the window's joules per sample and watts per device, or why not."""
        if self.joules is None:
            ended = "did not end at the run's last step" if self.running else "never opened"
            return self.not_measured(f"the counted window {ended}")
        record = {
            "energy_source": self.reader.source,
            "energy_joules": self.joules,
            "energy_seconds": seconds,
            "energy_devices_measured": 1,  # this process's device
            "energy_watts_per_device": self.joules / max(seconds, 1e-9),
        }
        if samples > 0:
            record["energy_joules_per_sample"] = self.joules / samples
        if isinstance(self.reader, RaplCounter):
            record["energy_domains"] = ", ".join(self.reader.names)
        return record

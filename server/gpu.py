"""GPU gauges from NVML (nvidia-ml-py), sampled about once a second on a side thread so a scrape never
waits on the driver and the event loop never calls into it. Without NVML or without a GPU nothing is
registered: the `decode_gpu_*` series are absent, not zero.

Each reading is tried on its own: a GPU that does not report one (memory temperature on consumer
boards, energy on old ones) leaves that gauge unset and the rest keep working."""

import threading

from prometheus_client import Gauge

# NVML clock-event reason bits (nvmlClocksEventReason*), as label values.
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
NVML_FI_DEV_MEMORY_TEMP = 82


def _import_nvml():
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class GpuSampler:
    """Starts only when NVML initialises and reports at least one GPU (`start()` returns False otherwise)."""

    def __init__(self, registry, interval_s: float = 1.0, nvml=None):
        self.registry = registry
        self.interval_s = interval_s
        self.nvml = nvml if nvml is not None else _import_nvml()
        self.handles: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        nv = self.nvml
        if nv is None:
            return False
        try:
            nv.nvmlInit()
            self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        except Exception:  # no driver, no device, or a container without the NVML library
            return False
        if not self.handles:
            return False
        self._register()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass

    def _register(self) -> None:
        r, g = self.registry, ["gpu"]
        self.sm_clock = Gauge("decode_gpu_sm_clock_hz", "SM clock", g, registry=r)
        self.mem_clock = Gauge("decode_gpu_memory_clock_hz", "Memory clock", g, registry=r)
        self.power = Gauge("decode_gpu_power_watts", "Power draw", g, registry=r)
        self.energy = Gauge("decode_gpu_energy_joules", "Energy used since the driver loaded", g, registry=r)
        self.temp = Gauge("decode_gpu_temperature_celsius", "GPU die temperature", g, registry=r)
        self.mem_temp = Gauge("decode_gpu_memory_temperature_celsius", "Memory (HBM) temperature", g, registry=r)
        self.mem_used = Gauge("decode_gpu_memory_used_bytes", "Device memory in use", g, registry=r)
        self.events = Gauge("decode_gpu_clock_event_active", "1 while NVML reports this clock-event (throttle) "
                            "reason", ["gpu", "reason"], registry=r)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        nv = self.nvml
        for i, h in enumerate(self.handles):
            gpu = str(i)
            self._set(self.sm_clock, gpu, lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) * 1e6)
            self._set(self.mem_clock, gpu, lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM) * 1e6)
            self._set(self.power, gpu, lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1e3)
            self._set(self.energy, gpu, lambda h=h: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3)
            self._set(self.temp, gpu, lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            self._set(self.mem_temp, gpu, lambda h=h: self._memory_temperature(h))
            self._set(self.mem_used, gpu, lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).used)
            reasons = self._read(lambda h=h: self._clock_events(h))
            if reasons is not None:
                for bit, name in CLOCK_EVENT_REASONS.items():
                    self.events.labels(gpu, name).set(1 if reasons & bit else 0)

    def _clock_events(self, h) -> int:
        nv = self.nvml
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons  # the name before driver 535
        return int(fn(h))

    def _memory_temperature(self, h) -> float | None:
        v = self.nvml.nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_MEMORY_TEMP])[0]
        if v.nvmlReturn != 0:
            return None
        return float(v.value.uiVal)

    @staticmethod
    def _read(fn):
        try:
            return fn()
        except Exception:  # NVMLError_NotSupported and friends: this GPU does not report it
            return None

    def _set(self, gauge, gpu: str, fn) -> None:
        value = self._read(fn)
        if value is not None:
            gauge.labels(gpu).set(value)

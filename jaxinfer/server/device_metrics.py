"""Device gauges read at scrape time: jax device memory, and NVML temperature/power/utilization.

Both sources are optional: jax is read only if the engine already imported it, NVML only if
``nvidia-ml-py`` (the ``nvml`` extra) imports and finds a GPU. A source that fails is skipped, so
``/metrics`` never breaks because of it; only a GPU without ``nvidia-ml-py`` logs a warning.
"""

from __future__ import annotations

import logging
import sys

from prometheus_client.core import GaugeMetricFamily

from jaxinfer.server.metrics import PREFIX

logger = logging.getLogger("jaxinfer.server")


def _is_on_gpu() -> bool:
    jax = sys.modules.get("jax")  # not imported here: a server without an engine has no device to ask
    try:
        return jax is not None and jax.default_backend() == "gpu"
    except Exception:
        return False


class DeviceCollector:
    def __init__(self):
        self._nvml = None
        try:
            import pynvml
        except ImportError:
            # Silent on CPU/TPU, where there is nothing to read; on a GPU the missing extra is named.
            if _is_on_gpu():
                logger.warning("GPU temperature/power/utilization gauges are off: nvidia-ml-py is not installed "
                               "(pip install 'jaxinfer[nvml]'; jaxinfer[cuda] includes it)")
            return
        try:
            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # no driver, no GPU
            self._nvml = None

    def collect(self):
        yield from self._jax_memory()
        yield from self._nvml_gauges()

    def _jax_memory(self):
        jax = sys.modules.get("jax")
        if jax is None:
            return
        used = GaugeMetricFamily(PREFIX + "device_memory_used_bytes", "Device memory in use (jax memory_stats).", labels=["device"])
        limit = GaugeMetricFamily(PREFIX + "device_memory_limit_bytes", "Device memory limit (jax memory_stats).", labels=["device"])
        peak = GaugeMetricFamily(PREFIX + "device_memory_peak_bytes", "Peak device memory in use (jax memory_stats).", labels=["device"])
        try:
            for device in jax.local_devices():
                stats = device.memory_stats() or {}
                name = f"{device.platform}:{device.id}"
                if "bytes_in_use" in stats:
                    used.add_metric([name], stats["bytes_in_use"])
                if "bytes_limit" in stats:
                    limit.add_metric([name], stats["bytes_limit"])
                if "peak_bytes_in_use" in stats:
                    peak.add_metric([name], stats["peak_bytes_in_use"])
        except Exception:
            return
        yield from (used, limit, peak)

    def _nvml_gauges(self):
        nvml = self._nvml
        if nvml is None:
            return
        temperature = GaugeMetricFamily(PREFIX + "gpu_temperature_celsius", "GPU temperature (NVML).", labels=["gpu"])
        power = GaugeMetricFamily(PREFIX + "gpu_power_watts", "GPU power draw (NVML).", labels=["gpu"])
        utilization = GaugeMetricFamily(PREFIX + "gpu_utilization_perc", "GPU utilization, 0..1 (NVML).", labels=["gpu"])
        memory = GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["gpu"])
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                temperature.add_metric([str(i)], nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
                power.add_metric([str(i)], nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
                utilization.add_metric([str(i)], nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                memory.add_metric([str(i)], nvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:
            return
        yield from (temperature, power, utilization, memory)

"""Device gauges read at scrape time: jax device memory, and NVML temperature/power/utilization.

Every family is declared on every platform (its ``# HELP``/``# TYPE`` lines are always there),
so dashboards and autoscalers written against these names find them on a CPU machine too;
samples appear only where a source reports them. jax is read only if the engine already
imported it, NVML only if ``nvidia-ml-py`` (the ``nvml`` extra) imports and finds a GPU. A source
that fails gives no samples, so ``/metrics`` never breaks because of it; only a GPU without
``nvidia-ml-py`` logs a warning.
"""

from __future__ import annotations

import logging
import sys

from prometheus_client.core import GaugeMetricFamily

from jaxinfer.server.metrics import PREFIX

# (name, help, jax memory_stats key)
_JAX_MEMORY = [
    ("device_memory_used_bytes", "Device memory in use (jax memory_stats).", "bytes_in_use"),
    ("device_memory_limit_bytes", "Device memory limit (jax memory_stats).", "bytes_limit"),
    ("device_memory_peak_bytes", "Peak device memory in use (jax memory_stats).", "peak_bytes_in_use"),
]
# (name, help, reader(pynvml, device handle))
_NVML = [
    ("gpu_temperature_celsius", "GPU temperature (NVML).",
     lambda nvml, h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
    ("gpu_power_watts", "GPU power draw (NVML).", lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
    ("gpu_utilization_perc", "GPU utilization, 0..1 (NVML).",
     lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
    ("gpu_memory_used_bytes", "GPU memory in use (NVML).", lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used),
]
# Every family this collector declares (the Ray ingress keeps their samples apart per engine replica).
FAMILY_NAMES = frozenset(PREFIX + name for name, *_ in _JAX_MEMORY + _NVML)

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
        yield from _families(_JAX_MEMORY, "device", self._jax_memory_samples())
        yield from _families(_NVML, "gpu", self._nvml_samples())

    def _jax_memory_samples(self) -> dict[str, list[tuple[str, float]]]:
        """Family name -> [(device, value)]; empty where jax is not loaded or fails."""
        jax = sys.modules.get("jax")
        if jax is None:
            return {}
        samples: dict[str, list[tuple[str, float]]] = {}
        try:
            for device in jax.local_devices():
                stats = device.memory_stats() or {}
                for name, _, key in _JAX_MEMORY:
                    if key in stats:
                        samples.setdefault(name, []).append((f"{device.platform}:{device.id}", stats[key]))
        except Exception:
            return {}
        return samples

    def _nvml_samples(self) -> dict[str, list[tuple[str, float]]]:
        """Family name -> [(gpu index, value)]; empty without NVML or if a read fails."""
        nvml = self._nvml
        if nvml is None:
            return {}
        samples: dict[str, list[tuple[str, float]]] = {}
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                for name, _, read in _NVML:
                    samples.setdefault(name, []).append((str(i), read(nvml, handle)))
        except Exception:
            return {}
        return samples


def _families(table, label: str, samples: dict[str, list[tuple[str, float]]]):
    """One gauge family per row of ``table``, declared even when it has no samples."""
    for name, doc, _ in table:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
        for key, value in samples.get(name, []):
            family.add_metric([key], value)
        yield family

"""``/metrics`` on the Ray ingress: the engine replicas' metrics, merged into the names ``server.py`` exports.

Under Ray the engine metrics (queue, KV usage, TTFT, tokens, ...) live in the engine replicas,
each of which keeps a :class:`~jaxinfer.server.metrics.ServerMetrics` for its ``EngineLoop``; the
refusals (``request_rejected``) and ``server_healthy`` are the ingress's, and the batch lines are
counted by the batch runner(s). :class:`RayIngressMetrics` is the ingress's ``ServerMetrics``: on
each scrape it fetches every replica's families (a broadcast through the handles) and exports
one set, so dashboards, KEDA queries and alerts written for ``jaxinfer serve`` (``deploy/``) read
the whole deployment. The merge (:func:`merge_families`), per family:

- counters and histograms: summed per label set (a histogram's buckets, ``_sum`` and ``_count``
  add up: the merged one is the histogram of every replica's observations);
- gauges: summed (``num_requests_waiting``, ``num_requests_running``, pages, ...), except
  ``kv_cache_usage_perc``, the mean over engine replicas (as ``avg()`` over pods would give);
  ``batch_lines_pending``, the maximum (every runner reports the whole queue); and the gauges the
  ingress sets itself (``server_healthy``; ``server_num_requests_waiting``, already the replicas'
  sum), taken from the ingress alone;
- device gauges (``device_metrics``: GPU utilization, temperature, power, memory): kept per
  replica, with a ``replica`` label added, since devices of different replicas share indices.

A replica that fails to answer, or a broadcast that times out, is left out of that scrape (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from jaxinfer.server.device_metrics import FAMILY_NAMES as DEVICE_FAMILY_NAMES
from jaxinfer.server.metrics import PREFIX, ServerMetrics

logger = logging.getLogger("jaxinfer.ray_serve")

SCRAPE_TIMEOUT_S = 10.0
MEAN_OVER_ENGINES = frozenset({PREFIX + "kv_cache_usage_perc"})
MAX_OVER_SOURCES = frozenset({PREFIX + "batch_lines_pending"})
INGRESS_ONLY = frozenset({PREFIX + "server_healthy", PREFIX + "server_num_requests_waiting"})
REPLICA_LABEL = "replica"


def merge_families(ingress: list[Metric], engines: dict[str, list[Metric]], others: list[list[Metric]]) -> list[Metric]:
    """One family per name from the ingress's, each engine replica's (by replica id) and other
    sources' (batch runners') families; see the module docstring for the rule of each."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, list[float]]] = {}

    def add(family: Metric, source: str, replica: str | None) -> None:
        if family.name not in merged:
            merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            values[family.name] = {}
        if family.name in INGRESS_ONLY and source != "ingress":
            return
        if family.name in MEAN_OVER_ENGINES and source != "engine":
            return
        if family.name in DEVICE_FAMILY_NAMES:
            if replica is None:
                return  # the ingress's own devices: it runs no model
            for s in family.samples:
                merged[family.name].samples.append(Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value))
            return
        for s in family.samples:
            values[family.name].setdefault((s.name, tuple(sorted(s.labels.items()))), []).append(s.value)

    for family in ingress:
        add(family, "ingress", None)
    for replica, families in engines.items():
        for family in families:
            add(family, "engine", replica)
    for families in others:
        for family in families:
            add(family, "other", None)
    for name, family in merged.items():
        for (sample_name, labels), sample_values in values[name].items():
            family.samples.append(Sample(sample_name, dict(labels), _combine(name, sample_values)))
    return list(merged.values())


def _combine(name: str, sample_values: list[float]) -> float:
    if name in MEAN_OVER_ENGINES:
        return sum(sample_values) / len(sample_values)
    if name in MAX_OVER_SOURCES:
        return max(sample_values)
    return sum(sample_values)


class _Families:
    """A prometheus collector that yields families already collected (for ``generate_latest``)."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self):
        return iter(self._families)


class RayIngressMetrics(ServerMetrics):
    """The ingress's metrics: its own (refusals, health) plus, per scrape, the engine replicas'
    and the batch runners' (:func:`merge_families`)."""

    def __init__(self, model_name: str, max_model_len: int, engine_handle, batch_handle=None):
        super().__init__(model_name, max_model_len)
        self._engine_handle = engine_handle
        self._batch_handle = batch_handle

    def render(self) -> bytes:
        engines = {}
        for replica in _broadcast(self._engine_handle, "metric_families"):
            engines[replica["replica"]] = replica["families"]
        others = _broadcast(self._batch_handle, "metric_families") if self._batch_handle is not None else []
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(merge_families(list(self.registry.collect()), engines, others)))
        return generate_latest(registry)


def _broadcast(handle, method: str) -> list:
    """Every replica's answer; a replica that fails is left out of this scrape (logged)."""
    try:
        answers = handle.broadcast(method).results(timeout_s=SCRAPE_TIMEOUT_S, return_exceptions=True)
    except Exception:  # the broadcast itself: no replica answered in time
        logger.exception("the replicas' metrics could not be read; this scrape leaves them out")
        return []
    for failed in (a for a in answers if isinstance(a, Exception)):
        logger.warning("a replica's metrics could not be read; this scrape leaves them out", exc_info=failed)
    return [a for a in answers if not isinstance(a, Exception)]

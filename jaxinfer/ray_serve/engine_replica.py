"""EngineReplica: one engine behind an :class:`~jaxinfer.server.engine_loop.EngineLoop`, as a Ray Serve deployment.

Each replica builds its engine (``build_engine``, e.g. :class:`~jaxinfer.ray_serve.config.ModelSpec`),
compiles it, and serves the ingress's :class:`~jaxinfer.ray_serve.remote_client.RemoteEngineClient`:

- ``generate``/``score`` are streaming methods (``handle.options(stream=True)``): the first item
  is the admission verdict (:mod:`jaxinfer.ray_serve.wire`), then every output of the call, read
  from the loop's ``OutputStream`` as the engine's thread puts them (``OutputStream.on_put`` wakes
  the call's coroutine: no thread blocks on the stream, and the replica's event loop never
  blocks). A call Serve cancels (its caller died, or gave up) aborts its engine requests, which
  frees their pages.
- ``abort`` reaches every replica (the ingress broadcasts it); ids a replica does not hold are ignored.
- ``record_autoscaling_stats`` is Ray Serve's custom-metrics hook: the queue and the KV cache
  usage that :class:`~jaxinfer.ray_serve.autoscaling.QueueAutoscalingPolicy` scales on.
- ``check_health`` fails once the engine died, so Serve replaces the replica.
- ``metric_families`` returns the replica's engine metrics (a ``ServerMetrics`` fed by its loop,
  the same families ``server.py`` exports), which the ingress's ``/metrics`` merges
  (:mod:`jaxinfer.ray_serve.metrics`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ray import serve

from jaxinfer.engine_client import EngineRequest, ServiceUnavailable
from jaxinfer.gc_freeze import freeze_startup_heap
from jaxinfer.outputs import RequestOutput
from jaxinfer.ray_serve import wire
from jaxinfer.ray_serve.autoscaling import KV_CACHE_USAGE, NUM_REQUESTS_WAITING
from jaxinfer.server.admission import AdmissionConfig
from jaxinfer.server.device_metrics import DeviceCollector
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.metrics import ServerMetrics

logger = logging.getLogger("jaxinfer.ray_serve")



class EngineReplica:
    def __init__(self, build_engine: Callable[[], object], admission: AdmissionConfig, served_model_name: str):
        engine = build_engine()
        # The engine's metrics, as server.py keeps them; the ingress's /metrics merges every replica's.
        self.metrics = ServerMetrics(served_model_name, engine.max_model_len)
        self.metrics.registry.register(DeviceCollector())
        self.loop = EngineLoop(admission, self.metrics)
        self.loop.start(engine, warmup=True)
        freeze_startup_heap()  # a replica's process lives to serve this engine (jaxinfer/gc_freeze.py)
        self._replica_id = serve.get_replica_context().replica_tag

    def describe(self) -> dict:
        """What the ingress needs before it parses requests: the tokenizer and the context length."""
        return {"tokenizer": self.loop.tokenizer, "max_model_len": self.loop.max_model_len}

    async def generate(self, requests: list[EngineRequest]):
        async for item in self._stream(requests, is_scoring=False):
            yield item

    async def score(self, requests: list[EngineRequest]):
        async for item in self._stream(requests, is_scoring=True):
            yield item

    def abort(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)

    def stats(self) -> dict:
        return self.loop.stats()

    def metric_families(self) -> dict:
        """This replica's id and its metric families (``jaxinfer.ray_serve.metrics`` merges them)."""
        self.metrics.set_state(self.loop.state)
        self.metrics.server_waiting.set(self.loop.stats()["server_num_requests_waiting"])
        return {"replica": self._replica_id, "families": list(self.metrics.registry.collect())}

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.loop.stats()
        return {NUM_REQUESTS_WAITING: stats["server_num_requests_waiting"],
                KV_CACHE_USAGE: stats.get("kv_cache_usage", 0.0)}

    def check_health(self) -> None:
        if self.loop.state == "dead":
            raise RuntimeError("the engine failed; this replica must be replaced")

    def __del__(self):
        self.loop.stop()

    async def _stream(self, requests: list[EngineRequest], is_scoring: bool):
        try:
            stream = self.loop.score(requests) if is_scoring else self.loop.generate(requests)
        except ServiceUnavailable as e:
            yield wire.Unavailable.from_error(e)
            return
        # The engine's thread wakes this coroutine when it puts an output: no thread waits on the
        # stream (a thread hand-off per output cost TTFT on a busy machine; docs/RAY.md).
        woken = asyncio.Event()
        stream.on_put = _waker(asyncio.get_running_loop(), woken)
        yield wire.Admitted()
        num_ended = 0
        try:
            while num_ended < len(requests):
                item = stream.get(timeout=0)
                if item is None:
                    await woken.wait()  # a put after the get above has set it, or will
                    woken.clear()
                    continue
                # Each request ends with one item: its finished output, or its error.
                if not isinstance(item, RequestOutput) or item.finished:
                    num_ended += 1
                yield wire.encode(item, stream.timings)
        finally:
            stream.on_put = None
            if num_ended < len(requests):  # cancelled: nobody reads these outputs any more
                self.loop.abort(stream.request_ids)


def _waker(loop: asyncio.AbstractEventLoop, event: asyncio.Event):
    """``event.set`` on ``loop``, callable from another thread; a no-op once the loop has closed."""
    def wake() -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop closed (the replica is stopping): nobody waits
            pass
    return wake

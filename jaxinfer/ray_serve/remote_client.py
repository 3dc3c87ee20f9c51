"""RemoteEngineClient: the :class:`~jaxinfer.engine_client.EngineClient` of the Ray ingress.

The Flask routes run unchanged in the ingress (through :class:`~jaxinfer.ray_serve.wsgi_bridge.WSGIBridge`)
and call this client from their threads; it forwards each call to the engine deployment through
its Serve handle, whose request router (:class:`~jaxinfer.ray_serve.prefix_router.PrefixAwareRouter`)
picks the replica:

- ``generate``/``score`` open a streaming call and wait for its first item, the replica's
  admission verdict, so a full queue is still raised here as ``ServiceUnavailable`` (503 +
  Retry-After). Past the deployment's ``max_queued_requests`` (every replica at its
  ``max_ongoing_requests``), Serve refuses the call itself (``BackPressureError``): also a 503
  ``queue_full``. Once admitted, one thread of ``stream_pumps`` moves the call's items onto the
  route's ``OutputStream``; a replica that dies mid-stream ends the stream with an ``EngineFault``.
- ``abort`` is broadcast: the client does not know which replica holds a request, and a replica
  ignores ids it does not hold. The aborted requests' streams end as the contract says (their
  final outputs come back through the still-open calls).
- ``stats`` sums the replicas' counters (``kv_cache_usage`` is their mean), cached for 0.1 s.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ray.serve.exceptions import BackPressureError

from jaxinfer.engine_client import EngineFault, EngineRequest, OutputStream, QueueFullError
from jaxinfer.ray_serve import wire
from jaxinfer.tokenizer import Tokenizer

logger = logging.getLogger("jaxinfer.ray_serve")

ABORT_TIMEOUT_S = 5.0
STATS_MAX_AGE_S = 0.1
STATS_TIMEOUT_S = 10.0


class RemoteEngineClient:
    """An EngineClient over a Ray Serve handle to the engine deployment; see the module docstring."""

    def __init__(self, engine_handle, tokenizer: Tokenizer, max_model_len: int, max_streams: int,
                 retry_after_s: float):
        """``max_streams``: calls streaming at once (the ingress's WSGI threads); ``retry_after_s``:
        the Retry-After of a 503 when Serve's own queue (``max_queued_requests``) is full."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.state = "ready"  # Serve routes to a replica only once its engine is compiled
        self._handle = engine_handle
        self._streaming_handle = engine_handle.options(stream=True)  # made once: options() copies the handle
        self._retry_after_s = retry_after_s
        self._stream_pumps = ThreadPoolExecutor(max_streams, thread_name_prefix="engine-call")
        self._stats_lock = threading.Lock()
        self._stats: dict | None = None
        self._stats_at = 0.0

    def generate(self, requests: list[EngineRequest]) -> OutputStream:
        return self._call("generate", requests)

    def score(self, requests: list[EngineRequest]) -> OutputStream:
        return self._call("score", requests)

    def abort(self, request_ids: list[str]) -> None:
        try:
            self._handle.broadcast("abort", list(request_ids)).results(timeout_s=ABORT_TIMEOUT_S)
        except Exception:
            logger.exception("could not abort requests", extra={"request_ids": request_ids})

    def stats(self) -> dict:
        """The replicas' summed stats, at most ``STATS_MAX_AGE_S`` old: the batch runner asks before
        each line it submits, and each answer is a broadcast to every replica."""
        now = time.monotonic()
        with self._stats_lock:
            if self._stats is None or now - self._stats_at > STATS_MAX_AGE_S:
                self._stats, self._stats_at = sum_replica_stats(self.replica_stats()), now
            return self._stats

    def replica_stats(self) -> list[dict]:
        """Each engine replica's ``EngineLoop.stats()``."""
        return self._handle.broadcast("stats").results(timeout_s=STATS_TIMEOUT_S)

    def _call(self, method: str, requests: list[EngineRequest]) -> OutputStream:
        try:
            responses = getattr(self._streaming_handle, method).remote(requests)
            verdict = next(responses)
        except BackPressureError as e:  # Serve's queue (max_queued_requests) is full: 503, not 500
            raise QueueFullError(f"every engine replica is busy and Serve's queue is full ({e}); retry later",
                                 e.retry_after_s or self._retry_after_s) from None
        if isinstance(verdict, wire.Unavailable):
            raise verdict.to_error()
        with self._stats_lock:
            self._stats = None  # the next reading counts this call
        stream = OutputStream([r.request_id for r in requests])
        self._stream_pumps.submit(_pump, responses, stream)
        return stream


def _pump(responses, stream: OutputStream) -> None:
    """Move a call's items from Serve's response generator onto the route's stream."""
    try:
        for item in responses:
            output, timing = wire.decode(item)
            if timing is not None:
                stream.timings[output.request_id] = timing
            stream.put(output)
    except Exception:
        logger.exception("engine replica call failed", extra={"request_ids": stream.request_ids})
        stream.put(EngineFault("the engine replica failed while running this request"))


def sum_replica_stats(replica_stats: list[dict]) -> dict:
    """Counters and gauges summed over replicas; the fractions (``kv_cache_usage``,
    ``admission_new_token_ratio``) averaged."""
    total: dict = {"num_replicas": len(replica_stats)}
    for stats in replica_stats:
        for key, value in stats.items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    if replica_stats:
        total["kv_cache_usage"] = total.get("kv_cache_usage", 0.0) / len(replica_stats)
        if "admission_new_token_ratio" in total:
            total["admission_new_token_ratio"] /= len(replica_stats)
    return total

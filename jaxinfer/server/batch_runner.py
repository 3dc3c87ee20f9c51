"""BatchRunner: a background thread that feeds batch lines to the engine, behind interactive traffic.

It reaches the engine only through the :class:`~jaxinfer.engine_client.EngineClient` the HTTP
routes use, at low priority: a line is submitted only while fewer than ``max_waiting_requests``
requests (interactive or batch) wait for their first token, and at most ``max_lines_in_flight``
lines run at once (with a client over several engine replicas, as under Ray, the waiting
limit is per replica). The engine schedules first come first served, so an interactive request that
arrives finds at most that many batch requests ahead of it in the queue, while the batch fills
whatever room the engine has left.

One pass of the loop (:meth:`BatchRunner.run_once`): renew the claims, drop lines of cancelled
batches, finalize finished batches, collect finished lines (each result recorded in the store,
exactly once), and claim and submit new lines while the queue is short. A line the engine did
not finish (aborted by a shutdown, a dead engine) is never recorded: it runs again later.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid

from jaxinfer.server.batch_line_requests import LineRequests, prepare_line
from jaxinfer.batch_api.records import ClaimedLine
from jaxinfer.batch_api.result_lines import response_line
from jaxinfer.batch_api.store import BatchStore
from jaxinfer.engine_client import EngineClient, EngineFault, OutputStream, ServiceUnavailable
from jaxinfer.errors import RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.server.errors import APIError, bad_request, internal_error

logger = logging.getLogger("jaxinfer.server")


@dataclasses.dataclass
class BatchRunnerConfig:
    max_lines_in_flight: int = 8
    max_waiting_requests: int = 2  # submit a line only while fewer requests wait for their first token
    poll_s: float = 0.02  # how often finished lines are collected
    housekeeping_s: float = 0.5  # how often cancellations, finished batches and (when idle) new lines are looked for
    heartbeat_s: float = 5.0  # how often claims are renewed: well within the store's lease


@dataclasses.dataclass
class _RunningLine:
    line: ClaimedLine
    prepared: LineRequests
    stream: OutputStream
    finals: dict[int, RequestOutput] = dataclasses.field(default_factory=dict)


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class BatchRunner:
    """See the module docstring. ``metrics`` (a ServerMetrics) may be None."""

    def __init__(self, store: BatchStore, client: EngineClient, served_model_name: str, metrics=None,
                 config: BatchRunnerConfig | None = None, worker_id: str | None = None):
        self.store = store
        self.client = client
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.config = config or BatchRunnerConfig()
        self.worker_id = worker_id or new_worker_id()
        self._claimed: list[ClaimedLine] = []  # claimed, not yet submitted
        self._running: dict[tuple[str, int], _RunningLine] = {}
        self._last_heartbeat = self._last_housekeeping = 0.0
        self._next_claim_at = 0.0  # after a claim found nothing, the store is asked again only later
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batch-runner", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; lines still running are aborted and left unrecorded (they run again later)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for running in self._running.values():
            self.client.abort([r.request_id for r in running.prepared.requests])
        self._running.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            try:
                self.run_once()
            except Exception:  # a store outage (Redis down, disk full) must not end the thread: retried
                logger.exception("batch runner pass failed; retrying")
                self._stop.wait(1.0)

    def run_once(self) -> None:
        if self.client.state == "dead":
            # Let the claims lapse (no more heartbeats), so another server takes these lines over.
            self._claimed.clear()
            self._running.clear()
        now = time.monotonic()
        if now - self._last_heartbeat >= self.config.heartbeat_s:
            self._last_heartbeat = now
            self.store.heartbeat(self.worker_id, self._held())
        if now - self._last_housekeeping >= self.config.housekeeping_s:
            self._last_housekeeping = now
            self._drop_stopped_batches()
            for batch_id in self.store.finalize_batches(self.worker_id):
                logger.info("batch finished", extra={"batch_id": batch_id})
            if self.metrics is not None:
                self.metrics.batch_lines_pending.set(self.store.num_pending_lines())
        if self.client.state != "ready":
            return
        self._collect()
        self._submit()

    def _held(self) -> list[ClaimedLine]:
        return self._claimed + [r.line for r in self._running.values()]

    def _queue_is_short(self) -> bool:
        stats = self.client.stats()
        waiting = max(stats.get("num_waiting", 0), stats.get("server_num_requests_waiting", 0))
        # A client over several engine replicas (Ray) sums their queues: the limit is per replica.
        return waiting < self.config.max_waiting_requests * stats.get("num_replicas", 1)

    def _submit(self) -> None:
        while len(self._running) < self.config.max_lines_in_flight:
            if not self._claimed and time.monotonic() < self._next_claim_at:
                return  # nothing to submit: the engine's stats are not even read
            if not self._queue_is_short():
                return
            if not self._claimed:
                held = {line.key for line in self._held()}
                room = self.config.max_lines_in_flight - len(self._running)
                self._claimed = self.store.claim_lines(self.worker_id, room, held)
                if not self._claimed:
                    self._next_claim_at = time.monotonic() + self.config.housekeeping_s
                    return
            line = self._claimed.pop(0)
            try:
                prepared = prepare_line(line, self.client.tokenizer, self.client.max_model_len,
                                        self.served_model_name)
            except APIError as e:
                self._record(line, e.status, e.body())
                continue
            except Exception:
                logger.exception("batch line could not be prepared", extra={"batch_id": line.batch_id})
                error = internal_error()
                self._record(line, error.status, error.body())
                continue
            try:
                run = self.client.score if prepared.parsed.score_only else self.client.generate
                stream = run(prepared.requests)
            except ServiceUnavailable:  # the queue filled meanwhile: keep the claim, try again later
                self._claimed.insert(0, line)
                return
            self._running[line.key] = _RunningLine(line, prepared, stream)

    def _collect(self) -> None:
        for key, running in list(self._running.items()):
            outcome = self._read(running)
            if outcome is None:
                continue
            del self._running[key]
            if outcome == "rerun":
                self.client.abort([r.request_id for r in running.prepared.requests])
            elif isinstance(outcome, APIError):
                self.client.abort([r.request_id for r in running.prepared.requests])
                self._record(running.line, outcome.status, outcome.body())
            else:
                self._record(running.line, 200, running.prepared.builder.full_response(running.finals))

    def _read(self, running: _RunningLine):
        """What the line's stream says so far: None (still running), "done", "rerun" (aborted or
        the engine died: leave it unrecorded) or the APIError of a refusal."""
        index_of = {r.request_id: i for i, r in enumerate(running.prepared.requests)}
        while (item := running.stream.get(timeout=0)) is not None:
            if isinstance(item, RequestError):
                return bad_request(str(item), param=item.field, code=item.code)
            if isinstance(item, EngineFault):
                return "rerun"
            if item.finished:
                if any(sample.finish_reason == "abort" for sample in item.outputs):
                    return "rerun"
                running.finals[index_of[item.request_id]] = item
        return "done" if len(running.finals) == len(running.prepared.requests) else None

    def _record(self, line: ClaimedLine, status_code: int, body: dict) -> None:
        result = response_line(line.batch_id, line.index, line.custom_id, status_code, body)
        is_recorded = self.store.record_result(self.worker_id, line, result, is_error=status_code != 200)
        if is_recorded and self.metrics is not None:
            counter = self.metrics.batch_lines_completed if status_code == 200 else self.metrics.batch_lines_failed
            counter.inc()

    def _drop_stopped_batches(self) -> None:
        batch_ids = {line.batch_id for line in self._held()}
        if not batch_ids:
            return
        runnable = self.store.runnable_batches(self.worker_id, batch_ids)
        self._claimed = [line for line in self._claimed if line.batch_id in runnable]
        for key, running in list(self._running.items()):
            if running.line.batch_id not in runnable:
                self.client.abort([r.request_id for r in running.prepared.requests])
                del self._running[key]

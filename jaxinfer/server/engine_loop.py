"""EngineLoop: the in-process :class:`~jaxinfer.engine_client.EngineClient`, one thread that owns the engine.

The engine is not thread-safe, so HTTP handler threads never call it. A request travels:

1. The handler validates the body and calls :meth:`EngineLoop.generate` (or :meth:`~EngineLoop.score`),
   which applies admission control (:mod:`jaxinfer.server.admission`), registers each engine
   request, and posts an ``add`` command to the inbox. It gets back an :class:`OutputStream`.
2. The loop thread drains the inbox (``add``/``abort``), calls ``engine.step()`` while there is
   work and blocks on the inbox when there is none.
3. Each ``RequestOutput`` (cumulative text and tokens per sample) goes to the stream of the
   HTTP call that owns it; the handler reads the stream and writes JSON or SSE chunks. A request
   the engine refuses puts the engine's :class:`~jaxinfer.errors.RequestError` itself on the stream.
4. When a request finishes the loop records its timing (metrics and one log line) and forgets it.

A fault in ``step()`` fails every request in flight with :class:`EngineFault` (500 / SSE error)
and marks the loop dead (``/health`` 503); nothing waits forever on a dead engine.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from jaxinfer.engine_client import (DrainingError, EngineDeadError, EngineFault, EngineRequest, NotReadyError,
                                    OutputStream)
from jaxinfer.errors import RequestError
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.server.admission import Admission, AdmissionConfig
from jaxinfer.server.request_timing import RequestTiming

logger = logging.getLogger("jaxinfer.server")


@dataclasses.dataclass
class PendingRequest:
    """A request the loop has admitted and not yet finished: where its outputs go, and its timing."""

    request: EngineRequest
    stream: OutputStream
    timing: RequestTiming
    is_scoring: bool  # score the prompt only (EngineClient.score), nothing generated
    is_waiting: bool = True  # holds an admission slot until its first output
    last_output: RequestOutput | None = None


class EngineLoop:
    """Owns the engine in one background thread; see the module docstring. An EngineClient."""

    def __init__(self, admission: AdmissionConfig | None = None, metrics=None):
        self.engine = None
        self.admission = Admission(admission or AdmissionConfig())
        self.metrics = metrics
        self.state = "loading"  # see EngineClient.state
        self._last_stats: dict = {}  # replaced whole by the loop thread, so readers never see it half-written
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, PendingRequest] = {}
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    @property
    def tokenizer(self):
        return None if self.engine is None else self.engine.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return None if self.engine is None else self.engine.max_model_len

    @property
    def kv_cache_metadata(self) -> dict | None:
        """``{"kv_cache_dtype": "auto" | "fp8", "kv_cache_storage_dtype": e.g. "float8_e4m3fn"}``
        for ``/v1/models``; None until the engine loads (and for engines that keep no EngineConfig)."""
        from jaxinfer.kv_cache_dtype import storage_dtype

        config = getattr(self.engine, "config", None)
        if getattr(config, "kv_cache_dtype", None) is None:
            return None
        stored = storage_dtype(config.kv_cache_dtype, self.engine.model.weights.embed.dtype)
        return {"kv_cache_dtype": config.kv_cache_dtype, "kv_cache_storage_dtype": stored.name}

    @property
    def quantization(self) -> str | None:
        """The weights' quantization (``"fp8"``, ``"int8"``; None: dense or not loaded yet)."""
        return getattr(getattr(self.engine, "config", None), "quantization", None)

    @property
    def activation_scales(self) -> str | None:
        """FP8 weights' activation scales (``"dynamic"``, ``"static"``; None: not FP8 or not loaded yet)."""
        return getattr(getattr(self.engine, "config", None), "activation_scales", None)

    def stats(self) -> dict:
        return {**self._last_stats, "server_num_requests_waiting": self.admission.num_waiting}

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def start(self, engine, warmup: bool = True) -> None:
        """Attach the engine (loaded elsewhere) and start the loop thread."""
        self.engine = engine
        if warmup and hasattr(engine, "warmup"):
            self.state = "warming"
            engine.warmup()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.state = "ready"
        self._thread.start()

    def generate(self, requests: list[EngineRequest]) -> OutputStream:
        """Admit one HTTP call's engine requests (all or none) and queue them for the engine."""
        return self._submit(requests, is_scoring=False)

    def score(self, requests: list[EngineRequest]) -> OutputStream:
        """As :meth:`generate`; the engine scores each prompt between steps and generates nothing."""
        return self._submit(requests, is_scoring=True)

    def _submit(self, requests: list[EngineRequest], is_scoring: bool) -> OutputStream:
        stream = OutputStream([r.request_id for r in requests])
        with self._lock:
            if self.state == "dead":
                raise EngineDeadError("the engine has failed; this server is restarting or needs a restart")
            if self.state in ("draining", "stopped"):
                raise DrainingError("the server is shutting down; retry on another replica")
            if self.state != "ready":
                raise NotReadyError(f"the server is {self.state}; retry shortly")
            self.admission.admit([len(r.prompt_token_ids) for r in requests])
            now = time.monotonic()
            for r in requests:
                timing = RequestTiming(arrival_time=now, num_prompt_tokens=len(r.prompt_token_ids),
                                       max_tokens=0 if is_scoring else r.params.max_tokens, n=r.params.n)
                self._pending[r.request_id] = PendingRequest(r, stream, timing, is_scoring)
        self._inbox.put(("add", requests))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (client gone); safe to call for finished ones."""
        self._inbox.put(("abort", list(request_ids)))

    def drain(self, timeout_s: float) -> None:
        """Stop admitting, let in-flight requests finish for ``timeout_s``, abort the rest, stop."""
        with self._lock:
            if self.state == "ready":
                self.state = "draining"
            deadline = time.monotonic() + timeout_s
            while self._pending and self.state == "draining" and time.monotonic() < deadline:
                self._lock.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            remaining = list(self._pending)
        if remaining:
            logger.warning("drain timeout: aborting %d requests", len(remaining))
            self.abort(remaining)
            with self._lock:
                end = time.monotonic() + 5.0
                while self._pending and self.state == "draining" and time.monotonic() < end:
                    self._lock.wait(timeout=0.1)
        self.stop()

    def stop(self) -> None:
        with self._lock:
            if self.state != "dead":
                self.state = "stopped"
        self._stop = True
        self._inbox.put(("wake", None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        engine = self.engine
        try:
            # An engine that has not stepped yet still reports its counters (zeros), not nothing: a
            # Ray replica the router never picked was asked for stats and answered {}. (Here, on the
            # loop's thread: the engine is only ever touched from it.)
            self._update_stats(stepped=False)
            while not self._stop:
                busy = engine.has_unfinished_requests()
                self._handle_commands(block=not busy)
                if self._stop:
                    break
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    now = time.monotonic()
                    for out in outputs:
                        self._deliver(out, now)
                    self._update_stats(stepped=True)
                elif not busy:
                    self._update_stats(stepped=False)  # idle: gauges drop to zero
            # Stopped with requests left (drain could not abort them in time): end their streams.
            with self._lock:
                left = list(self._pending.values())
            for entry in left:
                final = _aborted_output(entry)
                self._finish(entry, final, time.monotonic())
                entry.stream.put(final)
        except Exception:
            logger.exception("engine fault: failing all requests in flight")
            self._fail_all()

    def _handle_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = command
            if kind == "add":
                for r in payload:
                    self._add(r)
            elif kind == "abort":
                for request_id in payload:
                    self._abort(request_id)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, r: EngineRequest) -> None:
        with self._lock:
            entry = self._pending.get(r.request_id)
        if entry is None:
            return
        if entry.is_scoring:
            self._score(r, entry)
            return
        try:
            self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, prompt=r.prompt,
                                    arrival_time=entry.timing.arrival_time)
        except RequestError as e:
            self._reject(entry, e)
        except Exception:
            # A bug met while admitting one request fails that request, not the server: the
            # engine checks a request before it changes any state, and abort() clears whatever
            # part of it was queued.
            logger.exception("engine fault while adding a request", extra={"request_id": r.request_id})
            self.engine.abort(r.request_id)
            self._forget(r.request_id, "error")
            entry.stream.put(EngineFault("the engine failed while adding this request"))

    def _reject(self, entry: PendingRequest, error: RequestError) -> None:
        """The engine refused the request: its stream gets the engine's error itself (mapped by type)."""
        self._forget(entry.request.request_id, "rejected")
        entry.stream.put(error)

    def _score(self, r: EngineRequest, entry: PendingRequest) -> None:
        """A score-only request (max_tokens 0): the engine scores the prompt here, on the engine
        thread between steps (the engine is not thread-safe), and the request finishes at once
        without entering the scheduler. Its samples are empty, finished by "length" (OpenAI's
        answer to max_tokens 0)."""
        prompt_logprobs = None
        if r.params.prompt_logprobs is not None:
            try:
                prompt_logprobs = self.engine.score_prompt(r.prompt_token_ids, r.params.prompt_logprobs)
            except RequestError as e:
                self._reject(entry, e)
                return
        samples = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="length",
                                    logprobs=[] if r.params.logprobs is not None else None)
                   for i in range(r.params.n)]
        out = RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                            outputs=samples, finished=True, prompt_logprobs=prompt_logprobs)
        self._deliver(out, time.monotonic())

    def _abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._pending.get(request_id)
        if entry is None:
            return  # already finished
        self.engine.abort(request_id)
        # The engine may or may not report the aborted request again; the server does not wait
        # for it: the stream gets a final output built from the last one it saw.
        final = _aborted_output(entry)
        self._finish(entry, final, time.monotonic())
        entry.stream.put(final)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            entry = self._pending.get(out.request_id)
        if entry is None:
            return  # aborted already
        if entry.is_waiting:
            entry.is_waiting = False
            self.admission.release(entry.timing.num_prompt_tokens)
        is_first, itl = entry.timing.on_output(out, now)
        if self.metrics is not None:
            self.metrics.observe_output(entry.timing, is_first, itl)
        entry.last_output = out
        if out.finished:
            self._finish(entry, out, now)
        entry.stream.put(out)

    def _finish(self, entry: PendingRequest, out: RequestOutput, now: float) -> None:
        timing = entry.timing
        timing.on_finish(out, now)
        entry.stream.timings[entry.request.request_id] = timing
        self._forget(entry.request.request_id, timing.finish_reason)
        if self.metrics is not None:
            self.metrics.observe_finished(timing)
        logger.info("request finished", extra={"request_id": entry.request.log_id,
                                               "engine_request_id": entry.request.request_id,
                                               **timing.log_fields()})

    def _forget(self, request_id: str, reason: str) -> None:
        with self._lock:
            entry = self._pending.pop(request_id, None)
            if entry is not None and entry.is_waiting:
                entry.is_waiting = False
                self.admission.release(entry.timing.num_prompt_tokens)
            self._lock.notify_all()

    def _update_stats(self, stepped: bool) -> None:
        self._last_stats = self.engine.stats()
        if self.metrics is not None:
            self.metrics.update_engine_stats(self._last_stats, stepped=stepped)

    def _fail_all(self) -> None:
        with self._lock:
            self.state = "dead"
            entries = list(self._pending.values())
        if self.metrics is not None:
            self.metrics.set_state("dead")
        for entry in entries:
            self._forget(entry.request.request_id, "error")
            entry.stream.put(EngineFault("the engine failed while running this request"))


def _aborted_output(entry: PendingRequest) -> RequestOutput:
    last = entry.last_output
    r = entry.request
    if last is None:
        samples = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort",
                                    logprobs=[] if r.params.logprobs is not None else None)
                   for i in range(r.params.n)]
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             outputs=samples, finished=True)
    samples = [dataclasses.replace(s, finish_reason=s.finish_reason or "abort") for s in last.outputs]
    return dataclasses.replace(last, outputs=samples, finished=True)

"""EngineClient: what a front end needs from an engine, wherever the engine runs.

The HTTP server (``jaxinfer.server``) talks to an engine only through this interface, so the
same routes can sit in front of the engine in this process (:class:`jaxinfer.server.engine_loop.EngineLoop`,
which owns the engine in one thread), or in front of a remote one (a Ray Serve replica) through a
client that forwards these calls.

One call of a front end (an HTTP request) becomes one or more :class:`EngineRequest` s, submitted
together; their outputs come back, in arrival order, on one :class:`OutputStream`::

    stream = client.generate([EngineRequest("r-0", token_ids, params)])
    while True:
        item = stream.get(timeout=0.2)      # None: nothing yet (check the caller is still there)
        if isinstance(item, RequestError):  # the engine refused it: item.field, item.code, item.limit
            ...
        elif isinstance(item, EngineFault): # the engine failed while running it
            ...
        elif item is not None and item.finished:
            break                           # item: a RequestOutput, cumulative text and tokens
    client.abort(["r-0"])                   # the caller went away: free its pages now

``generate`` raises :class:`ServiceUnavailable` only when it cannot take the requests now. A
request the engine refuses is not raised there (it is checked on the engine's own thread, after
admission): it arrives on the stream as the engine's typed error (:mod:`jaxinfer.errors`), so
the front end maps it by type.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Callable, Protocol, runtime_checkable

from jaxinfer.errors import RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer


class EngineFault(Exception):
    """The engine failed while this request was in flight (HTTP 500); the engine is dead."""


class ServiceUnavailable(Exception):
    """The requests cannot be taken now (HTTP 503 + Retry-After); ``code`` says why."""

    code = "service_unavailable"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(ServiceUnavailable):
    code = "queue_full"


class DrainingError(ServiceUnavailable):
    code = "draining"


class NotReadyError(ServiceUnavailable):
    code = "not_ready"


class EngineDeadError(ServiceUnavailable):
    code = "engine_dead"


@dataclasses.dataclass
class EngineRequest:
    request_id: str  # unique per engine request
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    log_id: str = ""  # the caller's id for this call (the HTTP X-Request-Id), for logs


StreamItem = RequestOutput | RequestError | EngineFault


class OutputStream:
    """The outputs of one call's engine requests, in arrival order, from one queue.

    Items are :class:`RequestOutput` (cumulative: each replaces the last of its request), a
    :class:`~jaxinfer.errors.RequestError` (the engine refused that request) or an
    :class:`EngineFault`. A request's stream ends with its finished output or an error.
    """

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        # Per request id, filled as requests finish, by clients that time them (traces read it).
        self.timings: dict = {}
        self._queue: queue.Queue = queue.Queue()
        # Called after each put, from the putting thread: a reader on an event loop sets it to be
        # woken (asyncio) instead of blocking a thread in get(). Items put before it was set are
        # in the queue already: such a reader looks there after setting it.
        self.on_put: Callable[[], None] | None = None

    def put(self, item: StreamItem) -> None:
        self._queue.put(item)
        on_put = self.on_put
        if on_put is not None:
            on_put()

    def get(self, timeout: float) -> StreamItem | None:
        """The next item, or None after ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


@runtime_checkable  # isinstance checks that the methods and properties exist, not their signatures
class EngineClient(Protocol):
    """An engine as a front end sees it. Every method is safe to call from any thread."""

    @property
    def state(self) -> str:
        """"loading" -> "warming" -> "ready" -> "draining" -> "stopped", or "dead" once the engine
        failed; requests are taken only when "ready"."""

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (thread-safe); None until the engine is loaded."""

    @property
    def max_model_len(self) -> int | None:
        """Prompt plus output tokens a request may hold; None until the engine is loaded."""

    def generate(self, requests: list[EngineRequest]) -> OutputStream:
        """Admit one call's requests, all or none, and run them; their outputs come on the stream.

        Raises :class:`ServiceUnavailable` (with ``code`` and ``retry_after_s``) when the
        requests cannot be taken now: not ready, draining, dead, or too many waiting.
        """

    def score(self, requests: list[EngineRequest]) -> OutputStream:
        """As :meth:`generate`, but generate nothing: each request's one output is finished at
        once (finish reason "length", empty samples) and carries the prompt's logprobs when
        ``params.prompt_logprobs`` is set (OpenAI's ``echo`` with ``max_tokens: 0``)."""

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (the caller went away) and free their pages; their streams end
        with a finished output whose unfinished samples say "abort". Ids already finished are
        ignored."""

    def stats(self) -> dict:
        """The engine's latest counters (``Engine.stats()``: ``num_running``, ``num_waiting``,
        ``kv_cache_usage``, ...; empty before its first step) plus ``server_num_requests_waiting``,
        the requests admitted that have not produced their first output yet."""

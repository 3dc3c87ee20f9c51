"""``POST /v1/completions`` and ``POST /v1/chat/completions``: validate, submit, answer in JSON or SSE.

A handler parses the body (:mod:`jaxinfer.server.protocol`), submits one engine request per
prompt to the engine client (``generate``, or ``score`` for ``echo`` with ``max_tokens: 0``) and
reads the call's :class:`~jaxinfer.engine_client.OutputStream`. While it waits it polls waitress's
``client_disconnected``, so a client that hangs up (streaming or not) has its requests aborted and
their pages freed at once; a stream whose socket closes is also aborted when its generator is
closed. Errors on the stream are mapped by type (:func:`api_error_for`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from flask import Blueprint, Response, g, request

from jaxinfer.engine_client import EngineClient, EngineFault, EngineRequest, OutputStream, ServiceUnavailable
from jaxinfer.errors import RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.server import protocol
from jaxinfer.server.app_state import app_state, ready_client
from jaxinfer.server.errors import APIError, bad_request, engine_error, internal_error
from jaxinfer.server.responses import ResponseBuilder, sse
from jaxinfer.server.tracing import record_timing

logger = logging.getLogger("jaxinfer.server")

POLL_S = 0.2  # how often a waiting handler checks for a disconnected client
CLIENT_GONE = "client disconnected"  # the span's status when the client hung up

completion_routes = Blueprint("completions", __name__)


@completion_routes.post("/v1/completions")
def completions() -> Response:
    return _generate("completion")


@completion_routes.post("/v1/chat/completions")
def chat_completions() -> Response:
    return _generate("chat")


def api_error_for(item) -> APIError | None:
    """The HTTP error for a stream item that is not an output (None for an output).

    A refusal keeps what the engine said it is about: ``param`` is the request field at fault,
    ``code`` the reason (``context_length_exceeded`` for a prompt too long).
    """
    if isinstance(item, RequestError):
        return bad_request(str(item), param=item.field, code=item.code)
    if isinstance(item, EngineFault):
        return engine_error()
    return None


class _ClientGone(Exception):
    pass


class _Call:
    """One HTTP call's engine requests: reads their stream, aborts them if the client hangs up,
    and ends the call's trace span."""

    def __init__(self, client: EngineClient, stream: OutputStream, request_ids: list[str], span, is_disconnected):
        self.client = client
        self.stream = stream
        self.request_ids = request_ids
        self.index_of = {rid: i for i, rid in enumerate(request_ids)}
        self.span = span
        self._is_disconnected = is_disconnected
        self._last_check = time.monotonic()

    def next_item(self):
        """The stream's next item; aborts the requests and raises _ClientGone once the client has
        hung up (checked every POLL_S, whether outputs are flowing or not)."""
        while True:
            item = self.stream.get(POLL_S)
            now = time.monotonic()
            if item is None or now - self._last_check >= POLL_S:
                self._last_check = now
                if self._is_disconnected():
                    self.client.abort(self.request_ids)
                    raise _ClientGone()
            if item is not None:
                return item

    def next_output(self) -> RequestOutput:
        """The stream's next output; raises the APIError of an error item instead."""
        item = self.next_item()
        error = api_error_for(item)
        if error is None:
            return item
        if isinstance(item, RequestError):
            self.client.abort(self.request_ids)  # the call's other prompts are not answered either
        raise error

    def end_span(self, error: str | None = None) -> None:
        for timing in self.stream.timings.values():
            record_timing(self.span, timing)
        if error:
            self.span.set_status_error(error)
        self.span.end()


def _generate(kind: str) -> Response:
    state = app_state()
    client = ready_client()
    body = protocol.parse_json_body(request.get_data(cache=False))
    if kind == "chat":
        parsed = protocol.parse_chat(body, client.tokenizer, client.max_model_len, state.served_model_name,
                                     state.tool_call_parser)
    else:
        parsed = protocol.parse_completion(body, client.tokenizer, client.max_model_len, state.served_model_name)
    call_id = uuid.uuid4().hex
    requests = [EngineRequest(f"{call_id}-{i}", p.token_ids, params, prompt=p.text, log_id=g.request_id)
                for i, (p, params) in enumerate(zip(parsed.prompts, parsed.params))]
    span = state.tracer.start_span(f"POST {request.path}", {
        "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
        "gen_ai.request.model": parsed.model, "gen_ai.request.id": g.request_id,
        "gen_ai.request.max_tokens": 0 if parsed.score_only else parsed.params[0].max_tokens,
        "gen_ai.request.n": parsed.params[0].n, "gen_ai.request.temperature": parsed.params[0].temperature,
        "gen_ai.request.stream": parsed.stream}, request.headers.get("traceparent"))
    try:
        stream = client.score(requests) if parsed.score_only else client.generate(requests)
    except ServiceUnavailable as e:
        if state.metrics is not None:
            state.metrics.count_rejected(e.code)
        span.set_status_error(e.code)
        span.end()
        raise APIError(503, str(e), code=e.code, retry_after_s=e.retry_after_s) from None
    call = _Call(client, stream, [r.request_id for r in requests], span,
                 request.environ.get("waitress.client_disconnected", lambda: False))
    builder = ResponseBuilder(parsed, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{call_id}", client.tokenizer)
    if parsed.stream:
        return _event_stream(call, builder, parsed.include_usage)
    return _whole_response(call, builder)


def _whole_response(call: _Call, builder: ResponseBuilder) -> Response:
    finals: dict[int, RequestOutput] = {}
    try:
        while len(finals) < len(call.request_ids):
            out = call.next_output()
            if out.finished:
                finals[call.index_of[out.request_id]] = out
    except _ClientGone:
        call.end_span(CLIENT_GONE)
        return Response(status=499)  # nobody reads it; waitress logs it
    except APIError as e:
        call.end_span(e.code)
        raise
    call.end_span()
    return Response(json.dumps(builder.full_response(finals), ensure_ascii=False), mimetype="application/json")


def _event_stream(call: _Call, builder: ResponseBuilder, include_usage: bool) -> Response:
    # The first output is awaited here, before the 200 goes out, so a refusal or a fault is still
    # an HTTP error; later errors can only be SSE events.
    try:
        first = call.next_output()
    except _ClientGone:
        call.end_span(CLIENT_GONE)
        return Response(status=499)
    except APIError as e:
        call.end_span(e.code)
        raise
    log_id = g.request_id  # the generator runs after the request context is gone
    return Response(_events(call, builder, include_usage, first, log_id), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _events(call: _Call, builder: ResponseBuilder, include_usage: bool, first: RequestOutput, log_id: str):
    """The SSE events of a call: one chunk per output, then usage and [DONE]; an error event
    (then [DONE]) when the engine fails, refuses a later prompt, or this server has a bug."""
    done: set[str] = set()
    item, status = first, None
    try:
        while True:
            error = api_error_for(item)
            if error is not None:
                status = error.code
                yield error.sse_event()
                yield sse("[DONE]")
                return
            yield from builder.stream_chunks(call.index_of[item.request_id], item)
            if item.finished:
                done.add(item.request_id)
            if len(done) == len(call.request_ids):
                break
            item = call.next_item()
        if include_usage:
            yield builder.usage_chunk()
        yield sse("[DONE]")
    except _ClientGone:
        status = CLIENT_GONE
    except GeneratorExit:
        status = CLIENT_GONE
        raise
    except Exception:  # a server bug mid-stream: the client still gets an error event and [DONE]
        logger.exception("unexpected error while streaming", extra={"request_id": log_id})
        error = internal_error()
        status = error.code
        yield error.sse_event()
        yield sse("[DONE]")
    finally:
        if len(done) < len(call.request_ids):
            call.client.abort([rid for rid in call.request_ids if rid not in done])
        call.end_span(status)

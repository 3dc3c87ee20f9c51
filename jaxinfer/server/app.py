"""The Flask app: handlers validate, enqueue on the engine loop, and write JSON or SSE.

Handlers never call the engine; they talk to :class:`EngineLoop` (submit, abort) and read an
:class:`OutputStream`. While they wait they poll waitress's ``client_disconnected`` so a client
that hangs up (streaming or not) gets its request aborted and its pages freed at once; a stream
whose socket closes is also aborted when its generator is closed.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from jaxinfer.server import protocol
from jaxinfer.server.admission import ServiceUnavailable
from jaxinfer.server.device_metrics import DeviceCollector
from jaxinfer.server.engine_loop import EngineFault, EngineLoop, EngineRequest, RequestRejected
from jaxinfer.server.errors import APIError, bad_request, engine_error
from jaxinfer.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from jaxinfer.server.responses import ResponseBuilder, sse
from jaxinfer.server.tracing import Tracer, record_timing

logger = logging.getLogger("jaxinfer.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
POLL_S = 0.2  # how often a waiting handler checks for a disconnected client
OPEN_PATHS = {"/health", "/live", "/metrics"}  # probes and scrapers need no API key
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Request fields the engine validates itself (against the model), named first in its messages.
ENGINE_CHECKED_FIELDS = {"stop_token_ids", "min_tokens", "max_tokens", "n", "logprobs", "prompt_logprobs", "top_k",
                         "seed"}


class _ClientGone(Exception):
    pass


def _has_lone_surrogate(value) -> bool:
    """Whether a string anywhere in ``value`` (keys included) is not encodable as UTF-8."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return False


def create_app(engine_loop: EngineLoop, served_model_name: str, metrics: ServerMetrics | None = None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tracer_provider=None) -> Flask:
    app = Flask("jaxinfer.server")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    loop = engine_loop
    metrics = metrics or loop.metrics
    if metrics is not None:
        metrics.registry.register(DeviceCollector())
    tracer = Tracer(tracer_provider)
    started = int(time.time())

    @app.before_request
    def _start():
        g.start = time.monotonic()
        rid = request.headers.get("X-Request-Id", "")
        g.request_id = rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex
        if api_key and request.path not in OPEN_PATHS:
            auth = request.headers.get("Authorization", "")
            # The scheme is case-insensitive (RFC 9110), so "bearer KEY" is accepted too.
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise APIError(401, "Incorrect or missing API key (Authorization: Bearer <key>).", code="invalid_api_key")

    @app.after_request
    def _finish(response: Response):
        response.headers["X-Request-Id"] = g.get("request_id", "")
        if request.path not in OPEN_PATHS:
            logger.info("http request", extra={"request_id": g.get("request_id"), "method": request.method,
                                               "path": request.path, "status": response.status_code,
                                               "duration_s": round(time.monotonic() - g.get("start", time.monotonic()), 6)})
        return response

    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        return Response(json.dumps(e.body()), status=e.status, mimetype="application/json", headers=e.headers())

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        response = _api_error(APIError(e.code or 500, e.description or e.name, code=e.name.lower().replace(" ", "_")))
        # Keep what the exception says beyond its body: Allow on a 405 (HTTP requires it), Location
        # on a redirect.
        for name, value in e.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value
        return response

    @app.errorhandler(Exception)
    def _unexpected(e: Exception):
        logger.exception("unexpected error in a handler", extra={"request_id": g.get("request_id")})
        return _api_error(APIError(500, "internal server error; see the server log", code="internal_error"))

    def _json_body() -> dict:
        data = request.get_data(cache=False)
        try:
            body = json.loads(data or b"null")
        except (ValueError, RecursionError):
            raise bad_request("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        # JSON may escape a lone UTF-16 surrogate ("\ud800"); Python keeps it in the str, where the
        # tokenizer and the UTF-8 response writer fail on it (a 500). Only bodies with such an
        # escape are walked.
        if _SURROGATE_ESCAPE.search(data) and _has_lone_surrogate(body):
            raise bad_request("the request body is not valid JSON: a string holds a lone UTF-16 surrogate")
        return body

    def _engine():
        if loop.engine is None or loop.state in ("loading", "warming"):
            raise APIError(503, f"the server is {loop.state}; retry shortly", code="not_ready", retry_after_s=1)
        return loop.engine

    def _waiter(stream, request_ids: list[str], disconnected):
        """A function returning the stream's next item; it aborts the requests and raises
        _ClientGone once the client has hung up (checked every POLL_S, busy or not)."""
        last_check = time.monotonic()

        def next_item():
            nonlocal last_check
            while True:
                item = stream.get(POLL_S)
                now = time.monotonic()
                if item is None or now - last_check >= POLL_S:
                    last_check = now
                    if disconnected():
                        loop.abort(request_ids)
                        raise _ClientGone()
                if item is not None:
                    return item
        return next_item

    def _raise_for(item, request_ids):
        if isinstance(item, RequestRejected):
            loop.abort(request_ids)
            # The engine's messages start with the field they are about ("stop_token_ids must ...",
            # "min_tokens needs ..."); anything else is about the prompt (its length).
            message = str(item)
            field_name = message.split(" ", 1)[0]
            raise bad_request(message, param=field_name if field_name in ENGINE_CHECKED_FIELDS else "prompt")
        if isinstance(item, EngineFault):
            raise engine_error()

    def _generate(kind: str):
        engine = _engine()
        body = _json_body()
        parse = protocol.parse_chat if kind == "chat" else protocol.parse_completion
        parsed = parse(body, engine.tokenizer, engine.max_model_len, served_model_name)
        internal = uuid.uuid4().hex
        requests = [EngineRequest(f"{internal}-{i}", p.token_ids, params, prompt=p.text, log_id=g.request_id,
                                  score_only=parsed.score_only)
                    for i, (p, params) in enumerate(zip(parsed.prompts, parsed.params))]
        ids = [r.request_id for r in requests]
        index_of = {rid: i for i, rid in enumerate(ids)}
        span = tracer.start_span(f"POST {request.path}", {
            "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
            "gen_ai.request.model": parsed.model, "gen_ai.request.id": g.request_id,
            "gen_ai.request.max_tokens": 0 if parsed.score_only else parsed.params[0].max_tokens, "gen_ai.request.n": parsed.params[0].n,
            "gen_ai.request.temperature": parsed.params[0].temperature,
            "gen_ai.request.stream": parsed.stream}, request.headers.get("traceparent"))
        try:
            stream = loop.submit(requests)
        except ServiceUnavailable as e:
            if metrics is not None:
                metrics.count_rejected(e.code)
            span.set_status_error(e.code)
            span.end()
            raise APIError(503, str(e), code=e.code, retry_after_s=e.retry_after_s) from None
        disconnected = request.environ.get("waitress.client_disconnected", lambda: False)

        next_item = _waiter(stream, ids, disconnected)

        builder = ResponseBuilder(parsed, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{internal}", engine.tokenizer)

        def end_span(error: str | None = None):
            for timing in stream.timings.values():
                record_timing(span, timing)
            if error:
                span.set_status_error(error)
            span.end()

        if not parsed.stream:
            finals = {}
            try:
                while len(finals) < len(ids):
                    item = next_item()
                    _raise_for(item, ids)
                    if item.finished:
                        finals[index_of[item.request_id]] = item
            except (APIError, _ClientGone) as e:
                end_span(type(e).__name__)
                if isinstance(e, _ClientGone):
                    return Response(status=499)
                raise
            end_span()
            return Response(json.dumps(builder.full_response(finals), ensure_ascii=False), mimetype="application/json")

        try:
            first = next_item()
            _raise_for(first, ids)
        except (APIError, _ClientGone) as e:
            end_span(type(e).__name__)
            if isinstance(e, _ClientGone):
                return Response(status=499)
            raise

        log_id = g.request_id  # the generator runs after the request context is gone

        def events():
            done: set[str] = set()
            item, error = first, None
            try:
                while True:
                    if isinstance(item, Exception):
                        error = engine_error() if isinstance(item, EngineFault) else bad_request(str(item))
                        yield error.sse_event()
                        yield sse("[DONE]")
                        return
                    yield from builder.stream_chunks(index_of[item.request_id], item)
                    if item.finished:
                        done.add(item.request_id)
                    if len(done) == len(ids):
                        break
                    item = next_item()
                if parsed.include_usage:
                    yield builder.usage_chunk()
                yield sse("[DONE]")
            except _ClientGone:
                error = "client disconnected"
            except GeneratorExit:
                error = "client disconnected"
                raise
            except Exception:  # a server bug mid-stream: the client still gets an error event and [DONE]
                logger.exception("unexpected error while streaming", extra={"request_id": log_id})
                error = APIError(500, "internal server error; see the server log", code="internal_error")
                yield error.sse_event()
                yield sse("[DONE]")
            finally:
                if len(done) < len(ids):
                    loop.abort([rid for rid in ids if rid not in done])
                end_span(error if isinstance(error, str) else (error and error.code))

        return Response(events(), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    def completions():
        return _generate("completion")

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _generate("chat")

    def _model_card() -> dict:
        engine = loop.engine
        card = {"id": served_model_name, "object": "model", "created": started, "owned_by": "jaxinfer"}
        if engine is not None:
            card["max_model_len"] = engine.max_model_len
        return card

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/<path:model_id>")
    def model(model_id: str):
        if model_id != served_model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{served_model_name}'.",
                           param="model", code="model_not_found")
        return _model_card()

    @app.get("/health")
    def health():
        if loop.state == "ready":
            return {"status": "ok"}
        retry = {"Retry-After": "1"} if loop.state in ("loading", "warming") else {}
        return Response(json.dumps({"status": loop.state}), status=503, mimetype="application/json", headers=retry)

    @app.get("/live")
    def live():
        # A dead engine cannot recover in-process: failing liveness lets the orchestrator restart it.
        if loop.state == "dead":
            return Response(json.dumps({"status": "dead"}), status=503, mimetype="application/json")
        return {"status": "alive"}

    @app.get("/metrics")
    def prometheus():
        if metrics is None:
            raise APIError(404, "metrics are disabled")
        metrics.set_state(loop.state)
        metrics.server_waiting.set(loop.admission.num_waiting)
        return Response(metrics.render(), mimetype=CONTENT_TYPE_LATEST.split(";")[0],
                        headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.post("/tokenize")
    def tokenize():
        engine = _engine()
        body = _json_body()
        protocol.check_model(body, served_model_name)
        if "messages" in body:
            messages = protocol.parse_messages(body)
            add_generation_prompt = protocol.field(body, "add_generation_prompt", "bool", True)
            tokens = protocol.encode_chat(engine.tokenizer, messages, add_generation_prompt)
        else:
            prompt = protocol.field(body, "prompt", "str", None)
            if prompt is None:
                raise bad_request("'prompt' (a string) or 'messages' is required", param="prompt")
            add_special = protocol.field(body, "add_special_tokens", "bool", True)
            tokens = engine.tokenizer.encode(prompt, add_special_tokens=add_special)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    def detokenize():
        engine = _engine()
        body = _json_body()
        protocol.check_model(body, served_model_name)
        if "tokens" not in body:
            raise bad_request("'tokens' is required", param="tokens")
        tokens = protocol.token_ids(body["tokens"], "tokens", engine.tokenizer.vocab_size)
        return {"prompt": engine.tokenizer.decode(tokens)}

    return app

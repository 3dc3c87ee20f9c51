"""create_app: the Flask app, its request hooks and its error handlers, over one EngineClient.

The routes live one concept per module, each a Flask blueprint of plain functions:
:mod:`~jaxinfer.server.completion_routes` (``/v1/completions``, ``/v1/chat/completions``),
:mod:`~jaxinfer.server.model_routes` (``/v1/models``, ``/tokenize``, ``/detokenize``) and
:mod:`~jaxinfer.server.probe_routes` (``/health``, ``/live``, ``/metrics``). They reach the
engine only through the :class:`~jaxinfer.engine_client.EngineClient` in :class:`AppState`, so
the same app serves an engine in this process or a remote one.

Every error, the app's own and Flask's (404, 405, 413), leaves in OpenAI's JSON shape.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from jaxinfer.batch_api.store import BatchStore
from jaxinfer.engine_client import EngineClient
from jaxinfer.server.app_state import EXTENSION_KEY, AppState, app_state
from jaxinfer.server.batch_routes import batch_routes
from jaxinfer.server.completion_routes import completion_routes
from jaxinfer.server.device_metrics import DeviceCollector
from jaxinfer.server.errors import APIError, body_too_large, internal_error
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.model_routes import model_routes
from jaxinfer.server.probe_routes import probe_routes
from jaxinfer.server.tracing import Tracer

logger = logging.getLogger("jaxinfer.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024  # POST /v1/files: batch input files are large
OPEN_PATHS = {"/health", "/live", "/metrics"}  # probes and scrapers need no API key
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def create_app(client: EngineClient, served_model_name: str, metrics: ServerMetrics | None = None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tracer_provider=None, batch_store: BatchStore | None = None,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, tool_call_parser: str | None = None,
               batch_window_s: float | None = None) -> Flask:
    """The OpenAI-compatible app over ``client``; ``metrics`` None turns ``/metrics`` off, ``batch_store``
    None the Files and Batch API (``batch_window_s``: how long a batch's "24h" window lasts, for tests).

    ``max_body_bytes`` is checked here too (413), for WSGI servers other than the one
    :mod:`jaxinfer.server.waitress_server` configures, which answers before the app is called.
    """
    if batch_window_s is not None and not batch_window_s > 0:
        raise ValueError(f"batch_window_s must be positive, got {batch_window_s}")
    app = Flask("jaxinfer.server")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    if metrics is not None:
        metrics.registry.register(DeviceCollector())
    app.extensions[EXTENSION_KEY] = AppState(client, served_model_name, metrics, api_key, Tracer(tracer_provider),
                                             started=int(time.time()), batch_store=batch_store,
                                             max_file_bytes=max_file_bytes, tool_call_parser=tool_call_parser,
                                             batch_window_s=batch_window_s)
    app.before_request(assign_request_id_and_check_api_key)
    app.after_request(tag_and_log_response)
    app.register_error_handler(APIError, api_error_response)
    app.register_error_handler(RequestEntityTooLarge, body_too_large_response)
    app.register_error_handler(HTTPException, http_error_response)
    app.register_error_handler(Exception, unexpected_error_response)
    for routes in (completion_routes, model_routes, probe_routes):
        app.register_blueprint(routes)
    if batch_store is not None:
        app.register_blueprint(batch_routes)
    return app


def assign_request_id_and_check_api_key() -> None:
    g.start = time.monotonic()
    rid = request.headers.get("X-Request-Id", "")
    g.request_id = rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex
    api_key = app_state().api_key
    if api_key and request.path not in OPEN_PATHS:
        auth = request.headers.get("Authorization", "")
        # The scheme is case-insensitive (RFC 9110), so "bearer KEY" is accepted too.
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key (Authorization: Bearer <key>).", code="invalid_api_key")


def tag_and_log_response(response: Response) -> Response:
    response.headers["X-Request-Id"] = g.get("request_id", "")
    if request.path not in OPEN_PATHS:
        logger.info("http request", extra={"request_id": g.get("request_id"), "method": request.method,
                                           "path": request.path, "status": response.status_code,
                                           "duration_s": round(time.monotonic() - g.get("start", time.monotonic()), 6)})
    return response


def api_error_response(e: APIError) -> Response:
    return Response(json.dumps(e.body()), status=e.status, mimetype="application/json", headers=e.headers())


def body_too_large_response(e: RequestEntityTooLarge) -> Response:
    # The same answer waitress_server.JSONErrorTask gives, naming the limit (this path's: uploads have their own).
    return api_error_response(body_too_large(request.max_content_length))


def http_error_response(e: HTTPException) -> Response:
    """Flask's own errors (404 unknown path, 405, 413 past MAX_CONTENT_LENGTH) in OpenAI's shape."""
    response = api_error_response(APIError(e.code or 500, e.description or e.name,
                                           code=e.name.lower().replace(" ", "_")))
    # Keep what the exception says beyond its body: Allow on a 405 (HTTP requires it), Location
    # on a redirect.
    for name, value in e.get_headers():
        if name.lower() != "content-type":
            response.headers[name] = value
    return response


def unexpected_error_response(e: Exception) -> Response:
    logger.exception("unexpected error in a handler", extra={"request_id": g.get("request_id")})
    return api_error_response(internal_error())

"""What orchestrators and scrapers read: ``GET /health`` (readiness), ``GET /live`` (liveness), ``GET /metrics``.

These need no API key (``app.OPEN_PATHS``) and answer in every engine state, the model loading included.
"""

from __future__ import annotations

import json

from flask import Blueprint, Response

from jaxinfer.server.app_state import NOT_LOADED_STATES, app_state
from jaxinfer.server.errors import APIError
from jaxinfer.server.metrics import CONTENT_TYPE_LATEST

probe_routes = Blueprint("probes", __name__)


@probe_routes.get("/health")
def health():
    state = app_state().client.state
    if state == "ready":
        return {"status": "ok"}
    retry = {"Retry-After": "1"} if state in NOT_LOADED_STATES else {}
    return Response(json.dumps({"status": state}), status=503, mimetype="application/json", headers=retry)


@probe_routes.get("/live")
def live():
    # A dead engine cannot recover in-process: failing liveness lets the orchestrator restart it.
    if app_state().client.state == "dead":
        return Response(json.dumps({"status": "dead"}), status=503, mimetype="application/json")
    return {"status": "alive"}


@probe_routes.get("/metrics")
def prometheus() -> Response:
    state = app_state()
    if state.metrics is None:
        raise APIError(404, "metrics are disabled")
    state.metrics.set_state(state.client.state)
    state.metrics.server_waiting.set(state.client.stats()["server_num_requests_waiting"])
    return Response(state.metrics.render(), mimetype=CONTENT_TYPE_LATEST.split(";")[0],
                    headers={"Content-Type": CONTENT_TYPE_LATEST})

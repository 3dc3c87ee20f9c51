"""AppState: what every route reads (the engine client, the model's name, metrics), kept on the app.

``create_app`` stores one :class:`AppState` in ``app.extensions``; a route reaches it through
:func:`app_state` (Flask's ``current_app``), so routes are plain module functions that a reader
finds by their URL, with no closure over the app's arguments.
"""

from __future__ import annotations

import dataclasses

from flask import current_app

from jaxinfer.batch_api.store import BatchStore
from jaxinfer.engine_client import EngineClient
from jaxinfer.server.errors import APIError
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.tracing import Tracer

EXTENSION_KEY = "jaxinfer"
NOT_LOADED_STATES = ("loading", "warming")  # no tokenizer or no compiled programs yet


@dataclasses.dataclass
class AppState:
    client: EngineClient
    served_model_name: str
    metrics: ServerMetrics | None  # None: /metrics is 404
    api_key: str | None  # None: no Authorization needed
    tracer: Tracer
    started: int  # Unix time the app was made: the model card's "created"
    batch_store: BatchStore | None = None  # None: no /v1/files or /v1/batches
    max_file_bytes: int = 0  # upload limit of POST /v1/files
    tool_call_parser: str | None = None  # --tool-call-parser; None: chosen from the chat template
    # How long a batch's "24h" completion window really lasts; None: 24 h. Shorter only for tests
    # and debugging (--batch-window-s): clients still send "24h", as OpenAI's API requires.
    batch_window_s: float | None = None


def app_state() -> AppState:
    return current_app.extensions[EXTENSION_KEY]


def ready_client() -> EngineClient:
    """The engine client, once its engine is loaded and compiled; else 503 ``not_ready``.

    Only the routes that need the tokenizer or the engine call it: probes and ``/v1/models``
    answer while the model loads.
    """
    client = app_state().client
    state = client.state
    if client.tokenizer is None or state in NOT_LOADED_STATES:
        raise APIError(503, f"the server is {state}; retry shortly", code="not_ready", retry_after_s=1)
    return client

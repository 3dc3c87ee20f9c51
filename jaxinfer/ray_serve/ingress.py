"""OpenAIIngress: the OpenAI routes of ``server.py``, served by Ray Serve in front of the engine deployment.

Serve's proxy takes the HTTP request and hands it, as ASGI, to an ingress replica (the proxy
balances over them). The ingress serves the very Flask app ``server.py`` serves
(:func:`~jaxinfer.server.app.create_app`: same routes, validation, errors and SSE), through
:class:`~jaxinfer.ray_serve.wsgi_bridge.WSGIBridge`, over a
:class:`~jaxinfer.ray_serve.remote_client.RemoteEngineClient`: the routes tokenize and validate
here, and only the engine requests travel to an engine replica.

``/metrics`` is off here (the engine counters live in the replicas; Ray exports its own
metrics); ``/health`` and ``/live`` answer for the ingress.
"""

from __future__ import annotations

from jaxinfer.ray_serve.remote_client import RemoteEngineClient
from jaxinfer.ray_serve.wsgi_bridge import WSGIBridge
from jaxinfer.server.app import create_app


class OpenAIIngress:
    async def __init__(self, engine_handle, served_model_name: str, num_threads: int, retry_after_s: float,
                       api_key: str | None, max_body_bytes: int):
        """``num_threads``: HTTP calls in flight at once (each stream holds one thread to its end)."""
        description = await engine_handle.describe.remote()  # waits for a replica to be compiled
        client = RemoteEngineClient(engine_handle, description["tokenizer"], description["max_model_len"],
                                    max_streams=num_threads, retry_after_s=retry_after_s)
        app = create_app(client, served_model_name, metrics=None, api_key=api_key, max_body_bytes=max_body_bytes)
        self._asgi_app = WSGIBridge(app, num_threads)

    def __serve_build_asgi_app__(self):
        return self._asgi_app

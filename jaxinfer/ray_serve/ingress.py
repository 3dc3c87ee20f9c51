"""OpenAIIngress: the OpenAI routes of ``server.py``, served by Ray Serve in front of the engine deployment.

Serve's proxy takes the HTTP request and hands it, as ASGI, to an ingress replica (the proxy
balances over them). The ingress serves the very Flask app ``server.py`` serves
(:func:`~jaxinfer.server.app.create_app`: same routes, validation, errors and SSE), through
:class:`~jaxinfer.ray_serve.wsgi_bridge.WSGIBridge`, over a
:class:`~jaxinfer.ray_serve.remote_client.RemoteEngineClient`: the routes tokenize and validate
here, and only the engine requests travel to an engine replica.

- ``/metrics`` merges the engine replicas' and batch runners' metrics with the ingress's own
  (:class:`~jaxinfer.ray_serve.metrics.RayIngressMetrics`); ``/health`` and ``/live`` answer for
  the ingress.
- The Files and Batch API (``/v1/files``, ``/v1/batches``) is served here over the batch
  deployment's store (:mod:`jaxinfer.ray_serve.batch_replica`): with Redis the ingress opens it
  itself; with SQLite it calls the batch-runner replica, the file's one owner. Without a batch
  deployment those routes are 404.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.ray_serve.batch_replica import BatchStoreOptions, RemoteBatchStore
from jaxinfer.ray_serve.metrics import RayIngressMetrics
from jaxinfer.ray_serve.remote_client import RemoteEngineClient
from jaxinfer.ray_serve.wsgi_bridge import WSGIBridge
from jaxinfer.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILE_BYTES, create_app


@dataclasses.dataclass(frozen=True)
class IngressOptions:
    served_model_name: str
    num_threads: int  # HTTP calls in flight at once (each stream holds one thread to its end)
    retry_after_s: float
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    batch_store: BatchStoreOptions | None = None  # None: no Files and Batch API
    batch_window_s: float | None = None  # tests: how long a batch's "24h" window lasts
    tool_call_parser: str | None = None  # --tool-call-parser; None: chosen from the chat template


class OpenAIIngress:
    async def __init__(self, engine_handle, batch_handle, options: IngressOptions):
        """``batch_handle``: the batch-runner deployment's (None without the Batch API)."""
        description = await engine_handle.describe.remote()  # waits for a replica to be compiled
        client = RemoteEngineClient(engine_handle, description["tokenizer"], description["max_model_len"],
                                    max_streams=options.num_threads, retry_after_s=options.retry_after_s)
        metrics = RayIngressMetrics(options.served_model_name, description["max_model_len"], engine_handle,
                                    batch_handle)
        batch_store = None
        if options.batch_store is not None:
            batch_store = (options.batch_store.open() if options.batch_store.redis_url
                           else RemoteBatchStore(batch_handle))
        app = create_app(client, options.served_model_name, metrics=metrics, api_key=options.api_key,
                         max_body_bytes=options.max_body_bytes, batch_store=batch_store,
                         max_file_bytes=options.max_file_bytes, batch_window_s=options.batch_window_s,
                         tool_call_parser=options.tool_call_parser)
        self._asgi_app = WSGIBridge(app, options.num_threads)

    def __serve_build_asgi_app__(self):
        return self._asgi_app

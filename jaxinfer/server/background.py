"""Serve an engine from the current process, in background threads.

``python server.py`` and ``jaxinfer serve`` own their process: they load the model, install
signal handlers and drain on SIGTERM. In a notebook, or on a TPU VM where only one process
may open the chips, the model is already loaded; ``BackgroundServer(llm.engine)`` serves it
(the same Flask app, engine loop and waitress server) until ``stop()``::

    server = BackgroundServer(llm.engine, served_model_name="smollm2-135m-instruct")
    ...  # http://127.0.0.1:<port>/v1/... at server.base_url
    server.stop()

While it runs, the engine belongs to the server's engine thread: do not call
``llm.generate`` until it is stopped. Given a ``batch_store``, it also serves the Files and Batch
API and runs batches in a third thread (:class:`~jaxinfer.server.batch_runner.BatchRunner`).
"""

from __future__ import annotations

import threading

from jaxinfer.server.batch_runner import BatchRunner, BatchRunnerConfig
from jaxinfer.batch_api.store import BatchStore
from jaxinfer.server.admission import AdmissionConfig
from jaxinfer.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILE_BYTES, create_app
from jaxinfer.server.batch_routes import FILES_PATH
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.waitress_server import create_waitress_server, serve_forever


class BackgroundServer:
    def __init__(
        self,
        engine=None,
        *,
        served_model_name: str = "model",
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        admission: AdmissionConfig | None = None,
        threads: int = 96,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        tracer_provider=None,
        warmup: bool = True,
        max_model_len: int | None = None,
        batch_store: BatchStore | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        batch_runner: BatchRunnerConfig | None = None,
        tool_call_parser: str | None = None,
        batch_window_s: float | None = None,
    ):
        """Listen on ``host:port`` (port 0: a free one) and, given an ``engine``, serve it; returns once ready.

        Without an engine, ``/health`` says "loading" until :meth:`start` (``run_server`` loads
        the model meanwhile); ``max_model_len`` then sizes the token histograms.
        """
        self.engine = engine
        self.model = served_model_name
        self.metrics = ServerMetrics(served_model_name, max_model_len or engine.max_model_len)
        self.loop = EngineLoop(admission, self.metrics)
        self.app = create_app(self.loop, served_model_name, self.metrics, api_key=api_key,
                              max_body_bytes=max_body_bytes, tracer_provider=tracer_provider,
                              batch_store=batch_store, max_file_bytes=max_file_bytes,
                              tool_call_parser=tool_call_parser, batch_window_s=batch_window_s)
        self.server = create_waitress_server(self.app, host, port, threads, max_body_bytes,
                                             path_body_limits={FILES_PATH: max_file_bytes} if batch_store else None)
        # The runner waits for the engine to be ready by itself, so it starts with the HTTP server.
        self.batch_runner = (None if batch_store is None else
                             BatchRunner(batch_store, self.loop, served_model_name, self.metrics, batch_runner))
        if self.batch_runner is not None:
            self.batch_runner.start()
        self.base_url = f"http://{host}:{self.server.effective_port}"
        self._thread = threading.Thread(target=serve_forever, args=(self.server,), name="waitress", daemon=True)
        self._thread.start()
        if engine is not None:
            self.start(engine, warmup)

    def start(self, engine, warmup: bool = True) -> None:
        """Serve ``engine`` (compiling it first unless ``warmup`` is False); /health says "warming" meanwhile."""
        self.engine = engine
        self.loop.start(engine, warmup=warmup)
        self.metrics.set_state(self.loop.state)

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop: let requests in flight finish for up to ``drain_timeout_s``, abort the rest, close."""
        if self.batch_runner is not None:  # first: its lines in flight are aborted unrecorded, not answered "abort"
            self.batch_runner.stop()
        if drain_timeout_s > 0:
            self.loop.drain(drain_timeout_s)
        self.loop.stop()
        self.server.close()

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""jaxinfer's OpenAI-compatible HTTP server (see docs/SERVER.md).

    python server.py --model smollm2-135m-instruct --port 8000

Modules: ``serve`` (command line, SIGTERM), ``background`` (serve an engine from background threads:
the command line, a notebook, a test), ``waitress_server`` (the WSGI server and its JSON errors),
``app`` (the Flask app, hooks, error handlers) over ``app_state``, with the routes in
``completion_routes``, ``model_routes`` and ``probe_routes``; ``protocol`` (request validation),
``responses`` (response bodies), ``engine_loop`` (the engine's thread: the in-process
``jaxinfer.engine_client.EngineClient``), ``admission`` (the bounded waiting queue),
``metrics``/``device_metrics`` (Prometheus), ``request_timing``, ``json_logging``, ``tracing``
(OpenTelemetry), ``errors``; the Batch API's ``batch_routes``, ``batch_runner`` and
``batch_line_requests`` (over the stores of ``jaxinfer.batch_api``).
"""

from jaxinfer.server.app import create_app
from jaxinfer.server.background import BackgroundServer
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.serve import add_serve_arguments, run_server

__all__ = ["BackgroundServer", "create_app", "EngineLoop", "add_serve_arguments", "run_server"]

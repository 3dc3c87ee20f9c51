"""jaxinfer's OpenAI-compatible HTTP server (see docs/SERVER.md).

    python server.py --model smollm2-135m-instruct --port 8000

Modules: ``serve`` (command line, waitress, SIGTERM), ``app`` (Flask handlers), ``protocol``
(request validation), ``responses`` (response bodies), ``engine_loop`` (the engine's thread),
``admission`` (the bounded waiting queue), ``metrics``/``device_metrics`` (Prometheus),
``request_timing``, ``json_logging``, ``tracing`` (OpenTelemetry), ``errors``, ``background``
(serve an already-loaded engine from a notebook or test).
"""

from jaxinfer.server.app import create_app
from jaxinfer.server.background import BackgroundServer
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.serve import add_serve_arguments, run_server

__all__ = ["BackgroundServer", "create_app", "EngineLoop", "add_serve_arguments", "run_server"]

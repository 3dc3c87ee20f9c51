"""Command line and process life: load the engine, serve with waitress, drain on SIGTERM.

``python server.py ...`` and ``jaxinfer serve ...`` both call :func:`run_server`, which owns the
process (signals, drain) and serves through :class:`~jaxinfer.server.background.BackgroundServer`,
started before the model loads so ``/health`` can say so. The WSGI server is waitress, configured
in :mod:`jaxinfer.server.waitress_server`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

from jaxinfer.engine_args import add_engine_arguments, engine_options_from_args
from jaxinfer.engine_config import EngineConfig
from jaxinfer.gc_freeze import freeze_startup_heap
from jaxinfer.server.admission import (DEFAULT_MAX_WAITING_PROMPT_TOKENS, DEFAULT_MAX_WAITING_REQUESTS,
                                       DEFAULT_RETRY_AFTER_S, AdmissionConfig)
from jaxinfer.batch_api import open_batch_store
from jaxinfer.batch_api.sqlite_store import DEFAULT_LEASE_S
from jaxinfer.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILE_BYTES
from jaxinfer.server.background import BackgroundServer
from jaxinfer.server.json_logging import configure_logging
from jaxinfer.server.tracing import otlp_tracer_provider
from jaxinfer.tool_parsers import PARSERS

logger = logging.getLogger("jaxinfer.server")

DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="smollm2-135m-instruct", help="built-in name, Hugging Face directory or .gguf file")
    a("--served-model-name", default=None, help="the model id clients send (default: the model's short name)")
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    a("--port", type=int, default=8000)
    a("--api-key", default=os.environ.get("JAXINFER_API_KEY"),
      help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize (default: $JAXINFER_API_KEY, else none)")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    # The engine's flags and defaults are LLM's (jaxinfer.engine_config): no server-only default.
    add_engine_arguments(parser)
    a("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
      help="admitted requests not yet scheduled; past it new requests get 503 + Retry-After")
    a("--max-waiting-prompt-tokens", type=int, default=DEFAULT_MAX_WAITING_PROMPT_TOKENS,
      help="prompt tokens of the waiting requests; past it new requests get 503 + Retry-After")
    a("--retry-after", type=float, default=DEFAULT_RETRY_AFTER_S, help="Retry-After seconds on 503")
    a("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
      help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    a("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="request body size limit (413 past it)")
    a("--server-threads", type=int, default=None,
      help="waitress threads (default: the engine's max-num-seqs + max-waiting-requests + 16)")
    a("--otlp-traces-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
      help="OTLP/HTTP endpoint for OpenTelemetry traces (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    a("--log-level", default="info")
    a("--coordinator-address", default=None,
      help="multi-host: host:port of process 0 (jax.distributed); every process gets the same flags")
    a("--num-processes", type=int, default=1, help="multi-host: number of processes")
    a("--process-id", type=int, default=0, help="multi-host: this process's index; 0 serves HTTP")
    a("--batch-db", default=None,
      help="SQLite file of the Batch API's files and jobs (default: batches.sqlite3 in jaxinfer's cache directory)")
    a("--batch-redis", default=None,
      help="redis://host:port/db: keep Batch API files and jobs in Redis, one queue for several servers")
    a("--batch-lease-s", type=float, default=DEFAULT_LEASE_S,
      help="seconds a dead server's batch work stays claimed before another server (or its restart) takes it")
    a("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES,
      help="upload size limit of POST /v1/files (413 past it)")
    a("--tool-call-parser", default=None, choices=sorted(PARSERS),
      help="the format the model writes tool calls in (default: from the chat template's markers; "
           "a template without tools is taught the hermes format)")
    a("--batch-window-s", type=float, default=None,
      help="testing/debugging: how many seconds a batch's \"24h\" completion window lasts before it expires")


def default_served_name(model: str) -> str:
    """``smollm2-135m-instruct`` stays; a path becomes its directory name or file stem."""
    path = Path(model)
    if path.suffix == ".gguf":
        return path.stem
    return path.name or str(model)


def build_engine(args: argparse.Namespace):
    """The real engine for ``args``, built by ``jaxinfer.engine_factory`` as ``LLM``'s is.

    Compilation is left to the server's warm-up phase (``engine.warmup()``), so ``/health``
    can say ``warming`` meanwhile.
    """
    from jaxinfer import engine_factory
    from jaxinfer.activation_calibration import apply_activation_scales
    from jaxinfer.checkpoint import load_model
    from jaxinfer.kv_cache_dtype import check_kv_cache_dtype_supported

    check_kv_cache_dtype_supported(args.kv_cache_dtype)  # a device without FP8 refuses before the weights load
    # --activation-scales static takes the checkpoint's scales: a compressed-tensors FP8 one's, or those
    # `jaxinfer convert --calibration-file` stored (jaxinfer.activation_calibration).
    loaded = apply_activation_scales(load_model(args.model, args.dtype, quantization=args.quantization),
                                     args.activation_scales)
    engine = engine_factory.build_engine(
        loaded, engine_config_from_args(args),
        warm_up=False,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
    )
    if args.num_processes > 1:
        from jaxinfer import distributed

        if distributed.is_leader():
            distributed.lead(engine)  # process 0: every step's inputs go to the other processes
    return engine


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_options_from_args(args))


def default_server_threads(args: argparse.Namespace) -> int:
    """One waitress thread for every request the engine runs or keeps waiting, and a few for probes."""
    return engine_config_from_args(args).for_platform().max_num_seqs + args.max_waiting_requests + 16


def run_server(args: argparse.Namespace, engine_factory=build_engine) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return 0."""
    configure_logging(args.log_level)
    if getattr(args, "num_processes", 1) > 1:
        from jaxinfer import distributed

        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        if not distributed.is_leader():
            distributed.follow(engine_factory(args))  # no HTTP here: run process 0's steps until it stops
            return 0
    served = args.served_model_name or default_served_name(args.model)
    threads = args.server_threads or default_server_threads(args)
    admission = AdmissionConfig(args.max_waiting_requests, args.max_waiting_prompt_tokens, args.retry_after)
    tracer_provider = otlp_tracer_provider(args.otlp_traces_endpoint) if args.otlp_traces_endpoint else None
    batch_store = open_batch_store(args.batch_db, args.batch_redis, args.batch_lease_s)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # HTTP first, the engine after: /health answers "loading" while the model loads.
    # max_model_len is unknown before the engine loads; the token histograms' top bucket uses the flag or 128k.
    http = BackgroundServer(
        served_model_name=served, host=args.host, port=args.port, api_key=args.api_key, admission=admission,
        threads=threads, max_body_bytes=args.max_body_bytes, tracer_provider=tracer_provider,
        max_model_len=args.max_model_len or 131072,
        batch_store=batch_store, max_file_bytes=args.max_file_bytes, tool_call_parser=args.tool_call_parser,
        batch_window_s=args.batch_window_s,
    )
    loop, server = http.loop, http.server
    logger.info("listening (loading the model)", extra={"host": args.host, "port": server.effective_port,
                                                       "model": args.model, "served_model_name": served})
    try:
        engine = engine_factory(args)
    except Exception:
        logger.exception("could not load the engine")
        http.batch_runner.stop()
        server.close()
        batch_store.close()
        return 1
    if not stop.is_set():
        http.start(engine)
        # This process lives to serve this engine: keep the start-up heap out of full collections,
        # whose ~100 ms pauses would land inside engine steps (jaxinfer/gc_freeze.py).
        frozen = freeze_startup_heap()
        config = getattr(engine, "config", None)
        logger.info("ready", extra={"max_model_len": engine.max_model_len, "threads": threads,
                                  "quantization": getattr(config, "quantization", None),
                                  "activation_scales": getattr(config, "activation_scales", None),
                                  "gc_frozen_objects": frozen})
    while not stop.wait(0.5):
        pass
    logger.info("draining", extra={"in_flight": loop.num_in_flight(), "timeout_s": args.drain_timeout})
    http.batch_runner.stop()  # its lines in flight are left unrecorded: they run again after a restart
    loop.drain(args.drain_timeout)
    if getattr(args, "num_processes", 1) > 1 and loop.engine is not None:  # the loop thread has stopped
        from jaxinfer import distributed

        distributed.stop_followers(loop.engine)
    # Let the handlers write their last chunks before the sockets close.
    deadline = time.monotonic() + 2.0
    while server.task_dispatcher.active_count and time.monotonic() < deadline:
        time.sleep(0.05)
    server.close()
    batch_store.close()
    if tracer_provider is not None:
        tracer_provider.shutdown()
    logger.info("stopped")
    return 0

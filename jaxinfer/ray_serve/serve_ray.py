"""``jaxinfer serve-ray``: start (or join) a Ray cluster and serve the model through Ray Serve.

::

    jaxinfer serve-ray --model smollm2-135m-instruct --host 0.0.0.0 --port 8000 --min-replicas 1 --max-replicas 4

``build_app`` builds the same application from a dict of the same flags (by destination name),
for ``serve run deploy/ray/serve_config.yaml``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from jaxinfer.engine_args import add_engine_arguments, engine_options_from_args
from jaxinfer.engine_config import EngineConfig
from jaxinfer.batch_api.sqlite_store import DEFAULT_LEASE_S
from jaxinfer.ray_serve.config import ROUTERS, BatchStoreOptions, ModelSpec, RayServeConfig
from jaxinfer.server.admission import (DEFAULT_MAX_WAITING_PROMPT_TOKENS, DEFAULT_MAX_WAITING_REQUESTS,
                                       DEFAULT_RETRY_AFTER_S, AdmissionConfig)
from jaxinfer.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILE_BYTES
from jaxinfer.server.serve import default_served_name
from jaxinfer.tool_parsers import PARSERS

APP_NAME = "jaxinfer"
# Serve's low-latency path (--low-latency; docs/RAY.md, benchmarks/results/ray_overhead.cpu.md:
# the median TTFT overhead fell from 21 to 7 ms): HAProxy sends HTTP straight into the ingress
# replica, and Serve's system code shares the replica's event loop. The router keeps its own
# loop: the ingress calls handles from its WSGI threads. Ray reads them when the cluster starts,
# so they apply to a cluster this command starts; set them on `ray start` for one it joins.
LOW_LATENCY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                   "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}


def add_serve_ray_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="smollm2-135m-instruct", help="built-in name, Hugging Face directory or .gguf file")
    a("--served-model-name", default=None, help="the model id clients send (default: the model's short name)")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    a("--host", default="127.0.0.1", help="address Serve's HTTP proxy binds (default 127.0.0.1: local only)")
    a("--port", type=int, default=8000)
    a("--api-key", default=os.environ.get("JAXINFER_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1/*")
    a("--tool-call-parser", default=None, choices=sorted(PARSERS),
      help="the format the model writes tool calls in (default: from the chat template's markers)")
    add_engine_arguments(parser)
    r = parser.add_argument_group("ray", "replicas, autoscaling and routing (docs/RAY.md)").add_argument
    r("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    r("--min-replicas", type=int, default=1)
    r("--max-replicas", type=int, default=1)
    r("--accelerator", choices=["auto", "gpu", "tpu", "cpu"], default="auto",
      help="what a replica reserves: tensor-parallel-size GPUs or TPU chips (default: what the cluster has)")
    r("--num-cpus-per-replica", type=float, default=1.0)
    r("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
      help="per replica: admitted requests without a first token; past it 503 + Retry-After")
    r("--max-waiting-prompt-tokens", type=int, default=DEFAULT_MAX_WAITING_PROMPT_TOKENS)
    r("--retry-after", type=float, default=DEFAULT_RETRY_AFTER_S, help="Retry-After seconds on 503")
    r("--max-queued-requests", type=int, default=256,
      help="calls Serve queues when every replica is full; past it 503 + Retry-After")
    r("--max-waiting-per-replica", type=float, default=4.0, help="autoscaling: scale up past this queue per replica")
    r("--kv-usage-high", type=float, default=0.8, help="autoscaling: scale up past this mean KV cache usage")
    r("--kv-usage-low", type=float, default=0.5, help="autoscaling: scale down only under this (and no queue)")
    r("--upscale-delay", type=float, default=10.0, help="seconds a scale-up decision must hold")
    r("--downscale-delay", type=float, default=60.0, help="seconds a scale-down decision must hold")
    r("--look-back-period", type=float, default=15.0, help="seconds the replicas' metrics are averaged over")
    r("--metrics-interval", type=float, default=2.0, help="seconds between a replica's metric pushes")
    r("--router", choices=ROUTERS, default="prefix", help="how calls pick an engine replica")
    r("--low-latency", action="store_true",
      help="Serve's HAProxy with direct ingress and its throughput-optimized mode (a cluster this command starts); "
           "HAProxy also listens on *:8404 (stats) and *:9101 (metrics)")
    r("--ingress-threads", type=int, default=None,
      help="HTTP calls in flight per ingress replica (default: every engine replica's max ongoing + Serve's queue)")
    r("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    b = parser.add_argument_group("batch", "the Files and Batch API under Ray (docs/RAY.md)").add_argument
    b("--batch-db", default=None,
      help="SQLite file of the Batch API, owned by one batch-runner replica (default: batches.sqlite3 in "
           "jaxinfer's cache directory on that replica's node)")
    b("--batch-redis", default=None,
      help="redis://host:port/db: the Batch API's queue in Redis, shared by every ingress and batch runner")
    b("--batch-runners", type=int, default=1, help="batch-runner replicas (more than 1 needs --batch-redis)")
    b("--batch-lease-s", type=float, default=DEFAULT_LEASE_S,
      help="seconds a dead runner's batch work stays claimed before another runner takes it")
    b("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES,
      help="upload size limit of POST /v1/files (413 past it)")
    b("--batch-window-s", type=float, default=None,
      help="testing/debugging: how many seconds a batch's \"24h\" completion window lasts before it expires")
    b("--no-batch-api", action="store_true", help="serve no /v1/files or /v1/batches (no batch-runner replica)")


def config_from_args(args: argparse.Namespace, accelerator: str) -> RayServeConfig:
    """The deployments' sizes for ``args`` on a cluster of ``accelerator`` s ("gpu", "tpu" or "cpu")."""
    engine_config = EngineConfig(**engine_options_from_args(args))
    tp = args.tensor_parallel_size
    return RayServeConfig(
        served_model_name=args.served_model_name or default_served_name(args.model),
        max_num_seqs=engine_config.for_platform(accelerator).max_num_seqs,
        admission=AdmissionConfig(args.max_waiting_requests, args.max_waiting_prompt_tokens, args.retry_after),
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        num_cpus_per_replica=args.num_cpus_per_replica,
        num_gpus_per_replica=tp if accelerator == "gpu" else 0, num_tpus_per_replica=tp if accelerator == "tpu" else 0,
        max_queued_requests=args.max_queued_requests, max_waiting_per_replica=args.max_waiting_per_replica,
        kv_usage_high=args.kv_usage_high, kv_usage_low=args.kv_usage_low,
        upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
        look_back_period_s=args.look_back_period, metrics_interval_s=args.metrics_interval, router=args.router,
        page_size=engine_config.for_platform(accelerator).page_size,
        ingress_threads=args.ingress_threads, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        batch_store=None if args.no_batch_api else BatchStoreOptions(
            args.batch_db, args.batch_redis, args.batch_lease_s, args.batch_runners),
        max_file_bytes=args.max_file_bytes, batch_window_s=args.batch_window_s,
        tool_call_parser=args.tool_call_parser,
    )


def model_spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """One replica's engine; raises ValueError for flags that have no meaning per replica (before
    any cluster is started)."""
    if args.data_parallel_size != 1:
        raise ValueError("under Ray, data parallelism is replicas: use --min-replicas/--max-replicas, "
                         "not --data-parallel-size")
    return ModelSpec(args.model, args.dtype, EngineConfig(**engine_options_from_args(args)), args.tensor_parallel_size)


def cluster_accelerator(requested: str) -> str:
    """``requested``, or for "auto" what the connected Ray cluster offers (checked without
    touching a device here: the driver must not take the accelerators the replicas need)."""
    import ray

    if requested != "auto":
        return requested
    resources = ray.cluster_resources()
    return "gpu" if resources.get("GPU") else "tpu" if resources.get("TPU") else "cpu"


def build_app(args: dict):
    """The application for ``serve run``: ``args`` holds ``serve-ray`` flags by destination name."""
    from jaxinfer.ray_serve.application import build_application

    parser = argparse.ArgumentParser(prog="serve_config.yaml args")
    add_serve_ray_arguments(parser)
    namespace = parser.parse_args([])
    unknown = set(args) - set(vars(namespace))
    if unknown:
        raise ValueError(f"unknown args {sorted(unknown)}; use the serve-ray flags' names, e.g. min_replicas")
    vars(namespace).update(args)
    spec = model_spec_from_args(namespace)
    return build_application(spec, config_from_args(namespace, cluster_accelerator(namespace.accelerator)))


def run_serve_ray(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then shut Serve down (the replicas drain their calls)."""
    import ray
    from ray import serve

    from jaxinfer.ray_serve.application import build_application

    spec = model_spec_from_args(args)
    if args.ray_address is None:
        for name, value in {**(LOW_LATENCY_ENV if args.low_latency else {}), "RAY_USAGE_STATS_ENABLED": "0"}.items():
            os.environ.setdefault(name, value)
    ray.init(address=args.ray_address, include_dashboard=False)
    config = config_from_args(args, cluster_accelerator(args.accelerator))
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(spec, config), name=APP_NAME, route_prefix="/")
    print(f"serving {config.served_model_name} at http://{args.host}:{args.port}/v1", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0

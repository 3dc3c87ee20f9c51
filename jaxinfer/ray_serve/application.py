"""build_application: the two Serve deployments, bound into one application.

::

    HTTP -> Serve proxy -> OpenAIIngress replica (Flask routes, tokenizer)
                             | handle.options(stream=True).generate(...)   routed by PrefixAwareRouter
                             v
                           EngineReplica x [min_replicas, max_replicas]    QueueAutoscalingPolicy
                             ^ the same handle and router, at low priority
                           BatchRunnerReplica (Batch API: SQLite owner x 1, or Redis consumers x N)

``jaxinfer serve-ray`` and ``serve run deploy/ray/serve_config.yaml`` build it from flags
(:mod:`jaxinfer.ray_serve.serve_ray`).
"""

from __future__ import annotations

from typing import Callable

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, BackpressureConfig, RequestRouterConfig

from jaxinfer.ray_serve.autoscaling import QueueAutoscalingPolicy
from jaxinfer.ray_serve.batch_replica import BatchRunnerReplica
from jaxinfer.ray_serve.config import RayServeConfig
from jaxinfer.ray_serve.engine_replica import EngineReplica
from jaxinfer.ray_serve.ingress import IngressOptions, OpenAIIngress
from jaxinfer.ray_serve.prefix_router import PrefixAwareRouter

ENGINE_DEPLOYMENT = "JaxinferEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
BATCH_DEPLOYMENT = "JaxinferBatchRunner"
# Serve's access log writes lines per call on each hop; the routes log each request once already.
QUIET_LOGGING = {"enable_access_log": False}
ROUTER_CLASSES = {
    "prefix": PrefixAwareRouter,
    "round-robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
    "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}


def build_application(build_engine: Callable[[], object], config: RayServeConfig):
    """The ingress bound to the engine deployment; ``build_engine`` runs in each engine replica."""
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT,
        ray_actor_options=engine_actor_options(config),
        max_ongoing_requests=config.engine_max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        autoscaling_config=autoscaling_config(config),
        request_router_config=request_router_config(config),
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        logging_config=QUIET_LOGGING,
        # Serve's own 503 past max_queued_requests carries Retry-After natively (Ray 2.60's
        # BackpressureConfig); the ingress turns it into the routes' OpenAI-shaped 503 with the same header.
        backpressure_config=BackpressureConfig(retry_after_s=config.admission.retry_after_s),
    ).bind(build_engine, config.admission, config.served_model_name)
    batch_runner = None
    if config.batch_store is not None:
        batch_runner = serve.deployment(BatchRunnerReplica).options(
            name=BATCH_DEPLOYMENT,
            num_replicas=config.batch_store.num_runners,
            ray_actor_options={"num_cpus": config.batch_num_cpus},
            logging_config=QUIET_LOGGING,
        ).bind(engine, config.batch_store, config.served_model_name, config.batch_runner,
               config.admission.retry_after_s)
    num_threads = config.ingress_threads_needed()
    ingress = serve.deployment(serve.ingress()(OpenAIIngress)).options(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        max_ongoing_requests=num_threads,
        logging_config=QUIET_LOGGING,
    )
    return ingress.bind(engine, batch_runner, IngressOptions(
        config.served_model_name, num_threads, config.admission.retry_after_s, config.api_key,
        config.max_body_bytes, config.max_file_bytes, config.batch_store, config.batch_window_s,
        config.tool_call_parser))


def engine_actor_options(config: RayServeConfig) -> dict:
    options: dict = {"num_cpus": config.num_cpus_per_replica, "num_gpus": config.num_gpus_per_replica}
    if config.num_tpus_per_replica:
        options["resources"] = {"TPU": config.num_tpus_per_replica}
    return options


def autoscaling_config(config: RayServeConfig) -> AutoscalingConfig:
    return AutoscalingConfig(
        min_replicas=config.min_replicas, max_replicas=config.max_replicas,
        upscale_delay_s=config.upscale_delay_s, downscale_delay_s=config.downscale_delay_s,
        look_back_period_s=config.look_back_period_s, metrics_interval_s=config.metrics_interval_s,
        policy=AutoscalingPolicy(policy_function=QueueAutoscalingPolicy, policy_kwargs={
            "max_waiting_per_replica": config.max_waiting_per_replica,
            "kv_usage_high": config.kv_usage_high, "kv_usage_low": config.kv_usage_low}),
    )


def request_router_config(config: RayServeConfig) -> RequestRouterConfig:
    kwargs = {"page_size": config.page_size, "max_imbalance": config.max_imbalance} if config.router == "prefix" else {}
    return RequestRouterConfig(request_router_class=ROUTER_CLASSES[config.router], request_router_kwargs=kwargs)

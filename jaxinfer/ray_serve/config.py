"""ModelSpec (how an engine replica builds its engine) and RayServeConfig (how the deployments are sized).

Every value is explicit here and derives from the engine's own limits, so the queue forms where
the autoscaler can see it:

- an engine replica takes ``max_ongoing_requests = max_num_seqs + max_waiting_requests`` calls:
  the engine runs ``max_num_seqs`` and its admission queue holds the rest, whose length the
  replica reports (with fewer, the calls would wait in Serve's handle queue instead and the
  replica's queue would never grow);
- past that, Serve's own queue holds ``max_queued_requests`` calls per deployment, then answers
  503 (``queue_full``, with ``Retry-After``);
- the ingress holds a WSGI thread per call in flight: every replica's ``max_ongoing_requests``,
  plus Serve's queue, plus a few for probes.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine_config import EngineConfig
from jaxinfer.server.admission import AdmissionConfig
from jaxinfer.server.app import DEFAULT_MAX_BODY_BYTES

NUM_PROBE_THREADS = 16  # ingress threads kept for /health, /v1/models and the like under load
ROUTERS = ("prefix", "round-robin", "power-of-two")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Builds one replica's engine, as ``jaxinfer serve`` does (weights loaded in the replica)."""

    model: str
    dtype: str = "auto"
    engine_config: EngineConfig = EngineConfig()
    tensor_parallel_size: int = 1

    def __call__(self):
        from jaxinfer import engine_factory
        from jaxinfer.checkpoint import load_model

        # Compiled by the replica's EngineLoop.start (warmup), before Serve routes to it.
        loaded = load_model(self.model, self.dtype, quantization=self.engine_config.quantization)
        return engine_factory.build_engine(loaded, self.engine_config, warm_up=False,
                                           tensor_parallel_size=self.tensor_parallel_size, use_tqdm=False)


@dataclasses.dataclass(frozen=True)
class RayServeConfig:
    served_model_name: str
    max_num_seqs: int  # the engine's (resolved for the platform): sizes max_ongoing_requests
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    min_replicas: int = 1
    max_replicas: int = 1
    # Each replica's Ray resources: num_gpus = tensor-parallel size on GPUs, {"TPU": chips} on TPUs.
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    num_tpus_per_replica: int = 0
    ingress_num_cpus: float = 1.0
    max_queued_requests: int = 256
    # Autoscaling (jaxinfer.ray_serve.autoscaling): the rule's thresholds and Serve's delays.
    max_waiting_per_replica: float = 4.0
    kv_usage_high: float = 0.8
    kv_usage_low: float = 0.5
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float = 15.0  # must exceed metrics_interval_s
    # How often a replica pushes its metrics to Serve's controller. Serve 2.60 marks the field
    # deprecated (for environment variables it does not read yet) but still pushes at this
    # interval, 10 s by default: too slow to follow a queue.
    metrics_interval_s: float = 2.0
    # A replica being removed lets its calls finish for this long (every request answered).
    graceful_shutdown_timeout_s: float = 120.0
    router: str = "prefix"
    page_size: int = 32  # the engine's: the prefix router hashes prompts in pages of this size
    max_imbalance: int = 8  # prefix router: how much busier than the least loaded the owner may be
    ingress_threads: int | None = None  # default: ingress_threads_needed()
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self):
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas})")
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r} is not one of {ROUTERS}")

    @property
    def engine_max_ongoing_requests(self) -> int:
        return self.max_num_seqs + self.admission.max_waiting_requests

    def ingress_threads_needed(self) -> int:
        return (self.ingress_threads or
                self.max_replicas * self.engine_max_ongoing_requests + self.max_queued_requests + NUM_PROBE_THREADS)

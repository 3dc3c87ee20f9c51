"""ModelSpec (how an engine replica builds its engine) and RayServeConfig (how the deployments are sized).

Every value is explicit here and derives from the engine's own limits, so the queue forms where
the autoscaler can see it:

- an engine replica takes ``max_ongoing_requests = max_num_seqs + max_waiting_requests + 4``
  calls: the engine runs ``max_num_seqs`` and its admission queue holds the rest, whose length
  the replica reports (with fewer, the calls would wait in Serve's handle queue instead and the
  replica's queue would never grow); the 4 are for control calls (:data:`NUM_CONTROL_SLOTS`);
- past that, Serve's own queue holds ``max_queued_requests`` calls per deployment, then answers
  503 (``queue_full``, with ``Retry-After``);
- the ingress holds a WSGI thread per call in flight: every replica's ``max_ongoing_requests``,
  plus Serve's queue, plus a few for probes;
- the Batch API's store (:class:`BatchStoreOptions`): SQLite owned by one batch-runner replica,
  or Redis shared by several.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.batch_api import open_batch_store
from jaxinfer.batch_api.sqlite_store import DEFAULT_LEASE_S
from jaxinfer.engine_config import EngineConfig
from jaxinfer.server.admission import AdmissionConfig
from jaxinfer.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILE_BYTES
from jaxinfer.server.batch_runner import BatchRunnerConfig

NUM_PROBE_THREADS = 16  # ingress threads kept for /health, /v1/models and the like under load
# Calls an engine replica takes beyond its engine's running and waiting requests: Serve holds
# every call, broadcasts included, behind a replica's max_ongoing_requests, so without these the
# control calls (abort, stats, /metrics) would wait for a full replica's next free slot. An engine
# call that takes one of them is refused by the replica's admission at once (503 queue_full).
NUM_CONTROL_SLOTS = 4
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
        from jaxinfer.activation_calibration import apply_activation_scales
        from jaxinfer.checkpoint import load_model

        # Compiled by the replica's EngineLoop.start (warmup), before Serve routes to it.
        loaded = load_model(self.model, self.dtype, quantization=self.engine_config.quantization)
        loaded = apply_activation_scales(loaded, self.engine_config.activation_scales)  # as `jaxinfer serve`
        return engine_factory.build_engine(loaded, self.engine_config, warm_up=False,
                                           tensor_parallel_size=self.tensor_parallel_size, use_tqdm=False)


@dataclasses.dataclass(frozen=True)
class BatchStoreOptions:
    """The Batch API's store under Ray: ``redis_url`` given, Redis; else SQLite at ``db_path``
    (None: in jaxinfer's cache directory on the runner's node)."""

    db_path: str | None = None
    redis_url: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    num_runners: int = 1

    def __post_init__(self):
        if self.num_runners < 1:
            raise ValueError(f"num_runners must be at least 1, got {self.num_runners}")
        if self.num_runners > 1 and not self.redis_url:
            raise ValueError("several batch runners need a shared queue: give --batch-redis (a SQLite file "
                             "is owned by one runner)")

    def open(self):
        return open_batch_store(self.db_path, self.redis_url, self.lease_s)


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
    batch_num_cpus: float = 0.5  # a batch runner mostly waits on the engine replicas and its store
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
    # The Files and Batch API (jaxinfer.ray_serve.batch_replica): None turns it off.
    batch_store: BatchStoreOptions | None = dataclasses.field(default_factory=BatchStoreOptions)
    batch_runner: BatchRunnerConfig = dataclasses.field(default_factory=BatchRunnerConfig)
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    batch_window_s: float | None = None  # tests and debugging: how long a batch's "24h" window lasts
    tool_call_parser: str | None = None  # the format tool calls are parsed in; None: from the chat template

    def __post_init__(self):
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas})")
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r} is not one of {ROUTERS}")
        from jaxinfer.tool_parsers import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of {sorted(PARSERS)}")

    @property
    def engine_max_ongoing_requests(self) -> int:
        return self.max_num_seqs + self.admission.max_waiting_requests + NUM_CONTROL_SLOTS

    def ingress_threads_needed(self) -> int:
        return (self.ingress_threads or
                self.max_replicas * self.engine_max_ongoing_requests + self.max_queued_requests + NUM_PROBE_THREADS)

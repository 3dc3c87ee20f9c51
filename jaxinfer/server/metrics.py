"""Prometheus metrics with vLLM's (v1, 0.10+) names and buckets under a ``jaxinfer:`` prefix.

Dashboards and alerts written for vLLM work after replacing ``vllm:`` by ``jaxinfer:``.
Counters the engine keeps as running totals (``engine.stats()``) are turned into Prometheus
counters by adding the increase since the last read. Each ServerMetrics owns its registry, so
several servers (tests) can live in one process.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

from jaxinfer.server.request_timing import RequestTiming

PREFIX = "jaxinfer:"

# As vLLM does: no *_created series beside every counter and histogram (process-wide setting).
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort", "error")

# engine.stats() running total -> counter name (without prefix)
_ENGINE_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("num_preemptions", "Cumulative number of preemption from the engine."),
    "prompt_tokens_total": ("prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens_total": ("generation_tokens", "Number of generation tokens processed."),
    # Present only with speculative decoding (jaxinfer.spec_decode).
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_pages_total = gauge("kv_cache_num_pages_total", "KV-cache pages in the pool.")
        self.num_pages_used = gauge("kv_cache_num_pages_used", "KV-cache pages in use.")
        self.admission_new_token_ratio = gauge(
            "scheduler_admission_new_token_ratio",
            "Fraction of the running requests' remaining max_tokens that admission holds KV pages for.")
        self.admission_reserved_pages = gauge(
            "scheduler_admission_reserved_pages",
            "KV pages admission held back for the running requests' projected peak growth at its last check.")
        self.num_compilations = gauge("num_compilations_after_warmup",
                                      "XLA compilations after warm-up (each one stalls serving).")
        self.num_prompt_scoring_programs = gauge(
            "num_prompt_scoring_programs",
            "Prompt-logprob programs compiled on first use, one per prompt-length bucket (each stalls its request).")
        self.spec_decode_mean_acceptance_length = gauge(
            "spec_decode_mean_acceptance_length",
            "Tokens per verify step of a speculating sequence: accepted drafts + 1 (1 without speculation).")
        self.server_waiting = gauge("server_num_requests_waiting",
                                    "Requests admitted by the HTTP server that have not produced a token yet.")
        self.engine_counters = {key: counter(name, doc) for key, (name, doc) in _ENGINE_COUNTERS.items()}
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        rejected = Counter(PREFIX + "request_rejected", "Requests refused with 503 (queue full, draining, ...).",
                           labels + ["reason"], registry=r)
        self._rejected = rejected
        for reason in ("queue_full", "draining", "not_ready", "engine_dead"):
            rejected.labels(model_name, reason)  # exported as 0 before the first refusal
        self.healthy = gauge("server_healthy", "1 while the server is ready to serve, else 0.")
        self.batch_lines_pending = gauge("batch_lines_pending", "Batch API lines of unfinished batches not yet answered.")
        self.batch_lines_completed = counter("batch_lines_completed", "Batch API lines answered with status 200.")
        self.batch_lines_failed = counter("batch_lines_failed", "Batch API lines written to an error file.")

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.request_params_max_tokens = histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self._last_totals: dict[str, float] = {}

    def set_state(self, state: str) -> None:
        self.healthy.set(1 if state == "ready" else 0)

    def count_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def update_engine_stats(self, stats: dict, stepped: bool) -> None:
        """Called by the engine loop after each step (and now and then when idle)."""
        self.num_requests_running.set(stats.get("num_running", 0))
        self.num_requests_waiting.set(stats.get("num_waiting", 0))
        self.kv_cache_usage_perc.set(stats.get("kv_cache_usage", 0.0))
        self.num_pages_total.set(stats.get("num_pages_total", 0))
        self.num_pages_used.set(stats.get("num_pages_used", 0))
        self.admission_new_token_ratio.set(stats.get("admission_new_token_ratio", 0.0))
        self.admission_reserved_pages.set(stats.get("admission_reserved_pages", 0))
        self.num_compilations.set(stats.get("num_compilations_after_warmup", 0))
        self.num_prompt_scoring_programs.set(stats.get("num_prompt_scoring_programs", 0))
        if "spec_decode_mean_acceptance_length" in stats:
            self.spec_decode_mean_acceptance_length.set(stats["spec_decode_mean_acceptance_length"])
        for key, counter in self.engine_counters.items():
            total = stats.get(key)
            if total is None:
                continue
            increase = total - self._last_totals.get(key, 0)
            if increase > 0:
                counter.inc(increase)
            self._last_totals[key] = total
        if stepped and stats.get("last_step_num_tokens"):
            self.iteration_tokens.observe(stats["last_step_num_tokens"])

    def observe_output(self, timing: RequestTiming, is_first: bool, itl: float | None) -> None:
        if is_first:
            self.ttft.observe(timing.ttft)
        if itl is not None:
            self.itl.observe(itl)

    def observe_finished(self, timing: RequestTiming) -> None:
        reason = timing.finish_reason if timing.finish_reason in self.request_success else "abort"
        self.request_success[reason].inc()
        self.e2e.observe(timing.e2e_time)
        self.queue_time.observe(timing.queue_time)
        self.prefill_time.observe(timing.prefill_time)
        self.decode_time.observe(timing.decode_time)
        self.inference_time.observe(timing.inference_time)
        self.request_prompt_tokens.observe(timing.num_prompt_tokens)
        self.request_generation_tokens.observe(timing.num_generation_tokens)
        self.request_params_n.observe(timing.n)
        if timing.max_tokens:
            self.request_params_max_tokens.observe(timing.max_tokens)
        per_sample_tokens = timing.num_generation_tokens / max(1, timing.n)
        if per_sample_tokens > 1:
            self.tpot.observe(timing.decode_time / (per_sample_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

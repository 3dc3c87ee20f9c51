"""QueueAutoscalingPolicy: scale engine replicas on their queue and KV cache, not on ongoing requests.

Serve's default policy counts ongoing requests per replica. For an engine that batches, a
replica running ``max_num_seqs`` sequences is busy but not overloaded; it is overloaded when
requests *wait* (admitted, no first token yet) or when its KV cache fills (the next long
prompts will wait or preempt). Each replica reports both through Serve's custom-metrics hook
(``EngineReplica.record_autoscaling_stats``); Serve averages them per replica over
``look_back_period_s`` (``ctx.aggregated_metrics``) and calls this policy every control-loop tick.

The rule, with ``n`` running replicas:

- **up** when the waiting requests per replica (the replicas' own queues plus calls queued in
  Serve's handles) exceed ``max_waiting_per_replica``, or the mean KV usage passes
  ``kv_usage_high``: ``max(n + 1, ceil(waiting / max_waiting_per_replica))``;
- **down** by one only when nothing waits and the mean KV usage is under ``kv_usage_low``;
- otherwise hold.

Serve then applies ``upscale_delay_s``/``downscale_delay_s`` (the decision must hold that long)
and the replica bounds.
"""

from __future__ import annotations

import math

NUM_REQUESTS_WAITING = "num_requests_waiting"
KV_CACHE_USAGE = "kv_cache_usage"


class QueueAutoscalingPolicy:
    """Serve instantiates it once with ``policy_kwargs`` and calls it with an AutoscalingContext."""

    def __init__(self, max_waiting_per_replica: float = 4.0, kv_usage_high: float = 0.8,
                 kv_usage_low: float = 0.5):
        self.max_waiting_per_replica = max_waiting_per_replica
        self.kv_usage_high = kv_usage_high
        self.kv_usage_low = kv_usage_low

    def __call__(self, ctx) -> tuple[int, dict]:
        n = ctx.current_num_replicas
        if n == 0:
            return ctx.target_num_replicas, {}
        return self.desired_replicas(n, self.num_waiting(ctx), self.mean_kv_usage(ctx), ctx), {}

    def desired_replicas(self, n: int, num_waiting: float, kv_usage: float, ctx) -> int:
        if num_waiting / n > self.max_waiting_per_replica or kv_usage > self.kv_usage_high:
            desired = max(n + 1, math.ceil(num_waiting / self.max_waiting_per_replica))
        elif num_waiting == 0 and kv_usage < self.kv_usage_low:
            desired = n - 1
        else:
            desired = n
        return min(max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)

    @staticmethod
    def num_waiting(ctx) -> float:
        per_replica = (ctx.aggregated_metrics or {}).get(NUM_REQUESTS_WAITING, {})
        return sum(per_replica.values()) + (ctx.total_queued_requests or 0.0)

    @staticmethod
    def mean_kv_usage(ctx) -> float:
        per_replica = (ctx.aggregated_metrics or {}).get(KV_CACHE_USAGE, {})
        return sum(per_replica.values()) / len(per_replica) if per_replica else 0.0

"""DataParallelEngine: ``dp`` engine replicas in one process, a router in front.

Each replica is a whole :class:`~jaxinfer.engine.Engine` (scheduler, page allocator, KV
cache, compiled steps) on its own ``tp`` slice of the mesh; the router sends each new request
to the replica with the fewest unfinished sequences and steps every busy replica in turn.
Device work overlaps because a step only launches its program and then reads the *previous*
step's tokens (async scheduling), so replica 1 launches while replica 0's program runs.
Why replicas and not one batch split over ``dp``: see ``docs/SHARDING.md``.

It has the engine's interface (``add_request``/``score_prompt``/``abort``/``step``/``stats``/``warmup``), so
``LLM`` and the server use it unchanged; ``jaxinfer.engine_factory.build_engine`` builds it for ``dp > 1``.
"""

from __future__ import annotations

from jaxinfer.engine import Engine
from jaxinfer.errors import RequestIdInUseError
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec_decode.speculator import mean_acceptance_length


class DataParallelEngine:
    def __init__(self, engines: list[Engine]):
        if not engines:
            raise ValueError("DataParallelEngine needs at least one engine")
        self.engines = engines
        self.model = engines[0].model  # every replica holds the same weights, on its own devices
        self.tokenizer = engines[0].tokenizer
        self.model_config = engines[0].model_config
        self.config = engines[0].config
        self.max_model_len = engines[0].max_model_len
        self._owner: dict[str, Engine] = {}

    def warmup(self, use_tqdm: bool = True) -> float:
        return sum(engine.warmup(use_tqdm) for engine in self.engines)

    def score_prompt(self, prompt_token_ids: list[int], num_top: int):
        """Prompt logprobs from the first replica (every replica holds the same weights)."""
        return self.engines[0].score_prompt(prompt_token_ids, num_top)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, final_only: bool = False) -> None:
        if request_id in self._owner:
            raise RequestIdInUseError(f"request id {request_id!r} is already in use", field="request_id")
        engine = min(self.engines, key=_load)
        engine.add_request(request_id, prompt_token_ids, params, prompt=prompt, arrival_time=arrival_time,
                           final_only=final_only)
        self._owner[request_id] = engine

    def abort(self, request_id: str) -> bool:
        engine = self._owner.get(request_id)
        return engine is not None and engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for engine in self.engines:
            if engine.has_unfinished_requests():
                outputs += engine.step()
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def stats(self) -> dict:
        per_replica = [engine.stats() for engine in self.engines]
        total = {key: sum(s[key] for s in per_replica) for key in per_replica[0]}
        for fraction in ("kv_cache_usage", "admission_new_token_ratio"):  # means, not totals
            total[fraction] = sum(s[fraction] for s in per_replica) / len(per_replica)
        total["last_step_num_tokens"] = max(s["last_step_num_tokens"] for s in per_replica)
        total["num_replicas"] = len(self.engines)
        if "spec_decode_num_drafts" in total:  # a mean, not a total: from the summed counters
            total["spec_decode_mean_acceptance_length"] = mean_acceptance_length(
                total["spec_decode_num_accepted_tokens"], total["spec_decode_num_drafts"])
        return total


def _load(engine: Engine) -> tuple[int, float]:
    """Fewest unfinished sequences first, then the emptier page pool."""
    return engine.scheduler.num_running + engine.scheduler.num_waiting, engine.allocator.usage

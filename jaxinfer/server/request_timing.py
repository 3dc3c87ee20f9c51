"""RequestTiming: where one request's time went (queue, prefill, decode), for metrics and logs.

Times are ``time.monotonic()``. When the engine's ``RequestOutput.metrics`` is present its
``first_scheduled_time``/``first_token_time``/... are used as they are; otherwise the loop
measures them itself when outputs arrive, and the queue time (unknown without the scheduler)
is counted as prefill.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.outputs import RequestOutput


@dataclasses.dataclass
class RequestTiming:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None = None
    n: int = 1
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str = ""

    def on_output(self, out: RequestOutput, now: float) -> tuple[bool, float | None]:
        """Record an output: (is it the first token?, the inter-token latency it shows or None)."""
        num_tokens = sum(len(s.token_ids) for s in out.outputs)
        is_first, itl = False, None
        if num_tokens > self.num_generation_tokens:
            if self.first_token_time is None:
                self.first_token_time = now
                is_first = True
            elif self.last_token_time is not None:
                itl = now - self.last_token_time
            self.last_token_time = now
        self.num_generation_tokens = max(self.num_generation_tokens, num_tokens)
        self.num_cached_tokens = out.num_cached_tokens
        return is_first, itl

    def on_finish(self, out: RequestOutput, now: float) -> None:
        self.finished_time = now
        reasons = [s.finish_reason for s in out.outputs if s.finish_reason]
        # One reason per request for the success counter: the first sample's, as vLLM reports it.
        self.finish_reason = reasons[0] if reasons else "abort"
        engine = getattr(out, "metrics", None)
        if engine is None:
            return
        for field in ("first_scheduled_time", "first_token_time", "last_token_time"):
            value = getattr(engine, field, None)
            if value is not None:
                setattr(self, field, value)
        if getattr(engine, "num_generation_tokens", None):
            self.num_generation_tokens = engine.num_generation_tokens

    @property
    def queue_time(self) -> float:
        start = self.first_scheduled_time or self.arrival_time
        return max(0.0, start - self.arrival_time)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else max(0.0, self.first_token_time - self.arrival_time)

    @property
    def prefill_time(self) -> float:
        start = self.first_scheduled_time or self.arrival_time
        end = self.first_token_time or self.finished_time or start
        return max(0.0, end - start)

    @property
    def decode_time(self) -> float:
        if self.first_token_time is None:
            return 0.0
        return max(0.0, (self.last_token_time or self.first_token_time) - self.first_token_time)

    @property
    def inference_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def e2e_time(self) -> float:
        return max(0.0, (self.finished_time or self.arrival_time) - self.arrival_time)

    def log_fields(self) -> dict:
        ttft = self.ttft
        return {
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_generation_tokens,
            "cached_tokens": self.num_cached_tokens,
            "queue_s": round(self.queue_time, 6),
            "prefill_s": round(self.prefill_time, 6),
            "decode_s": round(self.decode_time, 6),
            "ttft_s": None if ttft is None else round(ttft, 6),
            "e2e_s": round(self.e2e_time, 6),
        }

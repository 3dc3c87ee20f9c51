"""What generation returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Per generated token: {token_id: logprob} for the sampled token and the top ``logprobs``.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()``) and counts of one request, for metrics and logs."""

    arrival_time: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set instead of outputs when the request could not run
    # With SamplingParams.prompt_logprobs (vLLM's format): one entry per prompt token, None for the
    # first (nothing before it), then {prompt_token: logprob, **top k} of the raw distribution.
    prompt_logprobs: list[dict[int, float] | None] | None = None

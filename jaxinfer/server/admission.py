"""Admission control: a bounded waiting queue, by requests and by prompt tokens.

A request is *waiting* from the moment the server accepts it until its first output
comes back from the engine (it has been scheduled and has produced a token). Past either
bound a new request is refused at once with 503 + ``Retry-After`` instead of piling up
behind the others: a burst is shaved, and the clients (the ``openai`` SDK retries 503s by
itself, honouring ``Retry-After``) come back when there is room.
"""

from __future__ import annotations

import dataclasses
import threading

from jaxinfer.engine_client import QueueFullError

DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_MAX_WAITING_PROMPT_TOKENS = 256 * 1024
DEFAULT_RETRY_AFTER_S = 1.0


@dataclasses.dataclass
class AdmissionConfig:
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_waiting_prompt_tokens: int = DEFAULT_MAX_WAITING_PROMPT_TOKENS
    retry_after_s: float = DEFAULT_RETRY_AFTER_S


class Admission:
    """Counts waiting requests and their prompt tokens; thread-safe."""

    def __init__(self, config: AdmissionConfig):
        self.config = config
        self._lock = threading.Lock()
        self.num_waiting = 0
        self.num_waiting_tokens = 0

    def admit(self, prompt_lens: list[int]) -> None:
        """Reserve room for one HTTP call's engine requests, all or none."""
        cfg = self.config
        with self._lock:
            num, tokens = len(prompt_lens), sum(prompt_lens)
            if self.num_waiting + num > cfg.max_waiting_requests:
                raise QueueFullError(
                    f"the server is overloaded: {self.num_waiting} requests are waiting "
                    f"(limit {cfg.max_waiting_requests}); retry later", cfg.retry_after_s)
            # One request larger than the whole token budget is admitted alone rather than never.
            if self.num_waiting and self.num_waiting_tokens + tokens > cfg.max_waiting_prompt_tokens:
                raise QueueFullError(
                    f"the server is overloaded: {self.num_waiting_tokens} prompt tokens are waiting "
                    f"(limit {cfg.max_waiting_prompt_tokens}); retry later", cfg.retry_after_s)
            self.num_waiting += num
            self.num_waiting_tokens += tokens

    def release(self, prompt_len: int) -> None:
        """One request left the waiting queue (first output, finish, abort or failure)."""
        with self._lock:
            self.num_waiting -= 1
            self.num_waiting_tokens -= prompt_len

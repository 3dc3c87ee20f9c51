"""FakeEngine: the server's engine contract with outputs computable by hand.

Sample ``s`` of a request generates, at position ``i``, the prompt's ``(i + s) % len``-th content
token (special tokens such as BOS and the chat template's markers are left out), so a prompt
"a b c" yields "a b c a b ..." for sample 0 and "b c a b ..." for sample 1. The sampled token's
logprob is ``-0.1 * (i + 1)``; the top-k alternatives are the next ids, each 1.0 lower.
Prompt logprobs (``score_prompt``) follow the same rule: prompt token ``j >= 1`` has ``-0.05 * j``.

Like the real engine it is not thread-safe, so it asserts that one thread calls it. It runs at
most ``max_num_seqs`` requests, keeps the rest waiting, and counts pages of ``page_size`` tokens
so tests can check that aborts free them. Hooks: ``step_delay`` (seconds per step),
``before_step`` (called at the start of each step, e.g. to wait on a ``threading.Event``) and
``fail_on_step`` (the step number whose call raises) and ``fail_on_prompt`` (a prompt whose
``add_request`` raises). ``script(prompt_token_ids, params) -> str``, when given, replaces the echo:
every sample generates that text's tokens and then stops (``finish_reason`` "stop", as at EOS); it
may raise ``RequestError`` to refuse the request as the engine would (a grammar it cannot compile).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path

from jaxinfer.config import ModelConfig
from jaxinfer.errors import PromptTooLongError, RequestError
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server.background import BackgroundServer
from jaxinfer.tokenizer import Tokenizer

TINY_LLAMA3 = Path(__file__).resolve().parent / "fixtures" / "tiny-llama3"


@dataclasses.dataclass
class FakeRequestMetrics:
    """The fields of the engine's RequestMetrics the server reads."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    source: list[int]  # the tokens samples echo
    params: SamplingParams
    max_tokens: int
    metrics: FakeRequestMetrics
    samples: list[CompletionOutput]
    prompt_logprobs: list | None = None
    scripted: bool = False  # source is a scripted reply, generated once, then "stop"

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + max(len(s.token_ids) for s in self.samples)


class InjectedFault(RuntimeError):
    pass


def load_tiny_tokenizer() -> tuple[Tokenizer, ModelConfig]:
    tokenizer = Tokenizer.from_hf_dir(TINY_LLAMA3)
    config = ModelConfig.from_hf(json.loads((TINY_LLAMA3 / "config.json").read_text()))
    return tokenizer, config


class FakeEngine:
    def __init__(self, max_model_len: int = 256, max_num_seqs: int = 8, page_size: int = 16,
                 num_pages_total: int = 1024, step_delay: float = 0.0, before_step=None,
                 fail_on_step: int | None = None, fail_on_prompt: str | None = None, script=None):
        self.tokenizer, self.model_config = load_tiny_tokenizer()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.page_size = page_size
        self.num_pages_total = num_pages_total
        self.step_delay = step_delay
        self.before_step = before_step
        self.fail_on_step = fail_on_step
        self.fail_on_prompt = fail_on_prompt
        self.script = script
        self.num_steps = 0
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.num_aborted = 0
        self._counters = dict(prompt_tokens_total=0, generation_tokens_total=0, prefix_cache_queries=0,
                              prefix_cache_hits=0, num_preemptions=0, last_step_num_tokens=0)
        self._special = set(self.tokenizer.eos_token_ids) | {
            i for i in range(self.tokenizer.vocab_size) if (self.tokenizer.id_to_token(i) or "").startswith("<|")}
        self._owner: int | None = None

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        assert self._owner == me, "FakeEngine called from two threads"

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        self._check_thread()
        if self.fail_on_prompt is not None and prompt == self.fail_on_prompt:
            raise InjectedFault("injected fault in /secret/path/engine.py")
        p = len(prompt_token_ids)
        if p == 0:
            raise RequestError("the prompt is empty", field="prompt", limit=1)
        if p >= self.max_model_len:
            raise PromptTooLongError(f"prompt of {p} tokens does not fit max_model_len {self.max_model_len}",
                                     field="prompt", limit=self.max_model_len - 1)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - p
        if p + max_tokens > self.max_model_len:
            raise PromptTooLongError(f"{p} prompt tokens + max_tokens {max_tokens} exceed max_model_len "
                                     f"{self.max_model_len}", field="max_tokens", limit=self.max_model_len - p)
        source = [t for t in prompt_token_ids if t not in self._special] or [prompt_token_ids[-1]]
        scripted = self.script is not None
        if scripted:
            source = self.tokenizer.encode(self.script(list(prompt_token_ids), params), add_special_tokens=False)
        samples = [CompletionOutput(index=s, text="", token_ids=[], cumulative_logprob=None,
                                    logprobs=[] if params.logprobs is not None else None)
                   for s in range(params.n)]
        metrics = FakeRequestMetrics(arrival_time=arrival_time or time.monotonic(), num_prompt_tokens=p)
        prompt_logprobs = (None if params.prompt_logprobs is None
                           else self.score_prompt(prompt_token_ids, params.prompt_logprobs))
        self.waiting.append(_Request(request_id, prompt, list(prompt_token_ids), source, params,
                                     max_tokens, metrics, samples, prompt_logprobs, scripted))

    def score_prompt(self, prompt_token_ids: list[int], num_top: int) -> list:
        """The engine's prompt logprobs, by the rule in the module docstring."""
        self._check_thread()
        vocab = self.tokenizer.vocab_size
        result = [None]
        for j, token in enumerate(prompt_token_ids[1:], start=1):
            logprob = -0.05 * j
            result.append({token: logprob, **{(token + i) % vocab: logprob - i for i in range(1, num_top + 1)}})
        return result

    def abort(self, request_id: str) -> bool:
        self._check_thread()
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    for s in req.samples:
                        if not s.finished:
                            s.finish_reason = "abort"
                    self.num_aborted += 1
                    return True
        return False

    def has_unfinished_requests(self) -> bool:
        self._check_thread()
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        self.num_steps += 1
        if self.before_step is not None:
            self.before_step(self.num_steps)
        if self.fail_on_step is not None and self.num_steps >= self.fail_on_step:
            raise InjectedFault("injected fault in /secret/path/engine.py")
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.monotonic()
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            req.metrics.first_scheduled_time = now
            num_tokens += len(req.prompt_token_ids)
            self._counters["prompt_tokens_total"] += len(req.prompt_token_ids)
            self._counters["prefix_cache_queries"] += len(req.prompt_token_ids)
            self.running.append(req)
        outputs = []
        for req in list(self.running):
            for s in req.samples:
                if not s.finished:
                    self._generate_one(req, s)
                    num_tokens += 1
                    self._counters["generation_tokens_total"] += 1
            req.metrics.num_generation_tokens = sum(len(s.token_ids) for s in req.samples)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            if req.finished:
                req.metrics.finished_time = now
                self.running.remove(req)
            outputs.append(self._output(req))
        self._counters["last_step_num_tokens"] = num_tokens
        return outputs

    def _generate_one(self, req: _Request, sample: CompletionOutput) -> None:
        i = len(sample.token_ids)
        token = req.source[i % len(req.source)] if req.scripted else req.source[(i + sample.index) % len(req.source)]
        sample.token_ids.append(token)
        logprob = -0.1 * (i + 1)
        sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + logprob
        if sample.logprobs is not None:
            top = {(token + j) % self.tokenizer.vocab_size: logprob - j for j in range(1, req.params.logprobs + 1)}
            sample.logprobs.append({token: logprob, **top})
        sample.text = self.tokenizer.decode(sample.token_ids)
        params = req.params
        can_stop = len(sample.token_ids) >= params.min_tokens
        for stop in params.stop if can_stop else []:
            if stop in sample.text:
                sample.text = sample.text[: sample.text.index(stop)]
                sample.finish_reason, sample.stop_reason = "stop", stop
                return
        if can_stop and token in params.stop_token_ids:
            sample.finish_reason, sample.stop_reason = "stop", token
        elif req.scripted and len(sample.token_ids) == len(req.source):
            sample.finish_reason = "stop"
        elif len(sample.token_ids) >= req.max_tokens:
            sample.finish_reason = "length"

    def _output(self, req: _Request) -> RequestOutput:
        # As the real engine (Detokenizer.visible_text): an unfinished sample's text holds back the
        # characters a stop string spanning tokens could still cut, so it only ever grows.
        hold_back = max((len(stop) for stop in req.params.stop), default=1) - 1
        samples = [dataclasses.replace(s, token_ids=list(s.token_ids),
                                       logprobs=None if s.logprobs is None else list(s.logprobs),
                                       text=s.text if s.finished else s.text[: max(0, len(s.text) - hold_back)])
                   for s in req.samples]
        out = RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                            outputs=samples, finished=req.finished, prompt_logprobs=req.prompt_logprobs)
        out.metrics = dataclasses.replace(req.metrics)
        return out

    def num_pages_used(self) -> int:
        return sum(math.ceil(r.num_tokens() / self.page_size) for r in self.running)

    def stats(self) -> dict:
        self._check_thread()
        used = self.num_pages_used()
        return dict(self._counters, num_running=len(self.running), num_waiting=len(self.waiting),
                    num_pages_total=self.num_pages_total, num_pages_used=used,
                    kv_cache_usage=used / self.num_pages_total, num_compilations_after_warmup=0)


class RunningServer(BackgroundServer):
    """A real waitress server on a free loopback port, serving ``engine`` in this process."""

    def __init__(self, engine, api_key: str | None = None, admission=None, threads: int = 96,
                 max_body_bytes: int = 1 << 20, tracer_provider=None, served_model_name: str = "tiny-llama3",
                 tool_call_parser: str | None = None):
        super().__init__(engine, served_model_name=served_model_name, api_key=api_key, admission=admission,
                         threads=threads, max_body_bytes=max_body_bytes, tracer_provider=tracer_provider,
                         tool_call_parser=tool_call_parser)

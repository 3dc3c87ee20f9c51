"""Engine: continuous batching. One step reads like a sentence:

    schedule -> launch on the device -> (while it runs) process the previous step's tokens

1. ``add_request`` validates the prompt and queues one ``Sequence`` per sample.
2. ``step`` asks the scheduler which tokens to compute (decodes first, then chunked
   prefills, one token budget), has the runner pack and launch the jitted step, and
   appends a placeholder for each token being sampled on the device.
3. While the device runs, the host fetches the *previous* step's sampled tokens, fills in
   their placeholders, detokenizes, checks stop conditions, and finishes sequences.
4. Finished sequences free their pages; requests whose samples all finished are returned.

Repetition/presence/frequency penalties read each sequence's history from token pages on
the device (``jaxinfer.token_history``), so they run under async scheduling too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time

import jax
import numpy as np

from jaxinfer.batch import build_step_batch
from jaxinfer.detokenizer import Detokenizer
from jaxinfer.errors import PromptTooLongError, RequestError, RequestIdInUseError
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.page_allocator import SCRATCH_PAGE, PageAllocator
from jaxinfer.prompt_logprobs import PromptLogprobs, PromptScorer
from jaxinfer.runner import MAX_BANNED, ModelRunner, StepInputs, enable_persistent_compilation_cache
from jaxinfer.sampling import SamplingTensors
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import Schedule, Scheduler, SchedulerConfig
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    num_pages: int = 1024
    enable_prefix_caching: bool = True
    max_wait_s: float = 0.002
    attention_impl: str = "auto"
    async_scheduling: bool = True
    overlap: object = None  # jaxinfer.compile_options.OverlapConfig: tp communication overlap per phase


@dataclasses.dataclass(frozen=True)
class SampleSettings:
    """What the engine attaches to each Sequence (opaque to the scheduler)."""

    params: SamplingParams
    seed: int  # this sample's own seed: the request's, or derived from it for n > 1
    max_tokens: int  # max_tokens, capped by the context left after the prompt
    index: int = 0  # which of the request's n samples


class _Request:
    """Host state of one request: its samples and what they have produced."""

    def __init__(self, request_id, prompt, prompt_ids, params, seqs, detokenizers, arrival_time, final_only=False):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs: list[Sequence] = seqs
        self.detokenizers: list[Detokenizer] = detokenizers
        # Tokens each sample has produced, filled as they arrive from the device (no placeholders).
        self.output_token_ids: list[list[int]] = [[] for _ in seqs]
        self.logprobs: list[list[dict[int, float]]] = [[] for _ in seqs]
        self.cumulative_logprob = [0.0 for _ in seqs]
        self.stop_reasons: list[int | str | None] = [None for _ in seqs]
        self.final_only = final_only  # output only once finished, not after every step
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_ids))
        self.prompt_logprobs: PromptLogprobs | None = None  # set by add_request when asked for

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def output(self, is_finished: bool) -> RequestOutput:
        """The request's outputs so far. Token lists are live: they keep growing until it finishes."""
        outputs = [
            CompletionOutput(
                index=i,
                text=self.detokenizers[i].visible_text(seq.is_finished),
                token_ids=self.output_token_ids[i],
                finish_reason=seq.finish_reason,
                stop_reason=self.stop_reasons[i],
                logprobs=self.logprobs[i] if self.params.logprobs is not None else None,
                cumulative_logprob=self.cumulative_logprob[i] if self.params.logprobs is not None else None,
            )
            for i, seq in enumerate(self.seqs)
        ]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
            outputs=outputs, finished=is_finished, num_cached_tokens=self.seqs[0].num_cached_tokens,
            metrics=self.metrics, prompt_logprobs=self.prompt_logprobs,
        )


@dataclasses.dataclass
class _InFlight:
    schedule: Schedule
    rows: list[int]  # row of each schedule item in the sampler output; -1: no token sampled
    sampler_output: object
    launch_time: float


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, *, warm_up: bool = True, use_tqdm: bool = True,
                 mesh=None):
        enable_persistent_compilation_cache()
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_config = model.config
        self.config = config
        self.max_model_len = config.max_model_len
        identity = f"{model.source}:{model.config}:{model.weights.embed.dtype}"
        self.allocator = PageAllocator(config.num_pages, config.page_size, identity, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len, page_size=config.page_size, max_wait_s=config.max_wait_s,
            ),
            self.allocator,
        )
        self.runner = ModelRunner(
            model, num_pages=config.num_pages, page_size=config.page_size, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            attention_impl=config.attention_impl, mesh=mesh, overlap=config.overlap,
        )
        # Prompt logprobs run as their own program over the runner's (possibly sharded) weights,
        # never through the step programs: see jaxinfer.prompt_logprobs.
        self.prompt_scorer = PromptScorer(
            self.runner.model.weights, self.runner.config, page_size=config.page_size,
            attention_impl=config.attention_impl, placement=self.runner.placement,
        )
        self.eos_ids = frozenset(model.tokenizer.eos_token_ids) | frozenset(model.config.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._seq_request: dict[int, _Request] = {}
        self._seq_ids = itertools.count()
        self._in_flight: _InFlight | None = None
        self._aborted: list[_Request] = []  # reported as finished by the next step()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_tokens_computed = 0
        self.last_step_num_tokens = 0
        self.device_wait_seconds = 0.0  # host time spent blocked on the device's results
        # Host time inside the runner's dispatch: small unless a program syncs with the host
        # (as a lax.cond did on the GPU), which takes the overlap of host and device away.
        self.dispatch_seconds = 0.0
        self.warmup_seconds = self.runner.warm_up(use_tqdm) if warm_up else 0.0

    def warmup(self, use_tqdm: bool = True) -> float:
        """Compile every step shape now (if not done at construction); returns seconds spent."""
        if not self.runner.warmup_done:
            self.warmup_seconds = self.runner.warm_up(use_tqdm)
        return self.warmup_seconds

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, final_only: bool = False) -> None:
        """Queue a request; raises ValueError, naming the limit, if it cannot run.

        ``final_only``: ``step`` returns this request's output once, when it finishes (offline
        generation), instead of after every step that changed it (streaming).

        With ``params.prompt_logprobs`` set the prompt is scored here, synchronously, before the
        request is queued (:meth:`score_prompt`): one extra forward over the prompt on this
        thread, which delays the steps of every other request by as much.
        """
        if request_id in self._requests:
            raise RequestIdInUseError(f"request id {request_id!r} is already in use", field="request_id")
        self.validate(prompt_token_ids, params)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = self.score_prompt(prompt_token_ids, params.prompt_logprobs)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "little")
        seqs, detokenizers = [], []
        for index in range(params.n):
            settings = SampleSettings(
                params=params,
                seed=_derive_seed(base_seed, index, params.n),
                max_tokens=min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt_token_ids)),
                index=index,
            )
            seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, sampling=settings, arrival_time=arrival)
            seqs.append(seq)
            detokenizers.append(Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output))
        request = _Request(request_id, prompt, list(prompt_token_ids), params, seqs, detokenizers, arrival, final_only)
        request.prompt_logprobs = prompt_logprobs
        self._requests[request_id] = request
        for seq in seqs:
            self._seq_request[seq.seq_id] = request
            self.scheduler.add(seq)
        self.prompt_tokens_total += len(prompt_token_ids)

    def score_prompt(self, prompt_token_ids: list[int], num_top: int) -> PromptLogprobs:
        """vLLM-format prompt logprobs of a prompt (the first entry None), with the top ``num_top``.

        Runs now, on this thread, without touching the KV cache or the scheduler, so it may be
        called between steps (the server scores ``max_tokens: 0`` requests this way). The first
        prompt of each new power-of-two length bucket compiles a program for it.
        """
        self._check_prompt(prompt_token_ids, leave_room_for_output=False)
        return self.prompt_scorer.score(list(prompt_token_ids), num_top)

    def _check_prompt(self, prompt_token_ids: list[int], leave_room_for_output: bool) -> None:
        if not prompt_token_ids:
            raise RequestError("the prompt is empty: give at least one token", field="prompt", limit=1)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", field="prompt", limit=vocab)
        limit = self.max_model_len - 1 if leave_room_for_output else self.max_model_len
        if len(prompt_token_ids) > limit:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is {self.max_model_len}"
                + (": it must leave room for at least one output token" if leave_room_for_output else ""),
                field="prompt", limit=limit,
            )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._check_prompt(prompt_token_ids, leave_room_for_output=True)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})", field="stop_token_ids", limit=vocab)
        # Before min_tokens the device bans EOS and the stop ids through a fixed-width list:
        # past its width the rest were silently left unbanned and could be sampled early.
        num_banned = len(self._banned_before_min_tokens(params))
        if params.min_tokens > 0 and num_banned > MAX_BANNED:
            raise ValueError(
                f"min_tokens needs {num_banned} token ids banned (stop_token_ids and EOS), "
                f"more than the {MAX_BANNED} supported",
                field="min_tokens", limit=MAX_BANNED,
            )

    def _banned_before_min_tokens(self, params: SamplingParams) -> list[int]:
        """Token ids a sample may not produce before ``min_tokens``: EOS (unless ignored) and the stop ids."""
        return sorted((set() if params.ignore_eos else set(self.eos_ids)) | set(params.stop_token_ids))

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request, freeing its pages now; its last output (finish
        reason "abort") comes from the next ``step``. False when there is nothing to abort: an
        unknown id, or one already finished or aborted."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
        self._aborted.append(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that changed."""
        changed: dict[str, _Request] = {r.request_id: r for r in self._aborted}
        self._aborted.clear()
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            if self._in_flight is not None:
                self._process(self._in_flight, changed)
                self._in_flight = None
            elif schedule.wait_until is not None:
                time.sleep(max(0.0, schedule.wait_until - time.monotonic()))
            return self._collect(changed)
        if self._in_flight is not None and not self.config.async_scheduling:
            self._process(self._in_flight, changed)
            self._in_flight = None
        launched = self._launch(schedule)
        self.scheduler.postprocess(schedule)
        for item in schedule.items:
            if item.samples_token and not item.seq.is_finished:
                item.seq.append_token(PLACEHOLDER_TOKEN)
        if self._in_flight is not None:
            self._process(self._in_flight, changed)
        self._in_flight = launched
        if not self.config.async_scheduling:
            self._process(self._in_flight, changed)
            self._in_flight = None
        return self._collect(changed)

    def stats(self) -> dict:
        return dict(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_pages_total=self.allocator.num_usable_pages,
            num_pages_used=self.allocator.num_used_pages,
            kv_cache_usage=self.allocator.usage,
            prefix_cache_queries=self.allocator.prefix_cache_queries,
            prefix_cache_hits=self.allocator.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_tokens_computed=self.num_tokens_computed,
            num_compilations_after_warmup=self.runner.num_compilations_after_warmup,
            # Prompt scoring compiles per prompt-length bucket on first use (jaxinfer.prompt_logprobs).
            num_prompt_scoring_programs=len(self.prompt_scorer.buckets_compiled),
            last_step_num_tokens=self.last_step_num_tokens,
        )

    def _launch(self, schedule: Schedule) -> _InFlight:
        inputs, rows = self._prepare(schedule)
        now = time.monotonic()
        for item in schedule.items:
            request = self._seq_request[item.seq.seq_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        dispatch_start = time.monotonic()
        output = self.runner.execute(inputs)
        self.dispatch_seconds += time.monotonic() - dispatch_start
        self.num_tokens_computed += schedule.num_batched_tokens
        self.last_step_num_tokens = schedule.num_batched_tokens
        return _InFlight(schedule, rows, output, now)

    def _prepare(self, schedule: Schedule) -> tuple[StepInputs, list[int]]:
        items = schedule.items
        num_tokens = sum(item.num_new_tokens for item in items)
        max_pages = max(len(item.seq.page_table) for item in items)
        t_bucket, b_bucket, p_bucket = self.runner.buckets.pick(num_tokens, len(items), max_pages)
        needs_full = any(_needs_full_sampler(item.seq) for item in items)
        sampling = SamplingTensors.neutral(b_bucket, 0, MAX_BANNED)
        # A placeholder input is read on the device from the previous step's sample (prev_rows).
        prev_rows = np.full(t_bucket, -1, np.int32)
        previous_rows = self._previous_rows()
        chunks, rows, row = [], [], 0
        sample_rows, temperatures, seeds, steps = [], [], [], []
        for b, item in enumerate(items):
            seq, start, n = item.seq, item.start_position, item.num_new_tokens
            if n == 1:  # a decode: its input is usually the placeholder of the step in flight
                token = seq.token_ids[start]
                if token == PLACEHOLDER_TOKEN:
                    prev_rows[row] = previous_rows[seq.seq_id]
                    token = 0
                tokens = (token,)
            else:
                tokens = seq.token_ids[start : start + n]
                if seq.has_placeholder:
                    for j, token in enumerate(tokens):
                        if token == PLACEHOLDER_TOKEN:
                            prev_rows[row + j] = previous_rows[seq.seq_id]
                    tokens = [max(t, 0) for t in tokens]
            chunks.append((tokens, start, seq.page_table))
            row += n
            if item.samples_token:
                rows.append(b)
                sample_rows.append(b)
                temperatures.append(seq.sampling.params.temperature)
                seeds.append(seq.sampling.seed)
                steps.append(seq.num_generated_tokens)
                if needs_full:
                    self._fill_full_sampling(sampling, b, seq)
            else:
                rows.append(-1)
        sampling.temperature[sample_rows] = temperatures
        sampling.seed[sample_rows] = seeds
        sampling.step[sample_rows] = steps
        batch = build_step_batch(
            chunks, num_tokens=t_bucket, num_seqs=b_bucket, pages_per_seq=p_bucket, padding_page=SCRATCH_PAGE
        )
        return StepInputs(batch, sampling, prev_rows, "full" if needs_full else "basic"), rows

    def _previous_rows(self) -> dict[int, int]:
        if self._in_flight is None:
            return {}
        return {
            item.seq.seq_id: row for item, row in zip(self._in_flight.schedule.items, self._in_flight.rows) if row >= 0
        }

    def _fill_full_sampling(self, sampling: SamplingTensors, b: int, seq: Sequence) -> None:
        """Row ``b``'s fields of the "full" sampler (the basic ones are filled for all rows at once)."""
        params: SamplingParams = seq.sampling.params
        # top_k at or past the vocabulary keeps every token, as off (0) does; it is also how a
        # huge top_k (>= 2**31) never reaches the int32 array.
        sampling.top_k[b] = params.top_k if 0 < params.top_k < self.model_config.vocab_size else 0
        sampling.top_p[b] = params.top_p
        sampling.min_p[b] = params.min_p
        sampling.repetition_penalty[b] = params.repetition_penalty
        sampling.presence_penalty[b] = params.presence_penalty
        sampling.frequency_penalty[b] = params.frequency_penalty
        sampling.num_prompt_tokens[b] = seq.num_prompt_tokens
        if seq.num_generated_tokens < params.min_tokens:
            banned = self._banned_before_min_tokens(params)  # validate() checked it fits MAX_BANNED
            sampling.banned_ids[b, : len(banned)] = banned

    def _process(self, in_flight: _InFlight, changed: dict[str, _Request]) -> None:
        """Fetch a launched step's sampled tokens and apply them to their sequences."""
        wait_start = time.monotonic()
        sampler = in_flight.sampler_output
        wants_logprobs = any(
            item.seq.sampling.params.logprobs is not None for item in in_flight.schedule.items
        )
        # One device-to-host copy per array needed: the logprob arrays only when asked for.
        token_ids = np.asarray(sampler.token_ids).tolist()
        out = jax.device_get(sampler) if wants_logprobs else None
        now = time.monotonic()
        self.device_wait_seconds += now - wait_start
        for item, row in zip(in_flight.schedule.items, in_flight.rows):
            if row < 0:
                continue
            seq = item.seq
            request = self._seq_request.get(seq.seq_id)
            if request is None or seq.is_finished:
                continue  # aborted or already stopped: this sample is dropped
            token = token_ids[row]
            # The earliest placeholder is this step's; a later one (the step now running) may follow.
            index = seq.num_tokens - 1 if seq.token_ids[-2] != PLACEHOLDER_TOKEN else seq.num_tokens - 2
            seq.set_token(index, token)
            self.generation_tokens_total += 1
            i = seq.sampling.index
            request.output_token_ids[i].append(token)
            if request.params.logprobs is not None:
                entry = {token: float(out.logprobs[row])}
                for tid, value in zip(out.top_logprob_ids[row][: request.params.logprobs], out.top_logprob_values[row]):
                    entry.setdefault(int(tid), float(value))
                request.logprobs[i].append(entry)
                request.cumulative_logprob[i] += float(out.logprobs[row])
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generation_tokens += 1
            self._check_stop(request, i, seq, token)
            changed[request.request_id] = request

    def _check_stop(self, request: _Request, i: int, seq: Sequence, token: int) -> None:
        params = request.params
        num_generated = seq.num_generated_tokens - int(seq.has_placeholder)  # this token included
        # min_tokens holds back every stop condition, stop strings included (vLLM's semantics):
        # before this, a stop string in the first min_tokens tokens ended the sample early.
        check_stop = num_generated >= params.min_tokens
        stop_string = request.detokenizers[i].add_token(token, check_stop=check_stop)
        reason = None
        if stop_string is not None:
            reason, request.stop_reasons[i] = "stop", stop_string
        elif token in params.stop_token_ids and num_generated >= params.min_tokens:
            reason, request.stop_reasons[i] = "stop", token
        elif token in self.eos_ids and not params.ignore_eos and num_generated >= params.min_tokens:
            reason = "stop"
        elif num_generated >= seq.sampling.max_tokens:
            reason = "length"
        if reason is not None:
            # The last bytes of an unfinished character decode lossily (U+FFFD) only now; a
            # stop string they complete comes before the other condition, so it is the reason.
            tail_stop = request.detokenizers[i].finish(check_stop=check_stop)
            if tail_stop is not None:
                reason, request.stop_reasons[i] = "stop", tail_stop
            self.scheduler.finish(seq, reason)

    def _collect(self, changed: dict[str, _Request]) -> list[RequestOutput]:
        outputs = []
        for request in changed.values():
            is_finished = request.is_finished
            if is_finished and request.metrics.finished_time is None:
                request.metrics.finished_time = time.monotonic()
            if is_finished or not request.final_only:
                outputs.append(request.output(is_finished))
            if is_finished:
                self._drop(request)
        return outputs

    def _drop(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._seq_request.pop(seq.seq_id, None)


def _uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _needs_full_sampler(seq: Sequence) -> bool:
    params: SamplingParams = seq.sampling.params
    return (
        _uses_penalties(params)
        or params.logprobs is not None
        or params.min_tokens > 0
        or (params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0))
    )


def _derive_seed(base_seed: int, index: int, n: int) -> int:
    """Sample ``index``'s seed: the request's own for n == 1, a hash of (seed, index) otherwise."""
    if n == 1:
        return base_seed % 2**32
    digest = hashlib.sha256(f"{base_seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")

"""Engine: request bookkeeping for continuous batching. One step reads like a sentence:

    schedule -> launch on the device -> (while it runs) process the previous step's tokens -> collect

1. ``add_request`` validates the prompt and queues one ``Sequence`` per sample.
2. ``step`` asks the scheduler which tokens to compute (decodes first, then chunked
   prefills, one token budget: *what* runs); the runner packs the step's inputs
   (``jaxinfer.input_batch``: *how* it runs) and launches the jitted step; a placeholder is
   appended for each token being sampled on the device.
3. While the device runs, the output processor (``jaxinfer.output_processor``) fetches the
   *previous* step's sampled tokens, fills in their placeholders, detokenizes and checks stop
   conditions; the scheduler finishes the sequences that stopped, freeing their pages.
4. The requests that changed are collected as ``RequestOutput``s; finished ones are dropped.

A request under a grammar (``structured_outputs``) waits outside the scheduler until its grammar
is compiled (on the compiler's threads); a step that samples for constrained sequences has the
runner call back, once the forward is dispatched, for the grammar's token bitmask: the host
waits for the previous step's tokens of those sequences, advances their matchers and fills the
mask while the device computes (``jaxinfer.structured_output``, docs/STRUCTURED_OUTPUT.md).

Speculative decoding (``config.speculative_config``, ``jaxinfer.spec_decode``): before each
schedule the speculator drafts tokens for the running sequences; a step with drafts verifies
them on the device, and the engine reads its accepted tokens before the next step is
prepared (the next drafts continue them), then rolls each sequence back to what it kept. With
``async_verify`` the device drafts the next step itself and the engine reads each verify step a
step late, as it reads sampled tokens (``jaxinfer.spec_decode.lagged``).

Repetition/presence/frequency penalties read each sequence's history from token pages on
the device (``jaxinfer.token_history``), so they run under async scheduling too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time

import numpy as np

from jaxinfer.bad_words import bad_words_token_ids, check_bad_words
from jaxinfer.engine_config import EngineConfig, EngineConfigError
from jaxinfer.errors import PromptTooLongError, RequestError, RequestIdInUseError
from jaxinfer.input_batch import MAX_BANNED, PackedStep
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.logit_bias import check_logit_bias
from jaxinfer.output_processor import OutputProcessor, RequestState, fetch_samples
from jaxinfer.outputs import RequestOutput
from jaxinfer.page_allocator import PageAllocator
from jaxinfer.prompt_logprobs import PromptLogprobs, PromptScorer
from jaxinfer.runner import MASKED_SAMPLER_PATHS, ModelRunner, enable_persistent_compilation_cache
from jaxinfer.sampling import SamplerOutput
from jaxinfer.sampling_params import SamplingParams, SequenceSampling, banned_before_min_tokens
from jaxinfer.admission import AdmissionConfig
from jaxinfer.scheduler import Schedule, Scheduler, SchedulerConfig
from jaxinfer.sequence import Sequence, SequenceStatus
from jaxinfer.spec_decode.config import SpeculativeConfig
from jaxinfer.spec_decode.rejection import VerifyOutput
from jaxinfer.spec_decode.speculator import Speculator, roll_back
from jaxinfer.structured_output import GrammarCompiler, GrammarMatchers, check_grammar, guidance_tokenizer


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step dispatched to the device whose sampled tokens the host has not read yet."""

    packed: PackedStep
    sampler_output: SamplerOutput | VerifyOutput  # VerifyOutput when packed.verify is set


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, *, warm_up: bool = True, use_tqdm: bool = True,
                 mesh=None):
        enable_persistent_compilation_cache()
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_config = model.config
        # None fields become the platform defaults (a config built by engine_factory comes resolved).
        self.config = config = config.resolve(model, mesh=mesh)
        self.max_model_len = config.max_model_len
        identity = f"{model.source}:{model.config}:{model.weights.embed.dtype}"
        self.allocator = PageAllocator(config.num_pages, config.page_size, identity, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len, page_size=config.page_size, max_wait_s=config.max_wait_s,
                admission=AdmissionConfig(policy=config.scheduling_admission),
            ),
            self.allocator,
        )
        speculative = SpeculativeConfig.from_value(config.speculative_config)
        # Asynchronous verify steps: drafts made on the device a step ahead (jaxinfer.spec_decode.lagged).
        self.is_verify_lagged = bool(speculative is not None and speculative.async_verify and config.async_scheduling)
        eagle3_head = None  # (Eagle3Config, Eagle3Weights): its target steps also keep the head's features
        if speculative is not None and speculative.method == "eagle3":
            from jaxinfer.spec_decode.eagle3_proposer import load_head_for

            eagle3_head = load_head_for(speculative, model, mesh)
        self.runner = ModelRunner(
            model, num_pages=config.num_pages, page_size=config.page_size, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            attention_impl=config.attention_impl, mesh=mesh, overlap=config.overlap,
            kv_cache_dtype=config.kv_cache_dtype,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative is not None else 0,
            lagged_ngram=((speculative.prompt_lookup_min, speculative.prompt_lookup_max)
                          if self.is_verify_lagged else None),
            aux_hidden_layers=eagle3_head[0].aux_layer_ids if eagle3_head is not None else (),
        )
        self.speculator = None
        if speculative is not None:
            proposer = self._draft_proposer(speculative, mesh, eagle3_head) if speculative.model else None
            self.speculator = Speculator(speculative, config.max_model_len, proposer)
        # Prompt logprobs run as their own program over the runner's (possibly sharded) weights,
        # never through the step programs: see jaxinfer.prompt_logprobs.
        self.prompt_scorer = PromptScorer(
            self.runner.model.weights, self.runner.config, page_size=config.page_size,
            attention_impl=config.attention_impl, placement=self.runner.placement,
            kv_cache_dtype=config.kv_cache_dtype, kv_cache_scales=model.kv_cache_scales,
        )
        self.eos_ids = frozenset(model.tokenizer.eos_token_ids) | frozenset(model.config.eos_token_ids)
        self.output_processor = OutputProcessor(self.eos_ids)
        vocab_size = model.config.vocab_size
        # The llguidance tokenizer is built on the compiler's thread, at the first grammar.
        self.grammar_compiler = GrammarCompiler(lambda: guidance_tokenizer(self.tokenizer, vocab_size, self.eos_ids))
        self.grammars = GrammarMatchers(min(self.tokenizer.vocab_size, vocab_size), vocab_size, self.eos_ids)
        self._grammar_advanced: LaunchedStep | None = None  # the launched step whose tokens the matchers consumed
        self.grammar_mask_seconds = 0.0  # host time filling structured-output bitmasks
        self._requests: dict[str, RequestState] = {}
        self._seq_request: dict[int, RequestState] = {}
        self._seq_ids = itertools.count()
        self._launched: LaunchedStep | None = None
        self._aborted: list[RequestState] = []  # reported as finished by the next step()
        self.prompt_tokens_total = 0
        self.num_tokens_computed = 0
        self.last_step_num_tokens = 0
        self.device_wait_seconds = 0.0  # host time spent blocked on the device's results
        # Host time inside the runner's dispatch: small unless a program syncs with the host
        # (as a lax.cond did on the GPU), which takes the overlap of host and device away.
        self.dispatch_seconds = 0.0
        self.warmup_seconds = 0.0
        if warm_up:
            self.warmup(use_tqdm)

    def warmup(self, use_tqdm: bool = True) -> float:
        """Compile every step shape now (if not done at construction); returns seconds spent."""
        if not self.runner.warmup_done:
            start = time.perf_counter()
            self.runner.warm_up(use_tqdm)
            if self.speculator is not None:
                self.speculator.proposer.warm_up()
            self.warmup_seconds = time.perf_counter() - start
        return self.warmup_seconds

    def _draft_proposer(self, speculative: SpeculativeConfig, mesh, eagle3_head=None):
        """The draft model named by ``speculative.model``, in the target's dtype, with its own cache
        (or, with ``eagle3_head``, that head reading the runner's auxiliary hidden states)."""
        if eagle3_head is not None:
            from jaxinfer.spec_decode.eagle3_proposer import Eagle3Proposer

            return Eagle3Proposer(
                *eagle3_head, target_embed=lambda: self.runner.model.weights.embed,
                aux_pages=lambda: self.runner.aux_pages, num_pages=self.config.num_pages,
                page_size=self.config.page_size, buckets=self.runner.buckets,
                num_speculative_tokens=speculative.num_speculative_tokens, allocator=self.allocator,
                attention_impl=self.config.attention_impl)
        from jaxinfer.checkpoint import load_model
        from jaxinfer.spec_decode.draft_model import DraftModelProposer

        if mesh is not None:
            raise EngineConfigError("a draft model runs on one device: use the n-gram proposer with tensor "
                                    "or data parallelism", field="speculative_config")
        draft = load_model(speculative.model, dtype=str(self.model.weights.embed.dtype))
        return DraftModelProposer(
            draft, target_vocab_size=self.model_config.vocab_size, num_pages=self.config.num_pages,
            page_size=self.config.page_size, buckets=self.runner.buckets,
            num_speculative_tokens=speculative.num_speculative_tokens, allocator=self.allocator,
            attention_impl=self.config.attention_impl)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, final_only: bool = False) -> None:
        """Queue a request; raises a ``RequestError`` (a ``ValueError``) naming the field and the
        limit if it cannot run.

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
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt_token_ids))
        banned = banned_before_min_tokens(params, self.eos_ids)
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer) if params.bad_words else ()
        seqs = [
            Sequence(
                next(self._seq_ids), request_id, prompt_token_ids, arrival_time=arrival, max_tokens=max_tokens,
                sampling=SequenceSampling(params, _derive_seed(base_seed, index, params.n), max_tokens, index, banned,
                                          bad_words),
            )
            for index in range(params.n)
        ]
        request = RequestState(request_id, prompt, list(prompt_token_ids), params, seqs, self.tokenizer, arrival,
                               final_only, prompt_logprobs)
        self._requests[request_id] = request
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler.submit(params.structured_outputs)
        for seq in seqs:
            self._seq_request[seq.seq_id] = request
            if grammar is None:
                self.scheduler.add(seq)
            else:  # scheduled once its grammar is compiled (step)
                self.grammars.add(seq, grammar)
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
        """Raise the ``RequestError`` ``add_request`` would for this prompt and these params, if any."""
        self._check_prompt(prompt_token_ids, leave_room_for_output=True)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})", field="stop_token_ids", limit=vocab)
        # Before min_tokens the device bans EOS and the stop ids through a fixed-width list:
        # past its width the rest were silently left unbanned and could be sampled early.
        num_banned = len(banned_before_min_tokens(params, self.eos_ids))
        if params.min_tokens > 0 and num_banned > MAX_BANNED:
            raise RequestError(
                f"min_tokens needs {num_banned} token ids banned (stop_token_ids and EOS), "
                f"more than the {MAX_BANNED} supported",
                field="min_tokens", limit=MAX_BANNED,
            )
        # logit_bias and bad words travel to the device in fixed-width lists.
        if params.logit_bias:
            check_logit_bias(params.logit_bias, vocab)
        if params.bad_words:
            check_bad_words(bad_words_token_ids(params.bad_words, self.tokenizer))
        if params.structured_outputs is not None:
            if params.min_tokens > 0:
                # Before min_tokens EOS is banned, but a complete grammar allows nothing else.
                raise RequestError("min_tokens cannot be combined with structured_outputs", field="min_tokens",
                                   limit=0)
            if self.runner.is_observed:
                # Other hosts replay each step's inputs (jaxinfer.distributed), not the bitmask.
                raise RequestError("structured_outputs is not supported on a multi-host engine yet",
                                   field="structured_outputs")
            check_grammar(params.structured_outputs)  # unsupported schema keywords: named here

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request, freeing its pages now; its last output (finish
        reason "abort") comes from the next ``step``. False when there is nothing to abort: an
        unknown id, or one already finished or aborted."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        for seq in request.seqs:
            self._finish(seq, "abort")
        self._aborted.append(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._launched is not None or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """Schedule, launch, process the previous step's tokens, collect: the outputs of the
        requests that changed (aborted ones included)."""
        self._admit_compiled_grammars()
        changed = {request.request_id: request for request in self._aborted}
        self._aborted.clear()
        if self.speculator is not None:
            self._draft(changed)
        schedule = self.scheduler.schedule()
        previous = self._launched
        self._launched = None if schedule.is_empty else self._launch(schedule, previous)
        if not self.config.async_scheduling:
            # Nothing stays in flight between synchronous steps: this step's own tokens are next.
            previous, self._launched = self._launched, None
        if previous is not None:
            self._process(previous, changed)
        elif schedule.wait_until is not None:  # nothing to do yet: gather arrivals for the first step
            time.sleep(max(0.0, schedule.wait_until - time.monotonic()))
        elif schedule.is_empty and self.grammars.num_waiting:  # only grammars to wait for
            self.grammars.wait(timeout=0.05)
        return self._collect(changed)

    def _draft(self, changed: dict[str, RequestState]) -> None:
        """Give the running sequences their drafts for the next schedule. Drafts continue a
        sequence's last token, so the step in flight is read first whenever someone may speculate
        (and always after a verify step, whose sequences roll back before they are scheduled)."""
        if self.is_verify_lagged:
            return self._draft_lagged(changed)
        launched = self._launched
        running = self.scheduler.running
        if launched is not None and (launched.packed.verify is not None or self.speculator.may_speculate(running)):
            self._launched = None
            self._process(launched, changed)
        self.speculator.propose(self.scheduler.running, waiting=self.scheduler.waiting)

    def _draft_lagged(self, changed: dict[str, RequestState]) -> None:
        """Asynchronous verify steps: the sequences of a verify step in flight continue it with the
        device's drafts, unread. The host reads the step in flight only to start speculating (a
        plain step's tokens seed the host's first drafts) or to stop (nobody may speculate: the
        steps after it are plain again, and a constrained row needs a plain, masked step)."""
        launched = self._launched
        # A sequence the step may admit counts too: a constrained one needs a plain (masked) step.
        may_speculate = self.speculator.may_speculate(self.scheduler.running, self.scheduler.waiting)
        is_verify = launched is not None and launched.packed.verify is not None
        if launched is not None and is_verify != may_speculate:
            self._launched = None
            self._process(launched, changed)
            launched = None
        continuing = frozenset()
        if launched is not None and launched.packed.verify is not None:
            continuing = frozenset(seq.seq_id for seq, _ in launched.packed.sampled if not seq.is_finished)
        self.speculator.propose(self.scheduler.running, continuing, self.scheduler.waiting)

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
            # The admission's estimate (jaxinfer.admission): the fraction of the remaining outputs
            # it expects, and the pages it held back for the running sequences at its last check.
            admission_new_token_ratio=self.scheduler.admission.ratio,
            admission_reserved_pages=self.scheduler.admission.num_reserved_pages,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.output_processor.num_generation_tokens,
            num_tokens_computed=self.num_tokens_computed,
            num_compilations_after_warmup=self.runner.num_compilations_after_warmup + (
                self.speculator.proposer.num_compilations_after_warmup if self.speculator is not None else 0),
            # Prompt scoring compiles per prompt-length bucket on first use (jaxinfer.prompt_logprobs).
            num_prompt_scoring_programs=len(self.prompt_scorer.buckets_compiled),
            last_step_num_tokens=self.last_step_num_tokens,
            grammar_compilations=self.grammar_compiler.num_compiled,
            grammar_cache_hits=self.grammar_compiler.num_cache_hits,
            num_waiting_for_grammar=self.grammars.num_waiting,
            grammar_mask_seconds=self.grammar_mask_seconds,
            **(self.speculator.stats() if self.speculator is not None else {}),
        )

    def _admit_compiled_grammars(self) -> None:
        """Hand the sequences whose grammar is compiled to the scheduler; a grammar that failed to
        build aborts its request."""
        for seq, error in self.grammars.take_ready():
            request = self._seq_request.get(seq.seq_id)
            if error is None:
                self.scheduler.add(seq)
            elif request is not None and not request.is_finished:
                for sibling in request.seqs:
                    self._finish(sibling, "abort")
                self._aborted.append(request)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq``, whether the scheduler holds it or it still waits for its grammar."""
        if self.grammars.is_waiting(seq):
            self.grammars.drop(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        else:
            self.scheduler.finish(seq, reason)

    def _grammar_bitmask(self, packed: PackedStep, in_flight: LaunchedStep | None):
        """The runner's callback for a step on a "_masked" sampler path: runs once the forward is dispatched."""

        def fill() -> np.ndarray:
            if in_flight is not None and self._grammar_advanced is not in_flight:
                wait_start = time.monotonic()
                tokens = np.asarray(in_flight.sampler_output.token_ids)  # the previous step's samples
                self.device_wait_seconds += time.monotonic() - wait_start
                self.grammars.advance(in_flight.packed.sampled, tokens)
                self._grammar_advanced = in_flight
            fill_start = time.monotonic()
            bitmask = self.grammars.fill_bitmask(packed.sampled, packed.inputs.batch.num_seqs)
            self.grammar_mask_seconds += time.monotonic() - fill_start
            return bitmask

        return fill

    def _launch(self, schedule: Schedule, in_flight: LaunchedStep | None) -> LaunchedStep:
        """Pack and dispatch ``schedule``'s step, then account for it as if done (the device
        runs steps in order): computed tokens advance, a placeholder awaits each sampled token.
        ``in_flight``: the step the device may still run, whose samples fill placeholders."""
        packed = self.runner.prepare(schedule, in_flight.packed if in_flight is not None else None)
        now = time.monotonic()
        for item in schedule.items:
            seq = item.seq
            # Only a sequence without generated tokens can be scheduled for the first time (a
            # decode always has one): the others skip the lookup.
            if len(seq.token_ids) == seq.num_prompt_tokens:
                metrics = self._seq_request[seq.seq_id].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
        dispatch_start = time.monotonic()
        is_masked = packed.inputs.sampler_path in MASKED_SAMPLER_PATHS
        token_bitmask = self._grammar_bitmask(packed, in_flight) if is_masked else None
        sampler_output = self.runner.execute(packed.inputs, token_bitmask)
        self.dispatch_seconds += time.monotonic() - dispatch_start
        self.num_tokens_computed += schedule.num_batched_tokens
        self.last_step_num_tokens = schedule.num_batched_tokens
        self.scheduler.postprocess(schedule)
        finished = SequenceStatus.FINISHED
        for seq, _ in packed.sampled:
            if seq.status is not finished:
                seq.append_placeholder()
        if self.is_verify_lagged:
            # The next step may find these sequences up to their drafts further on than the host counts.
            for item in schedule.items:
                item.seq.num_lookahead_slots = len(item.draft_token_ids) if packed.verify is not None else 0
        return LaunchedStep(packed, sampler_output)

    def _process(self, launched: LaunchedStep, changed: dict[str, RequestState]) -> None:
        """Read a launched step's sampled tokens into their requests; finish the samples that stop."""
        if launched.packed.verify is not None:
            return self._process_verified(launched, changed)
        wait_start = time.monotonic()
        fetched = fetch_samples(launched.sampler_output, with_logprobs=launched.packed.wants_logprobs)
        self.device_wait_seconds += time.monotonic() - wait_start
        if self._grammar_advanced is not launched:  # not yet consumed by a bitmask callback
            self.grammars.advance(launched.packed.sampled, fetched.token_ids)
        self._grammar_advanced = None
        stops = self.output_processor.process(launched.packed.sampled, fetched, self._seq_request, changed)
        if self.grammars.num_constrained:
            stopping = {seq.seq_id for seq, _ in stops}
            # A grammar that consumed EOS ends its sequence even under ignore_eos: nothing may follow.
            done = [(seq, "stop") for seq, _ in launched.packed.sampled
                    if seq.seq_id not in stopping and not seq.is_finished and self.grammars.is_done(seq)]
            for seq, _ in done:  # a final-only request is in ``changed`` only once a sample stops
                request = self._seq_request[seq.seq_id]
                changed[request.request_id] = request
            stops += done
        for seq, reason in stops:
            self.scheduler.finish(seq, reason)

    def _process_verified(self, launched: LaunchedStep, changed: dict[str, RequestState]) -> None:
        """A verify step: each sequence keeps its accepted drafts and the token after them (in
        order, so a stop inside the run ends it where a plain run would), then rolls back."""
        out: VerifyOutput = launched.sampler_output
        verify = launched.packed.verify
        wait_start = time.monotonic()
        num_accepted = np.asarray(out.num_accepted).tolist()
        num_drafts = np.asarray(out.num_drafts).tolist()  # the device's count: it drafts for lagged steps
        fetched = fetch_samples(out.sampler, with_logprobs=launched.packed.wants_logprobs)
        self.device_wait_seconds += time.monotonic() - wait_start
        for seq, slot in launched.packed.sampled:
            if not seq.is_finished and num_accepted[slot]:
                # The run's tokens come before the placeholder of any step launched since (lagged steps).
                seq.insert_placeholders(seq.first_placeholder_index + 1, num_accepted[slot])
        sampled = [(seq, row) for seq, slot in launched.packed.sampled
                   for row in verify.rows_of(slot, num_accepted[slot])]
        stops = self.output_processor.process(sampled, fetched, self._seq_request, changed)
        for seq, reason in stops:
            self.scheduler.finish(seq, reason)
        in_flight = {seq.seq_id for seq, _ in self._launched.packed.sampled} if self._launched is not None else set()
        for seq, slot in launched.packed.sampled:
            if seq.is_finished:
                continue
            if seq.seq_id not in in_flight:
                seq.num_lookahead_slots = 0
            if seq.status is SequenceStatus.RUNNING:  # not preempted since: it recomputes from scratch
                roll_back(seq, self.allocator, seq.num_lookahead_slots)
            if num_drafts[slot]:
                self.speculator.record(seq, num_drafts[slot], num_accepted[slot])

    def _collect(self, changed: dict[str, RequestState]) -> list[RequestOutput]:
        outputs = self.output_processor.collect(changed)
        for request in changed.values():
            if request.is_finished:
                self._drop(request)
        return outputs

    def _drop(self, request: RequestState) -> None:
        self._requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._seq_request.pop(seq.seq_id, None)
            self.grammars.drop(seq)
            if self.speculator is not None:
                self.speculator.forget(seq)


def _derive_seed(base_seed: int, index: int, n: int) -> int:
    """Sample ``index``'s seed: the request's own for n == 1, a hash of (seed, index) otherwise."""
    if n == 1:
        return base_seed % 2**32
    digest = hashlib.sha256(f"{base_seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")

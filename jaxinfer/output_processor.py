"""Output processing: a step's sampled token ids become sequence tokens, text, stops and outputs.

One launched step comes back here a step later (async scheduling): :func:`fetch_samples`
copies its sampled ids (and logprobs, when a row asked) to the host; :meth:`OutputProcessor.process`
writes each token over its sequence's placeholder, records logprobs and timings, feeds the
sample's ``Detokenizer`` and decides whether the sample stops (stop string, stop token, EOS,
``max_tokens``); :meth:`OutputProcessor.collect` builds the ``RequestOutput`` of every request
that changed. Which sequences finish is returned to the engine, whose scheduler frees their pages.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxinfer.detokenizer import Detokenizer
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.prompt_logprobs import PromptLogprobs
from jaxinfer.sampling import SamplerOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.sequence import Sequence, SequenceStatus
from jaxinfer.tokenizer import Tokenizer


class RequestState:
    """Host state of one request's outputs: its samples and what they have produced."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], tokenizer: Tokenizer, arrival_time: float, final_only: bool = False,
                 prompt_logprobs: PromptLogprobs | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = seqs
        # Tokens each sample has produced, filled as they arrive from the device (no placeholders).
        self.output_token_ids: list[list[int]] = [[] for _ in seqs]
        # A plain request needs nothing per token but its ids: it outputs once, when it finishes
        # (final_only), with no logprobs and no stop strings to search its text for. Its text is
        # decoded from output_token_ids when first read, and only a token that may stop it (a stop
        # id or EOS, or its max_tokens) takes the full stop check (OutputProcessor.process).
        self.is_plain = final_only and not params.stop and params.logprobs is None
        self.plain_stop_ids: frozenset[int] | None = None  # set by the output processor on first use
        # A final-only sample's text is read once it ends: its tokens are detokenized then (unless
        # stop strings must be searched for as they come).
        self.detokenizers = [
            Detokenizer(tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output,
                        defer=final_only, token_source=tokens if self.is_plain else None)
            for tokens in self.output_token_ids
        ]
        self.logprobs: list[list[dict[int, float]]] = [[] for _ in seqs]
        self.cumulative_logprob = [0.0 for _ in seqs]
        self.stop_reasons: list[int | str | None] = [None for _ in seqs]
        self.final_only = final_only  # output only once finished, not after every step
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_ids))
        self.prompt_logprobs = prompt_logprobs

    @property
    def is_finished(self) -> bool:
        # A loop, not all() over a generator: asked twice a step of every request that changed.
        for seq in self.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    def output(self, is_finished: bool) -> RequestOutput:
        """The request's outputs so far. Token lists are live: they keep growing until it finishes."""
        with_logprobs = self.params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=i,
                text=self.detokenizers[i].visible_text(seq.is_finished),
                token_ids=self.output_token_ids[i],
                finish_reason=seq.finish_reason,
                stop_reason=self.stop_reasons[i],
                logprobs=self.logprobs[i] if with_logprobs else None,
                cumulative_logprob=self.cumulative_logprob[i] if with_logprobs else None,
            )
            for i, seq in enumerate(self.seqs)
        ]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
            outputs=outputs, finished=is_finished, num_cached_tokens=self.seqs[0].num_cached_tokens,
            metrics=self.metrics, prompt_logprobs=self.prompt_logprobs,
        )


@dataclasses.dataclass(frozen=True)
class FetchedSamples:
    """A step's sampler output on the host: one entry per row."""

    token_ids: list[int]
    logprobs: SamplerOutput | None  # numpy arrays; None unless a row asked for logprobs


def fetch_samples(sampler_output: SamplerOutput, with_logprobs: bool) -> FetchedSamples:
    """Wait for a step's sampled tokens and copy them to the host: one device-to-host copy per
    array needed, the logprob arrays only when asked for."""
    token_ids = np.asarray(sampler_output.token_ids).tolist()
    return FetchedSamples(token_ids, jax.device_get(sampler_output) if with_logprobs else None)


class OutputProcessor:
    def __init__(self, eos_ids: frozenset[int]):
        self.eos_ids = eos_ids
        self.num_generation_tokens = 0  # tokens applied to a live sample, since start

    def process(self, sampled: list[tuple[Sequence, int]], fetched: FetchedSamples,
                request_of_seq: dict[int, RequestState], changed: dict[str, RequestState]) -> list[tuple[Sequence, str]]:
        """Apply the token of each ``(sequence, row)`` of a step; adds the requests it changes to
        ``changed`` (a final-only request only when a sample stops: it outputs nothing before it
        finishes) and returns the sequences that stop, with their finish reasons."""
        now = time.monotonic()
        token_ids, out = fetched.token_ids, fetched.logprobs
        stops = []
        stopped: set[int] = set()
        finished = SequenceStatus.FINISHED
        request_of = request_of_seq.get
        num_applied = 0
        # Runs for every sampled row of every step (1000 at a time): locals, no per-row helpers
        # beyond the stop check, and for plain requests not even that unless the token may stop.
        for seq, row in sampled:
            request = request_of(seq.seq_id)
            if request is None or seq.status is finished or seq.seq_id in stopped:
                continue  # aborted or already stopped: this sample (and the rest of its run) is dropped
            token = token_ids[row]
            # The earliest placeholder is this step's; later ones (the step now running, the rest
            # of an asynchronous verify step's run) may follow. Without one: a later token of a
            # verify step's accepted run (jaxinfer.spec_decode), appended.
            seq.fill_next_token(token)
            num_applied += 1
            i = seq.sampling.index
            request.output_token_ids[i].append(token)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generation_tokens += 1
            if request.is_plain:
                stop_ids = request.plain_stop_ids
                if stop_ids is None:
                    stop_ids = request.plain_stop_ids = self._plain_stop_ids(request.params)
                if token not in stop_ids and len(seq.token_ids) - seq.num_prompt_tokens - seq.num_placeholders \
                        < seq.sampling.max_tokens:
                    continue  # cannot stop here (the full check below agrees): nothing else to do
            else:
                num_top = request.params.logprobs
                if num_top is not None:
                    entry = {token: float(out.logprobs[row])}
                    for tid, value in zip(out.top_logprob_ids[row][:num_top], out.top_logprob_values[row]):
                        entry.setdefault(int(tid), float(value))
                    request.logprobs[i].append(entry)
                    request.cumulative_logprob[i] += float(out.logprobs[row])
                changed[request.request_id] = request
            reason = self._stop_reason(request, i, seq, token)
            if reason is not None:
                stops.append((seq, reason))
                stopped.add(seq.seq_id)
                changed[request.request_id] = request
        self.num_generation_tokens += num_applied
        return stops

    def _plain_stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that may stop a plain request's sample: its stop ids and, unless it
        ignores EOS, the EOS ids (whether one does depends on min_tokens: ``_stop_reason``)."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)

    def _stop_reason(self, request: RequestState, i: int, seq: Sequence, token: int) -> str | None:
        """Detokenize sample ``i``'s new ``token``; why the sample stops with it, or None."""
        params = request.params
        num_generated = seq.num_generated_tokens - seq.num_placeholders  # this token included
        # min_tokens holds back every stop condition, stop strings included (vLLM's semantics):
        # before this, a stop string in the first min_tokens tokens ended the sample early.
        check_stop = num_generated >= params.min_tokens
        # A plain request's detokenizer reads its tokens from output_token_ids, and has no stop strings.
        stop_string = None if request.is_plain else request.detokenizers[i].add_token(token, check_stop=check_stop)
        reason = None
        if stop_string is not None:
            reason, request.stop_reasons[i] = "stop", stop_string
        elif token in params.stop_token_ids and check_stop:
            reason, request.stop_reasons[i] = "stop", token
        elif token in self.eos_ids and not params.ignore_eos and check_stop:
            reason = "stop"
        elif num_generated >= seq.sampling.max_tokens:
            reason = "length"
        if reason is not None:
            # The last bytes of an unfinished character decode lossily (U+FFFD) only now; a
            # stop string they complete comes before the other condition, so it is the reason.
            tail_stop = request.detokenizers[i].finish(check_stop=check_stop)
            if tail_stop is not None:
                reason, request.stop_reasons[i] = "stop", tail_stop
        return reason

    @staticmethod
    def collect(changed: dict[str, RequestState]) -> list[RequestOutput]:
        """The outputs of the requests that changed: every one that finished, and the others
        unless they asked for their final output only."""
        outputs = []
        for request in changed.values():
            is_finished = request.is_finished
            if is_finished and request.metrics.finished_time is None:
                request.metrics.finished_time = time.monotonic()
            if is_finished or not request.final_only:
                outputs.append(request.output(is_finished))
        return outputs

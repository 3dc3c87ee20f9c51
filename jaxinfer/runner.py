"""ModelRunner: turns a Schedule into one jitted device step (forward + sampling).

The host packs the step's inputs as numpy and sends them in one transfer; the step is
padded to a bucket (tokens, sequences, page-table width) so that every program is compiled
at start-up and none after. The KV cache is donated and updated in place. Sampled tokens
stay on the device: the next step reads a decode's input token from the previous step's
output wherever the host still holds a placeholder (async scheduling), so the host can
prepare step n+1 while the device runs step n.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.batch import StepBatch
from jaxinfer.checkpoint import LoadedModel
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.model import forward
from jaxinfer.page_allocator import SCRATCH_PAGE
from jaxinfer.sampling import SamplerOutput, SamplingFlags, SamplingTensors, sample

logger = logging.getLogger(__name__)

# Two compiled sampling variants: "basic" serves greedy and plain temperature sampling;
# "full" adds penalties, bans (min_tokens), top-k/top-p/min-p and 20 top logprobs.
SAMPLING_VARIANTS = {
    "basic": SamplingFlags(any_random=True),
    "full": SamplingFlags(any_penalties=True, any_banned=True, any_random=True, any_truncation=True, num_top_logprobs=20),
}
HISTORY_BUCKETS_MIN = 64  # the history length is a multiple of this
MAX_BANNED = 16


def powers_of_two(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    out, n = [], low
    while n < high:
        out.append(n)
        n *= factor
    return tuple(out) + (high,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded step shapes compiled at start-up; a step takes the smallest that fits."""

    num_tokens: tuple[int, ...]
    num_seqs: tuple[int, ...]
    pages_per_seq: tuple[int, ...]

    def pick(self, num_tokens: int, num_seqs: int, pages: int) -> tuple[int, int, int]:
        def smallest(options, n, what):
            for o in options:
                if o >= n:
                    return o
            raise ValueError(f"{what}={n} exceeds the largest bucket {options[-1]}")

        return (
            smallest(self.num_tokens, num_tokens, "num_tokens"),
            smallest(self.num_seqs, num_seqs, "num_seqs"),
            smallest(self.pages_per_seq, pages, "pages_per_seq"),
        )

    def all(self) -> list[tuple[int, int, int]]:
        return [(t, b, p) for t, b, p in itertools.product(self.num_tokens, self.num_seqs, self.pages_per_seq) if b <= t]


def default_buckets(max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int, platform: str) -> Buckets:
    """GPU/TPU: powers of two. CPU: fewer, coarser buckets, since compiling costs more than padding there."""
    if platform == "cpu":
        seqs = (max_num_seqs,)
        tokens = powers_of_two(min(max_num_seqs, max_num_batched_tokens), max_num_batched_tokens, factor=4)
        pages = tuple(sorted({max(1, max_pages_per_seq // 8), max_pages_per_seq}))
    else:
        seqs = powers_of_two(min(8, max_num_seqs), max_num_seqs)
        tokens = powers_of_two(min(16, max_num_batched_tokens), max_num_batched_tokens)
        tokens = tuple(sorted(set(tokens) | set(seqs)))
        pages = (max_pages_per_seq,)  # the kernels read only each sequence's pages
    return Buckets(tokens, seqs, pages)


@dataclasses.dataclass
class StepInputs:
    """Host-side arrays of one step, sent to the device together."""

    batch: StepBatch
    sampling: SamplingTensors
    prev_rows: np.ndarray  # [T] int32: row of the previous step's sampled tokens to use, or -1
    variant: str


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        buckets: Buckets | None = None,
        attention_impl: str = "auto",
        sampling_variants: tuple[str, ...] = ("basic", "full"),
    ):
        self.model = model
        self.config = model.config
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = math.ceil(max_model_len / page_size)
        self.buckets = buckets or default_buckets(
            max_num_seqs, max_num_batched_tokens, self.max_pages_per_seq, jax.default_backend()
        )
        self.attention_impl = attention_impl
        self.sampling_variants = sampling_variants
        self.max_history_len = -(-max_model_len // HISTORY_BUCKETS_MIN) * HISTORY_BUCKETS_MIN
        self.cache = create_kv_cache(self.config, num_pages, page_size, model.weights.embed.dtype)
        # Sampled tokens of the last step, padded to max_num_seqs so their shape never changes.
        # Made by a jitted function, like every later value, so the step's signature never changes.
        self.last_sampled = jax.jit(lambda: jnp.zeros((self.buckets.num_seqs[-1],), jnp.int32))()
        self._step = jax.jit(
            functools.partial(_device_step, config=self.config, attention_impl=attention_impl),
            static_argnames=("flags",),
            donate_argnames=("cache",),
        )
        self.num_compilations = 0
        self.warmup_done = False

    def history_len(self, needed: int) -> int:
        """Penalty history length: one fixed size (the context) so that no length ever compiles anew.

        It costs a [B, max_model_len] transfer on steps that use the "full" sampler; a
        device-resident token-count table would remove it.
        """
        if needed > self.max_history_len:
            raise ValueError(f"penalty history of {needed} tokens exceeds max_model_len {self.max_history_len}")
        return self.max_history_len

    def warm_up(self, use_tqdm: bool = True) -> float:
        """Compile every bucket and sampling variant now; returns seconds spent."""
        start = time.perf_counter()
        shapes = [(shape, variant) for shape in self.buckets.all() for variant in self.sampling_variants]
        for (num_tokens, num_seqs, pages), variant in tqdm(shapes, desc="Compiling", unit="program", disable=not use_tqdm):
            history = self.history_len(1) if variant == "full" else 0
            inputs = self._empty_inputs(num_tokens, num_seqs, pages, history, variant)
            out = self.execute(inputs)
            jax.block_until_ready(out.token_ids)
        self.warmup_done = True
        self._cache_size_after_warmup = self._step._cache_size()
        seconds = time.perf_counter() - start
        logger.info("compiled %d step programs in %.1f s", len(shapes), seconds)
        return seconds

    @property
    def num_compilations_after_warmup(self) -> int:
        if not self.warmup_done:
            return 0
        return self._step._cache_size() - self._cache_size_after_warmup

    def _empty_inputs(self, num_tokens, num_seqs, pages, history, variant) -> StepInputs:
        batch = StepBatch(
            token_ids=np.zeros(num_tokens, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            cu_q_lens=np.zeros(num_seqs + 1, np.int32),
            kv_lens=np.zeros(num_seqs, np.int32),
            page_tables=np.full((num_seqs, pages), SCRATCH_PAGE, np.int32),
            logits_indices=np.zeros(num_seqs, np.int32),
        )
        sampling = SamplingTensors.neutral(num_seqs, history, MAX_BANNED if variant == "full" else 0)
        return StepInputs(batch, sampling, np.full(num_tokens, -1, np.int32), variant)

    def execute(self, inputs: StepInputs) -> SamplerOutput:
        """Dispatch one step (asynchronously); returns the device-side sampler output."""
        flags = SAMPLING_VARIANTS[inputs.variant]
        batch, sampling, prev_rows = jax.device_put((inputs.batch, inputs.sampling, inputs.prev_rows))
        out, self.cache = self._step(
            self.model.weights, self.cache, batch, sampling, prev_rows, self.last_sampled, flags=flags
        )
        self.last_sampled = out.token_ids_padded
        return out.sampler


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _StepOutput:
    sampler: SamplerOutput
    token_ids_padded: jax.Array  # [max_num_seqs]


def _device_step(weights, cache, batch, sampling, prev_rows, last_sampled, *, config, attention_impl, flags):
    # A placeholder input is the token this sequence sampled in the previous step.
    from_previous = jnp.take(last_sampled, jnp.maximum(prev_rows, 0))
    token_ids = jnp.where(prev_rows >= 0, from_previous, batch.token_ids)
    batch = dataclasses.replace(batch, token_ids=token_ids)
    logits, cache = forward(weights, cache, batch, config, attention_impl)
    out = sample(logits, sampling, flags)
    padded = jnp.zeros_like(last_sampled).at[: out.token_ids.shape[0]].set(out.token_ids)
    return _StepOutput(out, padded), cache

"""ModelRunner: turns a Schedule into one device step: a jitted forward, then a jitted sampler.

``prepare`` packs the step's inputs as numpy (``jaxinfer.input_batch``); ``execute`` sends
them in one transfer and dispatches the programs. The step is padded to a bucket (tokens,
sequences, page-table width) so that every program is compiled at start-up and none after. The KV cache is donated and updated in place. Sampled tokens
stay on the device: the next step reads a decode's input token from the previous step's
output wherever the host still holds a placeholder (async scheduling), so the host can
prepare step n+1 while the device runs step n.

With ``num_speculative_tokens`` k > 0 every bucket also has a *verify* step (``jaxinfer.spec_decode``):
the same forward with ``k + 1`` logits rows per sequence slot, and a verifier in place of the
sampler that decides on the device how many drafts each sequence keeps. Both are compiled at
warm-up; a step is a verify step when its inputs carry drafts (``StepInputs.is_verify``).

The forward and the sampler are two programs, and the host picks the sampler path
("basic" or "full") by which program it dispatches. One program with a ``lax.cond``
between the paths compiled the model once per bucket too, but on the GPU a conditional
copies its predicate to the host and waits for it: every step's dispatch blocked until
the device reached the sampler, so the host's work for the next step never overlapped the
device's (the H200 sat idle for half of each decode step at batch 384).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import os
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.attention import shared_kernel_programs
from jaxinfer.bad_words import gather_output_tail
from jaxinfer.compile_counter import BackendCompiles, CompilationCounter
from jaxinfer.compile_options import PhasedJit, graph_options
from jaxinfer.input_batch import PackedStep, StepInputs, empty_step_inputs, is_full_path, pack_step
from jaxinfer.kv_cache import create_kv_cache, engine_v_layout
from jaxinfer.kv_cache_dtype import storage_dtype
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.model import forward, forward_with_aux
from jaxinfer.page_table_rows import PageTableRows
from jaxinfer.sampling import SamplerOutput, SamplingFlags, sample
from jaxinfer.sampling_params import MAX_TOP_LOGPROBS
from jaxinfer.scheduler import Schedule
from jaxinfer.structured_output.bitmask import allocate_bitmask, bitmask_width
from jaxinfer.spec_decode.aux_hidden import create_aux_pages, write_aux_hidden
from jaxinfer.spec_decode.lagged import DeviceDrafts, continue_batch, continue_verify_inputs, drafts_for_next_step
from jaxinfer.spec_decode.layout import expand_to_rows
from jaxinfer.spec_decode.rejection import VerifyOutput, verify
from jaxinfer.token_history import gather_history, write_tokens
from sharding.placement import StepPlacement, committed_device

logger = logging.getLogger(__name__)

# Sampler paths, each its own small program per sequence bucket, chosen by the host per step:
# "basic" serves greedy and plain temperature sampling, without logprobs (a row asking for them
# takes "full": SequenceSampling.needs_full_sampler); "full" adds penalties, bans
# (min_tokens), logit_bias, bad words, top-k/top-p/min-p, logprobs and 20 top logprobs. Each has a
# "_masked" twin taking a structured-output token bitmask, an extra input filled on the host
# while the forward runs (docs/STRUCTURED_OUTPUT.md: why twins rather than a mask always there).
_BASIC_FLAGS = SamplingFlags(any_random=True, any_logprobs=False)
_FULL_FLAGS = SamplingFlags(any_penalties=True, any_banned=True, any_random=True, any_truncation=True,
                            num_top_logprobs=MAX_TOP_LOGPROBS, any_logit_bias=True, any_bad_words=True)
SAMPLER_PATHS = {"basic": _BASIC_FLAGS, "full": _FULL_FLAGS, "basic_masked": _BASIC_FLAGS, "full_masked": _FULL_FLAGS}
MASKED_SAMPLER_PATHS = frozenset({"basic_masked", "full_masked"})


def enable_persistent_compilation_cache() -> None:
    """Cache compiled programs on disk (unless the user chose a place) so a restart does not recompile."""
    if jax.config.jax_compilation_cache_dir is None:
        from jaxinfer.model_registry import default_cache_dir

        jax.config.update("jax_compilation_cache_dir", str(default_cache_dir() / "jax-compilation-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def powers_of_two(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    out, n = [], low
    while n < high:
        out.append(n)
        n *= factor
    return tuple(out) + (high,)


class ProgramCompileTime(NamedTuple):
    """One warm-up program: what it is and its seconds of lowering and of XLA compilation."""

    name: str  # "forward 8192x1024x128", "sampler full 1024x1024x128", ...
    lowering_seconds: float
    compile_seconds: float


class WarmupCompileTimes(NamedTuple):
    """Seconds of warm-up's ahead-of-time compilation: the pool's wall time, its longest program,
    its forward and sampler programs each summed (lowering and compiling), the lowering summed
    (serial, in the calling thread), every program's own times in the order they started, and the
    kernels compiled apart for the steps to share (``jaxinfer.attention.shared_kernel_programs``)."""

    pool_seconds: float
    longest_seconds: float
    forward_seconds: float
    sampler_seconds: float
    lowering_seconds: float = 0.0
    programs: tuple[ProgramCompileTime, ...] = ()
    kernel_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded step shapes compiled at start-up; a step takes the smallest that fits.

    A program is a (tokens, sequences, pages per sequence) triple. With ``tied_seqs`` the
    sequence bucket follows the token bucket (``min(tokens, largest sequence bucket)``), so
    there is one program per token bucket instead of one per pair: the extra sequence rows
    are empty slots, which cost the attention kernels nothing and the lm_head a few rows.
    """

    num_tokens: tuple[int, ...]
    num_seqs: tuple[int, ...]
    pages_per_seq: tuple[int, ...]
    tied_seqs: bool = False

    def pick(self, num_tokens: int, num_seqs: int, pages: int) -> tuple[int, int, int]:
        def smallest(options, n, what):
            for o in options:
                if o >= n:
                    return o
            raise ValueError(f"{what}={n} exceeds the largest bucket {options[-1]}")

        t = smallest(self.num_tokens, max(num_tokens, num_seqs), "num_tokens")
        wanted_seqs = max(num_seqs, min(t, self.num_seqs[-1])) if self.tied_seqs else num_seqs
        b = smallest(self.num_seqs, wanted_seqs, "num_seqs")
        return t, b, smallest(self.pages_per_seq, pages, "pages_per_seq")

    def all(self) -> list[tuple[int, int, int]]:
        if self.tied_seqs:
            pairs = [self.pick(t, 1, 1)[:2] for t in self.num_tokens]
        else:
            pairs = [(t, b) for t, b in itertools.product(self.num_tokens, self.num_seqs) if b <= t]
        return [(t, b, p) for (t, b), p in itertools.product(pairs, self.pages_per_seq)]


def default_buckets(max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int, platform: str,
                    one_row_bucket: bool = True) -> Buckets:
    """GPU/TPU: powers of two, 384/768/1536 between them above 256 rows, and ``max_num_seqs``; sequences
    tied to tokens (one program per token bucket).

    CPU: powers of four from 4, sequences tied too: fewer buckets, since compiling costs more
    than padding there, but none so coarse that a small batch pays for a large one; with
    ``one_row_bucket`` (float32 and int8 models) a 1-row bucket first.
    """
    if platform == "cpu":
        # A step gives each of its sequences at least one token, so it never holds more than
        # max_num_batched_tokens of them: the sequence buckets stop there.
        # One sequence bucket (max_num_seqs) padded a batch-1 decode to 16 rows offline and 64
        # through the server (its max_num_seqs): every step sampled and attended for them all.
        # A 1-row bucket of its own: padded to 4 rows, a batch-1 decode ran every projection as
        # a 4-row matmul and the lm_head over 4 rows of 49k logits; int8's native CPU matmul is
        # fastest at 1 row. Not for bfloat16: XLA:CPU's 1-row bf16 dot was 5x slower than the
        # 4-row one (its YNNPACK fusion): 290 vs ~50 ms a step, benchmarks/results/cpu_default_model.md.
        top_seqs = min(max_num_seqs, max_num_batched_tokens)
        first = (1,) if one_row_bucket else ()
        seqs = first + powers_of_two(min(4, top_seqs), top_seqs, factor=4) if top_seqs > 1 else (1,)
        tokens = first + powers_of_two(min(4, max_num_batched_tokens), max_num_batched_tokens, factor=4) \
            if max_num_batched_tokens > 1 else (1,)
        # The CPU attention path reads only each token's own context, whatever the table's width.
        return Buckets(tokens, seqs, (max_pages_per_seq,), tied_seqs=True)
    seqs = powers_of_two(min(8, max_num_seqs), max_num_seqs)
    tokens = powers_of_two(min(8, max_num_batched_tokens), max(max_num_batched_tokens, max_num_seqs))
    # A full decode step (max_num_seqs tokens) gets a bucket of its own: with 384 sequences the
    # next power of two ran every steady decode step's matmuls over 512 rows (33% padding).
    if tokens[0] < max_num_seqs < tokens[-1]:
        tokens = tuple(sorted(set(tokens) | {max_num_seqs}))
    # Above 256 rows a decode step's matmuls are bound by arithmetic, not by reading the weights
    # (by the H200's measured ceilings, 4.5 TB/s and 723 bf16 TFLOP/s, the two cross near 160 rows
    # for Llama-3.1-8B in bf16, and about there in fp8: half the bytes, twice the rate), so a
    # padded row costs what a real one does: between powers of two a step paid for up to twice its
    # rows (bf16 throughput-1k at 1024 sequences spent 34 s of 113 in steps of 513-896 sequences).
    # A bucket halfway (in ratio) between each pair of powers of two above 256, up to
    # max_num_seqs, tokens and sequences alike, keeps the padding under half: 384, 768, 1536.
    # Each bucket is ~5 programs to compile at start-up (every 128 rows instead cost 12 s more at
    # 1024 sequences).
    between = tuple(n for n in (3 * 2 ** e for e in range(7, 16)) if 256 < n < max_num_seqs)
    if between:
        seqs = tuple(sorted(set(seqs) | set(between)))
        tokens = tuple(sorted(set(tokens) | set(between)))
    pages = (max_pages_per_seq,)  # the kernels read only each sequence's pages
    return Buckets(tokens, seqs, pages, tied_seqs=True)


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
        mesh=None,
        overlap=None,
        kv_cache_dtype: str = "auto",
        num_speculative_tokens: int = 0,
        lagged_ngram: tuple[int, int] | None = None,
        stable_input_address: bool | None = None,
        aux_hidden_layers: tuple[int, ...] = (),
    ):
        """``mesh``: a ``sharding.make_mesh`` mesh the model was laid out on (``sharding.shard_model``);
        ``overlap``: a ``jaxinfer.compile_options.OverlapConfig`` (communication overlap per phase);
        ``num_speculative_tokens``: k > 0 compiles verify steps (k + 1 logits rows per sequence
        slot, ``jaxinfer.spec_decode``) beside the plain ones at warm-up; ``lagged_ngram``
        (``(prompt_lookup_min, prompt_lookup_max)``): verify steps are asynchronous, their next
        drafts made on the device by prompt lookup (``jaxinfer.spec_decode.lagged``);
        ``stable_input_address`` (default: on a GPU): the forward copies its packed inputs into a
        donated device buffer first (:attr:`input_slot`) and reads them from there;
        ``aux_hidden_layers``: every step also stores the residual stream entering these layers, per
        token, in ``aux_pages`` (an EAGLE-3 head's input, ``jaxinfer.spec_decode.aux_hidden``); empty:
        the step programs are exactly those of an engine without one."""
        self.model = model
        self.config = model.config
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = math.ceil(max_model_len / page_size)
        self.buckets = buckets or default_buckets(
            max_num_seqs, max_num_batched_tokens, self.max_pages_per_seq, jax.default_backend(),
            one_row_bucket=model.weights.embed.dtype != jnp.bfloat16,
        )
        self.attention_impl = attention_impl
        self.num_speculative_tokens = num_speculative_tokens
        if lagged_ngram is not None and not num_speculative_tokens:
            raise ValueError("lagged_ngram needs num_speculative_tokens > 0")
        self.lagged_ngram = lagged_ngram
        self.v_layout = engine_v_layout(attention_impl, self.config.head_dim)  # the cache's V layout
        self.placement = StepPlacement(self.config, mesh, self.v_layout)
        self.page_table_rows = PageTableRows()  # decode steps' page tables, kept between steps
        self._input_observer: Callable[[StepInputs], None] | None = None
        self.cache = create_kv_cache(
            self.config, num_pages, page_size, storage_dtype(kv_cache_dtype, model.weights.embed.dtype),
            sharding=self.placement.cache, scales=model.kv_cache_scales, v_layout=self.v_layout,
        )
        # Sampled tokens of the last step, padded to max_num_seqs so their shape never changes.
        # Made by a jitted function, like every later value, so the step's signature never changes.
        self.last_sampled = jax.jit(
            lambda: jnp.zeros((self.buckets.num_seqs[-1],), jnp.int32), **self.placement.jit_kwargs()
        )()
        # What the last verify step accepted and drafted, per slot, for the next (asynchronous) one.
        self.device_drafts = None
        if lagged_ngram is not None:
            self.device_drafts = jax.jit(
                lambda: DeviceDrafts.empty(self.buckets.num_seqs[-1], num_speculative_tokens),
                **self.placement.jit_kwargs())()
        # The token id at every KV slot, for the penalties (jaxinfer.token_history).
        self.token_pages = jax.jit(
            lambda: jnp.full((num_pages, page_size), -1, jnp.int32), **self.placement.jit_kwargs()
        )()
        # On a GPU the step runs as a CUDA graph (XLA's command buffers), which records device
        # addresses: a command reading a buffer whose address changed since the last run is
        # updated before the launch (command_buffer::update took ~3.4 ms of host time per decode
        # step of the 8B model at throughput-1k in session 9's profile). The packed inputs are a
        # new buffer every step, so the forward first copies them into this buffer, donated and
        # returned (its address never changes), and every other command reads them there. How
        # much of the update that saves: benchmarks/step_dispatch.py ("fresh" vs "staged").
        if stable_input_address is None:
            stable_input_address = jax.default_backend() == "gpu"
        self.input_slot = None
        if stable_input_address:
            size = max(pack_host_arrays(_forward_tree(self.empty_inputs(t, b, p, verify=verify)))[0].size
                       for t, b, p in self.buckets.all() for verify in ((False, True) if num_speculative_tokens
                                                                         else (False,)))
            # One element more than the largest step: a copy over the whole slot would be folded away.
            self.input_slot = jax.jit(lambda: jnp.zeros((size + 1,), jnp.int32), **self.placement.jit_kwargs())()
        self.aux_hidden_layers = tuple(aux_hidden_layers)
        self.aux_pages = None
        if self.aux_hidden_layers:
            width = len(self.aux_hidden_layers) * self.config.hidden_size
            self.aux_pages = create_aux_pages(num_pages, page_size, width, model.weights.embed.dtype)
        # On one device the step's state is committed to it exactly when the weights are
        # (sharding.placement.commit_beside says why); the sampler's logits follow.
        self.committed_device = committed_device(model.weights) if mesh is None else None
        if self.committed_device is not None:
            state = (self.cache, self.last_sampled, self.device_drafts, self.token_pages, self.input_slot,
                     self.aux_pages)
            (self.cache, self.last_sampled, self.device_drafts, self.token_pages, self.input_slot,
             self.aux_pages) = jax.device_put(state, self.committed_device)
        # Programs may compile with different options per token count: overlap per phase, no
        # Triton GEMMs for FP8 W8A8 steps on GPU (jaxinfer.compile_options).
        self._step = PhasedJit(
            functools.partial(_forward_step, config=self.config, attention_impl=attention_impl,
                              aux_layers=self.aux_hidden_layers),
            overlap, self.buckets.num_seqs[-1],
            base_compiler_options=graph_options(1 if mesh is None else mesh.size),
            quantization=model.quantization,
            static_argnames=("packing",),
            donate_argnames=("cache", "token_pages", "input_slot") + (("aux_pages",) if self.aux_hidden_layers else ()),
            **self.placement.jit_kwargs(with_cache=True),
        )
        self._sampler = jax.jit(
            functools.partial(_sample_step, num_padded=self.buckets.num_seqs[-1]),
            static_argnames=("packing", "sampler_path"),
            **self.placement.jit_kwargs(),
        )
        self._verifier = jax.jit(
            functools.partial(_verify_step, num_padded=self.buckets.num_seqs[-1], lagged_ngram=lagged_ngram),
            static_argnames=("packing", "sampler_path"),
            **self.placement.jit_kwargs(),
        )
        self.warmup_done = False
        self.warmup_recompiles = 0  # programs warm-up compiled twice (warm_up)
        self.warmup_compile_times: WarmupCompileTimes | None = None  # warm_up's compile pool
        # Forward and sampler programs apart: warm-up pairs each sampler with one forward bucket
        # only, and a new pairing of two warmed programs compiles nothing.
        self.forward_compilations = CompilationCounter(self._step._cache_size)
        self.sampler_compilations = CompilationCounter(self._num_sampler_programs)

    def warm_up(self, use_tqdm: bool = True, num_threads: int | None = None) -> float:
        """Compile every bucket's forward and every sequence bucket's samplers (one per path) now; returns seconds spent.

        Programs are lowered in this thread, largest first, and compiled ahead of time on
        ``num_threads`` threads (XLA releases the GIL while it compiles, and the programs are
        independent), then each is run once. ``warmup_compile_times`` keeps what each took.
        """
        start = time.perf_counter()
        # Largest buckets first: compile time grows with a program's rows (H200, Llama-3.1-8B
        # fp8: 35 s at 8192 tokens, 9 s at 256, benchmarks/results/compile_time.session13_*), and
        # queued behind the small ones (the buckets' own order) the largest started seconds late
        # and set when the pool finished. Longest-first is the classic bound on that makespan.
        shapes = sorted(self.buckets.all(), key=lambda shape: (shape[0], shape[2]), reverse=True)
        kinds = (False, True) if self.num_speculative_tokens else (False,)
        all_inputs = [self.empty_inputs(t, b, p, verify=v) for t, b, p in shapes for v in kinds]
        sampler_inputs = [self.empty_inputs(t, b, p, path, verify=v)
                          for t, b, p in reversed(self._sampler_shapes()) for path in SAMPLER_PATHS for v in kinds
                          if not (v and path in MASKED_SAMPLER_PATHS)]  # a verify step is never masked
        # Kernels several steps share (on one device: under a mesh each shard's kernel has its own
        # shapes) go right after the largest step: it starts compiling first, and reaches its
        # kernels near the end of its compilation, by when the pool has compiled them; the other
        # steps wait in the queue behind them.
        kernels = [] if self.placement.mesh is not None else shared_kernel_programs(
            self.attention_impl, self.config, [(t, b) for t, b, _ in shapes])
        forwards = [("forward", f"forward {_shape_name(inputs)}", functools.partial(self._lower, inputs))
                    for inputs in all_inputs]
        jobs = forwards[:1] + [("kernel", name, functools.partial(_lower_shared_kernel, name, lower))
                               for name, lower in kernels] + forwards[1:]
        jobs += [("sampler", f"sampler {inputs.sampler_path} {_shape_name(inputs)}",
                  functools.partial(self._lower_sampler, inputs)) for inputs in sampler_inputs]
        num_threads = num_threads or min(len(jobs), max(1, (os.cpu_count() or 1) // 2))

        def compile_timed(lowered) -> float:
            begin = time.perf_counter()
            lowered.compile()
            return time.perf_counter() - begin

        # Lowering (tracing to StableHLO) holds the GIL; XLA's compilation releases it. So this
        # thread lowers the programs one by one, in order, and hands each to the pool at once:
        # the largest starts compiling after its own lowering alone, not after a share of every
        # thread's (lowered in the pool, 8 programs at once took turns on the GIL).
        pool_start = time.perf_counter()
        lowering_seconds, futures = [], []
        with concurrent.futures.ThreadPoolExecutor(num_threads) as pool, \
                tqdm(total=len(jobs), desc="Compiling", unit="program", disable=not use_tqdm) as progress:
            for _, _, lower in jobs:
                begin = time.perf_counter()
                lowered = lower()
                lowering_seconds.append(time.perf_counter() - begin)
                future = pool.submit(compile_timed, lowered)
                future.add_done_callback(lambda _: progress.update())
                futures.append(future)
            compile_seconds = [future.result() for future in futures]
        programs = tuple(ProgramCompileTime(name, lowering, compiling) for (_, name, _), lowering, compiling
                         in zip(jobs, lowering_seconds, compile_seconds))
        totals = {kind: 0.0 for kind in ("kernel", "forward", "sampler")}
        for (kind, _, _), program in zip(jobs, programs):
            totals[kind] += program.lowering_seconds + program.compile_seconds
        # The pool's wall time against its longest program: near it, no order of the jobs can do better.
        self.warmup_compile_times = WarmupCompileTimes(
            time.perf_counter() - pool_start, max((p.lowering_seconds + p.compile_seconds for p in programs),
                                                  default=0.0),
            totals["forward"], totals["sampler"], sum(lowering_seconds), programs, totals["kernel"])
        # Each program's first run must find what the pool compiled; one that compiles again does
        # so serially (session 12's static-scale engine never finished warming up on an H200: its
        # scales were committed to a device in an uncommitted model, activation_scales.put_beside).
        with BackendCompiles() as recompiles:
            for inputs in [*all_inputs, *sampler_inputs]:
                jax.block_until_ready(self.execute(inputs))
        self.warmup_recompiles = recompiles.count
        if recompiles.count:
            logger.warning("warm-up: %d programs compiled again at their first run (%.1f s): their inputs were "
                           "committed or sharded unlike warm-up's", recompiles.count, recompiles.seconds)
        self.warmup_done = True
        self.forward_compilations.end_warm_up()
        self.sampler_compilations.end_warm_up()
        seconds = time.perf_counter() - start
        times = self.warmup_compile_times
        logger.info("compiled %d forward and %d sampler programs%s in %.1f s on %d threads (compiling %.1f s, the "
                    "longest program %.1f s; forward programs %.1f s, samplers %.1f s summed, of which lowering "
                    "%.1f s)", len(all_inputs), len(sampler_inputs),
                    f" after {len(kernels)} shared kernels ({times.kernel_seconds:.1f} s summed)" if kernels else "",
                    seconds, num_threads, times.pool_seconds, times.longest_seconds, times.forward_seconds,
                    times.sampler_seconds, times.lowering_seconds)
        return seconds

    def _lower(self, inputs: StepInputs) -> jax.stages.Lowered:
        fn, args, kwargs = self._step_call(inputs)
        with self.placement.context():
            return fn.lower(*args, **kwargs)

    def _lower_sampler(self, inputs: StepInputs) -> jax.stages.Lowered:
        args, kwargs = self._sampler_call(inputs)
        with self.placement.context():
            if inputs.is_verify:  # the verifier takes no bitmask
                return self._verifier.lower(*args[:3], self.device_drafts, **kwargs)
            return self._sampler.lower(*args, **kwargs)

    def _sampler_call(self, inputs: StepInputs):
        """The sampler's arguments for ``inputs``, its logits as a shape: what warm-up compiles."""
        num_rows = inputs.batch.logits_indices.shape[0]
        # The logits come from the forward, committed when its state is.
        logits_sharding = self.placement.replicated
        if self.committed_device is not None:
            logits_sharding = jax.sharding.SingleDeviceSharding(self.committed_device)
        logits = jax.ShapeDtypeStruct((num_rows, self.config.vocab_size), jnp.float32, sharding=logits_sharding)
        packed, packing = pack_host_arrays(_sampler_tree(inputs))
        packed = jax.device_put(packed, self.placement.replicated)
        bitmask = None
        if inputs.sampler_path in MASKED_SAMPLER_PATHS:
            bitmask = jax.ShapeDtypeStruct((inputs.batch.num_seqs, bitmask_width(self.config.vocab_size)), jnp.int32,
                                           sharding=self.placement.replicated)
        return (logits, self.token_pages, packed, bitmask), {"packing": packing, "sampler_path": inputs.sampler_path}

    def _sampler_shapes(self) -> list[tuple[int, int, int]]:
        """One bucket (tokens, sequences, pages) per (sequences, pages): the samplers depend on
        nothing else, and warm-up runs each through a forward program that exists."""
        first = {}
        for t, b, p in self.buckets.all():
            first.setdefault((b, p), (t, b, p))
        return list(first.values())

    @property
    def num_programs(self) -> int:
        """Programs compiled at warm-up: one forward per bucket, a sampler per path per sequence bucket;
        with speculation also a verify forward per bucket and a verifier per unmasked path (a verify
        step is never masked)."""
        samplers = len(SAMPLER_PATHS) * len(self._sampler_shapes())
        if not self.num_speculative_tokens:
            return len(self.buckets.all()) + samplers
        verifiers = (len(SAMPLER_PATHS) - len(MASKED_SAMPLER_PATHS)) * len(self._sampler_shapes())
        return 2 * len(self.buckets.all()) + samplers + verifiers

    def _num_sampler_programs(self) -> int:
        return self._sampler._cache_size() + self._verifier._cache_size()

    @property
    def num_compilations_after_warmup(self) -> int:
        return self.forward_compilations.num_after_warmup + self.sampler_compilations.num_after_warmup

    def empty_inputs(self, num_tokens: int, num_seqs: int, pages_per_seq: int, sampler_path: str = "basic",
                     verify: bool = False) -> StepInputs:
        """Inputs of a step of this bucket that computes nothing (warm-up; a template to receive into);
        ``verify``: of the verify step of this bucket (``num_speculative_tokens`` > 0)."""
        inputs = empty_step_inputs(num_tokens, num_seqs, pages_per_seq, sampler_path)
        if self.lagged_ngram is not None:
            inputs = dataclasses.replace(inputs, prev_slots=np.full(num_seqs, -1, np.int32),
                                         draft_rows=np.full(num_tokens, -1, np.int32))
        if not verify:
            return inputs
        batch, sampling, draft_ids, num_drafts = expand_to_rows(inputs.batch, inputs.sampling, [],
                                                                self.num_speculative_tokens)
        return dataclasses.replace(inputs, batch=batch, sampling=sampling, draft_ids=draft_ids, num_drafts=num_drafts)

    def prepare(self, schedule: Schedule, previous: PackedStep | None) -> PackedStep:
        """Pack ``schedule``'s step into the smallest bucket that fits; ``previous`` is the step
        still on the device, whose sampled tokens fill this one's placeholders."""
        return pack_step(schedule, self.buckets, previous, self.config.vocab_size, self.num_speculative_tokens,
                         lagged=self.lagged_ngram is not None, page_table_rows=self.page_table_rows)

    def observe_inputs(self, observer: Callable[[StepInputs], None] | None) -> None:
        """Have ``observer`` see every step's inputs before the step is dispatched (``None``: stop).

        Multi-host: the leader sends them to the other processes, which run the same step
        (``jaxinfer.distributed``). Warm-up steps go through it too.
        """
        self._input_observer = observer

    @property
    def is_observed(self) -> bool:
        return self._input_observer is not None

    def execute(self, inputs: StepInputs, token_bitmask: Callable[[], np.ndarray] | None = None) -> SamplerOutput | VerifyOutput:
        """Dispatch one step (asynchronously: nothing here waits for the device); returns the sampler
        output, or a verify step's ``VerifyOutput`` (accepted counts and tokens, still on the device).

        ``token_bitmask`` (a "_masked" path): called after the forward is dispatched, so the
        host computes the structured-output mask [B, ceil(V/32)] while the device runs the
        forward; it may wait for the previous step's tokens. Without it every id is allowed.
        """
        if self._input_observer is not None:
            self._input_observer(inputs)
        fn, args, kwargs, (sampler_packed, sampler_packing) = self._calls(inputs)
        forward_size = self.forward_compilations.before()
        with self.placement.context():
            step_out, self.cache = fn(*args, **kwargs)
            self.forward_compilations.after((fn, kwargs["packing"]), forward_size)
            sampler_size = self.sampler_compilations.before()
            logits, self.token_pages, *more = step_out
            if self.input_slot is not None:
                self.input_slot, *more = more
            if self.aux_hidden_layers:
                (self.aux_pages,) = more
            if inputs.is_verify:
                out = self._verifier(logits, self.token_pages, sampler_packed, self.device_drafts,
                                     packing=sampler_packing, sampler_path=inputs.sampler_path)
                if self.lagged_ngram is not None:
                    self.device_drafts = out.device_drafts
            else:
                bitmask = None
                if inputs.sampler_path in MASKED_SAMPLER_PATHS:
                    host_mask = (token_bitmask() if token_bitmask is not None
                                 else allocate_bitmask(inputs.batch.num_seqs, self.config.vocab_size))
                    bitmask = jax.device_put(host_mask, self.placement.replicated)
                out = self._sampler(logits, self.token_pages, sampler_packed, bitmask, packing=sampler_packing,
                                    sampler_path=inputs.sampler_path)
        self.sampler_compilations.after((sampler_packing, inputs.sampler_path, inputs.is_verify), sampler_size)
        self.last_sampled = out.token_ids_padded
        return out.sampler

    def _step_call(self, inputs: StepInputs):
        """The jitted forward for ``inputs`` and its arguments, as :meth:`execute` calls it."""
        return self._calls(inputs)[:3]

    def _calls(self, inputs: StepInputs):
        """The forward program, its arguments, and the sampler's (packed inputs, packing): the host
        arrays of both programs go to the device in one transfer."""
        if inputs.sampler_path not in SAMPLER_PATHS:
            raise ValueError(f"unknown sampler path {inputs.sampler_path!r}; one of {sorted(SAMPLER_PATHS)}")
        packed, packing = pack_host_arrays(_forward_tree(inputs))
        sampler_packed, sampler_packing = pack_host_arrays(_sampler_tree(inputs))
        packed, sampler_packed = jax.device_put((packed, sampler_packed), self.placement.replicated)
        args = (self.model.weights, self.cache, self.token_pages, packed, self.last_sampled, self.device_drafts,
                self.input_slot)
        if self.aux_hidden_layers:
            args += (self.aux_pages,)
        return self._step.for_tokens(inputs.batch.num_tokens), args, {"packing": packing}, (sampler_packed, sampler_packing)


class _SharedKernel(NamedTuple):
    """A shared kernel's lowered program, compiled best effort: it is only a head start for the
    steps that contain it, which compile it themselves if this fails."""

    name: str
    lowered: jax.stages.Lowered | None

    def compile(self) -> None:
        if self.lowered is None:
            return
        try:
            self.lowered.compile()
        except Exception as error:  # noqa: BLE001  any failure: the steps still compile the kernel
            logger.warning("warm-up: shared %s did not compile (%s); the steps that contain it compile it",
                           self.name, error)


def _lower_shared_kernel(name: str, lower: Callable[[], jax.stages.Lowered]) -> _SharedKernel:
    try:
        return _SharedKernel(name, lower())
    except Exception as error:  # noqa: BLE001  as _SharedKernel.compile
        logger.warning("warm-up: shared %s did not lower (%s); the steps that contain it compile it", name, error)
        return _SharedKernel(name, None)


def _shape_name(inputs: StepInputs) -> str:
    """A step's bucket as warm-up's report names it: tokens x sequences x pages, "verify" if it is one."""
    batch = inputs.batch
    name = f"{batch.num_tokens}x{batch.num_seqs}x{batch.page_tables.shape[1]}"
    return f"{name} verify" if inputs.is_verify else name


def _forward_tree(inputs: StepInputs):
    """What the forward program reads from the host: the batch, ``prev_rows`` and, on a runner of
    asynchronous verify steps, ``prev_slots`` and ``draft_rows``."""
    if inputs.prev_slots is not None:
        return inputs.batch, inputs.prev_rows, inputs.prev_slots, inputs.draft_rows
    return inputs.batch, inputs.prev_rows


def _sampler_tree(inputs: StepInputs):
    """What the sampler program reads: the sampling tensors and, for the penalties' history, the page
    tables; a verify step's also its drafts."""
    if inputs.is_verify:
        tree = inputs.sampling, inputs.batch.page_tables, inputs.batch.kv_lens, inputs.draft_ids, inputs.num_drafts
        return tree + (inputs.prev_slots,) if inputs.prev_slots is not None else tree
    if not is_full_path(inputs.sampler_path):
        # The basic paths read no history: the page tables (the step's largest input, [B, pages]
        # int32) are not sent twice.
        return (inputs.sampling,)
    return inputs.sampling, inputs.batch.page_tables, inputs.batch.kv_lens


def pack_host_arrays(tree) -> tuple[np.ndarray, tuple]:
    """One int32 buffer holding every array of ``tree`` (all 4-byte or bool), and its packing: the
    tree's structure and each array's (shape, dtype), static for the jitted program.

    A step's inputs are a dozen small arrays; sending them as one buffer makes one
    host-to-device transfer instead of a dozen. :func:`unpack_device_arrays` undoes it. Each
    array is copied once, straight into its place in the buffer.
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    for array in arrays:
        if array.dtype.itemsize != 4 and array.dtype != np.bool_:
            raise TypeError(f"step inputs must be 4-byte or bool arrays, not {array.dtype}")
    sizes = [array.size for array in arrays]
    packed = np.empty(sum(sizes), np.int32)
    offset = 0
    for array, size in zip(arrays, sizes):
        flat = array.reshape(-1)
        # bool is cast to 0/1; the 4-byte types are copied bit for bit.
        packed[offset : offset + size] = flat if array.dtype == np.bool_ else flat.view(np.int32)
        offset += size
    return packed, (treedef, tuple((array.shape, array.dtype.str) for array in arrays))


def unpack_device_arrays(packed: jax.Array, packing: tuple):
    """Inside the jitted step: slice, bitcast and reshape the packed buffer back into the tree."""
    treedef, shapes = packing
    leaves, offset = [], 0
    for shape, dtype_str in shapes:
        dtype = np.dtype(dtype_str)
        size = math.prod(shape)
        piece = packed[offset : offset + size].reshape(shape)
        offset += size
        if dtype == np.bool_:
            piece = piece != 0
        elif dtype != np.int32:
            piece = jax.lax.bitcast_convert_type(piece, dtype)
        leaves.append(piece)
    return jax.tree.unflatten(treedef, leaves)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _SamplerStepOutput:
    sampler: SamplerOutput | VerifyOutput
    token_ids_padded: jax.Array  # [max_num_seqs]: what the next step's placeholders read
    device_drafts: DeviceDrafts | None = None  # an asynchronous verify step's: what the next step continues


def _forward_step(weights, cache, token_pages, packed, last_sampled, device_drafts, input_slot, aux_pages=None, *,
                  config, attention_impl, packing, aux_layers=()):
    """Logits [B, V] at each sequence's last new token, the token pages with this step's inputs, the
    input slot (when given), and the cache.

    ``device_drafts``: None, or the last verify step's ``DeviceDrafts`` (asynchronous verify steps):
    the batch is then shifted to the sequences' true lengths and reads its drafts from there.
    ``input_slot``: None, or the runner's donated buffer that the packed inputs are copied into
    and read from (``ModelRunner.input_slot``: a device address that never changes).
    ``aux_layers`` (an EAGLE-3 head): also the ``aux_pages`` with this step's auxiliary hidden states."""
    if input_slot is not None:
        input_slot = jax.lax.dynamic_update_slice(input_slot, packed, (0,))
        # Else XLA folds the slices below into slices of ``packed`` and reads it directly again.
        input_slot = jax.lax.optimization_barrier(input_slot)
        packed = input_slot[: packed.shape[0]]
    unpacked = unpack_device_arrays(packed, packing)
    batch, prev_rows = unpacked[:2]
    # A placeholder input is the token this sequence sampled in the previous step.
    from_previous = jnp.take(last_sampled, jnp.maximum(prev_rows, 0))
    token_ids = jnp.where(prev_rows >= 0, from_previous, batch.token_ids)
    batch = dataclasses.replace(batch, token_ids=token_ids)
    if device_drafts is not None:
        prev_slots, draft_rows = unpacked[2:]
        batch = continue_batch(batch, prev_slots, draft_rows, device_drafts)
    # The batch's tokens, device drafts included: the history the next lookup reads must hold an
    # accepted draft itself, not the placeholder the host scheduled in its place.
    token_pages = write_tokens(token_pages, batch.token_ids, batch)
    # Outputs: logits and token pages, then the input slot and the aux pages where there are.
    outputs = (token_pages,) if input_slot is None else (token_pages, input_slot)
    if aux_layers:
        logits, aux, cache = forward_with_aux(weights, cache, batch, config, attention_impl, aux_layers)
        return (logits, *outputs, write_aux_hidden(aux_pages, aux, batch)), cache
    logits, cache = forward(weights, cache, batch, config, attention_impl)
    return (logits, *outputs), cache


def _sample_step(logits, token_pages, packed, token_bitmask, *, packing, sampler_path, num_padded):
    """One token per row of ``logits`` on the ``sampler_path`` path; every path returns the same shapes.
    ``token_bitmask``: [B, ceil(V/32)] int32 on a "_masked" path, else None."""
    sampling, *history_inputs = unpack_device_arrays(packed, packing)  # page tables and kv_lens on the full paths
    flags = SAMPLER_PATHS[sampler_path]
    if flags.any_penalties or flags.any_bad_words:
        page_tables, kv_lens = history_inputs
    if flags.any_penalties:
        # The penalties' history comes from the device's token pages, not the host.
        history_ids, history_is_output = gather_history(token_pages, page_tables, kv_lens, sampling.num_prompt_tokens)
        sampling = dataclasses.replace(sampling, history_ids=history_ids, history_is_output=history_is_output)
    if flags.any_bad_words:
        # Compared with the last tokens on the device: the host may not know them yet.
        tail = gather_output_tail(token_pages, page_tables, kv_lens, sampling.num_prompt_tokens,
                                  sampling.bad_word_ids.shape[2] - 1)
        sampling = dataclasses.replace(sampling, bad_word_tail=tail)
    out = sample(logits, sampling, flags, token_bitmask)
    k = SAMPLER_PATHS["full"].num_top_logprobs
    if flags.num_top_logprobs < k:
        rows = logits.shape[0]
        out = dataclasses.replace(out, top_logprob_ids=jnp.zeros((rows, k), jnp.int32),
                                  top_logprob_values=jnp.zeros((rows, k), jnp.float32))
    padded = jnp.zeros((num_padded,), jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
    return _SamplerStepOutput(out, padded)


def _verify_step(logits, token_pages, packed, device_drafts, *, packing, sampler_path, num_padded, lagged_ngram):
    """A verify step's sampler (``jaxinfer.spec_decode.rejection``): logits [B * (k + 1), V], one row per
    slot and position; the next step's placeholders read each slot's token after its accepted run.

    With ``lagged_ngram`` (asynchronous verify steps) the inputs are first shifted by what the previous
    verify step accepted (``device_drafts``), and the step drafts for the next one on the device."""
    sampling, page_tables, kv_lens, draft_ids, num_drafts, *lagged = unpack_device_arrays(packed, packing)
    scheduled_drafts = num_drafts  # the inputs the forward computed after each slot's first
    if lagged_ngram is not None:
        sampling, kv_lens, draft_ids, num_drafts = continue_verify_inputs(sampling, kv_lens, draft_ids, num_drafts,
                                                                          lagged[0], device_drafts)
    flags = SAMPLER_PATHS[sampler_path]
    rows_per_slot = draft_ids.shape[1] + 1
    if flags.any_penalties:
        # Only a slot's first row may have penalties (a sequence with penalties does not speculate),
        # so every row of a slot reads the slot's history.
        history_ids, history_is_output = gather_history(
            token_pages, page_tables, kv_lens, sampling.num_prompt_tokens[::rows_per_slot])
        sampling = dataclasses.replace(sampling, history_ids=jnp.repeat(history_ids, rows_per_slot, axis=0),
                                       history_is_output=jnp.repeat(history_is_output, rows_per_slot, axis=0))
    out = verify(logits, sampling, flags, draft_ids, num_drafts)
    k = SAMPLER_PATHS["full"].num_top_logprobs
    if flags.num_top_logprobs < k:
        rows = logits.shape[0]
        out = dataclasses.replace(out, sampler=dataclasses.replace(
            out.sampler, top_logprob_ids=jnp.zeros((rows, k), jnp.int32),
            top_logprob_values=jnp.zeros((rows, k), jnp.float32)))
    padded = jnp.zeros((num_padded,), jnp.int32).at[: out.last_token.shape[0]].set(out.last_token)
    if lagged_ngram is None:
        return _SamplerStepOutput(out, padded)
    next_drafts = drafts_for_next_step(token_pages, page_tables, kv_lens, scheduled_drafts, out.num_accepted,
                                       out.last_token, num_padded=num_padded, num_speculative_tokens=draft_ids.shape[1],
                                       min_n=lagged_ngram[0], max_n=lagged_ngram[1])
    return _SamplerStepOutput(out, padded, next_drafts)

"""Compiler options for the step programs, chosen per token count, and the jit wrapper that applies them.

Each layer of a tp-sharded model ends its attention and its MLP with a row-parallel matmul
whose partial sums XLA all-reduces; the next layer needs the sum, so by default the
all-reduce is exposed. XLA's latency-hiding scheduler and windowed einsums (GPU compiler
options, :data:`XLA_OVERLAP_OPTIONS`) can hide some of it: they reorder independent work
around collectives and split all-gather/reduce-scatter einsums into ring steps; they do not
split an all-reduce whose matmul feeds it directly. The options are set per compiled
program (:class:`PhasedJit`), so prefill and decode programs can differ; measured by
``benchmarks/tensor_parallel.py`` beside the ring collective matmul
(``sharding.collective_matmul``).

Decode steps move [B, E] activations (a few hundred KB): the all-reduce is latency-bound, and
splitting it only adds latency, so the options default to off for decode; prefill defaults
to off as well until the GPU numbers say otherwise.

Programs whose projections run FP8 W8A8 (``jaxinfer.linear.uses_fp8_w8a8``) compile on GPU
without XLA's Triton GEMMs (:data:`FP8_W8A8_GEMM_OPTIONS`): XLA autotunes Triton tilings of
every FP8 dot against cuBLASLt and on an H200 always picked cuBLASLt's FP8 GEMM in the end
(``benchmarks/fp8_hlo_check.py``), after 18 s (128 tokens) to 52 s (2048 tokens) of compiling
per program (``benchmarks/compile_time.py``; 8.5 s / 6.7 s without Triton). Weight-only
programs keep Triton: their dequantizing convert fuses into a Triton GEMM. docs/QUANTIZATION.md.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax

from jaxinfer.linear import uses_fp8_w8a8

# GPU compiler options for overlapped programs (other platforms accept and ignore them).
XLA_OVERLAP_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_multi_streamed_windowed_einsum": True,
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
}


# XLA's default kinds of GPU command buffers (CUDA graphs) plus COLLECTIVES. A collective ends
# a graph, so a tp=2 decode step runs as ~69 graphs per GPU, each updated and launched by the
# host: on two H200s the host needs more time a step than the GPUs (~3.5 ms of compute).
# Asking for COLLECTIVES was meant to merge them; measured, it did not (still ~69 in sessions
# 4 and 5, with NCCL's all-reduce or XLA's own kernel, async or not). TPOT with it was
# 5.25-6.15 ms over five calls, 6.66 ms in the one call without it: no effect shown beyond
# the calls' spread. What did help is process-wide (XLA_FLAGS, docs/SHARDING.md's latency
# recipe). benchmarks/results/tensor_parallel.md.
GRAPHS_WITH_COLLECTIVES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,COLLECTIVES"


# GPU compiler options for step programs whose projections run FP8 W8A8: no Triton GEMMs, so
# XLA neither autotunes Triton tilings of the FP8 dots nor fuses them into Triton kernels; the
# dots become cuBLASLt's FP8 GEMM, which the autotuner chose anyway (module docstring).
FP8_W8A8_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False}

# ... and, below FP8_UNMERGED_BELOW_TOKENS token rows, no dot merging. XLA's DotMerger rewrites
# dots that share an input (q/k/v, gate/up) into one dot over the concatenation of their weights.
# A Triton GEMM fuses that concatenation into its operand reads; cuBLASLt cannot, so XLA writes
# the concatenated FP8 weights out every step. Measured on an H200 (session 13, latency_lab
# --batches, 8B shapes): at 128 rows gate/up and q/k/v were both merged, 2.27 + 0.69 ms of copies
# in a 15.3 ms step; with merging off the step took 12.7 ms. From ~1000 rows only q/k/v merge,
# and there the one larger GEMM pays for its copy: throughput-1k's prefill-carrying steps ran
# 91.1 ms unmerged against 88.3 merged, its ~935-row decode steps 47.7 against 48.0 (one run
# each), so the large buckets keep XLA's default. linear_many quantizes a shared input once
# either way (jaxinfer.linear).
FP8_UNMERGED_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
FP8_UNMERGED_BELOW_TOKENS = 1024


# Small GPU steps merge gate/up into one dot too. XLA's DotMerger skips dots whose weights exceed
# 32 MB by default, so at 8B shapes q/k/v merge (<= 32 MB each) and gate/up (117 MB each) do not.
# In a Triton GEMM the concatenation is fused into the operand reads (no copy), and one GEMV
# over both weights reads them faster than two: H200, Llama-3.1-8B bf16, batch-1 step (bucket
# 8x8, latency_lab.py, session 19): 4.543 / 4.547 ms with the threshold at 1024 MB against 4.687 /
# 4.705 at the default (two runs); gate+up 54.6 us a layer (4.30 TB/s) against 2 x 29.3. 32
# sequences at 1536 tokens: 6.681 ms against 6.983. Not for larger steps: 128 sequences took
# 13.288 ms merged against 12.665 (a GEMM that is not a Triton fusion reads the concatenation
# from a copy written every step, as FP8_UNMERGED_OPTIONS says of cuBLASLt); 64 is unmeasured.
# FP8 weights keep XLA's default: latency_lab's step (bucket 8x8) took 3.207 ms merged against
# 3.340, but the engine's batch-1 latency did not move (3.39 vs 3.40 ms per token, same machine,
# one call after the other), so the gain is not shown where it counts. int8: unmeasured on a GPU.
MERGED_DOTS_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 1024}
MERGED_DOTS_MAX_TOKENS = 32
MERGED_DOTS_QUANTIZATIONS = (None,)

# Dense steps of DENSE_UNMERGED_MIN_TOKENS to DENSE_UNMERGED_BELOW_TOKENS rows: no dot merging at
# all. Their GEMMs are cuBLAS's, so a merged q/k/v (each <= 32 MB, under XLA's default threshold)
# reads a concatenation of the three weights written out every step, as FP8_UNMERGED_OPTIONS says
# of cuBLASLt: traced on an H200 (session 23, bf16 throughput-1k at 384 sequences), 26 us a layer
# of `wrapped_concatenate`, 825 us of a 23.6 ms decode step. Unmerged, the copy is gone and q, k
# and v take 405 us more GEMM time a step (k and v as XLA Triton GEMMs); throughput-1k's decode
# steps took 25.87 against 26.12 ms (-1.0%; the run 9,759 against 9,689 output tok/s, one call).
# Measured at 256-384 rows (throughput-1k's decode buckets); 512 follows the FP8 rule's bound,
# unmeasured. Smaller steps keep XLA's default (a Triton GEMM may fuse the concatenation there),
# and so do prefill sizes.
DENSE_UNMERGED_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
DENSE_UNMERGED_MIN_TOKENS = 256
DENSE_UNMERGED_BELOW_TOKENS = 1024


def _is_in_xla_flags(option: str) -> bool:
    # The "=" keeps out options that share the prefix.
    return f"--{option}=" in os.environ.get("XLA_FLAGS", "")


def _unless_in_xla_flags(options: dict) -> dict:
    """``options`` without those the user set in ``XLA_FLAGS``: theirs stay theirs."""
    return {k: v for k, v in options.items() if not _is_in_xla_flags(k)}


def quantized_gemm_options(quantization: str | None, num_tokens: int, platform: str) -> dict:
    """Compiler options for a step of ``num_tokens`` token rows over projections quantized as
    ``quantization`` (None: dense) on ``platform``: :data:`FP8_W8A8_GEMM_OPTIONS` for a GPU step
    that runs FP8 W8A8, with :data:`FP8_UNMERGED_OPTIONS` below :data:`FP8_UNMERGED_BELOW_TOKENS`
    rows; else none. An option the user set in ``XLA_FLAGS`` stays theirs."""
    if platform != "gpu" or quantization != "fp8" or not uses_fp8_w8a8(num_tokens):
        return {}
    options = dict(FP8_W8A8_GEMM_OPTIONS)
    if num_tokens < FP8_UNMERGED_BELOW_TOKENS:
        options.update(FP8_UNMERGED_OPTIONS)
    return _unless_in_xla_flags(options)


def merged_dots_options(quantization: str | None, num_tokens: int, platform: str) -> dict:
    """:data:`MERGED_DOTS_OPTIONS` for a GPU step of at most :data:`MERGED_DOTS_MAX_TOKENS` token rows over
    projections quantized as ``quantization`` (one of :data:`MERGED_DOTS_QUANTIZATIONS`), and
    :data:`DENSE_UNMERGED_OPTIONS` from :data:`DENSE_UNMERGED_MIN_TOKENS` to :data:`DENSE_UNMERGED_BELOW_TOKENS`
    rows; else none.
    An option the user set in ``XLA_FLAGS`` stays theirs."""
    if platform != "gpu" or quantization not in MERGED_DOTS_QUANTIZATIONS:
        return {}
    if num_tokens <= MERGED_DOTS_MAX_TOKENS:
        return _unless_in_xla_flags(MERGED_DOTS_OPTIONS)
    if DENSE_UNMERGED_MIN_TOKENS <= num_tokens < DENSE_UNMERGED_BELOW_TOKENS:
        return _unless_in_xla_flags(DENSE_UNMERGED_OPTIONS)
    return {}


def graph_options(num_devices: int) -> dict:
    """Compiler options for a step program over ``num_devices`` GPUs: collectives inside CUDA graphs."""
    if num_devices <= 1 or jax.default_backend() != "gpu":
        return {}
    if _is_in_xla_flags("xla_gpu_enable_command_buffer"):
        return {}  # the user chose the graph kinds
    return {"xla_gpu_enable_command_buffer": GRAPHS_WITH_COLLECTIVES}


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """Which phases compile with :data:`XLA_OVERLAP_OPTIONS`. A step is a prefill when it has
    more token rows than the largest decode batch (``max_num_seqs``)."""

    prefill: bool = False
    decode: bool = False
    # More XLA options for every step program, as (name, value) pairs: experiments such as
    # ("xla_gpu_disable_async_collectives", "ALLREDUCE") (benchmarks/tensor_parallel.py --xla-option).
    extra: tuple[tuple[str, str], ...] = ()

    def compiler_options(self, phase: str) -> dict | None:
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', not {phase!r}")
        options = dict(XLA_OVERLAP_OPTIONS) if getattr(self, phase) else {}
        options.update(self.extra)
        return options or None


class PhasedJit:
    """A jitted step whose compiler options depend on its token count: ``for_tokens(n)`` picks the program family.

    The options of an ``n``-token step (:meth:`compiler_options`) merge the base options, the
    phase's overlap options (a prefill has more than ``decode_max_tokens`` tokens), the merged-dot
    options of small steps (:func:`merged_dots_options`) and the quantized-GEMM options
    (:func:`quantized_gemm_options`). Steps with the same options share
    one ``jax.jit`` object: with no per-phase or per-size options it is a single one.
    """

    def __init__(self, fun, overlap: OverlapConfig | None, decode_max_tokens: int,
                 base_compiler_options: dict | None = None, *, quantization: str | None = None,
                 platform: str | None = None, **jit_kwargs):
        """``base_compiler_options`` apply to every step (e.g. :func:`graph_options`);
        ``quantization``: the model's (``"fp8"``, ``"int8"`` or None); ``platform``: the backend
        the programs compile for (default: JAX's default backend)."""
        self.overlap = overlap or OverlapConfig()
        self.decode_max_tokens = decode_max_tokens
        self.base_compiler_options = dict(base_compiler_options or {})
        self.quantization = quantization
        self.platform = platform or jax.default_backend()
        self._fun, self._jit_kwargs = fun, jit_kwargs
        self._jits: dict[tuple, object] = {}  # options -> jit
        self._by_tokens: dict[int, object] = {}  # token count -> jit: each step asks, keep it cheap
        self._lock = threading.Lock()  # warm-up asks for programs from several threads

    def compiler_options(self, num_tokens: int) -> dict | None:
        """The compiler options of a step of ``num_tokens`` token rows (None: XLA's defaults)."""
        phase = "prefill" if num_tokens > self.decode_max_tokens else "decode"
        options = {**self.base_compiler_options, **(self.overlap.compiler_options(phase) or {}),
                   **merged_dots_options(self.quantization, num_tokens, self.platform),
                   **quantized_gemm_options(self.quantization, num_tokens, self.platform)}
        return options or None

    def for_tokens(self, num_tokens: int):
        jitted = self._by_tokens.get(num_tokens)
        if jitted is not None:
            return jitted
        options = self.compiler_options(num_tokens)
        key = tuple(sorted((options or {}).items()))
        with self._lock:
            if key not in self._jits:
                self._jits[key] = jax.jit(self._fun, compiler_options=options, **self._jit_kwargs)
            self._by_tokens[num_tokens] = self._jits[key]
            return self._jits[key]

    def _cache_size(self) -> int:
        return sum(jitted._cache_size() for jitted in self._jits.values())

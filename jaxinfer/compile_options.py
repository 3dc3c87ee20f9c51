"""Compiler options for the step programs, chosen per phase, and the jit wrapper that applies them.

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
"""

from __future__ import annotations

import dataclasses
import os

import jax

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


def graph_options(num_devices: int) -> dict:
    """Compiler options for a step program over ``num_devices`` GPUs: collectives inside CUDA graphs."""
    if num_devices <= 1 or jax.default_backend() != "gpu":
        return {}
    if "--xla_gpu_enable_command_buffer=" in os.environ.get("XLA_FLAGS", ""):
        return {}  # the user chose the graph kinds (the "=" keeps out options that share the prefix)
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
    """A jitted step compiled with its phase's options: ``for_tokens(n)`` picks the program family.

    With the same options for both phases (the default) it is one ``jax.jit`` object.
    """

    def __init__(self, fun, overlap: OverlapConfig | None, decode_max_tokens: int,
                 base_compiler_options: dict | None = None, **jit_kwargs):
        """``base_compiler_options`` apply to both phases (e.g. :func:`graph_options`)."""
        overlap = overlap or OverlapConfig()
        self.decode_max_tokens = decode_max_tokens

        def options(phase):
            merged = {**(base_compiler_options or {}), **(overlap.compiler_options(phase) or {})}
            return merged or None

        self.decode = jax.jit(fun, compiler_options=options("decode"), **jit_kwargs)
        self.prefill = self.decode
        if overlap.prefill != overlap.decode:
            self.prefill = jax.jit(fun, compiler_options=options("prefill"), **jit_kwargs)

    def for_tokens(self, num_tokens: int):
        return self.prefill if num_tokens > self.decode_max_tokens else self.decode

    def _cache_size(self) -> int:
        return self.decode._cache_size() + (self.prefill._cache_size() if self.prefill is not self.decode else 0)

"""Hiding tensor-parallel communication behind computation: the options, chosen per phase.

Each layer of a tp-sharded model ends its attention and its MLP with a row-parallel matmul
whose partial sums XLA all-reduces; the next layer needs the sum, so by default the
all-reduce is exposed. Two ways to hide it, both measured by ``benchmarks/tensor_parallel.py``:

- ``"xla"``: XLA's latency-hiding scheduler and windowed einsums (GPU compiler options,
  :data:`XLA_OVERLAP_OPTIONS`), set per compiled program, so prefill and decode programs can
  differ. It reorders independent work around collectives and splits all-gather/reduce-scatter
  einsums into ring steps; it does not split an all-reduce whose matmul feeds it directly.
- collective matmul (:func:`reduce_scatter_matmul`): the matmul split into ``tp`` row chunks;
  each chunk's partial sum travels round a ring (``ppermute``) while the next chunk is
  multiplied, leaving the output reduce-scattered; an all-gather (or the next layer's
  all-gather matmul) completes it. Measured in isolation on the MLP's down projection at
  Llama-3.1-8B shapes by the benchmark; not yet wired into the model (see docs/SHARDING.md).

Decode steps move [B, E] activations (a few hundred KB): the all-reduce is latency-bound, and
splitting it only adds latency, so both options default to off for decode; prefill defaults
to off as well until the GPU numbers say otherwise.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

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


def reduce_scatter_matmul(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    """Inside ``shard_map``: ``psum_scatter(x @ w)`` over rows, as a ring of ``ppermute`` steps.

    x: [T, K/n] (this shard's columns), w: [K/n, N] (its rows); returns [T/n, N], rows
    ``i*T/n:(i+1)*T/n`` of the full sum on shard ``i``. Step ``s`` multiplies the row chunk whose
    partial sum arrives next while the previous one is in flight, so the transfer of each
    chunk overlaps the matmul of the next.
    """
    n = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    rows = x.shape[0] // n
    ring = [(i, (i + 1) % n) for i in range(n)]

    def partial(chunk):  # [T/n, N]: this shard's contribution to row chunk ``chunk``
        block = jax.lax.dynamic_slice_in_dim(x, chunk * rows, rows, axis=0)
        return jnp.einsum("tk,kn->tn", block, w, preferred_element_type=jnp.float32)

    # The partial sum of chunk c starts on shard c+1, visits every shard, and ends on shard c.
    acc = partial((index - 1) % n)
    for step in range(1, n):
        acc = jax.lax.ppermute(acc, axis_name, ring) + partial((index - 1 - step) % n)
    return acc.astype(x.dtype)


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

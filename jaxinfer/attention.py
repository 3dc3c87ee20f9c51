"""The one attention dispatcher: paged attention by kernel or by plain-JAX reference.

The model calls :func:`paged_attention` and never names an implementation. ``impl``
chooses: ``"auto"`` picks the Pallas kernel for the platform being compiled for (GPU or
TPU) and the context-bounded CPU path on a CPU (a native call per layer for float32/bf16 pages,
``jaxinfer.cpu_paged_attention``; plain JAX otherwise); tests force ``"reference"``, ``"cpu"``, ``"pallas_gpu"``,
``"pallas_tpu"``, or their ``_interpret`` variants to run a kernel on the CPU. ``"pallas_gpu_fused"``
(opt-in, never chosen by ``"auto"``) is the GPU kernel with the K/V write fused in, kept for its
benchmark: GPU run 2 measured it slower than ``"pallas_gpu"`` at large batches (docs/KERNELS.md).
``"pallas_gpu_fresh_prefill"`` (issue 21) is ``"pallas_gpu"`` with a prefill-heavy step's fresh
prompts (no cached prefix, >= 1024 tokens; over bf16 or fp8 pages) sent through jax's bundled Mosaic GPU flash
attention (``pallas_kernels.paged_attention.gpu_fresh_prefill``): the longest one a step
(``fresh_prompts.ENGINE_MAX_FRESH_PROMPTS`` = 1: session 12 measured several a step slower than the
Triton kernel at 1-2k-token prompts, docs/KERNELS.md); on other platforms it is ``"auto"``.
``"pallas_gpu_fresh_prefill_branchless"`` is the same with our bf16 Mosaic GPU window kernel
(``gpu_fresh_window``), which needs no device conditional; ``"pallas_gpu_fresh_prefill_cudnn"`` the
same branches with cuDNN's flash attention on the windows (``jax.nn.dot_product_attention``: bf16,
so no float16 range limit and no Mosaic GPU kernel to compile; opt-in until measured in that form);
``"pallas_gpu_fresh_prefill_cudnn_segments"`` cuDNN over up to 8 fresh prompts a step (>= 1000 tokens)
where they lie in the step's rows (its packed layout), with no windows and no device conditional.
What ``"auto"`` runs on a Hopper GPU is ``HOPPER_AUTO_IMPL``: the segments path since session 17, the
fastest of these in the kernel and in the engine (below); ``attention_impl="pallas_gpu"`` keeps the
Triton kernel for every step.

FP8 pages (``kv_cache_dtype="fp8"``) are scaled here, so that every kernel only converts the
tiles it loads: the new K/V are quantized before the kernel writes them, ``k_scale`` is folded
into q, and the output is multiplied by ``v_scale`` (the algebra is in ``jaxinfer.kv_cache_dtype``).
On a CPU those pages are ``uint8`` arrays of e4m3 bits, which ``"cpu"`` and ``"reference"`` read as
such; a Pallas kernel run there in interpret mode is handed the pool bitcast to e4m3 (a copy, in tests only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer import cpu_paged_attention
from jaxinfer.kv_cache_dtype import is_fp8, quantize_to_fp8
from pallas_kernels.paged_attention.cpu import ragged_paged_attention_cpu
from pallas_kernels.paged_attention.page_storage import E4M3, E4M3_BITS, holds_e4m3_bits
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.paged_attention.v_layout import check_v_layout_name
from sharding.rules import shard_over_heads

IMPLEMENTATIONS = ("auto", "reference", "cpu", "pallas_gpu", "pallas_tpu", "pallas_gpu_interpret", "pallas_tpu_interpret",
                   "pallas_gpu_fused", "pallas_gpu_fused_interpret", "pallas_gpu_fresh_prefill",
                   "pallas_gpu_fresh_prefill_branchless", "pallas_gpu_fresh_prefill_cudnn",
                   "pallas_gpu_fresh_prefill_cudnn_segments")
_FRESH_PREFILL = ("pallas_gpu_fresh_prefill", "pallas_gpu_fresh_prefill_branchless", "pallas_gpu_fresh_prefill_cudnn",
                  "pallas_gpu_fresh_prefill_cudnn_segments")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# "auto" on a Hopper GPU (sm_90): a prefill-heavy step's fresh prompts (>= SEGMENTS_MIN_FRESH_TOKENS, up to 8)
# go through cuDNN's flash attention where they lie in the step's rows. Session 9 made the Mosaic GPU
# window path the default (TTFT 1604 -> 1209 ms at 32k against Triton alone); session 17 measured the
# segments path past it on an H200 (benchmarks/results/session17_h200.md): a call at 4k tokens 397 vs
# 486 us, 8k 1128 vs 1264, a ragged 16k batch 1429 vs 2439 (cuDNN alone, contiguous: 1393), 8 x 1000
# 383 vs 550; in the engine TTFT 100.9 vs 104.1 ms at 4k, 480 vs 485 at 16k, 1196 vs 1187 at 32k,
# a 1k-8k prompt mix 35,276 vs 33,474 prompt tok/s, identical first tokens, and no Mosaic GPU windows
# to compile. "pallas_gpu" turns it off.
HOPPER_AUTO_IMPL = "pallas_gpu_fresh_prefill_cudnn_segments"


def resolve_impl(impl: str, platform: str | None = None, head_dim: int | None = None) -> str:
    """Turn ``"auto"`` into a concrete implementation for ``platform`` (default: JAX's backend).

    The GPU kernel tiles head_dim in powers of two; other head sizes take the reference.
    The fresh-prefill paths (``_FRESH_PREFILL``) need a Hopper GPU (the Mosaic GPU kernels issue
    wgmma and TMA; the cuDNN one is held to the same GPUs, where it is measured);
    elsewhere it is ``"auto"``. With ``platform`` given, the device is not asked (tests).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention impl {impl!r} is not one of {IMPLEMENTATIONS}")
    gpu_head_dim_ok = head_dim is None or (head_dim & (head_dim - 1)) == 0
    if impl in _FRESH_PREFILL:
        return impl if gpu_head_dim_ok and _is_hopper(platform) else resolve_impl("auto", platform, head_dim)
    if impl == "auto" and HOPPER_AUTO_IMPL != "pallas_gpu" and gpu_head_dim_ok and _is_hopper(platform):
        return resolve_impl(HOPPER_AUTO_IMPL, platform, head_dim)
    platform = platform or jax.default_backend()
    if impl != "auto":
        return impl
    if platform in _GPU_PLATFORMS and gpu_head_dim_ok:
        return "pallas_gpu"
    if platform == "tpu":
        return "pallas_tpu"
    if platform == "cpu":
        return "cpu"
    return "reference"


def _is_hopper(platform: str | None) -> bool:
    """A given platform is taken at its word ("gpu"/"cuda": Hopper; tests); else the device is asked."""
    return platform in ("gpu", "cuda") if platform else _is_hopper_gpu()


def shared_kernel_programs(impl: str, config, step_shapes) -> list[tuple[str, Callable[[], jax.stages.Lowered]]]:
    """Kernels that several step programs compile, each as a program of its own, named, to lower
    and compile early in warm-up; ``step_shapes``: their (tokens, sequence slots).

    Today the fresh-prefill path's window kernels on a Hopper GPU: the 2048-, 4096- and
    8192-token steps compile 3, 5 and 7 of them (up to ~5 s each on the H200, inferred), one
    after another inside each step's compilation. Compiled early and in parallel, they are in jaxlib's kernel cache
    when the steps need them (``pallas_kernels.mosaic_gpu_names``). Empty for other paths; for
    per-shard kernels under tensor parallelism the caller passes no shapes.
    """
    if resolve_impl(impl, head_dim=config.head_dim) != "pallas_gpu_fresh_prefill":
        return []
    from pallas_kernels.paged_attention import gpu_fresh_prefill as fresh
    from pallas_kernels.paged_attention.fresh_prompts import ENGINE_MAX_FRESH_PROMPTS

    branches = {branch for tokens, seqs in step_shapes  # as _attend calls the path
                for branch in fresh.step_window_branches(tokens, seqs, max_fresh_prompts=ENGINE_MAX_FRESH_PROMPTS)}
    # Longest windows first, as warm-up orders the steps (a stable order keeps logs comparable).
    return [(f"kernel fresh-prefill window {branch.num_slots}x{branch.length}",
             functools.partial(fresh.lower_window_kernel, branch, config.num_q_heads, config.num_kv_heads,
                               config.head_dim))
            for branch in sorted(branches, key=lambda b: (b.length * b.num_slots, b.length), reverse=True)]


def _is_hopper_gpu() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def paged_attention(q, k_new, v_new, k_pages, v_pages, batch, *, sm_scale, sliding_window=None, impl="auto",
                    k_scale=None, v_scale=None, v_layout="token_major"):
    """Write ``k_new``/``v_new`` into the pages and attend; returns ``(out, k_pages, v_pages)``.

    q: [T, Hq, D]; k_new, v_new: [T, Hkv, D]; pages: [Hkv, P, S, D]; ``batch`` is a StepBatch.
    ``k_scale``/``v_scale``: this layer's float32 scalars when the pages are FP8 (None: 1.0).
    ``v_layout="dim_major"``: ``v_pages`` is [Hkv, P, D, S] (``KVCache.v_layout``; the GPU kernels only).
    """
    impl = resolve_impl(impl, head_dim=q.shape[-1])
    check_v_layout(v_layout, impl)
    attend = functools.partial(_attend, impl=impl, sm_scale=sm_scale, sliding_window=sliding_window,
                               v_layout=v_layout)
    fp8 = is_fp8(k_pages.dtype)
    if fp8:
        k_scale = jnp.float32(1.0) if k_scale is None else k_scale
        v_scale = jnp.float32(1.0) if v_scale is None else v_scale
        k_new, v_new = quantize_to_fp8(k_new, k_scale), quantize_to_fp8(v_new, v_scale)  # [T, Hkv, D] e4m3
        # q . (k_scale k_page) = (q k_scale) . k_page: the kernel reads the pages as stored.
        q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
    # The Pallas kernels read e4m3 pages as such; only the plain-JAX paths read a CPU's bit pages.
    as_bits = holds_e4m3_bits(k_pages.dtype) and impl not in ("cpu", "reference")
    if as_bits:
        k_pages, v_pages = (jax.lax.bitcast_convert_type(p, E4M3) for p in (k_pages, v_pages))
    # Under a tensor-parallel mesh each shard runs the kernel on its own heads (sharding.rules).
    out, k_pages, v_pages = shard_over_heads(attend)(
        q, k_new, v_new, k_pages, v_pages, batch.page_tables, batch.cu_q_lens, batch.kv_lens
    )
    if as_bits:
        k_pages, v_pages = (jax.lax.bitcast_convert_type(p, E4M3_BITS) for p in (k_pages, v_pages))
    if fp8:
        out = (out.astype(jnp.float32) * v_scale).astype(out.dtype)  # softmax weights are linear in V
    return out, k_pages, v_pages


def check_v_layout(v_layout: str, impl: str) -> None:
    """Dim-major V pages (``pallas_kernels.paged_attention.v_layout``) are read by the Pallas-Triton
    kernel and its fresh-prefill paths only; a concrete ``impl`` (``resolve_impl``) that reads
    none, or an unknown layout, is refused here, before anything is traced."""
    check_v_layout_name(v_layout)
    if v_layout == "dim_major" and not (impl in ("pallas_gpu", "pallas_gpu_interpret") or impl in _FRESH_PREFILL):
        raise ValueError(f"dim-major V pages are read by the pallas_gpu kernels only, not by attention impl {impl!r}")


def _attend(*args, impl, sm_scale, sliding_window, v_layout="token_major"):
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window)
    gpu_kwargs = dict(kwargs, v_layout=v_layout)  # only the kernels check_v_layout lets through read it
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **kwargs)
    if impl == "cpu":
        k_pages = args[3]
        if cpu_paged_attention.supports(k_pages.dtype):  # one native call per layer (float32/bf16 pages)
            return cpu_paged_attention.ragged_paged_attention_native(*args, **kwargs)
        return ragged_paged_attention_cpu(*args, **kwargs)
    import pallas_kernels.paged_attention as pa

    if impl in _FRESH_PREFILL:
        from pallas_kernels.paged_attention.fresh_prompts import ENGINE_MAX_FRESH_PROMPTS, MAX_FRESH_PROMPTS
        from pallas_kernels.paged_attention.gpu_fresh_prefill import SEGMENTS_MIN_FRESH_TOKENS

        if impl.endswith("_cudnn_segments"):  # cuDNN's work follows the prompts: up to 8 a step, shorter ones
            return pa.ragged_paged_attention_gpu_fresh_prefill(
                *args, **gpu_kwargs, cudnn_segments=True, max_fresh_prompts=MAX_FRESH_PROMPTS,
                min_fresh_tokens=SEGMENTS_MIN_FRESH_TOKENS)
        return pa.ragged_paged_attention_gpu_fresh_prefill(*args, **gpu_kwargs, branchless=impl.endswith("_branchless"),
                                                           cudnn=impl.endswith("_cudnn"),
                                                           max_fresh_prompts=ENGINE_MAX_FRESH_PROMPTS)
    if impl.startswith("pallas_gpu_fused"):
        return pa.ragged_paged_attention_gpu_fused(*args, **kwargs, interpret=impl.endswith("_interpret"))
    if impl.startswith("pallas_gpu"):
        return pa.ragged_paged_attention_gpu(*args, **gpu_kwargs, interpret=impl.endswith("_interpret"))
    if impl == "pallas_tpu_interpret":
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode():
            return pa.ragged_paged_attention_tpu(*args, **kwargs)
    return pa.ragged_paged_attention_tpu(*args, **kwargs)

"""Issue 21, prefill: every causal prefill attention we can run on the H200, one run, same shapes.

Llama-3.1-8B heads (32 q / 8 KV, D = 128), bf16, causal. Shapes: one sequence's chunk of 4k, 8k,
16k, 32k and 2k tokens (fresh: no cached prefix), and a ragged batch of five fresh sequences
(1k + 1.5k + 2.5k + 4k + 7k = 16k tokens). Implementations, each in its own try/except (its
error is printed and recorded, the run goes on):

- ``ours``: the engine's default GPU path (``gpu.ragged_paged_attention_gpu``, Pallas-Triton:
  the XLA scatter of the K/V into the donated paged cache, then attention), at its tuned sizes;
- ``ours_attend``: the same kernel's attention alone (``gpu.attend_gpu``), without the scatter;
- ``ours_prefix``: the same full call for a chunk of the same length over a cached prefix as
  long as the chunk (the second chunk of a 2L prompt: the pages hold the prefix);
- ``fresh_path``: the opt-in engine path ``gpu_fresh_prefill.ragged_paged_attention_gpu_fresh_prefill``
  (the longest fresh prefill through jax's bundled Mosaic GPU kernel, float16 window, the rest
  through Triton), full call with its scatter: the number that decides the dispatcher's default;
- ``fresh_branchless``: the same path with our bf16 window kernel (``gpu_fresh_window.py``, the
  ``proto`` kernel with a dynamic block count) and no device conditional (``branchless=True``);
- ``fresh_cudnn`` / ``fresh_cudnn_single``: the fresh path's branches with cuDNN's flash attention
  on bf16 windows instead of the bundled kernel (``cudnn=True``), several fresh prompts a step / the
  longest only (the engine's count);
- ``fresh_segments`` / ``fresh_segments_single``: cuDNN's flash attention over the fresh prompts where
  they lie in the step's rows (its packed layout: ragged offsets, ``cudnn_segments=True``), no windows
  and no device conditional; several prompts a step / the longest only;
- ``bundled_Q_KV_S``: jax's bundled FA3-style kernel (``jax.experimental.pallas.ops.gpu.attention_mgpu``,
  two consumer warpgroups + a TMA warpgroup) alone, on float16 inputs (in jax 0.11.2 it stages
  through float16 shared memory and refuses bf16), block_q Q, block_kv KV, S pipeline steps;
- ``proto_S``: our one-warpgroup wgmma + TMA prototype (``mosaic_gpu_prefill_prototype.py``), S steps;
- ``segments_alone``: the segments path's cuDNN call alone (``causal_attention_cudnn_segments`` over the
  step's contiguous q/k_new/v_new, the prompts as segments, ``--max-fresh-prompts`` slots): with
  ``cudnn`` and ``fresh_segments`` it splits the path's time into cuDNN's packed call and the rest;
- ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` on contiguous bf16;
- ``xla``: ``jax.nn.dot_product_attention(..., implementation="xla")`` (chunks up to 8k: it
  materialises the scores).

The dense peers take the chunk as ``[n, L, H, D]`` (the ragged batch: one call per sequence,
all in one jitted step). TFLOP/s count 4 * D * Hq per visible (query, key) pair for everyone
(``kernel_attention.causal_flops``, through ``ragged_inputs``), beside the bf16 matmul rate (8192^3) measured in this run.
Each implementation's output is checked in the same run against the XLA reference (chunks up to
4k) or cuDNN (rel. Frobenius error). Timing: ``kernel_frontier.time_chain`` (calls chained,
unrolled in one jit, median of 3; ``--smoke`` times once); a time budget skips what is left,
results are written after every implementation. ``--trace-impls`` runs the named columns' chains once
more under the profiler and records each kernel's µs a call (``kernels_us`` in the JSON, a table in the .md).

    python3 benchmarks/prefill_peers.py --out DIR [--budget-s 270] [--shapes 4096,8192,...,ragged] \
        [--impls cudnn,ours,fresh_path,bundled_64_128_2]   # a subset: names, or families (bundled, proto)
        [--trace-impls fresh_segments]   # where a full call's time goes, kernel by kernel
    python3 benchmarks/prefill_peers.py --out /tmp/pp --smoke   # CPU: interpreter, tiny shapes

Writes DIR/prefill_peers.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernel_frontier as kf  # noqa: E402
from profile_collectives import busy_time, gpu_kernels, load_trace  # noqa: E402
from kernel_attention import pseudo_random, ragged_inputs  # noqa: E402
from kernel_frontier import Budget, OutOfTime, say, time_chain  # noqa: E402
from mosaic_gpu_prefill_prototype import causal_prefill_attention_mosaic_gpu  # noqa: E402
from pallas_kernels.paged_attention import fresh_prompts as fpr  # noqa: E402
from pallas_kernels.paged_attention import gpu, gpu_fresh_prefill, gpu_fresh_window  # noqa: E402
from pallas_kernels.paged_attention.block_sizes import gpu_block_sizes  # noqa: E402

RAGGED = (1024, 1536, 2560, 4096, 7168)  # fresh sequences of the ragged batch (multiples of 128)
BUNDLED_CONFIGS = ((64, 128, 2), (64, 64, 4), (64, 128, 3))  # (block_q, block_kv, steps); 3 x 128 may not fit smem
PROTO_STEPS = (2, 3, 4)
XLA_MAX_TOKENS = 8192
FRESH_MAX_REPEATS = 8  # chained calls of the window paths (>= 3 ms a timed program at 4k); segments: as the peers
CHECK_AGAINST_XLA_MAX = 4096


class Setup:
    """Heads, page size and mode of one run (the smoke run shrinks them)."""

    def __init__(self, smoke: bool, page_size: int, impls: str | None = None, min_fresh_tokens: int | None = None,
                 kv_dtypes: str = "bf16", max_fresh_prompts: int = gpu_fresh_prefill.MAX_FRESH_PROMPTS,
                 trace_impls: str = "", trace_dir: str | None = None):
        self.smoke = smoke
        self.trace_impls = set(filter(None, trace_impls.split(",")))
        self.trace_dir = trace_dir
        self.impls = set(impls.split(",")) if impls else None
        self.num_q_heads, self.num_kv_heads, self.head_dim = (4, 2, 64) if smoke else (32, 8, 128)
        self.sm_scale = self.head_dim**-0.5
        self.page_size = page_size
        self.min_fresh_tokens = min_fresh_tokens or (64 if smoke else gpu_fresh_prefill.MIN_FRESH_TOKENS)
        # The segments columns take the engine's own minimum for that path unless one is given.
        self.segments_min_fresh_tokens = min_fresh_tokens or (
            64 if smoke else gpu_fresh_prefill.SEGMENTS_MIN_FRESH_TOKENS)
        self.max_fresh_prompts = max_fresh_prompts
        self.kv_dtypes = kv_dtypes.split(",")
        unknown = set(self.kv_dtypes) - {"bf16", "fp8"}
        if unknown:
            raise SystemExit(f"--kv-dtypes: {sorted(unknown)} not in bf16, fp8")

    def is_wanted(self, impl: str) -> bool:
        """Every implementation, or those named in ``--impls`` (a family name selects its variants);
        ``X_fp8`` (over fp8 pages) runs when ``X`` is wanted and ``--kv-dtypes`` holds fp8."""
        if impl.endswith("_fp8"):
            return "fp8" in self.kv_dtypes and self.is_wanted(impl[:-len("_fp8")])
        family = impl.split("_")[0] if impl.startswith(("bundled_", "proto_")) else None
        return self.impls is None or impl == "reference-for-check" or impl in self.impls or family in self.impls

    def repeats(self, num_tokens: int) -> int:
        """Chained calls per timed program: fewer for long chunks (a 32k chunk is tens of ms)."""
        if self.smoke:
            return 1
        return 32 if num_tokens <= 4096 else 16 if num_tokens <= 8192 else 8


def traced_kernels(program, carry, consts, trace_dir: str, calls: int) -> tuple[object, dict]:
    """Run ``program`` (a chain of ``calls`` calls) once under the profiler: (its output, each GPU kernel's
    µs and launches a call, the span a call and the gaps in it). On a CPU the trace has no GPU kernels:
    the summary then says so."""
    import glob

    with jax.profiler.trace(trace_dir):
        carry = jax.block_until_ready(program(carry, *consts))
    traces = sorted(glob.glob(os.path.join(trace_dir, "plugins/profile/*/*.trace.json.gz")))
    if not traces:
        return carry, {"error": f"no trace written under {trace_dir}"}
    kernels = gpu_kernels(*load_trace(traces[-1]))
    if not kernels:
        return carry, {"error": "no GPU kernel events in the trace"}
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e["name"].split("(")[0][:90], [0.0, 0.0])
        entry[0] += e["dur"] / calls
        entry[1] += 1 / calls
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return carry, {"span_us": span / calls, "gaps_us": (span - busy_time(intervals)) / calls,
                   "kernels": {name: {"us": us, "launches": n} for name, (us, n) in ranked}}


def rel_err(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def dense_chunks(q_packed, k_packed, v_packed, lens):
    """Packed rows [T, H, D] -> one [1, L, H, D] array per sequence (the dense peers' inputs)."""
    starts = np.concatenate([[0], np.cumsum(lens)])
    return [tuple(x[a:b][None] for x in (q_packed, k_packed, v_packed)) for a, b in zip(starts[:-1], starts[1:])]


def per_sequence(attend):
    """One step over every sequence's dense chunk: the chain's carry is the tuple of queries."""
    def step(qs, ks, vs):
        return tuple(attend(q, k, v) for q, k, v in zip(qs, ks, vs))
    return step


SMOKE_SHAPES = "256,ragged"  # --smoke's default --shapes
SMOKE_RAGGED = (128, 256)


def parse_shape(shape: str, smoke: bool) -> tuple[str, tuple[int, ...]]:
    """One ``--shapes`` item -> (row name, prompt lengths): ``L`` one prompt ("1xL"), ``NxL`` N equal
    fresh prompts in one step, ``ragged`` the ragged mix (``SMOKE_RAGGED`` under ``--smoke``)."""
    if shape == "ragged":
        return "ragged", SMOKE_RAGGED if smoke else RAGGED
    if "x" in shape:  # N prompts of L tokens in one step: "8x1000"
        count, length = (int(part) for part in shape.split("x"))
        return shape, (length,) * count
    return f"1x{shape}", (int(shape),)


def run_shape(setup: Setup, name: str, lens: tuple[int, ...], results: list, budget: Budget, ceil: dict, save):
    """Time every implementation on fresh prefills of ``lens`` tokens, packed in one ragged batch."""
    kf.REPEATS = setup.repeats(sum(lens))
    hq, hkv, d, ps = setup.num_q_heads, setup.num_kv_heads, setup.head_dim, setup.page_size
    (q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens), flops = ragged_inputs(
        [(n, n) for n in lens], ps, hq, hkv, d)
    num_tokens = q.shape[0]
    k_new = pseudo_random((num_tokens, hkv, d), 18)
    v_new = pseudo_random((num_tokens, hkv, d), 19)
    row = {"workload": "prefill-peers", "shape": name, "lens": list(lens), "num_tokens": num_tokens, "flops": flops,
           "repeats": kf.REPEATS, "s": {}, "tflops": {}, "rel_err": {}, "errors": {}, "wall_s": {}}
    results.append(row)
    matmul = ceil.get("matmul_tflops", float("nan"))

    chunks = dense_chunks(q, k_new, v_new, lens)
    qs, ks, vs = (tuple(c[i] for c in chunks) for i in range(3))
    want = None  # the check's reference outputs, one [1, L, Hq, D] per sequence

    def record(impl, seconds, out=None, flops_done=flops, expected=None):
        row["s"][impl] = seconds
        row["tflops"][impl] = flops_done / seconds / 1e12
        expected = want if expected is None else expected
        if out is not None and expected is not None:
            outs = out if isinstance(out, (tuple, list)) else unpack(out)
            row["rel_err"][impl] = max(rel_err(o, w) for o, w in zip(outs, expected))
        err = row["rel_err"].get(impl)
        say(f"{name} {impl}: {seconds * 1e6:9.0f}us {row['tflops'][impl]:6.0f} TFLOP/s "
            f"({row['tflops'][impl] / matmul:.0%} of matmul)" + (f" rel err {err:.1e}" if err is not None else ""))
        save()

    def unpack(out_packed):  # [T, Hq, D] -> per-sequence [1, L, Hq, D]
        starts = np.concatenate([[0], np.cumsum(lens)])
        return [out_packed[a:b][None] for a, b in zip(starts[:-1], starts[1:])]

    def attempt(impl, fn):
        if not setup.is_wanted(impl):
            return
        start = time.time()
        try:
            budget.check(5)
            fn()
            # Compiles included: the fresh path compiles one Mosaic GPU kernel per window length.
            row["wall_s"][impl] = time.time() - start
        except OutOfTime:
            row["errors"][impl] = "skipped: out of time"
            say(f"{name} {impl}: skipped, out of time")
        except Exception as e:  # a peer refusing a shape, a compile failing: say which, go on
            row["errors"][impl] = f"{type(e).__name__}: {str(e)[:300]}"
            say(f"{name} {impl}: FAILED {row['errors'][impl]}")
            say(traceback.format_exc()[-800:])
            save()

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=setup.sm_scale, is_causal=True,
                                            implementation="cudnn").astype(q.dtype)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=setup.sm_scale, is_causal=True,
                                            implementation="xla").astype(q.dtype)

    def reference_for(k_packed, v_packed):
        """The check's outputs over these K/V (the fp8 rows': their e4m3 values, widened exactly)."""
        sources = dense_chunks(q, k_packed.astype(q.dtype), v_packed.astype(q.dtype), lens)
        if max(lens) <= CHECK_AGAINST_XLA_MAX or setup.smoke:
            up = lambda x: jnp.repeat(x, hq // hkv, axis=2).astype(jnp.float32)  # noqa: E731
            row["check_against"] = "xla-f32"
            return [jax.nn.dot_product_attention(q.astype(jnp.float32), up(k), up(v), scale=setup.sm_scale,
                                                 is_causal=True) for q, k, v in sources]
        row["check_against"] = "cudnn"
        return [jax.jit(cudnn)(*c) for c in sources]

    def reference_outputs():
        nonlocal want
        want = reference_for(k_new, v_new)

    attempt("reference-for-check", reference_outputs)

    def checked_chain(step, carry, *consts, impl: str = ""):
        """(seconds per call, the output to check) of ``carry = step(carry, *consts)`` (a dense peer, nothing donated).

        With one call a chain (--smoke) the chain's first run is that output: the kernel compiles once.
        ``impl`` in ``--trace-impls``: the chain runs once more under the profiler.
        """
        program = kf.compile_chain(step, carry, *consts, donate=False)
        out = program(carry, *consts) if kf.REPEATS == 1 else jax.jit(step)(carry, *consts)
        seconds = kf.time_compiled(program, carry, *consts)[0]
        if impl in setup.trace_impls:
            row.setdefault("kernels_us", {})[impl] = traced_kernels(
                program, carry, consts, os.path.join(setup.trace_dir, f"profile_{name}_{impl}"), kf.REPEATS)[1]
        return seconds, out

    def time_cudnn():
        record("cudnn", *checked_chain(per_sequence(cudnn), qs, ks, vs, impl="cudnn"))

    sizes = gpu_block_sizes(num_tokens=num_tokens, max_num_seqs=len(lens), max_kv_len=page_tables.shape[1] * ps,
                            num_kv_heads=hkv, group=hq // hkv, head_dim=d, page_size=ps, itemsize=2)
    row["ours_sizes"] = sizes.__dict__
    interpret = setup.smoke

    def full_step(kernel, **options):
        def step(state, k_new, v_new, page_tables, cu_q_lens, kv_lens):
            q, k_pages, v_pages = state  # the output becomes the next query: every call stays live
            return kernel(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                          sm_scale=setup.sm_scale, interpret=interpret, **options)
        return step

    is_multi = len(lens) > 1 and len(set(lens)) == 1  # a step of several equal fresh prompts ("8x1000")
    fp8 = jnp.float8_e4m3fn
    k_new8, v_new8 = k_new.astype(fp8), v_new.astype(fp8)  # what the dispatcher writes over fp8 pages (scale 1)
    want_fp8 = None  # the check's reference over the e4m3 K/V the fp8 impls read

    def time_full(impl, kernel, max_repeats=None, over_fp8=False, **options):
        nonlocal k_pages, v_pages, want_fp8
        kn, vn = (k_new8, v_new8) if over_fp8 else (k_new, v_new)
        kp, vp = (k_pages.astype(fp8), v_pages.astype(fp8)) if over_fp8 else (k_pages, v_pages)
        consts = (kn, vn, page_tables, cu_q_lens, kv_lens)
        repeats = kf.REPEATS
        # Fewer chained calls: session 8 compiled the fresh path's chain of 8-32 in 30-44 s (a loop compiles once).
        if max_repeats and not is_multi:
            kf.REPEATS = row.setdefault("repeats_by_impl", {})[impl] = min(repeats, max_repeats)
        try:
            step = full_step(kernel, **options)
            if is_multi:  # one compiled step in a loop: a fresh path's branches compile once, not per call
                program = loop_program(step)
            else:
                program = kf.compile_chain(step, (q, kp, vp), *consts, donate=True)
            if kf.REPEATS == 1:
                # One call a program (--smoke): its first run is the call to check, so the interpreted
                # kernel compiles once (checked apart, it compiled again: ~4 s a fresh path on CPU).
                out = program((jnp.copy(q), jnp.copy(kp), jnp.copy(vp)), *consts)[0]
            else:
                out = kernel(q, kn, vn, jnp.copy(kp), jnp.copy(vp), page_tables, cu_q_lens, kv_lens,
                             sm_scale=setup.sm_scale, interpret=interpret, **options)[0]
            # The carry is donated: a copy of q rides in it, so q itself stays for the next implementation.
            seconds, (_, kp, vp) = kf.time_compiled(program, (jnp.copy(q), kp, vp), *consts)
            if impl in setup.trace_impls:
                trace_dir = os.path.join(setup.trace_dir, f"profile_{name}_{impl}")
                (_, kp, vp), row.setdefault("kernels_us", {})[impl] = traced_kernels(
                    program, (jnp.copy(q), kp, vp), consts, trace_dir, kf.REPEATS)
        finally:
            kf.REPEATS = repeats
        if over_fp8:
            if want_fp8 is None and want is not None:
                want_fp8 = reference_for(k_new8, v_new8)
            record(impl, seconds, out, expected=want_fp8)
        else:
            k_pages, v_pages = kp, vp
            record(impl, seconds, out)
        if "max_fresh_prompts" in options or "branchless" in options:
            row.setdefault("fresh_prompts_served", {})[impl] = prompts_served(options)

    def loop_program(step):
        """``step`` run ``kf.REPEATS`` times in one jitted ``fori_loop`` (the carry donated)."""
        repeats = kf.REPEATS
        return jax.jit(lambda carry, *consts: jax.lax.fori_loop(0, repeats, lambda i, c: step(c, *consts), carry),
                       donate_argnums=(0,))

    def prompts_served(options) -> int:
        """How many of the step's fresh prompts the path hands its window kernel (its choice, on the host)."""
        limit = options.get("max_fresh_prompts", gpu_fresh_prefill.MAX_FRESH_PROMPTS)
        min_fresh_tokens = options.get("min_fresh_tokens", setup.min_fresh_tokens)
        if options.get("branchless") or options.get("cudnn_segments"):
            slots = fpr.max_fresh_prompts_in(num_tokens, min_fresh_tokens, limit)
            chosen = fpr.choose_packed(cu_q_lens, kv_lens, num_slots=slots,
                                       min_fresh_tokens=min_fresh_tokens) if slots else None
        else:
            waste = gpu_fresh_prefill.MAX_WINDOW_WASTE
            branches = fpr.window_branches(num_tokens, min_fresh_tokens, limit, waste)
            chosen = fpr.choose_slots(cu_q_lens, kv_lens, branches, min_fresh_tokens=min_fresh_tokens,
                                      max_window_waste=waste) if branches else None
        return 0 if chosen is None else int(jnp.sum(chosen.served > 0))

    def time_attend():
        def step(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens):
            return gpu.attend_gpu(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=setup.sm_scale,
                                  sizes=sizes, interpret=interpret)
        # The pages must hold this step's K/V for the check: write them once (outside the timing).
        written = gpu.attend_and_write_gpu(q, k_new, v_new, jnp.copy(k_pages), jnp.copy(v_pages), page_tables,
                                           cu_q_lens, kv_lens, sm_scale=setup.sm_scale, sizes=sizes,
                                           interpret=interpret)
        record("ours_attend", time_chain(step, q, *written[1:], page_tables, cu_q_lens, kv_lens, donate=False)[0],
               written[0])

    def time_prefix():
        # Each chunk is the second half of a prompt twice its length: the first half is in the pages.
        (qp, kpp, vpp, ptp, cup, kvp), flops_prefix = ragged_inputs([(n, 2 * n) for n in lens], ps, hq, hkv, d)
        seconds, _ = time_chain(full_step(gpu.ragged_paged_attention_gpu), (qp, kpp, vpp), k_new, v_new, ptp, cup,
                                kvp, donate=True)
        record("ours_prefix", seconds, flops_done=flops_prefix)

    fresh_attend = gpu_fresh_prefill.causal_attention_mgpu
    window_attend = None  # the branchless path's own kernel
    cudnn_attend = None  # the cuDNN variant's default: cuDNN itself
    segments_attend = None  # the cuDNN segments path's default: cuDNN's packed layout
    if setup.smoke:  # no Mosaic GPU kernel runs on a CPU: the prototype, interpreted, stands in for the check
        def fresh_attend(q, k, v, *, sm_scale):  # as the bundled kernel's wrapper, it widens e4m3 K/V itself
            return causal_prefill_attention_mosaic_gpu(q, k.astype(q.dtype), v.astype(q.dtype), sm_scale=sm_scale,
                                                       interpret=True)
        window_attend = functools.partial(gpu_fresh_window.packed_causal_attention_mosaic_gpu, interpret=True)
        cudnn_attend = functools.partial(gpu_fresh_prefill.causal_attention_cudnn, implementation="xla")
        segments_attend = functools.partial(gpu_fresh_prefill.causal_attention_cudnn_segments, implementation="xla")
    min_fresh = setup.min_fresh_tokens
    row["min_fresh_tokens"] = min_fresh

    def time_bundled(config):
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        def attend(q, k, v):  # float16 in and out; sm_scale folded into q outside the chain
            return attention_mgpu.attention(q, k, v, config)
        half = lambda xs: tuple(x.astype(jnp.float16) for x in xs)  # noqa: E731
        qs16 = tuple((q.astype(jnp.float32) * setup.sm_scale).astype(jnp.float16) for q in qs)
        tag = f"bundled_{config.block_q}_{config.block_kv}_{config.max_concurrent_steps}"
        record(tag, *checked_chain(per_sequence(attend), qs16, half(ks), half(vs)))

    def time_proto(steps):
        attend = functools.partial(causal_prefill_attention_mosaic_gpu, sm_scale=setup.sm_scale,
                                   max_concurrent_steps=steps, interpret=interpret)
        record(f"proto_{steps}", *checked_chain(per_sequence(attend), qs, ks, vs))

    def time_xla():
        record("xla", *checked_chain(per_sequence(xla), qs, ks, vs))

    def time_segments_alone():
        """The segments path's cuDNN call alone: every prompt a segment (as many slots as the path's), in place."""
        slots = max(setup.max_fresh_prompts, len(lens))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        seg_start = jnp.zeros((slots,), jnp.int32).at[:len(lens)].set(jnp.asarray(starts, jnp.int32))
        seg_len = jnp.zeros((slots,), jnp.int32).at[:len(lens)].set(jnp.asarray(lens, jnp.int32))
        attend = segments_attend or gpu_fresh_prefill.causal_attention_cudnn_segments

        def step(q, k, v, seg_start, seg_len):
            return attend(q, k, v, seg_start, seg_len, sm_scale=setup.sm_scale)
        record("segments_alone", *checked_chain(step, q, k_new, v_new, seg_start, seg_len, impl="segments_alone"))

    from jax.experimental.pallas.ops.gpu import attention_mgpu
    attempt("cudnn", time_cudnn)
    fresh = gpu_fresh_prefill.ragged_paged_attention_gpu_fresh_prefill
    several = setup.max_fresh_prompts
    # Each fresh-prefill column: (name, its window or segment attention, the path's options).
    fresh_columns = (
        ("fresh_single", fresh_attend, dict(max_fresh_prompts=1)),  # before session 11: the longest prompt only
        ("fresh_path", fresh_attend, dict(max_fresh_prompts=several)),
        ("fresh_branchless", window_attend, dict(branchless=True, max_fresh_prompts=several)),
        # The bundled path's branches with cuDNN's flash attention on the bf16 windows.
        ("fresh_cudnn_single", cudnn_attend, dict(cudnn=True, max_fresh_prompts=1)),
        ("fresh_cudnn", cudnn_attend, dict(cudnn=True, max_fresh_prompts=several)),
        # cuDNN over the fresh prompts where they lie in the step's rows (packed layout): no windows.
        ("fresh_segments_single", segments_attend, dict(cudnn_segments=True, max_fresh_prompts=1)),
        ("fresh_segments", segments_attend, dict(cudnn_segments=True, max_fresh_prompts=several)),
    )
    for suffix, over_fp8 in (("", False), ("_fp8", True)):
        attempt("ours" + suffix, lambda: time_full("ours" + suffix, gpu.ragged_paged_attention_gpu, over_fp8=over_fp8))
        for column, attend, options in fresh_columns:
            # The segments path compiles no window kernels: it chains as many calls as the dense peers.
            segments = options.get("cudnn_segments", False)
            attempt(column + suffix, lambda: time_full(
                column + suffix, fresh, max_repeats=None if segments else FRESH_MAX_REPEATS, over_fp8=over_fp8,
                min_fresh_tokens=setup.segments_min_fresh_tokens if segments else min_fresh, fresh_attend=attend,
                **options))
    for block_q, block_kv, steps in BUNDLED_CONFIGS:
        if setup.smoke and block_kv > min(lens):
            continue
        config = attention_mgpu.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps,
                                             causal=True)
        attempt(f"bundled_{block_q}_{block_kv}_{steps}", functools.partial(time_bundled, config))
    for steps in PROTO_STEPS[:1] if setup.smoke else PROTO_STEPS:  # the interpreter is slow
        attempt(f"proto_{steps}", functools.partial(time_proto, steps))
    attempt("ours_attend", time_attend)
    attempt("segments_alone", time_segments_alone)
    attempt("ours_prefix", time_prefix)
    if max(lens) <= XLA_MAX_TOKENS:
        attempt("xla", time_xla)
    if row["tflops"]:
        best = max(row["tflops"], key=row["tflops"].get)
        cud = row["tflops"].get("cudnn")
        say(f"{name} RESULT: best {best} {row['tflops'][best]:.0f} TFLOP/s ({row['tflops'][best] / matmul:.0%} of "
            f"matmul {matmul:.0f})" + (f", {row['tflops'][best] / cud:.2f}x cuDNN" if cud else "")
            + (f"; ours {row['tflops']['ours']:.0f}" if "ours" in row["tflops"] else "")
            + (f"; fresh_path {row['tflops']['fresh_path']:.0f}" if "fresh_path" in row["tflops"] else "")
            + (f"; fresh_branchless {row['tflops']['fresh_branchless']:.0f}" if "fresh_branchless" in row["tflops"]
               else "")
            + (f"; fresh_cudnn_single {row['tflops']['fresh_cudnn_single']:.0f}"
               if "fresh_cudnn_single" in row["tflops"] else ""))
    del q, k_pages, v_pages, k_new, v_new, chunks, qs, ks, vs, want


IMPLS = ("ours", "ours_attend", "ours_prefix", "fresh_single", "fresh_path", "fresh_branchless", "fresh_cudnn_single",
         "fresh_cudnn", "fresh_segments_single", "fresh_segments", "ours_fp8", "fresh_single_fp8", "fresh_path_fp8",
         "fresh_branchless_fp8", "fresh_cudnn_single_fp8", "fresh_cudnn_fp8", "fresh_segments_single_fp8",
         "fresh_segments_fp8", "segments_alone", "cudnn", "xla")


def write_outputs(out_dir: str, report: dict):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "prefill_peers.json"), "w") as f:
        json.dump(report, f, indent=1)
    matmul = (report.get("ceilings") or {}).get("matmul_tflops", float("nan"))
    rows = [r for r in report["results"] if r["workload"] == "prefill-peers"]
    mosaic = sorted({k for r in rows for k in r["tflops"] if k.startswith(("bundled", "proto"))})
    columns = [c for c in (*IMPLS, *mosaic) if any(c in r["tflops"] or c in r["errors"] for r in rows)]
    lines = [f"# prefill peers ({report['device']}, jax {report['jax']})", "",
             f"Command: `{report['command']}`", "",
             f"bf16 matmul rate in this run: {matmul:.0f} TFLOP/s. Cells: µs a call, TFLOP/s (causal FLOPs, "
             "counted alike), % of the matmul rate, rel. error against the check's reference (the `_fp8` "
             "columns: over fp8 pages, checked against the same e4m3 K/V); – = not run (errors in the JSON). "
             "`fresh_single`: the fresh path with one prompt a step (before session 11); `fresh_path` / "
             "`fresh_branchless`: several (`max_fresh_prompts`); prompts served: the `served` column. `min fresh`: "
             "the window paths' shortest prompt served; the `fresh_segments` columns take the engine's "
             f"{gpu_fresh_prefill.SEGMENTS_MIN_FRESH_TOKENS} unless `--min-fresh-tokens` is given, and chain as "
             "many calls as the dense peers.", "",
             "| shape | tokens | min fresh | " + " | ".join(columns) + " | served |",
             "|" + " --- |" * (len(columns) + 4)]
    for r in rows:
        cells = []
        for c in columns:
            if c in r["tflops"]:
                err = r["rel_err"].get(c)
                cells.append(f"{r['s'][c] * 1e6:.0f}µs {r['tflops'][c]:.0f} ({r['tflops'][c] / matmul:.0%})"
                             + (f" e{err:.0e}" if err is not None else ""))
            else:
                cells.append("–")
        served = ", ".join(f"{k} {v}" for k, v in r.get("fresh_prompts_served", {}).items())
        lines.append(f"| {r['shape']} | {r['num_tokens']} | {r.get('min_fresh_tokens', '')} | " + " | ".join(cells)
                     + f" | {served} |")
    for r in rows:
        for impl, traced in r.get("kernels_us", {}).items():
            lines += ["", f"Kernels of one `{impl}` call, {r['shape']} (profiler trace of the timed chain):", ""]
            if "error" in traced:
                lines.append(f"- {traced['error']}")
                continue
            lines += ["| kernel | µs a call | launches a call |", "| --- | --- | --- |"]
            lines += [f"| `{k}` | {v['us']:.1f} | {v['launches']:g} |" for k, v in traced["kernels"].items()]
            lines.append(f"| gaps between kernels | {traced['gaps_us']:.1f} | |")
            lines.append(f"| span | {traced['span_us']:.1f} | |")
    errors = [f"- {r['shape']} {impl}: {e}" for r in rows for impl, e in r["errors"].items()]
    if errors:
        lines += ["", "Not run:", *errors]
    with open(os.path.join(out_dir, "prefill_peers.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip what is left after this many seconds")
    parser.add_argument("--shapes", default="4096,8192,16384,32768,ragged,2048",
                        help="single-sequence chunk lengths, 'ragged', and/or NxL (N fresh prompts of L tokens in "
                             "one step, timed in a fori_loop), in the order run")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--impls", default=None, help="comma-separated implementations or families (default: all)")
    parser.add_argument("--kv-dtypes", default="bf16",
                        help="bf16 and/or fp8: fp8 adds ours/fresh_*_fp8 over float8_e4m3fn pages")
    parser.add_argument("--min-fresh-tokens", type=int, default=None,
                        help=f"the fresh paths' minimum prompt (default MIN_FRESH_TOKENS = "
                             f"{gpu_fresh_prefill.MIN_FRESH_TOKENS}); 1000-token prompts need <= 1000")
    parser.add_argument("--max-fresh-prompts", type=int, default=gpu_fresh_prefill.MAX_FRESH_PROMPTS,
                        help="fresh prompts a step of fresh_path / fresh_branchless (fresh_single: 1)")
    parser.add_argument("--trace-impls", default="",
                        help="columns (e.g. fresh_segments,cudnn,segments_alone) to run once more under the profiler: "
                             "each kernel's µs a call goes in the JSON and the .md")
    parser.add_argument("--smoke", action="store_true",
                        help=f"CPU check of this script: interpreter, tiny heads, --shapes {SMOKE_SHAPES} unless "
                             "given, each chain timed once (without it the GPU defaults hold)")
    args = parser.parse_args()
    setup = Setup(args.smoke, args.page_size, args.impls, args.min_fresh_tokens, args.kv_dtypes,
                  args.max_fresh_prompts, args.trace_impls, args.out)
    if args.smoke and args.shapes == parser.get_default("shapes"):
        args.shapes = SMOKE_SHAPES
    if args.smoke:  # the interpreter's numbers mean nothing: one timed run of each chain
        kf.TIMED_RUNS = 1
    budget = Budget(args.budget_s)
    device = jax.devices()[0]
    report = {"command": " ".join(["python3"] + sys.argv), "device": device.device_kind,
              "platform": platform.platform(), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC"),
              "heads": [setup.num_q_heads, setup.num_kv_heads, setup.head_dim], "results": []}
    say(f"command: {report['command']}")
    say(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; {platform.platform()}")
    save = lambda: write_outputs(args.out, report)  # noqa: E731
    try:
        if not args.smoke:
            report["ceilings"] = kf.guarded("ceilings", kf.measure_ceilings)
        save()
        for shape in args.shapes.split(","):
            name, lens = parse_shape(shape, args.smoke)
            if budget.left() < 15:
                say(f"{name}: skipped, out of time")
                continue
            kf.guarded(name, run_shape, setup, name, lens, report["results"], budget,
                       report.get("ceilings") or {}, save)
    finally:
        say(f"total {time.time() - kf.T0:.0f}s")
        report["log"] = kf.LOG
        save()
        print(open(os.path.join(args.out, "prefill_peers.md")).read())


if __name__ == "__main__":
    main()

"""Weight-only FP8 matmul for few tokens on one GPU: our Pallas kernel beside XLA's bf16, W8A16 and W8A8.

Llama-3.1-8B projection shapes (``[out, in]`` weights: q/o 4096x4096, k/v 1024x4096,
gate/up 14336x4096, down 4096x14336), token counts M in {1, 2, 4, 8, 16, 32, 64}:

* ceiling: the HBM read rate of a jitted ``jnp.sum`` over 4 GiB of bf16, this run;
* correctness: every kernel form against the float32 reference, on the GPU, fp8 and int8;
* ``sweep``: per projection shape and M, XLA bf16 dot, XLA W8A16 (convert then dot), XLA
  W8A8 (per-token fp8 activations, fp8 dot, scales after it) and our kernel at a list of
  tile sizes / multiply forms / pipeline depths, tried in rounds (candidate 1 of every
  shape and M, then candidate 2, ...) until the sweep's share of ``--budget-s`` is spent;
* ``chain``: ``--layers`` layers of q, k, v, o, gate, up, down (silu(gate) * up into down,
  a residual add), each implementation end to end, ours at the sweep's best sizes per shape
  and at its defaults; then "fused" chains (q/k/v as one call, gate/up as one call: four
  calls a layer) for ours and XLA bf16; then ours with int8 weights.

Timing: each timed program holds many distinct calls (a sweep program calls one shape on
8-32 different weight copies, more bytes than the 50 MB L2, in passes with different x until
about 1 GB is read; a chain touches every layer's weights once), and the program is enqueued ``REPEATS`` times back to back before one
wait, so host dispatch overlaps the device work; time per program is the median of 3
such batches. TB/s are the bytes each method must read (weights at their stored width,
scales, activations in and out) per second: the fp8 kernel and W8A16/W8A8 are counted on
fp8 bytes, bf16 on bf16 bytes, so the TB/s of different methods compare their speed at
their own minimum traffic, and the ratio to the ceiling says how close each is to its floor.

    python3 benchmarks/fp8_matmul.py --out DIR [--layers 16] [--ms 1,2,4,8,16,32,64] [--budget-s 300]
    python3 benchmarks/fp8_matmul.py --out DIR --shape tiny      # CPU smoke run (interpret mode)

Writes DIR/fp8_matmul.{json,md,log} (and fp8_matmul.partial.json as it goes); prints the summary
tables and the best sizes per shape and M last. JSON: ``hbm_read_tbs``; ``correctness`` (rel
errors per form and weight format); ``w8a8_hlo`` (whether XLA's W8A8 compiled to cuBLASLt FP8);
``sweep`` (one row per shape, M and method: ``us``, ``tbs``, ``of_ceiling``,
``rel_error_vs_fp8_reference``, ``sizes`` for ours, or ``error``); ``chains`` (one row per M and
method: ``ms``, ``tbs``, ``of_ceiling``, ``calls_per_layer``, ``sizes``); ``best_sizes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from common import SHAPES, Log, header, write_results  # noqa: E402

from pallas_kernels.quantized_matmul import (  # noqa: E402
    default_block_sizes,
    fp8_weight_only_matmul,
    int8_weight_only_matmul,
    quantize_per_channel,
    weight_only_matmul_reference,
)
from pallas_kernels.quantized_matmul.block_sizes import MAX_FMA_ROWS, MatmulBlockSizes, num_k_splits  # noqa: E402
from pallas_kernels.quantized_matmul.validation import check_block_sizes  # noqa: E402

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
REPEATS = 8  # programs enqueued back to back per timed batch
SWEEP_SHARE = 0.5  # of --budget-s: after it the sweep stops starting candidates; the chains follow


def layer_shapes(shape_name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection, weights stored [out, in]."""
    cfg = SHAPES[shape_name]
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {"q": (q_out, hidden), "k": (kv_out, hidden), "v": (kv_out, hidden), "o": (hidden, q_out),
            "gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}


# The sweep times one representative of each distinct shape on the weights of all projections of that shape.
SWEEP_SHAPES = {"gate": ("gate", "up"), "down": ("down",), "q": ("q", "o"), "k": ("k", "v")}


# ---------------------------------------------------------------------------------------------------------------
# implementations: each maps (x [M, K] bf16, weight) -> [M, N] bf16, weight being what that method stores


def xla_bf16(x, w):  # w: [N, K] bf16
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(BF16)


def xla_w8a16(x, wq):  # wq: (w [N, K] fp8, scale [N])
    w, scale = wq
    out = lax.dot_general(x, w.astype(BF16), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale[None, :]).astype(BF16)


def xla_w8a8(x, wq):
    """Per-token fp8 activations, an fp8 x fp8 dot contracting both minor dims, scales after it.

    M is padded to a multiple of 16, as cuBLASLt's FP8 GEMM wants (the weight layer's W8A8 path does the same).
    """
    w, scale = wq
    m = x.shape[0]
    x32 = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=1), 1e-12) / 448.0  # [M]
    xq = (x32 / x_scale[:, None]).astype(FP8)
    xq = jnp.pad(xq, ((0, -m % 16), (0, 0)))
    out = lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)[:m]
    return (out * x_scale[:, None] * scale[None, :]).astype(BF16)


def ours(sizes: MatmulBlockSizes | None, interpret: bool, weight_dtype=FP8):
    fn = fp8_weight_only_matmul if weight_dtype == FP8 else int8_weight_only_matmul
    options = {} if sizes is None else dataclasses.asdict(sizes)

    def apply(x, wq):
        return fn(x, wq[0], wq[1], interpret=interpret, **options)
    return apply


def bytes_read(m: int, n: int, k: int, method: str) -> int:
    """The least bytes a method must move: weights at their stored width (+ scales), x in and out."""
    weight = n * k * 2 if method == "bf16" else n * k + 4 * n
    return weight + m * k * 2 + m * n * 2


# ---------------------------------------------------------------------------------------------------------------
# timing


def set_repeats(repeats: int):
    """``--repeats``: programs per timed batch, here and in the scripts that time with ``time_program``."""
    global REPEATS
    if repeats < 1:
        raise SystemExit(f"--repeats: {repeats} must be at least 1")
    REPEATS = repeats


def time_program(fn, *args):
    """``(seconds per call, first outputs)`` of the jitted ``fn(*args)``: REPEATS calls enqueued, one wait; median of 3 batches."""
    first = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(REPEATS)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / REPEATS)
    return float(np.median(times)), first


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def measure_read_ceiling(log: Log, gib: float) -> float:
    n = int(gib * 2**30 / 2)
    x = jax.jit(lambda: jnp.ones((n,), BF16))()

    @jax.jit
    def reads(x):  # 4 dependent sums: each pass must read all of x again
        c = jnp.float32(0)
        for _ in range(4):
            c = c + jnp.sum(x + c.astype(BF16), dtype=jnp.float32) * 1e-30
        return c
    t = time_program(reads, x)[0] / 4
    del x
    tbs = n * 2 / t / 1e12
    log(f"ceiling: HBM read {tbs:.2f} TB/s (jnp.sum over {gib:g} GiB bf16)")
    return tbs


# ---------------------------------------------------------------------------------------------------------------
# weights


def make_weights(shapes: dict[str, tuple[int, int]], num_layers: int, seed: int = 0):
    """Per layer and projection: bf16 weights [N, K], and their fp8 and int8 quantizations (w, scale)."""
    layers = []
    key = jax.random.key(seed)

    @functools.partial(jax.jit, static_argnums=(1,))
    def draw(key, shape):
        n, k = shape
        # Per-row magnitudes spread over ~e^2, as real checkpoints' channels are, so scales matter.
        w = jax.random.normal(key, (n, k), jnp.float32) * (1.0 / np.sqrt(k))
        w = w * jnp.exp(0.5 * jax.random.normal(jax.random.fold_in(key, 1), (n, 1)))
        w_bf16 = w.astype(BF16)
        return w_bf16, quantize_per_channel(w_bf16, FP8), quantize_per_channel(w_bf16, jnp.int8)

    for layer in range(num_layers):
        entry = {}
        for name, shape in shapes.items():
            key, sub = jax.random.split(key)
            w_bf16, w_fp8, w_int8 = draw(sub, shape)
            entry[name] = {"bf16": w_bf16, "fp8": w_fp8, "int8": w_int8}
        layers.append(entry)
    jax.block_until_ready(layers)
    return layers


def activations(m: int, k: int, seed: int):
    return jax.random.normal(jax.random.key(1000 + seed), (m, k), jnp.float32).astype(BF16)


# ---------------------------------------------------------------------------------------------------------------
# sweep candidates


def sweep_candidates(m: int, n: int, k: int) -> list[MatmulBlockSizes]:
    """Tile sizes to try for one shape and M, most promising first (the default always first)."""
    def c(algorithm, block_n, block_k, num_warps=4, num_stages=4, split_factor=1, prefetch=False):
        block_k = min(block_k, k)
        splits = num_k_splits(n, k, block_n, block_k) if n % block_n == 0 else 1
        splits = max(1, splits * split_factor) if split_factor >= 1 else max(1, int(splits * split_factor))
        return MatmulBlockSizes(algorithm, block_n, block_k, splits, num_warps, num_stages, prefetch)

    if m <= 2:
        bk = 512 if m == 1 else 256
        raw = [c("fma", 16, bk, 4, 1, prefetch=True), c("mma", 32, 256), c("mma_swapped", 64, 256),
               c("fma", 16, bk, 4, 3), c("fma", 32, 256, 4, 3),
               c("fma", 16, 2 * bk, 8, 2), c("mma", 16, 512), c("mma", 64, 128, 4, 5), c("fma", 8, bk, 4, 4),
               c("mma_swapped", 128, 128), c("fma", 16, bk, 4, 5), c("mma", 32, 256, split_factor=2),
               c("mma", 32, 512, 8, 3), c("fma", 16, bk, 4, 3, split_factor=0.5), c("fma", 16, bk, 2, 4),
               c("fma", 32, bk, 8, 3)]
    elif m <= MAX_FMA_ROWS:
        raw = [c("mma", 32, 256), c("mma_swapped", 64, 256), c("fma", 8, 256, 4, 1, prefetch=True),
               c("mma", 32, 256, prefetch=True), c("fma", 8, 256, 4, 3), c("mma", 16, 512),
               c("mma", 64, 128, 4, 5), c("mma_swapped", 128, 128), c("mma", 32, 128, 4, 6),
               c("mma", 32, 512, 8, 3), c("mma", 32, 256, split_factor=2), c("fma", 16, 128, 4, 4),
               c("mma", 32, 256, 4, 3), c("mma_swapped", 64, 128, 4, 6)]
    else:
        raw = [c("mma", 32, 256), c("mma", 64, 128), c("mma_swapped", 64, 256), c("mma", 64, 128, prefetch=True),
               c("mma", 64, 256, 8, 3),
               c("mma_swapped", 128, 128, 8, 4), c("mma", 128, 128, 8, 3), c("mma", 16, 512),
               c("mma", 32, 128, 4, 6), c("mma", 64, 128, 4, 3, split_factor=2), c("mma_swapped", 128, 64, 4, 5),
               c("mma", 32, 256, 4, 3), c("mma", 64, 64, 4, 6)]
    return fitting_candidates(default_block_sizes(m, n, k), raw, m, n, k)


def fitting_candidates(first: MatmulBlockSizes, candidates, m: int, n: int, k: int) -> list[MatmulBlockSizes]:
    """``first``, then each of ``candidates`` that fits an ``[m, k] x [n, k]`` product, once each."""
    out = [first]
    for sizes in candidates:
        try:
            check_block_sizes(sizes, m, n, k)
        except ValueError:
            continue
        if sizes not in out:
            out.append(sizes)
    return out


def grid_candidates(m: int, n: int, k: int, seed: int = 0) -> list[MatmulBlockSizes]:
    """A wider, systematic set (``--sweep-set grid``): the default first, then a seeded shuffle of the grid.

    Shuffled so that a sweep cut short by its budget still samples every form and size evenly.
    fma tiles are kept to 8-128 accumulator registers per thread (M * block_n * block_k / threads).
    """
    grid = []
    if m <= MAX_FMA_ROWS:
        for block_n in (8, 16, 32):
            for block_k in (256, 512, 1024):
                for num_warps in (2, 4, 8):
                    registers = m * block_n * block_k / (32 * num_warps)
                    if not 8 <= registers <= 128:
                        continue
                    for prefetch in (False, True):
                        grid.append(("fma", block_n, block_k, num_warps, 1 if prefetch else 3, prefetch))
    for block_n in (16, 32, 64, 128):
        for block_k in (128, 256, 512):
            if block_n * block_k > 32768:  # fp8 bytes per stage
                continue
            for num_warps, num_stages in ((4, 3), (4, 5), (8, 4)):
                grid.append(("mma", block_n, block_k, num_warps, num_stages, False))
    for block_n in (64, 128):
        for block_k in (64, 128, 256):
            for num_warps in (4, 8):
                grid.append(("mma_swapped", block_n, block_k, num_warps, 4, False))
    order = np.random.default_rng(seed + 97 * m + n + k).permutation(len(grid))
    candidates = []
    for index in order:
        algorithm, block_n, block_k, num_warps, num_stages, prefetch = grid[index]
        block_k = min(block_k, k)
        if n % block_n == 0:
            candidates.append(MatmulBlockSizes(algorithm, block_n, block_k, num_k_splits(n, k, block_n, block_k),
                                               num_warps, num_stages, prefetch))
    return fitting_candidates(default_block_sizes(m, n, k), candidates, m, n, k)


def describe(sizes: MatmulBlockSizes) -> str:
    return (f"{sizes.algorithm} n{sizes.block_n} k{sizes.block_k} s{sizes.k_splits} "
            f"w{sizes.num_warps} st{sizes.num_stages}{' pf' if sizes.prefetch else ''}")


# ---------------------------------------------------------------------------------------------------------------
# stages


def check_correctness(log: Log, shapes, ms, interpret: bool) -> list[dict]:
    """Each kernel form vs the float32 reference on fresh random inputs (fp8 and int8), and XLA's W8A8 for context."""
    rows = []
    n, k = shapes["q"]
    kw, ks = jax.random.split(jax.random.key(7))
    w_real = jax.random.normal(kw, (n, k)) * jnp.exp(jax.random.normal(ks, (n, 1)))
    weights = {"fp8": quantize_per_channel(w_real, FP8), "int8": quantize_per_channel(w_real, jnp.int8)}
    # M=5: an odd count, padded in every form; the sweep checks each candidate at the swept Ms (fp8).
    for m in (5,):
        x = activations(m, k, seed=m)
        for fmt, wq in weights.items():
            ref = weight_only_matmul_reference(x.astype(jnp.float32), *wq)
            forms = {}
            for s in sweep_candidates(m, n, k):  # the first candidate of each multiply form
                forms.setdefault(s.algorithm, s)
            for sizes in forms.values():
                entry = {"m": m, "n": n, "k": k, "weights": fmt, "impl": "ours", "config": describe(sizes)}
                try:
                    out = jax.jit(ours(sizes, interpret, FP8 if fmt == "fp8" else jnp.int8))(x, wq)
                    entry["rel_error"] = rel_error(out, ref)
                except Exception as error:  # noqa: BLE001  (a failed compile is a result to report)
                    entry["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
                rows.append(entry)
                log(f"check M={m} {fmt} {entry['config']}: " + (f"rel err {entry['rel_error']:.2e}"
                    if "rel_error" in entry else entry["error"][:300]))
            if fmt == "fp8":
                out = jax.jit(xla_w8a8)(x, wq)
                rows.append({"m": m, "n": n, "k": k, "weights": fmt, "impl": "xla_w8a8 (fp8 activations)",
                             "rel_error": rel_error(out, ref)})
                log(f"check M={m} xla_w8a8: rel err {rows[-1]['rel_error']:.2e} (activation quantization)")
    return rows


def run_sweep(log: Log, layers, shapes, ms, interpret: bool, deadline: float, ceiling: float, rows: list,
              save, candidate_set: str = "curated", shape_keys=("gate", "down", "q", "k"),
              max_candidates: int | None = None) -> list[dict]:
    """Per shape and M: our defaults, XLA's three paths, then our other candidates in rounds until the deadline.

    ``max_candidates``: at most that many of our sizes per shape and M, the default first (the CPU
    smoke run compiles fewer programs; None: every candidate).

    Appends to ``rows`` as it goes and calls ``save()`` after each entry, so a crash keeps what was measured.
    """

    def copies(shape_key, fmt):
        return [layer[name][fmt] for layer in layers for name in SWEEP_SHAPES[shape_key]]

    def time_one(shape_key, m, method, apply, fmt, extra):
        n, k = shapes[shape_key]
        ws = copies(shape_key, fmt)
        # Enough calls per program to keep the device busier than the host's dispatch (~1 GB read per
        # program): small shapes make several passes over their copies, each with its own x, so no
        # call repeats another (XLA would merge two identical calls).
        passes = 1 if interpret else int(min(8, max(1, round(1e9 / (len(ws) * n * k)))))
        xs = [activations(m, k, seed=m + 1000 * p) for p in range(passes)]
        program = jax.jit(lambda xs, ws: [apply(x, w) for x in xs for w in ws])
        entry = {"shape": shape_key, "n": n, "k": k, "m": m, "method": method, "copies": len(ws), "passes": passes,
                 **extra}
        x = xs[0]
        try:
            t, outs = time_program(program, xs, ws)
            t /= len(ws) * passes
            ref = refs.get((shape_key, m))
            if ref is None:
                ref = refs[(shape_key, m)] = np.asarray(
                    weight_only_matmul_reference(x.astype(jnp.float32), *copies(shape_key, "fp8")[0]))
            entry["rel_error_vs_fp8_reference"] = rel_error(outs[0], ref)
            traffic = bytes_read(m, n, k, "bf16" if fmt == "bf16" else "fp8")
            entry.update(us=t * 1e6, tbs=traffic / t / 1e12, of_ceiling=traffic / t / 1e12 / ceiling)
            log(f"sweep {shape_key:4s} {n}x{k} M={m:2d} {method:40s} {t * 1e6:8.1f} us {entry['tbs']:5.2f} TB/s "
                f"({entry['of_ceiling']:.0%}) err {entry['rel_error_vs_fp8_reference']:.1e}")
        except Exception as error:  # noqa: BLE001
            entry["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
            log(f"sweep {shape_key} M={m} {method}: FAILED {entry['error'][:300]}")
        rows.append(entry)
        save()

    refs = {}
    order = list(shape_keys)
    make = grid_candidates if candidate_set == "grid" else sweep_candidates
    candidates = {(s, m): make(m, *shapes[s])[:max_candidates] for s in order for m in ms}
    max_rounds = max(len(v) for v in candidates.values())
    skipped = 0
    for round_index in range(max_rounds):
        if round_index == 1:
            # After our defaults, XLA's paths on the two large shapes (75% of a layer's bytes), as the bar to beat;
            # the chains compare all shapes together.
            for shape_key in [s for s in order if s in ("gate", "down")]:
                for m in ms:
                    if time.perf_counter() > deadline:
                        break
                    time_one(shape_key, m, "xla_bf16", xla_bf16, "bf16", {})
                    time_one(shape_key, m, "xla_w8a16", xla_w8a16, "fp8", {})
                    time_one(shape_key, m, "xla_w8a8", xla_w8a8, "fp8", {})
        # The small projections (q/o, k/v) get the first three candidates only: 20% of the bytes.
        for shape_key in order if round_index < 3 else [s for s in order if s in ("gate", "down")]:
            for m in ms:
                cands = candidates[(shape_key, m)]
                if round_index >= len(cands):
                    continue
                if time.perf_counter() > deadline:
                    skipped += 1
                    continue
                sizes = cands[round_index]
                time_one(shape_key, m, "ours " + describe(sizes), ours(sizes, interpret), "fp8",
                         {"sizes": dataclasses.asdict(sizes), "round": round_index})
    if skipped:
        log(f"sweep: {skipped} candidates not tried (budget spent)")
    rows.append({"skipped_candidates": skipped})


def best_sizes(sweep_rows, shape_key, m) -> MatmulBlockSizes | None:
    """The fastest correct candidate of the sweep for this shape at M, or at the nearest swept M above.

    Sizes valid at some M are valid at any smaller M (fewer padded rows; fma's limit is on M),
    so a chain at an M the sweep did not reach borrows the next larger M's best.
    """
    swept = sorted({r["m"] for r in sweep_rows if r.get("shape") == shape_key and "sizes" in r and "us" in r})
    above = [v for v in swept if v >= m]
    if not above:
        return None
    ok = [r for r in sweep_rows if r.get("shape") == shape_key and r.get("m") == above[0] and "sizes" in r
          and "us" in r and r.get("rel_error_vs_fp8_reference", 1.0) < 2e-2]
    if not ok:
        return None
    return MatmulBlockSizes(**min(ok, key=lambda r: r["us"])["sizes"])


def fuse_projections(layer: dict) -> dict:
    """A layer's q/k/v and gate/up weights concatenated along N (one call each), for every storage format."""
    fused = {}
    for fused_name, names in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
        fused[fused_name] = {"bf16": jnp.concatenate([layer[n]["bf16"] for n in names])}
        for fmt in ("fp8", "int8"):
            fused[fused_name][fmt] = tuple(jnp.concatenate([layer[n][fmt][i] for n in names]) for i in range(2))
    return fused


def run_chains(log: Log, layers, shapes, ms, sweep_rows, interpret: bool, ceiling: float, deadline: float,
               rows: list, save):
    """Every layer's projections end to end, per implementation and M (appended to ``rows``, saved as it goes).

    Tiers, each over all M before the next, so a budget cut leaves every M its headline numbers:
    1. XLA bf16 / W8A16 / W8A8 and ours at the sweep's best sizes (the defaults where the sweep
       found nothing better), seven calls per layer;
    2. ours at the defaults (when the best differ), and "fused": q/k/v as one call and gate/up as
       one call (4 calls per layer, what a weight layer with fused projections would do), ours
       and XLA bf16;
    3. ours with int8 weights at the best sizes.
    """
    num_layers = len(layers)
    hidden = shapes["q"][1]
    q_out, kv_out = shapes["q"][0], shapes["k"][0]
    ffn = shapes["gate"][0]
    fused_layers = None

    def chain_fn(linear_for, fused: bool):
        def run(x, weights):
            h = x
            kvs = []
            for layer in weights:
                if fused:
                    qkv = linear_for("qkv")(h, layer["qkv"])
                    q = qkv[:, :q_out]
                    kvs.append(qkv[:, q_out:])
                else:
                    q = linear_for("q")(h, layer["q"])
                    kvs += [linear_for("k")(h, layer["k"]), linear_for("v")(h, layer["v"])]
                o = linear_for("o")(q, layer["o"])
                if fused:
                    gu = linear_for("gate_up")(o, layer["gate_up"])
                    g, u = gu[:, :ffn], gu[:, ffn:]
                else:
                    g, u = linear_for("gate")(o, layer["gate"]), linear_for("up")(o, layer["up"])
                h = h + linear_for("down")((jax.nn.silu(g.astype(jnp.float32)) * u).astype(BF16), layer["down"])
            return h, kvs
        return jax.jit(run)

    # projection -> the sweep shape whose sizes it uses (a fused projection takes its first part's: N grows, K same)
    shape_of = {name: key for key, names in SWEEP_SHAPES.items() for name in names} | {"qkv": "q", "gate_up": "gate"}
    assert kv_out % 16 == 0
    plans = []  # (tier, m, method, fmt, fused, sizes or None)
    for m in ms:
        defaults = {s: default_block_sizes(m, *shapes[names[0]]) for s, names in SWEEP_SHAPES.items()}
        # Shapes the sweep did not reach keep their defaults.
        best = {s: best_sizes(sweep_rows, s, m) or defaults[s] for s in SWEEP_SHAPES}
        plans += [(1, m, "xla_bf16", "bf16", False, None), (1, m, "xla_w8a16", "fp8", False, None),
                  (1, m, "xla_w8a8", "fp8", False, None), (1, m, "ours best", "fp8", False, best)]
        if best != defaults:
            plans.append((2, m, "ours default", "fp8", False, defaults))
        plans += [(2, m, "ours best fused", "fp8", True, best), (2, m, "xla_bf16 fused", "bf16", True, None),
                  (3, m, "ours int8 best", "int8", False, best)]
    plans.sort(key=lambda plan: plan[0])
    for tier, m, method, fmt, fused, sizes in plans:
        if time.perf_counter() > deadline:
            log(f"chain M={m} {method}: skipped (budget spent)")
            rows.append({"m": m, "method": method, "skipped": True})
            continue
        if fused and fused_layers is None:
            fused_layers = [fuse_projections(layer) for layer in layers]
        names = ("qkv", "o", "gate_up", "down") if fused else tuple(shapes)
        source = [layer | extra for layer, extra in zip(layers, fused_layers)] if fused else layers
        weights = [{name: layer[name][fmt] for name in names} for layer in source]
        if method.startswith("xla_bf16"):
            linear_for = lambda name: xla_bf16  # noqa: E731
        elif method == "xla_w8a16":
            linear_for = lambda name: xla_w8a16  # noqa: E731
        elif method == "xla_w8a8":
            linear_for = lambda name: xla_w8a8  # noqa: E731
        else:
            weight_dtype = jnp.int8 if fmt == "int8" else FP8
            linear_for = lambda name, sizes=sizes, dt=weight_dtype: ours(sizes[shape_of[name]], interpret, dt)  # noqa: E731
        entry = {"m": m, "method": method, "tier": tier, "layers": num_layers, "calls_per_layer": len(names),
                 "sizes": {s: dataclasses.asdict(b) for s, b in sizes.items()} if sizes else None}
        # int8 weights are as many bytes as fp8; fusing changes no byte
        bytes_ = sum(bytes_read(m, *shapes[name], "bf16" if fmt == "bf16" else "fp8") for name in shapes) * num_layers
        x = activations(m, hidden, seed=m)
        try:
            t = time_program(chain_fn(linear_for, fused), x, weights)[0]
            entry.update(ms=t * 1e3, tbs=bytes_ / t / 1e12, of_ceiling=bytes_ / t / 1e12 / ceiling, bytes=bytes_)
            log(f"chain M={m:2d} {method:16s} {t * 1e3:7.3f} ms {entry['tbs']:5.2f} TB/s ({entry['of_ceiling']:.0%})")
        except Exception as error:  # noqa: BLE001
            entry["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
            log(f"chain M={m} {method}: FAILED {entry['error'][:300]}")
        rows.append(entry)
        save()


def w8a8_uses_fp8_gemm(shapes) -> dict:
    """Whether XLA compiled the W8A8 dot to an FP8 GEMM (cuBLASLt) and left the weight untransposed."""
    n, k = shapes["gate"]
    x = jax.ShapeDtypeStruct((1, k), BF16)
    wq = (jax.ShapeDtypeStruct((n, k), FP8), jax.ShapeDtypeStruct((n,), jnp.float32))
    text = jax.jit(xla_w8a8).lower(x, wq).compile().as_text()
    return {"cublas_fp8_gemm": "f8e4m3fn" in text and "cublas" in text.lower(),
            "transpose_in_hlo": " transpose(" in text}


def markdown_summary(info, ceiling, sweep_rows, chain_rows, ms, shapes) -> tuple[str, list[str]]:
    lines = [f"# fp8 weight-only matmul ({info['device']}, jax {info['jax']}, {info['date']})", "",
             f"HBM read ceiling this run: **{ceiling:.2f} TB/s**", "",
             "## Chains (all layers' q/k/v/o/gate/up/down, ms per chain; TB/s on each method's own bytes; "
             "fused: q/k/v and gate/up as one call each)", "",
             "| M | xla bf16 | xla W8A16 | xla W8A8 | ours default | ours best | ours best TB/s (of ceiling) | int8 best "
             "| fused: xla bf16 | fused: ours best |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in ms:
        got = {r["method"]: r for r in chain_rows if r["m"] == m}
        cell = lambda name: f"{got[name]['ms']:.3f}" if name in got and "ms" in got[name] else "-"  # noqa: E731
        best = got.get("ours best", {})
        tbs = f"{best['tbs']:.2f} ({best['of_ceiling']:.0%})" if "tbs" in best else "-"
        default_cell = cell("ours default") if "ours default" in got else "= best"
        lines.append(f"| {m} | {cell('xla_bf16')} | {cell('xla_w8a16')} | {cell('xla_w8a8')} | "
                     f"{default_cell} | {cell('ours best')} | {tbs} | {cell('ours int8 best')} | "
                     f"{cell('xla_bf16 fused')} | {cell('ours best fused')} |")
    # Batch-1 decode goal (issue 18): <= 2.4 ms per token, Llama-3.1-8B: 32 layers + a bf16 lm_head (1.05 GB).
    got = {r["method"]: r for r in chain_rows if r["m"] == ms[0] and "ms" in r}
    num_layers = next((r["layers"] for r in chain_rows if "layers" in r), None)
    if num_layers and got and shapes["q"] == (4096, 4096):  # Llama-3.1-8B's shapes
        lm_head_ms = 128256 * 4096 * 2 / (ceiling * 1e12) * 1e3
        per_token = {name: r["ms"] * 32 / num_layers for name, r in got.items()}
        lines += ["", f"M={ms[0]}, scaled to Llama-3.1-8B's 32 layers (x 32 / {num_layers}), plus the bf16 lm_head "
                  f"at the read ceiling ({lm_head_ms:.3f} ms): "
                  + ", ".join(f"{name} {v + lm_head_ms:.2f} ms" for name, v in sorted(per_token.items(), key=lambda kv: kv[1]))
                  + " (goal: <= 2.4 ms per token)"]
    lines += ["", "## Per shape: fastest of each kind (µs per call, TB/s)", "",
              "| shape (N x K) | M | xla bf16 | xla W8A16 | xla W8A8 | ours default | ours best | best config |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape_key in SWEEP_SHAPES:
        n, k = shapes[shape_key]
        for m in ms:
            rows = [r for r in sweep_rows if r.get("shape") == shape_key and r.get("m") == m and "us" in r]
            if not rows:
                continue
            by = {r["method"]: r for r in rows}
            fmt = lambda r: f"{r['us']:.1f} / {r['tbs']:.2f}" if r else "-"  # noqa: E731
            default = next((r for r in rows if r.get("round") == 0), None)
            mine = [r for r in rows if "sizes" in r and r.get("rel_error_vs_fp8_reference", 1) < 2e-2]
            best = min(mine, key=lambda r: r["us"]) if mine else None
            lines.append(f"| {shape_key} ({n} x {k}) | {m} | {fmt(by.get('xla_bf16'))} | {fmt(by.get('xla_w8a16'))} | "
                         f"{fmt(by.get('xla_w8a8'))} | {fmt(default)} | {fmt(best)} | "
                         f"{best['method'][5:] if best else '-'} |")
    return "\n".join(lines) + "\n", lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ms", default="1,2,4,8,16,32,64")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="wall seconds for the whole run; the sweep stops starting work at 50%% of it, "
                             "the chains at 100%% (a compile under way finishes)")
    parser.add_argument("--ceiling-gib", type=float, default=4.0)
    parser.add_argument("--sweep-set", default="curated", choices=["curated", "grid"],
                        help="curated: a short list per M class, most promising first; grid: a shuffled grid")
    parser.add_argument("--sweep-ms", default=None, help="Ms to sweep (default: --ms); chains borrow the next swept M")
    parser.add_argument("--sweep-shapes", default="gate,down,q,k")
    parser.add_argument("--sweep-share", type=float, default=SWEEP_SHARE,
                        help="share of --budget-s after which the sweep starts nothing new")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"programs enqueued back to back per timed batch (default {REPEATS}, the GPU runs'); "
                             "the CPU smoke test passes 1, since interpreted programs take long and time nothing")
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="our sizes swept per shape and M, the default first (default: every candidate, the "
                             "GPU runs'); the CPU smoke test passes 3")
    args = parser.parse_args()
    set_repeats(args.repeats)
    if args.max_candidates is not None and args.max_candidates < 1:
        raise SystemExit(f"--max-candidates: {args.max_candidates} must be at least 1")
    start = time.perf_counter()
    log = Log()
    info = header(log)
    interpret = jax.default_backend() == "cpu"
    if interpret:
        log("CPU: kernels run in Pallas interpret mode; the numbers mean nothing (smoke run)")
    ms = [int(v) for v in args.ms.split(",")]
    shapes = layer_shapes(args.shape)
    ceiling = measure_read_ceiling(log, args.ceiling_gib if not interpret else 0.01)
    layers = make_weights(shapes, args.layers)
    log(f"weights: {args.layers} layers of {', '.join(f'{k} {n}x{kk}' for k, (n, kk) in shapes.items())} "
        f"({time.perf_counter() - start:.0f} s so far)")
    results = {"info": info, "args": vars(args) | {"out": str(args.out)}, "hbm_read_tbs": ceiling}
    results["correctness"] = check_correctness(log, shapes, ms, interpret)
    log(f"checks done ({time.perf_counter() - start:.0f} s so far)")
    try:
        results["w8a8_hlo"] = w8a8_uses_fp8_gemm(shapes) if not interpret else None
        log(f"xla W8A8 compiled: {results['w8a8_hlo']}")
    except Exception as error:  # noqa: BLE001
        results["w8a8_hlo"] = {"error": str(error)[:500]}
    partial_path = args.out / "fp8_matmul.partial.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # everything so far, in case a compiler crash ends the process
        partial_path.write_text(json.dumps(results, indent=1, default=str))

    save()
    sweep_deadline = start + args.sweep_share * args.budget_s
    results["sweep"], results["chains"] = [], []
    sweep_ms = [int(v) for v in args.sweep_ms.split(",")] if args.sweep_ms else ms
    run_sweep(log, layers, shapes, sweep_ms, interpret, sweep_deadline, ceiling, results["sweep"], save,
              candidate_set=args.sweep_set, shape_keys=args.sweep_shapes.split(","),
              max_candidates=args.max_candidates)
    run_chains(log, layers, shapes, ms, results["sweep"], interpret, ceiling, start + args.budget_s,
               results["chains"], save)
    results["best_sizes"] = {s: {m: (dataclasses.asdict(b) if (b := best_sizes(results["sweep"], s, m)) else None)
                                 for m in ms} for s in SWEEP_SHAPES}
    markdown, lines = markdown_summary(info, ceiling, results["sweep"], results["chains"], ms, shapes)
    results["wall_s"] = time.perf_counter() - start
    for line in lines:
        log(line)
    log("best sizes per shape and M (MatmulBlockSizes fields), for block_sizes.default_block_sizes:")
    for shape_key, by_m in results["best_sizes"].items():
        log(f"  {shape_key} {shapes[shape_key]}: " + "; ".join(
            f"M={m}: {describe(MatmulBlockSizes(**b)) if b else '-'}" for m, b in by_m.items()))
    log(f"wall: {results['wall_s']:.0f} s")
    write_results(args.out, "fp8_matmul", results, markdown, log)


if __name__ == "__main__":
    main()

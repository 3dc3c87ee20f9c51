"""Decode-sized weight GEMV on one GPU: our Pallas kernel (fp8 and bf16 weights) against XLA, in a fixed wall budget.

A focused run (the weight-only kernel's GPU runs, see docs/KERNELS.md): every projection shape of
Llama-3.1-8B (``[out, in]``): gate/up ``14336 x 4096``, down ``4096 x 14336``, q/o ``4096 x 4096``
and k/v ``1024 x 4096``, at M in {1, 2, 4, 8, 16} tokens, with fp8 weights (per-channel scales; XLA's peer: W8A16, convert
then dot), with bf16 weights stored ``[out, in]`` (no scale; XLA's peer: its bf16 dot) and with
bf16 weights in the dense ``[in, out]`` layout the model keeps them in ("bf16kn": the kernel's
``layout="kn"``; XLA's peer: the model's own einsum, what the weight layer runs today):

* ceiling: the HBM read rate of a jitted ``jnp.sum`` over ``--ceiling-gib`` of bf16, this run;
* exactness: each fp8 form the sweep tries (algorithm, ``convert``, ``dot_dtype``), compiled on
  this GPU, multiplies every e4m3 code by one (``pallas_kernels.quantized_matmul.exactness``): a
  form that does not reproduce every code (e.g. a compiler flushing the f32 denormals that
  ``convert="bits"`` makes of e4m3 subnormals) stays out of the table;
* sweep: per shape, M and weight format, XLA's peer, our defaults, then our candidate sizes
  (the gemv / gemv_f16 / mma_swapped / mma forms, fp8 with the hardware conversion and with
  ``convert="bits"``) in rounds, most promising first.
  Every program is compiled ahead of time on a thread pool (compiles are most of the wall time
  and the host has cores to spare), until ``--sweep-share`` of the budget; then the compiled
  ones are timed one after another, so no compile's autotuning runs beside a timing. Each
  output is checked against the float32 reference (relative error; > 2e-2 disqualifies);
* table: per shape, M and format, our fastest correct sizes, our time and XLA's, written as
  ``gpu_gemv_table.json`` (the format ``pallas_kernels/quantized_matmul/tuning_table.py``
  reads; copy it there to make those sizes the defaults and ``prefer_pallas`` answer: the
  weight layer, ``jaxinfer.decode_gemv``, then runs ours for fp8 weight-only and dense bf16
  projections at the (M, N, K) where it won). Entries of ``--keep-table`` (the committed table)
  this run did not measure are carried over, marked ``"kept_from"`` with that table's date, so
  a run cut by its budget never drops a shape from the table;
* chains: ``--layers`` layers of q, k, v, o, gate, up, down (silu(gate) * up into down, a
  residual add) per M: XLA bf16 (both layouts), XLA W8A16, ours per format (gate/up/down at the
  table's sizes, q/k/v/o at the heuristics), then "dispatch" chains that use ours only where
  ``prefer_pallas`` says so (what the weight layer would do), until the budget is spent.

Timing as in ``fp8_matmul.py``: a timed program holds many distinct calls (a sweep program calls
one shape on every layer's copy of it, more bytes than the 50 MB L2; a chain touches every
layer's weights once), enqueued 8 times back to back (``--repeats``) before one wait, median of 3 such batches.
TB/s count each method's own minimum bytes (fp8: 1 byte a weight + scales; bf16: 2).

    python3 benchmarks/gemv_decode.py --out DIR [--budget-s 280] [--ms 1,8,4,16,2] [--layers 16]
    python3 benchmarks/gemv_decode.py --out DIR --shape tiny --layers 1 --ms 1,4 \
        --repeats 1 --max-candidates 4   # CPU smoke (interpret)

Writes DIR/gemv_decode.{json,md,log}, DIR/gpu_gemv_table.json (right after the sweep) and
DIR/gemv_decode.partial.json as it goes. JSON: ``hbm_read_tbs``; ``sweep`` (per shape, M,
weights and method: ``us``, ``tbs``, ``of_ceiling``, ``rel_error``, ``sizes`` for ours, or
``error``; ``compile_s``); ``exactness`` (per fp8 form: ``inexact_codes``, or ``error``);
``table`` (the table's entries); ``chains`` (per M and method:
``ms``, ``tbs``, ``of_ceiling``); ``not_compiled`` (jobs the budget cut).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

from common import Log, header, write_results  # noqa: E402
from fp8_matmul import (  # noqa: E402
    REPEATS, fitting_candidates, layer_shapes, measure_read_ceiling, rel_error, set_repeats, time_program, xla_bf16,
    xla_w8a16,
)

from pallas_kernels.quantized_matmul import (  # noqa: E402
    bf16_weight_only_matmul,
    fp8_weight_only_matmul,
    prefer_pallas,
    quantize_per_channel,
)
from pallas_kernels.quantized_matmul.block_sizes import (  # noqa: E402
    MatmulBlockSizes,
    default_block_sizes,
    num_k_splits,
)
from pallas_kernels.quantized_matmul.exactness import every_code_case, inexact_codes  # noqa: E402
from pallas_kernels.quantized_matmul.tuning_table import GPU_TABLE_PATH  # noqa: E402

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
# "bf16kn": bf16 weights stored [K, N], as the model's dense weights are (einsum "te,ef->tf"),
# through the kernel's layout="kn"; its XLA peer is that einsum.
FORMATS = {"fp8": FP8, "bf16": BF16, "bf16kn": BF16}
LAYOUT = {"fp8": "nk", "bf16": "nk", "bf16kn": "kn"}
XLA_PEER = {"fp8": "xla_w8a16", "bf16": "xla_bf16", "bf16kn": "xla_bf16_kn"}  # what the weight layer runs without ours
# One representative timed on all of these weights: every distinct projection shape of the model.
SWEEP_SHAPES = {"gate": ("gate", "up"), "down": ("down",), "q": ("q", "o"), "k": ("k", "v")}
MAX_REL_ERROR = 2e-2


def xla_bf16_kn(x, w):  # w: [K, N] bf16, the dense layout: what linear()'s einsum runs
    return jnp.einsum("te,ef->tf", x, w)


def xla_peer(fmt: str):
    return {"fp8": xla_w8a16, "bf16": xla_bf16, "bf16kn": xla_bf16_kn}[fmt]


def ours(fmt: str, sizes: MatmulBlockSizes | None, interpret: bool):
    """(x, weight) -> out with our kernel; weight is (w, scale) for fp8, w for bf16. ``sizes`` None: defaults."""
    options = {} if sizes is None else dataclasses.asdict(sizes)
    if fmt == "fp8":
        return lambda x, wq: fp8_weight_only_matmul(x, wq[0], wq[1], interpret=interpret, **options)
    return lambda x, w: bf16_weight_only_matmul(x, w, interpret=interpret, layout=LAYOUT[fmt], **options)


def weight_bytes(n: int, k: int, fmt: str) -> int:
    return n * k + 4 * n if fmt == "fp8" else n * k * 2


def traffic(m: int, n: int, k: int, fmt: str) -> int:
    """The least bytes a call must move: weights at their stored width (+ scales), x in and out."""
    return weight_bytes(n, k, fmt) + m * k * 2 + m * n * 2


def describe(sizes: MatmulBlockSizes) -> str:
    return (f"{sizes.algorithm} n{sizes.block_n} k{sizes.block_k} s{sizes.k_splits} "
            f"w{sizes.num_warps} st{sizes.num_stages}{f' pf{int(sizes.prefetch)}' if sizes.prefetch else ''}"
            f"{' f16' if sizes.dot_dtype == 'float16' else ''}{' ' + sizes.convert if sizes.convert != 'cvt' else ''}")


def form_of(sizes: MatmulBlockSizes) -> str:
    """What decides a form's arithmetic (not its tiles): the exactness probe's key."""
    return f"{sizes.algorithm} {sizes.convert}{' f16' if sizes.dot_dtype == 'float16' else ''}"


def make_weights(shapes: dict[str, tuple[int, int]], num_layers: int, seed: int = 0) -> list[dict]:
    """Per layer and projection: bf16 weights [N, K] and their fp8 quantization (w, scale)."""
    @functools.partial(jax.jit, static_argnums=(1,))
    def draw(key, shape):
        n, k = shape
        # Per-row magnitudes spread over ~e^2, as real checkpoints' channels are, so scales matter.
        w = jax.random.normal(key, (n, k), jnp.float32) * (1.0 / np.sqrt(k))
        w = (w * jnp.exp(0.5 * jax.random.normal(jax.random.fold_in(key, 1), (n, 1)))).astype(BF16)
        return w, quantize_per_channel(w, FP8)

    transpose = jax.jit(lambda w: w.T)  # a real [K, N] copy, contiguous along N
    layers, key = [], jax.random.key(seed)
    for _ in range(num_layers):
        entry = {}
        for name, shape in shapes.items():
            key, sub = jax.random.split(key)
            w_bf16, w_fp8 = draw(sub, shape)
            entry[name] = {"bf16": w_bf16, "fp8": w_fp8, "bf16kn": transpose(w_bf16)}
        layers.append(entry)
    return jax.block_until_ready(layers)


def activations(m: int, k: int, seed: int):
    return jax.random.normal(jax.random.key(1000 + seed), (m, k), jnp.float32).astype(BF16)


def reference(x, weight, fmt: str):
    """float32 x @ dequantized w^T at full precision: the bar for every method's output."""
    if fmt == "fp8":
        w, scale = weight
        w32 = w.astype(jnp.float32) * scale[:, None]
    elif fmt == "bf16kn":
        w32 = weight.astype(jnp.float32).T
    else:
        w32 = weight.astype(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w32.T, precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------------------------------------------------------
# candidates


def candidates(m: int, n: int, k: int, fmt: str) -> list[MatmulBlockSizes]:
    """Our sizes to try for one shape, M and format, most promising first; the defaults (heuristics) lead.

    Tiles are named by their weight bytes (16 KB = block_n * block_k * itemsize), so fp8 and
    bf16 get tiles of equal bytes in flight; K splits follow from the tile (``num_k_splits``:
    enough programs for the SMs), times ``split_factor``. Session 10's fp8 forms come first (the
    sweep goes in rounds, so early candidates are timed even when the budget runs out): the
    conversion by integer ops (``convert="bits"``, and ``"bits_ptx"``: the same as packed inline
    PTX) in the f32 ``gemv``, in ``gemv_f16`` (f16 products over 8-element spans) and in the f16
    tensor-core dots, each on the tiles that won with the hardware conversion; then those
    winners themselves (runs 2-3). Smaller tiles (8 KB)
    come along for q/o and k/v, whose N of 4096 / 1024 gives fewer programs. The bf16 lists
    keep runs 2-3's winners and their neighbours only (the budget is fp8's this time).
    """
    itemsize = 1 if fmt == "fp8" else 2

    def c(algorithm, block_n, tile_kb, num_warps=4, num_stages=4, prefetch=0, block_k=None, split_factor=1,
          dot_dtype=None, convert="cvt"):
        block_k = block_k or tile_kb * 1024 // (block_n * itemsize)
        block_k = min(block_k, k)
        splits = num_k_splits(n, k, block_n, block_k) * split_factor if n % block_n == 0 else 1
        return MatmulBlockSizes(algorithm, block_n, block_k, splits, num_warps, num_stages, int(prefetch), dot_dtype,
                                convert)

    raw = []
    if fmt == "bf16kn":
        if m <= 4:
            raw += [c("gemv", 128, 16, 4, 1, 1), c("mma", 128, 16, 4, 4), c("gemv", 64, 16, 4, 1, 1),
                    c("gemv", 128, 32, 8, 1, 1), c("gemv", 128, 16, 4, 1, 1, split_factor=2)]
        else:
            raw += [c("mma", 128, 16, 4, 4), c("mma", 64, 16, 4, 4), c("mma_swapped", 64, 16, 4, 4),
                    c("mma", 128, 32, 8, 3), c("mma", 128, 16, 4, 4, split_factor=2)]
        return fitting_candidates(default_block_sizes(m, n, k, BF16, table=(), layout="kn"), raw, m, n, k)
    if fmt == "bf16":
        # Runs 2-3: mma_swapped n64 k128 won every bf16 [out, in] row.
        raw += [c("mma_swapped", 64, 16, 4, 4), c("mma_swapped", 64, 16, 4, 4, split_factor=2),
                c("mma_swapped", 128, 16, 8, 4), c("mma_swapped", 64, 8, 4, 5)]
        if m <= 4:
            raw += [c("gemv", 16, 32, 8, 1, 1), c("gemv", 32, 32, 8, 1, 1)]
        return fitting_candidates(default_block_sizes(m, n, k, BF16, table=()), raw, m, n, k)
    bits, ptx = dict(convert="bits"), dict(convert="bits_ptx")
    if m <= 4:
        raw += [c("gemv_f16", 16, 16, 4, 1, 1, **bits), c("gemv", 16, 16, 4, 1, 1, split_factor=4, **bits),
                c("gemv_f16", 16, 16, 4, 1, 1, **ptx),
                c("gemv", 16, 16, 4, 3, **bits), c("gemv_f16", 16, 16, 4, 1, 1, split_factor=4, **bits),
                c("gemv_f16", 32, 16, 8, 1, 1, **bits), c("gemv_f16", 16, 8, 4, 1, 2, **bits),
                c("gemv", 32, 32, 8, 1, 2, **bits), c("gemv_f16", 16, 32, 8, 1, 1, **bits),
                c("mma_swapped", 64, 16, 4, 4, dot_dtype="float16", **bits),
                c("gemv_f16", 32, 16, 8, 1, 1, **ptx), c("gemv_f16", 16, 32, 8, 1, 1, **ptx),
                c("gemv_f16", 16, 8, 4, 1, 1, split_factor=2, **bits), c("gemv_f16", 64, 16, 8, 1, 1, **bits),
                c("gemv", 32, 16, 8, 1, 1, **bits),
                # runs 2-3's winners, with the hardware conversion
                c("gemv", 16, 16, 4, 1, 1, split_factor=4), c("gemv", 16, 16, 4, 3), c("gemv", 16, 16, 4, 1, 2),
                c("gemv", 16, 8, 4, 1, 1), c("gemv", 32, 32, 8, 1, 1)]
    else:
        raw += [c("mma", 64, 0, 4, 4, block_k=256, dot_dtype="float16", **bits),
                c("mma_swapped", 128, 32, 8, 3, dot_dtype="float16", **bits),
                c("mma", 64, 0, 4, 4, block_k=256, dot_dtype="float16", **ptx),
                c("gemv_f16", 16, 16, 4, 1, 1, **ptx),
                c("mma", 32, 0, 4, 4, block_k=256, dot_dtype="float16", **bits),
                c("gemv_f16", 16, 16, 4, 1, 1, **bits), c("gemv_f16", 32, 16, 8, 1, 1, **bits),
                c("mma_swapped", 64, 16, 4, 4, dot_dtype="float16", **bits),
                c("mma", 32, 0, 4, 4, block_k=256, split_factor=2, dot_dtype="float16", **bits),
                c("gemv_f16", 16, 8, 4, 1, 2, **bits), c("gemv", 16, 16, 4, 1, 1, **bits),
                c("mma_swapped", 128, 32, 8, 3, dot_dtype="float16", **ptx),
                c("gemv_f16", 32, 16, 8, 1, 2, **ptx), c("mma_swapped", 64, 16, 4, 4, dot_dtype="float16", **ptx),
                c("mma", 64, 0, 8, 3, block_k=512, dot_dtype="float16", **bits),
                # runs 2-3's winners, with the hardware conversion
                c("mma", 64, 0, 4, 4, block_k=256, dot_dtype="float16"),
                c("mma_swapped", 128, 32, 8, 3, dot_dtype="float16"), c("mma", 32, 0, 4, 4, block_k=256),
                c("mma", 64, 0, 4, 4, block_k=256)]
    return fitting_candidates(default_block_sizes(m, n, k, FORMATS[fmt], table=()), raw, m, n, k)


def exactness_probe(log: Log, sizes_list: list[MatmulBlockSizes], interpret: bool) -> dict[str, dict]:
    """Per fp8 form among ``sizes_list``: the e4m3 codes its compiled kernel does not reproduce (exactness module).

    Runs each form once on the every-code case (256 weight rows, K = 64), at small tiles of the
    same algorithm, conversion and dot dtype: whether denormals survive is a property of how the
    arithmetic is compiled, not of the tile sizes.
    """
    x, w, scale, expected = every_code_case()
    x, w, scale = jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale)
    results = {}
    for sizes in sizes_list:
        form = form_of(sizes)
        if form in results:
            continue
        probe = dataclasses.replace(sizes, block_n=16, block_k=32, k_splits=2, prefetch=0, num_stages=1,
                                    num_warps=4)
        try:
            out = ours("fp8", probe, interpret)(x, (w, scale))
            bad = inexact_codes(out, expected)
            results[form] = {"inexact_codes": bad}
            log(f"exactness {form:24s} " + ("every code exact" if not bad else f"INEXACT codes {[hex(c) for c in bad]}"))
        except Exception as error:  # noqa: BLE001  (a form that does not compile is reported, then left out)
            results[form] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            log(f"exactness {form}: FAILED {results[form]['error'][:300]}")
    return results


# ---------------------------------------------------------------------------------------------------------------
# compile ahead on a pool, time in order


@dataclasses.dataclass
class Job:
    kind: str  # "sweep" or "chain"
    label: str
    entry: dict  # the result row, filled in as the job goes
    build: callable  # () -> (jitted program, args)
    future: concurrent.futures.Future | None = None


def compile_job(job: Job):
    start = time.perf_counter()
    program, args = job.build()
    compiled = jax.jit(program).lower(*args).compile()
    return compiled, args, time.perf_counter() - start


def compile_all(log: Log, jobs: list[Job], threads: int, deadline: float, xla_threads: int = 1) -> None:
    """Compile ``jobs`` in order until done or ``deadline``; the rest are cancelled.

    Programs whose compile autotunes XLA's dots on the device (the XLA methods) go on their
    own ``xla_threads`` (one for the sweep: no two autotunings share the GPU, so XLA's
    choices are its own); ours (Pallas kernels: no autotuning) share the other threads.
    """
    xla_pool = concurrent.futures.ThreadPoolExecutor(max_workers=xla_threads)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads - xla_threads))
    for job in jobs:
        job.future = (xla_pool if job.entry["method"].startswith("xla") else pool).submit(compile_job, job)
    pending = [job.future for job in jobs]
    concurrent.futures.wait(pending, timeout=max(0.0, deadline - time.perf_counter()))
    cancelled = sum(future.cancel() for future in pending)
    running = sum(not future.done() for future in pending)
    # Running compiles are left to finish in the background (nothing can stop an XLA compile);
    # their programs are not timed, so they cannot disturb a timing except through the CPU.
    for executor in (xla_pool, pool):
        executor.shutdown(wait=False, cancel_futures=True)
    log(f"compiled {sum(f.done() and not f.cancelled() for f in pending)} of {len(jobs)} programs "
        f"({cancelled} cancelled, {running} still compiling at the deadline)")


def run_compiled(log: Log, job: Job) -> tuple | None:
    """The compiled program and its args, or None (the entry records why)."""
    future = job.future
    if future is None or future.cancelled() or not future.done():
        job.entry["skipped"] = "not compiled within the budget"
        return None
    error = future.exception()
    if error is not None:
        job.entry["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
        log(f"{job.kind} {job.label}: FAILED {job.entry['error'][:300]}")
        return None
    compiled, args, compile_s = future.result()
    job.entry["compile_s"] = compile_s
    return compiled, args


# ---------------------------------------------------------------------------------------------------------------
# stages


def sweep_jobs(layers, shapes, ms, fmts, interpret: bool, max_candidates: int | None = None) -> list[Job]:
    """Per shape, M and format: XLA's peer and our defaults first (all combinations), then our candidates in rounds.

    ``max_candidates``: at most that many of our sizes per combination, the defaults included (the
    first of each list: the CPU smoke run compiles fewer programs; None: every candidate).
    """
    rounds: list[list[Job]] = []

    def job_for(shape_key, m, fmt, method, apply, sizes):
        n, k = shapes[shape_key]
        ws = [layer[name][fmt] for layer in layers for name in SWEEP_SHAPES[shape_key]]
        # ~1 GB read per program so the device outruns the host's dispatch; small weights make several
        # passes, each with its own x (XLA would merge two identical calls).
        passes = 1 if interpret else int(min(8, max(1, round(1e9 / (len(ws) * weight_bytes(n, k, fmt))))))
        entry = {"shape": shape_key, "n": n, "k": k, "m": m, "weights": fmt, "method": method, "copies": len(ws),
                 "passes": passes, **({"sizes": dataclasses.asdict(sizes)} if sizes else {})}

        def build():
            xs = [activations(m, k, seed=m + 1000 * p) for p in range(passes)]
            return (lambda xs, ws: [apply(x, w) for x in xs for w in ws]), (xs, ws)
        return Job("sweep", f"{shape_key} M={m} {fmt} {method}", entry, build)

    per_combo = {}
    for m in ms:
        for shape_key in SWEEP_SHAPES:
            for fmt in fmts:
                n, k = shapes[shape_key]
                cands = candidates(m, n, k, fmt)[:max_candidates]
                jobs = [job_for(shape_key, m, fmt, XLA_PEER[fmt], xla_peer(fmt), None)]
                jobs += [job_for(shape_key, m, fmt, "ours " + describe(s), ours(fmt, s, interpret), s) for s in cands]
                jobs[1].entry["default"] = True
                per_combo[(shape_key, m, fmt)] = jobs
    depth = max(len(v) for v in per_combo.values())
    # Round 0: XLA and our defaults everywhere; then the i-th candidate of every combination.
    rounds.append([job for jobs in per_combo.values() for job in jobs[:2]])
    for index in range(2, depth):
        rounds.append([jobs[index] for jobs in per_combo.values() if index < len(jobs)])
    return [job for round_jobs in rounds for job in round_jobs]


def time_sweep(log: Log, jobs: list[Job], ceiling: float, rows: list, save, deadline: float) -> None:
    refs = {}
    for job in jobs:
        entry = job.entry
        rows.append(entry)
        if time.perf_counter() > deadline:
            entry["skipped"] = "not timed within the budget"
            continue
        got = run_compiled(log, job)
        if got is None:
            continue
        compiled, args = got
        try:
            t, outs = time_program(compiled, *args)
            t /= len(outs)
            key = (entry["shape"], entry["m"], entry["weights"])
            if key not in refs:
                x, w = args[0][0], args[1][0]
                refs[key] = np.asarray(reference(x, w, entry["weights"]))
            entry["rel_error"] = rel_error(outs[0], refs[key])
            bytes_ = traffic(entry["m"], entry["n"], entry["k"], entry["weights"])
            entry.update(us=t * 1e6, tbs=bytes_ / t / 1e12, of_ceiling=bytes_ / t / 1e12 / ceiling)
            log(f"sweep {entry['shape']:4s} M={entry['m']:2d} {entry['weights']:4s} {entry['method']:36s} "
                f"{t * 1e6:7.1f} us {entry['tbs']:5.2f} TB/s ({entry['of_ceiling']:.0%}) err {entry['rel_error']:.1e} "
                f"compile {entry['compile_s']:.1f} s")
        except Exception as error:  # noqa: BLE001  (a failed run is a result to report)
            entry["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
            log(f"sweep {job.label}: FAILED {entry['error'][:300]}")
        save()


def build_table(sweep_rows: list[dict], exactness: dict[str, dict]) -> list[dict]:
    """Per shape, M and format: our fastest correct sizes beside XLA's peer (entries of gpu_gemv_table.json).

    Correct: relative error under ``MAX_REL_ERROR`` and, for fp8, a form the exactness probe
    found exact on every e4m3 code.
    """
    def is_exact(row):
        if row["weights"] != "fp8":
            return True
        probe = exactness.get(form_of(MatmulBlockSizes(**row["sizes"])), {})
        return probe.get("inexact_codes") == []

    entries = []
    combos = sorted({(r["shape"], r["m"], r["weights"]) for r in sweep_rows})
    for shape_key, m, fmt in combos:
        rows = [r for r in sweep_rows if (r["shape"], r["m"], r["weights"]) == (shape_key, m, fmt) and "us" in r]
        xla = next((r for r in rows if r["method"] == XLA_PEER[fmt]), None)
        mine = [r for r in rows if "sizes" in r and r["rel_error"] < MAX_REL_ERROR and is_exact(r)]
        if not mine or xla is None:
            continue
        best = min(mine, key=lambda r: r["us"])
        entries.append({"m": m, "n": best["n"], "k": best["k"], "weights": np.dtype(FORMATS[fmt]).name,
                        "layout": LAYOUT[fmt],
                        "sizes": best["sizes"], "ours_us": best["us"], "ours_tbs": best["tbs"],
                        "xla_method": XLA_PEER[fmt], "xla_us": xla["us"], "xla_tbs": xla["tbs"]})
    return entries


def carried_over(entries: list[dict], keep_path: Path | None) -> list[dict]:
    """``entries`` plus those of the table at ``keep_path`` for keys this run did not measure, marked ``kept_from``."""
    if keep_path is None or not keep_path.exists():
        return entries
    kept = json.loads(keep_path.read_text())

    def key(e):
        return e["m"], e["n"], e["k"], e["weights"], e.get("layout", "nk")

    measured = {key(e) for e in entries}
    old = [dict(e, kept_from=e.get("kept_from", kept.get("date"))) for e in kept["entries"] if key(e) not in measured]
    return entries + old


def chain_jobs(layers, shapes, ms, table: list[dict], interpret: bool) -> list[Job]:
    """Per M: XLA bf16, XLA W8A16, ours fp8 and bf16 at the table's sizes; then the dispatch chains."""
    hidden = shapes["q"][1]
    num_layers = len(layers)

    def chain(linear_for):
        def run(x, weights):
            h, kvs = x, []
            for layer in weights:
                q = linear_for("q")(h, layer["q"])
                kvs += [linear_for("k")(h, layer["k"]), linear_for("v")(h, layer["v"])]
                o = linear_for("o")(q, layer["o"])
                g, u = linear_for("gate")(o, layer["gate"]), linear_for("up")(o, layer["up"])
                h = h + linear_for("down")((jax.nn.silu(g.astype(jnp.float32)) * u).astype(BF16), layer["down"])
            return h, kvs
        return run

    def ours_for(m, fmt, only_preferred: bool):
        def linear_for(name):
            n, k = shapes[name]
            if only_preferred and not prefer_pallas(m, n, k, FORMATS[fmt], table=table, layout=LAYOUT[fmt]):
                return xla_peer(fmt)
            return ours(fmt, default_block_sizes(m, n, k, FORMATS[fmt], table=table, layout=LAYOUT[fmt]), interpret)
        return linear_for

    tiers = []
    for m in ms:
        plans = [("xla_bf16", "bf16", lambda name: xla_bf16), ("xla_w8a16", "fp8", lambda name: xla_w8a16),
                 ("xla_bf16_kn", "bf16kn", lambda name: xla_bf16_kn),
                 ("ours fp8", "fp8", ours_for(m, "fp8", False)), ("ours bf16", "bf16", ours_for(m, "bf16", False)),
                 ("ours bf16kn", "bf16kn", ours_for(m, "bf16kn", False))]
        tiers.append((0, m, plans))
        tiers.append((1, m, [("dispatch fp8", "fp8", ours_for(m, "fp8", True)),
                             ("dispatch bf16", "bf16", ours_for(m, "bf16", True)),
                             ("dispatch bf16kn", "bf16kn", ours_for(m, "bf16kn", True))]))
    jobs = []
    for _tier, m, plans in sorted(tiers, key=lambda t: t[0]):
        for method, fmt, linear_for in plans:
            names = tuple(shapes)
            bytes_ = sum(traffic(m, *shapes[name], fmt) for name in names) * num_layers
            entry = {"m": m, "method": method, "weights": fmt, "layers": num_layers, "bytes": bytes_}
            if method.startswith(("ours", "dispatch")):
                entry["sizes"] = {name: dataclasses.asdict(default_block_sizes(m, *shapes[name], FORMATS[fmt],
                                                                               layout=LAYOUT[fmt],
                                                                               table=table)) for name in names}
            if method.startswith("dispatch"):
                entry["ours_for"] = [name for name in names
                                     if prefer_pallas(m, *shapes[name], FORMATS[fmt], table=table,
                                                      layout=LAYOUT[fmt])]

            def build(m=m, fmt=fmt, linear_for=linear_for, names=names):
                weights = [{name: layer[name][fmt] for name in names} for layer in layers]
                return chain(linear_for), (activations(m, hidden, seed=m), weights)
            jobs.append(Job("chain", f"M={m} {method}", entry, build))
    return jobs


def time_chains(log: Log, jobs: list[Job], ceiling: float, rows: list, save) -> None:
    for job in jobs:
        entry = job.entry
        rows.append(entry)
        got = run_compiled(log, job)
        if got is None:
            continue
        compiled, args = got
        try:
            t = time_program(compiled, *args)[0]
            entry.update(ms=t * 1e3, tbs=entry["bytes"] / t / 1e12, of_ceiling=entry["bytes"] / t / 1e12 / ceiling)
            log(f"chain M={entry['m']:2d} {entry['method']:14s} {t * 1e3:7.3f} ms {entry['tbs']:5.2f} TB/s "
                f"({entry['of_ceiling']:.0%})" + (f" ours for {entry['ours_for']}" if "ours_for" in entry else ""))
        except Exception as error:  # noqa: BLE001
            entry["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
            log(f"chain {job.label}: FAILED {entry['error'][:300]}")
        save()


def markdown_summary(info, ceiling, sweep_rows, table, chain_rows, ms, shapes, exactness) -> str:
    lines = [f"# Decode GEMV: ours (fp8 / bf16 weights) vs XLA ({info['device']}, jax {info['jax']}, {info['date']})",
             "", f"HBM read ceiling this run: **{ceiling:.2f} TB/s**", "",
             "## Per shape (µs per call / TB/s on each format's own bytes)", "",
             "Columns: XLA's peer; our default sizes; our fastest with the hardware conversion (`cvt`) and "
             "with the integer one (`bits` or `bits_ptx`, fp8 only), each with its sizes; the table's pick (fastest correct "
             "and exact) against XLA.", "",
             "| shape | M | weights | XLA peer | ours default | best cvt | best bits | table pick | ours/XLA |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fmt_cell = lambda r: f"{r['us']:.1f} / {r['tbs']:.2f} ({r['of_ceiling']:.0%})" if r and "us" in r else "-"  # noqa: E731
    for shape_key in SWEEP_SHAPES:
        n, k = shapes[shape_key]
        for m in ms:
            for fmt in FORMATS:
                rows = [r for r in sweep_rows if (r["shape"], r["m"], r["weights"]) == (shape_key, m, fmt)]
                if not rows:
                    continue
                xla = next((r for r in rows if r["method"] == XLA_PEER[fmt]), None)
                default = next((r for r in rows if r.get("default")), None)
                entry = next((e for e in table if (e["n"], e["k"], e["m"]) == (n, k, m)
                              and e["weights"] == np.dtype(FORMATS[fmt]).name
                              and e.get("layout", "nk") == LAYOUT[fmt]), None)
                ratio = f"{entry['ours_us'] / entry['xla_us']:.2f}" if entry else "-"

                def best_cell(convert):
                    timed = [r for r in rows if "sizes" in r and "us" in r and r["rel_error"] < MAX_REL_ERROR
                             and r["sizes"].get("convert", "cvt").startswith(convert)]
                    if not timed:
                        return "-"
                    best = min(timed, key=lambda r: r["us"])
                    sizes = MatmulBlockSizes(**best["sizes"])
                    probe = exactness.get(form_of(sizes)) if fmt == "fp8" else None
                    inexact = " (inexact: not in the table)" if probe and probe.get("inexact_codes") != [] else ""
                    return f"{fmt_cell(best)} {describe(sizes)}{inexact}"

                lines.append(f"| {shape_key} {n}x{k} | {m} | {fmt} | {XLA_PEER[fmt]} {fmt_cell(xla)} | "
                             f"{fmt_cell(default)} | {best_cell('cvt')} | {best_cell('bits')} | "
                             f"{describe(MatmulBlockSizes(**entry['sizes'])) if entry else '-'} | {ratio} |")
    if exactness:
        lines += ["", "## Exactness of each fp8 form on this GPU (every e4m3 code times one)", "",
                  "| form | result |", "| --- | --- |"]
        for form, probe in sorted(exactness.items()):
            result = probe.get("error") or ("every code exact" if not probe["inexact_codes"] else
                                            f"inexact: {[hex(c) for c in probe['inexact_codes']]}")
            lines.append(f"| {form} | {result} |")
    methods = ["xla_bf16", "ours bf16", "dispatch bf16", "xla_bf16_kn", "ours bf16kn", "dispatch bf16kn",
               "xla_w8a16", "ours fp8", "dispatch fp8"]
    lines += ["", "## Chains (all layers' q/k/v/o/gate/up/down, ms per chain, TB/s)", "",
              "| M | " + " | ".join(methods) + " |", "|" + " --- |" * (len(methods) + 1)]
    for m in ms:
        got = {r["method"]: r for r in chain_rows if r["m"] == m and "ms" in r}
        lines.append(f"| {m} | " + " | ".join(
            f"{got[name]['ms']:.3f} / {got[name]['tbs']:.2f}" if name in got else "-" for name in methods) + " |")
    num_layers = next((r["layers"] for r in chain_rows), None)
    got = {r["method"]: r for r in chain_rows if r["m"] == 1 and "ms" in r}
    if num_layers and got and shapes["q"] == (4096, 4096):
        # Batch-1 decode of Llama-3.1-8B: 32 layers + a bf16 lm_head (1.05 GB) at the read ceiling.
        lm_head_ms = 128256 * 4096 * 2 / (ceiling * 1e12) * 1e3
        lines += ["", "M=1 scaled to Llama-3.1-8B's 32 layers plus the bf16 lm_head at the ceiling "
                  f"({lm_head_ms:.3f} ms): " + ", ".join(
                      f"{name} {r['ms'] * 32 / num_layers + lm_head_ms:.2f} ms" for name, r in sorted(
                          got.items(), key=lambda kv: kv[1]["ms"])) + " (fp8 goal: <= 2.4 ms per token)"]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ms", default="1,8,4,16,2", help="token counts, in priority order (chains go M by M)")
    parser.add_argument("--weights", default="fp8,bf16kn,bf16",
                        help="weight formats to sweep and chain (fp8, bf16kn: bf16 in the dense [K, N] layout, bf16)")
    parser.add_argument("--budget-s", type=float, default=280.0,
                        help="wall seconds from the start of main; the sweep's compiles stop at --sweep-share of "
                             "it, the chains' at --chain-share, and results are written before it ends")
    parser.add_argument("--sweep-share", type=float, default=0.45)
    parser.add_argument("--sweep-timing-share", type=float, default=0.6,
                        help="share of --budget-s after which no more sweep programs are timed")
    parser.add_argument("--chain-share", type=float, default=0.85)
    parser.add_argument("--compile-threads", type=int, default=12)
    parser.add_argument("--ceiling-gib", type=float, default=2.0)
    parser.add_argument("--keep-table", type=Path, default=GPU_TABLE_PATH,
                        help="table whose entries this run does not measure are carried into the written one "
                             "(default: the committed table; a missing path keeps nothing)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"programs enqueued back to back per timed batch (default {REPEATS}, the GPU runs'); "
                             "the CPU smoke test passes 1, since interpreted programs take long and time nothing")
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="our sizes swept per shape, M and format, the defaults first (default: every "
                             "candidate, the GPU runs'); the CPU smoke test passes 4 (the exactness probe still "
                             "covers every fp8 form)")
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
    fmts = [f for f in args.weights.split(",") if f]
    for fmt in fmts:
        if fmt not in FORMATS:
            raise SystemExit(f"--weights: {fmt!r} is not one of {sorted(FORMATS)}")
    shapes = layer_shapes(args.shape)
    ceiling = measure_read_ceiling(log, args.ceiling_gib if not interpret else 0.01)
    layers = make_weights(shapes, args.layers)
    log(f"weights: {args.layers} layers ({time.perf_counter() - start:.0f} s so far)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"info": info, "args": {name: str(v) if isinstance(v, Path) else v for name, v in vars(args).items()}, "hbm_read_tbs": ceiling,
               "sweep": [], "table": [], "chains": []}
    partial_path = args.out / "gemv_decode.partial.json"

    def save():  # everything so far, in case the process dies or the wall clock runs out
        partial_path.write_text(json.dumps(results, indent=1, default=str))

    if "fp8" in fmts:
        forms = [s for m in ms for key in SWEEP_SHAPES for s in candidates(m, *shapes[key], "fp8")]
        results["exactness"] = exactness_probe(log, forms, interpret)
    save()
    jobs = sweep_jobs(layers, shapes, ms, fmts, interpret, args.max_candidates)
    compile_all(log, jobs, args.compile_threads, start + args.sweep_share * args.budget_s)
    time_sweep(log, jobs, ceiling, results["sweep"], save, start + args.sweep_timing_share * args.budget_s)
    results["table"] = build_table(results["sweep"], results.get("exactness", {}))
    table_doc = {"device": info["device"], "jax": info["jax"], "date": info["date"], "hbm_read_tbs": ceiling,
                 "source": "benchmarks/gemv_decode.py",
                 "entries": carried_over(results["table"], None if interpret else args.keep_table)}
    (args.out / "gpu_gemv_table.json").write_text(json.dumps(table_doc, indent=1))
    log(f"table: {len(results['table'])} entries measured, {len(table_doc['entries']) - len(results['table'])} "
        f"kept from {args.keep_table} -> {args.out / 'gpu_gemv_table.json'} "
        f"({time.perf_counter() - start:.0f} s so far)")
    for e in results["table"]:
        log(f"  M={e['m']:2d} {e['n']}x{e['k']} {e['weights']:13s} ours {e['ours_us']:6.1f} us "
            f"({describe(MatmulBlockSizes(**e['sizes']))}) vs {e['xla_method']} {e['xla_us']:6.1f} us")
    save()
    chain_list = chain_jobs(layers, shapes, ms, results["table"], interpret) if not set(fmts) ^ set(FORMATS) else []
    # Chain dots repeat the sweep's shapes (autotuned once already) or are small: two XLA threads.
    compile_all(log, chain_list, args.compile_threads, start + args.chain_share * args.budget_s, xla_threads=2)
    time_chains(log, chain_list, ceiling, results["chains"], save)
    results["not_compiled"] = [job.label for job in jobs + chain_list if job.entry.get("skipped")]
    results["wall_s"] = time.perf_counter() - start
    markdown = markdown_summary(info, ceiling, results["sweep"], results["table"], results["chains"], sorted(ms),
                                shapes, results.get("exactness", {}))
    for line in markdown.splitlines():
        log(line)
    log(f"wall: {results['wall_s']:.0f} s")
    write_results(args.out, "gemv_decode", results, markdown, log)
    # Compiles still running at a deadline would keep the interpreter alive past the budget.
    os._exit(0)


if __name__ == "__main__":
    main()

"""Decode projections through TMA + wgmma (``gpu_wgmma.py``) against XLA, one H200 run.

Issue 18/21: a batch-1 decode step is its weight read, and XLA's paths read Llama-3.1-8B's
projections at 3.3-4.1 TB/s (bf16) and ~2.3-2.8 TB/s of fp8 bytes (W8A16). This times, per
projection shape and token count M, the stored-weight read of:

* fp8 weights ``[out, in]`` (per-channel scales): XLA's W8A16 (convert, then dot: what the
  engine runs below 128 tokens), XLA's W8A8 (cuBLASLt FP8, M padded to 16), ours as W8A8 (x
  rounded to e4m3 per row inside the timed call) at several tile sizes, ours as W8A8 with x
  rounded inside the kernel (``wgmma-fused``: per token and 256-value K step) at the default
  sizes and two neighbours, and ours weight-only (``wgmma-f16``: x in f16, tiles widened in
  registers) at the default sizes;
* bf16 weights in the model's ``[in, out]`` layout: XLA's einsum (what the engine runs) and ours.
  q/k/v and gate/up are timed merged (``[4096, 6144]``, ``[4096, 28672]``), as XLA's DotMerger
  runs them in the engine's small steps.

Each timed program calls one shape on ``copies`` distinct weights (more bytes than the 50 MB L2)
with distinct inputs (so XLA cannot merge the dots), ``REPEATS`` programs enqueued before one wait,
median of 3 batches: the host-timed µs per call. Then every program of a case runs once more
under the profiler, in turn with idle gaps between, and its kernels' busy time / ``copies`` is
its **µs on the device** (its XLA ops included: x's rounding, epilogues), which ranks the tables
(session 22: the host-timed figures disagreed with the engine's own traces). TB/s of the
method's stored weight bytes, % of the HBM read ceiling measured in the same run. Every
candidate's output is checked against a float32 reference of its own rounding (relative error
> 2e-2 disqualifies). The last table sums the best per projection into one layer (x 32 layers)
for each method: the step's GEMV time at batch 1.

    python3 benchmarks/wgmma_gemv.py --out DIR [--ms 8,1,16] [--budget-s 240]
    python3 benchmarks/wgmma_gemv.py --out DIR --smoke   # CPU: interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from common import Log, header, measure_ceilings, write_results  # noqa: E402
from profile_collectives import busy_time, gpu_kernels, load_trace  # noqa: E402
from pallas_kernels.quantized_matmul.gpu_wgmma import (  # noqa: E402
    FP8, default_sizes, quantize_blocks_e4m3, quantize_rows_e4m3, split_count, wgmma_matmul)  # noqa: E402

BF16 = jnp.bfloat16
REPEATS = 8
MIN_BYTES_PER_PROGRAM = 256 * 2**20  # 5x the L2: each call reads its weights from HBM
MAX_COPIES = 32  # calls a program (compile time grows with them)
MAX_REL_ERROR = 2e-2
FP8_METHODS = ("xla_w8a16", "xla_w8a8", "ours", "wgmma-fused", "wgmma-f16")  # label prefixes, in table order
BF16_METHODS = ("xla_bf16", "ours")
NUM_LAYERS = 32
_CONTRACT_MINOR = (((1,), (1,)), ((), ()))

# Llama-3.1-8B, one layer. fp8: [N, K] payloads, one call each (XLA does not merge fp8 dots this
# large); bf16: [K, N] model layout, q/k/v and gate/up merged as the engine's steps run them.
FP8_SHAPES = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
              "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)}
BF16_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SMOKE_FP8_SHAPES = {"q": (128, 256), "down": (128, 512)}
SMOKE_BF16_SHAPES = {"qkv": (256, 192), "down": (512, 128)}


def xla_w8a16(x, w, scale):
    y = lax.dot_general(x, w.astype(BF16), _CONTRACT_MINOR, preferred_element_type=jnp.float32)
    return y * scale[None, :]


def xla_w8a8(x, w, scale):
    m = x.shape[0]
    x32 = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=1) / 448.0, 1e-12)
    xq = jnp.pad((x32 / x_scale[:, None]).astype(FP8), ((0, -m % 16), (0, 0)))
    y = lax.dot_general(xq, w, _CONTRACT_MINOR, preferred_element_type=jnp.float32)[:m]
    return y * x_scale[:, None] * scale[None, :]


def xla_bf16_kn(x, w):
    return jnp.einsum("mk,kn->mn", x, w).astype(BF16)


def ours_fp8(sizes, interpret):
    # bf16 out, as the weight layer asks: with one K split the epilogue is the kernel's own.
    return lambda x, w, scale: wgmma_matmul(x, w, scale, out_dtype=BF16, interpret=interpret, **sizes)


def ours_fp8_weight_only(sizes, interpret):
    # activations="f16": x scaled per row into f16, each e4m3 tile widened in registers (weight-only).
    return lambda x, w, scale: wgmma_matmul(x, w, scale, activations="f16", out_dtype=BF16, interpret=interpret,
                                            **sizes)


def ours_fp8_fused(sizes, interpret):
    # A partial, so the check below can read the block_k its reference rounds x by.
    return functools.partial(wgmma_matmul, activations="e4m3-fused", out_dtype=BF16, interpret=interpret, **sizes)


def fused_candidates(m: int, n: int, k: int) -> list[dict]:
    """``wgmma-fused``'s default sizes, then 128 weight rows a program and 4 steps in flight."""
    base = default_sizes(m, n, k, FP8, activations="e4m3-fused")
    out = [base, {**base, "max_concurrent_steps": 4}]
    if n % 128 == 0:
        out.append({**base, "block_n": 128, "max_concurrent_steps": 4})
    return out


def ours_bf16_kn(sizes, interpret):
    return lambda x, w: wgmma_matmul(x, w, weight_layout="kn", interpret=interpret, **sizes)


def candidates(m: int, n: int, k: int, weight_dtype, smoke: bool) -> list[dict]:
    """Tile sizes to try: 64/128 weight rows, one or two 128-byte swizzle rows of K a step,
    4, 6 or 8 steps in flight, the split count for one program per SM and twice it (or 1 and 2)."""
    base = default_sizes(m, n, k, weight_dtype)
    if smoke:
        return [base]
    itemsize = jnp.dtype(weight_dtype).itemsize
    out = []
    for block_n, k_bytes, stages in itertools.product((64, 128), (128, 256), (4, 6, 8)):
        block_k = k_bytes // itemsize
        if n % block_n or block_n * k_bytes * stages > 160 * 1024:  # shared memory: leave room
            continue
        splits = split_count(n, k, block_n, block_k, min_steps=2)
        for k_splits in sorted({splits, splits * 2} if splits > 1 else {1, 2}):
            if k % (block_k * k_splits) or k // (block_k * k_splits) < 2:
                continue
            out.append(dict(block_n=block_n, block_k=block_k, k_splits=k_splits, max_concurrent_steps=stages))
    return out


def describe(sizes: dict) -> str:
    return f"{sizes['block_n']}x{sizes['block_k']} s{sizes['max_concurrent_steps']} k{sizes['k_splits']}"


class Case:
    """One (format, projection, M): its weights (``copies`` of them), inputs and reference."""

    def __init__(self, fmt: str, name: str, shape: tuple[int, int], m: int, smoke: bool, seed: int):
        self.fmt, self.name, self.m = fmt, name, m
        if fmt == "fp8":
            self.n, self.k = shape
            weight_bytes = self.n * self.k
        else:
            self.k, self.n = shape
            weight_bytes = self.n * self.k * 2
        self.weight_bytes = weight_bytes
        self.copies = 2 if smoke else min(MAX_COPIES, max(4, math.ceil(MIN_BYTES_PER_PROGRAM / weight_bytes)))
        # Separate arrays per copy (as the model's layers are), not slices of one stacked array:
        # a slice of a stacked weight can cost XLA a copy of it before a custom call.
        keys = jax.random.split(jax.random.key(seed), (self.copies, 3))
        self.x = [jax.random.normal(key[0], (m, self.k), BF16) for key in keys]
        if fmt == "fp8":
            draw = jax.jit(lambda key: jax.random.normal(key, (self.n, self.k), jnp.float32).clip(-448, 448).astype(FP8))
            self.w = [draw(key[1]) for key in keys]
            self.scale = [jax.random.uniform(key[2], (self.n,), jnp.float32, 0.5, 2.0) / math.sqrt(self.k)
                          for key in keys]
            self.weights = (self.w, self.scale)
        else:
            self.w = [jax.random.normal(key[1], (self.k, self.n), BF16) / math.sqrt(self.k) for key in keys]
            self.weights = (self.w,)
        self.reference = self._reference(quantize_x=False)
        # W8A8 methods multiply x rounded to e4m3 per row: checked against that product (on
        # Gaussian x the rounding alone is ~2.5% of the output's norm, reported as x_rounding).
        self.reference_w8a8 = self._reference(quantize_x=True) if fmt == "fp8" else None
        self._references_fused = {}

    def reference_fused(self, block_k: int):
        """wgmma-fused's product: x rounded per token row and ``block_k``-value K step."""
        if block_k not in self._references_fused:
            self._references_fused[block_k] = self._reference(quantize_x=block_k)
        return self._references_fused[block_k]

    def _reference(self, quantize_x: bool | int):
        x = self.x[0].astype(jnp.float32)
        if quantize_x is not True and quantize_x:  # an int: wgmma-fused's K step
            x8, block_scale = quantize_blocks_e4m3(x, quantize_x)
            x = (x8.astype(jnp.float32).reshape(self.m, -1, quantize_x) * block_scale[..., None]).reshape(x.shape)
        elif quantize_x:
            x8, x_scale = quantize_rows_e4m3(x)
            x = x8.astype(jnp.float32) * x_scale[:, None]
        if self.fmt == "fp8":
            w = self.w[0].astype(jnp.float32) * self.scale[0][:, None]
            return np.asarray(jnp.dot(x, w.T, precision="highest"))
        return np.asarray(jnp.dot(x, self.w[0].astype(jnp.float32), precision="highest"))

    def program(self, fn):
        def run(x, *weights):
            return [fn(x[i], *(w[i] for w in weights)) for i in range(self.copies)]
        return jax.jit(run)

    def args(self):
        return (self.x, *self.weights)


TRACE_GAP_S = 0.05  # host sleep between traced programs: a device idle gap no program has inside it


def device_times(programs: dict, args, copies: int, trace_dir: Path) -> dict:
    """Each program's kernel time on the device, from one profiler trace of all of them run in
    turn with ``TRACE_GAP_S`` of idle between: ``{label: {"device_us", "kernels_per_call"}}``
    per call (the program's busy time / ``copies``), or ``{"error": ...}`` when the trace has no
    GPU kernels (a CPU) or its idle gaps do not split it into one group a program.

    The host-timed ``us`` disagreed with the engine's own traces at these sizes (session 22: XLA's
    W8A16 gate 1.78 TB/s timed from the host, 3.13 in the engine's trace), so tables rank by this."""
    labels = list(programs)
    for program in programs.values():
        jax.block_until_ready(program(*args))  # warm: nothing but the calls in the trace
    with jax.profiler.trace(str(trace_dir)):
        for label in labels:
            time.sleep(TRACE_GAP_S)
            jax.block_until_ready(programs[label](*args))
        time.sleep(TRACE_GAP_S)
    traces = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
    kernels = sorted(gpu_kernels(*load_trace(traces[-1])), key=lambda e: e["ts"]) if traces else []
    if not kernels:
        return {"error": "no GPU kernel events in the trace"}
    groups = split_at_gaps(kernels, TRACE_GAP_S * 1e6 / 2)
    if len(groups) != len(labels):
        return {"error": f"{len(groups)} groups of kernels in the trace for {len(labels)} programs"}
    return {label: {"device_us": busy_time([(e["ts"], e["ts"] + e["dur"]) for e in group]) / copies,
                    "kernels_per_call": len(group) / copies}
            for label, group in zip(labels, groups)}


def split_at_gaps(kernels: list[dict], gap_us: float) -> list[list[dict]]:
    """Kernel events (sorted by start) in groups: a new group wherever the device idled more than
    ``gap_us`` since the previous kernel's end."""
    groups = [[kernels[0]]]
    for previous, event in zip(kernels, kernels[1:]):
        if event["ts"] - (previous["ts"] + previous["dur"]) > gap_us:
            groups.append([])
        groups[-1].append(event)
    return groups


def rel_error(out, ref) -> float:
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def time_program(compiled, args, runs: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        outs = [compiled(*args) for _ in range(REPEATS)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / REPEATS)
    return float(np.median(times))


def methods_for(case: Case, smoke: bool, interpret: bool) -> dict:
    if case.fmt == "fp8":
        methods = {"xla_w8a16": xla_w8a16, "xla_w8a8": xla_w8a8}
        for sizes in candidates(case.m, case.n, case.k, FP8, smoke):
            methods["ours " + describe(sizes)] = ours_fp8(sizes, interpret)
        for sizes in fused_candidates(case.m, case.n, case.k)[:1 if smoke else None]:
            methods["wgmma-fused " + describe(sizes)] = ours_fp8_fused(sizes, interpret)
        sizes = default_sizes(case.m, case.n, case.k, FP8, activations="f16")  # weight-only: the defaults only
        methods["wgmma-f16 " + describe(sizes)] = ours_fp8_weight_only(sizes, interpret)
    else:
        methods = {"xla_bf16": xla_bf16_kn}
        for sizes in candidates(case.m, case.n, case.k, BF16, smoke):
            methods["ours " + describe(sizes)] = ours_bf16_kn(sizes, interpret)
    if smoke and interpret:  # on CPU: XLA's first path and ours, to keep the smoke short
        methods = {label: fn for i, (label, fn) in enumerate(methods.items())
                   if i == 0 or label.startswith(("ours", "wgmma-"))}
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ms", default="8,1,16", help="token counts, most important first")
    parser.add_argument("--formats", default="fp8,bf16")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this")
    parser.add_argument("--smoke", action="store_true", help="CPU: interpret mode, tiny shapes, one candidate")
    args = parser.parse_args()
    log = Log(elapsed=True)
    start = time.time()
    info = header(log)
    interpret = args.smoke and jax.default_backend() == "cpu"
    ceilings = measure_ceilings(log)
    ceiling = ceilings["hbm_read_tbs"]
    ms = [int(v) for v in args.ms.split(",")]
    formats = args.formats.split(",")
    shapes = {"fp8": SMOKE_FP8_SHAPES if args.smoke else FP8_SHAPES,
              "bf16": SMOKE_BF16_SHAPES if args.smoke else BF16_SHAPES}
    rows, device_errors = [], []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=12)
    try:
        for m, fmt in itertools.product(ms, formats):
            for seed, (name, shape) in enumerate(shapes[fmt].items()):
                if time.time() - start > args.budget_s:
                    log(f"budget spent: skipping {fmt} {name} M={m}")
                    continue
                case = Case(fmt, name, shape, m, args.smoke, seed)
                methods = methods_for(case, args.smoke, interpret)
                programs = {label: case.program(fn) for label, fn in methods.items()}

                def compile_one(item):
                    label, program = item
                    try:
                        return label, program.lower(*case.args()).compile()
                    except Exception as e:  # e.g. shared memory over the limit: reported, not fatal
                        return label, e

                compiled = dict(pool.map(compile_one, programs.items()))
                for label, program in compiled.items():
                    row = {"format": fmt, "projection": name, "m": m, "n": case.n, "k": case.k, "method": label}
                    if isinstance(program, Exception):
                        row["error"] = f"{type(program).__name__}: {str(program)[:200]}"
                        log(f"{fmt} {name} M={m} {label}: {row['error']}")
                        rows.append(row)
                        continue
                    outs = program(*case.args())
                    w8a8 = case.fmt == "fp8" and label.startswith(("xla_w8a8", "ours", "wgmma-fused"))
                    reference = (case.reference_fused(methods[label].keywords["block_k"])
                                 if label.startswith("wgmma-fused") else case.reference_w8a8)
                    row["rel_error"] = rel_error(outs[0], reference if w8a8 else case.reference)
                    if w8a8:
                        row["x_rounding"] = rel_error(outs[0], case.reference)
                    seconds = time_program(program, case.args(), runs=1 if interpret else 3) / case.copies
                    row["us"] = seconds * 1e6
                    row["tbs"] = case.weight_bytes / seconds / 1e12
                    row["of_ceiling"] = row["tbs"] / ceiling
                    row["ok"] = bool(row["rel_error"] <= MAX_REL_ERROR)
                    rows.append(row)
                    log(f"{fmt} {name:7s} M={m:2d} {label:26s} {row['us']:8.1f} us {row['tbs']:5.2f} TB/s "
                        f"({row['of_ceiling']:4.0%}) err {row['rel_error']:.1e}{'' if row['ok'] else ' WRONG'}")
                timed = {r["method"]: compiled[r["method"]] for r in rows
                         if (r["format"], r["projection"], r["m"]) == (fmt, name, m) and "us" in r}
                # (profile_* directories: device_runs.sh archives them apart from the results)
                traced = device_times(timed, case.args(), case.copies, args.out / f"profile_{fmt}_{name}_{m}")
                if "error" in traced:
                    device_errors.append(traced["error"])
                for r in rows:
                    if (r["format"], r["projection"], r["m"]) == (fmt, name, m) and r["method"] in traced:
                        r.update(traced[r["method"]])
                        r["device_tbs"] = case.weight_bytes / (r["device_us"] * 1e-6) / 1e12
                        log(f"{fmt} {name:7s} M={m:2d} {r['method']:26s} {r['device_us']:8.1f} us on the device "
                            f"({r['device_tbs']:5.2f} TB/s, {r['kernels_per_call']:.0f} kernels a call)")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        results = {**info, **ceilings, "rows": rows, "layers": layer_sums(rows, shapes, ms, formats),
                   "device_time_errors": sorted(set(device_errors))}
        write_results(args.out, "wgmma_gemv", results, markdown(info, ceiling, rows, results["layers"]), log)


def best(rows, fmt, name, m, prefix):
    ok = [r for r in rows if r["format"] == fmt and r["projection"] == name and r["m"] == m
          and r.get("ok") and r["method"].startswith(prefix)]
    return min(ok, key=time_us) if ok else None


def time_us(row) -> float:
    """A row's µs a call: on the device where traced (the ranking), else timed from the host."""
    return row.get("device_us", row["us"])


def layer_sums(rows, shapes, ms, formats) -> list[dict]:
    """Per format and M: one layer's projections at each method's best, and x 32 layers."""
    out = []
    for fmt, m in itertools.product(formats, ms):
        prefixes = FP8_METHODS if fmt == "fp8" else BF16_METHODS
        for prefix in prefixes:
            picks = [best(rows, fmt, name, m, prefix) for name in shapes[fmt]]
            if any(p is None for p in picks):
                continue
            layer_us = sum(time_us(p) for p in picks)
            out.append({"format": fmt, "m": m, "method": prefix, "layer_us": layer_us,
                        "step_ms": layer_us * NUM_LAYERS / 1e3})
    return out


def markdown(info, ceiling, rows, layers) -> str:
    lines = ["# Decode projections: TMA + wgmma (ours) against XLA", "",
             f"Command: `{info['command']}`  ",
             f"{info['device']}, jax {info['jax']}, {info['date']}; HBM read ceiling {ceiling:.2f} TB/s", "",
             "µs per call on the device (the kernels' busy time in a profiler trace, where traced; else "
             "timed from the host, marked *), the best correct tile sizes for ours; TB/s of the stored weight "
             "bytes, % of the ceiling; host-timed µs and kernels a call beside.", "",
             "| format | projection | M | method | µs | TB/s | % ceiling | sizes | host-timed µs | kernels a call |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["format"], r["m"], r["projection"]) for r in rows}, key=lambda t: (t[0], t[1]))
    for fmt, m, name in keys:
        prefixes = FP8_METHODS if fmt == "fp8" else BF16_METHODS
        for prefix in prefixes:
            r = best(rows, fmt, name, m, prefix)
            if r is None:
                continue
            sizes = r["method"][len(prefix) + 1:] if prefix in ("ours", "wgmma-fused", "wgmma-f16") else ""
            us, traced = time_us(r), "device_us" in r
            tbs = r["device_tbs"] if traced else r["tbs"]
            kernels = f"{r['kernels_per_call']:.0f}" if traced else ""
            lines.append(f"| {fmt} | {name} | {m} | {prefix} | {us:.1f}{'' if traced else '*'} | {tbs:.2f} | "
                         f"{tbs / ceiling:.0%} | {sizes} | {r['us']:.1f} | {kernels} |")
    lines += ["", "One layer's projections at each method's best, x 32 layers:", "",
              "| format | M | method | µs a layer | ms a step (32 layers) |", "| --- | --- | --- | --- | --- |"]
    for entry in layers:
        lines.append(f"| {entry['format']} | {entry['m']} | {entry['method']} | {entry['layer_us']:.1f} | "
                     f"{entry['step_ms']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

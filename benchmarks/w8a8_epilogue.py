"""The W8A8 MLP block around its FP8 GEMMs: float32 GEMM outputs (the weight layer's today) against bfloat16 ones.

    python3 benchmarks/w8a8_epilogue.py --out DIR [--ms 1024,8192] [--layers 4] [--activation-scales dynamic,static]
    python3 benchmarks/w8a8_epilogue.py --out DIR --shape tiny --ms 128 --layers 1   # CPU smoke run

Why: a traced prompt-carrying step of fp8 ``throughput-1k`` on the H200 (session 10,
``benchmarks/results/engine_throughput.session10_fp8_prefill_trace.*``, 8192 tokens) spent 77.7 ms
in the FP8 GEMMs and 34.5 ms in fusions around them; the largest, 12.9 ms a step (32 launches of
398 µs, one 256-thread block per token row), quantizes the down projection's input from the
gate/up GEMMs' float32 outputs (``jaxinfer.linear.fp8_w8a8_matmul`` asks for float32 so that
both scales apply before any rounding). bfloat16 GEMM outputs would halve the bytes every such
fusion reads, at the cost of one more rounding (bf16's, 2^-9 relative, before the scales).

One layer's MLP of Llama-3.1-8B shapes (gate/up [14336, 4096], down [4096, 14336], e4m3 per
output channel), ``--layers`` distinct copies so no layer's weights are in L2, ``M`` tokens:

* ``engine``: ``jaxinfer.linear`` as the model calls it (``linear_many`` for gate/up: one
  per-token quantization of x; SiLU(gate) * up; ``linear`` for down): float32 GEMM outputs;
* ``bf16_out``: the same, with the FP8 dots' outputs in bfloat16 (scales applied after, in f32);
* ``gemm_only``: the three FP8 dots alone on inputs quantized beforehand (float32 outputs), the
  block's floor as XLA runs the GEMMs;
* ``engine_static`` (``--activation-scales`` with ``static``): ``engine`` with static per-tensor
  activation scales on the weights (``QuantizedWeight.input_scale``, ``jaxinfer.activation_scales``):
  ``clip(x / s)`` with no row-max, which XLA can fuse into the producer (the silu-mul for down).
  The scales are each input's absmax over 448 on this very input (what calibration on it gives).

Each: milliseconds per layer (median of 3, many calls in one program), TFLOP/s of the block's
GEMMs, the compiled program's count of cuBLASLt FP8 GEMM calls (``__cublas$lt$matmul$f8``: both
must keep every GEMM there), and the relative error of its output against a float32 reference
(dequantized weights, float32 activations). Writes DIR/w8a8_epilogue.{json,md,log}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import Log, header, measure_ceilings, time_in_loop, write_results  # noqa: E402

from jaxinfer.linear import _CONTRACT_MINOR, FP8_GEMM_ROW_MULTIPLE, linear, linear_many, quantize_activations_fp8  # noqa: E402
from jaxinfer.quantization import QuantizedWeight, dequantize, quantize  # noqa: E402

NAME = "w8a8_epilogue"
SHAPES = {"llama-3.1-8b": (4096, 14336), "tiny": (64, 128)}  # (hidden, intermediate)
CUBLAS_FP8 = "__cublas$lt$matmul$f8"


def make_layers(hidden: int, intermediate: int, num_layers: int) -> list[dict]:
    layers = []
    for i in range(num_layers):
        keys = jax.random.split(jax.random.key(i), 3)
        draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32) / shape[1] ** 0.5  # noqa: E731
        layers.append({"gate": quantize(draw(keys[0], (intermediate, hidden)), "fp8", 1),
                       "up": quantize(draw(keys[1], (intermediate, hidden)), "fp8", 1),
                       "down": quantize(draw(keys[2], (hidden, intermediate)), "fp8", 1)})
    return layers


def fp8_dot(xq, x_scale, w: QuantizedWeight, out_dtype):
    """xq [M, K] e4m3 times the payload [N, K] with ``out_dtype`` GEMM output, then both scales."""
    m = xq.shape[0]
    padded = -m % FP8_GEMM_ROW_MULTIPLE
    if padded:
        xq = jnp.pad(xq, ((0, padded), (0, 0)))
    y = jax.lax.dot_general(xq, w.payload, _CONTRACT_MINOR, preferred_element_type=out_dtype)[:m]
    return y.astype(jnp.float32) * x_scale[:, None] * w.scale[None, :]


def mlp_engine(x, layer):
    # A QuantizedWeight's payload is [out, in], the layout linear() takes for these dense subscripts.
    gate, up = linear_many("te,ef->tf", x, (layer["gate"], layer["up"]))
    return linear("tf,fe->te", jax.nn.silu(gate) * up, layer["down"])


def mlp_bf16_out(x, layer):
    xq, xs = quantize_activations_fp8(x)
    gate = fp8_dot(xq, xs, layer["gate"], jnp.bfloat16).astype(x.dtype)
    up = fp8_dot(xq, xs, layer["up"], jnp.bfloat16).astype(x.dtype)
    hq, hs = quantize_activations_fp8(jax.nn.silu(gate) * up)
    return fp8_dot(hq, hs, layer["down"], jnp.bfloat16).astype(x.dtype)


def gemms_only(prepared, layers):
    """Every layer's three FP8 dots on inputs quantized beforehand, every output returned (none is dead)."""
    xq, xs, hq, hs = prepared
    return [(fp8_dot(xq, xs, layer["gate"], jnp.float32), fp8_dot(xq, xs, layer["up"], jnp.float32),
             fp8_dot(hq, hs, layer["down"], jnp.float32)) for layer in layers]


def time_calls(fn, *args, repeats: int = 5) -> float:
    """Median seconds of a call of the jitted ``fn`` (its outputs waited for), after a first call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def mlp_reference(x, layer):
    w = {name: dequantize(layer[name]) for name in ("gate", "up", "down")}
    x32 = x.astype(jnp.float32)
    h = jax.nn.silu(x32 @ w["gate"].T) * (x32 @ w["up"].T)
    return h @ w["down"].T


VARIANTS = {"engine": mlp_engine, "bf16_out": mlp_bf16_out}


def with_static_scales(layers: list[dict], x) -> list[dict]:
    """``layers`` whose weights carry static input scales: each input's absmax on ``x`` over 448
    (gate/up share theirs; down's is that of silu(gate) * up)."""
    from dataclasses import replace

    from jaxinfer.quantization import FP8_MAX

    out = []
    for layer in layers:
        s_in = jnp.max(jnp.abs(x.astype(jnp.float32))) / FP8_MAX
        gate, up = linear_many("te,ef->tf", x, (layer["gate"], layer["up"]))
        s_down = jnp.max(jnp.abs((jax.nn.silu(gate) * up).astype(jnp.float32))) / FP8_MAX
        out.append({"gate": replace(layer["gate"], input_scale=s_in), "up": replace(layer["up"], input_scale=s_in),
                    "down": replace(layer["down"], input_scale=s_down)})
    return out


def run(log: Log, shape: str, ms: list[int], num_layers: int, activation_scales: list[str]) -> list[dict]:
    hidden, intermediate = SHAPES[shape]
    layers = make_layers(hidden, intermediate, num_layers)
    rows = []
    for m in ms:
        x = (jax.random.normal(jax.random.key(100 + m), (m, hidden), jnp.float32)).astype(jnp.bfloat16)
        flops = 2 * m * 3 * hidden * intermediate
        want = mlp_reference(x, layers[0])
        variants = {name: (mlp, layers) for name, mlp in VARIANTS.items() if "dynamic" in activation_scales}
        if "static" in activation_scales:
            variants["engine_static"] = (mlp_engine, with_static_scales(layers, x))
        for name, (mlp, weights) in variants.items():
            # A residual add per layer chains the layers, so none is dead code and each reads the last one's output.
            def body(carry, layers, mlp=mlp):
                for layer in layers:
                    carry = (carry + mlp(carry, layer) * 1e-3).astype(carry.dtype)
                return carry

            seconds = time_in_loop(body, x, weights, unroll=4) / num_layers
            text = jax.jit(lambda x, layer, mlp=mlp: mlp(x, layer)).lower(x, weights[0]).compile().as_text()
            got = jax.jit(mlp)(x, weights[0]).astype(jnp.float32)
            rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            # Fusion kernels of one layer's program: a static scale's quantize should fuse into its producer.
            fusions = text.count(", kind=k")
            rows.append({"m": m, "variant": name, "ms_per_layer": 1e3 * seconds, "gemm_tflops": flops / seconds / 1e12,
                         "cublas_fp8_calls": text.count(CUBLAS_FP8), "fusions": fusions, "rel_error_vs_f32": rel})
            log(f"M={m} {name}: {1e3 * seconds:.3f} ms a layer, {flops / seconds / 1e12:.0f} TFLOP/s of GEMMs, "
                f"{text.count(CUBLAS_FP8)} cuBLASLt FP8 calls, {fusions} fusions, rel err {rel:.2e}")
        xq, xs = quantize_activations_fp8(x)
        h = jax.nn.silu(fp8_dot(xq, xs, layers[0]["gate"], jnp.float32)) * fp8_dot(xq, xs, layers[0]["up"], jnp.float32)
        hq, hs = quantize_activations_fp8(h.astype(x.dtype))
        seconds = time_calls(jax.jit(gemms_only), (xq, xs, hq, hs), layers) / num_layers
        rows.append({"m": m, "variant": "gemm_only", "ms_per_layer": 1e3 * seconds, "gemm_tflops": flops / seconds / 1e12})
        log(f"M={m} gemm_only: {1e3 * seconds:.3f} ms a layer, {flops / seconds / 1e12:.0f} TFLOP/s")
    return rows


def markdown(info: dict, ceilings: dict, rows: list[dict]) -> str:
    lines = [f"# W8A8 MLP block: float32 vs bfloat16 GEMM outputs, dynamic vs static activation scales ({info['device']}, jax {info['jax']}, {info['date']})", "",
             f"Command: `{info['command']}`  ", f"bf16 matmul rate this run: {ceilings['matmul_tflops']:.0f} TFLOP/s; "
             f"HBM read {ceilings['hbm_read_tbs']:.2f} TB/s.", "",
             "| M | variant | ms a layer | TFLOP/s of the GEMMs | cuBLASLt FP8 calls | fusions | rel. error vs f32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['m']} | {r['variant']} | {r['ms_per_layer']:.3f} | {r['gemm_tflops']:.0f} | "
                     f"{r.get('cublas_fp8_calls', '–')} | {r.get('fusions', '–')} | {r['rel_error_vs_f32']:.2e} |"
                     if "rel_error_vs_f32" in r else
                     f"| {r['m']} | {r['variant']} | {r['ms_per_layer']:.3f} | {r['gemm_tflops']:.0f} | – | – | – |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--ms", default="1024,8192", help="token counts (>= 128: the W8A8 path)")
    parser.add_argument("--layers", type=int, default=4, help="distinct layers' weights per timed program")
    parser.add_argument("--activation-scales", default="dynamic,static",
                        help="W8A8 activation scales to run: dynamic (engine, bf16_out), static (engine_static)")
    args = parser.parse_args()
    activation_scales = args.activation_scales.split(",")
    if not activation_scales or set(activation_scales) - {"dynamic", "static"}:
        parser.error(f"--activation-scales {args.activation_scales!r}: a comma list of dynamic, static")
    log = Log()
    info = header(log)
    ceilings = measure_ceilings(log)
    rows = run(log, args.shape, [int(m) for m in args.ms.split(",")], args.layers, activation_scales)
    results = {"info": info, "ceilings": ceilings, "rows": rows}
    write_results(args.out, NAME, results, markdown(info, ceilings, rows), log)


if __name__ == "__main__":
    main()

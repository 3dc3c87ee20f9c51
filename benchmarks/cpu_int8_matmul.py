"""Weight-only int8 matmuls on XLA:CPU against float32: the 30 layers' projections of SmolLM2-135M.

    python benchmarks/cpu_int8_matmul.py --rows 1,8 --rounds 2 --out DIR

Each variant runs the 210 projections of SmolLM2-135M's 30 layers (q, k, v, o, gate, up,
down; random weights) ``--iters`` times in one jitted ``fori_loop``, and reports milliseconds
per pass, wall and process CPU time (the machine may be shared: CPU time is what the pass
itself consumed, wall what it waited too), with the variants interleaved over ``--rounds``:

- ``f32``: the float32 weight, XLA's dot (the float32 model's path);
- ``xla_convert``: ``dot(x, w_int8.astype(f32))``, the weight converted in XLA (the int8
  path before the native kernel);
- ``xla_int8_dot``: x quantized per row to int8 and an ``int8 x int8 -> int32`` dot;
- ``ynn_convert``: ``xla_convert`` compiled with the YNNPACK dot fusion
  (``xla_cpu_experimental_ynn_fusion_type``), x padded to 2 rows (it takes no 1-row dot);
- ``native@T``: ``jaxinfer.cpu_int8_matmul`` on at most T threads.

Writes ``cpu_int8_matmul.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxinfer.cpu_int8_matmul import int8_matmul_cpu  # noqa: E402

NUM_LAYERS = 30
# [N, K] of q, k, v, o, gate, up, down in SmolLM2-135M.
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
CONTRACT_MINOR = (((1,), (1,)), ((), ()))
VARIANTS = ("f32", "xla_convert", "xla_int8_dot", "ynn_convert", "native@1", "native@2")


def project(variant: str, x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] float32 times the weight [N, K] -> [M, N] float32."""
    if variant == "f32":
        return jax.lax.dot_general(x, w, CONTRACT_MINOR, precision="highest")
    if variant in ("xla_convert", "ynn_convert"):
        rows = x.shape[0]
        if variant == "ynn_convert" and rows == 1:
            x = jnp.pad(x, ((0, 1), (0, 0)))
        return (jax.lax.dot_general(x, w.astype(jnp.float32), CONTRACT_MINOR, precision="highest") * scale)[:rows]
    if variant == "xla_int8_dot":
        x_scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127, 1e-12)
        xq = jnp.round(x / x_scale).astype(jnp.int8)
        y = jax.lax.dot_general(xq, w, CONTRACT_MINOR, preferred_element_type=jnp.int32)
        return y.astype(jnp.float32) * x_scale * scale
    if variant.startswith("native@"):
        return int8_matmul_cpu(x, w, scale, max_threads=int(variant.split("@")[1]))
    raise ValueError(f"unknown variant {variant!r}")


def make_weights(variant: str, rng: np.random.Generator) -> list[tuple[jax.Array, jax.Array]]:
    weights = []
    for _ in range(NUM_LAYERS):
        for n, k in SHAPES:
            payload = rng.integers(-127, 128, (n, k)).astype(np.int8)
            scale = np.full((n,), 0.01, np.float32)
            w = payload.astype(np.float32) * scale[:, None] if variant == "f32" else payload
            weights.append((jnp.asarray(w), jnp.asarray(scale)))
    return weights


def compile_pass(variant: str, rows: int, weights, iters: int):
    def one_pass(x, weights):
        def body(_, x):  # x [rows, 1536]: each projection reads its first K columns
            for w, scale in weights:
                n, k = w.shape
                y = project(variant, x[:, :k], w, scale)  # [rows, N]
                x = x + 1e-6 * jnp.pad(y, ((0, 0), (0, 1536 - n)))
            return x
        return jax.lax.fori_loop(0, iters, body, x)

    x = jnp.full((rows, 1536), 0.01, jnp.float32)
    options = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"} if variant == "ynn_convert" else {}
    return jax.jit(one_pass).lower(x, weights).compile(compiler_options=options), x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cores": os.cpu_count(), "jax": jax.__version__, "load_before": [round(x, 2) for x in os.getloadavg()]}
    print(info, flush=True)
    rng = np.random.default_rng(0)
    results = {"info": info, "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        programs = {}
        for variant in args.variants.split(","):
            weights = make_weights(variant, rng)
            program, x = compile_pass(variant, rows, weights, args.iters)
            program(x, weights).block_until_ready()
            nbytes = sum(w.nbytes for w, _ in weights)
            programs[variant] = (program, x, weights, nbytes)
        wall, cpu = {v: [] for v in programs}, {v: [] for v in programs}
        for _ in range(args.rounds):
            for variant, (program, x, weights, _) in programs.items():
                start_cpu, start = time.process_time(), time.perf_counter()
                program(x, weights).block_until_ready()
                wall[variant].append(1000 * (time.perf_counter() - start) / args.iters)
                cpu[variant].append(1000 * (time.process_time() - start_cpu) / args.iters)
        results["rows"][rows] = {}
        for variant, (_, _, _, nbytes) in programs.items():
            entry = {"wall_ms": min(wall[variant]), "cpu_ms": min(cpu[variant]), "weight_bytes": nbytes,
                     "gb_per_s_wall": nbytes / min(wall[variant]) / 1e6, "load": round(os.getloadavg()[0], 2)}
            results["rows"][rows][variant] = entry
            print(f"rows {rows} {variant:13s} wall {entry['wall_ms']:7.2f} ms  cpu {entry['cpu_ms']:7.2f} ms  "
                  f"{entry['gb_per_s_wall']:5.1f} GB/s  load {entry['load']}", flush=True)
        del programs
    info["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_int8_matmul.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

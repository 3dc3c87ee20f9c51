"""The residual add + RMSNorm of a decode step on the GPU: XLA's two kernels against one Pallas launch.

    python3 benchmarks/residual_norm_gpu.py --out DIR           [--smoke: CPU, interpreter, tiny shapes]

For steps of ``--rows`` tokens and hidden sizes ``--hidden`` (bf16; Llama-3.1-8B is 4096, SmolLM2-135M
576), ``add_rms_norm_reference`` (the model's add and norm as XLA compiles them) and
``add_rms_norm_gpu`` (``pallas_kernels.residual_norm``) are first compared on the device (largest
difference in units of the result's last place, share of bit-identical elements), then chained 128
times in one jit, each call's normed output fed back through an optimization barrier as the next
call's addend (in the model a projection sits there, so XLA cannot fuse one call into the next).
Reports µs a call. Rows past ``MAX_GPU_ROWS`` are timed too, to show why the model stops there.
Writes ``residual_norm_gpu.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernel_frontier as kf  # noqa: E402
from pallas_kernels.residual_norm import MAX_GPU_ROWS, add_rms_norm_gpu, add_rms_norm_reference  # noqa: E402

EPS = 1e-5


def last_place_differences(got: jax.Array, want: jax.Array) -> tuple[float, float]:
    """(largest |got - want| in units of want's last place, share of bit-identical elements)."""
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    mantissa_bits = jnp.finfo(want.dtype).nmant
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want32), np.finfo(np.float32).tiny))) - mantissa_bits)
    return float(np.max(np.abs(got32 - want32) / ulp)), float(np.mean(got32 == want32))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,8,16,32,64,256")
    parser.add_argument("--hidden", default="4096,576")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    rows_list = [1, 8] if args.smoke else [int(r) for r in args.rows.split(",")]
    hidden_list = [64, 96] if args.smoke else [int(h) for h in args.hidden.split(",")]
    interpret = args.smoke
    kf.REPEATS, kf.TIMED_RUNS = (2, 1) if args.smoke else (128, 5)
    device = jax.devices()[0]
    report = {"command": " ".join(["python3"] + sys.argv), "device": device.device_kind, "jax": jax.__version__,
              "platform": platform.platform(), "max_gpu_rows": MAX_GPU_ROWS, "chained_calls": kf.REPEATS,
              "results": []}
    kf.say(f"command: {report['command']}")
    kf.say(f"device: {device.device_kind}; jax {jax.__version__}")
    forms = {"xla": lambda x, d, w: add_rms_norm_reference(x, d, w, EPS),
             "pallas": lambda x, d, w: add_rms_norm_gpu(x, d, w, eps=EPS, interpret=interpret)}
    for hidden in hidden_list:
        for rows in rows_list:
            kx, kd, kw = jax.random.split(jax.random.key(rows * 7919 + hidden), 3)
            x = (jax.random.normal(kx, (rows, hidden)) * 4).astype(jnp.bfloat16)
            delta = jax.random.normal(kd, (rows, hidden), jnp.bfloat16)
            weight = (1 + 0.1 * jax.random.normal(kw, (hidden,))).astype(jnp.bfloat16)
            want = jax.jit(forms["xla"])(x, delta, weight)
            got = jax.jit(forms["pallas"])(x, delta, weight)
            row = {"rows": rows, "hidden": hidden, "sum_equal": bool(jnp.array_equal(got[0], want[0])),
                   "us": {}}
            row["norm_max_ulps"], row["norm_identical"] = last_place_differences(got[1], want[1])
            for name, form in forms.items():
                def step(carry, weight, form=form):
                    x, h = carry
                    return form(x, jax.lax.optimization_barrier(h), weight)
                seconds, _ = kf.time_chain(step, (x, delta), weight, donate=False)
                row["us"][name] = seconds * 1e6
            kf.say(f"E={hidden} T={rows}: XLA {row['us']['xla']:.2f} us, Pallas {row['us']['pallas']:.2f} us; "
                   f"sum equal {row['sum_equal']}, norm max {row['norm_max_ulps']:.0f} ulp, "
                   f"{100 * row['norm_identical']:.2f}% identical")
            report["results"].append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "residual_norm_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# Residual add + RMSNorm, bf16 ({report['device']}, jax {report['jax']})", "",
             f"Command: `{report['command']}`", "",
             f"µs a call, {kf.REPEATS} calls chained in one jit (median of {kf.TIMED_RUNS} runs). The model takes "
             f"the Pallas kernel for steps of <= {MAX_GPU_ROWS} tokens on one GPU.", "",
             "| hidden | rows | XLA add + norm | Pallas, one launch | Pallas / XLA | sum equal | norm: max ulp, identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        xla, ours = r["us"]["xla"], r["us"]["pallas"]
        lines.append(f"| {r['hidden']} | {r['rows']} | {xla:.2f} | {ours:.2f} | {ours / xla:.2f} | {r['sum_equal']} | "
                     f"{r['norm_max_ulps']:.0f}, {100 * r['norm_identical']:.2f}% |")
    with open(os.path.join(args.out, "residual_norm_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

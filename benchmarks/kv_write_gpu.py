"""One layer's K/V write into the paged pool on the GPU: XLA's two scatters against one Pallas launch.

    python3 benchmarks/kv_write_gpu.py --out DIR            [--smoke: CPU, interpreter, tiny shapes]

``write_kv_reference`` (the engine's write today: one XLA scatter for K, one for V) and
``gpu_write_kv.write_kv_gpu`` (K and V in one Pallas-Triton launch), on Llama-3.1-8B's 8 KV heads of
128, pages of 32 tokens, a pool of 4096 pages, bf16 and e4m3 pages, for steps of ``--tokens`` new
rows: decode-like (that many sequences, one row each, at random contexts) and prefill-like (one
fresh prompt of that many rows). Each write is chained 32 times in one jit with the pools donated
(in place, as in the engine; ``kernel_frontier.time_chain``), and checked equal to the reference
first. A third column writes V pages stored dim-major (``v_layout.write_kv_dim_major_v``: XLA's scatters,
K as before; ``JAXINFER_V_LAYOUT=dim_major``), checked against the reference's V transposed: what that
layout's write costs beside token-major's. Reports µs a call and the bytes moved (rows read + written)
per second, beside the HBM read ceiling measured in the same run. Writes ``kv_write_gpu.{json,md}`` into ``--out``.
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
from pallas_kernels.paged_attention.gpu_write_kv import write_kv_gpu  # noqa: E402
from pallas_kernels.paged_attention.reference import write_kv_reference  # noqa: E402
from pallas_kernels.paged_attention.v_layout import to_dim_major, write_kv_dim_major_v  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def step_inputs(num_tokens: int, kind: str, *, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                seed: int = 0):
    """(k_new, v_new, page_tables, cu_q_lens, kv_lens) of one step of ``num_tokens`` new rows."""
    rng = np.random.default_rng(seed)
    if kind == "decode":  # contexts up to 2048 tokens, as many as distinct pages allow
        q_lens = np.ones(num_tokens, np.int32)
        pages_per_seq = min(2048 // page_size, num_pages // num_tokens)
        kv_lens = rng.integers(1, pages_per_seq * page_size + 1, num_tokens).astype(np.int32)
    else:
        q_lens = np.array([num_tokens], np.int32)
        kv_lens = q_lens.copy()
        pages_per_seq = -(-num_tokens // page_size)
    if len(kv_lens) * pages_per_seq > num_pages:
        raise ValueError(f"{len(kv_lens)} x {pages_per_seq} pages do not fit a pool of {num_pages}")
    page_tables = rng.permutation(num_pages)[:len(kv_lens) * pages_per_seq].reshape(len(kv_lens), pages_per_seq)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    new = jax.random.normal(jax.random.key(seed), (2, num_tokens, num_kv_heads, head_dim), jnp.float32)
    return (new[0], new[1], jnp.asarray(page_tables, jnp.int32), jnp.asarray(cu_q_lens), jnp.asarray(kv_lens))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="8,64,256,1024,4096,16384")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads, head_dim, page_size, num_pages = (2, 64, 16, 64) if args.smoke else (8, 128, 32, 4096)
    tokens = [8, 20] if args.smoke else [int(t) for t in args.tokens.split(",")]
    interpret = args.smoke
    if args.smoke:
        kf.REPEATS, kf.TIMED_RUNS = 1, 1
    device = jax.devices()[0]
    report = {"command": " ".join(["python3"] + sys.argv), "device": device.device_kind, "jax": jax.__version__,
              "platform": platform.platform(), "results": []}
    kf.say(f"command: {report['command']}")
    kf.say(f"device: {device.device_kind}; jax {jax.__version__}")
    if not args.smoke:
        report["ceilings"] = kf.guarded("ceilings", kf.measure_ceilings)
    writers = {"xla_scatters": write_kv_reference,
               "pallas_one_launch": lambda *a: write_kv_gpu(*a, interpret=interpret),
               "xla_v_dim_major": write_kv_dim_major_v}
    dim_major_writers = {"xla_v_dim_major"}  # the writers whose V pool is dim-major
    for dtype_name, dtype in DTYPES.items():
        shape = (heads, num_pages, page_size, head_dim)
        pools_by_layout = {False: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                           True: (jnp.zeros(shape, dtype), to_dim_major(jnp.zeros(shape, dtype)))}
        for kind in ("decode", "prefill"):
            for t in tokens:
                if kind == "decode" and t > 1024:
                    continue
                k_new, v_new, *meta = step_inputs(t, kind, num_kv_heads=heads, head_dim=head_dim,
                                                  page_size=page_size, num_pages=num_pages)
                k_new, v_new = k_new.astype(dtype), v_new.astype(dtype)
                row = {"dtype": dtype_name, "kind": kind, "tokens": t, "us": {}, "gbps": {}}
                moved = 2 * 2 * k_new.size * k_new.dtype.itemsize  # K and V, read and written
                want = jax.jit(write_kv_reference)(k_new, v_new, *pools_by_layout[False], *meta)
                for name, write in writers.items():
                    dim_major = name in dim_major_writers
                    pools = pools_by_layout[dim_major]
                    got = jax.jit(write)(k_new, v_new, *[jnp.copy(p) for p in pools], *meta)
                    expected = (want[0], to_dim_major(want[1])) if dim_major else want
                    row.setdefault("equal", {})[name] = all(
                        bool(jnp.array_equal(g.astype(jnp.float32), w.astype(jnp.float32)))
                        for g, w in zip(got, expected))

                    def step(carry, k_new, v_new, *meta):
                        return write(k_new, v_new, *carry, *meta)
                    seconds, pools_by_layout[dim_major] = kf.time_chain(step, pools, k_new, v_new, *meta,
                                                                        donate=True)
                    row["us"][name] = seconds * 1e6
                    row["gbps"][name] = moved / seconds / 1e9
                    kf.say(f"{dtype_name} {kind} T={t}: {name} {seconds * 1e6:7.1f} us "
                           f"{moved / seconds / 1e9:7.0f} GB/s equal={row['equal'][name]}")
                report["results"].append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_write_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    ceiling = (report.get("ceilings") or {}).get("hbm_read_tbs")
    lines = [f"# K/V write, one layer ({report['device']}, jax {report['jax']})", "", f"Command: `{report['command']}`",
             "", f"HBM read ceiling in this run: {ceiling} TB/s. µs a call (32 chained, pools donated); GB/s of "
             "rows read and written (K and V).", "",
             "| pages | step | new rows | XLA scatters | Pallas, one launch | Pallas / XLA | XLA, V dim-major "
             "| V dim-major / XLA | equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        us, gbps = r["us"], r["gbps"]
        xla = us["xla_scatters"]
        cell = {n: f"{us[n]:.1f} µs ({gbps[n]:.0f} GB/s)" for n in us}
        cells = [cell["xla_scatters"], cell["pallas_one_launch"], f"{us['pallas_one_launch'] / xla:.2f}",
                 cell["xla_v_dim_major"], f"{us['xla_v_dim_major'] / xla:.2f}", str(all(r["equal"].values()))]
        lines.append(f"| {r['dtype']} | {r['kind']} | {r['tokens']} | {' | '.join(cells)} |")
    with open(os.path.join(args.out, "kv_write_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

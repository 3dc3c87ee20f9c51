"""Where the batch-1 decode step's time goes (Llama-3.1-8B shapes, random bf16 weights, one GPU).

    python3 benchmarks/latency_lab.py --out DIR

Times the jitted decode step (forward + greedy pick) of one sequence at a 384-token
context on the device alone (many steps inside one jitted loop, each feeding its token to
the next), in variants that isolate each cost: the token bucket (1 vs 8 rows), the
attention implementation (our Pallas kernel vs the plain-XLA reference vs none), and the
weight read alone (the same einsums with no attention, norms or rope: XLA's GEMV chain).
Each is compared with the roofline: weight bytes read per token / the HBM read ceiling.
Writes DIR/latency_lab.{json,md,log}.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import Log, header, measure_ceilings, random_model, time_in_loop, write_results  # noqa: E402

from jaxinfer.batch import build_step_batch  # noqa: E402
from jaxinfer.kv_cache import create_kv_cache  # noqa: E402
from jaxinfer.memory import weight_bytes  # noqa: E402
from jaxinfer.model import forward  # noqa: E402

NAME = "latency_lab"
CONTEXT = 384
PAGE_SIZE = 32


def decode_batch(num_tokens: int, num_seqs: int, max_pages: int):
    pages = list(range(1, CONTEXT // PAGE_SIZE + 2))
    return build_step_batch([([1], CONTEXT, pages)], num_tokens=num_tokens, num_seqs=num_seqs,
                            pages_per_seq=max_pages, padding_page=0)


def time_step(model, cache, num_tokens, num_seqs, impl, max_pages):
    batch = jax.tree.map(jnp.asarray, decode_batch(num_tokens, num_seqs, max_pages))

    def body(carry, weights):
        cache, batch = carry
        logits, cache = forward(weights, cache, batch, model.config, impl)
        token = jnp.argmax(logits[0]).astype(jnp.int32)
        batch = dataclasses.replace(batch, token_ids=batch.token_ids.at[0].set(token))
        return cache, batch

    return time_in_loop(body, (cache, batch), model.weights, min_seconds=0.2)


def time_weight_read(model, num_tokens):
    """The same weight einsums with nothing else: XLA's GEMV chain over every weight read per token."""

    def body(x, weights):
        for layer in weights.layers:
            q = jnp.einsum("te,ehd->thd", x, layer.q)
            k = jnp.einsum("te,ehd->thd", x, layer.k)
            v = jnp.einsum("te,ehd->thd", x, layer.v)
            attn = q + jnp.repeat(k + v, q.shape[1] // k.shape[1], axis=1)
            x = x + jnp.einsum("thd,hde->te", attn, layer.o)
            h = jax.nn.silu(jnp.einsum("te,ef->tf", x, layer.gate)) * jnp.einsum("te,ef->tf", x, layer.up)
            x = x + jnp.einsum("tf,fe->te", h, layer.down)
        logits = jnp.einsum("te,ev->tv", x, weights.lm_head, preferred_element_type=jnp.float32)
        return x + (jnp.max(logits) * 1e-30).astype(x.dtype)

    x = jnp.ones((num_tokens, model.config.hidden_size), jnp.bfloat16) * 0.01
    return time_in_loop(body, x, model.weights, min_seconds=0.2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b")
    args = parser.parse_args()
    log = Log()
    results = {"info": header(log)}
    results["ceilings"] = ceilings = measure_ceilings(log)
    model = random_model(args.shape)
    config = model.config
    per_token = weight_bytes(config, 2) - config.vocab_size * config.hidden_size * 2
    roofline = per_token / (ceilings["hbm_read_tbs"] * 1e12)
    log(f"roofline: {per_token / 1e9:.2f} GB / {ceilings['hbm_read_tbs']:.2f} TB/s = {roofline * 1e3:.3f} ms")
    cache = create_kv_cache(config, 64, PAGE_SIZE, jnp.bfloat16)
    max_pages = 2048 // PAGE_SIZE
    rows = []
    variants = [
        ("weights only (XLA GEMV chain), 1 row", None, 1, 1),
        ("weights only (XLA GEMV chain), 8 rows", None, 8, 8),
        ("decode step, pallas_gpu, bucket 8x8", "pallas_gpu", 8, 8),
        ("decode step, pallas_gpu, bucket 1x1", "pallas_gpu", 1, 1),
        ("decode step, reference (XLA), bucket 1x1", "reference", 1, 1),
        ("decode step, reference (XLA), bucket 8x8", "reference", 8, 8),
    ]
    for label, impl, t, b in variants:
        try:
            seconds = time_weight_read(model, t) if impl is None else time_step(model, cache, t, b, impl, max_pages)
        except Exception as error:  # reported, not hidden
            log(f"{label}: failed: {type(error).__name__}: {str(error)[:300]}")
            rows.append({"variant": label, "error": str(error)[:300]})
            continue
        rows.append({"variant": label, "ms": seconds * 1e3, "ratio_to_roofline": seconds / roofline,
                     "weights_tbs": per_token / seconds / 1e12})
        log(f"{label}: {seconds * 1e3:.3f} ms = {seconds / roofline:.2f}x roofline "
            f"({per_token / seconds / 1e12:.2f} TB/s of weights)")
    results["roofline_ms"] = roofline * 1e3
    results["variants"] = rows
    md = [f"# Batch-1 decode step, {args.shape}", "", f"Command: `{results['info']['command']}`  ",
          f"{results['info']['device']}, jax {results['info']['jax']}; HBM read ceiling {ceilings['hbm_read_tbs']:.2f} TB/s; "
          f"roofline {roofline * 1e3:.3f} ms ({per_token / 1e9:.2f} GB of weights per token)", "",
          "| variant | ms per step | x roofline | weight TB/s |", "| --- | --- | --- | --- |"]
    for r in rows:
        if "ms" in r:
            md.append(f"| {r['variant']} | {r['ms']:.3f} | {r['ratio_to_roofline']:.2f} | {r['weights_tbs']:.2f} |")
        else:
            md.append(f"| {r['variant']} | failed: {r['error'][:80]} | | |")
    write_results(args.out, NAME, results, "\n".join(md) + "\n", log)


if __name__ == "__main__":
    main()

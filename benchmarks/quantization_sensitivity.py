"""Which projections cost a quantized model its agreement, and what the scale choice buys (CPU).

    python benchmarks/quantization_sensitivity.py [--model smollm2-135m-instruct] [--out benchmarks/results]

The companion of ``benchmarks/quantization_accuracy.py`` (same passages, same engine scoring
program asked for the whole vocabulary, same metrics: top-1 agreement and mean KL against the
float32 model). Instead of one ``LLM`` per row it loads the float32 model once and swaps the
weights the scoring program reads, so a row can quantize *some* projection kinds (the others stay
float32: ``jaxinfer.linear`` takes either leaf; such rows run the quantized projections
dequantized, see :func:`quantize_some`) with a chosen ``scale_method`` (``jaxinfer.quantization``):

- every kind, fp8 and int8, absmax and MSE-searched scales, weight-only and (fp8) W8A8;
- one kind at a time (q, k, v, o, gate, up, down), fp8 weight-only: the sensitivity per kind;
- every kind but the most sensitive one (chosen from the rows above), fp8 weight-only: what
  leaving it dense would buy;
- every kind in every layer but the first and last few (kept float32), fp8 weight-only: what
  leaving the edge layers dense buys, beside the bytes it costs (``projection bytes``: the
  projections' bytes with the dense ones served in bfloat16, as a multiple of all-fp8).

For every row it also reports how many of its disagreements are near-ties of the baseline (top-2
log-probability within 0.1 and 0.5 nats of the top-1), since a 135M model's teacher-forced
distribution is often flat. Writes ``quantization_sensitivity.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.quantization_accuracy import load_texts, run_info  # noqa: E402

NO_W8A8 = 1 << 30
KINDS = ("q", "k", "v", "o", "gate", "up", "down")
NEAR_TIES = (0.1, 0.5)  # nats between the baseline's top-1 and top-2


def variants() -> list[dict]:
    """Rows: quantization, the kinds quantized, the scale method, W8A8 or weight-only."""
    rows = []
    for quantization in ("fp8", "int8"):
        for method in ("absmax", "mse"):
            rows.append({"quantization": quantization, "kinds": KINDS, "scale_method": method, "w8a8": False})
    for method in ("absmax", "mse"):
        rows.append({"quantization": "fp8", "kinds": KINDS, "scale_method": method, "w8a8": True})
    for kind in KINDS:
        rows.append({"quantization": "fp8", "kinds": (kind,), "scale_method": "mse", "w8a8": False})
    # Edge layers kept dense (negative indices count from the last layer).
    for dense_layers in ((0, -1), (0, 1, -2, -1), (0, 1, 2, 3, -4, -3, -2, -1)):
        rows.append({"quantization": "fp8", "kinds": KINDS, "scale_method": "mse", "w8a8": False,
                     "dense_layers": dense_layers})
    rows.append({"quantization": "fp8", "kinds": tuple(k for k in KINDS if k != "down"), "scale_method": "mse",
                 "w8a8": False, "dense_layers": (0, -1)})
    for row in rows:
        row.setdefault("dense_layers", ())
        row["name"] = _name(row)
    return rows


def _name(row: dict) -> str:
    kinds = ("all" if row["kinds"] == KINDS else
             "all but " + next(k for k in KINDS if k not in row["kinds"]) if len(row["kinds"]) == len(KINDS) - 1
             else "+".join(row["kinds"]))
    dense = row.get("dense_layers", ())
    if dense:
        first = sum(1 for i in dense if i >= 0)
        kinds += f" (first {first} and last {len(dense) - first} layers float32)"
    return f"{row['quantization']} {kinds}, {row['scale_method']} scales, {'W8A8' if row['w8a8'] else 'weight-only'}"


def projection_bytes_vs_quantized(dense, kinds, dense_layers) -> float:
    """The projections' bytes with ``kinds`` of every layer but ``dense_layers`` at 1 byte a weight
    and the rest at 2 (served in bfloat16), as a multiple of every projection at 1 byte."""
    from jaxinfer.params import QUANTIZED_PROJECTIONS

    total = weighted = 0
    for i, layer in enumerate(dense.layers):
        for kind in QUANTIZED_PROJECTIONS:
            size = getattr(layer, kind).size
            total += size
            weighted += size * (1 if kind in kinds and i not in dense_layers else 2)
    return weighted / total


def _schedule(planned: list[dict], rows: list[dict]):
    """The planned rows, with the single-kind rows first and then, from their results in ``rows``
    (appended as they run), every kind but the one whose row alone cost the most agreement."""
    singles = [v for v in planned if len(v["kinds"]) == 1]
    firsts = [v for v in planned if v["kinds"] == KINDS and v["quantization"] == "fp8" and not v["w8a8"]
              and not v["dense_layers"]]
    yield from firsts + singles
    measured = [r for r in rows if len(r["kinds"]) == 1 and r["quantization"] == "fp8"]
    if measured:
        worst = min(measured, key=lambda r: r["top1_agreement"])["kinds"][0]
        yield {"quantization": "fp8", "kinds": tuple(k for k in KINDS if k != worst), "scale_method": "mse",
               "w8a8": False, "dense_layers": (), "name": f"fp8 all but {worst}, mse scales, weight-only"}
    yield from (v for v in planned if v not in firsts and v not in singles)


def quantize_some(dense, quantization: str, kinds: tuple[str, ...], scale_method: str, as_dense: bool,
                  dense_layers: tuple[int, ...] = ()):
    """``dense`` Weights with the projections of ``kinds`` quantized (model layout -> [out..., in...])
    in every layer but ``dense_layers`` (indices into ``dense.layers``).

    ``as_dense``: each quantized projection dequantized back into the dense layout and dtype
    instead of a ``QuantizedWeight``. For weight-only rows that is the same product up to float32
    rounding order (the weight-only path multiplies the converted payload, then scales the
    output), and every such row reuses the float32 program instead of compiling its own mix of
    leaves, which on 2 shared cores is most of a row's time.
    """
    import jax
    import jax.numpy as jnp

    from jaxinfer.params import QUANTIZED_PROJECTIONS
    from jaxinfer.quantization import dequantize, quantize

    @functools.partial(jax.jit, static_argnums=(1,))
    def one(w, num_in):
        order = tuple(range(num_in, w.ndim)) + tuple(range(num_in))
        q = quantize(jnp.transpose(w, order), quantization, w.ndim - num_in, scale_method=scale_method)
        if not as_dense:
            return q
        num_out = w.ndim - num_in
        back = tuple(range(num_out, w.ndim)) + tuple(range(num_out))  # [out..., in...] -> [in..., out...]
        return jnp.transpose(dequantize(q, w.dtype), back)

    keep = {i % len(dense.layers) for i in dense_layers}
    layers = [layer if i in keep else
              dataclasses.replace(layer, **{k: one(getattr(layer, k), QUANTIZED_PROJECTIONS[k]) for k in kinds})
              for i, layer in enumerate(dense.layers)]
    return dataclasses.replace(dense, layers=layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--resume", action="store_true", help="keep the rows of an earlier run's JSON in --out "
                        "and run only the others (a row takes minutes on a shared 2-core machine)")
    args = parser.parse_args()

    import jax
    import numpy as np

    from jaxinfer import LLM
    from jaxinfer import linear as linear_module
    from jaxinfer.prompt_logprobs import bucket_for

    info = run_info()
    texts = load_texts()
    start = time.perf_counter()
    llm = LLM(args.model, dtype="float32", use_tqdm=False, warm_up=False, max_model_len=1024, max_num_seqs=8,
              enable_prefix_caching=False)
    scorer = llm.engine.prompt_scorer
    base = scorer._score.__wrapped__  # functools.partial(score_tokens, **the engine's arguments)
    vocab = llm.model.config.vocab_size
    dense = scorer.weights
    token_ids = {t["id"]: llm.tokenizer.encode(t["text"]) for t in texts}

    programs = {}

    def logprobs(weights, w8a8_min_tokens: int) -> dict:
        # One jit per threshold, since linear reads it when the program is traced; within one,
        # rows whose weights have the same structure and dtypes reuse the compiled programs.
        saved = linear_module.FP8_W8A8_MIN_TOKENS
        linear_module.FP8_W8A8_MIN_TOKENS = w8a8_min_tokens
        try:
            if w8a8_min_tokens not in programs:
                programs[w8a8_min_tokens] = jax.jit(functools.partial(base.func, **{**base.keywords, "num_top": vocab}))
            program = programs[w8a8_min_tokens]
            out = {}
            for pid, ids in token_ids.items():
                padded = np.zeros(bucket_for(len(ids)), np.int32)
                padded[:len(ids)] = ids
                _, top_ids, top_values = jax.device_get(program(weights, padded))
                num_rows = len(ids) - 1
                full = np.empty((num_rows, vocab), np.float32)
                np.put_along_axis(full, top_ids[:num_rows], top_values[:num_rows], axis=1)
                out[pid] = full
            return out
        finally:
            linear_module.FP8_W8A8_MIN_TOKENS = saved

    reference = logprobs(dense, NO_W8A8)
    ref_top2 = {pid: np.sort(lp, axis=1)[:, -2:] for pid, lp in reference.items()}
    print(f"baseline: {time.perf_counter() - start:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "quantization_sensitivity.json"
    rows = json.loads(saved.read_text())["rows"] if args.resume and saved.exists() else []
    if rows:
        info["resumed_from"] = sorted({r.get("date", "earlier run") for r in rows})
    for row in rows:  # rows kept from before the column existed
        row.setdefault("dense_layers", [])
        row.setdefault("projection_bytes", projection_bytes_vs_quantized(dense, row["kinds"], set()))
    done = {r["name"] for r in rows}
    for variant in _schedule(variants(), rows):
        if variant["name"] in done:
            continue
        t0 = time.perf_counter()
        # Rows of every kind run the real QuantizedWeight path (what the engine serves); the
        # weight-only rows of some kinds run dequantized copies (quantize_some).
        as_dense = (variant["kinds"] != KINDS or bool(variant["dense_layers"])) and not variant["w8a8"]
        weights = quantize_some(dense, variant["quantization"], variant["kinds"], variant["scale_method"], as_dense,
                                variant["dense_layers"])
        mine = logprobs(weights, linear_module.FP8_W8A8_MIN_TOKENS if variant["w8a8"] else NO_W8A8)
        agree = total = 0
        kls, near = [], {str(t): 0 for t in NEAR_TIES}
        for pid, p_log in reference.items():
            same = p_log.argmax(axis=1) == mine[pid].argmax(axis=1)
            agree += int(same.sum())
            total += same.size
            gap = ref_top2[pid][:, 1] - ref_top2[pid][:, 0]
            for t in NEAR_TIES:
                near[str(t)] += int(np.sum(~same & (gap < t)))
            kls.append(np.sum(np.exp(p_log) * (p_log - mine[pid]), axis=1))
        kl = np.concatenate(kls)
        dense_layers = {i % len(dense.layers) for i in variant["dense_layers"]}
        row = {**variant, "kinds": list(variant["kinds"]), "dense_layers": list(variant["dense_layers"]),
               "projection_bytes": projection_bytes_vs_quantized(dense, variant["kinds"], dense_layers),
               "date": info["date"], "top1_agreement": agree / total,
               "disagreements": total - agree, "positions": total, "disagreements_near_tie": near,
               "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{row['name']}: top-1 {row['top1_agreement']:.4f} KL {row['kl_mean']:.5f} "
              f"near-ties {near} ({row['seconds']:.0f} s)", flush=True)
        results = {"info": info, "rows": rows, "near_ties_nats": NEAR_TIES}
        (out / "quantization_sensitivity.json").write_text(json.dumps(results, indent=1))
        (out / "quantization_sensitivity.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    info = results["info"]
    t1, t2 = results["near_ties_nats"]
    lines = [
        "# Quantized weights: sensitivity per projection kind and scale choice (CPU, SmolLM2-135M-Instruct)",
        "",
        f"`{info['command']}` · {info['date']} · {info['cpu']} ({info['cores']} cores) · jax {info['jax']}"
        + (f" (rows kept from the run of {', '.join(info['resumed_from'])}: each row's `date` in the JSON)"
           if info.get("resumed_from") else ""),
        "",
        "Against the float32 model (the Q4_1 GGUF dequantized), teacher-forced over the passages of "
        "`benchmarks/data/quantization_accuracy_texts.jsonl`; kinds and layers not named stay float32. "
        "'projection bytes': the projections' bytes with the quantized ones at 1 byte a weight and the "
        "others served in bfloat16 (2), as a multiple of all of them quantized. "
        f"'near-tie' counts the disagreements where the baseline's top-2 is within {t1} / {t2} nats of its "
        "top-1.",
        "",
        "| row | top-1 agreement | mean KL | KL p99 | disagreements | of which near-tie "
        f"(< {t1} / < {t2} nats) | projection bytes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["rows"]:
        near = r["disagreements_near_tie"]
        lines.append(f"| {r['name']} | {100 * r['top1_agreement']:.2f}% | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | "
                     f"{r['disagreements']} / {r['positions']} | {near[str(t1)]} / {near[str(t2)]} | "
                     + (f"{r['projection_bytes']:.2f}x |" if "projection_bytes" in r else "|"))
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

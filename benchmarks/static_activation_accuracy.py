"""Static against dynamic FP8 activation scales: accuracy against float32 on CPU, real weights.

    python benchmarks/static_activation_accuracy.py [--model smollm2-135m-instruct] [--out benchmarks/results]

The evaluation text is ``quantization_accuracy.py``'s (``benchmarks/data/quantization_accuracy_texts.jsonl``,
~3,700 tokens); the static scales are calibrated (``jaxinfer.activation_calibration``) on a
*different* text, ``benchmarks/data/activation_calibration_texts.jsonl`` (a council report, Python,
a chat, planetary facts, a German letter; written for this benchmark), except the one row marked
as calibrated on the evaluated passages themselves (an upper bound for in-distribution scales).

Every configuration scores each passage teacher-forced in one step of the model's own forward
(``jaxinfer.model.hidden_states`` + ``compute_logits``; the step is the passage padded to a power
of two, 256-512 tokens, so FP8 runs W8A8: ``FP8_W8A8_MIN_TOKENS`` is 128). Which path ran is
checked on the traced program and recorded: its FP8 x FP8 dots, and its row-max reductions
(a dynamic W8A8 layer has four more than a static one). Reported against the float32 model:
top-1 agreement, mean KL(float32 || config) over the vocabulary, and the NLL of the text. The
fp8 weights are the float32 model's quantized as ``quantization="fp8"`` does at load (per-channel
scales, ``DEFAULT_SCALE_METHOD``); all rows share them, so the rows differ only in how
activations are scaled. Writes ``static_activation_scales.json`` and ``.md`` into ``--out``.
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
sys.path.insert(0, str(REPO / "benchmarks"))

import jax  # noqa: E402

from common import count_fp8_dots, jaxpr_equations  # noqa: E402
from quantization_accuracy import PUBLISHED, load_texts, run_info  # noqa: E402

CALIBRATION_TEXTS = REPO / "benchmarks" / "data" / "activation_calibration_texts.jsonl"
PAGE_SIZE = 16
# (name, percentile of the calibration tokens' absmax, margin); None: dynamic per-token scales.
STATIC_VARIANTS = [
    ("static: largest absmax", 100.0, 1.0),
    ("static: 99.9th percentile of token absmax", 99.9, 1.0),
    ("static: 99th percentile of token absmax", 99.0, 1.0),
    ("static: largest absmax x 1.5", 100.0, 1.5),
]


@functools.partial(jax.jit, static_argnames=("config",))
def passage_logprobs(weights, token_ids, length, *, config):
    """[T, V] float32 log-probabilities of the next token after each of ``token_ids``' first
    ``length`` positions, from one step of the serving forward."""
    from jaxinfer.activation_calibration import one_sequence_step
    from jaxinfer.model import compute_logits, hidden_states

    batch, cache = one_sequence_step(token_ids, length, config, PAGE_SIZE, weights.embed.dtype)
    x, _ = hidden_states(weights, cache, batch, config)
    return jax.nn.log_softmax(compute_logits(weights, x), axis=-1)


def path_check(model, num_tokens: int) -> dict:
    """What the traced step of ``num_tokens`` runs: FP8 x FP8 dots and row-max reductions."""
    import numpy as np

    jaxpr = jax.make_jaxpr(functools.partial(passage_logprobs, config=model.config))(
        model.weights, np.zeros(num_tokens, np.int32), np.int32(num_tokens)).jaxpr
    eqns = list(jaxpr_equations(jaxpr))
    fp8_dots = count_fp8_dots(eqns)
    return {"num_tokens": num_tokens, "fp8_x_fp8_dots": fp8_dots,
            "reduce_max": sum(e.primitive.name == "reduce_max" for e in eqns)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()

    import numpy as np

    from jaxinfer.activation_calibration import scales_from_token_absmax, token_absmax
    from jaxinfer.activation_scales import input_scales, with_static_input_scales
    from jaxinfer.checkpoint import load_model, quantize_weights
    from jaxinfer.prompt_logprobs import bucket_for
    from jaxinfer.quantization import DEFAULT_SCALE_METHOD

    info = run_info()
    start = time.perf_counter()
    dense = load_model(args.model, "float32")
    fp8 = dataclasses.replace(dense, config=dataclasses.replace(dense.config, quantization="fp8"),
                              weights=quantize_weights(dense.weights, "fp8"))
    tokenizer = dense.tokenizer
    texts = load_texts()
    passages = {t["id"]: tokenizer.encode(t["text"]) for t in texts}
    calibration = [tokenizer.encode(json.loads(line)["text"]) for line in CALIBRATION_TEXTS.read_text().splitlines()
                   if line.strip()]
    calibration_absmax = token_absmax(fp8, calibration, page_size=PAGE_SIZE)
    evaluation_absmax = token_absmax(fp8, list(passages.values()), page_size=PAGE_SIZE)
    print(f"loaded, quantized and calibrated in {time.perf_counter() - start:.0f} s "
          f"({sum(map(len, calibration))} calibration tokens)", flush=True)

    variants = [("dynamic (per-token scales)", fp8, None)]
    for name, percentile, margin in STATIC_VARIANTS:
        scales = scales_from_token_absmax(calibration_absmax, percentile=percentile, margin=margin)
        variants.append((name, with_static_input_scales(fp8, scales), {"percentile": percentile, "margin": margin}))
    variants.append(("static: largest absmax, calibrated on the evaluated passages (upper bound)",
                     with_static_input_scales(fp8, scales_from_token_absmax(evaluation_absmax)),
                     {"percentile": 100.0, "margin": 1.0, "calibrated_on": "the evaluation text"}))

    buckets = sorted({bucket_for(len(ids)) for ids in passages.values()})
    rows = [{"name": name, "calibration": calib, "paths": [path_check(model, b) for b in buckets],
             "passages": {}} for name, model, calib in variants]
    for row, (_, model, _) in zip(rows[1:], variants[1:]):
        # The share of the evaluated tokens with an input value past the static range (clipped).
        scales = input_scales(model)
        row["evaluation_tokens_saturated"] = {g: float(np.mean(evaluation_absmax[g] > 448 * s[:, None]))
                                              for g, s in scales.items()}
    for pid, ids in passages.items():
        padded = np.zeros(bucket_for(len(ids)), np.int32)
        padded[:len(ids)] = ids
        n = len(ids) - 1  # positions with a next token
        reference = np.asarray(jax.device_get(passage_logprobs(dense.weights, padded, np.int32(len(ids)),
                                                               config=dense.config)))[:n]
        ref_top1 = reference.argmax(axis=1)
        ref_nll = -float(np.mean(reference[np.arange(n), ids[1:]]))
        for row, (name, model, _) in zip(rows, variants):
            got = np.asarray(jax.device_get(passage_logprobs(model.weights, padded, np.int32(len(ids)),
                                                             config=model.config)))[:n]
            kl = np.sum(np.exp(reference) * (reference - got), axis=1)
            row["passages"][pid] = {"tokens": len(ids), "top1_agree": int(np.sum(got.argmax(axis=1) == ref_top1)),
                                    "kl_sum": float(kl.sum()), "nll": -float(np.mean(got[np.arange(n), ids[1:]])),
                                    "baseline_nll": ref_nll}
        print(f"  {pid} ({len(ids)} tokens) {time.perf_counter() - start:.0f} s", flush=True)
    positions = sum(len(ids) - 1 for ids in passages.values())
    for row in rows:
        row["top1_agreement"] = sum(p["top1_agree"] for p in row["passages"].values()) / positions
        row["kl_mean"] = sum(p["kl_sum"] for p in row["passages"].values()) / positions
        row["nll"] = sum(p["nll"] * (p["tokens"] - 1) for p in row["passages"].values()) / positions
    baseline_nll = sum(p["baseline_nll"] * (p["tokens"] - 1) for p in rows[0]["passages"].values()) / positions
    results = {"info": info, "model": args.model, "scale_method": DEFAULT_SCALE_METHOD["fp8"],
               "positions": positions, "calibration_tokens": sum(map(len, calibration)),
               "baseline_nll": baseline_nll, "rows": rows, "published": PUBLISHED,
               "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "static_activation_scales.json").write_text(json.dumps(results, indent=1))
    (out / "static_activation_scales.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    info = results["info"]
    lines = [
        "# FP8 W8A8: static against dynamic activation scales (CPU, SmolLM2-135M-Instruct)",
        "",
        f"`{info['command']}` · {info['date']} · {info['cpu']} ({info['cores']} cores) · jax {info['jax']} · "
        f"{results['seconds']:.0f} s",
        "",
        f"Against the float32 model (the default model's Q4_1 GGUF dequantized), teacher-forced over "
        f"{results['positions']} positions of `benchmarks/data/quantization_accuracy_texts.jsonl`, each passage one "
        f"step of 256-512 tokens (W8A8). fp8 weights: per-channel `{results['scale_method']}` scales, the same in "
        f"every row. Static scales calibrated on `benchmarks/data/activation_calibration_texts.jsonl` "
        f"({results['calibration_tokens']} tokens of other text) unless the row says otherwise. Path check: the "
        f"traced step's FP8 x FP8 dots and row-max reductions (per bucket). Saturated: the share of the evaluated "
        f"tokens whose absmax lies past the static range (448 x scale), per input (qkv / o / gate_up / down). "
        f"Baseline NLL {results['baseline_nll']:.3f}.",
        "",
        "| activation scales | top-1 agreement | mean KL (nats) | NLL | FP8 dots / row-max (per bucket) | "
        "saturated tokens (qkv / o / gate_up / down) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        paths = "; ".join(f"{p['num_tokens']}: {p['fp8_x_fp8_dots']} / {p['reduce_max']}" for p in row["paths"])
        sat = row.get("evaluation_tokens_saturated")
        sat_cell = " / ".join(f"{100 * sat[g]:.2f}%" for g in ("qkv", "o", "gate_up", "down")) if sat else "—"
        lines.append(f"| {row['name']} | {100 * row['top1_agreement']:.2f}% | {row['kl_mean']:.4f} | "
                     f"{row['nll']:.3f} | {paths} | {sat_cell} |")
    lines += ["", "Published, for context (a different model and metric: task-accuracy recovery):", "",
              "| model | metric | result |", "| --- | --- | --- |"]
    lines += [f"| {m} | {metric} | {value} |" for m, metric, value in results["published"]]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

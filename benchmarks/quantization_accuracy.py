"""Accuracy of quantized serving against the float32 model, on CPU with real weights.

    python benchmarks/quantization_accuracy.py [--model smollm2-135m-instruct] [--out benchmarks/results]

Teacher-forced over the passages of ``benchmarks/data/quantization_accuracy_texts.jsonl`` (written
for this benchmark: prose, code, dialogue, a recipe, worked maths, verse, French; about 3,700
tokens with SmolLM2's tokenizer), each configuration of :data:`CONFIGS` against the baseline (the
first row):

- **top-1 agreement**: the share of positions whose most likely next token is the baseline's;
- **mean KL(baseline || config)** over the whole vocabulary at each position;

both from the engine's prompt-scoring program (``jaxinfer.prompt_logprobs.score_tokens``, the
program behind ``SamplingParams(prompt_logprobs=k)``, with the engine's own arguments) asked for
every token instead of the top 20; on the first passage the public path (``LLM.generate`` with
``prompt_logprobs=1``) is run too, and its top-1 must match (``public_top1_mismatches``);
- the mean negative log-likelihood of the text (the baseline's perplexity beside each);
- **greedy continuations** of a prompt set: how many leading tokens match the baseline's.

A configuration is a row of ``LLM`` arguments (``quantization``, ``kv_cache_dtype``, ``dtype``:
float32 unless the row says otherwise); ``fp8_w8a8_min_tokens`` overrides
``jaxinfer.linear.FP8_W8A8_MIN_TOKENS`` for that row (the passages are scored in buckets of 256-512
tokens, so fp8 rows run W8A8 unless told otherwise; decode steps run weight-only). The bfloat16
row is the same model served in bfloat16 (weights, activations and KV cache, as ``dtype="bfloat16"``
serves it): how much of a quantized row's gap any 16-bit rounding already costs this model.
``--resume`` keeps the rows of an earlier run's JSON in ``--out`` that this run does not redo
(the baseline always runs; it is deterministic, so kept rows compare against the same logits).

The default model's only checkpoint is a Q4_1 GGUF: the baseline is those Q4_1 weights
dequantized to float32, and every quantized row re-quantizes that baseline (with the default
per-channel scales: ``jaxinfer.quantization.DEFAULT_SCALE_METHOD``, recorded in the results).
Writes ``quantization_accuracy.json`` and ``.md`` into ``--out``. Per-projection sensitivity and
the scale choices compared: ``benchmarks/quantization_sensitivity.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEXTS = REPO / "benchmarks" / "data" / "quantization_accuracy_texts.jsonl"
NO_W8A8 = 1 << 30

# name -> LLM arguments; the first row is the baseline every other row is compared with.
CONFIGS = [
    {"name": "float32 (baseline)", "llm": {}},
    {"name": "fp8 weights (W8A8 when scoring)", "llm": {"quantization": "fp8"}},
    {"name": "fp8 weights (weight-only everywhere)", "llm": {"quantization": "fp8"}, "fp8_w8a8_min_tokens": NO_W8A8,
     "optional": True},
    # What JAXINFER_DECODE_MATMUL=wgmma decodes with (gpu_wgmma.py: W8A8 at every step size).
    {"name": "fp8 weights (W8A8 everywhere)", "llm": {"quantization": "fp8"}, "fp8_w8a8_min_tokens": 1,
     "optional": True},
    {"name": "int8 weights (weight-only)", "llm": {"quantization": "int8"}},
    {"name": "bfloat16 weights, activations and KV", "llm": {"dtype": "bfloat16"}},
    {"name": "fp8 KV cache (float32 weights)", "llm": {"kv_cache_dtype": "fp8"}},
    {"name": "fp8 weights (W8A8 when scoring) + fp8 KV cache", "llm": {"quantization": "fp8", "kv_cache_dtype": "fp8"}},
]

GREEDY_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village by the sea,",
    "To make a cup of tea, first",
    "The capital of Japan is Tokyo. The capital of Italy is",
    "Photosynthesis is the process by which",
    "Dear Sir or Madam,\n\nI am writing to",
    "Q: What is 12 times 12?\nA:",
]

# RedHatAI's published evaluations of FP8 Llama-3.1-8B-Instruct (model cards), for context: a
# different model (60x larger), other metrics (task accuracy recovery, not token agreement).
PUBLISHED = [
    ("RedHatAI (Neural Magic) Meta-Llama-3.1-8B-Instruct-FP8: per-tensor static W8A8, compressed-tensors `FP8`",
     "OpenLLM v1 average score",
     "73.44 vs 73.79 unquantized: 99.5% recovery (model card, https://huggingface.co/neuralmagic/"
     "Meta-Llama-3.1-8B-Instruct-FP8; RedHatAI/ is the same repository's current name)"),
    ("RedHatAI (Neural Magic) Meta-Llama-3.1-8B-Instruct-FP8-dynamic: per-channel weights, per-token activations, "
     "`FP8_DYNAMIC`", "recovery vs unquantized",
     "Arena-Hard 105.4%, OpenLLM v1 99.7%, OpenLLM v2 101.2%, HumanEval pass@1 100.0%, HumanEval+ 101.0% "
     "(model card, https://huggingface.co/neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8-dynamic)"),
]


def load_texts() -> list[dict]:
    return [json.loads(line) for line in TEXTS.read_text().splitlines() if line.strip()]


def full_logprobs(llm, token_ids: list[int]):
    """[T-1, V] float32 log-probabilities of every vocabulary token after each prefix of
    ``token_ids``: the engine's scoring program with ``num_top`` = the vocabulary."""
    import jax
    import numpy as np

    from jaxinfer.prompt_logprobs import bucket_for

    scorer = llm.engine.prompt_scorer
    base = scorer._score.__wrapped__  # functools.partial(score_tokens, **the engine's arguments)
    vocab = llm.model.config.vocab_size
    from jaxinfer import linear as linear_module

    # Keyed by the W8A8 threshold too: it is read when the program is traced, and jit would
    # otherwise hand one row's trace to the next (same weight shapes and dtypes).
    full = _full_program(base.func, tuple(sorted({**base.keywords, "num_top": vocab}.items())),
                         linear_module.FP8_W8A8_MIN_TOKENS)
    padded = np.zeros(bucket_for(len(token_ids)), np.int32)
    padded[:len(token_ids)] = token_ids
    _, top_ids, top_values = jax.device_get(full(scorer.weights, padded))
    rows = len(token_ids) - 1
    out = np.empty((rows, vocab), np.float32)
    np.put_along_axis(out, top_ids[:rows], top_values[:rows], axis=1)
    return out


@functools.cache
def _full_program(func, keywords, fp8_w8a8_min_tokens):
    import jax

    return jax.jit(functools.partial(func, **dict(keywords)))


def evaluate(config: dict, model: str, texts: list[dict], baseline: dict | None, max_tokens: int) -> dict:
    import numpy as np

    from jaxinfer import LLM, SamplingParams
    from jaxinfer import linear as linear_module
    from jaxinfer.quantization import DEFAULT_SCALE_METHOD

    threshold = linear_module.FP8_W8A8_MIN_TOKENS
    linear_module.FP8_W8A8_MIN_TOKENS = config.get("fp8_w8a8_min_tokens", threshold)
    start = time.perf_counter()
    try:
        with LLM(model, use_tqdm=False, warm_up=False, max_model_len=1024, max_num_seqs=8,
                 enable_prefix_caching=False, **{"dtype": "float32", **config["llm"]}) as llm:
            loaded_s = time.perf_counter() - start
            tokenizer = llm.tokenizer
            result = {"name": config["name"], "llm": config["llm"], "load_s": loaded_s, "passages": {},
                      "fp8_w8a8_min_tokens": linear_module.FP8_W8A8_MIN_TOKENS,
                      "scale_method": DEFAULT_SCALE_METHOD.get(config["llm"].get("quantization"))}
            logprobs = {}
            for i, text in enumerate(texts):
                ids = tokenizer.encode(text["text"])
                full = full_logprobs(llm, ids)  # [T-1, V]
                top1 = full.argmax(axis=1)
                entry = {"tokens": len(ids), "nll": -float(np.mean(full[np.arange(len(ids) - 1), ids[1:]])),
                         "top1": top1.tolist()}
                if i == 0:
                    # The public path (LLM.generate with prompt_logprobs) runs the same scoring program
                    # for its top 20: its top-1 must be the full distribution's.
                    scored = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1),
                                          use_tqdm=False)[0]
                    public = [max(row, key=row.get) for row in scored.prompt_logprobs[1:]]
                    entry["public_top1_mismatches"] = int(np.sum(np.asarray(public) != top1))
                logprobs[text["id"]] = full
                result["passages"][text["id"]] = entry
                print(f"  {config['name']}: {text['id']} ({len(ids)} tokens) {time.perf_counter() - start:.0f} s",
                      flush=True)
            outs = llm.generate(GREEDY_PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                use_tqdm=False)
            result["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
            result["greedy_text"] = [o.outputs[0].text for o in outs]
    finally:
        linear_module.FP8_W8A8_MIN_TOKENS = threshold
    result["seconds"] = time.perf_counter() - start
    if baseline is None:
        result["_logprobs"] = logprobs
        return result
    agree = total = 0
    kls = []
    for text in texts:
        mine, ref = result["passages"][text["id"]], baseline["passages"][text["id"]]
        same = np.asarray(mine["top1"]) == np.asarray(ref["top1"])
        agree += int(same.sum())
        total += same.size
        p_log = baseline["_logprobs"][text["id"]]
        kl = np.sum(np.exp(p_log) * (p_log - logprobs[text["id"]]), axis=1)  # [T-1]
        mine["kl_mean"] = float(kl.mean())
        mine["top1_agreement"] = float(same.mean())
        kls.append(kl)
    result["top1_agreement"] = agree / total
    result["kl_mean"] = float(np.concatenate(kls).mean())
    result["kl_p99"] = float(np.percentile(np.concatenate(kls), 99))
    prefixes = [_common_prefix(a, b) for a, b in zip(result["greedy"], baseline["greedy"])]
    result["greedy_common_prefix"] = prefixes
    return result


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def markdown(results: dict) -> str:
    info = results["info"]
    rows = results["configs"]
    base = rows[0]
    n_tokens = sum(p["tokens"] - 1 for p in base["passages"].values())
    max_tokens = results["greedy_max_tokens"]
    lines = [
        "# Quantized weights: accuracy against float32 (CPU, SmolLM2-135M-Instruct)",
        "",
        f"`{info['command']}` · {info['date']} · {info['cpu']} ({info['cores']} cores) · jax {info['jax']}"
        + (" (rows not run here kept from " + "; ".join(f"`{run}`" for run in info["resumed_rows_from"]) + ")"
           if info.get("resumed_rows_from") else ""),
        "",
        f"Baseline: the default model's Q4_1 GGUF dequantized to float32 (no bf16/f32 safetensors of it are "
        f"on this machine), so each quantized row re-quantizes already-Q4_1 values. Teacher-forced over "
        f"{len(base['passages'])} passages ({n_tokens} scored positions) of "
        f"`benchmarks/data/quantization_accuracy_texts.jsonl`; activations float32 (fp8 emulated on CPU). "
        f"Per-channel weight scales: {_scale_methods(rows)}. "
        f"Targets (issue 18): fp8 weights top-1 ≥ 97%, mean KL ≤ 0.02. The bfloat16 row serves the same "
        f"model in bfloat16 (weights, activations, KV cache): what 16-bit rounding alone costs it, for scale. "
        f"Which projections and layers cost the agreement, and absmax against searched scales: "
        f"`quantization_sensitivity.md`.",
        "",
        "| configuration | top-1 agreement | mean KL (nats) | KL p99 | NLL (baseline "
        f"{_mean_nll(base):.3f}) | greedy: identical leading tokens of {max_tokens} (mean; per prompt) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows[1:]:
        prefixes = row["greedy_common_prefix"]
        lines.append(
            f"| {row['name']} | {100 * row['top1_agreement']:.2f}% | {row['kl_mean']:.4f} | {row['kl_p99']:.3f} | "
            f"{_mean_nll(row):.3f} | {sum(prefixes) / len(prefixes):.1f}; {', '.join(map(str, prefixes))} |")
    lines += ["", "Per passage (top-1 agreement / mean KL):", "",
              "| passage | tokens | " + " | ".join(r["name"] for r in rows[1:]) + " |",
              "| --- | --- | " + " | ".join("---" for _ in rows[1:]) + " |"]
    for pid, p in base["passages"].items():
        cells = [f"{100 * r['passages'][pid]['top1_agreement']:.1f}% / {r['passages'][pid]['kl_mean']:.4f}"
                 for r in rows[1:]]
        lines.append(f"| {pid} | {p['tokens']} | " + " | ".join(cells) + " |")
    lines += ["", "Published, for context (a different model and metric: task-accuracy recovery):", "",
              "| model | metric | result |", "| --- | --- | --- |"]
    lines += [f"| {m} | {metric} | {value} |" for m, metric, value in results["published"]]
    lines.append("")
    return "\n".join(lines)


def _scale_methods(rows: list[dict]) -> str:
    methods = {r["llm"]["quantization"]: r["scale_method"] for r in rows if r.get("scale_method")}
    return ", ".join(f"{q} `{m}`" for q, m in sorted(methods.items())) or "absmax (rows from before the scale search)"


def run_info() -> dict:
    """The command, date, CPU and jax of this run (printed, and kept in the results)."""
    import jax

    info = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "jax": jax.__version__,
            "backend": jax.default_backend()}
    print(info, flush=True)
    return info


def _mean_nll(row: dict) -> float:
    passages = row["passages"].values()
    return sum(p["nll"] * (p["tokens"] - 1) for p in passages) / sum(p["tokens"] - 1 for p in passages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--configs", default=None, help="';'-separated names of CONFIGS rows to run "
                        "(the baseline always runs); default: every row not marked optional")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--resume", action="store_true", help="keep the rows of --out's earlier JSON that this "
                        "run does not redo (a row takes ~15 min on a shared 2-core machine)")
    args = parser.parse_args()

    info = run_info()
    texts = load_texts()
    wanted = ([c for c in CONFIGS[1:] if not c.get("optional")] if args.configs is None
              else [c for c in CONFIGS[1:] if c["name"] in args.configs.split(";")])
    baseline = evaluate(CONFIGS[0], args.model, texts, None, args.greedy_tokens)
    print(f"{baseline['name']}: {baseline['seconds']:.0f} s", flush=True)
    rows = [baseline]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "quantization_accuracy.json"
    if args.resume and saved.exists():
        earlier = json.loads(saved.read_text())
        if earlier["greedy_max_tokens"] != args.greedy_tokens:
            raise SystemExit(f"--resume: the earlier run used --greedy-tokens {earlier['greedy_max_tokens']}")
        redo = {c["name"] for c in wanted}
        rows += [r for r in earlier["configs"][1:] if r["name"] not in redo]
        # Every earlier run whose rows are kept, the oldest first (a run resumed from one resumed before).
        info["resumed_rows_from"] = [*earlier["info"].get("resumed_rows_from", []),
                                     earlier["info"]["command"] + " · " + earlier["info"]["date"]]
    for config in wanted:
        row = evaluate(config, args.model, texts, baseline, args.greedy_tokens)
        print(f"{row['name']}: top-1 {row['top1_agreement']:.4f} KL {row['kl_mean']:.5f} "
              f"greedy prefixes {row['greedy_common_prefix']} ({row['seconds']:.0f} s)", flush=True)
        rows.append(row)
        # Written after each row: a slow machine still leaves the rows it finished.
        results = {"info": info, "configs": [{k: v for k, v in r.items() if k != "_logprobs"} for r in rows],
                   "greedy_prompts": GREEDY_PROMPTS, "greedy_max_tokens": args.greedy_tokens, "published": PUBLISHED}
        (out / "quantization_accuracy.json").write_text(json.dumps(results, indent=1))
        (out / "quantization_accuracy.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

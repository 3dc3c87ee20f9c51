"""FP8 KV cache accuracy on real weights: teacher-forced agreement with the float32 model (CPU).

    python3 benchmarks/kv_cache_accuracy.py --out benchmarks/results [--model smollm2-135m-instruct]

Scored text: the passages of ``benchmarks/data/quantization_accuracy_texts.jsonl`` (the weight
quantization report's, so the rows of both reports are measured on the same tokens). Calibration
text, for the calibrated-scales row: ``benchmarks/data/kv_calibration_text.txt``, never scored.

Every configuration runs through the engine's prompt scoring (``prompt_logprobs``, with its KV
cache stored in the configuration's ``kv_cache_dtype`` and scales) and is compared at every
position of every passage with the float32 model (float32 weights and KV pages):

- mean KL(float32 || configuration) over the whole vocabulary, from the scoring program behind
  ``prompt_logprobs`` (``jaxinfer.prompt_logprobs.score_tokens`` with the engine's arguments: its
  KV dtype and scales) asked for every token instead of the top 20;
- top-1 agreement: the configuration's most likely next token is the float32 model's (the argmax
  of the same distributions: what ``prompt_logprobs=1`` returns first);
- the perplexity of the text and the mean |change| of each actual next token's logprob;
- greedy continuations (``--generate-tokens``) of each passage's first 12 tokens: identical
  share, and the mean number of leading tokens equal to the float32 model's.

Configurations: float32 weights with an FP8 KV cache (scales 1.0, and calibrated scales), bf16
weights and KV for context, and, where this tree's ``LLM`` takes ``quantization=`` (issue 18's
weight layer), FP8 weights alone and with the FP8 KV cache. All LLMs given a loaded model share
its weights, so each passage is scored by every configuration while its float32 distributions are
in memory. On the CPU, FP8 is emulated by XLA exactly to the format.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from common import Log, header, write_results  # noqa: E402
from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.checkpoint import load_model  # noqa: E402
from jaxinfer.kv_calibration import calibrate_kv_scales  # noqa: E402
from jaxinfer.prompt_logprobs import bucket_for, score_tokens  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
SCORED_TEXT = DATA / "quantization_accuracy_texts.jsonl"
CALIBRATION_TEXT = DATA / "kv_calibration_text.txt"
GREEDY_PROMPT_TOKENS = 12
LLM_OPTIONS = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, num_pages=128, page_size=16,
                   warm_up=False, use_tqdm=False, max_wait_s=0.0)


def calibration_passages(path: Path) -> list[str]:
    """The passages of a ``=====``-separated file (``#`` notes before the first separator)."""
    return [chunk.strip("\n") for chunk in path.read_text().split("\n=====\n")[1:] if chunk.strip()]


def full_logprobs(llm: LLM, token_ids: list[int]) -> np.ndarray:
    """[T-1, V] log-probabilities of every token after each prefix: the engine's scoring program
    (its KV dtype and scales) asked for the whole vocabulary instead of the top 20."""
    program = _full_vocab_program(llm)
    padded = np.zeros(bucket_for(len(token_ids)), np.int32)
    padded[:len(token_ids)] = token_ids
    scorer = llm.engine.prompt_scorer
    _, top_ids, top_values = jax.device_get(program(scorer.weights, padded, scorer.kv_scales))
    rows = len(token_ids) - 1
    out = np.empty((rows, top_ids.shape[1]), np.float32)
    np.put_along_axis(out, top_ids[:rows], top_values[:rows], axis=1)
    return out


@functools.cache
def _full_vocab_program(llm: LLM):
    engine = llm.engine
    return jax.jit(functools.partial(
        score_tokens, config=engine.runner.config, page_size=engine.config.page_size,
        chunk_rows=engine.prompt_scorer.chunk_rows, num_top=engine.runner.config.vocab_size,
        attention_impl=engine.config.attention_impl, kv_dtype=engine.runner.cache.k[0].dtype,
    ))


class Comparison:
    """Running sums of one configuration's differences from the float32 model."""

    def __init__(self):
        self.agree, self.kl, self.target_change, self.nll, self.reference_nll = [], [], [], [], []

    def add(self, reference: np.ndarray, other: np.ndarray, targets: list[int]) -> None:
        """``reference``, ``other``: [rows, V] log-probabilities; ``targets``: each row's actual next token."""
        p = np.exp(reference)
        self.kl.extend(np.sum(p * (reference - other), axis=-1).tolist())
        self.agree.extend((np.argmax(reference, axis=-1) == np.argmax(other, axis=-1)).tolist())
        rows = np.arange(len(targets))
        self.target_change.extend(np.abs(reference[rows, targets] - other[rows, targets]).tolist())
        self.nll.extend((-other[rows, targets]).tolist())
        self.reference_nll.extend((-reference[rows, targets]).tolist())

    def summary(self) -> dict:
        return {"num_rows": len(self.agree), "top1_agreement": float(np.mean(self.agree)),
                "mean_kl": float(np.mean(self.kl)), "p99_kl": float(np.percentile(self.kl, 99)),
                "max_kl": float(np.max(self.kl)),
                "mean_abs_target_logprob_change": float(np.mean(self.target_change)),
                "perplexity": float(math.exp(np.mean(self.nll))),
                "reference_perplexity": float(math.exp(np.mean(self.reference_nll)))}


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    leading = []
    for ref, out in zip(reference, other):
        n = 0
        while n < min(len(ref), len(out)) and ref[n] == out[n]:
            n += 1
        leading.append(n)
    return {"identical_share": float(np.mean([r == o for r, o in zip(reference, other)])),
            "mean_leading_tokens_equal": float(np.mean(leading)), "tokens_per_continuation": len(reference[0])}


def markdown_report(info: dict, results: dict) -> str:
    lines = [
        "# FP8 KV cache accuracy (CPU, teacher-forced against the float32 model)", "",
        f"`{info['command']}` on {info['device']} ({info['platform']}), jax {info['jax']}, {info['date']}.", "",
        f"Model `{results['model']}` (the float32 baseline is its checkpoint's weights in float32); "
        f"{results['num_scored_tokens']} scored positions in the {results['num_passages']} passages of "
        f"`{results['scored_text']}`; calibrated scales from `{results['calibration_text']}` "
        f"({results['calibration_tokens']} tokens, never scored; scale = 2 x the largest |K| or |V| / 448). "
        f"KL: mean KL(float32 || row) over the whole vocabulary. Greedy: {results['generate_tokens']} tokens "
        f"after each passage's first {GREEDY_PROMPT_TOKENS} tokens.", "",
        "| configuration | top-1 agreement | mean KL | p99 KL | mean abs dlogprob | perplexity | greedy identical | "
        "leading tokens equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in results["configs"].items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} |  |  |  |  |  |  |")
            continue
        g = row["greedy"]
        lines.append(
            f"| {name} | {row['top1_agreement']:.2%} | {row['mean_kl']:.5f} | {row['p99_kl']:.4f} | "
            f"{row['mean_abs_target_logprob_change']:.4f} | {row['perplexity']:.3f} | "
            f"{g['identical_share']:.0%} | {g['mean_leading_tokens_equal']:.1f} / {g['tokens_per_continuation']} |")
    lines += ["", f"The float32 model's perplexity on this text: {results['reference_perplexity']:.3f}.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--generate-tokens", type=int, default=32)
    parser.add_argument("--skip-bf16", action="store_true", help="leave out the bfloat16 context row")
    args = parser.parse_args()
    log = Log()
    info = header(log)
    model = load_model(args.model, "float32")
    tokenizer = model.tokenizer
    passages = [json.loads(line)["text"] for line in SCORED_TEXT.read_text().splitlines() if line.strip()]
    passages_ids = [tokenizer.encode(p) for p in passages]
    prompts = [ids[:GREEDY_PROMPT_TOKENS] for ids in passages_ids]
    calibration_ids = [tokenizer.encode(p) for p in calibration_passages(CALIBRATION_TEXT)]
    log(f"{len(passages_ids)} passages, {sum(map(len, passages_ids))} tokens; "
        f"calibration: {sum(map(len, calibration_ids))} tokens")

    scales = calibrate_kv_scales(model, calibration_ids)
    log("calibrated K scales:", np.round(scales[0], 4).tolist())
    log("calibrated V scales:", np.round(scales[1], 4).tolist())
    configs = {
        "fp8 KV, scales 1.0 (f32 weights)": dict(loaded=model, kv_cache_dtype="fp8"),
        "fp8 KV, calibrated scales (f32 weights)": dict(loaded=dataclasses.replace(model, kv_cache_scales=scales),
                                                        kv_cache_dtype="fp8"),
    }
    if not args.skip_bf16:
        configs["bf16 weights + bf16 KV (context)"] = dict(loaded=load_model(args.model, "bfloat16"))
    results = {"model": args.model, "scored_text": str(SCORED_TEXT.relative_to(DATA.parent.parent)),
               "calibration_text": str(CALIBRATION_TEXT.relative_to(DATA.parent.parent)),
               "calibration_tokens": sum(map(len, calibration_ids)), "num_passages": len(passages_ids),
               "num_scored_tokens": sum(len(ids) - 1 for ids in passages_ids), "generate_tokens": args.generate_tokens,
               "kv_scales_calibrated": [s.tolist() for s in scales], "configs": {}, **info}
    if "quantization" in inspect.signature(LLM).parameters:
        quantized = dict(model=args.model, dtype="float32", quantization="fp8")
        configs["fp8 weights (f32 KV)"] = quantized
        configs["fp8 weights + fp8 KV, scales 1.0"] = dict(quantized, kv_cache_dtype="fp8")
    else:
        results["configs"]["fp8 weights + fp8 KV"] = {"skipped": "LLM(quantization=...) is not in this tree yet"}

    start = time.perf_counter()
    reference = LLM(loaded=model, **LLM_OPTIONS)
    llms = {name: LLM(**options, **LLM_OPTIONS) for name, options in configs.items()}
    comparisons = {name: Comparison() for name in configs}
    for i, ids in enumerate(passages_ids):
        expected = full_logprobs(reference, ids)
        for name, llm in llms.items():
            comparisons[name].add(expected, full_logprobs(llm, ids), ids[1:])
        log(f"passage {i + 1}/{len(passages_ids)} ({len(ids)} tokens) scored by every configuration "
            f"({time.perf_counter() - start:.0f} s)")
    params = SamplingParams(temperature=0, max_tokens=args.generate_tokens, ignore_eos=True)

    def continuations(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected_greedy = continuations(reference)
    for name, llm in llms.items():
        row = comparisons[name].summary()
        row["greedy"] = greedy_agreement(expected_greedy, continuations(llm))
        results["configs"][name] = row
        log(f"{name}: top-1 {row['top1_agreement']:.2%}, mean KL {row['mean_kl']:.5f}, ppl {row['perplexity']:.3f} "
            f"(f32 {row['reference_perplexity']:.3f}), greedy identical {row['greedy']['identical_share']:.0%}, "
            f"leading tokens equal {row['greedy']['mean_leading_tokens_equal']:.1f}")
        results["reference_perplexity"] = row["reference_perplexity"]
    write_results(args.out, "kv_cache_accuracy", results, markdown_report(info, results), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())

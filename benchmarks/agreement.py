"""Greedy agreement of batched and one-at-a-time generation, in the model's dtype (bf16 on the GPU).

    python3 benchmarks/agreement.py --out DIR [--model PATH | --shape NAME] [--num-prompts 32] [--max-tokens 64]
    python3 benchmarks/agreement.py --out DIR --against-tp 2     # TP=2 against TP=1, both batched

On CPU in float32 the engine's tests require the greedy tokens of a mixed batch to equal
those of each prompt run alone. In bf16 on a GPU, rows batched differently can round
differently (other matmul tiles, other attention splits), and a near-tie between two
tokens then flips and the texts part. This measures how often: the same prompts (random
lengths, as token ids) through one engine, all at once and then one at a time, greedy, EOS
ignored. Reported: the share of prompts whose outputs are identical, the share of output
positions that agree before the first divergence, and where divergences start.

``--against-tp N`` compares instead an engine over N devices with one over a single device,
the same prompts batched in both: the check that a sharded run (or the XLA options of
``docs/SHARDING.md``'s latency recipe, set through ``XLA_FLAGS``) computes the same thing.

``--model`` loads a checkpoint directory (default: the tiny Llama-3 fixture of the tests,
random weights); ``--shape`` builds random weights of a named architecture
(``benchmarks/model_shapes.py``). Random weights make near-ties common, so these rates are
a pessimistic bound for a trained model.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import Log, header, random_model, random_prompts, write_results  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.checkpoint import load_model  # noqa: E402

NAME = "agreement"
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny-llama3"
PAGE_SIZE = 32


def compare(first: list[list[int]], second: list[list[int]]) -> dict:
    """Agreement of two lists of token sequences, prompt by prompt."""
    first_divergence = []
    agreeing = total = 0
    for a, b in zip(first, second):
        n = min(len(a), len(b))
        diverge = next((i for i in range(n) if a[i] != b[i]), None)
        if diverge is None and len(a) != len(b):
            diverge = n
        first_divergence.append(diverge)
        agreeing += n if diverge is None else diverge
        total += max(len(a), len(b))
    diverged = [d for d in first_divergence if d is not None]
    return {
        "num_prompts": len(first),
        "identical_fraction": sum(d is None for d in first_divergence) / len(first),
        "token_agreement": agreeing / max(total, 1),
        "first_divergence": first_divergence,
        "median_first_divergence": statistics.median(diverged) if diverged else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=None, help=f"checkpoint directory (default {FIXTURE.name})")
    parser.add_argument("--shape", default=None, help="random weights of this architecture instead of --model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=200)
    parser.add_argument("--against-tp", type=int, default=None, metavar="N",
                        help="compare tensor_parallel_size N with 1 (both batched) instead of batched with alone")
    args = parser.parse_args()

    log = Log()
    results = {"info": header(log)}
    if args.shape:
        import jax.numpy as jnp

        model, source = random_model(args.shape, dtype=jnp.dtype(args.dtype)), f"random {args.shape}"
    else:
        path = args.model or FIXTURE
        model, source = load_model(path, dtype=args.dtype), str(path)
    options = dict(max_model_len=args.max_prompt_len + args.max_tokens, max_num_seqs=args.num_prompts,
                   page_size=PAGE_SIZE, use_tqdm=False, max_wait_s=0.0)
    if args.against_tp:
        # Two engines share the devices: a fixed pool each instead of one sized from free memory.
        options["num_pages"] = 4 * args.num_prompts * math.ceil(options["max_model_len"] / PAGE_SIZE)
    llm = LLM(loaded=model, **options)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, args.max_prompt_len, args.num_prompts)
    prompts = random_prompts(rng, lengths, model.config.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    first_outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    if args.against_tp:
        sharded = LLM(loaded=model, tensor_parallel_size=args.against_tp, **options)
        second_outputs = [out.outputs[0].token_ids for out in sharded.generate(prompts, params, use_tqdm=False)]
        first, second = "TP=1", f"TP={args.against_tp}"
    else:
        second_outputs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        first, second = "batched", "alone"
    report = compare(first_outputs, second_outputs)
    report.update(model=source, dtype=args.dtype, max_tokens=args.max_tokens, backend=jax.default_backend(),
                  compared=f"{first} vs {second}",
                  compilations_after_warmup=llm.engine.stats()["num_compilations_after_warmup"])
    results["agreement"] = report
    log(f"{source} {args.dtype} on {jax.default_backend()}: {report['identical_fraction']:.0%} of "
        f"{args.num_prompts} prompts identical {first} vs {second}; token agreement {report['token_agreement']:.1%}; "
        f"median first divergence {report['median_first_divergence']}")
    markdown = "\n".join([
        f"# Greedy agreement, {first} vs {second}", "",
        f"`{results['info']['command']}`", "",
        f"{results['info']['device']}, jax {results['info']['jax']}; model {source}, {args.dtype}", "",
        "| prompts | output tokens each | identical | token agreement | median first divergence |",
        "| --- | --- | --- | --- | --- |",
        f"| {args.num_prompts} | {args.max_tokens} | {report['identical_fraction']:.0%} | "
        f"{report['token_agreement']:.1%} | {report['median_first_divergence']} |", "",
    ])
    write_results(args.out, NAME, results, markdown, log)


if __name__ == "__main__":
    main()

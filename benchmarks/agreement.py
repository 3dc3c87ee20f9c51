"""Greedy agreement of batched and one-at-a-time generation, in the model's dtype (bf16 on the GPU).

    python3 benchmarks/agreement.py --out DIR [--model PATH | --shape NAME] [--num-prompts 32] [--max-tokens 64]
    python3 benchmarks/agreement.py --out DIR --against-tp 2     # TP=2 against TP=1, both batched
    python3 benchmarks/agreement.py --out DIR --against-hf --dtype float32   # transformers against the engine

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

``--against-hf`` compares Hugging Face transformers (each prompt alone, TF32 off in torch)
with the engine (all prompts batched), in ``--dtype``: in float32 the check that float32 means
float32 on the GPU too (``pallas_kernels/precision.py``: at JAX's default precision the float32
matmuls ran in TF32 and only 11 of 18 greedy continuations matched). For each divergence it
also reports transformers' margin between its top two logits there, to tell near-ties from
errors. It needs torch and transformers in the same environment; transformers runs on the GPU
when torch sees one, beside JAX's preallocated memory, so it is meant for small models.

``--model`` loads a checkpoint directory (default: the tiny Llama-3 fixture of the tests,
random weights); ``--shape`` builds random weights of a named architecture
(``benchmarks/model_shapes.py``; with ``--against-hf``, transformers initialises them and the
engine takes the same tensors). Random weights make near-ties common, so these rates are
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import SHAPES, Log, header, random_model, random_prompts, synthetic_tokenizer, write_results  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.checkpoint import load_model, weights_from_hf  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.loaded_model import LoadedModel  # noqa: E402

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


def load_with_transformers(args):
    """(transformers model, the engine's LoadedModel of the same weights, source) in ``args.dtype``.

    TF32 is switched off in torch, so transformers' float32 is IEEE float32; its attention is
    the eager one (plain matmuls, which that switch governs).
    """
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    options = dict(dtype=torch_dtype, attn_implementation="eager")
    if args.shape:
        hf_config = dict(SHAPES[args.shape])
        config = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
        torch.manual_seed(0)
        with torch.device(device):
            hf_model = transformers.AutoModelForCausalLM.from_config(config, **options)
        state = hf_model.state_dict()
        config = ModelConfig.from_hf(SHAPES[args.shape])
        weights = weights_from_hf(config, lambda name: state[name].float().cpu().numpy(), jnp.dtype(args.dtype))
        model = LoadedModel(config, weights, synthetic_tokenizer(config.vocab_size), Path(f"random:{args.shape}"))
        source = f"random {args.shape} (transformers' initialisation)"
    else:
        path = args.model or FIXTURE
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, **options).to(device)
        model, source = load_model(path, dtype=args.dtype), str(path)
    hf_model.eval()
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "torch_device": device}
    return hf_model, model, source, versions


def transformers_greedy(hf_model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of one prompt, EOS ignored, and its top-two logit margin at each token.

    A plain loop over the model's forward with its KV cache, so no generation setting (EOS,
    minimum lengths) touches a logit.
    """
    import torch

    ids = torch.tensor([prompt], device=hf_model.device)
    tokens, margins, cache = [], [], None
    with torch.inference_mode():
        for _ in range(max_tokens):
            out = hf_model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            top2 = out.logits[0, -1].float().topk(2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            ids = top2.indices[None, :1]
    return tokens, margins


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
    parser.add_argument("--against-hf", action="store_true",
                        help="compare transformers (each prompt alone, TF32 off) with the engine (batched)")
    args = parser.parse_args()
    if args.against_hf and args.against_tp:
        parser.error("--against-hf and --against-tp are two different comparisons: pick one")

    log = Log()
    results = {"info": header(log)}
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, args.max_prompt_len, args.num_prompts)
    if args.against_hf:
        hf_model, model, source, versions = load_with_transformers(args)
        results["info"].update(versions)
        prompts = random_prompts(rng, lengths, model.config.vocab_size)
        hf_runs = [transformers_greedy(hf_model, p, args.max_tokens) for p in prompts]
        del hf_model  # transformers gives its GPU memory back before the engine runs
        if versions["torch_device"] == "cuda":
            import torch

            torch.cuda.empty_cache()
    elif args.shape:
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
    if not args.against_hf:
        prompts = random_prompts(rng, lengths, model.config.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    first_outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    if args.against_hf:
        first_outputs, second_outputs = [tokens for tokens, _ in hf_runs], first_outputs
        first, second = "transformers", "jaxinfer"
    elif args.against_tp:
        sharded = LLM(loaded=model, tensor_parallel_size=args.against_tp, **options)
        second_outputs = [out.outputs[0].token_ids for out in sharded.generate(prompts, params, use_tqdm=False)]
        first, second = "TP=1", f"TP={args.against_tp}"
    else:
        second_outputs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        first, second = "batched", "alone"
    report = compare(first_outputs, second_outputs)
    if args.against_hf:
        # A margin near zero is a near-tie that any other summation order could flip.
        report["transformers_margin_at_divergence"] = [
            None if d is None or d >= len(margins) else margins[d]
            for d, (_, margins) in zip(report["first_divergence"], hf_runs)
        ]
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
    if args.against_hf:
        info = results["info"]
        margins = [f"{m:.2g}" for m in report["transformers_margin_at_divergence"] if m is not None]
        markdown += "\n".join([
            "", f"transformers {info['transformers']}, torch {info['torch']} on {info['torch_device']}, TF32 off, "
            "each prompt alone; jaxinfer all prompts batched.", "",
            f"transformers' top-two logit margin where they part: {', '.join(margins) or 'nowhere'}", "",
        ])
    write_results(args.out, NAME, results, markdown, log)


if __name__ == "__main__":
    main()

"""Host cost of structured output: filling a step's token bitmask for 256 constrained rows.

    python3 benchmarks/structured_output_host.py --out DIR [--tokenizer smollm2-135m-instruct]
        [--vocab-size 128256] [--batch 256] [--steps 300]
    python3 benchmarks/structured_output_host.py --export-tokenizer DIR [--tokenizer MODEL]

CPU only (runs anywhere; the number that matters is the GPU machine's CPU, whose cores the
engine's host thread shares with llguidance's). ``--batch`` sequences, each under one of three
JSON schemas (flat object, nested arrays of objects, a long string), advance together as the
engine advances them: each step :class:`GrammarMatchers` fills the ``[batch, ceil(V/32)]``
bitmask (``fill_bitmask``, llguidance's thread pool plus the padded-vocabulary clearing), then
each row takes a random allowed token (what random weights do under the mask) and the matchers
consume it (``advance``). A sequence whose grammar ends is replaced by a fresh one, as
continuous batching does. ``--vocab-size`` is the model's (Llama-3.1-8B's 128,256 by default,
the vocabulary ``engine_throughput.py --structured-fraction`` runs with); the tokenizer's own ids
(SmolLM2's 49,152) are the ones a grammar can allow.

Reported per step: fill p50/p90/p99/max against the 2 ms goal at batch 256, advance time, and
the same fill done one row at a time on one thread (``fill_next_token_bitmask``), the peer
that shows what llguidance's pool buys on this host.

``--export-tokenizer DIR`` writes the tokenizer as a Hugging Face directory (tokenizer.json,
tokenizer_config.json with its EOS), small enough to carry to a machine without the model
(the GGUF is 98 MB): ``engine_throughput.py --structured-tokenizer DIR`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llguidance.numpy as llguidance_numpy  # noqa: E402
import numpy as np  # noqa: E402
from common import Log, header, write_results  # noqa: E402

from jaxinfer.sampling_params import StructuredOutputsParams  # noqa: E402
from jaxinfer.sequence import Sequence  # noqa: E402
from jaxinfer.structured_output import GrammarCompiler, GrammarMatchers, guidance_tokenizer  # noqa: E402
from jaxinfer.tokenizer import Tokenizer  # noqa: E402

NAME = "structured_output_host"
GOAL_P99_MS = 2.0

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["name", "age"], "additionalProperties": False},
    "orders": {"type": "object", "properties": {"orders": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                         "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"], "additionalProperties": False}}}, "required": ["orders"]},
    # What engine_throughput.py --structured-fraction uses: no way to finish within 1,000 tokens.
    "long_text": {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}},
                  "required": ["text"], "additionalProperties": False},
}
LONG_OUTPUT_SCHEMA = SCHEMAS["long_text"]


def load_tokenizer(source: str) -> Tokenizer:
    """A model's tokenizer: a built-in name, a GGUF file or an HF directory (tokenizer.json)."""
    path = Path(source)
    if path.is_dir() and (path / "tokenizer.json").exists():
        return Tokenizer.from_hf_dir(path)
    from jaxinfer.model_registry import resolve_model

    path = resolve_model(source)
    if path.suffix == ".gguf":
        from jaxinfer.gguf_loader import read_gguf
        from jaxinfer.gguf_tokenizer import tokenizer_from_gguf

        tok, info = tokenizer_from_gguf(read_gguf(path).metadata)
        eos = [info["eos_token_id"]] if info.get("eos_token_id") is not None else []
        return Tokenizer(tokenizer=tok, eos_token=info.get("eos_token"), eos_token_ids=tuple(eos))
    return Tokenizer.from_hf_dir(path)


def export_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    eos = tokenizer.eos_token or tokenizer.id_to_token(tokenizer.eos_token_ids[0])
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct")
    parser.add_argument("--vocab-size", type=int, default=128256, help="the model's vocabulary (padded ids beyond the tokenizer's)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--export-tokenizer", type=Path, help="write the tokenizer as an HF directory and exit")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    if args.export_tokenizer:
        export_tokenizer(tokenizer, args.export_tokenizer)
        print(f"wrote {args.export_tokenizer}/tokenizer.json ({tokenizer.vocab_size} tokens, EOS {tokenizer.eos_token_ids})")
        return
    if args.out is None:
        parser.error("--out is required")

    log = Log()
    results = {"info": header(log), "cpu_count": os.cpu_count()}
    vocab = max(args.vocab_size, tokenizer.vocab_size)
    eos_ids = tokenizer.eos_token_ids
    start = time.perf_counter()
    compiler = GrammarCompiler(lambda: guidance_tokenizer(tokenizer, vocab, eos_ids))
    templates = {name: compiler.submit(StructuredOutputsParams(json=s)) for name, s in SCHEMAS.items()}
    for future in templates.values():
        future.result()
    log(f"tokenizer {args.tokenizer} ({tokenizer.vocab_size} tokens) over a {vocab}-id vocabulary; "
        f"{len(SCHEMAS)} schemas compiled in {time.perf_counter() - start:.2f} s; {os.cpu_count()} CPUs")

    matchers = GrammarMatchers(tokenizer.vocab_size, vocab, eos_ids)
    names = list(SCHEMAS)
    rng = np.random.default_rng(0)
    next_id = iter(range(10**9))

    def new_seq(row):
        seq = Sequence(next(next_id), f"r{row}", [1])
        matchers.add(seq, templates[names[row % len(names)]])
        return seq

    rows = [new_seq(row) for row in range(args.batch)]
    matchers.take_ready()
    fill_ms, advance_ms, serial_ms, num_replaced = [], [], [], 0
    for step in range(args.steps):
        sampled = [(seq, row) for row, seq in enumerate(rows)]
        if step % 10 == 5:
            # The peer, on every tenth step instead of the engine's fill (a matcher keeps its
            # last mask, so timing both on one state would time a cache): one row at a time,
            # on this thread, into the same layout.
            bitmask = np.empty((args.batch, (vocab + 31) // 32), np.int32)
            t0 = time.perf_counter()
            for seq, row in sampled:
                llguidance_numpy.fill_next_token_bitmask(matchers.matcher_of(seq), bitmask, row)
            serial_ms.append(1e3 * (time.perf_counter() - t0))
        else:
            t0 = time.perf_counter()
            bitmask = matchers.fill_bitmask(sampled, args.batch)
            fill_ms.append(1e3 * (time.perf_counter() - t0))
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # [B, W*32]
        tokens = [int(rng.choice(np.flatnonzero(bits[row]))) for row in range(args.batch)]
        t0 = time.perf_counter()
        matchers.advance(sampled, tokens)
        advance_ms.append(1e3 * (time.perf_counter() - t0))
        for row, seq in enumerate(rows):
            if matchers.is_done(seq):
                matchers.drop(seq)
                rows[row] = new_seq(row)
                num_replaced += 1
        matchers.take_ready()

    def summary(values):
        return {"p50_ms": float(np.percentile(values, 50)), "p90_ms": float(np.percentile(values, 90)),
                "p99_ms": float(np.percentile(values, 99)), "max_ms": float(max(values)),
                "mean_ms": statistics.mean(values)}

    results.update(
        tokenizer=args.tokenizer, tokenizer_vocab=tokenizer.vocab_size, vocab_size=vocab, batch=args.batch,
        steps=args.steps, sequences_completed=num_replaced, fill=summary(fill_ms), advance=summary(advance_ms),
        serial_fill=summary(serial_ms), goal_p99_ms=GOAL_P99_MS,
    )
    f, s = results["fill"], results["serial_fill"]
    log(f"fill at batch {args.batch}: p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms, max {f['max_ms']:.2f} ms "
        f"({1e3 * f['p50_ms'] / args.batch:.1f} us a row) against the {GOAL_P99_MS} ms goal: "
        f"{'met' if f['p99_ms'] <= GOAL_P99_MS else 'missed'}; one thread, row by row: p50 {s['p50_ms']:.2f} ms "
        f"({s['p50_ms'] / f['p50_ms']:.1f}x); advance p50 {results['advance']['p50_ms']:.2f} ms; "
        f"{num_replaced} grammars completed and replaced")
    markdown = (f"# Structured output: host mask fill\n\nCommand: `{results['info']['command']}`  \n"
                f"Host: {os.cpu_count()} CPUs, jax {results['info']['jax']}\n\n" + log.lines[-1] + "\n")
    write_results(args.out, NAME, results, markdown, log)


if __name__ == "__main__":
    main()

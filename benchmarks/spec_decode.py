"""Speculative decoding: acceptance on real weights, and the verify step's cost on the GPU.

    python benchmarks/spec_decode.py outputs --out DIR [--model smollm2-135m-instruct] [--max-tokens 256]
    python benchmarks/spec_decode.py replay --out DIR --outputs DIR/spec_greedy_outputs.json [--ks ...]
        [--lookup-mins 1 2] [--lookup-maxes 4] [--variants latest ...] [--judges 0.1,0.1 off]
    python benchmarks/spec_decode.py acceptance --out DIR [--model smollm2-135m-instruct] [--ks 2 4 8]
    python3 benchmarks/spec_decode.py step-cost --out DIR [--shape llama-3.1-8b] [--acceptance DIR/spec_acceptance.json ...]
    python3 benchmarks/spec_decode.py engine --out DIR [--shape llama-3.1-8b] [--ks 5] [--acceptance ...]
    python3 benchmarks/spec_decode.py eagle3 --out DIR [--shape llama-3.1-8b] [--ks 1 3 5 7] [--draft-vocab 32000]
    python3 benchmarks/spec_decode.py eagle3-engine --out DIR [--shape llama-3.1-8b] [--ks 3 5]

``outputs`` (CPU is fine): the default model's greedy outputs, speculation off, for the prompts of
``benchmarks/data/spec_prompts.json`` (copy-heavy and chat), token ids and all. ``replay``: from
those alone, the exact tokens per target step of prompt-lookup settings (k, lookup lengths, which
match, the low-gain switch), as ``jaxinfer.spec_decode.replay`` computes them: greedy output is
the same with speculation on, so a proposer's gain follows from the recorded tokens. Hundreds of
settings in seconds after one slow run of the model.

``acceptance`` (the ``latency-spec`` workload of shared/BENCHMARKS.md; CPU is fine): the default
model with real weights, greedy, one request at a time (batch 1), 128 output tokens, on the
same two prompt sets (``--num-prompts``: the first N of each), through the engine itself, with
the replay of its plain outputs beside it as a check. For each set and each ``k`` it reports
the mean acceptance length (tokens a verify step gives: accepted drafts + 1), the tokens per
target step over the whole output (steps without a draft count as 1), whether the output is token-identical to speculation off, and
the wall time per output token beside speculation off (on a CPU the step is compute-bound,
so the wall-time ratio says little about a GPU: see ``step-cost``).

``step-cost`` (the GPU; Llama-3.1-8B shapes, random bf16 weights, batch 1, a 1,024-token
context): the engine's own programs (``ModelRunner.execute``: forward + sampler, or forward +
verifier) for a plain decode step and a verify step with k = 1..8 drafts (``--max-k``), measured in
the same process two ways: back to back (the device's time per step; the plain engine overlaps
the host with it) and one at a time, each step's accepted count read by the host before the
next is dispatched (what a speculating sequence pays, since its next drafts continue the
accepted tokens). Random weights give meaningless acceptance, so acceptance comes from the
``acceptance`` run's JSON (``--acceptance``): the effective time per output token is

    t_eff(k) = t_verify_sync(k) / L(k)    against    t_plain = t_plain_back_to_back

where L(k) is the tokens per target step measured on real weights (a step without a draft
costs a plain synchronous step and gives one token; the JSON's ``tokens_per_step`` already
counts those). Writes DIR/spec_acceptance.* or DIR/spec_step_cost.{json,md,log}.

``engine`` (the GPU; same shapes, batch 1, a 1,024-token prompt, 256 greedy output tokens;
``--modes async`` skips the synchronous runs; ``--acceptance`` takes a ``replay`` JSON too): the
whole engine loop, host included, as ``Engine.step`` runs it, for plain async decode and, per
``k``, speculation with asynchronous verify steps (``async_verify``: drafts made on the device,
accepted counts read a step late) and with synchronous ones (the host reads each verify step
before it drafts). Each is timed as wall time per *target step* (a step's fixed shapes make its
cost independent of how many drafts the random weights accept: the step count comes from the
engine's own counters). The low-gain switch is off for these runs, so every step verifies
``k`` drafts' worth of rows, and both proposers are forced to draft every step
(``force_drafts``: prompt lookup finds nothing in random tokens). Then

    t_eff(k) = t_step_async(k) / L(k)    against    t_plain (the same engine loop, no speculation)

with ``L(k)`` the tokens per target step measured on real weights (``--acceptance``). A last run
keeps the low-gain switch on, as a deployment would: on random weights (no useful drafts, like
a chat the n-gram cannot predict) it measures what speculating costs a sequence it does not help
(goal: <= 3% over plain). Writes DIR/spec_engine.{json,md,log}.

``eagle3`` (the GPU; same shapes, batch 1, a 1,024-token context): what an EAGLE-3 head costs
per target step, with a random head of the Llama-3.1-8B EAGLE-3 checkpoints' shapes (one
decoder layer of the target's sizes with 2E-wide q/k/v, ``fc`` 3E -> E, a ``--draft-vocab``
lm_head). Random weights give meaningless acceptance, so only costs are measured, all in one
process: a plain decode step (back to back and one at a time), the verify step of ``k`` drafts
with and without the auxiliary hidden states written (the target's extra work), the head's
drafting round (``eagle3.draft_round``: a catch-up of ``k`` positions, as after a fully
accepted run, then ``k - 1`` one-row steps; its drafts read by the host, as the engine reads
them), and the synchronous cycle the engine runs per target step (draft round, drafts read,
verify step, accepted counts read). The acceptance length a head must reach to pay off is

    L_break_even(k) = t_cycle(k) / t_plain        (and t_cycle(k) / 2.3 ms for the issue's goal)

to be set against the acceptance a trained head measures on real weights (vLLM's anchor:
7.07 -> 4.05 ms/token for Llama-3.1-8B on an H100). The head's weights are also read once per
drafting round: its roofline is printed beside it. Writes DIR/spec_eagle3.{json,md,log}.

``eagle3-engine`` (the GPU; same shapes, batch 1, a 1,024-token prompt, 256 greedy output
tokens): the whole engine loop with ``{"method": "eagle3", ...}``, host included (the head's
catch-up batch, the drafts read, the verify step read), per target step, against plain async
decode in the same process, like ``engine``. The head is a random bf16 checkpoint of the
Llama-3.1-8B heads' shapes written in the ``speculators`` layout under DIR (so the loader runs
at full size too); the low-gain switch is off so every step verifies. Writes
DIR/spec_eagle3_engine.{json,md,log}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import Log, header, write_results  # noqa: E402

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "spec_prompts.json"


def load_prompt_sets(path: Path = PROMPTS_FILE) -> dict[str, list[str]]:
    """The prompt sets of ``benchmarks/data/spec_prompts.json``, their ``{TEXT}`` fields filled in."""
    data = json.loads(Path(path).read_text())
    texts = data["texts"]

    def fill(prompt):
        for name, text in texts.items():
            prompt = prompt.replace("{" + name + "}", text)
        return prompt

    return {name: [fill(p) for p in data[name]] for name in ("copy-heavy", "chat")}


def greedy_outputs(args, log):
    """Speculation off, greedy, all prompts in one batch: each prompt's token ids and its output's.

    Greedy output is token-identical with speculation on (tests/test_spec_decode*.py), so what a
    proposer would gain on it follows from these ids alone (``jaxinfer.spec_decode.replay``).
    """
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.checkpoint import load_model

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    sets = load_prompt_sets()
    prompts = [(name, p) for name, ps in sets.items() for p in ps]
    llm = LLM(loaded=load_model(args.model, dtype=dtype), max_model_len=1024, max_num_seqs=len(prompts),
              max_num_batched_tokens=2048, use_tqdm=False, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": p}] for _, p in prompts], params, use_tqdm=False)
    log(f"{len(prompts)} prompts, {sum(len(o.outputs[0].token_ids) for o in outputs)} output tokens in "
        f"{time.perf_counter() - start:.1f} s")
    records = [dict(set=name, prompt=p, prompt_token_ids=list(map(int, o.prompt_token_ids)),
                    output_token_ids=list(map(int, o.outputs[0].token_ids)), finish_reason=o.outputs[0].finish_reason)
               for (name, p), o in zip(prompts, outputs)]
    md = [f"# Greedy outputs, {args.model} ({dtype}), speculation off", "", f"Command: `{header_command()}`", "",
          "| set | prompt | output tokens | finish |", "| --- | --- | --- | --- |"]
    md += [f"| {r['set']} | {r['prompt'][:50]!r} | {len(r['output_token_ids'])} | {r['finish_reason']} |" for r in records]
    return {"model": args.model, "dtype": dtype, "max_tokens": args.max_tokens, "records": records}, md


def lookup_variant(variant: str, min_n: int, max_n: int, num_prompt: int):
    """A prompt-lookup proposer ``(context, room) -> drafts`` for the replay, by how it picks a match.

    ``latest``: what ``spec_decode/ngram.py`` does (the longest n-gram, its latest earlier
    occurrence). ``earliest``: its first occurrence. ``prompt-only``: matches inside the prompt
    only (what drafting from the generated text adds). ``overlap``: ``latest``, but a continuation
    that reaches the context's end goes on through its own drafts (a copy that overlaps itself, as
    LZ77 does: "a b a b" drafts "a b a b ..." rather than stopping after two tokens).
    """
    from numpy.lib.stride_tricks import sliding_window_view

    from jaxinfer.spec_decode.ngram import propose_ngram

    if variant == "latest":
        return lambda context, room: propose_ngram(context, room, min_n, max_n)

    def propose(context, room):
        length = context.shape[0]
        searched = context[: min(length - 1, num_prompt)] if variant == "prompt-only" else context[: length - 1]
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            if searched.shape[0] < n:
                continue
            matches = np.flatnonzero((sliding_window_view(searched, n) == context[length - n:]).all(axis=1))
            if matches.size:
                start = int(matches[0 if variant == "earliest" else -1]) + n
                if variant != "overlap":
                    return context[start: start + room].tolist()
                period = length - start  # each draft repeats the token `period` before it
                extended = context[start:].tolist()
                while len(extended) < room:
                    extended.append(extended[len(extended) - period])
                return extended[:room]
        return []

    if variant not in ("earliest", "prompt-only", "overlap"):
        raise ValueError(f"unknown lookup variant {variant!r}")
    return propose


def load_acceptance(args) -> list[dict]:
    """``(set, k, tokens_per_step)`` rows of ``--acceptance`` files: an ``acceptance`` run's rows, or
    the rows of a ``replay`` run for this run's lookup (``latest``, ``--lookup-min/max``, the low-gain
    switch's default thresholds for asynchronous verify steps, as an engine runs by default)."""
    from jaxinfer.spec_decode.config import SpeculativeConfig

    default = SpeculativeConfig(async_verify=True)
    rows = []
    for path in args.acceptance or []:
        for row in json.loads(Path(path).read_text())["rows"]:
            if "set" in row:
                rows.append(row)
            elif (row["variant"], row["prompt_lookup_min"], row["prompt_lookup_max"], row["min_acceptance_rate"],
                  row["min_accepted_per_step"]) == ("latest", args.lookup_min, args.lookup_max,
                                                    default.min_acceptance_rate, default.min_accepted_per_step):
                rows += [dict(set=name, k=row["k"], tokens_per_step=row[name]["tokens_per_step"])
                         for name in ("copy-heavy", "chat")]
    return rows


def judge_label(row) -> str:
    return f"rate {row['min_acceptance_rate']:g}, gain {row['min_accepted_per_step']:g}" if row["judge"] else "off"


def replay_acceptance(args, log):
    """Tokens per target step of prompt-lookup settings, replayed over recorded greedy outputs."""
    from jaxinfer.spec_decode.config import SpeculativeConfig
    from jaxinfer.spec_decode.replay import ReplayCounts, replay_greedy

    recorded = json.loads(Path(args.outputs).read_text())
    records = recorded["records"]
    # The low-gain switch: "off", or "RATE,PER_STEP" (min_acceptance_rate, min_accepted_per_step).
    judges = [None if j == "off" else tuple(map(float, j.split(","))) for j in args.judges]
    settings = [(variant, k, min_n, max_n, judge) for variant in args.variants for k in args.ks
                for min_n in args.lookup_mins for max_n in args.lookup_maxes if min_n <= max_n for judge in judges]
    rows = []
    for variant, k, min_n, max_n, thresholds in settings:
        judge = thresholds is not None
        config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n,
                                   **(dict(zip(("min_acceptance_rate", "min_accepted_per_step"), thresholds)) if judge else {}))
        row = dict(variant=variant, k=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n, judge=judge,
                   min_acceptance_rate=config.min_acceptance_rate if judge else None,
                   min_accepted_per_step=config.min_accepted_per_step if judge else None)
        for name in ("copy-heavy", "chat"):
            total, per_prompt = ReplayCounts(), []
            for record in records:
                if record["set"] != name:
                    continue
                propose = lookup_variant(variant, min_n, max_n, len(record["prompt_token_ids"]))
                counts = replay_greedy(record["prompt_token_ids"], record["output_token_ids"], propose, config,
                                       max_tokens=recorded["max_tokens"], max_model_len=1024, judge=judge)
                total += counts
                per_prompt.append(round(counts.tokens_per_step, 3))
            row[name] = dict(dataclasses.asdict(total), tokens_per_step=total.tokens_per_step,
                             mean_acceptance_length=total.mean_acceptance_length, acceptance_rate=total.acceptance_rate,
                             share_of_steps_with_drafts=total.share_of_steps_with_drafts, per_prompt=per_prompt)
        rows.append(row)
    rows.sort(key=lambda r: -r["copy-heavy"]["tokens_per_step"])
    for r in rows[:15]:
        log(f"{r['variant']:11s} k={r['k']:2d} n={r['prompt_lookup_min']}..{r['prompt_lookup_max']:2d} "
            f"judge={r['min_acceptance_rate']},{r['min_accepted_per_step']}: copy-heavy {r['copy-heavy']['tokens_per_step']:.2f}, "
            f"chat {r['chat']['tokens_per_step']:.2f} tokens per target step")
    md = [f"# Prompt lookup replayed over greedy outputs of {recorded['model']} ({recorded['dtype']})", "",
          f"Command: `{header_command()}`  ",
          f"outputs: `{args.outputs}` ({len(records)} prompts, max_tokens {recorded['max_tokens']})", "",
          "| lookup | k | n min..max | low-gain switch | copy-heavy tokens/step | steps with drafts | acceptance length "
          "| chat tokens/step | steps with drafts |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c, h = r["copy-heavy"], r["chat"]
        md.append(f"| {r['variant']} | {r['k']} | {r['prompt_lookup_min']}..{r['prompt_lookup_max']} | "
                  f"{judge_label(r)} | {c['tokens_per_step']:.3f} | {c['share_of_steps_with_drafts']:.0%} | "
                  f"{c['mean_acceptance_length']:.2f} | {h['tokens_per_step']:.3f} | {h['share_of_steps_with_drafts']:.0%} |")
    return {"outputs": args.outputs, "rows": rows}, md


def run_plain(llm_plain, prompts, max_tokens):
    """Speculation off, greedy, one request at a time: each prompt's (output token ids, seconds, prompt token ids)."""
    from jaxinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    results = {}
    for prompt in prompts:
        start = time.perf_counter()
        out = llm_plain.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        results[prompt] = (out.outputs[0].token_ids, time.perf_counter() - start, out.prompt_token_ids)
    return results


def run_set(plain_results, llm_spec, prompts, max_tokens):
    """Greedy, one request at a time, through the chat template: per-set acceptance and timing,
    beside what the replay (``jaxinfer.spec_decode.replay``) computes from the plain output alone."""
    from jaxinfer import SamplingParams
    from jaxinfer.spec_decode.replay import ReplayCounts, replay_greedy

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    totals = dict(output_tokens=0, accepted=0, drafts=0, draft_tokens=0, identical=0, plain_s=0.0, spec_s=0.0)
    config = llm_spec.engine.speculator.config
    replayed = ReplayCounts()
    per_prompt = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        plain_ids, plain_s, prompt_ids = plain_results[prompt]
        totals["plain_s"] += plain_s
        before = llm_spec.engine.stats()
        start = time.perf_counter()
        spec = llm_spec.chat(messages, params, use_tqdm=False)[0].outputs[0]
        totals["spec_s"] += time.perf_counter() - start
        after = llm_spec.engine.stats()
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        per_prompt.append(dict(prompt=prompt[:60], output_tokens=len(spec.token_ids),
                               tokens_per_step=len(spec.token_ids) / max(1, len(spec.token_ids) - accepted)))
        totals["output_tokens"] += len(spec.token_ids)
        totals["accepted"] += accepted
        totals["drafts"] += after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        totals["draft_tokens"] += after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        totals["identical"] += int(spec.token_ids == plain_ids)
        propose = lookup_variant("latest", config.prompt_lookup_min, config.prompt_lookup_max, len(prompt_ids))
        replayed += replay_greedy(prompt_ids, plain_ids, propose, config, max_tokens=max_tokens,
                                  max_model_len=llm_spec.engine.config.max_model_len)
    # Every target step (prefill's first token included) gives 1 token plus what it accepted. The
    # engine records no run its sequence ends in, so this counts the last run's tokens as steps and
    # reads a little low; the replay counts steps exactly (compare the accepted counts).
    steps = totals["output_tokens"] - totals["accepted"]
    return dict(
        totals,
        num_prompts=len(prompts),
        mean_acceptance_length=1 + totals["accepted"] / max(1, totals["drafts"]),
        acceptance_rate=totals["accepted"] / max(1, totals["draft_tokens"]),
        tokens_per_step=totals["output_tokens"] / max(1, steps),
        share_of_steps_with_drafts=totals["drafts"] / max(1, steps),
        wall_ratio_spec_over_plain=totals["spec_s"] / max(1e-9, totals["plain_s"]),
        per_prompt=per_prompt,
        replay=dict(dataclasses.asdict(replayed), tokens_per_step=replayed.tokens_per_step),
    )


def acceptance(args, log):
    from jaxinfer import LLM
    from jaxinfer.checkpoint import load_model

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    model = load_model(args.model, dtype=dtype)
    options = dict(max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=256, use_tqdm=False, max_wait_s=0.0,
                   enable_prefix_caching=False)
    plain = LLM(loaded=model, **options)
    sets = tuple((name, prompts[: args.num_prompts]) for name, prompts in load_prompt_sets().items())
    plain_results = {name: run_plain(plain, prompts, args.max_tokens) for name, prompts in sets}
    del plain
    rows = []
    for k in args.ks:
        spec = LLM(loaded=model, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                     "prompt_lookup_max": args.lookup_max,
                                                     "prompt_lookup_min": args.lookup_min,
                                                     "async_verify": args.async_verify == "on"}, **options)
        for name, prompts in sets:
            row = dict(set=name, k=k, **run_set(plain_results[name], spec, prompts, args.max_tokens))
            rows.append(row)
            log(f"{name:10s} k={k}: acceptance length {row['mean_acceptance_length']:.2f} per verify step, "
                f"{row['tokens_per_step']:.2f} tokens per target step, drafts in {row['share_of_steps_with_drafts']:.0%} "
                f"of steps, rate {row['acceptance_rate']:.0%}, identical {row['identical']}/{row['num_prompts']}, "
                f"wall spec/plain {row['wall_ratio_spec_over_plain']:.2f}; replayed: {row['replay']['tokens_per_step']:.2f} "
                f"tokens per step, {row['replay']['num_accepted_tokens']} accepted (engine {row['accepted']}); per prompt "
                + ", ".join(f"{p['tokens_per_step']:.2f}" for p in row["per_prompt"]))
        assert spec.engine.stats()["num_compilations_after_warmup"] == 0
        del spec
    md = [f"# Speculative decoding acceptance, {args.model} ({dtype}, n-gram, greedy, batch 1)", "",
          f"Command: `{header_command()}`", "",
          "Tokens / target step: the engine's recorded counts (a request's last run is not recorded: a "
          "little low); replayed: exact, from the plain output. Accepted tokens: engine / replay.", "",
          "| set | k | acceptance length | tokens / target step | replayed | accepted | steps with drafts | acceptance rate "
          "| identical | wall spec/plain |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['set']} | {r['k']} | {r['mean_acceptance_length']:.2f} | {r['tokens_per_step']:.2f} | "
                  f"{r['replay']['tokens_per_step']:.2f} | {r['accepted']} / {r['replay']['num_accepted_tokens']} | "
                  f"{r['share_of_steps_with_drafts']:.0%} | {r['acceptance_rate']:.0%} | "
                  f"{r['identical']}/{r['num_prompts']} | {r['wall_ratio_spec_over_plain']:.2f} |")
    return {"rows": rows}, md


def header_command():
    return "python " + " ".join(sys.argv)


def one_sequence_step_inputs(runner, num_drafts, context, pages):
    """The inputs of a batch-1 step at ``context`` tokens: a decode, or a verify of ``num_drafts`` drafts."""
    from jaxinfer.batch import build_step_batch
    from jaxinfer.input_batch import StepInputs
    from jaxinfer.sampling import SamplingTensors
    from jaxinfer.spec_decode.layout import expand_to_rows

    tokens = [7] * (1 + num_drafts)
    t, b, p = runner.buckets.pick(len(tokens), 1, len(pages))
    batch = build_step_batch([(tokens, context, pages)], num_tokens=t, num_seqs=b, pages_per_seq=p)
    inputs = StepInputs(batch, SamplingTensors.neutral(b, 0, 16), np.full(t, -1, np.int32), "basic")
    if runner.num_speculative_tokens == 0:
        return inputs
    batch, sampling, draft_ids, counts = expand_to_rows(batch, inputs.sampling, [tuple(tokens[1:])],
                                                        runner.num_speculative_tokens)
    return dataclasses.replace(inputs, batch=batch, sampling=sampling, draft_ids=draft_ids, num_drafts=counts)


def step_call(runner, inputs, synchronous):
    """One step as a call; ``synchronous``: also read what the host needs before it can draft the next."""
    def one():
        out = runner.execute(inputs)
        if synchronous:
            np.asarray(out.num_accepted if inputs.is_verify else out.token_ids)
        return out
    return one


def best_seconds_per_call(one, steps):
    """Seconds per call of ``one``: the best of 3 runs of ``steps`` calls back to back, after 3 warm-up calls."""
    for _ in range(3):
        jax.block_until_ready(one())
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            out = one()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def step_cost(args, log):

    from common import measure_ceilings, random_model
    from jaxinfer.memory import weight_bytes
    from jaxinfer.runner import ModelRunner

    ceilings = measure_ceilings(log)
    model = random_model(args.shape)
    config = model.config
    per_token = weight_bytes(config, 2)
    roofline_ms = per_token / (ceilings["hbm_read_tbs"] * 1e12) * 1e3
    log(f"roofline (every weight read once): {per_token / 1e9:.2f} GB -> {roofline_ms:.3f} ms")
    page_size, context = 32, args.context
    pages = list(range(1, context // page_size + 3))

    def inputs_for(runner, num_drafts):
        return one_sequence_step_inputs(runner, num_drafts, context, pages)

    def time_steps(runner, inputs, synchronous):
        return best_seconds_per_call(step_call(runner, inputs, synchronous), args.steps)

    def runner_for(k):
        return ModelRunner(model, num_pages=len(pages) + 2, page_size=page_size, max_model_len=context + 64 * page_size,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(16, args.max_num_seqs),
                           num_speculative_tokens=k)

    plain_runner = runner_for(0)
    plain = {mode: time_steps(plain_runner, inputs_for(plain_runner, 0), mode == "sync") for mode in ("async", "sync")}
    del plain_runner
    log(f"plain decode step: {plain['async'] * 1e3:.3f} ms back to back, {plain['sync'] * 1e3:.3f} ms one at a time "
        f"({plain['async'] * 1e3 / roofline_ms:.2f}x roofline)")
    acceptance_rows = load_acceptance(args)
    rows = []
    for k in range(1, args.max_k + 1):
        runner = runner_for(k)
        cost = {mode: time_steps(runner, inputs_for(runner, k), mode == "sync") for mode in ("async", "sync")}
        row = dict(k=k, verify_ms=cost["async"] * 1e3, verify_sync_ms=cost["sync"] * 1e3,
                   ratio_to_plain=cost["async"] / plain["async"], sync_ratio_to_plain=cost["sync"] / plain["async"])
        for acc in acceptance_rows:
            if acc["k"] == k:
                row[f"effective_ms_{acc['set']}"] = cost["sync"] * 1e3 / acc["tokens_per_step"]
        rows.append(row)
        log(f"k={k}: verify step {row['verify_ms']:.3f} ms ({row['ratio_to_plain']:.3f}x plain) back to back, "
            f"{row['verify_sync_ms']:.3f} ms one at a time ({row['sync_ratio_to_plain']:.3f}x plain)"
            + "".join(f"; effective {v:.3f} ms/token ({key[13:]})" for key, v in row.items() if key.startswith("effective")))
        del runner
    md = [f"# Verify step cost, {args.shape}, batch 1, context {context}", "", f"Command: `{header_command()}`  ",
          f"roofline {roofline_ms:.3f} ms; plain decode {plain['async'] * 1e3:.3f} ms back to back, "
          f"{plain['sync'] * 1e3:.3f} ms one at a time", "",
          "effective ms/token = verify step one at a time / tokens per target step (measured on real weights).", "",
          "| k | verify ms | x plain | one at a time ms | x plain | effective ms/token (copy-heavy) | (chat) |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['k']} | {r['verify_ms']:.3f} | {r['ratio_to_plain']:.3f} | {r['verify_sync_ms']:.3f} | "
                  f"{r['sync_ratio_to_plain']:.3f} | {r.get('effective_ms_copy-heavy', float('nan')):.3f} | "
                  f"{r.get('effective_ms_chat', float('nan')):.3f} |")
    return {"ceilings": ceilings, "roofline_ms": roofline_ms, "plain_ms": plain["async"] * 1e3,
            "plain_sync_ms": plain["sync"] * 1e3, "rows": rows}, md


def force_drafts(vocab_size: int):
    """Make both n-gram proposers always draft, as many as there is room for: on random weights
    prompt lookup finds nothing, and a step without drafts would run plain. The drafts (the
    token after the last one, repeated) are all but never accepted, even when a random model
    loops on one token: every step is a rejection, the pattern a sequence the proposer cannot
    help has. A verify step's device cost does not depend on what is accepted (its shapes are
    fixed); the acceptance comes from real weights (``--acceptance``)."""
    import jax.numpy as jnp

    from jaxinfer.spec_decode import device_ngram, speculator

    def on_host(context, num_drafts, min_n, max_n):
        return [(int(context[-1]) + 1) % vocab_size] * num_drafts

    def on_device(history, lengths, rooms, *, num_speculative_tokens, min_n, max_n):
        last = jnp.take_along_axis(history, jnp.maximum(lengths - 1, 0)[:, None], axis=1)  # [B, 1]
        last = (last + 1) % vocab_size
        num_drafts = jnp.where(lengths > 0, jnp.minimum(rooms, num_speculative_tokens), 0).astype(jnp.int32)
        return jnp.broadcast_to(last, (history.shape[0], num_speculative_tokens)).astype(jnp.int32), num_drafts

    speculator.propose_ngram = on_host
    device_ngram.propose_ngram_on_device = on_device  # before any verifier is traced


def engine_steps(args, log):
    from common import random_model, random_prompts
    from jaxinfer import SamplingParams
    from jaxinfer.engine import Engine
    from jaxinfer.engine_config import EngineConfig

    model = random_model(args.shape)
    force_drafts(model.config.vocab_size)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    base = dict(max_model_len=args.context + args.max_tokens + 64, max_num_seqs=1, max_num_batched_tokens=256,
                page_size=32, num_pages=(args.context + args.max_tokens + 64) // 32 * 2 + 8)

    def build(speculative):
        start = time.perf_counter()
        # Programs compile on first use: the timed runs follow an untimed one that reaches them all.
        engine = Engine(model, EngineConfig(**base, speculative_config=speculative), warm_up=False, use_tqdm=False)
        return engine, time.perf_counter() - start

    def run(engine, tag):
        """One request alone: (seconds per target step, tokens per target step, seconds per output token,
        the share of its decode steps that verified drafts)."""
        before = engine.stats()
        engine.add_request(tag, random_prompts(rng, [args.context], vocab)[0], params, final_only=True)
        first = last = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for output in outputs:
                metrics = output.metrics
                first, last = metrics.first_token_time, metrics.last_token_time
        after = engine.stats()
        accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
        # Steps after the first token: each gives one token plus what it accepted.
        decode_steps = args.max_tokens - 1 - accepted
        verified = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
        return ((last - first) / decode_steps, (args.max_tokens - 1) / decode_steps,
                (last - first) / (args.max_tokens - 1), verified / decode_steps)

    def best_of(engine, tag, repeats=3):
        run(engine, f"{tag}-warm")
        results = [run(engine, f"{tag}-{r}") for r in range(repeats)]
        return min(results)

    plain_engine, seconds = build(None)
    plain_step, _, plain_tpot, _ = best_of(plain_engine, "plain")
    log(f"plain async decode: {plain_step * 1e3:.3f} ms per step (engine built in {seconds:.1f} s)")
    del plain_engine
    acceptance_rows = load_acceptance(args)
    rows = []
    for k in args.ks:
        row = dict(k=k)
        for mode in args.modes:
            config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.lookup_max,
                      "prompt_lookup_min": args.lookup_min, "async_verify": mode == "async"}
            engine, seconds = build(config)
            row[f"{mode}_build_s"] = seconds
            if mode == "async":  # the low-gain switch on: what speculating costs where it does not help
                row["judged_tpot_ms"] = best_of(engine, "judged")[2] * 1e3
            # Every step verifies: random weights would otherwise be judged low and run plain.
            engine.speculator.config = dataclasses.replace(engine.speculator.config, min_acceptance_rate=0.0,
                                                           min_accepted_per_step=0.0)
            step, _, _, verified = best_of(engine, mode)
            row[f"{mode}_step_ms"] = step * 1e3
            row[f"{mode}_share_of_steps_verifying"] = verified
            row[f"{mode}_ratio_to_plain"] = step / plain_step
            del engine
        for acc in acceptance_rows:
            if acc["k"] == k:
                for mode in args.modes:
                    label = "effective_ms" if mode == "async" else "effective_sync_ms"
                    row[f"{label}_{acc['set']}"] = row[f"{mode}_step_ms"] / acc["tokens_per_step"]
        if "judged_tpot_ms" in row:
            row["judged_ratio_to_plain"] = row["judged_tpot_ms"] / (plain_tpot * 1e3)
        rows.append(row)
        log(f"k={k}: " + ", ".join(f"{mode} verify step {row[mode + '_step_ms']:.3f} ms "
                                   f"({row[mode + '_ratio_to_plain']:.3f}x plain, verifying drafts in "
                                   f"{row[mode + '_share_of_steps_verifying']:.0%} of steps)" for mode in args.modes)
            + "".join(f"; {key} {v:.3f}" for key, v in row.items() if key.startswith(("effective", "judged"))))
    md = [f"# Speculative decoding through the engine loop, {args.shape}, batch 1, prompt {args.context}", "",
          f"Command: `{header_command()}`  ",
          f"plain async decode {plain_step * 1e3:.3f} ms per step", "",
          "effective ms/token = wall time per target step / tokens per target step (measured on real weights).", "",
          "| k | async step ms | x plain | sync step ms | x plain | effective async (copy-heavy) | (chat) | "
          "effective sync (copy-heavy) | judged-low run ms/token | x plain |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    nan = float("nan")
    for r in rows:
        md.append(f"| {r['k']} | {r.get('async_step_ms', nan):.3f} | {r.get('async_ratio_to_plain', nan):.3f} | "
                  f"{r.get('sync_step_ms', nan):.3f} | {r.get('sync_ratio_to_plain', nan):.3f} | "
                  f"{r.get('effective_ms_copy-heavy', nan):.3f} | {r.get('effective_ms_chat', nan):.3f} | "
                  f"{r.get('effective_sync_ms_copy-heavy', nan):.3f} | {r.get('judged_tpot_ms', nan):.3f} | "
                  f"{r.get('judged_ratio_to_plain', nan):.3f} |")
    return {"plain_step_ms": plain_step * 1e3, "plain_tpot_ms": plain_tpot * 1e3, "rows": rows}, md


def eagle3_cost(args, log):
    import jax.numpy as jnp

    from common import measure_ceilings, random_model
    from jaxinfer.batch import build_step_batch
    from jaxinfer.config import ModelConfig
    from jaxinfer.kv_cache import create_kv_cache
    from jaxinfer.memory import weight_bytes
    from jaxinfer.runner import ModelRunner
    from jaxinfer.spec_decode.eagle3 import Eagle3Config, draft_round, init_random_head
    from jaxinfer.spec_decode.eagle3_checkpoint import default_aux_layer_ids
    from model_shapes import SHAPES

    ceilings = measure_ceilings(log)
    model = random_model(args.shape)
    config = model.config
    num_layers = config.num_layers
    # vLLM's layers; a model too shallow for them (the CPU smoke shape) takes first, middle, last.
    aux_ids = default_aux_layer_ids(num_layers) if num_layers >= 6 else (0, num_layers // 2, num_layers - 1)
    draft_vocab = min(args.draft_vocab, config.vocab_size)
    head_config = Eagle3Config(
        layer=ModelConfig.from_hf({**SHAPES[args.shape], "num_hidden_layers": 1, "vocab_size": draft_vocab}),
        target_hidden_size=config.hidden_size, target_vocab_size=config.vocab_size, aux_layer_ids=aux_ids)
    head = init_random_head(head_config, jax.random.key(1), jnp.bfloat16)
    head_bytes = sum(x.nbytes for x in jax.tree.leaves(head))
    roofline_ms = weight_bytes(config, 2) / (ceilings["hbm_read_tbs"] * 1e12) * 1e3
    head_roofline_ms = head_bytes / (ceilings["hbm_read_tbs"] * 1e12) * 1e3
    log(f"target roofline {roofline_ms:.3f} ms; head {head_bytes / 1e9:.3f} GB -> {head_roofline_ms:.3f} ms per "
        f"read; aux layers {aux_ids}, draft vocabulary {draft_vocab}")
    page_size, context = 32, args.context
    pages = list(range(1, context // page_size + 3))

    def runner_for(k, aux):
        return ModelRunner(model, num_pages=len(pages) + 2, page_size=page_size, max_model_len=context + 64 * page_size,
                           max_num_seqs=1, max_num_batched_tokens=16, num_speculative_tokens=k,
                           aux_hidden_layers=aux_ids if aux else ())

    def inputs_for(runner, num_drafts):
        return one_sequence_step_inputs(runner, num_drafts, context, pages)

    def best_time(one):
        return best_seconds_per_call(one, args.steps)

    step = step_call

    plain_runner = runner_for(0, aux=False)
    plain_inputs = inputs_for(plain_runner, 0)
    plain = {mode: best_time(step(plain_runner, plain_inputs, mode == "sync")) for mode in ("async", "sync")}
    del plain_runner
    log(f"plain decode step: {plain['async'] * 1e3:.3f} ms back to back, {plain['sync'] * 1e3:.3f} ms one at a time")
    rows = []
    for k in args.ks:
        if not _time_left(log):
            break
        row = dict(k=k)
        runner = runner_for(k, aux=False)
        row["verify_ms"] = best_time(step(runner, inputs_for(runner, k), False)) * 1e3
        del runner
        runner = runner_for(k, aux=True)
        verify_inputs = inputs_for(runner, k)
        row["verify_aux_ms"] = best_time(step(runner, verify_inputs, False)) * 1e3
        row["verify_aux_sync_ms"] = best_time(step(runner, verify_inputs, True)) * 1e3
        head_cache = create_kv_cache(head_config.layer, len(pages) + 2, page_size, jnp.bfloat16)
        round_fn = jax.jit(functools.partial(draft_round, config=head_config, attention_impl="auto", num_drafts=k),
                           donate_argnames=("cache",))
        # The catch-up after a fully accepted run: k positions whose target features are known.
        t, b, p = runner.buckets.pick(k, 1, len(pages))  # the shapes the engine's proposer would use
        catch_up = build_step_batch([([7] * k, context - k, pages)], num_tokens=t, num_seqs=b, pages_per_seq=p)
        catch_up = jax.tree.map(jnp.asarray, catch_up)
        state = {"cache": head_cache}

        def draft(read=True):
            drafts, state["cache"] = round_fn(head, state["cache"], model.weights.embed, runner.aux_pages, catch_up)
            if read:
                np.asarray(drafts)
            return drafts

        row["draft_round_ms"] = best_time(lambda: draft(read=False)) * 1e3
        row["draft_round_sync_ms"] = best_time(draft) * 1e3
        verify_one = step(runner, verify_inputs, True)

        def cycle():
            draft()
            return verify_one()

        row["cycle_ms"] = best_time(cycle) * 1e3
        row["cycle_ratio_to_plain"] = row["cycle_ms"] / (plain["async"] * 1e3)
        row["aux_overhead"] = row["verify_aux_ms"] / row["verify_ms"] - 1
        row["break_even_tokens_per_step"] = row["cycle_ratio_to_plain"]
        row["tokens_per_step_for_2_3_ms"] = row["cycle_ms"] / 2.3
        row["tokens_per_step_for_vllm_4_05_ms"] = row["cycle_ms"] / 4.05
        del runner, round_fn, state
        rows.append(row)
        log(f"k={k}: verify {row['verify_ms']:.3f} ms, with aux states {row['verify_aux_ms']:.3f} ms "
            f"({row['aux_overhead']:+.1%}); head round {row['draft_round_ms']:.3f} ms back to back, "
            f"{row['draft_round_sync_ms']:.3f} ms read; cycle {row['cycle_ms']:.3f} ms = "
            f"{row['cycle_ratio_to_plain']:.2f}x plain: pays off above {row['break_even_tokens_per_step']:.2f} "
            f"tokens/step, 2.3 ms/token needs {row['tokens_per_step_for_2_3_ms']:.2f}")
    md = [f"# EAGLE-3 step cost, {args.shape}, batch 1, context {context} (random head: costs only)", "",
          f"Command: `{header_command()}`  ",
          f"target roofline {roofline_ms:.3f} ms; head {head_bytes / 1e9:.3f} GB ({head_roofline_ms:.3f} ms per read); "
          f"plain decode {plain['async'] * 1e3:.3f} ms back to back, {plain['sync'] * 1e3:.3f} ms one at a time; "
          f"aux layers {list(aux_ids)}, draft vocabulary {draft_vocab}", "",
          "cycle = head round + drafts read + verify step with aux states + accepted counts read (the engine's "
          "synchronous step); break-even = cycle / plain back to back: the tokens per target step (accepted + 1) "
          "the head must give to beat plain decode.", "",
          "| k | verify ms | + aux states ms | aux overhead | head round ms | (read) | cycle ms | x plain = break-even "
          "tokens/step | tokens/step for 2.3 ms | for vLLM's 4.05 ms |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['k']} | {r['verify_ms']:.3f} | {r['verify_aux_ms']:.3f} | {r['aux_overhead']:+.1%} | "
                  f"{r['draft_round_ms']:.3f} | {r['draft_round_sync_ms']:.3f} | {r['cycle_ms']:.3f} | "
                  f"{r['break_even_tokens_per_step']:.2f} | {r['tokens_per_step_for_2_3_ms']:.2f} | "
                  f"{r['tokens_per_step_for_vllm_4_05_ms']:.2f} |")
    return {"ceilings": ceilings, "roofline_ms": roofline_ms, "head_bytes": head_bytes,
            "head_roofline_ms": head_roofline_ms, "plain_ms": plain["async"] * 1e3, "plain_sync_ms": plain["sync"] * 1e3,
            "aux_layer_ids": list(aux_ids), "draft_vocab": draft_vocab, "rows": rows}, md


_DEADLINE = [None]  # (--budget-s) the time after which no new k starts: results of finished ones are written


def _time_left(log) -> bool:
    if _DEADLINE[0] is not None and time.perf_counter() > _DEADLINE[0]:
        log("budget spent: no more k")
        return False
    return True


def write_random_eagle3_head(path: Path, shape: str, draft_vocab: int, seed: int = 0) -> Path:
    """A random bf16 EAGLE-3 head for ``shape`` in the ``speculators`` layout (d2t: the first
    ``draft_vocab`` target ids), written a tensor at a time."""
    from loader_memory import write_safetensors
    from model_shapes import SHAPES

    hf = SHAPES[shape]
    e, f, hq, hkv = hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or e // hq
    draft_vocab = min(draft_vocab, hf["vocab_size"])
    layers = hf["num_hidden_layers"]
    aux = [2, layers // 2, layers - 3] if layers >= 6 else [0, layers // 2, layers - 1]
    path.mkdir(parents=True, exist_ok=True)
    layer = "layers.0."
    tensors = [("fc.weight", (e, 3 * e)), (f"{layer}hidden_norm.weight", (e,)), (f"{layer}input_layernorm.weight", (e,)),
               (f"{layer}post_attention_layernorm.weight", (e,)), (f"{layer}self_attn.q_proj.weight", (hq * d, 2 * e)),
               (f"{layer}self_attn.k_proj.weight", (hkv * d, 2 * e)), (f"{layer}self_attn.v_proj.weight", (hkv * d, 2 * e)),
               (f"{layer}self_attn.o_proj.weight", (e, hq * d)), (f"{layer}mlp.gate_proj.weight", (f, e)),
               (f"{layer}mlp.up_proj.weight", (f, e)), (f"{layer}mlp.down_proj.weight", (e, f)), ("norm.weight", (e,)),
               ("lm_head.weight", (draft_vocab, e))]
    write_safetensors(path / "model.safetensors", tensors, np.random.default_rng(seed))
    d2t = np.zeros(draft_vocab, "<i8")  # draft id j is target id j
    header = json.dumps({"d2t": {"dtype": "I64", "shape": [draft_vocab], "data_offsets": [0, d2t.nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path / "d2t.safetensors", "wb") as out:
        out.write(len(header).to_bytes(8, "little") + header + d2t.tobytes())
    layer_config = {key: hf[key] for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                             "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                                             "max_position_embeddings") if key in hf}
    layer_config.update(head_dim=d, num_hidden_layers=1, rope_scaling=hf.get("rope_scaling"))
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": layer_config, "draft_vocab_size": draft_vocab, "norm_before_residual": False,
              "target_hidden_size": e, "eagle_aux_hidden_state_layer_ids": aux}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def eagle3_engine(args, log):
    from common import random_model, random_prompts
    from jaxinfer import SamplingParams
    from jaxinfer.engine import Engine
    from jaxinfer.engine_config import EngineConfig

    model = random_model(args.shape)
    vocab = model.config.vocab_size
    start = time.perf_counter()
    head_dir = write_random_eagle3_head(args.out / "eagle3-head", args.shape, args.draft_vocab)
    log(f"random head written to {head_dir} in {time.perf_counter() - start:.1f} s")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    length = args.context + args.max_tokens + 64
    base = dict(max_model_len=length, max_num_seqs=1, max_num_batched_tokens=256, page_size=32,
                num_pages=length // 32 * 2 + 8)

    def per_step(engine, tag):
        """Wall seconds per target step of one request alone, and its decode steps' share that verified."""
        before = engine.stats()
        engine.add_request(tag, random_prompts(rng, [args.context], vocab)[0], params, final_only=True)
        first = last = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                first, last = output.metrics.first_token_time, output.metrics.last_token_time
        after = engine.stats()
        accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
        decode_steps = args.max_tokens - 1 - accepted
        verified = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
        return (last - first) / decode_steps, verified / decode_steps

    def best_of(engine, tag, repeats=3):
        per_step(engine, f"{tag}-warm")
        return min(per_step(engine, f"{tag}-{r}") for r in range(repeats))

    plain = Engine(model, EngineConfig(**base), warm_up=False, use_tqdm=False)
    plain_step, _ = best_of(plain, "plain")
    del plain
    log(f"plain async decode: {plain_step * 1e3:.3f} ms per step")
    rows = []
    for k in args.ks:
        if not _time_left(log):
            break
        start = time.perf_counter()
        engine = Engine(model, EngineConfig(**base, speculative_config={"method": "eagle3", "model": str(head_dir),
                                                                        "num_speculative_tokens": k}),
                        warm_up=False, use_tqdm=False)
        built = time.perf_counter() - start
        # Every step verifies: random drafts would otherwise be judged low and the sequence run plain.
        engine.speculator.config = dataclasses.replace(engine.speculator.config, min_acceptance_rate=0.0,
                                                       min_accepted_per_step=0.0)
        step, verified = best_of(engine, f"eagle3-{k}")
        del engine
        row = dict(k=k, step_ms=step * 1e3, ratio_to_plain=step / plain_step, share_of_steps_verifying=verified,
                   tokens_per_step_for_2_3_ms=step * 1e3 / 2.3, built_s=built)
        rows.append(row)
        log(f"k={k}: {row['step_ms']:.3f} ms per target step ({row['ratio_to_plain']:.3f}x plain; verifying "
            f"{verified:.0%} of steps): pays off above {row['ratio_to_plain']:.2f} tokens/step, 2.3 ms/token needs "
            f"{row['tokens_per_step_for_2_3_ms']:.2f} (engine with head loaded in {built:.1f} s)")
    md = [f"# EAGLE-3 through the engine loop, {args.shape}, batch 1, prompt {args.context} (random head)", "",
          f"Command: `{header_command()}`  ", f"plain async decode {plain_step * 1e3:.3f} ms per step", "",
          "| k | ms per target step | x plain = break-even tokens/step | tokens/step for 2.3 ms | steps verifying |",
          "| --- | --- | --- | --- | --- |"]
    md += [f"| {r['k']} | {r['step_ms']:.3f} | {r['ratio_to_plain']:.3f} | {r['tokens_per_step_for_2_3_ms']:.2f} | "
           f"{r['share_of_steps_verifying']:.0%} |" for r in rows]
    return {"plain_step_ms": plain_step * 1e3, "rows": rows}, md


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("outputs", "replay", "acceptance", "step-cost", "engine", "eagle3",
                                         "eagle3-engine"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, help="acceptance: the first N prompts of each set (default: all)")
    parser.add_argument("--async-verify", choices=("on", "off"), default="on", help="acceptance: speculative_config.async_verify")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--outputs", help="replay: a spec_greedy_outputs.json of the outputs mode")
    parser.add_argument("--variants", nargs="+", default=["latest"],
                        help="replay: how a match is picked (latest, earliest, prompt-only, overlap)")
    parser.add_argument("--lookup-mins", type=int, nargs="+", default=[1, 2], help="replay: prompt_lookup_min values")
    parser.add_argument("--judges", nargs="+", default=["0.1,0.1", "off"],
                        help="replay: low-gain switches, 'RATE,PER_STEP' (min_acceptance_rate, min_accepted_per_step) or off")
    parser.add_argument("--lookup-maxes", type=int, nargs="+", default=[4], help="replay: prompt_lookup_max values")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--draft-vocab", type=int, default=32000, help="eagle3: the head's draft vocabulary")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="eagle3, eagle3-engine: start no new k after this many seconds")
    parser.add_argument("--modes", nargs="+", choices=("async", "sync"), default=["async", "sync"],
                        help="engine: verify steps to time (async_verify on, off)")
    parser.add_argument("--max-k", type=int, default=8,
                        help="step-cost: verify steps of k = 1..MAX_K drafts (default 8, the GPU runs'; the CPU "
                             "smoke test passes 2: each k compiles its own runner)")
    parser.add_argument("--acceptance", nargs="+",
                        help="spec_acceptance.json files of acceptance runs, for the effective time per token")
    args = parser.parse_args()
    if args.max_k < 1:
        parser.error(f"--max-k: {args.max_k} must be at least 1")
    if args.budget_s is not None:
        _DEADLINE[0] = time.perf_counter() + args.budget_s
    log = Log()
    info = header(log)
    run = {"outputs": greedy_outputs, "replay": replay_acceptance, "acceptance": acceptance, "step-cost": step_cost,
           "engine": engine_steps, "eagle3": eagle3_cost, "eagle3-engine": eagle3_engine}[args.mode]
    results, md = run(args, log)
    name = {"outputs": "spec_greedy_outputs", "replay": "spec_replay", "acceptance": "spec_acceptance",
            "step-cost": "spec_step_cost", "engine": "spec_engine", "eagle3": "spec_eagle3",
            "eagle3-engine": "spec_eagle3_engine"}[args.mode]
    write_results(args.out, name, {"info": info, "args": vars(args) | {"out": str(args.out)}, **results},
                  "\n".join(md) + "\n", log)


if __name__ == "__main__":
    main()

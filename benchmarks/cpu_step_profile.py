"""Where a CPU decode step's time goes, per variant, read from a `jax.profiler` trace: one run.

    python benchmarks/cpu_step_profile.py --variants float32,bfloat16,float32+int8 --batch 1 \
        --steps 16 --rounds 3 --out DIR

For each variant (an activation dtype, optionally ``+int8`` for int8 weights) an ``LLM`` of the
default model is built and warmed up; ``batch`` greedy requests are prefilled, then
``engine.step()`` is timed in decode, ``--rounds`` times with the variants interleaved (the
machine may be shared: each round gives every variant the same weather; the median per step of
each is kept). A last round runs under ``jax.profiler`` and the XLA ops' time is summed per
part of the step, using the ``op_name`` metadata of the compiled program (XLA's HLO dump):
layer matmuls (attention projections, MLP), the rest of attention (RoPE, cache write, the
attention itself), the lm_head, the sampler program, everything else in the forward; "host"
is the step's wall time minus the XLA ops' (ops on different threads can overlap, so it is a
lower bound). Writes ``cpu_step_profile.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The native CPU attention's FFI target (jaxinfer.cpu_paged_attention), told apart from the int8 matmuls.
ATTENTION_TARGET = "jaxinfer_paged_attention_cpu"
PROMPT = "Write a long story about a cat who learns to fly over the sea, with many details. "


def categorise(hlo_module: str, op: str, result_type: str, op_name: str, vocab: int) -> str:
    """The part of the step an XLA op belongs to. Matmuls are told by their op (XLA:CPU drops the
    metadata of the dots it emits itself), the lm_head by its [rows, vocab] result, the rest by
    the model's named scopes in ``op_name``."""
    if "sample" in hlo_module:
        return "sampler"
    if ATTENTION_TARGET in op_name:  # the native attention is an ffi_call too, not a matmul
        return "attention other (norm, rope, cache write, attention)"
    if op.startswith(("dot", "ffi_call", "ynn_fusion")) or "dot_general" in op_name:
        return "lm_head" if f",{vocab}]" in result_type else "layer matmuls"
    if "/attention" in op_name:
        return "attention other (norm, rope, cache write, attention)"
    if "/mlp" in op_name:
        return "mlp other (norm, silu)"
    return "forward other (embed, final norm, copies)"


def op_names_of(dump_dir: Path, variant: str, batch: int, vocab: int) -> dict[str, tuple[str, str]]:
    """instruction name -> (result type, op_name metadata), from the optimised decode forward
    program of ``variant`` (told apart by its embedding's dtype, int8 payloads and [batch, vocab] logits)."""
    dtype, _, quantization = variant.partition("@")[0].partition("+")
    embed = f"weights_embed.1: {'bf16' if dtype == 'bfloat16' else 'f32'}[{vocab},"
    for path in sorted(dump_dir.glob("*jit__forward_step*after_optimizations.txt")):
        text = path.read_text()
        if embed in text and (("s8[" in text) == (quantization == "int8")) and f"[{batch},{vocab}]" in text:
            found = {}
            for line in text.splitlines():
                m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) ", line)
                if m:
                    meta = re.search(r'op_name="([^"]*)"', line)
                    target = re.search(r'custom_call_target="([^"]*)"', line)
                    found[m.group(1)] = (m.group(2), (meta.group(1) if meta else "") + (f"/{target.group(1)}" if target else ""))
            return found
    raise RuntimeError(f"no decode forward program of {variant} in {dump_dir}")


def trace_ops(trace_dir: Path) -> list[dict]:
    path = next(trace_dir.glob("**/*.trace.json.gz"))
    events = json.load(gzip.open(path))["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and isinstance(e.get("args"), dict) and "hlo_op" in e["args"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--variants", default="float32,bfloat16,float32+int8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dump_dir = Path(tempfile.mkdtemp(prefix="cpu_step_profile_"))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir}/DUMP".strip()
    sys.path.insert(0, str(REPO))
    import jax

    from jaxinfer import LLM, SamplingParams

    info = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
            "load_before": [round(x, 2) for x in os.getloadavg()]}
    print(info, flush=True)
    llms = {}
    import jaxinfer.linear

    for variant in args.variants.split(","):
        # "float32+int8@1": int8 weights, the native CPU matmul on at most 1 thread. The constant
        # is read when the step programs are traced, which LLM() does while warming up.
        spec, _, threads = variant.partition("@")
        dtype, _, quantization = spec.partition("+")
        if threads:
            jaxinfer.linear.CPU_INT8_MAX_THREADS = int(threads)
        llms[variant] = LLM(model=args.model, dtype=dtype, quantization=quantization or None, use_tqdm=False,
                            enable_prefix_caching=False)

    def decode_steps(llm, trace_to: Path | None = None) -> list[float]:
        ids = llm.tokenizer.encode(PROMPT * (args.prompt_len // 8 + 1))[:args.prompt_len]
        params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
        engine = llm.engine
        for i in range(args.batch):
            engine.add_request(f"p{time.monotonic_ns()}-{i}", [(ids[0] + i) % 1000, *ids[1:]], params)
        engine.step()  # the prefill (and first token)
        if trace_to is not None:
            jax.profiler.start_trace(str(trace_to))
        times = []
        cpu_start = time.process_time()
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        cpu_ms[id(llm)].append(1000 * (time.process_time() - cpu_start) / args.steps)
        if trace_to is not None:
            jax.profiler.stop_trace()
        while engine.has_unfinished_requests():
            engine.step()
        return times

    # Process CPU time per step (every thread of this process): on a shared machine it counts
    # what the steps computed, not what they waited for a core.
    cpu_ms = collections.defaultdict(list)
    for llm in llms.values():
        decode_steps(llm)  # compiles whatever warmup left
    cpu_ms.clear()
    wall = collections.defaultdict(list)
    for _ in range(args.rounds):
        for variant, llm in llms.items():
            wall[variant] += decode_steps(llm)
    results = {"info": info, "batch": args.batch, "variants": {}}
    vocab = next(iter(llms.values())).model.config.vocab_size
    for variant, llm in llms.items():
        trace_dir = dump_dir / f"trace_{variant.replace('+', '_').replace('@', '_')}"
        traced = decode_steps(llm, trace_dir)
        step_parts = parts(trace_ops(trace_dir), op_names_of(dump_dir / "DUMP", variant, args.batch, vocab),
                           args.steps, vocab)
        traced_ms = 1000 * statistics.fmean(traced)
        step_parts["host (step wall time minus XLA ops)"] = traced_ms - sum(step_parts.values())
        results["variants"][variant] = {"wall_ms_per_step": 1000 * statistics.median(wall[variant]),
                                         "cpu_ms_per_step": statistics.median(cpu_ms[id(llm)][:args.rounds]),
                                         "traced_wall_ms_per_step": traced_ms, "parts_ms_per_step": step_parts}
        print(variant, json.dumps(results["variants"][variant], indent=1), flush=True)
    info["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_step_profile.json").write_text(json.dumps(results, indent=2))


def parts(ops: list[dict], op_names: dict[str, tuple[str, str]], steps: int, vocab: int) -> dict[str, float]:
    """ms per step of the traced XLA ops, summed per part of the step (see the module docstring)."""
    total = collections.Counter()
    # A while loop's thunk holds its body's thunks: count only the outermost op on each thread.
    outermost, end_of = [], {}
    for event in sorted(ops, key=lambda e: (e["tid"], e["ts"])):
        if event["ts"] >= end_of.get(event["tid"], -1.0):
            outermost.append(event)
            end_of[event["tid"]] = event["ts"] + event["dur"]
    for event in outermost:
        module, op = event["args"]["hlo_module"], event["args"]["hlo_op"]
        result_type, op_name = op_names.get(op, ("", "")) if "forward" in module else ("", "")
        total[categorise(module, op, result_type, op_name, vocab)] += event["dur"] / 1e3 / steps
    return dict(total.most_common())


if __name__ == "__main__":
    main()

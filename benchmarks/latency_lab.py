"""Where the batch-1 decode step's time goes (Llama-3.1-8B shapes, random weights, one GPU), bf16 and fp8 weights.

    python3 benchmarks/latency_lab.py --out DIR [--weights bf16,fp8] [--steps 16] [--top 30]
    python3 benchmarks/latency_lab.py --out DIR --shape tiny --steps 2   # CPU smoke run
    python3 benchmarks/latency_lab.py --out DIR --weights bf16 \
        --xla-options xla_gpu_unsupported_enable_triton_multi_output_fusion=true   # a fusion choice, same run
    python3 benchmarks/latency_lab.py --out DIR --attention pallas_gpu_fused   # the fused-write kernel at batch 1
    python3 benchmarks/latency_lab.py --out DIR --weights fp8 --batches 16,32,64,128   # moderate batches too

For each weight format (``fp8``: the projections quantized per channel, as
``--quantization fp8`` does; embedding and lm_head stay bf16), one sequence at a 384-token
context, on the device alone (``--steps`` steps inside one jitted loop with a static trip
count, so XLA's while loop never waits on the host; each step feeds its token to the next):

* the step the engine runs at batch 1, **bucket 8x8** (8 token rows, 8 sequence rows: the
  smallest GPU bucket), with the engine's "basic" sampler program (``jaxinfer.sampling.sample``,
  greedy) inside the loop; and the same at bucket 1x1;
* the weight layer alone: every projection and the lm_head through ``jaxinfer.linear`` at 8
  rows, nothing else (the GEMV chain the step cannot beat);
* a ``jax.profiler`` trace of each step loop, parsed (``profile_collectives.load_trace`` /
  ``busy_time``) into µs per step and share by what the kernel does: weight GEMVs (XLA's or
  ours), lm_head, attention kernel, KV-write scatter, sampler, other fusions (norms, rope,
  residual adds), and the gaps between kernels; plus the top kernels by name.

With ``--batches``, decode steps of N sequences (bucket NxN, every row a sequence at
``--batch-context`` tokens, bf16 cache) as well: fp8 decode steps of 16-128 sequences ran 5-11 ms
in throughput-1k (session 12), 1.5-3x a weight-and-K/V-read estimate, and the weight path changes
there (our GEMV to M = 16, XLA weight-only below ``FP8_W8A8_MIN_TOKENS``, W8A8 from it).

Each is compared with the roofline: bytes of every weight a step reads (all but the input
embedding; for the ``--batches`` rows plus the K/V they attend over) / the HBM read ceiling
measured in the same run. Writes DIR/latency_lab.{json,md,log}
and the traces under DIR/profile_<format>_<variant>/.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    Log, count_fp8_dots, decode_weight_bytes, header, jaxpr_equations, measure_ceilings, random_model, write_results,
)
from profile_collectives import busy_time, gpu_kernels, load_trace  # noqa: E402

from jaxinfer.batch import build_step_batch  # noqa: E402
import jaxinfer.linear as linear_lib  # noqa: E402
from jaxinfer.compile_options import merged_dots_options, quantized_gemm_options  # noqa: E402
from jaxinfer.kv_cache import create_kv_cache  # noqa: E402
from jaxinfer.linear import linear  # noqa: E402
from jaxinfer.model import compute_logits, hidden_states  # noqa: E402
from jaxinfer.sampling import SamplingFlags, SamplingTensors, sample  # noqa: E402

NAME = "latency_lab"
CONTEXT = 384
PAGE_SIZE = 32
BASIC_SAMPLER = SamplingFlags(any_random=True)  # the runner's "basic" path (greedy and plain temperature)
# What a kernel does, first match wins, over its name and the trace's annotations (HLO op, name
# scope) lower-cased. Scopes come from jax.named_scope in the model and in this step.
KINDS = (
    ("sampler", ("sampler", "logits_processing", "random_sampling")),
    ("lm_head", ("lm_head",)),
    ("attention kernel", ("paged_attention", "decode_attention", "ragged_attention")),
    ("KV write (scatter)", ("scatter", "dynamic_update_slice", "dynamic-update-slice", "write_kv")),
    ("weight GEMV (ours)", ("weight_only_matmul", "wgmma_matmul")),
    ("weight GEMV (XLA)", ("gemm", "gemv", "nvjet", "cublas", "cutlass", "xmma", "triton_dot", "dot_general",
                           "dot.", "matmul")),
    ("fusions (norms, rope, residual, convert)", ("fusion", "reduce", "loop_", "input_")),
)


def kernel_kind(text: str) -> str:
    for kind, tags in KINDS:
        if any(tag in text for tag in tags):
            return kind
    return "other (copies, memset, ...)"


_HLO_OP = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]*)"', re.M)


def op_scopes(hlo_text: str) -> dict[str, str]:
    """Each instruction of a compiled module's HLO text -> the JAX name stack it came from (``op_name``).

    Kernels in a GPU trace are named after the HLO instruction that launched them, with "."
    written "_" (``fusion.12`` -> ``fusion_12``), so both spellings map; the name stack carries
    the ``jax.named_scope``s (``.../lm_head/dot_general``), which names a kernel's purpose even
    where the trace annotates it with nothing but its own name.
    """
    scopes = {}
    for name, op_name in _HLO_OP.findall(hlo_text):
        scopes[name] = scopes[name.replace(".", "_").replace("-", "_")] = op_name
    return scopes


def event_text(event: dict, scopes: dict[str, str]) -> str:
    """A kernel event's name, string annotations and HLO name stack, lower-cased, for ``kernel_kind``."""
    args = event.get("args", {})
    strings = [event["name"]] + [str(v) for v in args.values() if isinstance(v, str)]
    names = [event["name"].split("(")[0]] + [str(args[key]) for key in ("hlo_op", "name") if key in args]
    strings += [scopes[n] for n in names if n in scopes]
    return " ".join(strings).lower()


def kernel_op(event: dict, scopes: dict[str, str]) -> str:
    """The JAX op a kernel event came from (its HLO name stack), shortened to what follows the
    layer scope ("layer_*/mlp/add") or to its last three parts; "" when the HLO does not name it.

    With identical fusions XLA reuses one compiled kernel, named after the first (layer 0's)."""
    args = event.get("args", {})
    names = [event["name"].split("(")[0]] + [str(args[key]) for key in ("hlo_op", "name") if key in args]
    op_name = next((scopes[n] for n in names if n in scopes), str(args.get("tf_op", "")))
    layer = re.search(r"/layer_\d+/(.*)", op_name)
    return f"layer_*/{layer.group(1)}" if layer else "/".join(op_name.split("/")[-3:])


def breakdown(trace_path: Path, steps: int, top: int, scopes: dict[str, str] | None = None) -> dict:
    """µs per step by kind and by kernel, busy vs the span (the rest are gaps), from the GPU's kernel events.

    ``scopes``: ``op_scopes`` of the traced program's HLO, so kernels are sorted by the named
    scope they ran in (lm_head, sampler) as well as by their own names."""
    scopes = scopes or {}
    events, processes = load_trace(trace_path)
    kernels = gpu_kernels(events, processes)
    if not kernels:
        return {"error": f"no GPU kernel events in {trace_path.name} (processes: {sorted(processes.values())})"}
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = busy_time(intervals)
    by_kind, by_name, counts = collections.Counter(), collections.Counter(), collections.Counter()
    launches, ops = collections.Counter(), {}
    for e in kernels:
        kind = kernel_kind(event_text(e, scopes))
        by_kind[kind] += e["dur"] / steps
        name = e["name"].split("(")[0][:90]
        by_name[f"{kind}: {name}"] += e["dur"] / steps
        launches[f"{kind}: {name}"] += 1 / steps
        ops.setdefault(f"{kind}: {name}", kernel_op(e, scopes))
        counts[kind] += 1 / steps
    by_kind["gaps between kernels"] = (span - busy) / steps
    step_us = span / steps
    return {
        "step_us": step_us, "busy_us": busy / steps, "kernels_per_step": len(kernels) / steps,
        "by_kind_us": dict(by_kind.most_common()), "kernels_per_step_by_kind": dict(counts),
        "share": {k: v / step_us for k, v in by_kind.items()},
        "top_kernels_us": dict(by_name.most_common(top)),
        # Per top kernel: launches a step (32 for one kernel per layer of Llama-3.1-8B, 64 for two)
        # and the JAX op it came from, which says what a generic name ("fusion_1305") does.
        "top_kernels": {key: {"us": us, "launches_per_step": launches[key], "jax_op": ops[key]}
                        for key, us in by_name.most_common(top)},
        # What the trace annotates kernels with, so the classification can be checked against it.
        "sample_event_args": [e.get("args", {}) for e in kernels[:3]],
    }


def pages_needed(num_active: int, context: int) -> int:
    """Cache pages for ``num_active`` sequences of ``context`` tokens and their next token (+ the padding page)."""
    return 1 + num_active * (context // PAGE_SIZE + 1)


def decode_batch(num_tokens: int, num_seqs: int, max_pages: int, num_active: int = 1, context: int = CONTEXT):
    """A decode step of ``num_active`` sequences at ``context`` tokens each (pages of their own), padded to the bucket."""
    per_seq = context // PAGE_SIZE + 1
    chunks = [([1], context, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(num_active)]
    return build_step_batch(chunks, num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=max_pages, padding_page=0)


def step_body(model, impl: str, num_seqs: int, num_active: int = 1):
    """One engine decode step (forward, lm_head over the sequence rows, basic sampler), feeding
    each active sequence its token back."""
    sampling = jax.tree.map(jnp.asarray, SamplingTensors.neutral(num_seqs))

    def body(carry, weights):
        cache, batch = carry
        x, cache = hidden_states(weights, cache, batch, model.config, impl)
        with jax.named_scope("lm_head"):
            logits = compute_logits(weights, x[batch.logits_indices])  # [B, V] f32
        with jax.named_scope("sampler"):
            tokens = sample(logits, sampling, BASIC_SAMPLER).token_ids[:num_active]
        return cache, dataclasses.replace(batch, token_ids=batch.token_ids.at[:num_active].set(tokens))

    return body


def weight_layer_body(model):
    """Every projection and the lm_head through the weight layer at x's rows, nothing else."""
    def body(x, weights):
        for layer in weights.layers:
            q = linear("te,ehd->thd", x, layer.q)
            k = linear("te,ehd->thd", x, layer.k)
            v = linear("te,ehd->thd", x, layer.v)
            attn = q + jnp.repeat(k + v, q.shape[1] // k.shape[1], axis=1)
            x = x + linear("thd,hde->te", attn, layer.o)
            h = jax.nn.silu(linear("te,ef->tf", x, layer.gate)) * linear("te,ef->tf", x, layer.up)
            x = x + linear("tf,fe->te", h, layer.down)
        with jax.named_scope("lm_head"):
            logits = compute_logits(weights, x)
        return x + (jnp.max(logits) * 1e-30).astype(x.dtype)

    return body


def static_loop(body, steps: int):
    """``carry = body(carry, weights)`` ``steps`` times in one program; a static trip count, so no host sync per step."""

    @jax.jit
    def run(carry, weights):
        return jax.lax.fori_loop(0, steps, lambda i, c: body(c, weights), carry)

    return run


def parse_xla_options(text: str) -> dict:
    """``"name=value,name=value"`` -> compiler options: true/false as booleans, integers as ints."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("xla_"):
            raise SystemExit(f"--xla-options: {item!r} is not xla_<name>=<value>")
        options[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.lstrip("-").isdigit()
                                                            else value)
    return options


def compile_loop(run, carry, weights, compiler_options: dict | None = None):
    """The loop compiled ahead of time (one compile), and its HLO's name stacks per instruction."""
    compiled = run.lower(carry, weights).compile(compiler_options or None)
    return compiled, op_scopes(compiled.as_text() or "")


def time_and_trace(log: Log, run, carry, weights, steps: int, repeats: int, trace_dir: Path | None):
    """Seconds per step (median of ``repeats`` calls) and, with ``trace_dir``, one more call under the profiler."""
    jax.block_until_ready(run(carry, weights))  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(carry, weights))
        times.append(time.perf_counter() - start)
    if trace_dir is not None:
        with jax.profiler.trace(str(trace_dir)):
            jax.block_until_ready(run(carry, weights))
    return float(np.median(times)) / steps


def measure_format(log: Log, args, fmt: str, ceiling_tbs: float) -> dict:
    model = random_model(args.shape, quantization=None if fmt == "bf16" else fmt)
    config, weights = model.config, model.weights
    per_token = decode_weight_bytes(weights)
    roofline = per_token / (ceiling_tbs * 1e12)
    log(f"[{fmt}] roofline: {per_token / 1e9:.2f} GB / {ceiling_tbs:.2f} TB/s = {roofline * 1e3:.3f} ms")
    on_gpu = jax.default_backend() == "gpu"
    impl = "pallas_gpu" if on_gpu else "reference"
    max_pages = 2048 // PAGE_SIZE
    rows = []
    variants = [("decode step, bucket 8x8 (engine's)", 8, 8, {}, impl), ("decode step, bucket 1x1", 1, 1, {}, impl),
                ("weight layer only (projections + lm_head), 8 rows", 8, None, {}, impl)]
    # The engine's step again with another attention kernel, or under other XLA compiler options
    # (fusion choices), in the same run. Off a GPU the kernels run the reference (smoke runs).
    extra = [(f"decode step, bucket 8x8, attention {other}", 8, 8, {}, other if on_gpu else impl)
             for other in args.attention if other != "pallas_gpu"]
    extra += [(f"decode step, bucket 8x8, XLA {text}", 8, 8, parse_xla_options(text), impl)
              for text in args.xla_options]
    variants[1:1] = extra
    # Moderate batches: every row a sequence at --batch-context tokens (throughput-1k's tail ran
    # ~76 sequences at ~1500 tokens, 11.2 ms a step in fp8, session 12). Their roofline adds the
    # K/V the step reads.
    batch_options = [("", {})] + [(f", XLA {text}", parse_xla_options(text)) for text in args.xla_options]
    variants += [(f"decode step, bucket {n}x{n}, {n} sequences at {args.batch_context} tokens{xla}", n, n, options,
                  impl) for n in args.batches for xla, options in batch_options]
    # The same with FP8 W8A8 from fewer rows than FP8_W8A8_MIN_TOKENS: where to put the switch.
    if fmt == "fp8" and args.w8a8_min_tokens:
        variants += [(f"decode step, bucket {n}x{n}, {n} sequences at {args.batch_context} tokens, "
                      f"W8A8 from {args.w8a8_min_tokens} rows", n, n, {}, impl)
                     for n in args.batches if args.w8a8_min_tokens <= n < linear_lib.FP8_W8A8_MIN_TOKENS]
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # bf16 cache
    for i, (label, t, b, options, step_impl) in enumerate(variants):
        trace_dir = None
        batched = b is not None and label.startswith(f"decode step, bucket {b}x{b}, {b} sequences")
        num_active, context = (b, args.batch_context) if batched else (1, CONTEXT)
        if not args.no_trace and b is not None:
            trace_dir = args.out / (f"profile_{fmt}_{t}x{b}" + (f"_v{i}" if i > 0 else ""))
        w8a8_min = args.w8a8_min_tokens if label.endswith(f"W8A8 from {args.w8a8_min_tokens} rows") else None
        default_w8a8_min = linear_lib.FP8_W8A8_MIN_TOKENS
        try:
            if w8a8_min:
                linear_lib.FP8_W8A8_MIN_TOKENS = w8a8_min  # read at trace time (compile_loop below)
            # As the engine compiles a step that runs FP8 W8A8: without Triton GEMMs.
            backend = jax.default_backend()
            options = {**merged_dots_options(model.config.quantization, t, backend),
                       **quantized_gemm_options(model.config.quantization, t, backend), **options}
            if b is None:
                carry = jnp.ones((t, config.hidden_size), jnp.bfloat16) * 0.01
                run = static_loop(weight_layer_body(model), args.steps)
            else:
                num_pages = max(64, pages_needed(num_active, context + args.steps))
                cache = create_kv_cache(config, num_pages, PAGE_SIZE, jnp.bfloat16)
                max_pages_here = max(max_pages, -(-(context + args.steps) // PAGE_SIZE) + 1)
                carry = (cache, jax.tree.map(jnp.asarray, decode_batch(t, b, max_pages_here, num_active, context)))
                run = static_loop(step_body(model, step_impl, b, num_active), args.steps)
            num_fp8_dots = count_fp8_dots(jaxpr_equations(jax.make_jaxpr(run)(carry, weights).jaxpr))
            run, scopes = compile_loop(run, carry, weights, options)
            seconds = time_and_trace(log, run, carry, weights, args.steps, args.repeats, trace_dir)
        except Exception as error:  # noqa: BLE001  (reported, not hidden)
            log(f"[{fmt}] {label}: failed: {type(error).__name__}: {str(error)[:300]}")
            rows.append({"variant": label, "error": str(error)[:300]})
            continue
        finally:
            linear_lib.FP8_W8A8_MIN_TOKENS = default_w8a8_min
        row_roofline = roofline + (num_active * context * kv_bytes_per_token / (ceiling_tbs * 1e12) if batched else 0)
        row = {"variant": label, "ms": seconds * 1e3, "ratio_to_roofline": seconds / row_roofline,
               "weights_tbs": per_token / seconds / 1e12, "fp8_x_fp8_dots": num_fp8_dots}
        log(f"[{fmt}] {label}: {seconds * 1e3:.3f} ms = {seconds / row_roofline:.2f}x roofline "
            f"({row['weights_tbs']:.2f} TB/s of weights)")
        if trace_dir is not None:
            traces = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
            row["breakdown"] = (breakdown(traces[-1], args.steps, args.top, scopes) if traces
                                else {"error": f"no trace under {trace_dir}"})
            log_breakdown(log, f"[{fmt}] {label}", row["breakdown"])
        rows.append(row)
    del model, weights
    return {"per_token_bytes": per_token, "roofline_ms": roofline * 1e3, "variants": rows}


def log_breakdown(log: Log, label: str, b: dict) -> None:
    if "error" in b:
        log(f"{label}: breakdown failed: {b['error']}")
        return
    log(f"{label}: trace {b['step_us']:.0f} us a step, {b['kernels_per_step']:.0f} kernels, busy {b['busy_us']:.0f} us")
    for kind, us in b["by_kind_us"].items():
        log(f"    {us:8.1f} us  {b['share'][kind]:6.1%}  {kind}")
    for name, us in list(b["top_kernels_us"].items())[:12]:
        about = b.get("top_kernels", {}).get(name, {})
        log(f"    {us:8.1f} us  {name}  ({about.get('launches_per_step', 0):.0f} a step: {about.get('jax_op', '')})")


def markdown(results: dict, args) -> str:
    info, ceiling = results["info"], results["ceilings"]["hbm_read_tbs"]
    md = [f"# Batch-1 decode step, {args.shape}: where the time goes", "", f"Command: `{info['command']}`  ",
          f"{info['device']}, jax {info['jax']}; HBM read ceiling {ceiling:.2f} TB/s; context {CONTEXT}, "
          f"{args.steps} steps per jitted loop", ""]
    for fmt, r in results["formats"].items():
        md += [f"## {fmt} weights: roofline {r['roofline_ms']:.3f} ms ({r['per_token_bytes'] / 1e9:.2f} GB a step)",
               "", "| variant | ms per step | x roofline | weight TB/s | FP8 x FP8 dots a step |",
               "| --- | --- | --- | --- | --- |"]
        for v in r["variants"]:
            md.append(f"| {v['variant']} | {v['ms']:.3f} | {v['ratio_to_roofline']:.2f} | {v['weights_tbs']:.2f} | "
                      f"{v.get('fp8_x_fp8_dots', '')} |" if "ms" in v else f"| {v['variant']} | failed: {v['error'][:80]} | | | |")
        for v in r["variants"]:
            b = v.get("breakdown")
            if not b or "error" in b:
                continue
            md += ["", f"### {fmt}, {v['variant']}: {b['step_us']:.0f} µs a step in the trace, "
                   f"{b['kernels_per_step']:.0f} kernels", "", "| kind | µs per step | share | kernels per step |",
                   "| --- | --- | --- | --- |"]
            md += [f"| {kind} | {us:.1f} | {b['share'][kind]:.1%} | {b['kernels_per_step_by_kind'].get(kind, 0):.0f} |"
                   for kind, us in b["by_kind_us"].items()]
            md += ["", "| top kernels | µs per step | launches per step | JAX op |", "| --- | --- | --- | --- |"]
            about = b.get("top_kernels", {})
            md += [f"| `{re.sub(r'[|`]', ' ', name)}` | {us:.1f} | {about.get(name, {}).get('launches_per_step', 0):.0f} "
                   f"| `{re.sub(r'[|`]', ' ', about.get(name, {}).get('jax_op', ''))}` |"
                   for name, us in b["top_kernels_us"].items()]
    return "\n".join(md) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--weights", default="bf16,fp8", help="weight formats, in order (bf16, fp8, int8)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per jitted loop (and per trace)")
    parser.add_argument("--no-trace", action="store_true", help="time only: no profiler traces, no breakdown")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of the loop (median)")
    parser.add_argument("--top", type=int, default=30, help="kernels listed by time per step")
    parser.add_argument("--batches", type=lambda text: [int(x) for x in text.split(",") if x], default=[],
                        help="also time and trace decode steps of this many sequences (bucket NxN), e.g. 32,64,128")
    parser.add_argument("--batch-context", type=int, default=1536, help="tokens of context of each --batches sequence")
    parser.add_argument("--w8a8-min-tokens", type=int, default=0,
                        help="fp8: also run the --batches steps below FP8_W8A8_MIN_TOKENS rows as W8A8 from this many rows")
    parser.add_argument("--attention", type=lambda text: [x for x in text.split(",") if x], default=[],
                        help="also time and trace the 8x8 step with these attention kernels (pallas_gpu_fused, ...)")
    parser.add_argument("--xla-options", action="append", default=[], metavar="NAME=VALUE,...",
                        help="time and trace the 8x8 step (and each --batches step) again compiled with these "
                             "XLA options (repeatable; values without commas)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log()
    results = {"info": header(log)}
    results["ceilings"] = ceilings = measure_ceilings(log)
    results["formats"] = {}
    formats = [f for f in args.weights.split(",") if f]
    from jaxinfer.attention import IMPLEMENTATIONS

    for impl in args.attention:
        if impl not in IMPLEMENTATIONS:
            raise SystemExit(f"--attention: {impl!r} is not one of {IMPLEMENTATIONS}")
    for fmt in formats:
        if fmt not in ("bf16", "fp8", "int8"):
            raise SystemExit(f"--weights: {fmt!r} is not one of bf16, fp8, int8")
    for fmt in formats:
        results["formats"][fmt] = measure_format(log, args, fmt, ceilings["hbm_read_tbs"])
        # What is measured so far survives a timeout that cuts the next format short.
        (args.out / f"{NAME}.partial.json").write_text(json.dumps(results, indent=1, default=str))
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    write_results(args.out, NAME, results, markdown(results, args), log)


if __name__ == "__main__":
    main()

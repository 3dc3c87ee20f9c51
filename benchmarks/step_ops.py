"""What one layer of the decode step emits: op counts of the lowered program, and (compiled) its kernels.

    python3 benchmarks/step_ops.py                                  # Llama-3.1-8B, bf16, bucket 8x8, pallas_gpu
    python3 benchmarks/step_ops.py --weights fp8 --out DIR          # fp8 weights; DIR/step_ops.{json,md,log}
    python3 benchmarks/step_ops.py --shape tiny --impl cpu          # CPU smoke run

Two views of the step the engine runs at batch 1 (``hidden_states`` + ``compute_logits`` over a
``StepBatch`` of ``--tokens`` rows and ``--seqs`` sequences, the cache donated), made from shapes
alone (no weights are allocated, so the 8B shapes cost nothing):

* **per-layer StableHLO op counts**, lowered for ``--platform`` (default: cuda when ``--impl`` is a
  GPU kernel, so this view works on a machine without a GPU). The model unrolls its layers, so a
  layer's ops are the difference between the programs of 3 and 2 layers; nested jits (the
  attention wrapper) are counted at each call. XLA:GPU fuses elementwise chains but starts a new
  kernel at reductions, scatters, custom calls (the Pallas kernel) and dots, so those counts bound
  the kernels a layer launches. ``tests/test_step_ops.py`` keeps the counts of the ops removed
  from the layer (sin/cos, concatenate, slices) from coming back.
* **the compiled layer's kernels**, with ``--compile`` or when the default backend is the target
  platform: the optimized HLO's entry instructions that came from layer 1 (``jax.named_scope``
  ``layer_1``), in program order, each with its fusion kind, its HLO name (a profile names the
  kernel after it, "." written "_") and the JAX ops fused into it (their name stacks), which maps
  the kernels of a ``benchmarks/latency_lab.py`` trace to the model's code.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from model_shapes import SHAPES  # noqa: E402

from jaxinfer.batch import build_step_batch  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.kv_cache import create_kv_cache  # noqa: E402
from jaxinfer.model import compute_logits, hidden_states  # noqa: E402
from jaxinfer.params import init_random  # noqa: E402

NAME = "step_ops"
CONTEXT = 384  # the latency benchmark's context
PAGE_SIZE = 32
GPU_IMPLS = ("pallas_gpu", "pallas_gpu_fused", "pallas_gpu_fresh_prefill")
# The ops that end an XLA:GPU fusion (a kernel of their own, or the kernel they are fused into).
KERNEL_BOUNDARY_OPS = ("dot_general", "reduce", "scatter", "custom_call", "sort")
# The attention kernels' jitted wrappers (pallas_kernels.paged_attention): their K/V write, work-tile
# metadata, output buffers and split merge are the kernel owners' code, counted apart from the model's.
ATTENTION_WRAPPERS = ("ragged_paged_attention",)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The step to inspect: architecture (a Hugging Face config dict), weights, bucket, attention."""

    hf_config: dict
    weights: str = "bf16"  # "bf16", "fp8", "int8" (projections quantized per channel)
    num_tokens: int = 8
    num_seqs: int = 8
    impl: str = "pallas_gpu"
    kv_cache_dtype: str = "bf16"  # "bf16" or "fp8"

    def config(self, num_layers: int) -> ModelConfig:
        hf = {**self.hf_config, "num_hidden_layers": num_layers}
        if self.weights != "bf16":
            hf["quantization_config"] = {"quant_method": "jaxinfer", "weights": self.weights}
        return ModelConfig.from_hf(hf)


def trace_step(shape: StepShape, num_layers: int):
    """The jitted decode step traced from abstract weights, cache and batch (nothing allocated)."""
    config = shape.config(num_layers)
    weights = jax.eval_shape(lambda: init_random(config, jax.random.key(0), jnp.bfloat16))
    cache_dtype = jnp.float8_e4m3fn if shape.kv_cache_dtype == "fp8" else jnp.bfloat16
    cache = jax.eval_shape(lambda: create_kv_cache(config, 64, PAGE_SIZE, cache_dtype))
    pages = list(range(1, CONTEXT // PAGE_SIZE + 2))
    batch = build_step_batch([([1], CONTEXT, pages)], num_tokens=shape.num_tokens, num_seqs=shape.num_seqs,
                             pages_per_seq=2048 // PAGE_SIZE)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)

    def step(weights, cache, batch):
        x, cache = hidden_states(weights, cache, batch, config, shape.impl)
        return compute_logits(weights, x[batch.logits_indices]), cache

    return jax.jit(step, donate_argnums=(1,)).trace(weights, cache, batch)


def lower_step(shape: StepShape, num_layers: int, platform: str):
    """``trace_step`` lowered for ``platform`` ("cuda" works without a GPU)."""
    if platform in ("cuda", "gpu", "rocm") and jax.default_backend() != "gpu":
        # Pallas's Triton lowering asks for the device it compiles for: name one.
        from jax.sharding import AbstractDevice, AbstractMesh

        mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
            device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
        with jax.sharding.use_abstract_mesh(mesh):
            return trace_step(shape, num_layers).lower(lowering_platforms=(platform,))
    return trace_step(shape, num_layers).lower(lowering_platforms=(platform,))


_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)")
_CALL = re.compile(r"(?<!custom_)call @([\w.$-]+)\(")
_OP = re.compile(r'= "?stablehlo\.([a-z_]+)')


def stablehlo_op_counts(text: str, entry: str = "main", skip_calls_to: tuple[str, ...] = ()) -> collections.Counter:
    """StableHLO ops of ``entry`` by name, each called function's ops counted once per call, except
    calls to functions whose names start with one of ``skip_calls_to`` (counted as ``call:<name>``)."""
    functions, ops = {}, None
    for line in text.splitlines():
        match = _FUNC.match(line)
        if match:
            ops = functions.setdefault(match.group(1), collections.Counter())
            continue
        if ops is None:
            continue
        for callee in _CALL.findall(line):
            ops["call:" + callee] += 1
        match = _OP.search(line)
        if match:
            ops[match.group(1)] += 1
    expanded = {}

    def expand(name):
        if name not in expanded:
            total = collections.Counter()
            for op, n in functions[name].items():
                if op.startswith("call:") and op[len("call:"):].startswith(skip_calls_to):
                    total[op] += n
                elif op.startswith("call:"):
                    for inner, m in expand(op[len("call:"):]).items():
                        total[inner] += n * m
                else:
                    total[op] += n
            expanded[name] = total
        return expanded[name]

    return expand(entry)


def per_layer_op_counts(shape: StepShape, platform: str, skip_calls_to: tuple[str, ...] = ()) -> dict[str, int]:
    """StableHLO ops one more layer adds to the step (3 layers minus 2): {op: count}, nonzero only.

    ``skip_calls_to``: function name prefixes whose calls count as one ``call:<name>`` each, not
    by their ops (``ATTENTION_WRAPPERS``: the model's own ops, without the kernel's wrapper)."""
    two, three = (stablehlo_op_counts(lower_step(shape, n, platform).as_text(), skip_calls_to=skip_calls_to)
                  for n in (2, 3))
    return {op: three[op] - two[op] for op in sorted(set(two) | set(three)) if three[op] != two[op]}


# name = shape op(...): the shape may be a tuple, "(bf16[8,64]{1,0}, f32[8]{0})".
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\(")
_HLO_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_FREE_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "opt-barrier"}


def hlo_computations(hlo_text: str) -> dict[str, list[str]]:
    """An optimized HLO module's computations: name -> instruction lines (the entry is "ENTRY")."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        match = _HLO_COMPUTATION.match(line)
        if match:
            current = computations.setdefault("ENTRY" if match.group(1) else match.group(2), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return computations


def launched_instructions(computations: dict[str, list[str]], name: str = "ENTRY"):
    """(line, HLO name, shape, op) of each instruction the program runs, in order: the entry's,
    with calls (XLA:GPU wraps runs of kernels in ``call``s to command-buffer computations, which a
    CUDA graph launches) replaced by the called computation's; free ops (parameters, bitcasts,
    tuples) left out."""
    for line in computations.get(name, []):
        match = _HLO_INSTRUCTION.match(line)
        if not match or match.group(3) in _FREE_OPS:
            continue
        called = re.search(r"to_apply=%?([\w.\-]+)", line)
        if match.group(3) == "call" and called:
            yield from launched_instructions(computations, called.group(1))
        else:
            yield line, match.group(1), match.group(2), match.group(3)


def _jax_ops(lines: list[str], scope: str) -> list[str]:
    """Distinct JAX op names (the name stack after ``scope``) of HLO instruction lines, in order."""
    names = []
    for line in lines:
        op_name = re.search(r'op_name="([^"]*)"', line)
        if op_name and scope in op_name.group(1) + "/":
            name = op_name.group(1).split(scope, 1)[1]
            if name not in names:
                names.append(name)
    return names


def kernels_by_layer(compiled_text: str) -> dict[str, int]:
    """Launched instructions per ``layer_<i>`` scope of their op name; "step" for the rest (work done
    once a step, and instructions XLA made without a JAX op, such as copies)."""
    counts = collections.Counter()
    for line, *_ in launched_instructions(hlo_computations(compiled_text)):
        layer = re.search(r'op_name="[^"]*?/(layer_\d+)/', line)
        counts[layer.group(1) if layer else "step"] += 1
    return dict(sorted(counts.items()))


def layer_kernels(compiled_text: str, layer: int = 1) -> list[dict]:
    """The instructions the compiled program runs for ``layer_<layer>``, in program order: each
    launches a kernel (or a library call) on the GPU. ``jax_ops_fused``: the JAX ops fused into it
    (name stacks below the layer's scope), which say what it does."""
    computations = hlo_computations(compiled_text)
    scope = f"/layer_{layer}/"
    kernels = []
    for line, hlo, shape, op in launched_instructions(computations):
        if not _jax_ops([line], scope):
            continue
        kind = re.search(r"kind=(k\w+)", line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        body = computations.get(called.group(1), []) if called else []
        kernels.append({
            "hlo": hlo, "op": op, "kind": kind.group(1) if kind else (target.group(1) if target else ""),
            "shape": shape, "jax_op": _jax_ops([line], scope)[0], "jax_ops_fused": _jax_ops(body, scope),
        })
    return kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--weights", default="bf16", choices=("bf16", "fp8", "int8"))
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--tokens", type=int, default=8, help="token rows of the step's bucket")
    parser.add_argument("--seqs", type=int, default=8, help="sequence rows of the step's bucket")
    parser.add_argument("--impl", default="pallas_gpu", help="attention implementation (jaxinfer.attention)")
    parser.add_argument("--platform", default=None, help="lowering platform (default: cuda for GPU kernels)")
    parser.add_argument("--compile", action="store_true", help="also compile on this machine and list layer 1's kernels")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/step_ops.{json,md,log}")
    args = parser.parse_args()
    platform = args.platform or ("cuda" if args.impl in GPU_IMPLS else jax.default_backend())
    shape = StepShape(SHAPES[args.shape], args.weights, args.tokens, args.seqs, args.impl, args.kv_cache_dtype)
    device = getattr(jax.devices()[0], "device_kind", str(jax.devices()[0]))
    lines = [f"command: python3 {' '.join(sys.argv)}", f"jax {jax.__version__}, backend {jax.default_backend()} ({device})",
             f"step: {args.shape}, {args.weights} weights, {args.kv_cache_dtype} KV, bucket "
             f"{args.tokens}x{args.seqs}, impl {args.impl}, lowered for {platform}"]
    counts = per_layer_op_counts(shape, platform)
    model_counts = per_layer_op_counts(shape, platform, skip_calls_to=ATTENTION_WRAPPERS)
    boundaries = sum(counts.get(op, 0) for op in KERNEL_BOUNDARY_OPS)
    lines.append(f"StableHLO ops per layer: {sum(counts.values())} ({sum(model_counts.values())} the model's, "
                 f"the rest in the attention wrapper); kernel boundaries ({', '.join(KERNEL_BOUNDARY_OPS)}): "
                 f"{boundaries}")
    lines.append(f"  {'layer':>5s}  {'model':>5s}  op")
    lines += [f"  {n:5d}  {model_counts.get(op, 0):5d}  {op}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    results = {"command": lines[0][len("command: "):], "jax": jax.__version__, "device": device,
               "shape": args.shape, "weights": args.weights, "kv_cache_dtype": args.kv_cache_dtype,
               "bucket": [args.tokens, args.seqs], "impl": args.impl, "platform": platform,
               "stablehlo_ops_per_layer": counts, "model_stablehlo_ops_per_layer": model_counts,
               "kernel_boundaries_per_layer": boundaries}
    backend = jax.default_backend()
    if args.compile or (backend == "gpu" and platform in ("cuda", "gpu")) or backend == platform:
        compiled = trace_step(shape, 3).lower().compile().as_text()
        kernels = layer_kernels(compiled, layer=1)
        results["layer_1_kernels"] = kernels
        results["kernels_by_layer"] = by_layer = kernels_by_layer(compiled)
        lines.append(f"compiled on {backend}: kernels by the layer they came from (3 layers; 'step': once a step "
                     f"or made by XLA): {by_layer}")
        lines.append(f"layer 1 launches {len(kernels)} kernels:")
        for k in kernels:
            lines.append(f"  {k['hlo']:36s} {k['op']:12s} {k['kind']:16s} {k['shape'][:40]:40s} {k['jax_op']}")
            fused = [op for op in k["jax_ops_fused"] if op != k["jax_op"]]
            if fused:
                lines.append(f"  {'':36s} fuses: {', '.join(fused)}")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{NAME}.json").write_text(json.dumps(results, indent=1))
        (args.out / f"{NAME}.log").write_text("\n".join(lines) + "\n")
        (args.out / f"{NAME}.md").write_text("```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()

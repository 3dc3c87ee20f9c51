"""FP8 weights on the GPU: the compiled program uses an FP8 GEMM and never transposes the weight,
and where weight-only and W8A8 cross over.

    python3 benchmarks/fp8_hlo_check.py --out /tmp/fp8_hlo   [--shape tiny: CPU smoke, no assertions]

1. **HLO checks** (the assertions; exit status 1 when one fails), for the Llama-3.1-8B MLP shapes
   (``[M, 4096] x gate/up [14336, 4096]``, ``[M, 14336] x down [4096, 14336]``) as the model runs
   it (gate and up through ``jaxinfer.linear.linear_many``, down through ``linear``) with FP8
   ``QuantizedWeight``s, compiled with the engine's options for that bucket
   (``jaxinfer.compile_options.quantized_gemm_options``), at each token bucket ``M``:

   - at ``M >= FP8_W8A8_MIN_TOKENS`` (W8A8) the optimized HLO holds a GEMM whose operands are both
     ``f8e4m3fn``: a cuBLASLt custom call (``__cublas$lt$matmul$f8`` in XLA of 2024-25; any
     custom call whose target names cublas and takes two f8 operands is accepted) or, failing
     that, a ``dot``/Triton GEMM fusion over two f8 operands (reported as such);
   - at every ``M`` no instruction transposes the weight: no ``transpose`` and no layout-changing
     ``copy`` of an ``f8e4m3fn[N, K]`` array into ``[K, N]`` (or of the weight's layout
     ``{1,0}`` into ``{0,1}``);
   - below ``FP8_UNMERGED_BELOW_TOKENS`` no instruction concatenates the weights: XLA's dot merger
     rewrites gate and up into one dot over ``concatenate(gate, up)``, which a cuBLASLt GEMM reads
     only once it is written out, every step (2.3 ms a step of the 8B model on an H200;
     compile_options.py); from there on, where the engine keeps XLA's default, they are reported;
   - below the threshold (weight-only), which form XLA picked is reported (a GEMM over a
     converted bf16 copy of the weight would read 3 bytes per weight where 1 is the goal).

2. **Crossover sweep**: 16 layers of that MLP (1.9 GB of e4m3 weights) chained in one jitted
   program, weight-only vs W8A8 vs the bf16 dense einsum, at M = 1 ... 2048, reported as ms per
   chain and TB/s of weight bytes against the HBM read ceiling measured in the same run. The
   smallest M from which W8A8 stays faster is the measured ``FP8_W8A8_MIN_TOKENS`` (printed;
   the constant in ``jaxinfer/linear.py`` is set from it by hand).

Writes ``fp8_hlo_check.{json,md,log}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import Log, header, measure_ceilings, time_in_loop, write_results  # noqa: E402

from jaxinfer import linear as linear_module  # noqa: E402
from jaxinfer.compile_options import FP8_UNMERGED_BELOW_TOKENS, quantized_gemm_options  # noqa: E402
from jaxinfer.quantization import QuantizedWeight, quantize  # noqa: E402

SHAPES = {"llama8b": (4096, 14336), "tiny": (256, 512)}
F8 = "f8e4m3fn"


def random_fp8_weight(key, n: int, k: int) -> QuantizedWeight:
    """An e4m3 weight [N, K] with per-channel scales, quantized from a normal draw on the device."""
    return jax.jit(lambda key: quantize(jax.random.normal(key, (n, k), jnp.float32) / k**0.5, "fp8", 1))(key)


def mlp_down_up(x, up: QuantizedWeight, down: QuantizedWeight):
    """x [M, E] -> up [M, F] -> down [M, E], both through the weight layer."""
    h = linear_module.linear("te,ef->tf", x, up)
    return linear_module.linear("tf,fe->te", h, down)


def gated_mlp(x, gate: QuantizedWeight, up: QuantizedWeight, down: QuantizedWeight):
    """The model's MLP (jaxinfer.model): gate and up share x, so they go through linear_many."""
    g, u = linear_module.linear_many("te,ef->tf", x, (gate, up))
    return linear_module.linear("tf,fe->te", jax.nn.silu(g) * u, down)


def hlo_of(fn, *args, compiler_options=None) -> str:
    return jax.jit(fn, compiler_options=compiler_options or None).lower(*args).compile().as_text()


INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*?)\)(.*)$")


def element_type(hlo_type: str) -> str:
    return hlo_type.lstrip("(").split("[", 1)[0]


def gemm_forms(hlo: str) -> dict:
    """What the optimized HLO multiplies with: cuBLAS custom calls, dots and GEMM fusions, each
    with the element types of its operands (operands are printed by name: each name is looked
    up in its own computation, where parameters and instructions declare their types)."""
    forms = {"cublas_custom_calls": [], "dots": [], "triton_gemm_fusions": []}
    types: dict[str, str] = {}
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("(", 1)[0]:
            types = {}  # a new computation: its own names
            continue
        match = INSTRUCTION.match(line)
        if not match:
            continue
        name, result_type, opcode, operands, rest = match.groups()
        types[name] = result_type
        operand_types = [element_type(types.get(op.strip().lstrip("%"), "?"))
                         for op in operands.split(",") if op.strip()]
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        if opcode == "custom-call" and target and re.search(r"cublas|gemm|matmul", target.group(1), re.I):
            forms["cublas_custom_calls"].append({"target": target.group(1), "types": operand_types})
        elif opcode == "dot":
            forms["dots"].append({"types": operand_types})
        elif opcode == "fusion" and "triton_gemm" in rest:
            forms["triton_gemm_fusions"].append({"types": operand_types})
    return forms


def fp8_gemm_found(forms: dict) -> str | None:
    """How the program runs an FP8 x FP8 GEMM, or None."""
    for call in forms["cublas_custom_calls"]:
        if call["types"].count(F8) >= 2 or "f8" in call["target"]:
            return f"custom call {call['target']}"
    for kind in ("triton_gemm_fusions", "dots"):
        for entry in forms[kind]:
            if entry["types"][:2] == [F8, F8]:
                return f"{kind[:-1]} over two f8 operands"
    return None


def weight_transposes(hlo: str, n: int, k: int) -> list[str]:
    """Instructions that transpose an f8 weight [n, k] (a transpose, or a copy into [k, n] or
    into the other layout)."""
    bad = []
    for line in hlo.splitlines():
        if not re.search(r"\b(transpose|copy)\(", line):
            continue
        result = line.split("=", 1)[1] if "=" in line else line
        result_type = result.strip().split(" ")[0]
        if result_type.startswith(f"{F8}[{k},{n}]") or (
                result_type.startswith(f"{F8}[{n},{k}]") and "{0,1}" in result_type):
            bad.append(line.strip()[:200])
    return bad


def weight_concatenations(hlo: str, weight_elements: int) -> list[str]:
    """Instructions that concatenate f8 arrays into one of at least ``weight_elements`` elements
    (merged weights: activations of a few hundred token rows are far smaller)."""
    bad = []
    for line in hlo.splitlines():
        match = INSTRUCTION.match(line)
        if not match or match.group(3) != "concatenate" or element_type(match.group(2)) != F8:
            continue
        dims = re.search(r"\[([\d,]*)\]", match.group(2)).group(1)
        if math.prod(int(d) for d in dims.split(",") if d) >= weight_elements:
            bad.append(line.strip()[:200])
    return bad


def check_hlo(log: Log, e: int, f: int, buckets: list[int], strict: bool) -> tuple[list[dict], list[str]]:
    keys = jax.random.split(jax.random.key(0), 3)
    gate, up, down = (random_fp8_weight(keys[0], f, e), random_fp8_weight(keys[1], f, e),
                      random_fp8_weight(keys[2], e, f))
    platform = jax.default_backend()
    rows, failures = [], []
    for m in buckets:
        x = jnp.ones((m, e), jnp.bfloat16)
        options = quantized_gemm_options("fp8", m, platform)
        hlo = hlo_of(gated_mlp, x, gate, up, down, compiler_options=options)
        forms = gemm_forms(hlo)
        fp8 = fp8_gemm_found(forms)
        transposes = weight_transposes(hlo, f, e) + weight_transposes(hlo, e, f)
        concatenations = weight_concatenations(hlo, f * e)
        path = "W8A8" if m >= linear_module.FP8_W8A8_MIN_TOKENS else "weight-only"
        row = {"m": m, "path": path, "fp8_gemm": fp8, "weight_transposes": transposes,
               "weight_concatenations": concatenations, "compiler_options": options,
               "gemm_forms": {k: v[:4] for k, v in forms.items()}}
        rows.append(row)
        log(f"M={m:5d} {path:11s}: fp8 GEMM: {fp8 or 'none'}; weight transposes: {len(transposes)}; "
            f"weight concatenations: {len(concatenations)}; "
            f"custom calls {[c['target'] for c in forms['cublas_custom_calls']]}")
        if not strict:
            continue
        if path == "W8A8" and fp8 is None:
            failures.append(f"M={m}: no FP8 x FP8 GEMM in the W8A8 program ({forms})")
        if transposes:
            failures.append(f"M={m}: the weight is transposed: {transposes[:2]}")
        if concatenations and m < FP8_UNMERGED_BELOW_TOKENS:
            failures.append(f"M={m}: the weights are concatenated (merged dots): {concatenations[:2]}")
    return rows, failures


def sweep(log: Log, e: int, f: int, buckets: list[int], layers: int, hbm_tbs: float) -> list[dict]:
    keys = jax.random.split(jax.random.key(1), 2 * layers)
    ups = [random_fp8_weight(keys[2 * i], f, e) for i in range(layers)]
    downs = [random_fp8_weight(keys[2 * i + 1], e, f) for i in range(layers)]
    dense_ups = [jax.jit(lambda w: (w.payload.astype(jnp.bfloat16).T))(w) for w in ups]  # [E, F] bf16
    dense_downs = [jax.jit(lambda w: (w.payload.astype(jnp.bfloat16).T))(w) for w in downs]  # [F, E]
    fp8_bytes = sum(w.payload.size for w in ups + downs)
    rows = []
    for m in buckets:
        x = jax.random.normal(jax.random.key(m), (m, e), jnp.bfloat16)

        def chain(threshold):
            def body(x, ups, downs):
                saved = linear_module.FP8_W8A8_MIN_TOKENS
                linear_module.FP8_W8A8_MIN_TOKENS = threshold  # read at trace time
                try:
                    for up, down in zip(ups, downs):
                        x = (mlp_down_up(x, up, down) * 1e-2).astype(jnp.bfloat16)
                finally:
                    linear_module.FP8_W8A8_MIN_TOKENS = saved
                return x
            return body

        def dense(x, ups, downs):
            for up, down in zip(ups, downs):
                h = jnp.einsum("te,ef->tf", x, up)
                x = (jnp.einsum("tf,fe->te", h, down) * 1e-2).astype(jnp.bfloat16)
            return x

        t_weight_only = time_in_loop(chain(1 << 30), x, ups, downs, unroll=4)
        t_w8a8 = time_in_loop(chain(0), x, ups, downs, unroll=4)
        t_bf16 = time_in_loop(dense, x, dense_ups, dense_downs, unroll=4)
        row = {"m": m, "weight_only_ms": 1e3 * t_weight_only, "w8a8_ms": 1e3 * t_w8a8, "bf16_ms": 1e3 * t_bf16,
               "weight_only_tbs": fp8_bytes / t_weight_only / 1e12, "w8a8_tbs": fp8_bytes / t_w8a8 / 1e12,
               "bf16_tbs": 2 * fp8_bytes / t_bf16 / 1e12}
        row["weight_only_of_ceiling"] = row["weight_only_tbs"] / hbm_tbs
        rows.append(row)
        log(f"M={m:5d}: weight-only {row['weight_only_ms']:.3f} ms ({row['weight_only_tbs']:.2f} TB/s, "
            f"{100 * row['weight_only_of_ceiling']:.0f}% of read ceiling) · W8A8 {row['w8a8_ms']:.3f} ms · "
            f"bf16 {row['bf16_ms']:.3f} ms")
    return rows


def crossover(rows: list[dict]) -> int | None:
    """The smallest M from which W8A8 is faster than weight-only at every larger M measured."""
    best = None
    for row in reversed(rows):
        if row["w8a8_ms"] < row["weight_only_ms"]:
            best = row["m"]
        else:
            break
    return best


def markdown(results: dict) -> str:
    info = results["info"]
    lines = ["# FP8 weights: compiled GEMMs and the weight-only / W8A8 crossover", "",
             f"`{info['command']}` · {info['date']} · {info['device']} · jax {info['jax']}", "",
             f"HBM read ceiling (same run): {results['ceilings']['hbm_read_tbs']:.2f} TB/s. "
             f"`FP8_W8A8_MIN_TOKENS` in the tree: {results['threshold_in_tree']}; measured crossover: "
             f"{results['measured_crossover']}.", "",
             "| M | path | FP8 GEMM | weight transposes | weight concatenations |", "| --- | --- | --- | --- | --- |"]
    for row in results["hlo"]:
        lines.append(f"| {row['m']} | {row['path']} | {row['fp8_gemm'] or 'none'} | {len(row['weight_transposes'])} "
                     f"| {len(row['weight_concatenations'])} |")
    lines += ["", f"{results['layers']} layers of the MLP chained in one program:", "",
              "| M | weight-only ms (TB/s, % ceiling) | W8A8 ms | bf16 ms |", "| --- | --- | --- | --- |"]
    for row in results["sweep"]:
        lines.append(f"| {row['m']} | {row['weight_only_ms']:.3f} ({row['weight_only_tbs']:.2f}, "
                     f"{100 * row['weight_only_of_ceiling']:.0f}%) | {row['w8a8_ms']:.3f} | {row['bf16_ms']:.3f} |")
    lines += ["", "Failures: " + ("; ".join(results["failures"]) if results["failures"] else "none"), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--buckets", default="1,16,32,64,128,256,512,1024,2048")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    log = Log()
    info = header(log)
    e, f = SHAPES[args.shape]
    buckets = [int(b) for b in args.buckets.split(",")]
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:
        log("not on a GPU: the HLO is printed but not asserted on, and the timings mean nothing")
        args.layers = min(args.layers, 2)
    ceilings = measure_ceilings(log)
    hlo_rows, failures = check_hlo(log, e, f, buckets, strict=on_gpu)
    sweep_rows = sweep(log, e, f, buckets, args.layers, ceilings["hbm_read_tbs"])
    results = {"info": info, "ceilings": ceilings, "shape": args.shape, "layers": args.layers,
               "threshold_in_tree": linear_module.FP8_W8A8_MIN_TOKENS, "measured_crossover": crossover(sweep_rows),
               "hlo": hlo_rows, "sweep": sweep_rows, "failures": failures}
    log(f"measured crossover (W8A8 faster from M =): {results['measured_crossover']}; "
        f"in the tree: {linear_module.FP8_W8A8_MIN_TOKENS}")
    write_results(Path(args.out), "fp8_hlo_check", results, markdown(results), log)
    for failure in failures:
        log("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Tensor parallelism on one host: all-reduce latency, TP=1 vs TP=N engines, communication overlap.

    python3 benchmarks/tensor_parallel.py --out DIR [--shape llama-3.1-8b] [--tp 2]
        [--workloads allreduce,collective-matmul,prefill-overlap,latency,throughput-1k] [--smoke]

Workloads (``../shared/BENCHMARKS.md`` defines ``latency`` and ``throughput-1k``):

- ``allreduce``: one all-reduce of a decode step's activations ([B, hidden] bf16, B = 1..256)
  over the tp devices, timed in a loop inside one jit. Twice per layer per step on the
  critical path, so ``2 * layers *`` this is what TP adds to a decode step.
- ``collective-matmul``: the MLP down projection of a prefill step ([T, ffn/tp] x [ffn/tp, hidden])
  followed by its reduction, three ways: matmul + all-reduce (what XLA does today), matmul +
  reduce-scatter + all-gather, and the ring collective matmul (``sharding.collective_matmul``) + all-gather.
- ``prefill-overlap``: one prefill step of the tp engine (``prefill_seqs x prefill_len`` tokens),
  compiled without and with XLA's latency-hiding scheduler / windowed einsums
  (``jaxinfer.compile_options.XLA_OVERLAP_OPTIONS``), replayed back to back; with ``--profile`` a
  ``jax.profiler`` trace of each (``profile_collectives.py`` reads the exposed collective time
  from them; Perfetto/TensorBoard show them).
  Also the same step at tp=1 and the all-reduce time of its activations summed over the
  layers: ``exposed ~= t(tp) - t(1)/tp`` against that sum.
- ``latency`` and ``throughput-1k``: the engine at tp=1 and at tp=N in the same run
  (``engine_throughput.py``'s workloads), time per output token and tokens/s; with ``--profile``
  also a trace of one latency request's decode steps per tp size (``profile_decode_tp*``).

``--smoke`` shrinks everything (use ``--shape tiny`` on CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu``).
Writes DIR/tensor_parallel.{json,md,log} after each workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import Log, header, measure_ceilings, random_model, time_in_loop, write_results  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxinfer.batch import build_step_batch  # noqa: E402
from jaxinfer.compile_options import OverlapConfig  # noqa: E402
from jaxinfer.engine import Engine, EngineConfig  # noqa: E402
from jaxinfer.memory import num_pages_for_device, pages_for, weight_bytes  # noqa: E402
from jaxinfer.runner import StepInputs  # noqa: E402
from jaxinfer.sampling import SamplingTensors  # noqa: E402
from sharding.collective_matmul import reduce_scatter_matmul  # noqa: E402
from sharding.mesh import TP, make_mesh  # noqa: E402
from sharding.placement import shard_model  # noqa: E402

NAME = "tensor_parallel"


def seconds_per_call(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def allreduce(mesh, hidden, batches, log) -> dict:
    n = mesh.shape[TP]

    def body(carry):  # [B, E] replicated; the mean keeps values bounded over many iterations
        return jax.shard_map(lambda c: jax.lax.psum(c, TP) * (1.0 / n), mesh=mesh, in_specs=P(), out_specs=P())(carry)

    out = {}
    for b in batches:
        x = jax.device_put(jnp.ones((b, hidden), jnp.bfloat16), jax.sharding.NamedSharding(mesh, P()))
        t = time_in_loop(body, x)
        out[str(b)] = t * 1e6
        log(f"allreduce tp={n}: [{b}, {hidden}] bf16 ({b * hidden * 2 / 1024:.0f} KiB): {t * 1e6:.1f} us")
    return {"us": out}


def collective_matmul(mesh, tokens, hidden, ffn, log) -> dict:
    n = mesh.shape[TP]
    sharding = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    x = jax.device_put(jax.random.normal(jax.random.key(0), (tokens, ffn), jnp.bfloat16), sharding(P(None, TP)))
    w = jax.device_put(jax.random.normal(jax.random.key(1), (ffn, hidden), jnp.bfloat16) * ffn**-0.5,
                       sharding(P(TP, None)))

    def local_matmul(a, b):
        return jnp.einsum("tk,kn->tn", a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    variants = {
        "matmul + all-reduce": lambda a, b: jax.lax.psum(local_matmul(a, b), TP),
        "matmul + reduce-scatter + all-gather": lambda a, b: jax.lax.all_gather(
            jax.lax.psum_scatter(local_matmul(a, b), TP, scatter_dimension=0, tiled=True), TP, axis=0, tiled=True),
        "collective matmul (ring) + all-gather": lambda a, b: jax.lax.all_gather(
            reduce_scatter_matmul(a, b, TP), TP, axis=0, tiled=True),
        "matmul only (no reduction)": local_matmul,
    }
    out = {}
    for name, fn in variants.items():
        out_spec = P(None, TP) if name == "matmul only (no reduction)" else P()  # partial sums side by side
        jitted = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(None, TP), P(TP, None)), out_specs=out_spec,
                                       check_vma=False))
        t = seconds_per_call(jitted, x, w)
        out[name] = t * 1e3
        log(f"collective-matmul tp={n} [{tokens}, {ffn}] x [{ffn}, {hidden}]: {name}: {t * 1e3:.3f} ms")
    return {"ms": out, "tokens": tokens, "hidden": hidden, "ffn": ffn}


def build_engine(model, tp, args, overlap=None, warm_up=True, mesh=None):
    """An engine for ``model`` over the first ``tp`` devices (tp=1: no mesh)."""
    mesh = mesh or (make_mesh(tp) if tp > 1 else None)
    if mesh is not None:
        model = shard_model(model, mesh)
    per_device = dataclasses.replace(model.config, num_kv_heads=model.config.num_kv_heads // tp)
    num_pages = num_pages_for_device(per_device, page_size=args.page_size,
                                     bytes_per_element=model.weights.embed.dtype.itemsize,
                                     memory_utilization=0.9, reserve_bytes=4 << 30)
    if jax.default_backend() == "cpu":
        num_pages = max(num_pages, 4 * pages_for(args.max_model_len, args.page_size) + 1)
    config = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                          num_pages=num_pages, overlap=overlap)
    start = time.perf_counter()
    engine = Engine(model, config, warm_up=warm_up, use_tqdm=False, mesh=mesh)
    return engine, time.perf_counter() - start


def prefill_inputs(engine, num_seqs, length) -> StepInputs:
    runner = engine.runner
    pages = pages_for(length, runner.page_size)
    chunks = [(list(np.random.default_rng(i).integers(0, engine.model_config.vocab_size, length)), 0,
               list(range(1 + i * pages, 1 + (i + 1) * pages))) for i in range(num_seqs)]
    t, b, p = runner.buckets.pick(num_seqs * length, num_seqs, pages)
    batch = build_step_batch(chunks, num_tokens=t, num_seqs=b, pages_per_seq=p)
    return StepInputs(batch, SamplingTensors.neutral(b), np.full(t, -1, np.int32), "basic")


def replay(engine, inputs, repeats, profile_dir=None) -> float:
    runner = engine.runner
    jax.block_until_ready(runner.execute(inputs).token_ids)
    if profile_dir is not None:
        jax.profiler.start_trace(str(profile_dir))
    start = time.perf_counter()
    for _ in range(repeats):
        out = runner.execute(inputs)
    jax.block_until_ready(out.token_ids)
    seconds = (time.perf_counter() - start) / repeats
    if profile_dir is not None:
        jax.profiler.stop_trace()
    return seconds


def prefill_overlap(shape, tp, args, log, out_dir) -> dict:
    results = {}
    for label, tp_size, overlap in (("tp=1", 1, None), (f"tp={tp} overlap off", tp, OverlapConfig()),
                                    (f"tp={tp} overlap on", tp, OverlapConfig(prefill=True))):
        model = random_model(shape)
        engine, compile_s = build_engine(model, tp_size, args, overlap, warm_up=False)  # one program replayed
        del model
        inputs = prefill_inputs(engine, args.prefill_seqs, args.prefill_len)
        profile = out_dir / f"profile_{label.replace(' ', '_').replace('=', '')}" if args.profile else None
        start = time.perf_counter()
        jax.block_until_ready(engine.runner.execute(inputs).token_ids)
        compile_s = time.perf_counter() - start
        t = replay(engine, inputs, args.repeats, profile)
        tokens = args.prefill_seqs * args.prefill_len
        results[label] = {"step_ms": t * 1e3, "tokens_per_s": tokens / t, "compile_s": compile_s}
        log(f"prefill {args.prefill_seqs} x {args.prefill_len} tokens, {label}: {t * 1e3:.2f} ms "
            f"({tokens / t:.0f} tok/s; compiled in {compile_s:.0f} s)")
        del engine
        gc.collect()
    config = random_model_config(shape)
    mesh = make_mesh(tp)
    rows = args.prefill_seqs * args.prefill_len
    reduce_us = allreduce(mesh, config.hidden_size, [rows], log)["us"][str(rows)]
    comm_ms = 2 * config.num_layers * reduce_us / 1e3
    off, on, one = (results[k]["step_ms"] for k in (f"tp={tp} overlap off", f"tp={tp} overlap on", "tp=1"))
    summary = {"allreduce_total_ms_if_exposed": comm_ms, "speedup_overlap": off / on,
               "exposed_ms_estimate_off": max(0.0, off - one / tp), "exposed_ms_estimate_on": max(0.0, on - one / tp)}
    log(f"prefill: {2 * config.num_layers} all-reduces of [{rows}, {config.hidden_size}] = {comm_ms:.2f} ms if exposed; "
        f"overlap on/off speed-up {off / on:.3f}x; exposed ~ {summary['exposed_ms_estimate_off']:.2f} ms (off), "
        f"{summary['exposed_ms_estimate_on']:.2f} ms (on)")
    return {"runs": results, **summary}


def random_model_config(shape):
    from common import SHAPES

    from jaxinfer.config import ModelConfig

    return ModelConfig.from_hf(SHAPES[shape])


DECODE_PROFILE_STEPS = 32  # output tokens of the profiled latency request (one prefill step, then decode)


def engine_workloads(shape, tp, args, workloads, ceilings, log) -> dict:
    import engine_throughput

    out = {}
    for tp_size in args.tp_sizes:
        mesh = make_mesh(tp_size) if tp_size > 1 else None
        model = random_model(shape, mesh=mesh)
        config = model.config
        overlap = OverlapConfig(extra=tuple(args.xla_option)) if args.xla_option and tp_size > 1 else None
        engine, compile_s = build_engine(model, tp_size, args, overlap=overlap, mesh=mesh)
        del model
        log(f"engine tp={tp_size}: compiled in {compile_s:.0f} s")
        entry = {"compile_s": compile_s}
        if "latency" in workloads:
            embed_bytes = config.vocab_size * config.hidden_size * 2
            per_device = (weight_bytes(config, 2) - embed_bytes) / tp_size
            entry["latency"] = engine_throughput.latency(engine, per_device, ceilings["hbm_read_tbs"], log,
                                                         repeats=1 if args.smoke else 3)
        if "latency" in workloads and args.profile:
            # A decode trace: is the step's time the GPU's (kernels back to back) or the host's
            # (gaps between steps), and how long do its 2 x layers all-reduces take in place?
            with jax.profiler.trace(str(args.out / f"profile_decode_tp{tp_size}")):
                engine_throughput.run_requests(engine, [[1] * 128], [DECODE_PROFILE_STEPS], f"profile tp={tp_size}")
        if "throughput-1k" in workloads:
            n, length = (8, 32) if args.smoke else (1000, 1000)
            entry["throughput-1k"] = engine_throughput.throughput(engine, [length] * n, [length] * n,
                                                                  f"throughput-1k tp={tp_size}", log)
        out[f"tp={tp_size}"] = entry
        del engine
        gc.collect()
    if 1 not in args.tp_sizes or tp not in args.tp_sizes:
        return out  # no tp=1 baseline (e.g. 70B, which fits no single GPU): the roofline ratios say it
    if "latency" in workloads:
        ratio = out[f"tp={tp}"]["latency"]["tpot_ms"] / out["tp=1"]["latency"]["tpot_ms"]
        out["latency_tpot_ratio"] = ratio
        log(f"latency: TPOT tp={tp} / tp=1 = {ratio:.3f} (goal <= 0.7)")
    if "throughput-1k" in workloads:
        ratio = out[f"tp={tp}"]["throughput-1k"]["output_tokens_per_s"] / out["tp=1"]["throughput-1k"]["output_tokens_per_s"]
        out["throughput_ratio"] = ratio
        log(f"throughput-1k: output tok/s tp={tp} / tp=1 = {ratio:.3f}")
    return out


def markdown(results: dict) -> str:
    lines = ["# Tensor parallelism", "", f"`{results['info']['command']}`", "",
             f"{results['info']['num_devices']} x {results['info']['device']}, jax {results['info']['jax']}", ""]
    w = results["workloads"]
    if "allreduce" in w:
        lines += ["## All-reduce of decode activations", "", "| batch | us |", "| --- | --- |"]
        lines += [f"| {b} | {us:.1f} |" for b, us in w["allreduce"]["us"].items()] + [""]
    if "collective-matmul" in w:
        lines += ["## Down projection + reduction (prefill shapes)", "", "| variant | ms |", "| --- | --- |"]
        lines += [f"| {k} | {v:.3f} |" for k, v in w["collective-matmul"]["ms"].items()] + [""]
    if "prefill-overlap" in w:
        p = w["prefill-overlap"]
        lines += ["## Prefill step, overlap off / on", "", "| run | step ms | tok/s |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['step_ms']:.2f} | {v['tokens_per_s']:.0f} |" for k, v in p["runs"].items()]
        lines += ["", f"Overlap speed-up: {p['speedup_overlap']:.3f}x; all-reduces if fully exposed "
                      f"{p['allreduce_total_ms_if_exposed']:.2f} ms; exposed estimate off/on "
                      f"{p['exposed_ms_estimate_off']:.2f} / {p['exposed_ms_estimate_on']:.2f} ms", ""]
    if "engine" in w:
        e = w["engine"]
        lines += ["## Engine", "", "| run | latency TPOT ms | throughput-1k output tok/s |", "| --- | --- | --- |"]
        for k, v in e.items():
            if isinstance(v, dict):
                lat = v.get("latency", {}).get("tpot_ms")
                thr = v.get("throughput-1k", {}).get("output_tokens_per_s")
                lines.append(f"| {k} | {'' if lat is None else f'{lat:.2f}'} | {'' if thr is None else f'{thr:.0f}'} |")
        lines.append("")
        for key in ("latency_tpot_ratio", "throughput_ratio"):
            if key in e:
                lines.append(f"{key}: {e[key]:.3f}")
    return "\n".join(lines) + "\n"


def xla_option(text: str) -> tuple[str, object]:
    """NAME=VALUE as a compiler option: XLA takes booleans and integers typed, not as strings."""
    name, _, value = text.partition("=")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    if value.lstrip("-").isdigit():
        return name, int(value)
    return name, value


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tp-sizes", default=None,
                        help="engine tp sizes for latency/throughput-1k (default '1,TP'; 70B on 8 GPUs: '4,8')")
    parser.add_argument("--workloads", default="allreduce,collective-matmul,prefill-overlap,latency,throughput-1k")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the code, measures nothing")
    parser.add_argument("--xla-option", action="append", default=[], type=xla_option,
                        metavar="NAME=VALUE", help="an XLA option for the tp>1 engines' step programs (repeatable)")
    parser.add_argument("--profile", action="store_true", help="write jax.profiler traces of the prefill steps and of a latency request's decode steps")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    args.tp_sizes = [int(n) for n in (args.tp_sizes or f"1,{args.tp}").split(",")]
    if args.smoke:
        args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens = 512, 8, 64
        args.prefill_seqs, args.prefill_len, args.repeats = 2, 32, 2
    workloads = args.workloads.split(",")
    log = Log()
    results = {"info": header(log), "workloads": {}}

    def save():
        write_results(args.out, NAME, results, markdown(results), log)

    config = random_model_config(args.shape)
    mesh = make_mesh(args.tp)
    if "allreduce" in workloads:
        results["workloads"]["allreduce"] = allreduce(mesh, config.hidden_size, [1, 8, 64, 256], log)
        save()
    if "collective-matmul" in workloads:
        tokens = 64 if args.smoke else args.prefill_seqs * args.prefill_len
        results["workloads"]["collective-matmul"] = collective_matmul(
            mesh, tokens, config.hidden_size, config.intermediate_size, log)
        save()
    if "prefill-overlap" in workloads:
        results["workloads"]["prefill-overlap"] = prefill_overlap(args.shape, args.tp, args, log, args.out)
        save()
    if "latency" in workloads or "throughput-1k" in workloads:
        results["ceilings"] = measure_ceilings(log, read_gib=1 / 64 if args.smoke else 8.0)
        results["workloads"]["engine"] = engine_workloads(args.shape, args.tp, args, workloads, results["ceilings"], log)
        save()


if __name__ == "__main__":
    main()

"""Host time to dispatch one steady decode step's forward, and what makes it: GPU, one device.

    python3 benchmarks/step_dispatch.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 \
        --batch 1024 --context 1000 --out DIR [--variants ...] [--iters 30] [--rounds 3]

At throughput-1k (fp8, ~1000 running sequences) the engine's dispatch took ~11 ms of a ~44 ms
decode step on the H200 (`host-gpu-profile`: PjitFunction ~12 ms a step, of which XLA's
command-buffer (CUDA graph) update ~3.4 ms a program and the graph launch ~2.9 ms). A command
buffer records device addresses; a buffer whose address changes between runs makes XLA
update every command that reads it, and the step's packed inputs are a new device buffer
every step. This benchmark dispatches the same decode forward (the engine's own
``ModelRunner``, one bucket: ``--batch`` sequences of ``--context`` tokens, each input a
placeholder read from the previous step, as in steady decode) under variants, interleaved
round by round:

- ``fresh``: ``ModelRunner.execute`` as the engine called it before the input slot (forward
  and sampler): host inputs packed and sent (``device_put``) every call, read where they land
- ``staged``: the engine's way now on a GPU: the same, but the forward first copies the inputs
  into the runner's donated ``input_slot`` and reads them there (one command reads the new
  buffer, not every one that uses an input)
- ``same-inputs``: ``fresh`` with the same device input buffers every call (no input address
  changes): the most a stable input address can save
- ``skip-temp``, ``skip-profiled``: ``fresh`` compiled with ``xla_gpu_command_buffer_update_mode``
  SKIP_TEMP / SKIP_PROFILED (XLA's stable-VA modes for command buffers); ``staged+skip-temp``
- ``no-graphs``: ``fresh`` compiled with ``xla_gpu_enable_command_buffer=""`` (every kernel
  launched by the host)

For each: the host's milliseconds inside the call (dispatch; the device is idle when it
starts: each call is waited for, untimed, before the next) and the wall milliseconds per step
of ``--iters`` calls back to back (nothing waited for between them: the larger of the host's
and the device's time per step). A variant whose option this jaxlib lacks is
reported as failed, the rest still run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # jaxinfer, run from anywhere
from common import Log, header, random_model, write_results  # noqa: E402

SKIP_TEMP = {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}
# name: (extra XLA options, inputs through the runner's stable input slot, the same device inputs every call)
VARIANTS = {
    "fresh": ({}, False, False),
    "staged": ({}, True, False),
    "same-inputs": ({}, False, True),
    "skip-temp": (SKIP_TEMP, False, False),
    "staged+skip-temp": (SKIP_TEMP, True, False),
    "skip-profiled": ({"xla_gpu_command_buffer_update_mode": "SKIP_PROFILED"}, False, False),
    "no-graphs": ({"xla_gpu_enable_command_buffer": ""}, False, False),
}


def decode_inputs(runner, batch: int, context: int, rng: np.random.Generator):
    """A steady decode step of ``batch`` sequences at ``context`` tokens, each on its own pages,
    every input token a placeholder (read from the previous step's samples on the device)."""
    t, b, p = runner.buckets.pick(batch, batch, -(-(context + 1) // runner.page_size))
    inputs = runner.empty_inputs(t, b, p)
    pages_per_seq = -(-(context + 1) // runner.page_size)
    pages = rng.permutation(np.arange(1, 1 + batch * pages_per_seq, dtype=np.int32)).reshape(batch, pages_per_seq)
    step = inputs.batch
    step.page_tables[:batch, :pages_per_seq] = pages
    step.positions[:batch] = context
    step.kv_lens[:batch] = context + 1
    step.cu_q_lens[: batch + 1] = np.arange(batch + 1)
    step.cu_q_lens[batch + 1 :] = batch
    step.logits_indices[:batch] = np.arange(batch)
    inputs.prev_rows[:batch] = np.arange(batch)
    inputs.sampling.temperature[:batch] = 0.0
    return inputs


def with_options(runner, extra_options: dict):
    """The runner's forward programs (same function, shardings, donation, options) with ``extra_options`` added."""
    from jaxinfer.compile_options import PhasedJit

    step = runner._step
    return PhasedJit(step._fun, step.overlap, step.decode_max_tokens,
                     base_compiler_options={**step.base_compiler_options, **extra_options},
                     quantization=step.quantization, platform=step.platform, **step._jit_kwargs)


def execute_same_inputs(runner, inputs, device_inputs):
    """``ModelRunner.execute`` for a plain, unmasked step, with inputs already on the device
    (the same buffers every call: no address of an input changes)."""
    fn, forward_packing, (sampler_packed, sampler_packing), packed = device_inputs
    with runner.placement.context():
        (logits, runner.token_pages), runner.cache = fn(  # "same-inputs" runs without the input slot
            runner.model.weights, runner.cache, runner.token_pages, packed, runner.last_sampled,
            runner.device_drafts, None, packing=forward_packing)
        out = runner._sampler(logits, runner.token_pages, sampler_packed, None, packing=sampler_packing,
                              sampler_path=inputs.sampler_path)
    runner.last_sampled = out.token_ids_padded
    return out.sampler


def measure(runner, inputs, same_inputs: bool, iters: int) -> dict:
    """Host ms inside ``execute`` (the device idle at each call's start) and wall ms per step of
    ``iters`` calls back to back (the larger of host and device time per step)."""
    if same_inputs:
        fn, args, kwargs, sampler = runner._calls(inputs)
        device_inputs = (fn, kwargs["packing"], sampler, args[3])

        def execute():
            return execute_same_inputs(runner, inputs, device_inputs)
    else:
        def execute():
            return runner.execute(inputs)
    for _ in range(2):  # compile, warm
        jax.block_until_ready(execute())
    dispatch = []
    for _ in range(iters):
        start = time.perf_counter()
        out = execute()
        dispatch.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(iters):
        out = execute()
    jax.block_until_ready((out, runner.cache))
    pipelined = (time.perf_counter() - start) / iters
    return {"dispatch_ms": 1e3 * statistics.median(dispatch), "dispatch_ms_all": [1e3 * d for d in dispatch],
            "pipelined_ms_per_step": 1e3 * pipelined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--quantization", default="fp8", help="fp8, int8 or none")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("step_dispatch_out"))
    args = parser.parse_args()
    import jax.numpy as jnp

    from jaxinfer.runner import ModelRunner

    log = Log()
    info = header(log)
    quantization = None if args.quantization == "none" else args.quantization
    model = random_model(args.shape, dtype=jnp.dtype(args.dtype), quantization=quantization)
    pages_per_seq = -(-(args.context + 1) // args.page_size)
    runner = ModelRunner(model, num_pages=args.batch * pages_per_seq + 2, page_size=args.page_size,
                         max_model_len=pages_per_seq * args.page_size, max_num_seqs=args.batch,
                         max_num_batched_tokens=max(8192, args.batch), kv_cache_dtype=args.kv_cache_dtype,
                         stable_input_address=True)
    inputs = decode_inputs(runner, args.batch, args.context, np.random.default_rng(0))
    log(f"bucket: {inputs.batch.num_tokens} tokens, {inputs.batch.num_seqs} sequences, "
        f"{inputs.batch.page_tables.shape[1]} pages each; compiler options of the engine's decode step: "
        f"{runner._step.compiler_options(inputs.batch.num_tokens)}")
    variants = args.variants.split(",")
    failed = {}
    engine_programs = runner._step
    programs = {name: with_options(runner, VARIANTS[name][0]) if VARIANTS[name][0] else engine_programs
                for name in variants}
    runs: dict[str, list[dict]] = {name: [] for name in programs}
    slot = runner.input_slot
    for round_index in range(args.rounds):
        for name, program in list(programs.items()):
            _, staged, same_inputs = VARIANTS[name]
            runner._step = program
            runner.input_slot = slot if staged else None
            try:
                row = measure(runner, inputs, same_inputs=same_inputs, iters=args.iters)
            except Exception as error:  # e.g. an option this jaxlib does not know (compiled on first call)
                failed[name] = f"{type(error).__name__}: {str(error)[:500]}"
                del programs[name]
                if staged:  # the slot may have been donated to the call that failed
                    slot = jax.numpy.zeros(slot.shape, slot.dtype)
                continue
            if staged:
                slot = runner.input_slot  # the donated slot comes back from each call
            runs[name].append(row)
            log(f"round {round_index} {name}: dispatch {row['dispatch_ms']:.2f} ms, "
                f"pipelined {row['pipelined_ms_per_step']:.2f} ms/step")
    results = {"info": info, "args": vars(args) | {"out": str(args.out)}, "failed": failed,
               "variants": {name: {"dispatch_ms": statistics.median(r["dispatch_ms"] for r in rows),
                                   "pipelined_ms_per_step": statistics.median(r["pipelined_ms_per_step"] for r in rows),
                                   "rounds": rows}
                            for name, rows in runs.items() if rows}}
    lines = ["# Decode forward dispatch: host time per call by variant", "",
             f"Command: `{info['command']}`  ", f"{info['device']}, jax {info['jax']}, {info['date']}  ",
             f"{args.shape}, quantization {args.quantization}, KV {args.kv_cache_dtype}, B={args.batch}, "
             f"context {args.context}, page size {args.page_size}; median of {args.rounds} interleaved rounds "
             f"of {args.iters} calls", "",
             "| variant | host ms in execute (dispatch) | wall ms per step, back to back | dispatch ÷ fresh |",
             "| --- | ---: | ---: | ---: |"]
    base = results["variants"].get("fresh", {}).get("dispatch_ms")
    for name, row in results["variants"].items():
        ratio = f"{row['dispatch_ms'] / base:.2f}" if base else "-"
        lines.append(f"| {name} | {row['dispatch_ms']:.2f} | {row['pipelined_ms_per_step']:.2f} | {ratio} |")
    for name, error in failed.items():
        lines.append(f"| {name} | failed: {error[:200]} | | |")
    write_results(args.out, "step_dispatch", results, "\n".join(lines) + "\n", log)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

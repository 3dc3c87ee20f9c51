"""The default model on a CPU: jaxinfer (f32, bf16) beside HF transformers and llama.cpp, one run.

    python benchmarks/cpu_default_model.py [--hf-python /tmp/hfvenv/bin/python] [--out DIR]

Measures, on the same GGUF (SmolLM2-135M-Instruct, Q4_1; jaxinfer and transformers load it
dequantized, llama.cpp runs it quantized):
- decode tokens/s at batch 1 and batch 8, and prompt (prefill) tokens/s, greedy with EOS
  ignored: decode time is the time of ``new_tokens`` outputs minus the time of one output
  (the prefill and first token), so it is steady-state decode only;
- the CPU read roofline of the same run: the bandwidth of a numpy sum over an array larger
  than the caches (on every core), divided by the weight bytes a step reads, is the batch-1
  decode rate a step that only reads the weights once would reach;
- the server's per-token latency at batch 1 (``jaxinfer serve`` in a subprocess on a free
  127.0.0.1 port, one streamed completion, inter-token time) against the offline path's.

transformers and llama-cpp-python are not in jaxinfer's environment: ``--hf-python`` names an
interpreter that has them (torch, transformers, gguf; llama-cpp-python optional), and this
same file runs there as a worker (``--worker``) that prints its results as JSON. jaxinfer's dtypes
(``--dtypes float32,bfloat16,float32+int8``) are built first and timed in turn, interleaved. ``llama-bench``
on PATH is used when llama-cpp-python is missing. Each timing is the best of ``--repeats``
(the machine may be shared: the load average before and after is recorded beside the results).
Writes ``cpu_default_model.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "smollm2-135m-instruct"
PROMPT_TEXT = "Write a long story about a cat who learns to fly over the sea, with many details. "


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def best_of(repeats: int, fn) -> float:
    """Fastest of ``repeats`` runs of ``fn()``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of a float32 numpy sum over ``num_bytes``, split over every core (numpy's
    reductions release the GIL), best of ``repeats``."""
    import concurrent.futures

    import numpy as np

    data = np.ones(num_bytes // 4, np.float32)
    num_threads = os.cpu_count() or 1
    pieces = np.array_split(data, num_threads)
    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        seconds = best_of(repeats, lambda: list(pool.map(np.sum, pieces)))
    return data.nbytes / seconds


def step_read_bytes(weights) -> int:
    """Bytes of weights a batch-1 decode step reads: every leaf, except that a model whose
    lm_head is its own leaf (untied, or int8 on CPU: ``jaxinfer.cpu_int8_lm_head``) reads one
    row of the embedding, not all of it."""
    import jax

    total = sum(leaf.nbytes for leaf in jax.tree.leaves(weights))
    if weights.lm_head is not None:
        total -= weights.embed.nbytes - weights.embed[0].nbytes
    return total


def prompt_ids(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(PROMPT_TEXT * (length // 8 + 1))
    return list(ids[:length])


# ---- jaxinfer ------------------------------------------------------------------------------

def bench_jaxinfer(model: str, dtypes: list[str], batch_sizes: list[int], prompt_len: int, new_tokens: int,
                   repeats: int, max_model_len: int | None) -> dict[str, dict]:
    """Every dtype's LLM is built first, then each timing runs the dtypes in turn (interleaved:
    on a shared machine each sees the same load), best of ``repeats``."""

    from jaxinfer import LLM, SamplingParams

    llms, results = {}, {}
    for label in dtypes:
        start = time.perf_counter()
        # "float32+int8": float32 activations, int8 weights (LLM(quantization="int8")).
        dtype, _, quantization = label.partition("+")
        # No prefix caching: a repeated prompt would skip its prefill.
        llms[label] = LLM(model=model, dtype=dtype, use_tqdm=False, max_model_len=max_model_len,
                          enable_prefix_caching=False, quantization=quantization or None)
        ids = prompt_ids(llms[label].tokenizer, prompt_len)
        results[label] = {"startup_s": time.perf_counter() - start, "prompt_ids": ids,
                          "weight_bytes": step_read_bytes(llms[label].model.weights)}

    def generate(llm, ids: list[int], batch: int, max_tokens: int):
        # Distinct prompts (a different first token each), so prefix caching shares nothing.
        prompts = [[(ids[0] + i) % llm.model.config.vocab_size, *ids[1:]] for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)

    for batch in batch_sizes:
        firsts, fulls = {label: [] for label in dtypes}, {label: [] for label in dtypes}
        # Process CPU time (every thread of this process) beside wall time: on a shared machine
        # it counts what the steps computed, not what they waited for a core.
        cpu_firsts, cpu_fulls = {label: [] for label in dtypes}, {label: [] for label in dtypes}
        for label in dtypes:  # the first run of each shape pays for nothing but itself
            generate(llms[label], results[label]["prompt_ids"], batch, new_tokens)
        for _ in range(repeats):
            for label in dtypes:
                ids = results[label]["prompt_ids"]
                for tokens, walls, cpus in ((1, firsts, cpu_firsts), (new_tokens, fulls, cpu_fulls)):
                    cpu_start = time.process_time()
                    walls[label].append(best_of(1, lambda: generate(llms[label], ids, batch, tokens)))
                    cpus[label].append(time.process_time() - cpu_start)
        for label in dtypes:
            first, full = min(firsts[label]), min(fulls[label])
            decode_s = max(full - first, 1e-9)
            results[label][f"batch{batch}"] = {
                "prompt_tokens_per_s": batch * len(results[label]["prompt_ids"]) / first,
                "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
                "decode_ms_per_step": 1000 * decode_s / (new_tokens - 1),
                "decode_cpu_ms_per_step": 1000 * max(min(cpu_fulls[label]) - min(cpu_firsts[label]), 0.0)
                                          / (new_tokens - 1),
            }
            print(f"jaxinfer {label} batch {batch}: {results[label][f'batch{batch}']}", flush=True)
    return results


def bench_server(model: str, dtype: str, ids: list[int], new_tokens: int, repeats: int,
                 max_model_len: int | None, timeout_s: float) -> dict:
    """Per-token latency of one streamed completion through ``jaxinfer serve``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dtype, _, quantization = dtype.partition("+")
    command = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", model, "--dtype", dtype,
               "--host", "127.0.0.1", "--port", str(port)] + (["--quantization", quantization] if quantization else [])
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = open(os.devnull, "w")
    server = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}: {shlex.join(command)}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready in {timeout_s} s")
            time.sleep(0.5)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
            served = json.load(response)["data"][0]["id"]

        def stream() -> list[float]:
            body = json.dumps({"model": served, "prompt": ids, "max_tokens": new_tokens, "temperature": 0,
                               "ignore_eos": True, "stream": True}).encode()
            request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            arrivals = []
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                for line in response:
                    if line.startswith(b"data: {"):
                        arrivals.append(time.perf_counter())
            return arrivals

        stream()
        gaps = []
        for _ in range(repeats):
            arrivals = stream()
            if len(arrivals) >= 3:
                gaps.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))
        return {"inter_token_ms": 1000 * min(gaps), "events": len(arrivals)}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


# ---- transformers and llama.cpp (run with --hf-python, as --worker) -----------------------------

def bench_transformers(gguf: Path, dtype: str, batch_sizes: list[int], prompt_len: int, new_tokens: int,
                       repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype).eval()
    ids = prompt_ids(tokenizer, prompt_len)
    result = {}
    for batch in batch_sizes:
        input_ids = torch.tensor([[(ids[0] + i) % model.config.vocab_size, *ids[1:]] for i in range(batch)])

        def generate(max_tokens: int):
            with torch.inference_mode():
                model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                               max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)

        generate(new_tokens)
        first = best_of(repeats, lambda: generate(1))
        full = best_of(repeats, lambda: generate(new_tokens))
        decode_s = max(full - first, 1e-9)
        result[f"batch{batch}"] = {
            "prompt_tokens_per_s": batch * len(ids) / first,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
            "decode_ms_per_step": 1000 * decode_s / (new_tokens - 1),
        }
        print(f"transformers {dtype} batch {batch}: {result[f'batch{batch}']}", file=sys.stderr, flush=True)
    return result


def bench_llama_cpp(gguf: Path, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """llama.cpp at batch 1 on every core: llama-cpp-python if importable, else llama-bench."""
    threads = os.cpu_count() or 1
    try:
        from llama_cpp import Llama
    except ImportError:
        binary = shutil.which("llama-bench")
        if binary is None:
            return {"skipped": "neither llama-cpp-python nor llama-bench is available"}
        done = subprocess.run([binary, "-m", str(gguf), "-p", str(prompt_len), "-n", str(new_tokens),
                               "-t", str(threads), "-r", str(repeats), "-o", "json"],
                              capture_output=True, text=True, check=True)
        rows = json.loads(done.stdout)
        prompt = next(r for r in rows if r.get("n_prompt", 0) > 0)
        decode = next(r for r in rows if r.get("n_gen", 0) > 0)
        return {"tool": "llama-bench", "batch1": {"prompt_tokens_per_s": prompt["avg_ts"],
                                                  "decode_tokens_per_s": decode["avg_ts"]}}
    llm = Llama(model_path=str(gguf), n_threads=threads, n_ctx=prompt_len + new_tokens + 8, verbose=False)
    ids = llm.tokenize(PROMPT_TEXT.encode() * (prompt_len // 8 + 1))[:prompt_len]

    def generate(max_tokens: int):
        llm.reset()
        produced = 0
        for _ in llm.generate(ids, temp=0.0, reset=True):
            produced += 1
            if produced == max_tokens:
                break

    generate(new_tokens)
    first = best_of(repeats, lambda: generate(1))
    full = best_of(repeats, lambda: generate(new_tokens))
    decode_s = max(full - first, 1e-9)
    return {"tool": "llama-cpp-python", "batch1": {
        "prompt_tokens_per_s": len(ids) / first, "decode_tokens_per_s": (new_tokens - 1) / decode_s,
        "decode_ms_per_step": 1000 * decode_s / (new_tokens - 1)}}


def worker(args: argparse.Namespace) -> None:
    """One peer, in its own process: a crash in one (llama-cpp-python 0.3.36 segfaulted in
    generation here) leaves the other's results standing."""
    gguf = Path(args.gguf)
    out = {"python": platform.python_version()}
    if args.worker == "transformers":
        try:
            import torch
            import transformers
        except ImportError as error:
            out["skipped"] = str(error)
        else:
            out["torch"], out["transformers"] = torch.__version__, transformers.__version__
            for dtype in args.dtypes:
                out[dtype] = bench_transformers(gguf, dtype, args.batch_sizes, args.prompt_len, args.new_tokens,
                                                args.repeats)
    else:
        out.update(bench_llama_cpp(gguf, args.prompt_len, args.new_tokens, args.repeats))
    print(json.dumps(out))


def run_peer(args: argparse.Namespace, peer: str, gguf: Path) -> dict:
    """The worker's JSON for ``peer`` run under ``--hf-python``, or {"skipped": why}."""
    command = [args.hf_python, __file__, "--worker", peer, "--gguf", str(gguf),
               "--dtypes", ",".join(d for d in args.dtypes if "+" not in d),  # peers run dense weights
               "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode != 0:
        return {"skipped": f"{peer} worker exited {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- report ------------------------------------------------------------------------------------

def markdown(results: dict) -> str:
    info = results["info"]
    lines = ["# The default model on a CPU", "",
             f"`{info['command']}`", "",
             f"{info['date']}; {info['cpu']} ({info['cores']} cores); jax {info['jax']}, python {info['python']}. "
             f"Load average (1, 5, 15 min) before: {info['load_before']}, after: {info['load_after']}.", ""]
    lines += [f"Read roofline: {results['read_gb_per_s']:.1f} GB/s (numpy sum over "
              f"{results['read_bytes'] / 2**20:.0f} MiB on {info['cores']} threads).", ""]
    lines += ["| engine | dtype | batch | decode tok/s | ms/step | CPU ms/step | prompt tok/s | batch-1 roofline tok/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in results["engines"].items():
        engine, _, dtype = name.partition(" ")
        for key, row in entry.items():
            if not key.startswith("batch"):
                continue
            roofline = results["roofline_tokens_per_s"].get(dtype, float("nan")) if key == "batch1" else float("nan")
            lines.append(f"| {engine} | {dtype or '-'} | {key[5:]} | {row['decode_tokens_per_s']:.1f} | "
                         f"{row.get('decode_ms_per_step', float('nan')):.1f} | "
                         f"{row.get('decode_cpu_ms_per_step', float('nan')):.1f} | {row['prompt_tokens_per_s']:.0f} | "
                         f"{'' if roofline != roofline else f'{roofline:.0f}'} |")
    if "server" in results:
        s = results["server"]
        lines += ["", f"Server, batch 1 ({s['dtype']}): {s['inter_token_ms']:.1f} ms per token streamed, "
                      f"offline {s['offline_ms']:.1f} ms per step ({s['ratio']:.2f}x)."]
    for name, reason in results.get("skipped", {}).items():
        lines.append(f"\n{name}: skipped ({reason})")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, Hugging Face directory or .gguf")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="activation dtypes, each optionally +fp8 or +int8 for quantized weights "
                             "(jaxinfer only: float32+int8)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--read-mib", type=int, default=1024, help="array the read roofline sums")
    parser.add_argument("--hf-python", default=None, help="an interpreter with torch + transformers (+ llama-cpp-python)")
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--server-timeout", type=float, default=900)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", choices=["transformers", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtypes = args.dtypes.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.worker:
        worker(args)
        return

    import jax

    sys.path.insert(0, str(REPO))
    info = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cpu": cpu_model(), "cores": os.cpu_count(), "jax": jax.__version__,
            "python": platform.python_version(), "load_before": [round(x, 2) for x in load_average()]}
    for key, value in info.items():
        print(f"{key}: {value}", flush=True)
    results = {"info": info, "engines": {}, "skipped": {}}

    results["read_bytes"] = args.read_mib * 2**20
    bandwidth = read_bandwidth(results["read_bytes"], args.repeats + 2)
    results["read_gb_per_s"] = bandwidth / 1e9
    print(f"read roofline: {bandwidth / 1e9:.1f} GB/s", flush=True)

    results["roofline_tokens_per_s"] = {}
    entries = bench_jaxinfer(args.model, args.dtypes, args.batch_sizes, args.prompt_len, args.new_tokens,
                             args.repeats, args.max_model_len)
    for dtype, entry in entries.items():
        results["roofline_tokens_per_s"][dtype] = bandwidth / entry["weight_bytes"]
        results["engines"][f"jaxinfer {dtype}"] = entry

    if not args.no_server:
        dtype = args.dtypes[0]
        server = bench_server(args.model, dtype, results["engines"][f"jaxinfer {dtype}"]["prompt_ids"],
                              args.new_tokens, args.repeats,
                              args.max_model_len, args.server_timeout)
        offline_ms = results["engines"][f"jaxinfer {dtype}"]["batch1"]["decode_ms_per_step"] \
            if 1 in args.batch_sizes else float("nan")
        results["server"] = {"dtype": dtype, **server, "offline_ms": offline_ms,
                             "ratio": server["inter_token_ms"] / offline_ms}
        print(f"server: {results['server']}", flush=True)

    if args.hf_python:
        from jaxinfer.model_registry import resolve_model

        gguf = resolve_model(args.model)
        hf = run_peer(args, "transformers", gguf)
        if "skipped" in hf:
            results["skipped"]["transformers"] = hf["skipped"]
        for dtype in args.dtypes:
            if dtype in hf:
                results["engines"][f"transformers {dtype}"] = hf[dtype]
        llama = run_peer(args, "llama.cpp", gguf)
        if "skipped" in llama:
            results["skipped"]["llama.cpp"] = llama["skipped"]
        else:
            results["engines"]["llama.cpp Q4_1"] = {"batch1": llama["batch1"]}
        results["peers_env"] = {k: v for k, v in {**hf, **llama}.items() if isinstance(v, str) and k != "skipped"}
    else:
        results["skipped"]["transformers, llama.cpp"] = "no --hf-python"

    info["load_after"] = [round(x, 2) for x in load_average()]
    for entry in results["engines"].values():
        entry.pop("prompt_ids", None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_default_model.json").write_text(json.dumps(results, indent=2))
    (out / "cpu_default_model.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

"""The `serve` workload: HTTP through the OpenAI endpoint, measured at the client.

    python3 benchmarks/serve_benchmark.py --out DIR --rates 1,4,16 [--num-requests 200] \
        [--shape llama-3.1-8b] [--url http://127.0.0.1:8000 to use a running server]

Starts ``serve_random.py`` (the production server over random weights of ``--shape``)
unless ``--url`` is given, waits for ``/health``, then for each request rate sends
``--num-requests`` streaming ``/v1/completions`` requests with Poisson arrivals (fixed seed),
prompts of token ids with lengths uniform in [100, 300] (mean 200) and outputs uniform in
[90, 270] (mean 180), EOS ignored. vLLM's metric set per rate: TTFT, TPOT, ITL and
end-to-end latency (mean, median, p99), request and output-token throughput, and the
count of failed requests. Client: aiohttp (one event loop, one connection per request).

Writes DIR/serve_benchmark.{json,md,log}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import SHAPES  # noqa: E402

NAME = "serve_benchmark"


async def one_request(session, url, model, prompt, max_tokens, start_at, t0):
    await asyncio.sleep(max(0.0, start_at - (time.perf_counter() - t0)))
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    token_times, usage, error = [], None, None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                return {"ok": False, "status": response.status, "error": (await response.text())[:200]}
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):
                    token_times.append(time.perf_counter())
    except aiohttp.ClientError as e:
        return {"ok": False, "status": None, "error": repr(e)}
    done = time.perf_counter()
    num_out = usage["completion_tokens"] if usage else len(token_times)
    if error or not token_times or num_out != max_tokens:
        return {"ok": False, "status": 200, "error": error or f"{num_out} of {max_tokens} tokens"}
    ttft = token_times[0] - sent
    return {
        "ok": True, "ttft": ttft, "e2e": done - sent, "itl": np.diff(token_times).tolist(),
        "tpot": (token_times[-1] - token_times[0]) / max(1, num_out - 1), "output_tokens": num_out,
        "input_tokens": len(prompt), "start": sent - t0, "end": done - t0,
    }


def summarize(results, rate, duration) -> dict:
    ok = [r for r in results if r["ok"]]

    def stats(values, scale=1e3):
        if not values:
            return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
        a = np.asarray(values) * scale
        return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}

    itl = [x for r in ok for x in r["itl"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "request_rate": rate, "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "failures": [r for r in results if not r["ok"]][:5], "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_input_tokens": sum(r["input_tokens"] for r in ok), "total_output_tokens": out_tokens,
        "ttft_ms": stats([r["ttft"] for r in ok]), "tpot_ms": stats([r["tpot"] for r in ok]),
        "itl_ms": stats(itl), "e2e_ms": stats([r["e2e"] for r in ok]),
    }


async def run_rate(url, model, rate, num_requests, vocab, seed):
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=num_requests) if rate != float("inf") else np.zeros(num_requests)
    starts = np.cumsum(gaps) - gaps[0]
    in_lens = rng.integers(100, 301, size=num_requests)
    out_lens = rng.integers(90, 271, size=num_requests)
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in in_lens]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            one_request(session, url, model, p, int(n), float(s), t0) for p, n, s in zip(prompts, out_lens, starts)
        ])
        duration = time.perf_counter() - t0
    return summarize(results, rate, duration)


def wait_for_health(url, process, timeout_s):
    import urllib.error
    import urllib.request

    start = time.monotonic()
    last = None
    while time.monotonic() < start + timeout_s:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:  # 503 while loading or warming up: say when that changes
            state = f"{e.code} {e.read()[:200]!r}"
        except Exception as e:
            state = f"no answer ({type(e).__name__})"
        else:
            state = "answered"
        if state != last:
            print(f"  /health after {time.monotonic() - start:.0f} s: {state}", flush=True)
            last = state
        time.sleep(1.0)
    raise TimeoutError(f"no healthy server at {url} after {timeout_s} s (last: {last})")


def markdown(result) -> str:
    lines = [
        "# Serving benchmark (`serve` workload)", "",
        f"Command: `{result['command']}`  ",
        f"Server: `{result['server_command']}`  ",
        f"Model: {result['shape']} (random bf16 weights), {result.get('device', '?')}, start-up {result['startup_s']:.0f} s", "",
        "| rate (req/s) | done / failed | req/s | out tok/s | TTFT mean / median / p99 (ms) | TPOT mean / median / p99 (ms) | ITL mean / median / p99 (ms) | e2e median / p99 (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rates"]:
        f = lambda s: f"{s['mean']:.1f} / {s['median']:.1f} / {s['p99']:.1f}"  # noqa: E731
        lines.append(
            f"| {r['request_rate']} | {r['completed']} / {r['failed']} | {r['request_throughput']:.2f} | "
            f"{r['output_token_throughput']:.0f} | {f(r['ttft_ms'])} | {f(r['tpot_ms'])} | {f(r['itl_ms'])} | "
            f"{r['e2e_ms']['median']:.0f} / {r['e2e_ms']['p99']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rates", default="1,4,16")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--url", default=None)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--server-args", default="",
                        help="more serve_random.py flags, e.g. '--num-pages 26500 --max-model-len 2048'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-timeout", type=float, default=600)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_lines = []

    def log(*parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        log_lines.append(line)

    server, url = None, args.url
    server_cmd = "(given --url)"
    start = time.perf_counter()
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        cmd = [args.python, str(Path(__file__).with_name("serve_random.py")), "--shape", args.shape, "--port",
               str(args.port), "--max-num-seqs", str(args.max_num_seqs), "--max-waiting-requests", "4096",
               "--max-waiting-prompt-tokens", "4000000", "--log-level", "info", *args.server_args.split()]
        server_cmd = " ".join(cmd[1:])
        server = subprocess.Popen(cmd, stdout=open(args.out / "server.log", "w"), stderr=subprocess.STDOUT)
    result = {"command": "python3 " + " ".join(sys.argv), "server_command": server_cmd, "shape": args.shape, "rates": [],
              "device": _device_name()}
    try:
        wait_for_health(url, server, args.server_timeout)
        result["startup_s"] = time.perf_counter() - start
        log(f"server healthy after {result['startup_s']:.0f} s")
        with urllib_json(f"{url}/v1/models") as models:
            model = models["data"][0]["id"]
        vocab = SHAPES[args.shape]["vocab_size"]
        asyncio.run(run_rate(url, model, 8, 8, vocab, args.seed + 99))  # warm the path once
        for rate in [float(r) for r in args.rates.split(",")]:
            summary = asyncio.run(run_rate(url, model, rate, args.num_requests, vocab, args.seed))
            result["rates"].append(summary)
            log(f"rate {rate}: {summary['completed']} ok, {summary['failed']} failed; TTFT median "
                f"{summary['ttft_ms']['median']:.1f} ms, ITL median {summary['itl_ms']['median']:.1f} ms, TPOT median "
                f"{summary['tpot_ms']['median']:.1f} ms; {summary['output_token_throughput']:.0f} out tok/s")
            (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2))
            (args.out / f"{NAME}.md").write_text(markdown(result))
    except Exception:
        if server is not None:  # the server's own account of what it was doing
            lines = (args.out / "server.log").read_text(errors="replace").splitlines()
            print("server.log (last 30 lines):\n" + "\n".join(lines[-30:]), flush=True)
        raise
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            result["server_exit_code"] = server.returncode
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{NAME}.md").write_text(markdown(result))
    (args.out / f"{NAME}.log").write_text("\n".join(log_lines) + "\n")


def _device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "cpu"


class urllib_json:
    """``with urllib_json(url) as data``: GET and parse JSON."""

    def __init__(self, url):
        self.url = url

    def __enter__(self):
        import urllib.request

        with urllib.request.urlopen(self.url, timeout=10) as r:
            return json.loads(r.read())

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

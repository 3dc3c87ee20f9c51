"""What Ray Serve adds to time-to-first-token at low load: the same engine served directly
(``BackgroundServer``: waitress + EngineLoop in this process) and through ``jaxinfer.ray_serve``
(Serve proxy -> OpenAI ingress -> engine replica), one streaming request at a time.

    python3 benchmarks/ray_overhead.py --out DIR [--model tests/fixtures/tiny-llama3] [--num-requests 100]

Both serve the same model with the same engine settings on the CPU (``JAX_PLATFORMS=cpu``), and
both run for the whole measurement: requests alternate between them in rounds of
``--round-size``, so a change in the machine's load (a shared machine) hits both alike. Each
request is a streaming ``/v1/completions`` of a short fixed prompt (``max_tokens`` 4); TTFT is
measured at the client, from sending the request to its first SSE chunk carrying text. The first
``--warmup`` requests of each server are not counted.

Where the overhead goes, measured in the same rounds:

- ``models``: ``GET /v1/models`` on each server: HTTP, Serve's proxy, the ingress's WSGI bridge
  and Flask, with no engine hop (the ingress answers it alone);
- ``engine_call``: from this process, the engine deployment's streaming ``generate`` through a
  Serve handle, to its first output (the ingress -> engine replica hop, routing included),
  against ``EngineLoop.generate`` in this process to its first output.

``--low-latency`` runs Ray as ``jaxinfer serve-ray --low-latency`` does
(``serve_ray.LOW_LATENCY_ENV``). Writes DIR/ray_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import requests  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaxinfer.engine_config import EngineConfig  # noqa: E402
from jaxinfer.ray_serve.config import ModelSpec, RayServeConfig  # noqa: E402
from jaxinfer.ray_serve.serve_ray import LOW_LATENCY_ENV  # noqa: E402

NAME = "ray_overhead"
SERVED_NAME = "model"
PROMPT = "The quick brown fox jumps over the lazy dog"


def ttft(session, base_url: str) -> float:
    """Seconds to the first text chunk of one streamed completion (the stream is read to its end)."""
    start = time.perf_counter()
    first = None
    with session.post(base_url + "/v1/completions", stream=True, timeout=60, json={
            "model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
    if first is None:  # an error event, or no text at all: not a TTFT sample
        raise RuntimeError(f"{base_url}: the stream carried no text")
    return first


def models_latency(session, base_url: str) -> float:
    start = time.perf_counter()
    session.get(base_url + "/v1/models", timeout=60).raise_for_status()
    return time.perf_counter() - start


def engine_requests(tokenizer, i: int) -> list:
    from jaxinfer.engine_client import EngineRequest
    from jaxinfer.sampling_params import SamplingParams

    return [EngineRequest(f"bench-{i}", tokenizer.encode(PROMPT), SamplingParams(max_tokens=4))]


def first_output_direct(loop, tokenizer, i: int) -> float:
    """EngineLoop.generate in this process, to its first output."""
    start = time.perf_counter()
    stream = loop.generate(engine_requests(tokenizer, i))
    while stream.get(timeout=10) is None:
        pass
    elapsed = time.perf_counter() - start
    while not getattr(stream.get(timeout=10), "finished", True):
        pass
    return elapsed


def first_output_through_handle(handle, tokenizer, i: int) -> float:
    """The engine deployment's generate through a Serve handle, to its first output (the item after
    the admission verdict)."""
    start = time.perf_counter()
    responses = handle.options(stream=True).generate.remote(engine_requests(tokenizer, i))
    next(responses)  # the verdict
    next(responses)
    elapsed = time.perf_counter() - start
    for _ in responses:
        pass
    return elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(spec: ModelSpec, num_requests: int, warmup: int, round_size: int, low_latency: bool) -> dict:
    """Both servers up at once; rounds of ``round_size`` requests alternate between them."""
    import ray
    from ray import serve

    from jaxinfer.ray_serve.application import ENGINE_DEPLOYMENT, build_application
    from jaxinfer.server.background import BackgroundServer

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    if low_latency:
        os.environ.update(LOW_LATENCY_ENV)  # read by the Ray processes ray.init starts
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = RayServeConfig(SERVED_NAME, max_num_seqs=spec.engine_config.max_num_seqs, num_cpus_per_replica=0,
                                ingress_num_cpus=0, ingress_threads=16, batch_store=None)
        serve.run(build_application(spec, config), name="jaxinfer", route_prefix="/")
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="jaxinfer")
        with BackgroundServer(spec(), served_model_name=SERVED_NAME, threads=16) as direct:
            tokenizer = direct.engine.tokenizer
            sides = {
                "direct": {"base_url": direct.base_url, "session": requests.Session(),
                           "engine_call": lambda i: first_output_direct(direct.loop, tokenizer, i)},
                "ray": {"base_url": f"http://127.0.0.1:{port}", "session": requests.Session(),
                        "engine_call": lambda i: first_output_through_handle(handle, tokenizer, i)},
            }
            samples = {side: {"ttft": [], "models": [], "engine_call": []} for side in sides}
            done = -warmup
            while done < num_requests:
                for side, s in sides.items():
                    for j in range(round_size):
                        values = (ttft(s["session"], s["base_url"]), models_latency(s["session"], s["base_url"]),
                                  s["engine_call"](done + j))
                        if 0 <= done + j < num_requests:
                            for name, value in zip(("ttft", "models", "engine_call"), values):
                                samples[side][name].append(value)
                done += round_size
            return samples
    finally:
        serve.shutdown()
        ray.shutdown()


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"median_ms": 1e3 * statistics.median(ordered), "mean_ms": 1e3 * statistics.fmean(ordered),
            "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))], "n": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", default=str(REPO / "tests" / "fixtures" / "tiny-llama3"))
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--round-size", type=int, default=10, help="requests to one server before the other's turn")
    parser.add_argument("--low-latency", action="store_true", help="Serve's HAProxy path (docs/RAY.md)")
    args = parser.parse_args()
    print("command:", " ".join(sys.argv), flush=True)
    print("load average before:", os.getloadavg(), flush=True)
    spec = ModelSpec(args.model, "float32", EngineConfig(max_num_seqs=4, max_model_len=512))
    samples = measure(spec, args.num_requests, args.warmup, args.round_size, args.low_latency)
    result = {"model": args.model, "low_latency": args.low_latency, "command": " ".join(sys.argv),
              "load_average_after": os.getloadavg(),
              **{side: {name: summary(values) for name, values in by_name.items()} for side, by_name in samples.items()}}
    result["median_overhead_ms"] = {name: result["ray"][name]["median_ms"] - result["direct"][name]["median_ms"]
                                    for name in ("ttft", "models", "engine_call")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2))
    table = ["| what | direct median ms | Ray median ms | overhead ms | Ray p90 ms | n |", "| --- | --- | --- | --- | --- | --- |"]
    for name, what in (("ttft", "TTFT, streamed /v1/completions"), ("models", "GET /v1/models (no engine hop)"),
                       ("engine_call", "engine call to first output (EngineLoop / Serve handle)")):
        d, r = result["direct"][name], result["ray"][name]
        table.append(f"| {what} | {d['median_ms']:.2f} | {r['median_ms']:.2f} | {r['median_ms'] - d['median_ms']:.2f} "
                     f"| {r['p90_ms']:.2f} | {r['n']} |")
    (args.out / f"{NAME}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()

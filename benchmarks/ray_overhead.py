"""What Ray Serve adds to time-to-first-token at low load: the same engine served directly
(``BackgroundServer``: waitress + EngineLoop in this process) and through ``jaxinfer.ray_serve``
(Serve proxy -> OpenAI ingress -> engine replica), one streaming request at a time.

    python3 benchmarks/ray_overhead.py --out DIR [--model tests/fixtures/tiny-llama3] [--num-requests 100]

Both serve the same model with the same engine settings on the CPU (``JAX_PLATFORMS=cpu``).
Each request is a streaming ``/v1/completions`` of a short fixed prompt (``max_tokens`` 4);
TTFT is measured at the client, from sending the request to its first SSE chunk carrying
text. The first ``--warmup`` requests of each server are not counted. ``--low-latency`` runs
Ray as ``jaxinfer serve-ray --low-latency`` does (``serve_ray.LOW_LATENCY_ENV``). Writes
DIR/ray_overhead.{json,md}.
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


def ttfts(base_url: str, num_requests: int, warmup: int) -> list[float]:
    """Seconds to the first text chunk of each streamed request, after ``warmup`` unmeasured ones."""
    session = requests.Session()
    measured = []
    for i in range(warmup + num_requests):
        start = time.perf_counter()
        with session.post(base_url + "/v1/completions", stream=True, timeout=60, json={
                "model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    if i >= warmup:
                        measured.append(time.perf_counter() - start)
                    break
            for _ in r.iter_lines():  # finish the stream, as a client would
                pass
    return measured


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_direct(spec: ModelSpec, num_requests: int, warmup: int) -> list[float]:
    from jaxinfer.server.background import BackgroundServer

    with BackgroundServer(spec(), served_model_name=SERVED_NAME, threads=16) as server:
        return ttfts(server.base_url, num_requests, warmup)


def measure_ray(spec: ModelSpec, num_requests: int, warmup: int, low_latency: bool) -> list[float]:
    import ray
    from ray import serve

    from jaxinfer.ray_serve.application import build_application

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    if low_latency:
        os.environ.update(LOW_LATENCY_ENV)  # read by the Ray processes ray.init starts
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = RayServeConfig(SERVED_NAME, max_num_seqs=spec.engine_config.max_num_seqs, num_cpus_per_replica=0,
                                ingress_num_cpus=0, ingress_threads=16)
        serve.run(build_application(spec, config), name="jaxinfer", route_prefix="/")
        return ttfts(f"http://127.0.0.1:{port}", num_requests, warmup)
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
    parser.add_argument("--low-latency", action="store_true", help="Serve's HAProxy path (docs/RAY.md)")
    args = parser.parse_args()
    print("command:", " ".join(sys.argv), flush=True)
    spec = ModelSpec(args.model, "float32", EngineConfig(max_num_seqs=4, max_model_len=512))
    direct = summary(measure_direct(spec, args.num_requests, args.warmup))
    through_ray = summary(measure_ray(spec, args.num_requests, args.warmup, args.low_latency))
    result = {"model": args.model, "low_latency": args.low_latency, "direct": direct, "ray": through_ray,
              "median_overhead_ms": through_ray["median_ms"] - direct["median_ms"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=2))
    table = ["| path | median TTFT ms | mean ms | p90 ms | n |", "| --- | --- | --- | --- | --- |"]
    for path, s in (("direct (waitress)", direct), ("through Ray Serve", through_ray)):
        table.append(f"| {path} | {s['median_ms']:.2f} | {s['mean_ms']:.2f} | {s['p90_ms']:.2f} | {s['n']} |")
    table.append(f"\nmedian overhead of Ray Serve: {result['median_overhead_ms']:.2f} ms")
    (args.out / f"{NAME}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()

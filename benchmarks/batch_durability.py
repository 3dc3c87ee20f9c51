"""Batch API durability: SIGKILL batch servers mid-batch, restart them on the same store, count lost
and duplicated lines.

    python benchmarks/batch_durability.py --cycles 10                       # SQLite, one server
    python benchmarks/batch_durability.py --cycles 10 --store redis --servers 2

Each server is ``server.py``'s :func:`run_server` over the fake engine of ``tests/fake_engine.py``
(a step delay, so a batch takes seconds; the queue is under test, not the model), with a short
``--batch-lease-s``. One batch of ``--lines`` completions runs; ``--cycles`` times a server is
killed with SIGKILL once the batch has moved on, and started again. With two servers the other
one keeps running meanwhile and takes over the dead one's work once its lease runs out. At the
end every ``custom_id`` must appear exactly once across the output and error files, each answer
finished by the engine (never an aborted one); every engine request is logged, so the re-runs
(lines in flight at a kill, run again) are counted too. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES_IN_FLIGHT = 8  # BatchRunnerConfig's default: the most lines one kill can make run again
LEASE_S = 1.0

SERVE = """
import argparse, sys
sys.path.insert(0, {root!r})
from tests.fake_engine import FakeEngine
import jaxinfer.server.serve as serve

class LoggingEngine(FakeEngine):
    def add_request(self, request_id, *args, **kw):
        super().add_request(request_id, *args, **kw)
        with open({runs!r}, "a") as f:  # one write per line: whole lines, even from two processes
            f.write(request_id + "\\n")

parser = argparse.ArgumentParser()
serve.add_serve_arguments(parser)
args = parser.parse_args(sys.argv[1:])
sys.exit(serve.run_server(args, engine_factory=lambda a: LoggingEngine(max_model_len=512, step_delay={step_delay})))
"""


class ServerProcess:
    def __init__(self, workdir: Path, name: str, store_args: list[str], step_delay: float, start_timeout_s: float):
        self.log = workdir / f"{name}.log"
        script = SERVE.format(root=str(ROOT), runs=str(workdir / "runs.log"), step_delay=step_delay)
        command = [sys.executable, "-c", script, "--port", "0", "--model", "fake", "--log-level", "info",
                   "--batch-lease-s", str(LEASE_S), *store_args]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
        deadline = time.monotonic() + start_timeout_s
        while (port := self._ready_port()) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{port}"

    def _ready_port(self) -> int | None:
        records = []
        for line in self.log.read_text().splitlines():
            start = line.find("{")
            try:
                records.append(json.loads(line[start:]) if start >= 0 else {})
            except ValueError:
                pass
        if not any(r.get("message") == "ready" for r in records):
            return None
        return next(r["port"] for r in records if r.get("message", "").startswith("listening"))

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def run_cycles(workdir: Path, store_args: list[str], cycles: int, num_lines: int, num_servers: int = 1,
               max_tokens: int = 6, step_delay: float = 0.03, timeout_s: float = 600.0) -> dict:
    """Run one batch through ``cycles`` SIGKILL/restart cycles; the counts of lost, duplicated and re-run lines."""
    deadline = time.monotonic() + timeout_s
    servers = [ServerProcess(workdir, f"server{i}", store_args, step_delay, timeout_s) for i in range(num_servers)]
    try:
        base = servers[0].base_url
        content = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                      "body": {"prompt": f"line {i} of the batch", "max_tokens": max_tokens}}) + "\n"
                          for i in range(num_lines)).encode()
        file_id = requests.post(base + "/v1/files", data={"purpose": "batch"},
                                files={"file": ("in.jsonl", io.BytesIO(content))}, timeout=30).json()["id"]
        batch_id = requests.post(base + "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                             "completion_window": "24h"}, timeout=30).json()["id"]

        def batch():
            return requests.get(f"{servers[0].base_url}/v1/batches/{batch_id}", timeout=30).json()

        for cycle in range(cycles):
            # Kill once the batch has moved on since the last restart, spreading kills over the batch.
            target = num_lines * (cycle + 1) // (cycles + 1)
            while (counts := batch()["request_counts"])["completed"] + counts["failed"] < target:
                assert time.monotonic() < deadline, f"no progress to {target} lines: {counts}"
                time.sleep(0.02)
            victim = cycle % num_servers
            servers[victim].kill()
            servers[victim] = ServerProcess(workdir, f"server{victim}-{cycle + 1}", store_args, step_delay, timeout_s)
        while (final := batch())["status"] != "completed":
            assert time.monotonic() < deadline, f"batch not completed: {final}"
            time.sleep(0.05)
        lines = []
        for file_key in ("output_file_id", "error_file_id"):
            if final[file_key]:
                text = requests.get(f"{servers[0].base_url}/v1/files/{final[file_key]}/content", timeout=30).text
                lines += [json.loads(x) for x in text.splitlines()]
    finally:
        for server in servers:
            server.kill()
    seen = Counter(line["custom_id"] for line in lines)
    expected = {f"line-{i}" for i in range(num_lines)}
    runs = Counter(r.rsplit("-", 1)[0] for r in (workdir / "runs.log").read_text().split())
    finished = [line for line in lines if line["response"] and line["response"]["status_code"] == 200
                and all(c["finish_reason"] == "length" for c in line["response"]["body"]["choices"])]
    return {"cycles": cycles, "servers": num_servers, "lines": num_lines,
            "lost": len(expected - set(seen)), "duplicated": sum(n - 1 for n in seen.values()),
            "unexpected": len(set(seen) - expected), "not_finished": len(lines) - len(finished),
            "request_counts": final["request_counts"], "engine_runs": sum(runs.values()),
            "reruns": sum(runs.values()) - len(runs), "max_runs_of_a_line": max(runs.values()),
            "max_reruns_allowed": cycles * MAX_LINES_IN_FLIGHT}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--store", choices=["sqlite", "redis"], default="sqlite")
    parser.add_argument("--redis-url", default=None, help="default: start a redis-server of its own")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        redis = None
        if args.store == "redis" and args.redis_url is None:
            sys.path.insert(0, str(ROOT))
            from tests.redis_server import RedisServer

            redis = RedisServer(workdir)
        try:
            store_args = (["--batch-redis", args.redis_url or redis.url] if args.store == "redis"
                          else ["--batch-db", str(workdir / "batches.db")])
            started = time.monotonic()
            result = run_cycles(workdir, store_args, args.cycles, args.lines, args.servers)
        finally:
            if redis is not None:
                redis.stop()
    print(json.dumps({"store": args.store, **result, "wall_s": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()

"""benchmarks/compare_trees.py runs two trees' engine benchmark interleaved and sets their medians side by side."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "compare_trees.py"


@pytest.mark.slow
def test_two_trees_interleaved_then_summarized(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "summary"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    # 16 sequences and 256 tokens a step hold --scale 0.01's 10 requests: fewer buckets to compile in
    # each of the three engine runs (59 -> 33 s), as the engine benchmark's own smoke test does.
    done = subprocess.run(
        [sys.executable, SCRIPT, "run", "--base", REPO, "--new", REPO, "--workloads", "startup,throughput-1k",
         "--order", "base,new,new", "--raw", raw, "--timeout-s", "600", "--",
         "--shape", "tiny", "--scale", "0.01", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in (raw / "new").glob("run*")) == ["run1", "run2"]
    done = subprocess.run([sys.executable, SCRIPT, "summarize", "--raw", raw, "--out", out],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = {r["metric"]: r for r in json.loads((out / "compare_trees.json").read_text())["rows"]}
    # Each tree's first run fills its own compilation cache; the second run of "new" finds it warm.
    assert len(rows["start-up, cold cache (s)"]["base_runs"]) == 1
    assert len(rows["start-up, cold cache (s)"]["new_runs"]) == 1
    assert len(rows["start-up, warm cache (s)"]["new_runs"]) == 1
    throughput = rows["throughput-1k (output tok/s)"]
    assert len(throughput["base_runs"]) == 1 and len(throughput["new_runs"]) == 2
    assert throughput["change"] is not None
    assert "throughput-1k (output tok/s)" in (out / "compare_trees.md").read_text()

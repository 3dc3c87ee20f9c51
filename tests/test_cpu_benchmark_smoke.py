"""benchmarks/cpu_default_model.py runs end to end on the tiny fixture model (jaxinfer only).

The numbers mean nothing; the test checks that the offline and server measurements complete
and that the JSON and markdown results are written.
"""

import json
import os
import subprocess
import sys

from tests.conftest import BENCHMARK_CACHE_ENV, REPO


def test_cpu_default_model_benchmark_completes(tmp_path):
    out = tmp_path / "results"
    args = [REPO / "benchmarks" / "cpu_default_model.py", "--model", REPO / "tests" / "fixtures" / "tiny-llama3",
            "--dtypes", "float32", "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "4",
            "--repeats", "1", "--read-mib", "16", "--max-model-len", "128", "--out", out]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **BENCHMARK_CACHE_ENV}
    done = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "cpu_default_model.json").read_text())
    jaxinfer = results["engines"]["jaxinfer float32"]
    assert jaxinfer["batch1"]["decode_tokens_per_s"] > 0 and jaxinfer["batch2"]["prompt_tokens_per_s"] > 0
    assert results["read_gb_per_s"] > 0 and results["server"]["inter_token_ms"] > 0
    assert "no --hf-python" in results["skipped"]["transformers, llama.cpp"]
    assert "| jaxinfer | float32 | 1 |" in (out / "cpu_default_model.md").read_text()

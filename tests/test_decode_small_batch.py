"""benchmarks/decode_small_batch.py's columns and report, without running a kernel (the kernel's own
paths are tested in test_paged_attention_gpu.py; the script runs end to end with --smoke); and
benchmarks/small_bucket_decode.py end to end in the interpreter."""

import json
import os
import subprocess
import sys

from tests.test_benchmarks_smoke import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path)

import decode_small_batch as dsb  # noqa: E402
from pallas_kernels.paged_attention import block_sizes as bs  # noqa: E402


def tuned(batch, context):
    return bs.gpu_block_sizes(num_tokens=batch, max_num_seqs=batch, max_kv_len=context, num_kv_heads=8, group=4,
                              head_dim=128, page_size=32, itemsize=2, kv_itemsize=2)


def test_the_session_18_column_has_the_split_counts_that_kernel_took():
    # Rounded up, as before session 19: 64 at B=1 from 16k, 8 at B=8, 4 at B=16; capped by the
    # context (>= 4 blocks of 64 a split) and unsplit from 132 programs on.
    assert [dsb.session18_splits(1, c) for c in (1024, 4096, 16384, 32768)] == [4, 16, 64, 64]
    assert dsb.session18_splits(8, 16384) == 8 and dsb.session18_splits(16, 4096) == 4
    assert dsb.session18_splits(32, 4096) == 1


def test_columns_compare_the_engine_with_what_changed():
    labels = {label: sizes for label, sizes in dsb.variants(tuned(1, 32768), 1, 32768)}
    assert labels["session 18"].num_splits == 64 and not labels["session 18"].merge_kernel
    assert labels["engine"] == tuned(1, 32768) and labels["engine"].num_splits == 32
    assert not labels["engine, XLA merge"].merge_kernel and labels["engine + prefetch"].prefetch_pages
    assert labels["engine at 16 splits"].merge_kernel and labels["engine at 64 splits"].num_splits == 64
    unsplit = [label for label, _ in dsb.variants(tuned(32, 4096), 32, 4096)]
    # Unsplit: nothing to merge and no prefetch column (measured slower there); two splits tried.
    assert unsplit == ["session 18", "engine", "engine at 2 splits"]


def test_report_names_the_fastest_and_the_ratio_to_session_18(tmp_path):
    row = {"kv_dtype": "bf16", "batch": 1, "context": 32768, "kv_bytes": 134217728, "tuned": {"num_splits": 32},
           "us": {"session 18": 69.0, "engine": 58.1, "cuDNN dense": 48.2}, "errors": {"engine + prefetch": "E"}}
    report = {"command": "c", "device": "d", "jax": "j", "ceilings": {"hbm_read_tbs": 4.58}, "rows": [row]}
    dsb.write_report(str(tmp_path), report)
    md = (tmp_path / "decode_small_batch.md").read_text()
    assert "| engine | **58.1** | 2.31 | 50% | 0.84x |" in md
    assert "| cuDNN dense | 48.2 |" in md and "failed: E" in md
    assert json.loads((tmp_path / "decode_small_batch.json").read_text())["rows"][0]["us"]["engine"] == 58.1


def test_small_bucket_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/small_bucket_decode.py end to end in the interpreter: both kernels agree on the live row."""
    from tests.conftest import BENCHMARK_CACHE_ENV, REPO

    subprocess.run([sys.executable, str(REPO / "benchmarks" / "small_bucket_decode.py"), "--out", str(tmp_path),
                    "--smoke"], check=True, capture_output=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu", **BENCHMARK_CACHE_ENV})
    report = json.loads((tmp_path / "small_bucket_decode.json").read_text())
    (row,) = report["results"]
    assert len(row["us"]) == 4 and all(us > 0 for us in row["us"].values())
    assert any(name.startswith("fused kernel") and "(tuned)" in name for name in row["us"])
    assert max(row["max_abs_diff"].values()) < 0.05  # bf16 outputs of one attention, four ways
    assert "| 40 | default kernel" in (tmp_path / "small_bucket_decode.md").read_text()

"""The issue-21 prefill benchmarks run end to end on CPU (tiny shapes; their numbers mean nothing).

``prefill_engine.py`` builds one engine per attention impl and measures compile, TTFT and a
prefill-heavy mix; ``prefill_peers.py --impls`` runs only the named implementations.
Each ``prefill_peers`` run costs ~5 s an implementation and shape (interpreted kernels
compiled), so each shape kind runs end to end once: the ragged mix (the one-prompt shape,
``1xL``, times through the same chain) and several equal fresh prompts (``NxL``, in a loop).
"""

import json

import pytest

from tests.test_benchmarks_smoke import BENCHMARKS, run_script


@pytest.mark.slow
def test_prefill_engine_measures_every_impl_and_compiles_nothing_after_warmup(tmp_path):
    out = tmp_path / "pe"
    run_script([BENCHMARKS / "prefill_engine.py", "--out", out, "--smoke"], tmp_path, shared_cache=True)
    results = json.loads((out / "prefill_engine.json").read_text())
    assert list(results["impls"]) == ["reference", "cpu"]
    for r in results["impls"].values():
        assert r["engine"]["num_programs"] > 0 and r["engine"]["compile_seconds"] > 0
        assert set(r["ttft"]) == {"48", "96"} and all(t["ttft_ms"] > 0 for t in r["ttft"].values())
        assert r["mix"]["input_tokens"] > 0 and r["mix"]["compilations_after_warmup"] == 0
        assert 0 <= r["agreement"] <= 1 and not r["skipped"]
    assert "TTFT 96 tokens" in (out / "prefill_engine.md").read_text()


def test_prefill_peers_parses_each_kind_of_shape():
    import prefill_peers

    smoke_default = [prefill_peers.parse_shape(s, smoke=True) for s in prefill_peers.SMOKE_SHAPES.split(",")]
    assert smoke_default == [("1x256", (256,)), ("ragged", (128, 256))]
    assert prefill_peers.parse_shape("3x128", smoke=True) == ("3x128", (128, 128, 128))
    assert prefill_peers.parse_shape("ragged", smoke=False) == ("ragged", prefill_peers.RAGGED)
    assert prefill_peers.parse_shape("4096", smoke=False) == ("1x4096", (4096,))


@pytest.mark.slow
def test_prefill_peers_runs_only_the_named_impls(tmp_path):
    out = tmp_path / "pp"
    impls = "ours,fresh_path,fresh_branchless,fresh_cudnn,fresh_segments,segments_alone,proto"
    run_script([BENCHMARKS / "prefill_peers.py", "--out", out, "--smoke", "--shapes", "ragged", "--impls", impls,
                "--trace-impls", "fresh_segments", "--budget-s", "1500"], tmp_path, shared_cache=True)
    rows = json.loads((out / "prefill_peers.json").read_text())["results"]
    assert [r["shape"] for r in rows] == ["ragged"]
    for r in rows:
        assert set(r["tflops"]) == {"ours", "fresh_path", "fresh_branchless", "fresh_cudnn", "fresh_segments",
                                    "segments_alone", "proto_2"}, r["errors"]
        checked = ("fresh_path", "fresh_branchless", "fresh_cudnn", "fresh_segments", "segments_alone")
        assert all(r["rel_err"][p] < 1e-2 for p in checked), r["rel_err"]
        # The traced column ran once more under the profiler; a CPU trace has no GPU kernels, and says so.
        assert r["kernels_us"] == {"fresh_segments": {"error": "no GPU kernel events in the trace"}}
        served = r["fresh_prompts_served"]
        assert served["fresh_cudnn"] == served["fresh_path"]  # same branches
        assert served["fresh_segments"] == served["fresh_branchless"] >= 2  # the same packed choice


@pytest.mark.slow
def test_prefill_peers_times_several_fresh_prompts_a_step_over_bf16_and_fp8_pages(tmp_path):
    out = tmp_path / "pp"
    # Triton, the single-prompt window path and Hopper's default (segments); the other window paths
    # run over bf16 pages in the test above.
    run_script([BENCHMARKS / "prefill_peers.py", "--out", out, "--smoke", "--shapes", "3x128", "--kv-dtypes",
                "bf16,fp8", "--impls", "ours,fresh_single,fresh_segments", "--budget-s", "1500"], tmp_path,
               shared_cache=True)
    (row,) = json.loads((out / "prefill_peers.json").read_text())["results"]
    paths = ("ours", "fresh_single", "fresh_segments")
    assert set(row["tflops"]) == {p + s for p in paths for s in ("", "_fp8")}, row["errors"]
    assert all(err < 1e-2 for err in row["rel_err"].values()), row["rel_err"]
    # Three 128-token prompts: the single-prompt path takes one, the segments path all three.
    assert row["fresh_prompts_served"] == {p + s: n for p, n in (("fresh_single", 1), ("fresh_segments", 3))
                                           for s in ("", "_fp8")}

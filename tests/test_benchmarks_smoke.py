"""The GPU benchmark scripts run end to end on CPU with tiny shapes, and their parsers add up.

Device time is scarce: a benchmark that breaks is found here, not in a GPU call. The numbers
these runs print mean nothing; the tests check that each workload completes, writes its
results and (for the engine) compiles nothing after warm-up. The two parsers of GPU-only
output (Nsight Compute's CSV, jax.profiler traces) are checked on synthetic files whose
answers are known.
"""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BENCHMARK_CACHE_ENV, REPO

BENCHMARKS = REPO / "benchmarks"
TINY_TOKENIZER = REPO / "tests" / "fixtures" / "tiny-llama3"
sys.path.insert(0, str(BENCHMARKS))


def run_script(args, tmp_path, devices=1, timeout=900, shared_cache=False):
    """``shared_cache``: the suite's benchmark compilation cache (tests/conftest.py), for a script
    whose test checks what it runs, not how long compiling takes; else a fresh one in ``tmp_path``."""
    # Every program goes to the cache, however fast it compiles: the tiny model's do in under
    # JAX's default threshold of 1 s, and the warm start-up run must find them.
    cache = BENCHMARK_CACHE_ENV if shared_cache else {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
                                                      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **cache,
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_engine_throughput_workloads_complete(tmp_path):
    out = tmp_path / "engine"
    # --scale 0.01: 10 requests of 10 tokens at most, so 16 sequences and 256 tokens a step hold
    # them all; fewer buckets than the GPU defaults (8192 tokens), so fewer programs to compile.
    args = [BENCHMARKS / "engine_throughput.py", "--out", out, "--shape", "tiny", "--nano-shape", "tiny",
            "--scale", "0.01", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
            "--workloads", "startup,throughput-1k,throughput-nano"]
    # Half of throughput-1k's requests again, under a JSON schema (the tiny fixture's tokenizer).
    run_script([*args[:-1], "startup,latency,decode256,throughput-1k,throughput-nano", "--profile-latency-steps", "2",
                "--profile-steps", "2", "--profile-prefill-steps", "1", "--structured-fraction", "0.5",
                "--structured-tokenizer", TINY_TOKENIZER], tmp_path)
    run_script([*args[:-1], "startup", "--resume"], tmp_path)  # the cache the first run filled: warm
    # A converted model's start-up: restored from Orbax, committed to its device, compiled once.
    run_script([*args[:-1], "startup", "--resume", "--via-orbax", tmp_path / "orbax"], tmp_path)
    assert list(out.glob("profile_throughput-1k_decode/plugins/profile/*/*.xplane.pb"))
    profile = json.loads((out / "engine_throughput.json").read_text())["workloads"]["throughput-1k"]["profile"]
    assert profile["num_traced_steps"] == 2 and len(profile["trace_files"]) == 1
    prefill = json.loads((out / "engine_throughput.json").read_text())["workloads"]["throughput-1k"]["prefill_profile"]
    assert prefill["num_traced_steps"] == 1 and len(prefill["trace_files"]) == 1
    # Batch-1 decode steps traced after the latency runs; on a CPU the trace has no GPU kernels to count.
    latency_trace = json.loads((out / "engine_throughput.json").read_text())["workloads"]["latency"]["trace"]
    assert latency_trace["num_traced_steps"] == 2 and latency_trace["min_running"] == 1
    assert "no GPU kernel events" in latency_trace["breakdown"]["error"]
    results = json.loads((out / "engine_throughput.json").read_text())
    workloads = results["workloads"]
    assert workloads["startup"]["cache_files_before"] == 0
    assert workloads["startup-warm"]["cache_files_before"] > 0
    assert workloads["startup-warm-orbax"]["warmup_recompiles"] == 0
    assert workloads["startup"]["warmup_recompiles"] == 0
    startup = workloads["startup"]
    assert 0 < startup["longest_compile_seconds"] <= startup["compile_pool_seconds"] <= startup["compile_seconds"]
    assert startup["forward_compile_seconds"] > 0 and startup["sampler_compile_seconds"] > 0
    assert 0 < startup["lowering_seconds"] < startup["forward_compile_seconds"] + startup["sampler_compile_seconds"]
    steps = [name for name, _, _ in startup["programs"] if name.startswith(("forward ", "sampler "))]
    assert len(steps) == startup["num_programs"] and startup["shared_kernel_compile_seconds"] == 0  # none on a CPU
    for name in ("throughput-1k", "throughput-nano"):
        assert workloads[name]["compilations_after_warmup"] == 0
        assert workloads[name]["output_tokens"] > 0
        # The phase split covers every step: prefill-carrying steps computed every prompt token.
        phases, steps = workloads[name]["phases"], workloads[name]["steps"]
        assert sum(p["steps"] for p in phases.values()) == len(steps["wall_ms"])
        assert phases["with_prefill"]["tokens"] + phases["decode_only"]["tokens"] == sum(steps["num_tokens"])
        assert phases["with_prefill"]["tokens"] >= workloads[name]["input_tokens"]
    # decode256: the step replayed from the inputs it captured (scaled to the run's few requests).
    assert workloads["decode256"]["device_replay_step_ms"] > 0 and workloads["decode256"]["num_steady_steps"] > 0
    structured = workloads["throughput-1k-structured"]
    assert structured["compilations_after_warmup"] == 0 and structured["grammar_mask_seconds"] > 0
    assert structured["output_tokens"] == workloads["throughput-1k"]["output_tokens"]
    markdown = (out / "engine_throughput.md").read_text()
    assert "startup, warm cache" in markdown and "throughput-nano" in markdown and "under a JSON schema" in markdown


def test_tensor_parallel_smoke_with_profiles(tmp_path):
    out = tmp_path / "tp"
    run_script([BENCHMARKS / "tensor_parallel.py", "--out", out, "--shape", "tiny", "--smoke", "--tp", "2",
                "--profile", "--workloads", "allreduce,prefill-overlap,latency",
                "--xla-option", "xla_gpu_enable_latency_hiding_scheduler=true"], tmp_path, devices=2, shared_cache=True)
    results = json.loads((out / "tensor_parallel.json").read_text())
    assert set(results["workloads"]) == {"allreduce", "prefill-overlap", "engine"}
    assert results["workloads"]["engine"]["latency_tpot_ratio"] > 0
    traces = sorted(p.parts[-5] for p in out.glob("profile_*/plugins/profile/*/*.trace.json.gz"))
    assert traces == ["profile_decode_tp1", "profile_decode_tp2", "profile_tp1", "profile_tp2_overlap_off",
                      "profile_tp2_overlap_on"]


def test_profile_collectives_splits_exposed_from_hidden(tmp_path):
    from profile_collectives import summarise

    # One GPU, two steps: compute 0-100 and 150-250 us; a collective 80-120 (20 us hidden
    # under compute, 20 exposed) and one 250-260 (exposed); a memcpy that counts as neither.
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "gemm_fusion", "ts": 0, "dur": 100},
        {"ph": "X", "pid": 1, "tid": 1, "name": "loop_fusion", "ts": 150, "dur": 100},
        {"ph": "X", "pid": 1, "tid": 2, "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(args)", "ts": 80, "dur": 40},
        {"ph": "X", "pid": 1, "tid": 2, "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(args)", "ts": 250, "dur": 10},
        {"ph": "X", "pid": 1, "tid": 3, "name": "MemcpyH2D", "ts": 300, "dur": 50},
        {"ph": "X", "pid": 9, "tid": 1, "name": "host work", "ts": 0, "dur": 1000},
    ]
    path = tmp_path / "vm.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = summarise(path, steps=2)
    assert list(summary) == ["/device:GPU:0"]
    gpu = summary["/device:GPU:0"]
    per_step = {k: round(v * 2e3, 6) for k, v in gpu.items() if k.endswith("_ms")}  # back to us over both steps
    assert per_step == {"step_span_ms": 260, "compute_busy_ms": 200, "collective_busy_ms": 50,
                        "collective_exposed_ms": 30, "collective_hidden_ms": 20, "idle_ms": 30}
    assert gpu["collective_kernels_per_step"] == {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 1.0}
    kinds = summarise(path, steps=2, top=2)["/device:GPU:0"]["kernel_ms_per_step_by_kind"]
    assert {k: round(v * 2e3, 6) for k, v in kinds.items()} == {"matmul": 100, "other": 100, "collective": 50}


def test_profile_host_ranks_host_events_per_step(tmp_path):
    from profile_host import summarise_host

    # Two steps on the host: each dispatch (400 us) holds a graph update (300 us); GPU events
    # and metadata are not host time.
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "gemm_fusion", "ts": 0, "dur": 5000},
    ]
    for step in range(2):
        events += [{"ph": "X", "pid": 9, "tid": 1, "name": "PjitFunction(_forward_step)", "ts": step * 1000, "dur": 400},
                   {"ph": "X", "pid": 9, "tid": 1, "name": "command_buffer::update", "ts": step * 1000, "dur": 300}]
    path = tmp_path / "vm.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = summarise_host(path, steps=2, top=5)
    assert [(r["name"], round(r["ms_per_step"], 6), r["calls_per_step"]) for r in rows] == [
        ("PjitFunction(_forward_step)", 0.4, 1.0), ("command_buffer::update", 0.3, 1.0)]


def test_agreement_counts_positions_before_the_first_divergence(tmp_path):
    from agreement import compare

    report = compare([[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[1, 2, 0, 4], [5, 6], [7, 8]])
    assert report["identical_fraction"] == 1 / 3
    assert report["first_divergence"] == [2, None, 2]
    assert report["token_agreement"] == (2 + 2 + 2) / (4 + 2 + 3)
    assert report["median_first_divergence"] == 2
    out = tmp_path / "agreement"
    run_script([BENCHMARKS / "agreement.py", "--out", out, "--dtype", "float32", "--num-prompts", "4",
                "--max-tokens", "8"], tmp_path, shared_cache=True)
    result = json.loads((out / "agreement.json").read_text())["agreement"]
    assert result["identical_fraction"] == 1.0 and result["compilations_after_warmup"] == 0
    assert result["compared"] == "batched vs alone"


def test_agreement_compares_tensor_parallel_with_one_device(tmp_path):
    out = tmp_path / "agreement_tp"
    run_script([BENCHMARKS / "agreement.py", "--out", out, "--dtype", "float32", "--num-prompts", "3",
                "--max-tokens", "6", "--against-tp", "2"], tmp_path, devices=2, shared_cache=True)
    result = json.loads((out / "agreement.json").read_text())["agreement"]
    assert result["compared"] == "TP=1 vs TP=2" and result["num_prompts"] == 3
    assert result["identical_fraction"] == 1.0  # f32 on CPU: the sharded sums agree to far below a flip


def test_kernel_ncu_report_reads_bytes_per_launch(tmp_path):
    from kernel_ncu import report

    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

    def row(launch, metric, unit, value):
        return (f'"{launch}","1","python3","vm","ragged_paged_attention","1","7","(128, 1, 1)","(8, 32, 1)",'
                f'"0","9.0","Command line profiler metrics","{metric}","{unit}","{value}"')

    counted = 2 * 32 * 4096 * 8 * 128 * 2  # K and V of B=32 ctx=4096, Llama-3.1-8B heads, bf16
    lines = ["==PROF== Connected to process 1", header]
    for launch, read_mb in enumerate((counted / 1e6 * 1.01, counted / 1e6 * 1.02, counted / 1e6 * 1.5)):
        lines += [row(launch, "dram__bytes_read.sum", "Mbyte", f"{read_mb:,.3f}"),
                  row(launch, "dram__bytes_write.sum", "Kbyte", "140.5"),
                  row(launch, "gpu__time_duration.sum", "usecond", "150")]
    csv_path = tmp_path / "ncu.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    result = report(csv_path, batch=32, context=4096)
    assert result["launches"] == 3 and result["kv_bytes"] == counted
    assert abs(result["read_over_counted_kv"] - 1.02) < 1e-3  # the median launch
    assert result["dram_write_bytes_median"] == 140.5e3


def test_kernel_ncu_sass_mix_totals_instructions_and_stalls_per_opcode(tmp_path):
    from kernel_ncu import sass_mix

    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
              '"# Samples","Instructions Executed"')
    lines = ['"Kernel Name","ragged_paged_attention",', header,
             '"0x10","      LDS.U8 R4, [R2+0x10]","30","20","30","6,000"',
             '"0x20","      @P0 LDS.U8 R5, [R2+0x11]","10","5","10","2000"',
             '"0x30","      HMMA.16816.F32 R8, R12, R4, R8 ;","0","0","0","1000"',
             '"0x40","      BAR.SYNC.DEFER_BLOCKING 0x0 ;","60","60","60","1000"']
    csv_path = tmp_path / "sass.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    result = sass_mix(csv_path)
    assert result["instructions_executed"] == 10_000 and result["stall_samples"] == 100
    by_op = {entry["opcode"]: entry for entry in result["opcodes"]}
    assert [entry["opcode"] for entry in result["opcodes"]][0] == "LDS.U8"  # the guarded one counted with it
    assert by_op["LDS.U8"]["share"] == 0.8 and by_op["LDS.U8"]["stall_share"] == 0.4
    assert by_op["BAR.SYNC.DEFER_BLOCKING"]["stall_share"] == 0.6
    with pytest.raises(SystemExit, match="no per-instruction table"):
        (tmp_path / "empty.csv").write_text("==PROF== nothing\n")
        sass_mix(tmp_path / "empty.csv")


@pytest.mark.parametrize("kv_dtype,v_layout", [("bf16", "token_major"), ("fp8", "token_major"), ("fp8", "dim_major")])
def test_kernel_ncu_launches_the_decode_kernel(kv_dtype, v_layout):
    # What ncu profiles on the GPU, here in interpret mode at a small shape: the launcher must keep
    # up with the kernel's API (session 23's GPU call found it importing a function long gone).
    import numpy as np
    from kernel_ncu import launch

    out = launch(batch=2, context=64, page_size=16, launches=1, kv_dtype=kv_dtype, interpret=True, v_layout=v_layout)
    assert out.shape == (2, 32, 128) and np.isfinite(np.asarray(out, np.float32)).all()


def test_loader_memory_loads_a_sharded_bf16_checkpoint_in_a_child_process(tmp_path):
    from safetensors import safe_open

    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    stdout = run_script([BENCHMARKS / "loader_memory.py", "--shape", "tiny", "--out", out, "--checkpoint", checkpoint,
                         "--shard-gb", "0.0001", "--tree", REPO], tmp_path)
    results = json.loads((out / "loader_memory.json").read_text())
    assert results["num_files"] >= 2
    (run,) = results["runs"]
    assert run["jaxinfer_file"] == str(REPO / "jaxinfer" / "__init__.py")
    assert run["weight_dtypes"] == ["bfloat16"] and run["load_s"] > 0
    assert 0 < run["rss_before_load_gib"] <= run["peak_rss_gib"]
    assert "peak RSS" in stdout
    # The files the script writes by hand read back with the safetensors package, as the index says.
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    found = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(checkpoint / file), framework="numpy") as f:
            found.update({name: file for name in f.keys()})
            assert {str(f.get_tensor(name).dtype) for name in f.keys()} == {"bfloat16"}
    assert found == index["weight_map"]



def test_structured_output_host_fill_completes(tmp_path):
    """The host mask-fill benchmark, with the tiny fixture's tokenizer standing in for the default model's."""
    host = tmp_path / "host"
    run_script([BENCHMARKS / "structured_output_host.py", "--out", host, "--tokenizer", TINY_TOKENIZER,
                "--vocab-size", "600", "--batch", "8", "--steps", "12"], tmp_path)
    results = json.loads((host / "structured_output_host.json").read_text())
    assert results["fill"]["p99_ms"] > 0 and results["batch"] == 8 and results["tokenizer_vocab"] == 512


def test_spec_decode_step_cost_completes(tmp_path):
    # Two of the GPU run's eight draft counts: every k runs the same code with its own runner.
    run_script([BENCHMARKS / "spec_decode.py", "step-cost", "--out", tmp_path, "--shape", "tiny", "--steps", "2",
                "--context", "128", "--max-k", "2"], tmp_path, shared_cache=True)
    rows = json.loads((tmp_path / "spec_step_cost.json").read_text())["rows"]
    assert [row["k"] for row in rows] == [1, 2]
    assert all(row["verify_ms"] > 0 and row["ratio_to_plain"] > 0 for row in rows)


def test_spec_decode_eagle3_cost_completes(tmp_path):
    run_script([BENCHMARKS / "spec_decode.py", "eagle3", "--out", tmp_path, "--shape", "tiny", "--steps", "2",
                "--context", "128", "--ks", "1", "3"], tmp_path, shared_cache=True)
    results = json.loads((tmp_path / "spec_eagle3.json").read_text())
    assert [row["k"] for row in results["rows"]] == [1, 3]
    assert all(row["cycle_ms"] > row["draft_round_ms"] > 0 for row in results["rows"])


def test_spec_decode_eagle3_engine_completes(tmp_path):
    """The engine loop with a random head the benchmark writes in the speculators layout."""
    run_script([BENCHMARKS / "spec_decode.py", "eagle3-engine", "--out", tmp_path, "--shape", "tiny", "--context", "64",
                "--max-tokens", "24", "--ks", "2"], tmp_path, shared_cache=True)
    rows = json.loads((tmp_path / "spec_eagle3_engine.json").read_text())["rows"]
    assert rows[0]["k"] == 2 and rows[0]["share_of_steps_verifying"] > 0.5


@pytest.mark.slow
def test_kernel_frontier_fp8_stage_writes_an_adoptable_table(tmp_path):
    # The fp8 stage the lead runs on the H200 (bf16 vs fp8 pages, the fp8 sweep, the table), in the
    # interpreter on two tiny shapes; then the adopt script reads its output (dry run).
    out = tmp_path / "fp8"
    run_script([BENCHMARKS / "kernel_frontier.py", "--smoke", "--only", "fp8", "--out", out], tmp_path,
               shared_cache=True)
    report = json.loads((out / "kernel_frontier.json").read_text())
    rows = [r for r in report["results"] if r["workload"] == "decode-fp8"]
    assert len(rows) == 2 and all(r.get("bf16_s") and r.get("fp8_s") and r.get("fp8_v_dim_major_s") and r.get("best_s")
                                  for r in rows)
    checks = [r for r in report["results"] if r["workload"] == "check-fp8"]
    assert {(c["fp8_widen_to"], c.get("v_layout", "token_major")) for c in checks} == {
        ("float16", "token_major"), ("query", "token_major"), ("float16", "dim_major")}
    assert all(c["rel_err"] < 3e-2 and not c["nan"] for c in checks)
    # The sweep times each candidate over both V layouts; only token-major entries reach the table.
    sweep = [r for r in report["results"] if r["workload"] == "sweep-decode-fp8"]
    assert {r["v_layout"] for r in sweep} == {"token_major", "dim_major"}
    assert all(r.get("best_v_dim_major_s") for r in rows)
    entries = json.loads((out / "gpu_fp8_decode_table.json").read_text())["entries"]
    assert {(e["batch"], e["context"], e["kv_itemsize"]) for e in entries} == {(2, 256, 1), (1, 512, 1)}
    assert "fp8 ÷ bf16 tok/s" in (out / "kernel_frontier.md").read_text()
    printed = run_script([BENCHMARKS / "adopt_frontier_run.py", out, "--dry-run"], tmp_path)
    assert "fp8 ('decode'" in printed


def fake_engine_steps(steps):
    """An engine stand-in for a run_requests capture: (tokens scheduled, sequences running) per step."""
    import types

    import numpy as np

    engine = types.SimpleNamespace(scheduler=types.SimpleNamespace(num_running=0, num_waiting=7),
                                   runner=types.SimpleNamespace(last_sampled=np.zeros(4)), last_step_num_tokens=0)
    for tokens, running in steps:
        engine.last_step_num_tokens, engine.scheduler.num_running = tokens, running
        yield engine


def test_decode_profiler_traces_steps_after_a_settled_decode_only_run(tmp_path, monkeypatch):
    import engine_throughput
    import jax

    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda path: calls.append(("start", path)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    profiler = engine_throughput.DecodeProfiler(tmp_path, num_steps=3, min_running=4, settle_steps=2, log=lambda _: None)
    # A prefill; decode-only but too few running; a mixed step; two decode-only steps of 4 (it
    # starts after the second, step 5); three traced steps; later steps are left alone.
    steps = [(50, 2), (2, 2), (60, 4), (4, 4), (4, 4), (4, 4), (4, 4), (3, 3), (3, 3), (3, 3)]
    for i, engine in enumerate(fake_engine_steps(steps), start=1):
        profiler(engine)
        if i == 5:
            assert calls == [("start", str(tmp_path))]
        if i == 7:
            assert profiler.active
    assert calls == [("start", str(tmp_path)), ("stop",)]
    profiler.stop(engine)  # the run's end: nothing left to stop
    assert calls[-1] == ("stop",) and len(calls) == 2
    report = profiler.report()
    assert report["started_at_step"] == 5 and report["num_traced_steps"] == 3


def test_decode_profiler_reports_where_the_traced_steps_went(tmp_path, monkeypatch):
    import engine_throughput
    import jax
    from tests.test_latency_lab import write_trace

    def start_trace(path):  # what jax.profiler writes: one trace of two 100 us steps
        trace_dir = Path(path) / "plugins" / "profile" / "2026_12_03"
        trace_dir.mkdir(parents=True)
        step = [("ragged_paged_attention", 0, 60, {}), ("nvjet_sm90_qqsss_128x128", 60, 30, {}),
                ("loop_add_fusion", 90, 10, {})]
        write_trace(trace_dir / "vm.trace.json.gz",
                    [(name, ts + offset, dur, args) for offset in (0, 100) for name, ts, dur, args in step])

    monkeypatch.setattr(jax.profiler, "start_trace", start_trace)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    lines = []
    profiler = engine_throughput.DecodeProfiler(tmp_path, num_steps=2, min_running=4, settle_steps=1, log=lines.append)
    for engine in fake_engine_steps([(4, 4), (4, 4), (4, 4)]):
        profiler(engine)
    breakdown = profiler.report()["breakdown"]
    assert breakdown["step_us"] == pytest.approx(100)
    assert breakdown["by_kind_us"]["attention kernel"] == pytest.approx(60)
    assert breakdown["by_kind_us"]["weight GEMV (XLA)"] == pytest.approx(30)
    assert any(line.startswith("decode steps: trace 100 us a step") for line in lines)


def test_decode_profiler_says_why_it_never_started(tmp_path, monkeypatch):
    import engine_throughput
    import jax

    monkeypatch.setattr(jax.profiler, "start_trace", lambda path: pytest.fail("started"))
    lines = []
    profiler = engine_throughput.DecodeProfiler(tmp_path, num_steps=2, min_running=8, settle_steps=2, log=lines.append)
    for engine in fake_engine_steps([(6, 6)] * 5 + [(40, 8), (8, 8), (40, 8)]):  # never two decode-only steps of 8
        profiler(engine)
    report = profiler.report()
    assert report["started_at_step"] is None and report["max_decode_only_running"] == 8
    assert "never started" in lines[-1] and "largest decode-only batch 8" in lines[-1]


def test_profile_collectives_says_what_a_directory_without_traces_holds(tmp_path):
    from profile_collectives import explain_missing, find_traces

    xplane = tmp_path / "profile_throughput-1k_decode" / "plugins" / "profile" / "2026_01_01" / "vm.xplane.pb"
    xplane.parent.mkdir(parents=True)
    xplane.write_bytes(b"")
    assert find_traces(tmp_path) == []
    assert "1 xplane file(s)" in explain_missing(tmp_path)
    trace = xplane.with_name("vm.trace.json.gz")
    trace.write_bytes(b"")
    assert find_traces(tmp_path) == [("throughput-1k_decode", trace)]
    assert find_traces(tmp_path / "profile_throughput-1k_decode") == [("throughput-1k_decode", trace)]

def test_spec_decode_engine_completes(tmp_path):
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps({"rows": [{"set": "copy-heavy", "k": 2, "tokens_per_step": 2.0}]}))
    run_script([BENCHMARKS / "spec_decode.py", "engine", "--out", tmp_path, "--shape", "tiny", "--ks", "2",
                "--context", "64", "--max-tokens", "12", "--acceptance", acceptance], tmp_path, shared_cache=True)
    row = json.loads((tmp_path / "spec_engine.json").read_text())["rows"][0]
    assert row["async_step_ms"] > 0 and row["sync_step_ms"] > 0 and row["judged_tpot_ms"] > 0
    # Forced drafts: every decode step verifies but the last few (no room left under max_tokens).
    assert row["async_share_of_steps_verifying"] > 0.6 and row["sync_share_of_steps_verifying"] > 0.6
    assert row["effective_ms_copy-heavy"] == row["async_step_ms"] / 2


def test_host_step_cost_splits_each_step_into_phases(tmp_path):
    """The host-cost benchmark on this tree: every batch reaches steady decode, and the phases
    (``detokenize`` and ``gc`` lie inside others) add up to the host time it reports."""
    out = tmp_path / "host"
    run_script([BENCHMARKS / "host_step_cost.py", "--trees", REPO, "--batches", "1,4", "--steps", "4",
                "--rounds", "1", "--prompt-len", "20", "--profile", "4", "--out", out], tmp_path, shared_cache=True)
    results = json.loads((out / "host_step_cost.json").read_text())
    (rows,) = results["results"].values()
    assert [row["batch"] for row in rows] == [1, 4]
    for row in rows:
        phases = row["phases_us_per_step"]
        outer = sum(v for k, v in phases.items() if k not in ("detokenize", "gc"))
        assert abs(outer - row["host_us_per_step"]) < 1e-6 * row["host_us_per_step"] + 1e-3
        assert phases["schedule"] > 0 and phases["pack"] > 0 and phases["dispatch"] > 0
        assert row["host_us_per_seq"] == pytest.approx(row["host_us_per_step"] / row["batch"])
    assert "pack_step" in next(iter(results["profiles"].values()))  # the cProfile of B=4
    assert "| 4 |" in (out / "host_step_cost.md").read_text()


def test_step_dispatch_times_every_variant(tmp_path):
    """The dispatch benchmark completes on CPU: every variant (the XLA GPU options are accepted
    and ignored there) has a dispatch time and a back-to-back wall time, none failed."""
    run_script([BENCHMARKS / "step_dispatch.py", "--shape", "tiny", "--quantization", "none", "--kv-cache-dtype",
                "auto", "--dtype", "float32", "--batch", "8", "--context", "40", "--iters", "2", "--rounds", "1",
                "--out", tmp_path], tmp_path, shared_cache=True)
    results = json.loads((tmp_path / "step_dispatch.json").read_text())
    assert results["failed"] == {}
    assert set(results["variants"]) == {"fresh", "staged", "same-inputs", "skip-temp", "staged+skip-temp",
                                        "skip-profiled", "no-graphs"}
    assert all(row["dispatch_ms"] > 0 and row["pipelined_ms_per_step"] > 0 for row in results["variants"].values())


def test_w8a8_epilogue_times_both_output_dtypes_and_the_gemms(tmp_path):
    """The W8A8 MLP-block benchmark completes on CPU: the engine's path, bf16 GEMM outputs and the
    GEMMs alone are timed; both full variants are near the float32 reference and near each other
    (bf16 outputs add one rounding, far below fp8's own error)."""
    run_script([BENCHMARKS / "w8a8_epilogue.py", "--shape", "tiny", "--ms", "128", "--layers", "1", "--out", tmp_path],
               tmp_path)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "w8a8_epilogue.json").read_text())["rows"]}
    assert set(rows) == {"engine", "bf16_out", "gemm_only", "engine_static"}
    assert all(r["ms_per_layer"] > 0 for r in rows.values())
    assert 0 < rows["engine"]["rel_error_vs_f32"] < 0.1
    assert abs(rows["bf16_out"]["rel_error_vs_f32"] - rows["engine"]["rel_error_vs_f32"]) < 0.01
    # Static scales: near the dynamic error, in fewer fusions (no row-max, the quantize fused into its producer).
    assert abs(rows["engine_static"]["rel_error_vs_f32"] - rows["engine"]["rel_error_vs_f32"]) < 0.02
    assert rows["engine_static"]["fusions"] < rows["engine"]["fusions"]


def test_static_activation_accuracy_checks_which_path_ran(tmp_path):
    """The static-vs-dynamic accuracy benchmark on the tiny fixture: every row runs W8A8 (7 FP8 x
    FP8 dots a layer), the dynamic row 4 row-max reductions a layer more than the static ones."""
    run_script([BENCHMARKS / "static_activation_accuracy.py", "--model", TINY_TOKENIZER, "--out", tmp_path], tmp_path,
               shared_cache=True)
    results = json.loads((tmp_path / "static_activation_scales.json").read_text())
    num_layers = 2
    dynamic, *static = results["rows"]
    assert dynamic["name"].startswith("dynamic") and len(static) >= 2
    for row in results["rows"]:
        assert all(p["fp8_x_fp8_dots"] == 7 * num_layers for p in row["paths"])
        assert 0 <= row["kl_mean"] and 0 < row["top1_agreement"] <= 1
    for row in static:
        for d, s in zip(dynamic["paths"], row["paths"]):
            assert d["reduce_max"] - s["reduce_max"] == 4 * num_layers
    assert (tmp_path / "static_activation_scales.md").read_text().count("| static:") == len(static)


def test_host_step_cost_with_a_fake_device_times_host_work_only(tmp_path):
    """``--fake-device``: no program runs (no warm-up, nothing waited for), the phases still add up,
    and the median step is reported beside the mean."""
    out = tmp_path / "host"
    run_script([BENCHMARKS / "host_step_cost.py", "--trees", REPO, "--batches", "8", "--steps", "4", "--rounds", "1",
                "--prompt-len", "40", "--fake-device", "--out", out], tmp_path, shared_cache=True)
    results = json.loads((out / "host_step_cost.json").read_text())
    assert results["info"]["fake_device"] is True
    ((row,),) = results["results"].values()
    assert row["device_wait_us_per_step"] < 0.05 * row["host_us_per_step"]
    outer = sum(v for k, v in row["phases_us_per_step"].items() if k not in ("detokenize", "gc"))
    assert abs(outer - row["host_us_per_step"]) < 1e-6 * row["host_us_per_step"] + 1e-3
    assert row["host_us_per_seq_median_step"] > 0 and "fake device" in (out / "host_step_cost.md").read_text()


def test_compile_time_compiles_static_activation_scale_programs_one_by_one(tmp_path):
    """compile_time.py with --activation-scales static (session 12: that engine outlived a 300 s
    warm-up on the H200; this is the probe that names the slow program): calibrates, then
    compiles each bucket alone and records it."""
    run_script([BENCHMARKS / "compile_time.py", "--out", tmp_path, "--shape", "tiny", "--quantization", "fp8",
                "--activation-scales", "static", "--tokens", "16,64", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "64", "--num-pages", "64", "--shared-kernels"], tmp_path)
    results = json.loads((tmp_path / "compile_time.json").read_text())
    assert "shared_kernels" not in results  # the fresh-prefill windows are Hopper-only
    assert results["activation_scales"] == "static"
    assert [program["bucket"][0] for program in results["programs"]] == [16, 64]
    assert all(program["lowering_seconds"] > 0 and program["compile_seconds"] > 0 for program in results["programs"])


def test_kv_write_gpu_writers_match_the_reference(tmp_path):
    # Every writer the GPU run times (XLA's scatters, the one Pallas launch, V pages dim-major) is
    # checked equal to the reference first; here in the interpreter on tiny shapes, bf16 and fp8.
    out = tmp_path / "kv_write"
    run_script([BENCHMARKS / "kv_write_gpu.py", "--smoke", "--out", out], tmp_path, shared_cache=True)
    rows = json.loads((out / "kv_write_gpu.json").read_text())["results"]
    assert {(r["dtype"], r["kind"]) for r in rows} == {(d, k) for d in ("bf16", "fp8") for k in ("decode", "prefill")}
    assert all(r["equal"] == {"xla_scatters": True, "pallas_one_launch": True, "xla_v_dim_major": True} for r in rows)
    assert "V dim-major / XLA" in (out / "kv_write_gpu.md").read_text()

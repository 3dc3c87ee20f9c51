"""benchmarks/latency_lab.py's trace breakdown, on a synthetic jax.profiler trace whose answer is known."""

import gzip
import json
import os
import sys

import pytest

from tests.conftest import BENCHMARK_CACHE_ENV, REPO

sys.path.insert(0, str(REPO / "benchmarks"))


def write_trace(path, kernels):
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 9, "tid": 1, "name": "host work", "ts": 0, "dur": 10_000}]
    events += [{"ph": "X", "pid": 1, "tid": 7, "name": name, "ts": ts, "dur": dur, "args": args}
               for name, ts, dur, args in kernels]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_breakdown_sorts_kernels_by_what_they_do_and_counts_the_gaps(tmp_path):
    from latency_lab import breakdown

    # Two steps of 100 us each: a GEMV, our kernel, attention, the KV scatter, a norm fusion,
    # the lm_head and sampler (known by their named scope only), a 10 us gap, and a memcpy
    # (not a kernel). Per step: busy 90 us, span 100.
    step = [("gemm_fusion_dot_3", 0, 30, {}), ("weight_only_matmul_float8_e4m3fn_nk", 30, 20, {}),
            ("ragged_paged_attention", 50, 10, {}), ("loop_scatter_fusion", 60, 5, {}),
            ("input_reduce_fusion_1", 65, 5, {}), ("fusion_12", 70, 12, {"tf_op": "jit(run)/while/body/lm_head/dot_general"}),
            ("input_reduce_fusion_7", 82, 3, {"tf_op": "jit(run)/while/body/sampler/reduce_max"}),
            ("MemcpyD2D", 85, 5, {}), ("loop_add_fusion", 95, 5, {})]
    kernels = [(name, ts + offset, dur, args) for offset in (0, 100) for name, ts, dur, args in step]
    path = tmp_path / "vm.trace.json.gz"
    write_trace(path, kernels)
    b = breakdown(path, steps=2, top=3)
    assert b["step_us"] == pytest.approx(100) and b["busy_us"] == pytest.approx(90)
    assert b["by_kind_us"] == pytest.approx({
        "weight GEMV (XLA)": 30, "weight GEMV (ours)": 20, "lm_head": 12, "attention kernel": 10,
        "fusions (norms, rope, residual, convert)": 10, "gaps between kernels": 10, "KV write (scatter)": 5,
        "sampler": 3})
    assert sum(b["share"].values()) == pytest.approx(1.0)
    assert b["kernels_per_step"] == pytest.approx(8)
    assert list(b["top_kernels_us"]) == ["weight GEMV (XLA): gemm_fusion_dot_3",
                                         "weight GEMV (ours): weight_only_matmul_float8_e4m3fn_nk",
                                         "lm_head: fusion_12"]
    # Each top kernel ran once a step; the lm_head's op comes from its trace annotation.
    assert {k: v["launches_per_step"] for k, v in b["top_kernels"].items()} == pytest.approx(
        {k: 1 for k in b["top_kernels_us"]})
    assert b["top_kernels"]["lm_head: fusion_12"]["jax_op"] == "body/lm_head/dot_general"


def test_breakdown_names_each_kernels_jax_op_and_launches_per_step(tmp_path):
    """Two layers' add fusions share one kernel (XLA's kernel reuse): 2 launches a step, named by the HLO's op."""
    from latency_lab import breakdown, op_scopes

    hlo = ('  %loop_add_fusion.1 = bf16[8,64]{1,0} fusion(%a, %b), kind=kLoop, calls=%f, '
           'metadata={op_name="jit(run)/while/body/layer_0/mlp/add" stack_frame_id=3}\n'
           '  %fusion.7 = bf16[8,64]{1,0} fusion(%c), kind=kCustom, calls=%g, '
           'metadata={op_name="jit(run)/while/body/layer_0/attention/mul" stack_frame_id=4}\n')
    step = [("loop_add_fusion_1", 0, 4, {}), ("fusion_7", 4, 2, {}), ("loop_add_fusion_1", 6, 4, {})]
    path = tmp_path / "vm.trace.json.gz"
    write_trace(path, [(name, ts + offset, dur, args) for offset in (0, 10) for name, ts, dur, args in step])
    b = breakdown(path, steps=2, top=2, scopes=op_scopes(hlo))
    add = b["top_kernels"]["fusions (norms, rope, residual, convert): loop_add_fusion_1"]
    assert add == {"us": pytest.approx(8), "launches_per_step": pytest.approx(2), "jax_op": "layer_*/mlp/add"}
    norm = b["top_kernels"]["fusions (norms, rope, residual, convert): fusion_7"]
    assert norm["launches_per_step"] == pytest.approx(1) and norm["jax_op"] == "layer_*/attention/mul"


def test_breakdown_says_when_the_trace_has_no_gpu(tmp_path):
    from latency_lab import breakdown

    path = tmp_path / "vm.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}}]}, f)
    assert "no GPU kernel events" in breakdown(path, steps=1, top=1)["error"]


@pytest.mark.slow
def test_latency_lab_runs_on_cpu_with_tiny_shapes(tmp_path):
    # End to end in ~40 s on 2 busy cores: both formats' step loops and weight-layer chains;
    # the CPU trace has no GPU kernels, so each breakdown records why it is missing.
    import subprocess

    done = subprocess.run([sys.executable, "benchmarks/latency_lab.py", "--out", str(tmp_path), "--shape", "tiny",
                           "--steps", "2", "--repeats", "1", "--batches", "4", "--batch-context", "64",
                           "--w8a8-min-tokens", "4"],
                          cwd=REPO, env={**os.environ, **BENCHMARK_CACHE_ENV}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "latency_lab.json").read_text())
    assert list(results["formats"]) == ["bf16", "fp8"]
    for name, fmt in results["formats"].items():
        labels = [v["variant"] for v in fmt["variants"]]
        assert all(v["ms"] > 0 for v in fmt["variants"]), fmt["variants"]
        assert labels[3] == "decode step, bucket 4x4, 4 sequences at 64 tokens"
        # fp8 also runs the 4-row step as W8A8 (--w8a8-min-tokens 4): its FP8 x FP8 dots, 7 a layer.
        if name == "fp8":
            assert labels[4:] == ["decode step, bucket 4x4, 4 sequences at 64 tokens, W8A8 from 4 rows"]
            assert [v["fp8_x_fp8_dots"] for v in fmt["variants"][3:]] == [0, 14]
        else:
            assert len(labels) == 4
        assert "no GPU kernel events" in fmt["variants"][0]["breakdown"]["error"]
    # fp8 projections are half the bytes of bf16 ones; the lm_head stays bf16.
    assert results["formats"]["fp8"]["per_token_bytes"] < results["formats"]["bf16"]["per_token_bytes"]


def test_a_batched_decode_step_gives_each_sequence_its_own_pages():
    from latency_lab import PAGE_SIZE, decode_batch, pages_needed

    batch = decode_batch(8, 8, max_pages=4, num_active=3, context=64)
    assert batch.kv_lens[:3].tolist() == [65, 65, 65] and batch.kv_lens[3:].tolist() == [0] * 5
    pages = batch.page_tables[:3, :64 // PAGE_SIZE + 1]
    assert len(set(pages.ravel().tolist())) == pages.size and pages.min() >= 1  # distinct, never the padding page
    assert pages.max() < pages_needed(3, 64)


def test_kernels_take_their_named_scope_from_the_compiled_hlo(tmp_path):
    import jax
    import jax.numpy as jnp

    from latency_lab import breakdown, op_scopes

    def step(x, w):
        with jax.named_scope("lm_head"):
            logits = jnp.tanh(x @ w)
        with jax.named_scope("sampler"):
            return jnp.argmax(logits, axis=1)

    compiled = jax.jit(step).lower(jnp.ones((2, 8)), jnp.ones((8, 16))).compile()
    scopes = op_scopes(compiled.as_text())
    assert any("lm_head" in s for s in scopes.values()) and any("sampler" in s for s in scopes.values())
    # A kernel named only after its HLO instruction ("." written "_") gets that instruction's scope.
    name = next(n for n, s in scopes.items() if "sampler" in s and "." in n)
    kernel = name.replace(".", "_")
    path = tmp_path / "vm.trace.json.gz"
    write_trace(path, [(kernel, 0, 4, {}), ("unknown_kernel", 4, 6, {})])
    b = breakdown(path, steps=1, top=2, scopes=scopes)
    assert b["by_kind_us"]["sampler"] == pytest.approx(4)


def test_xla_options_parse_and_reach_the_compiler():
    import jax
    import jax.numpy as jnp

    from latency_lab import compile_loop, parse_xla_options

    options = parse_xla_options("xla_gpu_enable_command_buffer=FUSION,xla_gpu_graph_min_graph_size=5,"
                                "xla_gpu_unsupported_enable_triton_multi_output_fusion=true")
    assert options == {"xla_gpu_enable_command_buffer": "FUSION", "xla_gpu_graph_min_graph_size": 5,
                       "xla_gpu_unsupported_enable_triton_multi_output_fusion": True}
    with pytest.raises(SystemExit, match="not xla_<name>=<value>"):
        parse_xla_options("enable_everything")
    compiled, _ = compile_loop(jax.jit(lambda x, w: x @ w), jnp.ones((2, 2)), jnp.ones((2, 2)), options)
    assert float(compiled(jnp.ones((2, 2)), jnp.ones((2, 2)))[0, 0]) == 2.0
    # An option XLA does not know is refused, not ignored: the variant's row says so.
    with pytest.raises(Exception, match="No such compile option"):
        compile_loop(jax.jit(lambda x, w: x @ w), jnp.ones((2, 2)), jnp.ones((2, 2)), {"xla_gpu_no_such_option": True})

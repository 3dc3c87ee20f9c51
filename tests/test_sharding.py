"""Tensor and data parallelism on 8 simulated CPU devices, against the same model on one device.

The model: a tiny random Llama whose head counts divide no tp size > 1 (9 query heads,
3 KV heads, like SmolLM2-135M), so every size exercises head padding and KV-head replication.
Tolerance: float32 logits within 1e-4 (absolute) of one device: the sharded programs differ
only in the order of the all-reduced partial sums. Greedy tokens must be identical.

Device-count flags must be set before JAX starts, so the multi-device checks run in one
subprocess (this file run as a script) and report JSON; the head-layout tests run here.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "tiny-llama3"
TP_SIZES = (1, 2, 4, 8)
LOGITS_ATOL = 1e-4
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9] * 7, [100], list(range(200, 240)), [5] * 33]
LLM_OPTIONS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_pages=48, page_size=16,
                   use_tqdm=False, max_wait_s=0.0, warm_up=False)


def tiny_9_3_model():
    """tiny-llama3's tokenizer and vocabulary with random weights and 9 query / 3 KV heads."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.checkpoint import load_model
    from jaxinfer.params import init_random

    base = load_model(FIXTURE, dtype="float32")
    config = dataclasses.replace(base.config, num_q_heads=9, num_kv_heads=3, head_dim=16, hidden_size=96)
    weights = init_random(config, jax.random.key(0), jnp.float32)
    return dataclasses.replace(base, config=config, weights=weights)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 2), (32, 8), (12, 4), (6, 6), (14, 2)])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 16])
def test_head_layout_keeps_whole_groups_on_each_shard(num_q_heads, num_kv_heads, tp):
    from sharding.heads import head_layout

    layout = head_layout(num_q_heads, num_kv_heads, tp)
    q, kv = np.asarray(layout.q_source), np.asarray(layout.kv_source)
    group = num_q_heads // num_kv_heads
    assert len(q) % tp == 0 and len(kv) % tp == 0
    assert sorted(q[q >= 0].tolist()) == list(range(num_q_heads))  # every query head exactly once
    assert sorted(set(kv.tolist())) == list(range(num_kv_heads))
    padded_group = len(q) // len(kv)
    for i, source in enumerate(q):
        if source >= 0:  # the kernel's mapping (head i -> KV head i // group) finds the right KV head
            assert kv[i // padded_group] == source // group
    if num_kv_heads % tp == 0:
        assert layout.is_identity


def test_padded_model_computes_the_same_logits():
    import jax
    import jax.numpy as jnp

    from jaxinfer.batch import build_step_batch
    from jaxinfer.kv_cache import create_kv_cache
    from sharding.heads import head_layout, pad_weights, padded_config

    from .all_logits import forward_all_logits

    model = tiny_9_3_model()
    batch = build_step_batch([(PROMPTS[0], 0, [1]), (PROMPTS[1], 0, [2, 3])], num_tokens=32, num_seqs=2,
                             pages_per_seq=2)
    step = jax.jit(forward_all_logits, static_argnums=(3, 4))
    expected, _ = step(model.weights, create_kv_cache(model.config, 4, 16, jnp.float32), batch, model.config, "reference")
    layout = head_layout(9, 3, 8)
    config = padded_config(model.config, layout)
    weights = jax.tree.map(jnp.asarray, pad_weights(model.weights, layout))
    got, _ = step(weights, create_kv_cache(config, 4, 16, jnp.float32), batch, config, "reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=LOGITS_ATOL)


@pytest.fixture(scope="module")
def multi_device_report():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    from .subprocess_report import read_report

    return read_report(result.stdout)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tensor_parallel_logits_match_one_device(multi_device_report, tp):
    assert multi_device_report["logits_max_abs_diff"][str(tp)] <= LOGITS_ATOL


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tensor_parallel_greedy_tokens_match_one_device(multi_device_report, tp):
    report = multi_device_report
    assert report["tokens"][str(tp)] == report["tokens"]["reference"]


def test_cache_stays_sharded_in_place(multi_device_report):
    hlo = multi_device_report["hlo_tp8"]
    assert hlo["cache_all_gathers"] == 0, "the step re-lays out the KV cache"
    assert hlo["donated"], "the step did not update the cache in place"
    assert hlo["cache_sharding_kept"]
    assert hlo["num_all_reduces"] > 0  # row-parallel projections do reduce


def test_fp8_kv_cache_under_tensor_parallelism_matches_one_device(multi_device_report):
    tokens = multi_device_report["tokens"]
    assert tokens["fp8_tp4"] == tokens["fp8_tp1"]


def test_dim_major_v_pages_under_tensor_parallelism_split_by_heads_and_match(multi_device_report):
    report = multi_device_report
    tokens = report["tokens"]
    assert tokens["fp8_tp2_gpu_kernel_dim_major"] == tokens["fp8_tp2_gpu_kernel_token_major"]
    token_major, dim_major = report["v_pages_token_major"], report["v_pages_dim_major"]
    assert dim_major["shape"] == token_major["shape"][:2] + token_major["shape"][2:][::-1]
    assert dim_major["spec"] == token_major["spec"] and "tp" in dim_major["spec"]


def test_data_parallel_replicas_match_one_device(multi_device_report):
    report = multi_device_report
    assert report["tokens"]["dp"] == report["tokens"]["reference"]
    assert min(report["dp_requests_per_replica"]) > 0  # the router used every replica


def _multi_device_checks() -> dict:
    """Runs in the 8-device subprocess."""
    import re

    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.batch import build_step_batch
    from jaxinfer.kv_cache import create_kv_cache
    from jaxinfer.model import forward
    from sharding.mesh import make_mesh
    from sharding.placement import StepPlacement, shard_model

    assert jax.device_count() == 8
    model = tiny_9_3_model()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    report = {"logits_max_abs_diff": {}, "tokens": {}}

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    report["tokens"]["reference"] = tokens(LLM(loaded=model, **LLM_OPTIONS))
    batch = build_step_batch([(PROMPTS[0], 0, [1]), (PROMPTS[3], 0, [2, 3, 4])], num_tokens=64, num_seqs=2,
                             pages_per_seq=4)
    # Logits at every row, not just each sequence's last (this runs as a script: no tests package).
    batch = dataclasses.replace(batch, logits_indices=np.arange(64, dtype=np.int32))
    step = jax.jit(forward, static_argnums=(3, 4), donate_argnums=(1,))
    expected, _ = step(model.weights, create_kv_cache(model.config, 8, 16, jnp.float32), batch, model.config,
                       "reference")
    for tp in TP_SIZES:
        mesh = make_mesh(tp)
        sharded = shard_model(model, mesh)
        placement = StepPlacement(sharded.config, mesh)
        cache = create_kv_cache(sharded.config, 8, 16, jnp.float32, sharding=placement.cache)
        with placement.context():
            logits, _ = step(sharded.weights, cache, jax.device_put(batch, placement.replicated), sharded.config,
                             "reference")
        report["logits_max_abs_diff"][str(tp)] = float(jnp.max(jnp.abs(logits - expected)))
        report["tokens"][str(tp)] = tokens(LLM(loaded=model, tensor_parallel_size=tp, **LLM_OPTIONS))

    # The engine's real step at tp=8: compiled HLO, donation, the cache's sharding after the step.
    llm = LLM(loaded=model, tensor_parallel_size=8, **LLM_OPTIONS)
    runner = llm.engine.runner
    inputs = runner.empty_inputs(32, 4, 8)
    step, args, kwargs = runner._step_call(inputs)  # the jitted step and its arguments, as execute() calls it
    with runner.placement.context():
        compiled = step.lower(*args, **kwargs).compile()
    hlo = compiled.as_text()
    cache_shape = runner.cache.k[0].shape  # global [Hkv', P, S, D]
    gathered = r"= f32\[{}\][^\n]* all-gather".format(",".join(map(str, cache_shape)))
    old_cache = runner.cache.k[0]
    before = old_cache.sharding
    jax.block_until_ready(runner.execute(inputs).token_ids)
    report["hlo_tp8"] = dict(
        cache_all_gathers=len(re.findall(gathered, hlo)),
        num_all_reduces=hlo.count("all-reduce("),
        donated=old_cache.is_deleted(),
        cache_sharding_kept=runner.cache.k[0].sharding == before and runner.cache.v[-1].sharding == before,
    )

    # An FP8 cache with non-trivial per-layer scales: the pages split by heads, the scales replicated.
    layers = model.config.num_layers
    fp8_model = dataclasses.replace(model, kv_cache_scales=(np.full(layers, 0.5), np.linspace(0.25, 2.0, layers)))
    for tp in (1, 4):
        llm = LLM(loaded=fp8_model, tensor_parallel_size=tp, kv_cache_dtype="fp8", **LLM_OPTIONS)
        report["tokens"][f"fp8_tp{tp}"] = tokens(llm)

    # Dim-major V pages (pallas_kernels.paged_attention.v_layout) under tensor parallelism, through the GPU
    # kernel in interpret mode: split by heads as token-major ones are, the same tokens.
    for v_layout in ("token_major", "dim_major"):
        os.environ["JAXINFER_V_LAYOUT"] = v_layout
        llm = LLM(loaded=fp8_model, tensor_parallel_size=2, kv_cache_dtype="fp8", attention_impl="pallas_gpu_interpret",
                  **LLM_OPTIONS)
        report["tokens"][f"fp8_tp2_gpu_kernel_{v_layout}"] = tokens(llm)
        v_pages = llm.engine.runner.cache.v[0]
        report[f"v_pages_{v_layout}"] = dict(shape=list(v_pages.shape), spec=str(v_pages.sharding.spec))
    del os.environ["JAXINFER_V_LAYOUT"]

    dp = LLM(loaded=model, tensor_parallel_size=2, data_parallel_size=4, **LLM_OPTIONS)
    report["tokens"]["dp"] = tokens(dp)
    report["dp_requests_per_replica"] = [e.stats()["prompt_tokens_total"] for e in dp.engine.engines]
    return report


def test_graph_options_respect_only_the_users_own_graph_kinds(monkeypatch):
    """A user's ``--xla_gpu_enable_command_buffer=`` wins; other options that merely share the
    prefix (``..._va_remapping`` in newer XLAs) must not switch the multi-GPU graph kinds off."""
    from jaxinfer import compile_options

    monkeypatch.setattr(compile_options.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer_va_remapping=true")
    expected = {"xla_gpu_enable_command_buffer": compile_options.GRAPHS_WITH_COLLECTIVES}
    assert compile_options.graph_options(2) == expected
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    assert compile_options.graph_options(2) == {}
    assert compile_options.graph_options(1) == {}


if __name__ == "__main__":
    from subprocess_report import report_line  # run as a script: tests/ is sys.path[0]

    print(report_line(_multi_device_checks()))


"""FP8 KV cache (``kv_cache_dtype="fp8"``): the format's arithmetic, the kernels over e4m3 pages,
the engine and prompt scoring end to end, the pool arithmetic, the flags and the errors.

All on CPU, where FP8 is emulated by XLA exactly to the format; the model is the tiny Llama-3
fixture in float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxinfer import LLM, SamplingParams, cli, memory
from jaxinfer.attention import paged_attention
from jaxinfer.batch import StepBatch
from jaxinfer.checkpoint import load_model
from jaxinfer.config import ModelConfig
from jaxinfer.engine_config import EngineConfig, EngineConfigError
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.kv_cache_dtype import (FP8_MAX, check_kv_cache_dtype_supported, kv_scales_from_amax, quantize_to_fp8,
                                     storage_dtype)
from jaxinfer.prompt_logprobs import PromptScorer
from pallas_kernels.paged_attention import ragged_paged_attention_reference, ragged_paged_attention_tpu
from pallas_kernels.paged_attention.cpu import ragged_paged_attention_cpu
from tests.attention_cases import make_case

from .conftest import FIXTURES
from .test_memory import LLAMA_3_1_8B

F8 = jnp.float8_e4m3fn
PAGE_SIZE = 16
PROMPT = "the cat sat on the mat and looked at the dog"


@pytest.fixture(scope="module")
def tiny():
    return load_model(FIXTURES / "tiny-llama3", dtype="float32")


def fp8_case(seed, seqs, **kwargs):
    """A make_case batch whose pages (and new K/V) are e4m3; q stays float32. NaN in unowned rows
    survives the cast (e4m3fn has NaN), so stray reads still show."""
    case = make_case(seed, seqs, **kwargs)
    return dataclasses.replace(case, k_new=case.k_new.astype(F8), v_new=case.v_new.astype(F8),
                               k_pages=case.k_pages.astype(F8), v_pages=case.v_pages.astype(F8))


def test_quantize_saturates_and_round_trips_within_e4m3_error():
    scale = jnp.float32(0.5)
    x = jnp.asarray([0.0, 1e-3, -0.3, 1.0, 3.7, -150.0, 224.0, 225.0, 1e4, -1e9], jnp.float32)
    q = quantize_to_fp8(x, scale)
    assert q.dtype == F8
    back = np.asarray(q.astype(jnp.float32)) * 0.5
    assert not np.isnan(back).any()  # a plain cast of 1e4 / 0.5 would be NaN
    # Past 448 * scale, values clip to it; inside, e4m3's 3 mantissa bits round within 2^-4 relative.
    np.testing.assert_array_equal(back[-3:], [FP8_MAX * 0.5, FP8_MAX * 0.5, -FP8_MAX * 0.5])
    normal = np.abs(np.asarray(x[:-3]) / 0.5) >= 2.0**-6  # e4m3's smallest normal
    np.testing.assert_allclose(back[:-3][normal], np.asarray(x[:-3])[normal], rtol=2.0**-4)
    assert abs(back[1] - 1e-3) <= 2.0**-9 * 0.5  # subnormals: absolute error within half a step
    rng = np.random.default_rng(0)
    values = rng.standard_normal(4096).astype(np.float32) * 3
    trip = np.asarray(quantize_to_fp8(jnp.asarray(values), jnp.float32(1.0)).astype(jnp.float32))
    expected = values.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # round to nearest even
    np.testing.assert_array_equal(trip, expected)


def _batch(case) -> StepBatch:
    return StepBatch(token_ids=None, positions=None, cu_q_lens=case.cu_q_lens, kv_lens=case.kv_lens,
                     page_tables=case.page_tables, logits_indices=None)


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas_gpu_interpret", "pallas_gpu_fused_interpret"])
def test_scaled_fp8_attention_equals_dequantize_then_attend(impl):
    """The dispatcher over e4m3 pages with scales vs the oracle: dequantize every page and the
    quantized new K/V to float32 and attend over those in float32."""
    case = make_case(5, [(1, 37), (6, 40), (0, 0), (17, 17)], num_q_heads=8, num_kv_heads=2, pad_tokens=2)
    k_scale, v_scale = jnp.float32(0.05), jnp.float32(3.0)  # |k| up to ~22 fits; v's small values go subnormal
    k_pages, v_pages = quantize_to_fp8(case.k_pages, k_scale), quantize_to_fp8(case.v_pages, v_scale)
    # Copies: the GPU kernels donate the pages they are given.
    out, new_k, new_v = paged_attention(case.q, case.k_new, case.v_new, jnp.array(k_pages), jnp.array(v_pages),
                                        _batch(case), sm_scale=case.sm_scale, impl=impl, k_scale=k_scale,
                                        v_scale=v_scale)
    assert new_k.dtype == new_v.dtype == F8 and out.dtype == jnp.float32

    def dequantize(x, scale):
        return x.astype(jnp.float32) * scale

    k_new = dequantize(quantize_to_fp8(case.k_new, k_scale), k_scale)
    v_new = dequantize(quantize_to_fp8(case.v_new, v_scale), v_scale)
    oracle, oracle_k, oracle_v = ragged_paged_attention_reference(
        case.q, k_new, v_new, dequantize(k_pages, k_scale), dequantize(v_pages, v_scale),
        case.page_tables, case.cu_q_lens, case.kv_lens, sm_scale=case.sm_scale)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(oracle), rtol=2e-5, atol=2e-5)
    # The written pages are the quantized new K/V, exactly.
    np.testing.assert_array_equal(np.asarray(dequantize(new_k, k_scale)), np.asarray(oracle_k))
    np.testing.assert_array_equal(np.asarray(dequantize(new_v, v_scale)), np.asarray(oracle_v))
    # And fp8 is really in play: the unquantized attention differs by e4m3's rounding, no more.
    exact = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)[0]
    valid = ~np.isnan(np.asarray(exact))
    diff = np.abs(np.asarray(out) - np.asarray(exact))[valid]
    assert 1e-3 < diff.max() < 0.3


def test_the_dispatcher_saturates_what_it_writes():
    case = make_case(8, [(2, 20)], num_q_heads=4, num_kv_heads=1, nan_fill=False)
    k_new = case.k_new.at[0, 0, :4].set(jnp.asarray([1e6, -1e6, 500.0, -3.0]))
    pages = case.k_pages.astype(F8)
    _, k_pages, _ = paged_attention(case.q, k_new, case.v_new, pages, pages, _batch(case), sm_scale=case.sm_scale,
                                    impl="reference", k_scale=jnp.float32(1.0), v_scale=jnp.float32(1.0))
    row = np.asarray(k_pages[0, case.page_tables[0, 18 // PAGE_SIZE], 18 % PAGE_SIZE, :4], np.float32)
    np.testing.assert_array_equal(row, [FP8_MAX, -FP8_MAX, FP8_MAX, -3.0])  # position 18: the first new token


FP8_KERNEL_CASES = {
    "decode_gqa4_f32": ([(1, 37), (1, 16), (0, 0), (1, 64)], 8, 2, 64, jnp.float32, 0, dict(block_kv=32)),
    "mixed_chunked_bf16": ([(1, 50), (0, 0), (24, 80), (9, 9)], 8, 1, 128, jnp.bfloat16, 3, {}),
}


@pytest.mark.parametrize("name", sorted(FP8_KERNEL_CASES))
def test_cpu_path_and_tpu_kernel_read_fp8_pages_as_the_reference_does(name):
    seqs, hq, hkv, head_dim, dtype, pad, options = FP8_KERNEL_CASES[name]
    case = fp8_case(len(name), seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=PAGE_SIZE,
                    pad_tokens=pad)
    case = dataclasses.replace(case, q=case.q.astype(dtype))
    ref_out, ref_k, ref_v = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)
    cpu_out, cpu_k, _ = ragged_paged_attention_cpu(*case.args(), sm_scale=case.sm_scale)
    with pltpu.force_tpu_interpret_mode():
        tpu_out, tpu_k, tpu_v = ragged_paged_attention_tpu(*[jnp.array(a) for a in case.args()],
                                                           sm_scale=case.sm_scale, **options)
    assert tpu_k.dtype == F8 and tpu_out.dtype == dtype
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    for out in (cpu_out, tpu_out):
        assert not np.isnan(np.asarray(out, np.float32)).any()
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=tol, atol=tol)
    for got, want in ((cpu_k, ref_k), (tpu_k, ref_k), (tpu_v, ref_v)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_tpu_kernel_with_fp8_pages_lowers_for_tpu():
    sds = jax.ShapeDtypeStruct
    args = (sds((4, 8, 128), jnp.bfloat16), sds((4, 2, 128), F8), sds((4, 2, 128), F8),
            sds((2, 64, 16, 128), F8), sds((2, 64, 16, 128), F8),
            sds((4, 8), jnp.int32), sds((5,), jnp.int32), sds((4,), jnp.int32))
    lowered = ragged_paged_attention_tpu.trace(*args, sm_scale=0.1, block_kv=128).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def _llm(tiny, **options):
    return LLM(loaded=tiny, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_pages=40,
               page_size=PAGE_SIZE, use_tqdm=False, max_wait_s=0.0, **options)


def test_llm_generates_with_an_fp8_cache_and_scores_prompts_in_it(tiny):
    llm = LLM(str(FIXTURES / "tiny-llama3"), dtype="float32", kv_cache_dtype="fp8", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, num_pages=40, page_size=PAGE_SIZE, use_tqdm=False, max_wait_s=0.0)
    assert llm.engine_config.kv_cache_dtype == "fp8"
    # On a CPU the pool holds the e4m3 bit patterns as uint8 (page_storage.py says why).
    assert {a.dtype for a in llm.engine.runner.cache.k + llm.engine.runner.cache.v} == {jnp.dtype(jnp.uint8)}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3)
    out = llm.generate([PROMPT, "hello"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    ids = out[0].prompt_token_ids
    # The engine's prompt logprobs are those of a scorer over an e4m3 cache...
    fp8_scorer = PromptScorer(tiny.weights, tiny.config, page_size=PAGE_SIZE, kv_cache_dtype="fp8")
    assert out[0].prompt_logprobs == fp8_scorer.score(ids, 3)
    # ...which differ from the float32 cache's by e4m3's rounding: present, and bounded (this random
    # fixture's logprobs move ~0.25 nats on average; the real model's accuracy is in benchmarks/).
    exact = PromptScorer(tiny.weights, tiny.config, page_size=PAGE_SIZE).score(ids, 3)
    diffs = [abs(entry[t] - ref[t]) for entry, ref, t in zip(out[0].prompt_logprobs[1:], exact[1:], ids[1:])]
    assert 0 < np.mean(diffs) < 0.5 and max(diffs) < 1.5
    # The greedy first token is the argmax of the scorer's last row, computed over the same cache.
    first = out[0].outputs[0].token_ids[0]
    assert list(fp8_scorer.score(ids + [first], 1)[-1]) == [first]  # the token is its own top 1


def test_models_endpoint_reports_the_kv_cache_dtype(tiny):
    import requests

    from .fake_engine import FakeEngine, RunningServer

    with RunningServer(_llm(tiny, kv_cache_dtype="fp8", warm_up=False).engine) as s:
        card = requests.get(f"{s.base_url}/v1/models", timeout=30).json()["data"][0]
    assert card["kv_cache_dtype"] == "fp8" and card["kv_cache_storage_dtype"] == "float8_e4m3fn"
    with RunningServer(FakeEngine()) as s:  # an engine without an EngineConfig says nothing
        assert "kv_cache_dtype" not in requests.get(f"{s.base_url}/v1/models", timeout=30).json()["data"][0]


def test_checkpoint_scales_reach_the_cache_and_change_the_result(tiny):
    layers = tiny.config.num_layers
    scales = (np.full(layers, 0.25, np.float32), np.linspace(0.5, 2.0, layers).astype(np.float32))
    scaled = dataclasses.replace(tiny, kv_cache_scales=scales)
    llm = _llm(scaled, kv_cache_dtype="fp8_e4m3")
    cache = llm.engine.runner.cache
    np.testing.assert_array_equal(np.asarray(cache.k_scale), scales[0])
    np.testing.assert_array_equal(np.asarray(cache.v_scale), scales[1])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    with_scales = llm.generate([PROMPT], params, use_tqdm=False)[0]
    unit = PromptScorer(tiny.weights, tiny.config, page_size=PAGE_SIZE, kv_cache_dtype="fp8")
    assert with_scales.prompt_logprobs != unit.score(with_scales.prompt_token_ids, 0)
    # Scales are used only by FP8 pages: an "auto" cache ignores them.
    assert _llm(scaled).engine.runner.cache.layer_scales(0) == (None, None)


def test_pool_holds_twice_the_bf16_tokens_and_four_times_f32s(tiny):
    auto = EngineConfig(page_size=PAGE_SIZE).resolve(tiny, platform="cpu")
    fp8 = EngineConfig(page_size=PAGE_SIZE, kv_cache_dtype="fp8").resolve(tiny, platform="cpu")
    assert fp8.num_pages == 4 * auto.num_pages  # float32 model, CPU's fixed 1 GiB pool
    llama = ModelConfig.from_hf(LLAMA_3_1_8B)
    bf16 = memory.estimate(llama, bytes_per_element=2, memory_bytes=141 * 2**30, request_len=2048)
    e4m3 = memory.estimate(llama, bytes_per_element=2, kv_bytes_per_element=1, memory_bytes=141 * 2**30,
                           request_len=2048)
    assert e4m3.weight_bytes == bf16.weight_bytes  # the weights stay bf16
    ratio = e4m3.num_tokens / bf16.num_tokens
    print(f"Llama-3.1-8B on an H200 (141 GiB, 0.9): the KV pool holds {bf16.num_tokens:,} bf16 tokens, "
          f"{e4m3.num_tokens:,} fp8 tokens: {ratio:.3f}x (goal >= 1.9x)")
    assert ratio >= 1.9


@pytest.mark.parametrize("flags,kib", [
    (["--kv-cache-dtype", "fp8"], 64.0), (["--kv-dtype", "float8"], 64.0), (["--kv-cache-dtype", "fp8_e4m3"], 64.0),
    ([], 128.0), (["--kv-dtype", "auto", "--dtype", "float32"], 256.0),
])
def test_estimate_kv_cache_dtype_flag_and_its_old_alias(tmp_path, capsys, flags, kib):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    assert cli.main(["estimate", "--model", str(tmp_path), *flags]) == 0
    assert f"{kib:.1f} KiB per token" in capsys.readouterr().out


def test_serve_flag_reaches_the_engine_config():
    from jaxinfer.server.serve import engine_config_from_args

    args = cli.build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8"
    assert engine_config_from_args(cli.build_parser().parse_args(["serve"])).kv_cache_dtype is None
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


class _Device:
    def __init__(self, platform, device_kind, compute_capability=None):
        self.platform, self.device_kind, self.compute_capability = platform, device_kind, compute_capability


@pytest.mark.parametrize("device,supported", [
    (_Device("gpu", "NVIDIA H200", "9.0"), True), (_Device("gpu", "NVIDIA L4", "8.9"), True),
    (_Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), False), (_Device("tpu", "TPU v5 lite"), False),
    (_Device("tpu", "TPU v6 lite"), False), (_Device("tpu", "TPU7x"), True), (_Device("cpu", "cpu"), True),
])
def test_fp8_is_refused_on_accelerators_without_it(device, supported):
    check_kv_cache_dtype_supported("auto", [device])  # always fine
    if supported:
        check_kv_cache_dtype_supported("fp8", [device])
        return
    with pytest.raises(EngineConfigError, match="compute capability >= 8.9.*TPU v7.*kv_cache_dtype='auto'") as e:
        check_kv_cache_dtype_supported("fp8", [device])
    assert e.value.field == "kv_cache_dtype" and device.device_kind in str(e.value)


def test_llm_refuses_fp8_before_loading_anything(monkeypatch):
    from jaxinfer import kv_cache_dtype, llm

    monkeypatch.setattr(kv_cache_dtype.jax, "devices", lambda: [_Device("gpu", "NVIDIA A100", "8.0")])
    monkeypatch.setattr(llm, "load_model", lambda *a: pytest.fail("loaded weights before refusing fp8"))
    with pytest.raises(EngineConfigError, match="A100"):
        LLM("tiny", kv_cache_dtype="fp8")


@pytest.mark.parametrize("bad", ["fp16", "int8", "fp8_e5m2", ""])
def test_unknown_kv_cache_dtype_names_the_field(bad):
    with pytest.raises(EngineConfigError, match="kv_cache_dtype") as e:
        EngineConfig(kv_cache_dtype=bad)
    assert e.value.field == "kv_cache_dtype"
    with pytest.raises(EngineConfigError, match="'auto', 'fp8', 'fp8_e4m3'"):
        check_kv_cache_dtype_supported(bad)


def test_bad_checkpoint_scales_are_refused(tiny):
    layers = tiny.config.num_layers
    with pytest.raises(ValueError, match=f"k_scales must hold one scale per layer \\({layers}\\)"):
        create_kv_cache(tiny.config, 4, PAGE_SIZE, F8, scales=(np.ones(layers + 1), np.ones(layers)))
    with pytest.raises(ValueError, match="v_scales must be finite and positive"):
        create_kv_cache(tiny.config, 4, PAGE_SIZE, F8, scales=(np.ones(layers), np.zeros(layers)))


def test_calibrated_scales_map_the_largest_value_inside_e4m3():
    k, v = kv_scales_from_amax([10.0, 896.0], [0.0, 4.0])
    np.testing.assert_allclose(k, [20.0 / FP8_MAX, 4.0])
    assert (v > 0).all() and v[1] == pytest.approx(8.0 / FP8_MAX)
    assert storage_dtype("auto", jnp.bfloat16) == jnp.bfloat16 and storage_dtype("fp8", jnp.float32) == F8


def test_calibration_reads_each_layers_largest_k_and_v(tiny):
    from jaxinfer.batch import build_step_batch
    from jaxinfer.kv_calibration import calibrate_kv_scales, kv_amax
    from jaxinfer.model import forward

    ids = tiny.tokenizer.encode(PROMPT)
    num_pages = -(-len(ids) // 8)
    padded = jnp.zeros(64, jnp.int32).at[:len(ids)].set(jnp.asarray(ids, jnp.int32))  # padding must not count
    k_amax, v_amax = kv_amax(tiny.weights, padded, jnp.int32(len(ids)), config=tiny.config, page_size=8)
    # Oracle: the engine's own forward into a float32 cache, then the largest |value| of each layer's pages.
    cache = create_kv_cache(tiny.config, num_pages + 1, 8, jnp.float32)
    batch = build_step_batch([(ids, 0, list(range(1, num_pages + 1)))], num_tokens=32, num_seqs=1,
                             pages_per_seq=num_pages)
    _, cache = forward(tiny.weights, cache, jax.tree.map(jnp.asarray, batch), tiny.config, "reference")
    np.testing.assert_allclose(k_amax, [float(jnp.max(jnp.abs(k))) for k in cache.k], rtol=1e-6)
    np.testing.assert_allclose(v_amax, [float(jnp.max(jnp.abs(v))) for v in cache.v], rtol=1e-6)
    # Calibrated on this text, no value of it comes near saturation (headroom 2: at most 224).
    k_scale, v_scale = calibrate_kv_scales(tiny, [ids, ids[:5]])
    np.testing.assert_allclose(k_scale * FP8_MAX / 2, k_amax, rtol=1e-6)
    np.testing.assert_allclose(v_scale * FP8_MAX / 2, v_amax, rtol=1e-6)
    with pytest.raises(ValueError, match="at least one non-empty sample"):
        calibrate_kv_scales(tiny, [[]])

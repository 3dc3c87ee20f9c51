"""Quantized models end to end: quantize at load, pre-quantized FP8 checkpoints (compressed-tensors
FP8 / FP8_DYNAMIC with KV scales, fbgemm-fp8) written here with numpy, greedy generation and
prompt logprobs through the engine, the Orbax round trip, and the checkpoints that are refused.
"""

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import load_model
from jaxinfer.engine_config import EngineConfig, EngineConfigError
from jaxinfer.orbax_checkpoint import restore, save
from jaxinfer.quantization import QuantizationError, QuantizedWeight, dequantize
from jaxinfer.quantized_checkpoint import parse_quantization_config
from jaxinfer.safetensors_reader import SafetensorsFile

from .conftest import FIXTURES

TINY = FIXTURES / "tiny-llama3"
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 64, "num_pages": 32,
          "use_tqdm": False, "warm_up": False}
SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
                      np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def write_safetensors(path, tensors):
    """A safetensors file written by hand: ``safetensors.numpy`` refuses float8 arrays."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def fp8_rows(w, per_channel):
    """(e4m3 payload, float32 scale) of ``w`` [out, in]: per output channel or per tensor."""
    absmax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max().reshape(1)
    scale = (absmax / 448.0).astype(np.float32)
    return (w / scale.reshape(-1, 1) if per_channel else w / scale).astype(ml_dtypes.float8_e4m3fn), scale


def compressed_tensors_checkpoint(out, scheme="FP8_DYNAMIC", kv_scales=True, quant_config=None):
    """The tiny Llama fixture as llm-compressor writes it, built with numpy: e4m3 projections,
    ``weight_scale`` per channel ([out, 1], FP8_DYNAMIC) or per tensor ([1], FP8, with an
    ``input_scale``), per-layer ``k_scale``/``v_scale``, and the matching ``quantization_config``."""
    out.mkdir()
    for f in TINY.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    reader = SafetensorsFile(TINY / "model.safetensors")
    tensors, written = {}, {}
    for name in reader.names():
        w = reader.read(name)
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".", 3)[-1] in PROJECTIONS:
            payload, scale = fp8_rows(w, per_channel=scheme == "FP8_DYNAMIC")
            tensors[name], tensors[module + ".weight_scale"] = payload, scale
            if scheme == "FP8":
                # Different per projection, so that sharing one per input (the largest) is seen.
                projection = PROJECTIONS.index(module.split(".", 3)[-1])
                tensors[module + ".input_scale"] = np.array([0.02 + 0.01 * projection], np.float32)
            written[name] = (payload, scale)
        else:
            tensors[name] = w
    config = json.loads((TINY / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    if kv_scales:
        for i in range(num_layers):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(0.5 + i, np.float32)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(0.25 + i, np.float32)
    write_safetensors(out / "model.safetensors", tensors)
    dynamic = scheme == "FP8_DYNAMIC"
    config["quantization_config"] = quant_config or {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "channel" if dynamic else "tensor", "group_size": None, "block_structure": None},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic,
                                  "strategy": "token" if dynamic else "tensor"},
        }},
        "kv_cache_scheme": ({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                             "strategy": "tensor"} if kv_scales else None),
    }
    (out / "config.json").write_text(json.dumps(config))
    return out, written


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8"])
def test_compressed_tensors_checkpoint_loads_as_written(tmp_path, scheme):
    path, written = compressed_tensors_checkpoint(tmp_path / "ct", scheme)
    assert parse_quantization_config(json.loads((path / "config.json").read_text())["quantization_config"]).scheme \
        == scheme
    model = load_model(path, "float32")
    assert model.quantization == "fp8" and model.config.quantization == "fp8"
    assert model.config.activation_scales == ("static" if scheme == "FP8" else "dynamic")
    layer = model.weights.layers[1]
    payload, scale = written["model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(layer.q, QuantizedWeight) and layer.q.payload.shape == (4, 64, 128)
    # The e4m3 bytes land untouched, [out, in] reshaped into heads, and the scale per channel.
    assert np.asarray(layer.q.payload).tobytes() == payload.tobytes()
    np.testing.assert_array_equal(np.asarray(layer.q.scale).reshape(-1), np.broadcast_to(scale.reshape(-1), (256,)))
    k_scales, v_scales = model.kv_cache_scales
    np.testing.assert_array_equal(k_scales, [0.5, 1.5])
    np.testing.assert_array_equal(v_scales, [0.25, 1.25])
    assert k_scales.dtype == np.float32
    # The dequantized weight is the dense one to e4m3's precision.
    dense = load_model(TINY, "float32")
    deq = dequantize(layer.down)  # [E, F]
    np.testing.assert_allclose(np.asarray(deq).T, np.asarray(dense.weights.layers[1].down),
                               atol=float(np.abs(np.asarray(dense.weights.layers[1].down)).max()) / 16)


def test_fbgemm_fp8_checkpoint_and_a_checkpoint_without_kv_scales(tmp_path):
    path, written = compressed_tensors_checkpoint(
        tmp_path / "fbgemm", "FP8_DYNAMIC", kv_scales=False,
        quant_config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                      "modules_to_not_convert": ["lm_head"]})
    model = load_model(path, "float32")
    assert model.quantization == "fp8" and model.kv_cache_scales is None
    payload, scale = written["model.layers.0.mlp.up_proj.weight"]
    np.testing.assert_array_equal(np.asarray(model.weights.layers[0].up.scale), scale.reshape(-1))


def greedy_and_scored(loaded, prompt):
    """Greedy tokens of ``prompt``, then the prompt + those tokens scored: each generated token's
    logprob and the best logprob at its position."""
    with LLM(loaded=loaded, **ENGINE) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        scored = llm.generate([prompt + tokens], SamplingParams(max_tokens=1, prompt_logprobs=3),
                              use_tqdm=False)[0].prompt_logprobs
    rows = scored[len(prompt):]
    return tokens, [(row[t], max(row.values())) for t, row in zip(tokens, rows)]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_greedy_generation_agrees_with_its_own_prompt_logprobs(quantization):
    """Decode (weight-only, one token a step) and prompt scoring (one forward over the whole
    text) run the same quantized weights: each greedy token is the top-1 of the scored row."""
    loaded = load_model(TINY, "float32", quantization=quantization)
    assert isinstance(loaded.weights.layers[0].gate, QuantizedWeight)
    assert loaded.weights.layers[0].gate.payload.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[quantization]
    tokens, scored = greedy_and_scored(loaded, [1, 2, 3, 4, 5, 6, 7])
    assert len(tokens) == 6
    for logprob, best in scored:
        assert logprob >= best - 1e-3


def test_int8_logits_stay_close_to_the_dense_model():
    prompt = list(range(1, 40))
    dense = load_model(TINY, "float32")
    int8 = load_model(TINY, "float32", quantization="int8")
    rows = []
    for model in (dense, int8):
        with LLM(loaded=model, **ENGINE) as llm:
            rows.append(llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1),
                                     use_tqdm=False)[0].prompt_logprobs[1:])
    agree = np.mean([max(a, key=a.get) == max(b, key=b.get) for a, b in zip(*rows)])
    assert agree >= 0.9, agree


def test_orbax_round_trip_of_a_quantized_model(tmp_path):
    path, _ = compressed_tensors_checkpoint(tmp_path / "ct")
    model = load_model(path, "float32")
    saved = save(model, tmp_path / "orbax")
    back = restore(saved)
    assert back.config == model.config and back.quantization == "fp8"
    for a, b in zip(jax.tree.leaves(model.weights), jax.tree.leaves(back.weights)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_array_equal(back.kv_cache_scales[0], model.kv_cache_scales[0])
    with pytest.raises(QuantizationError, match="holds fp8 weights"):
        restore(saved, quantization="int8")


def test_a_dense_orbax_checkpoint_quantizes_on_restore_as_at_load(tmp_path):
    saved = save(load_model(TINY, "float32"), tmp_path / "orbax")
    restored = restore(saved, quantization="int8")
    loaded = load_model(TINY, "float32", quantization="int8")
    for a, b in zip(jax.tree.leaves(loaded.weights), jax.tree.leaves(restored.weights)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_quantize_at_load_from_a_bf16_checkpoint_matches_f32_within_bf16(tmp_path):
    out = tmp_path / "bf16"
    shutil.copytree(TINY, out)
    reader = SafetensorsFile(TINY / "model.safetensors")
    write_safetensors(out / "model.safetensors",
                      {n: reader.read(n).astype(ml_dtypes.bfloat16) for n in reader.names()})
    a = load_model(out, "bfloat16", quantization="fp8").weights.layers[0].v
    b = load_model(TINY, "float32", quantization="fp8").weights.layers[0].v
    # fp8 scales are searched per row (quantization.DEFAULT_SCALE_METHOD), and bf16's rounding may
    # tip a row to a neighbouring candidate: compare what the scales stand for, the weights, each
    # within e4m3's 2^-4 relative rounding of the float32 one (plus bf16's 2^-8).
    w = np.asarray(dequantize(b, jnp.float32))
    diff = np.abs(np.asarray(dequantize(a, jnp.float32)) - w)
    row_max = np.abs(w).reshape(w.shape[0] * w.shape[1], -1).max(axis=1).reshape(w.shape[:2] + (1,))
    assert (diff <= 2 * (2**-4 + 2**-8) * np.abs(w) + 2**-9 * row_max).all()


def bad_config(**weights):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", **weights},
        "input_activations": None}}}


@pytest.mark.parametrize("config,match", [
    (bad_config(strategy="block", block_structure=[128, 128]), "FP8_BLOCK"),
    (bad_config(num_bits=4, type="int", strategy="group", group_size=128), "4-bit int"),
    ({**bad_config(), "format": "pack-quantized"}, "pack-quantized"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({**bad_config(), "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "head", "dynamic": False}},
     "kv_cache_scheme"),
])
def test_unsupported_schemes_are_refused_naming_what_is_supported(tmp_path, config, match):
    with pytest.raises(QuantizationError, match=match) as error:
        parse_quantization_config(config)
    assert "supported" in str(error.value)
    # Through the loader: refused from config.json, before a weight is read.
    path = tmp_path / "bad"
    shutil.copytree(TINY, path)
    (path / "model.safetensors").write_bytes(b"not read")
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    with pytest.raises(QuantizationError, match=match):
        load_model(path, "float32")


def test_a_scale_of_the_wrong_shape_is_refused(tmp_path):
    path, _ = compressed_tensors_checkpoint(tmp_path / "ct", kv_scales=False)
    reader = SafetensorsFile(path / "model.safetensors")
    tensors = {n: reader.read(n) for n in reader.names()}
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = np.ones((256, 2), np.float32)  # group scales
    write_safetensors(path / "model.safetensors", tensors)
    with pytest.raises(QuantizationError, match=r"up_proj.weight_scale has shape \[256, 2\]"):
        load_model(path, "float32")


def test_a_pre_quantized_checkpoint_refuses_another_quantization(tmp_path):
    path, _ = compressed_tensors_checkpoint(tmp_path / "ct", kv_scales=False)
    with pytest.raises(QuantizationError, match="quantization='fp8' or None"):
        load_model(path, "float32", quantization="int8")


def test_the_engine_config_must_match_the_loaded_weights():
    dense = load_model(TINY, "float32")
    with pytest.raises(EngineConfigError, match="not quantized") as error:
        EngineConfig(quantization="int8").resolve(dense)
    assert error.value.field == "quantization"
    int8 = load_model(TINY, "float32", quantization="int8")
    assert EngineConfig().resolve(int8).quantization == "int8"


def test_the_quantization_flag_reaches_the_engine_options():
    import argparse

    from jaxinfer.engine_args import add_engine_arguments, engine_options_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options_from_args(parser.parse_args(["--quantization", "int8"]))["quantization"] == "int8"
    assert engine_options_from_args(parser.parse_args([]))["quantization"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_head_padding_for_tensor_parallelism_keeps_quantized_logits(quantization):
    """9 query / 3 KV heads padded for tp=8: the quantized payloads and scales are padded along
    their own head axes (q's first, o's second), and the logits do not change."""
    import dataclasses

    from jaxinfer.batch import build_step_batch
    from jaxinfer.checkpoint import quantize_weights
    from jaxinfer.kv_cache import create_kv_cache
    from jaxinfer.params import init_random
    from sharding.heads import head_layout, pad_weights, padded_config

    from .all_logits import forward_all_logits

    base = load_model(TINY, "float32")
    dense_config = dataclasses.replace(base.config, num_q_heads=9, num_kv_heads=3, head_dim=16, hidden_size=96)
    config = dataclasses.replace(dense_config, quantization=quantization)
    weights = quantize_weights(init_random(dense_config, jax.random.key(0), jnp.float32), quantization)
    batch = build_step_batch([([1, 2, 3, 4, 5], 0, [1])], num_tokens=16, num_seqs=1, pages_per_seq=1)
    step = jax.jit(forward_all_logits, static_argnums=(3, 4))
    expected, _ = step(weights, create_kv_cache(config, 2, 16, jnp.float32), batch, config, "reference")
    layout = head_layout(9, 3, 8)
    padded = padded_config(config, layout)
    padded_weights = jax.tree.map(jnp.asarray, pad_weights(weights, layout))
    assert padded_weights.layers[0].q.payload.shape[0] == padded.num_q_heads
    assert padded_weights.layers[0].o.payload.shape[1] == padded.num_q_heads
    got, _ = step(padded_weights, create_kv_cache(padded, 2, 16, jnp.float32), batch, padded, "reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-4)


def test_models_endpoint_reports_the_quantization():
    import types

    import requests

    from tests.fake_engine import FakeEngine, RunningServer

    engine = FakeEngine(max_model_len=64, max_num_seqs=4)
    engine.config = types.SimpleNamespace(quantization="int8")  # the resolved EngineConfig's field
    with RunningServer(engine) as server:
        card = requests.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]
    assert card["quantization"] == "int8" and "activation_scales" not in card
    engine.config = types.SimpleNamespace(quantization="fp8", activation_scales="static")
    with RunningServer(engine) as server:
        card = requests.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]
    assert (card["quantization"], card["activation_scales"]) == ("fp8", "static")


def test_an_fp8_lm_head_is_dequantized_into_the_serving_dtype(tmp_path):
    """A checkpoint whose `ignore` left the lm_head quantized: the model keeps its lm_head dense."""
    out = tmp_path / "untied"
    shutil.copytree(TINY, out)
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "tie_word_embeddings": False}))
    reader = SafetensorsFile(TINY / "model.safetensors")
    tensors = {n: reader.read(n) for n in reader.names()}
    lm_head = tensors["model.embed_tokens.weight"][::-1].copy()  # [vocab, E]
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = fp8_rows(lm_head, per_channel=True)
    write_safetensors(out / "model.safetensors", tensors)
    model = load_model(out, "float32")
    want = tensors["lm_head.weight"].astype(np.float32) * tensors["lm_head.weight_scale"]
    np.testing.assert_allclose(np.asarray(model.weights.lm_head), want.T, rtol=1e-6)


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_convert_quantizes_once_and_a_start_from_it_serves_the_quantize_at_load_logits(
        tmp_path, monkeypatch, quantization):
    from jaxinfer import checkpoint
    from jaxinfer.cli import main

    out = tmp_path / f"orbax-{quantization}"
    assert main(["convert", "--model", str(TINY), "--output", str(out), "--quantization", quantization]) == 0
    at_load = load_model(TINY, "float32", quantization=quantization)

    def refuse(*args, **kwargs):
        raise AssertionError("a converted quantized checkpoint was quantized again")

    monkeypatch.setattr(checkpoint, "quantize_weights", refuse)
    monkeypatch.setattr(checkpoint, "quantize", refuse)
    converted = load_model(out, "float32", quantization=quantization)  # asking for its own: no requantizing
    assert converted.config == at_load.config and converted.config.quantization == quantization
    assert jax.tree.structure(converted.weights) == jax.tree.structure(at_load.weights)
    for a, b in zip(jax.tree.leaves(at_load.weights), jax.tree.leaves(converted.weights)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    prompt = list(range(1, 30))
    rows = []
    for model in (at_load, converted):
        with LLM(loaded=model, **ENGINE) as llm:
            rows.append(llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5),
                                     use_tqdm=False)[0].prompt_logprobs)
    assert rows[0] == rows[1]

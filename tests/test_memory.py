"""KV-cache memory: the design's formula, page-pool sizing from device memory, `jaxinfer estimate`."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from model_shapes import LLAMA_3_1_8B, QWEN3_0_6B  # noqa: E402

from jaxinfer import cli, memory  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402

GIB = 1 << 30


def test_bytes_per_token_is_the_design_formula():
    llama = ModelConfig.from_hf(LLAMA_3_1_8B)
    # 2 (K, V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 128 KiB a token in bf16.
    assert llama.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert ModelConfig.from_hf(QWEN3_0_6B).kv_bytes_per_token(4) == 2 * 28 * 8 * 128 * 4


def test_estimate_answers_how_many_requests_fit():
    llama = ModelConfig.from_hf(LLAMA_3_1_8B)
    result = memory.estimate(llama, bytes_per_element=2, memory_bytes=141 * GIB, request_len=2048,
                             memory_utilization=0.9)
    weights = memory.weight_bytes(llama, 2)
    assert weights == 2 * 8_030_261_248  # Llama-3.1-8B's published parameter count, in bf16
    assert result.available_bytes == int(141 * GIB * 0.9) - weights
    assert result.num_tokens == result.available_bytes // (128 * 1024)
    assert result.num_requests == result.num_tokens // 2048
    assert "requests of 2,048 tokens" in str(result)
    # Nothing fits when the weights alone exceed the budget; no negative counts.
    tiny = memory.estimate(llama, bytes_per_element=2, memory_bytes=8 * GIB, request_len=2048, memory_utilization=0.9)
    assert tiny.available_bytes == tiny.num_tokens == tiny.num_requests == 0


class _FakeDevice:
    def __init__(self, platform, stats):
        self.platform, self._stats, self.device_kind = platform, stats, f"fake {platform}"

    def memory_stats(self):
        return self._stats


def _pool(monkeypatch, device, **kwargs):
    monkeypatch.setattr(memory.jax, "local_devices", lambda: [device])
    config = ModelConfig.from_hf(LLAMA_3_1_8B)
    return memory.num_pages_for_device(config, page_size=32, bytes_per_element=2, **kwargs)


def test_page_pool_is_sized_from_the_devices_free_memory(monkeypatch):
    stats = {"bytes_limit": 140 * GIB, "bytes_in_use": 16 * GIB}
    pages = _pool(monkeypatch, _FakeDevice("gpu", stats), memory_utilization=0.9, reserve_bytes=2 * GIB)
    budget = int(140 * GIB * 0.9) - 16 * GIB - 2 * GIB
    assert pages == budget // (32 * 128 * 1024)


def test_an_accelerator_without_a_memory_limit_warns_and_falls_back(monkeypatch, caplog):
    # XLA's VMM allocator (selected by --xla_gpu_command_buffer_update_mode) reports no limit.
    with caplog.at_level(logging.WARNING, logger="jaxinfer.memory"):
        pages = _pool(monkeypatch, _FakeDevice("gpu", None), memory_utilization=0.9)
    assert pages == memory.CPU_KV_CACHE_BYTES // (32 * 128 * 1024)
    assert any("num_pages" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxinfer.memory"):
        assert _pool(monkeypatch, _FakeDevice("cpu", None), memory_utilization=0.9) == pages
    assert not caplog.records  # on CPU the fixed pool is the documented default, not a problem


def test_estimate_command_reads_a_config_without_loading_weights(tmp_path, capsys):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    assert cli.main(["estimate", "--model", str(tmp_path), "--memory-gib", "141", "--request-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "128.0 KiB per token" in out and "requests of 4,096 tokens" in out


@pytest.mark.parametrize("kv_dtype,kib", [("float32", 256.0), ("float8", 64.0)])
def test_estimate_command_kv_dtype(tmp_path, capsys, kv_dtype, kib):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    assert cli.main(["estimate", "--model", str(tmp_path), "--kv-dtype", kv_dtype]) == 0
    assert f"{kib:.1f} KiB per token" in capsys.readouterr().out


def test_gpu_fp8_page_pool_stays_under_2_31_elements_a_layer(caplog):
    from jaxinfer.engine_config import EngineConfigError, cap_gpu_num_pages

    config = ModelConfig.from_hf(LLAMA_3_1_8B)  # 8 KV heads of 128: 32,768 elements a page of 32 tokens
    limit = memory.max_num_pages(config, 32)
    assert limit == (2**31 - 1) // (8 * 32 * 128) == 65535
    # An FP8 cache of 8B on one H200 holds ~58k pages: under the limit, unchanged.
    assert cap_gpu_num_pages(58219, config, None, 32, explicit=False) == 58219
    with caplog.at_level(logging.WARNING, logger="jaxinfer.engine_config"):
        assert cap_gpu_num_pages(131072, config, None, 32, explicit=False) == limit
    assert any("2**31" in r.getMessage() for r in caplog.records)
    with pytest.raises(EngineConfigError, match="at most 65535 pages") as error:
        cap_gpu_num_pages(131072, config, None, 32, explicit=True)
    assert error.value.field == "num_pages"

@pytest.mark.parametrize("quantization", [None, "fp8", "int8"])
def test_estimate_counts_the_weights_the_engine_loads_and_sizes_the_same_pool(monkeypatch, quantization):
    """The estimate's weight bytes are the loaded model's, quantized or not, so on a device
    that holds those weights the engine's page pool is the estimate's tokens in pages."""
    import jax

    from jaxinfer.checkpoint import load_model
    from jaxinfer.engine_config import EngineConfig

    from .conftest import FIXTURES

    model = load_model(FIXTURES / "tiny-llama3", dtype="float32", quantization=quantization)
    loaded_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.weights))
    estimated = memory.estimate(model.config, bytes_per_element=4, memory_bytes=GIB, request_len=64,
                                memory_utilization=0.9)
    assert estimated.weight_bytes == loaded_bytes
    if quantization:  # 1-byte payloads: well under the float32 model's weights
        dense = memory.weight_bytes(ModelConfig.from_hf(json.loads((FIXTURES / "tiny-llama3" / "config.json")
                                                                   .read_text())), 4)
        assert loaded_bytes < dense
        assert f"{quantization} projections" in str(estimated)
    stats = {"bytes_limit": GIB, "bytes_in_use": loaded_bytes}
    monkeypatch.setattr(memory.jax, "local_devices", lambda: [_FakeDevice("gpu", stats)])
    page_size = 16
    config = EngineConfig(page_size=page_size, memory_utilization=0.9).resolve(model, platform="gpu")
    assert config.num_pages == estimated.num_tokens // page_size


def test_estimate_command_counts_quantized_weights(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    outputs = {}
    for flags in ([], ["--quantization", "fp8"], ["--quantization", "int8"]):
        assert cli.main(["estimate", "--model", str(tmp_path), *flags]) == 0
        outputs[tuple(flags)] = capsys.readouterr().out
    llama = ModelConfig.from_hf(LLAMA_3_1_8B)
    e, v = llama.hidden_size, llama.vocab_size
    bf16 = memory.weight_bytes(llama, 2)
    projections = bf16 // 2 - 2 * v * e - (2 * llama.num_layers + 1) * e  # parameters of q..down
    fp8 = memory.weight_bytes(dataclasses.replace(llama, quantization="fp8"), 2)
    # float32, one per output channel: q, k, v (heads x head_dim), o and down (embed), gate and up (ffn).
    outputs_per_layer = (llama.num_q_heads + 2 * llama.num_kv_heads) * llama.head_dim + 2 * e + 2 * llama.intermediate_size
    scales = llama.num_layers * 4 * outputs_per_layer
    assert fp8 == bf16 - projections + scales
    assert f"weights: {fp8 / GIB:.2f} GiB, fp8 projections" in outputs[("--quantization", "fp8")]
    assert outputs[("--quantization", "fp8")].replace("fp8", "int8") == outputs[("--quantization", "int8")]
    assert f"weights: {bf16 / GIB:.2f} GiB)" in outputs[()]


def test_estimate_command_refuses_another_quantization_than_the_checkpoints(tmp_path, capsys):
    hf = LLAMA_3_1_8B | {"quantization_config": {"quant_method": "jaxinfer", "weights": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert cli.main(["estimate", "--model", str(tmp_path)]) == 0
    assert "fp8 projections" in capsys.readouterr().out  # a quantized checkpoint counts as stored
    assert cli.main(["estimate", "--model", str(tmp_path), "--quantization", "int8"]) == 2
    assert "holds fp8 weights" in capsys.readouterr().err

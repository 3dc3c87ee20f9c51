"""read_gguf on tiny files written the way llama.cpp's converter writes them."""

import math

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants

from jaxinfer import gguf_loader
from jaxinfer.gguf_loader import read_gguf, read_metadata

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 40, 64, 96, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
Q = GGMLQuantizationType


def permute_like_llama_cpp(w, n_head):
    """HF -> GGUF row order for attn_q/attn_k, as convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed=0, tied=True, bias=False, qk_norm=False):
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = rand(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        if bias:
            weights |= {p + f"self_attn.{x}_proj.bias": rand(n * HEAD_DIM)
                        for x, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        if qk_norm:
            weights |= {p + "self_attn.q_norm.weight": rand(HEAD_DIM),
                        p + "self_attn.k_norm.weight": rand(HEAD_DIM)}
    return weights


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf):
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, layer, *module, kind = hf.split(".")
    return f"blk.{layer}.{_TO_GGUF['.'.join(module)]}.{kind}"


def write_gguf(path, weights, qtype=Q.F32, arch="llama", permute=True, extra=None, raw=None):
    """A llama.cpp-style file; `raw` maps names (HF, or GGUF if unknown) to (array, ggml type)
    written as given, in place of a weight."""
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (extra or {}).items():
        getattr(writer, key)(*value)
    raw = raw or {}
    for name, (data, raw_dtype) in raw.items():
        writer.add_tensor(gguf_name(name) if name in weights else name, data, raw_dtype=raw_dtype)
    for name, w in weights.items():
        if name in raw:
            continue
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute_like_llama_cpp(w, HEADS)
        if permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute_like_llama_cpp(w, KV_HEADS)
        # Like llama.cpp: 1-D tensors (norms, biases) stay F32 whatever the file type.
        if w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(gguf_name(name), w)
        else:
            writer.add_tensor(gguf_name(name), quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def roundtrip(w, qtype):
    """What a weight should read back as: quantized then dequantized, row by row."""
    if w.ndim == 1 or qtype == Q.F32:
        return w
    return quants.dequantize(quants.quantize(w, qtype), qtype).astype(np.float32)


def test_config_from_metadata(tmp_path):
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", hf_weights()))
    assert ckpt.architecture == "llama"
    assert ckpt.config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None,
    }
    assert ckpt.metadata["llama.block_count"] == LAYERS


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_tensors_restore_hf_names_shapes_and_row_order(tmp_path, qtype):
    weights = hf_weights(tied=False)
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", weights, qtype))
    assert ckpt.config["tie_word_embeddings"] is False
    assert sorted(ckpt.tensors) == sorted(weights)
    for name, w in weights.items():
        assert ckpt.tensors.shape(name) == w.shape
        got = ckpt.tensors[name]
        assert got.dtype == np.float32 and got.shape == w.shape, name
        # Rows are quantized independently, so un-permuting must give back exactly the
        # round-tripped HF rows; a wrong row order would not.
        np.testing.assert_array_equal(got, roundtrip(w, qtype), err_msg=name)
        tolerance = {Q.F32: 0, Q.F16: 2e-3, Q.Q8_0: 0.03, Q.Q4_0: 0.5, Q.Q4_1: 0.5}[qtype]
        np.testing.assert_allclose(got, w, atol=tolerance * np.abs(w).max(), err_msg=name)


def test_qk_permutation_is_undone_exactly(tmp_path):
    weights = hf_weights()
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", weights))
    for name, heads in (("model.layers.1.self_attn.q_proj.weight", HEADS),
                        ("model.layers.1.self_attn.k_proj.weight", KV_HEADS)):
        assert not np.array_equal(permute_like_llama_cpp(weights[name], heads), weights[name])
        np.testing.assert_array_equal(ckpt.tensors[name], weights[name])


def test_requested_dtype(tmp_path):
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", hf_weights(), Q.Q8_0), dtype=np.float16)
    assert ckpt.tensors["model.layers.0.mlp.up_proj.weight"].dtype == np.float16


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_1])
def test_bf16_tensors_are_dequantized_a_slice_of_rows_at_a_time(tmp_path, monkeypatch, qtype):
    """Slices of one row give the whole tensor's dequantization, rounded once to bf16."""
    monkeypatch.setattr(gguf_loader, "_DEQUANTIZE_SLICE_BYTES", 1)
    weights = hf_weights(tied=False)
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", weights, qtype), dtype=ml_dtypes.bfloat16)
    for name, w in weights.items():
        got = ckpt.tensors[name]
        assert got.dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(got.view(np.uint16), roundtrip(w, qtype).astype(ml_dtypes.bfloat16).view(np.uint16),
                                      err_msg=name)


def test_qwen2_bias_is_read_without_unpermuting(tmp_path):
    weights = hf_weights(bias=True)
    path = write_gguf(tmp_path / "q.gguf", weights, arch="qwen2", permute=False)
    ckpt = read_gguf(path)
    assert ckpt.config["model_type"] == "qwen2" and ckpt.config["attention_bias"] is True
    for name, w in weights.items():
        np.testing.assert_array_equal(ckpt.tensors[name], w, err_msg=name)


def test_qwen3_qk_norm_names(tmp_path):
    weights = hf_weights(qk_norm=True)
    ckpt = read_gguf(write_gguf(tmp_path / "q.gguf", weights, arch="qwen3", permute=False))
    assert ckpt.config["architectures"] == ["Qwen3ForCausalLM"]
    np.testing.assert_array_equal(ckpt.tensors["model.layers.0.self_attn.k_norm.weight"],
                                  weights["model.layers.0.self_attn.k_norm.weight"])


def test_linear_rope_scaling_and_eot(tmp_path):
    extra = {"add_rope_scaling_type": (RopeScalingType.LINEAR,), "add_rope_scaling_factor": (4.0,),
             "add_eot_token_id": (3,)}
    config = read_gguf(write_gguf(tmp_path / "m.gguf", hf_weights(), extra=extra)).config
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["eos_token_id"] == [2, 3]


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    dim, theta = 128, 500000.0
    wavelength = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    freqs = gguf_loader._llama3_freq_factors(scaling, wavelength).astype(np.float32)
    assert gguf_loader._llama3_rope_scaling(freqs, dim, theta) == scaling


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "f.gguf", hf_weights(), arch="falcon", permute=False)
    with pytest.raises(ValueError, match=r"'falcon' is not supported.*llama, qwen2, qwen3"):
        read_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    up = "model.layers.0.mlp.up_proj.weight"
    # Q8_1 is a ggml type (an activation format) that the gguf package cannot dequantize.
    raw = {up: (np.zeros((FFN, HIDDEN // 32 * 40), dtype=np.uint8), Q.Q8_1)}
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", hf_weights(), raw=raw))
    assert ckpt.tensors.ggml_type(up) == "Q8_1"
    assert ckpt.tensors.shape(up) == (FFN, HIDDEN)
    with pytest.raises(NotImplementedError, match=r"Q8_1.*supported types: .*Q4_1.*Q8_0"):
        ckpt.tensors[up]


def test_unknown_tensor_name(tmp_path):
    raw = {"blk.0.attn_qkv.weight": (np.zeros((3 * HIDDEN, HIDDEN), dtype=np.float32), None)}
    with pytest.raises(ValueError, match=r"'blk.0.attn_qkv.weight' has no Hugging Face counterpart"):
        read_gguf(write_gguf(tmp_path / "m.gguf", hf_weights(), raw=raw))


def test_read_metadata_only(tmp_path):
    metadata = read_metadata(write_gguf(tmp_path / "m.gguf", hf_weights()))
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.attention.head_count_kv"] == KV_HEADS

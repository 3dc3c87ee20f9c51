"""Hugging Face ``config.json`` contents of the benchmark shapes (plain dicts: no jax, no torch)."""

# Hugging Face config.json contents of the standard shapes (`../shared/BENCHMARKS.md`).
LLAMA_3_1_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}
LLAMA_3_1_70B = {
    **LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8,
}
QWEN3_0_6B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "attention_bias": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
}
TINY_LLAMA = {  # CPU smoke runs of the benchmark code
    **LLAMA_3_1_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8192,
    "bos_token_id": 1, "eos_token_id": 2,
}
SHAPES = {"llama-3.1-8b": LLAMA_3_1_8B, "llama-3.1-70b": LLAMA_3_1_70B, "qwen3-0.6b": QWEN3_0_6B, "tiny": TINY_LLAMA}

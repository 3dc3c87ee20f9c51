"""Builds the tiny random-weight fixture models in tests/fixtures/<name>/.

Each fixture is a real Hugging Face model directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with the chat template inline)
written by transformers' save_pretrained, with a byte-level BPE tokenizer trained here in the
style of its family. Called by make_golden.py; see there for how to run.
"""

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from golden_inputs import TRAINING_TEXT

# Split patterns copied from the Llama 3 and Qwen2 tokenizer.json files: Llama 3 groups up to
# three digits, Qwen splits every digit.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Qwen2 inserts a default system message; Qwen3 does not, and can close an empty think block.
QWEN2_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Mistral v0.1 style: [INST] is plain text, a system message is folded into the first user turn.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] + '\\n\\n' %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# vocab_size is the trained tokenizer size (special tokens included); config_vocab_size may pad
# past it the way Qwen2 checkpoints do, so one fixture has logits rows no token maps to.
FAMILIES = {
    "tiny-llama3": dict(
        split=LLAMA3_SPLIT, nfc=False, specials_first=[],
        specials_last=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, template=LLAMA3_TEMPLATE,
        vocab_size=512, config_vocab_size=512,
    ),
    "tiny-qwen2": dict(
        split=QWEN_SPLIT, nfc=True, specials_first=[],
        specials_last=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=QWEN2_TEMPLATE,
        vocab_size=500, config_vocab_size=512,
    ),
    "tiny-qwen3": dict(
        split=QWEN_SPLIT, nfc=True, specials_first=[],
        specials_last=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=QWEN3_TEMPLATE,
        vocab_size=512, config_vocab_size=512,
    ),
    "tiny-mistral": dict(
        split=None, nfc=False, specials_first=["<unk>", "<s>", "</s>"], specials_last=[],
        bos="<s>", eos="</s>", pad=None, template=MISTRAL_TEMPLATE,
        vocab_size=512, config_vocab_size=512,
    ),
}


def train_tokenizer(family: dict) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if family["nfc"]:
        tok.normalizer = normalizers.NFC()
    if family["split"] is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(family["split"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    num_trained = family["vocab_size"] - len(family["specials_last"])
    trainer = trainers.BpeTrainer(
        vocab_size=num_trained, min_frequency=1, show_progress=False,
        special_tokens=family["specials_first"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    # Added after training so they take the top ids, as in Llama 3 and Qwen vocabularies.
    tok.add_special_tokens(family["specials_last"])
    assert tok.get_vocab_size() == family["vocab_size"], (tok.get_vocab_size(), family["vocab_size"])
    if family["bos"] is not None:
        bos = family["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_config(name: str, tok: Tokenizer, family: dict):
    ids = lambda t: tok.token_to_id(t)  # noqa: E731
    common = dict(
        vocab_size=family["config_vocab_size"], hidden_size=128, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=256, rms_norm_eps=1e-5,
    )
    if name == "tiny-llama3":
        return LlamaConfig(
            **common, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64),
            tie_word_embeddings=True, bos_token_id=ids("<|begin_of_text|>"),
            eos_token_id=[ids("<|end_of_text|>"), ids("<|eot_id|>")],
        )
    if name == "tiny-qwen2":
        return Qwen2Config(
            **common, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1000000.0,
            tie_word_embeddings=False, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        )
    if name == "tiny-qwen3":
        return Qwen3Config(
            **common, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, rope_theta=1000000.0,
            tie_word_embeddings=True, sliding_window=None, bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
        )
    if name == "tiny-mistral":
        return MistralConfig(
            **common, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=10000.0,
            sliding_window=16, tie_word_embeddings=False, bos_token_id=ids("<s>"), eos_token_id=ids("</s>"),
        )
    raise ValueError(name)


MODEL_CLASSES = {
    "tiny-llama3": LlamaForCausalLM, "tiny-qwen2": Qwen2ForCausalLM,
    "tiny-qwen3": Qwen3ForCausalLM, "tiny-mistral": MistralForCausalLM,
}


def init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrites every parameter from one seeded generator, in name order.

    Norm weights become 1 + noise and biases are non-zero, so a loader that drops either
    gives visibly different logits.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)


def legacy_rope_fields(config_path: Path) -> None:
    """Rewrites rope_parameters as top-level rope_theta (+ rope_scaling), as hub Llama 3 and
    Mistral checkpoints spell it; transformers 5 reads both spellings."""
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    config_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def build_fixture(name: str, out_dir: Path, seed: int, std: float = 0.2) -> None:
    family = FAMILIES[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()
    tok = train_tokenizer(family)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=family["bos"], eos_token=family["eos"], pad_token=family["pad"],
        unk_token="<unk>" if "<unk>" in family["specials_first"] else None, chat_template=family["template"],
    )
    hf_tok.save_pretrained(out_dir, save_jinja_files=False)

    config = make_config(name, tok, family)
    model = MODEL_CLASSES[name](config).to(torch.float32)
    # std 0.2 at hidden 128: logits spread ~2 wide and greedy runs rarely loop on one token.
    init_weights(model, seed, std)
    if name.startswith("tiny-qwen"):
        # Qwen instruct checkpoints stop on either <|im_end|> or <|endoftext|>.
        model.generation_config.eos_token_id = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    model.save_pretrained(out_dir)
    if name in ("tiny-llama3", "tiny-mistral"):
        legacy_rope_fields(out_dir / "config.json")

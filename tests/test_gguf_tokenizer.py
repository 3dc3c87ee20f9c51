"""tokenizer_from_gguf against the tokenizer the GGUF metadata was written from."""

import json
import pathlib

import pytest
from gguf import GGUFWriter
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from jaxinfer.gguf_loader import read_metadata
from jaxinfer.gguf_tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT, tokenizer_from_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<filename>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024; they've paid $1,234.56 for 3 items!",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\ttabs   and   spaces",
    "naïve café résumé — 日本語のテキスト 😀 emoji, Ελληνικά, русский текст",
    "Numbers: 0 1 22 333 4444 55555 3.14159 1e-5 0xFF. URLs: https://example.com/a?b=c",
] * 20
TEXTS = [
    "Hello, world! It's a test.",
    "The year 2024 has 365 days; pi = 3.14159 and 1234567890.",
    "  leading spaces, multiple   spaces, trailing  ",
    "line one\nline two\n\n\nthree newlines\r\nwindows\ttab",
    "unicode: naïve café 日本語 😀 ñ ü ß Ελληνικά русский",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<filename>main.py\ndef f(x):\n    return x**2  # ok<|endoftext|>",
    "",
    " ",
    "I'm sure they'll say we've done it; you'd agree? He's RIGHT'S.",
]

# tokenizer.ggml.pre -> the pre-tokenizer of the original tokenizer.json it was detected from.
ORIGINAL_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]),
    "llama-bpe": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "qwen2": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}


def train_original(pre: str) -> Tokenizer:
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = ORIGINAL_PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    if pre == "llama-bpe":  # Llama 3's tokenizer.json takes whole in-vocabulary chunks
        spec = json.loads(tokenizer.to_str())
        spec["model"]["ignore_merges"] = True
        tokenizer = Tokenizer.from_str(json.dumps(spec))
    return tokenizer


def write_tokenizer_gguf(path, original: Tokenizer, pre: str, add_bos=False, template=None):
    """The tokenizer keys llama.cpp's converter writes for a byte-level BPE vocabulary."""
    vocab = original.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(pair) for pair in json.loads(original.to_str())["model"]["merges"]]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_unk_token_id(vocab["<|endoftext|>"])
    writer.add_pad_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(add_bos)
    if template:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", sorted(ORIGINAL_PRE_TOKENIZERS))
def test_byte_level_bpe_matches_original(tmp_path, pre):
    original = train_original(pre)
    metadata = read_metadata(write_tokenizer_gguf(tmp_path / "t.gguf", original, pre))
    rebuilt, info = tokenizer_from_gguf(metadata, reference="original")
    for text in TEXTS + CORPUS[:4]:
        expected = original.encode(text).ids
        got = rebuilt.encode(text).ids
        assert got == expected, (pre, text)
        assert rebuilt.decode(got, skip_special_tokens=False) == text
    assert info["pre_tokenizer"] == pre


def test_transformers_reference_splits_smollm_like_gpt2(tmp_path):
    # transformers builds a plain GPT-2 ByteLevel for "smollm" files: a run of spaces before a
    # digit is cut " " + " 1" there, "  " + "1" by the original Digits pre-tokenizer.
    original = train_original("smollm")
    metadata = read_metadata(write_tokenizer_gguf(tmp_path / "t.gguf", original, "smollm"))
    as_transformers, info = tokenizer_from_gguf(metadata)
    as_original, _ = tokenizer_from_gguf(metadata, reference="original")
    gpt2_split = Tokenizer.from_str(original.to_str())
    gpt2_split.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert info["reference"] == "transformers" and info["pre_tokenizer_split"] == "gpt2"
    for text in TEXTS + ["a  1", "x   22  3"]:
        assert as_transformers.encode(text).ids == gpt2_split.encode(text).ids, text
        assert as_original.encode(text).ids == original.encode(text).ids, text
    assert as_transformers.pre_tokenizer.pre_tokenize_str("a  1") != as_original.pre_tokenizer.pre_tokenize_str("a  1")


def test_special_tokens_are_single_ids_and_info(tmp_path):
    original = train_original("smollm")
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    path = write_tokenizer_gguf(tmp_path / "t.gguf", original, "smollm", template=template)
    tokenizer, info = tokenizer_from_gguf(read_metadata(path))
    vocab = original.get_vocab()
    ids = tokenizer.encode("<|im_start|>x<|im_end|>").ids
    assert ids[0] == vocab["<|im_start|>"] and ids[-1] == vocab["<|im_end|>"]
    assert info | {"chat_template": None} == {
        "tokenizer_model": "gpt2", "pre_tokenizer": "smollm", "pre_tokenizer_split": "gpt2",
        "reference": "transformers",
        "add_bos_token": False, "add_eos_token": False, "chat_template": None,
        "bos_token_id": vocab["<|im_start|>"], "bos_token": "<|im_start|>",
        "eos_token_id": vocab["<|im_end|>"], "eos_token": "<|im_end|>",
        "pad_token_id": vocab["<|im_end|>"], "pad_token": "<|im_end|>",
        "unk_token_id": vocab["<|endoftext|>"], "unk_token": "<|endoftext|>",
        "stop_token_ids": [vocab["<|im_end|>"]],
    }
    assert info["chat_template"] == template
    assert tokenizer.decode(ids, skip_special_tokens=True) == "x"


def test_add_bos_token_is_applied_by_post_processor(tmp_path):
    original = train_original("default")
    path = write_tokenizer_gguf(tmp_path / "t.gguf", original, "default", add_bos=True)
    tokenizer, info = tokenizer_from_gguf(read_metadata(path))
    bos = original.token_to_id("<|im_start|>")
    assert info["add_bos_token"] is True
    assert tokenizer.encode("hi there").ids == [bos] + original.encode("hi there").ids
    assert tokenizer.encode("hi there", add_special_tokens=False).ids == original.encode("hi there").ids


@pytest.mark.parametrize("pre, reference, expected", [
    ("llama-bpe", "original", ["abc"]), ("llama-bpe", "transformers", ["a", "bc"]),
    ("default", "original", ["a", "bc"]),
])
def test_llama3_takes_in_vocabulary_words_whole(pre, reference, expected):
    # "abc" is in the vocabulary but no merge sequence builds it: Llama 3's tokenizer (llama.cpp's
    # and tokenizer.json's ignore_merges) still emits it whole, GPT-2's does not.
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "bc", "abc"],
                "tokenizer.ggml.merges": ["b c", "a b"]}
    tokenizer, _ = tokenizer_from_gguf(metadata, reference=reference)
    assert tokenizer.encode("abc").tokens == expected


def test_unknown_pre_tokenizer_falls_back_with_warning(tmp_path):
    original = train_original("default")
    metadata = read_metadata(write_tokenizer_gguf(tmp_path / "t.gguf", original, "default"))
    with pytest.warns(UserWarning, match="'made-up'"):
        tokenizer, info = tokenizer_from_gguf(metadata | {"tokenizer.ggml.pre": "made-up"})
    assert info["pre_tokenizer_split"] == "gpt2"
    assert tokenizer.encode("plain words").ids == original.encode("plain words").ids


def test_sentencepiece_vocabulary():
    # A Llama-2-shaped vocabulary: <unk>, <s>, </s>, byte pieces, then scored pieces.
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w",
              "or", "▁wor", "ld", "▁world"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_pieces + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    # Longer pieces score higher in a trained model; give the merged words the best scores.
    for word, score in (("▁hello", 10.0), ("▁world", 9.0), ("hello", 8.0), ("▁wor", 7.0)):
        scores[tokens.index(word)] = score
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.unknown_token_id": 0}
    tokenizer, info = tokenizer_from_gguf(metadata)
    assert info["add_bos_token"] is True and info["bos_token"] == "<s>"
    encoding = tokenizer.encode("hello world")
    assert encoding.tokens == ["<s>", "▁hello", "▁world"]
    # A character outside the vocabulary falls back to its UTF-8 bytes.
    assert tokenizer.encode("hello é", add_special_tokens=False).tokens == [
        "▁hello", "▁", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(tokenizer.encode("hello é world").ids, skip_special_tokens=True) == "hello é world"
    assert tokenizer.encode("</s>", add_special_tokens=False).ids == [2]
    # After a special token: transformers starts the text without "▁", Llama 2's original adds one.
    assert tokenizer.encode("</s>hello", add_special_tokens=False).tokens[1] == "hello"
    legacy, _ = tokenizer_from_gguf(metadata, reference="original")
    assert legacy.encode("</s>hello", add_special_tokens=False).tokens == ["</s>", "▁hello"]
    assert legacy.encode("hello world").tokens == ["<s>", "▁hello", "▁world"]


def test_unsupported_tokenizer_model():
    with pytest.raises(ValueError, match=r"'t5' is not supported.*'gpt2'.*'llama'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


GOLDEN = pathlib.Path(__file__).parent / "golden" / "smollm2-135m-instruct.json"


@pytest.mark.slow
def test_default_model_matches_transformers_golden():
    """Ids transformers gives for the real default model (tests/golden/make_golden.py)."""
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN} not present")
    from jaxinfer.model_registry import resolve_model

    golden = json.loads(GOLDEN.read_text())
    tokenizer, info = tokenizer_from_gguf(read_metadata(resolve_model("smollm2-135m-instruct")))
    for prompt in golden["prompts"]:
        assert tokenizer.encode(prompt["text"]).ids == prompt["ids"], prompt["text"]
    for chat in golden["chats"]:
        assert tokenizer.encode(chat["text"], add_special_tokens=False).ids == chat["ids"], chat["text"]
        assert tokenizer.encode(chat["text"]).ids == chat["ids_with_default_special_tokens"]
    expected = golden["tokenizer"]
    for role in ("bos", "eos", "pad", "unk"):
        assert info[f"{role}_token"] == expected[f"{role}_token"], role
    assert info["chat_template"] == golden["chat_template"]

"""Building a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`),
the token kinds (`token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte), and either
BPE merges (`tokenizer.ggml.model` = "gpt2", byte-level: GPT-2, Llama 3, SmolLM, Qwen) or
sentencepiece scores ("llama": Llama 2, Mistral v0.1-0.3). This module rebuilds the tokenizer the
file was converted from:

- "gpt2": a byte-level BPE whose pre-tokenizer regex is chosen by `tokenizer.ggml.pre`, the name
  llama.cpp gives the pre-tokenizer it detected. The regex decides which chunks BPE may merge
  within, so the wrong one silently changes ids.
- "llama": sentencepiece BPE emulated by a `tokenizers` BPE with byte fallback, its merges ranked
  by the score of the merged piece (what sentencepiece's BPE maximises).

Control tokens become special added tokens, so "<|im_start|>" in text maps to its single id.

Two references disagree on a few details, so `reference` picks one:
- "transformers" (default): what transformers (5.x) builds from the same file, the reference the
  golden tests use. Files whose `pre` llama.cpp splits like GPT-2 plus single digits ("smollm")
  get plain GPT-2 splitting; Llama 3 vocabularies always apply merges; sentencepiece text gets one
  "▁" at the very start only.
- "original": the tokenizer.json the model was published with, which is also what llama.cpp does:
  digits split one by one for "smollm"; Llama 3 takes in-vocabulary chunks whole
  (ignore_merges); sentencepiece text gets a "▁" after every special token too (Llama 2's legacy).
On SmolLM2 the two differ only where a run of spaces precedes a digit ("a  1").
"""

import warnings
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's differs from Llama 3's only in taking digits one at a time.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> how text is cut before byte-level BPE. "gpt2" is ByteLevel's built-in
# regex; "gpt2+digits" puts each digit in its own chunk first (SmolLM's and StarCoder's
# tokenizer.json: Digits(individual_digits) then ByteLevel), which transformers does not do.
_PRE_TOKENIZER_KINDS = {
    **dict.fromkeys(["default", "gpt-2", "gpt2", "olmo", "jais"], "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"], "gpt2+digits"),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "falcon-h1",
                    "pixtral"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], "qwen2"),
    "tekken": "tekken",
}
_SPLIT_REGEX = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT}


REFERENCES = ("transformers", "original")


def tokenizer_from_gguf(
    metadata: dict[str, Any], reference: str = "transformers"
) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer described by GGUF metadata (as in `GGUFCheckpoint.metadata`), plus its facts.

    `reference` is "transformers" (ids identical to transformers' GGUF loading) or "original"
    (the model's published tokenizer.json, as llama.cpp tokenizes); see the module docstring.

    The info dict holds bos/eos/pad/unk token ids and strings, `stop_token_ids` (eos, eot, eom),
    `add_bos_token`, `add_eos_token`, `chat_template`, `tokenizer_model` and `pre_tokenizer`.
    When the file asks for BOS/EOS, the returned tokenizer's post-processor adds them, as
    transformers' does: `encode(text)` adds them, `encode(text, add_special_tokens=False)` does not.
    """
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, not {reference!r}")
    original = reference == "original"
    model = metadata.get("tokenizer.ggml.model")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if model == "gpt2":
        tokenizer, pre_kind = _byte_level_bpe(metadata, tokens, token_types, original)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens, token_types, original)
        pre_kind = "sentencepiece-legacy" if original else "sentencepiece"
    else:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE) "
            f"and 'llama' (sentencepiece BPE)."
        )
    info = _info(metadata, tokens, model, pre_kind) | {"reference": reference}
    post_processor = _post_processor(info, byte_level=model == "gpt2")
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer, info


def _byte_level_bpe(metadata, tokens, token_types, original) -> tuple[Tokenizer, str]:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp writes vocabulary entries in GPT-2's byte-level spelling, except tokens added to
    # the vocabulary by hand, which it writes as raw text: respell those so merges can find them.
    vocab = {}
    for i, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = [_merge_pair(m) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    kind = _PRE_TOKENIZER_KINDS.get(pre)
    if kind is None:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is unknown to jaxinfer; using GPT-2's regex, "
                      "so token ids may differ from the original tokenizer's.")
        kind = "gpt2"
    if kind == "gpt2+digits" and not original:
        kind = "gpt2"
    tokenizer = Tokenizer(BPE(
        vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
        # Llama 3's tokenizer.json (and llama.cpp) take a chunk whole when the vocabulary has it,
        # before trying merges.
        ignore_merges=original and kind == "llama3",
    ))
    # Byte-level vocabularies spell a leading space as part of the token ("Ġword"); neither
    # reference adds one, whatever tokenizer.ggml.add_space_prefix says.
    add_prefix_space = False
    if kind == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    elif kind == "gpt2+digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[kind]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    # A hand-added token whose text had to be respelled is an ordinary byte sequence to BPE;
    # registering its raw text would mint a second id for it.
    _add_tokens(metadata, tokens, token_types, tokenizer, usable=lambda t: set(t) <= alphabet)
    return tokenizer, kind


def _sentencepiece_bpe(metadata, tokens, token_types, original) -> Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    vocab = {token: i for i, token in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [_merge_pair(m) for m in metadata["tokenizer.ggml.merges"]]
    elif scores is None:
        raise ValueError("GGUF 'llama' tokenizer has neither merges nor scores to rank merges by.")
    else:
        merges = _merges_from_scores(vocab, scores)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(BPE(
        vocab, merges, unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True, byte_fallback=True,
    ))
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    if original:
        # Llama 2's and Mistral's published tokenizer.json ("legacy"), also llama.cpp's behaviour:
        # a "▁" before each stretch of text, including right after a special token.
        steps = [normalizers.Prepend("▁")] if add_prefix_space else []
        tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False)
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix_space else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()] + strip
    )
    _add_tokens(metadata, tokens, token_types, tokenizer, usable=lambda t: True)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores) -> list[tuple[str, str]]:
    """Sentencepiece BPE merges the best-scoring piece first: every split of a piece into two
    vocabulary pieces becomes a merge ranked by the piece's score (ties: longer left, then longer
    right piece first, then vocabulary order), the order transformers derives."""
    candidates = []
    for piece, piece_id in vocab.items():
        splits = [(vocab[piece[:cut]], vocab[piece[cut:]], piece[:cut], piece[cut:])
                  for cut in range(1, len(piece)) if piece[:cut] in vocab and piece[cut:] in vocab]
        candidates += [(scores[piece_id], left, right) for *_, left, right in sorted(splits)]
    # One stable descending sort on the whole key, as transformers does.
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(left, right) for _, left, right in candidates]


def _add_tokens(metadata, tokens, token_types, tokenizer, usable) -> None:
    # The tokens named bos/eos/unk/pad are special whatever their kind, as in transformers.
    named = {metadata.get(f"tokenizer.ggml.{k}_token_id")
             for k in ("bos", "eos", "unknown", "padding")}
    special = [AddedToken(t, normalized=False, special=True)
               for i, (t, kind) in enumerate(zip(tokens, token_types))
               if (kind in (_CONTROL, _UNKNOWN) or i in named) and usable(t)]
    added = [AddedToken(t, normalized=False, special=False)
             for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and usable(t)]
    if special:
        tokenizer.add_special_tokens(special)
    if added:
        tokenizer.add_tokens(added)


def _info(metadata, tokens, model, pre_kind) -> dict[str, Any]:
    def token_id(name):
        return metadata.get(f"tokenizer.ggml.{name}_token_id")

    def text(i):
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    # llama.cpp's defaults when the file is silent: sentencepiece vocabularies take a BOS.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", model == "llama")
    info = {
        "tokenizer_model": model,
        "pre_tokenizer": metadata.get("tokenizer.ggml.pre"),
        "pre_tokenizer_split": pre_kind,
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        info[f"{role}_token_id"] = token_id(key)
        info[f"{role}_token"] = text(token_id(key))
    stop = [token_id(k) for k in ("eos", "eot", "eom")]
    info["stop_token_ids"] = sorted({i for i in stop if i is not None})
    return info


def _post_processor(info, byte_level: bool):
    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if info["add_bos_token"] or info["add_eos_token"]:
        bos = [info["bos_token"]] if info["add_bos_token"] and info["bos_token"] else []
        eos = [info["eos_token"]] if info["add_eos_token"] and info["eos_token"] else []
        ids = {info["bos_token"]: info["bos_token_id"], info["eos_token"]: info["eos_token_id"]}
        steps.append(processors.TemplateProcessing(
            single=bos + ["$A"] + eos,
            pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
            special_tokens=[(t, ids[t]) for t in dict.fromkeys(bos + eos)],
        ))
    return processors.Sequence(steps) if steps else None


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ValueError(f"malformed GGUF merge {merge!r}: expected two tokens separated by a space")
    return left, right


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the rest are shifted past U+00FF in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table

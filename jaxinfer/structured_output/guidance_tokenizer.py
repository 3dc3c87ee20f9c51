"""The engine's tokenizer as llguidance sees it.

llguidance builds its token trie from a Hugging Face ``tokenizers`` JSON: jaxinfer's
``Tokenizer`` holds such an object whether it came from ``tokenizer.json`` or was built from
GGUF metadata (``jaxinfer.gguf_tokenizer``), so both work the same way. The model's vocabulary
may be larger than the tokenizer's (embedding rows padded to a multiple of 64 or 128, or a
benchmark's random weights over a borrowed tokenizer): llguidance is told the model's size, and
ids past the tokenizer's own never appear in a mask (``bitmask.py`` clears them again).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from jaxinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance


def guidance_tokenizer(tokenizer: Tokenizer, model_vocab_size: int, eos_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` over ``model_vocab_size`` ids whose end-of-sequence tokens are ``eos_ids``.

    Costs ~0.2 s for a 49k vocabulary (the trie), so the compiler builds it once, on first use.
    """
    import llguidance

    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                         f"vocab_size {model_vocab_size}")
    eos = sorted(i for i in set(eos_ids) if i < tokenizer.vocab_size)
    if not eos:
        raise ValueError("structured output needs an end-of-sequence token id in the tokenizer's vocabulary")
    return llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=model_vocab_size, eos_token=eos)

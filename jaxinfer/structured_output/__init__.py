"""Structured output: grammar-constrained sampling with llguidance (docs/STRUCTURED_OUTPUT.md).

- ``grammar.py``: a ``StructuredOutputsParams`` becomes an llguidance grammar; unsupported
  schema keywords become a ``RequestError`` when the request is added.
- ``guidance_tokenizer.py``: the engine's tokenizer (HF ``tokenizers``, GGUF-built included)
  as an ``llguidance.LLTokenizer`` over the model's vocabulary.
- ``compiler.py``: compiles grammars on a thread pool, cached per constraint.
- ``matchers.py``: one matcher per constrained sequence; fills a step's packed bitmask.
- ``bitmask.py``: the packed layout, and its application on the device (shifts, -inf).
"""

from jaxinfer.structured_output.bitmask import allocate_bitmask, allowed_tokens, apply_token_bitmask, bitmask_width
from jaxinfer.structured_output.compiler import GrammarCompileError, GrammarCompiler
from jaxinfer.structured_output.grammar import check_grammar, grammar_key, grammar_text
from jaxinfer.structured_output.guidance_tokenizer import guidance_tokenizer
from jaxinfer.structured_output.matchers import GrammarMatchers

__all__ = [
    "GrammarCompileError", "GrammarCompiler", "GrammarMatchers", "allocate_bitmask", "allowed_tokens",
    "apply_token_bitmask", "bitmask_width", "check_grammar", "grammar_key", "grammar_text", "guidance_tokenizer",
]

"""From a request's ``StructuredOutputsParams`` to an llguidance grammar, checked.

llguidance takes one grammar format (its Lark dialect, or a JSON envelope for JSON schemas);
each kind of constraint maps to it here. :func:`check_grammar` is cheap (a fraction of a
millisecond for typical schemas: no tokenizer involved), so the engine runs it when a request
is added and a schema llguidance cannot enforce becomes a ``RequestError`` naming the keyword
(a 400 from the server) instead of a request that fails later. The token-level work (the
matcher, its lexer) happens on the compiler's threads (``compiler.py``).
"""

from __future__ import annotations

import json
import re

from jaxinfer.errors import RequestError
from jaxinfer.sampling_params import StructuredOutputsParams

# OpenAI's response_format {"type": "json_object"}: any JSON object.
_ANY_JSON_OBJECT = {"type": "object"}
# JSON is laid out as Python's json.dumps does ({"a": 1, "b": [1, 2]}): with flexible
# whitespace (llguidance's default) a sampled model may emit newlines and indentation until
# max_tokens cuts it, an invalid output. A schema's own "x-guidance" options override these.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance reports unsupported schema keywords as 'Unimplemented keys: ["if", "then"]'.
_UNIMPLEMENTED = re.compile(r'Unimplemented keys?: \[([^\]]*)\]')


def grammar_key(constraint: StructuredOutputsParams) -> str:
    """A string that is equal for equal constraints: the compiler's cache key."""
    kind = constraint.kinds()[0]
    value = {"json": constraint.json, "regex": constraint.regex, "choice": constraint.choice,
             "grammar": constraint.grammar, "json_object": True}[kind]
    if kind == "json" and isinstance(value, str):
        value = _parse_json_schema(value)
    return kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))


def grammar_text(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar enforcing ``constraint`` (not yet checked: see :func:`check_grammar`)."""
    # llguidance is imported on first use: an engine that never sees a grammar never loads it
    # (and runs where it is not installed, as in the GPU machine's bare environment).
    import llguidance

    kind = constraint.kinds()[0]
    if kind == "json":
        schema = constraint.json if isinstance(constraint.json, dict) else _parse_json_schema(constraint.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, defaults=_JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        # One alternative per choice, each a literal: a regex alternation of the escaped strings.
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in constraint.choice))
    return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)


def check_grammar(constraint: StructuredOutputsParams) -> str:
    """The grammar of ``constraint``, or a ``RequestError`` naming what llguidance cannot enforce."""
    kind = constraint.kinds()[0]
    field = f"structured_outputs.{kind}"
    import llguidance

    try:
        grammar = grammar_text(constraint)
    except ValueError as e:  # a schema that is not a JSON object
        raise RequestError(f"{field} is not a valid JSON schema: {e}", field=field) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        message = messages[0] if messages else "invalid grammar"
        unsupported = _UNIMPLEMENTED.search(message)
        if unsupported:
            keys = [k.strip().strip('"') for k in unsupported.group(1).split(",") if k.strip()]
            raise RequestError(
                f"{field} uses JSON schema keyword(s) {', '.join(repr(k) for k in keys)} that structured "
                f"output does not support", field=field, limit=keys[0] if keys else None,
            )
        raise RequestError(f"{field} cannot be enforced: {message}", field=field)
    return grammar


def _parse_json_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"structured_outputs.json is not valid JSON: {e}", field="structured_outputs.json") from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError("structured_outputs.json must be a JSON schema object", field="structured_outputs.json")
    return schema

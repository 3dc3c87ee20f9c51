"""Request validation: OpenAI (and vLLM-extension) JSON bodies -> prompts + SamplingParams.

Everything a client can get wrong is caught here and becomes a 400 naming the field and the
limit; the engine only sees requests that can run. Unknown fields are ignored, as OpenAI's
and vLLM's servers do, so newer clients keep working.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from jaxinfer.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, StructuredOutputsParams
from jaxinfer.server.errors import APIError, bad_request
from jaxinfer.server.structured_requests import constraint_fields, structured_outputs
from jaxinfer.server.tool_requests import (ToolRequest, choose_parser, message_tool_fields, parse_tool_request,
                                           template_inputs)
from jaxinfer.tokenizer import ChatTemplateError

MAX_N = 64
MAX_PROMPTS = 64  # prompts in one /v1/completions call
MAX_STOP = 16
MAX_BAD_WORDS = 128
CHAT_ROLES = {"system", "user", "assistant", "developer", "tool"}


@dataclasses.dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # None when the client sent token ids


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per prompt (max_tokens may differ)
    stream: bool
    include_usage: bool
    echo: bool = False
    top_logprobs: int | None = None  # chat: how many alternatives to report
    # Completions with echo and max_tokens 0: score the prompt, generate nothing (the engine loop
    # answers at once; params carry max_tokens 1 only because SamplingParams requires >= 1).
    score_only: bool = False
    prompt_logprobs: int | None = None  # completions: vLLM's prompt_logprobs field, returned per choice
    tools: ToolRequest | None = None  # chat with tools offered (not "none"): outputs are parsed for calls


_MISSING = object()
# JSON's escape of a UTF-16 surrogate, the only way a body can smuggle one into a Python str.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_body(data: bytes) -> dict:
    """The request body as a JSON object; 400 for anything else."""
    try:
        body = json.loads(data or b"null")
    except (ValueError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    # JSON may escape a lone UTF-16 surrogate ("\ud800"); Python keeps it in the str, where the
    # tokenizer and the UTF-8 response writer fail on it (a 500). Only bodies with such an
    # escape are walked.
    if _SURROGATE_ESCAPE.search(data) and _has_lone_surrogate(body):
        raise bad_request("the request body is not valid JSON: a string holds a lone UTF-16 surrogate")
    return body


def _has_lone_surrogate(value) -> bool:
    """Whether a string anywhere in ``value`` (keys included) is not encodable as UTF-8."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return False


def field(body: dict, name: str, kind: str, default: Any = None, *, nullable: bool = True) -> Any:
    """The value of ``name`` checked against ``kind`` ("int", "number", "bool", "str")."""
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and nullable):
        return default
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool) and _is_finite(value),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        names = {"int": "an integer", "number": "a finite number", "bool": "a boolean", "str": "a string"}
        raise bad_request(f"'{name}' must be {names[kind]}, got {type(value).__name__}", param=name)
    return value


def _is_finite(value: float) -> bool:
    # math.isfinite(10**400) raises OverflowError (a 500); such an integer also cannot reach the
    # engine's float32 arrays, so it is "not a finite number" here.
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_model(body: dict, served_model_name: str) -> str:
    model = field(body, "model", "str", served_model_name)
    if model != served_model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served_model_name}'.",
                       param="model", code="model_not_found")
    return model


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return bool(field(options, "include_usage", "bool", False))


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP:
        raise bad_request(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise bad_request("'stop' strings must not be empty", param="stop")
    return stop


def token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"'{name}' must be a list of token ids", param=name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"'{name}' holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})", param=name)
    return value


def _common_params(body: dict, vocab_size: int) -> dict:
    """The SamplingParams fields shared by completions and chat (all but max_tokens/logprobs)."""
    n = field(body, "n", "int", 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be between 1 and {MAX_N}, got {n}", param="n")
    best_of = field(body, "best_of", "int", None)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' is not supported (only best_of == n)", param="best_of")
    stop_token_ids = body.get("stop_token_ids")
    return dict(
        n=n,
        temperature=field(body, "temperature", "number", 1.0),
        top_p=field(body, "top_p", "number", 1.0),
        top_k=_top_k(body, vocab_size),
        min_p=field(body, "min_p", "number", 0.0),
        presence_penalty=field(body, "presence_penalty", "number", 0.0),
        frequency_penalty=field(body, "frequency_penalty", "number", 0.0),
        repetition_penalty=field(body, "repetition_penalty", "number", 1.0),
        seed=_seed(body),
        stop=_stop(body),
        stop_token_ids=None if stop_token_ids is None else token_ids(stop_token_ids, "stop_token_ids", vocab_size),
        ignore_eos=field(body, "ignore_eos", "bool", False),
        min_tokens=field(body, "min_tokens", "int", 0),
        skip_special_tokens=field(body, "skip_special_tokens", "bool", True),
        include_stop_str_in_output=field(body, "include_stop_str_in_output", "bool", False),
        logit_bias=_logit_bias(body, vocab_size),
        bad_words=_bad_words(body),
        structured_outputs=structured_outputs(body),
    )


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token id (a JSON key, so a string) -> bias; ids in the vocabulary.
    The bias range is SamplingParams' to check."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    out = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) else (int(key) if isinstance(key, str) and key.isdigit() else None)
        if token is None or not 0 <= token < vocab_size:
            raise bad_request(f"'logit_bias' key {key!r} is not a token id in [0, {vocab_size})"[:200],
                              param="logit_bias")
        out[token] = value
    return out or None


def _bad_words(body: dict) -> list[str] | None:
    words = body.get("bad_words")
    if words is None:
        return None
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise bad_request("'bad_words' must be a list of non-empty strings", param="bad_words")
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"'bad_words' may hold at most {MAX_BAD_WORDS} strings, got {len(words)}", param="bad_words")
    return words or None


def _seed(body: dict) -> int | None:
    seed = field(body, "seed", "int", None)
    if seed is None:
        return None
    # OpenAI and vLLM take any 64-bit signed seed; the engine takes [0, 2**63): a negative seed
    # (-1 is common) maps to its two's-complement low 63 bits instead of being refused.
    if not -2**63 <= seed < 2**63:
        raise bad_request(f"'seed' must be a 64-bit integer, got {seed}"[:200], param="seed")
    return seed % 2**63


def _top_k(body: dict, vocab_size: int) -> int:
    top_k = field(body, "top_k", "int", 0)
    # A top_k at or past the vocabulary keeps every token, which is what top-k off (0) does; the
    # engine packs top_k into int32, so a huge one (2**31) would fail the whole engine step.
    # vLLM accepts such values too (it clamps to the vocabulary).
    return 0 if top_k >= vocab_size else top_k


def _max_tokens(body: dict, default: int | None, allow_zero: bool = False) -> int | None:
    value = field(body, "max_completion_tokens", "int", None)
    name = "max_completion_tokens"
    if value is None:
        value, name = field(body, "max_tokens", "int", default), "max_tokens"
    if value is not None and value < (0 if allow_zero else 1):
        hint = "" if allow_zero or value != 0 else " (0 only with 'echo': true, to score the prompt)"
        raise bad_request(f"'{name}' must be >= {0 if allow_zero else 1}{hint}, got {value}", param=name)
    return value


def _fit_context(num_prompt: int, max_tokens: int | None, max_model_len: int, where: str) -> int:
    """The max_tokens that will run; 400 with vLLM's wording when prompt + max_tokens do not fit."""
    if num_prompt >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input {where}.",
            param="messages" if where == "messages" else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the {where}, {max_tokens} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param="max_tokens", code="context_length_exceeded")
    return max_tokens


def _sampling_params(fields: dict) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValueError as e:  # SamplingParams names the field first
        message = str(e)
        raise bad_request(message, param=message.split(" ", 1)[0]) from None


def _prompts(body: dict, tokenizer, add_special_tokens: bool) -> list[Prompt]:
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad_request("'prompt' is required", param="prompt")
    vocab = tokenizer.vocab_size
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad_request("'prompt' must be a non-empty string, list of strings, or list of token ids", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(items)}", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("'prompt' must not be empty", param="prompt")
            prompts.append(Prompt(tokenizer.encode(item, add_special_tokens=add_special_tokens), item))
        elif isinstance(item, list) and item:
            prompts.append(Prompt(list(token_ids(item, "prompt", vocab)), None))
        else:
            raise bad_request("each prompt must be a non-empty string or a non-empty list of token ids", param="prompt")
    return prompts


def parse_completion(body: dict, tokenizer, max_model_len: int, served_model_name: str) -> ParsedRequest:
    model = check_model(body, served_model_name)
    stream = field(body, "stream", "bool", False)
    include_usage = _stream_options(body, stream)
    echo = field(body, "echo", "bool", False)
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported", param="suffix")
    logprobs = field(body, "logprobs", "int", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}", param="logprobs")
    vllm_prompt_logprobs = field(body, "prompt_logprobs", "int", None)
    if vllm_prompt_logprobs is not None and not 0 <= vllm_prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'prompt_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {vllm_prompt_logprobs}",
                          param="prompt_logprobs")
    # OpenAI's legacy echo + logprobs reports the prompt's tokens too; one scoring pass serves it
    # and vLLM's prompt_logprobs field, at the larger of the two top-k (each response slices its own).
    wanted = [k for k in (logprobs if echo else None, vllm_prompt_logprobs) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    common = _common_params(body, tokenizer.vocab_size)
    # max_tokens 0 is prompt scoring (OpenAI's legacy API, lm-eval's loglikelihood): only with echo.
    max_tokens = _max_tokens(body, 16, allow_zero=echo)
    score_only = max_tokens == 0
    if score_only and common["min_tokens"] > 0:
        raise bad_request("'min_tokens' must be 0 when 'max_tokens' is 0", param="min_tokens")
    prompts = _prompts(body, tokenizer, field(body, "add_special_tokens", "bool", True))
    params = []
    for p in prompts:
        if score_only:
            _fit_scored_prompt(len(p.token_ids), max_model_len)
            run_max_tokens = 1  # never generated: see ParsedRequest.score_only
        else:
            run_max_tokens = _fit_context(len(p.token_ids), max_tokens, max_model_len, "prompt")
        params.append(_sampling_params(dict(common, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                            max_tokens=run_max_tokens)))
    return ParsedRequest("completion", model, prompts, params, stream, include_usage, echo=echo,
                         score_only=score_only, prompt_logprobs=vllm_prompt_logprobs)


def _fit_scored_prompt(num_prompt: int, max_model_len: int) -> None:
    """A prompt only scored (max_tokens 0) may fill the whole context; past it, vLLM's wording."""
    if num_prompt > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input prompt.",
            param="prompt", code="context_length_exceeded")


def _message_content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        if message.get("role") == "assistant":
            return ""
        raise bad_request(f"messages[{i}].content is required", param=f"messages[{i}].content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                                  param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}"[:300],
                              param=f"messages[{i}].role")
        # "developer" is OpenAI's newer name for "system"; checkpoint templates know "system".
        out.append({"role": "system" if role == "developer" else role, "content": _message_content(m, i),
                    **message_tool_fields(m, i)})
    return out


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tool_request: ToolRequest | None = None) -> list[int]:
    """The prompt's token ids: ``messages`` (and the offered tools) through the model's template."""
    messages, extra = template_inputs(tokenizer.chat_template, messages, tool_request)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError as e:
        raise bad_request(str(e)[:500], param="messages") from None


def parse_chat(body: dict, tokenizer, max_model_len: int, served_model_name: str,
               tool_call_parser: str | None = None) -> ParsedRequest:
    """A chat request; ``tool_call_parser`` (``--tool-call-parser``) names the call format of a
    template that renders tools (else its markers tell)."""
    model = check_model(body, served_model_name)
    kwargs = body.get("chat_template_kwargs")
    if body.get("chat_template") is not None or (isinstance(kwargs, dict) and "chat_template" in kwargs):
        raise bad_request("request-supplied chat templates are not accepted; the model's own template is used",
                          param="chat_template")
    parser = choose_parser(tokenizer.chat_template, tool_call_parser)
    marker_id = tokenizer.token_to_id(parser.marker_token) if parser.marker_token else None
    tool_request = parse_tool_request(body, parser, marker_id)
    stream = field(body, "stream", "bool", False)
    include_usage = _stream_options(body, stream)
    want_logprobs = field(body, "logprobs", "bool", False)
    top_logprobs = field(body, "top_logprobs", "int", None)
    if top_logprobs is not None:
        if not want_logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}",
                              param="top_logprobs")
    common = _common_params(body, tokenizer.vocab_size)
    if tool_request is not None:
        common = _with_tool_constraint(common, tool_request, body)
    max_tokens = _max_tokens(body, None)
    messages = parse_messages(body)
    add_generation_prompt = field(body, "add_generation_prompt", "bool", True)
    token_ids = encode_chat(tokenizer, messages, add_generation_prompt, tool_request)
    if not token_ids:
        raise bad_request("the messages render to an empty prompt", param="messages")
    params = _sampling_params(dict(common, logprobs=(top_logprobs or 0) if want_logprobs else None,
                                   max_tokens=_fit_context(len(token_ids), max_tokens, max_model_len, "messages")))
    return ParsedRequest("chat", model, [Prompt(token_ids, None)], [params], stream, include_usage,
                         top_logprobs=(top_logprobs or 0) if want_logprobs else None, tools=tool_request)


def _with_tool_constraint(common: dict, tool_request: ToolRequest, body: dict) -> dict:
    """``common`` with the grammar that enforces ``tool_choice`` (required or named), and special
    tokens kept in the text when the call format's marker is one."""
    grammar = tool_request.grammar()
    if grammar is not None and common["structured_outputs"] is not None:
        other = constraint_fields(body)[0]
        raise bad_request(f"'tool_choice' {tool_request.choice!r} and '{other}' both constrain the output; "
                          "send only one of them", param="tool_choice")
    common = dict(common)
    if grammar is not None:
        common["structured_outputs"] = StructuredOutputsParams(grammar=grammar)
    if tool_request.parser.needs_special_tokens:
        common["skip_special_tokens"] = False
    return common

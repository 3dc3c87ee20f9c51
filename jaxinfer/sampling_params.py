"""SamplingParams: how to sample one request's output, with vLLM's names and defaults; and
SequenceSampling: what one sample (one ``Sequence``) of such a request runs with.

The sampling-related types, from the client to the device:

- ``SamplingParams`` (here): what a client asked for, per request (validated on construction).
- ``SequenceSampling`` (here): one sample's share of it: the request's params plus the seed,
  token budget and banned ids of that sample. The engine attaches one to each ``Sequence``.
- ``SamplingTensors`` (``jaxinfer.sampling``): the same settings as device arrays, one row per
  sampled token of a step, packed by ``jaxinfer.input_batch``.
- ``SamplingFlags`` (``jaxinfer.sampling``): static switches compiled into a sampler program;
  the runner's two sampler paths ("basic", "full") are two sets of them.
- ``SamplerOutput`` (``jaxinfer.sampling``): what the sampler returns: token ids and logprobs.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxinfer.errors import RequestError

MAX_TOP_LOGPROBS = 20
FLOAT32_MAX = 3.4028234663852886e38  # the sampler's arrays are float32
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output, vLLM's ``StructuredOutputsParams``: exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text) the output must validate against;
    - ``regex``: a regular expression the whole output must match;
    - ``choice``: a list of strings, the output being exactly one of them;
    - ``grammar``: a grammar in Lark/EBNF syntax (llguidance's dialect);
    - ``json_object=True``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    The output is valid by construction: each step only tokens the grammar allows can be
    sampled, and EOS only where the grammar accepts (``jaxinfer.structured_output``).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        # A bare string is not a list of choices (tuple("yes") would be its letters).
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = self.kinds()
        if len(kinds) != 1:
            found = ", ".join(kinds) or "none"
            raise RequestError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                               f"json_object; got {found}", field="structured_outputs")
        field = f"structured_outputs.{kinds[0]}"
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise RequestError(f"{field} must be a JSON schema object or its JSON text", field=field)
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise RequestError(f"{field} must be a non-empty string", field=field)
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise RequestError(f"{field} must be a non-empty grammar", field=field)
        if self.choice is not None and not (isinstance(self.choice, tuple) and self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise RequestError(f"{field} must be a non-empty list of non-empty strings", field=field)

    def kinds(self) -> list[str]:
        """Which constraints are set (valid params have exactly one)."""
        values = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        return [name for name, value in values.items() if value is not None] + (["json_object"] if self.json_object else [])


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling settings; validated on construction with messages naming the field.

    Defaults are vLLM's: ``temperature=1.0``, ``top_p=1.0``, top-k off, ``max_tokens=16``.
    ``temperature=0`` is greedy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus the top k
    # None: off; k: every prompt token's logprob after the ones before it, plus the top k there
    # (vLLM's meaning). Costs one extra forward over the prompt: see jaxinfer.prompt_logprobs.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Token id -> a bias in [-100, 100] added to its logit before sampling (OpenAI's meaning).
    logit_bias: dict[int, float] | None = None
    # Words (strings) the output may never contain: their token sequences are banned (vLLM's).
    bad_words: list[str] | None = None
    # A grammar the output must follow (JSON schema, regex, choice, Lark grammar).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            # JSON object keys arrive as strings ("50256"): accept them as the ids they spell.
            self.logit_bias = {_int_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    def validate(self) -> None:
        """Raise ``RequestError`` naming the first field out of range, and its (lower, upper) bounds."""

        def need(ok: bool, field: str, message: str, limit: object = None) -> None:
            if not ok:
                raise RequestError(f"{field} {message}, got {getattr(self, field)!r}", field=field, limit=limit)

        need(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1", (1, None))
        # The device holds these in float32: a larger value would arrive as inf there.
        need(_is_number(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX, "temperature",
             f"must be in [0, {FLOAT32_MAX:.4g}]", (0, FLOAT32_MAX))
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", (0, 1))
        need(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", "must be -1, 0 (off) or >= 1",
             (-1, None))
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", (0, 1))
        need(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             "must be in [-2, 2]", (-2, 2))
        need(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "must be in [-2, 2]", (-2, 2))
        need(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= FLOAT32_MAX, "repetition_penalty",
             f"must be in (0, {FLOAT32_MAX:.4g}]", (0, FLOAT32_MAX))
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
             "must be an integer in [0, 2**63)", (0, 2**63 - 1))
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0",
             (0, None))
        need(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
             "must be >= 1", (1, None))
        need(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0", (0, None))
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens})",
                 (0, self.max_tokens))
        need(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
            "logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}", (0, MAX_TOP_LOGPROBS),
        )
        need(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
            "prompt_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}", (0, MAX_TOP_LOGPROBS),
        )
        need(self.logit_bias is None or (
            isinstance(self.logit_bias, dict)
            and all(_is_int(k) and k >= 0 for k in self.logit_bias)
            and all(_is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias.values())),
            "logit_bias", f"must map token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            (-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS))
        need(self.bad_words is None or (isinstance(self.bad_words, list)
                                        and all(isinstance(w, str) and w for w in self.bad_words)),
             "bad_words", "must be a list of non-empty strings")
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "must be a StructuredOutputsParams")


@dataclasses.dataclass(frozen=True)
class SequenceSampling:
    """What one sample of a request runs with (opaque to the scheduler and allocator)."""

    params: SamplingParams
    seed: int  # this sample's own seed: the request's, or derived from it for n > 1
    max_tokens: int  # max_tokens, capped by the context left after the prompt
    index: int = 0  # which of the request's n samples
    # Ids the sample may not produce before min_tokens: see banned_before_min_tokens.
    banned_before_min_tokens: tuple[int, ...] = ()
    # The token sequences of params.bad_words (jaxinfer.bad_words.bad_words_token_ids).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @functools.cached_property
    def needs_full_sampler(self) -> bool:
        """Whether the "full" sampler path must serve this sample: the "basic" one serves only
        greedy and plain temperature sampling. Asked once per step per sequence, so cached."""
        params = self.params
        return (
            params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.logprobs is not None
            or params.min_tokens > 0
            or bool(params.logit_bias) or bool(self.bad_words_token_ids)
            or (params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0))
        )


def banned_before_min_tokens(params: SamplingParams, eos_ids: frozenset[int]) -> tuple[int, ...]:
    """Token ids a sample may not produce before ``min_tokens``: EOS (unless ignored) and the stop ids, sorted."""
    return tuple(sorted((set() if params.ignore_eos else set(eos_ids)) | set(params.stop_token_ids)))


def _int_key(key):
    """A logit_bias key as an int where it spells one ("42" -> 42); anything else unchanged, for validate."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN

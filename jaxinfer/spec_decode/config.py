"""SpeculativeConfig: which proposer, how many drafts, and when speculation stays on.

Accepts vLLM's dictionary keys (``method``, ``num_speculative_tokens``, ``prompt_lookup_max``,
``prompt_lookup_min``, ``model``, ``disable_by_batch_size``), so the same JSON works for
``LLM(speculative_config=...)`` and ``jaxinfer serve --speculative-config``.
"""

from __future__ import annotations

import dataclasses
import json

from jaxinfer.errors import RequestError

METHODS = ("ngram", "draft_model", "eagle3")
# More drafts than this cost a wider verify step for tokens that are rarely all accepted; it
# also bounds the verify programs compiled at start-up (k + 1 logits rows per sequence).
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(RequestError):
    """A speculative_config that cannot work; ``field`` names the key at fault."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with. ``None`` limits mean "no limit" (module docstring of speculator)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up in the context
    prompt_lookup_min: int = 1  # shortest one tried before giving up this step
    # "draft_model": a built-in name or directory sharing the tokenizer; "eagle3": the head's
    # directory (jaxinfer.spec_decode.eagle3_checkpoint)
    model: str | None = None
    # A step with more running sequences than this does not speculate (vLLM's key). None:
    # every batch size speculates, as an explicit config asks.
    disable_by_batch_size: int | None = None
    # A sequence whose accepted/drafted ratio is below this after judge_after_drafts drafted
    # tokens stops speculating: its verify rows would cost work for nothing.
    min_acceptance_rate: float = 0.1
    judge_after_drafts: int = 32
    # A sequence that gains fewer accepted tokens than this per step it could draft in (the
    # n-gram finding no match counts as a step without gain), once it has had judge_after_steps
    # of them, stops speculating: its steps then run asynchronously again.
    min_accepted_per_step: float = 0.1
    judge_after_steps: int = 32
    # n-gram only: draft on the device from the previous verify step's output, so the host
    # dispatches each verify step without waiting for the one before (docs/SPECULATIVE.md).
    # Needs the engine's async scheduling; with it off, steps are synchronous anyway.
    async_verify: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}",
                                         field="speculative_config.method")
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise SpeculativeConfigError(f"speculative_config.model is required with method {self.method!r}",
                                         field="speculative_config.model")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
                field="speculative_config.num_speculative_tokens", limit=MAX_SPECULATIVE_TOKENS)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"speculative_config needs 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})", field="speculative_config.prompt_lookup_min", limit=self.prompt_lookup_max)
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise SpeculativeConfigError("speculative_config.disable_by_batch_size must be positive",
                                         field="speculative_config.disable_by_batch_size", limit=1)
        if self.async_verify and self.method != "ngram":
            raise SpeculativeConfigError("speculative_config.async_verify drafts by prompt lookup on the device: "
                                         "it needs method \"ngram\"", field="speculative_config.async_verify")
        if not 0 <= self.min_acceptance_rate <= 1:
            raise SpeculativeConfigError("speculative_config.min_acceptance_rate must be in [0, 1]",
                                         field="speculative_config.min_acceptance_rate")

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """A config from a ``SpeculativeConfig``, a dict of vLLM's keys, a JSON string, or ``None``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise SpeculativeConfigError(f"speculative_config is not valid JSON: {error}",
                                             field="speculative_config") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("speculative_config must be a JSON object", field="speculative_config")
        value = dict(value)
        if "model" in value and "method" not in value:
            value["method"] = "ngram" if value["model"] in ("ngram", "[ngram]") else "draft_model"
        if value.get("model") in ("ngram", "[ngram]"):
            value.pop("model")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}",
                                         field=f"speculative_config.{unknown[0]}")
        return cls(**value)

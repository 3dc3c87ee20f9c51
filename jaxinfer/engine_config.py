"""EngineConfig: an engine's size and scheduling, with one set of defaults for every way of building one.

An ``EngineConfig`` holds what the user asked for; a field left ``None`` means "the platform
default". :meth:`EngineConfig.resolve` fills in every ``None`` when the engine is built, so
``LLM(...)``, ``jaxinfer serve``, ``jaxinfer generate`` and ``Engine(model, EngineConfig(...))``
get the same engine for the same inputs (``jaxinfer.engine_factory.build_engine`` is the one
place that builds them).

Defaults, by ``platform`` (``jax.default_backend()`` unless given):

| field | cpu | gpu | tpu |
| --- | --- | --- | --- |
| ``max_model_len`` | the model's context | the model's context | the model's context |
| ``max_num_seqs`` | 16 | 256 | 256 |
| ``max_num_batched_tokens`` | 256 | 8192 | 8192 |
| ``page_size`` | 32 | 32 | 32 |
| ``num_pages`` | 1 GiB of KV | sized from free device memory | sized from free device memory |
| ``memory_utilization`` | 0.9 (unused) | 0.9 | 0.9 |
| ``max_wait_s`` | 0.002 | 0.002 | 0.002 |
| ``scheduling_admission`` | ``"reserve"`` | ``"reserve"`` | ``"reserve"`` |
| ``enable_prefix_caching`` | on | on | on |
| ``async_scheduling`` | on | on | on |
| ``attention_impl`` | ``"auto"``: reference | ``"auto"``: Pallas-Triton | ``"auto"``: Mosaic |
| ``overlap`` | none | none | none |
| ``kv_cache_dtype`` | ``"auto"`` (float32 pages) | ``"auto"`` (bfloat16 pages) | ``"auto"`` (bfloat16 pages) |
| ``speculative_config`` | none | none | none |
| ``quantization`` | the model's | the model's | the model's |
| ``activation_scales`` | the model's (FP8) | the model's (FP8) | the model's (FP8) |

Why:

- ``max_model_len``: ``max_position_embeddings``, the context the model was trained for.
- ``max_num_seqs``: a decode step reads every weight once whatever the batch, so an
  accelerator's throughput grows with the batch (the H200 benchmarks ran 256-384,
  ``benchmarks/results/engine_throughput.md``); a CPU's matmuls are bound by its arithmetic,
  so a larger batch adds little throughput and lengthens every step.
- ``max_num_batched_tokens``: on an accelerator, prefill chunks large enough to keep the
  matmuls busy (the H200 benchmarks' budget); on a CPU, short steps, so running decodes do not
  wait long behind a prefill chunk.
- ``page_size``: at or near the best everywhere in the H200 kernel sweep, with half the tail
  waste of 64 (``docs/KERNELS.md``).
- ``num_pages``: ``memory_utilization`` of the device's memory limit, less what is in use
  once the weights are loaded (``jaxinfer.memory.num_pages_for_device``); a CPU reports no
  limit, so it gets a fixed 1 GiB pool. A measured pool is never smaller than one
  ``max_model_len`` request needs.
- ``memory_utilization``: the other 10% holds compiled programs and activations.
- ``max_wait_s``: with nothing running, batch arrivals into the first step for less time than a
  decode step takes.
- ``scheduling_admission``: ``"reserve"`` admits a waiting request only when the free pages
  also cover the expected growth of what runs (``jaxinfer.admission``): few preemptions at high
  concurrency without sizing ``max_num_seqs`` to the pool, and an adaptive estimate that lets
  more in when requests stop early. ``"greedy"`` admits whenever the prompt fits.
- ``enable_prefix_caching``: shared prompt prefixes (system prompts, earlier chat turns) are not
  recomputed.
- ``async_scheduling``: the host prepares step n+1 while the device runs step n.
- ``attention_impl``: ``"auto"`` is resolved when a step is compiled
  (``jaxinfer.attention.resolve_impl``); on a GPU the kernel needs a power-of-two ``head_dim``
  and falls back to the reference otherwise.
- ``overlap``: tensor-parallel communication overlap (``jaxinfer.compile_options.OverlapConfig``) is opt-in.
- ``kv_cache_dtype``: ``"auto"`` stores pages in the model's serving dtype; ``"fp8"`` (e4m3 with
  per-layer scales, ``jaxinfer.kv_cache_dtype``) halves a bf16 cache and is opt-in, as in vLLM,
  because it costs some accuracy (``benchmarks/results/kv_cache_accuracy.md``). A device
  without FP8 refuses it when the config is resolved, before the cache is allocated.
- ``speculative_config``: speculative decoding (``jaxinfer.spec_decode``, docs/SPECULATIVE.md) is
  opt-in: it pays at small batches on text that repeats its context, and it changes what a seeded
  sampled request returns (the target's distribution is kept, not a plain run's samples).
- ``quantization``: the weights are quantized when the model is loaded (``load_model(...,
  quantization=)``); the engine serves what was loaded, and a value given here must match it.
- ``activation_scales``: likewise set when the model is loaded (``LLM(activation_scales=,
  calibration_prompts=)``, ``jaxinfer.activation_calibration``): ``"static"`` for a
  compressed-tensors ``FP8`` checkpoint or a calibrated model, else ``"dynamic"``, as vLLM does.

``max_num_seqs`` and ``max_num_batched_tokens`` follow each other: a default ``max_num_seqs``
is capped at the budget, and a default budget is raised to ``max_num_seqs``, because each
running sequence needs a token of every step. Given both, a budget below ``max_num_seqs`` is an
error. Every error is an :class:`EngineConfigError` that names the field.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxinfer.admission import ADMISSION_POLICIES
from jaxinfer.attention import IMPLEMENTATIONS
from jaxinfer.kv_cache_dtype import (KV_CACHE_DTYPES, check_kv_cache_dtype_supported, normalize_kv_cache_dtype,
                                     storage_dtype)
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.memory import DEFAULT_MEMORY_UTILIZATION, max_num_pages, num_pages_for_device, pages_for
from jaxinfer.spec_decode.config import SpeculativeConfig
from jaxinfer.quantization import QUANTIZATIONS
from jaxinfer.quantized_checkpoint import ACTIVATION_SCALES
from sharding.mesh import tp_size

logger = logging.getLogger(__name__)


class EngineConfigError(ValueError):
    """An engine setting that cannot work; ``field`` names the ``EngineConfig`` field at fault."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What a user asks of an engine; ``None``: the platform default (module docstring)."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    page_size: int | None = None
    num_pages: int | None = None  # including the scratch page, which holds no sequence's tokens
    memory_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    max_wait_s: float | None = None
    scheduling_admission: str | None = None  # "reserve" or "greedy" (jaxinfer.admission)
    attention_impl: str | None = None
    async_scheduling: bool | None = None
    overlap: object = None  # jaxinfer.compile_options.OverlapConfig: tp communication overlap per phase
    kv_cache_dtype: str | None = None  # "auto" (the serving dtype) or "fp8" (alias "fp8_e4m3")
    # jaxinfer.spec_decode.SpeculativeConfig, or its dict / JSON (vLLM's keys); None: no speculation.
    speculative_config: object = None
    quantization: str | None = None  # "fp8" / "int8" weights (jaxinfer.quantization); resolved: the model's
    # "dynamic" / "static" FP8 activation scales (jaxinfer.activation_scales); resolved: the model's
    activation_scales: str | None = None

    def __post_init__(self):
        # A dict or JSON string (LLM, --speculative-config) is checked and parsed now.
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        # What can be checked field by field is checked as soon as it is given.
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise EngineConfigError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}",
                                    field="memory_utilization")
        if self.max_wait_s is not None and not self.max_wait_s >= 0:
            raise EngineConfigError(f"max_wait_s must be >= 0, got {self.max_wait_s}", field="max_wait_s")
        if self.scheduling_admission is not None and self.scheduling_admission not in ADMISSION_POLICIES:
            raise EngineConfigError(f"scheduling_admission {self.scheduling_admission!r} is not one of "
                                    f"{ADMISSION_POLICIES}", field="scheduling_admission")
        if self.attention_impl is not None and self.attention_impl not in IMPLEMENTATIONS:
            raise EngineConfigError(f"attention_impl {self.attention_impl!r} is not one of {IMPLEMENTATIONS}",
                                    field="attention_impl")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}",
                                    field="kv_cache_dtype")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise EngineConfigError(f"quantization {self.quantization!r} is not one of {sorted(QUANTIZATIONS)} "
                                    f"or None", field="quantization")
        if self.activation_scales is not None and self.activation_scales not in ACTIVATION_SCALES:
            raise EngineConfigError(f"activation_scales {self.activation_scales!r} is not one of "
                                    f"{list(ACTIVATION_SCALES)} or None", field="activation_scales")
        if (self.max_num_seqs is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            # Every running sequence needs a token of each step's budget: with fewer, the first
            # decodes would take every step while the rest starved.
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): each running sequence decodes one token per step",
                field="max_num_batched_tokens",
            )

    def for_platform(self, platform: str | None = None) -> EngineConfig:
        """Every field that does not depend on the model filled in: ``max_model_len`` and
        ``num_pages`` stay as given (:meth:`resolve` fills them)."""
        defaults = PLATFORM_DEFAULTS[normalize_platform(platform)]
        filled = {
            field.name: getattr(defaults, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) is None and getattr(defaults, field.name) is not None
        }
        # Each running sequence takes a token of every step: a default never breaks that.
        if self.max_num_seqs is None:
            filled["max_num_seqs"] = min(defaults.max_num_seqs, self.max_num_batched_tokens or defaults.max_num_seqs)
        if self.max_num_batched_tokens is None:
            filled["max_num_batched_tokens"] = max(defaults.max_num_batched_tokens, self.max_num_seqs or 0)
        return dataclasses.replace(self, **filled)

    def resolve(self, model: LoadedModel, *, mesh=None, platform: str | None = None) -> EngineConfig:
        """Every field filled in for ``model`` (laid out on ``mesh``, if given) on ``platform``.

        Sizing ``num_pages`` reads the device's free memory, so resolve after the weights are
        loaded and before any KV cache is allocated. A config with every field set comes back
        unchanged (checked against the model).
        """
        config = self.for_platform(platform)
        check_kv_cache_dtype_supported(config.kv_cache_dtype)
        kv_cache_dtype = normalize_kv_cache_dtype(config.kv_cache_dtype)
        kv_bytes = storage_dtype(kv_cache_dtype, model.weights.embed.dtype).itemsize
        if config.quantization not in (None, model.config.quantization):
            raise EngineConfigError(
                f"quantization {config.quantization!r} was asked for, but the loaded model's weights are "
                f"{model.config.quantization or 'not quantized'}: pass quantization to load_model / LLM",
                field="quantization",
            )
        # Only FP8 weights have activation scales: the others resolve to None (and run no W8A8).
        activation_scales = model.config.activation_scales if model.config.quantization == "fp8" else None
        if config.activation_scales not in (None, activation_scales or "dynamic"):
            raise EngineConfigError(
                f"activation_scales {config.activation_scales!r} was asked for, but the loaded model's are "
                f"{model.config.activation_scales}: pass activation_scales (and calibration_prompts) to LLM",
                field="activation_scales",
            )
        context = model.config.max_position_embeddings
        max_model_len = config.max_model_len or context
        if max_model_len > context:
            raise EngineConfigError(
                f"max_model_len {max_model_len} exceeds the model's context of {context} tokens", field="max_model_len"
            )
        # Page 0 is scratch: one request of max_model_len needs its pages and that one.
        min_pages = pages_for(max_model_len, config.page_size) + 1
        num_pages = config.num_pages
        if num_pages is None:
            # Each device holds its tensor-parallel shard of the (padded) KV heads.
            per_device = dataclasses.replace(model.config, num_kv_heads=model.config.num_kv_heads // tp_size(mesh))
            num_pages = max(min_pages, num_pages_for_device(
                per_device, page_size=config.page_size, bytes_per_element=kv_bytes,
                memory_utilization=config.memory_utilization,
            ))
        elif num_pages < min_pages:
            raise EngineConfigError(
                f"num_pages {num_pages} cannot hold one request of max_model_len {max_model_len}: it needs "
                f"{min_pages} pages of {config.page_size} tokens (one is scratch)", field="num_pages",
            )
        if normalize_platform(platform) == "gpu" and kv_bytes == 1:
            num_pages = cap_gpu_num_pages(num_pages, model.config, mesh, config.page_size,
                                          explicit=config.num_pages is not None)
        return dataclasses.replace(config, max_model_len=max_model_len, num_pages=num_pages,
                                   kv_cache_dtype=kv_cache_dtype, quantization=model.config.quantization,
                                   activation_scales=activation_scales)


def cap_gpu_num_pages(num_pages: int, model_config, mesh, page_size: int, explicit: bool) -> int:
    """``num_pages`` of FP8 pages within what the GPU kernel can address (``memory.max_num_pages``):
    a pool sized from free memory is cut down to it (logged); an explicit one past it is an error."""
    per_device = dataclasses.replace(model_config, num_kv_heads=max(1, model_config.num_kv_heads // tp_size(mesh)))
    limit = max_num_pages(per_device, page_size)
    if num_pages <= limit:
        return num_pages
    if explicit:
        raise EngineConfigError(
            f"num_pages {num_pages} of FP8 pages is more than the GPU attention kernel can address: each "
            f"layer's K/V array must stay under 2**31 elements, at most {limit} pages of {page_size} tokens here",
            field="num_pages",
        )
    logger.warning("KV cache capped at %d pages (from %d): each layer's K/V array must stay under 2**31 "
                   "elements for the GPU kernel's 8-bit page loads", limit, num_pages)
    return limit


def normalize_platform(platform: str | None) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``; ``None``: JAX's default backend."""
    platform = platform or jax.default_backend()
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if platform not in PLATFORM_DEFAULTS:
        raise ValueError(f"no engine defaults for platform {platform!r}; one of {sorted(PLATFORM_DEFAULTS)}")
    return platform


_SHARED_DEFAULTS = dict(page_size=32, memory_utilization=DEFAULT_MEMORY_UTILIZATION, enable_prefix_caching=True, max_wait_s=0.002,
                        scheduling_admission="reserve",
                        attention_impl="auto", async_scheduling=True, kv_cache_dtype="auto")

# The table in the module docstring; max_model_len and num_pages depend on the model (resolve).
PLATFORM_DEFAULTS = {
    "cpu": EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, **_SHARED_DEFAULTS),
    "gpu": EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, **_SHARED_DEFAULTS),
    "tpu": EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, **_SHARED_DEFAULTS),
}

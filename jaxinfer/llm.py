"""LLM: the offline, vLLM-shaped public API.

    from jaxinfer import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.activation_calibration import apply_activation_scales
from jaxinfer.activation_scales import check_activation_scales
from jaxinfer.checkpoint import load_model
from jaxinfer.engine_config import EngineConfig
from jaxinfer.engine_factory import build_engine
from jaxinfer.kv_cache_dtype import check_kv_cache_dtype_supported
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """Load a model and generate from it through the continuous-batching engine.

    Args:
        model: a built-in name (``jaxinfer.model_registry.builtin_models()``), a Hugging Face
            directory, or a GGUF file.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"auto"`` (bfloat16 on an accelerator, float32 on CPU).
        quantization: ``"fp8"`` or ``"int8"``: quantize the projections' weights at load, per
            output channel (docs/QUANTIZATION.md); ``None``: as the checkpoint stores them (a
            pre-quantized FP8 checkpoint stays FP8).
        activation_scales: how FP8 W8A8 scales activations: ``"dynamic"`` (per token at run time),
            ``"static"`` (one calibrated scale per projection input: a compressed-tensors ``FP8``
            checkpoint's own, or calibrated on ``calibration_prompts``); ``None``: the checkpoint's
            (static for ``FP8``, else dynamic), or static when ``calibration_prompts`` are given.
        calibration_prompts: texts or token-id lists run through the model to calibrate static
            activation scales (``jaxinfer.activation_calibration``); a few thousand tokens of text
            like the traffic to serve.
        seed: seeds requests that do not set their own ``seed``.
        max_model_len, max_num_seqs, max_num_batched_tokens, page_size, num_pages,
            memory_utilization, enable_prefix_caching, max_wait_s, scheduling_admission, attention_impl,
            async_scheduling, overlap, kv_cache_dtype, speculative_config: the ``EngineConfig`` fields; ``None`` (the default) is the
            platform's default, tabled in ``jaxinfer.engine_config`` and shared with
            ``jaxinfer serve``.
        tensor_parallel_size: devices each replica's layers are split over (heads, ffn, vocabulary).
        data_parallel_size: model replicas, each with its own scheduler, behind a router
            (``jaxinfer.data_parallel``); ``tp * dp`` devices in all. See docs/SHARDING.md.
        warm_up: compile every step shape now (else: on first use).
        loaded: an already loaded model (``model`` and ``dtype`` are then not used).
    """

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        *,
        dtype: str | None = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        page_size: int | None = None,
        num_pages: int | None = None,
        memory_utilization: float | None = None,
        enable_prefix_caching: bool | None = None,
        max_wait_s: float | None = None,
        scheduling_admission: str | None = None,
        attention_impl: str | None = None,
        async_scheduling: bool | None = None,
        overlap=None,
        kv_cache_dtype: str | None = None,
        speculative_config: dict | str | None = None,
        warm_up: bool = True,
        use_tqdm: bool = True,
        loaded: LoadedModel | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        quantization: str | None = None,
        activation_scales: str | None = None,
        calibration_prompts: Sequence[Prompt] | None = None,
    ):
        # Before the weights load: a device without FP8 refuses an FP8 cache before anything is allocated.
        check_kv_cache_dtype_supported(kv_cache_dtype)
        check_activation_scales(activation_scales)
        # A model passed in stays the caller's: close() frees only what this LLM made (the cache, and
        # weights it loaded or derived), so the same LoadedModel can serve another LLM afterwards.
        self._lent_weights = loaded.weights if loaded is not None else None
        loaded = loaded or load_model(model, dtype, quantization=quantization)
        if activation_scales is not None or calibration_prompts:
            samples = [loaded.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in calibration_prompts or ()]
            loaded = apply_activation_scales(loaded, activation_scales, samples)
        self._config = loaded.config
        config = EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            page_size=page_size, num_pages=num_pages, memory_utilization=memory_utilization,
            enable_prefix_caching=enable_prefix_caching, max_wait_s=max_wait_s,
            scheduling_admission=scheduling_admission, attention_impl=attention_impl,
            async_scheduling=async_scheduling, overlap=overlap, kv_cache_dtype=kv_cache_dtype,
            speculative_config=speculative_config, quantization=quantization,
            activation_scales=activation_scales,
        )
        self.engine = build_engine(loaded, config, tensor_parallel_size=tensor_parallel_size,
                                   data_parallel_size=data_parallel_size, warm_up=warm_up, use_tqdm=use_tqdm)
        self.model = self.engine.model  # the first replica's: heads padded for tp (self.config keeps the original)
        self.tokenizer = self.engine.tokenizer
        self._seed_rng = np.random.default_rng(seed)
        self._request_counter = itertools.count()

    @property
    def config(self):
        """The model's config (before any head padding for tensor parallelism)."""
        return self._config

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's resolved config: every platform default filled in."""
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. A prompt is a string or a list of token ids.

        A prompt that cannot run (too long for the context, empty, bad token ids) gets an
        output with ``error`` set and no text; the other prompts run normally.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        return self._run([self._encode(p) for p in prompt_list], params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template (generation prompt added) to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _as_params_list(sampling_params, len(conversations))
        encoded = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's growing output after every step that changed it (for notebooks)."""
        text, ids = self._encode(prompt)
        request_id = self._add(text, ids, sampling_params or SamplingParams())
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield _snapshot(out)
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()

    def close(self) -> None:
        """Free the weights and the KV cache now, without waiting for garbage collection.

        The LLM cannot generate afterwards. ``with LLM(...) as llm:`` closes it on exit. Weights of a
        model passed as ``loaded=`` are the caller's and stay alive (arrays the engine derived from
        them, e.g. padded for tensor parallelism, are freed).
        """
        engine = self.__dict__.pop("engine", None)
        if engine is None:
            return
        lent = {id(array) for array in jax.tree.leaves(self._lent_weights)}
        for e in getattr(engine, "engines", [engine]):
            for array in jax.tree.leaves((e.model.weights, e.runner.cache, e.runner.last_sampled)):
                if isinstance(array, jax.Array) and id(array) not in lent and not array.is_deleted():
                    array.delete()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        if name == "engine":  # only reached once close() removed it
            raise RuntimeError("this LLM was closed: create a new one to generate")
        raise AttributeError(name)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _add(self, text: str | None, ids: list[int], params: SamplingParams, final_only: bool = False) -> str:
        request_id = str(next(self._request_counter))
        if params.seed is None:
            params = _with_seed(params, int(self._seed_rng.integers(0, 2**31)))
        self.engine.add_request(request_id, ids, params, prompt=text, final_only=final_only)
        return request_id

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for (text, ids), sp in zip(encoded, params):
            try:
                order.append(self._add(text, ids, sp, final_only=True))
            except ValueError as e:
                request_id = f"invalid-{next(self._request_counter)}"
                logger.warning("request rejected: %s", e)
                results[request_id] = RequestOutput(
                    request_id, text, ids, [CompletionOutput(0, "", [], finish_reason="error")], finished=True, error=str(e)
                )
                order.append(request_id)
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, num_output_tokens = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        num_output_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.set_postfix_str(f"{num_output_tokens / (time.perf_counter() - start):.1f} output tok/s")
                        bar.update(1)
        finally:
            bar.close()
            for request_id in order:
                if request_id not in results:
                    self.engine.abort(request_id)
        return [results[r] for r in order]


def _snapshot(output: RequestOutput) -> RequestOutput:
    """``output`` with copies of its samples' token and logprob lists.

    The engine's lists are live (they keep growing as later steps run); a notebook that keeps
    the outputs a stream yields must see each as it was when yielded.
    """
    samples = [
        dataclasses.replace(sample, token_ids=list(sample.token_ids),
                            logprobs=None if sample.logprobs is None else list(sample.logprobs))
        for sample in output.outputs
    ]
    return dataclasses.replace(output, outputs=samples)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, (int, np.integer)) for p in prompts):
        return [prompts]  # a flat list of ints is one token-id prompt
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, list, tuple)):
            raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
    return params

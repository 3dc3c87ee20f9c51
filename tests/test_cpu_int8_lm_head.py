"""An int8 model on XLA:CPU gets an int8 lm_head (``jaxinfer.cpu_int8_lm_head``): built by
``build_engine`` on one device, read through the native kernel, and close to the float32 logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, cpu_native
from jaxinfer.checkpoint import load_model
from jaxinfer.cpu_int8_lm_head import with_int8_lm_head
from jaxinfer.model import compute_logits
from jaxinfer.quantization import QuantizedWeight
from tests.fake_engine import TINY_LLAMA3

pytestmark = pytest.mark.skipif(not cpu_native.is_available(), reason=f"native CPU kernels: {cpu_native.unavailable_reason()}")


def test_tied_embedding_gets_an_int8_copy_and_keeps_its_own():
    model = load_model(TINY_LLAMA3, "float32", quantization="int8")
    assert model.weights.lm_head is None  # tied
    with_head = with_int8_lm_head(model)
    head = with_head.weights.lm_head
    assert isinstance(head, QuantizedWeight) and head.payload.dtype == jnp.int8
    assert head.payload.shape == model.weights.embed.shape and head.scale.shape == (model.config.vocab_size,)
    assert with_head.weights.embed is model.weights.embed  # the gather still reads the float32 rows
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, model.config.hidden_size)).astype(np.float32))
    jaxpr = str(jax.make_jaxpr(compute_logits)(with_head.weights, x))
    assert "ffi_call" in jaxpr and "dot_general" not in jaxpr
    dense, int8 = compute_logits(model.weights, x), compute_logits(with_head.weights, x)
    # Per-row absmax int8: each logit moves by at most half a step of its row's scale per element.
    bound = 0.5 * np.asarray(head.scale)[None, :] * np.abs(np.asarray(x)).sum(axis=1, keepdims=True)
    assert np.all(np.abs(np.asarray(int8) - np.asarray(dense)) <= bound + 1e-5)
    assert np.all(np.argmax(np.asarray(int8), axis=1) == np.argmax(np.asarray(dense), axis=1))


def test_an_untied_lm_head_is_quantized_from_its_declared_layout():
    model = load_model(TINY_LLAMA3, "float32", quantization="int8")
    untied = dataclasses.replace(model, weights=dataclasses.replace(model.weights, lm_head=model.weights.embed.T))
    head = with_int8_lm_head(untied).weights.lm_head
    tied_head = with_int8_lm_head(model).weights.lm_head
    np.testing.assert_array_equal(np.asarray(head.payload), np.asarray(tied_head.payload))


def test_only_int8_models_get_one():
    for quantization in (None, "fp8"):
        model = load_model(TINY_LLAMA3, "float32", quantization=quantization)
        assert with_int8_lm_head(model) is model


def test_the_engine_serves_with_it():
    llm = LLM(str(TINY_LLAMA3), dtype="float32", quantization="int8", use_tqdm=False)
    assert isinstance(llm.model.weights.lm_head, QuantizedWeight)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4

"""Calibrating static FP8 activation scales in the model's own forward, and the option that turns
them on (``LLM(activation_scales=..., calibration_prompts=...)``)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.activation_calibration import (apply_activation_scales, calibrate_activation_scales,
                                             projection_input_absmax)
from jaxinfer.activation_scales import INPUT_GROUPS, input_scales, with_static_input_scales
from jaxinfer.checkpoint import load_model
from jaxinfer.errors import RequestError
from jaxinfer.linear import FP8_W8A8_MIN_TOKENS
from jaxinfer.model import rms_norm

from .conftest import FIXTURES

TINY = FIXTURES / "tiny-llama3"
SAMPLE = [int(t) for t in np.random.default_rng(0).integers(1, 256, 150)]
ENGINE = {"max_model_len": 256, "max_num_seqs": 2, "max_num_batched_tokens": 256, "num_pages": 40,
          "use_tqdm": False, "warm_up": False}


@functools.cache
def fp8_model():  # not handed to an LLM, which frees the weights it served when closed
    return load_model(TINY, "float32", quantization="fp8")


def test_the_first_layers_qkv_scale_is_the_absmax_of_its_normed_input_over_448():
    model = fp8_model()
    scales = calibrate_activation_scales(model, [SAMPLE[:70], SAMPLE])
    layer = model.weights.layers[0]
    h = rms_norm(model.weights.embed[jnp.asarray(SAMPLE)], layer.attn_norm, model.config.rms_norm_eps)
    assert scales["qkv"][0] == np.float32(float(jnp.max(jnp.abs(h))) / 448)
    assert set(scales) == set(INPUT_GROUPS)
    assert all(s.shape == (model.config.num_layers,) and (s > 0).all() for s in scales.values())


def test_padding_rows_are_not_observed():
    model = fp8_model()
    ids = np.zeros(256, np.int32)
    ids[:len(SAMPLE)] = SAMPLE
    run = functools.partial(projection_input_absmax, model.weights, config=model.config, page_size=16)
    long = jax.device_get(run(ids, np.int32(len(SAMPLE))))
    short = jax.device_get(run(ids[:len(SAMPLE) + 10], np.int32(len(SAMPLE))))
    for group in INPUT_GROUPS:
        assert (long[group][:, len(SAMPLE):] == 0).all()
        np.testing.assert_allclose(long[group][:, :len(SAMPLE)], short[group][:, :len(SAMPLE)], rtol=1e-6)


def test_a_percentile_and_a_margin_lower_and_raise_the_scales():
    model = fp8_model()
    full = calibrate_activation_scales(model, [SAMPLE])
    lower = calibrate_activation_scales(model, [SAMPLE], percentile=90.0)
    wider = calibrate_activation_scales(model, [SAMPLE], margin=1.5)
    for group in INPUT_GROUPS:
        assert (lower[group] < full[group]).all()
        np.testing.assert_allclose(wider[group], 1.5 * full[group], rtol=1e-6)


def all_logits(model, ids):
    """float32 logits [len(ids), V] of every position, one W8A8-sized step."""
    from jaxinfer.batch import build_step_batch
    from jaxinfer.kv_cache import create_kv_cache

    from .all_logits import forward_all_logits

    batch = build_step_batch([(ids, 0, [1])], num_tokens=256, num_seqs=1, pages_per_seq=16)
    cache = create_kv_cache(model.config, 17, 16, jnp.float32)
    out, _ = jax.jit(forward_all_logits, static_argnums=(3, 4))(model.weights, cache, batch, model.config, "reference")
    return np.asarray(out)[:len(ids)]


def test_a_calibrated_model_is_as_close_to_the_dense_one_as_the_dynamic_one():
    """A 256-token step runs W8A8. The tiny random model is fragile under FP8 (its logits are
    near-flat: dynamic scales keep only ~60% of its top-1s), so static scales calibrated on
    other text are held to what dynamic ones do, not to an absolute bar."""
    dense = all_logits(load_model(TINY, "float32"), SAMPLE)
    dynamic = fp8_model()
    calibration = [int(t) for t in np.random.default_rng(1).integers(1, 256, 200)]
    static = with_static_input_scales(dynamic, calibrate_activation_scales(dynamic, [calibration]))
    assert static.config.activation_scales == "static" and 256 >= FP8_W8A8_MIN_TOKENS
    errors, agreement = {}, {}
    for name, model in (("dynamic", dynamic), ("static", static)):
        logits = all_logits(model, SAMPLE)
        errors[name] = np.abs(logits - dense).mean()
        agreement[name] = np.mean(logits.argmax(-1) == dense.argmax(-1))
    assert errors["static"] < 1.3 * errors["dynamic"], errors
    assert agreement["static"] > agreement["dynamic"] - 0.1, agreement
    # And the static scales did change the program's numbers.
    assert not np.array_equal(all_logits(static, SAMPLE), all_logits(dynamic, SAMPLE))


def test_llm_calibrates_on_prompts_and_serves_static_scales():
    text = "The quick brown fox jumps over the lazy dog. " * 8
    with LLM(str(TINY), dtype="float32", quantization="fp8", activation_scales="static",
             calibration_prompts=[text, SAMPLE], **ENGINE) as llm:
        model = llm.engine.model
        assert model.config.activation_scales == "static"
        assert input_scales(model)["down"].shape == (model.config.num_layers,)
        out = llm.generate([SAMPLE], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4


def test_static_without_scales_or_on_the_wrong_weights_is_refused_by_field():
    with pytest.raises(RequestError, match="calibration_prompts") as error:
        apply_activation_scales(fp8_model(), "static")
    assert error.value.field == "activation_scales"
    with pytest.raises(RequestError, match="FP8 weights") as error:
        apply_activation_scales(load_model(TINY, "float32", quantization="int8"), "static", [SAMPLE])
    assert error.value.field == "activation_scales"
    with pytest.raises(RequestError) as error:
        apply_activation_scales(fp8_model(), "dynamic", [SAMPLE])
    assert error.value.field == "calibration_prompts"
    with pytest.raises(RequestError) as error:
        apply_activation_scales(fp8_model(), "per-token")
    assert error.value.field == "activation_scales"
    assert apply_activation_scales(fp8_model(), None) is fp8_model()
    assert apply_activation_scales(fp8_model(), None, [SAMPLE]).config.activation_scales == "static"


def test_the_engine_config_and_the_flag_carry_the_option():
    import argparse

    from jaxinfer.engine_args import add_engine_arguments, engine_options_from_args
    from jaxinfer.engine_config import EngineConfig, EngineConfigError

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options_from_args(parser.parse_args(["--activation-scales", "static"]))["activation_scales"] \
        == "static"
    assert engine_options_from_args(parser.parse_args([]))["activation_scales"] is None
    with pytest.raises(EngineConfigError) as error:
        EngineConfig(activation_scales="per-token")
    assert error.value.field == "activation_scales"
    dynamic = fp8_model()
    assert EngineConfig().resolve(dynamic).activation_scales == "dynamic"
    static = with_static_input_scales(dynamic, calibrate_activation_scales(dynamic, [SAMPLE]))
    assert EngineConfig(activation_scales="static").resolve(static).activation_scales == "static"
    with pytest.raises(EngineConfigError, match="calibration_prompts") as error:
        EngineConfig(activation_scales="static").resolve(dynamic)
    assert error.value.field == "activation_scales"


def test_convert_calibrates_and_serve_loads_the_static_scales(tmp_path):
    from jaxinfer.cli import main

    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\nA second paragraph, about something else.\n")
    out = tmp_path / "orbax"
    assert main(["convert", "--model", str(TINY), "--output", str(out), "--quantization", "fp8",
                 "--calibration-file", str(text)]) == 0
    converted = load_model(out, "float32")
    assert converted.config.activation_scales == "static"
    expected = with_static_input_scales(fp8_model(), calibrate_activation_scales(
        fp8_model(), [fp8_model().tokenizer.encode(t) for t in ("The quick brown fox jumps over the lazy dog.",
                                                                "A second paragraph, about something else.")]))
    for group, scales in input_scales(converted).items():
        np.testing.assert_array_equal(scales, input_scales(expected)[group])
    assert apply_activation_scales(converted, "static") is converted
    with pytest.raises(SystemExit, match="--quantization fp8"):
        main(["convert", "--model", str(TINY), "--output", str(tmp_path / "int8"), "--quantization", "int8",
              "--calibration-file", str(text)])


def test_static_scales_are_committed_as_the_model_is_and_warm_up_compiles_each_program_once():
    # Committed scales in an uncommitted model made every step program compile a second time at
    # its first run after warm-up (jaxinfer.activation_scales.put_beside): on an H200 the static
    # engine never finished warming up (session 12).
    from jaxinfer.runner import ModelRunner

    model = fp8_model()
    static = apply_activation_scales(model, "static", [SAMPLE])
    leaves = jax.tree_util.tree_leaves(static.weights)
    assert {leaf.committed for leaf in leaves} == {False}
    runner = ModelRunner(static, num_pages=64, page_size=16, max_model_len=256, max_num_seqs=16,
                         max_num_batched_tokens=256, kv_cache_dtype="fp8")
    runner.warm_up(use_tqdm=False)
    assert runner.warmup_recompiles == 0


def test_warm_up_says_when_programs_compile_again_at_their_first_run(caplog):
    from jaxinfer.runner import ModelRunner

    model = fp8_model()
    static = apply_activation_scales(model, "static", [SAMPLE])
    runner = ModelRunner(static, num_pages=64, page_size=16, max_model_len=256, max_num_seqs=16,
                         max_num_batched_tokens=256, kv_cache_dtype="fp8")

    # Scales committed to the device behind the runner's back, as session 12's were before the
    # runner committed its state beside committed weights: the runs no longer match warm-up's programs.
    def committed(layer):
        return dataclasses.replace(layer, **{
            name: dataclasses.replace(w, input_scale=jax.device_put(w.input_scale, jax.devices()[0]))
            for name, w in vars(layer).items() if getattr(w, "input_scale", None) is not None})

    layers = [committed(layer) for layer in static.weights.layers]
    runner.model = dataclasses.replace(static, weights=dataclasses.replace(static.weights, layers=layers))
    with caplog.at_level("WARNING", logger="jaxinfer.runner"):
        runner.warm_up(use_tqdm=False)
    assert runner.warmup_recompiles > 0
    assert "compiled again at their first run" in caplog.text

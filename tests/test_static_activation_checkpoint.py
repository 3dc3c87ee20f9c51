"""A compressed-tensors ``FP8`` checkpoint serves W8A8 with its own static ``input_scale``s: read,
shared per input (the largest), checked against a numpy emulation of the MLP, saved by Orbax."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.activation_scales import input_scales, without_static_input_scales
from jaxinfer.checkpoint import load_model
from jaxinfer.linear import FP8_W8A8_MIN_TOKENS
from jaxinfer.model import mlp_block
from jaxinfer.orbax_checkpoint import restore, save
from jaxinfer.quantization import QuantizationError
from jaxinfer.safetensors_reader import SafetensorsFile

from .test_quantized_checkpoint import compressed_tensors_checkpoint, write_safetensors


@pytest.fixture(scope="module")
def static_checkpoint(tmp_path_factory):
    path, _ = compressed_tensors_checkpoint(tmp_path_factory.mktemp("ct") / "fp8", "FP8", kv_scales=False)
    reader = SafetensorsFile(path / "model.safetensors")
    return path, {name: reader.read(name) for name in reader.names()}


def test_the_input_scales_are_read_and_each_input_gets_the_largest_of_its_projections(static_checkpoint):
    path, tensors = static_checkpoint
    model = load_model(path, "float32")
    assert model.config.activation_scales == "static"
    prefix = "model.layers.1."
    written = {p: float(tensors[prefix + p + ".input_scale"][0]) for p in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    scales = input_scales(model)
    assert scales["qkv"][1] == np.float32(max(written[p] for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                                    "self_attn.v_proj")))
    assert scales["o"][1] == np.float32(written["self_attn.o_proj"])
    assert scales["gate_up"][1] == np.float32(max(written["mlp.gate_proj"], written["mlp.up_proj"]))
    # Committed like every other weight (none are, on one device): a committed scale in an
    # uncommitted model made the engine compile each step program twice (activation_scales.put_beside).
    assert {leaf.committed for leaf in jax.tree.leaves(model.weights)} == {False}
    assert scales["down"][1] == np.float32(written["mlp.down_proj"])
    layer = model.weights.layers[1]
    assert float(layer.q.input_scale) == float(layer.k.input_scale) == float(layer.v.input_scale)


def numpy_mlp(x, tensors, layer, eps):
    """The MLP of ``layer`` from the checkpoint's tensors, W8A8 with its static scales, in numpy."""
    def e4m3(a):
        return a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)

    def w8a8(a, s, name):
        payload = tensors[name + ".weight"].astype(np.float32)  # [out, in]
        aq = e4m3(np.clip(a / s, -448, 448))
        return (aq @ payload.T) * (s * tensors[name + ".weight_scale"].reshape(-1))[None, :]

    prefix = f"model.layers.{layer}."
    norm = tensors[prefix + "post_attention_layernorm.weight"]
    h = norm * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))
    s_in = max(float(tensors[prefix + f"mlp.{p}_proj.input_scale"][0]) for p in ("gate", "up"))
    gate, up = (w8a8(h, np.float32(s_in), prefix + f"mlp.{p}_proj") for p in ("gate", "up"))
    silu = gate / (1 + np.exp(-gate))
    return w8a8(silu * up, np.float32(tensors[prefix + "mlp.down_proj.input_scale"][0]), prefix + "mlp.down_proj")


def test_the_mlp_of_a_static_checkpoint_matches_a_numpy_emulation(static_checkpoint):
    path, tensors = static_checkpoint
    model = load_model(path, "float32")
    x = 3 * np.asarray(jax.random.normal(jax.random.key(0), (FP8_W8A8_MIN_TOKENS, model.config.hidden_size)))
    got = np.asarray(jax.jit(mlp_block, static_argnums=2)(model.weights.layers[1], jnp.asarray(x), model.config))
    want = numpy_mlp(x.astype(np.float32), tensors, 1, model.config.rms_norm_eps)
    # float32 differences between XLA's and numpy's norm and silu can tip an element to the
    # neighbouring e4m3 value; that moves an output by far less than this.
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
    # And the dynamic scales compute something else (the static ones were used).
    dynamic = without_static_input_scales(model)
    assert dynamic.config.activation_scales == "dynamic" and dynamic.weights.layers[1].gate.input_scale is None
    other = np.asarray(mlp_block(dynamic.weights.layers[1], jnp.asarray(x), dynamic.config))
    assert np.abs(other - want).max() > 10 * np.abs(got - want).max()


def test_orbax_round_trip_keeps_the_static_scales(static_checkpoint, tmp_path):
    model = load_model(static_checkpoint[0], "float32")
    back = restore(save(model, tmp_path / "orbax"))
    assert back.config == model.config and back.config.activation_scales == "static"
    assert jax.tree.structure(back.weights) == jax.tree.structure(model.weights)
    for a, b in zip(jax.tree.leaves(model.weights), jax.tree.leaves(back.weights)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_missing_or_bad_input_scale_is_refused_by_name(static_checkpoint, tmp_path):
    path, tensors = static_checkpoint
    bad = dict(tensors)
    bad["model.layers.0.mlp.down_proj.input_scale"] = np.array([-1.0], np.float32)
    out = tmp_path / "bad"
    out.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    write_safetensors(out / "model.safetensors", bad)
    with pytest.raises(QuantizationError, match="down_proj.input_scale"):
        load_model(out, "float32")
    del bad["model.layers.0.mlp.down_proj.input_scale"]
    write_safetensors(out / "model.safetensors", bad)
    with pytest.raises(KeyError, match="down_proj.input_scale"):
        load_model(out, "float32")


TENSOR_PARALLEL_CHECK = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxinfer.activation_calibration import one_sequence_step
from jaxinfer.checkpoint import load_model
from jaxinfer.model import compute_logits, hidden_states
from sharding.mesh import make_mesh
from sharding.placement import StepPlacement, shard_model

def logits(model, ids, placement=None):
    def forward(w, t, n):
        batch, cache = one_sequence_step(t, n, model.config, 16, jnp.float32)
        return compute_logits(w, hidden_states(w, cache, batch, model.config)[0])

    step = jax.jit(forward)
    args = (model.weights, np.asarray(ids, np.int32), np.int32(len(ids)))
    if placement is None:
        return np.asarray(step(*args))
    with placement.context():
        return np.asarray(step(model.weights, *jax.device_put(args[1:], placement.replicated)))

model = load_model(sys.argv[1], "float32")
ids = list(np.random.default_rng(0).integers(1, 256, 256))
expected = logits(model, ids)
mesh = make_mesh(2)
sharded = shard_model(model, mesh)
scale = sharded.weights.layers[0].q.input_scale
report = {"diff": float(np.abs(logits(sharded, ids, StepPlacement(sharded.config, mesh)) - expected).max()),
          "scale": float(np.abs(expected).max()), "static": sharded.config.activation_scales,
          "replicated": scale.sharding.is_fully_replicated and len(scale.sharding.device_set) == 2}
print("REPORT " + json.dumps(report))  # tests/subprocess_report.py reads it
"""


def test_tensor_parallelism_keeps_the_static_scales_replicated_and_the_logits(static_checkpoint):
    import os
    import subprocess
    import sys

    from .conftest import REPO
    from .subprocess_report import read_report

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL_CHECK, str(static_checkpoint[0])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = read_report(done.stdout)
    assert report["static"] == "static" and report["replicated"]
    # Row-parallel sums in another order can tip an activation to the neighbouring e4m3 value.
    assert report["diff"] < 0.02 * report["scale"], report

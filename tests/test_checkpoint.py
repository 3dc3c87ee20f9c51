"""Hugging Face checkpoints load one tensor at a time in their own dtype, by each family's names.

The layout (transposes, head reshapes) is checked end to end by the golden tests
(``test_model_golden.py``); here: the safetensors reader, that a bf16 checkpoint reaches the
device as bf16 and lands bit for bit where the float32 one does, that a sharded checkpoint
(with its index file) loads, and that the name table covers every declared weight.
"""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxinfer import checkpoint
from jaxinfer.architectures import ARCHITECTURES, GGUF_ARCHITECTURES, gguf_to_hf_name, hf_tensors
from jaxinfer.checkpoint import load_model
from jaxinfer.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jaxinfer.params import is_spec, param_specs
from jaxinfer.safetensors_reader import SafetensorsFile

from .conftest import FIXTURES

TINY = ["tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


def test_reader_keeps_the_stored_dtype_and_values(tmp_path):
    tensors = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "f16": np.arange(4, dtype=np.float16) / 3,
        "bf16": (np.arange(10, dtype=np.float32) / 9).astype(ml_dtypes.bfloat16).reshape(5, 2),
        "scalar": np.array(2.5, dtype=np.float32),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "np"})
    reader = SafetensorsFile(tmp_path / "t.safetensors")
    assert sorted(reader.names()) == sorted(tensors)
    for name, want in tensors.items():
        got = reader.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name


def test_reader_refuses_a_truncated_file(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"w": np.ones((64, 64), np.float32)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="ends inside tensor 'w'"):
        SafetensorsFile(path).read("w")


def bf16_sharded_copy(source, out):
    """The fixture's tensors rounded to bf16, split over two files with an index, as HF shards them."""
    out.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    reader = SafetensorsFile(source / "model.safetensors")
    names = sorted(reader.names())
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard in shards.items():
        save_file({n: reader.read(n).astype(ml_dtypes.bfloat16) for n in shard}, str(out / file))
    weight_map = {n: file for file, shard in shards.items() for n in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.mark.parametrize("name", TINY)
def test_bf16_checkpoint_streams_in_bf16_and_matches_the_f32_one_cast(name, tmp_path, monkeypatch):
    copy = bf16_sharded_copy(FIXTURES / name, tmp_path / name)
    read_dtypes = set()
    read = SafetensorsFile.read

    def spy(self, tensor):
        array = read(self, tensor)
        read_dtypes.add(array.dtype)
        return array

    monkeypatch.setattr(SafetensorsFile, "read", spy)
    bf16 = load_model(copy, dtype="bfloat16")
    assert read_dtypes == {np.dtype(ml_dtypes.bfloat16)}  # no float32 copy on the host
    reference = load_model(FIXTURES / name, dtype="bfloat16")  # float32 on disk, rounded on the device
    for got, want in zip(jax.tree.leaves(bf16.weights), jax.tree.leaves(reference.weights), strict=True):
        assert got.dtype == want.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    widened = load_model(copy, dtype="float32")
    for got, want in zip(jax.tree.leaves(widened.weights), jax.tree.leaves(reference.weights), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(np.float32))


def test_shardings_place_each_weight():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    loaded = load_model(FIXTURES / "tiny-llama3", dtype="float32", shardings=lambda config: jax.tree.map(
        lambda _: sharding, param_specs(config), is_leaf=is_spec))
    assert all(x.sharding == sharding for x in jax.tree.leaves(loaded.weights))


def test_a_missing_tensor_is_named(tmp_path):
    copy = bf16_sharded_copy(FIXTURES / "tiny-llama3", tmp_path / "m")
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="model.layers.1.mlp.down_proj.weight"):
        checkpoint.load_model(copy, dtype="float32")


def test_every_supported_model_type_has_a_name_table():
    assert set(ARCHITECTURES) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", TINY)
def test_the_name_table_names_exactly_the_checkpoints_tensors(name):
    config = ModelConfig.from_hf(json.loads((FIXTURES / name / "config.json").read_text()))
    names = {t.name for t in jax.tree.leaves(hf_tensors(config))}
    assert len(names) == len(jax.tree.leaves(param_specs(config), is_leaf=is_spec))
    assert names == set(SafetensorsFile(FIXTURES / name / "model.safetensors").names())


def test_gguf_names_map_to_the_hf_names_of_the_same_weight():
    arch = GGUF_ARCHITECTURES["qwen3"]
    for field, tensor in {**arch.model_tensors, **arch.layer_tensors}.items():
        assert gguf_to_hf_name(arch, tensor.gguf.format(layer=11)) == tensor.hf.format(layer=11), field
    assert gguf_to_hf_name(arch, "blk.0.attn_qkv.weight") is None

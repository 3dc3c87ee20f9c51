"""Orbax checkpoints: convert once, restore bit-for-bit, restore shards straight onto their devices.

- A tiny Hugging Face fixture and the default GGUF model survive save -> restore bit-for-bit
  (weights, config, tokenizer, chat template), and ``LLM`` on the converted directory
  generates the same greedy tokens as on the source.
- ``jaxinfer convert`` writes a bfloat16 checkpoint and refuses to write over a directory.
- On 8 simulated CPU devices, restoring a 368 MiB model split 8 ways takes about one model's
  worth of host memory, where one full copy per device would take 8 (a replicated restore,
  run as the control, shows the measurement sees exactly that).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import load_model
from jaxinfer.cli import main
from jaxinfer.config import ModelConfig
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.orbax_checkpoint import MARKER, hf_config, restore, save
from jaxinfer.params import is_spec, param_specs

from .conftest import FIXTURES, REPO
from .subprocess_report import read_report

# Compiled on first use (no warm-up): one prompt needs one prefill and one decode program,
# which the second engine (same shapes) finds in the compilation cache.
ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 128, "num_pages": 160,
          "use_tqdm": False, "warm_up": False}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _assert_same_tokenizer(a, b):
    for field in ("chat_template", "bos_token", "eos_token", "special_tokens", "eos_token_ids"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    assert a.encode_chat(CHAT) == b.encode_chat(CHAT)


def _greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def _check_round_trip(source: LoadedModel, out: Path):
    save(source, out)
    converted = load_model(out, dtype="float32")
    assert converted.config == source.config
    _assert_bitwise_equal(converted.weights, source.weights)
    _assert_same_tokenizer(converted.tokenizer, source.tokenizer)
    assert _greedy(LLM(str(out), dtype="float32", **ENGINE)) == _greedy(LLM(loaded=source, **ENGINE))


def test_tiny_hf_round_trip(tmp_path):
    _check_round_trip(load_model(FIXTURES / "tiny-llama3", dtype="float32"), tmp_path / "orbax")


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_optional_weights_and_config_flags_round_trip(tmp_path, name):
    source = load_model(FIXTURES / name, dtype="float32")  # q/k/v bias, q/k norm, sliding window
    restored = restore(save(source, tmp_path / name))
    assert restored.config == source.config
    _assert_bitwise_equal(restored.weights, source.weights)
    _assert_same_tokenizer(restored.tokenizer, source.tokenizer)


def test_a_restored_model_warms_up_compiling_each_program_once(tmp_path):
    # Orbax restores committed arrays; the runner's state was not, so each program's first run
    # after warm-up compiled it again, serially (17 of a tiny model's; sharding.placement.commit_beside).
    from jaxinfer.runner import ModelRunner

    restored = restore(save(load_model(FIXTURES / "tiny-llama3", dtype="float32"), tmp_path / "orbax"))
    assert {leaf.committed for leaf in jax.tree.leaves(restored.weights)} == {True}
    runner = ModelRunner(restored, num_pages=64, page_size=16, max_model_len=256, max_num_seqs=16,
                         max_num_batched_tokens=256)
    runner.warm_up(use_tqdm=False)
    assert runner.warmup_recompiles == 0
    assert runner.cache.k[0].committed and runner.token_pages.committed


def test_restore_casts_to_the_requested_dtype(tmp_path):
    source = load_model(FIXTURES / "tiny-qwen2", dtype="float32")
    restored = restore(save(source, tmp_path / "orbax"), dtype=jnp.bfloat16)
    _assert_bitwise_equal(restored.weights, jax.tree.map(lambda x: x.astype(jnp.bfloat16), source.weights))


def test_hf_config_round_trips_llama31_rope_scaling():
    config = ModelConfig.from_hf(json.loads((FIXTURES / "tiny-llama3" / "config.json").read_text()))
    scaled = json.loads((FIXTURES / "tiny-llama3" / "config.json").read_text()) | {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }
    for c in (config, ModelConfig.from_hf(scaled)):
        assert ModelConfig.from_hf(hf_config(c)) == c


def test_convert_command_writes_bfloat16_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", "--model", str(FIXTURES / "tiny-llama3"), "--output", str(out), "--dtype", "bf16"]) == 0
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"
    source = load_model(FIXTURES / "tiny-llama3", dtype="bfloat16")
    _assert_bitwise_equal(load_model(out, dtype="bfloat16").weights, source.weights)
    assert main(["convert", "--model", str(FIXTURES / "tiny-llama3"), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_load_model_lays_out_any_format_by_the_given_shardings(tmp_path):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    seen = []

    def shardings(config):
        seen.append(config)
        return jax.tree.map(lambda _: device, param_specs(config), is_leaf=is_spec)

    source = load_model(FIXTURES / "tiny-qwen3", dtype="float32", shardings=shardings)
    restored = load_model(save(source, tmp_path / "orbax"), dtype="float32", shardings=shardings)
    assert seen == [source.config, source.config]
    assert all(x.sharding == device for x in jax.tree.leaves(restored.weights) + jax.tree.leaves(source.weights))


@pytest.mark.slow
def test_default_gguf_model_round_trip(tmp_path, default_model):
    _check_round_trip(default_model, tmp_path / "orbax")


# 92M parameters, float32: 368 MiB; every sharded dimension divides 8, so each device holds 1/8.
BIG = ModelConfig(model_type="llama", vocab_size=16384, hidden_size=1024, intermediate_size=4096, num_layers=4,
                  num_q_heads=16, num_kv_heads=8, head_dim=64)

# Runs in a fresh process: XLA_FLAGS must be set before jax starts, and ru_maxrss is per process.
RESTORE_SCRIPT = """
import hashlib, json, os, sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.checkpoint import load_model
from sharding.mesh import make_mesh
from sharding.rules import weight_shardings

big, small, layout = sys.argv[1:]
mesh = make_mesh(tensor_parallel_size=8)
if layout == "sharded":
    shardings = lambda config: weight_shardings(config, mesh)
else:  # the control: a full copy on every device
    shardings = lambda config: jax.tree.map(lambda _: NamedSharding(mesh, P()), weight_shardings(config, mesh))


def status(field):  # VmRSS: resident now; VmHWM: its high-water mark. Both in kB.
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


load_model(small, "float32", shardings)  # one-time costs (thread pools, tensorstore contexts, lazy imports)
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident size
model = load_model(big, "float32", shardings)
jax.block_until_ready(model.weights)
peak = status("VmHWM")
device_bytes = sum(s.data.nbytes for x in jax.tree.leaves(model.weights) for s in x.addressable_shards)
max_device_bytes = max(
    sum(s.data.nbytes for x in jax.tree.leaves(model.weights) for s in x.addressable_shards if s.device == d)
    for d in jax.devices()
)
hashes = [hashlib.sha1(np.asarray(x).tobytes()).hexdigest() for x in jax.tree.leaves(model.weights)]
report = dict(peak_delta=peak - before, device_bytes=device_bytes, max_device_bytes=max_device_bytes, hashes=hashes)
print("REPORT " + json.dumps(report))  # tests/subprocess_report.py reads it
"""


def _restore_in_subprocess(big: Path, small: Path, layout: str, env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RESTORE_SCRIPT, str(big), str(small), layout], cwd=REPO, env=os.environ | (env or {}),
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_report(result.stdout)


def test_sharded_restore_takes_one_model_of_host_memory_not_one_per_device(tmp_path):
    """Peak host memory of restoring a 368 MiB model onto 8 CPU devices, split by the sharding rules.

    Measured in a fresh process, after a warm-up restore of a tiny checkpoint, as the kernel's
    high-water mark of resident memory (VmHWM, reset just before the restore) minus the resident
    size before it. That covers the whole process, C++ included (XLA's CPU buffers, tensorstore's
    reads), which tracemalloc cannot see, and is a true peak, so a transient copy freed before
    the restore returns still counts. Not ru_maxrss: Linux carries it over from the parent
    through fork and exec, so under pytest it reports the test process's size.

    Measured on 2 CPU cores (MiB; the model is 368, one copy per device would be 2944):
    - split 8 ways: 540-590 (1.45-1.6x). Of that, 368 are the restored shards themselves (CPU
      "devices" live in host memory); the rest is Orbax's per-shard read buffers, freed but kept
      by glibc's malloc for reuse.
    - the same with MALLOC_MMAP_THRESHOLD_=1 MiB (big buffers go back to the OS when freed):
      about 398 (1.08x): the restore never holds much more than one model.
    - the control, a full copy per device: 3080-3210 (8.4-8.7x).
    """
    rng = np.random.default_rng(0)
    # numpy draws these 92M values in about a second; init_random's threefry takes ~20 s on 2 cores.
    weights = jax.tree.map(
        lambda spec: jnp.asarray(rng.standard_normal(spec.shape, dtype=np.float32)), param_specs(BIG), is_leaf=is_spec
    )
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(weights))
    hashes = [hashlib.sha1(np.asarray(x).tobytes()).hexdigest() for x in jax.tree.leaves(weights)]
    tiny = load_model(FIXTURES / "tiny-llama3", dtype="float32")
    save(LoadedModel(BIG, weights, tiny.tokenizer, Path("random")), tmp_path / "big")
    del weights
    save(tiny, tmp_path / "small")

    mib = 2**20
    sharded = _restore_in_subprocess(tmp_path / "big", tmp_path / "small", "sharded")
    assert sharded["hashes"] == hashes
    assert sharded["device_bytes"] < 1.01 * model_bytes  # each weight once, split over the devices
    assert sharded["max_device_bytes"] < 1.01 * model_bytes / 8
    message = f"peak {sharded['peak_delta'] / mib:.0f} MiB for a {model_bytes / mib:.0f} MiB model"
    assert sharded["peak_delta"] < 2 * model_bytes, message

    unretained = _restore_in_subprocess(
        tmp_path / "big", tmp_path / "small", "sharded", env={"MALLOC_MMAP_THRESHOLD_": str(mib)}
    )
    message = f"peak {unretained['peak_delta'] / mib:.0f} MiB for a {model_bytes / mib:.0f} MiB model"
    assert unretained["peak_delta"] < 1.3 * model_bytes, message

    replicated = _restore_in_subprocess(tmp_path / "big", tmp_path / "small", "replicated")
    assert replicated["hashes"] == hashes
    assert replicated["device_bytes"] > 7.9 * model_bytes
    message = f"control: peak {replicated['peak_delta'] / mib:.0f} MiB for 8 copies of {model_bytes / mib:.0f} MiB"
    assert replicated["peak_delta"] > 7 * model_bytes, message

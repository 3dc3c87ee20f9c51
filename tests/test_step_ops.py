"""What one layer of the GPU decode step emits stays small (benchmarks/step_ops.py; issue 21's batch-1 decode).

At batch 1 each kernel the step launches costs a few µs whatever it does, so ops that come back
into the layer cost time even when they compute little. These tests lower the engine's GPU decode
step (bucket 8x8, ``pallas_gpu``) for CUDA from the CPU, take one layer's StableHLO ops (3 layers
minus 2), and bound the kinds that were removed from the model's part of it: RoPE's sin/cos (made
once per step now), its split halves and concatenate, and the converts around them. Counts, not
timing; the kernel wrapper's own ops (K/V scatter, work tiles, split merge) belong to the kernel
owners and are only bounded as kernel boundaries of the whole layer.
"""

import pytest

from benchmarks.model_shapes import SHAPES
from benchmarks.step_ops import ATTENTION_WRAPPERS, KERNEL_BOUNDARY_OPS, StepShape, per_layer_op_counts

# The model's ops in one layer of the bf16 decode step (sharing-free count, 3 layers minus 2), as of
# the RoPE change; before it: 106, with 2 sine, 2 cosine, 2 concatenate, 4 slice and 10 convert.
MODEL_OPS_PER_LAYER = 76


@pytest.fixture(scope="module")
def bf16_layer():
    shape = StepShape(SHAPES["tiny"], weights="bf16")
    return per_layer_op_counts(shape, "cuda"), per_layer_op_counts(shape, "cuda", skip_calls_to=ATTENTION_WRAPPERS)


def test_rope_is_made_once_per_step_and_has_no_split(bf16_layer):
    layer, model = bf16_layer
    for op in ("sine", "cosine"):
        assert layer.get(op, 0) == 0, f"{op} in every layer: RoPE tables belong to the step (model.rope_tables)"
    for op in ("concatenate", "slice"):
        assert model.get(op, 0) == 0, f"{op} in the model's layer: RoPE rotates without splitting (model.apply_rope)"
    # Two norms and two RoPEs, each converting in and out of float32: nothing converts twice.
    assert model.get("convert", 0) <= 8, model


def test_model_ops_per_layer_do_not_grow(bf16_layer):
    layer, model = bf16_layer
    # The attention is one call to a kernel wrapper, whichever serves it (only those stay calls).
    calls = {op: n for op, n in model.items() if op.startswith("call:")}
    assert sum(calls.values()) == 1 and all(op[len("call:"):].startswith(ATTENTION_WRAPPERS) for op in calls), calls
    assert model.get("dot_general", 0) == 7, model  # q, k, v, o, gate, up, down
    assert model.get("reduce", 0) == 2, model  # the two RMSNorms
    assert sum(model.values()) <= MODEL_OPS_PER_LAYER, model


def test_layer_kernel_boundaries_do_not_grow(bf16_layer):
    layer, _ = bf16_layer
    # 7 projections + the split merge's dot, 2 norms + 4 reductions of the wrapper (merge, tile plan),
    # the K and V scatters, the kernel. A fused K/V write would take the scatters away.
    boundaries = {op: layer.get(op, 0) for op in KERNEL_BOUNDARY_OPS}
    assert sum(boundaries.values()) <= 17, boundaries
    assert 1 <= boundaries["custom_call"] and boundaries["scatter"] <= 2, boundaries


def test_fp8_weights_add_no_rope_work():
    model = per_layer_op_counts(StepShape(SHAPES["tiny"], weights="fp8"), "cuda", skip_calls_to=ATTENTION_WRAPPERS)
    assert model.get("sine", 0) == model.get("cosine", 0) == model.get("concatenate", 0) == 0, model
    assert model.get("dot_general", 0) == 7, model


def test_compiled_layer_kernels_are_listed_with_their_ops():
    """The GPU view of the tool (compiled layer 1's kernels), run on XLA:CPU's program."""
    from benchmarks.step_ops import layer_kernels, trace_step

    compiled = trace_step(StepShape(SHAPES["tiny"], impl="cpu"), 3).lower().compile().as_text()
    kernels = layer_kernels(compiled, layer=1)
    ops = [k["jax_op"] for k in kernels]
    assert kernels and all(k["hlo"] and k["op"] for k in kernels), kernels
    assert any(op.startswith("attention/") for op in ops) and any(op.startswith("mlp/") for op in ops), ops
    # Layer 1's projections are there, and no other layer's (3 MLP dots, not 9).
    assert sum(op.startswith("mlp/") and op.endswith("dot_general") for op in ops) == 3, ops


def test_step_ops_cli_writes_the_layer_counts(tmp_path):
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "benchmarks/step_ops.py", "--shape", "tiny", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "step_ops.json").read_text())
    assert results["platform"] == "cuda" and results["bucket"] == [8, 8]
    assert results["stablehlo_ops_per_layer"]["custom_call"] >= 1  # the Triton kernel, lowered without a GPU
    assert results["model_stablehlo_ops_per_layer"]["dot_general"] == 7
    import jax

    # The compiled view comes only where the program can be compiled for the GPU.
    assert ("layer_1_kernels" in results) == (jax.default_backend() == "gpu")
    assert "kernel boundaries" in (tmp_path / "step_ops.md").read_text()

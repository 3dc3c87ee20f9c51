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


# XLA:GPU's optimized HLO as printed: kernels inside a command buffer's computation (one CUDA graph)
# reached through a call, and a custom call with a tuple shape (the split kernel's two outputs).
GPU_LIKE_HLO = """HloModule jit_step, entry_computation_layout={(bf16[8,64]{1,0})->bf16[8,64]{1,0}}

%fused_add (param_0: bf16[8,64], param_1: bf16[8,64]) -> bf16[8,64] {
  %param_0 = bf16[8,64]{1,0} parameter(0)
  %param_1 = bf16[8,64]{1,0} parameter(1)
  %convert.2 = f32[8,64]{1,0} convert(%param_1), metadata={op_name="jit(step)/layer_1/mlp/convert_element_type"}
  ROOT %add.3 = bf16[8,64]{1,0} add(%param_0, %param_1), metadata={op_name="jit(step)/layer_1/mlp/add"}
}

%command_buffer (p0: bf16[8,64], p1: bf16[8,64]) -> bf16[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[8,64]{1,0} parameter(1)
  ROOT %loop_add_fusion.1 = bf16[8,64]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/layer_1/mlp/add"}
}

ENTRY %main.9 (Arg_0.1: bf16[8,64]) -> bf16[8,64] {
  %Arg_0.1 = bf16[8,64]{1,0} parameter(0)
  %custom-call.4 = (f32[8,9]{1,0}, f32[8]{0}) custom-call(%Arg_0.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/layer_1/attention/ragged_paged_attention_gpu/pallas_call"}
  %get-tuple-element.5 = f32[8,9]{1,0} get-tuple-element(%custom-call.4), index=0
  %call.6 = bf16[8,64]{1,0} call(%Arg_0.1, %Arg_0.1), to_apply=%command_buffer
  %fusion.7 = bf16[8,64]{1,0} fusion(%call.6, %Arg_0.1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/layer_0/mlp/add"}
  ROOT %copy.8 = bf16[8,64]{1,0} copy(%fusion.7)
}
"""


def test_layer_kernels_reads_command_buffers_and_tuple_shapes():
    from benchmarks.step_ops import kernels_by_layer, layer_kernels

    kernels = layer_kernels(GPU_LIKE_HLO, layer=1)
    assert [(k["hlo"], k["op"], k["kind"]) for k in kernels] == [
        ("custom-call.4", "custom-call", "__gpu$xla.gpu.triton"), ("loop_add_fusion.1", "fusion", "kLoop")]
    assert kernels[0]["shape"] == "(f32[8,9]{1,0}, f32[8]{0})"
    assert kernels[0]["jax_op"] == "attention/ragged_paged_attention_gpu/pallas_call"
    assert kernels[1]["jax_ops_fused"] == ["mlp/convert_element_type", "mlp/add"]
    assert kernels_by_layer(GPU_LIKE_HLO) == {"layer_0": 1, "layer_1": 2, "step": 1}  # the copy is XLA's

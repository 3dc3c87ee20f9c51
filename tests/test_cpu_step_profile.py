"""benchmarks/cpu_step_profile.py's attribution of traced XLA ops to parts of a step, on hand-made events."""

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_step_profile import categorise, parts  # noqa: E402

VOCAB = 100


def event(op, ts, dur, module="jit__forward_step", tid=1):
    return {"ph": "X", "tid": tid, "ts": ts, "dur": dur, "args": {"hlo_module": module, "hlo_op": op}}


def test_ops_are_attributed_by_kind_shape_and_scope():
    assert categorise("jit__forward_step", "dot.3", f"f32[1,{VOCAB}]{{1,0}}", "", VOCAB) == "lm_head"
    assert categorise("jit__forward_step", "ffi_call.7", "f32[1,1536]{1,0}", "", VOCAB) == "layer matmuls"
    assert categorise("jit__forward_step", "ffi_call.8", "(f32[1,9,64]{2,1,0}, f32[3,8,32,64])",
                      "jit(f)/layer_0/attention/ffi_call/jaxinfer_paged_attention_cpu", VOCAB).startswith("attention other")
    assert categorise("jit__forward_step", "ffi_call.9", f"f32[1,{VOCAB}]{{1,0}}", "jit(f)/ffi_call", VOCAB) == "lm_head"
    assert categorise("jit__forward_step", "fusion.2", "f32[1,576]", "jit(f)/layer_3/attention/rope/mul",
                      VOCAB).startswith("attention other")
    assert categorise("jit__sample_step", "dot.1", f"f32[1,{VOCAB}]", "", VOCAB) == "sampler"
    assert categorise("jit__forward_step", "copy.1", "f32[4]", "", VOCAB).startswith("forward other")


def test_nested_ops_count_once_and_time_is_per_step():
    op_names = {"while.1": ("f32[1,64]", "jit(f)/layer_0/attention/while"),
                "dot.9": ("f32[1,64]", "jit(f)/layer_0/attention/while/body/dot_general"),
                "dot.2": (f"f32[1,{VOCAB}]", "")}
    ops = [event("while.1", 0, 3000), event("dot.9", 100, 1000),  # inside the while: not counted again
           event("dot.2", 5000, 2000), event("argmax.1", 0, 400, module="jit__sample_step", tid=2)]
    got = parts(ops, op_names, steps=2, vocab=VOCAB)
    assert got == {"attention other (norm, rope, cache write, attention)": 1.5, "lm_head": 1.0, "sampler": 0.2}

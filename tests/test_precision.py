"""float32 means float32 on every platform: each matmul of the model and of its attention kernels
asks for HIGHEST precision when its operands are float32, and keeps JAX's default in bfloat16.

At JAX's default precision a float32 dot may round its operands to TF32 (GPU) or to bfloat16
passes (TPU), while the CPU computes float32 either way: so these tests read the precision off
the traced and lowered programs, not off the numbers a CPU would give.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import jaxprs_in_params

from jaxinfer import cpu_paged_attention
from jaxinfer.batch import build_step_batch
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.model import forward
from jaxinfer.params import init_random
from pallas_kernels.paged_attention import ragged_paged_attention_gpu
from pallas_kernels.precision import matmul_precision
from tests.attention_cases import make_case

HIGHEST = jax.lax.Precision.HIGHEST
PAGE_SIZE = 16
# Two layers, GQA 2, untied lm_head: per layer q, k, v, o, gate, up, down, plus the lm_head.
CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_q_heads=4, num_kv_heads=2, head_dim=16)
NUM_PROJECTIONS = 7 * CONFIG.num_layers + 1
# (new tokens, start position, pages) per sequence: a prefill beside a decode, and decodes
# alone (decode-like: the GPU kernel splits the KV walk and merges the splits with a dot).
BATCHES = {
    "prefill_and_decode": ([([1, 2, 3, 4, 5], 0, [1]), ([6], 20, [2, 3])], 8),
    "decodes": ([([7], 9, [1]), ([8], 20, [2, 3])], 2),
}


def _step_args(dtype, batch_name):
    weights = jax.eval_shape(lambda: init_random(CONFIG, jax.random.key(0), dtype))
    cache = jax.eval_shape(lambda: create_kv_cache(CONFIG, 4, PAGE_SIZE, dtype))
    chunks, num_tokens = BATCHES[batch_name]
    batch = build_step_batch(chunks, num_tokens=num_tokens, num_seqs=2, pages_per_seq=2)
    return weights, cache, jax.tree.map(jnp.asarray, batch)


def _attention_dots_per_layer(impl, dtype) -> int:
    """Q.K and P.V: 2 dots a layer, except where the CPU's native attention (C++ through the XLA
    FFI, float32 arithmetic by construction) replaces them."""
    native = impl == "cpu" and cpu_paged_attention.supports(dtype)
    return 0 if native else 2


def _dot_precisions(jaxpr, in_kernel=False):
    """(inside a pallas_call?, precision) of every dot_general in ``jaxpr`` and the jaxprs it calls."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield in_kernel, eqn.params["precision"]
        for sub in jaxprs_in_params(eqn.params):
            yield from _dot_precisions(sub, in_kernel or eqn.primitive.name == "pallas_call")


def test_matmul_precision_is_highest_only_for_float32():
    assert matmul_precision(jnp.float32) == HIGHEST
    assert matmul_precision(jnp.dtype("float32")) == HIGHEST
    assert matmul_precision(jnp.bfloat16) is None
    assert matmul_precision(jnp.float16) is None


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas_gpu_interpret"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lowered_step_runs_every_dot_at_its_dtypes_precision(dtype, impl):
    # The StableHLO the step compiles from: every dot_general carries its precision_config.
    step = jax.jit(forward, static_argnums=(3, 4))
    text = step.lower(*_step_args(jnp.dtype(dtype), "prefill_and_decode"), CONFIG, impl).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    # Projections and the lm_head, and Q.K and P.V of each layer's attention.
    attention_dots = _attention_dots_per_layer(impl, dtype)
    assert len(dots) >= NUM_PROJECTIONS + attention_dots * CONFIG.num_layers
    if attention_dots == 0:
        assert text.count(cpu_paged_attention.TARGET_NAME) == CONFIG.num_layers
    want = "HIGHEST" if dtype == "float32" else "DEFAULT"
    precisions = {re.search(r"precision = \[(\w+), (\w+)\]", line).groups() for line in dots}
    assert precisions == {(want, want)}


@pytest.mark.parametrize("batch_name", sorted(BATCHES))
@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_traced_step_and_kernels_ask_for_their_dtypes_precision(dtype, impl, batch_name):
    # The kernels' own dots live inside their pallas_call, which only their GPU or TPU lowering
    # turns into Triton or Mosaic: read them off the jaxpr (precision HIGHEST becomes Triton's
    # IEEE float32 dot and Mosaic's contract_precision<fp32>).
    jaxpr = jax.make_jaxpr(forward, static_argnums=(3, 4))(*_step_args(jnp.dtype(dtype), batch_name), CONFIG, impl)
    found = list(_dot_precisions(jaxpr.jaxpr))
    want = (HIGHEST, HIGHEST) if dtype == "float32" else None
    assert {precision for _, precision in found} == {want}
    # Q.K and P.V at least once per layer (the GPU kernel has them in each of its three KV loops).
    in_kernel = sum(inside for inside, _ in found)
    assert in_kernel == 0 if impl in ("reference", "cpu") else in_kernel >= 2 * CONFIG.num_layers
    assert len(found) >= NUM_PROJECTIONS + _attention_dots_per_layer(impl, dtype) * CONFIG.num_layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernel_merges_its_splits_at_its_dtypes_precision(dtype):
    # The split outputs are float32 in either dtype. By default a Pallas kernel merges them with
    # float32 elementwise sums (no dot outside the attention kernel); XLA's merge, when asked
    # for, is an einsum at the precision of q's dtype.
    case = make_case(0, [(1, 40), (1, 9)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     dtype=jnp.dtype(dtype))
    want = (HIGHEST, HIGHEST) if dtype == "float32" else None
    for merge_kernel, outside_want in ((None, []), (False, [want])):
        jaxpr = jax.make_jaxpr(lambda *args: ragged_paged_attention_gpu(
            *args, sm_scale=0.125, num_splits=3, merge_kernel=merge_kernel))(*case.args())
        found = list(_dot_precisions(jaxpr.jaxpr))
        outside_kernel = [precision for inside, precision in found if not inside]
        assert outside_kernel == outside_want and {precision for _, precision in found} == {want}

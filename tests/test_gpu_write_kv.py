"""``gpu_write_kv.write_kv_gpu`` (one launch for K and V) against ``write_kv_reference``, in Pallas's
interpreter: decode rows, a prefill, a chunk over a cached prefix, empty slots and padding rows,
over bf16 and e4m3 pages; and its Triton lowering for an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.gpu_write_kv import BLOCK_TOKENS, write_kv_gpu
from pallas_kernels.paged_attention.reference import write_kv_reference
from tests.attention_cases import make_case

SEQS = [(1, 40), (70, 70), (0, 0), (37, 100), (1, 1)]  # decode, fresh prompt, empty, chunk over a prefix, first token
# (each program finds its tokens' sequences and slots itself: the 7 padding rows and the empty
# slot between live ones check that search)


@pytest.mark.parametrize("page_dtype, seqs", [(jnp.bfloat16, SEQS), (jnp.float8_e4m3fn, SEQS),
                                               (jnp.bfloat16, SEQS * 4)])  # 20 sequence slots: past 16
def test_one_launch_writes_what_the_two_scatters_write(page_dtype, seqs):
    case = make_case(3, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=7)
    assert case.q.shape[0] % BLOCK_TOKENS  # a partial last block
    k_pages, v_pages = case.k_pages.astype(page_dtype), case.v_pages.astype(page_dtype)
    k_new, v_new = case.k_new.astype(page_dtype), case.v_new.astype(page_dtype)
    args = (k_new, v_new, k_pages, v_pages, case.page_tables, case.cu_q_lens, case.kv_lens)
    want = write_kv_reference(*args)
    got = jax.jit(lambda *a: write_kv_gpu(*a, interpret=True))(*[jnp.array(a) for a in args])
    for g, w, before in zip(got, want, (k_pages, v_pages)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    changed = np.asarray(got[0] != k_pages)
    assert changed.any() and not changed.all()  # it wrote this step's rows, and only those


def test_lowers_for_an_h200_from_a_cpu():
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    spec = jax.ShapeDtypeStruct
    args = (spec((4096, 8, 128), jnp.bfloat16), spec((4096, 8, 128), jnp.bfloat16),
            spec((8, 512, 32, 128), jnp.bfloat16), spec((8, 512, 32, 128), jnp.bfloat16),
            spec((4, 128), jnp.int32), spec((5,), jnp.int32), spec((4,), jnp.int32))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(write_kv_gpu, donate_argnums=(2, 3)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "write_kv" in text and "triton" in text
    assert "stablehlo.scatter" not in text  # no XLA scatter left: the pages are written by the kernel
    # ... and the slots are found inside it: no XLA ops left to compute them (a fusion a layer).
    assert "stablehlo.compare" not in text and "stablehlo.gather" not in text


def test_the_gpu_kernel_with_the_pallas_write_matches_its_default():
    """``ragged_paged_attention_gpu(kv_write="pallas")`` (opt-in): the same output and pages as its
    default, XLA's scatters, in the interpreter."""
    from pallas_kernels.paged_attention.gpu import ragged_paged_attention_gpu

    case = make_case(4, SEQS, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=7)
    results = {}
    for kv_write in ("xla", "pallas"):
        args = [jnp.array(a) for a in case.args()]  # fresh pages: the call donates them
        results[kv_write] = ragged_paged_attention_gpu(*args, sm_scale=case.sm_scale, interpret=True,
                                                       kv_write=kv_write)
    for got, want in zip(results["pallas"], results["xla"], strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="kv_write must be one of"):
        ragged_paged_attention_gpu(*[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, interpret=True,
                                   kv_write="triton")

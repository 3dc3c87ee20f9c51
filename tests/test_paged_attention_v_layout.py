"""Dim-major V pages (``v_layout.py``): the write and the GPU kernel's transposed V loads, against
the token-major reference, in interpret mode on CPU; and the Triton lowering of that kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.block_sizes import BlockSizes
from pallas_kernels.paged_attention.gpu import attend_gpu
from pallas_kernels.paged_attention.page_storage import to_page_storage
from pallas_kernels.paged_attention.reference import attend_reference, kv_slots, write_kv_reference
from pallas_kernels.paged_attention.v_layout import _write_whole_pages, to_dim_major, write_kv_dim_major_v
from tests.attention_cases import make_case

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def _as_f32(x):
    return np.asarray(x.astype(F32))


@pytest.mark.parametrize("page_dtype", [F32, FP8])
def test_dim_major_write_stores_what_the_reference_stores_transposed(page_dtype):
    # Decode and prefill tokens, an empty slot, two padding tokens (dropped), NaN in unowned rows (kept).
    case = make_case(3, [(1, 40), (0, 0), (9, 9), (1, 17)], num_q_heads=4, num_kv_heads=2, head_dim=32,
                     page_size=8, pad_tokens=2)
    k_new, v_new, k_pages, v_pages = (x.astype(page_dtype) for x in (case.k_new, case.v_new, case.k_pages,
                                                                        case.v_pages))
    rest = (case.page_tables, case.cu_q_lens, case.kv_lens)
    ref_k, ref_v = write_kv_reference(k_new, v_new, k_pages, v_pages, *rest)
    got_k, got_v = write_kv_dim_major_v(k_new, v_new, k_pages, to_dim_major(v_pages), *rest)
    assert got_v.shape == to_dim_major(v_pages).shape and got_v.dtype == page_dtype
    np.testing.assert_array_equal(_as_f32(got_k), _as_f32(ref_k))
    np.testing.assert_array_equal(_as_f32(got_v), _as_f32(to_dim_major(ref_v)))


@pytest.mark.parametrize("page_dtype", [F32, FP8])
def test_dim_major_write_stores_whole_pages_where_a_step_fills_them(page_dtype):
    # Prompt chunks that start mid-page, at a page's start, end at a page's end, span several whole
    # pages or none; decode rows and padding between. Pages filled whole go through the page write
    # (the rows it took are dropped from the scatter); what lands equals the reference transposed.
    seqs = [(37, 40), (1, 17), (16, 16), (8, 24), (5, 13), (0, 0), (30, 30)]
    case = make_case(5, seqs, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8, pad_tokens=3)
    k_new, v_new, k_pages, v_pages = (x.astype(page_dtype) for x in (case.k_new, case.v_new, case.k_pages,
                                                                        case.v_pages))
    rest = (case.page_tables, case.cu_q_lens, case.kv_lens)
    ref_k, ref_v = write_kv_reference(k_new, v_new, k_pages, v_pages, *rest)
    got_k, got_v = jax.jit(write_kv_dim_major_v)(k_new, v_new, k_pages, to_dim_major(v_pages), *rest)
    np.testing.assert_array_equal(_as_f32(got_k), _as_f32(ref_k))
    np.testing.assert_array_equal(_as_f32(got_v), _as_f32(to_dim_major(ref_v)))

    # Which rows the page write took: those of pages the step fills whole, and no other.
    num_pages, page_size = k_pages.shape[1:3]
    slot = kv_slots(case.page_tables, case.cu_q_lens, case.kv_lens, k_new.shape[0], num_pages, page_size)
    new_v = to_page_storage(v_new, page_dtype)
    _, left = _write_whole_pages(to_dim_major(v_pages), new_v, slot, page_size)
    taken = np.asarray(left) != np.asarray(slot)
    want = np.zeros(len(slot), bool)
    start = 0
    for q_len, kv_len in seqs:
        positions = np.arange(kv_len - q_len, kv_len)
        for page in set(positions // page_size):
            rows = positions // page_size == page
            want[start:start + q_len] |= rows if rows.sum() == page_size else False
        start += q_len
    assert want.sum() == 10 * 8  # 4 pages of the first prompt, 2 of the third, 1 of the fourth, 3 of the last
    np.testing.assert_array_equal(taken, want)


def test_dim_major_write_rejects_token_major_v_pages():
    case = make_case(3, [(1, 40)], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8)
    with pytest.raises(ValueError, match=r"dim-major v_pages must be \[Hkv, P, D, page_size\]"):
        write_kv_dim_major_v(case.k_new, case.v_new, case.k_pages, case.v_pages, case.page_tables,
                             case.cu_q_lens, case.kv_lens)


# (seqs, q dtype, page dtype, sizes): decode with splits over fp8 pages (the layout's purpose), a
# mixed prefill + decode batch at one split with blocks of two pages, f32 to the reference's precision
# with blocks of half a page, and blocks of four pages; contexts end mid-page and on a page boundary.
CASES = {
    "fp8_decode_splits": ([(1, 70), (1, 32), (0, 0), (1, 5)], BF16, FP8, BlockSizes(4, 16, 3, merge_kernel=True)),
    "bf16_mixed": ([(12, 40), (1, 64), (5, 5)], BF16, BF16, BlockSizes(8, 32, 1)),
    "f32_decode": ([(1, 37), (1, 16), (1, 1)], F32, F32, BlockSizes(4, 8, 2)),
    # Four pages a block, one part each, with splits: parts past a sequence's pages are masked.
    "fp8_four_pages_a_block": ([(1, 150), (1, 20), (3, 70)], BF16, FP8, BlockSizes(4, 64, 2, merge_kernel=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_kernel_reads_dim_major_v_pages_as_the_reference_reads_token_major(name):
    seqs, q_dtype, page_dtype, sizes = CASES[name]
    case = make_case(11, seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, pad_tokens=1)
    rest = (case.page_tables, case.cu_q_lens, case.kv_lens)
    # This step's K/V written first (the pages hold NaN where they go, as in the engine before its write).
    k_pages, v_pages = write_kv_reference(*(x.astype(page_dtype) for x in (case.k_new, case.v_new, case.k_pages,
                                                                          case.v_pages)), *rest)
    q = case.q.astype(q_dtype)
    want = attend_reference(q.astype(F32), k_pages.astype(F32), v_pages.astype(F32), *rest, sm_scale=case.sm_scale)
    got = attend_gpu(q, k_pages, to_dim_major(v_pages), *rest, sm_scale=case.sm_scale, sizes=sizes, interpret=True,
                     v_layout="dim_major")
    token_major = attend_gpu(q, k_pages, v_pages, *rest, sm_scale=case.sm_scale, sizes=sizes, interpret=True)
    assert got.shape == q.shape and got.dtype == q_dtype and not np.isnan(_as_f32(got)).any()
    tol = 1e-4 if q_dtype == F32 else 3e-2
    np.testing.assert_allclose(_as_f32(got), _as_f32(want), rtol=tol, atol=tol)
    # Same values in, the same sums: the layout changes only how V reaches the dot.
    np.testing.assert_allclose(_as_f32(got), _as_f32(token_major), rtol=tol / 10, atol=tol / 10)


def test_gpu_kernel_rejects_an_unknown_v_layout_and_mismatched_v_pages():
    case = make_case(11, [(1, 20)], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    args = (case.q, case.k_pages, case.v_pages, case.page_tables, case.cu_q_lens, case.kv_lens)
    with pytest.raises(ValueError, match="v_layout must be one of"):
        attend_gpu(*args, sm_scale=0.1, sizes=BlockSizes(4, 16, 1), interpret=True, v_layout="head_major")
    with pytest.raises(ValueError, match="do not hold k_pages"):
        attend_gpu(case.q, case.k_pages, case.v_pages[:, :-1], *args[3:], sm_scale=0.1, sizes=BlockSizes(4, 16, 1),
                   interpret=True, v_layout="dim_major")


@pytest.mark.parametrize("block_kv", [64, 16])  # a block of two pages; a block of half a page
def test_gpu_kernel_over_dim_major_fp8_v_pages_lowers_through_triton_from_cpu(block_kv, monkeypatch):
    # Pallas -> Triton IR for an abstract H200: catches what interpret mode does not (the transposed
    # gather and the dot's trans_b on a widened fp8 tile), and checks that every V^T tile's addresses
    # are built from ranges and scalars only, and its masks from scalars only. An elementwise select
    # in the addresses (jnp's `%` lowers to one) hides their contiguity from Triton, which then loads
    # the tile one byte a value, unpipelined: 0.67x the token-major kernel on an H100 (session 26)
    # until the columns were a plain range.
    from jax._src.lib.mlir import ir
    from jax._src.mesh import AbstractDevice, AbstractMesh
    from jax._src.pallas.triton import pallas_call_registration

    modules = []
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def keep_module(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module)
        return result

    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", keep_module)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    spec = jax.ShapeDtypeStruct
    num_kv_heads, num_pages, page_size, head_dim = 2, 64, 32, 128
    step = jax.jit(lambda q, k, v, pt, cu, kv: attend_gpu(q, k, v, pt, cu, kv, sm_scale=0.1, v_layout="dim_major",
                                                          sizes=BlockSizes(4, block_kv, 2, num_warps=2, num_stages=3,
                                                                           merge_kernel=True)))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = step.trace(spec((4, 8, head_dim), BF16), spec((num_kv_heads, num_pages, page_size, head_dim), FP8),
                             spec((num_kv_heads, num_pages, head_dim, page_size), FP8), spec((4, 16), jnp.int32),
                             spec((5,), jnp.int32), spec((4,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()

    def operations(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    yield inner
                    yield from operations(inner)

    def producers(value, found):  # every operation a value is computed from (block arguments end a path)
        owner = value.owner
        if isinstance(owner, ir.Block) or owner in found:
            return found
        found.append(owner)
        for operand in owner.operands:
            producers(operand, found)
        return found

    part = min(block_kv, page_size)
    v_tile_loads = [op for module in modules for op in operations(module.operation)
                    if op.name == "tt.load" and str(op.results[0].type).startswith(f"tensor<{head_dim}x{part}xf8")]
    assert len(v_tile_loads) >= 2  # the masked and the unmasked walk
    for load in v_tile_loads:
        elementwise_selects = [op.name for op in producers(load.operands[0], [])
                               if op.name == "arith.select" and str(op.results[0].type).startswith("tensor")]
        assert not elementwise_selects
    # An edge block's mask is one value for the whole tile (a mask varying along the columns would
    # limit the loads to a byte a value); its slots past the sequence's end are zeroed after the load.
    masked_loads = [load for load in v_tile_loads if len(load.operands) > 1]
    assert masked_loads
    for load in masked_loads:
        assert not [op for op in producers(load.operands[1], []) if op.name == "tt.make_range"]


# The engine's side: the dispatcher, the cache and the switch ------------------------------------------------


def _batch(case):
    from jaxinfer.batch import StepBatch

    return StepBatch(token_ids=None, positions=None, cu_q_lens=case.cu_q_lens, kv_lens=case.kv_lens,
                     page_tables=case.page_tables, logits_indices=None)


@pytest.mark.parametrize("impl", ["pallas_gpu_interpret"])
def test_dispatcher_over_dim_major_fp8_pages_equals_it_over_token_major(impl):
    # Scaled fp8 pages as the engine holds them; copies, since the kernel donates its pages.
    from jaxinfer.attention import paged_attention
    from jaxinfer.kv_cache_dtype import quantize_to_fp8

    case = make_case(5, [(1, 37), (6, 40), (0, 0), (17, 17)], num_q_heads=8, num_kv_heads=2, pad_tokens=2)
    k_scale, v_scale = jnp.float32(0.05), jnp.float32(3.0)
    k_pages, v_pages = quantize_to_fp8(case.k_pages, k_scale), quantize_to_fp8(case.v_pages, v_scale)
    common = dict(sm_scale=case.sm_scale, impl=impl, k_scale=k_scale, v_scale=v_scale)
    want, want_k, want_v = paged_attention(case.q, case.k_new, case.v_new, jnp.array(k_pages), jnp.array(v_pages),
                                           _batch(case), **common)
    got, got_k, got_v = paged_attention(case.q, case.k_new, case.v_new, jnp.array(k_pages), to_dim_major(v_pages),
                                        _batch(case), v_layout="dim_major", **common)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_as_f32(got_k), _as_f32(want_k))
    np.testing.assert_array_equal(_as_f32(got_v), _as_f32(to_dim_major(want_v)))  # NaN of unowned rows kept


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas_tpu_interpret", "pallas_gpu_fused_interpret"])
def test_dispatcher_refuses_dim_major_v_pages_where_the_kernel_cannot_read_them(impl):
    from jaxinfer.attention import check_v_layout

    with pytest.raises(ValueError, match=f"not by attention impl '{impl}'"):
        check_v_layout("dim_major", impl)
    with pytest.raises(ValueError, match="v_layout must be one of"):
        check_v_layout("transposed", "pallas_gpu")
    check_v_layout("token_major", impl)  # every implementation reads the engine's default


def _fp8_llm(**options):
    from jaxinfer import LLM

    from .conftest import FIXTURES

    return LLM(str(FIXTURES / "tiny-llama3"), dtype="float32", kv_cache_dtype="fp8", max_model_len=256,
               max_num_seqs=4, max_num_batched_tokens=32, num_pages=40, page_size=16, use_tqdm=False, max_wait_s=0.0,
               warm_up=False, **options)


def test_engine_with_dim_major_v_pages_generates_what_it_does_with_token_major(monkeypatch):
    # JAXINFER_V_LAYOUT is read once, when the engine is made: the cache's V arrays are dim-major and every
    # step reads them so. A 32-token budget chunks the prompts and mixes chunks with decode tokens.
    from jaxinfer import SamplingParams

    prompts = ["The quick brown fox jumps over the lazy dog " * 4, "hello", "Paged attention reads pages"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _fp8_llm(attention_impl="pallas_gpu_interpret").generate(
        prompts, params, use_tqdm=False)]
    monkeypatch.setenv("JAXINFER_V_LAYOUT", "dim_major")
    llm = _fp8_llm(attention_impl="pallas_gpu_interpret")
    cache = llm.engine.runner.cache
    assert cache.v_layout == "dim_major" and cache.v[0].shape == cache.k[0].shape[:2] + cache.k[0].shape[2:][::-1]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_engine_refuses_dim_major_v_pages_for_an_attention_that_cannot_read_them(monkeypatch):
    monkeypatch.setenv("JAXINFER_V_LAYOUT", "dim_major")
    with pytest.raises(ValueError, match=r"\$JAXINFER_V_LAYOUT='dim_major': dim-major V pages are read by the "
                                         r"pallas_gpu kernels only, not by attention impl 'cpu'"):
        _fp8_llm(attention_impl="cpu")
    monkeypatch.setenv("JAXINFER_V_LAYOUT", "sideways")
    with pytest.raises(ValueError, match="v_layout must be one of"):
        _fp8_llm(attention_impl="pallas_gpu_interpret")

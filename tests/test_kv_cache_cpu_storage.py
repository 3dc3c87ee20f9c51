"""FP8 pages on a CPU are held as uint8 bit patterns: the same bytes, the same results, no pool copies.

XLA:CPU has no float8 scatter or gather and runs them in float16 over the whole pool, converting
it there and back on every K/V write (``pallas_kernels/paged_attention/page_storage.py``). These
tests pin the fix: the bit pool holds exactly what an e4m3 pool would, the CPU path and the
reference read it identically, and the compiled CPU step never makes a pool-sized value of any
other dtype, nor copies the pool.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import paged_attention
from jaxinfer.batch import StepBatch, build_step_batch
from jaxinfer.checkpoint import load_model
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.kv_cache_dtype import is_fp8, page_array_dtype, quantize_to_fp8, storage_dtype
from jaxinfer.model import forward
from pallas_kernels.paged_attention.cpu import ragged_paged_attention_cpu
from pallas_kernels.paged_attention.page_storage import E4M3, E4M3_BITS, page_values, to_page_storage
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference
from tests.attention_cases import make_case

from .conftest import FIXTURES

# Optimized-HLO instruction results: "%name = f16[2,211,16,64]{3,2,1,0} fusion(" -> ("f16", "2,211,16,64", "fusion").
_RESULT = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s+([a-z-]+)\(", re.MULTILINE)
_HLO_DTYPES = {"u8": E4M3_BITS, "f8e4m3fn": E4M3, "f16": jnp.dtype(jnp.float16), "bf16": jnp.dtype(jnp.bfloat16),
               "f32": jnp.dtype(jnp.float32)}


def pool_sized_values(hlo_text: str, num_elements: int) -> list[tuple[str, str]]:
    """(dtype, opcode) of every instruction in ``hlo_text`` whose result has ``num_elements`` elements."""
    found = []
    for dtype, dims, opcode in _RESULT.findall(hlo_text):
        if dims and int(np.prod([int(d) for d in dims.split(",")])) == num_elements:
            found.append((dtype, opcode))
    return found


def bit_pages(pages):
    return jax.lax.bitcast_convert_type(pages, E4M3_BITS)


def test_the_array_dtype_is_uint8_only_for_e4m3_on_a_cpu():
    fp8 = storage_dtype("fp8", jnp.float32)
    assert fp8 == E4M3 and page_array_dtype(fp8, "cpu") == E4M3_BITS
    assert page_array_dtype(fp8, "gpu") == page_array_dtype(fp8, "tpu") == E4M3  # the kernels read e4m3 pages
    assert page_array_dtype(jnp.bfloat16, "cpu") == jnp.bfloat16
    assert page_array_dtype(E4M3_BITS, "cpu") == E4M3_BITS  # already the array dtype: unchanged
    assert is_fp8(E4M3) and is_fp8(E4M3_BITS) and not is_fp8(jnp.bfloat16)


def test_page_storage_round_trips_every_e4m3_value():
    every_byte = jnp.arange(256, dtype=jnp.uint8)
    values = jax.lax.bitcast_convert_type(every_byte, E4M3)
    stored = to_page_storage(values, E4M3_BITS)
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(every_byte))
    np.testing.assert_array_equal(np.asarray(page_values(stored)).view(np.uint8), np.asarray(every_byte))
    assert to_page_storage(values, E4M3).dtype == E4M3 and page_values(values) is values


@pytest.mark.parametrize("attend", [ragged_paged_attention_cpu, ragged_paged_attention_reference])
def test_bit_pages_write_the_same_bytes_and_attend_identically(attend):
    """Same e4m3 inputs, pages held as e4m3 or as bits: identical outputs and identical bytes written."""
    case = make_case(11, [(1, 37), (6, 40), (0, 0), (17, 17)], num_q_heads=8, num_kv_heads=2, pad_tokens=2)
    k_new, v_new = quantize_to_fp8(case.k_new, 0.1), quantize_to_fp8(case.v_new, 0.1)
    k_pages, v_pages = quantize_to_fp8(case.k_pages, 0.1), quantize_to_fp8(case.v_pages, 0.1)  # NaN stays NaN
    tables = (case.page_tables, case.cu_q_lens, case.kv_lens)
    out, k_out, v_out = attend(case.q, k_new, v_new, k_pages, v_pages, *tables, sm_scale=case.sm_scale)
    bits_out, k_bits, v_bits = attend(case.q, k_new, v_new, bit_pages(k_pages), bit_pages(v_pages), *tables,
                                      sm_scale=case.sm_scale)
    assert k_bits.dtype == v_bits.dtype == E4M3_BITS
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(np.asarray(bits_out), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(k_bits), np.asarray(bit_pages(k_out)))
    np.testing.assert_array_equal(np.asarray(v_bits), np.asarray(bit_pages(v_out)))


def test_a_pallas_kernel_in_interpret_mode_reads_a_cpus_bit_pages():
    """The dispatcher hands a Pallas kernel (interpret mode, on this CPU) the bit pool as e4m3 pages."""
    case = make_case(4, [(1, 20), (3, 33)], num_q_heads=4, num_kv_heads=2, nan_fill=False)
    batch = StepBatch(token_ids=None, positions=None, cu_q_lens=case.cu_q_lens, kv_lens=case.kv_lens,
                      page_tables=case.page_tables, logits_indices=None)
    pages = quantize_to_fp8(case.k_pages, 1.0), quantize_to_fp8(case.v_pages, 1.0)
    results = {}
    for impl in ("cpu", "pallas_gpu_interpret"):
        results[impl] = paged_attention(case.q, case.k_new, case.v_new, *(bit_pages(p) for p in pages), batch,
                                        sm_scale=case.sm_scale, impl=impl)
    cpu, kernel = results["cpu"], results["pallas_gpu_interpret"]
    assert kernel[1].dtype == E4M3_BITS
    np.testing.assert_allclose(np.asarray(kernel[0]), np.asarray(cpu[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(kernel[1]), np.asarray(cpu[1]))


def test_the_compiled_cpu_step_neither_converts_nor_copies_an_fp8_pool():
    """The engine's forward over an FP8 cache, jitted with the cache donated as the runner does: no
    pool-sized value of another dtype (XLA's float16 round trip of the whole pool, or a bitcast
    compiled as a copy), no pool-sized copy, and the pool's buffer is updated in place."""
    tiny = load_model(FIXTURES / "tiny-llama3", dtype="float32")
    config, page_size, num_pages = tiny.config, 16, 211  # 211: no other tensor of the step has the pool's size
    cache = create_kv_cache(config, num_pages, page_size, storage_dtype("fp8", jnp.float32))
    pool_dtype = cache.k[0].dtype
    assert pool_dtype == E4M3_BITS
    ids = list(range(3, 40))
    batch = jax.tree.map(jnp.asarray, build_step_batch([(ids, 0, [1, 2, 3])], num_tokens=64, num_seqs=2,
                                                       pages_per_seq=4))
    step = jax.jit(forward, static_argnums=(3, 4), donate_argnums=(1,))
    hlo = step.lower(tiny.weights, cache, batch, config, "auto").compile().as_text()
    pool = pool_sized_values(hlo, config.num_kv_heads * num_pages * page_size * config.head_dim)
    assert pool, "the pool's size matched nothing: the HLO pattern is stale"
    assert not [v for v in pool if _HLO_DTYPES.get(v[0]) != pool_dtype], pool
    assert not [v for v in pool if v[1] == "copy"], pool
    pointer = cache.k[0].unsafe_buffer_pointer()
    _, cache = step(tiny.weights, cache, batch, config, "auto")
    assert cache.k[0].unsafe_buffer_pointer() == pointer
    # And it wrote the prompt's K: its first page's rows are no longer all zero bytes.
    assert np.asarray(cache.k[0][:, 1]).any()


def test_fp8_and_bit_caches_give_the_engine_the_same_logits():
    """The same forward over an e4m3-array cache (how it was held before) and a bit cache: equal logits."""
    tiny = load_model(FIXTURES / "tiny-llama3", dtype="float32")
    bits = create_kv_cache(tiny.config, 8, 16, E4M3)
    e4m3 = dataclasses.replace(bits, k=[p.view(E4M3) for p in bits.k], v=[p.view(E4M3) for p in bits.v])
    batch = jax.tree.map(jnp.asarray, build_step_batch([(list(range(3, 40)), 0, [1, 2, 3])], num_tokens=64,
                                                       num_seqs=2, pages_per_seq=4))
    logits_bits, out_bits = forward(tiny.weights, bits, batch, tiny.config, "cpu")
    logits_e4m3, out_e4m3 = forward(tiny.weights, e4m3, batch, tiny.config, "cpu")
    np.testing.assert_array_equal(np.asarray(logits_bits), np.asarray(logits_e4m3))
    np.testing.assert_array_equal(np.asarray(out_bits.k[1]), np.asarray(out_e4m3.k[1]).view(np.uint8))


def test_kv_write_benchmark_smoke_reports_the_pool_copies_it_removed(tmp_path):
    """benchmarks/kv_write_cpu.py --smoke completes; its HLO columns show the fp8 round trip before, none after."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import BENCHMARK_CACHE_ENV, REPO

    env = {**os.environ, "JAX_PLATFORMS": "cpu", **BENCHMARK_CACHE_ENV}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kv_write_cpu.py"), "--smoke", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "kv_write_cpu.json").read_text())["rows"]
    writes = {row["dtype"]: row for row in rows if row["op"] == "write"}
    assert set(writes) == {"bfloat16", "float32", "fp8-e4m3", "fp8-bits"}
    assert writes["fp8-e4m3"]["pool_sized_other_dtype"] > 0
    assert all(writes[name]["pool_sized_other_dtype"] == 0 for name in ("bfloat16", "float32", "fp8-bits"))
    assert all(row["ms_per_step"] > 0 for row in rows) and len(rows) == 8

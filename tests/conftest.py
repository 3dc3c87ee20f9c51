"""Test setup: CPU only, a persistent compilation cache, shared model fixtures."""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
GOLDEN = REPO / "tests" / "golden"

# Recompiling the same programs in every test run costs minutes on 2 cores; the cache lives
# beside the downloaded models so that fresh clones (CI) on the same machine reuse it.
from jaxinfer.model_registry import default_cache_dir  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(default_cache_dir() / "jax-compilation-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The benchmark scripts that smoke tests run in child processes (Pallas kernels interpreted, tiny
# engines) spent half their time or more compiling the same programs in every run of the suite:
# with this cache a later run (CI on the same machine, a developer's re-run) loads each program
# whose code did not change and compiles only the ones that did. Every program is kept, however
# fast it compiles (most of the interpreted kernels take under a second). A test of start-up itself
# (cold against warm cache, compile seconds) keeps a fresh cache of its own instead.
BENCHMARK_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": str(default_cache_dir() / "jax-compilation-cache-benchmarks"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
}


# The heaviest test files, longest first, by seconds on 2 cores (session 22's full run: 4,613
# worker-seconds in all). The workers take whole files in collection order (the Makefile's
# --no-loadscope-reorder; xdist's default orders files by their number of tests), so these start
# first and the run ends on small files: longest-first, both workers finish within a small file
# of each other (session 22's run left one idle ~100 s while the other ran a 90 s file).
HEAVY_TEST_FILES = (
    "test_benchmarks_smoke.py",  # 563
    "test_quantized_matmul.py",  # 362
    "test_ray_serve.py",  # 350
    "test_notebooks.py",  # 238
    "test_prefill_benchmarks_smoke.py",  # 197
    "test_readme.py",  # 192
    "test_spec_decode_lagged.py",  # 165
    "test_structured_output.py",  # 161
    "test_wgmma_matmul.py",  # 151
    "test_gpu_fresh_prefill.py",  # 128
    "test_paged_attention_fp8_wgmma.py",  # 113
    "test_orbax_checkpoint.py",  # 113
    "test_quantized_matmul_bits.py",  # 113
    "test_kv_cache_cpu_storage.py",  # 111
    "test_spec_decode_eagle3.py",  # 103
    "test_sharding.py",  # 100
    "test_spec_decode.py",  # 99
    "test_model_golden.py",  # 90
    "test_compare_trees.py",  # 88
)


def pytest_collection_modifyitems(session, config, items):
    """The heavy files first, longest first (``HEAVY_TEST_FILES``); the rest as collected."""
    rank = {name: i for i, name in enumerate(HEAVY_TEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


# Tests between two looks at the process's memory mappings: reading /proc/self/maps costs a few ms
# near the limit, and 16 tests add a few thousand mappings at most, far inside the guard's half.
MAP_CHECK_EVERY = 16
_tests_since_map_check = [0]


def pytest_runtest_teardown(item, nextitem):
    """Free compiled programs before one process reaches the kernel's mapping limit (tests/map_budget.py)."""
    _tests_since_map_check[0] += 1
    if _tests_since_map_check[0] < MAP_CHECK_EVERY:
        return
    _tests_since_map_check[0] = 0
    from .map_budget import release_compiled_programs_if_near_limit

    release_compiled_programs_if_near_limit()


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct (the default model) in float32, loaded once per session."""
    from jaxinfer.checkpoint import load_model

    return load_model("smollm2-135m-instruct", dtype="float32")

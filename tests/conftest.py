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

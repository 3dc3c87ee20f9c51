"""tests/map_budget.py: the guard that keeps one long test process below vm.max_map_count."""

import gc

import jax
import jax.numpy as jnp
import pytest

from .map_budget import memory_map_count, memory_map_limit, release_compiled_programs_if_near_limit

linux_proc = pytest.mark.skipif(memory_map_count() is None or memory_map_limit() is None,
                                reason="needs /proc/self/maps and /proc/sys/vm/max_map_count")


@linux_proc
def test_map_count_grows_with_live_executables_and_the_guard_gives_them_back():
    @jax.jit
    def kernels(x):
        return jnp.sin(x) + jnp.cumsum(x)

    # Earlier tests' garbage (executables no longer referenced) is freed first: freed during the loop,
    # their mappings made the count fall while this test's grew (seen once in a full run).
    gc.collect()
    before = memory_map_count()
    for n in range(1, 21):
        kernels(jnp.arange(float(n))).block_until_ready()
    grown = memory_map_count()
    assert grown > before + 20, (before, grown)  # each XLA:CPU executable holds mappings
    assert kernels._cache_size() == 20

    assert release_compiled_programs_if_near_limit(fraction=0.0)  # always "near": clears
    assert kernels._cache_size() == 0
    assert memory_map_count() < grown - (grown - before) // 2, (before, grown, memory_map_count())


@linux_proc
def test_guard_leaves_caches_alone_below_the_threshold():
    @jax.jit
    def double(x):
        return 2 * x

    double(jnp.ones(3)).block_until_ready()
    assert not release_compiled_programs_if_near_limit(fraction=1.0)
    assert double._cache_size() == 1


def test_guard_rejects_a_fraction_outside_0_1():
    with pytest.raises(ValueError, match="fraction"):
        release_compiled_programs_if_near_limit(fraction=1.5)

"""``CompilationCounter``: compilations after warm-up, counted per call and across ``jax.clear_caches()``."""

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.compile_counter import CompilationCounter


@pytest.fixture
def counted():
    """A jitted function and a counter around it; ``call(x, key)`` runs it as the runner does."""
    fn = jax.jit(lambda x: x * 2)
    counter = CompilationCounter(fn._cache_size)

    def call(x, key=None):
        size = counter.before()
        fn(x)
        counter.after(key if key is not None else (x.shape, x.dtype.name), size)

    return counter, call


def test_only_programs_new_after_warm_up_count(counted):
    counter, call = counted
    call(jnp.zeros(2))
    call(jnp.zeros(3))
    assert counter.num_after_warmup == 0  # not warm yet: warm-up compiles everything
    counter.end_warm_up()
    call(jnp.zeros(2))
    call(jnp.zeros(3))
    assert counter.num_after_warmup == 0
    call(jnp.zeros(4))
    call(jnp.zeros(4))
    assert counter.num_after_warmup == 1


def test_recompiles_after_clearing_the_caches_do_not_count_but_new_programs_do(counted):
    counter, call = counted
    call(jnp.zeros(2))
    counter.end_warm_up()
    jax.clear_caches()  # what a user, a notebook or tests/map_budget.py may do
    call(jnp.zeros(2))
    call(jnp.zeros(2))
    assert counter.num_after_warmup == 0  # the old count went negative here
    call(jnp.zeros(5))
    assert counter.num_after_warmup == 1
    jax.clear_caches()
    call(jnp.zeros(5))
    call(jnp.zeros(2))
    assert counter.num_after_warmup == 1
    call(jnp.zeros(6))
    assert counter.num_after_warmup == 2


def test_a_retrace_under_a_key_already_called_since_the_last_clear_counts(counted):
    counter, call = counted
    call(jnp.zeros(2, jnp.float32), key="bucket-2")
    counter.end_warm_up()
    call(jnp.zeros(2, jnp.int32), key="bucket-2")  # same bucket, another dtype: a real compile
    assert counter.num_after_warmup == 1

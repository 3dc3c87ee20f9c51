"""Does jax.clear_caches() give back the memory mappings of executables that jit caches hold?"""
import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp


def map_count():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@jax.jit
def shared(x):  # a module-level jitted function: its cache keeps one executable per input shape
    return jnp.sin(x) + jnp.cumsum(x)


start = map_count()
for n in range(1, 101):
    shared(jnp.arange(float(n))).block_until_ready()
grown = map_count()
jax.clear_caches()
gc.collect()
print(f"start {start}, after 100 shapes {grown} (+{grown - start}), after clear_caches {map_count()}")

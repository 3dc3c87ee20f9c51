"""Compile jitted functions, drop them, and see whether XLA:CPU deregisters their eh_frames."""
import ctypes, gc, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp

shim = ctypes.CDLL(os.environ["LD_PRELOAD"])
def state(tag):
    print(tag, "live", shim.ehtrack_live(), "leaks", shim.ehtrack_leaks(), flush=True)

state("start")
fs = []
for i in range(5):
    f = jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cumsum(x))
    f(jnp.arange(8.0 + i)).block_until_ready()
    fs.append(f)
state("after compile 5")
del fs, f
gc.collect()
state("after del")
jax.clear_caches(); gc.collect()
state("after clear_caches")

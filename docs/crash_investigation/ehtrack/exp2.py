"""As exp1, with the persistent compilation cache on: second compile loads from the cache."""
import ctypes, gc, os, sys, tempfile
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp
cache = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
shim = ctypes.CDLL(os.environ["LD_PRELOAD"])
def state(tag):
    print(tag, "live", shim.ehtrack_live(), "leaks", shim.ehtrack_leaks(), flush=True)
def body(x):
    return jnp.sin(x) * 3 + jnp.cumsum(x)
for round in range(3):
    f = jax.jit(body)
    f(jnp.arange(8.0)).block_until_ready()
    state(f"round {round} compiled")
    del f; jax.clear_caches(); gc.collect()
    state(f"round {round} cleared")

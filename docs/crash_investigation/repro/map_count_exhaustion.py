"""Fill the process's memory-map budget (vm.max_map_count), then JIT-compile until XLA:CPU fails.

Usage: python map_count_exhaustion.py HEADROOM
Leaves HEADROOM mappings below the limit by splitting one anonymous region into many VMAs
(alternating page protections), then jits distinct small functions one after another.
"""
import ctypes
import mmap
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = mmap.PAGESIZE


def map_count():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


limit = int(open("/proc/sys/vm/max_map_count").read())
jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()  # start the runtime's threads first
headroom = int(sys.argv[1])
need = limit - headroom - map_count()
pages = need + 2
base = libc.mmap(None, pages * PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
for i in range(1, pages, 2):  # every other page PROT_NONE: each page its own VMA
    libc.mprotect(base + i * PAGE, PAGE, 0)  # PROT_NONE
print(f"limit {limit}, mappings now {map_count()}", flush=True)
alive = []  # keep every executable, as jit caches in a long test process do
for n in range(2_000):
    try:
        alive.append(jax.jit(lambda x, n=n: jnp.sin(x) * n + jnp.cumsum(x)))
        alive[-1](jnp.arange(8.0)).block_until_ready()
    except Exception as error:  # the compile that hit the limit, if the process survives it
        print(f"compile {n} failed at {map_count()} mappings: {type(error).__name__}: {str(error)[:300]}", flush=True)
        break
    if n % 20 == 0:
        print(f"compile {n}: {map_count()} mappings", flush=True)
print("survived", flush=True)

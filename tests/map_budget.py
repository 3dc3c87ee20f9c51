"""Keep one long test process below the kernel's limit on memory mappings (``vm.max_map_count``).

Why: every XLA:CPU executable holds a few separate memory mappings (code, read-only data,
read-write data of its JIT-linked objects), and jit caches keep every executable of a run
alive, so a single-process run of the whole suite grows to the kernel's limit (65,530 mappings
by default, reached ~1,300 tests in). The first compile that then fails to map or protect its
memory makes XLA:CPU free that memory without deregistering the object's ``.eh_frame`` from
libgcc's unwinder, and the C++ exception that reports the failure reads the freed frame: SIGSEGV
in ``libgcc_s.so.1`` (docs/crash_investigation.md). Dropping the compiled programs while far
from the limit avoids both the failure and the crash; it costs only recompiles (the persistent
compilation cache keeps most of them cheap).
"""

from __future__ import annotations

import gc
from pathlib import Path

import jax

MAPS = Path("/proc/self/maps")
MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")


def memory_map_count() -> int | None:
    """Number of memory mappings of this process, or None where /proc does not tell (not Linux)."""
    try:
        with MAPS.open("rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return None


def memory_map_limit() -> int | None:
    """The kernel's per-process limit on memory mappings, or None where /proc does not tell."""
    try:
        return int(MAX_MAP_COUNT.read_text())
    except (OSError, ValueError):
        return None


def release_compiled_programs_if_near_limit(fraction: float = 0.5) -> bool:
    """Clear JAX's caches (freeing executables no one else holds) once mappings pass ``fraction`` of the limit.

    Returns whether it cleared. ``fraction`` is a share of ``vm.max_map_count`` in [0, 1].
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    count, limit = memory_map_count(), memory_map_limit()
    if count is None or limit is None or count < fraction * limit:
        return False
    jax.clear_caches()
    gc.collect()
    return True

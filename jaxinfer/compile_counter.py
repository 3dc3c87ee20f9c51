"""Count the programs jitted functions compile after warm-up, across ``jax.clear_caches()``.

An engine compiles every program it needs at warm-up; a compilation while serving is a stall of
seconds, so ``num_compilations_after_warmup`` (in ``Engine.stats()`` and ``/metrics``) should stay 0
and the tests check that it does. Reading it as "jit cache size now minus at warm-up" breaks when
the caches are cleared (``jax.clear_caches()``, which a user, a notebook or a long test process
may call): the size drops, goes negative, and the re-compiles of warmed programs look new.

So the count is kept per call. Each call has a key naming its program (its bucket and static
arguments); a call that grows the caches compiles either

- a program never called before (a new shape: counted once warm), or
- a program already called since the caches were last cleared (a retrace with the same key, say
  from a changed weak type: counted too), or
- a program called before the last clear (its re-compile: not counted).

A clear shows as the cache size dropping between two calls; the calls observe the size just
before and after, so no clear goes unseen (only these calls run these functions).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import jax


class CompilationCounter:
    """Compilations of the programs behind ``cache_size`` (the summed ``_cache_size()`` of some jits).

    Around each call of those jits: ``size = counter.before()``, the call, ``counter.after(key, size)``.
    """

    def __init__(self, cache_size: Callable[[], int]):
        self._cache_size = cache_size
        self._last_size = 0
        self._generation = 0  # bumped at each observed cache clear
        self._called_in: dict[Hashable, int] = {}  # program key -> generation of its last call
        self.is_warm = False
        self.num_after_warmup = 0

    def before(self) -> int:
        size = self._cache_size()
        if size < self._last_size:
            self._generation += 1  # the caches were cleared: every program compiles once more
        return size

    def after(self, key: Hashable, size_before: int) -> None:
        size = self._cache_size()
        self._last_size = size
        last_called = self._called_in.get(key)
        self._called_in[key] = self._generation
        if size > size_before and self.is_warm and (last_called is None or last_called == self._generation):
            self.num_after_warmup += size - size_before

    def end_warm_up(self) -> None:
        """From now on, compilations of programs not called so far count."""
        self._last_size = self._cache_size()
        self.is_warm = True


# What jax records around each XLA compilation that is not served from a compilation cache.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class BackendCompiles:
    """Counts XLA compilations (any thread) while the ``with`` block runs.

    The jit caches cannot tell this: a program compiled ahead of time (``lower().compile()``, as
    warm-up does on its thread pool) enters no jit cache, and its first call adds an entry either
    way, reusing the compiled program when the call lowers to the same module and compiling it
    again when it does not (inputs committed or sharded unlike the ahead-of-time arguments).
    """

    def __init__(self):
        self.count = 0
        self.seconds = 0.0

    def _listener(self, event: str, duration: float, **_) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def __enter__(self) -> "BackendCompiles":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)

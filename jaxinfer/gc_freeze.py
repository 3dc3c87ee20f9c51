"""Take a serving process's start-up heap out of Python's cyclic garbage collector, once it is warm.

After start-up a process holds hundreds of thousands of container objects that live as long as
it does: jax and its traced programs, the model's pytrees, the tokenizer, the modules. A full
(generation 2) collection walks every one of them, about 100 ms for an engine process on a
2-core VM (``benchmarks/results/host_step_cost.md``), and it runs inside whichever engine step
happens to allocate when the collector decides to: a pause in one step's host work, seen as
a stall in every running stream. ``gc.freeze()`` moves every object tracked now into a
permanent generation that collections skip, so later full collections walk only what was made
since (vLLM freezes after start-up for the same reason).

The cost: objects frozen here that later become unreachable *inside a reference cycle* are
never freed (reference counting still frees everything else, frozen or not). That is right for
a process that lives to serve one engine, wrong for one that builds and drops many engines (the
test suite, a notebook). So ``Engine`` and ``LLM`` never freeze; the long-lived serving processes
call :func:`freeze_startup_heap` once their engine is warm: ``jaxinfer serve`` / ``server.py``
(``jaxinfer.server.serve.run_server``) and the Ray Serve replica
(``jaxinfer.ray_serve.engine_replica.EngineReplica``). An offline user with one long-lived
``LLM`` may call it too, after building it.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what is already garbage, then freeze every object still tracked; returns how many.

    Call it once, after the engine is built and warm; calling it again freezes what was made since.
    """
    gc.collect()  # garbage of the start-up is freed now rather than frozen for good
    gc.freeze()
    return gc.get_freeze_count()

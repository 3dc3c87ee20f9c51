"""freeze_startup_heap: start-up garbage is freed, the rest leaves the collector's full passes.

Run in a child process: a freeze in the test process would keep every later test's cyclic
garbage alive (which is why only the serving processes freeze; jaxinfer/gc_freeze.py).
"""

import subprocess
import sys

from tests.conftest import BENCHMARK_CACHE_ENV, REPO

CHILD = """
import gc, sys, weakref
sys.path.insert(0, {repo!r})
from jaxinfer.gc_freeze import freeze_startup_heap

class Node:
    pass

garbage = Node()
garbage.cycle = garbage          # unreachable once deleted, freed only by the cyclic collector
was_garbage = weakref.ref(garbage)
del garbage
kept = [Node() for _ in range(1000)]
tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
assert was_garbage() is None, "start-up garbage was frozen instead of freed"
assert frozen == gc.get_freeze_count() and frozen >= 1000, frozen
# The collector's generations now hold only what was made since: a full pass walks little.
assert len(gc.get_objects()) < tracked_before // 10, (len(gc.get_objects()), tracked_before)
# Reference counting still frees a frozen object once nothing refers to it.
one = weakref.ref(kept[0])
kept.clear()
assert one() is None
print("ok", frozen)
"""


def test_freeze_startup_heap_frees_garbage_then_freezes_what_lives():
    done = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO))], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr


def test_host_step_cost_runs_each_tree_with_and_without_a_frozen_heap(tmp_path):
    """benchmarks/host_step_cost.py --gc-modes default,freeze: both variants reach steady decode,
    only the frozen one froze anything, and each row carries the step's tail beside its mean."""
    import json
    import os

    out = tmp_path / "host"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **BENCHMARK_CACHE_ENV}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_step_cost.py"), "--trees", str(REPO),
                           "--batches", "2", "--steps", "6", "--rounds", "1", "--gc-modes", "default,freeze",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "host_step_cost.json").read_text())["results"]
    assert sorted(label.split(" ")[-1] for label in results) == ["gc=default", "gc=freeze"]
    for (row,) in results.values():
        assert row["host_us_per_step_max"] >= row["host_us_per_step_p99"] >= 0.5 * row["host_us_per_step"] > 0
        assert row["gc_full_collections"] >= 0 and row["gc_max_pause_us"] >= 0
    frozen = {mode: json.loads((out / f"worker_0_{REPO.name}_{mode}.json").read_text())["gc_frozen_objects"]
              for mode in ("default", "freeze")}
    # (Something imported freezes a few hundred objects of its own: the default run is not at 0.)
    assert frozen["freeze"] > 10_000 and frozen["freeze"] > 10 * frozen["default"], frozen

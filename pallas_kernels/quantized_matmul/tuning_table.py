"""The measured table of the weight-only GEMV: best tile sizes per (M, N, K, weight format), and whether it beats XLA.

``benchmarks/gemv_decode.py`` writes ``gpu_gemv_table.json`` on the GPU; copied next to this
file (with the run's results under benchmarks/results/) it decides the kernel's default
sizes and ``prefer_pallas``. Absent, or without the shape: the heuristics in ``block_sizes``
pick the sizes, and ``prefer_pallas`` says False (XLA stays in charge of anything not measured).

One entry per measured (M, N, K, weights)::

    {"m": 1, "n": 14336, "k": 4096, "weights": "float8_e4m3fn", "layout": "nk",
     "sizes": {MatmulBlockSizes fields}, "ours_us": 14.1, "xla_method": "xla_w8a16", "xla_us": 30.2}

``xla_method`` is the XLA path the weight layer would otherwise run for that format
(``xla_w8a16``: convert then dot, for fp8/int8; ``xla_bf16`` for bf16 weights). ``layout``:
"nk" (``w [N, K]``, the quantized payload; entries without the key) or "kn" (``w [K, N]``,
the dense bf16 weights as the model stores them).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

GPU_TABLE_PATH = Path(__file__).with_name("gpu_gemv_table.json")
# Ours must beat XLA by this factor to be preferred: timing noise between runs is a few percent,
# and a tie is not worth a custom kernel in the step.
PREFERENCE_MARGIN = 0.97


def weights_name(weight_dtype) -> str:
    """The table's name for a weight format (numpy's dtype name: float8_e4m3fn, int8, bfloat16)."""
    return np.dtype(weight_dtype).name


@functools.cache
def _load(path: Path = GPU_TABLE_PATH) -> tuple[dict, ...]:
    if not path.exists():
        return ()
    return tuple(json.loads(path.read_text())["entries"])


def _entries(table) -> tuple[dict, ...]:
    return _load() if table is None else tuple(table)


def _measured_rows(n: int, k: int, weight_dtype, table, layout: str) -> list[dict]:
    """This shape's entries, by M."""
    name = weights_name(weight_dtype)
    return sorted((e for e in _entries(table) if e["n"] == n and e["k"] == k and e["weights"] == name
                   and e.get("layout", "nk") == layout), key=lambda e: e["m"])


def measured_block_sizes(m: int, n: int, k: int, weight_dtype, table=None, layout: str = "nk") -> dict | None:
    """The sizes measured best at the smallest measured M >= m for this (N, K, weights), or None.

    Sizes valid at some M are valid at any smaller M (fewer padded rows; the row limits of
    "fma" and "gemv" are upper bounds), so a smaller M borrows the next larger one's.
    """
    above = [e for e in _measured_rows(n, k, weight_dtype, table, layout) if e["m"] >= m]
    return dict(above[0]["sizes"]) if above else None


def prefer_pallas(m: int, n: int, k: int, weight_dtype, table=None, layout: str = "nk") -> bool:
    """Whether the measured table says our kernel beats XLA for ``x [m, k] @ w [n, k]^T`` with these weights.

    True only when the shape and format were measured at Ms bracketing ``m`` (the nearest
    measured M at or below it and the nearest at or above it; the same entry when ``m`` was
    measured) and ours was faster than XLA's path for that format by ``PREFERENCE_MARGIN`` at
    both. Anything unmeasured (other shapes, M outside the measured range, no table) is False:
    XLA's path is the safe default. ``weight_dtype``: float8_e4m3fn, int8 or bfloat16 (a
    dtype or its name); ``layout``: how the weights are stored ("nk" or "kn", see above).
    """
    rows = _measured_rows(n, k, weight_dtype, table, layout)
    below = [e for e in rows if e["m"] <= m]
    above = [e for e in rows if e["m"] >= m]
    if not below or not above:
        return False
    return all(e["ours_us"] < PREFERENCE_MARGIN * e["xla_us"] for e in (below[-1], above[0]))

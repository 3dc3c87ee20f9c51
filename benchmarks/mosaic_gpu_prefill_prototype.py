"""PROTOTYPE name kept for the benchmarks: the one-warpgroup Mosaic GPU causal prefill kernel.

The kernel now lives in ``pallas_kernels/paged_attention/gpu_fresh_window.py`` (with a dynamic
number of query blocks, which the engine's branchless fresh-prefill path uses); its docstring
has the design and what session 8 measured. ``prefill_peers.py`` (``proto_*``) and
``kernel_frontier.py`` time it under this name, on whole chunks (every block live).
"""

from pallas_kernels.paged_attention.gpu_fresh_window import (  # noqa: F401
    causal_window_attention_mosaic_gpu as causal_prefill_attention_mosaic_gpu,
)

"""The GPU paged-attention kernel as it was at commit 50370cd (before issue 21), frozen for comparison.

``benchmarks/kernel_frontier.py`` times it in the same run as the current kernel, so every
speed-up is measured against the code it replaced, on the same card at the same time. These
are verbatim copies of ``gpu.py``, ``block_sizes.py`` and ``work_tiles.py`` from that commit,
with only their imports pointed here. `kernel_lowering_choice.py` also uses them: its recorded
comparison (Mosaic GPU prototype vs Triton) was run against this kernel.
"""

"""Ragged paged attention over the paged KV cache: plain-JAX reference, GPU and TPU kernels.

The GPU has three entry points: ``ragged_paged_attention_gpu`` (the default: XLA scatter, then
attention), ``ragged_paged_attention_gpu_fused`` (opt-in: the write fused into the kernel) and
``ragged_paged_attention_gpu_fresh_prefill`` (Hopper's ``"auto"``: a step's fresh prompts, up to 8,
through jax's bundled Mosaic GPU flash attention in one batched call behind a device branch, with
``cudnn=True`` through cuDNN's in the same branches, or with ``branchless=True`` packed into our own
Mosaic GPU window kernel, ``gpu_fresh_window``; which prompts, ``fresh_prompts``; the rest as the default).
All share one signature (``ragged_paged_attention_reference``'s) and return
``(out, k_pages, v_pages)``; the kernels take extra keyword-only tile sizes and an
interpret switch. The cache layout and the ragged-batch metadata are documented in
``reference.py``.
"""

from pallas_kernels.paged_attention.block_sizes import BlockSizes, gpu_block_sizes, tpu_block_sizes
from pallas_kernels.paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.paged_attention.gpu_fresh_prefill import ragged_paged_attention_gpu_fresh_prefill
from pallas_kernels.paged_attention.gpu_fused import ragged_paged_attention_gpu_fused
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.paged_attention.tpu import ragged_paged_attention_tpu

__all__ = [
    "BlockSizes",
    "gpu_block_sizes",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_gpu_fresh_prefill",
    "ragged_paged_attention_gpu_fused",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "tpu_block_sizes",
]

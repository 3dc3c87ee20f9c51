"""A model ready to serve: its config, its weights on the device(s), its tokenizer, where it came from.

Every loader (``jaxinfer.checkpoint``, ``jaxinfer.orbax_checkpoint``) returns one, and
``sharding.placement`` lays one out on a mesh; it lives apart from the loaders so that neither
they nor the sharding layer import each other for the type.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.params import Weights
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    source: Path
    # Per-layer float32 (k_scales [L], v_scales [L]) of an FP8 KV cache, from a checkpoint's
    # compressed-tensors kv_cache_scheme; None when the checkpoint has none.
    kv_cache_scales: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def quantization(self) -> str | None:
        """``"fp8"``/``"int8"`` when the projections are quantized, else ``None``."""
        return self.config.quantization

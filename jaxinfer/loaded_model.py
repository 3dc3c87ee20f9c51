"""A model ready to serve: its config, its weights on the device(s), its tokenizer, where it came from.

Every loader (``jaxinfer.checkpoint``, ``jaxinfer.orbax_checkpoint``) returns one, and
``sharding.placement`` lays one out on a mesh; it lives apart from the loaders so that neither
they nor the sharding layer import each other for the type.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxinfer.config import ModelConfig
from jaxinfer.params import Weights
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    source: Path

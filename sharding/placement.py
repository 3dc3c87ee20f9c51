"""Laying a loaded model out on a mesh: pad heads for the tp size, then place each weight by the rules."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.loaded_model import LoadedModel
from sharding.heads import head_layout, pad_weights, padded_config
from sharding.mesh import TP
from sharding.rules import cache_sharding, replicated, weight_shardings


def place(host_tree, shardings):
    """Put a pytree of host arrays on the devices of ``shardings`` (a matching pytree).

    ``make_array_from_callback`` lets every process build its own shards from the same host
    value, so this works unchanged when the mesh spans several processes (multi-host).
    """

    def put(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, host_tree, shardings)


def shard_model(model: LoadedModel, mesh: Mesh) -> LoadedModel:
    """The same model with heads padded for ``mesh``'s tp size and every weight laid out by the rules."""
    layout = head_layout(model.config.num_q_heads, model.config.num_kv_heads, mesh.shape[TP])
    config = padded_config(model.config, layout)
    shardings = weight_shardings(config, mesh)
    if layout.is_identity and jax.process_count() == 1:
        weights = jax.device_put(model.weights, shardings)  # no host round trip (e.g. Orbax-restored shards)
    else:
        weights = place(pad_weights(model.weights, layout), shardings)
    return dataclasses.replace(model, config=config, weights=weights)


class StepPlacement:
    """Where a runner's step puts things on ``mesh`` (``None``: one device, JAX's defaults).

    The cache keeps its head-split sharding across steps (``out_shardings`` pins it to the
    input's, so the donated buffers are updated in place); step inputs and sampler outputs
    are replicated, so every process of a multi-host mesh can read the sampled tokens.
    """

    def __init__(self, config, mesh: Mesh | None):
        self.mesh = mesh
        self.cache = None if mesh is None else cache_sharding(config, mesh)
        self.replicated = None if mesh is None else replicated(mesh)

    def jit_kwargs(self, with_cache: bool = False) -> dict:
        """``out_shardings`` for a jitted function returning ``(outputs, cache)`` or just outputs."""
        if self.mesh is None:
            return {}
        return dict(out_shardings=(self.replicated, self.cache) if with_cache else self.replicated)

    def context(self):
        """Trace under the mesh, so the attention dispatcher shards its kernels (``shard_over_heads``)."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

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


def committed_device(*trees) -> jax.Device | None:
    """The device that committed single-device arrays among ``trees`` are on, or None (nothing
    committed, or arrays spread over a mesh, whose shardings say where everything goes)."""
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array) and leaf.committed:
            devices = leaf.devices()
            return next(iter(devices)) if len(devices) == 1 else None
    return None


def commit_beside(tree, *weights):
    """``tree`` (arrays on one device) committed to that device when any of ``weights`` is, else as it is.

    A model on one device may arrive committed to it (restored from Orbax, put there by the
    caller) or not (made by jit on the default device), and state a jitted step reads beside it
    must be as it is: a call with a committed input returns committed outputs, so uncommitted
    state came back committed from a program's first run, and the next call no longer lowered to
    what warm-up had compiled (a tiny Orbax-restored model compiled 17 programs twice at warm-up).
    ``jax.device_put`` to the arrays' own device copies nothing.
    """
    device = committed_device(*weights)
    return tree if device is None else jax.device_put(tree, device)


class StepPlacement:
    """Where a runner's step puts things on ``mesh`` (``None``: one device, JAX's defaults).

    The cache keeps its head-split sharding across steps (``out_shardings`` pins it to the
    input's, so the donated buffers are updated in place); step inputs and sampler outputs
    are replicated, so every process of a multi-host mesh can read the sampled tokens.
    """

    def __init__(self, config, mesh: Mesh | None, v_layout: str = "token_major"):
        self.mesh = mesh
        self.cache = None if mesh is None else cache_sharding(config, mesh, v_layout)
        self.replicated = None if mesh is None else replicated(mesh)

    def jit_kwargs(self, with_cache: bool = False) -> dict:
        """``out_shardings`` for a jitted function returning ``(outputs, cache)`` or just outputs."""
        if self.mesh is None:
            return {}
        return dict(out_shardings=(self.replicated, self.cache) if with_cache else self.replicated)

    def context(self):
        """Trace under the mesh, so the attention dispatcher shards its kernels (``shard_over_heads``)."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

"""The one table from the model's logical axis names to mesh axes, and the shardings it implies.

Every weight declares its logical axes once (``jaxinfer.params.param_specs``) and the KV cache
its own (``jaxinfer.kv_cache.CACHE_LOGICAL_AXES``); this table turns them into mesh axes, which
gives the Megatron layout without the model naming a mesh axis:

- q/k/v split by heads (column parallel), the output projection by its head rows (row
  parallel: XLA all-reduces its partial sums);
- gate/up split by ffn columns, down by ffn rows (one all-reduce per MLP);
- embedding and lm_head split by vocabulary: the logits come out vocabulary-split and are
  all-gathered for sampling (``[B, V]`` floats per step, small next to the weights);
- the KV cache split by KV heads, so each shard's attention reads only its own pages.

Heads that do not divide the tensor-parallel size are padded first (``sharding.heads``).
A dimension that still does not divide its mesh axis is replicated instead (logged).
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import CACHE_LOGICAL_AXES, KVCache
from jaxinfer.params import Weights, is_spec, param_specs
from sharding.mesh import TP

logger = logging.getLogger(__name__)

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": TP,
    "embed": None,
    "q_heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "ffn": TP,
    "pages": None,
    "page_rows": None,
    "tokens": None,  # activations: every tp shard sees the whole step
}


def logical_to_spec(logical_axes: tuple[str, ...], shape: tuple[int, ...] | None = None, mesh: Mesh | None = None) -> P:
    """The PartitionSpec of an array with these logical axes (and, if given, this shape on this mesh)."""
    axes = []
    for i, name in enumerate(logical_axes):
        mesh_axis = LOGICAL_AXIS_RULES[name]
        if mesh_axis is not None and shape is not None and mesh is not None and shape[i] % mesh.shape[mesh_axis]:
            logger.warning("%s axis of size %d does not divide %s=%d: replicated", name, shape[i], mesh_axis,
                           mesh.shape[mesh_axis])
            mesh_axis = None
        axes.append(mesh_axis)
    return P(*axes)


def weight_shardings(config: ModelConfig, mesh: Mesh) -> Weights:
    """A ``Weights`` pytree of NamedShardings, one per declared weight (config: the padded one)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, logical_to_spec(s.logical_axes, s.shape, mesh)), param_specs(config),
        is_leaf=is_spec,
    )


def cache_sharding(config: ModelConfig, mesh: Mesh, v_layout: str = "token_major") -> KVCache:
    """A ``KVCache`` pytree of NamedShardings: every layer's K and V split by KV heads, the
    per-layer scales replicated (every shard's heads use its layer's scale). ``v_layout``: the
    cache's (its pytree metadata); KV heads lead in both layouts, so V's sharding is K's."""
    shape = (config.num_kv_heads, 1, 1, config.head_dim)
    sharding = NamedSharding(mesh, logical_to_spec(CACHE_LOGICAL_AXES, shape, mesh))
    return KVCache(k=[sharding] * config.num_layers, v=[sharding] * config.num_layers,
                   k_scale=replicated(mesh), v_scale=replicated(mesh), v_layout=v_layout)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_over_heads(attention_fn):
    """Run ``attention_fn(q, k_new, v_new, k_pages, v_pages, *metadata)`` on each tp shard's own heads.

    The kernels are per-device programs that XLA cannot partition, so under a mesh with a
    ``tp`` axis (``jax.set_mesh``) they run inside ``shard_map``: each shard gets its query
    heads, the matching KV heads and its slice of the pages; metadata is replicated. Outside a
    mesh, or with one tp shard, the function is returned unchanged.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP not in mesh.axis_names or mesh.shape[TP] == 1:
        return attention_fn
    q_spec = P(*(LOGICAL_AXIS_RULES[a] for a in ("tokens", "q_heads", "head_dim")))
    kv_new_spec = P(*(LOGICAL_AXIS_RULES[a] for a in ("tokens", "kv_heads", "head_dim")))
    pages_spec = P(*(LOGICAL_AXIS_RULES[a] for a in CACHE_LOGICAL_AXES))

    def wrapped(q, k_new, v_new, k_pages, v_pages, *metadata):
        fn = jax.shard_map(
            attention_fn, mesh=mesh, check_vma=False,
            in_specs=(q_spec, kv_new_spec, kv_new_spec, pages_spec, pages_spec) + (P(),) * len(metadata),
            out_specs=(q_spec, pages_spec, pages_spec),
        )
        return fn(q, k_new, v_new, k_pages, v_pages, *metadata)

    return wrapped

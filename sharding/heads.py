"""Head padding: lay out query and KV heads so that every tensor-parallel shard holds whole GQA groups.

The attention kernels map query head ``i`` to KV head ``i // group`` (``group = Hq / Hkv``).
Splitting heads over ``tp`` shards keeps that mapping inside each shard only if every shard
holds the same number of KV heads and, for each, the same number of query heads. When
``tp`` divides ``Hkv`` that is already true and nothing changes. Otherwise:

1. **KV slots.** Each shard gets ``ceil(Hkv / tp)`` KV-head slots, ``slots = tp * ceil(Hkv / tp)``
   in all. Slot ``j`` holds a copy of KV head ``j * Hkv // slots``: every KV head is
   *replicated* over ``r_h`` consecutive slots (1 or more), never zero-padded.
2. **Query heads.** KV head ``h``'s ``group`` query heads are split over its ``r_h`` slots,
   ``ceil(group / r_h)`` per slot at most; every slot is then padded with zero query heads to
   ``g = max_h ceil(group / r_h)``, so ``Hq' = slots * g``.

A zero query head attends somewhere harmless and its output projection rows are zero, so the
padded model computes exactly the original function. The default model (Hq=9, Hkv=3):

    tp=1: Hq'=9,  Hkv'=3 (nothing padded)
    tp=2: Hq'=12, Hkv'=4 (2 KV slots per shard: KV head 0 twice on shard 0, its 3 query heads split 2+1)
    tp=4: Hq'=12, Hkv'=4 (1 KV slot per shard; KV head 0 on 2 shards)
    tp=8: Hq'=16, Hkv'=8 (1 KV slot per shard; 2 query heads per shard, 7 of them zero)

Cost: the query/output projections and attention grow by ``Hq'/Hq``, the KV cache and K/V
projections by ``Hkv'/Hkv`` (replicated KV heads are stored and written on every shard that
holds them). Each shard already has ``ceil`` of its share, so per-device cost equals that of
the largest shard of any head split; only the all-device totals grow.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.params import Weights
from jaxinfer.quantization import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Where each padded head comes from: an original head index, or -1 for a zero head."""

    q_source: tuple[int, ...]  # [Hq'] original query head, -1: zero head
    kv_source: tuple[int, ...]  # [Hkv'] original KV head (copies allowed)

    @property
    def is_identity(self) -> bool:
        return self.q_source == tuple(range(len(self.q_source))) and self.kv_source == tuple(
            range(len(self.kv_source))
        )


def head_layout(num_q_heads: int, num_kv_heads: int, tp: int) -> HeadLayout:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    slots = tp * -(-num_kv_heads // tp)
    kv_source = [j * num_kv_heads // slots for j in range(slots)]
    copies = np.bincount(kv_source, minlength=num_kv_heads)  # r_h
    per_slot = int(max(-(-group // r) for r in copies))  # g
    q_source = []
    for j, h in enumerate(kv_source):
        replica = j - kv_source.index(h)  # which of h's copies this slot is
        chunk = -(-group // int(copies[h]))
        heads = [h * group + i for i in range(replica * chunk, min((replica + 1) * chunk, group))]
        q_source += heads + [-1] * (per_slot - len(heads))
    return HeadLayout(tuple(q_source), tuple(kv_source))


def padded_config(config: ModelConfig, layout: HeadLayout) -> ModelConfig:
    """The config of the padded model. ``head_dim`` (and so the softmax scale) is unchanged."""
    return dataclasses.replace(config, num_q_heads=len(layout.q_source), num_kv_heads=len(layout.kv_source))


def _take_heads(x: np.ndarray, source: tuple[int, ...], axis: int) -> np.ndarray:
    index = np.asarray(source)
    out = np.take(x, np.maximum(index, 0), axis=axis)
    mask_shape = [1] * x.ndim
    mask_shape[axis] = len(index)
    return np.where((index >= 0).reshape(mask_shape), out, np.zeros((), x.dtype))


def _take_projection_heads(w, source: tuple[int, ...], axis: int, quantized_axes: tuple[int, int | None]):
    """``_take_heads`` of a dense projection along ``axis``, or of a ``QuantizedWeight``'s payload
    and scale along ``quantized_axes`` (the scale has no head axis when heads are contracted)."""
    if not isinstance(w, QuantizedWeight):
        return _take_heads(w, source, axis)
    payload_axis, scale_axis = quantized_axes
    return QuantizedWeight(
        payload=_take_heads(w.payload, source, payload_axis),
        scale=w.scale if scale_axis is None else _take_heads(w.scale, source, scale_axis),
        input_scale=w.input_scale,  # per tensor: padded heads read the same input
    )


def pad_weights(weights: Weights, layout: HeadLayout) -> Weights:
    """Host (numpy) weights laid out by ``layout``: zero query heads, copied KV heads."""
    weights = _to_numpy(weights)
    if layout.is_identity:
        return weights
    q, kv = layout.q_source, layout.kv_source
    layers = []
    for layer in weights.layers:
        layers.append(dataclasses.replace(
            layer,
            q=_take_projection_heads(layer.q, q, 1, (0, 0)),  # [E, Hq', D] (quantized: [Hq', D, E])
            k=_take_projection_heads(layer.k, kv, 1, (0, 0)),  # [E, Hkv', D]
            v=_take_projection_heads(layer.v, kv, 1, (0, 0)),
            # [Hq', D, E] (quantized: [E, Hq', D]): zero rows make zero heads contribute nothing
            o=_take_projection_heads(layer.o, q, 0, (1, None)),
            q_bias=None if layer.q_bias is None else _take_heads(layer.q_bias, q, 0),
            k_bias=None if layer.k_bias is None else _take_heads(layer.k_bias, kv, 0),
            v_bias=None if layer.v_bias is None else _take_heads(layer.v_bias, kv, 0),
        ))
    return dataclasses.replace(weights, layers=layers)


def _to_numpy(weights: Weights) -> Weights:
    import jax

    return jax.tree.map(np.asarray, weights)

"""Static FP8 activation scales: one per-tensor scale per projection input, fixed before serving.

W8A8 (``jaxinfer.linear``) quantizes a projection's input to e4m3 either per token at run time
(``"dynamic"``: a row-max reduction, then a second pass to quantize) or with a scale fixed in
advance (``"static"``: ``clip(x / s, -448, 448)``, an elementwise op that XLA fuses into the
producer of ``x``, the RMSNorm or the silu-mul, in one pass). A static scale lives on the weight,
``QuantizedWeight.input_scale`` (a float32 scalar), and comes from one of two places:

- a compressed-tensors ``FP8`` checkpoint's ``input_scale`` tensors (``jaxinfer.checkpoint``);
- calibration over sample text (``jaxinfer.activation_calibration``), for a model quantized at
  load from bf16/f32 weights.

Projections that read one input (q/k/v; gate/up) quantize it once (``linear_many``), so they must
agree on one scale: :func:`share_input_scales` gives each group the **largest** of its members'
scales, as vLLM does when it fuses q/k/v (a larger scale clips nothing the smaller ones kept, at
the cost of a little resolution for the projection that had the smaller one).

:class:`ActivationObserver` is what calibration puts in ``input_scale`` while it runs the model's
own forward: :func:`jaxinfer.linear.linear` hands it each input it sees and runs the dynamic path.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import RequestError
from jaxinfer.quantization import QuantizedWeight
from jaxinfer.quantized_checkpoint import ACTIVATION_SCALES

if TYPE_CHECKING:
    from jaxinfer.loaded_model import LoadedModel

# The projections of a layer that read one input, by the name of that input.
INPUT_GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


@dataclasses.dataclass(eq=False)
class ActivationObserver:
    """Stands in a ``QuantizedWeight.input_scale`` during calibration: :func:`jaxinfer.linear.linear`
    calls ``observe(x)`` with the projection's input as ``[M, K]`` and runs the dynamic path.

    ``observe`` is called while the calibration program is traced; it keeps what it makes (traced
    arrays of that same program) for the program to return.
    """

    observe: Callable[[jax.Array], None]


def check_activation_scales(activation_scales: str | None, field: str = "activation_scales") -> str | None:
    """``activation_scales`` when ``None`` or one of :data:`ACTIVATION_SCALES`, else a ``RequestError``."""
    if activation_scales is not None and activation_scales not in ACTIVATION_SCALES:
        raise RequestError(f"{field} {activation_scales!r} is not one of {list(ACTIVATION_SCALES)} or None",
                           field=field)
    return activation_scales


def share_input_scales(weights):
    """``Weights`` in which each group of :data:`INPUT_GROUPS` carries the largest of its members'
    static input scales (the module docstring says why the largest); weights without one are kept."""
    def one(layer):
        updates = {}
        for names in INPUT_GROUPS.values():
            members = [getattr(layer, name) for name in names]
            if not all(isinstance(w, QuantizedWeight) and w.input_scale is not None for w in members):
                continue
            # On the host (a few scalars at load time), then back where the first member's scale is.
            shared = np.float32(max(float(w.input_scale) for w in members))
            shared = (put_beside(shared, members[0].input_scale)
                      if isinstance(members[0].input_scale, jax.Array) else jnp.asarray(shared))
            updates.update({name: dataclasses.replace(w, input_scale=shared) for name, w in zip(names, members)})
        return dataclasses.replace(layer, **updates)

    return dataclasses.replace(weights, layers=[one(layer) for layer in weights.layers])


def with_static_input_scales(model: "LoadedModel", scales: dict[str, np.ndarray]) -> "LoadedModel":
    """``model`` (FP8 weights) serving W8A8 with static activation scales: ``scales[group]`` is a
    ``[num_layers]`` float32 array for each group of :data:`INPUT_GROUPS` (what
    ``jaxinfer.activation_calibration.calibrate_activation_scales`` returns)."""
    if model.config.quantization != "fp8":
        raise RequestError(f"static activation scales need FP8 weights; the model's are "
                           f"{model.config.quantization or 'not quantized'}", field="quantization")
    missing = sorted(set(INPUT_GROUPS) - set(scales))
    if missing:
        raise ValueError(f"static activation scales: no scales for {missing}")
    num_layers = model.config.num_layers
    for group in INPUT_GROUPS:
        values = np.asarray(scales[group], np.float32)
        if values.shape != (num_layers,) or not (np.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"static activation scales[{group!r}]: expected {num_layers} positive finite "
                             f"numbers, got shape {values.shape}")

    def one(i, layer):
        updates = {}
        for group, names in INPUT_GROUPS.items():
            s = put_beside(np.float32(scales[group][i]), getattr(layer, names[0]).scale)
            updates.update({name: dataclasses.replace(getattr(layer, name), input_scale=s) for name in names})
        return dataclasses.replace(layer, **updates)

    weights = dataclasses.replace(model.weights, layers=[one(i, layer) for i, layer in enumerate(model.weights.layers)])
    config = dataclasses.replace(model.config, activation_scales="static")
    return dataclasses.replace(model, config=config, weights=weights)


def put_beside(value, array) -> jax.Array:
    """``value`` (a host scalar) on the device(s) of ``array``, committed only if ``array`` is.

    An uncommitted model (one device, its arrays made by jit on the default device) must get an
    uncommitted scale: jit keys and lowers its programs by which inputs are committed, and outputs
    of a call with a committed input are committed. With committed scales in an uncommitted model
    the step programs' runs no longer lowered to what the engine's warm-up had compiled ahead of
    time, and compiled again, serially: session 12's static-scale engine did not finish warming up
    in 300 s on an H200; a tiny CPU model compiled its 5 forward programs 8 times and its samplers
    twice (tests/test_activation_calibration.py)."""
    if not array.committed:
        return jnp.asarray(value)
    return jax.device_put(value, _replicated_like(array))


def _replicated_like(array) -> jax.sharding.Sharding:
    """Where a scalar beside ``array`` goes: on every device of its mesh (its sharding's own
    partition would not fit a scalar), or on its one device."""
    sharding = array.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def without_static_input_scales(model: "LoadedModel") -> "LoadedModel":
    """``model`` with per-token dynamic activation scales (any static ones dropped)."""
    if model.config.activation_scales == "dynamic":
        return model

    def one(layer):
        return dataclasses.replace(layer, **{
            name: dataclasses.replace(getattr(layer, name), input_scale=None)
            for names in INPUT_GROUPS.values() for name in names})

    weights = dataclasses.replace(model.weights, layers=[one(layer) for layer in model.weights.layers])
    return dataclasses.replace(model, config=dataclasses.replace(model.config, activation_scales="dynamic"),
                               weights=weights)


def input_scales(model: "LoadedModel") -> dict[str, np.ndarray]:
    """The static scales of a static model, as :func:`with_static_input_scales` takes them."""
    if model.config.activation_scales != "static":
        raise ValueError("the model's activation scales are dynamic")
    return {group: np.asarray([float(getattr(layer, names[0]).input_scale) for layer in model.weights.layers],
                              np.float32)
            for group, names in INPUT_GROUPS.items()}

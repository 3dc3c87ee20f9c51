"""The model's weights: declared once, with shapes and logical axis names.

Every weight is declared in :func:`param_specs` with its shape and the *logical* names
of its axes (``vocab``, ``embed``, ``q_heads``, ``kv_heads``, ``head_dim``, ``ffn``).
Random initialisation, loading, and the sharding rules in ``sharding/`` all derive from
that one declaration, so laying weights on a mesh never touches model code.

Matrices are stored input-axis first (``[embed, q_heads, head_dim]``) so the model's
einsums read ``"te,ehd->thd"``; loaders transpose Hugging Face's ``[out, in]`` tensors.

With ``config.quantization`` set (``"fp8"``/``"int8"``) each projection (q, k, v, o, gate, up,
down) is declared as a :class:`~jaxinfer.quantization.QuantizedWeight` of two specs: the payload
``[out..., in...]`` (Hugging Face's order, no transpose on loading) in the quantized dtype and the
per-output-channel scale ``[out...]`` in float32, both with the dense weight's axis names. With
``config.activation_scales == "static"`` (FP8) each also declares its ``input_scale``, a float32
scalar with no axes (so replicated everywhere). The embedding, norms and lm_head stay in the
serving dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.quantization import QUANTIZATIONS, QuantizedWeight, quantization_of_dtype, quantize

# The projections that a quantized model quantizes, and how many of their leading (input) axes
# the matmul contracts: o is [q_heads, head_dim, embed], the rest [in, out...].
QUANTIZED_PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    logical_axes: tuple[str, ...]
    init: str  # "normal" (scaled by fan-in), "ones" or "zeros"
    dtype: str | None = None  # None: the serving dtype (the model's dtype argument); else fixed


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: Any  # [embed]
    q: Any  # [embed, q_heads, head_dim]
    k: Any  # [embed, kv_heads, head_dim]
    v: Any  # [embed, kv_heads, head_dim]
    o: Any  # [q_heads, head_dim, embed]
    mlp_norm: Any  # [embed]
    gate: Any  # [embed, ffn]
    up: Any  # [embed, ffn]
    down: Any  # [ffn, embed]
    q_bias: Any = None  # [q_heads, head_dim]   (Qwen2)
    k_bias: Any = None  # [kv_heads, head_dim]
    v_bias: Any = None  # [kv_heads, head_dim]
    q_norm: Any = None  # [head_dim]            (Qwen3)
    k_norm: Any = None  # [head_dim]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: Any  # [vocab, embed]
    layers: list[LayerWeights]
    final_norm: Any  # [embed]
    lm_head: Any = None  # [embed, vocab]; None when tied to ``embed``


def param_specs(config: ModelConfig) -> Weights:
    """The declaration of every weight: a ``Weights`` pytree whose leaves are ``ParamSpec``s."""
    e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv, vocab = config.num_q_heads, config.num_kv_heads, config.vocab_size

    def layer() -> LayerWeights:
        bias = config.attention_bias
        return LayerWeights(
            attn_norm=ParamSpec((e,), ("embed",), "ones"),
            q=ParamSpec((e, hq, d), ("embed", "q_heads", "head_dim"), "normal"),
            k=ParamSpec((e, hkv, d), ("embed", "kv_heads", "head_dim"), "normal"),
            v=ParamSpec((e, hkv, d), ("embed", "kv_heads", "head_dim"), "normal"),
            o=ParamSpec((hq, d, e), ("q_heads", "head_dim", "embed"), "normal"),
            mlp_norm=ParamSpec((e,), ("embed",), "ones"),
            gate=ParamSpec((e, f), ("embed", "ffn"), "normal"),
            up=ParamSpec((e, f), ("embed", "ffn"), "normal"),
            down=ParamSpec((f, e), ("ffn", "embed"), "normal"),
            q_bias=ParamSpec((hq, d), ("q_heads", "head_dim"), "zeros") if bias else None,
            k_bias=ParamSpec((hkv, d), ("kv_heads", "head_dim"), "zeros") if bias else None,
            v_bias=ParamSpec((hkv, d), ("kv_heads", "head_dim"), "zeros") if bias else None,
            q_norm=ParamSpec((d,), ("head_dim",), "ones") if config.qk_norm else None,
            k_norm=ParamSpec((d,), ("head_dim",), "ones") if config.qk_norm else None,
        )

    def quantized_layer() -> LayerWeights:
        dense = layer()
        return dataclasses.replace(dense, **{
            name: quantized_spec(getattr(dense, name), num_in, config.quantization,
                                 static_input_scale=config.activation_scales == "static")
            for name, num_in in QUANTIZED_PROJECTIONS.items()
        })

    return Weights(
        embed=ParamSpec((vocab, e), ("vocab", "embed"), "normal"),
        layers=[quantized_layer() if config.quantization else layer() for _ in range(config.num_layers)],
        final_norm=ParamSpec((e,), ("embed",), "ones"),
        lm_head=None if config.tie_word_embeddings else ParamSpec((e, vocab), ("embed", "vocab"), "normal"),
    )


def quantized_spec(dense: ParamSpec, num_in_axes: int, quantization: str,
                   static_input_scale: bool = False) -> QuantizedWeight:
    """The declaration of a quantized projection: payload [out..., in...], scale [out...], and with
    ``static_input_scale`` the activations' scale [] (initialised to one, a placeholder until calibrated)."""
    in_shape, out_shape = dense.shape[:num_in_axes], dense.shape[num_in_axes:]
    in_axes, out_axes = dense.logical_axes[:num_in_axes], dense.logical_axes[num_in_axes:]
    return QuantizedWeight(
        payload=ParamSpec(out_shape + in_shape, out_axes + in_axes, dense.init,
                          jnp.dtype(QUANTIZATIONS[quantization]).name),
        scale=ParamSpec(out_shape, out_axes, "ones", "float32"),
        input_scale=ParamSpec((), (), "ones", "float32") if static_input_scale else None,
    )


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def is_declared_weight(x: Any) -> bool:
    """A leaf of the declaration as the loaders see it: a ``ParamSpec`` or a whole ``QuantizedWeight``."""
    return isinstance(x, (ParamSpec, QuantizedWeight))


def spec_dtype(spec: ParamSpec, serving_dtype) -> jnp.dtype:
    """The dtype a weight is stored in: its fixed dtype, else the serving dtype."""
    return jnp.dtype(spec.dtype or serving_dtype)


def logical_axes(config: ModelConfig) -> Weights:
    """``Weights`` pytree of logical-axis tuples, for the sharding rules."""
    return jax.tree.map(lambda s: s.logical_axes, param_specs(config), is_leaf=is_spec)


def init_random(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, out_shardings=None) -> Weights:
    """Random weights (for benchmarks and tests): normal scaled by 1/sqrt(fan-in), norms at one.

    Made on the device(s), laid out by ``out_shardings`` when given, one small jitted
    program per distinct (shape, init, sharding): the layers share shapes, so a model
    compiles about ten tiny programs. One jit over every weight looked simpler, but XLA's
    GPU compiler fused the hundreds of small random draws of Qwen3-0.6B (and of a
    tp-sharded Llama-3.1-8B) into fusions it took minutes to compile.
    """
    specs = param_specs(config)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_declared_weight)
    shardings = (treedef.flatten_up_to(out_shardings) if out_shardings is not None else [None] * len(leaves))
    if len(shardings) != len(leaves):
        raise ValueError(f"out_shardings has {len(shardings)} leaves, the weights {len(leaves)}")
    keys = jax.random.split(key, len(leaves))
    programs = {}

    def program(spec, sharding):
        if isinstance(spec, QuantizedWeight):
            return quantized_program(spec, sharding)
        signature = (spec.shape, spec.init, spec.logical_axes[0] == "vocab", sharding)
        if signature not in programs:
            if spec.init in ("ones", "zeros"):
                fill = jnp.ones if spec.init == "ones" else jnp.zeros
                make = lambda k, shape=spec.shape, fill=fill: fill(shape, dtype)  # noqa: E731
            else:
                fan_in = spec.shape[0] if spec.logical_axes[0] != "vocab" else spec.shape[-1]
                make = lambda k, shape=spec.shape, fan_in=fan_in: (  # noqa: E731
                    jax.random.normal(k, shape, jnp.float32) / fan_in**0.5).astype(dtype)
            programs[signature] = jax.jit(make, out_shardings=sharding)
        return programs[signature]

    def quantized_program(spec: QuantizedWeight, sharding):
        # Drawn dense in the [out..., in...] layout (fan-in: the trailing axes), then quantized.
        num_out = len(spec.scale.shape)
        shape, quantization = spec.payload.shape, quantization_of_dtype(spec.payload.dtype)
        static = spec.input_scale is not None
        signature = (shape, num_out, quantization, static, sharding)
        if signature not in programs:
            fan_in = math.prod(shape[num_out:])

            def make(k, shape=shape, fan_in=fan_in, num_out=num_out, quantization=quantization, static=static):
                w = quantize(jax.random.normal(k, shape, jnp.float32) / fan_in**0.5, quantization, num_out)
                # A static scale of one until calibrated (jaxinfer.activation_calibration).
                return dataclasses.replace(w, input_scale=jnp.ones((), jnp.float32)) if static else w

            programs[signature] = jax.jit(make, out_shardings=sharding)
        return programs[signature]

    arrays = [program(spec, sharding)(k) for spec, sharding, k in zip(leaves, shardings, keys)]
    return jax.tree.unflatten(treedef, arrays)


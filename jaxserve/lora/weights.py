"""The adapters on the device: stacked factors, one slot per adapter, and the batched LoRA product.

    {w}_a   [layers, *in, max_loras + 1, max_rank]      w in wq, wk, wv, wo, w_gate, w_up, w_down
    {w}_b   [layers, max_loras + 1, max_rank, *out]     (scale folded in; slot 0 and unused ranks are zeros)

The factors sit in the model beside the weights they adapt (`model.layers.lora`), so the layer scan slices them
with the rest, the memory plan counts them before the KV cache, and tensor parallelism splits them like their base
projection: `a` keeps the weight's input axes, `b` its output axes (column-parallel q/k/v/gate/up split b on
heads / mlp; row-parallel o/down split a, and GSPMD sums the partial products).

Every token row carries its slot. A step computes the product for the whole mixed batch at once, against every
slot, with each token's slot selected by a one-hot mask (XLA; no gathered copy of the factors). The layouts make
both products plain matrix products, [T, in] @ [in, S * r] and [T, S * r] @ [S * r, out] (no transposes):

    xa    = einsum(x [T, *in], a [*in, S, r])                      -> [T, S, r]
    delta = einsum(xa * onehot(slot) [T, S, 1], b [S, r, *out])   -> [T, *out]

Loading an adapter writes its slot in place (the arrays are donated); the shapes never change, so nothing
recompiles when adapters come and go.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.lora.adapter import WEIGHT_NAMES, Adapter, weight_dims

_IN, _OUT = "ijk", "uvw"  # einsum letters of a weight's input and output dims (at most two of each)


class LoraWeights(nnx.Module):
    """Stacked adapter factors of every target weight (see the module docstring). `num_slots` = max_loras + 1."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype):
        from jaxserve.models.llama import layer_weight_specs
        specs = layer_weight_specs(cfg)
        self.num_slots, self.max_rank = max_loras + 1, max_rank
        for name in WEIGHT_NAMES:
            in_dims, out_dims = weight_dims(cfg, name)
            axes = specs[name].axes[1:]
            in_axes, out_axes = axes[:len(in_dims)], axes[len(in_dims):]
            shape_a = (cfg.num_layers, *in_dims, self.num_slots, max_rank)
            shape_b = (cfg.num_layers, self.num_slots, max_rank, *out_dims)
            setattr(self, f"{name}_a", nnx.Param(jnp.zeros(shape_a, dtype), axes=("layers", *in_axes, None, None)))
            setattr(self, f"{name}_b", nnx.Param(jnp.zeros(shape_b, dtype), axes=("layers", None, None, *out_axes)))

    def token_mask(self, slots: jax.Array, dtype) -> jax.Array:
        """[..., T] int32 adapter slots -> [..., T, num_slots] one-hot selection."""
        return jax.nn.one_hot(slots, self.num_slots, dtype=dtype)

    def delta(self, name: str, x: jax.Array, mask: jax.Array) -> jax.Array:
        """The LoRA term of projection `name` (one layer's slice) for tokens x [..., T, *in]: [..., T, *out]."""
        a, b = getattr(self, f"{name}_a")[...], getattr(self, f"{name}_b")[...]
        return lora_delta(x, a, b, mask)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """x [..., T, *in], a [*in, S, r], b [S, r, *out], mask [..., T, S] -> [..., T, *out] float32."""
    i, o = _IN[:a.ndim - 2], _OUT[:b.ndim - 2]
    xa = jnp.einsum(f"...t{i},{i}sr->...tsr", x, a, preferred_element_type=jnp.float32)
    xa = (xa * mask[..., None]).astype(b.dtype)
    return jnp.einsum(f"...tsr,sr{o}->...t{o}", xa, b, preferred_element_type=jnp.float32)


def attach(model, max_loras: int, max_rank: int):
    """A copy of `model` with empty adapter slots (`model.layers.lora`); `model` itself is left as it was."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    copy.layers.lora = LoraWeights(model.cfg, max_loras, max_rank, model.dtype)
    return copy


def slot_values(adapter: Adapter | None, cfg: ModelConfig, max_rank: int) -> dict[str, np.ndarray]:
    """What one slot holds for `adapter` (zeros for None and for the weights it does not adapt): {"wq_a":
    [layers, *in, max_rank], "wq_b": [layers, max_rank, *out], ...} float32, ranks zero-padded (write_slot puts
    them at the slot axis of each stacked array)."""
    values = {}
    for name in WEIGHT_NAMES:
        in_dims, out_dims = weight_dims(cfg, name)
        a = np.zeros((cfg.num_layers, *in_dims, max_rank), np.float32)
        b = np.zeros((cfg.num_layers, max_rank, *out_dims), np.float32)
        if adapter is not None and name in adapter.weights:
            fa, fb = adapter.weights[name]
            a[..., :fa.shape[-1]] = fa
            b[:, :fb.shape[1]] = fb
        values[f"{name}_a"], values[f"{name}_b"] = a, b
    return values


def write_slot(factors: dict[str, jax.Array], slot: jax.Array, values: dict[str, jax.Array]
               ) -> dict[str, jax.Array]:
    """factors[k][..., slot, :] (a) or [:, slot] (b) = values[k] for every stacked array (jit with `factors`
    donated: in place)."""
    return {k: (w.at[..., slot, :] if k.endswith("_a") else w.at[:, slot]).set(values[k].astype(w.dtype))
            for k, w in factors.items()}


def merge(model, adapter: Adapter):
    """A copy of `model` whose float weights have the adapter merged in (W + scale * B @ A, on the device, one
    weight at a time); `model` itself is left as it was."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    for name, (a, b) in adapter.weights.items():
        param = getattr(copy.layers, name)  # replaced, not set: the copy's Variables may be the model's
        setattr(copy.layers, name, nnx.Param(_merged(param[...], jnp.asarray(a), jnp.asarray(b)),
                                             **param.get_metadata()))
    return copy


@jax.jit
def _merged(w: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """w [layers, *in, *out] + a [layers, *in, r] @ b [layers, r, *out], accumulated in float32."""
    flat_a = a.reshape(a.shape[0], -1, a.shape[-1])
    flat_b = b.reshape(b.shape[0], b.shape[1], -1)
    delta = jnp.einsum("lir,lro->lio", flat_a, flat_b, preferred_element_type=jnp.float32)
    return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)


def merged_weights(model, adapter: Adapter) -> dict[str, np.ndarray]:
    """W + scale * B @ A for every weight the adapter adapts, in jaxserve layout ([layers, *in, *out], float32):
    the reference the tests compare batched serving against, and what --merge-lora would load."""
    merged = {}
    for name, (a, b) in adapter.weights.items():
        base = np.asarray(getattr(model.layers, name)[...], np.float32)
        flat_a = a.reshape(a.shape[0], -1, a.shape[-1])  # [layers, in, r]
        flat_b = b.reshape(b.shape[0], b.shape[1], -1)  # [layers, r, out]
        merged[name] = base + np.einsum("lir,lro->lio", flat_a, flat_b).reshape(base.shape)
    return merged

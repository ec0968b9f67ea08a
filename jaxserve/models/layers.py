"""Building blocks shared by the decoder families: RMSNorm (both weightings), the gated MLP's activations.
Rotary embeddings live in jaxserve.models.rope."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """RMSNorm in float32. Llama casts back before the weight multiply; with `offset` (Gemma) the weight is
    1 + weight and the multiply happens in float32 before the cast, as each family's transformers code does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x unchanged when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)

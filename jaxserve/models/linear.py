"""The dense product every projection goes through, so that quantized weights plug in at one place."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense(x: jax.Array, weight, spec: str, out_dtype=None) -> jax.Array:
    """einsum(spec, x, weight) accumulated in float32, returned in `out_dtype` (default: x's dtype)."""
    out = jnp.einsum(spec, x, weight[...], preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)

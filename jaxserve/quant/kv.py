"""Quantized KV-cache storage: `--kv-cache-dtype int8 | fp8`.

    int8  values int8 [..., head_dim], one float32 scale per token and KV head:  x = q * scale,
          scale = max_d |x[d]| / 127 (symmetric, per token and head; written with the token, never rescaled)
    fp8   values float8_e4m3fn [..., head_dim], no scale (the value itself, saturated to +-448)

The attention paths dequantize on load: K's scale multiplies the q.k logits and V's scale the softmax
probabilities, so the int8 values go into the dot products unchanged (exact in bfloat16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16,
                   "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
SCALE_BYTES = 4  # one float32 per token, head and K/V in an int8 cache


def kv_storage_dtype(name: str, model_dtype) -> jnp.dtype:
    """The cache's element type for `--kv-cache-dtype` (auto: the model's activation dtype)."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    return jnp.dtype(KV_CACHE_DTYPES[name])


def has_scales(dtype) -> bool:
    """int8 caches carry per-token, per-head scales; float (and fp8) caches do not."""
    return jnp.dtype(dtype) == jnp.int8


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """x [..., head_dim] float -> (values in the cache dtype, scales [...] float32 for int8 else None)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        x = x.astype(jnp.float32)
        amax = jnp.abs(x).max(axis=-1)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale
    if dtype == jnp.float8_e4m3fn:
        return jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX).astype(dtype), None
    return x.astype(dtype), None


def dequantize_kv(values: jax.Array, scale: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    out = values.astype(jnp.float32)
    if scale is not None:
        out = out * scale[..., None]
    return out.astype(dtype)

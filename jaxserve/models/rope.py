"""Rotary position embeddings and their long-context scalings, as transformers computes them.

    inv_freq, attention_factor = rope_frequencies(cfg.rope, cfg.head_dim)     # numpy, once per trace
    cos, sin = rope_cos_sin(positions, inv_freq, attention_factor, dtype)      # [T, rotary_dim]
    q = apply_rope(q, cos, sin)                                                # rotates q[..., :rotary_dim]

Every scaling is a static table of inverse frequencies (plus a cos/sin multiplier for YaRN and LongRoPE), so a
key written to the cache is never rotated differently later:

    default   theta ** (-2i / d)
    linear    inv_freq / factor
    llama3    long wavelengths / factor, short kept, a smooth ramp between (Llama 3.1)
    yarn      interpolation (/ factor) below a rotation count, extrapolation above, a linear ramp between;
              cos and sin times the attention factor (0.1 ln(factor) + 1 unless the config gives one)
    dynamic   NTK: theta grown for a context of factor x max_position_embeddings. transformers regrows theta as
              a sequence lengthens (its cached keys then mix bases); jaxserve fixes it at that length, as vLLM does
    longrope  Phi-3: one rescale factor per frequency, the long set when the engine's context exceeds
              original_max_position_embeddings, else the short set (decided once, as vLLM does); cos and sin
              times sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) unless the config gives one

Partial rotary (partial_rotary_factor < 1): only the first int(head_dim * factor) dims rotate.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rotary_dim // 2] float32, cos/sin multiplier)."""
    dim = rotary_dim(rope, head_dim)
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.type == "linear":
        return (inv_freq / rope.factor).astype(np.float32), 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, rope).astype(np.float32), 1.0
    if rope.type == "yarn":
        return _yarn(rope, dim)
    if rope.type == "dynamic":
        return _dynamic_ntk(rope, dim), 1.0
    if rope.type == "longrope":
        return _longrope(rope, exponents)
    return inv_freq.astype(np.float32), 1.0


def _llama3(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short kept, a smooth ramp between."""
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071), transformers' `_compute_yarn_parameters` step for step."""
    factor, base, original = rope.factor, rope.theta, rope.original_max_position_embeddings
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention)


def _dynamic_ntk(rope: RopeConfig, dim: int) -> np.ndarray:
    """NTK-aware theta for a context of factor x max_position_embeddings (transformers' formula at that length)."""
    factor, max_positions = rope.factor, rope.max_position_embeddings
    seq_len = factor * max_positions
    base = rope.theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return (1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


def uses_long_factors(rope: RopeConfig) -> bool:
    """LongRoPE: the long factor set when the served context exceeds the pretraining one."""
    context = rope.context_len if rope.context_len is not None else rope.max_position_embeddings
    return context > rope.original_max_position_embeddings


def _longrope(rope: RopeConfig, exponents: np.ndarray) -> tuple[np.ndarray, float]:
    factors = np.asarray(rope.long_factor if uses_long_factors(rope) else rope.short_factor, np.float32)
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if rope.factor <= 1.0 else math.sqrt(
            1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    inv_freq = 1.0 / (factors * rope.theta ** exponents)
    return inv_freq.astype(np.float32), float(attention)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, attention_factor: float,
                 dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [T, rotary_dim] for the given positions, computed in float32, times the attention
    factor, then cast (the order transformers uses)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of x's first cos.shape[-1] dims. x: [T, heads, head_dim]; cos, sin:
    [T, rotary_dim]. The remaining dims pass through (partial rotary)."""
    rot = cos.shape[-1]
    x_rot, x_pass = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if x_pass is None else jnp.concatenate([out, x_pass], axis=-1)

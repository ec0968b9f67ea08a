"""Weight-only quantization schemes: how a float weight becomes integer values plus float32 scales, and back.

A weight is declared [contract dims..., output dims...] (see `jaxserve.models.llama.WeightSpec.contract`); its
matrix view is [K, N] with K = prod(contract dims), N = prod(output dims), and `x @ W` contracts K.

    int8   values  int8  [contract dims..., out dims...]          q in [-127, 127]
           scales  f32   [out dims...]                            W[k, n] = q[k, n] * scales[n]
                   per output channel, symmetric: scales[n] = max_k |W[k, n]| / 127

    int4   values  uint8 [contract dims (last one halved)..., out dims...]
           scales  f32   [K / G, out dims...]                     W[k, n] = (nibble[k, n] - 8) * scales[k // G, n]
                   group-wise along K (G = group_size(K), 128 when it divides K), symmetric, nibbles in [1, 15]
                   (value -7..7, offset by 8); scales[g, n] = r * max_{k in group g} |W[k, n]| / 7 with the clip
                   ratio r in INT4_CLIP_RATIOS that minimises the group's squared error (r = 1 is plain absmax;
                   clipping a few outliers buys a finer step for the rest)

int4 packing (matrix view [K, N] -> [K / 2, N] bytes): byte [r, n] holds rows 2r and 2r + 1 of column n, row 2r
in the low nibble, each stored as value + 8. Pairs are adjacent along K, i.e. along the last contract dim, which
must be even:

    byte[r, n] = (q[2r, n] + 8) | (q[2r + 1, n] + 8) << 4
    q[2r, n] = (byte[r, n] & 15) - 8,   q[2r + 1, n] = (byte[r, n] >> 4) - 8

Group size: 128 when 128 divides K; otherwise the largest power of two dividing K (64 for the test models'
hidden size 64 and for the demo model's intermediate size 704 = 11 x 64), and at least MIN_GROUP_SIZE (the
kernel's k-tiles, of at least 2 x 16 rows, must not straddle a group).

Scales are float32 in the checkpoint and at run time (the loader keeps them: `keep_dtype` metadata).
Everything here is jnp (usable on numpy inputs, under jit and vmap); nothing imports the model.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

SCHEMES = ("int8", "int4")
INT8_MAX = 127
INT4_MAX = 7  # symmetric: -7..7 (the nibble 0, value -8, is never written)
INT4_OFFSET = 8
INT4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
GROUP_SIZE = 128
MIN_GROUP_SIZE = 32


class QuantizationError(ValueError):
    """A weight or setting a scheme cannot take; the message says what to change."""


def check_scheme(scheme: str | None) -> None:
    if scheme is not None and scheme not in SCHEMES:
        raise QuantizationError(f"quantization scheme must be one of {', '.join(SCHEMES)}, not {scheme!r}")


def group_size(k: int) -> int:
    """int4 group size for a contraction of K: 128, or the largest power of two dividing K when 128 does not."""
    g = min(GROUP_SIZE, k & -k)
    if g < MIN_GROUP_SIZE:
        raise QuantizationError(f"int4 needs a contraction size divisible by {MIN_GROUP_SIZE}; {k} is not "
                                f"(use --quantize int8 for this model)")
    return g


@dataclasses.dataclass(frozen=True)
class QuantizedLayout:
    """Shapes, dtypes and logical axes of one quantized weight (per layer, or stacked when `shape` is)."""

    values_shape: tuple[int, ...]
    values_dtype: jnp.dtype
    values_axes: tuple[str | None, ...]
    scales_shape: tuple[int, ...]
    scales_axes: tuple[str | None, ...]

    @property
    def nbytes(self) -> int:
        return (math.prod(self.values_shape) * jnp.dtype(self.values_dtype).itemsize
                + math.prod(self.scales_shape) * 4)


def layout(shape: tuple[int, ...], axes: tuple[str | None, ...], contract: int, scheme: str,
           stacked: int = 0) -> QuantizedLayout:
    """The stored layout of a weight of `shape` whose first `stacked` dims are layer dims (not contracted),
    followed by `contract` contraction dims and then the output dims."""
    check_scheme(scheme)
    lead, kdims, ndims = shape[:stacked], shape[stacked:stacked + contract], shape[stacked + contract:]
    lead_axes, k_axes, n_axes = axes[:stacked], axes[stacked:stacked + contract], axes[stacked + contract:]
    if scheme == "int8":
        return QuantizedLayout(shape, jnp.int8, axes, lead + ndims, lead_axes + n_axes)
    if kdims[-1] % 2:
        raise QuantizationError(f"int4 packs pairs along the last contraction dim; {shape} has an odd one")
    k = math.prod(kdims)
    values_shape = lead + kdims[:-1] + (kdims[-1] // 2,) + ndims
    # The group axis takes the first contraction dim's logical name: sharding it splits groups like the rows.
    return QuantizedLayout(values_shape, jnp.uint8, axes, lead + (k // group_size(k),) + ndims,
                           lead_axes + k_axes[:1] + n_axes)


def _as_matrix(w: jax.Array, contract: int) -> jax.Array:
    k = math.prod(w.shape[:contract])
    return w.reshape(k, -1)


def quantize(w: jax.Array, contract: int, scheme: str) -> tuple[jax.Array, jax.Array]:
    """One (unstacked) float weight [contract dims..., out dims...] -> (values, scales), layouts as above."""
    check_scheme(scheme)
    kdims, ndims = w.shape[:contract], w.shape[contract:]
    w2 = _as_matrix(jnp.asarray(w, jnp.float32), contract)
    if scheme == "int8":
        scales = _scale(jnp.abs(w2).max(axis=0), INT8_MAX)
        q = jnp.clip(jnp.round(w2 / scales), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return q.reshape(w.shape), scales.reshape(ndims)
    k, n = w2.shape
    g = group_size(k)
    groups = w2.reshape(k // g, g, n)
    scales = _int4_scales(groups)  # [K / G, N]
    q = jnp.clip(jnp.round(groups / scales[:, None, :]), -INT4_MAX, INT4_MAX).astype(jnp.int32).reshape(k, n)
    packed = pack_int4(q)
    return packed.reshape(kdims[:-1] + (kdims[-1] // 2,) + ndims), scales.reshape((k // g,) + ndims)


def _int4_scales(groups: jax.Array) -> jax.Array:
    """[K / G, G, N] float32 -> [K / G, N]: per group, the clipped-absmax scale with the least squared error."""
    amax = jnp.abs(groups).max(axis=1)
    best_scale, best_error = None, None
    for ratio in INT4_CLIP_RATIOS:
        scale = _scale(amax * ratio, INT4_MAX)
        q = jnp.clip(jnp.round(groups / scale[:, None, :]), -INT4_MAX, INT4_MAX)
        error = jnp.square(q * scale[:, None, :] - groups).sum(axis=1)
        if best_scale is None:
            best_scale, best_error = scale, error
        else:
            better = error < best_error
            best_scale, best_error = jnp.where(better, scale, best_scale), jnp.where(better, error, best_error)
    return best_scale


def quantize_stacked(w: jax.Array, contract: int, scheme: str, stacked: int = 0) -> tuple[jax.Array, jax.Array]:
    """quantize() of a weight whose first `stacked` dims are layers, one layer at a time (vmapped)."""
    fn = functools.partial(quantize, contract=contract, scheme=scheme)
    for _ in range(stacked):
        fn = jax.vmap(fn)
    return fn(w)


def _scale(amax: jax.Array, qmax: int) -> jax.Array:
    """amax / qmax, with 1 for all-zero channels (any scale reproduces zeros; 1 keeps q = 0, not NaN)."""
    return jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)


def pack_int4(q: jax.Array) -> jax.Array:
    """[K, N] integers in [-8, 7] -> [K / 2, N] uint8, row 2r in the low nibble of row r (values offset by 8)."""
    u = (q + INT4_OFFSET).astype(jnp.uint8)
    return u[0::2] | (u[1::2] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[K / 2, N] uint8 -> [K, N] int8 in [-8, 7] (inverse of pack_int4)."""
    low = (packed & 15).astype(jnp.int8) - INT4_OFFSET
    high = (packed >> 4).astype(jnp.int8) - INT4_OFFSET
    return jnp.stack([low, high], axis=1).reshape(-1, packed.shape[-1])


def dequantize(values: jax.Array, scales: jax.Array, contract: int, scheme: str, dtype=jnp.float32) -> jax.Array:
    """(values, scales) of one unstacked weight -> the float weight [contract dims..., out dims...] in `dtype`."""
    w2 = dequantize_matrix(matrix(values, scales, contract, scheme), scheme)
    ndims = scales.shape if scheme == "int8" else scales.shape[1:]
    kdims = values.shape[:contract]
    if scheme == "int4":
        kdims = kdims[:-1] + (kdims[-1] * 2,)
    return w2.reshape(kdims + ndims).astype(dtype)


def matrix(values: jax.Array, scales: jax.Array, contract: int, scheme: str) -> tuple[jax.Array, jax.Array]:
    """The [K (/ 2 for int4), N] values and [N] (int8) or [K / G, N] (int4) scales matrix views (free reshapes)."""
    values2 = _as_matrix(values, contract)
    scales2 = scales.reshape(-1) if scheme == "int8" else scales.reshape(scales.shape[0], -1)
    return values2, scales2


def dequantize_matrix(mat: tuple[jax.Array, jax.Array], scheme: str) -> jax.Array:
    """float32 [K, N] from the matrix views."""
    values, scales = mat
    if scheme == "int8":
        return values.astype(jnp.float32) * scales[None, :]
    q = unpack_int4(values).astype(jnp.float32)
    k, n = q.shape
    return (q.reshape(scales.shape[0], -1, n) * scales[:, None, :]).reshape(k, n)


def xla_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, scheme: str) -> jax.Array:
    """x [M, K] @ quantized [K, N] (matrix views) -> [M, N] float32, with XLA ops only (the CPU path).

    int8 multiplies by the exact integer weights in x's dtype and scales the float32 result; int4 dequantizes
    to x's dtype first (one weight-sized temporary)."""
    if scheme == "int8":
        out = jnp.dot(x, values.astype(x.dtype), preferred_element_type=jnp.float32)
        return out * scales[None, :]
    w = dequantize_matrix((values, scales), scheme).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)

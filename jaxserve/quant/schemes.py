"""Weight-only quantization formats: how a float weight is stored as integer (or fp8) values plus float32 scales,
optional zero points and an optional act-order permutation, and back.

A weight is declared [contract dims..., output dims...] (see `jaxserve.models.llama.WeightSpec.contract`); its
matrix view is [K, N] with K = prod(contract dims), N = prod(output dims), and `x @ W` contracts K.

A scheme is a name (static, hashable, recorded in jaxserve.json): `<kind>[-g<G> | -ch][-zp][-act]`

    kind    int8   values int8  [contract dims..., out dims...]                     v in [-128, 127]
            int4   values uint8 [contract dims (last one halved)..., out dims...]   v in [-8, 7], packed below
            fp8    values float8_e4m3fn [contract dims..., out dims...]
    -g<G>   scales f32 [K / G, out dims...]: one per group of G rows along K and output channel
    -ch     scales f32 [out dims...]: one per output channel (the default of int8 and fp8)
    -zp     zeros  bf16, shaped like the scales (asymmetric: integers, exact in bfloat16)
    -act    perm   int32 [K]: the rows are stored sorted by group (GPTQ act-order, desc_act): x's columns are
                   gathered by `perm` before the product, so the kernels only ever see contiguous groups

    W[k, n] = (v[k, n] - zeros[g(k), n]) * scales[g(k), n]     computed in float32 (exact: see below), then cast
    W_original[perm[k], :] = W[k, :]                            with -act

Two names predate the general form and keep their meaning: `int8` (per channel, symmetric, what `--quantize
int8` writes) and `int4` (symmetric, group size group_size(K), what `--quantize int4` writes: scales[g, n] =
r * max_{k in group g} |W[k, n]| / 7, with the clip ratio r in INT4_CLIP_RATIOS that minimises the group's
squared error). Imported checkpoints (jaxserve.convert.quantized) use the general names, e.g. GPTQ 4-bit,
group 128, asymmetric, act-order: `int4-g128-zp-act`; FP8 with 128 x 128 block scales: `fp8-g128` (the block
scale repeated over its 128 output channels).

Exactness: v - z is a small integer and the scales come from float16 / bfloat16 / float32 checkpoints, so
(v - z) * s in float32 is the exact product for float16 and bfloat16 scales; cast to the checkpoint's float
type it equals, bit for bit, what the format's own dequantization computes in that type.

int4 packing (matrix view [K, N] -> [K / 2, N] bytes): byte [r, n] holds rows 2r and 2r + 1 of column n, row 2r
in the low nibble, each stored as value + 8. Pairs are adjacent along K, i.e. along the last contract dim, which
must be even:

    byte[r, n] = (v[2r, n] + 8) | (v[2r + 1, n] + 8) << 4
    v[2r, n] = (byte[r, n] & 15) - 8,   v[2r + 1, n] = (byte[r, n] >> 4) - 8

Group size of `int4`: 128 when 128 divides K; otherwise the largest power of two dividing K (64 for the test
models' hidden size 64 and for the demo model's intermediate size 704 = 11 x 64), and at least MIN_GROUP_SIZE
(the kernel's k-tiles, of at least 2 x 16 rows, must not straddle a group). An explicit -g<G> must divide K and
be a multiple of 32 (int4) or 16 (int8, fp8) for the same reason.

Scales are float32 and zeros bfloat16 in the checkpoint and at run time (the loader keeps them: `keep_dtype`).
Everything here is jnp (usable on numpy inputs, under jit and vmap); nothing imports the model.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

SCHEMES = ("int8", "int4")  # what `--quantize` makes from a float model
KINDS = ("int8", "int4", "fp8")
INT8_MAX = 127
INT4_MAX = 7  # symmetric: -7..7 (the nibble 0, value -8, is never written)
INT4_OFFSET = 8
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
INT4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
GROUP_SIZE = 128
MIN_GROUP_SIZE = 32
AUTO_GROUP = 0  # `int4`: group_size(K)
VALUE_DTYPES = {"int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn}
ZEROS_DTYPE = jnp.bfloat16
PERM_DTYPE = jnp.int32
TILE_ROWS = {"int8": 16, "int4": 32, "fp8": 16}  # a group must hold whole kernel k-tiles of at least this size


class QuantizationError(ValueError):
    """A weight or setting a scheme cannot take; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Format:
    """A parsed scheme name (see the module docstring)."""

    kind: str  # int8 | int4 | fp8
    group: int | None  # rows per scale along K; None: one scale per output channel; AUTO_GROUP: group_size(K)
    zero_point: bool = False
    act_order: bool = False

    @property
    def name(self) -> str:
        return format_name(self.kind, self.group, self.zero_point, self.act_order)

    def group_for(self, k: int) -> int | None:
        """The group size for a contraction of K (None: per output channel)."""
        if self.group is None:
            return None
        if self.group == AUTO_GROUP:
            return group_size(k)
        if k % self.group:
            raise QuantizationError(f"group size {self.group} does not divide a contraction of {k}")
        return self.group


def format_name(kind: str, group: int | None, zero_point: bool = False, act_order: bool = False) -> str:
    """The canonical scheme name: `int8` / `fp8` (symmetric, per channel) and `int4` (symmetric, automatic group)
    stay short; everything else names its group (-g<G> or -ch)."""
    default_group = AUTO_GROUP if kind == "int4" else None
    parts = [kind]
    if group != default_group or zero_point or act_order:
        parts.append("ch" if group is None else f"g{group}")
    return "-".join(parts + ["zp"] * zero_point + ["act"] * act_order)


@functools.cache
def parse(scheme: str) -> Format:
    """`int4-g128-zp-act` -> Format("int4", 128, True, True); QuantizationError for anything else."""
    kind, *rest = str(scheme).split("-")
    if kind not in KINDS:
        raise QuantizationError(f"quantization scheme {scheme!r} is not one jaxserve stores; the kinds are "
                                f"{', '.join(KINDS)} (e.g. int8, int4, int4-g128-zp, fp8, fp8-g128)")
    group = AUTO_GROUP if kind == "int4" else None
    flags = set()
    for part in rest:
        if part == "ch":
            group = None
        elif part.startswith("g") and part[1:].isdigit() and int(part[1:]) % TILE_ROWS[kind] == 0:
            group = int(part[1:])
        elif part in ("zp", "act") and part not in flags:
            flags.add(part)
        else:
            raise QuantizationError(f"quantization scheme {scheme!r}: {part!r} is not -g<G> (G a multiple of "
                                    f"{TILE_ROWS[kind]}), -ch, -zp or -act")
    fmt = Format(kind, group, "zp" in flags, "act" in flags)
    if group == AUTO_GROUP and flags:
        raise QuantizationError(f"quantization scheme {scheme!r}: name the group (-g<G> or -ch) of a scheme with "
                                f"zero points or act-order")
    if kind == "fp8" and fmt.zero_point:
        raise QuantizationError(f"quantization scheme {scheme!r}: fp8 weights have no zero points")
    if fmt.act_order and group is None:
        raise QuantizationError(f"quantization scheme {scheme!r}: act-order needs groups (-g<G>)")
    return fmt


def check_scheme(scheme: str | None) -> None:
    if scheme is not None:
        parse(scheme)


def group_size(k: int) -> int:
    """int4 group size for a contraction of K: 128, or the largest power of two dividing K when 128 does not."""
    g = min(GROUP_SIZE, k & -k)
    if g < MIN_GROUP_SIZE:
        raise QuantizationError(f"int4 needs a contraction size divisible by {MIN_GROUP_SIZE}; {k} is not "
                                f"(use --quantize int8 for this model)")
    return g


@dataclasses.dataclass(frozen=True)
class QuantizedLayout:
    """Shapes, dtypes and logical axes of one quantized weight (per layer, or stacked when `shape` is). Zeros
    share the scales' shape and axes."""

    values_shape: tuple[int, ...]
    values_dtype: jnp.dtype
    values_axes: tuple[str | None, ...]
    scales_shape: tuple[int, ...]
    scales_axes: tuple[str | None, ...]
    zero_point: bool = False
    perm_shape: tuple[int, ...] | None = None  # act-order
    perm_axes: tuple[str | None, ...] | None = None

    @property
    def nbytes(self) -> int:
        scales = math.prod(self.scales_shape)
        return (math.prod(self.values_shape) * jnp.dtype(self.values_dtype).itemsize + scales * 4
                + (scales * jnp.dtype(ZEROS_DTYPE).itemsize if self.zero_point else 0)
                + (math.prod(self.perm_shape) * 4 if self.perm_shape else 0))

    def arrays(self) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
        """{"values": (shape, dtype), "scales": ..., ["zeros": ...], ["perm": ...]}: the checkpoint's leaves."""
        out = {"values": (self.values_shape, jnp.dtype(self.values_dtype)),
               "scales": (self.scales_shape, jnp.dtype(jnp.float32))}
        if self.zero_point:
            out["zeros"] = (self.scales_shape, jnp.dtype(ZEROS_DTYPE))
        if self.perm_shape:
            out["perm"] = (self.perm_shape, jnp.dtype(PERM_DTYPE))
        return out


def layout(shape: tuple[int, ...], axes: tuple[str | None, ...], contract: int, scheme: str,
           stacked: int = 0) -> QuantizedLayout:
    """The stored layout of a weight of `shape` whose first `stacked` dims are layer dims (not contracted),
    followed by `contract` contraction dims and then the output dims."""
    fmt = parse(scheme)
    lead, kdims, ndims = shape[:stacked], shape[stacked:stacked + contract], shape[stacked + contract:]
    lead_axes, k_axes, n_axes = axes[:stacked], axes[stacked:stacked + contract], axes[stacked + contract:]
    k = math.prod(kdims)
    values_shape = shape
    if fmt.kind == "int4":
        if kdims[-1] % 2:
            raise QuantizationError(f"int4 packs pairs along the last contraction dim; {shape} has an odd one")
        values_shape = lead + kdims[:-1] + (kdims[-1] // 2,) + ndims
    group = fmt.group_for(k)
    if group is None:
        scales_shape, scales_axes = lead + ndims, lead_axes + n_axes
    else:
        # The group axis takes the first contraction dim's logical name: sharding it splits groups like the rows.
        scales_shape, scales_axes = lead + (k // group,) + ndims, lead_axes + k_axes[:1] + n_axes
    perm_shape, perm_axes = (lead + (k,), lead_axes + (None,)) if fmt.act_order else (None, None)
    return QuantizedLayout(values_shape, VALUE_DTYPES[fmt.kind], axes, scales_shape, scales_axes, fmt.zero_point,
                           perm_shape, perm_axes)


def _as_matrix(w: jax.Array, contract: int) -> jax.Array:
    k = math.prod(w.shape[:contract])
    return w.reshape(k, -1)


def quantize(w: jax.Array, contract: int, scheme: str) -> tuple[jax.Array, ...]:
    """One (unstacked) float weight [contract dims..., out dims...] -> (values, scales[, zeros][, perm])."""
    return tuple(quantize_arrays(w, contract, scheme).values())


def quantize_arrays(w: jax.Array, contract: int, scheme: str) -> dict[str, jax.Array]:
    """One float weight -> {"values", "scales"[, "zeros"][, "perm"]}, layouts as in the module docstring.

    Round to nearest: symmetric int scales are max|W| / 127 (int4: the clipped search above), asymmetric ones
    (max(W, 0) - min(W, 0)) / (2^bits - 1) with the zero point that puts min(W, 0) on the lowest level; fp8
    scales are max|W| / 448. Act-order without a calibration set sorts the rows by decreasing norm (GPTQ sorts
    by the activations' energy): what `-act` costs at run time is the same either way."""
    fmt = parse(scheme)
    kdims, ndims = w.shape[:contract], w.shape[contract:]
    w2 = _as_matrix(jnp.asarray(w, jnp.float32), contract)
    k, n = w2.shape
    perm = None
    if fmt.act_order:
        perm = jnp.argsort(-jnp.square(w2).sum(axis=1), stable=True).astype(PERM_DTYPE)
        w2 = w2[perm]
    group = fmt.group_for(k)
    blocks = w2.reshape(1 if group is None else k // group, -1, n)
    v, scales, zeros = _quantize_blocks(blocks, fmt)
    v = v.reshape(k, n)
    values = pack_int4(v.astype(jnp.int32)) if fmt.kind == "int4" else v.astype(VALUE_DTYPES[fmt.kind])
    if fmt.kind == "int4":
        kdims = kdims[:-1] + (kdims[-1] // 2,)
    scales_shape = ndims if group is None else (k // group,) + ndims
    out = {"values": values.reshape(kdims + ndims), "scales": scales.reshape(scales_shape)}
    if zeros is not None:
        out["zeros"] = zeros.astype(ZEROS_DTYPE).reshape(scales_shape)
    if perm is not None:
        out["perm"] = perm
    return out


def _quantize_blocks(blocks: jax.Array, fmt: Format):
    """[groups, rows, N] float32 -> values [groups, rows, N] (int8 / int4 integers as float, or fp8), scales
    [groups, N], zeros [groups, N] or None."""
    if fmt.kind == "fp8":
        scales = _scale(jnp.abs(blocks).max(axis=1), FP8_MAX)
        return jnp.clip(blocks / scales[:, None, :], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scales, None
    if fmt.zero_point:
        levels, offset = (255, 128) if fmt.kind == "int8" else (15, INT4_OFFSET)
        low, high = jnp.minimum(blocks.min(axis=1), 0), jnp.maximum(blocks.max(axis=1), 0)
        scales = _scale(high - low, levels)
        zero = jnp.round(-low / scales)
        q = jnp.clip(jnp.round(blocks / scales[:, None, :]) + zero[:, None, :], 0, levels)
        return q - offset, scales, zero - offset
    if fmt.kind == "int4":
        scales = _int4_scales(blocks)
        return jnp.clip(jnp.round(blocks / scales[:, None, :]), -INT4_MAX, INT4_MAX), scales, None
    scales = _scale(jnp.abs(blocks).max(axis=1), INT8_MAX)
    return jnp.clip(jnp.round(blocks / scales[:, None, :]), -INT8_MAX, INT8_MAX), scales, None


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


def quantize_stacked(w: jax.Array, contract: int, scheme: str, stacked: int = 0) -> dict[str, jax.Array]:
    """quantize_arrays() of a weight whose first `stacked` dims are layers, one layer at a time (vmapped)."""
    fn = functools.partial(quantize_arrays, contract=contract, scheme=scheme)
    for _ in range(stacked):
        fn = jax.vmap(fn)
    return fn(w)


def _scale(amax: jax.Array, qmax: float) -> jax.Array:
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


def dequantize(values: jax.Array, scales: jax.Array, contract: int, scheme: str, dtype=jnp.float32,
               zeros: jax.Array | None = None, perm: jax.Array | None = None) -> jax.Array:
    """The arrays of one unstacked weight -> the float weight [contract dims..., out dims...] in `dtype`, rows in
    the original order (act-order undone)."""
    w2 = dequantize_matrix(matrix(values, scales, contract, scheme), scheme, scales_matrix(zeros, scheme))
    if perm is not None:
        w2 = jnp.zeros_like(w2).at[perm].set(w2)
    per_channel = parse(scheme).group is None
    ndims = scales.shape if per_channel else scales.shape[1:]
    kdims = values.shape[:contract]
    if parse(scheme).kind == "int4":
        kdims = kdims[:-1] + (kdims[-1] * 2,)
    return w2.reshape(kdims + ndims).astype(dtype)


def matrix(values: jax.Array, scales: jax.Array, contract: int, scheme: str) -> tuple[jax.Array, jax.Array]:
    """The [K (/ 2 for int4), N] values and [N] (per channel) or [K / G, N] (groups) scales matrix views (free
    reshapes)."""
    return _as_matrix(values, contract), scales_matrix(scales, scheme)


def scales_matrix(a: jax.Array | None, scheme: str) -> jax.Array | None:
    """Scales or zeros as [N] (per channel) or [K / G, N] (groups)."""
    if a is None:
        return None
    return a.reshape(-1) if parse(scheme).group is None else a.reshape(a.shape[0], -1)


def dequantize_matrix(mat: tuple[jax.Array, jax.Array], scheme: str, zeros: jax.Array | None = None) -> jax.Array:
    """float32 [K, N] from the matrix views: (v - zeros) * scales, per group of rows or per channel."""
    values, scales = mat
    v = unpack_int4(values) if parse(scheme).kind == "int4" else values
    v = v.astype(jnp.float32)
    k, n = v.shape
    blocks = v.reshape(1 if scales.ndim == 1 else scales.shape[0], -1, n)
    if zeros is not None:
        blocks = blocks - zeros.astype(jnp.float32).reshape(-1, 1, n)
    return (blocks * scales.reshape(-1, 1, n)).reshape(k, n)


def xla_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, scheme: str,
               zeros: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ quantized [K, N] (matrix views; act-order already applied to x) -> [M, N] float32, with XLA
    ops only (the CPU path).

    int8 / fp8 per channel without zeros multiply by the exact stored values in x's dtype and scale the float32
    result; everything else dequantizes to x's dtype first (one weight-sized temporary)."""
    if parse(scheme).kind != "int4" and scales.ndim == 1 and zeros is None:
        out = jnp.dot(x, values.astype(x.dtype), preferred_element_type=jnp.float32)
        return out * scales[None, :]
    w = dequantize_matrix((values, scales), scheme, zeros).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)

"""Weight-only quantized matmul, W8A16 / W4A16 / WFP8A16: x [M, K] @ W [K, N] with W stored as int8, packed int4
or float8_e4m3fn, scaled per output channel or per group of rows, optionally with zero points.

    x        [M, K]       bfloat16 (float16, float32) activations
    values   [K, N]       int8    scheme "int8": v[k, n] = values[k, n]
             [K / 2, N]   uint8   scheme "int4": v[2r, n] = (values[r, n] & 15) - 8, v[2r + 1, n] = (values[r, n]
                                  >> 4) - 8
             [K, N]       float8_e4m3fn  scheme "fp8": v[k, n] = values[k, n]
    scales   [N] f32              per output channel:  W[k, n] = (v[k, n] - zeros[n]) * scales[n]
             [K / G, N] f32       per group of G rows: W[k, n] = (v[k, n] - zeros[k // G, n]) * scales[k // G, n]
    zeros    like scales, or None (symmetric: zero 0); integers (any float dtype; bfloat16 in jaxserve)
    -> out   [M, N]       out_dtype (float32 by default)

(The format is jaxserve.quant.schemes' matrix view; this module depends on jax only and restates what it reads.
Act-order checkpoints store their rows sorted by group, and the caller gathers x's columns to match, so the
kernel only ever sees contiguous groups.)

Kernel grid (cdiv(M, block_m), N / block_n, splits). Program (i, j, s) walks the s-th share of K in block_k
tiles: it loads the x tile and the weight tile, converts the weight to x's dtype in registers (int8 and int4
values, fp8 values and the integer differences v - zero are all exact in bfloat16), subtracts the tile's zero
row, multiplies on the tensor cores (the Triton dot needs equal operand dtypes and >= 16 rows: rows past M are
masked off on load and store, so x is never padded in memory) and accumulates in float32. Per-channel scales
apply once, in the epilogue; group scales multiply each k-tile's partial product (a tile never straddles a
group: block_k divides G) before adding it. With several splits (split-K: a decode-sized M over few output
tiles still fills the GPU) each split writes scaled float32 partials and a jnp sum combines them; with one
split the kernel writes out_dtype directly and nothing runs around it.

int4 reads x as two planes, x_even (k = 0, 2, ..) for the low nibbles and x_odd for the high ones, so the packed
tile [block_k / 2, block_n] unpacks into two dot operands with no interleaving in registers:
out = x_even @ low + x_odd @ high. For M <= STRIDED_X_MAX_ROWS (decode) the kernel reads the planes straight
from the free view x[M, K / 2, 2] (stride-2 loads of a small x; no op runs before the kernel); for larger M
(prefill) the wrapper splits x once into two contiguous planes, whose tiles Triton then pipelines with cp.async
(strided 2-byte loads cannot be; at 128 rows they also cost registers and spill).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as c

SCHEMES = ("int8", "int4", "fp8")  # storage kinds
KERNEL_NAMES = {"int8": "w8a16", "int4": "w4a16", "fp8": "wfp8a16"}
MAX_BLOCK_K = 128
MIN_K_TILES_PER_SPLIT = 4  # a split's fixed cost (its partial write and the combine) wants a few tiles of work
PROGRAMS_PER_SM = 2
STRIDED_X_MAX_ROWS = 64  # int4: above this M the wrapper splits x into contiguous even / odd planes


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Launch parameters (hashable: a static argument)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128  # K rows per tile (int4: two planes of block_k / 2 packed rows)
    splits: int = 1  # split-K shares
    num_warps: int = 4
    num_stages: int = 4
    x_planes: bool | None = None  # int4: split x into contiguous even/odd planes first (None: when M > 64)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most cap."""
    return min(cap, n & -n)


def choose_config(m: int, k: int, n: int, scheme: str, group: int | None = None,
                  num_sms: int = c.H100_CLASS_SMS) -> MatmulConfig:
    """Block sizes from the shapes (`group`: rows per scale, None for per-channel scales). Small M (decode) is
    bound by reading the weight once: narrow output tiles, a deep pipeline and split-K until there are ~2
    programs per SM. Large M (prefill) uses 128 x 128 tiles."""
    block_m = min(128, max(c.MIN_DOT_ROWS, c.next_pow2(m)))
    block_n = _pow2_divisor(n, 64 if m <= 64 else 128)
    block_k = _pow2_divisor(k if group is None else group, MAX_BLOCK_K)
    programs = -(-m // block_m) * (n // block_n)
    unit = block_k if group is None else group  # a split covers whole tiles (grouped: whole groups)
    splits = _split_count(k // unit, -(-PROGRAMS_PER_SM * num_sms // programs), k // block_k)
    big = block_m * block_n >= 128 * 128
    return MatmulConfig(block_m, block_n, block_k, splits, num_warps=8 if big else 4, num_stages=3 if big else 4)


def _split_count(units: int, wanted: int, tiles: int) -> int:
    """The largest divisor of `units` that is <= wanted and leaves each split MIN_K_TILES_PER_SPLIT tiles."""
    best = 1
    for d in range(1, min(units, wanted) + 1):
        if units % d == 0 and tiles // d >= MIN_K_TILES_PER_SPLIT:
            best = d
    return best


def check_config(k: int, n: int, scheme: str, group: int | None, config: MatmulConfig) -> None:
    """Tile rules of the Triton dot (power-of-2 tiles, >= 16 rows and columns) and of the format."""
    half = config.block_k // 2 if scheme == "int4" else config.block_k
    for name, size in (("block_m", config.block_m), ("block_n", config.block_n), ("block_k (per dot)", half)):
        if not c.is_pow2(size) or size < c.MIN_DOT_ROWS:
            raise ValueError(f"{name} must be a power of 2 >= {c.MIN_DOT_ROWS} for the Triton dot, got {size}")
    if n % config.block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={config.block_n}")
    unit = config.block_k if group is None else group
    if k % (unit * config.splits) or (group is not None and group % config.block_k):
        raise ValueError(f"K={k} must split into {config.splits} shares of whole {unit}-row units, and a "
                         f"k-tile ({config.block_k}) must divide the group ({group})")


def _rows_mask(m: int, block_m: int):
    """[block_m, 1] bool: which rows of this program's block are real (None when M is a multiple of block_m)."""
    if m % block_m == 0:
        return None
    return (pl.program_id(0) * block_m + lax.iota(jnp.int32, block_m) < m)[:, None]


def _load_rows(ref, mask):
    return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)


def _store_rows(ref, value, mask):
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=mask)


def _kernel(*refs, scheme: str, m: int, block_k: int, group: int | None, planes: bool, has_zeros: bool):
    """refs: the x operands (int4 with planes: xe_ref, xo_ref [block_m, K_share / 2], x's even / odd columns;
    int4 without: the pair view [block_m, K_share / 2, 2]; else x_ref [block_m, K_share]), w_ref [K_share (/ 2),
    block_n], s_ref [block_n] or [K_share / G, block_n], z_ref (has_zeros) like s_ref, o_ref [block_m,
    block_n]."""
    o_ref = refs[-1]
    w_ref, s_ref, *z_ref = refs[2 if planes else 1:-1]
    x_refs = refs[:2 if planes else 1]
    rows = _rows_mask(m, o_ref.shape[0])
    tile = _int4_tile if scheme == "int4" else _byte_tile

    def per_tile(ref, t):
        """The [block_n] row of scales / zeros that k-tile t uses."""
        return ref[...] if group is None else ref[c.div(t, group // block_k), :]

    def body(t, acc):
        zero = per_tile(z_ref[0], t) if has_zeros else None
        part = tile(x_refs, w_ref, t, rows, zero, block_k=block_k, planes=planes)
        return acc + (part if group is None else part * per_tile(s_ref, t)[None, :])

    steps = w_ref.shape[0] // (block_k // 2 if scheme == "int4" else block_k)
    acc = lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    if group is None:
        acc = acc * s_ref[...][None, :]
    _store_rows(o_ref, acc.astype(o_ref.dtype), rows)


def _byte_tile(x_refs, w_ref, t, rows, zero, *, block_k: int, planes: bool):
    """int8 / fp8: x tile @ (w tile - zero row), float32 [block_m, block_n]."""
    del planes
    k0 = pl.multiple_of(t * block_k, block_k)
    x = _load_rows(x_refs[0].at[:, pl.ds(k0, block_k)], rows)
    w = w_ref[pl.ds(k0, block_k), :].astype(x.dtype)
    if zero is not None:
        w = w - zero.astype(x.dtype)[None, :]
    return c.dot(x, w)


def _int4_tile(x_refs, w_ref, t, rows, zero, *, block_k: int, planes: bool):
    """int4: x_even @ (low nibbles - 8 - zero) + x_odd @ (high nibbles - 8 - zero), float32."""
    half = block_k // 2
    r0 = pl.multiple_of(t * half, half)

    def x_plane(parity: int):
        if planes:
            return x_refs[parity].at[:, pl.ds(r0, half)]
        return x_refs[0].at[:, pl.ds(r0, half), jnp.int32(parity)]

    x_even, x_odd = _load_rows(x_plane(0), rows), _load_rows(x_plane(1), rows)
    packed = w_ref[pl.ds(r0, half), :]
    offset = 8 if zero is None else (zero.astype(jnp.float32) + 8).astype(x_even.dtype)[None, :]
    low = (packed & 15).astype(x_even.dtype) - offset
    high = (packed >> 4).astype(x_even.dtype) - offset
    return c.dot(x_even, low) + c.dot(x_odd, high)


def _call(xs, values, scales, zeros, *, scheme, group, config: MatmulConfig, out_dtype, interpret):
    """xs: (x [M, K],) for int8 / fp8; int4: (x_even, x_odd) [M, K / 2] planes or (the pair view [M, K / 2, 2],).
    -> out [splits, M, N]."""
    m, n = xs[0].shape[0], values.shape[1]
    share_x = xs[0].shape[1] // config.splits  # K / splits (int4: pairs, like the packed rows)
    share_w = values.shape[0] // config.splits
    grid = (-(-m // config.block_m), n // config.block_n, config.splits)
    w_spec = pl.BlockSpec((share_w, config.block_n), lambda i, j, s: (s, j))
    if xs[0].ndim == 3:
        x_spec = pl.BlockSpec((config.block_m, share_x, 2), lambda i, j, s: (i, s, 0))
    else:
        x_spec = pl.BlockSpec((config.block_m, share_x), lambda i, j, s: (i, s))
    if group is None:
        s_spec = pl.BlockSpec((config.block_n,), lambda i, j, s: (j,))
    else:
        s_spec = pl.BlockSpec((scales.shape[0] // config.splits, config.block_n), lambda i, j, s: (s, j))
    kernel = functools.partial(_kernel, scheme=scheme, m=m, block_k=config.block_k, group=group,
                               planes=len(xs) == 2, has_zeros=zeros is not None)
    extra = () if zeros is None else (zeros,)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[x_spec] * len(xs) + [w_spec, s_spec] + [s_spec] * len(extra),
        out_specs=pl.BlockSpec((None, config.block_m, config.block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((config.splits, m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"jaxserve_{KERNEL_NAMES[scheme]}{'_zp' if zeros is not None else ''}_matmul",
    )(*xs, values, scales, *extra)


def x_operands(x: jax.Array, scheme: str, planes: bool | None = None) -> tuple[jax.Array, ...]:
    """What the kernel reads x as (see the module docstring): x itself, or int4's pair view or planes."""
    if scheme != "int4":
        return (x,)
    m, k = x.shape
    if not (m > STRIDED_X_MAX_ROWS if planes is None else planes):
        return (x.reshape(m, k // 2, 2),)
    return x[:, 0::2], x[:, 1::2]


def matrix_k(values: jax.Array, scheme: str) -> int:
    return values.shape[0] * (2 if scheme == "int4" else 1)


def group_of(values: jax.Array, scales: jax.Array, scheme: str) -> int | None:
    """Rows per scale along K: None for per-channel scales [N]."""
    return matrix_k(values, scheme) // scales.shape[0] if scales.ndim == 2 else None


@functools.partial(jax.jit, static_argnames=("scheme", "out_dtype", "interpret", "config"))
def quant_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, zeros: jax.Array | None = None, *,
                 scheme: str, out_dtype=jnp.float32, interpret: bool = False,
                 config: MatmulConfig | None = None) -> jax.Array:
    """x [M, K] @ the quantized [K, N] weight (see the module docstring) -> [M, N] in out_dtype."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    m, k = x.shape
    n = values.shape[1]
    if matrix_k(values, scheme) != k:
        raise ValueError(f"x has K={k} but the {scheme} weight {values.shape} holds K={matrix_k(values, scheme)}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"zeros {zeros.shape} must have the scales' shape {scales.shape}")
    group = group_of(values, scales, scheme)
    config = config or choose_config(m, k, n, scheme, group, c.num_sms())
    check_config(k, n, scheme, group, config)
    partial_dtype = out_dtype if config.splits == 1 else jnp.float32
    out = _call(x_operands(x, scheme, config.x_planes), values, scales, zeros, scheme=scheme, group=group,
                config=config, out_dtype=partial_dtype, interpret=interpret)
    return out[0] if config.splits == 1 else out.sum(axis=0).astype(out_dtype)


def unpack_int4_reference(values: jax.Array) -> jax.Array:
    """[K / 2, N] uint8 -> [K, N] float32 integer values in [-8, 7]."""
    low = (values & 15).astype(jnp.float32) - 8
    high = (values >> 4).astype(jnp.float32) - 8
    return jnp.stack([low, high], axis=1).reshape(-1, values.shape[1])


def dequantize_reference(values: jax.Array, scales: jax.Array, scheme: str,
                         zeros: jax.Array | None = None) -> jax.Array:
    """The float32 weight [K, N]: (v - zeros) * scales, per channel ([N]) or per group of rows ([K / G, N])."""
    v = unpack_int4_reference(values) if scheme == "int4" else values.astype(jnp.float32)
    k, n = v.shape
    blocks = v.reshape(scales.shape[0] if scales.ndim == 2 else 1, -1, n)
    if zeros is not None:
        blocks = blocks - zeros.astype(jnp.float32).reshape(-1, 1, n)
    return (blocks * scales.reshape(-1, 1, n)).reshape(k, n)


def quant_matmul_reference(x: jax.Array, values: jax.Array, scales: jax.Array, zeros: jax.Array | None = None, *,
                           scheme: str) -> jax.Array:
    """float32 x @ dequantized W, at full float32 precision -> [M, N] float32."""
    w = dequantize_reference(values, scales, scheme, zeros)
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)

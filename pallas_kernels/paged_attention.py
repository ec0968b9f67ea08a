"""Paged attention for decode steps: one query token per sequence against its pages of the KV cache.

    q            [B, H, D]                               token b sits at position context_lens[b] - 1
    cache_k/v    [layers, kv_heads, pages, page_size, D]  this step's K/V already written; page 0 is the null page
                                                          (float, int8 or float8_e4m3fn)
    k/v_scale    [layers, kv_heads, pages, page_size] f32 int8 caches only: per-token, per-head scales
    block_tables [B, P] int32                             page ids, 0 past a sequence's last page
    context_lens [B] int32                                0 marks a padding row: its output is zeros
    sliding_window  None, an int or a traced int32 (0: none): keys at positions > position - window
    softcap      None or a float (static): scores -> softcap * tanh(scores / softcap) before the mask
    -> out       [B, H, D]

Kernel grid (B, kv_heads, splits). Program (b, h, s) takes the `group` query heads of KV head h, padded to
block_h >= 16 rows, and runs an online softmax over the s-th share of sequence b's key tiles. The shares are
cut from the sequence's real length at run time, so every split gets work even when block_tables is much wider
than the context. With one split the kernel writes the normalised output directly; with several it writes
(out, log-sum-exp) per split and a small jnp pass combines them (split-K: a small batch still fills the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as c

MIN_TILES_PER_SPLIT = 4  # below this a split's fixed cost (q load, partial write, combine) outweighs its keys


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (hashable: it is a static argument)."""

    block_k: int = 64  # keys per inner-loop tile (power of 2)
    num_splits: int = 1  # split-K shares of each sequence's keys
    num_warps: int = 4
    num_stages: int = 3


def choose_decode_config(batch: int, kv_heads: int, head_dim: int, itemsize: int, max_context: int,
                         num_sms: int = c.H100_CLASS_SMS) -> DecodeConfig:
    """Block sizes from the shapes: 16 KiB K and V tiles, and enough splits for ~2 programs per SM."""
    block_k = min(128, max(16, c.TILE_BYTES // (head_dim * itemsize)))
    max_tiles = -(-max_context // block_k)
    wanted = -(-2 * num_sms // max(1, batch * kv_heads))
    num_splits = max(1, min(wanted, max_tiles // MIN_TILES_PER_SPLIT))
    return DecodeConfig(block_k=block_k, num_splits=num_splits, num_warps=4, num_stages=3)


def _decode_kernel(layer_ref, window_ref, tables_ref, lens_ref, q_ref, k_ref, v_ref, *refs, scale_log2: float,
                   block_k: int, page_size: int, num_splits: int, softcap: float | None, scaled: bool):
    scale_refs, (o_ref, lse_ref) = (refs[:2], refs[2:]) if scaled else (None, refs)
    b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window, length = layer_ref[0], window_ref[0], lens_ref[b]
    kv_start = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)
    first_tile = c.div(kv_start, block_k)
    num_tiles = c.cdiv(length, block_k) - first_tile  # 0 for padding rows
    per_split = c.cdiv(num_tiles, num_splits)
    lo = first_tile + split * per_split
    hi = jnp.minimum(lo + per_split, first_tile + num_tiles)

    def mask(key_pos):
        return ((key_pos < length) & (key_pos >= kv_start))[None, :]

    q = q_ref[...].astype(c.compute_dtype(q_ref.dtype, k_ref.dtype))
    m, l, acc = c.attend_tiles(q, k_ref, v_ref, tables_ref, b, layer, kv_head, lo, hi, mask,
                               c.softmax_init(q.shape[0], q.shape[1]), block_k=block_k, page_size=page_size,
                               scale_log2=scale_log2, scale_refs=scale_refs, softcap=softcap)
    seen = l > 0  # a split past the end of the sequence (or a padding row) saw no keys
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)


def _decode_call(qg, cache_k, cache_v, layer, window, tables, lens, *, scale, config, interpret, softcap=None,
                 kv_scales=()):
    """qg: [B, KVH, block_h, D] -> (out [B, KVH, splits, block_h, D], lse [B, KVH, splits, block_h] in log2).
    layer, window: [1] int32 (c.layer_operand, c.window_operand); kv_scales: () or an int8 cache's scale pools."""
    batch, kv_heads, block_h, head_dim = qg.shape
    splits = config.num_splits
    kernel = functools.partial(
        _decode_kernel, scale_log2=scale * c.LOG2_E, block_k=config.block_k, page_size=cache_k.shape[3],
        num_splits=splits, softcap=softcap, scaled=bool(kv_scales))
    out_dtype = qg.dtype if splits == 1 else jnp.float32
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[
            pl.no_block_spec, pl.no_block_spec, pl.no_block_spec, pl.no_block_spec,  # layer, window, tables, lens
            pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pl.no_block_spec, pl.no_block_spec,  # the pools stay in HBM; tiles are gathered in the kernel
        ] + [pl.no_block_spec] * len(kv_scales),
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, splits, block_h, head_dim), out_dtype),
                   jax.ShapeDtypeStruct((batch, kv_heads, splits, block_h), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="jaxserve_paged_attention",
    )(layer, window, tables, lens, qg, cache_k, cache_v, *kv_scales)


def combine_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Merges split-K partial results. out: [..., S, R, D] (each normalised), lse: [..., S, R] log2 -> [..., R, D]."""
    m = lse.max(axis=-2, keepdims=True)
    weights = jnp.exp2(lse - jnp.where(jnp.isfinite(m), m, 0.0))  # 0 for empty splits
    total = weights.sum(axis=-2)
    merged = (weights[..., None] * out.astype(jnp.float32)).sum(axis=-3)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "interpret", "config"))
def paged_attention(q, cache_k, cache_v, layer, block_tables, context_lens, *, scale: float,
                    sliding_window: int | jax.Array | None = None, softcap: float | None = None,
                    interpret: bool = False, config: DecodeConfig | None = None, k_scale=None,
                    v_scale=None) -> jax.Array:
    """Decode attention over the paged cache (see the module docstring for shapes). Returns [B, H, D] in q.dtype."""
    batch, heads, head_dim = q.shape
    kv_heads, group = c.check_paged_inputs(heads, head_dim, cache_k, cache_v)
    page_size = cache_k.shape[3]
    if config is None:
        config = choose_decode_config(batch, kv_heads, head_dim, cache_k.dtype.itemsize,
                                      block_tables.shape[1] * page_size, c.num_sms())
    block_h = max(c.MIN_DOT_ROWS, c.next_pow2(group))
    c.check_tiles(block_h, config.block_k)
    qg = jnp.pad(q.reshape(batch, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    tables = c.pad_block_tables(block_tables, page_size, config.block_k)
    out, lse = _decode_call(qg, cache_k, cache_v, c.layer_operand(layer), c.window_operand(sliding_window), tables,
                            context_lens.astype(jnp.int32), scale=scale, softcap=softcap, config=config,
                            interpret=interpret, kv_scales=c.scale_pools(k_scale, v_scale))
    out = out[:, :, 0] if config.num_splits == 1 else combine_splits(out, lse)
    return out[:, :, :group].reshape(batch, heads, head_dim).astype(q.dtype)


def paged_attention_reference(q, cache_k, cache_v, layer, block_tables, context_lens, *, scale: float,
                              sliding_window: int | None = None, softcap: float | None = None, k_scale=None,
                              v_scale=None) -> jax.Array:
    """Dense float32 attention of each sequence's query over all its gathered pages, masked by position."""
    batch, heads, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    keys = c.dequantized_pages(cache_k, k_scale, layer, block_tables)  # [KVH, B, P, page_size, D]
    values = c.dequantized_pages(cache_v, v_scale, layer, block_tables)
    keys = keys.reshape(kv_heads, batch, -1, head_dim)  # [KVH, B, C, D]
    values = values.reshape(kv_heads, batch, -1, head_dim)
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = c.reference_softcap(jnp.einsum("bkgd,kbcd->bkgc", qg, keys) * scale, softcap)
    key_pos = jnp.arange(keys.shape[2])[None, :]
    q_pos = (context_lens - 1)[:, None]
    mask = (key_pos <= q_pos) & c.reference_window(key_pos, q_pos, sliding_window)
    mask = mask[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # padding rows (no key) give zeros, not NaN
    out = jnp.einsum("bkgc,kbcd->bkgd", probs, values)
    return out.reshape(batch, heads, head_dim).astype(q.dtype)

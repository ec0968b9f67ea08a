"""Pieces shared by the attention kernels: shape checks, the paged K/V tile load and the online-softmax step.

Everything here runs inside Triton-style Pallas kernels (or builds their inputs) and is written for what the Pallas
Triton lowering accepts: power-of-2 tensor sizes, equal dot operand dtypes, at least 16 dot rows, no scalar prefetch.

Quantized caches: int8 pools carry scale pools [layers, kv_heads, pages, page_size] (float32, one per token and
KV head); fp8 (e4m3) pools carry none. Tiles are converted to the query's dtype in registers; a K scale multiplies
the logits of its key and a V scale the probability of its key (sum_c p_c (s_c v_c) = sum_c (p_c s_c) v_c).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

LOG2_E = math.log2(math.e)
# Finite stand-in for -inf in masked logits: a fully masked block then gives exp2(MASK - MASK) = 1 instead of NaN,
# and that garbage is wiped (multiplied by exp2(MASK - real) = 0) as soon as the row sees a real key.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_DOT_ROWS = 16  # the Triton dot needs at least 16 rows
H100_CLASS_SMS = 132  # H100 SXM / H200: what the split-K heuristic assumes when no GPU is attached
TILE_BYTES = 16 * 1024  # bytes of K (and of V) per key tile: 64 keys x 128 dims in bf16


@functools.cache
def num_sms() -> int:
    """Multiprocessors of the attached GPU (the split-K heuristic aims at a few programs per SM)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return H100_CLASS_SMS
    return getattr(device, "core_count", None) or H100_CLASS_SMS


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def div(a, b):
    """Integer division for non-negative operands (one `lax.div`, not jnp's floor-division expansion)."""
    return lax.div(a, jnp.asarray(b, jnp.int32))


def cdiv(a, b):
    return div(a + (b - 1), b)


def check_paged_inputs(q_heads: int, head_dim: int, cache_k: jax.Array, cache_v: jax.Array) -> tuple[int, int]:
    """Validates the pool layout against the queries; returns (kv_heads, group)."""
    if cache_k.shape != cache_v.shape or cache_k.ndim != 5:
        raise ValueError(f"cache_k/cache_v must both be [layers, kv_heads, pages, page_size, head_dim], got "
                         f"{cache_k.shape} and {cache_v.shape}")
    kv_heads, d = cache_k.shape[1], cache_k.shape[4]
    if d != head_dim or not is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must match the cache and be a power of 2 >= 16, got q {head_dim}, cache {d}")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    return kv_heads, q_heads // kv_heads


def check_tiles(rows: int, block_k: int) -> None:
    """Tile rules of the Triton dot: power-of-2 sizes, at least 16 rows, columns and contraction."""
    for name, size in (("query rows", rows), ("block_k", block_k)):
        if not is_pow2(size) or size < MIN_DOT_ROWS:
            raise ValueError(f"{name} must be a power of 2 >= {MIN_DOT_ROWS} for the Triton dot, got {size}")


def layer_operand(layer) -> jax.Array:
    """The layer index as the [1] int32 array the kernels read (it is traced inside the model's layer scan)."""
    return jnp.asarray(layer, jnp.int32).reshape(1)


def pad_block_tables(block_tables: jax.Array, page_size: int, block_k: int) -> jax.Array:
    """Pads [N, P] with null-page columns so the last `block_k`-key tile never indexes past the table."""
    pages = block_tables.shape[1]
    padded = -(-(-(-pages * page_size // block_k) * block_k) // page_size)
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - pages)))


def load_kv_tile(k_ref, v_ref, tables_ref, seq, layer, kv_head, key_pos, page_size: int):
    """K and V of keys `key_pos` [block_k] of sequence `seq`: two [block_k, head_dim] gathers through its pages.

    k_ref, v_ref: [layers, kv_heads, pages, page_size, head_dim] pools left in HBM (no block spec);
    tables_ref: [N, P_padded] page ids. One table entry per key is re-read (cached) so the load stays 2-D.
    """
    pages = tables_ref[seq, div(key_pos, page_size)]
    offsets = lax.rem(key_pos, jnp.int32(page_size))
    return k_ref[layer, kv_head, pages, offsets, :], v_ref[layer, kv_head, pages, offsets, :]


def load_kv_scales(ks_ref, vs_ref, tables_ref, seq, layer, kv_head, key_pos, page_size: int):
    """The [block_k] K and V scales of keys `key_pos` (int8 caches), gathered through the pages like the tiles."""
    pages = tables_ref[seq, div(key_pos, page_size)]
    offsets = lax.rem(key_pos, jnp.int32(page_size))
    return ks_ref[layer, kv_head, pages, offsets], vs_ref[layer, kv_head, pages, offsets]


def scale_pools(k_scale, v_scale) -> tuple:
    """() for float / fp8 caches, (k_scale, v_scale) for int8 ones (both or neither)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    return () if k_scale is None else (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))


def dequantized_pages(cache, scale, layer, block_tables):
    """References: float32 [kv_heads, *block_tables.shape, page_size, head_dim] of one layer, scales applied."""
    pages = cache[layer][:, block_tables].astype(jnp.float32)
    return pages if scale is None else pages * scale[layer][:, block_tables].astype(jnp.float32)[..., None]


def is_quantized_cache(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def compute_dtype(q_dtype, cache_dtype):
    """The dot operand dtype: the cache's for float caches (q is cast to it), the query's for int8/fp8 caches
    (their tiles are cast to it in registers)."""
    return q_dtype if is_quantized_cache(cache_dtype) else cache_dtype


def dot(a, b, trans_b: bool = False):
    """Triton dot with f32 accumulation. HIGHEST keeps float32 operands in IEEE float32: the Pallas Triton
    lowering's default precision turns a float32 dot into TF32 (10-bit mantissa); 16-bit operands are unaffected."""
    return plgpu.dot(a, b, trans_b=trans_b, precision=lax.Precision.HIGHEST)


def online_softmax_step(logits, v, m_prev, l_prev, acc_prev, v_scale=None):
    """One flash-attention update. logits: [R, K] f32 in log2 units, already masked with MASK_VALUE; v: [K, D];
    v_scale: [K] (int8 caches) or None."""
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(logits - m_next[:, None])
    l_next = alpha * l_prev + p.sum(axis=1)
    pv = p if v_scale is None else p * v_scale[None, :]
    acc_next = acc_prev * alpha[:, None] + dot(pv.astype(v.dtype), v)
    return m_next, l_next, acc_next


def softmax_init(rows: int, head_dim: int):
    return (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def window_operand(sliding_window) -> jax.Array:
    """The window as the [1] int32 array the kernels read: 0 for none. It may be traced (a per-layer window read
    inside the model's layer scan), so it is an operand, not a compile-time constant."""
    return jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)


def apply_softcap(logits, softcap: float | None):
    """Soft-capping of logits in log2 units: cap * tanh(s / cap) on the natural-unit score s = logits / LOG2_E."""
    if softcap is None:
        return logits
    return (softcap * LOG2_E) * jnp.tanh(logits * (1.0 / (softcap * LOG2_E)))


def attend_tiles(q, k_ref, v_ref, tables_ref, seq, layer, kv_head, first_tile, end_tile, mask_fn, carry, *,
                 block_k: int, page_size: int, scale_log2: float, scale_refs=None, softcap: float | None = None):
    """Runs the online softmax over key tiles [first_tile, end_tile) of one sequence.

    q: [R, D] in compute_dtype(q, cache); mask_fn(key_pos [block_k]) -> bool [R, block_k] or [1, block_k];
    scale_refs: (k_scale, v_scale) pools of an int8 cache, else None; softcap: Gemma 2's score soft-capping.
    """
    def body(tile, state):
        key_pos = tile * block_k + lax.iota(jnp.int32, block_k)
        k, v = load_kv_tile(k_ref, v_ref, tables_ref, seq, layer, kv_head, key_pos, page_size)
        k, v = k.astype(q.dtype), v.astype(q.dtype)  # no-op for float caches; int8 / fp8 -> q's dtype
        logits = dot(q, k, trans_b=True) * scale_log2
        v_scale = None
        if scale_refs is not None:
            k_scale, v_scale = load_kv_scales(*scale_refs, tables_ref, seq, layer, kv_head, key_pos, page_size)
            logits = logits * k_scale[None, :]
        logits = jnp.where(mask_fn(key_pos), apply_softcap(logits, softcap), MASK_VALUE)
        return online_softmax_step(logits, v, *state, v_scale=v_scale)

    return lax.fori_loop(first_tile, end_tile, body, carry)


def reference_softcap(scores, softcap: float | None):
    """References: softcap * tanh(scores / softcap) on natural-unit scores."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def reference_window(key_pos, q_pos, sliding_window):
    """References: keys inside the window (all when sliding_window is None or 0)."""
    if sliding_window is None:
        return True
    window = jnp.asarray(sliding_window, jnp.int32)
    return (window <= 0) | (key_pos > q_pos - window)

"""Ragged paged attention for prefill and mixed steps: any mix of prompt chunks and decode tokens.

    q            [T, H, D]                         S sequences' new tokens back to back, then padding
    query_start  [S + 1] int32                     cumulative new-token counts; padding sequences repeat the last
    context_lens [S] int32                         tokens in the cache per sequence (this step's already written)
    block_tables [S, P] int32                      page ids, 0 past a sequence's last page
    cache_k/v    [layers, kv_heads, pages, page_size, D]   float, int8 or float8_e4m3fn
    k/v_scale    [layers, kv_heads, pages, page_size] f32  int8 caches only: per-token, per-head scales
    sliding_window  None, an int or a traced int32 (0: none); softcap  None or a float (static), as in decode
    -> out       [T, H, D]                         zeros for tokens at or past query_start[S]

Token t of sequence s sits at position context_lens[s] - (query_start[s+1] - t) and attends causally to every
cached position <= its own (and > its own - sliding_window when one is set).

The tokens are cut into query blocks of `block_q` tokens, each inside one sequence (the layout is derived on
device from query_start, with the static bound ceil(T / block_q) + S blocks; unused blocks are empty). Kernel
grid (blocks, kv_heads): program (n, h) stacks block n's tokens x the `group` query heads of KV head h into
block_q * group_padded rows and runs a flash-attention loop over the key tiles its causal window needs.

    tokens      | s0 s0 s0 s0 s0 | s1 | s2 s2 | pad |     block_q = 4
    blocks      | b0 b0 b0 b0|b1 | b2 | b3 b3 | b4 .. (empty) |
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as c

MAX_ROWS = 128  # query rows (tokens x grouped heads) per program in prefill-heavy steps


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Launch parameters of the ragged kernel (hashable: it is a static argument)."""

    block_q: int = 16  # query tokens per block (power of 2); rows = block_q * group_padded
    block_k: int = 64  # keys per inner-loop tile (power of 2)
    num_warps: int = 4
    num_stages: int = 2


def choose_ragged_config(num_tokens: int, num_seqs: int, group: int, head_dim: int, itemsize: int) -> RaggedConfig:
    """Rows per program follow the mean tokens per sequence: 16 rows for decode-like mixes, 128 for prefill."""
    group_padded = c.next_pow2(group)
    mean_tokens = -(-num_tokens // max(1, num_seqs))
    max_rows = MAX_ROWS if itemsize <= 2 else MAX_ROWS // 2  # float32 dots run on FMAs: 128 rows spill
    min_q = max(1, c.MIN_DOT_ROWS // group_padded)
    block_q = min(max(c.next_pow2(mean_tokens), min_q), max(min_q, max_rows // group_padded))
    rows = block_q * group_padded
    block_k = min(64 if rows >= 64 else 128, max(16, c.TILE_BYTES // (head_dim * itemsize)))
    return RaggedConfig(block_q=block_q, block_k=block_k, num_warps=8 if rows >= 128 else 4,
                        num_stages=2 if rows >= 64 else 3)


def query_block_layout(query_start: jax.Array, context_lens: jax.Array, num_tokens: int, block_q: int):
    """One sequence per block. Returns per block (seq, first token, tokens, position of first token), each [NB].

    NB = ceil(T / block_q) + S covers any layout; unused blocks have 0 tokens, seq S - 1 and position 0.
    """
    num_seqs = query_start.shape[0] - 1
    num_blocks = -(-num_tokens // block_q) + num_seqs
    q_lens = query_start[1:] - query_start[:-1]
    per_seq = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(per_seq)
    n = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, n, side="right"), num_seqs - 1).astype(jnp.int32)
    index_in_seq = n - (ends[seq] - per_seq[seq])
    used = n < ends[-1]
    first = query_start[seq] + index_in_seq * block_q
    count = jnp.where(used, jnp.clip(q_lens[seq] - index_in_seq * block_q, 0, block_q), 0)
    position = jnp.where(used, context_lens[seq] - (query_start[seq + 1] - first), 0)
    return seq, first, count.astype(jnp.int32), position.astype(jnp.int32)


def _ragged_kernel(layer_ref, window_ref, tables_ref, seq_ref, count_ref, pos_ref, q_ref, k_ref, v_ref, *refs,
                   scale_log2: float, block_k: int, page_size: int, group_padded: int,
                   softcap: float | None, scaled: bool):
    scale_refs, (o_ref,) = (refs[:2], refs[2:]) if scaled else (None, refs)
    n, kv_head = pl.program_id(0), pl.program_id(1)
    layer, window, seq, count, first_pos = layer_ref[0], window_ref[0], seq_ref[n], count_ref[n], pos_ref[n]
    rows = q_ref.shape[0]
    q_pos = first_pos + c.div(jax.lax.iota(jnp.int32, rows), group_padded)  # row = token * group_padded + head
    kv_end = first_pos + count  # one past the block's last position; 0 for empty blocks
    kv_start = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)

    def mask(key_pos):
        causal = key_pos[None, :] <= q_pos[:, None]
        return causal & ((window <= 0) | (key_pos[None, :] > q_pos[:, None] - window))

    q = q_ref[...].astype(c.compute_dtype(q_ref.dtype, k_ref.dtype))
    _, l, acc = c.attend_tiles(q, k_ref, v_ref, tables_ref, seq, layer, kv_head, c.div(kv_start, block_k),
                               c.cdiv(kv_end, block_k), mask, c.softmax_init(rows, q.shape[1]),
                               block_k=block_k, page_size=page_size, scale_log2=scale_log2, scale_refs=scale_refs,
                               softcap=softcap)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _ragged_call(q_blocks, cache_k, cache_v, layer, window, tables, layout, *, scale, config, group_padded,
                 interpret, softcap=None, kv_scales=()):
    """q_blocks: [NB, KVH, rows, D] -> out [NB, KVH, rows, D]. kv_scales: () or an int8 cache's scale pools."""
    num_blocks, kv_heads, rows, head_dim = q_blocks.shape
    kernel = functools.partial(
        _ragged_kernel, scale_log2=scale * c.LOG2_E, block_k=config.block_k, page_size=cache_k.shape[3],
        group_padded=group_padded, softcap=softcap, scaled=bool(kv_scales))
    block = pl.BlockSpec((None, None, rows, head_dim), lambda n, h: (n, h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_blocks, kv_heads),
        in_specs=[pl.no_block_spec] * 6 + [block] + [pl.no_block_spec] * (2 + len(kv_scales)),
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="jaxserve_ragged_paged_attention",
    )(layer, window, tables, *layout, q_blocks, cache_k, cache_v, *kv_scales)


def _to_blocks(q, first, count, kv_heads, group_padded, block_q):
    """[T, H, D] -> [NB, KVH, block_q * group_padded, D]; rows past a block's tokens and padded heads are 0."""
    t, heads, d = q.shape
    group = heads // kv_heads
    tok = first[:, None] + jnp.arange(block_q)[None, :]  # [NB, block_q]
    valid = jnp.arange(block_q)[None, :] < count[:, None]
    qb = jnp.where(valid[..., None, None], q[jnp.clip(tok, 0, t - 1)], 0)  # [NB, block_q, H, D]
    qb = qb.reshape(-1, block_q, kv_heads, group, d)
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, 0), (0, group_padded - group), (0, 0)))
    return qb.transpose(0, 2, 1, 3, 4).reshape(-1, kv_heads, block_q * group_padded, d)


def _from_blocks(out, query_start, num_tokens, heads, block_q, group_padded):
    """Inverse of _to_blocks: [NB, KVH, rows, D] -> [T, H, D], zeros for padding tokens."""
    num_blocks, kv_heads, _, d = out.shape
    group = heads // kv_heads
    out = out.reshape(num_blocks, kv_heads, block_q, group_padded, d)[:, :, :, :group]
    num_seqs = query_start.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(query_start[1:], t, side="right"), num_seqs - 1)
    per_seq = (query_start[1:] - query_start[:-1] + block_q - 1) // block_q
    first_block = jnp.cumsum(per_seq) - per_seq
    index_in_seq = t - query_start[seq]
    block, row = first_block[seq] + index_in_seq // block_q, index_in_seq % block_q
    gathered = out[jnp.clip(block, 0, num_blocks - 1), :, row]  # [T, KVH, group, D]
    valid = t < query_start[-1]
    return jnp.where(valid[:, None, None, None], gathered, 0).reshape(num_tokens, heads, d)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "interpret", "config"))
def ragged_paged_attention(q, cache_k, cache_v, layer, block_tables, context_lens, query_start, *, scale: float,
                           sliding_window: int | jax.Array | None = None, softcap: float | None = None,
                           interpret: bool = False, config: RaggedConfig | None = None, k_scale=None,
                           v_scale=None) -> jax.Array:
    """Causal attention of a ragged token batch over the paged cache (see the module docstring). [T, H, D]."""
    num_tokens, heads, head_dim = q.shape
    kv_heads, group = c.check_paged_inputs(heads, head_dim, cache_k, cache_v)
    if config is None:
        config = choose_ragged_config(num_tokens, block_tables.shape[0], group, head_dim, cache_k.dtype.itemsize)
    group_padded = c.next_pow2(group)
    c.check_tiles(config.block_q * group_padded, config.block_k)
    query_start, context_lens = query_start.astype(jnp.int32), context_lens.astype(jnp.int32)
    seq, first, count, position = query_block_layout(query_start, context_lens, num_tokens, config.block_q)
    q_blocks = _to_blocks(q, first, count, kv_heads, group_padded, config.block_q)
    tables = c.pad_block_tables(block_tables, cache_k.shape[3], config.block_k)
    out = _ragged_call(q_blocks, cache_k, cache_v, c.layer_operand(layer), c.window_operand(sliding_window), tables,
                       (seq, count, position), scale=scale, config=config, group_padded=group_padded,
                       interpret=interpret, softcap=softcap, kv_scales=c.scale_pools(k_scale, v_scale))
    return _from_blocks(out, query_start, num_tokens, heads, config.block_q, group_padded).astype(q.dtype)


def ragged_paged_attention_reference(q, cache_k, cache_v, layer, block_tables, context_lens, query_start, *,
                                     scale: float, sliding_window: int | None = None, softcap: float | None = None,
                                     k_scale=None, v_scale=None) -> jax.Array:
    """Dense float32 attention of each token over its sequence's gathered pages, masked by position."""
    num_tokens, heads, head_dim = q.shape
    num_seqs, kv_heads = block_tables.shape[0], cache_k.shape[1]
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start[1:], t, side="right")  # S for padding tokens
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_pos = jnp.where(valid, context_lens[seq] - (query_start[seq + 1] - t), -1)  # -1: sees no key
    keys = c.dequantized_pages(cache_k, k_scale, layer, block_tables[seq]).reshape(kv_heads, num_tokens, -1, head_dim)
    values = c.dequantized_pages(cache_v, v_scale, layer, block_tables[seq]).reshape(kv_heads, num_tokens, -1,
                                                                                     head_dim)
    qg = q.astype(jnp.float32).reshape(num_tokens, kv_heads, heads // kv_heads, head_dim)
    scores = c.reference_softcap(jnp.einsum("tkgd,ktcd->tkgc", qg, keys) * scale, softcap)
    key_pos = jnp.arange(keys.shape[2])[None, :]
    mask = (key_pos <= q_pos[:, None]) & c.reference_window(key_pos, q_pos[:, None], sliding_window)
    mask = mask[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    probs = jnp.where(mask, probs, 0.0)
    out = jnp.einsum("tkgc,ktcd->tkgd", probs, values)
    return out.reshape(num_tokens, heads, head_dim).astype(q.dtype)

"""Paged attention as the models see it: write this step's K/V into the cache, then attend.

The kernel comes from the engine's `Kernels` bundle (jaxserve.models.kernels), resolved once at start-up: the
jnp implementations below ("xla", also the references of the other kernels), the Pallas kernels, or the C++ CPU
kernel. This module calls whichever it was handed.

Quantized caches (int8 with per-token scales, fp8; jaxserve.quant.kv) are dequantized on load by both paths:
the cache values are cast to the query dtype, K's scales multiply the logits and V's the probabilities.

Gemma's variants reach every kernel: `scale` (query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5),
`softcap` (scores -> cap * tanh(scores / cap) before the mask, Gemma 2) and a per-layer `sliding_window` that
may be a traced int32 inside the layer scan (0: no window), so alternating sliding/global layers compile once.

Tensor parallelism: attention is independent per KV head, so both paths run under shard_map over kv_heads
(jaxserve.parallel.shard_map_logical): each device writes and attends its own heads' slice of the cache, with no
communication. Queries enter grouped by KV head, [T, kv_heads, q_per_kv, head_dim], so their heads split with
their KV heads. With fewer KV heads than devices everything stays whole (replicated) on every device.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.kv.cache import AttentionMetadata, KVCache
from jaxserve.parallel import shard_map_logical

if TYPE_CHECKING:  # jaxserve.models.kernels imports the jnp implementations below
    from jaxserve.models.kernels import Kernels

BY_KV_HEAD = P(None, "kv_heads")  # q [T, kv_heads, q_per_kv, head_dim]; k, v, out [T, kv_heads, head_dim]

XLA_QUERY_BLOCK = 16  # query tokens per block in the ragged XLA path


def attend_paged(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: jax.Array,
                 meta: AttentionMetadata, *, sliding_window: int | jax.Array | None, kernels: Kernels,
                 scale: float | None = None, softcap: float | None = None) -> tuple[jax.Array, KVCache]:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Writes k, v (quantizing them for an int8/fp8
    cache), then attends. Returns (out [T, heads, head_dim], the updated cache). Split over KV heads when a mesh
    is in context (see the module docstring). scale defaults to head_dim ** -0.5."""
    t, h, d = q.shape
    kvh = k.shape[1]
    local = functools.partial(_attend_local_heads, kernels=kernels, scale=d ** -0.5 if scale is None else scale,
                              softcap=softcap)
    cache_specs = cache.logical_specs()
    window = window_operand(sliding_window) if isinstance(sliding_window, jax.Array) else sliding_window
    if isinstance(window, jax.Array):  # traced: it enters the shard_map as an operand
        local_with_window = lambda *args: local(*args[:-1], sliding_window=args[-1])  # noqa: E731
        specs, args = (P(),), (window,)
    else:
        local_with_window = functools.partial(local, sliding_window=window)
        specs, args = (), ()
    out, cache = shard_map_logical(
        local_with_window, in_specs=(BY_KV_HEAD, BY_KV_HEAD, BY_KV_HEAD, cache_specs, P(), P(), *specs),
        out_specs=(BY_KV_HEAD, cache_specs))(q.reshape(t, kvh, h // kvh, d), k, v, cache, layer, meta, *args)
    return out.reshape(t, h, d), cache


def _attend_local_heads(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: jax.Array,
                        meta: AttentionMetadata, *, sliding_window, kernels: Kernels, scale: float,
                        softcap: float | None):
    """attend_paged on the KV heads one device holds: q [T, kvh, q_per_kv, d] -> out [T, kvh, q_per_kv, d]."""
    t, kvh, group, d = q.shape
    q = q.reshape(t, kvh * group, d)
    cache = cache.write(layer, k, v, meta.slot_mapping)
    attend = kernels.decode_attention if meta.is_decode else kernels.attention
    out = attend(q, cache, layer, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
    return out.astype(q.dtype).reshape(t, kvh, group, d), cache


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                    layer: jax.Array, meta: AttentionMetadata, *, sliding_window: int | None, kernels: Kernels,
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """attend_paged on a float cache given as two pools. Returns (out [T, heads, head_dim], cache_k, cache_v)."""
    out, cache = attend_paged(q, k, v, KVCache(cache_k, cache_v), layer, meta, sliding_window=sliding_window,
                              kernels=kernels)
    return out, cache.k, cache.v


def window_operand(sliding_window) -> jax.Array:
    """A window as the int32 scalar the kernels read: a traced per-layer window, or a Python int / None (0)."""
    return jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)


def window_mask(key_pos: jax.Array, q_pos: jax.Array, sliding_window) -> jax.Array | bool:
    """Keys inside the query's window: key_pos > q_pos - window. sliding_window: None (all keys), a Python int,
    or a traced int32 where 0 means no window."""
    if sliding_window is None:
        return True
    inside = key_pos > q_pos - sliding_window
    return inside if isinstance(sliding_window, int) else inside | (sliding_window <= 0)


def cap_scores(scores: jax.Array, softcap: float | None) -> jax.Array:
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _gather_pages(cache: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[N, P] page ids -> [N, kv_heads, P * page_size, head_dim] for one layer, in one gather."""
    pages = cache[layer, :, block_tables]  # [N, P, kv_heads, page_size, head_dim]
    n, p, kvh, ps, d = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(n, kvh, p * ps, d)


def _gather_scales(scale: jax.Array | None, layer: jax.Array, block_tables: jax.Array) -> jax.Array | None:
    """[N, P] page ids -> [N, kv_heads, P * page_size] per-token scales of one layer (None for unscaled caches)."""
    if scale is None:
        return None
    pages = scale[layer, :, block_tables]  # [N, P, kv_heads, page_size]
    n, p, kvh, ps = pages.shape
    return pages.transpose(0, 2, 1, 3).reshape(n, kvh, p * ps)


def _masked_softmax_attend(scores: jax.Array, mask: jax.Array, values: jax.Array, spec: str,
                           value_scale: jax.Array | None = None) -> jax.Array:
    """value_scale (int8 caches) multiplies each key's probability: sum_c p_c (s_c v_c) = sum_c (p_c s_c) v_c."""
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # rows with no valid key (padding) give zeros, not NaN
    if value_scale is not None:
        probs = probs * value_scale
    return jnp.einsum(spec, probs.astype(values.dtype), values, preferred_element_type=jnp.float32)


def decode_attention_xla(q, cache_k, cache_v, layer, block_tables, context_lens, *, scale, sliding_window,
                         softcap=None, k_scale=None, v_scale=None):
    """One query per sequence. q: [B, heads, head_dim] -> [B, heads, head_dim]. k_scale, v_scale: the int8
    cache's scale pools [layers, kv_heads, pages, page_size] (None for float caches)."""
    b, h, d = q.shape
    kvh = cache_k.shape[1]
    keys = _gather_pages(cache_k, layer, block_tables).astype(q.dtype)  # [B, kvh, C, d]
    values = _gather_pages(cache_v, layer, block_tables).astype(q.dtype)
    qg = q.reshape(b, kvh, h // kvh, d)
    scores = jnp.einsum("bkgd,bkcd->bkgc", qg, keys, preferred_element_type=jnp.float32) * scale
    ks, vs = _gather_scales(k_scale, layer, block_tables), _gather_scales(v_scale, layer, block_tables)
    if ks is not None:
        scores, vs = scores * ks[:, :, None, :], vs[:, :, None, :]
    scores = cap_scores(scores, softcap)
    key_pos = jnp.arange(keys.shape[2])[None, :]
    q_pos = (context_lens - 1)[:, None]
    mask = (key_pos <= q_pos) & window_mask(key_pos, q_pos, sliding_window)
    out = _masked_softmax_attend(scores, mask[:, None, None, :], values, "bkgc,bkcd->bkgd", vs)
    return out.reshape(b, h, d)


def query_blocks(query_start: jax.Array, num_tokens: int, block: int):
    """Splits each sequence's new tokens into blocks of `block` tokens, one sequence per block.

    Returns (seq [NB], start [NB], length [NB]) with NB = ceil(T / block) + S, enough for any layout;
    unused blocks have length 0 and seq == S.
    """
    num_seqs = query_start.shape[0] - 1
    nb = -(-num_tokens // block) + num_seqs
    q_lens = query_start[1:] - query_start[:-1]
    per_seq = (q_lens + block - 1) // block
    cum = jnp.cumsum(per_seq)
    b = jnp.arange(nb, dtype=jnp.int32)
    seq = jnp.searchsorted(cum, b, side="right").astype(jnp.int32)
    valid = seq < num_seqs
    s = jnp.minimum(seq, num_seqs - 1)
    index_in_seq = b - (cum[s] - per_seq[s])
    start = query_start[s] + index_in_seq * block
    length = jnp.where(valid, jnp.clip(q_lens[s] - index_in_seq * block, 0, block), 0)
    return seq, start, length


def ragged_attention_xla(q, cache_k, cache_v, layer, meta: AttentionMetadata, *, scale, sliding_window,
                         softcap=None, block: int = XLA_QUERY_BLOCK, k_scale=None, v_scale=None):
    """Any mix of prompt chunks and decode tokens. q: [T, heads, head_dim] -> [T, heads, head_dim]."""
    t, h, d = q.shape
    kvh = cache_k.shape[1]
    num_seqs = meta.block_tables.shape[0]
    seq, start, length = query_blocks(meta.query_start, t, block)
    tok = start[:, None] + jnp.arange(block)[None, :]  # [NB, block]
    tok_valid = jnp.arange(block)[None, :] < length[:, None]
    tok_c = jnp.clip(tok, 0, t - 1)
    qb = q[tok_c].reshape(-1, block, kvh, h // kvh, d)  # [NB, block, kvh, g, d]
    q_pos = jnp.where(tok_valid, meta.positions[tok_c], -1)  # -1: attends to nothing
    s = jnp.minimum(seq, num_seqs - 1)
    keys = _gather_pages(cache_k, layer, meta.block_tables[s]).astype(q.dtype)  # [NB, kvh, C, d]
    values = _gather_pages(cache_v, layer, meta.block_tables[s]).astype(q.dtype)
    scores = jnp.einsum("nqkgd,nkcd->nkgqc", qb, keys, preferred_element_type=jnp.float32) * scale
    ks, vs = (_gather_scales(scale_pool, layer, meta.block_tables[s]) for scale_pool in (k_scale, v_scale))
    if ks is not None:
        scores, vs = scores * ks[:, :, None, None, :], vs[:, :, None, None, :]
    scores = cap_scores(scores, softcap)
    key_pos = jnp.arange(keys.shape[2])[None, None, :]
    mask = (key_pos <= q_pos[:, :, None]) & window_mask(key_pos, q_pos[:, :, None], sliding_window)  # [NB, block, C]
    # Produce [NB, kvh, g, block, d] and transpose after: XLA:CPU has no bf16 x bf16 -> f32 dot that writes the
    # transposed "nqkgd" layout directly (UNIMPLEMENTED ... DotThunk::Execute), so bfloat16 prefill failed on CPU.
    out = _masked_softmax_attend(scores, mask[:, None, None, :, :], values, "nkgqc,nkcd->nkgqd", vs)
    out = out.transpose(0, 3, 1, 2, 4).reshape(-1, h, d)
    dest = jnp.where(tok_valid, tok, t).reshape(-1)  # invalid rows go out of bounds and are dropped
    return jnp.zeros((t, h, d), out.dtype).at[dest].set(out, mode="drop")


def reference_attention(q, k, v, *, sliding_window=None, scale=None, softcap=None):
    """Dense causal attention over one whole sequence (tests, forward_dense). q: [T, H, D]; k, v: [T, KVH, D].
    sliding_window: None, an int, or a traced int32 (0: none); scale defaults to D ** -0.5."""
    t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, d)
    scale = d ** -0.5 if scale is None else scale
    scores = cap_scores(jnp.einsum("qkgd,ckd->kgqc", qg, k, preferred_element_type=jnp.float32) * scale, softcap)
    pos = jnp.arange(t)
    mask = (pos[None, :] <= pos[:, None]) & window_mask(pos[None, :], pos[:, None], sliding_window)
    out = _masked_softmax_attend(scores, mask[None, None], v, "kgqc,ckd->qkgd")
    return out.reshape(t, h, d).astype(q.dtype)

"""Device-side KV cache and the attention metadata of one step.

Layout (decided once, used by the XLA path and every kernel):

    k, v:              [layers, kv_heads, pages, page_size, head_dim]
    k_scale, v_scale:  [layers, kv_heads, pages, page_size] float32, int8 caches only (one scale per token and
                       KV head, see jaxserve.quant.kv); None otherwise

A page holds `page_size` consecutive positions of one sequence for every layer and KV head. Page 0 is the null page:
padding tokens write there and no valid block-table entry ever points at it.

A step's tokens are laid out ragged, sequence after sequence:

    tokens   | s0 s0 s0 s0 | s1 | s2 s2 | pad pad |
    query_start  0           4    5       7         (S + 1 entries; padding sequences repeat the last value)

Token t of sequence s sits at position context_lens[s] - (query_start[s + 1] - t): the new tokens are the last
ones of the sequence's context, and the cache already holds the earlier ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxserve.quant.kv import SCALE_BYTES, has_scales, quantize_kv

CACHE_AXES = ("layers", "kv_heads", "pages", "page_size", "head_dim")  # logical axes of k, v (scales: the first 4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Paged K and V pools. Donated to every step so updates happen in place."""

    k: jax.Array  # [layers, kv_heads, pages, page_size, head_dim]
    v: jax.Array  # [layers, kv_heads, pages, page_size, head_dim]
    k_scale: jax.Array | None = None  # [layers, kv_heads, pages, page_size] float32 (int8 caches only)
    v_scale: jax.Array | None = None  # [layers, kv_heads, pages, page_size] float32 (int8 caches only)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
              dtype) -> "KVCache":
        """An int8 `dtype` also allocates the scale pools (ones)."""
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        if not has_scales(dtype):
            return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.ones(shape[:-1], jnp.float32),
                   jnp.ones(shape[:-1], jnp.float32))

    @staticmethod
    def scale_bytes(dtype) -> int:
        """Bytes of scale per token, KV head and K/V: 4 for int8 caches, else 0."""
        return SCALE_BYTES if has_scales(dtype) else 0

    def logical_specs(self) -> "KVCache":
        """This cache with each array (or abstract array) replaced by its logical axes, as a PartitionSpec of
        logical names (jaxserve.parallel maps them to the mesh: the cache splits on kv_heads)."""
        return jax.tree.map(lambda x: PartitionSpec(*CACHE_AXES[:x.ndim]), self)

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> "KVCache":
        """Quantizes (for int8/fp8 caches) and scatters new K/V [T, kv_heads, head_dim]; see write_kv."""
        k_values, k_scale = quantize_kv(k, self.k.dtype)
        v_values, v_scale = quantize_kv(v, self.v.dtype)
        cache_k, cache_v = write_kv(self.k, self.v, layer, k_values, v_values, slot_mapping)
        if self.k_scale is None:
            return KVCache(cache_k, cache_v)
        scale_k, scale_v = write_kv(self.k_scale, self.v_scale, layer, k_scale, v_scale, slot_mapping)
        return KVCache(cache_k, cache_v, scale_k, scale_v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each token of a step lives in the paged cache, and what it may attend to.

    Built on device from the three host inputs (block_tables, context_lens, query_start); the token-level
    fields are derived so the host never sends per-token arrays.
    """

    block_tables: jax.Array  # [S, P] int32: page ids of each sequence; 0 past its last page
    context_lens: jax.Array  # [S] int32: tokens in the cache for each sequence after this step's writes
    query_start: jax.Array  # [S + 1] int32: cumulative count of new tokens per sequence
    seq_ids: jax.Array  # [T] int32: sequence of each token; S for padding tokens
    positions: jax.Array  # [T] int32: position of each token in its sequence; 0 for padding
    slot_mapping: jax.Array  # [T] int32: flat cache slot (page * page_size + offset) to write; null page for padding
    is_decode: bool = dataclasses.field(metadata=dict(static=True), default=False)  # one token per sequence

    @property
    def num_tokens(self) -> int:
        return self.seq_ids.shape[0]

    def real_tokens(self) -> jax.Array:
        """int32 scalar: one past the last token that is not padding (0 when all are); the tokens from there on are
        padding, so a product may skip their rows."""
        return _one_past_last(self.seq_ids < self.block_tables.shape[0])

    def real_seqs(self) -> jax.Array:
        """int32 scalar: one past the last sequence row that is not padding (context 0), as real_tokens."""
        return _one_past_last(self.context_lens > 0)

    @classmethod
    def build(cls, block_tables: jax.Array, context_lens: jax.Array, query_start: jax.Array, num_tokens: int,
              page_size: int, is_decode: bool = False) -> "AttentionMetadata":
        num_seqs = block_tables.shape[0]
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        if is_decode:
            seq_ids = jnp.where(context_lens > 0, t, num_seqs)
        else:
            seq_ids = jnp.searchsorted(query_start[1:], t, side="right").astype(jnp.int32)
        valid = seq_ids < num_seqs
        sid = jnp.minimum(seq_ids, num_seqs - 1)
        positions = jnp.where(valid, context_lens[sid] - (query_start[sid + 1] - t), 0)
        page = block_tables[sid, positions // page_size]
        slot_mapping = jnp.where(valid, page * page_size + positions % page_size, 0)
        return cls(block_tables, context_lens, query_start, seq_ids.astype(jnp.int32),
                   positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), is_decode)


def _one_past_last(mask: jax.Array) -> jax.Array:
    """int32 scalar: 1 + the last index where the 1-D `mask` holds (0 when nowhere)."""
    return jnp.max(jnp.where(mask, jnp.arange(1, mask.shape[0] + 1, dtype=jnp.int32), 0), initial=0)


def write_kv(cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V [T, kv_heads, head_dim] into layer `layer` at flat slots [T] (in place when donated).

    The indexed view `cache[layer, :, pages, offsets]` has shape [T, kv_heads, head_dim] (advanced indices first).
    Also used for the scale pools: [layers, kv_heads, pages, page_size] with values [T, kv_heads].
    """
    page_size = cache_k.shape[3]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    cache_k = cache_k.at[layer, :, pages, offsets].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[layer, :, pages, offsets].set(v.astype(cache_v.dtype), mode="drop")
    return cache_k, cache_v

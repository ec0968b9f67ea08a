"""Random paged-attention inputs for the kernel tests and benchmarks (numpy on the host, then device arrays).

Everything is random (never zeros), the null page included, so a kernel that reads the wrong page, layer or
head, or lets a masked key through, gives a visibly wrong answer.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PagedShape:
    """Sizes of a test or benchmark problem."""

    group: int  # query heads per KV head
    head_dim: int
    page_size: int
    dtype: str = "float32"
    kv_heads: int = 2
    layers: int = 2


def random_pool(rng: np.random.Generator, shape: PagedShape, num_pages: int):
    """(cache_k, cache_v), each [layers, kv_heads, num_pages, page_size, head_dim]."""
    dims = (shape.layers, shape.kv_heads, num_pages, shape.page_size, shape.head_dim)
    return tuple(jnp.asarray(rng.standard_normal(dims, np.float32), shape.dtype) for _ in range(2))


def block_tables_for(rng: np.random.Generator, context_lens, page_size: int, max_pages: int, num_pages: int):
    """[N, max_pages] int32: distinct random pages (never the null page 0) for each sequence, 0 past its end."""
    needed = [-(-int(n) // page_size) for n in context_lens]
    if sum(needed) > num_pages - 1 or max(needed, default=0) > max_pages:
        raise ValueError(f"{needed} pages do not fit {num_pages - 1} free pages / {max_pages} per sequence")
    free = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((len(context_lens), max_pages), np.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = [next(free) for _ in range(n)]
    return jnp.asarray(tables)


def random_queries(rng: np.random.Generator, num_tokens: int, shape: PagedShape):
    dims = (num_tokens, shape.kv_heads * shape.group, shape.head_dim)
    return jnp.asarray(rng.standard_normal(dims, np.float32), shape.dtype)


def decode_lengths(page_size: int, max_context: int) -> list[int]:
    """Lengths that hit the edge cases: 1, around a page boundary, a full table, and 0 (a padding row)."""
    return [1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5, max_context, 0]


def decode_problem(rng: np.random.Generator, shape: PagedShape, context_lens, max_pages: int):
    """(q [B, H, D], cache_k, cache_v, block_tables [B, max_pages], context_lens [B])."""
    num_pages = sum(-(-int(n) // shape.page_size) for n in context_lens) + 3
    cache_k, cache_v = random_pool(rng, shape, num_pages)
    tables = block_tables_for(rng, context_lens, shape.page_size, max_pages, num_pages)
    q = random_queries(rng, len(context_lens), shape)
    return q, cache_k, cache_v, tables, jnp.asarray(context_lens, jnp.int32)


def ragged_mix(rng: np.random.Generator, num_seqs: int, max_context: int, max_chunk: int):
    """(query_lens, context_lens) for a random mix: fresh prompt chunks, later chunks, decode tokens, empty slots."""
    query_lens, context_lens = [], []
    for _ in range(num_seqs):
        kind = rng.choice(["first_chunk", "later_chunk", "decode", "empty"], p=[0.3, 0.3, 0.3, 0.1])
        if kind == "empty":
            q_len, ctx = 0, 0
        elif kind == "decode":
            q_len, ctx = 1, int(rng.integers(1, max_context + 1))
        else:
            q_len = int(rng.integers(1, max_chunk + 1))
            ctx = q_len if kind == "first_chunk" else int(rng.integers(q_len, max_context + 1))
        query_lens.append(q_len)
        context_lens.append(ctx)
    return query_lens, context_lens


def ragged_problem(rng: np.random.Generator, shape: PagedShape, query_lens, context_lens, num_tokens: int,
                   max_pages: int):
    """(q [T, H, D], cache_k, cache_v, block_tables [S, max_pages], context_lens [S], query_start [S + 1])."""
    if sum(query_lens) > num_tokens:
        raise ValueError(f"{sum(query_lens)} new tokens do not fit {num_tokens}")
    num_pages = sum(-(-int(n) // shape.page_size) for n in context_lens) + 3
    cache_k, cache_v = random_pool(rng, shape, num_pages)
    tables = block_tables_for(rng, context_lens, shape.page_size, max_pages, num_pages)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32)
    q = random_queries(rng, num_tokens, shape)
    return q, cache_k, cache_v, tables, jnp.asarray(context_lens, jnp.int32), query_start


def tolerance(dtype) -> dict:
    """assert_allclose tolerances: bf16 rounds q, K, V, P and the output to 8 bits of mantissa."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return dict(atol=2e-2, rtol=2e-2)
    if jnp.dtype(dtype) == jnp.float16:
        return dict(atol=5e-3, rtol=5e-3)
    return dict(atol=1e-4, rtol=1e-4)

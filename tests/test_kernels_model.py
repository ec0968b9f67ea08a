"""The kernels behind the model's attention: the Pallas bundle must agree with the XLA one.

Goes through jaxserve.models.attention.paged_attention exactly as a model layer does (write this step's K/V,
then attend), with metadata built by AttentionMetadata.build, for a decode step and a mixed step.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kv.cache import AttentionMetadata
from jaxserve.models import attention
from jaxserve.models.kernels import Kernels
from pallas_kernels.testing import PagedShape, block_tables_for, random_pool, random_queries, tolerance

FAST_COMPILE = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _both_impls(rng, shape, query_lens, context_lens, num_tokens, is_decode, window):
    max_pages = 6
    num_pages = sum(-(-n // shape.page_size) for n in context_lens) + 2
    cache_k, cache_v = random_pool(rng, shape, num_pages)
    tables = block_tables_for(rng, context_lens, shape.page_size, max_pages, num_pages)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32)
    meta = AttentionMetadata.build(tables, jnp.asarray(context_lens, jnp.int32), query_start, num_tokens,
                                   shape.page_size, is_decode=is_decode)
    q = random_queries(rng, num_tokens, shape)
    k, v = (random_queries(rng, num_tokens, PagedShape(1, shape.head_dim, shape.page_size, shape.dtype,
                                                       shape.kv_heads)) for _ in range(2))
    layer = jnp.int32(1)
    outs = {}
    for impl in ("xla", "pallas"):
        step = jax.jit(functools.partial(attention.paged_attention, sliding_window=window,
                                         kernels=Kernels.resolve(impl, "xla")),
                       compiler_options=FAST_COMPILE)
        outs[impl] = step(q, k, v, cache_k, cache_v, layer, meta)
    for a, b in zip(outs["xla"], outs["pallas"]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tolerance(shape.dtype))


def test_decode_step_pallas_equals_xla(rng):
    shape = PagedShape(group=4, head_dim=64, page_size=16, dtype="bfloat16")
    lens = [1, 16, 17, 70, 0]
    _both_impls(rng, shape, [1 if n else 0 for n in lens], lens, num_tokens=5, is_decode=True, window=None)


def test_mixed_step_pallas_equals_xla(rng):
    shape = PagedShape(group=2, head_dim=64, page_size=16)
    query_lens, context_lens = [9, 1, 20, 0], [9, 40, 52, 0]  # first chunk, decode, later chunk, empty slot
    _both_impls(rng, shape, query_lens, context_lens, num_tokens=40, is_decode=False, window=24)

"""The CPU paged-attention kernel (jaxserve/cpu/paged_attention.cc) against XLA's gather path
(jaxserve.models.attention.ragged_attention_xla) on the small preset's heads (12 query, 4 KV, head_dim 64, pages
of 16, float32 cache), one layer, interleaved in one process:

    decode    N sequences, one query token each, at a context of C tokens
    prefill   N prompts of 128 tokens, whole (the 16-concurrent serving wave)
    verify    N sequences, K + 1 = 5 query tokens each at a context of C (speculative decoding's verify step)

    python bench/cpu_attention.py [--rounds 20]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import cpu
from jaxserve.kv.cache import AttentionMetadata
from jaxserve.models.attention import ragged_attention_xla
from pallas_kernels.testing import PagedShape, ragged_problem
from moe_grouped import timed  # bench/

SHAPE = PagedShape(group=3, head_dim=64, page_size=16, kv_heads=4, layers=1)
CASES = [("decode", 16, 1, 256), ("decode", 64, 1, 256), ("prefill", 16, 128, 128), ("verify", 1, 5, 256),
         ("verify", 16, 5, 256)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    assert cpu.available(), "the CPU kernels did not build"
    rng = np.random.default_rng(0)
    scale = SHAPE.head_dim ** -0.5
    for kind, seqs, query_len, context in CASES:
        max_pages = -(-context // SHAPE.page_size)
        q, ck, cv, tables, lens, starts = ragged_problem(rng, SHAPE, [query_len] * seqs, [context] * seqs,
                                                         seqs * query_len, max_pages)
        layer = jnp.int32(0)
        ours = jax.jit(lambda *a: cpu.paged_attention(*a, scale=scale, sliding_window=None))
        meta = AttentionMetadata.build(tables, lens, starts, seqs * query_len, SHAPE.page_size)
        xla = jax.jit(lambda q, ck, cv, layer, meta: ragged_attention_xla(q, ck, cv, layer, meta, scale=scale,
                                                                          sliding_window=None))
        t_ours = timed(ours, q, ck, cv, layer, tables, lens, starts, repeats=args.rounds)
        t_xla = timed(xla, q, ck, cv, layer, meta, repeats=args.rounds)
        print(f"{kind:8s} {seqs:3d} seqs x {query_len:3d} tokens, context {context}: kernel {t_ours * 1e3:7.3f} ms, "
              f"xla {t_xla * 1e3:7.3f} ms ({t_xla / t_ours:.1f}x)", flush=True)


if __name__ == "__main__":
    main()

"""Paged-attention kernels against their pure-jnp references.

On CPU the kernels run in Pallas interpret mode. JAXSERVE_KERNEL_INTERPRET=0 runs them compiled on a GPU
(bench/gpu_check.sh does); =1 forces interpret mode anywhere. Every case draws fresh random inputs, and each
kernel call covers many lengths at once (interpret-mode compiles dominate the run time on a 2-core CI box).
"""

from __future__ import annotations

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import env_str
from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.testing import (PagedShape, decode_lengths, decode_problem, ragged_mix, ragged_problem,
                                    tolerance)


def _interpret() -> bool:
    flag = env_str("JAXSERVE_KERNEL_INTERPRET")
    if flag is None:
        return jax.default_backend() != "gpu"
    return flag not in ("0", "false", "no")


INTERPRET = _interpret()
# Interpret mode is compile-bound on CPU: XLA's LLVM optimisation halves the compile and buys nothing here.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0} if INTERPRET else None


def _jit(fn, **static):
    return jax.jit(functools.partial(fn, **static), compiler_options=COMPILER_OPTIONS)


@pytest.fixture
def rng(request):
    """A generator seeded by the test's id: fresh inputs per case, reproducible when a case fails."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _run_decode(rng, shape: PagedShape, window, config, max_pages=8, softcap=None):
    lens = decode_lengths(shape.page_size, max_pages * shape.page_size)
    q, ck, cv, tables, lens = decode_problem(rng, shape, lens, max_pages)
    layer = jnp.int32(shape.layers - 1)
    scale = shape.head_dim ** -0.5
    kernel = _jit(pa.paged_attention, scale=scale, sliding_window=window, softcap=softcap, interpret=INTERPRET,
                  config=config)
    reference = _jit(pa.paged_attention_reference, scale=scale, sliding_window=window, softcap=softcap)
    out, ref = kernel(q, ck, cv, layer, tables, lens), reference(q, ck, cv, layer, tables, lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tolerance(shape.dtype))
    assert not np.asarray(out[-1]).any(), "a padding row (context_lens 0) must give zeros"


# (group, head_dim, page_size, dtype, sliding_window, config): together they cover GQA 1/2/4/8 (and an odd group),
# head_dim 64/128, pages 16/32/64, both dtypes, windows, one split and several.
DECODE_CASES = [
    (1, 64, 16, "float32", None, pa.DecodeConfig(block_k=32, num_splits=1)),
    (2, 128, 32, "bfloat16", None, None),
    (4, 64, 64, "float32", None, pa.DecodeConfig(block_k=64, num_splits=3)),
    (8, 128, 16, "bfloat16", None, pa.DecodeConfig(block_k=16, num_splits=2)),
    (4, 128, 16, "float32", 40, pa.DecodeConfig(block_k=32, num_splits=2)),
    (8, 64, 32, "bfloat16", 17, pa.DecodeConfig(block_k=128, num_splits=1)),
    (3, 64, 16, "float32", None, pa.DecodeConfig(block_k=16, num_splits=4)),
]


@pytest.mark.parametrize("group,head_dim,page_size,dtype,window,config", DECODE_CASES)
def test_decode_matches_reference(rng, group, head_dim, page_size, dtype, window, config):
    _run_decode(rng, PagedShape(group, head_dim, page_size, dtype), window, config)


def _run_ragged(rng, shape: PagedShape, window, config, num_seqs=7, max_pages=6, num_tokens=112, softcap=None):
    # num_tokens bounds the mix: 1 + 24 fixed tokens plus up to 16 for each of the other 5 sequences, then padding
    max_context = max_pages * shape.page_size
    query_lens, context_lens = ragged_mix(rng, num_seqs, max_context, max_chunk=16)
    query_lens[:2], context_lens[:2] = [1, 24], [1, max_context - 3]  # a 1-token prompt; a long chunk after a prefix
    q, ck, cv, tables, lens, query_start = ragged_problem(rng, shape, query_lens, context_lens, num_tokens,
                                                          max_pages)
    layer = jnp.int32(shape.layers - 1)
    scale = shape.head_dim ** -0.5
    kernel = _jit(rpa.ragged_paged_attention, scale=scale, sliding_window=window, softcap=softcap,
                  interpret=INTERPRET, config=config)
    reference = _jit(rpa.ragged_paged_attention_reference, scale=scale, sliding_window=window, softcap=softcap)
    out = kernel(q, ck, cv, layer, tables, lens, query_start)
    ref = reference(q, ck, cv, layer, tables, lens, query_start)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tolerance(shape.dtype))
    assert not np.asarray(out[int(query_start[-1]):]).any(), "padding tokens must give zeros"


RAGGED_CASES = [
    (1, 64, 16, "float32", None, None),
    (2, 128, 32, "bfloat16", None, rpa.RaggedConfig(block_q=8, block_k=32)),
    (4, 64, 64, "float32", 24, rpa.RaggedConfig(block_q=4, block_k=16)),
    (8, 128, 16, "bfloat16", None, None),
    (3, 64, 16, "float32", None, rpa.RaggedConfig(block_q=16, block_k=64)),
    (4, 128, 32, "bfloat16", 50, rpa.RaggedConfig(block_q=16, block_k=32)),
]


@pytest.mark.parametrize("group,head_dim,page_size,dtype,window,config", RAGGED_CASES)
def test_ragged_matches_reference(rng, group, head_dim, page_size, dtype, window, config):
    _run_ragged(rng, PagedShape(group, head_dim, page_size, dtype), window, config)


# Gemma's variants: soft-capped scores, and windows that arrive as traced int32 operands (0: no window), as the
# layer scan of a model with alternating sliding and global layers hands them over.
@pytest.mark.parametrize("window", [None, 23, 0])
def test_softcap_and_operand_windows_match_reference(rng, window):
    window = None if window is None else jnp.int32(window)
    _run_decode(rng, PagedShape(2, 64, 16, "float32"), window, pa.DecodeConfig(block_k=16, num_splits=2),
                softcap=0.5)  # scores of random q, k reach ~1: a cap of 0.5 changes them visibly
    _run_ragged(rng, PagedShape(2, 64, 16, "bfloat16"), window, rpa.RaggedConfig(block_q=8, block_k=16),
                softcap=0.5)


def test_softcap_changes_the_output(rng):
    """The soft-cap reaches the kernel: capped and uncapped attention differ on the same inputs."""
    shape = PagedShape(2, 64, 16, "float32")
    q, ck, cv, tables, lens = decode_problem(rng, shape, decode_lengths(16, 64), 4)
    run = lambda cap: _jit(pa.paged_attention, scale=0.125, softcap=cap, interpret=INTERPRET)(  # noqa: E731
        q, ck, cv, jnp.int32(0), tables, lens)
    assert float(jnp.max(jnp.abs(run(0.5) - run(None)))) > 1e-3


def test_split_combine_ignores_empty_splits():
    out = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 1, 4)), jnp.float32)
    lse = jnp.asarray([[[0.0], [-jnp.inf], [1.0]], [[-jnp.inf], [-jnp.inf], [-jnp.inf]]])
    merged = _jit(pa.combine_splits)(out, lse)
    w = np.exp2([0.0, 1.0]) / np.exp2([0.0, 1.0]).sum()
    np.testing.assert_allclose(merged[0, 0], w[0] * out[0, 0, 0] + w[1] * out[0, 2, 0], rtol=1e-6)
    assert not np.asarray(merged[1]).any() and np.isfinite(np.asarray(merged)).all()


def test_configs_are_triton_friendly():
    for batch, ctx, dim, size in itertools.product([1, 16, 64, 256], [512, 2048, 8192], [64, 128], [2, 4]):
        cfg = pa.choose_decode_config(batch, 8, dim, size, ctx)
        assert cfg.block_k & (cfg.block_k - 1) == 0 and 16 <= cfg.block_k <= 128
        assert 1 <= cfg.num_splits <= max(1, ctx // cfg.block_k)
    assert pa.choose_decode_config(1, 8, 128, 2, 8192).num_splits > 1, "a small batch must split the context"
    assert pa.choose_decode_config(64, 8, 128, 2, 2048).num_splits == 1
    for tokens, seqs, group in itertools.product([16, 256, 4096], [1, 16, 256], [1, 2, 4, 8]):
        cfg = rpa.choose_ragged_config(tokens, seqs, group, 128, 2)
        rows = cfg.block_q * (1 << (group - 1).bit_length())
        assert 16 <= rows <= 128 and rows & (rows - 1) == 0


@pytest.mark.slow
@pytest.mark.parametrize("group,head_dim,page_size,dtype,window", list(itertools.product(
    [1, 2, 4, 8], [64, 128], [16, 32, 64], ["float32", "bfloat16"], [None, 33])))
def test_exhaustive_sweep(rng, group, head_dim, page_size, dtype, window):
    shape = PagedShape(group, head_dim, page_size, dtype)
    _run_decode(rng, shape, window, None)
    _run_ragged(rng, shape, window, None)

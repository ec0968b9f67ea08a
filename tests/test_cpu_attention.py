"""The CPU attention kernel (jaxserve/cpu, C++ through XLA's FFI) against the float32 reference, and the engine
with attention=cpu against attention=xla and transformers."""

from __future__ import annotations

import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HF_FIXTURES
from jaxserve import cpu
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.models.kernels import resolve_attention
from jaxserve.sampling_params import SamplingParams
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.testing import (PagedShape, decode_lengths, decode_problem, ragged_mix, ragged_problem,
                                    tolerance)

# Skipped only where the kernel cannot exist; with a compiler at hand, a kernel that fails to build fails the tests.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or cpu.compiler() is None,
                                reason="the CPU kernel needs the CPU backend and a C++ compiler")


def test_kernel_builds_here():
    assert cpu.available(), "the C++ kernel failed to build: see the warning logged by jaxserve.cpu"


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _check(out, ref, q, dtype, first_padding_token):
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tolerance(dtype))
    assert not np.asarray(out[first_padding_token:]).any(), "padding tokens must give zeros"


# (group, head_dim, page_size, dtype, window): GQA 1/2/3/4/8, head_dim 64/128 and 36 (not a multiple of 8), pages 16/32/64.
CASES = [
    (1, 64, 16, "float32", None),
    (2, 128, 32, "bfloat16", None),
    (4, 64, 64, "float32", 24),
    (8, 128, 16, "bfloat16", 17),
    (3, 36, 16, "float32", None),
]


@pytest.mark.parametrize("group,head_dim,page_size,dtype,window", CASES)
def test_ragged_matches_reference(rng, group, head_dim, page_size, dtype, window):
    shape = PagedShape(group, head_dim, page_size, dtype, layers=3)
    max_pages = 6
    max_context = max_pages * page_size
    query_lens, context_lens = ragged_mix(rng, 9, max_context, max_chunk=16)
    query_lens[:3], context_lens[:3] = [1, 24, 0], [1, max_context - 3, 0]  # 1-token prompt, chunk after a prefix
    q, ck, cv, tables, lens, query_start = ragged_problem(rng, shape, query_lens, context_lens, 200, max_pages)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window)
    for layer in (0, 2):
        out = jax.jit(lambda *a: cpu.paged_attention(*a, **kw))(q, ck, cv, jnp.int32(layer), tables, lens,
                                                                query_start)
        ref = rpa.ragged_paged_attention_reference(q, ck, cv, jnp.int32(layer), tables, lens, query_start, **kw)
        _check(out, ref, q, dtype, int(query_start[-1]))


# (group, dtype, window, softcap): the prompt path's tiles hold up to 16 tokens, as many as fit 4 vectors of rows
# (tokens x group: 64 rows with AVX-512, 32 with AVX2), and score keys 128 at a time, so these prompts span several
# tiles and several key chunks, with chunks that start after a prefix. Group 16 fills a tile with 2 (AVX2) or 4
# tokens; group 40 is wider than an AVX2 tile, so there its prompts take the per-token path.
LONG_CASES = [(3, "float32", None, None), (1, "bfloat16", None, None), (8, "float32", 100, None),
              (4, "bfloat16", 37, 30.0), (16, "float32", None, None), (40, "bfloat16", 50, None)]


@pytest.mark.parametrize("group,dtype,window,softcap", LONG_CASES)
def test_long_prompts_match_reference(rng, group, dtype, window, softcap):
    shape = PagedShape(group, 64, 16, dtype, layers=2)
    query_lens = [300, 1, 17, 130, 2, 0, 45]
    context_lens = [300, 290, 17, 400, 129, 0, 45 + 211]  # a whole prompt, decode, chunks after a prefix, an empty slot
    q, ck, cv, tables, lens, query_start = ragged_problem(rng, shape, query_lens, context_lens, 512, 26)
    kw = dict(scale=0.125, sliding_window=window, softcap=softcap)
    out = jax.jit(lambda *a: cpu.paged_attention(*a, **kw))(q, ck, cv, jnp.int32(1), tables, lens, query_start)
    ref = rpa.ragged_paged_attention_reference(q, ck, cv, jnp.int32(1), tables, lens, query_start, **kw)
    _check(out, ref, q, dtype, int(query_start[-1]))


@pytest.mark.parametrize("group,head_dim,page_size,dtype,window", CASES)
def test_decode_matches_reference(rng, group, head_dim, page_size, dtype, window):
    """Decode is the ragged layout with one token per sequence; a 0 context is a padding row."""
    shape = PagedShape(group, head_dim, page_size, dtype)
    lengths = decode_lengths(page_size, 8 * page_size)  # ends with 0: the last row is padding
    q, ck, cv, tables, lens = decode_problem(rng, shape, lengths, 8)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(np.asarray(lens) > 0)]), jnp.int32)
    layer = jnp.int32(1)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window)
    out = cpu.paged_attention(q, ck, cv, layer, tables, lens, query_start, **kw)
    ref = rpa.ragged_paged_attention_reference(q, ck, cv, layer, tables, lens, query_start, **kw)
    _check(out, ref, q, dtype, len(lengths) - 1)


@pytest.mark.parametrize("window", [None, 19, 0])
def test_softcap_and_traced_window_match_reference(rng, window):
    """Gemma: soft-capped scores, and the window as a traced int32 (0: none) read inside a layer scan."""
    shape = PagedShape(2, 64, 16, "float32", layers=2)
    query_lens, context_lens = ragged_mix(rng, 5, 96, max_chunk=16)
    q, ck, cv, tables, lens, query_start = ragged_problem(rng, shape, query_lens, context_lens, 64, 6)
    windows = jnp.asarray([0 if window is None else window, 0], jnp.int32)
    step = jax.jit(lambda *a: cpu.paged_attention(*a[:-1], scale=0.125, sliding_window=a[-1][0], softcap=0.5))
    out = step(q, ck, cv, jnp.int32(1), tables, lens, query_start, windows)
    ref = rpa.ragged_paged_attention_reference(q, ck, cv, jnp.int32(1), tables, lens, query_start, scale=0.125,
                                               sliding_window=window, softcap=0.5)
    _check(out, ref, q, "float32", int(query_start[-1]))


def test_auto_picks_the_kernel_for_float_caches_only():
    assert resolve_attention("auto", jnp.float32) == "cpu"
    assert resolve_attention("auto", jnp.bfloat16) == "cpu"
    assert resolve_attention("auto", jnp.int8) == "xla"  # quantized caches keep the XLA path
    with pytest.raises(ValueError, match="auto, pallas, cpu or xla"):
        resolve_attention("flash", jnp.float32)


SMALL = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=128,
                     decode_buckets=(4,), prefill_token_buckets=(32,), prefill_seq_buckets=(4,),
                     context_buckets=(128,), kv_cache_memory=2**22, xla_optimization_level=0,
                     compilation_cache_dir="")


@pytest.mark.parametrize("family", ["llama3.1", "mistral", "qwen3"])
def test_engine_greedy_matches_xla_and_transformers(converted, family):
    """Chunked prefill (prompts longer than the 32-token budget), decode, sliding window (mistral), head_dim != H/h."""
    reference = json.loads((HF_FIXTURES / family / "reference.json").read_text())
    prompts = [p["ids"] for p in reference["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for impl in ("xla", "cpu"):
        engine = LLMEngine.from_model_dir(converted(family), SMALL.replace(attention=impl), show_progress=False)
        assert engine.core.kernels.attention_name == impl
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        finals = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
        tokens[impl] = [finals[str(i)] for i in range(len(prompts))]
    assert tokens["cpu"] == tokens["xla"] == [p["continuation"][:12] for p in reference["prompts"]]

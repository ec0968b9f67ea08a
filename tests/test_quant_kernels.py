"""Quantized kernels: the W8A16 / W4A16 / WFP8A16 matmul (zero points, groups, per channel) and the attention
kernels over int8 / fp8 KV caches.

Interpret mode on CPU against the pure-jnp references (JAXSERVE_KERNEL_INTERPRET=0 runs them compiled on a GPU,
as bench/gpu_check.sh does), the model's kernels bundle (Pallas == XLA), CUDA cross-lowering for an
abstract H200, and, where the `triton` package is installed, an offline sm_90 compile of the Triton IR.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import env_str
from jaxserve.kv.cache import AttentionMetadata, KVCache
from jaxserve.models import attention
from jaxserve.models.kernels import Kernels
from jaxserve.models.linear import QuantizedWeight, dense, gather_columns
from jaxserve.quant import kv, schemes
from pallas_kernels import paged_attention as pa
from pallas_kernels import quant_matmul as qm
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.testing import (PagedShape, block_tables_for, decode_lengths, decode_problem, random_queries,
                                    ragged_mix, ragged_problem, tolerance)
from test_kernels_lowering import (SM90_SHARED_MEMORY, _i32, _pool, _ptxas_spill_bytes, lower_for_h200,
                                   triton_calls)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _interpret() -> bool:
    flag = env_str("JAXSERVE_KERNEL_INTERPRET")
    return jax.default_backend() != "gpu" if flag is None else flag not in ("0", "false", "no")


INTERPRET = _interpret()
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0} if INTERPRET else None


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _jit(fn, **static):
    return jax.jit(functools.partial(fn, **static), compiler_options=COMPILER_OPTIONS)


# ---------------------------------------------------------------------------------------------- matmul

# (scheme, M, K, N, dtype, config): decode-sized and prefill-sized M, M not a multiple of the row block (masked
# rows), split-K, the demo model's w_down (K = 704: int4 group 64), both ways int4 reads x, and default tiles.
MATMUL_CASES = [
    ("int8", 1, 256, 64, "float32", None),
    ("int8", 33, 384, 96, "bfloat16", None),
    ("int8", 5, 1024, 64, "bfloat16", qm.MatmulConfig(block_k=128, splits=2)),
    ("int4", 1, 256, 64, "float32", None),
    ("int4", 20, 512, 128, "bfloat16", qm.MatmulConfig(block_m=32, block_k=64, splits=2)),
    ("int4", 3, 704, 256, "bfloat16", None),
    ("int4", 5, 256, 64, "bfloat16", qm.MatmulConfig(x_planes=True)),  # decode M through contiguous planes
    ("int4", 70, 256, 64, "bfloat16", None),  # M > 64: planes by default, a partial 128-row block
]


@pytest.mark.parametrize("scheme, m, k, n, dtype, config", MATMUL_CASES)
def test_quant_matmul_matches_reference(rng, scheme, m, k, n, dtype, config):
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.5, 2, (1, n)).astype(np.float32)
    values, scales = schemes.quantize(w, 1, scheme)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    out = _jit(qm.quant_matmul, scheme=scheme, interpret=INTERPRET, config=config)(x, values, scales)
    ref = qm.quant_matmul_reference(x, values, scales, scheme=scheme)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    # Both sides use the same bf16-exact integer weights and inputs and accumulate in float32: only the order
    # of float32 sums differs.
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))
    np.testing.assert_allclose(schemes.xla_matmul(x, values, scales, scheme), ref, rtol=2e-2,
                               atol=1e-2 * float(jnp.abs(ref).max()))  # int4 xla: weights rounded to x's dtype


def test_kernel_reference_reads_the_format_jaxserve_quant_writes(rng):
    w = rng.standard_normal((256, 32)).astype(np.float32)
    for scheme in schemes.SCHEMES:
        values, scales = schemes.quantize(w, 1, scheme)
        np.testing.assert_array_equal(qm.dequantize_reference(values, scales, scheme),
                                      schemes.dequantize(values, scales, 1, scheme))


# Imported formats (jaxserve.convert.quantized): zero points (int4 / int8), explicit groups, per-channel int4,
# grouped int8, fp8 per channel and per group; split-K and masked rows again; both ways int4 reads x.
VARIANT_CASES = [
    ("int4-g32-zp", 3, 256, 64, "bfloat16", None),
    ("int4-g64-zp", 20, 512, 128, "bfloat16", qm.MatmulConfig(block_m=32, block_k=64, splits=2)),
    ("int4-ch", 5, 256, 64, "bfloat16", None),
    ("int4-ch-zp", 70, 256, 64, "float32", None),
    ("int8-g32-zp", 5, 256, 64, "bfloat16", None),
    ("int8-g64", 33, 384, 96, "bfloat16", None),
    ("int8-ch-zp", 1, 256, 64, "float32", None),
    ("fp8", 1, 256, 64, "bfloat16", None),
    ("fp8-g32", 17, 512, 128, "bfloat16", qm.MatmulConfig(block_k=32, splits=2)),
    ("fp8", 70, 256, 128, "float32", None),
]


def _variant_operands(rng, scheme, k, n):
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.5, 2, (1, n)).astype(np.float32)
    w += rng.uniform(-0.5, 0.5, (1, n)).astype(np.float32)  # off-centre columns: the zero points matter
    arrays = schemes.quantize_arrays(w, 1, scheme)
    return arrays["values"], arrays["scales"], arrays.get("zeros")


@pytest.mark.parametrize("scheme, m, k, n, dtype, config", VARIANT_CASES)
def test_quant_matmul_variants_match_reference(rng, scheme, m, k, n, dtype, config):
    values, scales, zeros = _variant_operands(rng, scheme, k, n)
    kind = schemes.parse(scheme).kind
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    out = _jit(qm.quant_matmul, scheme=kind, interpret=INTERPRET, config=config)(x, values, scales, zeros)
    ref = qm.quant_matmul_reference(x, values, scales, zeros, scheme=kind)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))
    np.testing.assert_allclose(schemes.xla_matmul(x, values, scales, scheme, zeros), ref, rtol=2e-2,
                               atol=1e-2 * float(jnp.abs(ref).max()))
    np.testing.assert_array_equal(qm.dequantize_reference(values, scales, kind, zeros),
                                  schemes.dequantize(values, scales, 1, scheme, zeros=zeros))


def test_matmul_refuses_zeros_that_are_not_shaped_like_the_scales(rng):
    values, scales, zeros = _variant_operands(rng, "int4-g32-zp", 128, 64)
    with pytest.raises(ValueError, match="zeros"):
        qm.quant_matmul(jnp.zeros((2, 128), jnp.bfloat16), values, scales, zeros[:1], scheme="int4")


def test_matmul_refuses_tiles_the_triton_dot_cannot_take():
    x, values, scales = jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((128, 40), jnp.int8), jnp.ones(40)
    with pytest.raises(ValueError, match="block_n"):
        qm.quant_matmul(x, values, scales, scheme="int8", config=qm.MatmulConfig(block_n=8))
    with pytest.raises(ValueError, match="block_n must be a power of 2"):
        qm.quant_matmul(x, values, scales, scheme="int8")  # N = 40: 8-column tiles at most
    with pytest.raises(ValueError, match="multiple of block_n"):
        qm.quant_matmul(x, values, scales, scheme="int8", config=qm.MatmulConfig(block_n=32))
    with pytest.raises(ValueError, match="K=256"):
        qm.quant_matmul(jnp.zeros((4, 256), jnp.bfloat16), values, scales, scheme="int8")


@pytest.mark.parametrize("m, k, n, splits", [(1, 4096, 14336, 2), (16, 14336, 4096, 4), (256, 4096, 14336, 2)])
def test_config_heuristic_fills_an_h200(m, k, n, splits):
    for scheme in schemes.SCHEMES:
        config = qm.choose_config(m, k, n, scheme, 128 if scheme == "int4" else None)
        qm.check_config(k, n, scheme, 128 if scheme == "int4" else None, config)
        programs = -(-m // config.block_m) * (n // config.block_n) * config.splits
        assert config.splits == splits and programs >= 132, (scheme, config)


@pytest.mark.parametrize("scheme", [*schemes.SCHEMES, "int4-g32-zp-act", "int8-g32-zp", "fp8", "fp8-g32-act",
                                    "int4-ch"])
def test_dense_dispatch_pallas_equals_xla(rng, scheme):
    """dense() on QuantizedWeights of every contraction form the model uses (wq, wo with 2 dims, w_down)."""
    cases = [((64, 4, 16), ("embed", "heads", "head_dim"), 1, (2, 7, 64), "...te,ehd->...thd"),
             ((4, 16, 64), ("heads", "head_dim", "embed"), 2, (7, 4, 16), "...thd,hde->...te"),
             ((128, 64), ("mlp", "embed"), 1, (7, 128), "...tf,fe->...te")]
    for shape, axes, contract, x_shape, spec in cases:
        w = rng.standard_normal(shape).astype(np.float32)
        weight = QuantizedWeight.from_arrays(schemes.quantize_arrays(w, contract, scheme),
                                             schemes.layout(shape, axes, contract, scheme), scheme, contract)
        if schemes.parse(scheme).act_order:  # rows really stored out of order, undone by dequantize
            assert not np.array_equal(np.asarray(weight.perm[...]), np.arange(weight.perm.shape[0]))
        x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
        expected = jnp.einsum(spec, x, weight.dequantize())
        for impl in ("xla", "pallas"):
            got = dense(x, weight, spec, kernels=Kernels.resolve("xla", impl))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(jnp.abs(expected).max()))


def test_act_order_runs_in_bfloat16_on_the_xla_path(rng):
    """The act-order gather feeding a bfloat16 dot (XLA:CPU rejects a column gather there: gather_columns)."""
    scheme = "int4-g32-zp-act"
    w = rng.standard_normal((128, 64)).astype(np.float32)
    weight = QuantizedWeight.from_arrays(schemes.quantize_arrays(w, 1, scheme),
                                         schemes.layout((128, 64), ("mlp", "embed"), 1, scheme), scheme, 1)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    got = nnx.jit(lambda weight, x: dense(x, weight, "...tf,fe->...te", out_dtype=jnp.float32))(weight, x)
    expected = jnp.dot(x.astype(jnp.float32), weight.dequantize(), precision="highest")
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * float(jnp.abs(expected).max()))


def test_dense_refuses_a_spec_that_is_not_a_matrix_product(rng):
    weight = QuantizedWeight(*schemes.quantize(np.ones((64, 32), np.float32), 1, "int8"),
                             schemes.layout((64, 32), ("embed", "mlp"), 1, "int8"), "int8", 1)
    with pytest.raises(ValueError, match="K dims"):
        dense(jnp.ones((3, 64)), weight, "te,ef->ft")


# ---------------------------------------------------------------------------------------------- KV cache

def _quantized_pools(cache_k, cache_v, dtype):
    (k, ks), (v, vs) = kv.quantize_kv(cache_k, dtype), kv.quantize_kv(cache_v, dtype)
    return k, v, dict(k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float32"])
def test_decode_kernel_over_quantized_cache_matches_reference(rng, cache_dtype, q_dtype):
    shape = PagedShape(group=4, head_dim=64, page_size=16, dtype=q_dtype)
    q, ck, cv, tables, lens = decode_problem(rng, shape, decode_lengths(16, 128), 8)
    k, v, scales = _quantized_pools(ck, cv, cache_dtype)
    layer = jnp.int32(1)
    out = _jit(pa.paged_attention, scale=0.125, interpret=INTERPRET)(q, k, v, layer, tables, lens, **scales)
    ref = pa.paged_attention_reference(q, k, v, layer, tables, lens, scale=0.125, **scales)
    assert out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tolerance(q_dtype))
    assert not np.asarray(out[-1]).any()


@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_ragged_kernel_over_quantized_cache_matches_reference(rng, cache_dtype):
    shape = PagedShape(group=2, head_dim=64, page_size=16, dtype="bfloat16")
    query_lens, context_lens = ragged_mix(rng, 6, 100, 30)
    q, ck, cv, tables, lens, query_start = ragged_problem(rng, shape, query_lens, context_lens, 128, 8)
    k, v, scales = _quantized_pools(ck, cv, cache_dtype)
    layer = jnp.int32(0)
    out = _jit(rpa.ragged_paged_attention, scale=0.125, sliding_window=40, interpret=INTERPRET)(
        q, k, v, layer, tables, lens, query_start, **scales)
    ref = rpa.ragged_paged_attention_reference(q, k, v, layer, tables, lens, query_start, scale=0.125,
                                               sliding_window=40, **scales)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tolerance("bfloat16"))


@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("is_decode", [True, False])
def test_model_attention_dispatch_over_quantized_cache(rng, cache_dtype, is_decode):
    """attend_paged writes (quantizing) and attends: Pallas kernels == XLA ones, and both stay close to the
    same step over a float cache."""
    shape = PagedShape(group=2, head_dim=32, page_size=8)
    query_lens, context_lens = ([1, 1, 1, 0], [5, 19, 40, 0]) if is_decode else ([9, 1, 20, 0], [9, 30, 37, 0])
    num_tokens = 4 if is_decode else 32
    tables = block_tables_for(rng, context_lens, 8, 6, 24)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32)
    meta = AttentionMetadata.build(tables, jnp.asarray(context_lens, jnp.int32), query_start, num_tokens, 8,
                                   is_decode=is_decode)
    q = random_queries(rng, num_tokens, shape)
    k, v = (random_queries(rng, num_tokens, PagedShape(1, 32, 8, kv_heads=2)) for _ in range(2))
    float_cache = KVCache(*(jnp.asarray(rng.standard_normal((2, 2, 24, 8, 32)), jnp.float32) for _ in range(2)))
    quant_cache = _quantize_cache(float_cache, cache_dtype)
    outs = {}
    for impl, cache in (("xla", quant_cache), ("pallas", quant_cache), ("float", float_cache)):
        kernels = Kernels.resolve("xla" if impl == "float" else impl, "xla")
        step = jax.jit(functools.partial(attention.attend_paged, sliding_window=None, kernels=kernels),
                       compiler_options=COMPILER_OPTIONS)
        outs[impl] = step(q, k, v, cache, jnp.int32(1), meta)
    np.testing.assert_allclose(outs["pallas"][0], outs["xla"][0], **tolerance("float32"))
    for a, b in zip(jax.tree.leaves(outs["pallas"][1]), jax.tree.leaves(outs["xla"][1])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    error = float(jnp.abs(outs["xla"][0] - outs["float"][0]).max())
    assert error < (0.02 if cache_dtype == jnp.int8 else 0.15), error  # int8: ~1/254 per value; e4m3: 2^-4


def _quantize_cache(cache: KVCache, dtype) -> KVCache:
    (k, ks), (v, vs) = kv.quantize_kv(cache.k, dtype), kv.quantize_kv(cache.v, dtype)
    return KVCache(k, v, ks, vs)


# ---------------------------------------------------------------------------------------------- CUDA lowering

MLP_SHAPES = [(m, k, n) for m in (1, 16, 64, 256) for k, n in ((4096, 14336), (14336, 4096))]


def _weight_avals(scheme, k, n):
    if scheme == "int8":
        return jax.ShapeDtypeStruct((k, n), jnp.int8), jax.ShapeDtypeStruct((n,), jnp.float32)
    return jax.ShapeDtypeStruct((k // 2, n), jnp.uint8), jax.ShapeDtypeStruct((k // 128, n), jnp.float32)


def _lower_matmul(scheme, m, k, n):
    fn = functools.partial(qm.quant_matmul, scheme=scheme, out_dtype=jnp.bfloat16)
    return lower_for_h200(fn, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), *_weight_avals(scheme, k, n))


@pytest.mark.parametrize("scheme", schemes.SCHEMES)
@pytest.mark.parametrize("m, k, n", MLP_SHAPES)
def test_matmul_lowers_for_h200(scheme, m, k, n):
    [call] = triton_calls(_lower_matmul(scheme, m, k, n))
    weight = f"tensor<{k}x{n}xi8>" if scheme == "int8" else f"tensor<{k // 2}x{n}xui8>"
    assert weight in call["operand_types"], "the quantized weight must reach the kernel as stored (no dequantize)"
    assert "tt.dot" in call["module"] and "inputPrecision = tf32" not in call["module"]
    config = qm.choose_config(m, k, n, scheme, 128 if scheme == "int4" else None)
    assert (call["num_warps"], call["num_stages"]) == (config.num_warps, config.num_stages)


VALUE_AVALS = {"int8": ("i8", jnp.int8), "int4": ("ui8", jnp.uint8), "fp8": ("f8E4M3FN", jnp.float8_e4m3fn)}


def _lower_variant(kind, m, k, n, group, zero_point, act_order=False):
    """The kernel variant as the model calls it: act-order gathers x's columns first (an XLA gather)."""
    rows = k // 2 if kind == "int4" else k
    values = jax.ShapeDtypeStruct((rows, n), VALUE_AVALS[kind][1])
    scales = jax.ShapeDtypeStruct((n,) if group is None else (k // group, n), jnp.float32)
    extra = (jax.ShapeDtypeStruct(scales.shape, jnp.bfloat16),) if zero_point else ()
    perm = (_i32(k),) if act_order else ()

    def fn(x, values, scales, *rest):
        if act_order:
            x, rest = gather_columns(x, rest[-1]), rest[:-1]
        return qm.quant_matmul(x, values, scales, *rest, scheme=kind, out_dtype=jnp.bfloat16)
    return lower_for_h200(fn, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), values, scales, *extra, *perm)


VARIANTS = [("int4", 128, True, False), ("int4", 128, True, True), ("int4", None, False, False),
            ("int8", 128, True, False), ("fp8", None, False, False), ("fp8", 128, False, False)]


@pytest.mark.parametrize("kind, group, zero_point, act_order", VARIANTS)
@pytest.mark.parametrize("m", [1, 256])
def test_matmul_variants_lower_for_h200(kind, group, zero_point, act_order, m):
    k, n = 4096, 14336
    [call] = triton_calls(_lower_variant(kind, m, k, n, group, zero_point, act_order))
    rows = k // 2 if kind == "int4" else k
    assert f"tensor<{rows}x{n}x{VALUE_AVALS[kind][0]}>" in call["operand_types"], "weights reach the kernel as stored"
    scales = f"tensor<{n}xf32>" if group is None else f"tensor<{k // group}x{n}xf32>"
    assert scales in call["operand_types"]
    assert (scales.replace("f32", "bf16") in call["operand_types"]) == zero_point
    assert "tt.dot" in call["module"] and "inputPrecision = tf32" not in call["module"]


@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_attention_over_quantized_cache_lowers_for_h200(cache_dtype, kernel):
    call = triton_calls(_lower_quantized_attention(kernel, cache_dtype))[0]
    pool = f"tensor<4x8x2048x16x128x{'i8' if cache_dtype == jnp.int8 else 'f8E4M3FN'}>"
    assert call["operand_types"].count(pool) == 2
    assert call["operand_types"].count("tensor<4x8x2048x16xf32>") == (2 if cache_dtype == jnp.int8 else 0)


def _lower_quantized_attention(kernel, cache_dtype, rows=64):
    pool = _pool(8, 16, 128, cache_dtype)
    scale_pool = jax.ShapeDtypeStruct(pool.shape[:-1], jnp.float32)
    scales = (scale_pool, scale_pool) if cache_dtype == jnp.int8 else ()
    q = jax.ShapeDtypeStruct((rows, 32, 128), jnp.bfloat16)
    if kernel == "decode":
        def fn(q, ck, cv, layer, tables, lens, *s):
            return pa.paged_attention(q, ck, cv, layer, tables, lens, scale=0.1, **_scale_kwargs(s))
        return lower_for_h200(fn, q, pool, pool, _i32(), _i32(rows, 128), _i32(rows), *scales)

    def fn(q, ck, cv, layer, tables, lens, query_start, *s):
        return rpa.ragged_paged_attention(q, ck, cv, layer, tables, lens, query_start, scale=0.1, **_scale_kwargs(s))
    return lower_for_h200(fn, q, pool, pool, _i32(), _i32(4, 128), _i32(4), _i32(5), *scales)


def _scale_kwargs(scales):
    return dict(zip(("k_scale", "v_scale"), scales))


SM90_CASES = {  # name -> lowering
    "w8a16_m16": lambda: _lower_matmul("int8", 16, 14336, 4096),
    "w8a16_m256": lambda: _lower_matmul("int8", 256, 4096, 14336),
    "w4a16_m16": lambda: _lower_matmul("int4", 16, 14336, 4096),
    "w4a16_m256": lambda: _lower_matmul("int4", 256, 4096, 14336),
    "w4a16_zp_g128_m16": lambda: _lower_variant("int4", 16, 14336, 4096, 128, True),
    "w4a16_zp_g128_m256": lambda: _lower_variant("int4", 256, 4096, 14336, 128, True),
    "w8a16_zp_g128_m16": lambda: _lower_variant("int8", 16, 14336, 4096, 128, True),
    "wfp8a16_m16": lambda: _lower_variant("fp8", 16, 14336, 4096, None, False),
    "wfp8a16_g128_m256": lambda: _lower_variant("fp8", 256, 4096, 14336, 128, False),
    "decode_int8_kv": lambda: _lower_quantized_attention("decode", jnp.int8),
    "decode_fp8_kv": lambda: _lower_quantized_attention("decode", jnp.float8_e4m3fn),
}


@pytest.mark.parametrize("name", SM90_CASES)
def test_triton_compiles_for_sm90(name, tmp_path):
    """Triton IR -> cubin for sm_90: pipelined loads, tensor-core dots, shared memory within a block's limit,
    no register spills."""
    triton = pytest.importorskip("triton")
    from pathlib import Path
    from triton.backends.compiler import GPUTarget
    [call] = triton_calls(SM90_CASES[name]())
    source = tmp_path / f"{name}.ttir"
    source.write_text(call["triton_ir"])
    kernel = triton.compile(str(source), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=call["num_warps"], num_stages=call["num_stages"]))
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SM90_SHARED_MEMORY
    assert "cp.async" in ptx and "mma" in ptx
    assert _ptxas_spill_bytes(Path(triton.__file__).parent, ptx, tmp_path) == 0

"""Quantization schemes (jaxserve.quant): the stored format byte for byte, error bounds, layouts, byte counts."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.kv.cache import KVCache
from jaxserve.models.llama import abstract_model, weight_specs
from jaxserve.quant import kv, schemes
from jaxserve.quant.memory import kv_bytes_per_token, weight_bytes, weight_bytes_per_scheme
from jaxserve.quant.model import quantized_config

TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
DEMO_SHAPED = dataclasses.replace(TINY, vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4,
                                  num_heads=8, num_kv_heads=4, head_dim=32, tie_word_embeddings=True)
LLAMA3_8B = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


def test_int4_packing_is_two_nibbles_per_byte_low_first_offset_by_eight():
    q = jnp.array([[-8, 7], [7, -1], [0, 3], [-7, 0]])  # [K=4, N=2]
    packed = np.asarray(schemes.pack_int4(q))
    # byte [r, n] = (q[2r, n] + 8) | (q[2r + 1, n] + 8) << 4
    assert packed.dtype == np.uint8
    assert packed.tolist() == [[0x0 | 0xF << 4, 0xF | 0x7 << 4], [0x8 | 0x1 << 4, 0xB | 0x8 << 4]]
    np.testing.assert_array_equal(schemes.unpack_int4(jnp.asarray(packed)), q)


def test_int4_pairs_run_along_the_last_contraction_dim():
    """wo [heads, head_dim, E] (contract 2): byte [h, r, e] holds head_dim rows 2r (low) and 2r + 1 (high)."""
    rng = np.random.default_rng(0)
    q = rng.integers(-7, 8, (4, 32, 64))
    q[0, 0, :] = 7  # every column's max |q| is 7, so the scale is exactly 1 and quantization is exact
    values, scales = schemes.quantize(q.astype(np.float32), 2, "int4")
    assert values.shape == (4, 16, 64) and scales.shape == (1, 64)  # K = 4 x 32 = 128: one group
    np.testing.assert_array_equal(scales, 1.0)
    np.testing.assert_array_equal(np.asarray(values) & 15, q[:, 0::2] + 8)
    np.testing.assert_array_equal(np.asarray(values) >> 4, q[:, 1::2] + 8)


@pytest.mark.parametrize("k, group", [(4096, 128), (14336, 128), (64, 64), (704, 64), (96, 32)])
def test_group_size_is_128_or_the_largest_power_of_two_dividing_k(k, group):
    assert schemes.group_size(k) == group


def test_group_size_below_32_is_refused():
    with pytest.raises(schemes.QuantizationError, match="divisible by 32"):
        schemes.group_size(48)


@pytest.mark.parametrize("scheme, qmax", [("int8", 127), ("int4", 7)])
def test_round_trip_error_is_at_most_half_a_step_inside_the_clip_range(scheme, qmax):
    """Every element the scale can represent is within half a step; int8 represents its channel's max, int4's
    clip search picks a scale between 0.7 and 1 times its group's absmax scale."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 3, 32)).astype(np.float32) * rng.uniform(0.1, 10, (1, 3, 32))
    values, scales = schemes.quantize(w, 1, scheme)
    back = np.asarray(schemes.dequantize(values, scales, 1, scheme))
    g = 256 if scheme == "int8" else 128
    step = np.repeat(np.asarray(scales).reshape(-1, 1, 3, 32), g, axis=1).reshape(w.shape)
    amax_step = np.repeat(np.abs(w.reshape(256 // g, g, 3, 32)).max(axis=1, keepdims=True) / qmax, g, 1)
    inside = np.abs(w) <= qmax * step * (1 + 1e-6)
    assert np.all(np.abs(back - w)[inside] <= 0.5 * step[inside] * (1 + 1e-6))
    assert np.all(step <= amax_step.reshape(w.shape) * (1 + 1e-6))
    assert np.all(step >= min(schemes.INT4_CLIP_RATIOS) * amax_step.reshape(w.shape) * (1 - 1e-6))
    assert inside.all() or scheme == "int4"


def test_int4_clip_search_never_loses_to_plain_absmax():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((512, 64)).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 8  # outliers make clipping worthwhile
    values, scales = schemes.quantize(w, 1, "int4")
    searched = np.square(np.asarray(schemes.dequantize(values, scales, 1, "int4")) - w).reshape(4, 128, 64).sum(1)
    absmax = np.abs(w.reshape(4, 128, 64)).max(axis=1, keepdims=True) / 7
    plain = np.square(np.clip(np.round(w.reshape(4, 128, 64) / absmax), -7, 7) * absmax - w.reshape(4, 128, 64))
    assert np.all(searched <= plain.sum(1) * (1 + 1e-5))
    assert searched.sum() < 0.95 * plain.sum()


def test_zero_channels_quantize_to_zero_without_nans():
    w = np.zeros((128, 4), np.float32)
    w[:, 1] = 1.0
    for scheme in schemes.SCHEMES:
        values, scales = schemes.quantize(w, 1, scheme)
        np.testing.assert_array_equal(schemes.dequantize(values, scales, 1, scheme), w)


@pytest.mark.parametrize("scheme", schemes.SCHEMES)
def test_xla_matmul_equals_matmul_with_the_dequantized_weight(scheme):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 96)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    values, scales = schemes.quantize(w, 1, scheme)
    expected = x @ schemes.dequantize(values, scales, 1, scheme)
    got = schemes.xla_matmul(x, *schemes.matrix(values, scales, 1, scheme), scheme)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scheme", schemes.SCHEMES)
@pytest.mark.parametrize("lm_head", [None, "int8"])
def test_layouts_match_the_arrays_a_quantized_model_holds(scheme, lm_head):
    cfg = quantized_config(TINY, scheme, lm_head)
    state = nnx.state(abstract_model(cfg, jnp.float32), nnx.Param)
    leaves = jax.tree.leaves(state)
    assert sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in leaves) == weight_bytes(cfg, "float32")
    wq = state["layers"]["wq"]
    dtype = jnp.int8 if scheme == "int8" else jnp.uint8
    assert wq["values"].get_value().dtype == dtype and wq["scales"].get_value().dtype == jnp.float32
    assert wq["scales"].get_metadata()["keep_dtype"]
    assert isinstance(state["lm_head"], nnx.Variable) == (lm_head is None)
    assert state["embed"].get_value().dtype == jnp.float32  # embeddings and norms stay float
    assert state["layers"]["attn_norm"].get_value().dtype == jnp.float32


def test_weight_bytes_per_scheme_for_llama3_8b():
    sizes = weight_bytes_per_scheme(LLAMA3_8B, "bfloat16")
    assert sizes["bfloat16"] == 2 * LLAMA3_8B.num_params()
    embed_and_head = 2 * 2 * 128256 * 4096  # stay bfloat16
    projections = LLAMA3_8B.num_params() - 2 * 128256 * 4096 - (2 * 32 + 1) * 4096
    assert sizes["int8"] - embed_and_head == pytest.approx(projections, rel=0.01)  # + per-channel scales
    assert sizes["int4"] - embed_and_head == pytest.approx(projections / 2 * (1 + 8 / 128), rel=0.01)


def test_demo_shaped_model_takes_both_schemes_and_a_tied_head_stays_float():
    assert set(weight_bytes_per_scheme(DEMO_SHAPED)) == {"bfloat16", "int8", "int4"}
    assert schemes.layout((4, 704, 256), ("layers", "mlp", "embed"), 1, "int4", 1).scales_shape == (4, 11, 256)
    with pytest.raises(schemes.QuantizationError, match="ties its LM head"):
        quantized_config(DEMO_SHAPED, "int8", "int8")


def test_a_model_int4_cannot_take_is_refused_with_advice():
    odd = dataclasses.replace(TINY, intermediate_size=120)  # w_down contracts 120 = 8 x 15
    with pytest.raises(schemes.QuantizationError, match="int8"):
        quantized_config(odd, "int4")
    assert quantized_config(odd, "int8").quantization == "int8"


@pytest.mark.parametrize("name, per_head", [("auto", 16 * 4), ("float32", 16 * 4), ("bfloat16", 16 * 2),
                                            ("int8", 16 + 4), ("fp8", 16)])
def test_kv_bytes_per_token_count_scales(name, per_head):
    assert kv_bytes_per_token(TINY, name, "float32") == 2 * TINY.num_layers * TINY.num_kv_heads * per_head
    dtype = kv.kv_storage_dtype(name, jnp.float32)
    cache = KVCache.zeros(TINY.num_layers, TINY.num_kv_heads, 3, 8, TINY.head_dim, dtype)
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
    assert cache_bytes == 3 * 8 * kv_bytes_per_token(TINY, name, "float32")


def test_kv_int8_round_trip_is_within_half_a_step_per_token_and_head():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((7, 2, 64)) * 5, jnp.float32)
    values, scale = kv.quantize_kv(x, jnp.int8)
    assert values.dtype == jnp.int8 and scale.shape == (7, 2)
    err = jnp.abs(kv.dequantize_kv(values, scale) - x)
    assert bool(jnp.all(err <= 0.5 * jnp.abs(x).max(axis=-1, keepdims=True) / 127 * (1 + 1e-6)))


def test_kv_fp8_saturates_instead_of_overflowing():
    values, scale = kv.quantize_kv(jnp.array([1e4, -1e4, 0.3]), jnp.float8_e4m3fn)
    assert scale is None
    np.testing.assert_allclose(values.astype(jnp.float32), [448, -448, 0.3], rtol=0.07)


def test_weight_specs_contract_dims_lead_every_quantized_weight():
    """dense() views a quantized weight as [K, N] by a free reshape: contraction dims must come first."""
    for path, spec in weight_specs(TINY).items():
        if spec.contract:
            assert spec.axes[1 if path.startswith("layers/") else 0] in ("embed", "heads", "mlp"), path


# ---------------------------------------------------------------------------------------------- imported formats

@pytest.mark.parametrize("name, fmt", [
    ("int8", schemes.Format("int8", None)), ("int4", schemes.Format("int4", schemes.AUTO_GROUP)),
    ("fp8", schemes.Format("fp8", None)), ("int4-g128-zp-act", schemes.Format("int4", 128, True, True)),
    ("int4-ch", schemes.Format("int4", None)), ("int8-g64-zp", schemes.Format("int8", 64, True)),
    ("int8-ch-zp", schemes.Format("int8", None, True)), ("fp8-g128", schemes.Format("fp8", 128))])
def test_scheme_names_parse_and_print_back(name, fmt):
    assert schemes.parse(name) == fmt and fmt.name == name


@pytest.mark.parametrize("bad", ["int3", "int4-g24", "fp8-zp", "int8-ch-act", "int4-g32-zp-zp", "int4-x", "int4-zp",
                                 ""])
def test_scheme_names_jaxserve_cannot_store_are_refused(bad):
    with pytest.raises(schemes.QuantizationError, match="scheme"):
        schemes.parse(bad)


IMPORTED = ["int4-g32-zp", "int8-g32-zp", "int4-ch", "int4-ch-zp", "int8-ch-zp", "fp8", "fp8-g32",
            "int4-g32-zp-act", "int8-g64"]


@pytest.mark.parametrize("scheme", IMPORTED)
def test_imported_formats_round_trip_within_their_step_and_match_their_layout(scheme):
    fmt = schemes.parse(scheme)
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((4, 32, 48)) + rng.uniform(-1, 1, (1, 1, 48))).astype(np.float32)  # contract 2
    arrays = schemes.quantize_arrays(w, 2, scheme)
    layout = schemes.layout(w.shape, ("heads", "head_dim", "embed"), 2, scheme)
    assert {k: (v.shape, jnp.dtype(v.dtype)) for k, v in arrays.items()} == layout.arrays()
    assert layout.nbytes == sum(np.asarray(v).nbytes for v in arrays.values())
    back = np.asarray(schemes.dequantize(arrays["values"], arrays["scales"], 2, scheme, zeros=arrays.get("zeros"),
                                         perm=arrays.get("perm")))
    step = np.asarray(arrays["scales"], np.float32).reshape(-1, 48).max()
    if fmt.kind == "fp8":
        np.testing.assert_allclose(back, w, rtol=2 ** -4, atol=step * 2 ** -9)
    elif fmt.kind == "int4" and not fmt.zero_point:  # symmetric int4 clips up to 30% of a group's range
        assert np.abs(back - w).max() <= 0.5 * step + 0.3 * np.abs(w).max()
    else:
        assert np.abs(back - w).max() <= 0.5 * step * (1 + 1e-5)
    if fmt.act_order:
        assert sorted(np.asarray(arrays["perm"]).tolist()) == list(range(4 * 32))


def test_zero_points_reach_the_asymmetric_range():
    """An all-positive group uses all 16 levels (zero at the bottom), a symmetric one only 15."""
    w = np.linspace(0.0, 1.5, 64, dtype=np.float32).reshape(64, 1) * np.ones((1, 16), np.float32)
    arrays = schemes.quantize_arrays(w, 1, "int4-g32-zp")
    values = np.asarray(schemes.unpack_int4(arrays["values"]))
    assert values.min() == -8 and values.max() == 7
    np.testing.assert_array_equal(np.asarray(arrays["zeros"], np.float32), -8)

"""Tiny quantized Hugging Face checkpoints for the import tests, packed by an independent numpy implementation of
each format's published layout (not jaxserve's code):

    GPTQ   AutoGPTQ's QuantLinear.pack: qweight [K / p, N] packed along K, qzeros [K / G, N / p] along N, value j
           of a word at bits b*j; the v1 format stores zero - 1; g_idx[k] is row k's group (act-order: GPTQ's
           column order, each group G rows); scales float16; W = (q - zero[g_idx]) * scale[g_idx] in float16
    AWQ    AutoAWQ's WQLinear_GEMM: qweight [K, N / 8] and qzeros [K / G, N / 8] packed along N in the order
           0 2 4 6 1 3 5 7; scales float16; W = (q - zero) * scale in float16
    compressed-tensors pack-quantized: weight_packed [N, K * b / 32] along K, weight_zero_point [N * b / 32, K / G]
           along N, values stored + 2^(b-1); weight_scale bfloat16 [N, K / G | 1]; W = (q - zp) * scale in bfloat16
    FP8    e4m3 weight [N, K]; HF fp8: weight_scale_inv float32 [N / bn, K / bk] blocks, W = w * s in float32;
           compressed-tensors float-quantized per channel: weight_scale bfloat16 [N, 1], W = w * s in bfloat16

Each packer takes a float32 Linear weight [N, K] and returns (tensors by suffix, reference W [N, K] in the
format's dequantized dtype). `write_checkpoint` replaces a float fixture's projections with them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
FP8_MAX = 448.0


def _pack_along_rows(u: np.ndarray, bits: int) -> np.ndarray:
    """[R, C] unsigned -> int32 [ceil(R * bits / 32), C]: rows j, j + p, ... of a word at bits*j."""
    per = 32 // bits
    rows = -(-u.shape[0] // per) * per
    u = np.pad(u.astype(np.uint32), ((0, rows - u.shape[0]), (0, 0)))
    out = np.zeros((rows // per, u.shape[1]), np.uint32)
    for j in range(per):
        out |= u[j::per] << np.uint32(bits * j)
    return out.view(np.int32)


def _pack_along_cols(u: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[R, C] unsigned -> int32 [R, ceil(C * bits / 32)]; value j of word c is column c*p + order[j]."""
    return _pack_along_rows(_interleave(u, 32 // bits, order).T, bits).T.copy()


def _interleave(u: np.ndarray, per: int, order) -> np.ndarray:
    if order is None:
        return u
    cols = u.reshape(u.shape[0], -1, per)
    return cols[:, :, list(order)].reshape(u.shape)


def _minmax(cols: np.ndarray, levels: int, sym: bool):
    """Per row of [rows, n]: (scale, zero) in GPTQ's min-max style (zero in 0..levels)."""
    low, high = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
    if sym:
        high = np.maximum(-low, high)
        low = -high
    scale = np.where(high > low, (high - low) / levels, 1.0)
    zero = np.full_like(scale, (levels + 1) // 2) if sym else np.round(-low / scale)
    return scale, zero


def gptq(w, bits=4, group=32, sym=True, desc_act=False, v1=True, rng=None):
    n, k = w.shape
    g = k if group is None else group
    levels = 2 ** bits - 1
    g_idx = np.arange(k) // g
    if desc_act:
        order = rng.permutation(k)  # GPTQ's column order (by Hessian diagonal); groups follow it
        g_idx = np.empty(k, np.int64)
        g_idx[order] = np.arange(k) // g
    scales = np.zeros((k // g, n), np.float16)
    zeros = np.zeros((k // g, n), np.int64)
    for j in range(k // g):
        s, z = _minmax(w[:, g_idx == j], levels, sym)
        scales[j], zeros[j] = s.astype(np.float16), z
    s_row, z_row = scales[g_idx].T.astype(np.float32), zeros[g_idx].T  # [N, K]
    q = np.clip(np.round(w / s_row) + z_row, 0, levels).astype(np.int64)
    stored_zeros = (zeros - 1) & levels if v1 else zeros
    read_zeros = stored_zeros + 1 if v1 else stored_zeros  # what a GPTQ reader subtracts
    reference = ((q - read_zeros[g_idx].T).astype(np.float16) * scales[g_idx].T).astype(np.float16)
    tensors = {"qweight": _pack_along_rows(q.T, bits), "qzeros": _pack_along_cols(stored_zeros, bits),
               "scales": scales, "g_idx": g_idx.astype(np.int32)}
    return tensors, reference


def awq(w, group=32):
    n, k = w.shape
    scales = np.zeros((k // group, n), np.float16)
    zeros = np.zeros((k // group, n), np.int64)
    for j in range(k // group):
        s, z = _minmax(w[:, j * group:(j + 1) * group], 15, sym=False)
        scales[j], zeros[j] = s.astype(np.float16), z
    s_row, z_row = np.repeat(scales, group, axis=0).T.astype(np.float32), np.repeat(zeros, group, axis=0).T
    q = np.clip(np.round(w / s_row) + z_row, 0, 15).astype(np.int64)
    reference = ((q - z_row).astype(np.float16) * np.repeat(scales, group, axis=0).T).astype(np.float16)
    tensors = {"qweight": _pack_along_cols(q.T, 4, AWQ_ORDER), "qzeros": _pack_along_cols(zeros, 4, AWQ_ORDER),
               "scales": scales}
    return tensors, reference


def compressed_pack(w, bits=4, group=32, symmetric=True):
    n, k = w.shape
    g = k if group is None else group
    offset = 1 << (bits - 1)
    blocks = w.reshape(n, k // g, g)
    if symmetric:
        scale = np.abs(blocks).max(axis=2) / (offset - 0.5)
        zp = np.zeros(scale.shape, np.int64)
    else:
        low, high = np.minimum(blocks.min(axis=2), 0), np.maximum(blocks.max(axis=2), 0)
        scale = (high - low) / (2 * offset - 1)
        zp = np.clip(np.round(-offset - low / scale), -offset, offset - 1).astype(np.int64)
    scale = np.where(scale > 0, scale, 1.0).astype(ml_dtypes.bfloat16)  # [N, K / G]
    s_col = np.repeat(scale.astype(np.float32), g, axis=1)
    zp_col = np.repeat(zp, g, axis=1)
    q = np.clip(np.round(w / s_col) + zp_col, -offset, offset - 1).astype(np.int64)
    reference = (q - zp_col).astype(ml_dtypes.bfloat16) * np.repeat(scale, g, axis=1)
    tensors = {"weight_packed": _pack_along_cols(q + offset, bits), "weight_scale": scale,
               "weight_shape": np.array([n, k], np.int64)}
    if not symmetric:
        tensors["weight_zero_point"] = _pack_along_rows(zp + offset, bits)
    return tensors, reference


def fp8_blocks(w, block=(16, 32)):
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        for c in range(cols):
            amax = np.abs(w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk]).max()
            scale[r, c] = amax / FP8_MAX if amax > 0 else 1.0
    s_full = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[:n, :k]
    q = (w / s_full).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.astype(np.float32) * s_full


def fp8_channel(w):
    scale = (np.abs(w).max(axis=1, keepdims=True) / FP8_MAX).astype(ml_dtypes.bfloat16)
    q = (w / scale.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.astype(ml_dtypes.bfloat16) * scale


def fp8_tensor(w):
    scale = np.float32(np.abs(w).max() / FP8_MAX)
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": q, "weight_scale": np.array(scale), "input_scale": np.array(np.float32(0.02))}, \
        q.astype(np.float32) * scale


def write_checkpoint(float_dir: Path, out_dir: Path, packer, quantization_config: dict | None,
                     quantize_config_file: dict | None = None, lm_head: bool = False) -> dict[str, np.ndarray]:
    """A copy of the float fixture `float_dir` with every decoder projection (and the LM head if `lm_head`)
    replaced by packer(weight) tensors; returns the reference dequantized weights [N, K] by HF prefix."""
    shutil.copytree(float_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if quantize_config_file is not None:
        (out_dir / "quantize_config.json").write_text(json.dumps(quantize_config_file))
    tensors = load_file(out_dir / "model.safetensors")
    prefixes = [f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in PROJECTIONS]
    references = {}
    for prefix in prefixes + (["lm_head"] if lm_head else []):
        packed, references[prefix] = packer(tensors.pop(f"{prefix}.weight").astype(np.float32))
        tensors.update({f"{prefix}.{suffix}": value for suffix, value in packed.items()})
    save_file(tensors, out_dir / "model.safetensors")
    return references

"""Weight and KV-cache bytes per quantization scheme, from the config alone (nothing is allocated).

The engine's start-up log and `jaxserve estimate` print these; tests check them against real arrays.

    weight_bytes(cfg, "bfloat16")            the model as cfg declares it (cfg.quantization, cfg.lm_head_quantization)
    weight_bytes_per_scheme(cfg, "bfloat16") {"bfloat16": ..., "int8": ..., "int4": ...} for the same model
    kv_bytes_per_token(cfg, "int8", "bfloat16")   K + V bytes of one token over all layers, scales included
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.llama import weight_scheme, weight_specs
from jaxserve.quant import kv, schemes


def weight_bytes(cfg: ModelConfig, dtype: str = "bfloat16", stored: Mapping[str, str] | None = None) -> int:
    """Bytes of every weight: float ones in `dtype` (or in stored[path], for those kept in another:
    jaxserve.models.llama.kept_in_storage), quantized ones as values + float32 scales."""
    total = 0
    stored = stored or {}
    for path, spec in weight_specs(cfg).items():
        scheme = weight_scheme(path, spec, cfg)
        if scheme is None:
            total += math.prod(spec.shape) * jnp.dtype(stored.get(path, dtype)).itemsize
        else:
            stacked = 1 if path.startswith("layers/") else 0
            total += schemes.layout(spec.shape, spec.axes, spec.contract, scheme, stacked).nbytes
    return total


def weight_bytes_per_scheme(cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, int]:
    """The same model unquantized (keyed by `dtype`) and under each scheme that its shapes allow (the LM head
    as cfg has it)."""
    out = {dtype: weight_bytes(dataclasses.replace(cfg, quantization=None, lm_head_quantization=None), dtype)}
    for scheme in schemes.SCHEMES:
        try:
            out[scheme] = weight_bytes(dataclasses.replace(cfg, quantization=scheme), dtype)
        except schemes.QuantizationError:
            continue
    return out


def kv_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str = "auto", model_dtype: str = "bfloat16") -> int:
    """K and V bytes of one token over all layers and KV heads (int8: + one float32 scale per head each). The one
    formula: the engine and `jaxserve estimate` call it with ("auto", the cache's resolved storage dtype)."""
    dtype = kv.kv_storage_dtype(kv_cache_dtype, model_dtype)
    per_head = cfg.head_dim * dtype.itemsize + (kv.SCALE_BYTES if kv.has_scales(dtype) else 0)
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head

"""Quantization: weight-only int8 / int4 / fp8 formats (`schemes`), quantized KV-cache storage (`kv`), whole-model
quantization (`model`) and weight/KV byte accounting (`memory`).

`schemes` and `kv` are pure jnp and import nothing of the model; `model` and `memory` import the model
declarations and are imported by name (`from jaxserve.quant.model import quantize_model`).
"""

from jaxserve.quant.kv import dequantize_kv, has_scales, kv_storage_dtype, quantize_kv
from jaxserve.quant.schemes import (KINDS, SCHEMES, Format, QuantizationError, QuantizedLayout, dequantize,
                                    group_size, layout, pack_int4, parse, quantize, unpack_int4, xla_matmul)

__all__ = ["KINDS", "SCHEMES", "Format", "QuantizationError", "QuantizedLayout", "dequantize", "group_size",
           "layout", "pack_int4", "parse", "quantize", "unpack_int4", "xla_matmul", "dequantize_kv", "has_scales",
           "kv_storage_dtype", "quantize_kv"]

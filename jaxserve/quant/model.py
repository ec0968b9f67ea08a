"""Quantizing a whole model: which weights, and the parameter tree a quantized Llama expects.

    quantize_model(model, "int8")       a float Llama -> the same model with int8 projections (on device, one jit)
    quantized_config(cfg, "int4")       the ModelConfig that records the scheme (saved in jaxserve.json)
    quantize_weight(w, spec, scheme)    one float weight (stacked or one layer) -> {"values", "scales", ...}

`jaxserve convert --quantize` uses quantize_weight per Hugging Face tensor (one layer at a time), and
quantize_model serves tests, benchmarks and random models; both reach the same arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.llama import Llama, WeightSpec, abstract_model, weight_scheme, weight_specs
from jaxserve.quant import schemes


def quantized_config(cfg: ModelConfig, scheme: str | None, lm_head: str | None = None) -> ModelConfig:
    """cfg with the schemes recorded; checks every weight can take them (group sizes, packing, a tied head)."""
    schemes.check_scheme(scheme)
    schemes.check_scheme(lm_head)
    if lm_head is not None and cfg.tie_word_embeddings:
        raise schemes.QuantizationError("this model ties its LM head to the embedding, which stays float; "
                                        "leave the LM head unquantized")
    out = dataclasses.replace(cfg, quantization=scheme, lm_head_quantization=lm_head)
    for path, spec in weight_specs(out).items():
        chosen = weight_scheme(path, spec, out)
        if chosen is not None:
            schemes.layout(spec.shape, spec.axes, spec.contract, chosen, stacked=1 if path.startswith("layers/") else 0)
    return out


def quantize_weight(w: jax.Array, spec: WeightSpec, scheme: str, stacked: int) -> dict[str, jax.Array]:
    """A float weight whose first `stacked` dims are layers -> {"values", "scales"[, "zeros"][, "perm"]}
    (checkpoint leaf names)."""
    return schemes.quantize_stacked(w, spec.contract, scheme, stacked)


def quantize_params(params: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """A float model's nested parameter dict -> the nested dict of the quantized model `cfg` declares."""
    out = jax.tree.map(lambda x: x, params)  # a fresh tree of the same leaves
    for path, spec in weight_specs(cfg).items():
        scheme = weight_scheme(path, spec, cfg)
        if scheme is None:
            continue
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node[p]
        node[leaf] = quantize_weight(node[leaf], spec, scheme, stacked=len(parents))
    return out


def quantize_model(model: Llama, scheme: str | None, lm_head: str | None = None) -> Llama:
    """The model with its decoder projections (and optionally its untied LM head) quantized; embeddings and
    norms keep their dtype. Runs as one jit on the model's device."""
    cfg = quantized_config(model.cfg, scheme, lm_head)
    graphdef, state = nnx.split(abstract_model(cfg, model.dtype), nnx.Param)
    float_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.replace_by_pure_dict(state, jax.jit(functools.partial(quantize_params, cfg=cfg))(float_params))
    return nnx.merge(graphdef, state)

"""The Hugging Face → jaxserve weight map: one table for every supported Llama-family checkpoint.

Each row names an HF tensor (`{layer}` stands for the layer index), the jaxserve weight it fills (a path of
`jaxserve.models.llama.weight_specs`) and how its layout changes. A row whose weight the config does not have
(biases, q/k norms, an untied head) is skipped, so Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3 share the table.

    HF Linear weight  [out, in]            jaxserve  [in, ...out]   (einsum "...te,ehd->...thd")
    q_proj            [heads * head_dim, E]   ->   wq [E, heads, head_dim]
    o_proj            [E, heads * head_dim]   ->   wo [heads, head_dim, E]
    q_proj.bias       [heads * head_dim]      ->   bq [heads, head_dim]

RoPE is rotate-half in both, so q and k need no permutation.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.llama import weight_specs

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Transform:
    """How one HF tensor becomes one (per-layer) jaxserve weight of shape `shape`."""

    name: str
    hf_shape: Callable[[Shape], Shape]  # the HF shape implied by our shape
    apply: Callable[[np.ndarray, Shape], np.ndarray]


COPY = Transform("copy", lambda s: s, lambda a, s: a)
TRANSPOSE = Transform("transpose", lambda s: s[::-1], lambda a, s: a.T)
TO_HEADS = Transform(  # [heads * head_dim, E] -> [E, heads, head_dim]
    "to_heads", lambda s: (s[1] * s[2], s[0]), lambda a, s: a.T.reshape(s))
FROM_HEADS = Transform(  # [E, heads * head_dim] -> [heads, head_dim, E]
    "from_heads", lambda s: (s[2], s[0] * s[1]), lambda a, s: a.T.reshape(s))
SPLIT_HEADS = Transform(  # [heads * head_dim] -> [heads, head_dim]
    "split_heads", lambda s: (s[0] * s[1],), lambda a, s: a.reshape(s))


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    hf_name: str
    path: str
    transform: Transform


LAYER = "model.layers.{layer}"
HF_TENSORS = (
    TensorMapping("model.embed_tokens.weight", "embed", COPY),
    TensorMapping(f"{LAYER}.input_layernorm.weight", "layers/attn_norm", COPY),
    TensorMapping(f"{LAYER}.self_attn.q_proj.weight", "layers/wq", TO_HEADS),
    TensorMapping(f"{LAYER}.self_attn.k_proj.weight", "layers/wk", TO_HEADS),
    TensorMapping(f"{LAYER}.self_attn.v_proj.weight", "layers/wv", TO_HEADS),
    TensorMapping(f"{LAYER}.self_attn.q_proj.bias", "layers/bq", SPLIT_HEADS),
    TensorMapping(f"{LAYER}.self_attn.k_proj.bias", "layers/bk", SPLIT_HEADS),
    TensorMapping(f"{LAYER}.self_attn.v_proj.bias", "layers/bv", SPLIT_HEADS),
    TensorMapping(f"{LAYER}.self_attn.q_norm.weight", "layers/q_norm", COPY),
    TensorMapping(f"{LAYER}.self_attn.k_norm.weight", "layers/k_norm", COPY),
    TensorMapping(f"{LAYER}.self_attn.o_proj.weight", "layers/wo", FROM_HEADS),
    TensorMapping(f"{LAYER}.post_attention_layernorm.weight", "layers/mlp_norm", COPY),
    TensorMapping(f"{LAYER}.mlp.gate_proj.weight", "layers/w_gate", TRANSPOSE),
    TensorMapping(f"{LAYER}.mlp.up_proj.weight", "layers/w_up", TRANSPOSE),
    TensorMapping(f"{LAYER}.mlp.down_proj.weight", "layers/w_down", TRANSPOSE),
    TensorMapping("model.norm.weight", "final_norm", COPY),
    TensorMapping("lm_head.weight", "lm_head", TRANSPOSE),
)


@dataclasses.dataclass(frozen=True)
class IgnoredTensor:
    """An HF tensor that carries nothing the model needs."""

    hf_name: str
    reason: str
    only_if_tied: bool = False


IGNORED_TENSORS = (
    IgnoredTensor(f"{LAYER}.self_attn.rotary_emb.inv_freq", "recomputed from the rope config"),
    IgnoredTensor("model.rotary_emb.inv_freq", "recomputed from the rope config"),
    IgnoredTensor("lm_head.weight", "the head is the embedding when tie_word_embeddings is true",
                  only_if_tied=True),
)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: weight `path`, layer `layer` (None for unstacked weights), in layout `shape`."""

    path: str
    layer: int | None
    transform: Transform
    shape: Shape

    @property
    def hf_shape(self) -> Shape:
        return tuple(self.transform.hf_shape(self.shape))


def expected_tensors(cfg: ModelConfig) -> dict[str, Target]:
    """Every HF tensor a checkpoint with this config must hold, and where it goes."""
    specs = weight_specs(cfg)
    targets: dict[str, Target] = {}
    for row in HF_TENSORS:
        spec = specs.get(row.path)
        if spec is None:
            continue
        if "{layer}" not in row.hf_name:
            targets[row.hf_name] = Target(row.path, None, row.transform, spec.shape)
            continue
        for layer in range(cfg.num_layers):
            targets[row.hf_name.format(layer=layer)] = Target(row.path, layer, row.transform, spec.shape[1:])
    unmapped = set(specs) - {t.path for t in targets.values()}
    assert not unmapped, f"HF_TENSORS has no row for {sorted(unmapped)}"
    return targets


def is_ignored(hf_name: str, cfg: ModelConfig) -> bool:
    return any(_pattern(row.hf_name).fullmatch(hf_name) and (cfg.tie_word_embeddings or not row.only_if_tied)
               for row in IGNORED_TENSORS)


def _pattern(hf_name: str) -> re.Pattern:
    return re.compile(re.escape(hf_name).replace(re.escape("{layer}"), r"\d+"))

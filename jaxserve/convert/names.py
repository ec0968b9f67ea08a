"""The Hugging Face → jaxserve weight maps: one table per family layout (`TABLES`, by ModelConfig.family).

Each row names an HF tensor (`{layer}` stands for the layer index), the jaxserve weight it fills (a path of
`jaxserve.models.llama.weight_specs`) and how its layout changes. A row whose weight the config does not have
(biases, q/k norms, an untied head) is skipped, so Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3 share one table.
A fused HF tensor (Phi-3's qkv_proj and gate_up_proj) is one row with several weights: its rows (dim 0) are cut
in order into each weight's share, then each share is transformed like an unfused tensor. MoE checkpoints keep
one tensor per expert (`{expert}`), each filling its slot of the stacked [layers, experts, ...] weight.

    HF Linear weight  [out, in]            jaxserve  [in, ...out]   (einsum "...te,ehd->...thd")
    q_proj            [heads * head_dim, E]   ->   wq [E, heads, head_dim]
    o_proj            [E, heads * head_dim]   ->   wo [heads, head_dim, E]
    q_proj.bias       [heads * head_dim]      ->   bq [heads, head_dim]

RoPE is rotate-half in both, so q and k need no permutation.
"""

from __future__ import annotations

import dataclasses
import itertools
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
    path: str | tuple[str, ...]  # several: a fused tensor, split along dim 0 into these weights in order
    transform: Transform

    @property
    def paths(self) -> tuple[str, ...]:
        return self.path if isinstance(self.path, tuple) else (self.path,)


LAYER = "model.layers.{layer}"
EMBEDDING = TensorMapping("model.embed_tokens.weight", "embed", COPY)
HEAD = (TensorMapping("model.norm.weight", "final_norm", COPY), TensorMapping("lm_head.weight", "lm_head", TRANSPOSE))
ATTENTION_NORM = TensorMapping(f"{LAYER}.input_layernorm.weight", "layers/attn_norm", COPY)
QKV = (
    TensorMapping(f"{LAYER}.self_attn.q_proj.weight", "layers/wq", TO_HEADS),
    TensorMapping(f"{LAYER}.self_attn.k_proj.weight", "layers/wk", TO_HEADS),
    TensorMapping(f"{LAYER}.self_attn.v_proj.weight", "layers/wv", TO_HEADS),
    TensorMapping(f"{LAYER}.self_attn.q_proj.bias", "layers/bq", SPLIT_HEADS),
    TensorMapping(f"{LAYER}.self_attn.k_proj.bias", "layers/bk", SPLIT_HEADS),
    TensorMapping(f"{LAYER}.self_attn.v_proj.bias", "layers/bv", SPLIT_HEADS),
    TensorMapping(f"{LAYER}.self_attn.q_norm.weight", "layers/q_norm", COPY),
    TensorMapping(f"{LAYER}.self_attn.k_norm.weight", "layers/k_norm", COPY),
)
OUT_PROJ = TensorMapping(f"{LAYER}.self_attn.o_proj.weight", "layers/wo", FROM_HEADS)
GATE_UP = (TensorMapping(f"{LAYER}.mlp.gate_proj.weight", "layers/w_gate", TRANSPOSE),
           TensorMapping(f"{LAYER}.mlp.up_proj.weight", "layers/w_up", TRANSPOSE))
DOWN_PROJ = TensorMapping(f"{LAYER}.mlp.down_proj.weight", "layers/w_down", TRANSPOSE)

LLAMA_TENSORS = (
    EMBEDDING, ATTENTION_NORM, *QKV, OUT_PROJ,
    TensorMapping(f"{LAYER}.post_attention_layernorm.weight", "layers/mlp_norm", COPY),
    *GATE_UP, DOWN_PROJ, *HEAD,
)
HF_TENSORS = LLAMA_TENSORS

PHI3_TENSORS = (  # Llama's layers with q/k/v and gate/up fused
    EMBEDDING, ATTENTION_NORM,
    TensorMapping(f"{LAYER}.self_attn.qkv_proj.weight", ("layers/wq", "layers/wk", "layers/wv"), TO_HEADS),
    OUT_PROJ,
    TensorMapping(f"{LAYER}.post_attention_layernorm.weight", "layers/mlp_norm", COPY),
    TensorMapping(f"{LAYER}.mlp.gate_up_proj.weight", ("layers/w_gate", "layers/w_up"), TRANSPOSE),
    DOWN_PROJ, *HEAD,
)

GEMMA_TENSORS = (  # Gemma 2 and 3: four norms per layer; post_attention_layernorm is the attention output's
    EMBEDDING, ATTENTION_NORM, *QKV, OUT_PROJ,
    TensorMapping(f"{LAYER}.post_attention_layernorm.weight", "layers/attn_post_norm", COPY),
    TensorMapping(f"{LAYER}.pre_feedforward_layernorm.weight", "layers/mlp_norm", COPY),
    TensorMapping(f"{LAYER}.post_feedforward_layernorm.weight", "layers/mlp_post_norm", COPY),
    *GATE_UP, DOWN_PROJ, *HEAD,
)

MIXTRAL_TENSORS = (  # the Hub's names: block_sparse_moe, experts' w1 (gate), w3 (up), w2 (down)
    EMBEDDING, ATTENTION_NORM, *QKV, OUT_PROJ,
    TensorMapping(f"{LAYER}.post_attention_layernorm.weight", "layers/mlp_norm", COPY),
    TensorMapping(f"{LAYER}.block_sparse_moe.gate.weight", "layers/router", TRANSPOSE),
    TensorMapping(f"{LAYER}.block_sparse_moe.experts.{{expert}}.w1.weight", "layers/we_gate", TRANSPOSE),
    TensorMapping(f"{LAYER}.block_sparse_moe.experts.{{expert}}.w3.weight", "layers/we_up", TRANSPOSE),
    TensorMapping(f"{LAYER}.block_sparse_moe.experts.{{expert}}.w2.weight", "layers/we_down", TRANSPOSE),
    *HEAD,
)
QWEN3_MOE_TENSORS = (
    EMBEDDING, ATTENTION_NORM, *QKV, OUT_PROJ,
    TensorMapping(f"{LAYER}.post_attention_layernorm.weight", "layers/mlp_norm", COPY),
    TensorMapping(f"{LAYER}.mlp.gate.weight", "layers/router", TRANSPOSE),  # [experts, E] -> [E, experts]
    TensorMapping(f"{LAYER}.mlp.experts.{{expert}}.gate_proj.weight", "layers/we_gate", TRANSPOSE),
    TensorMapping(f"{LAYER}.mlp.experts.{{expert}}.up_proj.weight", "layers/we_up", TRANSPOSE),
    TensorMapping(f"{LAYER}.mlp.experts.{{expert}}.down_proj.weight", "layers/we_down", TRANSPOSE),
    *HEAD,
)

TABLES = {"llama": LLAMA_TENSORS, "mistral": LLAMA_TENSORS, "qwen2": LLAMA_TENSORS, "qwen3": LLAMA_TENSORS,
          "phi3": PHI3_TENSORS, "gemma2": GEMMA_TENSORS, "gemma3": GEMMA_TENSORS, "mixtral": MIXTRAL_TENSORS,
          "qwen3_moe": QWEN3_MOE_TENSORS}


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
    """Where one HF tensor goes: weight `path`, layer `layer` (None for unstacked weights) and MoE `expert`, in
    layout `shape`. A fused HF tensor has `parts` (one Target per weight, in row order) and no path of its own."""

    path: str | None
    layer: int | None
    transform: Transform
    shape: Shape
    parts: tuple["Target", ...] = ()
    expert: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """The slot of the stored weight this tensor fills: (), (layer,) or (layer, expert)."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)

    @property
    def hf_shape(self) -> Shape:
        if self.parts:
            shapes = [part.hf_shape for part in self.parts]
            return (sum(shape[0] for shape in shapes),) + shapes[0][1:]
        return tuple(self.transform.hf_shape(self.shape))

    def pieces(self, tensor: np.ndarray) -> list[tuple["Target", np.ndarray]]:
        """(target, its weight in jaxserve layout) for each weight this HF tensor fills."""
        if not self.parts:
            return [(self, self.transform.apply(tensor, self.shape))]
        bounds = np.cumsum([0] + [part.hf_shape[0] for part in self.parts])
        return [(part, part.transform.apply(tensor[start:stop], part.shape))
                for part, start, stop in zip(self.parts, bounds[:-1], bounds[1:])]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(part.path for part in self.parts) if self.parts else (self.path,)


def expected_tensors(cfg: ModelConfig) -> dict[str, Target]:
    """Every HF tensor a checkpoint with this config must hold, and where it goes."""
    specs = weight_specs(cfg)
    targets: dict[str, Target] = {}
    for row in TABLES[cfg.family]:
        if any(path not in specs for path in row.paths):
            continue
        layers = [None] if "{layer}" not in row.hf_name else range(cfg.num_layers)
        experts = [None] if "{expert}" not in row.hf_name else range(cfg.num_experts)
        for layer, expert in itertools.product(layers, experts):
            stacked = (layer is not None) + (expert is not None)
            parts = tuple(Target(path, layer, row.transform, specs[path].shape[stacked:], expert=expert)
                          for path in row.paths)
            name = row.hf_name.format(layer=layer, expert=expert)
            targets[name] = parts[0] if len(parts) == 1 else Target(None, layer, row.transform, (), parts)
    unmapped = set(specs) - {path for t in targets.values() for path in t.paths}
    assert not unmapped, f"the {cfg.family} table has no row for {sorted(unmapped)}"
    return targets


def is_ignored(hf_name: str, cfg: ModelConfig) -> bool:
    return any(_pattern(row.hf_name).fullmatch(hf_name) and (cfg.tie_word_embeddings or not row.only_if_tied)
               for row in IGNORED_TENSORS)


def _pattern(hf_name: str) -> re.Pattern:
    return re.compile(re.escape(hf_name).replace(re.escape("{layer}"), r"\d+").replace(re.escape("{expert}"), r"\d+"))

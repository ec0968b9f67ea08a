"""Configuration: the model config (from Hugging Face `config.json` or our `jaxserve.json`) and the engine config.

Everything here is a frozen dataclass. Environment variables are read in this module only (`env_*` helpers).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # older Phi-3 configs; Phi-3's own "yarn" means longrope too (see _phi3)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF layer_types


class ConfigError(ValueError):
    """A model or engine configuration jaxserve cannot use; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from both HF config forms (jaxserve.models.rope computes them).

    type: default | linear | llama3 | yarn | dynamic (NTK) | longrope (Phi-3's "su"). Fields a type does not use
    keep their defaults. `context_len` is the longest context the engine runs the model for: LongRoPE uses its long
    factors when it exceeds `original_max_position_embeddings` (decided once, as vLLM does, so cached keys never
    mix the two sets); None means `max_position_embeddings`."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 8192  # the model's (dynamic NTK, LongRoPE's default attention factor)
    partial_rotary_factor: float = 1.0  # rotate the first head_dim * this dims, pass the rest through (Phi-4-mini)
    attention_factor: float | None = None  # yarn, longrope: cos/sin multiplier; None derives it from `factor`
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek form)
    mscale_all_dim: float | None = None  # yarn (DeepSeek form)
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope, one per rotated frequency
    long_factor: tuple[float, ...] = ()  # longrope
    context_len: int | None = None  # longrope: see the class docstring

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RopeConfig":
        data = dict(data)
        for key in ("short_factor", "long_factor"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. Field names follow Hugging Face where one exists."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer "sliding_attention" | "full_attention"; None: every
    #                                             layer attends with sliding_window (None: full)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own rope (None: every layer uses `rope`)
    hidden_act: str = "silu"  # silu (SwiGLU) | gelu_pytorch_tanh (GeGLU)
    norm_offset: bool = False  # Gemma: RMSNorm multiplies by (1 + weight), in float32
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the model dtype
    sandwich_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs too, before the residual add
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is this ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before the mask
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the output logits
    num_experts: int = 0  # Mixture of Experts: experts per layer, each an intermediate_size gated MLP (0: dense)
    num_experts_per_tok: int = 0  # MoE: experts each token is routed to (top-k of the router's softmax)
    norm_topk_prob: bool = True  # MoE: rescale the top-k routing weights to sum to 1 (Mixtral; Qwen3-MoE's flag)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # dtype the checkpoint's floating-point weights are stored in
    quantization: str | None = None  # None | "int8" | "int4": the decoder layers' projections (jaxserve.quant)
    lm_head_quantization: str | None = None  # None | "int8" | "int4": the untied LM head (embeddings stay float)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: that layer attends to the whole context)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if kind == SLIDING else None for kind in self.layer_types)

    def for_context(self, max_model_len: int) -> "ModelConfig":
        """This config as the engine runs it for contexts up to max_model_len (LongRoPE picks its factors)."""
        rope = dataclasses.replace(self.rope, context_len=max_model_len)
        local = self.local_rope and dataclasses.replace(self.local_rope, context_len=max_model_len)
        return dataclasses.replace(self, rope=rope, local_rope=local)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def num_params(self, active: bool = False) -> int:
        """Parameter count as Hugging Face counts it (tied embeddings once). `active`: a MoE model's parameters
        that one token uses (its num_experts_per_tok experts, not all of them)."""
        e, v, d = self.hidden_size, self.vocab_size, self.head_dim
        attn = e * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * e
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        norms = (4 if self.sandwich_norms else 2) * e + (2 * d if self.qk_norm else 0)
        layer = attn + self.mlp_params(active) + norms
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * layer + e + head

    def mlp_params(self, active: bool = False) -> int:
        """One layer's MLP parameters: the gated MLP, or the router plus all (or, `active`, the routed) experts."""
        gated = 3 * self.hidden_size * self.intermediate_size
        if not self.is_moe:
            return gated
        return self.hidden_size * self.num_experts + gated * (self.num_experts_per_tok if active else self.num_experts)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelConfig":
        data = dict(data)
        data["rope"] = RopeConfig.from_json(data.get("rope", {}))
        if data.get("local_rope") is not None:
            data["local_rope"] = RopeConfig.from_json(data["local_rope"])
        if data.get("layer_types") is not None:
            data["layer_types"] = tuple(data["layer_types"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)

    @classmethod
    def load(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir) / "jaxserve.json"
        if not path.exists():
            raise ConfigError(
                f"{model_dir} is not a jaxserve checkpoint (no jaxserve.json). "
                f"Convert a Hugging Face model first: jaxserve convert HF_DIR OUT_DIR")
        return cls.from_json(json.loads(path.read_text())["model"])


def _rope_from_hf(hf: dict[str, Any], params: dict[str, Any] | None = None) -> RopeConfig:
    """Both forms: `rope_parameters` (transformers >= 5) and top-level `rope_theta` + `rope_scaling` (older).
    `params` is one layer type's entry of a nested `rope_parameters` (Gemma 3)."""
    if params is None:
        params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {rope_type!r} is not supported; jaxserve supports {', '.join(SUPPORTED_ROPE_TYPES)}.")
    max_positions = int(hf.get("max_position_embeddings", 8192))
    original = int(hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_positions)  # Phi-3 keeps it top level, and that one wins (as in transformers)
    factor = params.get("factor")
    if factor is None:  # yarn and longrope derive it from the two lengths
        factor = max_positions / original if rope_type in ("yarn", "longrope") else 1.0
    return RopeConfig(
        theta=float(theta), type=rope_type, factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original, max_position_embeddings=max_positions,
        partial_rotary_factor=float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0),
        attention_factor=_optional_float(params.get("attention_factor")),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_optional_float(params.get("mscale")), mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for v in (value if isinstance(value, list) else [value]):
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


# ---------------------------------------------------------------------------------------------- families
# What each family sets beyond the shared Llama-style fields: one function per family, reading its config.json.

def _llama(hf: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": bool(hf.get("attention_bias", False))}


def _mistral(hf: dict[str, Any]) -> dict[str, Any]:
    return {**_llama(hf), "sliding_window": hf.get("sliding_window")}


def _qwen(hf: dict[str, Any], qkv_bias: bool, qk_norm: bool) -> dict[str, Any]:
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    return {"qkv_bias": qkv_bias or bool(hf.get("attention_bias", False)), "qk_norm": qk_norm,
            "sliding_window": sliding}


def _phi3(hf: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini: Llama layers with fused qkv and gate_up tensors (split by the converter), LongRoPE,
    partial rotary. Older configs call LongRoPE "su" or, for Phi-3 only, "yarn" (transformers reads both so)."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        rope["rope_type"] = "longrope"
    hf = {**hf, "rope_parameters": rope, "rope_scaling": None}
    return {"sliding_window": hf.get("sliding_window"), "rope": _rope_from_hf(hf)}


def _gemma(hf: dict[str, Any], pattern: int) -> dict[str, Any]:
    """Gemma 2 and 3 (text): (1 + w) norms, scaled embeddings, GeGLU, sandwich norms, query_pre_attn_scalar,
    sliding layers every `pattern` - 1 of `pattern` (when config.json lists no layer_types)."""
    layers = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern") or pattern)
    layer_types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown or len(layer_types) != layers:
        raise ConfigError(f"layer_types must list {layers} entries of {SLIDING!r} or {FULL!r}, got {layer_types}.")
    return {"layer_types": tuple(layer_types), "sliding_window": hf.get("sliding_window"), "norm_offset": True,
            "scale_embeddings": True, "sandwich_norms": True,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "query_pre_attn_scalar": _optional_float(hf.get("query_pre_attn_scalar")),
            "attn_logit_softcapping": _optional_float(hf.get("attn_logit_softcapping")),
            "final_logit_softcapping": _optional_float(hf.get("final_logit_softcapping")),
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"}


def _gemma3(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 adds q/k norms and a rope per layer type: global layers keep rope_theta (and any scaling),
    sliding layers use rope_local_base_freq unscaled."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = _rope_from_hf(hf, params.get(FULL) or {}), _rope_from_hf(hf, params.get(SLIDING) or {})
    else:
        full = _rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)})
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)),
                           max_position_embeddings=full.max_position_embeddings,
                           original_max_position_embeddings=full.max_position_embeddings)
    return {**_gemma(hf, pattern=6), "qk_norm": True, "rope": full, "local_rope": local}


def _moe(hf: dict[str, Any], norm_topk_prob: bool | None) -> dict[str, Any]:
    """Mixtral and Qwen3-MoE: every layer's MLP is a routed set of experts (softmax over the router's logits,
    top-k, renormalised when the family does). Layers that keep a dense MLP are refused, with the reason."""
    sparse_step = int(hf.get("decoder_sparse_step") or 1)
    if hf.get("mlp_only_layers") or sparse_step != 1:
        raise ConfigError(f"mlp_only_layers {hf.get('mlp_only_layers')} / decoder_sparse_step {sparse_step}: "
                          f"jaxserve serves MoE models whose every layer is sparse (mlp_only_layers [], "
                          f"decoder_sparse_step 1).")
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError("shared experts (shared_expert_intermediate_size) are not supported; jaxserve serves "
                          "Mixtral and Qwen3-MoE, which have none.")
    # Mixtral's name, then Qwen3-MoE's (transformers 5 writes both families' as num_local_experts)
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ConfigError("a MoE config.json needs num_local_experts (or num_experts); restore it from the model's "
                          "repository.")
    return {"num_experts": int(experts), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob}


def _qwen3_moe(hf: dict[str, Any]) -> dict[str, Any]:
    return {**_qwen(hf, qkv_bias=False, qk_norm=True), **_moe(hf, norm_topk_prob=None),
            "intermediate_size": int(hf["moe_intermediate_size"])}


FAMILY_FIELDS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": lambda hf: _qwen(hf, qkv_bias=True, qk_norm=False),
    "qwen3": lambda hf: _qwen(hf, qkv_bias=False, qk_norm=True),
    "phi3": _phi3,
    "gemma2": lambda hf: _gemma(hf, pattern=2),
    "gemma3": _gemma3,
    "mixtral": lambda hf: {**_mistral(hf), **_moe(hf, norm_topk_prob=True)},
    "qwen3_moe": _qwen3_moe,
}


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None,
                         dtype: str | None = None) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face `config.json` dict (and optionally `generation_config.json`)."""
    archs = hf.get("architectures") or [arch for arch, family in SUPPORTED_ARCHITECTURES.items()
                                        if family == hf.get("model_type")]  # as AutoModelForCausalLM picks
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {archs or hf.get('model_type')!r}: "
                          f"jaxserve supports {supported}.")
    arch = archs[0]
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // heads
    generation = generation or {}
    fields = {"rope": _rope_from_hf(hf), "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
              **FAMILY_FIELDS[SUPPORTED_ARCHITECTURES[arch]](hf)}
    act = fields.get("hidden_act", hf.get("hidden_act", "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"hidden_act {act!r} is not supported; jaxserve supports {', '.join(SUPPORTED_ACTIVATIONS)}.")
    fields["hidden_act"] = act
    sliding = fields.get("sliding_window")
    fields["sliding_window"] = int(sliding) if sliding else None
    fields.setdefault("intermediate_size", int(hf["intermediate_size"]))
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_served_positions(hf, fields["rope"], SUPPORTED_ARCHITECTURES[arch]),
        bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
        eos_token_ids=_eos_ids(generation.get("eos_token_id"), hf.get("eos_token_id")),
        dtype=dtype or _hf_dtype(hf),
        **fields,
    )
    _check_rope(cfg.rope, cfg.head_dim)
    return cfg


def _served_positions(hf: dict[str, Any], rope: RopeConfig, family: str) -> int:
    """The longest context the model serves, by vLLM's rule: linear, dynamic-NTK and YaRN scalings multiply the
    stated length (YaRN: the original one) by their factor; llama3 and LongRoPE configs already state the extended
    length, and so do Gemma 3's (whose global layers are linear-scaled)."""
    stated = int(hf.get("max_position_embeddings", 4096))
    if family == "gemma3" or rope.type not in ("linear", "dynamic", "yarn"):
        return stated
    base = rope.original_max_position_embeddings if rope.type == "yarn" else stated
    return int(base * rope.factor)


def _check_rope(rope: RopeConfig, head_dim: int) -> None:
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(f"partial_rotary_factor {rope.partial_rotary_factor} gives {rotary_dim} rotary dims of "
                          f"head_dim {head_dim}; it must give an even number between 2 and head_dim.")
    if rope.type == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(getattr(rope, name)) != rotary_dim // 2:
                raise ConfigError(f"longrope {name} must have {rotary_dim // 2} entries (one per rotary frequency), "
                                  f"got {len(getattr(rope, name))}.")


def _hf_dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    return "float32" if dtype == "float32" else "bfloat16"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Every field has a CLI flag of the same name (underscores as dashes)."""

    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    kv_cache_memory: float | None = None  # bytes for the KV cache itself (must fit beside the step temporaries)
    kv_cache_fraction: float = 0.9
    kv_cache_dtype: str = "auto"  # auto | bfloat16 | float32 | int8 | fp8
    dtype: str = "auto"  # activation/weight dtype at run time: auto | bfloat16 | float32
    attention: str = "auto"  # auto | pallas | cpu | xla (auto: Pallas on a GPU, the C++ kernel on a CPU)
    matmul: str = "auto"  # auto | pallas | cpu | xla (see jaxserve.models.kernels)
    enable_prefix_caching: bool = True
    async_scheduling: bool = True  # schedule and dispatch step N+1 before reading step N's tokens
    decode_burst: int | None = None  # decode steps per executable call when only decodes run (1: off)
    decode_burst_max_batch: int = 4  # no decode bursts with more running sequences
    decode_buckets: tuple[int, ...] | None = None
    prefill_token_buckets: tuple[int, ...] | None = None
    prefill_seq_buckets: tuple[int, ...] | None = None
    context_buckets: tuple[int, ...] | None = None  # pages-per-sequence ladder (tokens, rounded to pages)
    compilation_cache_dir: str | None = None  # "" disables JAX's persistent compilation cache
    xla_optimization_level: int | None = None  # XLA backend optimisation level (tests use 0 to compile fast)
    seed: int = 0
    tensor_parallel_size: int = 1  # devices to shard the model over (tensor parallelism; docs/parallel.md)
    data_parallel_size: int = 1  # model replicas, each on its own tensor_parallel_size devices, behind one front
    coordinator_address: str | None = None  # multi-host: process 0's HOST:PORT, the same on every host
    num_processes: int | None = None  # multi-host: processes (hosts) in the run
    process_id: int | None = None  # multi-host: this process's rank, 0..num_processes-1 (0 serves and schedules)
    generation_config: str = "auto"  # auto | vllm | a folder: where requests' default sampling comes from
    speculative_method: str | None = None  # speculative decoding: ngram (prompt lookup) or draft (a small model)
    num_speculative_tokens: int = 3  # K: tokens proposed per speculating sequence and step, 1..8
    ngram_max: int = 4  # ngram: longest suffix looked up in the sequence's earlier tokens
    ngram_min: int = 1  # ngram: shortest suffix looked up
    speculative_model: str | None = None  # --speculative-method draft: the draft's jaxserve checkpoint folder
    speculative_disable_batch_size: int | None = 8  # no speculation in a step with more running sequences

    enable_lora: bool = False  # serve LoRA adapters (PEFT directories) beside the base model, mixed in one batch
    lora_modules: tuple[str, ...] = dataclasses.field(default=(), metadata={"nargs": "+", "metavar": "NAME=DIR"})  # adapters loaded at start-up: NAME=DIR ... (or JSON {"name": ..., "path": ...}); requests pick one with `model`
    max_loras: int = 1  # adapters on the device at once (slots); requests for others wait for a free slot
    max_lora_rank: int = 16  # largest adapter rank the slots hold (adapters of lower rank are zero-padded)
    merge_lora: bool = False  # merge the one --lora-modules adapter into the base weights at load (base-model speed; every request then runs with it, under either name)

    def speculation(self) -> "SpeculativeConfig | None":
        """The speculative-decoding settings, checked (ConfigError names the flag), or None when off."""
        if self.speculative_method is None:
            return None
        spec = SpeculativeConfig(self.speculative_method, self.num_speculative_tokens, self.ngram_min,
                                 self.ngram_max, self.speculative_model, self.speculative_disable_batch_size)
        spec.check()
        return spec

    def resolved_decode_burst(self, cpu: bool) -> int:
        """Tokens per row and call of a decode burst (1: none). `cpu`: the engine runs the CPU kernels, where the
        host's work per step shares the cores with the step itself. No bursts with speculative decoding (its
        verify steps already sample several tokens a call) or across hosts (the followers replay plain steps)."""
        burst = self.decode_burst if self.decode_burst is not None else (DEFAULT_CPU_DECODE_BURST if cpu else 1)
        if burst < 1:
            raise ConfigError(f"decode_burst must be at least 1 (1: off), got {burst}.")
        if self.decode_burst_max_batch < 1:
            raise ConfigError(f"decode_burst_max_batch must be at least 1, got {self.decode_burst_max_batch}.")
        if self.speculative_method is not None or (self.num_processes or 1) > 1:
            return 1
        return burst

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is not None:
            if self.max_model_len > model.max_position_embeddings:
                raise ConfigError(
                    f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                    f"{model.max_position_embeddings}.")
            return self.max_model_len
        return min(model.max_position_embeddings, 8192)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


DEFAULT_CPU_DECODE_BURST = 8  # see bench/RESULTS.md, "Decode bursts"
SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (jaxserve.spec): `method` proposes up to `num_tokens` (K) tokens per sequence and step,
    the target verifies them in one step. No speculation in a step with more than `disable_batch_size` running
    sequences (None: always speculate)."""

    method: str
    num_tokens: int
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    disable_batch_size: int | None = None

    def check(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-method {self.method!r} is not supported; use one of "
                              f"{', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--num-speculative-tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_tokens}")
        if self.method == "ngram" and not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"--ngram-min {self.ngram_min} and --ngram-max {self.ngram_max}: need "
                              f"1 <= ngram-min <= ngram-max")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("--speculative-method draft needs --speculative-model DIR (a jaxserve checkpoint "
                              "sharing the target's tokenizer)")
        if self.disable_batch_size is not None and self.disable_batch_size < 1:
            raise ConfigError(f"--speculative-disable-batch-size must be >= 1, got {self.disable_batch_size}")


# generation_config.json key -> the SamplingParams field it gives a default to (as vLLM reads the file)
GENERATION_CONFIG_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_FILE = "generation_config.json"


def sampling_defaults(model_dir: str | os.PathLike, generation_config: str = "auto") -> dict[str, Any]:
    """SamplingParams field -> the default a request that leaves it unset gets, as vLLM's --generation-config:
    "auto": from the model's generation_config.json (a converted checkpoint keeps a copy, and the same values in
    jaxserve.json); "vllm": none, jaxserve's built-in defaults; another value: a folder with a
    generation_config.json. Values the engine would refuse are a ConfigError now, not a 400 per request."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        values = _generation_config(Path(model_dir))
    else:
        path = Path(generation_config) / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"--generation-config {generation_config}: no {GENERATION_CONFIG_FILE} there; pass "
                              f"auto (the model's), vllm (built-in defaults) or a folder that holds one")
        values = json.loads(path.read_text())
    defaults = {field: values[key] for key, field in GENERATION_CONFIG_DEFAULTS.items() if values.get(key) is not None}
    _check_sampling_defaults(defaults, model_dir)
    return defaults


def _generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / GENERATION_CONFIG_FILE
    if path.is_file():
        return json.loads(path.read_text())
    meta = model_dir / "jaxserve.json"
    return json.loads(meta.read_text()).get("generation") or {} if meta.is_file() else {}


def _check_sampling_defaults(defaults: dict[str, Any], model_dir: str | os.PathLike) -> None:
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.validation import validate_sampling_params
    try:
        validate_sampling_params(SamplingParams(**defaults))
    except ValueError as exc:
        raise ConfigError(f"{model_dir}: generation_config.json's sampling defaults are unusable ({exc}); fix the "
                          f"file or pass --generation-config vllm") from None


def env_str(name: str, default: str | None = None) -> str | None:
    """The one place jaxserve reads environment variables."""
    return os.environ.get(name, default)


def default_compilation_cache_dir() -> str:
    return env_str("JAXSERVE_CACHE_DIR") or os.path.join(
        env_str("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxserve", "xla")

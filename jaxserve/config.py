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
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A model or engine configuration jaxserve cannot use; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from both HF config forms."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def num_params(self) -> int:
        """Parameter count as Hugging Face counts it (tied embeddings once)."""
        e, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = e * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * e
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        norms = 2 * e + (2 * d if self.qk_norm else 0)
        layer = attn + 3 * e * f + norms
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * layer + e + head

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelConfig":
        data = dict(data)
        data["rope"] = RopeConfig(**data.get("rope", {}))
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


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Both forms: `rope_parameters` (transformers >= 5) and top-level `rope_theta` + `rope_scaling` (older)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {rope_type!r} is not supported; jaxserve supports {', '.join(SUPPORTED_ROPE_TYPES)}.")
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 8192))),
    )


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for v in (value if isinstance(value, list) else [value]):
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None,
                         dtype: str | None = None) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face `config.json` dict (and optionally `generation_config.json`)."""
    archs = hf.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {archs or hf.get('model_type')!r}: "
                          f"jaxserve supports {supported}.")
    arch = archs[0]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported; the Llama family uses 'silu'.")
    family = SUPPORTED_ARCHITECTURES[arch]
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // heads
    sliding = hf.get("sliding_window") if family in ("mistral", "qwen2", "qwen3") else None
    if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        sliding = None
    generation = generation or {}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
        eos_token_ids=_eos_ids(generation.get("eos_token_id"), hf.get("eos_token_id")),
        dtype=dtype or _hf_dtype(hf),
    )


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
    matmul: str = "auto"  # auto | pallas | xla (quantized weights only)
    enable_prefix_caching: bool = True
    async_scheduling: bool = True  # schedule and dispatch step N+1 before reading step N's tokens
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
    speculative_method: str | None = None  # speculative decoding: ngram (prompt lookup); draft is not implemented yet
    num_speculative_tokens: int = 3  # K: tokens proposed per speculating sequence and step, 1..8
    ngram_max: int = 4  # ngram: longest suffix looked up in the sequence's earlier tokens
    ngram_min: int = 1  # ngram: shortest suffix looked up
    speculative_model: str | None = None  # for --speculative-method draft (not implemented yet): the draft's folder
    speculative_disable_batch_size: int | None = 8  # no speculation in a step with more running sequences

    def speculation(self) -> "SpeculativeConfig | None":
        """The speculative-decoding settings, checked (ConfigError names the flag), or None when off."""
        if self.speculative_method is None:
            return None
        spec = SpeculativeConfig(self.speculative_method, self.num_speculative_tokens, self.ngram_min,
                                 self.ngram_max, self.speculative_model, self.speculative_disable_batch_size)
        spec.check()
        return spec

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

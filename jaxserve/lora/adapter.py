"""A Hugging Face PEFT LoRA adapter directory, read directly and checked against the base model. No jax.

    adapter_config.json          r, lora_alpha, use_rslora, target_modules, rank_pattern, alpha_pattern, ...
    adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
                                 base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]

PEFT adds scale * B @ A to the projection's [out, in] weight (scale = lora_alpha / r, or lora_alpha / sqrt(r) with
use_rslora). jaxserve keeps each projection's two factors in its own weight layout (jaxserve.convert.names):

    q_proj   A [r, E]          -> a [E, r]          B [H * D, r] -> b [r, H, D]      (wq [E, H, D])
    o_proj   A [r, H * D]      -> a [H, D, r]       B [E, r]     -> b [r, E]         (wo [H, D, E])
    gate/up  A [r, E]          -> a [E, r]          B [F, r]     -> b [r, F]
    down     A [r, F]          -> a [F, r]          B [E, r]     -> b [r, E]

with the scale folded into b, so the product of a token x is (x @ a) @ b, and a module the adapter does not touch
(or a layer outside layers_to_transform) is zeros. Refused, each with a sentence: DoRA, embedding and LM-head
adapters, modules_to_save, LoRA biases, fan_in_fan_out, a rank above --max-lora-rank, and any tensor whose shape
or layer does not fit the base model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> the jaxserve weight (jaxserve.models.llama.layer_weight_specs) whose output it adds to
TARGET_WEIGHTS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
                  "up_proj": "w_up", "down_proj": "w_down"}
WEIGHT_NAMES = tuple(TARGET_WEIGHTS.values())
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")


class LoraError(ValueError):
    """An adapter jaxserve cannot serve; the message names what and why."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter's factors in jaxserve layouts, float32, scale folded into b. weights[name] = (a, b) with
    a [layers, *in, rank] and b [layers, rank, *out] for each targeted weight name ("wq", ...)."""

    path: str
    rank: int  # the largest rank of its modules
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    base_model_name_or_path: str | None = None

    @property
    def target_weights(self) -> tuple[str, ...]:
        return tuple(name for name in WEIGHT_NAMES if name in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def weight_dims(cfg: ModelConfig, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of one layer's projection `name` in jaxserve's layout."""
    e, f, h, k, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {"wq": ((e,), (h, d)), "wk": ((e,), (k, d)), "wv": ((e,), (k, d)), "wo": ((h, d), (e,)),
            "w_gate": ((e,), (f,)), "w_up": ((e,), (f,)), "w_down": ((f,), (e,))}[name]


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int | None = None) -> Adapter:
    """Reads and checks a PEFT LoRA directory for base model `cfg`; raises LoraError naming the problem."""
    directory = Path(path)
    config = _read_config(directory)
    tensors = _read_tensors(directory)
    factors = _factors_by_module(tensors, cfg, directory)
    weights, rank = {}, 0
    for name in WEIGHT_NAMES:
        modules = {layer: ab for (layer, weight), ab in factors.items() if weight == name}
        if modules:
            weights[name] = _stack(modules, name, cfg, config)
            rank = max(rank, weights[name][0].shape[-1])
    if not weights:
        raise LoraError(f"{directory}: {WEIGHTS_FILE} holds no LoRA factors of q/k/v/o/gate/up/down projections")
    if max_rank is not None and rank > max_rank:
        raise LoraError(f"{directory}: rank {rank} exceeds --max-lora-rank {max_rank}; raise --max-lora-rank")
    return Adapter(str(directory), rank, weights, config.get("base_model_name_or_path"))


def _read_config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"{directory} is not a PEFT adapter directory: it has no {CONFIG_FILE}")
    config = json.loads(file.read_text())
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} is not LoRA"),
        (config.get("use_dora"), "DoRA adapters (use_dora) are not supported"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} (fully trained modules "
                                        f"beside the LoRA factors) are not supported"),
        (config.get("bias", "none") != "none", f"LoRA biases (bias={config.get('bias')!r}) are not supported"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D layouts) is not supported"),
    ]
    for refused, reason in refusals:
        if refused:
            raise LoraError(f"{directory}: {reason}")
    targets = config.get("target_modules") or []
    unsupported = ({targets} if isinstance(targets, str) else set(targets)) & {"embed_tokens", "lm_head"}
    if unsupported:
        raise LoraError(f"{directory}: adapters of {', '.join(sorted(unsupported))} (embedding / LM head) are not "
                        f"supported; jaxserve serves LoRA on q/k/v/o/gate/up/down projections")
    return config


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
        raise LoraError(f"{directory}: no {WEIGHTS_FILE} (found {found}); save the adapter with safetensors")
    try:
        return load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise LoraError(f"{file}: not a readable safetensors file ({exc})") from None


def _factors_by_module(tensors: dict[str, np.ndarray], cfg: ModelConfig, directory: Path
                       ) -> dict[tuple[int, str], dict[str, np.ndarray]]:
    """(layer, weight name) -> {"A": [r, in], "B": [out, r]}; refuses every tensor that is not one of those."""
    factors: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match.group(2) not in TARGET_WEIGHTS:
            raise LoraError(f"{directory}: tensor {key!r} is not supported ({_what_is(key)})")
        layer = int(match.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(f"{directory}: tensor {key!r} is for layer {layer}, but the base model has "
                            f"{cfg.num_layers} layers: the adapter was trained for another base model")
        factors.setdefault((layer, TARGET_WEIGHTS[match.group(2)]), {})[match.group(3)] = value
    return factors


def _what_is(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA magnitudes: DoRA adapters are not supported"
    if "embed" in key or "lora_embedding" in key:
        return "embedding adapters are not supported"
    if "lm_head" in key:
        return "LM-head adapters are not supported"
    if key.endswith(".bias"):
        return "LoRA biases are not supported"
    return "jaxserve serves LoRA factors of q/k/v/o/gate/up/down projections only"


def _stack(modules: dict[int, dict[str, np.ndarray]], name: str, cfg: ModelConfig, config: dict
           ) -> tuple[np.ndarray, np.ndarray]:
    """One weight's factors over all layers, in jaxserve layout, zero-padded to the weight's largest rank."""
    in_dims, out_dims = weight_dims(cfg, name)
    peft_name = next(k for k, v in TARGET_WEIGHTS.items() if v == name)
    rank = max(f["A"].shape[0] for f in modules.values() if "A" in f)
    a = np.zeros((cfg.num_layers, *in_dims, rank), np.float32)
    b = np.zeros((cfg.num_layers, rank, *out_dims), np.float32)
    for layer, f in modules.items():
        where = f"model.layers.{layer}.{peft_name}"
        if set(f) != {"A", "B"}:
            raise LoraError(f"{where} has lora_{''.join(f)} but not both lora_A and lora_B")
        fa, fb = f["A"].astype(np.float32), f["B"].astype(np.float32)
        r = fa.shape[0]
        expected = ((r, math.prod(in_dims)), (math.prod(out_dims), r))
        if (fa.shape, fb.shape) != expected:
            raise LoraError(f"{where}: lora_A {list(fa.shape)} and lora_B {list(fb.shape)} do not fit this base "
                            f"model's {peft_name} (expected {list(expected[0])} and {list(expected[1])}): the "
                            f"adapter was trained for another base model")
        a[layer, ..., :r] = fa.T.reshape(*in_dims, r)
        b[layer, :r] = (fb.T * _scale(config, f"model.layers.{layer}.{_parent(name)}.{peft_name}", r)
                        ).reshape(r, *out_dims)
    return a, b


def _parent(name: str) -> str:
    return "self_attn" if name in ("wq", "wk", "wv", "wo") else "mlp"


def _scale(config: dict, module: str, rank: int) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora); alpha_pattern may override alpha per module (PEFT matches
    a pattern key against the end of the module's name)."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = float(value)
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

"""Random PEFT LoRA adapters written the way PEFT's save_pretrained writes them, and the merged weights
(W + scale * B @ A, in Hugging Face's [out, in] layout) computed independently of jaxserve.lora."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ALL_MODULES = tuple(PARENT)


def hf_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """[out, in] of a Hugging Face Linear."""
    e, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, e), "k_proj": (kv, e), "v_proj": (kv, e), "o_proj": (e, q), "gate_proj": (f, e),
            "up_proj": (f, e), "down_proj": (e, f)}[module]


def write_adapter(directory: Path, cfg: ModelConfig, modules=ALL_MODULES, rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, use_rslora: bool = False, std: float = 0.3, extra_config: dict | None = None,
                  extra_tensors: dict | None = None) -> Path:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in modules:
            out, inp = hf_shape(cfg, module)
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, inp)) * std).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out, rank)) * std).astype(np.float32)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
              "use_rslora": use_rslora, "use_dora": False, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": "tiny-random", "task_type": "CAUSAL_LM", **(extra_config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def merged_hf(directory: Path, base_hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{"model.layers.0.self_attn.q_proj.weight": W + scale * B @ A, ...} for the adapted modules."""
    from safetensors.numpy import load_file
    config = json.loads((directory / "adapter_config.json").read_text())
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    merged = dict(base_hf)
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged[name] = base_hf[name] + scale * (b.astype(np.float64) @ a.astype(np.float64))
    return merged


# Hugging Face <-> jaxserve layouts of the projections, written out here (not taken from jaxserve.convert)
def to_hf(model) -> dict[str, np.ndarray]:
    cfg, layers = model.cfg, model.layers
    e = cfg.hidden_size
    out = {}
    for i in range(cfg.num_layers):
        w = lambda name: np.asarray(getattr(layers, name)[...][i], np.float64)  # noqa: E731
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.q_proj.weight"] = w("wq").reshape(e, -1).T
        out[f"{p}.self_attn.k_proj.weight"] = w("wk").reshape(e, -1).T
        out[f"{p}.self_attn.v_proj.weight"] = w("wv").reshape(e, -1).T
        out[f"{p}.self_attn.o_proj.weight"] = w("wo").reshape(-1, e).T
        out[f"{p}.mlp.gate_proj.weight"] = w("w_gate").T
        out[f"{p}.mlp.up_proj.weight"] = w("w_up").T
        out[f"{p}.mlp.down_proj.weight"] = w("w_down").T
    return out


def merged_model(model, directory: Path):
    """A copy of `model` with the adapter merged into its weights (computed in HF layout)."""
    import jax.numpy as jnp
    from flax import nnx
    cfg = model.cfg
    merged = merged_hf(directory, to_hf(model))
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    stacks = {name: [] for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h, k, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        stacks["wq"].append(merged[f"{p}.self_attn.q_proj.weight"].T.reshape(e, h, d))
        stacks["wk"].append(merged[f"{p}.self_attn.k_proj.weight"].T.reshape(e, k, d))
        stacks["wv"].append(merged[f"{p}.self_attn.v_proj.weight"].T.reshape(e, k, d))
        stacks["wo"].append(merged[f"{p}.self_attn.o_proj.weight"].T.reshape(h, d, e))
        stacks["w_gate"].append(merged[f"{p}.mlp.gate_proj.weight"].T)
        stacks["w_up"].append(merged[f"{p}.mlp.up_proj.weight"].T)
        stacks["w_down"].append(merged[f"{p}.mlp.down_proj.weight"].T)
    for name, layers in stacks.items():
        param = getattr(copy.layers, name)
        setattr(copy.layers, name, nnx.Param(jnp.asarray(np.stack(layers), param.dtype), **param.get_metadata()))
    return copy

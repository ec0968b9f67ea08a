"""jaxserve's checkpoint format: what `jaxserve convert` writes and every command loads.

    MODEL_DIR/
      jaxserve.json        {"format": 1, "model": ModelConfig, "generation": {...}, "tokenizer": {...}}
      params/              Orbax checkpoint of the weights as a nested dict, keyed like `weight_specs` paths
      tokenizer.model | tokenizer.json, tokenizer_config.json, chat_template.jinja (whichever the source had)

Loading restores straight into the requested dtype and shardings; nothing is materialised twice.

Quantized checkpoints (`jaxserve convert --quantize`) record their schemes in the model config
(`quantization`, `lm_head_quantization`); `abstract_model` then declares each quantized weight as
`<path>/values` (int8 / packed uint8) and `<path>/scales` (float32, kept float32 whatever the load dtype).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from collections.abc import Callable, Collection
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.llama import Llama, abstract_weights, numpy_dtype

FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def params_to_nested(flat: dict[str, Any]) -> dict[str, Any]:
    """{"layers/wq": a, "embed": b} -> {"layers": {"wq": a}, "embed": b}."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        node = nested
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def save_checkpoint(out_dir: str | os.PathLike, cfg: ModelConfig, params: dict[str, Any], *,
                    tokenizer_dir: str | os.PathLike | None = None, generation: dict[str, Any] | None = None,
                    extra: dict[str, Any] | None = None) -> Path:
    """Writes params (nested dict of arrays, or flat "a/b" keys), the config and the tokenizer files."""
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if any("/" in k for k in params):
        params = params_to_nested(params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "params", params, force=True)
    copied = []
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
                copied.append(name)
    meta = {"format": FORMAT_VERSION, "model": cfg.to_json(), "generation": generation or {},
            "tokenizer_files": copied, **(extra or {})}
    (out / "jaxserve.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_metadata(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "jaxserve.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{model_dir} is not a jaxserve checkpoint (no jaxserve.json); "
            f"convert a Hugging Face model with `jaxserve convert HF_DIR {model_dir}`.")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{model_dir}: checkpoint format {meta.get('format')} is not {FORMAT_VERSION}; "
                         f"reconvert it with this version of jaxserve.")
    return meta


def load_model(model_dir: str | os.PathLike, dtype: str | None = None,
               sharding_for: Callable[[tuple[str | None, ...]], jax.sharding.Sharding] | None = None,
               keep_stored: Collection[str] = ()) -> Llama:
    """Restores the model. `sharding_for(logical_axes)` gives each weight's sharding (default: one device).
    `keep_stored`: paths of weights ("layers/wq", "lm_head") that stay in the checkpoint's dtype instead of `dtype`
    (weights a kernel reads in place and multiplies in float32 whatever their storage)."""
    cfg = ModelConfig.load(model_dir)
    graphdef, abstract_state = abstract_weights(cfg, numpy_dtype(dtype or cfg.dtype), keep_stored)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(var: nnx.Variable):
        sharding = sharding_for(var.get_metadata()["axes"]) if sharding_for else default
        value = var.get_value()
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

    targets = jax.tree.map(target, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(Path(model_dir).absolute() / "params", nnx.to_pure_dict(targets))
    nnx.replace_by_pure_dict(abstract_state, restored)
    return nnx.merge(graphdef, abstract_state)


def model_params_numpy(model: Llama) -> dict[str, Any]:
    """The model's weights as a nested dict of numpy arrays (for saving)."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))

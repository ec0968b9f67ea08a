"""`convert`: a Hugging Face model directory -> a jaxserve checkpoint (format: `jaxserve.checkpoint`).

Everything that can be checked without reading tensor data is checked first (config, tokenizer, shards, tensor
names, shapes and dtypes), so a bad checkpoint fails within a second and leaves OUT_DIR untouched. Then each weight
is preallocated at its stacked [layers, ...] shape in the target dtype and filled one HF tensor at a time: peak host
memory is one copy of the converted model plus the tensor in hand.

With `quantize` ("int8" / "int4", jaxserve.quant.schemes) the decoder projections (and, with `quantize_lm_head`,
an untied LM head) are preallocated in their quantized layout, `<path>/values` and `<path>/scales`, and each HF
tensor (one layer of one weight) is quantized as it is read, so peak memory is the quantized model plus one
tensor. The schemes are recorded in jaxserve.json's model config: loading needs no flag. A float jaxserve
checkpoint (one with jaxserve.json, e.g. the demo model) can be the source too: it is loaded and quantized whole.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxserve.checkpoint import TOKENIZER_FILES, load_model, model_params_numpy, read_metadata, save_checkpoint
from jaxserve.config import ConfigError, ModelConfig, model_config_from_hf
from jaxserve.convert.hf_source import CONFIG, ConvertError, HFSource, TensorReader, open_source
from jaxserve.convert.names import Target, expected_tensors, is_ignored
from jaxserve.models.llama import WeightSpec, numpy_dtype, weight_scheme, weight_specs
from jaxserve.quant import schemes
from jaxserve.quant.model import quantize_model, quantized_config

OUTPUT_DTYPES = ("bfloat16", "float32")
FLOAT_STORAGE = ("F32", "BF16", "F16")  # safetensors dtype names jaxserve converts
CHECKPOINT_ENTRIES = ("params", "jaxserve.json", *TOKENIZER_FILES)  # what save_checkpoint writes


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, force: bool = False,
            progress: bool = True, quantize: str | None = None, quantize_lm_head: str | None = None) -> Path:
    """Converts the Hugging Face model in `hf_dir` into `out_dir`; `dtype` defaults to the one in config.json.
    `quantize` ("int8" | "int4") stores the decoder projections weight-only quantized, `quantize_lm_head` the
    untied LM head."""
    if (Path(hf_dir) / "jaxserve.json").exists():
        return quantize_checkpoint(hf_dir, out_dir, dtype=dtype, force=force, quantize=quantize,
                                   quantize_lm_head=quantize_lm_head)
    source = open_source(hf_dir)
    cfg = config_from_source(source, dtype, quantize, quantize_lm_head)
    out = Path(out_dir)
    check_output_dir(out, source.directory, force)
    targets = expected_tensors(cfg)
    with TensorReader(source) as reader:
        check_tensor_names(reader.names, targets, cfg, source.directory)
        check_tensor_layouts(reader, targets, cfg)
        params = read_params(reader, targets, cfg, progress)
    clear_previous_checkpoint(out)
    return save_checkpoint(out, cfg, params, tokenizer_dir=source.directory, generation=source.generation,
                           extra={"hf_config": source.config})


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, *, dtype: str | None, force: bool,
                        quantize: str | None, quantize_lm_head: str | None) -> Path:
    """A float jaxserve checkpoint -> the same model with quantized weights (loaded whole, then quantized)."""
    src, out = Path(src_dir), Path(out_dir)
    meta = read_metadata(src)
    cfg = ModelConfig.from_json(meta["model"])
    if cfg.quantization or cfg.lm_head_quantization:
        raise ConvertError(f"{src} is already quantized ({cfg.quantization}); convert from the float model.")
    if quantize is None and quantize_lm_head is None:
        raise ConvertError(f"{src} is already a jaxserve checkpoint; pass --quantize to write a quantized copy.")
    check_output_dir(out, src, force)
    try:
        model = quantize_model(load_model(src, dtype=dtype), quantize, quantize_lm_head)
    except schemes.QuantizationError as e:
        raise ConvertError(f"cannot quantize {src}: {e}.") from None
    clear_previous_checkpoint(out)
    extra = {k: v for k, v in meta.items() if k not in ("format", "model", "generation", "tokenizer_files")}
    saved_cfg = dataclasses.replace(model.cfg, dtype=dtype or cfg.dtype)
    return save_checkpoint(out, saved_cfg, model_params_numpy(model), tokenizer_dir=src,
                           generation=meta.get("generation"), extra=extra)


def config_from_source(source: HFSource, dtype: str | None, quantize: str | None = None,
                       quantize_lm_head: str | None = None) -> ModelConfig:
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ConvertError(f"dtype {dtype!r} is not one jaxserve stores weights in; use {' or '.join(OUTPUT_DTYPES)}.")
    path = source.directory / CONFIG
    try:
        cfg = model_config_from_hf(source.config, source.generation, dtype)
    except ConfigError as e:
        raise ConvertError(f"{path}: {e}") from None
    except KeyError as e:
        raise ConvertError(f"{path} has no {e.args[0]!r}; restore config.json from the model's repository.") from None
    try:
        return quantized_config(cfg, quantize, quantize_lm_head)
    except schemes.QuantizationError as e:
        raise ConvertError(f"cannot quantize {source.directory}: {e}.") from None


def check_output_dir(out: Path, hf_dir: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"OUT_DIR {out} is a file; choose a new or empty directory.")
    if out.exists() and out.resolve() == hf_dir.resolve():
        raise ConvertError(f"OUT_DIR {out} is the Hugging Face directory itself; choose another directory.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConvertError(f"OUT_DIR {out} is not empty; choose a new or empty directory, or pass --force to "
                           f"replace the jaxserve checkpoint in it.")


def clear_previous_checkpoint(out: Path) -> None:
    """Removes what an earlier conversion wrote (and only that), so no stale tokenizer file survives --force."""
    for name in CHECKPOINT_ENTRIES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def check_tensor_names(names: set[str], targets: dict[str, Target], cfg: ModelConfig, hf_dir: Path) -> None:
    unexpected = sorted(n for n in names - targets.keys() if not is_ignored(n, cfg))
    missing = sorted(targets.keys() - names)
    problems = []
    if unexpected:
        problems.append(f"it has tensors a {cfg.architecture} with this config.json does not use: "
                        f"{_listing(unexpected)} (dropping them would change the model: is it a quantized "
                        f"checkpoint, a variant jaxserve does not support, or is a setting missing from config.json?)")
    if missing:
        tied = " (if the head is the embedding, set tie_word_embeddings: true)" if "lm_head.weight" in missing else ""
        problems.append(f"it lacks tensors this config.json needs: {_listing(missing)}{tied}")
    if problems:
        raise ConvertError(f"cannot convert {hf_dir}: {'; '.join(problems)}. Check that config.json belongs to "
                           f"these weights and that every shard was downloaded.")


def check_tensor_layouts(reader: TensorReader, targets: dict[str, Target], cfg: ModelConfig) -> None:
    for name, target in targets.items():
        shape, dtype = reader.shape(name), reader.dtype(name)
        if shape != target.hf_shape:
            raise ConvertError(
                f"tensor {name} has shape {list(shape)}, but config.json implies {list(target.hf_shape)} "
                f"({_dimensions(cfg)}); check that config.json belongs to these weights.")
        if dtype not in FLOAT_STORAGE:
            raise ConvertError(f"tensor {name} is stored as {dtype}; jaxserve converts floating-point checkpoints "
                               f"({', '.join(FLOAT_STORAGE)}), not quantized ones.")


def read_params(reader: TensorReader, targets: dict[str, Target], cfg: ModelConfig,
                progress: bool) -> dict[str, np.ndarray]:
    """Fills preallocated [layers, ...] arrays (flat paths, as in weight_specs; quantized weights as
    `<path>/values` and `<path>/scales`) one HF tensor at a time."""
    params = allocate_params(cfg)
    specs = weight_specs(cfg)
    in_file_order = sorted(targets, key=lambda name: (str(reader.shard(name)), name))
    for name in tqdm(in_file_order, desc="converting", unit="tensor", disable=not progress):
        for target, weight in targets[name].pieces(reader.read(name)):  # several for a fused tensor (Phi-3)
            _store(params, target, weight, specs[target.path], cfg)
    return params


def _store(params: dict[str, np.ndarray], target: Target, weight: np.ndarray, spec: WeightSpec,
           cfg: ModelConfig) -> None:
    scheme = weight_scheme(target.path, spec, cfg)
    if scheme is None:
        params[target.path][target.index] = weight
        return
    values, scales = _quantize(weight, contract=spec.contract, scheme=scheme)
    params[f"{target.path}/values"][target.index] = values
    params[f"{target.path}/scales"][target.index] = scales


_quantize = jax.jit(schemes.quantize, static_argnames=("contract", "scheme"))  # one tensor (one layer) at a time


def allocate_params(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Uninitialised arrays for every weight in its stored layout, by flat path."""
    dtype = np.dtype(numpy_dtype(cfg.dtype))
    params = {}
    for path, spec in weight_specs(cfg).items():
        scheme = weight_scheme(path, spec, cfg)
        if scheme is None:
            params[path] = np.empty(spec.shape, dtype)
        else:
            params.update(_allocate_quantized(path, spec, scheme))
    return params


def _allocate_quantized(path: str, spec: WeightSpec, scheme: str) -> dict[str, np.ndarray]:
    stacked = 1 if path.startswith("layers/") else 0
    layout = schemes.layout(spec.shape, spec.axes, spec.contract, scheme, stacked)
    return {f"{path}/values": np.empty(layout.values_shape, layout.values_dtype),
            f"{path}/scales": np.empty(layout.scales_shape, np.float32)}


def _dimensions(cfg: ModelConfig) -> str:
    return (f"hidden_size={cfg.hidden_size}, num_attention_heads={cfg.num_heads}, "
            f"num_key_value_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
            f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}")


def _listing(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more

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

An already quantized checkpoint (GPTQ, AWQ, compressed-tensors, FP8: jaxserve.convert.quantized) is imported in
its own format: the reader is wrapped so that each quantized Linear looks like its float `.weight`, and
`read_params` takes its arrays already in jaxserve's layout. With `dequantize` it is read as float instead (and
may then be re-quantized with `quantize`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from jaxserve.checkpoint import TOKENIZER_FILES, load_model, model_params_numpy, read_metadata, save_checkpoint
from jaxserve.config import ConfigError, ModelConfig, model_config_from_hf
from jaxserve.convert import quantized
from jaxserve.convert.hf_source import CONFIG, ConvertError, HFSource, TensorReader, open_source
from jaxserve.convert.names import Target, expected_tensors, is_ignored
from jaxserve.logs import progress as show_progress
from jaxserve.models.llama import WeightSpec, numpy_dtype, weight_scheme, weight_specs
from jaxserve.quant import schemes
from jaxserve.quant.model import quantize_model, quantized_config

OUTPUT_DTYPES = ("bfloat16", "float32")
FLOAT_STORAGE = ("F32", "BF16", "F16")  # safetensors dtype names jaxserve converts
CHECKPOINT_ENTRIES = ("params", "jaxserve.json", *TOKENIZER_FILES)  # what save_checkpoint writes


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, force: bool = False,
            progress: bool = True, quantize: str | None = None, quantize_lm_head: str | None = None,
            dequantize: bool = False) -> Path:
    """Converts the Hugging Face model in `hf_dir` into `out_dir`; `dtype` defaults to the one in config.json.
    `quantize` ("int8" | "int4") stores the decoder projections weight-only quantized, `quantize_lm_head` the
    untied LM head. A quantized checkpoint is imported as it is quantized, or as float with `dequantize`."""
    if (Path(hf_dir) / "jaxserve.json").exists():
        return quantize_checkpoint(hf_dir, out_dir, dtype=dtype, force=force, quantize=quantize,
                                   quantize_lm_head=quantize_lm_head)
    source = open_source(hf_dir)
    imported = quantized.source_quantization(source)
    check_import_flags(source, imported, quantize or quantize_lm_head, dequantize)
    cfg = config_from_source(source, dtype, quantize, quantize_lm_head)
    out = Path(out_dir)
    check_output_dir(out, source.directory, force)
    extra = {"hf_config": source.config}
    with TensorReader(source) as reader:
        if imported is not None:
            reader = quantized.ImportedTensors(reader, imported, quantized.quantized_linears(expected_tensors(cfg)),
                                               as_float=dequantize)
            cfg = cfg if dequantize else imported_config(cfg, reader, source.directory)
            extra["imported_quantization"] = imported_record(reader, dequantize)
        targets = expected_tensors(cfg)
        check_tensor_names(reader.names, targets, cfg, source.directory)
        check_tensor_layouts(reader, targets, cfg)
        check_writable(out)
        params = read_params(reader, targets, cfg, progress)
    clear_previous_checkpoint(out)
    return save_checkpoint(out, cfg, params, tokenizer_dir=source.directory, generation=source.generation,
                           extra=extra)


def check_import_flags(source: HFSource, imported: quantized.SourceQuantization | None, requantize: str | None,
                       dequantize: bool) -> None:
    if imported is None and dequantize:
        raise ConvertError(f"{source.directory} is not a quantized checkpoint; --dequantize applies to GPTQ, AWQ, "
                           f"compressed-tensors and FP8 checkpoints.")
    if imported is not None and requantize and not dequantize:
        raise ConvertError(f"{source.directory} is already quantized ({imported.describe()}); convert it as it is "
                           f"(no --quantize), or pass --dequantize to re-quantize its dequantized weights.")


def imported_config(cfg: ModelConfig, reader: quantized.ImportedTensors, hf_dir: Path) -> ModelConfig:
    """cfg with the imported scheme: every decoder projection quantized alike, the LM head as the checkpoint has
    it."""
    targets = expected_tensors(cfg)
    linears = quantized.quantized_linears(targets)
    left_float = sorted(n for n in linears if targets[n].path != "lm_head" and not reader.is_quantized(n))
    if left_float:
        raise ConvertError(f"cannot import {hf_dir}: it leaves {_listing(left_float)} unquantized, and jaxserve "
                           f"stores every decoder projection in one format; pass --dequantize to import it as a "
                           f"float model.")
    head = "lm_head.weight" if "lm_head.weight" in linears and reader.is_quantized("lm_head.weight") else None
    try:
        return quantized_config(cfg, reader.scheme, reader.scheme if head else None)
    except schemes.QuantizationError as e:
        raise ConvertError(f"cannot import {hf_dir}: {e}.") from None


def imported_record(reader: quantized.ImportedTensors, dequantize: bool) -> dict:
    """What jaxserve.json says about the source's quantization (the CLI prints it)."""
    source = reader.source
    return {"method": source.method, "source": source.describe(), "scheme": None if dequantize else reader.scheme,
            "dequantized": dequantize, "dropped": source.dropped_activations}


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
    check_writable(out)
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


def check_writable(out: Path) -> None:
    """Creates OUT_DIR (and its missing parents) and writes a probe file there, before any tensor is read: a
    path under a file, on a read-only or special file system (/proc), or without permission fails now, in one
    line, instead of after the whole conversion. What this created is removed again if the probe fails."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConvertError(f"cannot create OUT_DIR {out}: {existing} is a file, not a directory.")
    created = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".jaxserve-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        for path in created:  # deepest first
            shutil.rmtree(path, ignore_errors=True)
        raise ConvertError(f"cannot write to OUT_DIR {out}: {e.strerror or e}.") from None


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
    for name in (show_progress(in_file_order, "converting", unit="tensor") if progress else in_file_order):
        target = targets[name]
        if (isinstance(reader, quantized.ImportedTensors) and target.path is not None
                and weight_scheme(target.path, specs[target.path], cfg) is not None and reader.stays_quantized(name)):
            _store_quantized(params, target, reader.read_quantized(name))  # already in jaxserve's format
            continue
        for piece, weight in target.pieces(reader.read(name)):  # several for a fused tensor (Phi-3)
            _store(params, piece, weight, specs[piece.path], cfg)
    return params


def _store(params: dict[str, np.ndarray], target: Target, weight: np.ndarray, spec: WeightSpec,
           cfg: ModelConfig) -> None:
    scheme = weight_scheme(target.path, spec, cfg)
    if scheme is None:
        params[target.path][target.index] = weight
        return
    _store_quantized(params, target, _quantize(weight, contract=spec.contract, scheme=scheme))


_quantize = jax.jit(schemes.quantize_arrays, static_argnames=("contract", "scheme"))  # one tensor (layer) at a time


def _store_quantized(params: dict[str, np.ndarray], target: Target, arrays: dict) -> None:
    """{"values", "scales", ...} of one weight (one layer), in any shape with the layout's size (the matrix view
    reshapes into it) -> the preallocated `<path>/<leaf>` arrays."""
    for leaf, array in arrays.items():
        destination = params[f"{target.path}/{leaf}"][target.index]
        destination[...] = np.asarray(array).reshape(destination.shape)


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
    return {f"{path}/{leaf}": np.empty(shape, dtype) for leaf, (shape, dtype) in layout.arrays().items()}


def _dimensions(cfg: ModelConfig) -> str:
    return (f"hidden_size={cfg.hidden_size}, num_attention_heads={cfg.num_heads}, "
            f"num_key_value_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
            f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}")


def _listing(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more

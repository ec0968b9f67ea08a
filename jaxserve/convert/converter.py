"""`convert`: a Hugging Face model directory -> a jaxserve checkpoint (format: `jaxserve.checkpoint`).

Everything that can be checked without reading tensor data is checked first (config, tokenizer, shards, tensor
names, shapes and dtypes), so a bad checkpoint fails within a second and leaves OUT_DIR untouched. Then each weight
is preallocated at its stacked [layers, ...] shape in the target dtype and filled one HF tensor at a time: peak host
memory is one copy of the converted model plus the tensor in hand.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxserve.checkpoint import TOKENIZER_FILES, save_checkpoint
from jaxserve.config import ConfigError, ModelConfig, model_config_from_hf
from jaxserve.convert.hf_source import CONFIG, ConvertError, HFSource, TensorReader, open_source
from jaxserve.convert.names import Target, expected_tensors, is_ignored
from jaxserve.models.llama import numpy_dtype, weight_specs

OUTPUT_DTYPES = ("bfloat16", "float32")
FLOAT_STORAGE = ("F32", "BF16", "F16")  # safetensors dtype names jaxserve converts
CHECKPOINT_ENTRIES = ("params", "jaxserve.json", *TOKENIZER_FILES)  # what save_checkpoint writes


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, force: bool = False,
            progress: bool = True) -> Path:
    """Converts the Hugging Face model in `hf_dir` into `out_dir`; `dtype` defaults to the one in config.json."""
    source = open_source(hf_dir)
    cfg = config_from_source(source, dtype)
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


def config_from_source(source: HFSource, dtype: str | None) -> ModelConfig:
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ConvertError(f"dtype {dtype!r} is not one jaxserve stores weights in; use {' or '.join(OUTPUT_DTYPES)}.")
    path = source.directory / CONFIG
    try:
        return model_config_from_hf(source.config, source.generation, dtype)
    except ConfigError as e:
        raise ConvertError(f"{path}: {e}") from None
    except KeyError as e:
        raise ConvertError(f"{path} has no {e.args[0]!r}; restore config.json from the model's repository.") from None


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
    """Fills preallocated [layers, ...] arrays (flat paths, as in weight_specs) one HF tensor at a time."""
    dtype = np.dtype(numpy_dtype(cfg.dtype))
    params = {path: np.empty(spec.shape, dtype) for path, spec in weight_specs(cfg).items()}
    in_file_order = sorted(targets, key=lambda name: (str(reader.shard(name)), name))
    for name in tqdm(in_file_order, desc="converting", unit="tensor", disable=not progress):
        target = targets[name]
        dest = params[target.path] if target.layer is None else params[target.path][target.layer]
        dest[...] = target.transform.apply(reader.read(name), target.shape)
    return params


def _dimensions(cfg: ModelConfig) -> str:
    return (f"hidden_size={cfg.hidden_size}, num_attention_heads={cfg.num_heads}, "
            f"num_key_value_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
            f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}")


def _listing(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more

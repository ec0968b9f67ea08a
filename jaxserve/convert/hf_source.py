"""Reading a Hugging Face model directory: config, generation config, tokenizer presence and safetensors shards.

Tensors are read one at a time through `safe_open` (memory-mapped), so converting never holds more than the output
arrays plus the tensor in hand. safetensors returns BF16 tensors as `ml_dtypes.bfloat16` numpy arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SHARD_INDEX = "model.safetensors.index.json"
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model")


class ConvertError(ValueError):
    """A Hugging Face checkpoint jaxserve cannot convert as it is; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class HFSource:
    """What a Hugging Face model directory holds, found without reading any tensor data."""

    directory: Path
    config: dict[str, Any]
    generation: dict[str, Any]
    shards: tuple[Path, ...]
    index: dict[str, str] | None  # tensor name -> shard file name, from model.safetensors.index.json


def open_source(hf_dir: str | Path) -> HFSource:
    directory = Path(hf_dir)
    if not directory.is_dir():
        raise ConvertError(f"{directory} is not a directory; pass the folder that holds config.json and the "
                           f"*.safetensors files of a Hugging Face model.")
    config = _read_json(directory / CONFIG, required=True)
    generation = _read_json(directory / GENERATION_CONFIG, required=False)
    _check_tokenizer(directory)
    index = _read_index(directory)
    shards = _shard_files(directory, index)
    return HFSource(directory, config, generation, shards, index)


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise ConvertError(f"{path.parent} has no {path.name}; pass the folder of a Hugging Face model "
                               f"(the one with config.json, *.safetensors and the tokenizer files).")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path} is not valid JSON ({e}); restore it from the model's repository.") from None


def _check_tokenizer(directory: Path) -> None:
    if not any((directory / name).exists() for name in TOKENIZER_MODELS):
        raise ConvertError(
            f"{directory} has no tokenizer ({' or '.join(TOKENIZER_MODELS)}); copy the tokenizer files "
            f"(with tokenizer_config.json) from the model's repository next to config.json.")


def _read_index(directory: Path) -> dict[str, str] | None:
    path = directory / SHARD_INDEX
    if not path.exists():
        return None
    weight_map = _read_json(path, required=True).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConvertError(f"{path} has no weight_map; restore it from the model's repository.")
    return weight_map


def _shard_files(directory: Path, index: dict[str, str] | None) -> tuple[Path, ...]:
    if index is not None:
        names = sorted(set(index.values()))
        absent = [n for n in names if not (directory / n).exists()]
        if absent:
            raise ConvertError(f"{directory / SHARD_INDEX} lists shards that are missing: {', '.join(absent)}; "
                               f"download them into {directory}.")
        return tuple(directory / n for n in names)
    shards = tuple(sorted(directory.glob("*.safetensors")))
    if not shards:
        other = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pth"))
        hint = (f" It holds {', '.join(other[:3])}: jaxserve reads only safetensors, so download the "
                f"model's *.safetensors files or convert these with transformers' save_pretrained.") if other else ""
        raise ConvertError(f"{directory} has no *.safetensors weights.{hint or ' Download them into it.'}")
    return shards


class TensorReader(contextlib.AbstractContextManager):
    """Names, shapes and data of every tensor in a set of safetensors shards; shards stay open (mmap) until exit."""

    def __init__(self, source: HFSource):
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        try:
            for shard in source.shards:
                handle = self._stack.enter_context(_open_shard(shard))
                for name in handle.keys():
                    self._files[name] = (shard, handle)
            if source.index is not None:
                self._check_index(source)
        except BaseException:
            self._stack.close()
            raise

    def _check_index(self, source: HFSource) -> None:
        for name, shard_name in source.index.items():
            if name not in self._files:
                raise ConvertError(f"{SHARD_INDEX} puts {name} in {shard_name}, but no shard holds it; the download "
                                   f"may be incomplete, so download {shard_name} again.")

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def names(self) -> set[str]:
        return set(self._files)

    def shard(self, name: str) -> Path:
        return self._files[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[name][1].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype name: F32, BF16, F16, I8, ..."""
        return self._files[name][1].get_slice(name).get_dtype()

    def read(self, name: str) -> np.ndarray:
        return self._files[name][1].get_tensor(name)


def _open_shard(shard: Path):
    try:
        return safe_open(shard, framework="numpy")
    except SafetensorError as e:
        raise ConvertError(f"{shard} is not a readable safetensors file ({e}); download it again.") from None

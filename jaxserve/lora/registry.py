"""The adapters one engine knows, by name. No jax.

Each registration gets a fresh id (never reused), so an adapter unloaded and loaded again under the same name,
perhaps from other files, shares neither a device slot's stale contents nor prefix-cache pages with its past.
Id 0 means "no adapter".
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxserve.lora.adapter import Adapter, LoraError


class LoraInUseError(RuntimeError):
    """An adapter cannot be unloaded while requests run or wait with it."""


@dataclasses.dataclass(frozen=True)
class LoraInfo:
    """What a front end may know of a loaded adapter (for /v1/models)."""

    name: str
    id: int
    path: str
    rank: int
    target_weights: tuple[str, ...]


class AdapterRegistry:
    def __init__(self, max_rank: int):
        self.max_rank = max_rank
        self._by_name: dict[str, tuple[int, Adapter]] = {}
        self._by_id: dict[int, Adapter] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, adapter: Adapter) -> int:
        if not name:
            raise LoraError("an adapter needs a non-empty name")
        if name in self._by_name:
            raise LoraError(f"the LoRA adapter {name!r} has already been loaded")
        if adapter.rank > self.max_rank:
            raise LoraError(f"adapter {name!r} has rank {adapter.rank}, above --max-lora-rank {self.max_rank}")
        adapter_id = next(self._ids)
        self._by_name[name] = (adapter_id, adapter)
        self._by_id[adapter_id] = adapter
        return adapter_id

    def remove(self, name: str) -> int:
        adapter_id, _ = self._by_name.pop(name)
        del self._by_id[adapter_id]
        return adapter_id

    def id_of(self, name: str) -> int | None:
        entry = self._by_name.get(name)
        return entry[0] if entry is not None else None

    def adapter(self, adapter_id: int) -> Adapter:
        return self._by_id[adapter_id]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def infos(self) -> tuple[LoraInfo, ...]:
        return tuple(LoraInfo(name, i, a.path, a.rank, a.target_weights) for name, (i, a) in self._by_name.items())


def parse_lora_module(item: str) -> tuple[str, str]:
    """One --lora-modules entry, in either of vLLM's forms: NAME=DIR, or JSON {"name": ..., "path": ...}."""
    text = item.strip()
    if text.startswith("{"):
        import json
        try:
            entry = json.loads(text)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError):
            raise LoraError(f"--lora-modules {item!r}: a JSON entry needs \"name\" and \"path\"") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise LoraError(f"--lora-modules {item!r}: expected NAME=DIR (or JSON {{\"name\": ..., \"path\": ...}})")
    return name, path

"""How many KV-cache pages fit: the same arithmetic at engine start-up and in `jaxserve estimate`."""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxserve.config import EngineConfig, ModelConfig

CPU_DEFAULT_KV_FRACTION_OF_RAM = 0.25  # the CPU backend shares RAM with the host: take a quarter of what is free


@dataclasses.dataclass(frozen=True)
class KVPlan:
    num_pages: int  # including the null page
    page_size: int
    bytes_per_page: int
    budget_bytes: int  # what the cache was allowed
    wanted_pages: int  # what max_num_seqs sequences at max_model_len would use

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def max_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int, scale_bytes: int = 0) -> int:
    """K and V bytes of one token in every layer; `scale_bytes` per token and KV head (4 for an int8 cache)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * itemsize + scale_bytes)


def plan_kv_cache(cfg: ModelConfig, engine: EngineConfig, max_model_len: int, itemsize: int,
                  free_bytes: int, scale_bytes: int = 0, kv_shards: int = 1) -> KVPlan:
    """Pages for the KV cache: the explicit budget, else `kv_cache_fraction` of free memory; never more than
    max_num_seqs full-length sequences need (plus the null page). Budgets and bytes are per device: with the KV
    heads split over `kv_shards` devices (tensor parallelism), a page takes 1/kv_shards of its bytes on each."""
    page_size = engine.page_size
    bytes_per_page = kv_bytes_per_token(cfg, itemsize, scale_bytes) * page_size // kv_shards
    wanted = engine.max_num_seqs * math.ceil(max_model_len / page_size) + 1
    budget = int(engine.kv_cache_memory) if engine.kv_cache_memory else int(free_bytes * engine.kv_cache_fraction)
    num_pages = min(wanted, budget // bytes_per_page)
    if num_pages < math.ceil(max_model_len / page_size) + 1:
        raise MemoryError(
            f"the KV cache budget ({budget / 2**20:.0f} MiB) holds {max(num_pages - 1, 0) * page_size} tokens, "
            f"less than one sequence of max_model_len {max_model_len}; lower --max-model-len or raise "
            f"--kv-cache-memory / --kv-cache-fraction")
    return KVPlan(num_pages, page_size, bytes_per_page, budget, wanted)


def free_device_memory(device: jax.Device | None = None) -> int:
    """Bytes the KV cache may draw from on this device, measured after the weights are loaded."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(_available_ram() * CPU_DEFAULT_KV_FRACTION_OF_RAM)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30

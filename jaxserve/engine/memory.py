"""How many KV-cache pages fit: the same arithmetic at engine start-up and in `jaxserve estimate`.

Per device, after the weights and the slot state are on it (`free`), and once the step executables are compiled:

    temporaries   the largest step's transient bytes: memory_analysis() temp + outputs - donated (aliased) inputs
    margin        TEMPORARIES_MARGIN x temporaries (shapes not measured, fragmentation), at least MIN_MARGIN_BYTES
    budget        free x kv_cache_fraction - temporaries - margin    (or exactly --kv-cache-memory bytes, if given)
    pages         min(budget // bytes per page, max_num_seqs full-length sequences + the null page)

An explicit --kv-cache-memory is the KV cache's own size, not a total: it must fit beside the temporaries and margin
in free memory, else start-up fails.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import jax

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.quant.memory import kv_bytes_per_token

CPU_DEFAULT_KV_FRACTION_OF_RAM = 0.25  # the CPU backend shares RAM with the host: take a quarter of what is free
TEMPORARIES_MARGIN = 0.1  # on top of the measured temporaries: unmeasured shapes' variation, allocator slack
MIN_MARGIN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class KVPlan:
    num_pages: int  # including the null page
    page_size: int
    bytes_per_page: int
    budget_bytes: int  # what the cache was allowed
    wanted_pages: int  # what max_num_seqs sequences at max_model_len would use
    free_bytes: int = 0  # per device, after the weights and slot state
    temporaries: int = 0  # the largest step executable's transient bytes (measured, or estimated)
    margin: int = 0

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def max_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size


def wanted_pages(engine: EngineConfig, max_model_len: int) -> int:
    """Pages of max_num_seqs sequences at max_model_len, plus the null page: the cache never grows past this."""
    return engine.max_num_seqs * math.ceil(max_model_len / engine.page_size) + 1


def reserve_margin(temporaries: int) -> int:
    return max(int(temporaries * TEMPORARIES_MARGIN), MIN_MARGIN_BYTES)


def plan_kv_cache(cfg: ModelConfig, engine: EngineConfig, max_model_len: int, kv_dtype, free_bytes: int,
                  temporaries: int, kv_shards: int = 1, draft: ModelConfig | None = None) -> KVPlan:
    """Pages for the KV cache of storage dtype `kv_dtype` (see the module docstring). Budgets and bytes are per
    device: with the KV heads split over `kv_shards` devices (tensor parallelism), a page takes 1/kv_shards of its
    bytes on each. With a `draft` model (speculative decoding), each page also has the draft's K/V for its
    tokens, in a cache of its own (jaxserve.spec.draft)."""
    page_size = engine.page_size
    per_token = kv_bytes_per_token(cfg, "auto", kv_dtype)
    if draft is not None:
        per_token += kv_bytes_per_token(draft, "auto", kv_dtype)
    bytes_per_page = per_token * page_size // kv_shards
    wanted = wanted_pages(engine, max_model_len)
    margin = reserve_margin(temporaries)
    room = free_bytes - temporaries - margin
    budget = int(engine.kv_cache_memory) if engine.kv_cache_memory else int(free_bytes * engine.kv_cache_fraction) - \
        temporaries - margin
    num_pages = max(0, min(wanted, budget // bytes_per_page))
    if num_pages < math.ceil(max_model_len / page_size) + 1:
        raise MemoryError(
            f"the KV cache budget ({budget / 2**20:.0f} MiB: {free_bytes / 2**20:.0f} MiB free after the weights, "
            f"{temporaries / 2**20:.1f} MiB of step temporaries + {margin / 2**20:.1f} MiB margin) holds "
            f"{max(num_pages - 1, 0) * page_size} tokens, less than one sequence of max_model_len {max_model_len}; "
            f"lower --max-model-len or --max-num-batched-tokens, or raise --kv-cache-memory / --kv-cache-fraction")
    if num_pages * bytes_per_page > room:
        raise MemoryError(
            f"--kv-cache-memory {budget / 2**20:.0f} MiB does not fit: {free_bytes / 2**20:.0f} MiB are free after "
            f"the weights, and the step temporaries take {temporaries / 2**20:.1f} MiB + {margin / 2**20:.1f} MiB "
            f"margin; give at most {max(room, 0) / 2**20:.0f} MiB")
    return KVPlan(num_pages, page_size, bytes_per_page, budget, wanted, free_bytes, temporaries, margin)


def transient_bytes(compiled: Iterable[jax.stages.Compiled]) -> int:
    """The most any one of these executables needs beyond its persistent arguments: its temporaries plus the
    outputs that do not reuse a donated input's buffer (memory_analysis(), per device)."""
    most = 0
    for executable in compiled:
        m = executable.memory_analysis()
        if m is not None:
            most = max(most, m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    return most


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

"""What one device can do at best, measured once per device kind by two short probes and cached on disk:

    bandwidth   a copy probe: x = x + 1 in place over a buffer larger than any cache, a few passes inside one
                executable (each pass reads and writes the buffer: 2 x nbytes per pass)
    flops       a matmul probe: [n, n] @ [n, n] in the model's dtype (2 n^3 FLOPs)

Both take the best of a few timed runs after a warm-up. The cache file (`device-ceilings.json` in the compilation
cache directory) is keyed by platform, device kind, dtype and jax version. If a probe fails (no memory left beside
the KV cache, say), a GPU falls back to its datasheet figures (jaxserve.observability.gpus).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.observability.gpus import gpu_for_device_kind

log = logging.getLogger(__name__)
CACHE_FILE = "device-ceilings.json"


@dataclasses.dataclass(frozen=True)
class ProbeSize:
    copy_bytes: int
    copy_passes: int
    matmul_n: int
    repeats: int = 3


# Accelerators: 256 MiB updated 8 times per call (~1 ms on an H100, so launch overhead is noise) and an 8192^3
# matmul (~1.1 TFLOP). CPU: 64 MiB (past the last-level cache) once per call and a 1024^3 matmul: about a second
# on a busy 2-core machine.
PROBE_SIZES = {"cpu": ProbeSize(64 * 2**20, 1, 1024, repeats=5), "default": ProbeSize(256 * 2**20, 8, 8192)}


@dataclasses.dataclass(frozen=True)
class DeviceCeilings:
    device_kind: str
    dtype: str  # the matmul probe's dtype (the model's)
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s
    source: str  # "measured" | "datasheet" | "given"

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a step is compute-bound on this device (the roofline's knee)."""
        return self.flops / self.bandwidth


def device_ceilings(device: jax.Device, dtype: str, cache_dir: str | os.PathLike | None) -> DeviceCeilings:
    """The cached ceilings of this device kind, else measured now (and cached when cache_dir is given)."""
    key = f"{device.platform}|{device.device_kind}|{dtype}|jax {jax.__version__}"
    path = Path(cache_dir) / CACHE_FILE if cache_dir else None
    cached = _read_cache(path).get(key)
    if cached is not None:
        return DeviceCeilings(**cached)
    ceilings = measure_ceilings(device, dtype)
    if path is not None and ceilings.source == "measured":
        _write_cache(path, key, ceilings)
    return ceilings


def measure_ceilings(device: jax.Device, dtype: str) -> DeviceCeilings:
    size = PROBE_SIZES.get(device.platform, PROBE_SIZES["default"])
    try:
        started = time.perf_counter()
        ceilings = DeviceCeilings(device.device_kind, dtype, measure_copy_bandwidth(device, size),
                                  measure_matmul_flops(device, size, dtype), "measured")
        log.info("device ceilings of %s (%.1fs to measure): copy %s, %s matmul %s", device.device_kind,
                 time.perf_counter() - started, si_rate(ceilings.bandwidth, "B/s"), dtype,
                 si_rate(ceilings.flops, "FLOP/s"))
        return ceilings
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory beside the KV cache: fall back, never fail a server
        spec = gpu_for_device_kind(device.device_kind)
        if spec is None:
            raise
        log.warning("device ceiling probes failed (%s); using the %s datasheet figures", exc, spec.name)
        return DeviceCeilings(device.device_kind, dtype, spec.bandwidth, spec.bf16_flops, "datasheet")


def si_rate(value: float, unit: str) -> str:
    """4.4e10, "FLOP/s" -> "44 GFLOP/s": three significant digits at the nearest SI prefix."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def measure_copy_bandwidth(device: jax.Device, size: ProbeSize) -> float:
    """In place (the buffer is donated), as a step updates its KV cache: no fresh pages to fault in."""
    x = jax.device_put(jnp.zeros(size.copy_bytes // 4, jnp.float32), device)
    copy = jax.jit(lambda x: jax.lax.fori_loop(0, size.copy_passes, lambda i, y: y + 1.0, x), donate_argnums=0)
    seconds, _ = _best_time(copy, x, size.repeats, chain=True)
    return 2 * size.copy_bytes * size.copy_passes / seconds


def measure_matmul_flops(device: jax.Device, size: ProbeSize, dtype: str) -> float:
    n = size.matmul_n
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    seconds, _ = _best_time(jax.jit(lambda a: a @ a), a, size.repeats)
    return 2 * n**3 / seconds


def _best_time(fn, x, repeats: int, chain: bool = False):
    """Best of `repeats` timed calls after a warm-up; `chain` feeds each output back in (donated inputs)."""
    y = fn(x).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        arg = y if chain else x
        started = time.perf_counter()
        y = fn(arg).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return best, y


def _read_cache(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, ceilings: DeviceCeilings) -> None:
    """Atomic replace, so concurrent servers never read half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache(path)
        entries[key] = dataclasses.asdict(ceilings)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not cache the device ceilings in %s: %s", path, exc)

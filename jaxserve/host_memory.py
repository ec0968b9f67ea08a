"""Host allocator settings for the CPU backend: keep XLA's per-step buffers resident instead of faulting them in.

XLA:CPU allocates each executable's temporary buffers with malloc at every call and frees them after. With glibc's
defaults those blocks (tens of MB for a decode step at batch 64: the [rows, vocab] logits and the sampler's
copies of them) come from mmap or from per-thread arenas that are shrunk on free, so every step faults them in
again page by page: 8,000 minor faults (32 MB) per call of the small Llama's batch-64 decode step, 26% of its
time on a 2-vCPU Zen 3 VM (bench/fused_step_ab.py, RESULTS.md "Host allocator"). One arena that never returns memory
to the OS and never mmaps makes the second call reuse the first one's pages: zero faults per step.

`tune()` applies that with mallopt when jaxserve is imported, on Linux/glibc, when the process can only run JAX on
the CPU (no GPU or TPU plugin installed, or JAX_PLATFORMS names cpu first). It has to run before JAX starts its
threads (a thread keeps the arena it already has), so jaxserve/__init__.py calls it. Because freed memory then
stays with the process, `release()` hands the free pages back once, after the engine has loaded its weights and
compiled (their host-side copies are gone by then); the pages the steps use come back on the first steps and stay.
`JAXSERVE_HOST_MALLOC=default` keeps glibc's defaults (for a process that embeds jaxserve and wants them).
"""

from __future__ import annotations

import ctypes
import importlib.util
import platform
import sys

from jaxserve.config import env_str

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
_libc = None  # set when tune() applied the settings


def cpu_only() -> bool:
    """Whether JAX in this process can only use the CPU backend."""
    platforms = (env_str("JAX_PLATFORMS") or "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS)


def tune() -> bool:
    """One malloc arena, no mmap, no trimming on free (see the module docstring). True when applied."""
    global _libc
    if _libc is not None:
        return True
    if (env_str("JAXSERVE_HOST_MALLOC") or "tuned") == "default" or not sys.platform.startswith("linux"):
        return False
    if platform.libc_ver()[0] != "glibc" or not cpu_only():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not (libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_MMAP_MAX, 0)
            and libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))):
        return False
    _libc = libc
    return True


def release() -> None:
    """Return the heap's free pages to the OS once (after loading and compiling); a no-op unless tune() applied."""
    if _libc is not None:
        _libc.malloc_trim(0)

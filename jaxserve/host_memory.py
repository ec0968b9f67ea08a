"""Host allocator settings for the CPU backend: keep XLA's per-step buffers resident instead of faulting them in.

XLA:CPU allocates each executable's temporary buffers with malloc at every call and frees them after. With glibc's
defaults those blocks (tens of MB for a decode step at batch 64: the [rows, vocab] logits and the sampler's
copies of them) come from mmap or from per-thread arenas that are shrunk on free, so every step faults them in
again page by page: 8,000 minor faults (32 MB) per call of the small Llama's batch-64 decode step, 26% of its
time on a 2-vCPU Zen 3 VM (bench/fused_step_ab.py, RESULTS.md "Host allocator"). One arena that never returns memory
to the OS and never mmaps makes later calls reuse earlier calls' pages: most steps fault nothing. Not all: glibc
carves small allocations out of a freed large block, so a step's 64 MB block sometimes fits no free chunk and the
heap grows, faulting the new pages in once. On a loaded 2-vCPU Zen 3 VM a [256, 32000] probe grew the heap in 64 MB
steps at calls 0-4, 21, 23, 26 and 42 (630 MB of heap for ~100 MB of temporaries), then not once in 1,458 calls.

`tune()` applies that with mallopt when jaxserve is imported, on Linux/glibc, when the process can only run JAX on
the CPU (no GPU or TPU plugin installed, or JAX_PLATFORMS names cpu first). It has to run before JAX starts its
threads (a thread keeps the arena it already has), so jaxserve/__init__.py calls it. Because freed memory then
stays with the process, `release()` hands the free pages back once, after the engine has loaded its weights and
compiled (their host-side copies are gone by then); the pages the steps use come back on the first steps and stay.
`JAXSERVE_HOST_MALLOC=default` keeps glibc's defaults (for a process that embeds jaxserve and wants them).

`huge_pages()` then backs the memory every step reads (the weights, the KV cache) with 2 MB pages: a decode step
streams hundreds of MB, and with 4 KB pages each 4 KB is a TLB miss and a page walk. It asks the kernel with
madvise: MADV_HUGEPAGE, then MADV_COLLAPSE (Linux 6.1+), which turns the pages already there into huge ones at
once. A kernel that refuses (older, THP `never`, no free huge pages) leaves the 4 KB pages and nothing else changes.
On a 2-vCPU Zen 4 VM the small preset's float32 batch-1 decode step went from 15.3-16.9 ms to 13.9-15.0 ms
(bench/offline_throughput.py, runs alternating with and without; RESULTS.md, issue 22).
"""

from __future__ import annotations

import ctypes
import importlib.util
import platform
import sys

from jaxserve.config import env_str

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE_PAGE = 2 << 20
MIN_HUGE_BYTES = 2 * HUGE_PAGE  # smaller arrays hold no whole aligned huge page worth asking for
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


def huge_pages(arrays) -> int:
    """Backs the CPU buffers of `arrays` (jax.Arrays, every addressable shard) with 2 MB pages where the kernel
    agrees: each buffer's whole aligned 2 MB pages are advised MADV_HUGEPAGE and collapsed. Returns the bytes
    collapsed (0 where refused, or unless tune() applied). Call it once the buffers exist and stay (after loading,
    after the cache is allocated)."""
    if _libc is None:
        return 0
    madvise = _libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed = 0
    for array in arrays:
        for shard in getattr(array, "addressable_shards", ()):
            data = shard.data
            if data.nbytes < MIN_HUGE_BYTES or shard.device.platform != "cpu" or data.is_deleted():
                continue
            start = data.unsafe_buffer_pointer()
            first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + data.nbytes) // HUGE_PAGE * HUGE_PAGE
            if last > first and madvise(first, last - first, MADV_HUGEPAGE) == 0 \
                    and madvise(first, last - first, MADV_COLLAPSE) == 0:
                collapsed += last - first
    return collapsed

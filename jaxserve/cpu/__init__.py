"""Kernels for the CPU backend in C++, called from XLA through its FFI: paged attention (paged_attention.cc) and a
matmul that reads stacked weights in place (matmul.cc).

Why attention: XLA's attention path gathers each sequence's pages into a dense copy before attending. On a CPU,
whose memory bandwidth is a few GB/s per core, that copy costs more than the attention itself (at batch 64 and
256-token contexts it doubled the small Llama's decode step). The kernel reads the pages where they are.

Why the matmul: a decode step's projections read every weight once for a few rows, so with one or two rows they
run at the speed weights stream from memory, and up to a few dozen at the rate of multiply-adds over weights that
stream once; XLA:CPU first copies each layer's slice out of the stacked [layers, ...] weight, and its dot streams
below what this machine copies at. A prompt step's products (hundreds of rows) are bound by multiply-adds
instead, where XLA's dot reached 0.56-0.69 of the multiply-add peak on one VM, 0.82 on another
(bench/cpu_peak.py). The kernel reads the layer's slice in place, float32, bfloat16 or int8 (per-channel scales):
streaming for one or two rows (float32), register-blocked tiles up to 64, cache-blocked bands of packed weights
beyond. An engine stores the weights it reads in 64-column panels (`pack`, once, when it is built), which a decode
step streams in long sequential runs, and multiplies a layer's q, k and v (and gate and up) in one call
(`matmuls`). Its reference is the einsum (jaxserve.models.linear).

The kernels are compiled on first use with the system's C++ compiler (`$CXX`, else c++) against the jaxlib FFI
headers, for this machine's instruction set, into one library cached under the jaxserve cache directory keyed by
the sources, the compiler and the CPU. Without a compiler, `available()` is False and the engine keeps the XLA
paths (its start-up log says so). The attention reference is jaxserve.models.attention.ragged_attention_xla.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import default_compilation_cache_dir, env_str

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = (HERE / "paged_attention.cc", HERE / "matmul.cc")
HEADERS = (HERE / "common.h",)
TARGET = "jaxserve_cpu_paged_attention"
MATMUL_TARGET = "jaxserve_cpu_matmul"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-w")


def paged_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
                    block_tables: jax.Array, context_lens: jax.Array, query_start: jax.Array, *, scale: float,
                    sliding_window: int | jax.Array | None, softcap: float | None = None) -> jax.Array:
    """Ragged paged attention, decode included (query_start = arange). q [T, H, D] -> [T, H, D]; the layout and
    the contract are those of pallas_kernels.ragged_paged_attention (sliding_window may be a traced int32, 0 for
    none). Needs `available()`."""
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built; use attention='xla'")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)
    return call(q, cache_k, cache_v, jnp.asarray(layer, jnp.int32).reshape(1), window, block_tables.astype(jnp.int32),
                context_lens.astype(jnp.int32), query_start.astype(jnp.int32), scale=np.float32(scale),
                softcap=np.float32(softcap or 0.0))


PACK_COLUMNS = 64  # a packed weight's panel width (matmul.cc kPackCols)


def packable(w) -> bool:
    """Whether a stacked weight [L, K, N] can be packed: N is whole panels."""
    return w.ndim == 3 and w.shape[2] % PACK_COLUMNS == 0


@jax.jit
def pack(w: jax.Array) -> jax.Array:
    """[L, K, N] -> [L, N / 64, K, 64]: each 64 columns' K rows contiguous, the layout matmul streams fastest (one
    sequential run per panel instead of K short runs N apart; see matmul.cc). A new array; w is left as it is."""
    layers, k, n = w.shape
    return w.reshape(layers, k, n // PACK_COLUMNS, PACK_COLUMNS).transpose(0, 2, 1, 3)


def unpack(w: jax.Array) -> jax.Array:
    """pack's inverse: [L, N / 64, K, 64] -> [L, K, N]."""
    layers, panels, k, cols = w.shape
    return w.transpose(0, 2, 1, 3).reshape(layers, k, panels * cols)


def matmul(x: jax.Array, w: jax.Array, layer, scales: jax.Array | None = None, rows=None) -> jax.Array:
    """x [M, K] @ w[layer] -> [M, N] float32, reading the layer's slice of a stacked weight in place: w [L, K, N], or
    packed [L, N / 64, K, 64] (`pack`; faster), or [K, N] (one layer). Float32 or bfloat16 weights; int8 weights with
    scales [L, N] (or [N]) per output channel. `rows` (an int or int32 scalar, None: M): x's leading rows to
    multiply; the others are a step's padding and come back as zeros, at no cost. Needs `available()`."""
    return matmuls(x, [(w, scales)], layer, rows)[0]


def matmuls(x: jax.Array, weights, layer, rows=None) -> list[jax.Array]:
    """[x @ w[layer] for (w, scales) in weights] in one call (as `matmul`, each weight its own layout and dtype):
    a decode step's q, k and v products, or gate and up, wait for the threads once instead of once each."""
    if not available():
        raise RuntimeError("the CPU kernels could not be built; use matmul='xla'")
    operands, outputs = [], []
    for w, scales in weights:
        w = w if w.ndim >= 3 else w[None]
        n = w.shape[1] * w.shape[3] if w.ndim == 4 else w.shape[2]
        if w.dtype == jnp.int8:
            if scales is None:
                raise ValueError("int8 weights need their per-channel scales")
            scales = scales.astype(jnp.float32).reshape(w.shape[0], n)
        else:
            scales = jnp.zeros((1, 1), jnp.float32)
        operands += [w, scales]
        outputs.append(jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    call = jax.ffi.ffi_call(MATMUL_TARGET, outputs)
    rows = jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32).reshape(1)
    return list(call(x, jnp.asarray(layer, jnp.int32).reshape(1), rows, *operands))


def supports(cache_dtype) -> bool:
    """float32 and bfloat16 caches; quantized caches keep the XLA path."""
    return jnp.dtype(cache_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Builds (once per machine), loads and registers the kernel; False if that is impossible here."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as exc:
        detail = (getattr(exc, "stderr", None) or "").strip()[-2000:]
        log.warning("CPU attention kernel unavailable (%s)%s; attention runs on XLA's gather path", exc,
                    f":\n{detail}" if detail else "")
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxservePagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(library.JaxserveMatmul), platform="cpu")
    return True


def compiler() -> str | None:
    return env_str("CXX") or shutil.which("c++") or shutil.which("g++")


def _build() -> Path:
    compiler_path = compiler()
    if compiler_path is None:
        raise FileNotFoundError("no C++ compiler (set CXX)")
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES + HEADERS), version, " ".join(FLAGS), platform.machine(),
                                    _cpu_model(), jax.__version__]).encode()).hexdigest()[:16]
    library = Path(default_compilation_cache_dir()).parent / "cpu_kernels" / f"kernels-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        subprocess.run([compiler_path, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(built)], check=True,
                       capture_output=True, text=True)
        os.replace(built, library)  # atomic: a concurrent build by another process is harmless
    log.info("built the CPU kernels: %s", library)
    return library


def _cpu_model() -> str:
    """The CPU's name and feature flags (-march=native code is only good for the same features)."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [line for line in fh if line.startswith(("model name", "flags"))]
        return "".join(lines[:1] + [line for line in lines if line.startswith("flags")][:1])
    except OSError:
        return platform.processor()

"""The kernels a model runs, chosen once: a frozen bundle of callables the model calls without asking which.

    kernels = Kernels.resolve(attention="auto", matmul="auto", kv_dtype=jnp.bfloat16)   # at engine start
    out = kernels.decode_attention(q, cache, layer, meta, scale=s, sliding_window=w, softcap=c)   # in the model
    kernels.attention_name                                                              # "pallas" | "cpu" | "xla"

Choices (the engine resolves `auto` from the backend and the cache dtype, once):

    attention  "pallas"  pallas_kernels' paged (decode) and ragged kernels: compiled on a GPU, interpreted elsewhere
               "cpu"     the C++ kernel of jaxserve.cpu (float caches on the CPU backend), decode and ragged alike
               "xla"     the jnp implementations in jaxserve.models.attention, everywhere
    matmul     "pallas"  pallas_kernels.quant_matmul for quantized weights, run under shard_map (GSPMD cannot split
                         a kernel); "xla" the jnp product of jaxserve.quant.schemes. Float weights are one einsum.
               "cpu"     (one device on the CPU backend) the C++ kernel of jaxserve.cpu for the products with float
                         or int8 weights, decode and prompt steps alike, reading a layer's slice of the stacked
                         weights in place; XLA for the rest, as "xla"
    grouped    MoE experts (jaxserve.models.moe.grouped_matmul): jax.lax.ragged_dot, except for decode-sized steps
               on a CPU (decided when the step is traced, like interpret mode), whose lowering of ragged_dot
               multiplies every expert with every row; there the tiled grouped matmul.

A bundle is hashable and compares equal to another resolved from the same names (its fields are module-level
functions), so jit can close over it as a static value.

Contracts (the model calls these inside shard_map, on the KV heads one device holds):

    attention(q [T, H, D], cache: KVCache, layer, meta: AttentionMetadata, *, scale, sliding_window, softcap)
        -> [T, H, D]: any mix of prompt chunks and decode tokens; decode_attention: the same for one query per
        sequence. sliding_window: None, an int, or a traced int32 (0: none); softcap: None or a float
    matmul(x [M, K], values, scales[, zeros], *, scheme) -> [M, N] float32   (quantized weight as its matrix view;
        scheme: a jaxserve.quant.schemes name; act-order is applied to x before)
    stacked_matmul(x [M, K], w [L, K, N], layer, scales [L, N] | None, rows) -> [M, N] float32   (rows: x's leading
        rows that are real tokens, an int32 scalar or None for all; the rest are padding, their products zeros)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve import cpu
from jaxserve.kv.cache import AttentionMetadata, KVCache
from jaxserve.models import moe
from jaxserve.models.attention import decode_attention_xla, ragged_attention_xla
from jaxserve.quant import schemes
from pallas_kernels import paged_attention as pa, quant_matmul as qm, ragged_paged_attention as rpa

ATTENTION_CHOICES = ("pallas", "cpu", "xla")
MATMUL_CHOICES = ("pallas", "cpu", "xla")
# the weight types the CPU kernel reads in place, at every row count, where it beats XLA's dot (bench/cpu_matmul.py,
# the small preset's projections, 2-vCPU AMD EPYC VM with AVX-512, XLA / kernel at 2 / 16 / 64 / 128 / 512 / 2048
# rows: float32 2.14 / 1.38 / 1.32 / 1.17 / 1.05 / 1.02x, int8 3.06 / 1.97 / 1.27 / 1.19 / 1.11 / 1.04x, bfloat16
# 2.87 / 1.82 / 1.35 / 1.14 / 1.06 / 1.02x)
CPU_MATMUL_DTYPES = ("float32", "bfloat16", "int8")


@dataclasses.dataclass(frozen=True)
class Kernels:
    attention_name: str  # "pallas" | "cpu" | "xla": for logs, metrics and the bucket ladder
    matmul_name: str  # "pallas" | "cpu" | "xla"
    attention: Callable = dataclasses.field(repr=False)  # ragged paged attention
    decode_attention: Callable = dataclasses.field(repr=False)  # one query per sequence
    matmul: Callable = dataclasses.field(repr=False)  # quantized weights only
    matmul_under_shard_map: bool  # an opaque kernel: split like the weight by hand (jaxserve.models.linear)
    # reads stacked weights in place, several in one call: (x, [(w, scales), ...], layer, rows) -> [x @ w[layer], ...]
    stacked_matmul: Callable | None = dataclasses.field(default=None, repr=False)
    # products with weights stored in one of stacked_dtypes go to stacked_matmul
    stacked_dtypes: tuple[str, ...] = ()
    # stacked [layers, K, N] -> the layout stacked_matmul streams fastest, None where the shape does not allow (the
    # engine packs the weights it reads once, at build: jaxserve.models.llama.pack_weights); None: no such layout
    pack: Callable | None = dataclasses.field(default=None, repr=False)
    grouped_matmul: Callable = dataclasses.field(default=moe.grouped_matmul, repr=False)  # MoE experts

    @classmethod
    def resolve(cls, attention: str = "auto", matmul: str = "auto", kv_dtype=None,
                tensor_parallel_size: int = 1) -> "Kernels":
        """The bundle for config values `auto|pallas|cpu|xla` (both) on this backend."""
        attention_name = resolve_attention(attention, kv_dtype)
        matmul_name = resolve_matmul(matmul, tensor_parallel_size)
        ragged, decode = _ATTENTION[attention_name]
        stacked = matmul_name == "cpu"
        return cls(attention_name, matmul_name, ragged, decode, _MATMUL[matmul_name],
                   matmul_under_shard_map=matmul_name == "pallas", stacked_matmul=cpu.matmuls if stacked else None,
                   stacked_dtypes=CPU_MATMUL_DTYPES if stacked else (), pack=_cpu_pack if stacked else None)

    def reads_stacked(self, weight_dtype="float32") -> bool:
        """Whether products with weights stored as `weight_dtype` run on stacked_matmul (then the layer scan leaves
        those weights stacked)."""
        return self.stacked_matmul is not None and jnp.dtype(weight_dtype).name in self.stacked_dtypes

    def describe(self) -> str:
        return f"{self.attention_name} attention, {self.matmul_name} matmul"


def resolve_attention(choice: str, kv_dtype=None) -> str:
    """`auto`: the Pallas kernels on a GPU; on a CPU the C++ kernel for float caches if it builds, else XLA."""
    if choice == "auto":
        backend = jax.default_backend()
        if backend == "gpu":
            return "pallas"
        usable = backend == "cpu" and kv_dtype is not None and cpu.supports(kv_dtype) and cpu.available()
        return "cpu" if usable else "xla"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be auto, pallas, cpu or xla, not {choice!r}")
    return choice


def resolve_matmul(choice: str, tensor_parallel_size: int = 1) -> str:
    """`auto`: the Pallas kernel (quantized weights) on a GPU; on a CPU the C++ kernel (every step's products with
    float or int8 weights) when the model is on one device and the kernel builds; else XLA."""
    if choice == "auto":
        backend = jax.default_backend()
        if backend == "gpu":
            return "pallas"
        return "cpu" if backend == "cpu" and tensor_parallel_size == 1 and cpu.available() else "xla"
    if choice not in MATMUL_CHOICES:
        raise ValueError(f"matmul must be auto, pallas, cpu or xla, not {choice!r}")
    if choice == "cpu" and tensor_parallel_size != 1:
        raise ValueError("matmul='cpu' runs on one device; use matmul='xla' with tensor parallelism")
    return choice


def _interpret() -> bool:
    """Pallas kernels compile on a GPU and run interpreted elsewhere (decided when the step is traced)."""
    return jax.default_backend() != "gpu"


def _scale_pools(cache: KVCache) -> dict:
    return dict(k_scale=cache.k_scale, v_scale=cache.v_scale)


def _xla_decode(q, cache: KVCache, layer, meta: AttentionMetadata, *, scale, sliding_window, softcap=None):
    return decode_attention_xla(q, cache.k, cache.v, layer, meta.block_tables, meta.context_lens, scale=scale,
                                sliding_window=sliding_window, softcap=softcap, **_scale_pools(cache))


def _xla_ragged(q, cache: KVCache, layer, meta: AttentionMetadata, *, scale, sliding_window, softcap=None):
    return ragged_attention_xla(q, cache.k, cache.v, layer, meta, scale=scale, sliding_window=sliding_window,
                                softcap=softcap, **_scale_pools(cache))


def _pallas_decode(q, cache: KVCache, layer, meta: AttentionMetadata, *, scale, sliding_window, softcap=None):
    return pa.paged_attention(q, cache.k, cache.v, layer, meta.block_tables, meta.context_lens, scale=scale,
                              sliding_window=sliding_window, softcap=softcap, interpret=_interpret(),
                              **_scale_pools(cache))


def _pallas_ragged(q, cache: KVCache, layer, meta: AttentionMetadata, *, scale, sliding_window, softcap=None):
    return rpa.ragged_paged_attention(q, cache.k, cache.v, layer, meta.block_tables, meta.context_lens,
                                      meta.query_start, scale=scale, sliding_window=sliding_window,
                                      softcap=softcap, interpret=_interpret(), **_scale_pools(cache))


def _cpu_attention(q, cache: KVCache, layer, meta: AttentionMetadata, *, scale, sliding_window, softcap=None):
    """Decode included: a decode step's query_start is arange(S + 1)."""
    return cpu.paged_attention(q, cache.k, cache.v, layer, meta.block_tables, meta.context_lens, meta.query_start,
                               scale=scale, sliding_window=sliding_window, softcap=softcap)


def _cpu_pack(w):
    return cpu.pack(w) if cpu.packable(w) else None


def _xla_matmul(x, values, scales, zeros=None, *, scheme):
    return schemes.xla_matmul(x, values, scales, scheme, zeros)


def _pallas_matmul(x, values, scales, zeros=None, *, scheme):
    return qm.quant_matmul(x, values, scales, zeros, scheme=schemes.parse(scheme).kind, interpret=_interpret())


_ATTENTION = {"xla": (_xla_ragged, _xla_decode), "pallas": (_pallas_ragged, _pallas_decode),
              "cpu": (_cpu_attention, _cpu_attention)}
_MATMUL = {"xla": _xla_matmul, "pallas": _pallas_matmul, "cpu": _xla_matmul}  # cpu: stacked_matmul, else XLA

XLA = Kernels.resolve("xla", "xla")  # the default of the model's entry points: runs on every backend

"""The CPU matmul kernel (jaxserve/cpu/matmul.cc) against XLA's dot on a decode step's projections: the small
preset's 12 layers of q/k/v/o/gate/up/down weights stacked [layers, K, N], M rows, one jitted scan over the layers
(XLA indexes each layer's slice, as the model does), interleaved in one process; the kernel on the weights as
they are and packed in 64-column panels (jaxserve.cpu.pack, as an engine stores them). Reports ms per pass, the
weights' GB/s and that as a fraction of this machine's copy bandwidth measured in the same run (numpy copy of
512 MB).

    python bench/cpu_matmul.py [--rows 1 4 16 32] [--dtype float32 bfloat16 int8] [--rounds 15]
"""
import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import cpu

LAYERS, E, F, H, KVH, D = 12, 768, 2048, 12, 4, 64
SHAPES = {"wq": (E, H * D), "wk": (E, KVH * D), "wv": (E, KVH * D), "wo": (H * D, E), "w_gate": (E, F),
          "w_up": (E, F), "w_down": (F, E)}


def copy_bandwidth() -> float:
    a, b = _page_aligned(128 << 20), _page_aligned(128 << 20)
    a[:] = 1.0
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best  # read + write


def _page_aligned(n: int) -> np.ndarray:
    """n float32 starting on a 4 KB boundary. A plain np.empty comes from glibc's heap when jaxserve's allocator
    settings are on (jaxserve/host_memory.py), 16 bytes past a boundary, and glibc's memcpy of a destination so
    misaligned ran at 8.5 GB/s on a Zen 3 VM where an aligned one ran at 31 (its non-temporal stores split lines)."""
    raw = np.empty(n + 1024, np.float32)
    skip = (-raw.ctypes.data % 4096) // 4
    return raw[skip:skip + n]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weights(dtype: str, rng):
    out = {}
    for name, (k, n) in SHAPES.items():
        if dtype == "int8":
            out[name] = (jnp.asarray(rng.integers(-127, 128, (LAYERS, k, n)), jnp.int8),
                         jnp.asarray(rng.random((LAYERS, n)) * 0.01, jnp.float32))
        else:
            out[name] = (jnp.asarray(rng.standard_normal((LAYERS, k, n)) * 0.02, dtype), None)
    return out


def passes():
    """{"xla": fn, "cpu": fn}, fn(x, ws) -> x after the 12 layers' products; the weights are arguments, as the
    model's are (a jitted function's closed-over arrays become constants, which XLA:CPU handles differently)."""
    def product(kernel):
        def one_layer(ws, x, layer):
            acc = x
            for w, s in ws.values():
                k = w.shape[2] if w.ndim == 4 else w.shape[1]  # packed: [L, N / 64, K, 64]
                xin = jnp.resize(acc, (acc.shape[0], k)) if acc.shape[1] != k else acc
                if kernel != "xla":
                    y = cpu.matmul(xin, w, layer, s)
                else:
                    wl = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
                    y = jnp.einsum("mk,kn->mn", xin, wl.astype(jnp.float32) if s is not None else wl,
                                   preferred_element_type=jnp.float32)
                    y = y * jax.lax.dynamic_index_in_dim(s, layer, keepdims=False) if s is not None else y
                acc = acc + jnp.resize(y, acc.shape) * 1e-3
            return acc, None
        return jax.jit(lambda x, ws: jax.lax.scan(functools.partial(one_layer, ws), x,
                                                  jnp.arange(LAYERS, dtype=jnp.int32))[0])
    return {"xla": product("xla"), "cpu": product("cpu"), "packed": product("packed")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "int8"])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    assert cpu.available(), "the CPU kernels did not build"
    rng = np.random.default_rng(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s")
    for dtype in args.dtype:
        ws = weights(dtype, rng)
        inputs = {"xla": ws, "cpu": ws, "packed": {name: (cpu.pack(w), s) for name, (w, s) in ws.items()}}
        nbytes = sum(w.nbytes + (s.nbytes if s is not None else 0) for w, s in ws.values())
        fns = passes()
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, E)), jnp.float32)
            for k, f in fns.items():
                f(x, inputs[k]).block_until_ready()
            t = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    t[k].append(_timed(lambda: f(x, inputs[k]).block_until_ready()))
            xla, ours, packed = (statistics.median(t[k]) for k in ("xla", "cpu", "packed"))
            print(f"{dtype:8s} M={m:2d}: xla {xla * 1e3:6.2f} ms ({nbytes / xla / bw:.2f} of copy bw), "
                  f"cpu kernel {ours * 1e3:6.2f} ms ({nbytes / ours / bw:.2f}), packed {packed * 1e3:6.2f} ms "
                  f"({nbytes / packed / bw:.2f}), xla/cpu {xla / ours:.2f}x, cpu/packed {ours / packed:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()

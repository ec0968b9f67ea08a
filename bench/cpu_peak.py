"""How close a prefill step's matrix products come to this CPU's multiply-add peak.

The peak: a loop of independent fused multiply-adds (12 chains, no loads), compiled here with jaxserve/cpu's
compiler and -march=native, run on every core at once, on 512-bit and on 256-bit vectors. The achieved rates: the
C++ kernel's cache-blocked path (what a prompt step runs with matmul=cpu) and XLA's dot (matmul=xla) over the small
preset's 12 layers of projections at M rows (bench/cpu_matmul.py's pass), in the same run. A prompt step's time is these products plus attention and norms, so prefill throughput,
and a burst's time to first token, scale with the ratio printed last.

    python bench/cpu_peak.py [--rows 512 2048]
"""
import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import cpu_matmul  # bench/
from jaxserve import cpu
from moe_grouped import timed  # bench/

FMA_LOOP = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <class V, V (*Fma)(V, V, V), V (*Set)(float)>
double GflopS(long iters) {
  V a[12];
  const V b = Set(1.0000001f), c = Set(0.999999f);
  for (int i = 0; i < 12; i++) a[i] = Set(i);
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < iters; k++) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) a[i] = Fma(a[i], b, c);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (int i = 0; i < 12; i++) sink += reinterpret_cast<float*>(&a[i])[0];
  if (sink == 12345.f) std::puts("");
  return 12.0 * iters * (sizeof(V) / 4) * 2 / s / 1e9;
}
#ifdef __AVX512F__
__m512 F16(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
__m512 S16(float x) { return _mm512_set1_ps(x); }
#endif
__m256 F8(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
__m256 S8(float x) { return _mm256_set1_ps(x); }
int main() {
#ifdef __AVX512F__
  const double wide = GflopS<__m512, F16, S16>(100000000);
#else
  const double wide = 0;
#endif
  std::printf("%f %f\n", wide, GflopS<__m256, F8, S8>(100000000));
}
"""


def fma_peak() -> tuple[float, float]:
    """(512-bit, 256-bit) GFLOP/s summed over all cores, each core running the loop at once (0: no AVX-512)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fma.cc", Path(tmp) / "fma"
        src.write_text(FMA_LOOP)
        subprocess.run([cpu.compiler(), "-O2", "-march=native", "-o", str(exe), str(src)], check=True)
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(os.cpu_count())]
        runs = [[float(v) for v in p.communicate()[0].split()] for p in procs]
    return sum(r[0] for r in runs), sum(r[1] for r in runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    wide, narrow = fma_peak()
    peak = max(wide, narrow)
    print(f"multiply-add peak, {os.cpu_count()} cores at once: 512-bit {wide:.0f} GFLOP/s, 256-bit {narrow:.0f}")
    rng = np.random.default_rng(0)
    weights, passes = cpu_matmul.weights("float32", rng), cpu_matmul.passes()
    per_row = 2 * cpu_matmul.LAYERS * sum(k * n for k, n in cpu_matmul.SHAPES.values())
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, cpu_matmul.E)), jnp.float32)
        for name, label in (("cpu", "C++ kernel"), ("xla", "XLA dot")):
            seconds = timed(passes[name], x, weights, repeats=args.rounds)
            rate = per_row * m / seconds / 1e9
            print(f"{label}, {m} rows: {seconds * 1e3:.1f} ms, {rate:.0f} GFLOP/s, {rate / peak:.2f} of peak")


if __name__ == "__main__":
    main()

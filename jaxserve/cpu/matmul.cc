// Weight-streaming matmul for few rows (decode steps) on the CPU backend, called from XLA through the FFI
// (jaxserve/cpu/__init__.py).
//
// With a handful of rows a projection reads each weight once and does a few FLOPs per weight: its speed is the
// rate the weights stream from memory. This kernel reads one layer's slice of a stacked [layers, K, N] weight in
// place (XLA copies a dynamically indexed slice out before its dot) and streams it once for all rows.
//
//   x       [M, K]          float32 | bfloat16
//   w       [L, K, N]       float32 | bfloat16 | int8          (row-major: K rows of N outputs)
//   scales  [L, N]          float32, int8 weights only (per output channel; out = (x . w) * scale)
//   layer   int32 [1]       the slice of w to use
//   out     [M, N]          float32
//
// Work is split over blocks of output columns. One row (M = 1): each block keeps its [block] float32 sums in L1
// and walks K in steps of four rows, so every weight is loaded once and every sum is written once per four weight
// rows. Several rows: each block converts 16 weight rows at a time into a float32 buffer in L1 (read from memory
// once, whatever the weight type), then multiplies it into register tiles of up to 4 rows x 16 columns (explicit
// 8-lane vectors) whose sums stay in registers over those 16 weight rows: each weight load feeds up to 4 rows'
// multiply-adds, where the one-row loop would load (and convert) it again for every row.

#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

using namespace jaxserve_cpu;

constexpr int64_t kBlock = 256;  // output columns per task: [M, 256] float32 sums (M <= 32: at most 32 KB)

struct Shape {
  int64_t m, k, n;
};

// out[:, n0:n0+nb] = acc [M, kBlock] (times the int8 weights' per-channel scales)
inline void WriteBlock(const Shape& s, const float* acc, const float* scales, float* out, int64_t n0, int64_t nb) {
  for (int64_t m = 0; m < s.m; ++m) {
    float* o = out + m * s.n + n0;
    const float* a = acc + m * kBlock;
    if (scales != nullptr) {
      for (int64_t j = 0; j < nb; ++j) o[j] = a[j] * scales[n0 + j];
    } else {
      std::copy(a, a + nb, o);
    }
  }
}

template <typename WT>
void ColumnBlock(const Shape& s, const float* __restrict x, const WT* __restrict w, const float* scales,
                 float* __restrict out, int64_t n0) {
  const int64_t nb = std::min(kBlock, s.n - n0);
  alignas(64) float acc[32 * kBlock];
  std::fill(acc, acc + s.m * kBlock, 0.0f);
  int64_t k = 0;
  for (; k + 4 <= s.k; k += 4) {
    const WT* __restrict r0 = w + k * s.n + n0;
    const WT* __restrict r1 = r0 + s.n;
    const WT* __restrict r2 = r1 + s.n;
    const WT* __restrict r3 = r2 + s.n;
    for (int64_t m = 0; m < s.m; ++m) {
      const float x0 = x[m * s.k + k], x1 = x[m * s.k + k + 1], x2 = x[m * s.k + k + 2], x3 = x[m * s.k + k + 3];
      float* __restrict a = acc + m * kBlock;
      for (int64_t j = 0; j < nb; ++j) {
        a[j] += (x0 * ToFloat(r0[j]) + x1 * ToFloat(r1[j])) + (x2 * ToFloat(r2[j]) + x3 * ToFloat(r3[j]));
      }
    }
  }
  for (; k < s.k; ++k) {
    const WT* __restrict r = w + k * s.n + n0;
    for (int64_t m = 0; m < s.m; ++m) {
      const float xv = x[m * s.k + k];
      float* __restrict a = acc + m * kBlock;
      for (int64_t j = 0; j < nb; ++j) a[j] += xv * ToFloat(r[j]);
    }
  }
  WriteBlock(s, acc, scales, out, n0, nb);
}

constexpr int64_t kChunk = 16;  // weight rows per float32 buffer: [16, 256] = 16 KB
constexpr int64_t kTile = 16;   // output columns per register tile: two 8-lane vectors

typedef float v8f __attribute__((vector_size(32)));
inline v8f Load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// acc[r, j0:j0+16] += sum over i < kr of x[r, i] * buf[i, j0:j0+16], for R rows (x and acc at their first row)
template <int R>
inline void Tile(const float* __restrict x, int64_t x_stride, int64_t kr, const float* __restrict buf,
                 float* __restrict acc, int64_t j0) {
  v8f lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = Load8(acc + r * kBlock + j0);
    hi[r] = Load8(acc + r * kBlock + j0 + 8);
  }
  for (int64_t i = 0; i < kr; ++i) {
    const v8f w0 = Load8(buf + i * kBlock + j0), w1 = Load8(buf + i * kBlock + j0 + 8);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * x_stride + i];
      lo[r] += xv * w0;
      hi[r] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    Store8(acc + r * kBlock + j0, lo[r]);
    Store8(acc + r * kBlock + j0 + 8, hi[r]);
  }
}

template <int R>
inline void Tiles(const Shape& s, const float* x, int64_t m0, int64_t k0, int64_t kr, const float* buf, float* acc,
                  int64_t tiles) {
  for (int64_t t = 0; t < tiles; ++t) Tile<R>(x + m0 * s.k + k0, s.k, kr, buf, acc + m0 * kBlock, t * kTile);
}

template <typename WT>
void ColumnBlockRows(const Shape& s, const float* __restrict x, const WT* __restrict w, const float* scales,
                     float* __restrict out, int64_t n0) {
  const int64_t nb = std::min(kBlock, s.n - n0);
  const int64_t tiles = (nb + kTile - 1) / kTile;
  alignas(64) float acc[32 * kBlock];
  alignas(64) float buf[kChunk * kBlock];
  std::fill(acc, acc + s.m * kBlock, 0.0f);
  if (nb < kBlock) std::fill(buf, buf + kChunk * kBlock, 0.0f);  // columns past n stay zero
  for (int64_t k0 = 0; k0 < s.k; k0 += kChunk) {
    const int64_t kr = std::min(kChunk, s.k - k0);
    for (int64_t i = 0; i < kr; ++i) {
      const WT* __restrict r = w + (k0 + i) * s.n + n0;
      float* __restrict b = buf + i * kBlock;
      for (int64_t j = 0; j < nb; ++j) b[j] = ToFloat(r[j]);
    }
    int64_t m0 = 0;
    for (; m0 + 4 <= s.m; m0 += 4) Tiles<4>(s, x, m0, k0, kr, buf, acc, tiles);
    switch (s.m - m0) {
      case 3: Tiles<3>(s, x, m0, k0, kr, buf, acc, tiles); break;
      case 2: Tiles<2>(s, x, m0, k0, kr, buf, acc, tiles); break;
      case 1: Tiles<1>(s, x, m0, k0, kr, buf, acc, tiles); break;
      default: break;
    }
  }
  WriteBlock(s, acc, scales, out, n0, nb);
}

template <typename WT>
void Run(ffi::ThreadPool& pool, const Shape& s, const float* x, const WT* w, const float* scales, float* out) {
  const int64_t blocks = (s.n + kBlock - 1) / kBlock;
  if (s.m == 1) {
    ParallelFor(pool, blocks, [&](int64_t block) { ColumnBlock(s, x, w, scales, out, block * kBlock); });
  } else {
    ParallelFor(pool, blocks, [&](int64_t block) { ColumnBlockRows(s, x, w, scales, out, block * kBlock); });
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scales,
                      ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("cpu matmul: expected x [M, K] and w [L, K, N]");
  }
  const Shape s{xd[0], xd[1], wd[2]};
  const int64_t l = layer.typed_data()[0];
  if (s.m > 32 || l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("cpu matmul: M > 32 or layer out of range");
  const bool int8 = w.element_type() == ffi::S8;
  if (int8 && (scales.dimensions().size() != 2 || scales.dimensions()[1] != s.n)) {
    return ffi::Error::InvalidArgument("cpu matmul: int8 weights need scales [L, N]");
  }
  std::vector<float> xf(s.m * s.k);  // rows in float32 once, not once per column block
  if (x.element_type() == ffi::F32) {
    const float* xp = static_cast<const float*>(x.untyped_data());
    std::copy(xp, xp + xf.size(), xf.begin());
  } else if (x.element_type() == ffi::BF16) {
    const bf16_bits* xp = static_cast<const bf16_bits*>(x.untyped_data());
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = ToFloat(xp[i]);
  } else {
    return ffi::Error::InvalidArgument("cpu matmul: x must be float32 or bfloat16");
  }
  const int64_t slice = s.k * s.n;
  float* o = out->typed_data();
  switch (w.element_type()) {
    case ffi::F32:
      Run(pool, s, xf.data(), static_cast<const float*>(w.untyped_data()) + l * slice, nullptr, o);
      break;
    case ffi::BF16:
      Run(pool, s, xf.data(), static_cast<const bf16_bits*>(w.untyped_data()) + l * slice, nullptr, o);
      break;
    case ffi::S8:
      Run(pool, s, xf.data(), static_cast<const int8_t*>(w.untyped_data()) + l * slice,
          scales.typed_data() + l * s.n, o);
      break;
    default:
      return ffi::Error::InvalidArgument("cpu matmul: w must be float32, bfloat16 or int8");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);

// Weight-streaming matmul for few rows (decode and verify steps) on the CPU backend, called from XLA through the
// FFI (jaxserve/cpu/__init__.py).
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
// How the weight is read. A core streams memory fastest along long contiguous runs (its prefetchers follow a few
// dozen sequential streams, each within a 4 KB page). So the weight is cut into tasks of whole row runs:
//
//          n0        n0+nb                 a task: rows [k0, k1) x columns [n0, n0+nb), nb * sizeof(weight)
//     k0   +---------+                     = 4 KB (the whole row if shorter, less if M rows of nb sums would
//                                          not fit L1); tasks split K too when there are fewer
//          |  task   |  ... next column     column blocks than threads, each K split summing into its own
//     k1   +---------+      block           [M, N] partial that one pass adds up at the end. One task a thread
//                                           streams best: more, shorter tasks measured up to 1.3x slower.
//
// Inside a task KR weight rows are walked together along N, one vector of columns at a time (16 float32 with
// AVX-512, 8 with AVX2): KR sequential streams, each vector loaded and converted to float32 once and multiplied
// into every row of x; the rows' sums for the task's columns stay in L1 ([M, nb] float32) and are read and written
// once per KR weight rows.

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

using namespace jaxserve_cpu;

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one 512-bit register of float32
#else
constexpr int kLanes = 8;   // AVX2 (or whatever the compiler makes of 32-byte vectors)
#endif
typedef float fvec __attribute__((vector_size(4 * kLanes)));
typedef uint16_t u16vec __attribute__((vector_size(2 * kLanes)));
typedef uint32_t u32vec __attribute__((vector_size(4 * kLanes)));

inline fvec Load(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline fvec Load(const bf16_bits* p) {  // bfloat16 is float32's upper half
  u16vec h;
  std::memcpy(&h, p, sizeof(h));
  const u32vec bits = __builtin_convertvector(h, u32vec) << 16;
  fvec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline fvec Load(const int8_t* p) {  // GCC 12 widens int8 vector extensions element by element: intrinsics
  fvec v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &f, sizeof(v));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &f, sizeof(v));
#else
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}
inline void Store(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

struct Shape {
  int64_t m, k, n;
};

// The task grid: column blocks of nb columns times k_splits row ranges.
struct Grid {
  int64_t nb, col_blocks, k_splits, k_per_split;
};

constexpr int64_t kRunBytes = 4096;    // a task's contiguous run per weight row, at least (a page)
constexpr int64_t kMaxRows = 32;       // rows of x, at most (jaxserve.cpu.MATMUL_MAX_ROWS)
constexpr int64_t kAccFloats = 8192;   // a task's [M, nb] float32 sums, at most (32 KB: L1); >= 256 columns at M = 32
constexpr int64_t kMinSplitRows = 64;  // rows per K split, at least

Grid MakeGrid(const Shape& s, int64_t weight_bytes, int64_t workers) {
  const int64_t nb = std::min(s.n, std::min(kRunBytes / weight_bytes, kAccFloats / s.m) / kLanes * kLanes);
  const int64_t col_blocks = (s.n + nb - 1) / nb;
  int64_t k_splits = std::max<int64_t>(1, (workers + col_blocks - 1) / col_blocks);
  k_splits = std::max<int64_t>(1, std::min(k_splits, s.k / kMinSplitRows));
  const int64_t k_per_split = (s.k + k_splits - 1) / k_splits;
  return {nb, col_blocks, (s.k + k_per_split - 1) / k_per_split, k_per_split};
}

// acc[r, j] += sum over i < KR of x[r, i] * w[i, j], for rows r < R and columns j < nb: one tile of R rows of x
// against KR weight rows. x's values stay in registers, broadcast, for the whole walk along the columns; each
// weight vector is loaded (and converted) once for the R rows.
template <int R, int KR, typename WT>
void Tile(const Shape& s, const float* __restrict x, const WT* __restrict w, int64_t nb, float* __restrict acc,
          int64_t acc_stride) {
  fvec xb[R][KR];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < KR; ++i) xb[r][i] = fvec{} + x[r * s.k + i];
  }
  int64_t j = 0;
  for (; j + kLanes <= nb; j += kLanes) {
    fvec wv[KR];
    for (int i = 0; i < KR; ++i) wv[i] = Load(w + i * s.n + j);
    for (int r = 0; r < R; ++r) {
      fvec sum = Load(acc + r * acc_stride + j);
      for (int i = 0; i < KR; ++i) sum += xb[r][i] * wv[i];
      Store(acc + r * acc_stride + j, sum);
    }
  }
  for (; j < nb; ++j) {  // the last columns when nb is not a multiple of the vector width
    for (int r = 0; r < R; ++r) {
      float sum = acc[r * acc_stride + j];
      for (int i = 0; i < KR; ++i) sum += x[r * s.k + i] * ToFloat(w[i * s.n + j]);
      acc[r * acc_stride + j] = sum;
    }
  }
}

// One tile of R rows of x against weight rows [k0, k1), KR at a time, the last (k1 - k0) % KR one at a time.
template <int R, int KR, typename WT>
void TileRows(const Shape& s, const float* x, const WT* w, int64_t k0, int64_t k1, int64_t nb, float* acc,
              int64_t acc_stride) {
  int64_t k = k0;
  for (; k + KR <= k1; k += KR) Tile<R, KR>(s, x + k, w + k * s.n, nb, acc, acc_stride);
  for (; k < k1; ++k) Tile<R, 1>(s, x + k, w + k * s.n, nb, acc, acc_stride);
}

// Every row of x against weight rows [k0, k1): tiles of 4 rows, the last one of up to 5 (a verify step's K + 1 = 5
// rows in one pass over the weights; 5 rows x 4 broadcast values + 4 weight vectors + 5 sums fit the 32 registers
// of AVX-512). Each tile walks all the rows before the next starts: its sums stay in L1 meanwhile, and the rows
// (a chunk of kChunkRows) come from L1/L2 again for the later tiles.
template <int KR, typename WT>
void Rows(const Shape& s, const float* x, const WT* w, int64_t k0, int64_t k1, int64_t nb, float* acc,
          int64_t acc_stride) {
  int64_t m = 0;
  for (; s.m - m > 5; m += 4) TileRows<4, KR>(s, x + m * s.k, w, k0, k1, nb, acc + m * acc_stride, acc_stride);
  const float* xm = x + m * s.k;
  float* am = acc + m * acc_stride;
  switch (s.m - m) {
    case 5: TileRows<5, KR>(s, xm, w, k0, k1, nb, am, acc_stride); break;
    case 4: TileRows<4, KR>(s, xm, w, k0, k1, nb, am, acc_stride); break;
    case 3: TileRows<3, KR>(s, xm, w, k0, k1, nb, am, acc_stride); break;
    case 2: TileRows<2, KR>(s, xm, w, k0, k1, nb, am, acc_stride); break;
    case 1: TileRows<1, KR>(s, xm, w, k0, k1, nb, am, acc_stride); break;
    default: break;
  }
}

constexpr int64_t kChunkRows = 16;  // weight rows each tile of x walks before the next tile starts

// acc [M, n1 - n0] (row stride acc_stride) = x[:, k0:k1] @ w[k0:k1, n0:n1]. Few rows take 8 weight rows at a
// time (fewer passes over acc), tiles of 3-5 rows take 4 (x's broadcast values plus the tile fill the registers).
template <typename WT>
void Accumulate(const Shape& s, const float* x, const WT* w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                float* acc, int64_t acc_stride) {
  const int64_t nb = n1 - n0;
  for (int64_t m = 0; m < s.m; ++m) std::fill(acc + m * acc_stride, acc + m * acc_stride + nb, 0.0f);
  const WT* wn = w + n0;
  for (int64_t k = k0; k < k1; k += kChunkRows) {
    if (s.m <= 2) {
      Rows<8>(s, x, wn, k, std::min(k1, k + kChunkRows), nb, acc, acc_stride);
    } else {
      Rows<4>(s, x, wn, k, std::min(k1, k + kChunkRows), nb, acc, acc_stride);
    }
  }
}

// A float32 buffer of at least `size` of the calling thread's, kept from call to call: a heap allocation per call
// (tens of KB, served from the main heap once jaxserve.host_memory turns mmap off) showed up in profiles.
template <int Which>
float* Scratch(int64_t size) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// out[:, n0:n0+nb] = acc [M, nb] (row stride acc_stride), times the int8 weights' per-channel scales
inline void Write(const Shape& s, const float* acc, int64_t acc_stride, const float* scales, float* out, int64_t n0,
                  int64_t nb) {
  for (int64_t m = 0; m < s.m; ++m) {
    const float* a = acc + m * acc_stride;
    float* o = out + m * s.n + n0;
    if (scales != nullptr) {
      for (int64_t j = 0; j < nb; ++j) o[j] = a[j] * scales[n0 + j];
    } else {
      std::copy(a, a + nb, o);
    }
  }
}

template <typename WT>
void Run(ffi::ThreadPool& pool, const Shape& s, const float* x, const WT* w, const float* scales, float* out) {
  const Grid g = MakeGrid(s, sizeof(WT), std::max<int64_t>(1, pool.num_threads()));
  float* partial = Scratch<1>(g.k_splits > 1 ? g.k_splits * s.m * s.n : 0);  // [k_splits, M, N]
  ParallelFor(pool, g.col_blocks * g.k_splits, [&](int64_t task) {
    const int64_t n0 = task % g.col_blocks * g.nb, nb = std::min(g.nb, s.n - n0);
    const int64_t split = task / g.col_blocks, k0 = split * g.k_per_split;
    // acc rows kLanes apart from a multiple of 4 KB: rows at 4 KB strides would alias in L1 and stall the stores
    const int64_t stride = g.nb + kLanes;
    alignas(64) float acc[kAccFloats + kMaxRows * kLanes];
    Accumulate(s, x, w, k0, std::min(s.k, k0 + g.k_per_split), n0, n0 + nb, acc, stride);
    if (g.k_splits == 1) {
      Write(s, acc, stride, scales, out, n0, nb);
    } else {
      Write(s, acc, stride, nullptr, partial + split * s.m * s.n, n0, nb);
    }
  });
  if (g.k_splits == 1) return;
  for (int64_t i = 0; i < s.m * s.n; ++i) {
    float sum = partial[i];
    for (int64_t split = 1; split < g.k_splits; ++split) sum += partial[split * s.m * s.n + i];
    out[i] = scales != nullptr ? sum * scales[i % s.n] : sum;
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
  if (s.m > kMaxRows || l < 0 || l >= wd[0]) {
    return ffi::Error::InvalidArgument("cpu matmul: M > 32 or layer out of range");
  }
  const bool int8 = w.element_type() == ffi::S8;
  if (int8 && (scales.dimensions().size() != 2 || scales.dimensions()[1] != s.n)) {
    return ffi::Error::InvalidArgument("cpu matmul: int8 weights need scales [L, N]");
  }
  const float* xf = static_cast<const float*>(x.untyped_data());  // float32 rows are read where they are
  if (x.element_type() == ffi::BF16) {  // bfloat16 rows in float32 once, not once per task
    const bf16_bits* xp = static_cast<const bf16_bits*>(x.untyped_data());
    float* converted = Scratch<0>(s.m * s.k);
    for (int64_t i = 0; i < s.m * s.k; ++i) converted[i] = ToFloat(xp[i]);
    xf = converted;
  } else if (x.element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("cpu matmul: x must be float32 or bfloat16");
  }
  const int64_t slice = s.k * s.n;
  float* o = out->typed_data();
  switch (w.element_type()) {
    case ffi::F32:
      Run(pool, s, xf, static_cast<const float*>(w.untyped_data()) + l * slice, nullptr, o);
      break;
    case ffi::BF16:
      Run(pool, s, xf, static_cast<const bf16_bits*>(w.untyped_data()) + l * slice, nullptr, o);
      break;
    case ffi::S8:
      Run(pool, s, xf, static_cast<const int8_t*>(w.untyped_data()) + l * slice,
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

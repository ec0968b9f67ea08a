// The projections' matmuls on the CPU backend, decode and prompt steps alike, called from XLA through the FFI
// (jaxserve/cpu/__init__.py). The kernel reads one layer's slice of a stacked [layers, K, N] weight in place (XLA
// copies a dynamically indexed slice out before its dot).
//
//   x       [M, K]          float32 | bfloat16
//   layer   int32 [1]       the slice of each w to use
//   rows    int32 [1]       x's leading rows to multiply (a step's real tokens); the rest are padding, the outputs'
//                           rows for them zeros
// then, for each weight x is multiplied by (one call can take a layer's q, k and v, say):
//   w       [L, K, N]       float32 | bfloat16 | int8          (row-major: K rows of N outputs)
//        or [L, N / 64, K, 64]                                  (packed: panels of 64 columns, each K rows long)
//   scales  [L, N]          float32, int8 weights only (per output channel; out = (x . w) * scale)
// and its output
//   out     [M, N]          float32
//
// A packed weight (pack() in __init__.py, made once when an engine is built) holds each 64 columns' K rows
// contiguously, so a task's panels are one sequential stream instead of K short runs N apart: the one-row products
// of a small model's step measured 1.15x (float32) and 1.4x (int8) faster packed, at 33-38 GB/s against this VM's
// 32-35 GB/s read bandwidth (2-vCPU AMD EPYC, AVX-512; the register-blocked path below, every row count).
//
// Three paths, by what binds (a packed weight takes the register-blocked one from one row; there one row, and with
// AVX-512 up to six, walk each panel as four streams at once: Streams):
// - One or two rows of float32 weights (streaming): a few FLOPs per weight, so the speed is the rate weights stream
//   from memory. A core streams fastest along long contiguous runs (its prefetchers follow a few dozen sequential
//   streams, each within a 4 KB page), so the weight is cut into tasks of whole row runs:
//
//          n0        n0+nb                 a task: rows [k0, k1) x columns [n0, n0+nb), nb * sizeof(weight)
//     k0   +---------+                     = 4 KB (the whole row if shorter); tasks split K too when there are
//          |  task   |  ... next column     fewer column blocks than threads, each K split summing into its own
//     k1   +---------+      block           [M, N] partial that one pass adds up at the end. One task a thread
//                                           streams best: more, shorter tasks measured up to 1.3x slower.
//
//   Inside a task 8 weight rows are walked together along N, one vector of columns at a time (16 float32 with
//   AVX-512, 8 with AVX2): 8 sequential streams, each vector loaded and converted to float32 once and multiplied
//   into every row of x; the rows' sums for the task's columns stay in L1 and are read and written once per 8 rows.
// - Up to 64 rows otherwise (register-blocked, below): the streaming path's sums, loaded and stored per weight
//   vector and row, would bind; tiles of 6 rows x 4 vectors keep theirs in registers over 32 weight rows at a time,
//   and each band of 32 rows is prefetched into L2 while the one before is worked.
// - More than 64 rows (a prompt step; cache-blocked, further below): multiply-adds bind; bands of the weight are
//   packed once into L2 and every tile of x walks them.

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

using namespace jaxserve_cpu;

constexpr int64_t kPackCols = 64;  // a packed weight's panel width, in columns

struct Shape {
  int64_t m, k, n;
  bool packed = false;  // w is [N / kPackCols, K, kPackCols]
};

// w's element at (row k, column j), and the distance between a column's consecutive rows. A packed panel holds the
// columns [j, j + width) of every tile and band below whole: their starts are multiples of their widths, which
// divide kPackCols.
template <typename WT>
inline const WT* At(const Shape& s, const WT* w, int64_t k, int64_t j) {
  return s.packed ? w + (j / kPackCols * s.k + k) * kPackCols + j % kPackCols : w + k * s.n + j;
}
inline int64_t RowStride(const Shape& s) { return s.packed ? kPackCols : s.n; }

// The task grid: column blocks of nb columns times k_splits row ranges.
struct Grid {
  int64_t nb, col_blocks, k_splits, k_per_split;
};

constexpr int64_t kRunBytes = 4096;    // a task's contiguous run per weight row, at least (a page)
constexpr int64_t kMaxRows = 64;       // rows of x the paths below take; more take the cache-blocked one
// rows of x the streaming path takes, float32 weights only; more, and narrower weights, take the register-blocked
// one (bench/cpu_matmul.py, AMD EPYC AVX-512, streaming / blocked ms at 1 and 2 rows: float32 10.4 / 14.3 and 11.0 /
// 11.6, int8 5.1 / 4.1 and 6.0 / 4.4, bfloat16 7.3 / 6.5 and 7.5 / 6.0)
constexpr int64_t kMaxStreamedRows = 2;
constexpr int64_t kAccFloats = 8192;   // a task's [M, nb] float32 sums, at most (32 KB: L1)
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

constexpr int64_t kChunkRows = 16;  // weight rows walked together before the sums are next written

// acc [M, n1 - n0] (row stride acc_stride) = x[:, k0:k1] @ w[k0:k1, n0:n1] for one or two rows of x, 8 weight rows
// at a time (the last k1 - k0 mod 8 one at a time).
template <typename WT>
void Accumulate(const Shape& s, const float* x, const WT* w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                float* acc, int64_t acc_stride) {
  const int64_t nb = n1 - n0;
  for (int64_t m = 0; m < s.m; ++m) std::fill(acc + m * acc_stride, acc + m * acc_stride + nb, 0.0f);
  const WT* wn = w + n0;
  for (int64_t k = k0; k < k1; k += kChunkRows) {
    const int64_t k_end = std::min(k1, k + kChunkRows);
    if (s.m == 2) {
      TileRows<2, 8>(s, x, wn, k, k_end, nb, acc, acc_stride);
    } else {
      TileRows<1, 8>(s, x, wn, k, k_end, nb, acc, acc_stride);
    }
  }
}

// A float32 buffer of at least `size` of the calling thread's, kept from call to call: a heap allocation per call
// (tens of KB, served from the main heap once jaxserve.host_memory turns mmap off) showed up in profiles.
// 64-byte aligned (a cache line): packed panels that straddle lines measured 0.66 against 0.76 of peak.
template <int Which>
float* Scratch(int64_t size) {
  constexpr int64_t kAlignFloats = 16;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < size + kAlignFloats) buffer.resize(size + kAlignFloats);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (-address / sizeof(float)) % kAlignFloats;
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

// ---- Register-blocked path, up to 64 rows ----------------------------------------------------------------------
//
// From a few rows on, the streaming path above is bound by its sums' loads and stores (one per weight vector and
// row), not by the weights. Here a tile of up to kMR rows x kNR vectors of columns keeps its sums in registers over
// a band of kKC weight rows: per weight row, kNR weight vectors and kMR broadcast values of x feed kMR * kNR
// multiply-adds (6 x 4 = 24 sums of the 32 AVX-512 registers), so multiply-adds bind, not loads. A task (a column
// block, one per thread) walks its weight rows a band at a time and each band along its columns a panel of kNR
// vectors at a time: the band's kKC row runs are kKC sequential streams, as in the streaming path, and each panel
// (kKC x kNR vectors, 8 KB of float32) comes from memory for the first tile of x and from L1 for the others. The
// sums go to memory (L1/L2) once per band. x is packed once per call, tile by tile, row index fastest ([tile, K,
// kMR]), so a tile's broadcast values are one pointer and constant offsets.

// 6 x 4 rather than 8 x 3: a tile alone in L1 measured 137 against 125 GFLOP/s a core (this Xeon, AVX-512), the
// small preset's float32 projections at 5 / 16 / 64 rows 9 / 4 / 11% faster, int8 at 5 rows 1.35x
// (bench/cpu_matmul.py).
constexpr int64_t kMR = 6;     // rows of x per register tile
#if defined(__AVX512F__)
constexpr int kNR = 4;         // vectors of columns per register tile: 6 x 4 sums + 4 weights + 1 of 32 registers
#else
constexpr int kNR = 2;         // AVX2: 6 x 2 sums + 2 + 1 of the 16 (4 spilled: 16 / 64 rows 1.14-1.18 / 1.31-1.43x
                               // slower float32, 1.28-1.41 / 1.41-1.49x int8; 2-vCPU Zen 3, bench/cpu_matmul.py)
#endif
constexpr int64_t kKC = 32;    // weight rows a band: a tile sums them in registers before writing its sums
// AVX2, a packed weight and at least kDeepBandRows rows of x: bands of kDeepKC rows, walked panel by panel (see
// AccumulateBlocked). A band's sums are loaded and stored once a tile, so deeper bands spend more of a tile's time
// in multiply-adds; with fewer rows the weight's stream binds, and 32-row bands kept it faster (2-vCPU Zen 3 VM, the
// small preset's projections interleaved in one process: 16-32 rows 1.05-1.13x faster with 64-row bands than with
// 32, 7-12 rows 1.22-1.28x slower; 64 requests end to end level with 128-row bands).
constexpr int64_t kDeepKC = 64;
constexpr int64_t kDeepBandRows = 16;
constexpr int64_t kBlockedAcc = 65536;  // a task's [M, nb] float32 sums, at most (256 KB: L2)

inline fvec Broadcast(float v) {
  fvec out;
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(v);
#elif defined(__AVX__)
  const __m256 b = _mm256_set1_ps(v);
#else
  fvec b;
  for (int i = 0; i < kLanes; ++i) b[i] = v;
#endif
  std::memcpy(&out, &b, sizeof(out));
  return out;
}

// Rows of the next band a tile prefetches while it works: `rows` rows `stride` bytes apart from `first`, `bytes`
// of each (the panel's width in weight bytes). The panel's tiles share them out, so the requests spread over the
// band's work instead of queueing behind the first tile. Into L2, not L1: a band ahead is more than L1 holds, and
// prefetching it into L1 evicted what was in use (one core, 4 / 16 rows over 24 [768, 2048] float32 weights: 15.7 /
// 22.4 ms into L1, 9.2 / 17.0 ms into L2, 20.8 / 30.1 ms without prefetching; AMD EPYC, AVX-512).
struct Ahead {
  const char* first;
  int64_t stride, rows;
  int bytes;
};

// acc[r, j * kLanes + l] += sum over k < kc of x[r, k] * w[k, j * kLanes + l] for r < MR, j < NR, with x packed
// [k, kMR]; with kPack also pack[k, j * kLanes + l] = w[k, j * kLanes + l] in float32. kc >= 1.
template <int MR, int NR, bool kPack, typename WT>
inline void MicroTile(const float* __restrict xp, const WT* __restrict w, int64_t w_stride, int64_t kc,
                      const Ahead& ahead, float* __restrict pack, float* __restrict acc, int64_t acc_stride) {
  fvec c[MR][NR];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NR; ++j) c[r][j] = Load(acc + r * acc_stride + j * kLanes);
  }
  // kc >= 1: a do-while, so that the sums need no copy for an empty band (GCC kept one on the stack, stored and
  // reloaded around the loop: 64 rows 1.05x faster without, one core, 2-vCPU Zen 3 VM)
  int64_t k = 0;
  do {
    if (k < ahead.rows) {
      const char* p = ahead.first + k * ahead.stride;
      for (int b = 0; b < ahead.bytes; b += 64) __builtin_prefetch(p + b, 0, 2);  // into L2 (prefetcht1)
    }
    fvec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Load(w + j * kLanes);
    if (kPack) {
      for (int j = 0; j < NR; ++j) Store(pack + (k * NR + j) * kLanes, wv[j]);
    }
    for (int r = 0; r < MR; ++r) {
      const fvec xb = Broadcast(xp[r]);
      for (int j = 0; j < NR; ++j) c[r][j] += xb * wv[j];
    }
    ++k, w += w_stride, xp += kMR;
  } while (k < kc);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NR; ++j) Store(acc + r * acc_stride + j * kLanes, c[r][j]);
  }
}

// MicroTile for `rows` (1..kMR) rows of x.
template <int NR, bool kPack, typename WT>
inline void MicroTileRows(int64_t rows, const float* xp, const WT* w, int64_t w_stride, int64_t kc,
                          const Ahead& ahead, float* pack, float* acc, int64_t acc_stride) {
  static_assert(kMR == 6, "one case per row count");
  switch (rows) {
    case 6: MicroTile<6, NR, kPack>(xp, w, w_stride, kc, ahead, pack, acc, acc_stride); break;
    case 5: MicroTile<5, NR, kPack>(xp, w, w_stride, kc, ahead, pack, acc, acc_stride); break;
    case 4: MicroTile<4, NR, kPack>(xp, w, w_stride, kc, ahead, pack, acc, acc_stride); break;
    case 3: MicroTile<3, NR, kPack>(xp, w, w_stride, kc, ahead, pack, acc, acc_stride); break;
    case 2: MicroTile<2, NR, kPack>(xp, w, w_stride, kc, ahead, pack, acc, acc_stride); break;
    default: MicroTile<1, NR, kPack>(xp, w, w_stride, kc, ahead, pack, acc, acc_stride); break;
  }
}

// Every tile of x (kMR rows, the last one shorter) against one panel of NR vectors over kc weight rows from k. With
// more than one tile, the first packs the panel (float32, contiguous) as it reads it and the others read the pack:
// weight rows a multiple of 4 KB apart share L1 sets, so the panel itself would not stay in L1, and int8 or
// bfloat16 weights are converted once. `next` is the same panel in the next band (null: none to prefetch).
template <int NR, typename WT>
void Panel(const Shape& s, const float* xp, int64_t k, const WT* w, int64_t kc, const WT* next, float* acc,
           int64_t acc_stride, int64_t band = kKC) {
  alignas(64) float pack[kDeepKC * NR * kLanes];
  const int64_t tiles = (s.m + kMR - 1) / kMR, share = next == nullptr ? 0 : (band + tiles - 1) / tiles;
  const auto ahead = [&](int64_t tile) {
    const int64_t first = std::min(band, tile * share);
    return Ahead{reinterpret_cast<const char*>(next + first * RowStride(s)),
                 static_cast<int64_t>(RowStride(s) * sizeof(WT)),
                 std::min(band, first + share) - first, static_cast<int>(NR * kLanes * sizeof(WT))};
  };
  const float* x0 = xp + k * kMR;  // tile 0, row k
  if (s.m > kMR) {
    MicroTileRows<NR, true>(kMR, x0, w, RowStride(s), kc, ahead(0), pack, acc, acc_stride);
  } else {
    MicroTileRows<NR, false>(s.m, x0, w, RowStride(s), kc, ahead(0), pack, acc, acc_stride);
  }
  for (int64_t m = kMR; m < s.m; m += kMR) {
    const float* xt = xp + (m / kMR * s.k + k) * kMR;  // tile m / kMR, row k
    MicroTileRows<NR, false, float>(std::min(kMR, s.m - m), xt, pack, NR * kLanes, kc, ahead(m / kMR), nullptr,
                                    acc + m * acc_stride, acc_stride);
  }
}

// x [M, K] packed tile by tile, row index fastest: xp[t, k, r] = x[t * kMR + r, k]. The last tile's lanes past M
// are left as they were: every walk multiplies a tile's real rows only (MicroTileRows), and writing them zero was
// most of this pass's stores at one row (5 of 6 lanes), 1.3% of an int8 one-request step's CPU time.
void PackRows(const Shape& s, const float* x, float* xp) {
  for (int64_t m = 0; m < s.m; ++m) {
    float* out = xp + m / kMR * s.k * kMR + m % kMR;
    for (int64_t k = 0; k < s.k; ++k) out[k * kMR] = x[m * s.k + k];
  }
}

// The vectors of columns a tile walks on a packed weight when x is one tile of rows that do not walk Streams (below):
// 2 to 6 rows with AVX2. 4 vectors: up to 24 sums, some spilled of AVX2's 16 registers, and still level with 2
// vectors' 12 at 4-6 rows; walked band by band over the panel's two halves, 2-4 rows ran 1.02-1.06x faster than half
// by half (2-vCPU Zen 3 VM, bench/cpu_matmul.py's projections, packed, interleaved in one process).
constexpr int kOneTileNR = 4;

// acc[r, :kPackCols] (row stride acc_stride) = x[r, k0:k1] @ w[k0:k1, j:j + kPackCols] for R rows r of x on a packed
// weight, the panel's rows walked as S sequential streams at once (S equal parts of [k0, k1)), each weight vector
// loaded once for the R rows and summed into one set of registers a row. One stream a core read 18.8-21.2 GB/s on the
// 2-vCPU Zen 3 VM, two 26.0 (scratch read loop); a one-row product over the panel's two halves at once ran 1.10-1.13x
// (float32) and 1.07-1.20x (int8) faster than down the panel in one stream (bench/cpu_matmul.py's projections,
// interleaved in one process), four streams no better than two there. Down the whole panel in one stream was itself
// 1.29-1.36x (float32) and 1.06-1.20x (int8) faster than in two halves. On a 2-vCPU Intel Xeon VM (AVX-512, 2.6 GHz)
// four streams beat two, and both beat the register tile (MicroTile<1, 4>, one stream a panel) that AVX-512 took for
// one row before: the projections, interleaved in one process, in ms per pass (GB/s): int8 4.81 (15.8) with the tile,
// 4.21 (18.0) with two streams, 3.14 (24.1) with four, eight 0.93x of four; bfloat16 8.73 / 5.29 / 4.78; float32 11.13
// / 10.35 / 9.85. One request end to end there, int8 137-139 tok/s with the tile and 274-280 with four streams, float32
// 68-71 and 75-78 (two streams 70-71). Narrow weights prefetch each stream kStreamAhead bytes ahead, into L2: an int8
// row is one cache line against float32's four, so a stream moves on by one line per row walked. (Not because of the
// widening: int8 bytes read as float32 lanes, with no widening at all, walked no faster, 0.96-1.04x.) The small
// preset's 100 MB of int8 products as a decode step calls them (two threads, pairs interleaved in one process, 2-vCPU
// Zen 3 VM): 16.0 GB/s without, 16.6 with, 233 of 300 pairs faster; bfloat16 1.06x; float32 0.84x, so not there; 1 to 3
// KB ahead alike. One request end to end: int8 1.05x (15 of 16 alternating rounds), bfloat16 1.06x (8 of 10).
constexpr int64_t kStreamAhead = 2048;

constexpr int kStreamParts = 4;  // S above

// Rows of x that walk Streams on a packed weight, each weight vector loaded once for all of them. With AVX-512 a
// panel is 4 vectors, so 6 rows' sums are 24 of the 32 registers; it beat the register tiles (MicroTile, one stream a
// panel) at every row count up to 6 on the 2-vCPU Xeon VM (the projections, interleaved in one process, ms per pass
// tiles / streams: 2 rows int8 5.80 / 4.43, float32 12.83 / 10.91, bfloat16 10.44 / 6.52; 4 rows 7.60 / 4.40, 15.09
// / 11.70, 10.71 / 6.06; 6 rows 8.85 / 5.93, 17.31 / 12.43, 12.45 / 7.50; 4 requests int8 end to end 343-358 against
// 543-548 tok/s). With AVX2 a panel is 8 vectors and two rows' sums would fill all 16 registers: one row.
#if defined(__AVX512F__)
constexpr int64_t kStreamedRows = kMR;
#else
constexpr int64_t kStreamedRows = 1;
#endif

// Up to kStreamedRows rows of x on a packed weight walk Streams, which reads x where it is, not packed.
inline bool WalksStreams(const Shape& s) { return s.packed && s.m <= kStreamedRows; }

template <int S, int R, typename WT>
void Streams(const Shape& s, const float* x, const WT* w, int64_t k0, int64_t k1, int64_t j, float* acc,
             int64_t acc_stride) {
  constexpr bool kAhead = sizeof(WT) < sizeof(float);
  constexpr int kRowBytes = kPackCols * sizeof(WT);
  constexpr int NR = kPackCols / kLanes;
  fvec c[R][NR];
  for (int m = 0; m < R; ++m) {
    for (int v = 0; v < NR; ++v) c[m][v] = fvec{};
  }
  const int64_t part = (k1 - k0) / S;
  const WT* r[S];
  const float* xs[S];
  for (int i = 0; i < S; ++i) {
    r[i] = At(s, w, k0 + i * part, j);
    xs[i] = x + k0 + i * part;
  }
  const auto add_row = [&](const float* xk, const WT* row) {  // c[m] += x[m, k] * w[k, j:j + kPackCols]
    fvec wv[NR];
    for (int v = 0; v < NR; ++v) wv[v] = Load(row + v * kLanes);
    for (int m = 0; m < R; ++m) {
      const fvec bx = Broadcast(xk[m * s.k]);
      for (int v = 0; v < NR; ++v) c[m][v] += bx * wv[v];
    }
  };
  for (int64_t k = 0; k < part; ++k) {
    for (int i = 0; i < S; ++i) {
      if (kAhead) {
        const char* ahead = reinterpret_cast<const char*>(r[i] + k * kPackCols) + kStreamAhead;
        for (int b = 0; b < kRowBytes; b += 64) __builtin_prefetch(ahead + b, 0, 2);  // into L2 (prefetcht1)
      }
      add_row(xs[i] + k, r[i] + k * kPackCols);
    }
  }
  for (int64_t k = k0 + S * part; k < k1; ++k) add_row(x + k, At(s, w, k, j));  // left over from S parts
  for (int m = 0; m < R; ++m) {
    for (int v = 0; v < NR; ++v) Store(acc + m * acc_stride + v * kLanes, c[m][v]);
  }
}

// acc [M, nb] = x[:, k0:k1] @ w[k0:k1, n0:n0 + nb] on a packed weight, panel by panel: each 64-column panel's
// bands of `band` rows in order, each band NR vectors of columns at a time (Panel). With `prefetch`, a band's tiles
// prefetch the same columns of the panel's next band (none past the task's rows). acc starts at zero.
template <int NR, typename WT>
void PanelByPanel(const Shape& s, const float* xp, const WT* w, int64_t k0, int64_t k1, int64_t n0, int64_t nb,
                  int64_t band, bool prefetch, float* acc, int64_t acc_stride) {
  for (int64_t p = 0; p < nb; p += kPackCols) {
    for (int64_t kb = k0; kb < k1; kb += band) {
      const int64_t kc = std::min(band, k1 - kb);
      const bool ahead = prefetch && kb + 2 * band <= k1;
      for (int64_t j = p; j < p + kPackCols; j += NR * kLanes) {
        Panel<NR>(s, xp, kb, At(s, w, kb, n0 + j), kc, ahead ? At(s, w, kb + band, n0 + j) : nullptr, acc + j,
                  acc_stride, band);
      }
    }
  }
}

// acc [M, n1 - n0] (row stride acc_stride) = x[:, k0:k1] @ w[k0:k1, n0:n1], register-blocked; xp is x packed
// (PackRows), except where it walks Streams (WalksStreams), which reads x where it is.
template <typename WT>
void AccumulateBlocked(const Shape& s, const float* x, const float* xp, const WT* w, int64_t k0, int64_t k1,
                       int64_t n0, int64_t n1, float* acc, int64_t acc_stride) {
  const int64_t nb = n1 - n0;
  // One tile of x on a packed weight: panel by panel, each walked down all its rows in sequential runs the
  // prefetchers follow (band-ahead prefetching measured slower here); up to kStreamedRows rows walk each panel's
  // quarters at once (Streams, which writes its sums rather than adding to them). A tile narrower than the panel
  // (AVX2, more than one row) walks it a band at a time, every part of the band before the next, so the band's rows
  // come from memory once, in order, and from L1 for the other parts. More tiles with AVX2 on a packed weight: panel
  // by panel as well, below; otherwise band by band, so that x's band stays in L1 across the panels.
  if (WalksStreams(s)) {
    static_assert(kStreamedRows == 1 || kStreamedRows == 6, "one case per row count");
    for (int64_t p = 0; p < nb; p += kPackCols) {
      switch (s.m) {
        case 1: Streams<kStreamParts, 1>(s, x, w, k0, k1, n0 + p, acc + p, acc_stride); break;
#if defined(__AVX512F__)
        case 2: Streams<kStreamParts, 2>(s, x, w, k0, k1, n0 + p, acc + p, acc_stride); break;
        case 3: Streams<kStreamParts, 3>(s, x, w, k0, k1, n0 + p, acc + p, acc_stride); break;
        case 4: Streams<kStreamParts, 4>(s, x, w, k0, k1, n0 + p, acc + p, acc_stride); break;
        case 5: Streams<kStreamParts, 5>(s, x, w, k0, k1, n0 + p, acc + p, acc_stride); break;
        case 6: Streams<kStreamParts, 6>(s, x, w, k0, k1, n0 + p, acc + p, acc_stride); break;
#endif
        default: break;
      }
    }
    return;
  }
  for (int64_t m = 0; m < s.m; ++m) std::fill(acc + m * acc_stride, acc + m * acc_stride + nb, 0.0f);
  if (s.packed && s.m <= kMR) {
    PanelByPanel<kOneTileNR>(s, xp, w, k0, k1, n0, nb, kKC, /*prefetch=*/false, acc, acc_stride);
    return;
  }
#if !defined(__AVX512F__)
  // More tiles on a packed weight with AVX2: panel by panel too, each panel's bands in order, so a task's weight is
  // one sequential stream and a band ahead of it (prefetched) is a few KB away. Band by band across the panels
  // (below) keeps x's band in L1 instead, but its prefetches run a whole band of the task's panels ahead (up to
  // 512 KB with 128-row bands: L2), and the stream it reads has one run per panel. Panel by panel measured
  // 1.10-1.20x the tokens end to end (2-vCPU Zen 3 VM, the peers' small model: 16 requests float32 1.11x and int8
  // 1.10x, 64 requests float32 1.20x; the projections alone 1.11-1.19x faster at 7-32 rows).
  if (s.packed) {
    PanelByPanel<kNR>(s, xp, w, k0, k1, n0, nb, s.m >= kDeepBandRows ? kDeepKC : kKC, /*prefetch=*/true, acc,
                      acc_stride);
    return;
  }
#endif
  for (int64_t kb = k0; kb < k1; kb += kKC) {
    const int64_t kc = std::min(kKC, k1 - kb);
    // the next band, prefetched while this one is worked (none past the task's rows)
    const bool prefetch = kb + 2 * kKC <= k1;
    const auto next = [&](int64_t j) { return prefetch ? At(s, w, kb + kKC, n0 + j) : nullptr; };
    int64_t j = 0;
    for (; j + kNR * kLanes <= nb; j += kNR * kLanes) {
      Panel<kNR>(s, xp, kb, At(s, w, kb, n0 + j), kc, next(j), acc + j, acc_stride);
    }
    static_assert(kNR <= 4, "one case per remaining vector count");
    switch ((nb - j) / kLanes) {  // the last panel, narrower (never of a packed weight: N is whole panels)
      case 3: Panel<3>(s, xp, kb, At(s, w, kb, n0 + j), kc, next(j), acc + j, acc_stride); break;
      case 2: Panel<2>(s, xp, kb, At(s, w, kb, n0 + j), kc, next(j), acc + j, acc_stride); break;
      case 1: Panel<1>(s, xp, kb, At(s, w, kb, n0 + j), kc, next(j), acc + j, acc_stride); break;
      default: break;
    }
    j += (nb - j) / kLanes * kLanes;
    for (; j < nb; ++j) {  // the last columns when nb is not a multiple of the vector width
      for (int64_t m = 0; m < s.m; ++m) {
        const float* xr = xp + (m / kMR * s.k + kb) * kMR + m % kMR;
        float sum = acc[m * acc_stride + j];
        for (int64_t k = 0; k < kc; ++k) sum += xr[k * kMR] * ToFloat(*At(s, w, kb + k, n0 + j));
        acc[m * acc_stride + j] = sum;
      }
    }
  }
}

// The blocked path's task grid: one column block a thread (panels of kNR vectors spread evenly), more when a
// block's sums would not fit kBlockedAcc, K splits when there are fewer column blocks than threads.
Grid MakeBlockedGrid(const Shape& s, int64_t workers) {
  constexpr int64_t panel = kNR * kLanes;
  const int64_t max_nb = std::max<int64_t>(panel, kBlockedAcc / s.m / panel * panel);
  int64_t blocks = std::max<int64_t>(workers, (s.n + max_nb - 1) / max_nb);
  blocks = (blocks + workers - 1) / workers * workers;  // a multiple of the threads
  int64_t nb = (s.n + blocks - 1) / blocks;
  const int64_t unit = s.packed ? kPackCols : kLanes;  // a packed weight's blocks are whole panels
  nb = std::min(std::max(unit, max_nb / unit * unit), (nb + unit - 1) / unit * unit);
  const int64_t col_blocks = (s.n + nb - 1) / nb;
  int64_t k_splits = std::max<int64_t>(1, (workers + col_blocks - 1) / col_blocks);
  k_splits = std::max<int64_t>(1, std::min(k_splits, s.k / kMinSplitRows));
  const int64_t k_per_split = (s.k + k_splits - 1) / k_splits;
  return {nb, col_blocks, (s.k + k_per_split - 1) / k_per_split, k_per_split};
}

// ---- Many rows (a prompt step), cache-blocked ------------------------------------------------------------------
//
// A prompt step multiplies hundreds or thousands of rows, so each weight is used by many rows and the products are
// bound by multiply-adds, not by memory: the point is to keep the FMA units fed. The weight is cut into bands of
// kGemmKC rows x kGemmNC columns; each band is packed once (converted to float32, panel by panel: [panel, k,
// kGemmPanel], 64-byte aligned) into a per-thread buffer, and then every tile of kGemmMR rows of x walks the whole
// band a panel at a time. Per weight row a tile loads kGemmNR vectors of the panel (L2/L3, prefetched kGemmAhead
// rows ahead into L1) and broadcasts kGemmMR values of x (read in place: the tile's kGemmKC-long row runs stay in
// L1 across the band's panels), feeding kGemmMR * kGemmNR multiply-adds to sums held in registers. Sums go to
// `out` once per band (loaded back for the next band; the int8 scales are applied after the last).
//
// Bands are deep (kGemmKC): a task's block of `out` (M x its columns: megabytes in a prompt step) does not stay in
// cache from one band to the next, so every band after the first reloads it from memory, tile by tile, with
// stalls the multiply-adds do not hide. 768 rows (the small preset's K = 768 in one band, its K = 2048 in three)
// measured 1.05-1.10x the throughput of 256 (2-vCPU AMD EPYC Zen 4: one core's products at 1,920 rows 104-109
// against 95-102 GFLOP/s; the step's 84 products on two threads 1,713-1,772 against 1,806-1,851 ms; at 128 rows
// 124-129 against 133-134 ms), although the band itself (1.5 MB) no longer fits L2.
//
//   out [M, N]:   tasks split the columns in whole panels (one task a thread), and the rows too (in whole tiles)
//                 when there are fewer panels than threads; each task packs the bands of its own columns.

#if defined(__AVX512F__)
constexpr int kGemmNR = 4;  // 6 x 4 sums + 4 weight vectors + 1 broadcast of the 32 registers
#else
constexpr int kGemmNR = 2;  // AVX2: 6 x 2 sums + 2 + 1 of the 16
#endif
constexpr int kGemmMR = 6;                           // rows of x a tile
constexpr int64_t kGemmPanel = kGemmNR * kLanes;     // columns a panel
constexpr int64_t kGemmKC = 768;                     // weight rows a band (see above)
constexpr int64_t kGemmNC = 512;                     // columns a band: 768 x 512 float32 = 1.5 MB
constexpr int64_t kGemmAhead = 8;                    // panel rows prefetched ahead of the one in use
static_assert(kGemmNC % kGemmPanel == 0, "a band holds whole panels");
static_assert(kPackCols % kGemmPanel == 0 && kPackCols % (kNR * kLanes) == 0, "a tile stays in one packed panel");

// c[r, :kGemmPanel] (row stride c_stride) = sum over k < kc of x[r][k] * panel[k, :] (+ c when not kFirst), for
// r < kGemmMR; times scales[:kGemmPanel] when scales is not null (the band is the last).
template <bool kFirst>
inline void GemmTile(const float* const* __restrict x, const float* __restrict panel, int64_t kc,
                     const float* scales, float* __restrict c, int64_t c_stride) {
  fvec sum[kGemmMR][kGemmNR];
  for (int r = 0; r < kGemmMR; ++r) {
    for (int j = 0; j < kGemmNR; ++j) sum[r][j] = kFirst ? fvec{} : Load(c + r * c_stride + j * kLanes);
  }
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5];
  static_assert(kGemmMR == 6, "one pointer per row");
  for (int64_t k = 0; k < kc; ++k, panel += kGemmPanel) {
    for (int64_t j = 0; j < kGemmPanel * static_cast<int64_t>(sizeof(float)); j += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(panel + kGemmAhead * kGemmPanel) + j, 0, 3);
    }
    fvec w[kGemmNR];
    for (int j = 0; j < kGemmNR; ++j) w[j] = Load(panel + j * kLanes);
    // one broadcast live at a time: 6 x NR sums + NR weights + 1 fit the registers without spilling
    fvec b = Broadcast(x0[k]);
    for (int j = 0; j < kGemmNR; ++j) sum[0][j] += b * w[j];
    b = Broadcast(x1[k]);
    for (int j = 0; j < kGemmNR; ++j) sum[1][j] += b * w[j];
    b = Broadcast(x2[k]);
    for (int j = 0; j < kGemmNR; ++j) sum[2][j] += b * w[j];
    b = Broadcast(x3[k]);
    for (int j = 0; j < kGemmNR; ++j) sum[3][j] += b * w[j];
    b = Broadcast(x4[k]);
    for (int j = 0; j < kGemmNR; ++j) sum[4][j] += b * w[j];
    b = Broadcast(x5[k]);
    for (int j = 0; j < kGemmNR; ++j) sum[5][j] += b * w[j];
  }
  for (int r = 0; r < kGemmMR; ++r) {
    for (int j = 0; j < kGemmNR; ++j) {
      Store(c + r * c_stride + j * kLanes, scales == nullptr ? sum[r][j] : sum[r][j] * Load(scales + j * kLanes));
    }
  }
}

// band[p, k, :] = w[k0 + k, n0 + p * kGemmPanel + :] in float32, for k < kc and the panels of columns [n0, n1)
// (the last panel zero-padded to kGemmPanel columns).
template <typename WT>
void PackBand(const Shape& s, const WT* w, int64_t k0, int64_t kc, int64_t n0, int64_t n1, float* band) {
  for (int64_t p0 = n0; p0 < n1; p0 += kGemmPanel, band += kc * kGemmPanel) {
    const int64_t cols = std::min(kGemmPanel, n1 - p0);
    for (int64_t k = 0; k < kc; ++k) {
      const WT* row = At(s, w, k0 + k, p0);
      float* dst = band + k * kGemmPanel;
      if (cols == kGemmPanel) {
        for (int j = 0; j < kGemmNR; ++j) Store(dst + j * kLanes, Load(row + j * kLanes));
      } else {
        for (int64_t j = 0; j < kGemmPanel; ++j) dst[j] = j < cols ? ToFloat(row[j]) : 0.0f;
      }
    }
  }
}

alignas(64) constexpr float kZeroRow[kGemmKC] = {};  // the x rows past M of a short tile

// out[m0:m1, n0:n1] = x[m0:m1, :] @ w[:, n0:n1] (times scales[n0:n1] when not null): one task.
template <typename WT>
void GemmTask(const Shape& s, const float* x, const WT* w, const float* scales, float* out, int64_t m0, int64_t m1,
              int64_t n0, int64_t n1) {
  float* band = Scratch<4>(kGemmKC * kGemmNC);
  for (int64_t nc0 = n0; nc0 < n1; nc0 += kGemmNC) {
    const int64_t nc1 = std::min(n1, nc0 + kGemmNC);
    for (int64_t k0 = 0; k0 < s.k; k0 += kGemmKC) {
      const int64_t kc = std::min(kGemmKC, s.k - k0);
      const bool last = k0 + kc == s.k;
      const auto tile = k0 == 0 ? &GemmTile<true> : &GemmTile<false>;  // the first band starts the sums
      PackBand(s, w, k0, kc, nc0, nc1, band);
      for (int64_t m = m0; m < m1; m += kGemmMR) {
        const int64_t rows = std::min<int64_t>(kGemmMR, m1 - m);
        const float* xr[kGemmMR];
        for (int r = 0; r < kGemmMR; ++r) xr[r] = r < rows ? x + (m + r) * s.k + k0 : kZeroRow;
        const float* panel = band;
        for (int64_t p0 = nc0; p0 < nc1; p0 += kGemmPanel, panel += kc * kGemmPanel) {
          const int64_t cols = std::min(kGemmPanel, nc1 - p0);
          const float* sc = last && scales != nullptr ? scales + p0 : nullptr;
          float* c = out + m * s.n + p0;
          if (rows == kGemmMR && cols == kGemmPanel) {
            tile(xr, panel, kc, sc, c, s.n);
            continue;
          }
          // an edge tile (fewer rows or columns): through a full-size buffer, scaled on the way back
          alignas(64) float local[kGemmMR * kGemmPanel] = {};
          for (int64_t r = 0; r < rows && k0 > 0; ++r) {
            std::copy(c + r * s.n, c + r * s.n + cols, local + r * kGemmPanel);
          }
          tile(xr, panel, kc, nullptr, local, kGemmPanel);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < cols; ++j) {
              c[r * s.n + j] = local[r * kGemmPanel + j] * (sc == nullptr ? 1.0f : sc[j]);
            }
          }
        }
      }
    }
  }
}

// out = x @ w (times scales) for M > kMaxRows: tasks of whole panels of columns, and whole tiles of rows when there
// are fewer panels than threads.
template <typename WT>
void RunGemm(ffi::ThreadPool& pool, const Shape& s, const float* x, const WT* w, const float* scales, float* out) {
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t panels = (s.n + kGemmPanel - 1) / kGemmPanel, tiles = (s.m + kGemmMR - 1) / kGemmMR;
  const int64_t col_tasks = std::min(panels, workers);
  const int64_t row_tasks = std::min(tiles, (workers + col_tasks - 1) / col_tasks);
  ParallelFor(pool, col_tasks * row_tasks, [&](int64_t task) {
    const int64_t ct = task % col_tasks, rt = task / col_tasks;
    const int64_t n0 = std::min(s.n, panels * ct / col_tasks * kGemmPanel);
    const int64_t n1 = std::min(s.n, panels * (ct + 1) / col_tasks * kGemmPanel);
    const int64_t m0 = std::min(s.m, tiles * rt / row_tasks * kGemmMR);
    const int64_t m1 = std::min(s.m, tiles * (rt + 1) / row_tasks * kGemmMR);
    if (n0 < n1 && m0 < m1) GemmTask(s, x, w, scales, out, m0, m1, n0, n1);
  });
}

// One weight's product in a call (a call multiplies x by one or more weights: a layer's q, k and v, or its gate and
// up projections): the layer's slice, its output, and the task grid its columns (and rows of K) are cut into.
struct Product {
  Shape s;
  ffi::DataType type;
  const void* w;        // the layer's slice
  const float* scales;  // int8: per output channel
  float* out;           // [M, N]
  bool blocked;         // register-blocked tasks (else streaming)
  Grid g;
  float* partial;       // [k_splits, M, N] when the grid splits K
  int64_t first_task;   // the call's tasks [first_task, first_task + tasks) are this product's
  int64_t tasks() const { return g.col_blocks * g.k_splits; }
  int64_t partial_size() const { return g.k_splits > 1 ? g.k_splits * s.m * s.n : 0; }
};

template <typename WT>
void RunTask(const Product& p, const float* x, const float* xp, int64_t task) {
  const Shape& s = p.s;
  const Grid& g = p.g;
  const WT* w = static_cast<const WT*>(p.w);
  const int64_t n0 = task % g.col_blocks * g.nb, nb = std::min(g.nb, s.n - n0);
  const int64_t split = task / g.col_blocks, k0 = split * g.k_per_split, k1 = std::min(s.k, k0 + g.k_per_split);
  // acc rows kLanes apart from a multiple of 4 KB: rows at 4 KB strides would alias in L1 and stall the stores
  const int64_t stride = g.nb + kLanes;
  float* acc;
  alignas(64) float local[kAccFloats + kMaxStreamedRows * kLanes];
  if (p.blocked) {
    acc = Scratch<2>(s.m * stride);
    AccumulateBlocked(s, x, xp, w, k0, k1, n0, n0 + nb, acc, stride);
  } else {
    acc = local;
    Accumulate(s, x, w, k0, k1, n0, n0 + nb, acc, stride);
  }
  if (g.k_splits == 1) {
    Write(s, acc, stride, p.scales, p.out, n0, nb);
  } else {
    Write(s, acc, stride, nullptr, p.partial + split * s.m * s.n, n0, nb);
  }
}

int64_t WeightBytes(ffi::DataType type) { return type == ffi::F32 ? 4 : type == ffi::BF16 ? 2 : 1; }

// out = x @ w (times scales) for every product, M rows of x alike. Up to kMaxRows rows the products' tasks go to the
// pool together, so a few small weights cost one wait for the threads rather than one each; more rows (a prompt
// step, bound by multiply-adds) run the products one after the other.
void RunProducts(ffi::ThreadPool& pool, const float* x, std::vector<Product>& products) {
  const int64_t m = products[0].s.m, k = products[0].s.k;
  if (m > kMaxRows) {
    for (const Product& p : products) {
      switch (p.type) {
        case ffi::F32: RunGemm(pool, p.s, x, static_cast<const float*>(p.w), p.scales, p.out); break;
        case ffi::BF16: RunGemm(pool, p.s, x, static_cast<const bf16_bits*>(p.w), p.scales, p.out); break;
        default: RunGemm(pool, p.s, x, static_cast<const int8_t*>(p.w), p.scales, p.out); break;
      }
    }
    return;
  }
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  int64_t tasks = 0, partials = 0;
  bool any_blocked = false;
  for (Product& p : products) {
    p.blocked = p.s.packed || m > (p.type == ffi::F32 ? kMaxStreamedRows : 0);
    p.g = p.blocked ? MakeBlockedGrid(p.s, workers) : MakeGrid(p.s, WeightBytes(p.type), workers);
    p.first_task = tasks;
    tasks += p.tasks();
    partials += p.partial_size();
    any_blocked |= p.blocked;
  }
  // Rows that walk Streams are not packed: Streams reads them where they are. Packing one row took ~2 us of each
  // such call before any thread could start (the row had just been written on the other core), 0.1 ms of an int8
  // one-request step.
  const bool x_as_is =
      std::all_of(products.begin(), products.end(), [](const Product& p) { return WalksStreams(p.s); });
  float* xp = nullptr;
  if (any_blocked && !x_as_is) {
    xp = Scratch<3>((m + kMR - 1) / kMR * kMR * k);
    PackRows(products[0].s, x, xp);
  }
  float* partial = Scratch<1>(partials);
  for (Product& p : products) {
    p.partial = partial;
    partial += p.partial_size();
  }
  ParallelFor(pool, tasks, [&](int64_t task) {
    size_t i = 0;
    while (task >= products[i].first_task + products[i].tasks()) ++i;
    const Product& p = products[i];
    switch (p.type) {
      case ffi::F32: RunTask<float>(p, x, xp, task - p.first_task); break;
      case ffi::BF16: RunTask<bf16_bits>(p, x, xp, task - p.first_task); break;
      default: RunTask<int8_t>(p, x, xp, task - p.first_task); break;
    }
  });
  for (const Product& p : products) {
    if (p.g.k_splits == 1) continue;
    const int64_t size = m * p.s.n;
    for (int64_t i = 0; i < size; ++i) {
      float sum = p.partial[i];
      for (int64_t split = 1; split < p.g.k_splits; ++split) sum += p.partial[split * size + i];
      p.out[i] = p.scales != nullptr ? sum * p.scales[i % p.s.n] : sum;
    }
  }
}

// The weights and their scales come in pairs after x, layer and rows; one output a pair.
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                      ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || weights.size() == 0 || weights.size() != 2 * outs.size()) {
    return ffi::Error::InvalidArgument("cpu matmul: expected x [M, K], then (w, scales) pairs, one output each");
  }
  // the padding rows past `rows` are not multiplied: m counts the real ones
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]), l = layer.typed_data()[0];
  std::vector<Product> products;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto w = weights.get<ffi::AnyBuffer>(2 * i);
    auto scales = weights.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !scales.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("cpu matmul: a weight, its scales or its output has the wrong type");
    }
    auto wd = w->dimensions();
    const bool packed = wd.size() == 4;
    if (!(wd.size() == 3 && xd[1] == wd[1]) && !(packed && xd[1] == wd[2] && wd[3] == kPackCols)) {
      return ffi::Error::InvalidArgument("cpu matmul: expected w [L, K, N] or [L, N / 64, K, 64] for x [M, K]");
    }
    if (l < 0 || l >= wd[0]) {
      return ffi::Error::InvalidArgument("cpu matmul: layer out of range");
    }
    const Shape s{m, xd[1], packed ? wd[1] * wd[3] : wd[2], packed};
    const ffi::DataType type = w->element_type();
    if (type != ffi::F32 && type != ffi::BF16 && type != ffi::S8) {
      return ffi::Error::InvalidArgument("cpu matmul: w must be float32, bfloat16 or int8");
    }
    if (type == ffi::S8 && (scales->dimensions().size() != 2 || scales->dimensions()[1] != s.n)) {
      return ffi::Error::InvalidArgument("cpu matmul: int8 weights need scales [L, N]");
    }
    float* o = (*out)->typed_data();
    std::fill(o + m * s.n, o + xd[0] * s.n, 0.0f);
    const char* slice = static_cast<const char*>(w->untyped_data()) + l * s.k * s.n * WeightBytes(type);
    products.push_back(Product{s, type, slice, type == ffi::S8 ? scales->typed_data() + l * s.n : nullptr, o});
  }
  const float* xf = static_cast<const float*>(x.untyped_data());  // float32 rows are read where they are
  if (x.element_type() == ffi::BF16) {  // bfloat16 rows in float32 once, not once per task
    const bf16_bits* xb = static_cast<const bf16_bits*>(x.untyped_data());
    float* converted = Scratch<0>(m * xd[1]);
    for (int64_t i = 0; i < m * xd[1]; ++i) converted[i] = ToFloat(xb[i]);
    xf = converted;
  } else if (x.element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("cpu matmul: x must be float32 or bfloat16");
  }
  if (m > 0) RunProducts(pool, xf, products);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .RemainingArgs()               // (w, scales) for each product
                                  .RemainingRets()               // out for each product
);

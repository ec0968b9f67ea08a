// Paged attention for the CPU backend, called from XLA through the FFI (jaxserve/cpu/__init__.py).
//
// The XLA path of jaxserve/models/attention.py gathers every sequence's pages into a dense [.., context, head_dim]
// copy before attending; on a CPU that copy is the step's largest memory traffic. This kernel reads the pages
// in place instead. One kernel serves decode and mixed steps: tokens are laid out ragged, sequence after sequence.
//
//   q            [T, H, D]                       float32 | bfloat16
//   cache_k, _v  [layers, kv_heads, pages, page_size, D]   float32 | bfloat16 (page 0: the null page)
//   layer        int32 [1]; window int32 [1] (0: none; an operand because a layer scan reads it per layer)
//   block_tables [S, P] int32, context_lens [S] int32, query_start [S + 1] int32
//   scale, softcap (attributes): scores = q.k * scale, then softcap * tanh(scores / softcap) when softcap > 0
//   out          [T, H, D] (q's dtype); padding tokens (t >= query_start[S]) and empty sequences give zeros
//
// Token t of sequence s sits at position context_lens[s] - (query_start[s + 1] - t) and attends to the cached
// positions <= its own (and > its own - window when window > 0). Work is split into tasks that the calling thread
// and XLA's intra-op thread pool share: a (token, kv head) pair for a decode token (or without AVX2), a tile of up
// to 16 consecutive tokens of one sequence against one kv head for a prompt's tokens (the prompt path below).

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

using namespace jaxserve_cpu;

inline fvec Splat(float v) { return fvec{} + v; }
inline float Sum(fvec v) {  // a tree of halvings, not a chain of kLanes dependent adds
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &v, sizeof(x));
  return _mm512_reduce_add_ps(x);
#elif defined(__AVX__)
  __m256 x;
  std::memcpy(&x, &v, sizeof(x));
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
#else
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// exp(x) for x <= 0 (scores minus their maximum), lanewise: 2^n * p(r) with x = n ln 2 + r, |r| <= ln 2 / 2, p the
// degree-6 minimax polynomial of Cephes' expf (relative error about 2e-7); below -87 (where exp underflows float32's
// normal range) the result is 0.
inline fvec Exp(fvec x) {
  const fvec lo = Splat(-87.0f);
  const ivec under = x < lo;
  x = under ? lo : x;
  const fvec t = x * 1.44269504088896341f - 0.5f;  // x / ln 2, then rounded to nearest by truncating t - 0.5 <= 0
  const ivec n = __builtin_convertvector(t, ivec);
  const fvec nf = __builtin_convertvector(n, fvec);
  const fvec r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;  // ln 2 in two parts
  fvec p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (n + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const fvec out = p * scale;
  return under ? fvec{} : out;
}

// row[j] = exp(row[j] - peak) for j < n; returns their sum. The last n % kLanes in one vector too (padded with
// -inf, whose exp is 0): a row of a prompt's token is short, and its tail one at a time cost as much as the rest.
inline float ExpRow(float* row, int64_t n, float peak) {
  fvec total{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const fvec e = Exp(Load(row + j) - peak);
    Store(row + j, e);
    total += e;
  }
  if (j < n) {
    alignas(64) float tail[kLanes];
    std::fill(tail, tail + kLanes, -INFINITY);
    std::copy(row + j, row + n, tail);
    const fvec e = Exp(Load(tail) - peak);
    Store(tail, e);
    std::copy(tail, tail + (n - j), row + j);
    total += e;
  }
  return Sum(total);
}

// max(row[0..n)), n >= 1
inline float MaxRow(const float* row, int64_t n) {
  float peak = row[0];
  int64_t j = 0;
  if (n >= kLanes) {
    fvec m = Load(row);
    for (j = kLanes; j + kLanes <= n; j += kLanes) {
      const fvec v = Load(row + j);
      m = v > m ? v : m;
    }
    for (int i = 0; i < kLanes; ++i) peak = std::max(peak, m[i]);
  }
  for (; j < n; ++j) peak = std::max(peak, row[j]);
  return peak;
}

// q . k over d values; q is float32, k the cache's type
template <typename KT>
inline float Dot(const float* q, const KT* k, int64_t d) {
  int64_t i = 0;
  float sum = 0.0f;
  if (d >= kLanes) {
    fvec acc = Load(q) * Load(k);
    for (i = kLanes; i + kLanes <= d; i += kLanes) acc += Load(q + i) * Load(k + i);
    sum = Sum(acc);
  }
  for (; i < d; ++i) sum += q[i] * ToFloat(k[i]);
  return sum;
}

// a[i] += w * v[i] for i < d
template <typename KT>
inline void AddScaled(float* a, float w, const KT* v, int64_t d) {
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) Store(a + i, Load(a + i) + w * Load(v + i));
  for (; i < d; ++i) a[i] += w * ToFloat(v[i]);
}

// The blocked paths below (a vector's worth of keys dotted at once, value sums and a prompt's scores held in
// registers) take AVX-512 or AVX2; their register budgets are sized for 32 and 16 vector registers.
#if defined(__AVX512F__) || defined(__AVX2__)
#define JAXSERVE_BLOCKED_ATTENTION 1
constexpr int64_t kMaxBlockedDim = 256;  // head_dim the blocked paths take
constexpr int64_t kHeadsInRegisters = 4;  // query heads whose value sums stay in registers together
// vectors of a value row those sums cover at a time: 4 x 4 sums of 32 registers (AVX-512); 4 x 2 sums, 2 value
// vectors and a splat of 16 (AVX2)
#if defined(__AVX512F__)
constexpr int kRowVectors = 4;
typedef __m512 vreg;
#else
constexpr int kRowVectors = 2;
typedef __m256 vreg;
#endif

inline vreg AsReg(fvec v) {
  vreg x;
  std::memcpy(&x, &v, sizeof(x));
  return x;
}

// The first two levels of SumsOfLanes' tree, per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of vectors a, b; then
// of two such, [a, b, c, d] summed over their four lanes.
#if defined(__AVX512F__)
inline vreg InterleavedSum(vreg a, vreg b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline vreg PairedSum(vreg a, vreg b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
#else
inline vreg InterleavedSum(vreg a, vreg b) {
  return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
}
inline vreg PairedSum(vreg a, vreg b) {
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
#endif

// {sum(v[0]), ..., sum(v[kLanes - 1])}: the vectors' horizontal sums in one vector, by pairwise interleaves and
// adds (AVX-512: 45 operations, where 16 separate reductions take about 160).
inline fvec SumsOfLanes(const vreg* v) {
  vreg t[kLanes / 2], u[kLanes / 4];
  for (int i = 0; i < kLanes / 2; ++i) t[i] = InterleavedSum(v[2 * i], v[2 * i + 1]);  // keys 2i, 2i + 1
  for (int i = 0; i < kLanes / 4; ++i) u[i] = PairedSum(t[2 * i], t[2 * i + 1]);  // per lane, keys 4i..4i+3
#if defined(__AVX512F__)
  // the four 128-bit lanes summed: lane i of the result holds keys 4i..4i+3
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
#else
  // the two 128-bit lanes summed: the low lane of the result holds keys 0..3, the high one keys 4..7
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
#endif
  fvec out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// {q . keys[0], ..., q . keys[kLanes - 1]} over d values (a multiple of kLanes)
template <typename KT>
inline fvec DotsOfLanes(const float* q, const KT* const* keys, int64_t d) {
  vreg part[kLanes];
  for (int i = 0; i < kLanes; ++i) part[i] = AsReg(Load(q) * Load(keys[i]));
  for (int64_t c = kLanes; c < d; c += kLanes) {
    const fvec qc = Load(q + c);
    for (int i = 0; i < kLanes; ++i) part[i] = AsReg(fvec(part[i]) + qc * Load(keys[i] + c));
  }
  return SumsOfLanes(part);
}

// Weight w(h, j) of head (or row) h for key j sits at weights[h * Strides::head + j * Strides::key].
struct Strides {
  int64_t head, key;
};

// acc[h * d + c0 + i] += sum over keys j < n of w(h, j) * row_of(j)[c0 + i], for H heads and V vectors of columns
// from c0: the H x V sums stay in registers over all n keys; each value row is read once for the heads. The walk
// prefetches the row `ahead` keys on (the next page's).
template <int H, int V, typename RowOf>
inline void WeightedRowsTile(const float* weights, Strides ws, int64_t n, RowOf row_of, int64_t c0, int64_t d,
                             int64_t ahead, float* acc) {
  fvec sum[H][V] = {};
  for (int64_t j = 0; j < n; ++j) {
    if (j + ahead < n) {
      const char* next = reinterpret_cast<const char*>(row_of(j + ahead) + c0);
      for (int64_t b = 0; b < V * kLanes * static_cast<int64_t>(sizeof(*row_of(0))); b += 64) {
        __builtin_prefetch(next + b, 0, 3);
      }
    }
    const auto* v = row_of(j) + c0;
    fvec vv[V];
    for (int c = 0; c < V; ++c) vv[c] = Load(v + c * kLanes);
    for (int h = 0; h < H; ++h) {
      const fvec w = Splat(weights[h * ws.head + j * ws.key]);
      for (int c = 0; c < V; ++c) sum[h][c] += w * vv[c];
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < V; ++c) {
      float* a = acc + h * d + c0 + c * kLanes;
      Store(a, Load(a) + sum[h][c]);
    }
  }
}

template <int H, typename RowOf>
inline void WeightedRowsHeads(const float* weights, Strides ws, int64_t n, RowOf row_of, int64_t d, int64_t ahead,
                              float* acc) {
  static_assert(kRowVectors <= 4, "one case per vector count");
  for (int64_t c0 = 0; c0 < d; c0 += kRowVectors * kLanes) {
    switch (std::min<int64_t>(kRowVectors, (d - c0) / kLanes)) {
      case 1: WeightedRowsTile<H, 1>(weights, ws, n, row_of, c0, d, ahead, acc); break;
      case 2: WeightedRowsTile<H, 2>(weights, ws, n, row_of, c0, d, ahead, acc); break;
      case 3: WeightedRowsTile<H, 3>(weights, ws, n, row_of, c0, d, ahead, acc); break;
      default: WeightedRowsTile<H, kRowVectors>(weights, ws, n, row_of, c0, d, ahead, acc); break;
    }
  }
}

// acc[h * d + i] += sum over keys j < n of w(h, j) * row_of(j)[i] for h < heads (<= kHeadsInRegisters); d a
// multiple of kLanes
template <typename RowOf>
inline void WeightedRows(const float* weights, Strides ws, int64_t n, int64_t heads, RowOf row_of, int64_t d,
                         int64_t ahead, float* acc) {
  switch (heads) {
    case 1: WeightedRowsHeads<1>(weights, ws, n, row_of, d, ahead, acc); break;
    case 2: WeightedRowsHeads<2>(weights, ws, n, row_of, d, ahead, acc); break;
    case 3: WeightedRowsHeads<3>(weights, ws, n, row_of, d, ahead, acc); break;
    default: WeightedRowsHeads<4>(weights, ws, n, row_of, d, ahead, acc); break;
  }
}
#endif

struct Problem {
  int64_t num_tokens, num_heads, head_dim, kv_heads, num_pages, page_size, num_seqs, max_pages, layer;
  float scale;
  int32_t window;
  float softcap;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start;
  std::vector<int32_t> seq_of_token;  // S for padding tokens
};

constexpr int64_t kMaxGroup = 64;  // query heads per kv head, at most

// A thread's buffers, kept from call to call (no allocation per task)
struct Buffers {
  std::vector<float> q, scores, acc;
  std::vector<const void*> rows;  // the token's key rows, then its value rows
};

// One (token, kv head) pair: the `group` query heads that share the kv head, against the token's keys. Each key and
// value row is read once for the whole group.
template <typename QT, typename KT>
void AttendToken(const Problem& p, const QT* q, const KT* cache_k, const KT* cache_v, QT* out, int64_t token,
                 int64_t kv_head, Buffers& buf) {
  const int64_t group = p.num_heads / p.kv_heads, d = p.head_dim;
  const int64_t head0 = kv_head * group;
  QT* out_row = out + (token * p.num_heads + head0) * d;
  const int32_t s = p.seq_of_token[token];
  if (s >= p.num_seqs || p.context_lens[s] <= 0) {
    std::memset(out_row, 0, sizeof(QT) * group * d);
    return;
  }
  const int64_t pos = p.context_lens[s] - (p.query_start[s + 1] - token);
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  const int64_t n = pos + 1 - first;
  buf.q.resize(group * d);
  float* qf = buf.q.data();
  for (int64_t i = 0; i < group * d; ++i) qf[i] = ToFloat(q[(token * p.num_heads + head0) * d + i]) * p.scale;
  buf.scores.resize(group * n);
  float* scores = buf.scores.data();
  // The token's key rows (rows[j], j < n), then its value rows (rows[n + j]), looked up page by page once. A division
  // by the page size for every row, and again on every pass over the values, made 16 decode tokens at 256 keys of
  // context 1.4-1.9x slower with the cache's rows in cache (bench/cpu_attention.py); read from memory, level.
  const int32_t* table = p.block_tables + s * p.max_pages;
  const int64_t layer_head = (p.layer * p.kv_heads + kv_head) * p.num_pages;
  buf.rows.resize(2 * n);
  const KT** rows = reinterpret_cast<const KT**>(buf.rows.data());
  for (int64_t j = 0; j < n;) {
    const int64_t key = first + j, in_page = key % p.page_size;
    const int64_t at = ((layer_head + table[key / p.page_size]) * p.page_size + in_page) * d;
    const int64_t count = std::min(p.page_size - in_page, n - j);  // the rows left in this page
    for (int64_t i = 0; i < count; ++i, ++j) {
      rows[j] = cache_k + at + i * d;
      rows[n + j] = cache_v + at + i * d;
    }
  }
  // Pages are scattered, so the prefetchers lose the stream at each page's end: each key's row prefetches the row
  // two pages on (the keys', then the values' first rows), so a page is in cache when its turn comes.
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(KT)), ahead = 2 * p.page_size;
  const auto prefetch = [&](int64_t j) {  // rows[j + ahead], past the values' last row none
    if (j + ahead >= 2 * n) return;
    const char* row = reinterpret_cast<const char*>(rows[j + ahead]);
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  };
  int64_t j = 0;
#if defined(JAXSERVE_BLOCKED_ATTENTION)
  if (d % kLanes == 0 && d <= kMaxBlockedDim) {  // a vector's worth of keys at a time, their dots summed together
    for (; j + kLanes <= n; j += kLanes) {
      for (int64_t i = 0; i < kLanes; ++i) prefetch(j + i);
      for (int64_t g = 0; g < group; ++g) Store(scores + g * n + j, DotsOfLanes(qf + g * d, rows + j, d));
    }
  }
#endif
  for (; j < n; ++j) {
    prefetch(j);
    for (int64_t g = 0; g < group; ++g) scores[g * n + j] = Dot(qf + g * d, rows[j], d);
  }
  if (p.softcap > 0) {
    for (int64_t i = 0; i < group * n; ++i) scores[i] = p.softcap * std::tanh(scores[i] / p.softcap);
  }
  float inv_total[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* r = scores + g * n;
    inv_total[g] = 1.0f / ExpRow(r, n, MaxRow(r, n));
  }
  buf.acc.assign(group * d, 0.0f);
  float* acc = buf.acc.data();
#if defined(JAXSERVE_BLOCKED_ATTENTION)
  if (d % kLanes == 0 && d <= kMaxBlockedDim) {  // the value rows into sums held in registers, a few heads at once
    for (int64_t g = 0; g < group; g += kHeadsInRegisters) {
      WeightedRows(scores + g * n, Strides{n, 1}, n, std::min<int64_t>(kHeadsInRegisters, group - g),
                   [&](int64_t key) { return rows[n + key]; }, d, ahead, acc + g * d);
    }
  } else
#endif
  for (int64_t j = 0; j < n; ++j) {
    prefetch(n + j);
    for (int64_t g = 0; g < group; ++g) AddScaled(acc + g * d, scores[g * n + j], rows[n + j], d);
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < d; ++i) FromFloat(acc[g * d + i] * inv_total[g], &out_row[g * d + i]);
  }
}

#if defined(JAXSERVE_BLOCKED_ATTENTION)
// The prompt path. A prompt's tokens attend to nearly the same keys, so a task takes a tile of consecutive query
// tokens of one sequence against one kv head: rows = tokens x the kv head's query heads, at most kTileRows (4 row
// vectors: 64 with AVX-512, 32 with AVX2). Each key and value row is then read once for the tile instead of once
// per token, and the rows sit in the vector lanes: scores are kept key-major (st[j * rp + r]), so the softmax's
// maximum, exponentials and sums are lanewise, with no horizontal reductions. Keys go by chunks of kKeyChunk, the
// softmax running online across chunks (each row's maximum and sum carried, earlier sums rescaled), so the buffers
// stay in cache for any context length.
constexpr int64_t kTileRows = 4 * kLanes;
constexpr int64_t kTileTokens = 16;
constexpr int64_t kKeyChunk = 128;

inline int64_t TileTokens(int64_t group) { return std::clamp<int64_t>(kTileRows / group, 1, kTileTokens); }

// st[j * rp + r] = sum over c < d of key_of(j)[c] * qt[c * rp + r] for keys j0 <= j < j0 + KB and RV vectors of rows:
// the KB x RV sums stay in registers, each key value is broadcast against the RV row vectors.
template <int RV, int KB, typename KeyOf>
inline void ScoreBlock(const float* qt, int64_t rp, int64_t d, KeyOf key_of, int64_t j0, float* st) {
  fvec acc[KB][RV] = {};
  decltype(key_of(0)) k[KB];
  for (int b = 0; b < KB; ++b) k[b] = key_of(j0 + b);
  for (int64_t c = 0; c < d; ++c) {
    fvec qv[RV];
    for (int v = 0; v < RV; ++v) qv[v] = Load(qt + c * rp + v * kLanes);
    for (int b = 0; b < KB; ++b) {
      const fvec kb = Splat(ToFloat(k[b][c]));
      for (int v = 0; v < RV; ++v) acc[b][v] += kb * qv[v];
    }
  }
  for (int b = 0; b < KB; ++b) {
    for (int v = 0; v < RV; ++v) Store(st + (j0 + b) * rp + v * kLanes, acc[b][v]);
  }
}

template <int RV, typename KeyOf>
inline void ScoreChunk(const float* qt, int64_t rp, int64_t d, KeyOf key_of, int64_t n, float* st) {
#if defined(__AVX512F__)
  constexpr int KB = RV == 1 ? 12 : RV == 2 ? 8 : 24 / RV;  // at most 24 sums in registers (of 32)
#else
  constexpr int KB = RV == 1 ? 12 : RV == 2 ? 6 : RV == 3 ? 3 : 2;  // KB x RV sums, RV rows and a splat in 16
#endif
  int64_t j = 0;
  for (; j + KB <= n; j += KB) ScoreBlock<RV, KB>(qt, rp, d, key_of, j, st);
  for (; j < n; ++j) ScoreBlock<RV, 1>(qt, rp, d, key_of, j, st);
}

struct TileBuffers {
  std::vector<float> qt, st, acc;
};

// Query tokens [t0, t1) of sequence s (context_lens[s] > 0) against kv head kv_head.
template <typename QT, typename KT>
void AttendTile(const Problem& p, const QT* q, const KT* cache_k, const KT* cache_v, QT* out, int64_t s, int64_t t0,
                int64_t t1, int64_t kv_head, TileBuffers& buf) {
  const int64_t group = p.num_heads / p.kv_heads, d = p.head_dim, head0 = kv_head * group;
  const int64_t rows = (t1 - t0) * group, rp = (rows + kLanes - 1) / kLanes * kLanes, rv = rp / kLanes;
  const int64_t context = p.context_lens[s], end = p.query_start[s + 1];
  const auto pos_of = [&](int64_t t) { return context - (end - t); };
  const auto first_of = [&](int64_t t) {
    return p.window > 0 ? std::max<int64_t>(0, pos_of(t) - p.window + 1) : int64_t{0};
  };
  // the rows' queries, scaled and transposed: qt[c * rp + r], row r = token t0 + r / group, head head0 + r % group
  buf.qt.assign(d * rp, 0.0f);
  float* qt = buf.qt.data();
  for (int64_t r = 0; r < rows; ++r) {
    const QT* qrow = q + ((t0 + r / group) * p.num_heads + head0 + r % group) * d;
    for (int64_t c = 0; c < d; ++c) qt[c * rp + r] = ToFloat(qrow[c]) * p.scale;
  }
  // each lane's keys: [lane_first, lane_last]; padding lanes none
  alignas(64) int32_t lane_first[kTileRows], lane_last[kTileRows];
  for (int64_t r = 0; r < rp; ++r) {
    lane_first[r] = r < rows ? static_cast<int32_t>(first_of(t0 + r / group)) : INT32_MAX;
    lane_last[r] = r < rows ? static_cast<int32_t>(pos_of(t0 + r / group)) : -1;
  }
  const int64_t lo = first_of(t0), hi = pos_of(t1 - 1) + 1;
  const int32_t* table = p.block_tables + s * p.max_pages;
  const int64_t layer_head = (p.layer * p.kv_heads + kv_head) * p.num_pages;
  const auto row = [&](const KT* cache, int64_t key) {
    return cache + ((layer_head + table[key / p.page_size]) * p.page_size + key % p.page_size) * d;
  };
  buf.st.resize(kKeyChunk * rp);
  float* st = buf.st.data();
  buf.acc.assign(rows * d, 0.0f);
  float* acc = buf.acc.data();
  const fvec minus_inf = Splat(-INFINITY);
  fvec peak[kTileRows / kLanes], total[kTileRows / kLanes];
  for (int64_t v = 0; v < rv; ++v) peak[v] = minus_inf, total[v] = fvec{};
  alignas(64) float rescale[kTileRows];
  const KT* key_rows[kKeyChunk];
  const KT* value_rows[kKeyChunk];
  for (int64_t c0 = lo; c0 < hi; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, hi - c0);
    for (int64_t j = 0; j < n; ++j) {  // the chunk's rows, looked up once (a division by the page size each)
      key_rows[j] = row(cache_k, c0 + j);
      value_rows[j] = row(cache_v, c0 + j);
    }
    const auto key_of = [&](int64_t j) { return key_rows[j]; };
    switch (rv) {
      case 1: ScoreChunk<1>(qt, rp, d, key_of, n, st); break;
      case 2: ScoreChunk<2>(qt, rp, d, key_of, n, st); break;
      case 3: ScoreChunk<3>(qt, rp, d, key_of, n, st); break;
      default: ScoreChunk<4>(qt, rp, d, key_of, n, st); break;
    }
    if (p.softcap > 0) {
      for (int64_t i = 0; i < n * rp; ++i) st[i] = p.softcap * std::tanh(st[i] / p.softcap);
    }
    for (int64_t v = 0; v < rv; ++v) {
      // keys outside a lane's range to -inf, the chunk's maximum, then the online softmax's step
      ivec first, last;
      std::memcpy(&first, lane_first + v * kLanes, sizeof(first));
      std::memcpy(&last, lane_last + v * kLanes, sizeof(last));
      fvec chunk_peak = minus_inf;
      for (int64_t j = 0; j < n; ++j) {
        const ivec key = ivec{} + static_cast<int32_t>(c0 + j);
        const ivec inside = (key >= first) & (key <= last);
        const fvec x = inside ? Load(st + j * rp + v * kLanes) : minus_inf;
        Store(st + j * rp + v * kLanes, x);
        chunk_peak = x > chunk_peak ? x : chunk_peak;
      }
      const fvec new_peak = chunk_peak > peak[v] ? chunk_peak : peak[v];
      const fvec base = new_peak == minus_inf ? fvec{} : new_peak;  // a lane with no key yet: exp(-inf - 0) = 0
      const fvec alpha = Exp(peak[v] - base);
      fvec sum{};
      for (int64_t j = 0; j < n; ++j) {
        const fvec e = Exp(Load(st + j * rp + v * kLanes) - base);
        Store(st + j * rp + v * kLanes, e);
        sum += e;
      }
      total[v] = total[v] * alpha + sum;
      peak[v] = new_peak;
      Store(rescale + v * kLanes, alpha);
    }
    if (c0 > lo) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < d; c += kLanes) Store(acc + r * d + c, Load(acc + r * d + c) * rescale[r]);
      }
    }
    for (int64_t r = 0; r < rows; r += kHeadsInRegisters) {
      WeightedRows(st + r, Strides{1, rp}, n, std::min(kHeadsInRegisters, rows - r),
                   [&](int64_t j) { return value_rows[j]; }, d, n, acc + r * d);  // n ahead: no prefetch
    }
  }
  alignas(64) float inv_total[kTileRows];
  for (int64_t v = 0; v < rv; ++v) {
    const fvec t = total[v];
    Store(inv_total + v * kLanes, t > fvec{} ? 1.0f / t : fvec{});
  }
  for (int64_t r = 0; r < rows; ++r) {
    QT* o = out + ((t0 + r / group) * p.num_heads + head0 + r % group) * d;
    for (int64_t c = 0; c < d; ++c) FromFloat(acc[r * d + c] * inv_total[r], &o[c]);
  }
}
#endif

// A task: query tokens [t0, t1) against one kv head; a tile of sequence s (prompt path) when s >= 0, else one token.
struct Task {
  int32_t s, t0, t1, kv_head;
};

template <typename QT, typename KT>
void Run(ffi::ThreadPool& pool, Problem& p, const void* q, const void* k, const void* v, void* out) {
  std::vector<Task> tasks;
  std::vector<bool> tiled(p.num_tokens, false);
#if defined(JAXSERVE_BLOCKED_ATTENTION)
  // a tile's rows fit its vectors only when a token's query heads do (AVX2: groups up to 32)
  if (p.head_dim % kLanes == 0 && p.head_dim <= kMaxBlockedDim && p.num_heads / p.kv_heads <= kTileRows) {
    const int64_t tile = TileTokens(p.num_heads / p.kv_heads);
    for (int64_t s = 0; s < p.num_seqs; ++s) {
      const int64_t begin = std::max<int64_t>(p.query_start[s], 0);
      const int64_t end = std::min<int64_t>(p.query_start[s + 1], p.num_tokens);
      if (end - begin < 2 || p.context_lens[s] <= 0 || end != p.query_start[s + 1]) continue;
      for (int64_t t0 = begin; t0 < end; t0 += tile) {
        const int64_t t1 = std::min(end, t0 + tile);
        for (int64_t h = 0; h < p.kv_heads; ++h) {
          tasks.push_back({static_cast<int32_t>(s), static_cast<int32_t>(t0), static_cast<int32_t>(t1),
                           static_cast<int32_t>(h)});
        }
        std::fill(tiled.begin() + t0, tiled.begin() + t1, true);
      }
    }
  }
#endif
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (tiled[t]) continue;
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      tasks.push_back({-1, static_cast<int32_t>(t), static_cast<int32_t>(t + 1), static_cast<int32_t>(h)});
    }
  }
  const auto* qt = static_cast<const QT*>(q);
  const auto* kt = static_cast<const KT*>(k);
  const auto* vt = static_cast<const KT*>(v);
  auto* ot = static_cast<QT*>(out);
  ParallelFor(pool, static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task& task = tasks[i];
#if defined(JAXSERVE_BLOCKED_ATTENTION)
    if (task.s >= 0) {
      thread_local TileBuffers buf;
      AttendTile<QT, KT>(p, qt, kt, vt, ot, task.s, task.t0, task.t1, task.kv_head, buf);
      return;
    }
#endif
    thread_local Buffers buf;
    AttendToken<QT, KT>(p, qt, kt, vt, ot, task.t0, task.kv_head, buf);
  });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer cache_k, ffi::AnyBuffer cache_v,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> context_lens,
                              ffi::Buffer<ffi::S32> query_start, ffi::Result<ffi::AnyBuffer> out, float scale,
                              float softcap) {
  auto qd = q.dimensions(), kd = cache_k.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention: expected q [T,H,D], cache [L,KVH,P,PS,D], tables [S,P]");
  }
  Problem p{qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], bd[0], bd[1], layer.typed_data()[0], scale,
            window.typed_data()[0], softcap, block_tables.typed_data(), context_lens.typed_data(),
            query_start.typed_data(), {}};
  if (p.num_heads % p.kv_heads != 0 || kd[4] != p.head_dim) {
    return ffi::Error::InvalidArgument("paged_attention: heads must be a multiple of kv_heads, head_dim equal");
  }
  if (p.num_heads / p.kv_heads > kMaxGroup) {
    return ffi::Error::InvalidArgument("paged_attention: at most 64 query heads per kv head");
  }
  p.seq_of_token.assign(p.num_tokens, static_cast<int32_t>(p.num_seqs));
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    for (int64_t t = std::max<int64_t>(p.query_start[s], 0); t < std::min<int64_t>(p.query_start[s + 1], p.num_tokens);
         ++t) {
      p.seq_of_token[t] = static_cast<int32_t>(s);
    }
  }
  const auto q_type = q.element_type(), kv_type = cache_k.element_type();
  const void *qp = q.untyped_data(), *kp = cache_k.untyped_data(), *vp = cache_v.untyped_data();
  void* op = out->untyped_data();
  if (q_type == ffi::F32 && kv_type == ffi::F32) Run<float, float>(pool, p, qp, kp, vp, op);
  else if (q_type == ffi::F32 && kv_type == ffi::BF16) Run<float, bf16_bits>(pool, p, qp, kp, vp, op);
  else if (q_type == ffi::BF16 && kv_type == ffi::BF16) Run<bf16_bits, bf16_bits>(pool, p, qp, kp, vp, op);
  else if (q_type == ffi::BF16 && kv_type == ffi::F32) Run<bf16_bits, float>(pool, p, qp, kp, vp, op);
  else return ffi::Error::InvalidArgument("paged_attention: q and cache must be float32 or bfloat16");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()       // q
                                  .Arg<ffi::AnyBuffer>()       // cache_k
                                  .Arg<ffi::AnyBuffer>()       // cache_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Ret<ffi::AnyBuffer>()       // out
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));

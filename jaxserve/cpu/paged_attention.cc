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
// positions <= its own (and > its own - window when window > 0). Work is split over (token, kv head) pairs; the
// calling thread and XLA's intra-op thread pool share it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

using namespace jaxserve_cpu;

// Dot product with independent partial sums, so the compiler vectorises it without reassociating floats freely.
template <typename KT>
inline float Dot(const float* q, const KT* k, int64_t d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += q[i + j] * ToFloat(k[i + j]);
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < d; ++i) sum += q[i] * ToFloat(k[i]);
  return sum;
}

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

// One (token, kv head) pair: the `group` query heads that share the kv head, against the token's keys.
template <typename QT, typename KT>
void AttendToken(const Problem& p, const QT* q, const KT* cache_k, const KT* cache_v, QT* out, int64_t token,
                 int64_t kv_head, std::vector<float>& scores, std::vector<float>& acc) {
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
  std::vector<float> qf(group * d);
  for (int64_t i = 0; i < group * d; ++i) qf[i] = ToFloat(q[(token * p.num_heads + head0) * d + i]) * p.scale;
  scores.resize(group * n);
  const int32_t* table = p.block_tables + s * p.max_pages;
  const int64_t layer_head = (p.layer * p.kv_heads + kv_head) * p.num_pages;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = first + j;
    const KT* k = cache_k + ((layer_head + table[key / p.page_size]) * p.page_size + key % p.page_size) * d;
    for (int64_t g = 0; g < group; ++g) scores[g * n + j] = Dot(&qf[g * d], k, d);
  }
  if (p.softcap > 0) {
    for (int64_t i = 0; i < group * n; ++i) scores[i] = p.softcap * std::tanh(scores[i] / p.softcap);
  }
  acc.assign(group * d, 0.0f);
  std::vector<float> total(group, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    float* row = &scores[g * n];
    const float peak = *std::max_element(row, row + n);
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - peak);
      total[g] += row[j];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = first + j;
    const KT* v = cache_v + ((layer_head + table[key / p.page_size]) * p.page_size + key % p.page_size) * d;
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * n + j];
      float* a = &acc[g * d];
      for (int64_t i = 0; i < d; ++i) a[i] += w * ToFloat(v[i]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / total[g];
    for (int64_t i = 0; i < d; ++i) FromFloat(acc[g * d + i] * inv, &out_row[g * d + i]);
  }
}

template <typename QT, typename KT>
void Run(ffi::ThreadPool& pool, Problem& p, const void* q, const void* k, const void* v, void* out) {
  const int64_t tasks = p.num_tokens * p.kv_heads;
  ParallelFor(pool, tasks, [&](int64_t i) {
    thread_local std::vector<float> scores, acc;
    AttendToken<QT, KT>(p, static_cast<const QT*>(q), static_cast<const KT*>(k), static_cast<const KT*>(v),
                        static_cast<QT*>(out), i / p.kv_heads, i % p.kv_heads, scores, acc);
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

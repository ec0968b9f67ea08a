// Shared by the CPU kernels (paged_attention.cc, matmul.cc): bfloat16 conversions, the vector types and their
// loads, and a parallel loop over XLA's intra-op thread pool.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxserve_cpu {

using bf16_bits = uint16_t;

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }
inline float ToFloat(bf16_bits x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, bf16_bits* out) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<bf16_bits>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<bf16_bits>(bits >> 16);
}

// The vector types of the kernels: one register of float32 lanes (AVX-512: 16, else 8, whatever the compiler makes
// of 32-byte vectors without AVX2), and their loads and stores (unaligned; bfloat16 and int8 converted to float32).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float fvec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));
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

constexpr int kSpinsBeforeSleep = 20000;  // about 0.1-1 ms of pause instructions

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Whether this thread has run one of ParallelFor's pool tasks, i.e. is one of the pool's threads.
inline thread_local bool tls_pool_thread = false;

// Runs fn(i) for i in [0, n) on the calling thread and the pool's threads; returns when every fn(i) has finished.
// The caller never waits for a pool task to start: it claims items itself, so the call completes even when every
// pool thread is busy (another step's kernel on another device, or this very call running on a pool thread).
// A pool task that starts late finds no item left and touches only the shared counters, never the caller's stack.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, F&& fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    std::mutex mu;
    std::condition_variable all_done;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, n, &fn] {
    int64_t ran = 0;
    for (int64_t i = shared->next.fetch_add(1); i < n; i = shared->next.fetch_add(1), ++ran) fn(i);
    if (ran > 0 && shared->finished.fetch_add(ran) + ran == n) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->all_done.notify_all();
    }
  };
  // XLA calls a kernel on one of the pool's threads (a prompt step) or on its client's own thread (a decode step).
  // From outside the pool, one helper per pool thread plus the caller is one runnable thread more than cores: the
  // small model's 16-row decode step took a median 30.4 ms against 27.2 ms with one helper fewer (2-vCPU AMD EPYC,
  // six runs each, interleaved). From inside, the pool's other threads are the helpers.
  const int64_t threads = pool.num_threads();
  const int64_t helpers = std::min<int64_t>(tls_pool_thread ? threads : std::max<int64_t>(threads - 1, 1), n - 1);
  for (int64_t w = 0; w < helpers; ++w) {
    pool.Schedule([work] {
      tls_pool_thread = true;
      work();
    });
  }
  work();
  // The last items are short (tens of microseconds): spin for them before sleeping, since waking a sleeping thread
  // costs about as much on a VM.
  for (int spin = 0; spin < kSpinsBeforeSleep && shared->finished.load(std::memory_order_acquire) != n; ++spin) {
    CpuRelax();
  }
  if (shared->finished.load(std::memory_order_acquire) == n) return;
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->finished.load() == n; });
}

}  // namespace jaxserve_cpu

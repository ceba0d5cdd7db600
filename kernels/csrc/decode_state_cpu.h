// What both paths of the CPU decode kernel (paged_decode_cpu.cpp) share: a cache row as floats,
// the prefetch of the next block, and one sequence's online-softmax state per query head.
#pragma once
#include "decode_shared_prefix_cpu.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace paged_decode {

// A row of one position (all KV heads) as floats: float32 caches are used in place; bfloat16 is
// the top half of a float32, so widening is a shift the compiler vectorizes (the generic
// conversion does not).
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(buf);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
    return buf;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// One sequence's running state, per query head: the scaled query, the online softmax's max and
// sum, and the weighted sum of values so far.
struct SequenceState {
  std::vector<float> qf, acc, m, l;
  int64_t heads, D;
  SequenceState(int64_t num_heads, int64_t head_size)
      : qf(num_heads * head_size), acc(num_heads * head_size), m(num_heads), l(num_heads), heads(num_heads),
        D(head_size) {}

  template <typename scalar_t>
  void start(const scalar_t* q, float scale) {
    for (int64_t i = 0; i < heads * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
    std::fill(acc.begin(), acc.end(), 0.f);
    // Finite "minus infinity": the kernel is built with -ffast-math, which assumes no infinities.
    std::fill(m.begin(), m.end(), -1e30f);
    std::fill(l.begin(), l.end(), 0.f);
  }

  // Carries on from the state over sequence b's shared prefix.
  void resume(const PrefixStates& prefix, int64_t b) {
    std::copy_n(prefix.m.data() + b * heads, heads, m.data());
    std::copy_n(prefix.l.data() + b * heads, heads, l.data());
    std::copy_n(prefix.acc.data() + b * heads * D, heads * D, acc.data());
  }

  template <typename scalar_t>
  void finish(scalar_t* out) const {
    for (int64_t h = 0; h < heads; ++h) {
      const float inv = 1.f / l[h];
      for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv);
    }
  }
};

}  // namespace paged_decode

// The vector type of the CPU attention kernels: GCC/Clang vector extensions, so one source
// compiles for whatever the build machine's -march=native offers (16 floats with AVX-512, else 8).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float vfloat __attribute__((vector_size(kW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(kW * 4)));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// bfloat16 is the top half of a float32: widening is a shift the compiler vectorizes (the generic
// conversion does not). One vector of kW bfloat16 from `src`.
inline vfloat widen_vector(const at::BFloat16* src) {
  vfloat v;
#if defined(__AVX512F__)
  // One zero-extending load: GCC splits the generic conversion below into two 256-bit halves
  // and a merge where it tunes for 256-bit vectors (Zen 4), 3x the instructions.
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
  vu16 h;
  std::memcpy(&h, src, sizeof h);
  const vu32 w = __builtin_convertvector(h, vu32) << 16;
#endif
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// n floats from `src` into `dst`, n a multiple of kW.
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += kW) vstore(dst + i, widen_vector(src + i));
}

// A row of n floats (n a multiple of kW): float32 in place, bfloat16 widened into `buf` in whole
// vectors (element-wise stores read back as vectors stall on store forwarding).
inline const float* row_as_float(const float* src, float*, int64_t) { return src; }

inline const float* row_as_float(const at::BFloat16* src, float* buf, int64_t n) {
  widen(src, buf, n);
  return buf;
}

typedef int32_t vint __attribute__((vector_size(kW * 4)));

// e^x lane by lane, inlined (libmvec's expf is a call per vector, and handles cases softmax never
// meets): x = n ln2 + r with |r| <= ln2/2, e^r by Cephes' expf polynomial (relative error ~1e-7),
// times 2^n. Lanes below -87 (e^x under float's normal range) give 0, so a masked score of -1e30
// weighs exactly nothing.
inline vfloat exp_reduced(vfloat r) {  // e^r for |r| <= ln2/2
  vfloat p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}

#if defined(__AVX512F__)
// AVX-512 rounds (vrndscaleps) and scales by 2^n (vscalefps, zeroing the underflowed lanes under
// a mask) in one instruction each: 14 instructions a vector against the portable version's 22,
// which matters in the softmax of the attention kernels.
inline vfloat vexp(vfloat x) {
  const __m512 v = (__m512)x;
  const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 hi = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), hi);
  return (vfloat)_mm512_maskz_scalef_ps(live, (__m512)exp_reduced((vfloat)r), n);
}
#else
// 2^n built in the exponent bits (2^(n-1) and a doubling where n > 0, so that e^x up to float's
// largest, n = 128, stays finite); rounding by integer conversion, which -ffast-math cannot
// reassociate away. Callers keep x below ln(FLT_MAX) = 88.72.
inline vfloat vexp(vfloat x) {
  const vint underflow = x < -87.f;
  x = x < -87.f ? -87.f : x;
  const vfloat t = x * 1.44269504f;
  const vint n = __builtin_convertvector(t + (t >= 0.f ? 0.5f : -0.5f), vint);
  const vfloat nf = __builtin_convertvector(n, vfloat);
  const vfloat p = exp_reduced((x - nf * 0.693359375f) + nf * 2.12194440e-4f);
  const vint high = n > 0;  // -1 where n > 0
  vint bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += (n + high) << 23;
  bits = underflow ? 0 : bits;
  vfloat out;
  std::memcpy(&out, &bits, sizeof out);
  return high ? out * 2.f : out;
}
#endif

// cap * tanh(x / cap), lane by lane (Gemma 2's soft-capped scores): tanh(y) = 1 - 2 / (e^(2y) + 1),
// 2y clamped to +-80, where tanh is +-1 in float and e^(2y) stays finite.
inline vfloat vsoftcap(vfloat x, float cap) {
  vfloat y2 = x * (2.f / cap);
  y2 = y2 > 80.f ? 80.f : y2;
  y2 = y2 < -80.f ? -80.f : y2;
  return cap * (1.f - 2.f / (vexp(y2) + 1.f));
}

// Sum and max of a vector's lanes.
inline float hsum(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < kW; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0];
  for (int i = 1; i < kW; ++i) m = m > v[i] ? m : v[i];
  return m;
#endif
}

// fp8 e4m3 (float8_e4m3fn) KV-cache rows widened to float32 on the CPU, times the layer's scale
// (kernels/fp8.py: dequantize_fp8_ref). The CPU has no fp8 arithmetic: each row is widened once
// per decode position, for every head that reads it, as bfloat16 rows are (vec_cpu.h: widen).
#pragma once
#include "vec_cpu.h"

#include <cstdint>
#include <cstring>

typedef uint8_t vu8 __attribute__((vector_size(kW)));

// n values (n a multiple of kW) from `src` into `dst`. e4m3: sign, 4 exponent bits (bias 7), 3
// mantissa bits. A normal value's float32 pattern is its exponent and mantissa shifted into place
// with the bias moved from 7 to 127 (+120 on the exponent); a subnormal one (exponent 0) is
// mantissa * 2^-9, exact in float32. 0x7F / 0xFF (NaN) is never written: the cache write saturates.
inline const float* fp8_row_as_float(const uint8_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i += kW) {
    vu8 b;
    std::memcpy(&b, src + i, sizeof b);
    const vu32 u = __builtin_convertvector(b, vu32);
    const vu32 em = u & 0x7F;
    const vu32 normal = (em << 20) + (120u << 23);
    const vfloat sub = __builtin_convertvector(em, vfloat) * (1.0f / 512.0f);
    vu32 sub_bits;
    std::memcpy(&sub_bits, &sub, sizeof sub_bits);
    const vu32 bits = (em < 8 ? sub_bits : normal) | ((u & 0x80) << 24);
    vfloat f;
    std::memcpy(&f, &bits, sizeof f);
    vstore(dst + i, f * scale);
  }
  return dst;
}

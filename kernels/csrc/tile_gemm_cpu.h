// The register-tiled small matrix product of the prefill attention kernel, for three element types:
// float32 (one multiply-add per element); float32 a with bfloat16 b widened as it is loaded (half
// the bytes of b read, for products that wait on memory: the LoRA stacks); and, on CPUs with
// AVX-512 BF16, pairs of bfloat16 packed in 32-bit words (one vdpbf16ps per pair: products exact
// in float32, summed in float32, twice the work per instruction).
//
//   c[m][0 : N] (+)= sum over k < K of a[m, k] * b[k][0 : N]
//
// a[m, k] sits at a[m * ars + k * aks] (any strides: the callers pass transposed operands), b is
// row-major with leading dimension ldb, N a multiple of the vector width. For pairs, a[m, k] and
// b[k][n] are words holding two reduction steps each, so K counts pairs.
#pragma once
#include "vec_cpu.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

struct F32Elements {
  using A = float;
  using B = float;
  static vfloat load(const float* p) { return vload(p); }
  static vfloat madd(vfloat acc, float a, vfloat b) { return acc + a * b; }
};

struct F32Bf16Elements {
  using A = float;
  using B = at::BFloat16;
  static vfloat load(const at::BFloat16* p) { return widen_vector(p); }
  static vfloat madd(vfloat acc, float a, vfloat b) { return acc + a * b; }
};

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
struct Bf16PairElements {
  using A = uint32_t;  // two bfloat16: the lower half is the even reduction step
  using B = uint32_t;
  static vfloat load(const uint32_t* p) {
    vfloat v;
    std::memcpy(&v, p, sizeof v);  // bit pattern only: 32 bfloat16
    return v;
  }
  static vfloat madd(vfloat acc, uint32_t a, vfloat b) {
    return (vfloat)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
  }
};
#else
constexpr bool kHasBf16Dot = false;
#endif

namespace tile_gemm {

// Register tiles of up to kMaxRows x kMaxCols vectors: 24 accumulators with AVX-512's 32
// registers, 12 with AVX2's 16.
constexpr int kMaxRows = kW == 16 ? 8 : 6;
constexpr int kMaxCols = kW == 16 ? 4 : 2;

// R and C are template parameters so that the accumulators stay in registers.
template <typename E, int R, int C>
void tile(const typename E::A* a, int64_t ars, int64_t aks, const typename E::B* b, int64_t ldb, int64_t K,
          float* c, int64_t ldc, bool accumulate) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = accumulate ? vload(c + r * ldc + j * kW) : vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    vfloat bv[C];
    for (int j = 0; j < C; ++j) bv[j] = E::load(b + k * ldb + j * kW);
    for (int r = 0; r < R; ++r) {
      const typename E::A x = a[r * ars + k * aks];
      for (int j = 0; j < C; ++j) acc[r][j] = E::madd(acc[r][j], x, bv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) vstore(c + r * ldc + j * kW, acc[r][j]);
}

template <typename E>
using TileFn = void (*)(const typename E::A*, int64_t, int64_t, const typename E::B*, int64_t, int64_t, float*,
                        int64_t, bool);

template <typename E, int R, int... C>
constexpr std::array<TileFn<E>, sizeof...(C)> tile_row(std::integer_sequence<int, C...>) {
  return {&tile<E, R, C + 1>...};
}

template <typename E, int... R>
constexpr std::array<std::array<TileFn<E>, kMaxCols>, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {tile_row<E, R + 1>(std::make_integer_sequence<int, kMaxCols>{})...};
}

template <typename E>
constexpr auto kTile = tile_table<E>(std::make_integer_sequence<int, kMaxRows>{});  // [rows - 1][vectors - 1]

}  // namespace tile_gemm

// Columns in groups of 4 vectors where they divide evenly (6 rows), else of 3 (8 rows); with
// AVX2 2 vectors, 6 rows.
template <typename E>
void tile_gemm_product(const typename E::A* a, int64_t ars, int64_t aks, const typename E::B* b, int64_t ldb,
                       int64_t M, int64_t N, int64_t K, float* c, int64_t ldc, bool accumulate) {
  using namespace tile_gemm;
  const int64_t vectors = N / kW;
  const int64_t cols = kMaxCols < 4 ? kMaxCols : (vectors % 4 == 0 ? 4 : 3);
  const int64_t rows = kMaxCols < 4 ? kMaxRows : (cols == 4 ? 6 : 8);
  for (int64_t n0 = 0; n0 < vectors; n0 += cols) {
    const int64_t nc = std::min(cols, vectors - n0);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      const int64_t nr = std::min(rows, M - m0);
      kTile<E>[nr - 1][nc - 1](a + m0 * ars, ars, aks, b + n0 * kW, ldb, K, c + m0 * ldc + n0 * kW, ldc,
                               accumulate);
    }
  }
}

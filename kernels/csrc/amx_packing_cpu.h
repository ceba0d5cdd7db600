// The bfloat16 packing of attention_rows_cpu.h on AMX: the two products of each tile run on the
// CPU's tile matrix unit (tdpbf16ps: a 16 x 16 float32 block += 16 x 32 bfloat16 by 32 x 16 in
// one instruction), the softmax between them stays on AVX-512. Q and V keep the pair layouts
// of the vdpbf16ps packing, which are the tile unit's right-operand layout; only the softmax
// weights are transposed to rows x keys, the left operand's. And which packing a call runs.
//
// The products are hand-written tile loops, not oneDNN's micro-kernels (ATen's
// cpublas::brgemm): the two products have different shapes, and switching between two of those
// kernels reconfigures the tile registers every call, which measured 1.0 us of every 1.8 us
// tile pair. Here one configuration (every tile 16 rows x 64 bytes) serves both, set once per
// thread and task batch.
#pragma once
#include "attention_rows_cpu.h"
#include <ATen/native/CPUBlas.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace attention_rows {

#if defined(__AVX512F__)
// dst[c][r] = src[r][c] for a 16 x 16 block of 32-bit values (row strides in elements): two
// rounds of unpacks transpose 4 x 4 blocks inside each 128-bit lane, two of lane shuffles the
// 4 x 4 arrangement of lanes.
inline void transpose_16x16(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // r[g + c], lane L: column 4L + c of rows g..g+3
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(dst + c * ldd, _mm512_shuffle_i32x4(v0, v2, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * ldd, _mm512_shuffle_i32x4(v0, v2, 0xDD));
    _mm512_storeu_si512(dst + (8 + c) * ldd, _mm512_shuffle_i32x4(v1, v3, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * ldd, _mm512_shuffle_i32x4(v1, v3, 0xDD));
  }
}

// dst[c][r] = src[r][c] for r < rows (rounded up to 16: the caller's buffers hold the extra
// rows, whose columns it never reads) and c < cols (a multiple of 16).
inline void transpose_words(const void* src, int64_t rows, int64_t cols, int64_t lds, void* dst, int64_t ldd) {
  const uint32_t* s = static_cast<const uint32_t*>(src);
  uint32_t* d = static_cast<uint32_t*>(dst);
  for (int64_t r = 0; r < rows; r += 16)
    for (int64_t c = 0; c < cols; c += 16) transpose_16x16(s + r * lds + c, lds, d + c * ldd + r, ldd);
}

#endif

#if defined(__AMX_BF16__)
namespace amx {

// Linux hands out the tile registers' state only to processes that ask for it, once.
inline bool permitted() {
  static const bool ok = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// Tiles 0-3 accumulate a 32 x 32 float32 block (C[i][j] in tile 2i + j), 4-5 hold the left
// operand's two 16-row blocks, 6-7 the right operand's two 16-column blocks.
inline void configure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) cfg.bytes_per_row[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// c[0 : 16 RM][0 : 16 RN] (+)= a x b over K (a multiple of 32): a row-major bfloat16 (lda
// elements), b pairs (b[k/2][n] holds b[k][n], b[k+1][n]; ldb words), c float32 (ldc).
template <int RM, int RN>
void block(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t K, float* c, int64_t ldc,
           bool accumulate) {
  const int64_t cs = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, cs);
    if constexpr (RN > 1) _tile_loadd(1, c + 16, cs);
    if constexpr (RM > 1) _tile_loadd(2, c + 16 * ldc, cs);
    if constexpr (RM > 1 && RN > 1) _tile_loadd(3, c + 16 * ldc + 16, cs);
  } else {
    _tile_zero(0);
    if constexpr (RN > 1) _tile_zero(1);
    if constexpr (RM > 1) _tile_zero(2);
    if constexpr (RM > 1 && RN > 1) _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, a + k, lda * 2);
    if constexpr (RM > 1) _tile_loadd(5, a + 16 * lda + k, lda * 2);
    _tile_loadd(6, b + k / 2 * ldb, ldb * 4);
    if constexpr (RN > 1) _tile_loadd(7, b + k / 2 * ldb + 16, ldb * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (RN > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RM > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RM > 1 && RN > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, cs);
  if constexpr (RN > 1) _tile_stored(1, c + 16, cs);
  if constexpr (RM > 1) _tile_stored(2, c + 16 * ldc, cs);
  if constexpr (RM > 1 && RN > 1) _tile_stored(3, c + 16 * ldc + 16, cs);
}

// The whole product, M and N multiples of 16, in 32 x 32 blocks (16-wide at the edges).
inline void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                 float* c, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; m += 32) {
    const bool two_rows = M - m >= 32;
    for (int64_t n = 0; n < N; n += 32) {
      const uint16_t* am = a + m * lda;
      const uint32_t* bn = b + n;
      float* cmn = c + m * ldc + n;
      if (two_rows && N - n >= 32) block<2, 2>(am, lda, bn, ldb, K, cmn, ldc, accumulate);
      else if (two_rows) block<2, 1>(am, lda, bn, ldb, K, cmn, ldc, accumulate);
      else if (N - n >= 32) block<1, 2>(am, lda, bn, ldb, K, cmn, ldc, accumulate);
      else block<1, 1>(am, lda, bn, ldb, K, cmn, ldc, accumulate);
    }
  }
}

}  // namespace amx

// Q as pairs (qp[d/2][r]) is the right operand of the scores K Q^T, V with two keys interleaved
// (vp) that of the weighted values; the softmax weights, stored as pairs along the keys
// (pp[j/2][r]), are transposed to rows x keys (pa) for the left. Products run on whole 16-row
// and 32-key blocks: score rows past the tile's keys are computed and never read, and the
// weights past them are zeroed, so the value rows there (finite: packed rows, or zeros past a
// packed sequence's end) add nothing.
struct AmxBf16Packing : Bf16DotPacking {
  // Twice the keys of the vector packings: the output block is loaded, rescaled and stored once
  // per tile (5.75 against 6.8 ms for a 1,450-token prompt; 256 keys: 6.8, the causal tiles
  // waste more).
  static constexpr int64_t kKeys = 2 * kKeyTile;

  struct Buffers : Bf16DotPacking::Buffers {
    std::vector<uint32_t> pa;
    Buffers(const Shape& sh, int64_t keys) : Bf16DotPacking::Buffers(sh, keys), pa(sh.max_rows() * keys / 2) {
      amx::configure();
    }
    // Releases the tiles (a thread holding them saves 8 KiB more state at every switch), and
    // tells ATen's micro-kernels, which remember the configuration they last set on a thread, to
    // set theirs again.
    ~Buffers() {
      at::native::cpublas::brgemm_release(true);
      _tile_release();
    }
    Buffers(const Buffers&) = delete;
    Buffers& operator=(const Buffers&) = delete;
  };

  static const uint16_t* bits(const uint32_t* words) { return reinterpret_cast<const uint16_t*>(words); }

  static void scores(int64_t n, int64_t Mp, const Shape& sh, const uint32_t* k, const Buffers& b, float* st) {
    amx::gemm((n + 15) / 16 * 16, Mp, sh.Dp, bits(k), sh.Dp, b.qp.data(), Mp, st, Mp, false);  // st [n][Mp]
  }

  static void weighted_values(int64_t n, int64_t Mp, const Shape& sh, const float*, const uint32_t* v, Buffers& b,
                              float* o) {
    const int64_t pairs = (n + 1) / 2, K = (n + 31) / 32 * 32;  // an odd tile's last pair: a zero weight
    transpose_words(b.pp.data(), pairs, Mp, Mp, b.pa.data(), kKeys / 2);
    if (pairs < K / 2)
      for (int64_t r = 0; r < Mp; ++r) std::fill_n(b.pa.data() + r * kKeys / 2 + pairs, K / 2 - pairs, 0u);
    amx::gemm(Mp, sh.Dp, K, bits(b.pa.data()), kKeys, v, sh.Dp, o, sh.Dp, true);
  }
};
#endif

// The products a prefill or shared-prefix tile runs on. kAuto: the fastest this CPU has.
enum class Products { kAuto, kFloat32, kBf16Dot, kAmx };

Products parse_products(const std::string& name);  // "auto", "float32", "bf16_dot", "amx"

// Whether this CPU (and this build) runs `p` for float32 (bf16 false) or bfloat16 inputs.
inline bool has_products(Products p, bool bf16) {
  switch (p) {
    case Products::kAuto:
    case Products::kFloat32:
      return true;
    case Products::kBf16Dot:
      return bf16 && kHasBf16Dot;
    case Products::kAmx:
#if defined(__AMX_BF16__)
      return bf16 && amx::permitted();
#else
      return false;
#endif
  }
  return false;
}

// Calls fn(pack) with a null pointer of the packing that runs `p` for scalar_t. kAuto: AMX for
// bfloat16 where the CPU has it, else vdpbf16ps where it has AVX-512 BF16, else float32 tiles.
template <typename scalar_t, typename Fn>
void with_packing(Products p, Fn&& fn) {
  constexpr bool bf16 = std::is_same_v<scalar_t, at::BFloat16>;
  TORCH_CHECK(has_products(p, bf16), "these attention products do not run on this CPU");
  if (p == Products::kAuto) {
    p = has_products(Products::kAmx, bf16)       ? Products::kAmx
        : has_products(Products::kBf16Dot, bf16) ? Products::kBf16Dot
                                                 : Products::kFloat32;
  }
#if defined(__AMX_BF16__)
  if constexpr (bf16)
    if (p == Products::kAmx) return fn(static_cast<AmxBf16Packing*>(nullptr));
#endif
#if defined(__AVX512BF16__)
  if constexpr (bf16)
    if (p == Products::kBf16Dot) return fn(static_cast<Bf16DotPacking*>(nullptr));
#endif
  fn(static_cast<F32Packing<scalar_t>*>(nullptr));
}

}  // namespace attention_rows

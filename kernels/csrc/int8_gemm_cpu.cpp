// Weight-only int8 linear layer for CPUs: y = (x . q^T) * scale + bias, q int8 per output
// channel, defined by kernels/int8_gemm.py: int8_linear_ref.
//
// Decoding reads every weight once per step for a handful of rows, so the step time is the
// weights' bytes over memory bandwidth: int8 halves bfloat16's bytes, if widening the weights costs
// less than reading them. Here one vpmovsxbw widens 32 weights to int16 and one vpdpwssd (AVX-512
// VNNI) per row multiplies them with x, which each call first rounds to int16 with one scale per row
// (`max|x| / 32767`, relative error <= 2^-16 of the row's largest value: below bfloat16's own
// rounding of x, 2^-9 of each value). Widening int8 to bfloat16 for vdpbf16ps instead took 5
// instructions per 32 weights and was slower than oneDNN's bfloat16 GEMM; torch's
// _weight_int8pack_mm too at 4-8 rows (bench/README.md).
//
// Packed layout (kernels/int8_gemm.py: pack_int8_weight): [N/16][K/2][16][2] int8, N padded to 16
// and K to 2 with zeros: one 32-byte load holds 16 output channels times 2 inputs, which is what one
// vpdpwssd lane pair needs. A block of 16 channels is contiguous, so each thread streams its own.
//
// On CPUs with AMX, bfloat16 x of kMinTileRows rows or more takes another way: the vpdpwssd tiles
// are compute-bound from a few rows, where oneDNN's bfloat16 products on the tile unit are not. Each
// group of 4 blocks is widened to bfloat16 (exact: every int8 is a bfloat16) into the pair layout
// the tile unit reads, which is the packed layout with bfloat16 for int8, and multiplied by x as it
// is (no rounding of x) with ATen's oneDNN micro-kernel; the channel scales apply to the float32 sums.
// Widening costs what it costs whatever the rows: measured (2 threads, the built-in model's shapes)
// 1.3-1.7x slower than vpdpwssd at 8 rows, 0.95-1.2x its speed at 16, 2-4.5x at 64
// (bench/results/quantization.md), hence 16.
#include "brgemm_cpu.h"
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output channels per block (one float32 vector)
constexpr int kMaxRows = 4;     // rows per register tile (4 measured as fast as 8 at 8 rows, fewer spills)

// Each row of x as int16 pairs (one uint32 per two inputs, K padded with a zero) and its scale:
// x[m][k] ~= q[m][k] * row_scale[m], q = round(x / (max|x[m]| / 32767)).
void quantize_rows(const torch::Tensor& x, int64_t K2, std::vector<uint32_t>& pairs, std::vector<float>& row_scale) {
  const int64_t M = x.size(0), K = x.size(1);
  pairs.assign(M * K2, 0);
  row_scale.assign(M, 1.0f);
  const torch::Tensor xf = x.to(at::kFloat);
  for (int64_t m = 0; m < M; ++m) {
    const float* src = xf.data_ptr<float>() + m * xf.stride(0);
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(src[k]));
    if (amax == 0.0f) continue;
    const float s = amax / 32767.0f, inv = 32767.0f / amax;
    row_scale[m] = s;
    auto* q = reinterpret_cast<int16_t*>(pairs.data() + m * K2);
    for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int16_t>(std::lrintf(src[k] * inv));
  }
}

template <typename out_t>
inline void store_block(const float* acc, float row_scale, const float* scale, const float* bias, int64_t n0,
                        int64_t n_valid, out_t* out_row) {
  for (int64_t i = 0; i < n_valid; ++i) {
    float v = acc[i] * row_scale * scale[n0 + i];
    if (bias) v += bias[n0 + i];
    out_row[n0 + i] = static_cast<out_t>(v);
  }
}

// int32 sums are moved into float32 every kChunk pairs: 2 * 256 products of at most 127 * 32767
// stay below 2^31, so no sum can overflow whatever the values.
constexpr int64_t kChunk = 256;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Rows [m0, m0+R) of NB consecutive blocks of 16 channels. One vpmovsxbw widens 32 weights (16
// channels x 2 inputs) to int16 and one vpdpwssd per row multiplies them with a broadcast pair of
// x: 1 + R instructions per 32 weights. NB blocks give NB independent accumulator chains per row
// and share each broadcast; R rows share each widened weight.
template <int R, int NB, typename out_t>
void tile(const int8_t* w0, int64_t K2, const uint32_t* xq, const float* row_scale, int64_t m0, const float* scale,
          const float* bias, int64_t n0, int64_t n_total, out_t* out, int64_t out_stride) {
  __m512 sum[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) sum[r][b] = _mm512_setzero_ps();
  const int64_t block_bytes = K2 * 2 * kBlock;
  for (int64_t c0 = 0; c0 < K2; c0 += kChunk) {
    const int64_t c1 = std::min(K2, c0 + kChunk);
    __m512i acc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_si512();
    for (int64_t k2 = c0; k2 < c1; ++k2) {
      __m512i w[NB];
      for (int b = 0; b < NB; ++b)
        w[b] = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * block_bytes + k2 * 2 * kBlock)));
      const uint32_t* x = xq + m0 * K2 + k2;
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[r * K2]));
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpwssd_epi32(acc[r][b], w[b], xb);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) sum[r][b] = _mm512_add_ps(sum[r][b], _mm512_cvtepi32_ps(acc[r][b]));
  }
  alignas(64) float buf[kBlock];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      _mm512_store_ps(buf, sum[r][b]);
      const int64_t n = n0 + b * kBlock;
      store_block(buf, row_scale[m0 + r], scale, bias, n, std::min<int64_t>(kBlock, n_total - n),
                  out + (m0 + r) * out_stride);
    }
}
#else
template <int R, int NB, typename out_t>
void tile(const int8_t* w0, int64_t K2, const uint32_t* xq, const float* row_scale, int64_t m0, const float* scale,
          const float* bias, int64_t n0, int64_t n_total, out_t* out, int64_t out_stride) {
  // Any other CPU: the same integer arithmetic in scalar code.
  for (int b = 0; b < NB; ++b) {
    const int8_t* wblock = w0 + b * K2 * 2 * kBlock;
    const int64_t n = n0 + b * kBlock;
    for (int r = 0; r < R; ++r) {
      float sum[kBlock] = {};
      for (int64_t c0 = 0; c0 < K2; c0 += kChunk) {
        int32_t acc[kBlock] = {};
        for (int64_t k2 = c0; k2 < std::min(K2, c0 + kChunk); ++k2) {
          const int8_t* w = wblock + k2 * 2 * kBlock;
          const auto* x = reinterpret_cast<const int16_t*>(xq + (m0 + r) * K2 + k2);
          for (int c = 0; c < kBlock; ++c) acc[c] += w[2 * c] * x[0] + w[2 * c + 1] * x[1];
        }
        for (int c = 0; c < kBlock; ++c) sum[c] += static_cast<float>(acc[c]);
      }
      store_block(sum, row_scale[m0 + r], scale, bias, n, std::min<int64_t>(kBlock, n_total - n),
                  out + (m0 + r) * out_stride);
    }
  }
}
#endif

// Blocks per tile for a tile of R rows: 16-24 accumulators, the rest of the 32 registers for the
// widened weights and the broadcast.
template <int R>
constexpr int blocks_for_rows() {
  return R <= 2 ? 8 : R <= 4 ? 4 : 2;
}

// All rows of the blocks [b0, b0 + nb), nb <= blocks_for_rows<R>() for every R used.
template <typename out_t>
void rows_of_blocks(const int8_t* w, int64_t K2, const uint32_t* xq, const float* row_scale, int64_t M,
                    const float* scale,
                    const float* bias, int64_t b0, int64_t nb, int64_t n_total, out_t* out) {
  const auto run = [&](auto rows_tag, int64_t m) {
    constexpr int R = decltype(rows_tag)::value;
    constexpr int NB = blocks_for_rows<R>();
    int64_t b = b0;
    for (; b + NB <= b0 + nb; b += NB)
      tile<R, NB>(w + b * K2 * 2 * kBlock, K2, xq, row_scale, m, scale, bias, b * kBlock, n_total, out, n_total);
    for (; b < b0 + nb; ++b)  // fewer than NB blocks left
      tile<R, 1>(w + b * K2 * 2 * kBlock, K2, xq, row_scale, m, scale, bias, b * kBlock, n_total, out, n_total);
  };
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) run(std::integral_constant<int, kMaxRows>{}, m);
  switch (M - m) {  // the remainder as one tile of its own height (registers are named at compile time)
#define TAIL(R) \
  case R:       \
    run(std::integral_constant<int, R>{}, m); \
    break;
    TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
    default:
      break;
  }
}

#if defined(__AVX512BF16__)
constexpr int64_t kMinTileRows = 16, kGroupBlocks = 4, kRowBlock = 32;

// One k2 row of a block, 16 channels x 2 inputs of int8, as the same 32 values in bfloat16.
inline void widen_pairs(const int8_t* src, at::BFloat16* dst) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w, 1)));
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// All rows of the blocks [b0, b0 + nb), a group of kGroupBlocks at a time: widened once into wb
// ([K2][group channels][2], the micro-kernel's pair layout), then kRowBlock rows of x per product.
void tile_unit_blocks(const at::BFloat16* x, int64_t ldx, int64_t M, const int8_t* w, int64_t K2, const float* scale,
                      const float* bias, int64_t b0, int64_t nb, int64_t n_total, at::BFloat16* out,
                      std::vector<at::BFloat16>& wb, std::vector<float>& c) {
  for (int64_t g = b0; g < b0 + nb; g += kGroupBlocks) {
    const int64_t blocks = std::min(kGroupBlocks, b0 + nb - g), N = blocks * kBlock;
    wb.resize(K2 * N * 2);
    for (int64_t k2 = 0; k2 < K2; ++k2)
      for (int64_t b = 0; b < blocks; ++b)
        widen_pairs(w + ((g + b) * K2 + k2) * 2 * kBlock, wb.data() + (k2 * N + b * kBlock) * 2);
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, M - m0);
      c.resize(rows * N);
      at::native::cpublas::brgemm(rows, N, 2 * K2, ldx, N, N, false, x + m0 * ldx, wb.data(), c.data(), true);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t n = (g + b) * kBlock;
          store_block(c.data() + r * N + b * kBlock, 1.0f, scale, bias, n, std::min(kBlock, n_total - n),
                      out + (m0 + r) * n_total);
        }
    }
  }
}

// Whether bfloat16 x of M rows and K inputs takes the tile unit (K even: the products read x's K
// columns as K/2 pairs, with no padding column).
bool tile_unit_runs(const torch::Tensor& x) {
  static const bool amx = at::cpu::init_amx() && bf16_pairs_run();
  return amx && x.scalar_type() == at::kBFloat16 && x.size(0) >= kMinTileRows && x.size(1) % 2 == 0;
}
#else
bool tile_unit_runs(const torch::Tensor&) { return false; }
#endif

}  // namespace

bool int8_linear_tile_unit(torch::Tensor x) { return tile_unit_runs(x); }

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, std::optional<torch::Tensor> bias,
                          int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(x.stride(1) == 1, "x's rows must be contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kBlock &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be int8 [N/16, K/2, 16, 2] (pack_int8_weight)");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(K2 == (K + 1) / 2 && blocks * kBlock >= out_features && blocks == (out_features + kBlock - 1) / kBlock,
              "packed weight does not match x's width or out_features");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == out_features,
              "scale must be float32 [out_features]");
  torch::Tensor bias_f;
  if (bias) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == out_features, "bias must have out_features elements");
  }
  auto out = torch::empty({M, out_features}, x.options());
  if (M == 0) return out;
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  const float* b = bias ? bias_f.data_ptr<float>() : nullptr;
#if defined(__AVX512BF16__)
  if (tile_unit_runs(x)) {
    const auto* xp = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
    auto* op = reinterpret_cast<at::BFloat16*>(out.data_ptr());
    at::parallel_for(0, (blocks + kGroupBlocks - 1) / kGroupBlocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<at::BFloat16> wb;
      std::vector<float> c;
      const int64_t b0 = begin * kGroupBlocks, nb = std::min(end * kGroupBlocks, blocks) - b0;
      tile_unit_blocks(xp, x.stride(0), M, w, K2, s, b, b0, nb, out_features, op, wb, c);
      at::native::cpublas::brgemm_release(true);
    });
    return out;
  }
#endif
  std::vector<uint32_t> xq;
  std::vector<float> row_scale;
  quantize_rows(x, K2, xq, row_scale);
  // Threads take groups of 8 blocks (the widest tile), so tiles never straddle two threads.
  const int64_t groups = (blocks + 7) / 8;
  const auto run = [&](auto* o) {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      const int64_t b0 = begin * 8, nb = std::min(end * 8, blocks) - b0;
      rows_of_blocks(w, K2, xq.data(), row_scale.data(), M, s, b, b0, nb, out_features, o);
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<at::BFloat16>());
  return out;
}

// Paged decode attention for CPUs: one query token per sequence, K/V read in place through the
// block table. The torch reference (kernels/paged_attention.py) gathers K/V into a dense copy
// and then attends; on a CPU that triples the memory traffic of the step's largest read.
//
// One task per sequence handles all its heads: within a block, the rows of consecutive positions
// (all KV heads) are contiguous, so each block is read front to back in one stream (48 KiB for
// 16 positions x 12 heads x 64 floats) rather than as scattered per-head pieces. Softmax is
// computed online, block by block (flash-decoding style), so K and V are each read exactly once.
//
// Two implementations of that: the vector path below (float32 and bfloat16, head sizes a multiple
// of the vector width: every model streamer runs) and the generic one (float16, other head sizes;
// paged_decode_generic_cpu.h). At batch 64 x 400 positions the vector path measured 1.6x faster
// in float32 (2.5-2.8 vs 4.0-4.8 ms a layer on 2 cores) and 1.2x in bfloat16 (bench/README.md).
// In bfloat16 on CPUs with AVX-512 BF16 its scores take the K rows as bfloat16 pairs, unwidened
// (64 x 400 positions on a 2-core Xeon: 1.09 against 1.37 ms a layer).
//
// An fp8 (e4m3) cache is read by the vector path as bfloat16 rows are: each row widened once, times
// the layer's k_scale / v_scale (fp8_cpu.h). Half of bfloat16's bytes come from memory.
#include "cpu_ops.h"
#include "decode_shared_prefix_cpu.h"
#include "decode_state_cpu.h"
#include "fp8_cpu.h"
#include "paged_decode_generic_cpu.h"
#include "vec_cpu.h"
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using paged_decode::prefetch_block;
using paged_decode::SequenceState;

// ---- the vector path: float32 and bfloat16, head sizes a multiple of the vector width ----------
// Per sequence, positions are taken kW at a time (kW = the vector width: 16 floats with AVX-512,
// 8 otherwise) and each query head handles its kW positions in three steps:
//   scores: kW dot products, each a vector of partial sums, reduced together by a shuffle tree
//           (kW-1 vector adds for all kW instead of a horizontal sum each: the horizontal sums
//           were most of the generic kernel's time at head size 64);
//   softmax: online, over the kW lanes;
//   values: accumulated in registers over the kW positions, read from L1 (the rows were just
//           read for the scores).
// Written with GCC/Clang vector extensions, so the one source compiles for whatever the build
// machine's -march=native offers.
// Lane j of the result = the sum of the lanes of p[j]. Each level adds the two halves of every
// group of lanes of two vectors; the sums come out in bit-reversed order, undone at the end.
#define SHUF __builtin_shufflevector
#if defined(__AVX512F__)
__attribute__((always_inline)) inline vfloat reduce_lanes(const vfloat* p) {
  vfloat r[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    r[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    u[i] = SHUF(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUF(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    w[i] = SHUF(u[2 * i], u[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUF(u[2 * i], u[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const vfloat f = SHUF(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                   SHUF(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return SHUF(f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#else
__attribute__((always_inline)) inline vfloat reduce_lanes(const vfloat* p) {
  vfloat r[4], u[2];
  for (int i = 0; i < 4; ++i)
    r[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    u[i] = SHUF(r[2 * i], r[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(r[2 * i], r[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  const vfloat f = SHUF(u[0], u[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(u[0], u[1], 1, 9, 3, 11, 5, 13, 7, 15);
  return SHUF(f, f, 0, 4, 2, 6, 1, 5, 3, 7);
}
#endif
#undef SHUF

constexpr int kMaxChunks = 16;  // head size up to 16 vectors (256 floats with AVX-512)

// The online softmax and the values of one query head over kW positions, from its kW vectors of
// partial dot products (lane sums, times `scale`, are the scores, capped by `softcap` when it is
// > 0; positions past n weigh 0): updates its running max, sum and accumulator (`acc`, C vectors).
template <int C>
__attribute__((always_inline)) inline void softmax_values(const vfloat* p, float scale, float softcap,
                                                          const float* const* vrow, int64_t n, float& m, float& l,
                                                          float* acc) {
  vint lane;
  for (int j = 0; j < kW; ++j) lane[j] = j;
  vfloat raw = reduce_lanes(p) * scale;
  if (softcap > 0.f) raw = vsoftcap(raw, softcap);
  const vfloat scores = lane < static_cast<int>(n) ? raw : -1e30f;  // finite: -ffast-math
  const float block_max = std::max(m, hmax(scores));
  const vfloat e = vexp(scores - block_max);
  const float rescale = vexp(vfloat{} + (m - block_max))[0];  // 0 on the first positions
  l = l * rescale + hsum(e);
  m = block_max;
  float s[kW];
  vstore(s, e);
  vfloat av[C];
  for (int c = 0; c < C; ++c) av[c] = vload(acc + c * kW) * rescale;
  for (int j = 0; j < kW; ++j)
    for (int c = 0; c < C; ++c) av[c] += s[j] * vload(vrow[j] + c * kW);
  std::memcpy(acc, av, sizeof av);
}

// One query head over kW positions (the first n real; the rows past them point at zeros), K and V
// rows in float32 and the query scaled. C is a template parameter so that the query and the
// accumulator stay in registers and every loop unrolls.
template <int C>
void attend_positions(const float* q, float, float softcap, const void* const* krows, const float* const* vrow,
                      int64_t n, float& m, float& l, float* acc) {
  const float* const* krow = reinterpret_cast<const float* const*>(krows);
  vfloat qv[C], p[kW];
  for (int c = 0; c < C; ++c) qv[c] = vload(q + c * kW);
  for (int j = 0; j < kW; ++j) {
    vfloat a = qv[0] * vload(krow[j]);
    for (int c = 1; c < C; ++c) a += qv[c] * vload(krow[j] + c * kW);
    p[j] = a;
  }
  softmax_values<C>(p, 1.f, softcap, vrow, n, m, l, acc);
}

using AttendFn = void (*)(const float*, float, float, const void* const*, const float* const*, int64_t, float&, float&,
                          float*);

template <int... I>
constexpr std::array<AttendFn, sizeof...(I)> attend_table(std::integer_sequence<int, I...>) {
  return {&attend_positions<I + 1>...};
}

constexpr auto kAttend = attend_table(std::make_integer_sequence<int, kMaxChunks>{});

#if defined(__AVX512BF16__)
// bfloat16 with AVX-512 BF16: the scores straight from the bfloat16 query and K rows as pairs
// (vdpbf16ps: exact products summed in float32, 32 values an instruction, the K rows never
// widened), scaled after the lane sums; V widened as before. C2: vectors of 32 values a head.
template <int C2>
void attend_positions_dot(const float* q, float scale, float softcap, const void* const* krows,
                          const float* const* vrow, int64_t n, float& m, float& l, float* acc) {
  const uint32_t* const* krow = reinterpret_cast<const uint32_t* const*>(krows);
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q);  // here the raw bfloat16 query row
  __m512bh qv[C2];
  vfloat p[kW];
  for (int c = 0; c < C2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qw + c * 16);
  for (int j = 0; j < kW; ++j) {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(krow[j]));
    for (int c = 1; c < C2; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(krow[j] + c * 16));
    p[j] = (vfloat)a;
  }
  softmax_values<2 * C2>(p, scale, softcap, vrow, n, m, l, acc);
}

template <int... I>
constexpr std::array<AttendFn, sizeof...(I)> attend_dot_table(std::integer_sequence<int, I...>) {
  return {&attend_positions_dot<I + 1>...};
}

constexpr auto kAttendDot = attend_dot_table(std::make_integer_sequence<int, kMaxChunks / 2>{});
constexpr bool kDecodeDot = true;
#else
constexpr bool kDecodeDot = false;
#endif

// A cache row as float32: float32 in place, bfloat16 widened, fp8 (uint8_t bytes) widened and scaled.
template <typename cache_t>
inline const float* cache_row_as_float(const cache_t* src, float* buf, int64_t n, float scale) {
  if constexpr (std::is_same_v<cache_t, uint8_t>)
    return fp8_row_as_float(src, buf, n, scale);
  else
    return row_as_float(src, buf, n);
}

// cache_t: scalar_t, or uint8_t for an fp8 e4m3 cache read with k_scale / v_scale.
template <typename scalar_t, typename cache_t>
void decode_vec(const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache, const int32_t* block_tables,
                const int32_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_size, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                float softcap, float k_scale, float v_scale) {
  constexpr bool same = std::is_same_v<scalar_t, cache_t>;
  // A sliding window reads each sequence's last positions only: shared leading blocks, if any,
  // lie mostly before the windows, so no sequences are grouped; nor with soft-capped scores, which
  // the grouped kernel does not cap, nor over an fp8 cache, which it does not read.
  PrefixStates prefix{std::vector<int64_t>(num_seqs, 0), {}, {}, {}};
  if constexpr (same) {
    if (window <= 0 && softcap <= 0.f)
      prefix = attend_shared_prefixes(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, num_heads,
                                      num_kv_heads, head_size, block_size, max_blocks, scale);
  }
  const int64_t group = num_heads / num_kv_heads, D = head_size, chunks = D / kW;
  const int64_t row_size = num_kv_heads * D;
  // bfloat16 scores on pairs where the CPU has AVX-512 BF16 and a head is whole 32-value vectors
  const bool dot = std::is_same_v<scalar_t, at::BFloat16> && same && kDecodeDot && D % 32 == 0;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    SequenceState st(num_heads, D);
    // bfloat16 rows widened once for all the heads that read them (float32 rows are used in place;
    // K rows not at all where the scores take bfloat16 pairs)
    std::vector<float> kbuf(kW * row_size), vbuf(kW * row_size);
    const void* krow[kW];
    const float* vrow[kW];
    const void* khead[kW];
    const float* vhead[kW];
    const std::vector<float> zeros(row_size, 0.f);  // the rows past a sequence's end
    const int64_t k_bytes = dot ? 2 : 4;            // bytes of a K row value as the scores read it
#if defined(__AVX512BF16__)
    const AttendFn attend = dot ? kAttendDot[chunks / 2 - 1] : kAttend[chunks - 1];
#else
    const AttendFn attend = kAttend[chunks - 1];
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int64_t len = seq_lens[b];
      const int32_t* table = block_tables + b * max_blocks;
      st.start(q + b * num_heads * D, scale);
      if (prefix.start[b] > 0) st.resume(prefix, b);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : prefix.start[b];
      for (int64_t start = first; start < len; start += kW) {
        const int64_t n = std::min<int64_t>(kW, len - start);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t pos = start + j;
          const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
          krow[j] = dot ? static_cast<const void*>(k_cache + slot * row_size)
                        : cache_row_as_float(k_cache + slot * row_size, kbuf.data() + j * row_size, row_size, k_scale);
          vrow[j] = cache_row_as_float(v_cache + slot * row_size, vbuf.data() + j * row_size, row_size, v_scale);
        }
        for (int64_t j = n; j < kW; ++j) krow[j] = vrow[j] = zeros.data();
        // The next positions' rows, prefetched a share per head while these are computed: all at
        // once, most of the requests were dropped (queues full) and the kernel waited on memory.
        const char* next_k = nullptr;
        const char* next_v = nullptr;
        if (start + kW < len) {
          const int64_t next = start + kW;
          const int64_t slot = static_cast<int64_t>(table[next / block_size]) * block_size + next % block_size;
          next_k = reinterpret_cast<const char*>(k_cache + slot * row_size);
          next_v = reinterpret_cast<const char*>(v_cache + slot * row_size);
        }
        const int64_t next_bytes = std::min<int64_t>(kW, block_size) * row_size * sizeof(cache_t);
        for (int64_t h = 0; h < num_heads; ++h) {
          if (next_k != nullptr) {
            const int64_t from = next_bytes * h / num_heads, to = next_bytes * (h + 1) / num_heads;
            prefetch_block(next_k + from, to - from);
            prefetch_block(next_v + from, to - from);
          }
          const int64_t off = (h / group) * D;
          for (int64_t j = 0; j < kW; ++j) {
            khead[j] = static_cast<const char*>(krow[j]) + (j < n ? off * k_bytes : 0);
            vhead[j] = vrow[j] + (j < n ? off : 0);
          }
          const float* qh = dot ? reinterpret_cast<const float*>(q + (b * num_heads + h) * D) : st.qf.data() + h * D;
          attend(qh, scale, softcap, khead, vhead, n, st.m[h], st.l[h], st.acc.data() + h * D);
        }
      }
      st.finish(out + b * num_heads * D);
    }
  }
}

// The same-type cache with the generic kernel's signature (the dispatch picks one of the two).
template <typename scalar_t, typename cache_t, int Unscaled>
void decode_vec(const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache, const int32_t* block_tables,
                const int32_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_size, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                float softcap) {
  decode_vec<scalar_t, cache_t>(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                head_size, block_size, max_blocks, scale, window, softcap, 1.f, 1.f);
}

}  // namespace
std::vector<std::pair<std::vector<int64_t>, int64_t>> decode_prefix_groups(torch::Tensor block_tables,
                                                                           torch::Tensor seq_lens, int64_t block_size) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  block_tables.dim() == 2 && seq_lens.size(0) == block_tables.size(0),
              "block_tables [B, blocks] and seq_lens [B], int32");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  std::vector<std::pair<std::vector<int64_t>, int64_t>> out;
  for (auto& g : find_prefix_groups(block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                                    seq_lens.size(0), block_tables.size(1), block_size))
    out.emplace_back(std::move(g.members), g.blocks);
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap, double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B,H,D], caches [N,BS,KVH,D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto out = torch::empty_like(query);
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && key_cache.size(3) == D, "head shapes do not match the cache");
  const bool vector_path = D % kW == 0 && D / kW <= kMaxChunks &&
                           (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16);
  if (key_cache.scalar_type() == at::kFloat8_e4m3fn) {
    TORCH_CHECK(vector_path && value_cache.scalar_type() == at::kFloat8_e4m3fn,
                "an fp8 cache is read with float32 or bfloat16 queries and head sizes a multiple of ", kW);
    const auto* kc = static_cast<const uint8_t*>(key_cache.data_ptr());
    const auto* vc = static_cast<const uint8_t*>(value_cache.data_ptr());
    const auto run = [&](auto* typed) {
      using scalar_t = std::remove_pointer_t<decltype(typed)>;
      decode_vec<scalar_t, uint8_t>(query.data_ptr<scalar_t>(), kc, vc, block_tables.data_ptr<int32_t>(),
                                    seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D, BS,
                                    block_tables.size(1), static_cast<float>(scale), window,
                                    static_cast<float>(softcap), static_cast<float>(k_scale),
                                    static_cast<float>(v_scale));
    };
    if (query.scalar_type() == at::kFloat)
      run(static_cast<float*>(nullptr));
    else
      run(static_cast<at::BFloat16*>(nullptr));
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_cpu", [&] {
    auto* kernel = &paged_decode::decode<scalar_t>;
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>)
      if (vector_path) kernel = &decode_vec<scalar_t, scalar_t, 1>;
    kernel(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), B, H,
                     KVH, D, BS, block_tables.size(1), static_cast<float>(scale), window,
                     static_cast<float>(softcap));
  });
  return out;
}

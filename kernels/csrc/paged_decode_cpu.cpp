// Paged decode attention for CPUs: one query token per sequence, K/V read in place through the
// block table. The torch reference (kernels/paged_attention.py) gathers K/V into a dense copy
// and then attends; on a CPU that triples the memory traffic of the step's largest read.
//
// One task per sequence handles all its heads: within a block, the rows of consecutive positions
// (all KV heads) are contiguous, so each block is read front to back in one stream (48 KiB for
// 16 positions x 12 heads x 64 floats) rather than as scattered per-head pieces. Softmax is
// computed online, block by block (flash-decoding style), so K and V are each read exactly once.
#include "cpu_ops.h"
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

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
  for (int64_t off = 0; off < bytes; off += 256) __builtin_prefetch(c + off, 0, 1);
}

template <typename scalar_t>
void decode(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t D = head_size;
  const int64_t row_size = num_kv_heads * D;  // one position, all KV heads: contiguous
  const int64_t block_elems = block_size * row_size;
  // Dynamic scheduling: sequences differ in length, so equal halves would leave a core idle.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qf(num_heads * D), acc(num_heads * D), row(row_size), s(num_heads * block_size);
    std::vector<float> m(num_heads), l(num_heads);
    // Offset of each query head's KV head within a row, computed once: an integer division per
    // head and position would cost more than the dot product itself.
    std::vector<int64_t> kv_offset(num_heads);
    for (int64_t h = 0; h < num_heads; ++h) kv_offset[h] = (h / group) * D;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int64_t len = seq_lens[b];
      const int32_t* table = block_tables + b * max_blocks;
      for (int64_t i = 0; i < num_heads * D; ++i) qf[i] = static_cast<float>(q[b * num_heads * D + i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      // Finite "minus infinity": the kernel is built with -ffast-math, which assumes no infinities.
      std::fill(m.begin(), m.end(), -1e30f);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      // Block by block with an online softmax: each block's K then V (contiguous, L2-resident)
      // are read once, in order, while the next block is prefetched.
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t n = std::min(block_size, len - blk * block_size);
        const scalar_t* kb = k_cache + static_cast<int64_t>(table[blk]) * block_elems;
        const scalar_t* vb = v_cache + static_cast<int64_t>(table[blk]) * block_elems;
        if (blk + 1 < num_blocks) {
          const int64_t next = static_cast<int64_t>(table[blk + 1]) * block_elems;
          prefetch_block(k_cache + next, block_elems * sizeof(scalar_t));
          prefetch_block(v_cache + next, block_elems * sizeof(scalar_t));
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* k = as_float(kb + j * row_size, row.data(), row_size);
          int64_t h = 0;
          // Four heads at a time: four independent accumulator chains keep the FMA units busy,
          // where one dot product at a time waits on each add's latency (2x on this loop).
          for (; h + 4 <= num_heads; h += 4) {
            const float *q0 = qf.data() + h * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
            const float *k0 = k + kv_offset[h], *k1 = k + kv_offset[h + 1], *k2 = k + kv_offset[h + 2],
                        *k3 = k + kv_offset[h + 3];
            float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t d = 0; d < D; ++d) {
              d0 += q0[d] * k0[d];
              d1 += q1[d] * k1[d];
              d2 += q2[d] * k2[d];
              d3 += q3[d] * k3[d];
            }
            s[h * block_size + j] = d0;
            s[(h + 1) * block_size + j] = d1;
            s[(h + 2) * block_size + j] = d2;
            s[(h + 3) * block_size + j] = d3;
          }
          for (; h < num_heads; ++h) {
            const float* kh = k + kv_offset[h];
            const float* qh = qf.data() + h * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
            s[h * block_size + j] = dot;
          }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          float* sh = s.data() + h * block_size;
          float block_max = sh[0];
#pragma omp simd reduction(max : block_max)
          for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, sh[j]);
          const float new_max = std::max(m[h], block_max);
          const float rescale = std::exp(m[h] - new_max);  // underflows to 0 on the first block
          if (rescale != 1.f) {
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
          }
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)  // vectorized expf (libmvec) under -ffast-math
          for (int64_t j = 0; j < n; ++j) {
            sh[j] = std::exp(sh[j] - new_max);
            sum += sh[j];
          }
          l[h] = l[h] * rescale + sum;
          m[h] = new_max;
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* v = as_float(vb + j * row_size, row.data(), row_size);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float w = s[h * block_size + j];
            const float* vh = v + kv_offset[h];
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * vh[d];
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* o = out + (b * num_heads + h) * D;
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[h * D + d] * inv);
      }
    }
  }
}

}  // namespace
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_cpu", [&] {
    decode<scalar_t>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), B, H,
                     KVH, D, BS, block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

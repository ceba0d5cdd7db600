// The generic path of the CPU decode kernel (paged_decode_cpu.cpp): any floating type (float16
// among them) and any head size, a query head at a time over each position's row. The vector
// path there serves float32 and bfloat16 at head sizes a multiple of the vector width.
#pragma once
#include "decode_state_cpu.h"
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paged_decode {

template <typename scalar_t>
void decode(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, int64_t block_size, int64_t max_blocks, float scale, int64_t window,
            float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t D = head_size;
  const int64_t row_size = num_kv_heads * D;  // one position, all KV heads: contiguous
  const int64_t block_elems = block_size * row_size;
  // Dynamic scheduling: sequences differ in length, so equal halves would leave a core idle.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    SequenceState st(num_heads, D);
    std::vector<float> row(row_size), s(num_heads * block_size);
    auto &qf = st.qf, &acc = st.acc, &m = st.m, &l = st.l;  // the generic body's names
    // Offset of each query head's KV head within a row, computed once: an integer division per
    // head and position would cost more than the dot product itself.
    std::vector<int64_t> kv_offset(num_heads);
    for (int64_t h = 0; h < num_heads; ++h) kv_offset[h] = (h / group) * D;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int64_t len = seq_lens[b];
      const int32_t* table = block_tables + b * max_blocks;
      st.start(q + b * num_heads * D, scale);
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      // A sliding window starts mid-block: that block is read from its first position in the window.
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      // Block by block with an online softmax: each block's K then V (contiguous, L2-resident)
      // are read once, in order, while the next block is prefetched.
      for (int64_t blk = first / block_size; blk < num_blocks; ++blk) {
        const int64_t skip = blk == first / block_size ? first % block_size : 0;
        const int64_t n = std::min(block_size, len - blk * block_size) - skip;
        const scalar_t* kb = k_cache + static_cast<int64_t>(table[blk]) * block_elems + skip * row_size;
        const scalar_t* vb = v_cache + static_cast<int64_t>(table[blk]) * block_elems + skip * row_size;
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
          if (softcap > 0.f)
            for (int64_t j = 0; j < n; ++j) sh[j] = softcap * std::tanh(sh[j] / softcap);
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
      st.finish(out + b * num_heads * D);
    }
  }
}

}  // namespace paged_decode

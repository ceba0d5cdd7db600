// Paged decode attention for CPUs: one query token per sequence, K/V read in place through the
// block table. The torch reference (kernels/paged_attention.py) gathers K/V into a dense copy
// and then attends; on a CPU that triples the memory traffic of the step's largest read.
//
// One task per sequence handles all its heads: within a block, the rows of consecutive positions
// (all KV heads) are contiguous, so each block is read front to back in one stream (48 KiB for
// 16 positions x 12 heads x 64 floats) rather than as scattered per-head pieces.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t D = head_size;
  const int64_t row_size = num_kv_heads * D;  // one position, all KV heads
  // Dynamic scheduling: sequences differ in length, so equal halves would leave a core idle.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qf(num_heads * D), acc(num_heads * D), row(row_size), scores, denom(num_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int64_t len = seq_lens[b];
      const int32_t* table = block_tables + b * max_blocks;
      scores.assign(num_heads * len, 0.f);
      for (int64_t i = 0; i < num_heads * D; ++i) qf[i] = static_cast<float>(q[b * num_heads * D + i]) * scale;
      // Pass 1: scores[h][p] = q_h . k_{kv(h)}(p)
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        const scalar_t* k = k_cache + slot * row_size;
#pragma omp simd
        for (int64_t i = 0; i < row_size; ++i) row[i] = static_cast<float>(k[i]);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* kr = row.data() + (h / group) * D;
          const float* qh = qf.data() + h * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kr[d];
          scores[h * len + p] = s;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < len; ++p) m = std::max(m, s[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - m);
          sum += s[p];
        }
        denom[h] = sum;
      }
      // Pass 2: acc[h] = sum_p w[h][p] * v_{kv(h)}(p)
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        const scalar_t* v = v_cache + slot * row_size;
#pragma omp simd
        for (int64_t i = 0; i < row_size; ++i) row[i] = static_cast<float>(v[i]);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float w = scores[h * len + p];
          const float* vr = row.data() + (h / group) * D;
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* o = out + (b * num_heads + h) * D;
        const float inv = 1.f / denom[h];
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}

// Paged decode attention for CPUs: one query token per sequence, K/V read in place through the
// block table. The torch reference (kernels/paged_attention.py) gathers K/V into a dense copy
// and then attends; on a CPU that triples the memory traffic of the step's largest read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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
  // One task per (sequence, kv head): the group of query heads sharing it reads each K/V row once.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), row(D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, kv = task % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int32_t* table = block_tables + b * max_blocks;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(b * num_heads + kv * group + g) * D + d]) * scale;
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        const scalar_t* k = k_cache + (slot * num_kv_heads + kv) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * row[d];
          scores[g * len + p] = s;
        }
      }
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < len; ++p) m = std::max(m, s[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - m);
          sum += s[p];
        }
        denom[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        const scalar_t* v = v_cache + (slot * num_kv_heads + kv) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + p];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o = out + (b * num_heads + kv * group + g) * D;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
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

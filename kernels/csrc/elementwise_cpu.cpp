// The small per-token ops of a Llama layer for CPUs, float32: RMSNorm (alone and fused with the
// residual add before it), rotary embedding and SiLU-and-mul. Their torch references run 3-8
// separate ATen ops each, every one a full pass over the activations plus dispatch overhead
// (16 ms of a 164 ms decode step at batch 64 on 2 cores); here each is one pass, parallel over
// tokens.
#include "cpu_ops.h"
#include <ATen/Parallel.h>

#include <cmath>

namespace {

// Rows per task: small batches (decode) stay on one thread unless there is enough work to split.
constexpr int64_t kGrain = 16;

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [tokens, hidden] with contiguous rows");
}

inline float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), ld = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * ld;
      float* o = op + t * n;
      const float r = inv_rms(row, n, static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = (row[i] * r) * w[i];
    }
  });
  return out;
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  weight = weight.contiguous();
  const int64_t n = x.size(1), ldx = x.stride(0), ldr = residual.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * ldx;
      float* rr = rp + t * ldr;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      const float r = inv_rms(rr, n, static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) xr[i] = (rr[i] * r) * w[i];
    }
  });
}

void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                      torch::Tensor cos_sin_cache, int64_t head_size) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1, "positions must be int64 [T]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == torch::kFloat32 && cos_sin_cache.size(1) == head_size,
              "cos_sin_cache must be float32 [max_position, head_size]");
  positions = positions.contiguous();
  cos_sin_cache = cos_sin_cache.contiguous();
  const int64_t half = head_size / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t max_pos = cos_sin_cache.size(0);
  auto rotate = [&](float* rows, int64_t ld, int64_t heads, int64_t t) {
    const float* c = cache + pos[t] * head_size;
    const float* s = c + half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = rows + t * ld + h * head_size;
      float* x2 = x1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  };
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
  float* q = query.data_ptr<float>();
  float* k = key.data_ptr<float>();
  const int64_t qh = query.size(1) / head_size, kh = key.size(1) / head_size;
  const int64_t ldq = query.stride(0), ldk = key.stride(0);
  at::parallel_for(0, positions.size(0), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, ldq, qh, t);
      rotate(k, ldk, kh, t);
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t n = x.size(1) / 2, ld = x.stride(0);
  auto out = torch::empty({x.size(0), n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * ld;
      const float* up = gate + n;
      float* o = op + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

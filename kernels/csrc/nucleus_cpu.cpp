// Top-p's cut of a whole row without sorting it (kernels/nucleus.py: nucleus_threshold_ref).
//
// A sampling row without a top-k whose nucleus reaches past the sampler's candidates (a flat
// distribution) needed a sort of its whole vocabulary: ~70 ms for 16 rows of 32k on one core.
// Here, per row: one pass histograms the weights' mass by the top bits of their float pattern
// (non-negative floats order as their bit patterns do), a walk down the buckets finds the one the
// cut falls in, a second pass gathers that bucket's few values, and only they are sorted.
// Sums are in double; the reference sums a sorted float row in double too, so the two differ
// only where the mass above a token is within rounding of the limit.
#include "cpu_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace {

constexpr int kBucketBits = 12;  // the exponent's 8 bits and 4 of the mantissa (the sign is 0)
constexpr int kShift = 31 - kBucketBits;
constexpr int kBuckets = 1 << kBucketBits;

inline uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

float row_threshold(const float* w, int64_t vocab, double limit, std::vector<double>& mass,
                    std::vector<float>& bucket) {
  std::fill(mass.begin(), mass.end(), 0.0);
  for (int64_t i = 0; i < vocab; ++i) mass[bits_of(w[i]) >> kShift] += w[i];
  // The lowest non-empty bucket with less than `limit` above it holds the cut.
  double above = 0.0, above_cut = 0.0;
  int cut = -1;
  for (int b = kBuckets - 1; b >= 0; --b) {
    if (mass[b] == 0.0) continue;
    if (above >= limit) break;
    cut = b;
    above_cut = above;
    above += mass[b];
  }
  if (cut < 0) return 0.0f;  // an all-zero row: every token weighs the threshold
  bucket.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    if ((bits_of(w[i]) >> kShift) == static_cast<uint32_t>(cut)) bucket.push_back(w[i]);
  }
  std::sort(bucket.begin(), bucket.end(), std::greater<float>());
  float threshold = bucket[0];
  double run = above_cut;
  for (size_t i = 0; i < bucket.size();) {
    if (run >= limit) break;
    threshold = bucket[i];
    size_t j = i;
    while (j < bucket.size() && bucket[j] == bucket[i]) run += bucket[j++];
    i = j;
  }
  return threshold;
}

}  // namespace

torch::Tensor nucleus_threshold_rows(torch::Tensor weights, torch::Tensor limit) {
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == torch::kFloat32 && weights.is_contiguous(),
              "weights must be a contiguous float32 [rows, vocab] tensor");
  TORCH_CHECK(limit.dim() == 1 && limit.size(0) == weights.size(0), "limit must be [rows]");
  const int64_t rows = weights.size(0), vocab = weights.size(1);
  auto lim = limit.to(torch::kFloat64).contiguous();
  auto out = torch::empty({rows}, weights.options());
  const float* w = weights.data_ptr<float>();
  const double* l = lim.data_ptr<double>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> mass(kBuckets);
    std::vector<float> bucket;
    for (int64_t r = begin; r < end; ++r) o[r] = row_threshold(w + r * vocab, vocab, l[r], mass, bucket);
  });
  return out;
}

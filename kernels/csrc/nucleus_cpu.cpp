// Top-p's cut of a whole row without sorting it (kernels/nucleus.py: nucleus_threshold_ref), and the
// whole sampling row built around it (nucleus_weights_ref).
//
// A sampling row without a top-k whose nucleus reaches past the sampler's candidates (a flat
// distribution) needed a sort of its whole vocabulary: ~70 ms for 16 rows of 32k on one core.
// Here, per row: one pass histograms the weights' mass by the top bits of their float pattern
// (non-negative floats order as their bit patterns do), a walk down the buckets finds the one the
// cut falls in, a second pass gathers that bucket's few values, and only they are sorted.
// Sums are in double; the reference sums a sorted float row in double too, so the two differ
// only where the mass above a token is within rounding of the limit.
// A whole sampling row (nucleus_weights_rows) weighs its tokens and fills the histogram in the same
// pass, so a flat top-p row costs three passes over the vocabulary instead of torch's eight.
#include "cpu_ops.h"
#include "vec_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
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

inline uint32_t bucket_of(float v) { return bits_of(v) >> kShift; }

constexpr int kLanes = 4;  // histograms filled in turn: a flat row sends run after run of tokens to
                           // one bucket, and one histogram would wait on each add's store

struct Scratch {
  std::vector<double> mass = std::vector<double>(kBuckets);
  std::vector<double> lanes = std::vector<double>(kLanes * kBuckets);
  std::vector<float> bucket;
};

// The cut given the row's mass histogram: the lowest non-empty bucket with less than `limit`
// above it holds it; only that bucket's values are sorted.
float cut_of(const float* w, int64_t vocab, double limit, Scratch& s) {
  double above = 0.0, above_cut = 0.0;
  int cut = -1;
  for (int b = kBuckets - 1; b >= 0; --b) {
    if (s.mass[b] == 0.0) continue;
    if (above >= limit) break;
    cut = b;
    above_cut = above;
    above += s.mass[b];
  }
  if (cut < 0) return 0.0f;  // an all-zero row: every token weighs the threshold
  s.bucket.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    if (bucket_of(w[i]) == static_cast<uint32_t>(cut)) s.bucket.push_back(w[i]);
  }
  std::sort(s.bucket.begin(), s.bucket.end(), std::greater<float>());
  float threshold = s.bucket[0];
  double run = above_cut;
  for (size_t i = 0; i < s.bucket.size();) {
    if (run >= limit) break;
    threshold = s.bucket[i];
    size_t j = i;
    while (j < s.bucket.size() && s.bucket[j] == s.bucket[i]) run += s.bucket[j++];
    i = j;
  }
  return threshold;
}

float row_threshold(const float* w, int64_t vocab, double limit, Scratch& s) {
  std::fill(s.mass.begin(), s.mass.end(), 0.0);
  for (int64_t i = 0; i < vocab; ++i) s.mass[bucket_of(w[i])] += w[i];
  return cut_of(w, vocab, limit, s);
}

float row_max(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t i = 0;
  if (n >= kW) {
    vfloat vm = vload(x);
    for (i = kW; i + kW <= n; i += kW) {
      const vfloat v = vload(x + i);
      vm = v > vm ? v : vm;
    }
    m = hmax(vm);
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// w = e^((x - max) / t), zero below min_p, histogrammed on the way; returns the row's mass.
double weigh_row(const float* x, float* w, int64_t n, float t, float min_p, Scratch& s) {
  const float top = row_max(x, n), inv = 1.0f / t;
  std::fill(s.lanes.begin(), s.lanes.end(), 0.0);
  double* lanes = s.lanes.data();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    vfloat v = vexp((vload(x + i) - top) * inv);
    v = v >= min_p ? v : 0.f;
    vstore(w + i, v);
    for (int l = 0; l < kW; ++l) lanes[(l % kLanes) * kBuckets + bucket_of(v[l])] += v[l];
  }
  for (; i < n; ++i) {
    float v = std::exp((x[i] - top) * inv);
    w[i] = v >= min_p ? v : 0.f;
    lanes[bucket_of(w[i])] += w[i];
  }
  double total = 0.0;
  for (int b = 0; b < kBuckets; ++b) {
    double m = 0.0;
    for (int l = 0; l < kLanes; ++l) m += lanes[l * kBuckets + b];
    s.mass[b] = m;
    total += m;
  }
  return total;
}

void keep_from(float* w, int64_t n, float threshold) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vfloat v = vload(w + i);
    vstore(w + i, v >= threshold ? v : 0.f);
  }
  for (; i < n; ++i) w[i] = w[i] >= threshold ? w[i] : 0.f;
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
    Scratch s;
    for (int64_t r = begin; r < end; ++r) o[r] = row_threshold(w + r * vocab, vocab, l[r], s);
  });
  return out;
}

torch::Tensor nucleus_weights_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_p,
                                   torch::Tensor min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits must be a contiguous float32 [rows, vocab] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const auto* rule : {&temperature, &top_p, &min_p}) {
    TORCH_CHECK(rule->dim() == 1 && rule->size(0) == rows, "each rule must be [rows]");
  }
  auto t = temperature.to(torch::kFloat32).contiguous(), p = top_p.to(torch::kFloat64).contiguous();
  auto mp = min_p.to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(logits);
  const float *x = logits.data_ptr<float>(), *tt = t.data_ptr<float>(), *mm = mp.data_ptr<float>();
  const double* pp = p.data_ptr<double>();
  float* w = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t r = begin; r < end; ++r) {
      float* row = w + r * vocab;
      const double total = weigh_row(x + r * vocab, row, vocab, tt[r], mm[r], s);
      keep_from(row, vocab, cut_of(row, vocab, pp[r] * total, s));
    }
  });
  return out;
}

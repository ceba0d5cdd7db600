// Multi-LoRA on the CPU: the shrink and expand products of every run of one adapter's rows of a
// module, in one call, added into the module's output in place. Defined by kernels/lora.py:
// lora_delta_ref.
//
// Why a kernel: the torch path (kernels/lora.py: lora_add_segmented) runs 1 + 3 x runs small ops
// per adapted module, and at decode sizes each op's eager dispatch (~20 us) costs more than its
// arithmetic (bench/results/lora.md).
//
// Layout (streamer/lora/stacks.py): a_t [S, in, K] and b_t [S, K, out], K = parts x R: float32, or
// bfloat16 for a bfloat16 model (widened as read: half the bytes, the sums still float32). Part
// p of slot s reads the rank columns spans[s][p] = [lo, hi) and writes the output columns
// [part_cols[p], part_cols[p+1]). The caller keeps b_t zero outside those blocks, so leaving them
// out changes nothing; it saves 2/3 of the expand on q/k/v, 1/2 on gate/up, and all of the zero
// padding past an adapter's own rank.
//
// Work: tasks of rows of one run, spread over the threads. A task widens its rows to float32,
// shrinks them (t = x a_t, one product for all the parts) and expands t into y part by part: float32
// sums, added into y and rounded once into y's dtype. A task reads its slot's stacks once for all
// its rows (the register tiles' later rows find them in the cache), so tasks are as large as keeps
// every thread busy: the step's rows over the threads, from one register tile of rows to four.
// (Tasks of one tile each read each stack once per tile: twice the time in a decode step of 64 rows
// of 4 adapters, where the model's own products have pushed the stacks out of the cache.)
#include "cpu_ops.h"
#include "tile_gemm_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMinTaskRows = tile_gemm::kMaxRows, kMaxTaskRows = 4 * tile_gemm::kMaxRows;

// c[M, N] (+)= a[M, K] b[K, N], row-major with leading dimensions lda, ldb, ldc: the register tiles
// over N's whole vectors, a plain loop over the columns past them. b float32, or bfloat16 widened as
// it is read (the stacks of a bfloat16 model: decode steps wait on reading them, not on the sums).
template <typename W>
void product(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t M, int64_t N, int64_t K, float* c,
             int64_t ldc, bool accumulate) {
  using E = std::conditional_t<std::is_same_v<W, float>, F32Elements, F32Bf16Elements>;
  const int64_t whole = N / kW * kW;
  if (whole > 0) tile_gemm_product<E>(a, lda, 1, b, ldb, M, whole, K, c, ldc, accumulate);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = whole; n < N; ++n) {
      float sum = accumulate ? c[m * ldc + n] : 0.f;
      for (int64_t k = 0; k < K; ++k) sum += a[m * lda + k] * static_cast<float>(b[k * ldb + n]);
      c[m * ldc + n] = sum;
    }
}

// y[0 : n] += c[0 : n]: bfloat16 widened, summed in float32 and rounded to the nearest (ties to
// even) a vector at a time; c10's scalar conversion in this loop cost more than the products.
inline void add_into(float* y, const float* c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += c[i];
}

inline void add_into(at::BFloat16* y, const float* c, int64_t n) {
  auto* bits = reinterpret_cast<uint16_t*>(y);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    vu16 h;
    std::memcpy(&h, bits + i, sizeof h);
    const vu32 wide = __builtin_convertvector(h, vu32) << 16;
    vfloat v;
    std::memcpy(&v, &wide, sizeof v);
    v += vload(c + i);
    vu32 u;
    std::memcpy(&u, &v, sizeof u);
    h = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, vu16);
    std::memcpy(bits + i, &h, sizeof h);
  }
  for (; i < n; ++i) y[i] = static_cast<float>(y[i]) + c[i];
}

// `rows` rows of x from `first` as float32 with leading dimension *ld: float32 in place, bfloat16
// widened into buf.
inline const float* rows_as_float(const float* x, int64_t stride, int64_t, int64_t, std::vector<float>&,
                                  int64_t* ld) {
  *ld = stride;
  return x;
}

inline const float* rows_as_float(const at::BFloat16* x, int64_t stride, int64_t rows, int64_t n,
                                  std::vector<float>& buf, int64_t* ld) {
  buf.resize(rows * n);
  const int64_t whole = n / kW * kW;
  for (int64_t m = 0; m < rows; ++m) {
    const at::BFloat16* src = x + m * stride;
    float* dst = buf.data() + m * n;
    widen(src, dst, whole);
    for (int64_t i = whole; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
  *ld = n;
  return buf.data();
}

struct Task {
  int64_t slot, start, rows;
};

template <typename W>
struct Shapes {
  int64_t in, out, K, parts;
  const W* a;              // [S, in, K]
  const W* b;              // [S, K, out]
  const int64_t* spans;    // [S, parts, 2]
  const int64_t* cols;     // [parts + 1]
};

// One task: its rows' delta added into y. t and c are the thread's buffers.
template <typename T, typename W>
void run_task(const Task& task, const Shapes<W>& s, const T* x, int64_t x_stride, T* y, int64_t y_stride,
              std::vector<float>& xbuf, std::vector<float>& t, std::vector<float>& c) {
  int64_t ldx = 0;
  const float* xs = rows_as_float(x + task.start * x_stride, x_stride, task.rows, s.in, xbuf, &ldx);
  const W* a = s.a + task.slot * s.in * s.K;
  const W* b = s.b + task.slot * s.K * s.out;
  const int64_t* spans = s.spans + task.slot * s.parts * 2;
  t.resize(task.rows * s.K);
  // Shrink: one product over all the parts' rank columns, [first lo, last hi) widened to whole
  // vectors where the stack has the columns. Columns between or past the spans are zero in a_t, so
  // they only cost their multiply-adds, and one product over them reads each row of x once for all
  // the parts (per-part products measured ~10% slower end to end on q/k/v and gate/up).
  int64_t first = s.K, last = 0;
  for (int64_t p = 0; p < s.parts; ++p)
    if (spans[2 * p + 1] > spans[2 * p]) first = std::min(first, spans[2 * p]), last = std::max(last, spans[2 * p + 1]);
  if (last <= first) return;
  const int64_t width = std::min(s.K - first, (last - first + kW - 1) / kW * kW);
  product(xs, ldx, a + first, s.K, task.rows, width, s.in, t.data() + first, s.K, false);
  // Expand, part by part, into y's rows.
  T* y_rows = y + task.start * y_stride;
  for (int64_t p = 0; p < s.parts; ++p) {
    const int64_t lo = spans[2 * p], hi = spans[2 * p + 1], c0 = s.cols[p], n = s.cols[p + 1] - c0;
    if (hi <= lo || n == 0) continue;
    if constexpr (std::is_same_v<T, float>) {
      product(t.data() + lo, s.K, b + lo * s.out + c0, s.out, task.rows, n, hi - lo, y_rows + c0, y_stride, true);
    } else {
      c.resize(task.rows * n);
      product(t.data() + lo, s.K, b + lo * s.out + c0, s.out, task.rows, n, hi - lo, c.data(), n, false);
      for (int64_t m = 0; m < task.rows; ++m) add_into(y_rows + m * y_stride + c0, c.data() + m * n, n);
    }
  }
}

void check_stack(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16) &&
                  t.dim() == 3 && t.is_contiguous(),
              name, " must be a contiguous float32 or bfloat16 CPU tensor [slots, rows, columns]");
}

void check_index(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.is_contiguous(), name,
              " must be a contiguous int64 CPU tensor");
}

}  // namespace

void lora_add_runs(torch::Tensor x, torch::Tensor y, torch::Tensor a_t, torch::Tensor b_t, torch::Tensor runs,
                   torch::Tensor spans, torch::Tensor part_cols) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1,
              "x and y must be CPU [rows, features] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x and y must both be float32 or both bfloat16");
  TORCH_CHECK(x.size(0) == y.size(0), "x and y must have the same rows");
  check_stack(a_t, "a_t");
  check_stack(b_t, "b_t");
  TORCH_CHECK(a_t.scalar_type() == b_t.scalar_type(), "a_t and b_t must have one dtype");
  check_index(runs, "runs");
  check_index(spans, "spans");
  check_index(part_cols, "part_cols");
  const int64_t S = a_t.size(0), K = a_t.size(2), P = spans.dim() == 3 ? spans.size(1) : 0;
  TORCH_CHECK(a_t.size(1) == x.size(1) && b_t.size(0) == S && b_t.size(1) == K && b_t.size(2) == y.size(1),
              "a_t must be [S, in, K] and b_t [S, K, out] for x [rows, in] and y [rows, out]");
  TORCH_CHECK(P > 0 && spans.size(0) == S && spans.size(2) == 2 && part_cols.numel() == P + 1,
              "spans must be [S, parts, 2] and part_cols [parts + 1]");
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3, "runs must be [n, 3]: slot, start, end");
  const int64_t* spans_p = spans.data_ptr<int64_t>();
  const int64_t* cols = part_cols.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * P; ++i) {
    const int64_t lo = spans_p[2 * i], hi = spans_p[2 * i + 1];
    TORCH_CHECK(0 <= lo && hi <= K, "a span is outside the rank columns");
  }
  TORCH_CHECK(cols[0] == 0 && cols[P] == y.size(1), "part_cols must run from 0 to out");
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(cols[p] <= cols[p + 1], "part_cols must not decrease");

  // Each run split into near-equal tasks of at most task_rows rows (13 rows by 6: 5, 4, 4, not 6, 6, 1).
  std::vector<Task> tasks;
  const int64_t* r = runs.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t i = 0; i < runs.size(0); ++i) rows += std::max<int64_t>(0, r[3 * i + 2] - r[3 * i + 1]);
  const int64_t threads = at::get_num_threads();
  const int64_t task_rows = std::clamp((rows + threads - 1) / threads, kMinTaskRows, kMaxTaskRows);
  for (int64_t i = 0; i < runs.size(0); ++i) {
    const int64_t slot = r[3 * i], start = r[3 * i + 1], end = r[3 * i + 2];
    TORCH_CHECK(0 <= slot && slot < S && 0 <= start && start <= end && end <= x.size(0), "run ", i,
                " is outside the slots or the rows");
    const int64_t count = (end - start + task_rows - 1) / task_rows;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t first = start + (end - start) * j / count, last = start + (end - start) * (j + 1) / count;
      tasks.push_back({slot, first, last - first});
    }
  }
  const auto launch = [&](auto x_zero, auto w_zero) {
    using T = decltype(x_zero);
    using W = decltype(w_zero);
    const Shapes<W> shapes{x.size(1), y.size(1), K, P, reinterpret_cast<const W*>(a_t.data_ptr()),
                           reinterpret_cast<const W*>(b_t.data_ptr()), spans_p, cols};
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xbuf, t, c;
      for (int64_t i = begin; i < end; ++i) run_task(tasks[i], shapes, xp, x.stride(0), yp, y.stride(0), xbuf, t, c);
    });
  };
  const bool x_bf16 = x.scalar_type() == torch::kBFloat16, w_bf16 = a_t.scalar_type() == torch::kBFloat16;
  if (x_bf16 && w_bf16)
    launch(at::BFloat16{}, at::BFloat16{});
  else if (x_bf16)
    launch(at::BFloat16{}, float{});
  else if (w_bf16)
    launch(float{}, at::BFloat16{});
  else
    launch(float{}, float{});
}

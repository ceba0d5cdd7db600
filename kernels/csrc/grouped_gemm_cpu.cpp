// The grouped product of a mixture-of-experts layer (kernels/grouped_gemm.py: grouped_mm_ref) with
// the experts, not the rows of one expert, spread over the threads.
//
// In a decode step each expert owns a few rows (64 tokens x top 2 over 8 experts: 16 each), and a
// product of 16 rows split across threads spends much of its time in the threads' fork and join and
// in re-reading the expert's weights per thread: torch's grouped product does exactly that, one
// threaded product per expert. Here each (expert, column block) is one task on one thread, running
// ATen's single-threaded product (inside a parallel region ATen does not nest threads), so each
// expert's weights are streamed once, by one core. Columns are split only when there are fewer
// experts than twice the threads, to keep every thread busy.
#include "brgemm_cpu.h"
#include "cpu_ops.h"
#include "vec_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

torch::Tensor grouped_mm_rows(torch::Tensor a, torch::Tensor b, torch::Tensor offs) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && a.size(1) == b.size(1), "grouped_mm_rows: a [N, K], b [E, K, M]");
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == b.size(0), "grouped_mm_rows: offs [E]");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "grouped_mm_rows: a and b of one dtype");
  const int64_t experts = b.size(0), cols = b.size(2);
  auto out = torch::empty({a.size(0), cols}, a.options());
  const auto ends = offs.to(torch::kInt64).contiguous();
  const int64_t* end = ends.data_ptr<int64_t>();
  TORCH_CHECK(experts == 0 || end[experts - 1] == a.size(0), "grouped_mm_rows: offs must end at a's rows");
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, (2 * threads + experts - 1) / std::max<int64_t>(experts, 1));
  const int64_t width = (cols + splits - 1) / splits;
  // ATen ops on the pool's threads need the caller's modes (inference mode: `out` is an inference
  // tensor that only code in inference mode may write).
  const at::ThreadLocalState caller;
  at::parallel_for(0, experts * splits, 1, [&](int64_t first, int64_t last) {
    const at::ThreadLocalStateGuard modes(caller);
    for (int64_t task = first; task < last; ++task) {
      const int64_t e = task / splits, lo = (task % splits) * width, hi = std::min(cols, lo + width);
      const int64_t start = e ? end[e - 1] : 0;
      if (end[e] <= start || hi <= lo) continue;
      auto dst = out.slice(0, start, end[e]).slice(1, lo, hi);
      at::mm_out(dst, a.slice(0, start, end[e]), b[e].slice(1, lo, hi));
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// The whole experts' MLP of a mixture-of-experts layer in one call (kernels/grouped_gemm.py:
// moe_experts_ref): for each expert's rows, gate/up, SiLU(gate) * up and down, over weights packed
// once at load (kernels/grouped_gemm.py: pack_experts).
//
// Each product is a oneDNN micro-kernel (ATen's cpublas::brgemm: AMX tiles for bfloat16 where the
// CPU has them, AVX-512 or AVX2 FMA for float32) on a block of at most kRowBlock rows of one expert
// and one block of packed columns, so the packed block (at most 64 columns by K) stays in cache
// across the expert's row blocks. Two passes, each over (column block, expert) tasks spread over
// the threads, column block outermost so that each thread gets every expert's rows for its share
// of the columns: gate/up then the activation into h [pairs, I], then down into y [pairs, H].
//
// Packed layout: w13 [E, NB1, Hp, 2 B1] (block j: gate columns j B1.. then the same up columns;
// Hp = H padded to 32, the padded rows zero), w2 [E, NB2, Ip, B2] (Ip = NB1 B1, its rows past I
// zero); bfloat16 as K pairs (the micro-kernels' VNNI layout: [K/2][N][2] flattened to [K/2][2N]).
// Rounding follows the unfused path: gate and up rounded to the dtype as the grouped product
// returns them, SiLU(gate) rounded before the multiply (as silu_and_mul), h and y in the dtype.
namespace {

namespace cpublas = at::native::cpublas;

constexpr int64_t kRowBlock = 32;  // rows of one micro-kernel call

template <typename T>
constexpr bool kPairs = std::is_same_v<T, at::BFloat16>;

inline vfloat rounded(vfloat v, float) { return v; }

inline vfloat rounded(vfloat v, at::BFloat16) {  // the nearest bfloat16 (ties to even), as float32
  vu32 u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  vfloat f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void put(float* p, vfloat v) { vstore(p, v); }

inline void put(at::BFloat16* p, vfloat v) {  // v already rounded: its top halves
  vu32 u;
  std::memcpy(&u, &v, sizeof u);
  const vu16 h = __builtin_convertvector(u >> 16, vu16);
  std::memcpy(p, &h, sizeof h);
}

// SiLU as elementwise_cpu.cpp's silu_and_mul computes it (below -80 through e^(g+8) e^-8).
inline vfloat silu(vfloat g) {
  constexpr float kExpMinus8 = 3.35462628e-4f;
  const vint tiny = g < -80.f;
  const vfloat e = vexp(tiny ? g + 8.f : -g);
  return tiny ? g * e * kExpMinus8 : g / (1.f + e);
}

struct ExpertShape {
  int64_t experts, pairs, hidden, hp, nb1, b1, ip, nb2, b2;
};

// y[p] = down(SiLU(gate(a[p])) * up(a[p])) times scale[p] (null: 1) for every pair p, the pairs of
// expert e the rows end[e-1]..end[e] of a (`active`: the experts with rows).
template <typename T>
void run_experts(const ExpertShape& s, const std::vector<int64_t>& active, const int64_t* end, const T* a,
                 const T* w13, const T* w2, const float* scale, T* h, T* y) {
  const int64_t n_active = static_cast<int64_t>(active.size());
  const auto first_row = [&](int64_t e) { return e ? end[e - 1] : 0; };
  // Gate/up and the activation: task (column block j, expert).
  at::parallel_for(0, s.nb1 * n_active, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> c(kRowBlock * 2 * s.b1);
    for (int64_t t = begin; t < stop; ++t) {
      const int64_t j = t / n_active, e = active[t % n_active];
      const T* b = w13 + (e * s.nb1 + j) * s.hp * 2 * s.b1;
      for (int64_t m0 = first_row(e); m0 < end[e]; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, end[e] - m0);
        cpublas::brgemm(rows, 2 * s.b1, s.hp, s.hp, 2 * s.b1, 2 * s.b1, false, a + m0 * s.hp, b, c.data(), kPairs<T>);
        for (int64_t r = 0; r < rows; ++r) {
          const float* gate = c.data() + r * 2 * s.b1;
          T* out = h + (m0 + r) * s.ip + j * s.b1;
          for (int64_t i = 0; i < s.b1; i += kW) {
            const vfloat g = rounded(vload(gate + i), T{}), u = rounded(vload(gate + s.b1 + i), T{});
            put(out + i, rounded(rounded(silu(g), T{}) * u, T{}));
          }
        }
      }
    }
    cpublas::brgemm_release(kPairs<T>);
  });
  // Down: task (column block j, expert); the last block's columns past H are not written.
  at::parallel_for(0, s.nb2 * n_active, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> c(kRowBlock * s.b2);
    for (int64_t t = begin; t < stop; ++t) {
      const int64_t j = t / n_active, e = active[t % n_active];
      const T* b = w2 + (e * s.nb2 + j) * s.ip * s.b2;
      const int64_t col0 = j * s.b2, cols = std::min(s.b2, s.hidden - col0), whole = cols / kW * kW;
      for (int64_t m0 = first_row(e); m0 < end[e]; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, end[e] - m0);
        cpublas::brgemm(rows, s.b2, s.ip, s.ip, s.b2, s.b2, false, h + m0 * s.ip, b, c.data(), kPairs<T>);
        for (int64_t r = 0; r < rows; ++r) {
          // As the unfused path: y rounded to the dtype, times the pair's weight, rounded again
          // (a weight of 1 changes nothing).
          const float* src = c.data() + r * s.b2;
          const float w = scale ? scale[m0 + r] : 1.f;
          T* out = y + (m0 + r) * s.hidden + col0;
          for (int64_t i = 0; i < whole; i += kW) put(out + i, rounded(rounded(vload(src + i), T{}) * w, T{}));
          for (int64_t i = whole; i < cols; ++i)
            out[i] = static_cast<T>(static_cast<float>(static_cast<T>(src[i])) * w);
        }
      }
    }
    cpublas::brgemm_release(kPairs<T>);
  });
}

inline vfloat load_float(const float* p) { return vload(p); }

inline vfloat load_float(const at::BFloat16* p) {
  vu16 bits;
  std::memcpy(&bits, p, sizeof bits);
  const vu32 w = __builtin_convertvector(bits, vu32) << 16;
  vfloat f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

// out[t] = the sum of token t's weighted pair rows y[pos[t k + j]] (pos ascending: expert order)
// in float32, rounded once to the dtype: what zeros.index_add_(0, rows, y) computes (for bfloat16
// torch sums in float32 too).
template <typename T>
void combine(const T* y, const int64_t* pos, int64_t tokens, int64_t k, int64_t hidden, T* out) {
  const int64_t whole = hidden / kW * kW;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t stop) {
    for (int64_t t = begin; t < stop; ++t) {
      const int64_t* p = pos + t * k;
      T* o = out + t * hidden;
      for (int64_t i = 0; i < whole; i += kW) {
        vfloat acc = load_float(y + p[0] * hidden + i);
        for (int64_t j = 1; j < k; ++j) acc += load_float(y + p[j] * hidden + i);
        put(o + i, rounded(acc, T{}));
      }
      for (int64_t i = whole; i < hidden; ++i) {
        float acc = static_cast<float>(y[p[0] * hidden + i]);
        for (int64_t j = 1; j < k; ++j) acc += static_cast<float>(y[p[j] * hidden + i]);
        o[i] = static_cast<T>(acc);
      }
    }
  });
}

// The packed weights' blocks (pack_experts' layout), checked against x.
ExpertShape packed_shape(const torch::Tensor& x, int64_t pairs, const torch::Tensor& w13, const torch::Tensor& w2) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "moe_experts: x must be a CPU [tokens, hidden] tensor with contiguous rows");
  TORCH_CHECK(moe_experts_runs(dtype), "moe_experts: float32, or bfloat16 where the micro-kernels take it");
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype && w13.dim() == 4 && w2.dim() == 4 &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "moe_experts: w13 and w2 must be packed (pack_experts) in x's dtype");
  const int64_t f = dtype == torch::kBFloat16 ? 2 : 1;  // K steps per packed row
  ExpertShape s{};
  s.experts = w13.size(0);
  s.pairs = pairs;
  s.hidden = x.size(1);
  s.nb1 = w13.size(1);
  s.hp = w13.size(2) * f;
  s.b1 = w13.size(3) / f / 2;
  s.ip = s.nb1 * s.b1;
  s.nb2 = w2.size(1);
  s.b2 = w2.size(3) / f;
  TORCH_CHECK(s.b1 > 0 && s.b1 % kW == 0 && w13.size(3) == 2 * s.b1 * f, "moe_experts: w13's blocks");
  TORCH_CHECK(w2.size(0) == s.experts && w2.size(2) * f == s.ip && s.nb2 * s.b2 >= s.hidden && s.hp >= s.hidden,
              "moe_experts: w2 [E, NB2, Ip, B2] must match w13 and x");
  return s;
}

// The experts on the pairs sorted by expert: rows[p] the token of pair p, ends the running counts
// of the experts' pairs, scale[p] its weight (or null). Returns y [pairs, hidden].
torch::Tensor experts_on_pairs(const torch::Tensor& x, const std::vector<int64_t>& rows,
                               const std::vector<int64_t>& ends, const float* scale, const torch::Tensor& w13,
                               const torch::Tensor& w2) {
  const ExpertShape s = packed_shape(x, static_cast<int64_t>(rows.size()), w13, w2);
  TORCH_CHECK(static_cast<int64_t>(ends.size()) == s.experts, "moe_experts: offs [E]");
  std::vector<int64_t> active;
  for (int64_t e = 0, start = 0; e < s.experts; start = ends[e++]) {
    TORCH_CHECK(start <= ends[e], "moe_experts: offs must not decrease");
    if (ends[e] > start) active.push_back(e);
  }
  TORCH_CHECK(s.experts == 0 || ends.back() == s.pairs, "moe_experts: offs must end at the number of pairs");
  for (const int64_t r : rows) TORCH_CHECK(0 <= r && r < x.size(0), "moe_experts: a row outside x");
  // Every pair's row of x, expert by expert, padded with zero columns to Hp.
  auto a = torch::empty({s.pairs, s.hp}, x.options());
  auto h = torch::empty({s.pairs, s.ip}, x.options());
  auto y = torch::empty({s.pairs, s.hidden}, x.options());
  const int64_t size = x.element_size(), ld = x.stride(0);
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* ap = static_cast<char*>(a.data_ptr());
  at::parallel_for(0, s.pairs, 16, [&](int64_t begin, int64_t stop) {
    for (int64_t p = begin; p < stop; ++p) {
      std::memcpy(ap + p * s.hp * size, xp + rows[p] * ld * size, s.hidden * size);
      std::memset(ap + (p * s.hp + s.hidden) * size, 0, (s.hp - s.hidden) * size);
    }
  });
  if (x.scalar_type() == torch::kBFloat16) {
    using T = at::BFloat16;
    run_experts<T>(s, active, ends.data(), a.data_ptr<T>(), w13.data_ptr<T>(), w2.data_ptr<T>(), scale,
                   h.data_ptr<T>(), y.data_ptr<T>());
  } else {
    run_experts<float>(s, active, ends.data(), a.data_ptr<float>(), w13.data_ptr<float>(), w2.data_ptr<float>(),
                       scale, h.data_ptr<float>(), y.data_ptr<float>());
  }
  return y;
}

}  // namespace

bool moe_experts_runs(torch::ScalarType dtype) {
  return dtype == torch::kFloat32 || (dtype == torch::kBFloat16 && bf16_pairs_run());
}

torch::Tensor moe_experts(torch::Tensor x, torch::Tensor rows, torch::Tensor offs, torch::Tensor w13,
                          torch::Tensor w2) {
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1, "moe_experts: rows must be int64 [pairs]");
  TORCH_CHECK(offs.dim() == 1, "moe_experts: offs [E]");
  const auto r = rows.contiguous();
  const auto o = offs.to(torch::kInt64).contiguous();
  return experts_on_pairs(x, std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()),
                          std::vector<int64_t>(o.data_ptr<int64_t>(), o.data_ptr<int64_t>() + o.numel()), nullptr,
                          w13, w2);
}

torch::Tensor moe_layer(torch::Tensor x, torch::Tensor weights, torch::Tensor experts, torch::Tensor w13,
                        torch::Tensor w2) {
  TORCH_CHECK(experts.scalar_type() == torch::kInt64 && experts.dim() == 2 && experts.size(0) == x.size(0) &&
                  experts.size(1) > 0,
              "moe_layer: experts must be int64 [tokens, k]");
  TORCH_CHECK(weights.sizes() == experts.sizes(), "moe_layer: weights [tokens, k]");
  const int64_t tokens = experts.size(0), k = experts.size(1), pairs = tokens * k, num_experts = w13.size(0);
  const auto ids_t = experts.contiguous();
  const auto w_t = weights.to(torch::kFloat32).contiguous();  // exact for bfloat16 weights
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const float* w = w_t.data_ptr<float>();
  // The pairs sorted by expert, (token, choice) order within an expert: a stable counting sort, as
  // the unfused path's stable argsort.
  std::vector<int64_t> ends(num_experts, 0), rows(pairs), pos(pairs);
  std::vector<float> scale(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(0 <= ids[p] && ids[p] < num_experts, "moe_layer: an expert id outside the packed experts");
    ++ends[ids[p]];
  }
  std::vector<int64_t> next(num_experts, 0);
  for (int64_t e = 1; e < num_experts; ++e) next[e] = next[e - 1] + ends[e - 1];
  for (int64_t e = 0; e < num_experts; ++e) ends[e] += next[e];
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t q = next[ids[p]]++;
    rows[q] = p / k;
    scale[q] = w[p];
    pos[p] = q;
  }
  for (int64_t t = 0; t < tokens; ++t) std::sort(pos.begin() + t * k, pos.begin() + (t + 1) * k);
  const auto y = experts_on_pairs(x, rows, ends, scale.data(), w13, w2);
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == torch::kBFloat16) {
    using T = at::BFloat16;
    combine<T>(y.data_ptr<T>(), pos.data(), tokens, k, x.size(1), out.data_ptr<T>());
  } else {
    combine<float>(y.data_ptr<float>(), pos.data(), tokens, k, x.size(1), out.data_ptr<float>());
  }
  return out;
}

// Paged prefill (and extend) attention for CPUs: each sequence's new tokens attend causally to
// its cached context and to each other, K/V read through the block table. Defined by
// `paged_prefill_attention_ref` (kernels/paged_attention.py).
//
// Flash-attention tiling with the grouped query heads folded into the rows: a task is one
// sequence, one KV head and kQueryTile consecutive positions, so its rows are those positions x
// the query heads that share the KV head (no K/V copy per query head, as the fused ATen kernel
// needs). Keys go kKeyTile at a time, widened to float32 and packed once per task and tile (K
// transposed), then two register-tiled products: scores = Q K^T, out += P V, with the softmax
// online in between. Key tiles past a task's last position are never visited (causal), so a
// prompt costs half its square; a short extend over a long context is a few rows over many keys
// and needs no padding or mask. Everything accumulates in float32; bfloat16 rounds once, at the
// output. Any head size: rows are padded with zeros to whole vectors.
#include "cpu_ops.h"
#include "vec_cpu.h"
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kTaskRows = 96;  // query rows per task (positions x the query heads of one KV head)
constexpr int64_t kKeyTile = 64;   // keys per step
constexpr float kMasked = -1e30f;  // finite "minus infinity": the kernel is built with -ffast-math
// Register tiles of up to kMaxRows x kMaxCols vectors: 24 float32 accumulators with AVX-512's 32
// registers, 12 with AVX2's 16.
constexpr int kMaxRows = kW == 16 ? 8 : 6;
constexpr int kMaxCols = kW == 16 ? 4 : 2;

// c[r][0 : C*kW] (+)= sum over k < K of a[r, k] * b[k][0 : C*kW] for R rows, a[r, k] at
// a[r * ars + k * aks]: the micro-kernel of both products. R and C are template parameters so
// the accumulators stay in registers.
template <int R, int C>
void tile(const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, int64_t K, float* c, int64_t ldc,
          bool accumulate) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = accumulate ? vload(c + r * ldc + j * kW) : vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    vfloat bv[C];
    for (int j = 0; j < C; ++j) bv[j] = vload(b + k * ldb + j * kW);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * ars + k * aks];
      for (int j = 0; j < C; ++j) acc[r][j] += x * bv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) vstore(c + r * ldc + j * kW, acc[r][j]);
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool);

template <int R, int... C>
constexpr std::array<TileFn, sizeof...(C)> tile_row(std::integer_sequence<int, C...>) {
  return {&tile<R, C + 1>...};
}

template <int... R>
constexpr std::array<std::array<TileFn, kMaxCols>, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {tile_row<R + 1>(std::make_integer_sequence<int, kMaxCols>{})...};
}

constexpr auto kTile = tile_table(std::make_integer_sequence<int, kMaxRows>{});  // [rows - 1][vectors - 1]

// c[M][N] (+)= a[M, K] b[K][N] (N a multiple of kW) in register tiles: columns in groups of 4
// vectors where they divide evenly (6 rows), else of 3 (8 rows); with AVX2 2 vectors, 6 rows.
void gemm(const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, int64_t M, int64_t N, int64_t K,
          float* c, int64_t ldc, bool accumulate) {
  const int64_t vectors = N / kW;
  const int64_t cols = kMaxCols < 4 ? kMaxCols : (vectors % 4 == 0 ? 4 : 3);
  const int64_t rows = kMaxCols < 4 ? kMaxRows : (cols == 4 ? 6 : 8);
  for (int64_t n0 = 0; n0 < vectors; n0 += cols) {
    const int64_t nc = std::min(cols, vectors - n0);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      const int64_t nr = std::min(rows, M - m0);
      kTile[nr - 1][nc - 1](a + m0 * ars, ars, aks, b + n0 * kW, ldb, K, c + m0 * ldc + n0 * kW, ldc, accumulate);
    }
  }
}

// One head's row of D values as Dp floats (zero padded).
template <typename scalar_t>
inline void load_row(const scalar_t* src, int64_t D, int64_t Dp, float* dst) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (D == Dp) return widen(src, dst, D);
  }
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
}

struct Shape {
  int64_t heads, kv_heads, group, D, Dp, block_size, max_blocks;
  int64_t positions_per_task() const { return std::max<int64_t>(1, kTaskRows / group); }
  int64_t max_rows() const { return (positions_per_task() * group + kW - 1) / kW * kW; }
};

// A task: one sequence, one KV head, query positions [q0, q1) of its new tokens.
struct Task {
  int64_t seq, kv_head, q0, q1;
};

// A thread's working set (~100 KiB at head size 64: L2-resident). Scores are kept transposed,
// keys x rows, so that the softmax's per-row max and sum run down columns, a vector of rows at a
// time, and K and V tiles are plain row copies (no transpose): Q is transposed once per task.
struct Workspace {
  std::vector<float> qt, k, v, st, o, m, l, pos;
  explicit Workspace(const Shape& sh)
      : qt(sh.Dp * sh.max_rows()), k(kKeyTile * sh.Dp), v(kKeyTile * sh.Dp), st(kKeyTile * sh.max_rows()),
        o(sh.max_rows() * sh.Dp), m(sh.max_rows()), l(sh.max_rows()), pos(sh.max_rows()) {}
};

template <typename scalar_t>
class PrefillKernel {
 public:
  PrefillKernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_tables,
                const Shape& sh, float scale, scalar_t* out)
      : q_(q), k_(k_cache), v_(v_cache), tables_(block_tables), sh_(sh), scale_(scale), out_(out) {}

  // `row0`: the sequence's first token row; `context`: its cached positions before the new ones.
  void run(const Task& t, int64_t row0, int64_t context, Workspace& w) const {
    const int64_t G = sh_.group, Dp = sh_.Dp, M = (t.q1 - t.q0) * G, Mp = (M + kW - 1) / kW * kW;
    load_queries(t, row0, M, Mp, w);
    for (int64_t r = 0; r < Mp; ++r) w.pos[r] = r < M ? static_cast<float>(context + t.q0 + r / G) : 1e9f;
    std::fill(w.o.begin(), w.o.begin() + Mp * Dp, 0.f);
    std::fill(w.m.begin(), w.m.begin() + Mp, kMasked);
    std::fill(w.l.begin(), w.l.begin() + Mp, 0.f);
    const int64_t keys = context + t.q1;  // the last row's position + 1: keys past it are masked for all
    for (int64_t k0 = 0; k0 < keys; k0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, keys - k0);
      pack_keys(t, k0, n, w);
      gemm(w.k.data(), Dp, 1, w.qt.data(), Mp, n, Mp, Dp, w.st.data(), Mp, false);  // scores^T [n][Mp]
      softmax_step(k0, n, Mp, k0 + n - 1 > context + t.q0, w);
      gemm(w.st.data(), 1, Mp, w.v.data(), Dp, Mp, Dp, n, w.o.data(), Dp, true);  // o += P V
    }
    store(t, row0, M, w);
  }

 private:
  const scalar_t* row(const scalar_t* cache, const Task& t, int64_t pos) const {
    const int32_t* table = tables_ + t.seq * sh_.max_blocks;
    const int64_t slot = static_cast<int64_t>(table[pos / sh_.block_size]) * sh_.block_size + pos % sh_.block_size;
    return cache + (slot * sh_.kv_heads + t.kv_head) * sh_.D;
  }

  // qt[d][r], rows position-major (r = i * G + query head within the group), scaled; rows past
  // M and dimensions past D are zero.
  void load_queries(const Task& t, int64_t row0, int64_t M, int64_t Mp, Workspace& w) const {
    const int64_t G = sh_.group, Dp = sh_.Dp;
    float buf[512];  // head sizes up to 512
    std::fill(w.qt.begin(), w.qt.begin() + Dp * Mp, 0.f);
    for (int64_t r = 0; r < M; ++r) {
      load_row(q_ + ((row0 + t.q0 + r / G) * sh_.heads + t.kv_head * G + r % G) * sh_.D, sh_.D, Dp, buf);
      for (int64_t d = 0; d < Dp; ++d) w.qt[d * Mp + r] = buf[d] * scale_;
    }
  }

  void pack_keys(const Task& t, int64_t k0, int64_t n, Workspace& w) const {
    const int64_t Dp = sh_.Dp;
    for (int64_t j = 0; j < n; ++j) {
      load_row(row(k_, t, k0 + j), sh_.D, Dp, w.k.data() + j * Dp);
      load_row(row(v_, t, k0 + j), sh_.D, Dp, w.v.data() + j * Dp);
    }
  }

  // Online softmax over this tile's scores (keys x rows), in place: they become the weights P.
  // A vector of rows at a time; rescales their running sums and outputs. `causal`: some key of
  // the tile lies past some row's position.
  void softmax_step(int64_t k0, int64_t n, int64_t Mp, bool causal, Workspace& w) const {
    for (int64_t r0 = 0; r0 < Mp; r0 += kW) {
      const vfloat pos = vload(w.pos.data() + r0), old_max = vload(w.m.data() + r0);
      vfloat top = old_max;
      for (int64_t j = 0; j < n; ++j) {
        float* s = w.st.data() + j * Mp + r0;
        vfloat x = vload(s);
        if (causal) {
          x = pos >= static_cast<float>(k0 + j) ? x : kMasked;
          vstore(s, x);
        }
        top = top > x ? top : x;
      }
      vfloat sum{};
      for (int64_t j = 0; j < n; ++j) {
        float* s = w.st.data() + j * Mp + r0;
        const vfloat p = vexp(vload(s) - top);  // 0 where masked: every row has seen key 0 by now
        vstore(s, p);
        sum += p;
      }
      float rescale[kW];
      vstore(rescale, vexp(old_max - top));  // 0 on the first tile
      vstore(w.l.data() + r0, vload(w.l.data() + r0) * vload(rescale) + sum);
      vstore(w.m.data() + r0, top);
      for (int64_t i = 0; i < kW; ++i) {
        if (rescale[i] == 1.f) continue;
        float* o = w.o.data() + (r0 + i) * sh_.Dp;
        for (int64_t d = 0; d < sh_.Dp; d += kW) vstore(o + d, vload(o + d) * rescale[i]);
      }
    }
  }

  void store(const Task& t, int64_t row0, int64_t M, const Workspace& w) const {
    const int64_t G = sh_.group, Dp = sh_.Dp;
    for (int64_t r = 0; r < M; ++r) {
      const float inv = 1.f / w.l[r];
      scalar_t* dst = out_ + ((row0 + t.q0 + r / G) * sh_.heads + t.kv_head * G + r % G) * sh_.D;
      for (int64_t d = 0; d < sh_.D; ++d) dst[d] = static_cast<scalar_t>(w.o[r * Dp + d] * inv);
    }
  }

  const scalar_t *q_, *k_, *v_;
  const int32_t* tables_;
  Shape sh_;
  float scale_;
  scalar_t* out_;
};

// Every task, the most expensive (most keys) first so that dynamic scheduling ends evenly.
std::vector<Task> make_tasks(const int32_t* starts, const int32_t* seq_lens, int64_t num_seqs, const Shape& sh) {
  const int64_t step = sh.positions_per_task();
  std::vector<std::pair<int64_t, Task>> costed;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b], context = seq_lens[b] - q_len;
    for (int64_t q0 = 0; q0 < q_len; q0 += step)
      for (int64_t h = 0; h < sh.kv_heads; ++h)
        costed.push_back({context + q0, Task{b, h, q0, std::min(q_len, q0 + step)}});
  }
  std::stable_sort(costed.begin(), costed.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<Task> tasks;
  tasks.reserve(costed.size());
  for (const auto& c : costed) tasks.push_back(c.second);
  return tasks;
}

template <typename scalar_t>
void prefill(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_tables,
             const int32_t* starts, const int32_t* seq_lens, int64_t num_seqs, const Shape& sh, float scale,
             scalar_t* out) {
  const std::vector<Task> tasks = make_tasks(starts, seq_lens, num_seqs, sh);
  const PrefillKernel<scalar_t> kernel(q, k_cache, v_cache, block_tables, sh, scale, out);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Workspace w(sh);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const Task& t = tasks[i];
      const int64_t q_len = starts[t.seq + 1] - starts[t.seq];
      kernel.run(t, starts[t.seq] - starts[0], seq_lens[t.seq] - q_len, w);
    }
  }
}

}  // namespace

torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T,H,D], caches [N,BS,KVH,D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 (float16 takes the reference)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  query_start_loc = query_start_loc.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = seq_lens.size(0), H = query.size(1), D = query.size(2), KVH = key_cache.size(2);
  TORCH_CHECK(query_start_loc.size(0) == B + 1, "query_start_loc needs one entry per sequence plus one");
  TORCH_CHECK(H % KVH == 0 && key_cache.size(3) == D && D <= 512, "head shapes do not match the cache");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[B] - starts[0] == query.size(0), "query_start_loc does not cover the query rows");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(starts[b + 1] >= starts[b] && lens[b] >= starts[b + 1] - starts[b] &&
                    (lens[b] + key_cache.size(1) - 1) / key_cache.size(1) <= block_tables.size(1),
                "sequence ", b, ": its new tokens exceed its length or its length its block table");
  const Shape sh{H, KVH, H / KVH, D, (D + kW - 1) / kW * kW, key_cache.size(1), block_tables.size(1)};
  auto out = torch::empty_like(query);
  auto run = [&](auto* typed) {
    using scalar_t = std::remove_pointer_t<decltype(typed)>;
    prefill(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
            block_tables.data_ptr<int32_t>(), starts, lens, B, sh, static_cast<float>(scale),
            out.data_ptr<scalar_t>());
  };
  if (query.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<at::BFloat16*>(nullptr));
  return out;
}

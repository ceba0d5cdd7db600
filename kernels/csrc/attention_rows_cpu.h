// The core of the CPU attention kernels over tiles of query rows: any set of query rows that
// read the same keys (a prefill task's positions x grouped heads, or the decodes of sequences
// sharing a cached prefix) attends to keys read through a block table, a tile at a time, with
// two register-tiled products (tile_gemm_cpu.h) and the softmax online in between, in float32.
// Leaves each row's running max, sum and unnormalized output in `Rows`: callers normalize and
// store (prefill) or carry the state on (the decode kernel continues over the unshared keys).
//
// The products run on float32 (F32Packing), or for bfloat16 on CPUs with AVX-512 BF16 on
// bfloat16 pairs (Bf16DotPacking: half the instructions; the weights P are rounded to bfloat16
// for the second product, as flash attention does). Any head size: rows are zero padded.
#pragma once
#include "tile_gemm_cpu.h"
#include "vec_cpu.h"
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace attention_rows {

constexpr int64_t kTaskRows = 96;  // query rows per task (positions x the query heads of one KV head)
constexpr int64_t kKeyTile = 64;   // keys per step unless a packing says (even: bfloat16 pairs take two keys)
constexpr float kMasked = -1e30f;  // finite "minus infinity": the kernel is built with -ffast-math

struct Shape {
  int64_t heads, kv_heads, group, D, Dp, block_size, max_blocks;  // Dp: D zero padded for the packing
  int64_t window = 0;  // > 0: a row at position p attends to keys (p - window, p] only
  float softcap = 0.f;  // > 0: scaled scores s become softcap * tanh(s / softcap)
  int64_t positions_per_task() const { return std::max<int64_t>(1, kTaskRows / group); }
  int64_t max_rows() const { return (positions_per_task() * group + kW - 1) / kW * kW; }
};

// One head's row of D values as Dp floats (zero padded).
template <typename scalar_t>
inline void load_row(const scalar_t* src, int64_t D, int64_t Dp, float* dst) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (D == Dp) return widen(src, dst, D);
  }
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
}

// float32 products: K and V widened to float32, the scale folded into Q. Q is kept transposed
// (qt[d][r]) and the scores too (keys x rows), so that the softmax runs down columns, a vector of
// rows at a time, and the K and V tiles are plain row copies.
template <typename scalar_t>
struct F32Packing {
  using E = F32Elements;
  static constexpr bool kScaledScores = false;
  static constexpr int64_t kKeys = kKeyTile;
  static int64_t padded_head(int64_t D) { return (D + kW - 1) / kW * kW; }
  // Packed K and V: rows of Dp floats; where key k0 starts in each.
  using KElem = float;
  using VElem = float;
  static int64_t k_offset(int64_t k0, const Shape& sh) { return k0 * sh.Dp; }
  static int64_t v_offset(int64_t k0, const Shape& sh) { return k0 * sh.Dp; }

  struct Buffers {
    std::vector<float> qt, k, v;
    Buffers(const Shape& sh, int64_t keys) : qt(sh.Dp * sh.max_rows()), k(keys * sh.Dp), v(keys * sh.Dp) {}
  };

  template <typename RowFn>
  static void queries(RowFn q_row, int64_t M, int64_t Mp, const Shape& sh, float scale, Buffers& b) {
    float buf[512];  // head sizes up to 512
    std::fill(b.qt.begin(), b.qt.begin() + sh.Dp * Mp, 0.f);
    for (int64_t r = 0; r < M; ++r) {
      load_row(q_row(r), sh.D, sh.Dp, buf);
      for (int64_t d = 0; d < sh.Dp; ++d) b.qt[d * Mp + r] = buf[d] * scale;
    }
  }

  // n keys packed at k and v (a tile's worth: the caller's buffers or a slice of a packed cache).
  template <typename KRow, typename VRow>
  static void keys(KRow k_row, VRow v_row, int64_t n, const Shape& sh, float* k, float* v) {
    for (int64_t j = 0; j < n; ++j) {
      load_row(k_row(j), sh.D, sh.Dp, k + j * sh.Dp);
      load_row(v_row(j), sh.D, sh.Dp, v + j * sh.Dp);
    }
  }

  static void scores(int64_t n, int64_t Mp, const Shape& sh, const float* k, const Buffers& b, float* st) {  // st [n][Mp]
    tile_gemm_product<E>(k, sh.Dp, 1, b.qt.data(), Mp, n, Mp, sh.Dp, st, Mp, false);
  }

  // The weights of keys j and j + 1 (when j + 1 < n) for rows r0.. replace their scores.
  static void store_weights(int64_t j, int64_t n, int64_t r0, int64_t Mp, vfloat p0, vfloat p1, float* st, Buffers&) {
    vstore(st + j * Mp + r0, p0);
    if (j + 1 < n) vstore(st + (j + 1) * Mp + r0, p1);
  }

  static void weighted_values(int64_t n, int64_t Mp, const Shape& sh, const float* p, const float* v, Buffers&,
                              float* o) {
    tile_gemm_product<E>(p, 1, Mp, v, sh.Dp, Mp, sh.Dp, n, o, sh.Dp, true);  // o += P V
  }
};

#if defined(__AVX512BF16__)
// bfloat16 products with vdpbf16ps: every operand in pairs along the reduction. Q as qp[d/2][r]
// (word d/2 of each row: no conversion), K rows as they are (padded to Dp), V with two keys
// interleaved (vp[j/2][d] holds V[j][d], V[j+1][d]), and the weights P rounded to bfloat16 pairs
// the same way, as flash attention does for its second product. The scale is applied to the
// float32 scores (rounding a scaled Q would add an error of its own).
struct Bf16DotPacking {
  using E = Bf16PairElements;
  static constexpr bool kScaledScores = true;
  static constexpr int64_t kKeys = kKeyTile;
  static int64_t padded_head(int64_t D) { return (D + 31) / 32 * 32; }  // whole 32-value vectors
  // Packed K: rows of Dp/2 words; V: pairs of rows, Dp words each (k0 is even).
  using KElem = uint32_t;
  using VElem = uint32_t;
  static int64_t k_offset(int64_t k0, const Shape& sh) { return k0 * sh.Dp / 2; }
  static int64_t v_offset(int64_t k0, const Shape& sh) { return k0 / 2 * sh.Dp; }

  struct Buffers {
    std::vector<uint32_t> qp, k, v, pp;
    Buffers(const Shape& sh, int64_t keys)
        : qp(sh.Dp / 2 * sh.max_rows()), k(keys * sh.Dp / 2), v(keys / 2 * sh.Dp), pp(keys / 2 * sh.max_rows()) {}
  };

  // A row's Dp bfloat16 as bits: in place when D == Dp, else zero padded into `buf`.
  static const uint16_t* padded(const at::BFloat16* src, const Shape& sh, uint16_t* buf) {
    if (sh.D == sh.Dp) return reinterpret_cast<const uint16_t*>(src);
    std::memcpy(buf, src, sh.D * 2);
    std::fill(buf + sh.D, buf + sh.Dp, uint16_t{0});
    return buf;
  }

  // 16-bit lanes gathered by index (0-31 from `a`, 32-63 from `b`): idx[2i] = first + i,
  // idx[2i + 1] = second + i.
  struct PairIndex {
    alignas(64) uint16_t idx[32];
  };
  static constexpr PairIndex pair_index(int first, int second) {
    PairIndex p{};
    for (int i = 0; i < 16; ++i) p.idx[2 * i] = static_cast<uint16_t>(first + i), p.idx[2 * i + 1] = static_cast<uint16_t>(second + i);
    return p;
  }
  template <int First, int Second>
  static __m512i pairs(__m512i a, __m512i b) {
    static constexpr PairIndex kIndex = pair_index(First, Second);
    return _mm512_permutex2var_epi16(a, _mm512_load_si512(kIndex.idx), b);
  }

  template <typename RowFn>
  static void queries(RowFn q_row, int64_t M, int64_t Mp, const Shape& sh, float, Buffers& b) {
    uint16_t buf[512];
    const int64_t words = sh.Dp / 2;
    std::fill(b.qp.begin(), b.qp.begin() + words * Mp, 0u);
    for (int64_t r = 0; r < M; ++r) {
      const uint16_t* row = padded(q_row(r), sh, buf);
      for (int64_t w = 0; w < words; ++w) std::memcpy(&b.qp[w * Mp + r], row + 2 * w, 4);
    }
  }

  template <typename KRow, typename VRow>
  static void keys(KRow k_row, VRow v_row, int64_t n, const Shape& sh, uint32_t* k, uint32_t* v) {
    static const uint16_t zeros[512] = {};
    uint16_t buf0[512], buf1[512];
    for (int64_t j = 0; j < n; ++j) std::memcpy(k + j * sh.Dp / 2, padded(k_row(j), sh, buf0), sh.Dp * 2);
    for (int64_t j = 0; j < n; j += 2) {  // an odd tile's last pair takes a zero row: never garbage
      const uint16_t* v0 = padded(v_row(j), sh, buf0);
      const uint16_t* v1 = j + 1 < n ? padded(v_row(j + 1), sh, buf1) : zeros;
      uint32_t* dst = v + j / 2 * sh.Dp;
      for (int64_t d = 0; d < sh.Dp; d += 32) {
        const __m512i x = _mm512_loadu_si512(v0 + d), y = _mm512_loadu_si512(v1 + d);
        _mm512_storeu_si512(dst + d, pairs<0, 32>(x, y));        // V[j][d + i], V[j + 1][d + i], i < 16
        _mm512_storeu_si512(dst + d + 16, pairs<16, 48>(x, y));  // the same for 16 <= i < 32
      }
    }
  }

  static void scores(int64_t n, int64_t Mp, const Shape& sh, const uint32_t* k, const Buffers& b, float* st) {
    tile_gemm_product<E>(k, sh.Dp / 2, 1, b.qp.data(), Mp, n, Mp, sh.Dp / 2, st, Mp, false);
  }

  // The weights of keys j and j + 1 for rows r0.. as bfloat16 pairs (pp[j/2][r]), straight from
  // the softmax: the float32 weights are never stored.
  static void store_weights(int64_t j, int64_t, int64_t r0, int64_t Mp, vfloat p0, vfloat p1, float*, Buffers& b) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0);  // 16-bit lanes: p0's, then p1's
    _mm512_storeu_si512(&b.pp[j / 2 * Mp + r0], pairs<0, 16>(both, both));
  }

  static void weighted_values(int64_t n, int64_t Mp, const Shape& sh, const float*, const uint32_t* v, Buffers& b,
                              float* o) {
    tile_gemm_product<E>(b.pp.data(), 1, Mp, v, sh.Dp, Mp, sh.Dp, (n + 1) / 2, o, sh.Dp, true);
  }
};
#endif

// The softmax state of a task's rows: scores (keys x rows), running max and sum, output, and
// each row's position.
struct Rows {
  std::vector<float> st, o, m, l, pos;
  Rows(const Shape& sh, int64_t keys)
      : st(keys * sh.max_rows()), o(sh.max_rows() * sh.Dp), m(sh.max_rows()), l(sh.max_rows()),
        pos(sh.max_rows()) {}
};

template <typename Pack>
struct Workspace {  // a thread's (~100 KiB at head size 64: L2-resident)
  Rows rows;
  typename Pack::Buffers buffers;
  explicit Workspace(const Shape& sh) : rows(sh, Pack::kKeys), buffers(sh, Pack::kKeys) {}
};

// Online softmax over one tile's scores (keys x rows), a vector of rows at a time: the weights P
// go to Pack::store_weights, the running sums and outputs are rescaled. Two passes: the max of
// the raw scores, then P = e^(scale * s - max) two keys at a time (the bfloat16 packing stores
// them as pairs). `causal`: some key of the tile lies past some row's position, and is masked;
// `window` > 0: keys at or before a row's position minus `window` are masked too. A row that has
// seen only masked keys so far weighs them 1 against a max of kMasked; its first real key rescales
// that to 0 (e^(kMasked - max)), and every row reaches its own position. `softcap` > 0: the scaled
// scores are capped (before masking: a capped mask would be finite).
template <typename Pack>
void softmax_step(int64_t k0, int64_t n, int64_t Mp, int64_t Dp, bool causal, int64_t window, float softcap,
                  float scale, Rows& w, typename Pack::Buffers& b) {
  for (int64_t r0 = 0; r0 < Mp; r0 += kW) {
    const vfloat pos = vload(w.pos.data() + r0), old_max = vload(w.m.data() + r0);
    const vfloat lowest = pos - static_cast<float>(window);  // keys at or below it fall outside the window
    auto score = [&](int64_t j) {  // scaled (and capped), masked
      vfloat x = vload(w.st.data() + j * Mp + r0) * scale;
      if (softcap > 0.f) x = vsoftcap(x, softcap);
      const float key = static_cast<float>(k0 + j);
      const vfloat y = causal ? (pos >= key ? x : kMasked) : x;
      return window > 0 ? (lowest < key ? y : kMasked) : y;
    };
    auto vmax = [](vfloat a, vfloat b) { return a > b ? a : b; };
    // Four running maxima: one would wait out vmaxps's latency at every key (20% of the AMX
    // kernel's time).
    vfloat tops[4] = {score(0), score(0), score(0), score(0)};
    int64_t key = 1;
    for (; key + 4 <= n; key += 4)
      for (int u = 0; u < 4; ++u) tops[u] = vmax(tops[u], score(key + u));
    for (; key < n; ++key) tops[0] = vmax(tops[0], score(key));
    const vfloat tile_top = vmax(vmax(tops[0], tops[1]), vmax(tops[2], tops[3]));
    const vfloat top = old_max > tile_top ? old_max : tile_top;
    vfloat sum{};
    for (int64_t j = 0; j < n; j += 2) {  // 0 where masked: every row has seen key 0 by now
      const vfloat p0 = vexp(score(j) - top);
      const vfloat p1 = j + 1 < n ? vexp(score(j + 1) - top) : vfloat{};
      sum += p0 + p1;
      Pack::store_weights(j, n, r0, Mp, p0, p1, w.st.data(), b);
    }
    float rescale[kW];
    vstore(rescale, vexp(old_max - top));  // 0 on the first tile
    vstore(w.l.data() + r0, vload(w.l.data() + r0) * vload(rescale) + sum);
    vstore(w.m.data() + r0, top);
    for (int64_t i = 0; i < kW; ++i) {
      if (rescale[i] == 1.f) continue;
      float* o = w.o.data() + (r0 + i) * Dp;
      for (int64_t d = 0; d < Dp; d += kW) vstore(o + d, vload(o + d) * rescale[i]);
    }
  }
}

// The row of position `pos` of a KV head in a cache, through a sequence's block table.
template <typename scalar_t>
inline const scalar_t* cache_row(const scalar_t* cache, const int32_t* table, int64_t pos, int64_t kv_head,
                                 const Shape& sh) {
  const int64_t slot = static_cast<int64_t>(table[pos / sh.block_size]) * sh.block_size + pos % sh.block_size;
  return cache + (slot * sh.kv_heads + kv_head) * sh.D;
}

// The first key of the first tile a row at `min_pos` (or any later row) reads: 0 without a window.
template <typename Pack>
inline int64_t first_tile(int64_t min_pos, const Shape& sh) {
  if (sh.window <= 0) return 0;
  return std::max<int64_t>(0, min_pos - sh.window + 1) / Pack::kKeys * Pack::kKeys;
}

// Rows [0, M) (positions in rows.pos, filled by the caller; the smallest is `min_pos`) attend
// to keys [0, keys): q_row(r) gives a head row, tile(k0, n) the packed K and V of keys
// [k0, k0 + n) as a pair of pointers. Keys past a row's position are masked; tiles past every
// row's position are the caller's to leave out (`keys`). With a sliding window (sh.window) the
// tiles wholly before the smallest row's window are never visited.
template <typename Pack, typename QRow, typename TileFn>
void attend_tiles(QRow q_row, int64_t M, TileFn tile, int64_t keys, int64_t min_pos, const Shape& sh, float scale,
                  Workspace<Pack>& w) {
  const int64_t Dp = sh.Dp, Mp = (M + kW - 1) / kW * kW;
  Rows& rows = w.rows;
  Pack::queries(q_row, M, Mp, sh, scale, w.buffers);
  for (int64_t r = M; r < Mp; ++r) rows.pos[r] = 1e9f;
  std::fill(rows.o.begin(), rows.o.begin() + Mp * Dp, 0.f);
  std::fill(rows.m.begin(), rows.m.begin() + Mp, kMasked);
  std::fill(rows.l.begin(), rows.l.begin() + Mp, 0.f);
  const float score_scale = Pack::kScaledScores ? scale : 1.f;
  for (int64_t k0 = first_tile<Pack>(min_pos, sh); k0 < keys; k0 += Pack::kKeys) {
    const int64_t n = std::min(Pack::kKeys, keys - k0);
    const auto [k, v] = tile(k0, n);
    Pack::scores(n, Mp, sh, k, w.buffers, rows.st.data());
    softmax_step<Pack>(k0, n, Mp, Dp, k0 + n - 1 > min_pos, sh.window, sh.softcap, score_scale, rows, w.buffers);
    Pack::weighted_values(n, Mp, sh, rows.st.data(), v, w.buffers, rows.o.data());
  }
}

// attend_tiles with each tile packed into the workspace as it is reached, from k_row(j) and
// v_row(j), the head rows of key j.
template <typename Pack, typename QRow, typename KRow, typename VRow>
void attend_rows(QRow q_row, int64_t M, KRow k_row, VRow v_row, int64_t keys, int64_t min_pos, const Shape& sh,
                 float scale, Workspace<Pack>& w) {
  auto& b = w.buffers;
  auto tile = [&](int64_t k0, int64_t n) {
    Pack::keys([&](int64_t j) { return k_row(k0 + j); }, [&](int64_t j) { return v_row(k0 + j); }, n, sh, b.k.data(),
               b.v.data());
    return std::pair<const typename Pack::KElem*, const typename Pack::VElem*>(b.k.data(), b.v.data());
  };
  attend_tiles<Pack>(q_row, M, tile, keys, min_pos, sh, scale, w);
}

// fn(i, workspace) for every task i < num_tasks, on all threads, each with its own workspace.
// Dynamic scheduling: tasks differ in cost (callers order them most expensive first).
template <typename Pack, typename Fn>
void for_each_task(int64_t num_tasks, const Shape& sh, Fn&& fn) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Workspace<Pack> w(sh);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) fn(i, w);
  }
}

}  // namespace attention_rows

// Paged prefill (and extend) attention for CPUs: each sequence's new tokens attend causally to
// its cached context and to each other, K/V read through the block table. Defined by
// `paged_prefill_attention_ref` (kernels/paged_attention.py).
//
// A task is one sequence, one KV head and kTaskRows query rows: consecutive positions x the
// query heads that share the KV head (no K/V copy per query head, as the fused ATen kernel
// needs), attended by attention_rows_cpu.h's flash-attention tiles. Key tiles past a task's last
// position are never visited (causal), so a prompt costs half its square; a short extend over a
// long context is a few rows over many keys and needs no padding or mask.
#include "cpu_ops.h"
#include "attention_rows_cpu.h"
#include "amx_packing_cpu.h"
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

using namespace attention_rows;

// A task: one sequence, one KV head, query positions [q0, q1) of its new tokens.
struct Task {
  int64_t seq, kv_head, q0, q1;
};

// The K and V of the (sequence, KV head) pairs that several tasks read (prompts longer than one
// task's positions), packed once for all of them instead of again by every task (11-16% of the
// kernel's time on 1,000-1,500-token prompts), in whole tiles: rows past a sequence's end are
// zeros. A sequence read by one task per head packs its tiles as it goes (packing it up front
// would write and read it all once more: 2.9 -> 7.9 ms for 32 x 24 new tokens over 200).
template <typename Pack>
class PackedKV {
 public:
  template <typename scalar_t>
  PackedKV(const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* tables, const int32_t* starts,
           const int32_t* seq_lens, int64_t num_seqs, const Shape& sh)
      : k_start_(num_seqs * sh.kv_heads, -1), v_start_(num_seqs * sh.kv_heads, -1) {
    std::vector<std::array<int64_t, 3>> tiles;  // (sequence, KV head, first key)
    int64_t k_size = 0, v_size = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
      if (starts[b + 1] - starts[b] <= sh.positions_per_task()) continue;
      for (int64_t h = 0; h < sh.kv_heads; ++h) {
        const int64_t keys = (seq_lens[b] + Pack::kKeys - 1) / Pack::kKeys * Pack::kKeys;
        k_start_[b * sh.kv_heads + h] = k_size;
        v_start_[b * sh.kv_heads + h] = v_size;
        k_size += Pack::k_offset(keys, sh);
        v_size += Pack::v_offset(keys, sh);
        // From the first tile any of its new tokens reads (a sliding window skips the rest).
        const int64_t context = seq_lens[b] - (starts[b + 1] - starts[b]);
        for (int64_t k0 = first_tile<Pack>(context, sh); k0 < seq_lens[b]; k0 += Pack::kKeys)
          tiles.push_back({b, h, k0});
      }
    }
    k_ = buffer<typename Pack::KElem, 0>(k_size, own_k_);
    v_ = buffer<typename Pack::VElem, 1>(v_size, own_v_);
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto [b, h, k0] = tiles[i];
        const int64_t n = std::min<int64_t>(Pack::kKeys, seq_lens[b] - k0);
        const int32_t* table = tables + b * sh.max_blocks;
        auto* kt = k_ + k_start_[b * sh.kv_heads + h] + Pack::k_offset(k0, sh);
        auto* vt = v_ + v_start_[b * sh.kv_heads + h] + Pack::v_offset(k0, sh);
        if (n < Pack::kKeys) {  // a sequence's last tile: zeros past its end
          std::fill(kt, kt + Pack::k_offset(Pack::kKeys, sh), typename Pack::KElem{});
          std::fill(vt, vt + Pack::v_offset(Pack::kKeys, sh), typename Pack::VElem{});
        }
        Pack::keys([&](int64_t j) { return cache_row(k_cache, table, k0 + j, h, sh); },
                   [&](int64_t j) { return cache_row(v_cache, table, k0 + j, h, sh); }, n, sh, kt, vt);
      }
    });
  }

  bool packed(int64_t seq, int64_t kv_head, const Shape& sh) const { return k_start_[seq * sh.kv_heads + kv_head] >= 0; }

  // The packed K and V from key k0 of a packed sequence's KV head.
  std::pair<const typename Pack::KElem*, const typename Pack::VElem*> tile(int64_t seq, int64_t kv_head, int64_t k0,
                                                                           const Shape& sh) const {
    const int64_t i = seq * sh.kv_heads + kv_head;
    return {k_ + k_start_[i] + Pack::k_offset(k0, sh), v_ + v_start_[i] + Pack::v_offset(k0, sh)};
  }

 private:
  // At least n elements: the calling thread's buffer, kept between calls, up to 64 MiB (fresh
  // pages cost a fault each: ~6% of a 1,450-token prompt's attention); above that `own`, freed
  // with this object.
  template <typename T, int Which>
  static T* buffer(int64_t n, std::vector<T>& own) {
    if (n * static_cast<int64_t>(sizeof(T)) > (int64_t{64} << 20)) {
      own.resize(n);
      return own.data();
    }
    thread_local std::vector<T> kept;
    if (static_cast<int64_t>(kept.size()) < n) kept.resize(n);
    return kept.data();
  }

  std::vector<typename Pack::KElem> own_k_;
  std::vector<typename Pack::VElem> own_v_;
  typename Pack::KElem* k_ = nullptr;
  typename Pack::VElem* v_ = nullptr;
  std::vector<int64_t> k_start_, v_start_;  // per (sequence, KV head); -1: not packed
};

template <typename scalar_t, typename Pack>
class PrefillKernel {
 public:
  // `q_stride`: elements from one token's query row to the next (a view of the fused QKV
  // projection's output is read in place); `out` is dense [tokens, heads, D].
  PrefillKernel(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                const int32_t* block_tables, const PackedKV<Pack>& kv, const Shape& sh, float scale, scalar_t* out)
      : q_(q), q_stride_(q_stride), k_(k_cache), v_(v_cache), tables_(block_tables), kv_(kv), sh_(sh),
        scale_(scale), out_(out) {}

  // `row0`: the sequence's first token row; `context`: its cached positions before the new ones.
  void run(const Task& t, int64_t row0, int64_t context, Workspace<Pack>& w) const {
    const int64_t G = sh_.group, M = (t.q1 - t.q0) * G;
    for (int64_t r = 0; r < M; ++r) w.rows.pos[r] = static_cast<float>(context + t.q0 + r / G);
    auto q_row = [&](int64_t r) { return query_row(q_, q_stride_, t, row0, r); };
    const int64_t keys = context + t.q1;  // the last row's position + 1: keys past it are masked for all
    if (kv_.packed(t.seq, t.kv_head, sh_)) {
      attend_tiles<Pack>(q_row, M, [&](int64_t k0, int64_t) { return kv_.tile(t.seq, t.kv_head, k0, sh_); }, keys,
                         context + t.q0, sh_, scale_, w);
    } else {
      const int32_t* table = tables_ + t.seq * sh_.max_blocks;
      attend_rows<Pack>(q_row, M, [&](int64_t j) { return cache_row(k_, table, j, t.kv_head, sh_); },
                        [&](int64_t j) { return cache_row(v_, table, j, t.kv_head, sh_); }, keys, context + t.q0,
                        sh_, scale_, w);
    }
    store(t, row0, M, w.rows);
  }

 private:
  // Rows are position-major: r = i * G + query head within the group.
  template <typename T>
  T* query_row(T* base, int64_t token_stride, const Task& t, int64_t row0, int64_t r) const {
    return base + (row0 + t.q0 + r / sh_.group) * token_stride + (t.kv_head * sh_.group + r % sh_.group) * sh_.D;
  }

  void store(const Task& t, int64_t row0, int64_t M, const Rows& w) const {
    for (int64_t r = 0; r < M; ++r) {
      const float inv = 1.f / w.l[r];
      const float* o = w.o.data() + r * sh_.Dp;
      scalar_t* dst = query_row(out_, sh_.heads * sh_.D, t, row0, r);
      for (int64_t d = 0; d < sh_.D; ++d) dst[d] = static_cast<scalar_t>(o[d] * inv);
    }
  }

  const scalar_t* q_;
  int64_t q_stride_;
  const scalar_t *k_, *v_;
  const int32_t* tables_;
  const PackedKV<Pack>& kv_;
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

template <typename scalar_t, typename Pack>
void prefill(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
             const int32_t* block_tables, const int32_t* starts, const int32_t* seq_lens, int64_t num_seqs, Shape sh,
             float scale, scalar_t* out) {
  sh.Dp = Pack::padded_head(sh.D);
  const std::vector<Task> tasks = make_tasks(starts, seq_lens, num_seqs, sh);
  const PackedKV<Pack> kv(k_cache, v_cache, block_tables, starts, seq_lens, num_seqs, sh);
  const PrefillKernel<scalar_t, Pack> kernel(q, q_stride, k_cache, v_cache, block_tables, kv, sh, scale, out);
  for_each_task<Pack>(static_cast<int64_t>(tasks.size()), sh, [&](int64_t i, Workspace<Pack>& w) {
    const Task& t = tasks[i];
    const int64_t q_len = starts[t.seq + 1] - starts[t.seq];
    kernel.run(t, starts[t.seq] - starts[0], seq_lens[t.seq] - q_len, w);
  });
}

}  // namespace

namespace attention_rows {
Products parse_products(const std::string& name) {
  if (name == "auto") return Products::kAuto;
  if (name == "float32") return Products::kFloat32;
  if (name == "bf16_dot") return Products::kBf16Dot;
  if (name == "amx") return Products::kAmx;
  TORCH_CHECK(false, "products: auto, float32, bf16_dot or amx, not ", name);
}
}  // namespace attention_rows

std::vector<std::string> prefill_products(torch::ScalarType dtype) {
  std::vector<std::string> names;
  for (const char* name : {"float32", "bf16_dot", "amx"})
    if (attention_rows::has_products(attention_rows::parse_products(name), dtype == at::kBFloat16))
      names.push_back(name);
  return names;
}

torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor seq_lens, double scale, const std::string& products,
                                      std::optional<torch::Tensor> out, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T,H,D], caches [N,BS,KVH,D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 (float16 takes the reference)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  // Heads dense within a token's row; the rows themselves may be strided (a view of the fused
  // QKV output, read in place instead of copied: 6 MB a layer at 2,048 tokens).
  if (query.stride(2) != 1 || query.stride(1) != query.size(2)) query = query.contiguous();
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
  const Shape sh{H, KVH, H / KVH, D, 0, key_cache.size(1), block_tables.size(1), std::max<int64_t>(0, window),
                 static_cast<float>(softcap)};
  const attention_rows::Products choice = attention_rows::parse_products(products);
  if (out) {
    TORCH_CHECK(out->is_contiguous() && out->sizes() == query.sizes() && out->scalar_type() == query.scalar_type(),
                "out must be a contiguous tensor of the query's shape and dtype");
  } else {
    out = torch::empty(query.sizes(), query.options());
  }
  auto run = [&](auto* typed) {
    using scalar_t = std::remove_pointer_t<decltype(typed)>;
    with_packing<scalar_t>(choice, [&](auto* pack) {
      prefill<scalar_t, std::remove_pointer_t<decltype(pack)>>(
          query.data_ptr<scalar_t>(), query.stride(0), key_cache.data_ptr<scalar_t>(),
          value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(), starts, lens, B, sh,
          static_cast<float>(scale), out->data_ptr<scalar_t>());
    });
  };
  if (query.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<at::BFloat16*>(nullptr));
  return *out;
}

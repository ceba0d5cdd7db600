// Decode attention over shared cached prefixes: see decode_shared_prefix_cpu.h.
#include "decode_shared_prefix_cpu.h"

#include "attention_rows_cpu.h"
#include "amx_packing_cpu.h"

#include <algorithm>
#include <map>

using namespace attention_rows;

std::vector<PrefixGroup> find_prefix_groups(const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                                            int64_t max_blocks, int64_t block_size) {
  std::map<int32_t, std::vector<int64_t>> by_first_block;  // ordered: the same groups on every call
  for (int64_t b = 0; b < num_seqs; ++b)
    if (seq_lens[b] >= block_size) by_first_block[block_tables[b * max_blocks]].push_back(b);
  std::vector<PrefixGroup> groups;
  for (auto& [first, members] : by_first_block) {
    if (members.size() < 2) continue;
    int64_t full = max_blocks;  // blocks every member has filled
    for (const int64_t b : members) full = std::min<int64_t>(full, seq_lens[b] / block_size);
    const int32_t* lead = block_tables + members[0] * max_blocks;
    int64_t blocks = 1;
    for (; blocks < full; ++blocks) {
      const bool same = std::all_of(members.begin(), members.end(), [&](int64_t b) {
        return block_tables[b * max_blocks + blocks] == lead[blocks];
      });
      if (!same) break;
    }
    groups.push_back({std::move(members), blocks});
  }
  return groups;
}

namespace {

// A task: one KV head's query rows of `count` members of a group, from member `first` on.
struct SharedTask {
  const PrefixGroup* group;
  int64_t first, count, kv_head;
};

template <typename scalar_t, typename Pack>
void attend_groups(const std::vector<PrefixGroup>& groups, const scalar_t* q, const scalar_t* k_cache,
                   const scalar_t* v_cache, const int32_t* block_tables, Shape sh, float scale, PrefixStates& states) {
  sh.Dp = Pack::padded_head(sh.D);
  const int64_t G = sh.group, per_task = sh.positions_per_task(), H = sh.heads, D = sh.D;
  std::vector<SharedTask> tasks;
  for (const PrefixGroup& g : groups)
    for (int64_t first = 0; first < static_cast<int64_t>(g.members.size()); first += per_task)
      for (int64_t h = 0; h < sh.kv_heads; ++h)
        tasks.push_back({&g, first, std::min<int64_t>(per_task, g.members.size() - first), h});
  for_each_task<Pack>(static_cast<int64_t>(tasks.size()), sh, [&](int64_t i, Workspace<Pack>& w) {
    const SharedTask& t = tasks[i];
    const int64_t* members = t.group->members.data() + t.first;
    const int32_t* table = block_tables + members[0] * sh.max_blocks;
    const int64_t M = t.count * G;
    // Row r: member r / G, query head kv_head * G + r % G. Every shared key precedes every
    // decode position: nothing is masked.
    auto head_of = [&](int64_t r) { return members[r / G] * H + t.kv_head * G + r % G; };
    for (int64_t r = 0; r < M; ++r) w.rows.pos[r] = 1e9f;
    attend_rows<Pack>([&](int64_t r) { return q + head_of(r) * D; }, M,
                      [&](int64_t j) { return cache_row(k_cache, table, j, t.kv_head, sh); },
                      [&](int64_t j) { return cache_row(v_cache, table, j, t.kv_head, sh); },
                      t.group->blocks * sh.block_size, INT64_MAX, sh, scale, w);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t at = head_of(r);
      states.m[at] = w.rows.m[r];
      states.l[at] = w.rows.l[r];
      std::copy_n(w.rows.o.data() + r * sh.Dp, D, states.acc.data() + at * D);
    }
  });
}

}  // namespace

template <typename scalar_t>
PrefixStates attend_shared_prefixes(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                                    const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                                    int64_t heads, int64_t kv_heads, int64_t head_size, int64_t block_size,
                                    int64_t max_blocks, float scale) {
  PrefixStates states;
  states.start.assign(num_seqs, 0);
  const std::vector<PrefixGroup> groups = find_prefix_groups(block_tables, seq_lens, num_seqs, max_blocks, block_size);
  if (groups.empty()) return states;
  states.m.resize(num_seqs * heads);
  states.l.resize(num_seqs * heads);
  states.acc.resize(num_seqs * heads * head_size);
  for (const PrefixGroup& g : groups)
    for (const int64_t b : g.members) states.start[b] = g.blocks * block_size;
  const Shape sh{heads, kv_heads, heads / kv_heads, head_size, 0, block_size, max_blocks};
  with_packing<scalar_t>(Products::kAuto, [&](auto* pack) {
    attend_groups<scalar_t, std::remove_pointer_t<decltype(pack)>>(groups, q, k_cache, v_cache, block_tables, sh,
                                                                   scale, states);
  });
  return states;
}

template PrefixStates attend_shared_prefixes<float>(const float*, const float*, const float*, const int32_t*,
                                                    const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                    int64_t, float);
template PrefixStates attend_shared_prefixes<at::BFloat16>(const at::BFloat16*, const at::BFloat16*,
                                                           const at::BFloat16*, const int32_t*, const int32_t*,
                                                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                           float);

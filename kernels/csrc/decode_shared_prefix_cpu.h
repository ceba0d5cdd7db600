// Decode attention over a shared cached prefix, the first half of the CPU decode kernel
// (paged_decode_cpu.cpp). Sequences whose block tables start with the same physical blocks (a
// prefix-cache hit: a system prompt, a shared document, forked beams) read the same keys there.
// Per sequence that is a dot product per head and position, read again for every sequence;
// together it is one product of all their query rows with those keys: attention_rows_cpu.h's
// tiles, at several times the per-sequence rate, with each key row read once for the group.
//
// The result is each (sequence, head)'s online-softmax state over the shared positions (running
// max, sum and unnormalized output): the decode kernel carries it on over the rest of the
// sequence, so every output is still softmax over all of its positions.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

// Sequences sharing their first `blocks` physical blocks (all full, all before every member's
// last position): at least two members.
struct PrefixGroup {
  std::vector<int64_t> members;
  int64_t blocks;
};

std::vector<PrefixGroup> find_prefix_groups(const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                                            int64_t max_blocks, int64_t block_size);

// Per (sequence, query head): the state after the shared positions; `start[b]` is where the
// decode kernel continues (0 outside every group, whose state it starts itself).
struct PrefixStates {
  std::vector<int64_t> start;
  std::vector<float> m, l, acc;  // [B * H], [B * H], [B * H * D]
};

template <typename scalar_t>
PrefixStates attend_shared_prefixes(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                                    const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                                    int64_t heads, int64_t kv_heads, int64_t head_size, int64_t block_size,
                                    int64_t max_blocks, float scale);

// The CPU kernels (decode attention in any float type; the rest float32 and bfloat16). Each is
// defined by a torch reference in kernels/.
#pragma once
#include <torch/extension.h>

#include <optional>

// kernels/paged_attention.py: paged_decode_attention_ref (`window` > 0: each sequence's last
// `window` positions only, none before them read; `softcap` > 0: capped scores). An fp8 e4m3
// cache (kernels/fp8.py) is read as `value * k_scale` / `value * v_scale`.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap, double k_scale, double v_scale);
// The groups of sequences whose decodes the kernel above attends together over their shared
// leading blocks (decode_shared_prefix_cpu.h): (members, shared blocks) each
std::vector<std::pair<std::vector<int64_t>, int64_t>> decode_prefix_groups(torch::Tensor block_tables,
                                                                           torch::Tensor seq_lens, int64_t block_size);
// kernels/paged_attention.py: paged_prefill_attention_ref (float32 and bfloat16). `products`:
// what the tiles multiply on (amx_packing_cpu.h): "auto" (the fastest here), "float32"
// (register tiles, any CPU), "bf16_dot" (vdpbf16ps, AVX-512 BF16), "amx" (tile matrix unit).
// `query`'s token rows may be strided; written into `out` (dense, the query's shape) when given.
// `window` > 0: sliding-window attention (key tiles before every row's window are not read);
// `softcap` > 0: capped scores
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor seq_lens, double scale, const std::string& products,
                                      std::optional<torch::Tensor> out, int64_t window, double softcap);
// The `products` this CPU runs for a dtype, besides "auto"
std::vector<std::string> prefill_products(torch::ScalarType dtype);
// kernels/rms_norm.py: rms_norm_ref(x, weight, eps)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
// kernels/rms_norm.py: rms_norm_ref(x, weight, eps, residual), in place: residual <- x + residual,
// x <- norm(residual)
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
// kernels/rotary.py: rotary_embedding_ref, in place on query and key (rows may be strided views)
void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                      torch::Tensor cos_sin_cache, int64_t head_size);
// kernels/activation.py: silu_and_mul_ref
torch::Tensor silu_and_mul(torch::Tensor x);
// kernels/cache_ops.py: reshape_and_cache_ref, any dtype (rows are copied bytewise)
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                       torch::Tensor slot_mapping);
// kernels/grouped_gemm.py: grouped_mm_ref (any float dtype; b may be a transposed view)
torch::Tensor grouped_mm_rows(torch::Tensor a, torch::Tensor b, torch::Tensor offs);
// kernels/grouped_gemm.py: moe_experts_ref (float32; bfloat16 where moe_experts_runs): the rows of x
// picked by `rows` (int64, sorted by expert, `offs` [E] their running counts) through each expert's
// gate/up, SiLU-mul and down, w13 and w2 packed by pack_experts. Returns [pairs, hidden] in x's dtype
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor rows, torch::Tensor offs, torch::Tensor w13,
                          torch::Tensor w2);
bool moe_experts_runs(torch::ScalarType dtype);
// kernels/grouped_gemm.py: moe_layer_ref: the whole experts' part of a layer, from each token's
// expert ids and weights ([tokens, k]) to the weighted sum of its experts' outputs, in x's dtype
torch::Tensor moe_layer(torch::Tensor x, torch::Tensor weights, torch::Tensor experts, torch::Tensor w13,
                        torch::Tensor w2);
// kernels/argmax.py: argmax_ref (float32 and bfloat16 rows)
torch::Tensor argmax_rows(torch::Tensor logits);
// kernels/nucleus.py: nucleus_threshold_ref (float32 weights, contiguous rows)
torch::Tensor nucleus_threshold_rows(torch::Tensor weights, torch::Tensor limit);
// kernels/nucleus.py: nucleus_weights_ref (float32 logits, contiguous rows; rules [rows] each)
torch::Tensor nucleus_weights_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_p,
                                   torch::Tensor min_p);
// kernels/int8_gemm.py: int8_linear_ref, x rounded to int16 per row (int8_linear_kernel_arith_ref);
// `packed` in pack_int8_weight's layout, `scale` float32 [out_features]
// Whether int8_linear runs x on the tile unit (AMX, bfloat16 x of 16+ rows and an even width): there x
// is not rounded to int16 (int8_linear_ref's arithmetic, sums in float32).
bool int8_linear_tile_unit(torch::Tensor x);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, std::optional<torch::Tensor> bias,
                          int64_t out_features);
// kernels/lora.py: lora_delta_ref, added into y in place (float32 sums, rounded once into y's
// dtype): y[start:end] += x[start:end] a_t[slot] b_t[slot] for each row of `runs` [n, 3] int64
// (slot, start, end). x, y float32 or bfloat16 alike; a_t [S, in, K], b_t [S, K, out] float32. Part
// p of slot s reads the rank columns spans[s][p] = [lo, hi) ([S, P, 2] int64) and writes the output
// columns [part_cols[p], part_cols[p + 1]); b_t must be zero outside those blocks
void lora_add_runs(torch::Tensor x, torch::Tensor y, torch::Tensor a_t, torch::Tensor b_t, torch::Tensor runs,
                   torch::Tensor spans, torch::Tensor part_cols);

// One Python module for every CPU kernel in this folder; each is defined by the torch reference
// named beside its declaration in cpu_ops.h.
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("decode_prefix_groups", &decode_prefix_groups, "sequences the decode kernel attends together (CPU)");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged prefill/extend attention (CPU)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("products") = "auto",
        py::arg("out") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("prefill_products", &prefill_products, "the prefill products this CPU runs for a dtype");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm, in place (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "NeoX-style rotary embedding, in place (CPU)");
  m.def("reshape_and_cache", &reshape_and_cache, "K/V rows into their cache slots (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("grouped_mm_rows", &grouped_mm_rows, "a mixture-of-experts grouped product, experts over threads (CPU)");
  m.def("moe_experts", &moe_experts, "a mixture-of-experts layer's experts, gate/up + SiLU-mul + down, packed weights (CPU)");
  m.def("moe_experts_runs", &moe_experts_runs, "whether moe_experts runs a dtype on this CPU");
  m.def("moe_layer", &moe_layer, "a mixture-of-experts layer's experts from the router's choices, one call (CPU)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (CPU)");
  m.def("int8_linear", &int8_linear, "weight-only int8 linear layer (CPU, AVX-512 VNNI)", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("bias"), py::arg("out_features"));
  m.def("int8_linear_tile_unit", &int8_linear_tile_unit, "whether int8_linear runs this x on AMX (CPU)");
  m.def("lora_add_runs", &lora_add_runs, "multi-LoRA shrink and expand of every run of rows, into y (CPU)",
        py::arg("x"), py::arg("y"), py::arg("a_t"), py::arg("b_t"), py::arg("runs"), py::arg("spans"),
        py::arg("part_cols"));
  m.def("nucleus_threshold_rows", &nucleus_threshold_rows, "top-p's cut of each whole row, unsorted (CPU)");
  m.def("nucleus_weights_rows", &nucleus_weights_rows, "whole sampling rows: temperature, min-p, top-p (CPU)");
}

// Registers the CPU ops as torch.ops.vllm_pp.* and makes the library importable as the Python
// module vllm._C: importing it runs the static registrations below. No pybind11, which keeps
// the build short.

#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(vllm_pp, m) {
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor context_lens, float scale, "
      "int sliding_window=0, float soft_cap=0.0) -> ()");
  m.def(
      "write_to_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
      "Tensor cos_cache, Tensor sin_cache) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "sample_from_logits(Tensor logits, Tensor draw_rows, Tensor uniforms, Tensor(a!) tokens, "
      "Tensor(b!) argmax, Tensor(c!) lse) -> ()");
  m.def(
      "prefill_attention_paged(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_table, int context_len, float scale) -> ()");
  m.def("linear_panels(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor weight, int type) -> ()");
  m.def("gguf_linear_panels(Tensor(a!) out, Tensor x, Tensor weight, int type) -> ()");
  m.def("gguf_dequantize(Tensor(a!) out, Tensor weight, int type) -> ()");
  m.def("gguf_linear_q8(Tensor(a!) out, Tensor x, Tensor weight, int type) -> ()");
  m.def("gguf_quantize_q8(Tensor(a!) q, Tensor(b!) scales, Tensor x) -> ()");
  m.def(
      "lora_apply(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b_t, Tensor tokens, "
      "Tensor slots, Tensor scale, Tensor ranks, int[] slice_offsets) -> ()");
  m.def(
      "decode_layer_gguf(Tensor(a!) hidden, Tensor(b!) residual, bool first, Tensor in_norm, "
      "float in_eps, Tensor post_norm, float post_eps, Tensor qkv_w, Tensor o_w, "
      "Tensor gate_up_w, Tensor down_w, int[] qtypes, int[] int8, Tensor positions, "
      "Tensor cos_cache, Tensor sin_cache, int num_heads, int num_kv_heads, int head_size, "
      "Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, float scale, int sliding_window, float soft_cap) -> Tensor");
  // No tensor arguments, so these cannot dispatch on a device: register them for all.
  m.def("cpu_isa() -> str", &vllm_pp::cpu_isa);
  m.def("set_cpu_isa(str isa) -> ()", &vllm_pp::set_cpu_isa);
}

TORCH_LIBRARY_IMPL(vllm_pp, CPU, m) {
  m.impl("paged_attention_decode", &vllm_pp::paged_attention_decode);
  m.impl("write_to_kv_cache", &vllm_pp::write_to_kv_cache);
  m.impl("rms_norm", &vllm_pp::rms_norm);
  m.impl("fused_add_rms_norm", &vllm_pp::fused_add_rms_norm);
  m.impl("rotary_embedding", &vllm_pp::rotary_embedding);
  m.impl("silu_and_mul", &vllm_pp::silu_and_mul);
  m.impl("sample_from_logits", &vllm_pp::sample_from_logits);
  m.impl("prefill_attention_paged", &vllm_pp::prefill_attention_paged);
  m.impl("linear_panels", &vllm_pp::linear_panels);
  m.impl("gguf_linear", &vllm_pp::gguf_linear);
  m.impl("gguf_linear_panels", &vllm_pp::gguf_linear_panels);
  m.impl("gguf_dequantize", &vllm_pp::gguf_dequantize);
  m.impl("gguf_linear_q8", &vllm_pp::gguf_linear_q8);
  m.impl("gguf_quantize_q8", &vllm_pp::gguf_quantize_q8);
  m.impl("lora_apply", &vllm_pp::lora_apply);
  m.impl("decode_layer_gguf", &vllm_pp::decode_layer_gguf);
}

// An empty module: everything is reached through torch.ops.vllm_pp.
static PyModuleDef vllm_pp_module = {PyModuleDef_HEAD_INIT, "_C",
                                     "vllm-pp CPU kernels, registered as torch.ops.vllm_pp",
                                     -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&vllm_pp_module); }

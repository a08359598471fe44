// One LLaMA decoder layer of a decode step on GGUF blocks as a single op: the kernel calls
// vllm/model_executor/models/llama_decode.py's LayerPlan.run makes, in its order, with its
// arguments, from C++. The kernels are the same functions (ops.h), so the results are
// bit-identical; what goes away is the Python between them: at batch 1 a layer's ~14 us of
// non-matmul kernels came with ~12 op dispatches, 6 output allocations and 6 views or slices
// from Python (~1.5-4 us each): 6-12% of a batch-1 step in the A/B runs (docs/PERFORMANCE.md,
// "One op per decoder layer").

#include <ATen/ATen.h>

#include "ops.h"

namespace vllm_pp {
namespace {

// out = x @ W^T with the block kernel LayerPlan would call: int8 activations (gguf_linear_q8)
// when `int8`, else the float kernel (quantization/gguf.py's block_kernel decides, in Python).
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type, bool int8) {
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());  // [T, N]
  if (int8) {
    gguf_linear_q8(out, x, weight, type);
  } else {
    gguf_linear(out, x, weight, type);
  }
  return out;
}

}  // namespace

at::Tensor decode_layer_gguf(at::Tensor& hidden, at::Tensor& residual, bool first,
                             const at::Tensor& in_norm, double in_eps,
                             const at::Tensor& post_norm, double post_eps,
                             const at::Tensor& qkv_w, const at::Tensor& o_w,
                             const at::Tensor& gate_up_w, const at::Tensor& down_w,
                             c10::IntArrayRef qtypes, c10::IntArrayRef int8,
                             const at::Tensor& positions, const at::Tensor& cos_cache,
                             const at::Tensor& sin_cache, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_size, at::Tensor& key_cache,
                             at::Tensor& value_cache, const at::Tensor& slot_mapping,
                             const at::Tensor& block_tables, const at::Tensor& context_lens,
                             double scale, int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(qtypes.size() == 4 && int8.size() == 4,
              "decode_layer_gguf: qtypes and int8 hold one entry per matmul (qkv, o, gate_up, "
              "down)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "decode_layer_gguf: hidden must be a contiguous [T, hidden] tensor");
  const int64_t t = hidden.size(0);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  // The input norm: the first layer's residual is its input (`residual` is `hidden` there).
  at::Tensor h;
  if (first) {
    h = at::empty_like(hidden);  // [T, hidden]
    rms_norm(h, hidden, in_norm, in_eps);
  } else {
    fused_add_rms_norm(hidden, residual, in_norm, in_eps);
    h = hidden;
  }
  const at::Tensor qkv = block_matmul(h, qkv_w, qtypes[0], int8[0] != 0);  // [T, q + 2kv]
  at::Tensor q = qkv.narrow(1, 0, q_size);  // column slices with unit last stride
  at::Tensor k = qkv.narrow(1, q_size, kv_size);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  rotary_embedding(positions, q, k, head_size, cos_cache, sin_cache);  // in place
  write_to_kv_cache(k.view({t, num_kv_heads, head_size}), v.view({t, num_kv_heads, head_size}),
                    key_cache, value_cache, slot_mapping);
  const at::Tensor q3 = q.view({t, num_heads, head_size});  // [T, H, D]
  at::Tensor attn = at::empty({t, num_heads, head_size}, hidden.options());
  paged_attention_decode(attn, q3, key_cache, value_cache, block_tables, context_lens, scale,
                         sliding_window, soft_cap);
  at::Tensor o = block_matmul(attn.view({t, q_size}), o_w, qtypes[1], int8[1] != 0);  // [T, hidden]
  fused_add_rms_norm(o, first ? hidden : residual, post_norm, post_eps);
  const at::Tensor gate_up = block_matmul(o, gate_up_w, qtypes[2], int8[2] != 0);  // [T, 2I]
  at::Tensor act = at::empty({t, gate_up.size(1) / 2}, hidden.options());           // [T, I]
  silu_and_mul(act, gate_up);
  return block_matmul(act, down_w, qtypes[3], int8[3] != 0);  // [T, hidden]
}

}  // namespace vllm_pp

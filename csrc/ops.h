// Declarations of the CPU ops registered in torch_bindings.cpp (namespace vllm_pp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace vllm_pp {

// out[B, H, D] = softmax(scale * q k^T) v for one query token per sequence, with K/V read from
// the paged caches [num_blocks, block_size, Hkv, D] through block_tables[B, max_blocks] (int64)
// up to context_lens[B] (int64). float32 or bfloat16; fp32 accumulation. sliding_window > 0:
// only the last sliding_window positions are visible (blocks before them are not read);
// soft_cap > 0: scores become soft_cap * tanh(scores / soft_cap) before the softmax.
void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale,
                            int64_t sliding_window, double soft_cap);

// key/value [T, Hkv, D] -> caches at flat slot slot_mapping[t] (int64); slots < 0 are skipped.
void write_to_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// Fused elementwise ops of the LLaMA layers (elementwise.cpp), float32 or bfloat16, rows
// [T, width] with any row stride and a unit last stride; each repeats the casts of the torch
// code it replaces (vllm/model_executor/layers/). rms_norm: out = weight * (x * rsqrt(mean(x^2)
// + eps)) with HF LlamaRMSNorm's casts. fused_add_rms_norm, in place: residual = x + residual,
// then x = rms_norm(residual). rotary_embedding, in place: rotate-half RoPE of query [T, H*D]
// and key [T, Hkv*D] at positions[T] (int64) from float32 caches [max_position, D].
// silu_and_mul: x [T, 2I] = (gate, up) -> out [T, I] = silu(gate) * up.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

// The sampler's vocabulary passes (sampler.cpp) over logits [N, V] float32: argmax[N] (first
// maximum), lse[N] = logsumexp of each row, and for each draw m an inverse-CDF sample
// tokens[m] from row draw_rows[m] with uniform uniforms[m] in (0, 1].
void sample_from_logits(const at::Tensor& logits, const at::Tensor& draw_rows,
                        const at::Tensor& uniforms, at::Tensor& tokens, at::Tensor& argmax,
                        at::Tensor& lse);

// Causal prefill attention of one chunk over its cached context (prefill_attention.cpp):
// query [L, H, D] float32 at positions context_len .. context_len + L - 1, whose K/V (and the
// context's) are in the paged caches [blocks, block_size, Hkv, D] at block_table [>= blocks];
// out [L, H, D]. Query i sees keys 0 .. context_len + i. D a multiple of 16.
void prefill_attention_paged(at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, int64_t context_len, double scale);

// Dense float32 matmul on column panels (linear_panels.cpp): out[M, N] = x[M, K] @ W^T + bias,
// W packed as panels [ceil(N / 16), K, 16] (column 16p + j of W^T at panels[p, :, j], the last
// panel zero-padded); x, out and bias contiguous float32.
void linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                   const c10::optional<at::Tensor>& bias);

// Weight-only quantized matmul on GGUF blocks (quant_gguf.cpp): out[T, N] = x[T, K] @ W^T,
// W [N, K / 32 * block bytes] uint8, the rows of a GGUF tensor of ggml type `type` (Q4_0 = 2,
// Q4_1 = 3, Q8_0 = 8) with each row's bytes regrouped: all scales, (Q4_1) all minima, quants; x and out float32 or bfloat16 (unit last stride). gguf_dequantize
// expands the same rows to a dense out [N, K] (float32 or bfloat16).
void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t type);
void gguf_dequantize(at::Tensor& out, const at::Tensor& weight, int64_t type);
// The same product for many float32 tokens without a dense copy of W (quant_gguf.cpp): 16 rows
// at a time decoded into a cached panel and multiplied with every token (panel_block.h).
void gguf_linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        int64_t type);
// The same matmul with int8 activations (quant_gguf_vnni.cpp, Q4_0 / Q4_1 / Q8_0 only): x
// quantized per 32-element block to int8 with an fp32 scale, integer dot products per block
// (AVX-512 VNNI where present). gguf_quantize_q8 exposes that activation quantization (tests):
// q [T, K] int8 and scales [T, K / 32] float32.
void gguf_linear_q8(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    int64_t type);
void gguf_quantize_q8(at::Tensor& q, at::Tensor& scales, const at::Tensor& x);

// The batched LoRA update of one layer (lora.cpp), float32 or bfloat16: for each adapted token
// tokens[j] (sorted by slot) of slot slots[j], and each output slice i ([slice_offsets[i],
// slice_offsets[i + 1]) of out's columns) with ranks[s, i] > 0,
// out[t, slice i] += (x[t] @ lora_a[s, i*R : i*R+rank]^T) @ lora_b_t[s, i*R : i*R+rank, slice i]
// * scale[s], with R = lora_a.size(1) / number of slices. x [T, in] and out [T, out_width] with
// unit last strides; lora_a [S, n*R, in] and lora_b_t [S, n*R, out_width] contiguous; tokens,
// slots int64 [N]; scale float32 [S]; ranks int64 [S, n].
void lora_apply(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
                const at::Tensor& lora_b_t, const at::Tensor& tokens, const at::Tensor& slots,
                const at::Tensor& scale, const at::Tensor& ranks,
                c10::IntArrayRef slice_offsets);

// One LLaMA decoder layer of a decode step whose four matmuls are GGUF blocks
// (decode_layer.cpp): the kernel calls of llama_decode.py's LayerPlan.run, in its order. hidden
// [T, hidden] contiguous; first: the input norm is rms_norm(hidden) and hidden is the residual
// (pass it as residual too), else fused_add_rms_norm(hidden, residual). Then qkv, RoPE (the
// caches [max_position, D]), KV write, decode attention, o, fused add + post norm, gate_up,
// SiLU-and-mul, down. qtypes / int8: per matmul (qkv, o, gate_up, down) the ggml type and
// whether it takes gguf_linear_q8. Returns the MLP output [T, hidden]; hidden, residual and
// the caches are written in place as the separate kernels write them.
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
                             double scale, int64_t sliding_window, double soft_cap);

// The instruction set the attention kernel runs with ("avx512", "avx2" or "generic"), and a
// way to lower it so tests can check every variant on one machine.
std::string cpu_isa();
void set_cpu_isa(const std::string& isa);

}  // namespace vllm_pp

// Paged-attention decode on the CPU: one query token per sequence against its cached context,
// reading K/V rows straight from the paged cache through the block table (no gather into a
// padded copy, which is what makes the torch fallback slow and memory hungry).
//
// Work is split over (sequence, kv head) pairs. One pair handles the G = H / Hkv query heads
// that share its KV head (grouped-query attention), so each K/V row is read once for G queries.
// Per pair:
//   1. scores[g][t] = scale * q_g . k_t        for every context token t (fp32)
//   2. p[g][t]      = exp(scores - max_g)       two-pass softmax: max first, so exp never
//                                               overflows, and sum_g accumulated in fp32
//   3. out_g        = (sum_t p[g][t] v_t) / sum_g
// Only tokens t < context_len are ever touched, so uninitialised (even NaN) cache memory past
// the end of a sequence cannot reach the output.

#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu_simd.h"

namespace vllm_pp {
namespace {

using simd::f32x16;
using simd::kLanes;

// Everything one (sequence, kv head) task needs; raw pointers and element strides.
struct DecodeArgs {
  void* out;              // [B, H, D], contiguous
  const void* query;      // [B, H, D], any token/head stride, unit stride within a head
  const void* key_cache;  // [num_blocks, block_size, Hkv, D], contiguous
  const void* value_cache;
  const int64_t* block_tables;  // [B, max_blocks], row stride table_stride
  const int64_t* context_lens;  // [B]
  int64_t num_heads, num_kv_heads, head_size, block_size, num_blocks;
  int64_t table_stride, q_stride_tok, q_stride_head;
  int64_t max_context_len;  // over the batch; sizes the per-thread scratch
  float scale;
};

template <typename scalar_t>
VLLM_PP_INLINE float dot(const float* q, const scalar_t* k, int64_t n) {
  // Two independent accumulators hide the FMA latency for the common D = 64 / 128.
  f32x16 acc0{}, acc1{};
  int64_t d = 0;
  for (; d + 2 * kLanes <= n; d += 2 * kLanes) {
    acc0 += simd::load(q + d) * simd::load(k + d);
    acc1 += simd::load(q + d + kLanes) * simd::load(k + d + kLanes);
  }
  for (; d + kLanes <= n; d += kLanes) acc0 += simd::load(q + d) * simd::load(k + d);
  float s = simd::reduce_add(acc0 + acc1);
  for (; d < n; ++d) s += q[d] * simd::to_float(k[d]);
  return s;
}

// acc[0:n) += p * v[0:n)
template <typename scalar_t>
VLLM_PP_INLINE void axpy(float* acc, float p, const scalar_t* v, int64_t n) {
  const f32x16 pv = simd::splat(p);
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) simd::store(acc + d, simd::load(acc + d) + pv * simd::load(v + d));
  for (; d < n; ++d) acc[d] += p * simd::to_float(v[d]);
}

// Fills p[0:n) with exp(scores - max) in place and returns the sum. Scores past n are never
// read: the padded tail of the row goes through the scalar path.
VLLM_PP_INLINE float softmax_numerators(float* s, int64_t n) {
  f32x16 vmax = simd::splat(-__builtin_inff());
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) vmax = simd::max(vmax, simd::load(s + t));
  float m = simd::reduce_max(vmax);
  for (; t < n; ++t) m = s[t] > m ? s[t] : m;

  f32x16 vsum{};
  t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const f32x16 e = simd::exp_nonpositive(simd::load(s + t) - m);
    simd::store(s + t, e);
    vsum += e;
  }
  float sum = simd::reduce_add(vsum);
  if (t < n) {
    // The tail through the same vector exp (not libm) so every element is rounded alike.
    float tail[kLanes];
    std::fill(tail, tail + kLanes, -__builtin_inff());
    std::copy(s + t, s + n, tail);
    const f32x16 e = simd::exp_nonpositive(simd::load(tail) - m);
    for (int64_t i = 0; t + i < n; ++i) {
      s[t + i] = e[i];
      sum += e[i];
    }
  }
  return sum;
}

// Tasks [begin, end) of the flattened (sequence, kv head) grid. always_inline so that each
// ISA variant below gets its own fully vectorised copy of the whole loop nest.
template <typename scalar_t>
VLLM_PP_INLINE void decode_tasks(const DecodeArgs& a, int64_t begin, int64_t end) {
  const int64_t D = a.head_size, G = a.num_heads / a.num_kv_heads, bs = a.block_size;
  const int64_t row_stride = a.num_kv_heads * D;  // elements between consecutive tokens
  const int64_t ctx_pad = (a.max_context_len + kLanes - 1) / kLanes * kLanes;
  const auto* key_cache = static_cast<const scalar_t*>(a.key_cache);
  const auto* value_cache = static_cast<const scalar_t*>(a.value_cache);
  const auto* query = static_cast<const scalar_t*>(a.query);
  auto* out = static_cast<scalar_t*>(a.out);

  // Scratch once per thread chunk, not per task: q in fp32, the score rows, the accumulators.
  std::vector<float> q(G * D), scores(G * ctx_pad), acc(G * D), inv_sum(G);

  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / a.num_kv_heads, kvh = task % a.num_kv_heads;
    const int64_t ctx = a.context_lens[b];
    const int64_t* table = a.block_tables + b * a.table_stride;
    const int64_t n_blocks = (ctx + bs - 1) / bs;
    scalar_t* out_b = out + (b * a.num_heads + kvh * G) * D;

    if (ctx == 0) {  // nothing to attend to: define the output as zeros
      std::fill(out_b, out_b + G * D, scalar_t(0));
      continue;
    }
    // Query heads kvh*G .. kvh*G+G-1 share this KV head; fold the scale into q once.
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* qg = query + b * a.q_stride_tok + (kvh * G + g) * a.q_stride_head;
      for (int64_t d = 0; d < D; ++d) q[g * D + d] = simd::to_float(qg[d]) * a.scale;
    }

    // 1. Scores, walking the block table.
    for (int64_t i = 0; i < n_blocks; ++i) {
      const int64_t block = table[i];
      TORCH_CHECK(block >= 0 && block < a.num_blocks, "paged_attention_decode: block table "
                  "entry ", block, " out of range [0, ", a.num_blocks, ")");
      const scalar_t* k = key_cache + (block * bs * a.num_kv_heads + kvh) * D;
      const int64_t n = std::min(bs, ctx - i * bs);
      for (int64_t j = 0; j < n; ++j, k += row_stride)
        for (int64_t g = 0; g < G; ++g) scores[g * ctx_pad + i * bs + j] = dot(&q[g * D], k, D);
    }

    // 2. Softmax numerators and their sums.
    for (int64_t g = 0; g < G; ++g)
      inv_sum[g] = 1.0f / softmax_numerators(&scores[g * ctx_pad], ctx);

    // 3. Weighted sum of the value rows; blocks were range-checked in step 1.
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = 0; i < n_blocks; ++i) {
      const scalar_t* v = value_cache + (table[i] * bs * a.num_kv_heads + kvh) * D;
      const int64_t n = std::min(bs, ctx - i * bs);
      for (int64_t j = 0; j < n; ++j, v += row_stride)
        for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], scores[g * ctx_pad + i * bs + j], v, D);
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out_b[g * D + d] = scalar_t(acc[g * D + d] * inv_sum[g]);
  }
}

// One copy of decode_tasks per instruction set. The target attribute changes only how the
// vector types above are lowered (zmm / ymm / xmm); the arithmetic is the same.
using TaskFn = void (*)(const DecodeArgs&, int64_t, int64_t);

template <typename scalar_t>
void decode_tasks_generic(const DecodeArgs& a, int64_t begin, int64_t end) {
  decode_tasks<scalar_t>(a, begin, end);
}

#if defined(__x86_64__)
template <typename scalar_t>
__attribute__((target("avx2,fma"))) void decode_tasks_avx2(const DecodeArgs& a, int64_t begin,
                                                            int64_t end) {
  decode_tasks<scalar_t>(a, begin, end);
}

template <typename scalar_t>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void decode_tasks_avx512(
    const DecodeArgs& a, int64_t begin, int64_t end) {
  decode_tasks<scalar_t>(a, begin, end);
}
#endif

std::string best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
#endif
  return "generic";
}

// 0 = generic, 1 = avx2, 2 = avx512. Chosen once; tests may lower it with set_cpu_isa.
int isa_rank(const std::string& isa) {
  if (isa == "avx512") return 2;
  if (isa == "avx2") return 1;
  if (isa == "generic") return 0;
  return -1;
}

std::atomic<int>& active_isa() {
  static std::atomic<int> rank{isa_rank(best_isa())};
  return rank;
}

template <typename scalar_t>
TaskFn select_tasks() {
#if defined(__x86_64__)
  switch (active_isa().load()) {
    case 2:
      return decode_tasks_avx512<scalar_t>;
    case 1:
      return decode_tasks_avx2<scalar_t>;
  }
#endif
  return decode_tasks_generic<scalar_t>;
}

}  // namespace

std::string cpu_isa() {
  static const char* names[] = {"generic", "avx2", "avx512"};
  return names[active_isa().load()];
}

void set_cpu_isa(const std::string& isa) {
  const int rank = isa_rank(isa);
  TORCH_CHECK(rank >= 0, "set_cpu_isa: unknown ISA '", isa, "' (generic, avx2, avx512)");
  TORCH_CHECK(rank <= isa_rank(best_isa()), "set_cpu_isa: this CPU does not support ", isa);
  active_isa().store(rank);
}

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3, "paged_attention_decode: query must be [B, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "paged_attention_decode: caches must both be [num_blocks, block_size, Hkv, D]");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D, "paged_attention_decode: head size mismatch");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "paged_attention_decode: H must be a multiple of Hkv");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(),
              "paged_attention_decode: out must be a contiguous [B, H, D] tensor");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_attention_decode: dtype must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype &&
                  value_cache.scalar_type() == dtype,
              "paged_attention_decode: query, out and caches must share one dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention_decode: caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "paged_attention_decode: query head dim must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.scalar_type() == at::kLong && block_tables.stride(1) == 1,
              "paged_attention_decode: block_tables must be int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "paged_attention_decode: context_lens must be contiguous int64 [B]");
  for (const auto& t : {query, key_cache, value_cache, block_tables, context_lens, out})
    TORCH_CHECK(t.device().is_cpu(), "paged_attention_decode: CPU tensors only");
  if (B == 0) return;

  DecodeArgs a{};
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int64_t>();
  a.context_lens = context_lens.data_ptr<int64_t>();
  a.num_heads = H;
  a.num_kv_heads = Hkv;
  a.head_size = D;
  a.block_size = key_cache.size(1);
  a.num_blocks = key_cache.size(0);
  a.table_stride = block_tables.stride(0);
  a.q_stride_tok = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.scale = static_cast<float>(scale);
  // Validate the lengths up front: a bad one must not read past the block table.
  const int64_t table_capacity = block_tables.size(1) * a.block_size;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = a.context_lens[b];
    TORCH_CHECK(len >= 0 && len <= table_capacity, "paged_attention_decode: context_lens[", b,
                "] = ", len, " outside [0, ", table_capacity, "]");
    a.max_context_len = std::max(a.max_context_len, len);
  }

  const TaskFn fn = dtype == at::kFloat ? select_tasks<float>() : select_tasks<c10::BFloat16>();
  // at::parallel_for uses torch's own OpenMP pool, so torch.set_num_threads governs it (a
  // pipeline stage pinned to one thread runs this inline, without a parallel region), and no
  // second OpenMP runtime gets loaded next to the one torch ships.
  at::parallel_for(0, B * Hkv, /*grain_size=*/1,
                   [&](int64_t begin, int64_t end) { fn(a, begin, end); });
}

}  // namespace vllm_pp

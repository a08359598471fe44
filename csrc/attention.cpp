// Paged-attention decode on the CPU: one query token per sequence against its cached context,
// reading K/V rows straight from the paged cache through the block table (no gather into a
// padded copy, which is what makes the torch fallback slow and memory hungry).
//
// Work is split over sequences (and over KV heads when there are few sequences), in parallel
// with at::parallel_for. Query head h reads KV head h / G with G = H / Hkv (grouped-query
// attention); the G heads sharing a KV head are handled together, so each K/V row is loaded
// once for all of them. For each query head:
//   1. s[t]  = scale * q . k_t          for every visible context token t (fp32); with a
//                                       soft-cap c, s[t] = c * tanh(s[t] / c)
//   2. p[t]  = exp(s[t] - max(s))       two-pass softmax: max first, so exp never overflows;
//                                       the sum of p accumulated in fp32
//   3. out   = (sum_t p[t] v_t) / sum(p)
// The visible tokens are start <= t < context_len, with start = 0, or context_len - W with a
// sliding window W (the last W positions, the query's own included, as HF masks them). Only
// those rows are ever read: blocks wholly before the window are skipped, and uninitialised
// (even NaN) cache memory past the end of a sequence cannot reach the output.

#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "cpu_simd.h"

namespace vllm_pp {
namespace {

// Everything one task needs; raw pointers and element strides.
struct DecodeArgs {
  void* out;              // [B, H, D], contiguous
  const void* query;      // [B, H, D], any token/head stride, unit stride within a head
  const void* key_cache;  // [num_blocks, block_size, Hkv, D], contiguous
  const void* value_cache;
  const int64_t* block_tables;  // [B, max_blocks], row stride table_stride
  const int64_t* context_lens;  // [B]
  int64_t num_heads, num_kv_heads, head_size, block_size, num_blocks;
  int64_t table_stride, q_stride_tok, q_stride_head;
  int64_t max_span;         // most visible tokens of a sequence; sizes the per-thread scratch
  int64_t kv_per_task;      // KV heads per task, a divisor of num_kv_heads
  int64_t sliding_window;   // > 0: only the last sliding_window positions are visible
  float scale;
  float soft_cap;  // > 0: scores become soft_cap * tanh(scores / soft_cap)
};

// Software prefetch of the next block's rows while the current block is processed. The blocks
// of a sequence lie anywhere in the cache, so the hardware prefetcher cannot guess where the
// next one starts. The rows are requested one at a time, spread evenly over the work on the
// current block (one row every `every` rows visited): issued in one burst they would stall on
// the CPU's limited number of outstanding misses.
struct Prefetch {
  const char* next_row = nullptr;  // nullptr: nothing (more) to fetch
  int64_t rows_left = 0, stride_bytes = 0, row_bytes = 0, every = 1, countdown = 1;

  Prefetch() = default;
  Prefetch(const void* first_row, int64_t n_rows, int64_t stride, int64_t bytes, int64_t steps)
      : next_row(static_cast<const char*>(first_row)), rows_left(n_rows), stride_bytes(stride),
        row_bytes(bytes), every(std::max<int64_t>(1, steps / n_rows)) {}

  VLLM_PP_INLINE void step() {
    if (--countdown > 0 || rows_left == 0) return;
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next_row + off);
    next_row += stride_bytes;
    --rows_left;
    countdown = every;
  }
};

// The kernel proper, for vector width W (floats per register of the target ISA) and head size
// kD. kD > 0 fixes the head size at compile time (the common 64 and 128): a head's row is then
// kD / W vectors held in registers, and every loop over it is unrolled. kD = 0 takes the head
// size at run time (any size, including ones that are not a multiple of W).
template <int W, typename scalar_t, int kD>
struct DecodeKernel {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  static constexpr int kC = kD / W;  // vectors per head row when kD > 0
  static_assert(kD % W == 0 && kC <= 8, "a fixed head size must fit in 8 registers");

  // q . k over n elements (run-time head size).
  static VLLM_PP_INLINE float dot(const float* q, const float* k, int64_t n) {
    // Two independent accumulators, so consecutive FMAs do not wait on each other.
    f32 acc0{}, acc1{};
    int64_t d = 0;
    for (; d + 2 * W <= n; d += 2 * W) {
      acc0 += S::load(q + d) * S::load(k + d);
      acc1 += S::load(q + d + W) * S::load(k + d + W);
    }
    for (; d + W <= n; d += W) acc0 += S::load(q + d) * S::load(k + d);
    float s = S::reduce_add(acc0 + acc1);
    for (; d < n; ++d) s += q[d] * k[d];
    return s;
  }

  // One query head against the n rows of a block: s[j] = q . k_j, k_j = k + j * k_stride.
  static VLLM_PP_INLINE void block_scores(const float* q, const float* k, int64_t k_stride,
                                          int64_t n, int64_t D, float* s, Prefetch& pf) {
    if constexpr (kD > 0) {
      f32 qv[kC];
      for (int c = 0; c < kC; ++c) qv[c] = S::load(q + c * W);
      for (int64_t j = 0; j < n; ++j, k += k_stride) {
        pf.step();
        f32 acc0 = qv[0] * S::load(k), acc1{};
        for (int c = 1; c < kC; ++c) (c % 2 ? acc1 : acc0) += qv[c] * S::load(k + c * W);
        s[j] = S::reduce_add(acc0 + acc1);
      }
    } else {
      for (int64_t j = 0; j < n; ++j, k += k_stride) {
        pf.step();
        s[j] = dot(q, k, D);
      }
    }
  }

  // One query head over the n rows of a block: acc += sum_j p[j] * v_j.
  static VLLM_PP_INLINE void block_values(const float* p, const float* v, int64_t v_stride,
                                          int64_t n, int64_t D, float* acc, Prefetch& pf) {
    if constexpr (kD > 0) {
      f32 av[kC];  // the accumulator stays in registers for the whole block
      for (int c = 0; c < kC; ++c) av[c] = S::load(acc + c * W);
      for (int64_t j = 0; j < n; ++j, v += v_stride) {
        pf.step();
        const f32 pj = S::splat(p[j]);
        for (int c = 0; c < kC; ++c) av[c] += pj * S::load(v + c * W);
      }
      for (int c = 0; c < kC; ++c) S::store(acc + c * W, av[c]);
    } else {
      for (int64_t j = 0; j < n; ++j, v += v_stride) {
        pf.step();
        const f32 pj = S::splat(p[j]);
        int64_t d = 0;
        for (; d + W <= D; d += W) S::store(acc + d, S::load(acc + d) + pj * S::load(v + d));
        for (; d < D; ++d) acc[d] += p[j] * v[d];
      }
    }
  }

  // The n rows (`width` elements each, `stride` apart) of a block in fp32: float rows are used
  // in place; bfloat16 rows are widened once into `buf`, then shared by all the query heads.
  static VLLM_PP_INLINE const float* rows_f32(const scalar_t* rows, int64_t n, int64_t width,
                                              int64_t& stride, float* buf) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      return rows;
    } else {
      for (int64_t j = 0; j < n; ++j, rows += stride) {
        float* dst = buf + j * width;
        int64_t d = 0;
        for (; d + W <= width; d += W) S::store(dst + d, S::load(rows + d));
        for (; d < width; ++d) dst[d] = simd::to_float(rows[d]);
      }
      stride = width;
      return buf;
    }
  }

  // Replaces s[0:n) by exp(s - max(s)) and returns their sum.
  static VLLM_PP_INLINE float softmax_numerators(float* s, int64_t n) {
    f32 vmax = S::splat(-__builtin_inff());
    int64_t t = 0;
    for (; t + W <= n; t += W) vmax = S::max(vmax, S::load(s + t));
    float m = S::reduce_max(vmax);
    for (; t < n; ++t) m = s[t] > m ? s[t] : m;

    f32 vsum{};
    for (t = 0; t + W <= n; t += W) {
      const f32 e = S::exp_nonpositive(S::load(s + t) - m);
      S::store(s + t, e);
      vsum += e;
    }
    float sum = S::reduce_add(vsum);
    if (t < n) {
      // The tail goes through the same vector exp (not libm), so all elements round alike.
      float tail[W];
      std::fill(tail, tail + W, -__builtin_inff());
      std::copy(s + t, s + n, tail);
      const f32 e = S::exp_nonpositive(S::load(tail) - m);
      for (int64_t i = 0; t + i < n; ++i) {
        s[t + i] = e[i];
        sum += e[i];
      }
    }
    return sum;
  }

  // Tasks [begin, end) of the flattened (sequence, KV-head chunk) grid. A task covers
  // `kv_per_task` consecutive KV heads (all of them when there are enough sequences to keep
  // the threads busy), so it streams each block's rows front to back rather than picking one
  // head's slice out of every row. Work goes block by block: a block's rows (12 KiB for
  // SmolLM2's fp32 blocks of 16 tokens) stay in L1/L2 while each query head passes over them.
  static VLLM_PP_INLINE void run(const DecodeArgs& a, int64_t begin, int64_t end) {
    const int64_t D = kD > 0 ? kD : a.head_size;
    const int64_t G = a.num_heads / a.num_kv_heads, bs = a.block_size;
    const int64_t kv_per_task = a.kv_per_task, chunks = a.num_kv_heads / kv_per_task;
    const int64_t nq = kv_per_task * G;             // query heads per task
    const int64_t width = kv_per_task * D;          // elements of a row this task reads
    const int64_t row_stride = a.num_kv_heads * D;  // elements between consecutive tokens
    const int64_t row_bytes = width * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t ctx_pad = (a.max_span + W - 1) / W * W;
    const auto* key_cache = static_cast<const scalar_t*>(a.key_cache);
    const auto* value_cache = static_cast<const scalar_t*>(a.value_cache);
    const auto* query = static_cast<const scalar_t*>(a.query);
    auto* out = static_cast<scalar_t*>(a.out);

    // Scratch once per thread chunk, not per task: q in fp32, score rows, accumulators, and
    // one block of widened bfloat16 rows.
    std::vector<float> q(nq * D), scores(nq * ctx_pad), acc(nq * D), inv_sum(nq);
    std::vector<float> block_buf(std::is_same_v<scalar_t, float> ? 0 : bs * width);

    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, kv0 = task % chunks * kv_per_task;
      const int64_t ctx = a.context_lens[b];
      const int64_t* table = a.block_tables + b * a.table_stride;
      // Visible positions [start, ctx): blocks [first_block, n_blocks) hold them.
      const int64_t start =
          a.sliding_window > 0 ? std::max<int64_t>(0, ctx - a.sliding_window) : 0;
      const int64_t span = ctx - start;
      const int64_t first_block = start / bs, n_blocks = (ctx + bs - 1) / bs;
      scalar_t* out_b = out + (b * a.num_heads + kv0 * G) * D;  // nq heads, back to back

      if (ctx == 0) {  // nothing to attend to: define the output as zeros
        std::fill(out_b, out_b + nq * D, scalar_t(0));
        continue;
      }
      for (int64_t i = first_block; i < n_blocks; ++i)
        TORCH_CHECK(table[i] >= 0 && table[i] < a.num_blocks, "paged_attention_decode: block "
                    "table entry ", table[i], " out of range [0, ", a.num_blocks, ")");
      // Query heads kv0*G .. kv0*G+nq-1 (head h reads KV head h / G); scale folded in once.
      for (int64_t h = 0; h < nq; ++h) {
        const scalar_t* qh = query + b * a.q_stride_tok + (kv0 * G + h) * a.q_stride_head;
        for (int64_t d = 0; d < D; ++d) q[h * D + d] = simd::to_float(qh[d]) * a.scale;
      }
      // The visible rows of block i: from position block_lo(i) (the window's start in the
      // first block), block_len(i) of them; this task's first such row; and where their
      // scores go (index block_lo(i) - start of each score row).
      auto block_lo = [&](int64_t i) { return std::max(start, i * bs); };
      auto block_len = [&](int64_t i) { return std::min((i + 1) * bs, ctx) - block_lo(i); };
      auto block_rows = [&](const scalar_t* cache, int64_t i) {
        return cache + (table[i] * bs + block_lo(i) - i * bs) * row_stride + kv0 * D;
      };
      // Prefetch of block i + 1, spread over the nq passes of the query heads over block i.
      auto prefetch_next = [&](const scalar_t* cache, int64_t i) {
        if (i + 1 >= n_blocks) return Prefetch{};
        return Prefetch(block_rows(cache, i + 1), block_len(i + 1),
                        row_stride * static_cast<int64_t>(sizeof(scalar_t)), row_bytes,
                        nq * block_len(i));
      };

      // 1. Scores, walking the block table (from the window's first block).
      for (int64_t i = first_block; i < n_blocks; ++i) {
        Prefetch pf = prefetch_next(key_cache, i);
        int64_t stride = row_stride;
        const float* k =
            rows_f32(block_rows(key_cache, i), block_len(i), width, stride, block_buf.data());
        for (int64_t kh = 0, h = 0; kh < kv_per_task; ++kh)
          for (int64_t g = 0; g < G; ++g, ++h)
            block_scores(&q[h * D], k + kh * D, stride, block_len(i), D,
                         &scores[h * ctx_pad + block_lo(i) - start], pf);
      }
      if (a.soft_cap > 0.0f) {
        // HF's order: scores / c, tanh, * c.
        for (int64_t h = 0; h < nq; ++h) {
          float* s = &scores[h * ctx_pad];
          for (int64_t t = 0; t < span; ++t) s[t] = std::tanh(s[t] / a.soft_cap) * a.soft_cap;
        }
      }

      // 2. Softmax numerators and their sums.
      for (int64_t h = 0; h < nq; ++h)
        inv_sum[h] = 1.0f / softmax_numerators(&scores[h * ctx_pad], span);

      // 3. Probability-weighted sum of the value rows.
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = first_block; i < n_blocks; ++i) {
        Prefetch pf = prefetch_next(value_cache, i);
        int64_t stride = row_stride;
        const float* v =
            rows_f32(block_rows(value_cache, i), block_len(i), width, stride, block_buf.data());
        for (int64_t kh = 0, h = 0; kh < kv_per_task; ++kh)
          for (int64_t g = 0; g < G; ++g, ++h)
            block_values(&scores[h * ctx_pad + block_lo(i) - start], v + kh * D, stride,
                         block_len(i), D, &acc[h * D], pf);
      }
      for (int64_t h = 0; h < nq; ++h)
        for (int64_t d = 0; d < D; ++d) out_b[h * D + d] = scalar_t(acc[h * D + d] * inv_sum[h]);
    }
  }
};

// The kernel as select_isa_kernel (cpu_isa.h) wants it: one class per vector width W. A head
// size of 64 or 128 is compiled in (kD) when a head row fits in 8 registers of that width
// (64: AVX2 and AVX-512; 128: AVX-512); any other size takes the runtime-D kernel.
using TaskFn = void (*)(const DecodeArgs&, int64_t, int64_t);

template <typename scalar_t>
struct DecodeTasks {
  template <int W>
  struct Kernel {
    static VLLM_PP_INLINE void run(const DecodeArgs& a, int64_t begin, int64_t end) {
      if constexpr (64 <= 8 * W) {
        if (a.head_size == 64) return DecodeKernel<W, scalar_t, 64>::run(a, begin, end);
      }
      if constexpr (128 <= 8 * W) {
        if (a.head_size == 128) return DecodeKernel<W, scalar_t, 128>::run(a, begin, end);
      }
      DecodeKernel<W, scalar_t, 0>::run(a, begin, end);
    }
  };
};

template <typename scalar_t>
TaskFn select_tasks() {
  return select_isa_kernel<DecodeTasks<scalar_t>::template Kernel, const DecodeArgs&, int64_t,
                           int64_t>();
}

}  // namespace

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale,
                            int64_t sliding_window, double soft_cap) {
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
  TORCH_CHECK(sliding_window >= 0, "paged_attention_decode: sliding_window must be >= 0 "
              "(0: no window), got ", sliding_window);
  TORCH_CHECK(soft_cap >= 0.0, "paged_attention_decode: soft_cap must be >= 0 (0: none), got ",
              soft_cap);
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
  a.sliding_window = sliding_window;
  a.soft_cap = static_cast<float>(soft_cap);
  // Validate the lengths up front: a bad one must not read past the block table.
  const int64_t table_capacity = block_tables.size(1) * a.block_size;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = a.context_lens[b];
    TORCH_CHECK(len >= 0 && len <= table_capacity, "paged_attention_decode: context_lens[", b,
                "] = ", len, " outside [0, ", table_capacity, "]");
    const int64_t span = sliding_window > 0 ? std::min(len, sliding_window) : len;
    a.max_span = std::max(a.max_span, span);
  }

  // Whole sequences per task stream the cache best; split them by KV head only when there are
  // too few sequences to give every thread a few tasks.
  a.kv_per_task = B >= 4 * at::get_num_threads() ? Hkv : 1;
  const TaskFn fn = dtype == at::kFloat ? select_tasks<float>() : select_tasks<c10::BFloat16>();
  // at::parallel_for is OpenMP here (built with -fopenmp, linked against the libgomp torch has
  // already loaded), so torch.set_num_threads governs it, and a pipeline stage pinned to one
  // thread runs this inline without entering a parallel region at all.
  at::parallel_for(0, B * (Hkv / a.kv_per_task), /*grain_size=*/1,
                   [&](int64_t begin, int64_t end) { fn(a, begin, end); });
}

}  // namespace vllm_pp

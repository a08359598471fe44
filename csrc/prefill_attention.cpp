// Causal attention of one prefill chunk over its cached context (chunked prefill, prefix-cache
// hits), float32: out[i] = softmax(scale * q_i K^T) V over keys 0 .. context_len + i, read from
// the paged cache through the block table.
//
// Why not torch's SDPA: at 4k tokens attention is half of a long prompt's prefill, and SDPA's
// CPU flash kernel, given the boolean mask a chunk needs (its queries end-aligned to the keys),
// ran SmolLM2's shapes at ~30 GFLOP/s of useful work on one AVX2 core: it also computes every
// masked pair, and a gather of the context's K/V into a dense copy came first.
//
// Here, per layer and chunk:
//   1. The context's keys are packed per KV head as panels [ceil(n / 16), D, 16] (key 16p + j
//      at [p, :, j], zero-padded) and the values as [D / 16, n16, 16] (dims 16q..16q+15 of
//      key t at [q, t, :]): both straight from the cache blocks, once.
//   2. Tasks are (KV head, block of query rows); the G query heads sharing the KV head go
//      together, so each packed key and value line serves G x the rows. A task runs
//      FlashAttention-2's loop over blocks of 128 keys, only up to its last query's position:
//      scores S = Q K^T with the panel block of linear_panels (panel_block.h: Q rows times a
//      16-key panel, K = D), the running max and sum of each row updated, exp(S - max), then
//      P V with the same block (P rows times a 16-dim panel of values, K = 128 keys), added to
//      the output rows rescaled by exp(old max - new max). Keys past a query's position are
//      masked only in the diagonal block; blocks wholly past the task's last query are skipped.
//   3. out = sum / row sum.
// Every output is computed by one task in a fixed order, so any thread count gives the same
// bits. The exp is Simd's exp_nonpositive (within an ulp or two of expf). Sliding windows,
// soft-caps, bf16 and head sizes not a multiple of 16 keep the SDPA path
// (vllm/model_executor/layers/attention.py decides).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_isa.h"
#include "cpu_simd.h"
#include "ops.h"
#include "panel_block.h"

namespace vllm_pp {
namespace {

using panels::kPanel;
constexpr int64_t kKeyBlock = 128;  // keys per step of the online softmax (8 panels)
constexpr int64_t kTaskRows = 96;  // query rows (queries x heads of a group) per task

struct PrefillArgs {
  float* out;                 // [L, H, D], row stride out_stride
  const float* query;         // [L, H, D], row stride q_stride
  const float* key_panels;    // [Hkv, P, D, 16]
  const float* value_panels;  // [Hkv, D / 16, P * 16, 16]
  int64_t length, heads, kv_heads, head_size, context_len, panels, q_stride, out_stride;
  int64_t query_block;  // queries per task
  float scale;
};

template <int W>
struct PrefillAttention {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;

  // Rows [0, rows) of x (row stride ldx) times `panel_count` consecutive panels of B (each
  // [K, 16], `panel_stride` floats apart) into y (row stride ldy), 16 columns per panel.
  static VLLM_PP_INLINE void matmul(const float* x, int64_t ldx, int64_t rows, int64_t K,
                                    const float* B, int64_t panel_stride, int64_t panel_count,
                                    float* y, int64_t ldy) {
    for (int64_t p = 0; p < panel_count; ++p) {
      panels::rows_times_panel<panels::BlockFor<W>>(x, ldx, rows, K, B + p * panel_stride,
                                                    nullptr, nullptr, y + p * kPanel, ldy,
                                                    kPanel);
    }
  }

  static VLLM_PP_INLINE void run(const PrefillArgs* a, int64_t begin, int64_t end) {
    const int64_t D = a->head_size, G = a->heads / a->kv_heads, Bq = a->query_block;
    const int64_t q_blocks = (a->length + Bq - 1) / Bq;
    const int64_t max_rows = Bq * G;
    std::vector<float> q_rows(max_rows * D), scores(max_rows * kKeyBlock), acc(max_rows * D),
        pv(max_rows * D), row_max(max_rows), row_sum(max_rows), rescale(max_rows);
    alignas(64) float lane_index[W];
    for (int i = 0; i < W; ++i) lane_index[i] = static_cast<float>(i);
    const f32 lanes = S::load(lane_index);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / q_blocks, i0 = (task % q_blocks) * Bq;
      const int64_t bq = std::min(Bq, a->length - i0), rows = bq * G;
      // Row g * bq + ii: query i0 + ii of head h * G + g.
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t ii = 0; ii < bq; ++ii) {
          std::memcpy(q_rows.data() + (g * bq + ii) * D,
                      a->query + (i0 + ii) * a->q_stride + (h * G + g) * D, D * sizeof(float));
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * D, 0.0f);
      std::fill(row_max.begin(), row_max.begin() + rows, neg_inf);
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.0f);
      const float* kp = a->key_panels + h * a->panels * D * kPanel;
      const float* vp = a->value_panels + h * (D / kPanel) * a->panels * kPanel * kPanel;
      const int64_t keys_end = a->context_len + i0 + bq;  // the last query sees keys < this
      for (int64_t t0 = 0; t0 < keys_end; t0 += kKeyBlock) {
        const int64_t nk = std::min(kKeyBlock, keys_end - t0);
        const int64_t np = (nk + kPanel - 1) / kPanel;
        matmul(q_rows.data(), D, rows, D, kp + (t0 / kPanel) * D * kPanel, D * kPanel, np,
               scores.data(), kKeyBlock);
        // The online softmax of each row over this block's visible keys.
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t ii = r % bq;
          const int64_t visible = std::min(nk, a->context_len + i0 + ii + 1 - t0);
          float* s = scores.data() + r * kKeyBlock;
          if (visible <= 0) {  // every key of the block is after this query
            rescale[r] = 1.0f;
            std::fill(s, s + np * kPanel, 0.0f);
            continue;
          }
          const f32 limit = S::splat(static_cast<float>(visible));
          const f32 masked = S::splat(neg_inf);
          f32 mx = masked;
          for (int64_t c = 0; c < np * kPanel; c += W) {
            f32 v = S::load(s + c) * a->scale;
            v = (lanes + static_cast<float>(c)) < limit ? v : masked;
            S::store(s + c, v);
            mx = S::max(mx, v);
          }
          const float m_new = std::max(row_max[r], S::reduce_max(mx));
          const f32 m = S::splat(m_new);
          f32 sum = S::splat(0.0f);
          for (int64_t c = 0; c < np * kPanel; c += W) {
            const f32 p = S::exp_nonpositive(S::load(s + c) - m);
            S::store(s + c, p);
            sum += p;
          }
          const float alpha = row_max[r] == neg_inf ? 0.0f : std::exp(row_max[r] - m_new);
          row_sum[r] = row_sum[r] * alpha + S::reduce_add(sum);
          row_max[r] = m_new;
          rescale[r] = alpha;
        }
        // pv = P V over the block's keys (zero-padded keys have P = 0 and zero values).
        matmul(scores.data(), kKeyBlock, rows, np * kPanel, vp + t0 * kPanel,
               a->panels * kPanel * kPanel, D / kPanel, pv.data(), D);
        for (int64_t r = 0; r < rows; ++r) {
          const f32 alpha = S::splat(rescale[r]);
          float* o = acc.data() + r * D;
          const float* add = pv.data() + r * D;
          for (int64_t d = 0; d < D; d += W) {
            S::store(o + d, S::load(o + d) * alpha + S::load(add + d));
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t ii = 0; ii < bq; ++ii) {
          const int64_t r = g * bq + ii;
          const f32 inv = S::splat(1.0f / row_sum[r]);
          float* o = a->out + (i0 + ii) * a->out_stride + (h * G + g) * D;
          for (int64_t d = 0; d < D; d += W) {
            S::store(o + d, S::load(acc.data() + r * D + d) * inv);
          }
        }
      }
    }
  }
};

}  // namespace

void prefill_attention_paged(at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, int64_t context_len, double scale) {
  constexpr const char* op = "prefill_attention_paged";
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2),
              op, ": query must be float32 [L, H, D] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == at::kFloat &&
                  out.stride(2) == 1 && out.stride(1) == out.size(2),
              op, ": out must be float32 of query's shape with contiguous heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  key_cache.scalar_type() == at::kFloat &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == at::kFloat,
              op, ": the caches must be contiguous float32 [blocks, block_size, Hkv, D]");
  const int64_t L = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && D % kPanel == 0, op, ": head size ", D,
              " must match the cache and be a multiple of 16");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, op, ": ", H, " query heads cannot share ", Hkv,
              " KV heads");
  TORCH_CHECK(context_len >= 0, op, ": context_len must be >= 0");
  const int64_t n = context_len + L;
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong &&
                  block_table.is_contiguous() && block_table.size(0) * bs >= n,
              op, ": block_table must be a contiguous int64 [>= ", (n + bs - 1) / bs,
              "] tensor");
  if (L == 0) return;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t b = 0; b < (n + bs - 1) / bs; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, op, ": block ", table[b],
                " is outside the cache");
  }
  const int64_t P = (n + kPanel - 1) / kPanel;
  // The packed keys and values (step 1 above); zero past n.
  at::Tensor key_panels = at::zeros({Hkv, P, D, kPanel}, query.options());
  at::Tensor value_panels = at::zeros({Hkv, D / kPanel, P * kPanel, kPanel}, query.options());
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* kp = key_panels.data_ptr<float>();
  float* vp = value_panels.data_ptr<float>();
  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const float* krow = kc + (slot * Hkv + h) * D;
        const float* vrow = vc + (slot * Hkv + h) * D;
        float* kdst = kp + ((h * P + t / kPanel) * D) * kPanel + t % kPanel;
        for (int64_t d = 0; d < D; ++d) kdst[d * kPanel] = krow[d];
        for (int64_t q = 0; q < D / kPanel; ++q) {
          std::memcpy(vp + ((h * (D / kPanel) + q) * P * kPanel + t) * kPanel,
                      vrow + q * kPanel, kPanel * sizeof(float));
        }
      }
    }
  });
  const int64_t G = H / Hkv;
  const int64_t query_block = std::max<int64_t>(1, kTaskRows / G);
  const PrefillArgs args{out.data_ptr<float>(), query.data_ptr<float>(), kp, vp,
                         L, H, Hkv, D, context_len, P, query.stride(0), out.stride(0),
                         query_block, static_cast<float>(scale)};
  const int64_t tasks = Hkv * ((L + query_block - 1) / query_block);
  auto fn = select_isa_kernel<PrefillAttention, const PrefillArgs*, int64_t, int64_t>();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { fn(&args, begin, end); });
}

}  // namespace vllm_pp

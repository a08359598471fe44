// The sampler's per-row work over the vocabulary, in two or three streaming passes per row
// instead of torch's softmax + cumsum + searchsorted (which write and re-read [N, V] fp32
// tensors, ~35 ms per decode step at 128 x 49k on one core):
//   1. max and argmax of the row (argmax: the first index holding the maximum, as torch's);
//   2. total = sum_j exp(x_j - max), accumulated block by block in a fixed order, which also
//      gives logsumexp = max + log(total) for the sampled token's logprob;
//   3. for each draw with uniform u in (0, 1]: walk the same blocks, adding the same block sums
//      in the same order, until the running sum reaches u * total, then find the token inside
//      that block (inverse-CDF sampling).
// Pass 3 repeats pass 2's arithmetic exactly, so the target u * total <= total is always
// reached; a token with zero probability (logit -inf) adds nothing and is never picked.

#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_isa.h"
#include "cpu_simd.h"

namespace vllm_pp {
namespace {

struct SampleArgs {
  const float* logits;  // [N, V], row stride `stride`
  int64_t num_rows, vocab, stride;
  float* row_max;       // [N] scratch
  float* row_total;     // [N] scratch: sum of exp(x - max)
  int64_t* argmax;      // [N]
  float* lse;           // [N]
  const int64_t* draw_rows;  // [M]: the logits row of each draw
  const float* uniforms;     // [M], in (0, 1]
  int64_t* tokens;           // [M]
};

template <int W>
struct SampleKernel {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  static constexpr int64_t kBlock = 4 * W;  // elements per block of the fixed summation order

  // exp(x - max) of one block, as four vectors.
  static VLLM_PP_INLINE void block_exp(const float* x, f32 mx, f32 e[4]) {
    for (int c = 0; c < 4; ++c) e[c] = S::exp_nonpositive(S::load(x + c * W) - mx);
  }

  // The block's sum in a fixed order: used verbatim by passes 2 and 3, so both see
  // bit-identical block sums.
  static VLLM_PP_INLINE float block_sum(const f32 e[4]) {
    return S::reduce_add((e[0] + e[1]) + (e[2] + e[3]));
  }

  // A block of n <= kBlock elements; a short one (the row's tail) is padded with -inf, whose
  // exp is exactly 0.
  static VLLM_PP_INLINE void any_block_exp(const float* x, int64_t n, f32 mx, f32 e[4]) {
    if (n == kBlock) return block_exp(x, mx, e);
    float pad[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) pad[j] = j < n ? x[j] : -INFINITY;
    block_exp(pad, mx, e);
  }

  // Always inlined: compiled inside each ISA-specific caller below, never for the baseline.
  static VLLM_PP_INLINE void row_stats(const SampleArgs& a, int64_t r) {
    const float* x = a.logits + r * a.stride;
    const int64_t V = a.vocab;
    f32 vmax = S::splat(-INFINITY);
    int64_t j = 0;
    for (; j + W <= V; j += W) vmax = S::max(vmax, S::load(x + j));
    float mx = S::reduce_max(vmax);
    for (; j < V; ++j) mx = x[j] > mx ? x[j] : mx;
    int64_t best = 0;
    for (int64_t i = 0; i < V; ++i) {
      if (x[i] == mx) {
        best = i;
        break;
      }
    }
    a.argmax[r] = best;
    a.row_max[r] = mx;
    if (!(mx > -INFINITY) || std::isnan(mx)) {  // all -inf (or NaN): nothing to normalise
      a.row_total[r] = 0.0f;
      a.lse[r] = mx;
      return;
    }
    const f32 mxv = S::splat(mx);
    float total = 0.0f;
    f32 e[4];
    for (j = 0; j < V; j += kBlock) {
      any_block_exp(x + j, std::min<int64_t>(kBlock, V - j), mxv, e);
      total += block_sum(e);
    }
    a.row_total[r] = total;
    a.lse[r] = mx + std::log(total);
  }

  static VLLM_PP_INLINE void draw(const SampleArgs& a, int64_t m) {
    const int64_t r = a.draw_rows[m];
    const float* x = a.logits + r * a.stride;
    const int64_t V = a.vocab;
    const float mx = a.row_max[r], total = a.row_total[r];
    if (!(total > 0.0f)) {  // a degenerate row: fall back to its argmax
      a.tokens[m] = a.argmax[r];
      return;
    }
    const float target = a.uniforms[m] * total;
    const f32 mxv = S::splat(mx);
    float acc = 0.0f;
    f32 e[4];
    for (int64_t j = 0; j < V; j += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, V - j);
      any_block_exp(x + j, n, mxv, e);
      const float bs = block_sum(e);
      if (acc + bs >= target) {
        // Inside this block: add its tokens one by one. The block sum was added as a tree, so
        // this running sum can fall a rounding error short of it; then the last token with
        // non-zero probability in the block is taken.
        float p[kBlock];
        std::memcpy(p, e, sizeof(p));
        float run = acc;
        int64_t last_positive = -1;
        for (int64_t i = 0; i < n; ++i) {
          if (!(p[i] > 0.0f)) continue;
          last_positive = j + i;
          run += p[i];
          if (run >= target) {
            a.tokens[m] = j + i;
            return;
          }
        }
        if (last_positive >= 0) {
          a.tokens[m] = last_positive;
          return;
        }
      }
      acc += bs;
    }
    a.tokens[m] = a.argmax[r];  // unreachable in exact arithmetic: the last block reaches total
  }
};

// The two passes as select_isa_kernel (cpu_isa.h) wants them: a class per vector width W.
template <int W>
struct RowStats {
  static VLLM_PP_INLINE void run(const SampleArgs& a, int64_t r) {
    SampleKernel<W>::row_stats(a, r);
  }
};

template <int W>
struct Draw {
  static VLLM_PP_INLINE void run(const SampleArgs& a, int64_t m) { SampleKernel<W>::draw(a, m); }
};

}  // namespace

void sample_from_logits(const at::Tensor& logits, const at::Tensor& draw_rows,
                        const at::Tensor& uniforms, at::Tensor& tokens, at::Tensor& argmax,
                        at::Tensor& lse) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_from_logits: logits must be float32 [N, V] with contiguous rows");
  const int64_t N = logits.size(0), V = logits.size(1), M = draw_rows.numel();
  TORCH_CHECK(V > 0, "sample_from_logits: empty vocabulary");
  TORCH_CHECK(draw_rows.dim() == 1 && draw_rows.scalar_type() == at::kLong &&
                  draw_rows.is_contiguous(),
              "sample_from_logits: draw_rows must be contiguous int64 [M]");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == M &&
                  uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous(),
              "sample_from_logits: uniforms must be contiguous float32 [M]");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == M && tokens.scalar_type() == at::kLong &&
                  tokens.is_contiguous(),
              "sample_from_logits: tokens must be contiguous int64 [M]");
  TORCH_CHECK(argmax.dim() == 1 && argmax.size(0) == N && argmax.scalar_type() == at::kLong &&
                  argmax.is_contiguous(),
              "sample_from_logits: argmax must be contiguous int64 [N]");
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == N && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous(),
              "sample_from_logits: lse must be contiguous float32 [N]");
  for (const auto& t : {logits, draw_rows, uniforms, tokens, argmax, lse})
    TORCH_CHECK(t.device().is_cpu(), "sample_from_logits: CPU tensors only");
  const int64_t* rows = draw_rows.data_ptr<int64_t>();
  const float* u = uniforms.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(rows[m] >= 0 && rows[m] < N, "sample_from_logits: draw_rows[", m, "] = ",
                rows[m], " outside [0, ", N, ")");
    TORCH_CHECK(u[m] > 0.0f && u[m] <= 1.0f, "sample_from_logits: uniforms[", m, "] = ", u[m],
                " outside (0, 1]");
  }
  if (N == 0) return;

  std::vector<float> row_max(N), row_total(N);
  SampleArgs a{logits.data_ptr<float>(), N, V, logits.stride(0), row_max.data(),
               row_total.data(), argmax.data_ptr<int64_t>(), lse.data_ptr<float>(), rows, u,
               tokens.data_ptr<int64_t>()};
  const auto stats = select_isa_kernel<RowStats, const SampleArgs&, int64_t>();
  const auto draw = select_isa_kernel<Draw, const SampleArgs&, int64_t>();
  // A row is ~50-150k element operations: a few rows per task amortise the task start-up.
  at::parallel_for(0, N, /*grain_size=*/4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) stats(a, r);
  });
  at::parallel_for(0, M, /*grain_size=*/4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) draw(a, m);
  });
}

}  // namespace vllm_pp

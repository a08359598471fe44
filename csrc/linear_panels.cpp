// Dense float32 matmul on weights packed in column panels: out[M, N] = x[M, K] @ W^T (+ bias).
//
// Why not oneDNN's prepacked layout: at the row counts of a decode step (1-32 rows) the
// weights stream from memory once per step, and oneDNN's single-thread kernel waits on them
// and computes in turn (32 GFLOP/s over SmolLM2's 538 MB at 16 rows, AVX2 EPYC). Here the
// first row block of each panel prefetches the next panel, so memory and arithmetic overlap:
// 1.29x oneDNN at 1 row, 1.76x at 4, 1.22x at 16, 1.31x at 32, 1.12x at 128 and 1.04x at 512
// (benchmarks/linear_layouts.py; docs/PERFORMANCE.md, "Panel matmuls").
//
// Layout (vllm/model_executor/layers/packed_weight.py packs it): W [N, K] becomes
// panels [P = ceil(N / 16), K, 16], panel p holding columns 16p..16p+15 of the output, each k
// one 64-byte line of 16 weights (the last panel zero-padded). A kernel step broadcasts one
// x value per row and multiplies it into the line: rows x 16 columns of accumulators in 12
// vector registers. The AVX2 kernel (also what an AVX-512 CPU runs: no AVX-512 variant is
// written, and packed_weight.py keeps oneDNN there by default) is written with intrinsics, 6
// rows per block: GCC compiled the vector-extension form (the generic kernel below, at 8
// lanes) to a scalar add and a register broadcast per x value, 1.2-1.6x slower. Every variant
// sums each output in the same order (bias, then k = 0, 1, ...), with FMA on AVX2 and a
// multiply and an add in the generic one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>

#include "cpu_isa.h"
#include "cpu_simd.h"
#include "ops.h"

namespace vllm_pp {
namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: one 64-byte line per k

// The generic kernel (4 lanes, 3 rows per block), for CPUs without AVX2.
template <int W>
struct PanelKernel {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  static constexpr int V = kPanel / W;        // vectors per row of a panel
  static constexpr int R = 12 / V;            // rows per register block
  static_assert(kPanel % W == 0, "a panel is a whole number of vectors");


  // rows (<= R) rows of x [rows, K] times one panel B [K, 16] into y (row stride ldy), the
  // first `cols` columns stored. Rows past `rows` repeat row 0: computed, never stored (one
  // code path for every row count keeps the accumulators in registers). `next` is prefetched
  // line by line when not null: the panel the caller multiplies next.
  static VLLM_PP_INLINE void block(const float* x, int64_t rows, int64_t K, const float* B,
                                   const float* bias, const float* next, float* y, int64_t ldy,
                                   int64_t cols) {
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x + (r < rows ? r : 0) * K;
    f32 acc[R][V];
    for (int v = 0; v < V; ++v) {
      const f32 b = bias != nullptr ? S::load(bias + v * W) : S::splat(0.0f);
      for (int r = 0; r < R; ++r) acc[r][v] = b;
    }
    for (int64_t k = 0; k < K; ++k) {
      const float* line = B + k * kPanel;
      f32 b[V];
      for (int v = 0; v < V; ++v) b[v] = S::load(line + v * W);
      if (next != nullptr) __builtin_prefetch(next + k * kPanel, 0, 3);
      for (int r = 0; r < R; ++r) {
        const f32 a = S::splat(xr[r][k]);
        for (int v = 0; v < V; ++v) acc[r][v] += a * b[v];
      }
    }
    for (int r = 0; r < R && r < rows; ++r) {
      if (cols == kPanel) {
        for (int v = 0; v < V; ++v) S::store(y + r * ldy + v * W, acc[r][v]);
      } else {  // the last, zero-padded panel: only its real columns exist in y
        float tmp[kPanel];
        for (int v = 0; v < V; ++v) S::store(tmp + v * W, acc[r][v]);
        std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
      }
    }
  }
};

#if defined(__x86_64__)
#define VLLM_PP_AVX2_INLINE VLLM_PP_AVX2 inline __attribute__((always_inline))

// The AVX2 block: 6 rows x 16 columns in 12 named ymm accumulators (an array of them was kept
// on the stack by GCC, every iteration). Same contract as PanelKernel::block; the prefetch is
// a template flag so the loop has no branch.
template <bool kPrefetch>
VLLM_PP_AVX2_INLINE void block_avx2(const float* x, int64_t rows, int64_t K, const float* B,
                                    const float* bias, const float* next, float* y,
                                    int64_t ldy, int64_t cols) {
  const float* x0 = x;
  const float* x1 = rows > 1 ? x + K : x;
  const float* x2 = rows > 2 ? x + 2 * K : x;
  const float* x3 = rows > 3 ? x + 3 * K : x;
  const float* x4 = rows > 4 ? x + 4 * K : x;
  const float* x5 = rows > 5 ? x + 5 * K : x;
  const __m256 lo = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 hi = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 c00 = lo, c01 = hi, c10 = lo, c11 = hi, c20 = lo, c21 = hi, c30 = lo, c31 = hi,
         c40 = lo, c41 = hi, c50 = lo, c51 = hi;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * kPanel), b1 = _mm256_loadu_ps(B + k * kPanel + 8);
    if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T0);
    // Row i: x[i, k] broadcast, times the line's two halves, into its two accumulators.
#define VLLM_PP_PANEL_ROW(i)                          \
  {                                                   \
    const __m256 a = _mm256_broadcast_ss(x##i + k);   \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);        \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);        \
  }
    VLLM_PP_PANEL_ROW(0)
    VLLM_PP_PANEL_ROW(1)
    VLLM_PP_PANEL_ROW(2)
    VLLM_PP_PANEL_ROW(3)
    VLLM_PP_PANEL_ROW(4)
    VLLM_PP_PANEL_ROW(5)
#undef VLLM_PP_PANEL_ROW
  }
  const __m256 acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                            {c30, c31}, {c40, c41}, {c50, c51}};
  for (int64_t r = 0; r < rows; ++r) {
    if (cols == kPanel) {
      _mm256_storeu_ps(y + r * ldy, acc[r][0]);
      _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    } else {  // the last, zero-padded panel: only its real columns exist in y
      float tmp[kPanel];
      _mm256_storeu_ps(tmp, acc[r][0]);
      _mm256_storeu_ps(tmp + 8, acc[r][1]);
      std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
    }
  }
}

// The AVX2 kernel as a block policy of run_panels (a call per block: an always_inline AVX2
// function cannot be inlined into the ISA-neutral driver).
struct Avx2Block {
  static constexpr int64_t R = 6;
  VLLM_PP_AVX2 static void block(const float* x, int64_t rows, int64_t K, const float* B,
                                 const float* bias, const float* next, float* y, int64_t ldy,
                                 int64_t cols) {
    if (next != nullptr) {
      block_avx2<true>(x, rows, K, B, bias, next, y, ldy, cols);
    } else {
      block_avx2<false>(x, rows, K, B, bias, nullptr, y, ldy, cols);
    }
  }
};
#endif

// Panels [p0, p1) for every row of x, with Block's kernel (Block::R rows at a time). For each
// panel the row blocks run one after the other over it (read from memory by the first block,
// from cache by the rest); the first block prefetches the next panel so it arrives while this
// one is multiplied.
template <typename Block>
void run_panels(const float* x, int64_t M, int64_t K, const float* panels, const float* bias,
                float* out, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* B = panels + p * K * kPanel;
    const float* next = p + 1 < p1 ? B + K * kPanel : nullptr;
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    const float* pb = nullptr;
    float bias_panel[kPanel] = {};
    if (bias != nullptr) {
      std::memcpy(bias_panel, bias + p * kPanel, cols * sizeof(float));
      pb = bias_panel;
    }
    for (int64_t m = 0; m < M; m += Block::R) {
      Block::block(x + m * K, std::min<int64_t>(Block::R, M - m), K, B, pb,
                   m == 0 ? next : nullptr, out + m * N + p * kPanel, N, cols);
    }
  }
}

using PanelFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*,
                         int64_t, int64_t, int64_t);

// The variant for the active ISA (cpu_isa.h; AVX-512 CPUs run the AVX2 one).
PanelFn select_panel_kernel() {
#if defined(__x86_64__)
  if (active_isa().load() >= VLLM_PP_ISA_AVX2) return run_panels<Avx2Block>;
#endif
  return run_panels<PanelKernel<4>>;
}

}  // namespace

void linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "linear_panels: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel &&
                  panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "linear_panels: panels must be a contiguous float32 [P, K, 16] tensor");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "linear_panels: x has ", K, " columns, the panels ",
              panels.size(1));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(),
              "linear_panels: out must be a contiguous float32 [M, N] tensor");
  const int64_t N = out.size(1);
  TORCH_CHECK((N + kPanel - 1) / kPanel == P, "linear_panels: ", P, " panels cannot hold ", N,
              " output columns");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "linear_panels: bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const PanelFn fn = select_panel_kernel();
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Threads split the panels (each its own range of weights, so each streams its own part
  // of memory); a few panels per task keep the prefetch of the next one useful.
  at::parallel_for(0, P, /*grain_size=*/8, [&](int64_t p0, int64_t p1) {
    fn(xp, M, K, wp, b, op, N, p0, p1);
  });
}

}  // namespace vllm_pp

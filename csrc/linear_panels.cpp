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
// one 64-byte line of 16 weights (the last panel zero-padded). The register block that
// multiplies rows of x into one panel is panel_block.h's (AVX2 intrinsics, 6 rows x 16 columns
// in 12 ymm accumulators, also what an AVX-512 CPU runs: no AVX-512 variant is written, and
// packed_weight.py keeps oneDNN there by default; a generic vector-extension block elsewhere).
// This file drives it over the panels and the rows, and splits the panels over threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu_isa.h"
#include "ops.h"
#include "panel_block.h"

namespace vllm_pp {
namespace {

using panels::kPanel;
using panels::PanelKernel;
#if defined(__x86_64__)
using panels::Avx2Block;
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
    panels::rows_times_panel<Block>(x, K, M, K, B, pb, next, out + p * kPanel, N, cols);
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

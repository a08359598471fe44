// The register block of the panel matmuls: up to R rows of x [rows, K] (row stride ldx) times
// one panel B [K, 16] (one 64-byte line of 16 columns per k) into y (row stride ldy), the
// first `cols` columns stored. linear_panels.cpp runs it over packed weights; the prefill
// attention kernel (prefill_attention.cpp) over keys and values packed the same way.
//
// Rows past `rows` repeat row 0: computed, never stored (one code path for every row count
// keeps the accumulators in registers). Every variant sums each output in the same order
// (bias, then k = 0, 1, ...), with FMA on AVX2 and a multiply and an add in the generic one.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_isa.h"
#include "cpu_simd.h"

namespace vllm_pp::panels {

constexpr int64_t kPanel = 16;  // columns per panel: one 64-byte line per k

// The generic block (W lanes, 12 / (16 / W) rows): for CPUs without AVX2. `next` is
// prefetched line by line when not null: the panel the caller multiplies next.
template <int W>
struct PanelKernel {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  static constexpr int V = kPanel / W;  // vectors per row of a panel
  static constexpr int64_t R = 12 / V;  // rows per register block
  static_assert(kPanel % W == 0, "a panel is a whole number of vectors");

  static VLLM_PP_INLINE void block(const float* x, int64_t ldx, int64_t rows, int64_t K,
                                   const float* B, const float* bias, const float* next,
                                   float* y, int64_t ldy, int64_t cols) {
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x + (r < rows ? r : 0) * ldx;
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
      } else {  // a last, zero-padded panel: only its real columns exist in y
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
// on the stack by GCC, every iteration; GCC's vector extensions turned each broadcast into a
// scalar add plus a register shuffle, 1.2-1.6x slower). Same contract as PanelKernel::block;
// the prefetch is a template flag so the loop has no branch.
template <bool kPrefetch>
VLLM_PP_AVX2_INLINE void block_avx2(const float* x, int64_t ldx, int64_t rows, int64_t K,
                                    const float* B, const float* bias, const float* next,
                                    float* y, int64_t ldy, int64_t cols) {
  const float* x0 = x;
  const float* x1 = rows > 1 ? x + ldx : x;
  const float* x2 = rows > 2 ? x + 2 * ldx : x;
  const float* x3 = rows > 3 ? x + 3 * ldx : x;
  const float* x4 = rows > 4 ? x + 4 * ldx : x;
  const float* x5 = rows > 5 ? x + 5 * ldx : x;
  const __m256 lo = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 hi = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 c00 = lo, c01 = hi, c10 = lo, c11 = hi, c20 = lo, c21 = hi, c30 = lo, c31 = hi,
         c40 = lo, c41 = hi, c50 = lo, c51 = hi;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * kPanel), b1 = _mm256_loadu_ps(B + k * kPanel + 8);
    if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T0);
    // Row i: x[i, k] broadcast, times the line's two halves, into its two accumulators.
#define VLLM_PP_PANEL_ROW(i)                        \
  {                                                 \
    const __m256 a = _mm256_broadcast_ss(x##i + k); \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);      \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);      \
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
    } else {  // a last, zero-padded panel: only its real columns exist in y
      float tmp[kPanel];
      _mm256_storeu_ps(tmp, acc[r][0]);
      _mm256_storeu_ps(tmp + 8, acc[r][1]);
      std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
    }
  }
}

// The AVX2 block as a policy with PanelKernel's interface: a call per block, never inlined.
// Callers compiled for the baseline ISA could not inline it anyway; inlined into an AVX2
// caller's loop, GCC kept the accumulators in memory and the fused GGUF prefill matmul ran
// at 0.4x the speed of the same block called.
struct Avx2Block {
  static constexpr int64_t R = 6;
  VLLM_PP_AVX2 __attribute__((noinline)) static void block(const float* x, int64_t ldx,
                                                          int64_t rows, int64_t K,
                                                          const float* B, const float* bias,
                                                          const float* next, float* y,
                                                          int64_t ldy, int64_t cols) {
    if (next != nullptr) {
      block_avx2<true>(x, ldx, rows, K, B, bias, next, y, ldy, cols);
    } else {
      block_avx2<false>(x, ldx, rows, K, B, bias, nullptr, y, ldy, cols);
    }
  }
};
#endif

// The block a kernel of vector width W calls: the AVX2 one for W >= 8 (AVX-512 runs it too),
// the generic one otherwise.
#if defined(__x86_64__)
template <int W>
using BlockFor = std::conditional_t<(W >= 8), Avx2Block, PanelKernel<4>>;
#else
template <int W>
using BlockFor = PanelKernel<4>;
#endif

// Rows [0, rows) of x (row stride ldx) times one panel B [K, 16] into y (row stride ldy), the
// first `cols` columns stored, Block::R rows at a time; the first block prefetches `next`
// (nullptr: nothing to prefetch).
template <typename Block>
inline void rows_times_panel(const float* x, int64_t ldx, int64_t rows, int64_t K,
                             const float* B, const float* bias, const float* next, float* y,
                             int64_t ldy, int64_t cols) {
  for (int64_t m = 0; m < rows; m += Block::R) {
    Block::block(x + m * ldx, ldx, std::min<int64_t>(Block::R, rows - m), K, B, bias,
                 m == 0 ? next : nullptr, y + m * ldy, ldy, cols);
  }
}

}  // namespace vllm_pp::panels

// Row access for the CPU kernels: Vec<W, scalar_t> loads and stores chunks of a row of float32
// or bfloat16 (computing in fp32), a shorter last chunk going through the same vector code, and
// marks the points where torch rounds a materialised result. Shared by the elementwise kernels
// and the LoRA update; like cpu_simd.h, everything is always_inline so that it is compiled
// inside each ISA-specific caller.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_simd.h"

// For the lambdas passed to Vec::chunks. A lambda is a function of its own: it does not
// inherit the caller's target attribute, so unless it is inlined it is compiled for baseline
// x86-64, where 16-lane vectors are emulated through the stack (cpu_simd.h).
#define VLLM_PP_LAMBDA_INLINE __attribute__((always_inline))

namespace vllm_pp {

// Vector access to rows of scalar_t for width W, computing in fp32.
template <int W, typename scalar_t>
struct Vec {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  using u32 = typename S::u32;
  static constexpr bool kBF16 = std::is_same_v<scalar_t, c10::BFloat16>;

  // n <= W elements from p; the lanes past n are 0. The tail of a row goes through the same
  // vector code as the rest, so every element is computed alike.
  template <typename T>
  static VLLM_PP_INLINE f32 load(const T* p, int64_t n) {
    if (n == W) return S::load(p);
    T buf[W] = {};
    std::copy(p, p + n, buf);
    return S::load(buf);
  }

  // The first n <= W lanes of v to p, rounded to scalar_t.
  static VLLM_PP_INLINE void store(scalar_t* p, f32 v, int64_t n) {
    if (n == W) return S::store(p, v);
    scalar_t buf[W];
    S::store(buf, v);
    std::copy(buf, buf + n, p);
  }

  // v as torch would hold it in a scalar_t tensor: rounded to bf16, or in fp32 materialised as
  // an fp32 value. The empty asm claims to modify v, so the compiler cannot fuse the operation
  // that produced v with the one that consumes it (an FMA would skip this rounding).
  static VLLM_PP_INLINE f32 round(f32 v) {
    if constexpr (kBF16) {
      return S::round_bf16(v);
    } else {
#if defined(__x86_64__) || defined(__i386__)
      asm("" : "+v"(v));  // any SSE/AVX register
#elif defined(__aarch64__)
      asm("" : "+w"(v));  // any SIMD register
#else
      asm("" : "+m"(v));
#endif
      return v;
    }
  }

  // f(d, n) for the chunks [d, d + n) of [0, len): n == W but for a shorter last chunk. Once f
  // is inlined, the main loop sees n == W as a constant and keeps no tail branches.
  template <typename F>
  static VLLM_PP_INLINE void chunks(int64_t len, F&& f) {
    int64_t d = 0;
    for (; d + W <= len; d += W) f(d, int64_t{W});
    if (d < len) f(d, len - d);
  }
};

}  // namespace vllm_pp

// Run-time choice of the instruction set the CPU kernels use, and the one dispatcher every
// kernel goes through.
//
// The library is compiled for baseline x86-64. A kernel is written once as a class template
// over its vector width W (`Kernel<W>::run(args...)`, always_inline, built on Simd<W> of
// cpu_simd.h); select_isa_kernel<Kernel, Args...>() returns its entry point compiled for the
// active ISA: Kernel<16> inside a function carrying the AVX-512 target attribute, Kernel<8>
// inside an AVX2 one, Kernel<4> otherwise. One choice for every kernel, made once at load
// time; tests lower it with set_cpu_isa to check every variant on one machine.
#pragma once

#include <atomic>

// 0 = generic (4-lane vectors), 1 = AVX2 + FMA (8 lanes), 2 = AVX-512 (16 lanes).
#define VLLM_PP_ISA_GENERIC 0
#define VLLM_PP_ISA_AVX2 1
#define VLLM_PP_ISA_AVX512 2

#if defined(__x86_64__)
#define VLLM_PP_AVX2 __attribute__((target("avx2,fma")))
#define VLLM_PP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#endif

namespace vllm_pp {

// The ISA rank every kernel dispatches on (see cpu_isa.cpp).
std::atomic<int>& active_isa();

// One entry point per ISA for Kernel. The target attribute lets the compiler use that ISA
// inside the function and everything inlined into it (the kernel's run() and its Simd<W>
// helpers are always_inline), while the rest of the library stays baseline. The vector width
// must be the ISA's native one: a 16-lane vector built for AVX2 is emulated through the stack.
template <template <int> class Kernel, typename... Args>
struct IsaEntries {
  static void generic(Args... args) { Kernel<4>::run(args...); }
#if defined(__x86_64__)
  VLLM_PP_AVX2 static void avx2(Args... args) { Kernel<8>::run(args...); }
  VLLM_PP_AVX512 static void avx512(Args... args) { Kernel<16>::run(args...); }
#endif
};

// Kernel's entry point for the active ISA. Call it once per op and reuse the pointer inside
// the parallel loop (the choice is a load and a switch; the call is indirect either way).
template <template <int> class Kernel, typename... Args>
auto select_isa_kernel() -> void (*)(Args...) {
  using Entries = IsaEntries<Kernel, Args...>;
#if defined(__x86_64__)
  switch (active_isa().load()) {
    case VLLM_PP_ISA_AVX512:
      return Entries::avx512;
    case VLLM_PP_ISA_AVX2:
      return Entries::avx2;
  }
#endif
  return Entries::generic;
}

}  // namespace vllm_pp

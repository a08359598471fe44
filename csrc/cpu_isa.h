// Run-time choice of the instruction set the CPU kernels use.
//
// The library is compiled for baseline x86-64; each kernel is instantiated once per ISA inside
// a function carrying the matching target attribute (VLLM_PP_AVX2 / VLLM_PP_AVX512), and the
// caller picks the instantiation with active_isa(). One choice for every kernel, made once at
// load time; tests lower it with set_cpu_isa to check every variant on one machine.
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

}  // namespace vllm_pp

// Portable 16-lane float SIMD for the CPU kernels, built on GCC/Clang vector extensions.
//
// Why vector extensions rather than intrinsics: the same source compiles to AVX-512 (one zmm
// register per vector), AVX2 (two ymm) or plain SSE2 (four xmm), depending only on the target
// attribute of the function it is inlined into. The kernels are therefore written once and
// instantiated per instruction set (see attention.cpp), with the choice made at run time, so the
// extension never needs -march=native and runs on any x86-64 (and non-x86) machine.
//
// Everything here is `always_inline`: a helper must be compiled inside the ISA-specific caller,
// never as a shared out-of-line copy built for the baseline ISA.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#define VLLM_PP_INLINE inline __attribute__((always_inline))

namespace vllm_pp::simd {

constexpr int64_t kLanes = 16;

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

VLLM_PP_INLINE f32x16 splat(float x) { return f32x16{} + x; }

// Unaligned loads: memcpy is the portable way to say "no alignment assumed"; it compiles to a
// single vector load.
VLLM_PP_INLINE f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bfloat16 is the top half of a float32, so widening is exact: zero-extend to 32 bits and shift.
VLLM_PP_INLINE f32x16 load(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  // A C-style cast between same-sized vector types reinterprets the bits (GCC and Clang).
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
}

VLLM_PP_INLINE void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

VLLM_PP_INLINE float to_float(float x) { return x; }
VLLM_PP_INLINE float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Sum of the 16 lanes by halving (16 -> 8 -> 4 -> 1), a fixed order independent of the ISA.
VLLM_PP_INLINE float reduce_add(f32x16 v) {
  f32x8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(lo8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(lo8), sizeof(hi8));
  const f32x8 s8 = lo8 + hi8;
  f32x4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof(lo4), sizeof(hi4));
  const f32x4 s4 = lo4 + hi4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

VLLM_PP_INLINE float reduce_max(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

VLLM_PP_INLINE f32x16 max(f32x16 a, f32x16 b) { return a > b ? a : b; }

// exp(x) for x <= 0, the only range softmax needs once the row maximum is subtracted.
// Cephes' expf: x = n*ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n built in
// the exponent bits. Relative error ~1e-7, i.e. within an ulp or two of libm's expf, which is
// what keeps the kernel within fp32 tolerance of torch.softmax. Inputs below -87.3 (including
// -inf) return exactly 0 where libm would return a denormal; NaN stays NaN.
VLLM_PP_INLINE f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lowest = splat(-87.3f);  // e^-87.3 ~ 1.2e-38, the smallest normal float
  const f32x16 xc = x < lowest ? lowest : x;
  // Round x*log2(e) to the nearest integer: adding 1.5*2^23 pushes the fraction out of the
  // mantissa (exact for |v| < 2^22), without depending on the rounding mode or on SSE4.1.
  const f32x16 magic = splat(12582912.0f);
  const f32x16 n = (xc * 1.44269504088896341f + magic) - magic;
  // ln2 split into a part exact in float and a correction, so r keeps full precision.
  f32x16 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n with n in [-126, 0]: the biased exponent n + 127 is in [1, 127], always normal.
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  const f32x16 result = p * (f32x16)bits;
  return x < lowest ? f32x16{} : result;
}

}  // namespace vllm_pp::simd

// Portable float SIMD for the CPU kernels, built on GCC/Clang vector extensions.
//
// Why vector extensions rather than intrinsics: the kernels are written once, against
// Simd<W>, and instantiated per instruction set with the vector width that is native to it:
// W = 16 floats (one zmm register) for AVX-512, 8 (ymm) for AVX2, 4 (xmm / NEON) otherwise.
// The ISA is chosen at run time (see cpu_isa.h), so the extension never needs
// -march=native. The width must match the ISA: a 16-lane vector built for AVX2 is emulated
// through the stack and runs several times slower.
//
// Everything here is `always_inline`: a helper must be compiled inside the ISA-specific caller,
// never as a shared out-of-line copy built for the baseline ISA.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#define VLLM_PP_INLINE inline __attribute__((always_inline))

namespace vllm_pp::simd {

// The vector types of each width (vector_size needs a constant, hence one block per width).
template <int W>
struct Types;
template <>
struct Types<4> {
  typedef float f32 __attribute__((vector_size(16)));
  typedef int32_t i32 __attribute__((vector_size(16)));
  typedef uint32_t u32 __attribute__((vector_size(16)));
  typedef uint16_t u16 __attribute__((vector_size(8)));
};
template <>
struct Types<8> {
  typedef float f32 __attribute__((vector_size(32)));
  typedef int32_t i32 __attribute__((vector_size(32)));
  typedef uint32_t u32 __attribute__((vector_size(32)));
  typedef uint16_t u16 __attribute__((vector_size(16)));
};
template <>
struct Types<16> {
  typedef float f32 __attribute__((vector_size(64)));
  typedef int32_t i32 __attribute__((vector_size(64)));
  typedef uint32_t u32 __attribute__((vector_size(64)));
  typedef uint16_t u16 __attribute__((vector_size(32)));
};

template <int W>
struct Simd {
  static constexpr int64_t kLanes = W;
  using f32 = typename Types<W>::f32;
  using i32 = typename Types<W>::i32;
  using u32 = typename Types<W>::u32;
  using u16 = typename Types<W>::u16;

  static VLLM_PP_INLINE f32 splat(float x) { return f32{} + x; }

  // Unaligned loads and stores: memcpy is the portable way to say "no alignment assumed"; it
  // compiles to a single vector move.
  static VLLM_PP_INLINE f32 load(const float* p) {
    f32 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }

  // bfloat16 is the top half of a float32, so widening is exact: zero-extend and shift.
  // (A C-style cast between same-sized vector types reinterprets the bits.)
  static VLLM_PP_INLINE f32 load(const c10::BFloat16* p) {
    u16 h;
    std::memcpy(&h, p, sizeof(h));
    return (f32)(__builtin_convertvector(h, u32) << 16);
  }

  static VLLM_PP_INLINE void store(float* p, f32 v) { std::memcpy(p, &v, sizeof(v)); }

  // v rounded to bfloat16 (the result's low 16 bits are zero), exactly as c10::BFloat16(float)
  // rounds: to nearest, ties to even, by adding 0x7FFF plus the lowest kept bit; NaN becomes
  // the canonical quiet NaN (the sign and payload of NaN are not preserved, as in c10).
  static VLLM_PP_INLINE f32 round_bf16(f32 v) {
    const u32 bits = (u32)v;
    const u32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    return v != v ? (f32)(u32{} + 0x7FC00000u) : (f32)rounded;
  }

  // Narrowing store: each lane rounded to bfloat16 as round_bf16 does.
  static VLLM_PP_INLINE void store(c10::BFloat16* p, f32 v) {
    const u16 h = __builtin_convertvector((u32)round_bf16(v) >> 16, u16);
    std::memcpy(p, &h, sizeof(h));
  }

  static VLLM_PP_INLINE f32 max(f32 a, f32 b) { return a > b ? a : b; }

  // Sum of the lanes by halving down to four, then a fixed order.
  static VLLM_PP_INLINE float reduce_add(f32 v) {
    if constexpr (W == 4) {
      return (v[0] + v[2]) + (v[1] + v[3]);
    } else {
      using Half = Simd<W / 2>;
      typename Half::f32 lo, hi;
      std::memcpy(&lo, &v, sizeof(lo));
      std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
      return Half::reduce_add(lo + hi);
    }
  }

  static VLLM_PP_INLINE float reduce_max(f32 v) {
    float m = v[0];
    for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }

  // exp(x) for x <= 0, the only range softmax needs once the row maximum is subtracted.
  // Cephes' expf: x = n*ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n built in
  // the exponent bits. Relative error ~1e-7, i.e. within an ulp or two of libm's expf, which
  // keeps the kernel within fp32 tolerance of torch.softmax. Inputs below -87.3 (including
  // -inf) give exactly 0 where libm would give a denormal; NaN stays NaN.
  static VLLM_PP_INLINE f32 exp_nonpositive(f32 x) {
    const f32 lowest = splat(-87.3f);  // e^-87.3 ~ 1.2e-38, about the smallest normal float
    const f32 xc = x < lowest ? lowest : x;
    // Round x*log2(e) to the nearest integer: adding 1.5*2^23 pushes the fraction out of the
    // mantissa (exact for |v| < 2^22) without depending on the rounding mode or on SSE4.1.
    const f32 magic = splat(12582912.0f);
    const f32 n = (xc * 1.44269504088896341f + magic) - magic;
    // ln2 split into a part exact in float and a correction, so r keeps full precision.
    f32 r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    f32 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    // 2^n with n in [-126, 0]: the biased exponent n + 127 is in [1, 127], always normal.
    const i32 bits = (__builtin_convertvector(n, i32) + 127) << 23;
    const f32 result = p * (f32)bits;
    return x < lowest ? f32{} : result;
  }
};

VLLM_PP_INLINE float to_float(float x) { return x; }
VLLM_PP_INLINE float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

}  // namespace vllm_pp::simd

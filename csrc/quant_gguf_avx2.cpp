// The GGUF matmul with AVX2 + FMA + F16C: y[T, N] = x[T, K] @ W^T, W in the kernels' row layout
// (quant_gguf.h), in tiles of up to 4 tokens (quant_gguf.cpp calls it for up to 8 tokens, 4 for
// the K-quants). The AVX2 counterpart of quant_gguf_avx512.cpp, for CPUs without AVX-512: the
// generic vector-extension kernel (quant_gguf.cpp's Tile at W = 8) keeps its accumulators on
// the stack and widens the nibbles through byte shuffles; this one keeps every accumulator in a
// ymm register, widens a block's quants with vpmovzxbd / vpmovsxbd, loads the scales with
// vcvtph2ps and prefetches the next tile.
//
// Per block of 32 weights and row, as 4 vectors of 8 weights (v: weights 8v .. 8v + 7):
//   Q4_0 / Q4_1: bytes 0-7 and 8-15 zero-extended to dwords once; their low nibbles are
//     weights 0-15, their high nibbles (the dwords shifted right by 4) weights 16-31. Each
//     vector is converted to fp32 (exact) and scaled: d * q + m as one FMA (Q4_1), or
//     (q - 8) * d (Q4_0). The AVX-512 kernel's table lookup instead (here two 8-entry vpermps
//     and a blend on bit 3 of the index, as vpermps on ymm reads 3 index bits) measured 1.3x
//     slower: 4 instructions per vector against 3 (docs/PERFORMANCE.md, Quantized GGUF).
//   Q8_0: 8 int8 sign-extended and converted (exact), times d.
//   Q4_K / Q5_K / Q6_K (ktile): per super-block of 256 weights and row, the 8 groups' floats
//     (k_scales: the values of quant_gguf.h's k_group_scales), then per group of 32 the quants
//     built from their low nibbles (and high bits) as dwords, converted and scaled: q * s + t,
//     or (q - 32) * s (weights 0-15) and * t (16-31).
// Each weight is the value the numpy dequantization gives (d * q is exact in fp32), and it is
// multiplied into the same accumulator lane in the same order as the generic kernel at W = 8
// (lane l: weights l, l + 8, l + 16, ... of the row, then Simd<8>::reduce_add), so both
// kernels, and the decoded-rows path of more tokens, give bit-identical results.
//
// A tile of RT rows x TT tokens keeps RT * TT accumulators in registers, 4 (4 x 1, 2 x 2,
// 1 x 4) or, for Q8_0, 8 (8 x 1, 4 x 2, 2 x 4): with 16 ymm registers, 8 accumulators next
// to the 4 weight vectors and the constants of the 4-bit decodes measured 1.1x slower; Q8_0's
// decode needs fewer and runs 1.4x faster with 8. The x of a block is read from L1 by the FMAs.

#include "quant_gguf.h"

#if defined(__x86_64__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_isa.h"
#include "cpu_simd.h"

// AVX2 + FMA (cpu_isa.h's VLLM_PP_AVX2) and F16C, which every AVX2 CPU has (cpu_isa.cpp
// requires it for the AVX2 rank).
#define VLLM_PP_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#define VLLM_PP_AVX2_INLINE VLLM_PP_AVX2_F16C inline __attribute__((always_inline))
#define VLLM_PP_GGUF_TARGET VLLM_PP_AVX2_F16C
#include "quant_gguf_driver.h"

namespace vllm_pp::gguf {
namespace {

VLLM_PP_AVX2_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bfloat16 is the top half of a float32: zero-extend and shift (exact).
VLLM_PP_AVX2_INLINE __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 bytes at p zero- or sign-extended to dwords.
VLLM_PP_AVX2_INLINE __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
VLLM_PP_AVX2_INLINE __m256i s8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// The 16 fp16 numbers at p as fp32 in out[16] (exact). Only the first n <= 16 are wanted;
// `readable` says whether all 32 bytes at p lie inside the row (then they are read directly,
// the extra lanes ignored), otherwise the n halves are copied out first.
VLLM_PP_AVX2_INLINE void halves16(const uint8_t* p, int64_t n, bool readable, float* out) {
  __m128i h0, h1;
  if (readable) {
    h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  } else {
    alignas(16) uint8_t buf[32] = {};
    std::memcpy(buf, p, 2 * n);
    h0 = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    h1 = _mm_load_si128(reinterpret_cast<const __m128i*>(buf + 16));
  }
  _mm256_store_ps(out, _mm256_cvtph_ps(h0));
  _mm256_store_ps(out + 8, _mm256_cvtph_ps(h1));
}

// Each accumulator's 8 lanes summed into out[tok + t, row + r] in Simd<8>::reduce_add's order.
template <int RT, int TT, typename scalar_t>
VLLM_PP_AVX2_INLINE void store_tile(const LinearArgs& a, const __m256 (&acc)[RT][TT],
                                    int64_t row, int64_t tok) {
  auto* out = static_cast<scalar_t*>(a.out);
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const float sum = simd::Simd<8>::reduce_add((simd::Simd<8>::f32)acc[r][t]);
      out[(tok + t) * a.out_stride + row + r] = static_cast<scalar_t>(sum);
    }
}

// acc[r][t] += w[v] * x_t[v] for v = 0..3 in order (the generic kernel's order), x read from
// the block's 32 activations of each token.
template <int RT, int TT, typename scalar_t>
VLLM_PP_AVX2_INLINE void accumulate(__m256 (&acc)[RT][TT], int r, const __m256 (&w)[4],
                                    const scalar_t* x, int64_t x_stride) {
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t)
      acc[r][t] = _mm256_fmadd_ps(w[v], load8(x + t * x_stride + 8 * v), acc[r][t]);
}

// The kernels, as quant_gguf_driver.h's tile policy (defined below).
struct Avx2Tiles {
  // Accumulators per tile (RT * TT): 8 for Q8_0, whose decode needs few registers; 4 for the
  // others (8 spilled and measured slower).
  static constexpr int accumulators(int64_t type) { return type == kQ8_0 ? 8 : 4; }
  // Rows [row, row + RT) x tokens [tok, tok + TT): 32-weight blocks, K-quant super-blocks.
  template <int64_t Type, int RT, int TT, typename scalar_t>
  VLLM_PP_AVX2_INLINE static void tile(const LinearArgs& a, int64_t row, int64_t tok);
  template <int64_t Type, int RT, int TT, typename scalar_t>
  VLLM_PP_AVX2_INLINE static void ktile(const LinearArgs& a, int64_t row, int64_t tok);
};

template <int64_t Type, int RT, int TT, typename scalar_t>
VLLM_PP_AVX2_INLINE void Avx2Tiles::tile(const LinearArgs& a, int64_t row, int64_t tok) {
  using L = Layout<Type>;
  const auto* x = static_cast<const scalar_t*>(a.x) + tok * a.x_stride;
  const uint8_t* w = a.w + row * a.row_bytes;
  const int64_t blocks = a.k / kBlock;
  __m256 acc[RT][TT];
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  alignas(32) float d[RT][16];
  alignas(32) float m[RT][16];
  // The next tile's bytes (its rows follow this tile's), prefetched a slice per block: the
  // hardware prefetcher does not follow the 2 x RT streams (scales and quants) a tile reads.
  const char* next = reinterpret_cast<const char*>(w + RT * a.row_bytes);
  const int64_t next_lines = (RT * a.row_bytes + 63) / 64;
  const int64_t lines_per_block = (next_lines + blocks - 1) / blocks;
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, blocks - b0);
    // The last scale (minimum) read ends inside the row: 32 bytes from it can be read whole.
    const int64_t scale_end = Type == kQ4_1 ? 2 * blocks + 2 * b0 + 32 : 2 * b0 + 32;
    const bool readable = scale_end <= a.row_bytes;
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r) {
      const uint8_t* w_row = w + r * a.row_bytes;
      halves16(w_row + 2 * b0, n, readable, d[r]);
      if constexpr (Type == kQ4_1) halves16(L::mins(w_row, blocks) + 2 * b0, n, readable, m[r]);
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = b0 + j;
      prefetch_slice(next, next_lines, lines_per_block, b);
      const scalar_t* xb = x + b * kBlock;
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r) {
        const uint8_t* qs = L::quants(w + r * a.row_bytes, blocks) + b * L::kQuantBytes;
        const __m256 dv = _mm256_broadcast_ss(&d[r][j]);
        __m256 wv[4];
        if constexpr (Type == kQ8_0) {
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v)
            wv[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(s8x8(qs + 8 * v)), dv);
        } else {
          const __m256i q0 = u8x8(qs), q1 = u8x8(qs + 8);  // bytes 0-7, 8-15
          __m256i q[4] = {_mm256_and_si256(q0, low4), _mm256_and_si256(q1, low4),
                          _mm256_srli_epi32(q0, 4), _mm256_srli_epi32(q1, 4)};
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {
            if constexpr (Type == kQ4_1) {
              wv[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[v]), dv, _mm256_broadcast_ss(&m[r][j]));
            } else {  // Q4_0: q - 8 is exact in int32 and fp32 alike
              wv[v] = _mm256_mul_ps(
                  _mm256_cvtepi32_ps(_mm256_sub_epi32(q[v], _mm256_set1_epi32(8))), dv);
            }
          }
        }
        accumulate<RT, TT>(acc, r, wv, xb, a.x_stride);
      }
    }
  }
  store_tile<RT, TT, scalar_t>(a, acc, row, tok);
}

// A K-quant group's 32 weights (w[v]: weights 8v .. 8v + 7) from super-block sb, group j, with
// its two floats s, t; the values of quant_gguf.cpp's KQuant<8>::decode.
template <int64_t Type>
VLLM_PP_AVX2_INLINE void k_group(const uint8_t* sb, int64_t j, float s, float t, __m256 (&w)[4]) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  if constexpr (Type == kQ4_K) {
    const uint8_t* ql = sb + 16 + 32 * (j / 2);
    const int nib = (j & 1) ? 4 : 0;  // the odd groups are the high nibbles
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256i q = _mm256_and_si256(_mm256_srli_epi32(u8x8(ql + 8 * v), nib), low4);
      w[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s), _mm256_set1_ps(t));
    }
  } else if constexpr (Type == kQ5_K) {
    const uint8_t* ql = sb + 48 + 32 * (j / 2);
    const int nib = (j & 1) ? 4 : 0;
    const int bit = static_cast<int>(j);
    const __m256i one = _mm256_set1_epi32(1);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(u8x8(ql + 8 * v), nib), low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(u8x8(sb + 16 + 8 * v), bit), one);
      const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
      w[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s), _mm256_set1_ps(t));
    }
  } else {  // Q6_K
    const int64_t i = j % 4;
    const uint8_t* ql = sb + 64 * (j / 4) + 32 * (i & 1);
    const uint8_t* qh = sb + 128 + 32 * (j / 4);
    const int nib = i >= 2 ? 4 : 0;
    const int shift = static_cast<int>(2 * i);
    const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(u8x8(ql + 8 * v), nib), low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(u8x8(qh + 8 * v), shift), three);
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
      w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(v < 2 ? s : t));
    }
  }
}

// A super-block's group floats as k_group_scales (quant_gguf.h) gives them, 16 lanes: Q4_K /
// Q5_K s_j = f[j], t_j = f[8 + j]; Q6_K s_j = f[2j], t_j = f[2j + 1]. The 6-bit scales and
// mins unpacked with 32-bit masks (llama.cpp's kmask trick), converted and scaled by d (or
// -dmin: the negation is exact); the products are exact as there.
template <int64_t Type>
VLLM_PP_AVX2_INLINE void k_scales(const uint8_t* sb, float* f) {
  if constexpr (Type == kQ6_K) {
    const __m256 d = _mm256_set1_ps(half_at(sb + 208));
    _mm256_store_ps(f, _mm256_mul_ps(_mm256_cvtepi32_ps(s8x8(sb + 192)), d));
    _mm256_store_ps(f + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(s8x8(sb + 200)), d));
  } else {
    uint32_t u[3], out[4];
    std::memcpy(u, sb + 4, 12);
    constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
    out[0] = u[0] & k6;                                       // sc 0-3
    out[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);         // sc 4-7
    out[2] = u[1] & k6;                                       // m 0-3
    out[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // m 4-7
    const auto* bytes = reinterpret_cast<const uint8_t*>(out);
    _mm256_store_ps(f, _mm256_mul_ps(_mm256_cvtepi32_ps(u8x8(bytes)),
                                     _mm256_set1_ps(half_at(sb))));
    _mm256_store_ps(f + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(u8x8(bytes + 8)),
                                         _mm256_set1_ps(-half_at(sb + 2))));
  }
}

// tile() for the K-quants: RT rows x TT tokens, a super-block at a time.
template <int64_t Type, int RT, int TT, typename scalar_t>
VLLM_PP_AVX2_INLINE void Avx2Tiles::ktile(const LinearArgs& a, int64_t row, int64_t tok) {
  const auto* x = static_cast<const scalar_t*>(a.x) + tok * a.x_stride;
  const uint8_t* w = a.w + row * a.row_bytes;
  const int64_t supers = a.k / kSuper;
  constexpr int64_t kBytes = block_bytes(Type);
  constexpr bool kQ6 = Type == kQ6_K;
  __m256 acc[RT][TT];
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  alignas(32) float f[RT][16];  // k_scales per row
  const char* next = reinterpret_cast<const char*>(w + RT * a.row_bytes);
  const int64_t next_lines = (RT * a.row_bytes + 63) / 64;
  const int64_t groups = supers * 8;
  const int64_t lines_per_group = (next_lines + groups - 1) / groups;
  for (int64_t sb = 0; sb < supers; ++sb) {
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r) k_scales<Type>(w + r * a.row_bytes + sb * kBytes, f[r]);
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t g = sb * 8 + j;
      prefetch_slice(next, next_lines, lines_per_group, g);
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r) {
        __m256 wv[4];
        k_group<Type>(w + r * a.row_bytes + sb * kBytes, j, f[r][kQ6 ? 2 * j : j],
                      f[r][kQ6 ? 2 * j + 1 : 8 + j], wv);
        accumulate<RT, TT>(acc, r, wv, x + g * kBlock, a.x_stride);
      }
    }
  }
  store_tile<RT, TT, scalar_t>(a, acc, row, tok);
}

}  // namespace

VLLM_PP_AVX2_F16C void decode_avx2(const LinearArgs& a, int64_t type, bool bf16, int64_t begin,
                                   int64_t end) {
  decode_tiles<Avx2Tiles>(a, type, bf16, begin, end);
}

}  // namespace vllm_pp::gguf

#endif  // __x86_64__

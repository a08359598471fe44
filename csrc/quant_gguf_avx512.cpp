// The GGUF matmul with AVX-512: y[T, N] = x[T, K] @ W^T, W in the kernels' row layout
// (quant_gguf.h), in tiles of up to 4 tokens (more tokens re-decode a row chunk from L1 per
// tile, still faster than quant_gguf.cpp's decode-to-fp32 DenseTile at 5-256 tokens).
// Written with intrinsics in functions carrying the AVX-512 target attribute, because the
// generic vector-extension kernel (quant_gguf.cpp's Tile) left its accumulators on the stack
// and ran at half this speed: this one keeps every accumulator in a register and decodes a
// block in a handful of instructions (docs/PERFORMANCE.md, Quantized GGUF).
//
// Per block of 32 weights and row:
//   Q4_0 / Q4_1: the 16 weights a nibble can stand for, table[q] = d * (q - 8) or d * q + m, in
//     one zmm (one multiply or FMA), then the block's 16 bytes zero-extended to 16 dwords: vpermps
//     reads only an index's low 4 bits, so the dwords themselves index the low nibbles
//     (weights 0-15) and the dwords shifted right by 4 the high ones (weights 16-31). No
//     masking, no int -> float conversion.
//   Q8_0: the 32 int8 sign-extended and converted (exact), times d.
//   Q4_K / Q5_K / Q6_K (ktile): per super-block of 256 weights and row, the 8 groups' floats
//     (k_scales16: the values of quant_gguf.h's k_group_scales, 16 at a time), then per group of 32: Q4_K as Q4_1 above with the table
//     q * s + t (the odd groups' quants are the high nibbles: the dwords shifted right by 4);
//     Q5_K / Q6_K the quants built from their low nibbles and high bits as dwords, converted
//     (exact) and scaled: q * s + t, or (q - 32) * s (first 16) and * t (last 16).
// Each weight is the value the dequantization gives (d * q is exact in fp32: an fp16 scale
// times a small integer), and it is multiplied into the same accumulator lane in the same
// order as the generic kernel (lane l: weights l, l + 16, l + 32, ... of the row, then
// Simd<16>::reduce_add), so both kernels give the same results.
//
// A tile of RT rows x TT tokens (8 x 1, 4 x 2, 2 x 4) keeps RT * TT accumulators; the x of a
// block is loaded once for the RT rows. The rows of the next tile follow this tile's in
// memory and are prefetched a slice per block while this one computes.

#include "quant_gguf.h"

#if defined(__x86_64__)

// GCC 12 reports the intrinsics headers' deliberately undefined pass-through operands
// (_mm512_undefined_*) as "may be used uninitialized" once they are inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_isa.h"
#include "cpu_simd.h"

// The driver (quant_gguf_driver.h) compiled for AVX-512.
#define VLLM_PP_GGUF_TARGET VLLM_PP_AVX512
#include "quant_gguf_driver.h"

namespace vllm_pp::gguf {
namespace {

#define VLLM_PP_AVX512_INLINE VLLM_PP_AVX512 inline __attribute__((always_inline))

VLLM_PP_AVX512_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// bfloat16 is the top half of a float32: zero-extend and shift (exact).
VLLM_PP_AVX512_INLINE __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The first n <= 16 fp16 numbers at p as fp32 (exact); the masked load reads only those.
VLLM_PP_AVX512_INLINE __m512 halves(const uint8_t* p, int64_t n) {
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// Each accumulator's 16 lanes summed into out[tok + t, row + r] (the tile kernels' last step).
template <int RT, int TT, typename scalar_t>
VLLM_PP_AVX512_INLINE void store_tile(const LinearArgs& a, const __m512 (&acc)[RT][TT],
                                      int64_t row, int64_t tok) {
  auto* out = static_cast<scalar_t*>(a.out);
#pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const float sum = simd::Simd<16>::reduce_add((simd::Simd<16>::f32)acc[r][t]);
      out[(tok + t) * a.out_stride + row + r] = static_cast<scalar_t>(sum);
    }
}

// The kernels, as quant_gguf_driver.h's tile policy (defined below).
struct Avx512Tiles {
  // Accumulators per tile (RT * TT): 8 of the 32 zmm registers, for every type.
  static constexpr int accumulators(int64_t) { return 8; }
  // Rows [row, row + RT) x tokens [tok, tok + TT): 32-weight blocks, K-quant super-blocks.
  template <int64_t Type, int RT, int TT, typename scalar_t>
  VLLM_PP_AVX512_INLINE static void tile(const LinearArgs& a, int64_t row, int64_t tok);
  template <int64_t Type, int RT, int TT, typename scalar_t>
  VLLM_PP_AVX512_INLINE static void ktile(const LinearArgs& a, int64_t row, int64_t tok);
};

template <int64_t Type, int RT, int TT, typename scalar_t>
VLLM_PP_AVX512_INLINE void Avx512Tiles::tile(const LinearArgs& a, int64_t row, int64_t tok) {
  using L = Layout<Type>;
  const auto* x = static_cast<const scalar_t*>(a.x) + tok * a.x_stride;
  const uint8_t* w = a.w + row * a.row_bytes;
  const int64_t blocks = a.k / kBlock;
  // The value each nibble stands for before scaling: q (Q4_1) or q - 8 (Q4_0), exact.
  const __m512 base = _mm512_sub_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_ps(Type == kQ4_0 ? 8.0f : 0.0f));
  __m512 acc[RT][TT];
#pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  alignas(64) float d[RT][16];
  alignas(64) float m[RT][16];
  // The next tile's bytes (its rows follow this tile's), prefetched a slice per block so they
  // arrive while this tile computes: the hardware prefetcher does not follow the 2 x RT
  // streams (scales and quants of each row) a tile reads.
  const char* next = reinterpret_cast<const char*>(w + RT * a.row_bytes);
  const int64_t next_lines = (RT * a.row_bytes + 63) / 64;
  const int64_t lines_per_block = (next_lines + blocks - 1) / blocks;
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, blocks - b0);
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r) {
      const uint8_t* w_row = w + r * a.row_bytes;
      _mm512_store_ps(d[r], halves(w_row + 2 * b0, n));
      if constexpr (Type == kQ4_1)
        _mm512_store_ps(m[r], halves(L::mins(w_row, blocks) + 2 * b0, n));
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = b0 + j;
      prefetch_slice(next, next_lines, lines_per_block, b);
      __m512 x0[TT], x1[TT];  // the block's x: weights 0-15 and 16-31
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        x0[t] = load16(x + t * a.x_stride + b * kBlock);
        x1[t] = load16(x + t * a.x_stride + b * kBlock + 16);
      }
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const uint8_t* qs = L::quants(w + r * a.row_bytes, blocks) + b * L::kQuantBytes;
        const __m512 dv = _mm512_set1_ps(d[r][j]);
        __m512 w0, w1;
        if constexpr (Type == kQ8_0) {
          const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
          const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
          w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), dv);
          w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), dv);
        } else {
          const __m512i q =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
          __m512 table;
          if constexpr (Type == kQ4_1) {
            table = _mm512_fmadd_ps(base, dv, _mm512_set1_ps(m[r][j]));
          } else {
            table = _mm512_mul_ps(base, dv);
          }
          w0 = _mm512_permutexvar_ps(q, table);
          w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
        }
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          acc[r][t] = _mm512_fmadd_ps(w0, x0[t], acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(w1, x1[t], acc[r][t]);
        }
      }
    }
  }
  store_tile<RT, TT, scalar_t>(a, acc, row, tok);
}

// 16 bytes at p zero-extended to dwords.
VLLM_PP_AVX512_INLINE __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A K-quant group's 32 weights (w0: 0-15, w1: 16-31) from super-block sb, group j, with its
// two floats s, t; the values of quant_gguf.cpp's KQuant<16>::decode.
template <int64_t Type>
VLLM_PP_AVX512_INLINE void k_group(const uint8_t* sb, int64_t j, float s, float t, __m512& w0,
                                   __m512& w1) {
  const __m512i low4 = _mm512_set1_epi32(0xF);
  if constexpr (Type == kQ4_K) {
    const uint8_t* ql = sb + 16 + 32 * (j / 2);
    // table[q] = q * s + t; vpermps reads an index's low 4 bits only (no masking needed).
    const __m512 table = _mm512_fmadd_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_ps(s), _mm512_set1_ps(t));
    __m512i q0 = bytes16(ql), q1 = bytes16(ql + 16);
    if (j & 1) {
      q0 = _mm512_srli_epi32(q0, 4);
      q1 = _mm512_srli_epi32(q1, 4);
    }
    w0 = _mm512_permutexvar_ps(q0, table);
    w1 = _mm512_permutexvar_ps(q1, table);
  } else if constexpr (Type == kQ5_K) {
    const uint8_t* ql = sb + 48 + 32 * (j / 2);
    const int nib = (j & 1) ? 4 : 0;
    const int bit = static_cast<int>(j);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i q[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(bytes16(ql + 16 * h), nib), low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(bytes16(sb + 16 + 16 * h), bit), one);
      q[h] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
    }
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[0]), _mm512_set1_ps(s), _mm512_set1_ps(t));
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[1]), _mm512_set1_ps(s), _mm512_set1_ps(t));
  } else {  // Q6_K
    const int64_t i = j % 4;
    const uint8_t* ql = sb + 64 * (j / 4) + 32 * (i & 1);
    const uint8_t* qh = sb + 128 + 32 * (j / 4);
    const int nib = i >= 2 ? 4 : 0;
    const int shift = static_cast<int>(2 * i);
    const __m512i three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
    __m512i q[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(bytes16(ql + 16 * h), nib), low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(bytes16(qh + 16 * h), shift), three);
      q[h] = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), bias);
    }
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q[0]), _mm512_set1_ps(s));
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q[1]), _mm512_set1_ps(t));
  }
}

// A super-block's group floats as k_group_scales (quant_gguf.h) gives them, in 16 lanes:
// Q4_K / Q5_K s_j = f[j], t_j = f[8 + j]; Q6_K s_j = f[2j], t_j = f[2j + 1]. The 6-bit scales
// and mins unpacked with 32-bit masks (llama.cpp's kmask trick), all 16 converted and scaled
// by d (or -dmin: the negation is exact) in one multiply; the products are exact as there.
template <int64_t Type>
VLLM_PP_AVX512_INLINE void k_scales16(const uint8_t* sb, float* f) {
  __m128i bytes;
  __m512 mult;
  if constexpr (Type == kQ6_K) {
    bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192));
    _mm512_store_ps(f, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                                     _mm512_set1_ps(half_at(sb + 208))));
    return;
  } else {
    uint32_t u[3], out[4];
    std::memcpy(u, sb + 4, 12);
    constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
    out[0] = u[0] & k6;                                    // sc 0-3
    out[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);      // sc 4-7
    out[2] = u[1] & k6;                                    // m 0-3
    out[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // m 4-7
    std::memcpy(&bytes, out, 16);
    mult = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_at(sb)),
                                _mm512_set1_ps(-half_at(sb + 2)));
    _mm512_store_ps(f, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), mult));
  }
}

// tile() for the K-quants: RT rows x TT tokens, a super-block at a time.
template <int64_t Type, int RT, int TT, typename scalar_t>
VLLM_PP_AVX512_INLINE void Avx512Tiles::ktile(const LinearArgs& a, int64_t row, int64_t tok) {
  const auto* x = static_cast<const scalar_t*>(a.x) + tok * a.x_stride;
  const uint8_t* w = a.w + row * a.row_bytes;
  const int64_t supers = a.k / kSuper;
  constexpr int64_t kBytes = block_bytes(Type);
  __m512 acc[RT][TT];
#pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  alignas(64) float f[RT][16];  // k_scales16 per row
  constexpr bool kQ6 = Type == kQ6_K;
  // The next tile's rows, prefetched a slice per group as in tile().
  const char* next = reinterpret_cast<const char*>(w + RT * a.row_bytes);
  const int64_t next_lines = (RT * a.row_bytes + 63) / 64;
  const int64_t groups = supers * 8;
  const int64_t lines_per_group = (next_lines + groups - 1) / groups;
  for (int64_t sb = 0; sb < supers; ++sb) {
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r) k_scales16<Type>(w + r * a.row_bytes + sb * kBytes, f[r]);
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t g = sb * 8 + j;
      prefetch_slice(next, next_lines, lines_per_group, g);
      __m512 x0[TT], x1[TT];
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        x0[t] = load16(x + t * a.x_stride + g * kBlock);
        x1[t] = load16(x + t * a.x_stride + g * kBlock + 16);
      }
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        __m512 w0, w1;
        k_group<Type>(w + r * a.row_bytes + sb * kBytes, j, f[r][kQ6 ? 2 * j : j],
                      f[r][kQ6 ? 2 * j + 1 : 8 + j], w0, w1);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          acc[r][t] = _mm512_fmadd_ps(w0, x0[t], acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(w1, x1[t], acc[r][t]);
        }
      }
    }
  }
  store_tile<RT, TT, scalar_t>(a, acc, row, tok);
}
}  // namespace

VLLM_PP_AVX512 void decode_avx512(const LinearArgs& a, int64_t type, bool bf16, int64_t begin,
                                  int64_t end) {
  decode_tiles<Avx512Tiles>(a, type, bf16, begin, end);
}

}  // namespace vllm_pp::gguf

#endif  // __x86_64__

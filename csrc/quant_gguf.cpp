// Weight-only quantized matmul on GGUF blocks: y[T, N] = x[T, K] @ W^T with W [N, K] kept in
// llama.cpp's block formats (the bytes of the .gguf file, row by row), x and y float32 or
// bfloat16. Q4_0, Q4_1 and Q8_0: blocks of 32 weights sharing an fp16 scale d (and, Q4_1, an
// fp16 minimum m):
//   Q4_0 (18 bytes): d, 16 bytes of nibbles       w = d * (q - 8)
//   Q4_1 (20 bytes): d, m, 16 bytes of nibbles    w = d * q + m
//   Q8_0 (34 bytes): d, 32 int8                   w = d * q
// where weight j < 16 of a 4-bit block is the low nibble of byte j, weight j >= 16 the high
// nibble of byte j - 16. The K-quants: super-blocks of 256 weights in 8 groups of 32, decoded
// as ggml's dequantize_row_q*_K (and gguf-py's numpy) does:
//   Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit scales sc[8] / mins m[8], 128 bytes of nibbles
//     (group 2i: low nibbles of bytes 32i..32i+31, group 2i + 1: their high nibbles)
//     w = (d * sc) * q - dmin * m
//   Q5_K (176 bytes): the same with a fifth bit per weight (32 bytes qh: group g's bit g)
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, int8 scales sc[16] (one per
//     16 weights), then d                                          w = (d * sc) * (q - 32)
// Every product but the last subtraction is exact in fp32, so a weight is the same float as
// numpy's whichever way it is contracted into an FMA. The kernels read each Q4_0/Q4_1/Q8_0
// row with its bytes regrouped once at load (`Layout` in quant_gguf.h): the scales of all its
// blocks first, so they widen a vector at a time; K-quant rows are read as stored, their
// scales decoded once per super-block (`Groups`).
//
// At decode (a few tokens per step) the matmul is bound by the bytes of weights it reads: each
// weight row is read from memory once per step, its blocks widened to fp32 in registers and
// multiplied with every token of the step (a tile of up to 4 tokens at a time, the row tile
// staying in L1 between token tiles). Each (row, token) pair accumulates in one vector: 8 rows x
// 1 token, 4 x 2 or 2 x 4, so 8 independent FMA chains hide the FMA latency. Rows are split
// over threads (at::parallel_for). The order of the sum: lane l of the accumulator adds the
// products of weights l, l + W, l + 2W, ... in order, then the lanes are added (cpu_simd.h's
// reduce_add), and every weight is d * q (+ m) as an FMA: the results are within fp32
// summation error of the dequantized weights' dot product (tests/models/test_gguf_quant.py).
// With AVX-512 every call (K-quants: 1-4 tokens) goes to the intrinsics kernel of
// quant_gguf_avx512.cpp instead (same products, same order; ~2x faster at one token, ~1.4x at
// 5-32 tokens). With AVX2 (no AVX-512), 1-8 tokens (K-quants: 1-4) go to quant_gguf_avx2.cpp's
// intrinsics kernel (same products, same order as W = 8; ~2x faster at one token).
//
// More than 4 tokens: each tile of 8 rows is decoded once into an fp32 buffer and multiplied
// with every token from there (DenseTile). For many tokens (prefill), gguf_dequantize expands
// the rows to a dense fp32/bf16 matrix for the GEMM instead;
// vllm/model_executor/layers/quantization/gguf.py picks by token count.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "cpu_simd.h"
#include "ops.h"
#include "panel_block.h"
#include "quant_gguf.h"

namespace vllm_pp {
namespace {

using gguf::block_bytes;
using gguf::block_weights;
using gguf::is_k_quant;
using gguf::kBlock;
using gguf::kQ4_0;
using gguf::kQ4_1;
using gguf::kQ4_K;
using gguf::kQ5_K;
using gguf::kQ6_K;
using gguf::kQ8_0;
using gguf::Layout;
using gguf::LinearArgs;

// W bytes widened to W fp32 lanes: signed (Q8_0), or the low / high nibbles of 16 bytes
// (W = 8: of their first or second half). GCC 12 turns a byte -> int vector conversion written
// with __builtin_convertvector into one scalar insert per lane, and intrinsics cannot be
// inlined into these ISA-generic templates (their target attribute must be the caller's), so
// the wide ISAs sign/zero-extend with one pmovsxbd / pmovzxbd in inline asm. These functions
// are only ever inlined into their ISA's kernel (cpu_isa.h), where the asm is valid.
typedef uint8_t Bytes16 __attribute__((vector_size(16)));
typedef uint16_t Words8 __attribute__((vector_size(16)));

VLLM_PP_INLINE Bytes16 nibbles16(const uint8_t* p, bool high) {
  Bytes16 q;
  std::memcpy(&q, p, 16);
  if (high) q = (Bytes16)((Words8)q >> 4);
  return q & 15;
}

template <int W>
struct Widen;

template <>
struct Widen<4> {
  using f32 = simd::Simd<4>::f32;
  static VLLM_PP_INLINE f32 s8(const uint8_t* p) {
    f32 v;
    for (int i = 0; i < 4; ++i) v[i] = static_cast<int8_t>(p[i]);
    return v;
  }
  // W bytes zero-extended to ints (the K-quants' high bits).
  static VLLM_PP_INLINE simd::Simd<4>::i32 u8(const uint8_t* p) {
    simd::Simd<4>::i32 v;
    for (int i = 0; i < 4; ++i) v[i] = p[i];
    return v;
  }
  // Lanes from byte `first` of the 16 (a multiple of 4).
  static VLLM_PP_INLINE f32 nibbles(const uint8_t* p, int first, bool high) {
    f32 v;
    for (int i = 0; i < 4; ++i) v[i] = high ? p[first + i] >> 4 : p[first + i] & 15;
    return v;
  }
};

#if defined(__x86_64__)
template <>
struct Widen<8> {
  using f32 = simd::Simd<8>::f32;
  using i32 = simd::Simd<8>::i32;
  static VLLM_PP_INLINE f32 s8(const uint8_t* p) {
    i32 v;
    asm("vpmovsxbd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const uint8_t(*)[8]>(p)));
    return __builtin_convertvector(v, f32);
  }
  static VLLM_PP_INLINE i32 u8(const uint8_t* p) {
    i32 v;
    asm("vpmovzxbd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const uint8_t(*)[8]>(p)));
    return v;
  }
  static VLLM_PP_INLINE f32 nibbles(const uint8_t* p, int first, bool high) {
    Bytes16 q = nibbles16(p, high);
    if (first == 8) q = __builtin_shufflevector(q, q, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11,
                                                12, 13, 14, 15);
    i32 v;
    asm("vpmovzxbd %1, %0" : "=v"(v) : "v"(q));
    return __builtin_convertvector(v, f32);
  }
};

template <>
struct Widen<16> {
  using f32 = simd::Simd<16>::f32;
  using i32 = simd::Simd<16>::i32;
  static VLLM_PP_INLINE f32 s8(const uint8_t* p) {
    i32 v;
    asm("vpmovsxbd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const uint8_t(*)[16]>(p)));
    return __builtin_convertvector(v, f32);
  }
  static VLLM_PP_INLINE i32 u8(const uint8_t* p) {
    i32 v;
    asm("vpmovzxbd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const uint8_t(*)[16]>(p)));
    return v;
  }
  static VLLM_PP_INLINE f32 nibbles(const uint8_t* p, int, bool high) {
    i32 v;
    asm("vpmovzxbd %1, %0" : "=v"(v) : "v"(nibbles16(p, high)));
    return __builtin_convertvector(v, f32);
  }
};
#endif

// IEEE half -> float for finite values (a scale is never inf or NaN): the half's exponent and
// mantissa moved into a float's fields, then scaled by 2^(127 - 15) = 2^112, which is exact and
// also covers subnormal halves. Integer ops only (no F16C needed), W halves at a time.
template <int W>
struct Halves {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  using u32 = typename S::u32;
  using u16 = typename S::u16;

  static VLLM_PP_INLINE f32 widen(u16 h16) {
    const u32 h = __builtin_convertvector(h16, u32);
    const f32 magnitude = (f32)((h & 0x7fffu) << 13) * 0x1p112f;
    return (f32)((u32)magnitude | ((h & 0x8000u) << 16));
  }

  // out[i] = the half at p[2i] as a float, for i < n.
  static VLLM_PP_INLINE void convert(const uint8_t* p, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      u16 h;
      std::memcpy(&h, p + 2 * i, sizeof(h));
      S::store(out + i, widen(h));
    }
    if (i < n) {
      u16 h{};
      std::memcpy(&h, p + 2 * i, 2 * (n - i));
      float tail[W];
      S::store(tail, widen(h));
      std::copy(tail, tail + (n - i), out + i);
    }
  }
};

// One block's 32 weights as 32 / W fp32 vectors, from its quants qs and its scale (and min).
template <int W, int64_t Type>
struct Block {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  static constexpr int kVecs = kBlock / W;

  static VLLM_PP_INLINE void decode(const uint8_t* qs, float scale, float min,
                                    f32 (&w)[kVecs]) {
    const f32 d = S::splat(scale);
    if constexpr (Type == kQ8_0) {
      for (int v = 0; v < kVecs; ++v) w[v] = Widen<W>::s8(qs + v * W) * d;
    } else {
      for (int v = 0; v < kVecs; ++v) {
        const f32 f = Widen<W>::nibbles(qs, (v * W) % 16, v * W >= 16);
        if constexpr (Type == kQ4_1) {
          w[v] = f * d + S::splat(min);
        } else {
          w[v] = (f - 8.0f) * d;  // q - 8 is exact in fp32
        }
      }
    }
  }
};

// A K-quant super-block's 8 groups of 32 weights.
template <int W, int64_t Type>
struct KQuant {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  static constexpr int kVecs = kBlock / W;

  // The groups' two floats (quant_gguf.h).
  static VLLM_PP_INLINE void prepare(const uint8_t* sb, float* s, float* t) {
    gguf::k_group_scales(sb, Type, s, t);
  }

  // Group j's 32 weights (vector v: weights v * W .. v * W + W - 1 of the group).
  static VLLM_PP_INLINE void decode(const uint8_t* sb, int64_t j, float s, float t,
                                    f32 (&w)[kVecs]) {
    if constexpr (Type == kQ6_K) {
      const int64_t i = j % 4;  // each half of 128: groups of ql[0:32], ql[32:64], then highs
      const uint8_t* ql = sb + 64 * (j / 4) + 32 * (i & 1);
      const uint8_t* qh = sb + 128 + 32 * (j / 4);
      const int shift = static_cast<int>(2 * i);
      for (int v = 0; v < kVecs; ++v) {
        const f32 low = Widen<W>::nibbles(ql + v * W / 16 * 16, (v * W) % 16, i >= 2);
        const auto high = ((Widen<W>::u8(qh + v * W) >> shift) & 3) << 4;
        const f32 q = low + __builtin_convertvector(high, f32) - 32.0f;  // exact
        w[v] = q * S::splat(v * W < 16 ? s : t);
      }
    } else {
      const uint8_t* ql = sb + (Type == kQ4_K ? 16 : 48) + 32 * (j / 2);
      const f32 d = S::splat(s), m = S::splat(t);
      for (int v = 0; v < kVecs; ++v) {
        f32 q = Widen<W>::nibbles(ql + v * W / 16 * 16, (v * W) % 16, j & 1);
        if constexpr (Type == kQ5_K) {
          const auto high = ((Widen<W>::u8(sb + 16 + v * W) >> static_cast<int>(j)) & 1) << 4;
          q += __builtin_convertvector(high, f32);
        }
        w[v] = q * d + m;
      }
    }
  }
};

// A row as groups of 32 weights for the kernels: the floats each group's decoding needs,
// prepared kChunk groups at a time (Q4_0/Q4_1/Q8_0: 64 blocks' scales (and minima) widened
// together; K-quants: one super-block's 8 groups), then the group's weights.
template <int W, int64_t Type>
struct Groups {
  using f32 = typename simd::Simd<W>::f32;
  using L = Layout<Type>;
  static constexpr int64_t kChunk = is_k_quant(Type) ? gguf::kSuper / kBlock : 64;
  static constexpr int kVecs = kBlock / W;

  // Groups [g0, g0 + n) of a row of `groups`; g0 is a multiple of kChunk.
  static VLLM_PP_INLINE void prepare(const uint8_t* row, int64_t groups, int64_t g0, int64_t n,
                                     float* s, float* t) {
    if constexpr (is_k_quant(Type)) {
      KQuant<W, Type>::prepare(row + g0 / 8 * block_bytes(Type), s, t);
    } else {
      Halves<W>::convert(row + 2 * g0, s, n);
      if constexpr (Type == kQ4_1) Halves<W>::convert(L::mins(row, groups) + 2 * g0, t, n);
    }
  }

  static VLLM_PP_INLINE void decode(const uint8_t* row, int64_t groups, int64_t g, float s,
                                    float t, f32 (&w)[kVecs]) {
    if constexpr (is_k_quant(Type)) {
      KQuant<W, Type>::decode(row + g / 8 * block_bytes(Type), g % 8, s, t, w);
    } else {
      Block<W, Type>::decode(L::quants(row, groups) + g * L::kQuantBytes, s, t, w);
    }
  }

  // Whether a group has a second float t (Q4_1's minimum, the K-quants' t); Q4_0 / Q8_0
  // leave it unset and get 0.
  static constexpr bool kHasT = Type == kQ4_1 || is_k_quant(Type);
};

template <int W, int64_t Type, typename scalar_t>
struct Tile {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;
  using B = Block<W, Type>;
  static constexpr int64_t kBytes = block_bytes(Type);

  // Rows [row, row + RT) x tokens [tok, tok + TT): each weight block is decoded once per tile
  // and multiplied with the TT tokens' matching x.
  template <int RT, int TT>
  static VLLM_PP_INLINE void run(const LinearArgs& a, int64_t row, int64_t tok) {
    using G = Groups<W, Type>;
    constexpr int64_t kChunk = G::kChunk;
    const auto* x = static_cast<const scalar_t*>(a.x) + tok * a.x_stride;
    const uint8_t* w = a.w + row * a.row_bytes;
    const int64_t blocks = a.k / kBlock;  // groups of 32 weights
    f32 acc[RT][TT];
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < TT; ++t) acc[r][t] = f32{};
    float scales[RT][kChunk], mins[RT][kChunk];
    for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
      const int64_t n = std::min(kChunk, blocks - b0);
      for (int r = 0; r < RT; ++r)
        G::prepare(w + r * a.row_bytes, blocks, b0, n, scales[r], mins[r]);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t b = b0 + j;
        for (int r = 0; r < RT; ++r) {
          typename S::f32 wv[B::kVecs];
          G::decode(w + r * a.row_bytes, blocks, b, scales[r][j], G::kHasT ? mins[r][j] : 0.0f,
                    wv);
          for (int v = 0; v < B::kVecs; ++v)
            for (int t = 0; t < TT; ++t)
              acc[r][t] += wv[v] * S::load(x + t * a.x_stride + b * kBlock + v * W);
        }
      }
    }
    auto* out = static_cast<scalar_t*>(a.out);
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < TT; ++t)
        out[(tok + t) * a.out_stride + row + r] = static_cast<scalar_t>(S::reduce_add(acc[r][t]));
  }

  // Rows [begin, end) for all tokens: tiles of RT rows (8 / TT), the remainder row by row.
  template <int TT>
  static VLLM_PP_INLINE void rows(const LinearArgs& a, int64_t begin, int64_t end, int64_t tok) {
    constexpr int RT = 8 / TT;
    int64_t row = begin;
    for (; row + RT <= end; row += RT) run<RT, TT>(a, row, tok);
    for (; row < end; ++row) run<1, TT>(a, row, tok);
  }
};

// More than 4 tokens: decoding a block per 4-token tile would be repeated T / 4 times, so the
// rows of a tile are decoded once into an fp32 buffer (L1/L2) and multiplied from there. The
// products and their order are those of Tile (lane l adds columns l, l + W, ... in order), so
// both paths give the same results.
template <int W, int64_t Type, typename scalar_t>
VLLM_PP_INLINE void decode_rows(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t rows,
                                scalar_t* out) {
  using S = simd::Simd<W>;
  using B = Block<W, Type>;
  using G = Groups<W, Type>;
  constexpr int64_t kChunk = G::kChunk;
  const int64_t blocks = k / kBlock;  // groups of 32 weights
  float scales[kChunk], mins[kChunk];
  for (int64_t row = 0; row < rows; ++row) {
    const uint8_t* w_row = w + row * row_bytes;
    for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
      const int64_t n = std::min(kChunk, blocks - b0);
      G::prepare(w_row, blocks, b0, n, scales, mins);
      for (int64_t j = 0; j < n; ++j) {
        typename S::f32 wv[B::kVecs];
        const int64_t b = b0 + j;
        G::decode(w_row, blocks, b, scales[j], G::kHasT ? mins[j] : 0.0f, wv);
        for (int v = 0; v < B::kVecs; ++v) S::store(out + row * k + b * kBlock + v * W, wv[v]);
      }
    }
  }
}

template <int W, typename scalar_t>
struct DenseTile {
  using S = simd::Simd<W>;
  using f32 = typename S::f32;

  // Rows [row, row + RT) (fp32 in wbuf, [RT][k]) x tokens [tok, tok + TT).
  template <int RT, int TT>
  static VLLM_PP_INLINE void run(const LinearArgs& a, const float* wbuf, int64_t row,
                                 int64_t tok) {
    const auto* x = static_cast<const scalar_t*>(a.x) + tok * a.x_stride;
    f32 acc[RT][TT];
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < TT; ++t) acc[r][t] = f32{};
    for (int64_t c = 0; c < a.k; c += W) {
      for (int r = 0; r < RT; ++r) {
        const f32 wv = S::load(wbuf + r * a.k + c);
        for (int t = 0; t < TT; ++t) acc[r][t] += wv * S::load(x + t * a.x_stride + c);
      }
    }
    auto* out = static_cast<scalar_t*>(a.out);
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < TT; ++t)
        out[(tok + t) * a.out_stride + row + r] = static_cast<scalar_t>(S::reduce_add(acc[r][t]));
  }

  // Every token for rows [row, row + rows) decoded in wbuf: pairs of rows x 4 tokens.
  static VLLM_PP_INLINE void rows(const LinearArgs& a, const float* wbuf, int64_t row,
                                  int64_t rows) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      int64_t tok = 0;
      for (; tok + 4 <= a.tokens; tok += 4) run<2, 4>(a, wbuf + r * a.k, row + r, tok);
      for (; tok < a.tokens; ++tok) run<2, 1>(a, wbuf + r * a.k, row + r, tok);
    }
    for (; r < rows; ++r) {
      int64_t tok = 0;
      for (; tok + 4 <= a.tokens; tok += 4) run<1, 4>(a, wbuf + r * a.k, row + r, tok);
      for (; tok < a.tokens; ++tok) run<1, 1>(a, wbuf + r * a.k, row + r, tok);
    }
  }
};

template <int W>
struct LinearKernel {
  template <int64_t Type, typename scalar_t>
  static VLLM_PP_INLINE void typed(const LinearArgs& a, int64_t begin, int64_t end) {
    using T = Tile<W, Type, scalar_t>;
    if (a.tokens > 4) {
      // 8 rows at a time decoded once (8 x K floats: 48 KiB at K = 1536).
      std::vector<float> wbuf(8 * a.k);
      for (int64_t row = begin; row < end; row += 8) {
        const int64_t rows = std::min<int64_t>(8, end - row);
        decode_rows<W, Type>(a.w + row * a.row_bytes, a.row_bytes, a.k, rows, wbuf.data());
        DenseTile<W, scalar_t>::rows(a, wbuf.data(), row, rows);
      }
      return;
    }
    // Row chunks of 64 so a tile's weights stay in L1/L2 across the token tiles.
    for (int64_t r0 = begin; r0 < end; r0 += 64) {
      const int64_t r1 = std::min(end, r0 + 64);
      int64_t tok = 0;
      for (; tok + 4 <= a.tokens; tok += 4) T::template rows<4>(a, r0, r1, tok);
      for (; tok + 2 <= a.tokens; tok += 2) T::template rows<2>(a, r0, r1, tok);
      for (; tok < a.tokens; ++tok) T::template rows<1>(a, r0, r1, tok);
    }
  }

  template <typename scalar_t>
  static VLLM_PP_INLINE void run(const LinearArgs& a, int64_t type, int64_t begin, int64_t end,
                                 scalar_t*) {
    switch (type) {
      case kQ4_0:
        return typed<kQ4_0, scalar_t>(a, begin, end);
      case kQ4_1:
        return typed<kQ4_1, scalar_t>(a, begin, end);
      case kQ4_K:
        return typed<kQ4_K, scalar_t>(a, begin, end);
      case kQ5_K:
        return typed<kQ5_K, scalar_t>(a, begin, end);
      case kQ6_K:
        return typed<kQ6_K, scalar_t>(a, begin, end);
      default:
        return typed<kQ8_0, scalar_t>(a, begin, end);
    }
  }

  static VLLM_PP_INLINE void run(const LinearArgs* a, int64_t type, bool bf16, int64_t begin,
                                 int64_t end) {
#if defined(__x86_64__)
    // AVX-512: the intrinsics kernel (quant_gguf_avx512.cpp), same sums, for every token
    // count: its tiles of 4 tokens re-decode the blocks from L1, which still beats decoding
    // the rows to an fp32 buffer (DenseTile) at every size measured (5-256 tokens).
    // K-quants from 5 tokens on: the rows decoded once (DenseTile) beat re-decoding a
    // super-block per 4-token tile (1.2-2x at 8-64 tokens, docs/PERFORMANCE.md); same sums.
    if (W == 16 && !(is_k_quant(type) && a->tokens > 4))
      return gguf::decode_avx512(*a, type, bf16, begin, end);
    // AVX2: its intrinsics kernel (quant_gguf_avx2.cpp), same sums, up to 8 tokens (K-quants:
    // 4): 1.3-1.45x DenseTile at 5-7 tokens, even at 8, slower from 16 (docs/PERFORMANCE.md).
    if (W == 8 && a->tokens <= (is_k_quant(type) ? 4 : 8))
      return gguf::decode_avx2(*a, type, bf16, begin, end);
#endif
    if (bf16) {
      run(*a, type, begin, end, static_cast<c10::BFloat16*>(nullptr));
    } else {
      run(*a, type, begin, end, static_cast<float*>(nullptr));
    }
  }
};

template <int W>
struct DequantKernel {
  template <int64_t Type, typename scalar_t>
  static VLLM_PP_INLINE void typed(scalar_t* out, const uint8_t* w, int64_t k, int64_t row_bytes,
                                   int64_t begin, int64_t end) {
    decode_rows<W, Type>(w + begin * row_bytes, row_bytes, k, end - begin, out + begin * k);
  }

  static VLLM_PP_INLINE void run(void* out, const uint8_t* w, int64_t type, bool bf16, int64_t k,
                                 int64_t row_bytes, int64_t begin, int64_t end) {
#define VLLM_PP_DEQUANT_CASE(TYPE)                                                         \
  if (type == TYPE) {                                                                      \
    if (bf16)                                                                              \
      typed<TYPE>(static_cast<c10::BFloat16*>(out), w, k, row_bytes, begin, end);          \
    else                                                                                   \
      typed<TYPE>(static_cast<float*>(out), w, k, row_bytes, begin, end);                  \
    return;                                                                                \
  }
    VLLM_PP_DEQUANT_CASE(kQ4_0)
    VLLM_PP_DEQUANT_CASE(kQ4_1)
    VLLM_PP_DEQUANT_CASE(kQ8_0)
    VLLM_PP_DEQUANT_CASE(kQ4_K)
    VLLM_PP_DEQUANT_CASE(kQ5_K)
    VLLM_PP_DEQUANT_CASE(kQ6_K)
#undef VLLM_PP_DEQUANT_CASE
  }
};

// Many tokens, float32 (a prefill chunk): out[T, N] = x[T, K] @ W^T without a dense copy of W.
// Panels [p0, p1) of 16 weight rows each: the rows are decoded (DequantKernel, the same
// floats as gguf_dequantize) into a [16, K] buffer, transposed into one panel [K, 16] (the
// layout of linear_panels.cpp), and panel_block.h's block multiplies every token into it.
// The decoded weights stay in L1/L2: dequantize + GEMM wrote and re-read the whole fp32
// matrix each call (~650 MB a chunk for SmolLM2's layers).
template <int W>
struct DequantPanelKernel {
  static VLLM_PP_INLINE void run(const LinearArgs* a, int64_t type, int64_t p0, int64_t p1) {
    using panels::kPanel;
    const int64_t k = a->k;
    // The panel 64-byte aligned, so each k is one cache line as in a packed weight (aligning
    // it made no measurable difference here; the block being called, not inlined, did).
    std::vector<float> rows(kPanel * k), panel_storage(k * kPanel + kPanel);
    float* panel = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(panel_storage.data()) + 63) & ~uintptr_t{63});
    const auto* x = static_cast<const float*>(a->x);
    auto* out = static_cast<float*>(a->out);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, a->n - n0);
      DequantKernel<W>::run(rows.data(), a->w + n0 * a->row_bytes, type, false, k, a->row_bytes,
                            0, cols);
      if (cols < kPanel) std::fill(rows.begin() + cols * k, rows.end(), 0.0f);
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t j = 0; j < kPanel; ++j) panel[kk * kPanel + j] = rows[j * k + kk];
      }
      // AVX2 and AVX-512 (which runs the AVX2 block, as linear_panels does) or generic.
      panels::rows_times_panel<panels::BlockFor<W>>(x, a->x_stride, a->tokens, k, panel,
                                                    nullptr, nullptr, out + n0, a->out_stride,
                                                    cols);
    }
  }
};

void check_blocks(const char* op, const at::Tensor& weight, int64_t type, int64_t k) {
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || is_k_quant(type), op,
              ": ggml type ", type,
              " is not supported (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte, op,
              ": weight must be a CPU uint8 tensor of GGUF blocks");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), op,
              ": weight must be contiguous [N, row_bytes], got ", weight.sizes());
  const int64_t bw = block_weights(type);
  TORCH_CHECK(k > 0 && k % bw == 0, op, ": K (", k, ") must be a multiple of ", bw);
  TORCH_CHECK(weight.size(1) == k / bw * block_bytes(type), op, ": weight rows hold ",
              weight.size(1), " bytes, expected ", k / bw * block_bytes(type), " for K = ", k);
}

// Rows per task: enough weight bytes (>= 256 KiB) that a thread's share outweighs waking it.
int64_t row_grain(int64_t row_bytes, int64_t tokens) {
  return std::max<int64_t>(8, (int64_t{1} << 18) / std::max<int64_t>(1, row_bytes * tokens));
}

}  // namespace

void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t type) {
  constexpr const char* op = "gguf_linear";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be a CPU [T, K] tensor with unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  check_blocks(op, weight, type, x.size(1));
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              op, ": out must be [T, N] of x's dtype with unit last stride");
  const LinearArgs args{out.data_ptr(), x.data_ptr(), weight.data_ptr<uint8_t>(),
                        x.size(0),      weight.size(0), x.size(1),
                        weight.size(1), x.stride(0),    out.stride(0)};
  if (args.tokens == 0 || args.n == 0) return;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto fn = select_isa_kernel<LinearKernel, const LinearArgs*, int64_t, bool, int64_t, int64_t>();
  at::parallel_for(0, args.n, row_grain(args.row_bytes, args.tokens),
                   [&](int64_t begin, int64_t end) { fn(&args, type, bf16, begin, end); });
}

void gguf_dequantize(at::Tensor& out, const at::Tensor& weight, int64_t type) {
  constexpr const char* op = "gguf_dequantize";
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, op,
              ": out must be float32 or bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == weight.size(0), op,
              ": out must be contiguous [N, K]");
  check_blocks(op, weight, type, out.size(1));
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  auto fn = select_isa_kernel<DequantKernel, void*, const uint8_t*, int64_t, bool, int64_t,
                              int64_t, int64_t, int64_t>();
  void* dst = out.data_ptr();
  const uint8_t* src = weight.data_ptr<uint8_t>();
  const int64_t k = out.size(1), row_bytes = weight.size(1);
  at::parallel_for(0, weight.size(0), row_grain(row_bytes, 1), [&](int64_t begin, int64_t end) {
    fn(dst, src, type, bf16, k, row_bytes, begin, end);
  });
}

void gguf_linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        int64_t type) {
  constexpr const char* op = "gguf_linear_panels";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be float32 [T, K] with unit last stride");
  check_blocks(op, weight, type, x.size(1));
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              op, ": out must be float32 [T, N] with unit last stride");
  const LinearArgs args{out.data_ptr(), x.data_ptr(), weight.data_ptr<uint8_t>(),
                        x.size(0),      weight.size(0), x.size(1),
                        weight.size(1), x.stride(0),    out.stride(0)};
  if (args.tokens == 0 || args.n == 0) return;
  auto fn = select_isa_kernel<DequantPanelKernel, const LinearArgs*, int64_t, int64_t, int64_t>();
  const int64_t panel_count = (args.n + panels::kPanel - 1) / panels::kPanel;
  // Threads split the panels: each decodes its own rows, and any thread count gives the same
  // bits (one panel is one task's, summed in one order).
  at::parallel_for(0, panel_count, 4, [&](int64_t p0, int64_t p1) { fn(&args, type, p0, p1); });
}

}  // namespace vllm_pp

// The loops around an intrinsics GGUF decode kernel, shared by quant_gguf_avx2.cpp and
// quant_gguf_avx512.cpp: rows in chunks, tokens in tiles of 4, 2 and 1, a tile's rows, the
// switch over ggml types and activation dtypes. An ISA file supplies only its kernels, as a
// tile policy:
//
//   struct Tiles {
//     // Accumulators per tile (RT * TT) for a ggml type: what the ISA's registers hold.
//     static constexpr int accumulators(int64_t type);
//     // Rows [row, row + RT) x tokens [tok, tok + TT) of y = x W^T: 32-weight blocks (Q4_0,
//     // Q4_1, Q8_0) and 256-weight K-quant super-blocks.
//     template <int64_t Type, int RT, int TT, typename scalar_t>
//     static void tile(const LinearArgs& a, int64_t row, int64_t tok);
//     template <int64_t Type, int RT, int TT, typename scalar_t>
//     static void ktile(const LinearArgs& a, int64_t row, int64_t tok);
//   };
//
// (always_inline, with the ISA's target attribute), and one entry point with that attribute
// calling decode_tiles<Tiles>. The file defines VLLM_PP_GGUF_TARGET to its target attribute
// before including this header: the driver is compiled with the same attribute, because GCC
// does not always_inline a function into one built for a narrower target, and the whole
// matmul must end up inlined into the entry point as one function, as it was when each file
// carried its own copy of these loops. A `flatten` entry point over an attribute-free driver
// also inlines everything, but its different inlining order moved Q4_K's AVX-512 kernel 1.16x
// slower (docs/PERFORMANCE.md, "AVX2 kernel").
#pragma once

#include <c10/util/BFloat16.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>

#include "quant_gguf.h"

#ifndef VLLM_PP_GGUF_TARGET
#error "define VLLM_PP_GGUF_TARGET (the including ISA file's target attribute) first"
#endif
#define VLLM_PP_GGUF_DRIVER_INLINE VLLM_PP_GGUF_TARGET inline __attribute__((always_inline))

namespace vllm_pp::gguf {
// Unnamed: each ISA file compiles its own copy, for its own target.
namespace {

// Prefetch lines [g * per, (g + 1) * per) of the `lines` lines at next (the next tile's rows,
// a slice per block while this tile computes: the hardware prefetcher does not follow the
// 2 x RT streams, scales and quants of each row, a tile reads).
VLLM_PP_GGUF_DRIVER_INLINE void prefetch_slice(const char* next, int64_t lines, int64_t per,
                                                int64_t g) {
  for (int64_t l = g * per; l < std::min(lines, (g + 1) * per); ++l)
    _mm_prefetch(next + 64 * l, _MM_HINT_T0);
}

// Rows [begin, end) for tokens [tok, tok + TT): tiles of accumulators / TT rows, the rest row
// by row.
template <typename Tiles, int64_t Type, int TT, typename scalar_t>
VLLM_PP_GGUF_DRIVER_INLINE void token_tile(const LinearArgs& a, int64_t begin, int64_t end,
                                           int64_t tok) {
  constexpr int RT = Tiles::accumulators(Type) / TT;
  int64_t row = begin;
  if constexpr (is_k_quant(Type)) {
    for (; row + RT <= end; row += RT) Tiles::template ktile<Type, RT, TT, scalar_t>(a, row, tok);
    for (; row < end; ++row) Tiles::template ktile<Type, 1, TT, scalar_t>(a, row, tok);
  } else {
    for (; row + RT <= end; row += RT) Tiles::template tile<Type, RT, TT, scalar_t>(a, row, tok);
    for (; row < end; ++row) Tiles::template tile<Type, 1, TT, scalar_t>(a, row, tok);
  }
}

template <typename Tiles, int64_t Type, typename scalar_t>
VLLM_PP_GGUF_DRIVER_INLINE void tile_rows(const LinearArgs& a, int64_t begin, int64_t end) {
  // Row chunks of 64 so a chunk's weights stay in L1/L2 across the token tiles.
  for (int64_t r0 = begin; r0 < end; r0 += 64) {
    const int64_t r1 = std::min(end, r0 + 64);
    int64_t tok = 0;
    for (; tok + 4 <= a.tokens; tok += 4) token_tile<Tiles, Type, 4, scalar_t>(a, r0, r1, tok);
    for (; tok + 2 <= a.tokens; tok += 2) token_tile<Tiles, Type, 2, scalar_t>(a, r0, r1, tok);
    for (; tok < a.tokens; ++tok) token_tile<Tiles, Type, 1, scalar_t>(a, r0, r1, tok);
  }
}

template <typename Tiles, typename scalar_t>
VLLM_PP_GGUF_DRIVER_INLINE void typed_rows(const LinearArgs& a, int64_t type, int64_t begin,
                                           int64_t end) {
  switch (type) {
    case kQ4_0:
      return tile_rows<Tiles, kQ4_0, scalar_t>(a, begin, end);
    case kQ4_1:
      return tile_rows<Tiles, kQ4_1, scalar_t>(a, begin, end);
    case kQ4_K:
      return tile_rows<Tiles, kQ4_K, scalar_t>(a, begin, end);
    case kQ5_K:
      return tile_rows<Tiles, kQ5_K, scalar_t>(a, begin, end);
    case kQ6_K:
      return tile_rows<Tiles, kQ6_K, scalar_t>(a, begin, end);
    default:
      return tile_rows<Tiles, kQ8_0, scalar_t>(a, begin, end);
  }
}

// Rows [begin, end) of y = x W^T for all a.tokens with Tiles' kernels; x and out are bfloat16
// when bf16, float32 otherwise. Called by an ISA file's entry point (decode_avx2, ...).
template <typename Tiles>
VLLM_PP_GGUF_DRIVER_INLINE void decode_tiles(const LinearArgs& a, int64_t type, bool bf16,
                                             int64_t begin, int64_t end) {
  if (bf16) {
    typed_rows<Tiles, c10::BFloat16>(a, type, begin, end);
  } else {
    typed_rows<Tiles, float>(a, type, begin, end);
  }
}

}  // namespace
}  // namespace vllm_pp::gguf

// What quant_gguf.cpp (the ISA-generic GGUF kernels and the ops) shares with
// quant_gguf_avx512.cpp (the AVX-512 decode kernel): the matmul's arguments, ggml's type ids
// and the row layout.
#pragma once

#include <cstdint>
#include <cstring>

namespace vllm_pp::gguf {

// ggml's type ids (ggml.h: GGML_TYPE_*).
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ5_K = 13;
constexpr int64_t kQ6_K = 14;
// Weights per group: the unit the kernels decode at a time and the span of one (Q4_0/Q4_1/Q8_0)
// block; a K-quant super-block of 256 weights is 8 such groups, each with its own scale (and
// min), or, for Q6_K, two scales (one per 16 weights).
constexpr int64_t kBlock = 32;
constexpr int64_t kSuper = 256;  // weights per K-quant super-block

constexpr bool is_k_quant(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// Weights per ggml block (32, or 256 for the K-quants) and bytes per block (ggml's block_q*).
constexpr int64_t block_weights(int64_t type) { return is_k_quant(type) ? kSuper : kBlock; }
constexpr int64_t block_bytes(int64_t type) {
  return type == kQ4_0   ? 18
         : type == kQ4_1 ? 20
         : type == kQ8_0 ? 34
         : type == kQ4_K ? 144
         : type == kQ5_K ? 176
                         : 210;
}

// The row layout the kernels read: the bytes of a GGUF row regrouped (repack_gguf_rows in
// vllm/model_executor/layers/quantization/gguf.py does it once at load): first the fp16 scales
// d of all its blocks, then (Q4_1) their minima m, then the blocks' quants one after the
// other. Same bytes, so the same size; but the scales of a row are contiguous, and W of them
// are widened to fp32 with a few vector ops instead of one block at a time. The K-quants keep
// the file's layout (their scales are decoded once per 256 weights, not per 32).
template <int64_t Type>
struct Layout {
  static constexpr int64_t kScaleBytes = Type == kQ4_1 ? 4 : 2;  // per block
  static constexpr int64_t kQuantBytes = block_bytes(Type) - kScaleBytes;
  static inline const uint8_t* mins(const uint8_t* row, int64_t blocks) {
    return row + 2 * blocks;
  }
  static inline const uint8_t* quants(const uint8_t* row, int64_t blocks) {
    return row + kScaleBytes * blocks;
  }
};

// The IEEE half at p as a float (finite values: a scale is never inf or NaN). The half's
// exponent and mantissa moved into a float's fields, then scaled by 2^(127 - 15) = 2^112,
// which is exact and also covers subnormal halves.
inline __attribute__((always_inline)) float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t magnitude_bits = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float magnitude;
  std::memcpy(&magnitude, &magnitude_bits, 4);
  magnitude *= 0x1p112f;
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// A K-quant super-block sb's 8 groups of 32 weights as two floats each, so that a weight is
// one multiply (and add) of its integer quant: Q4_K / Q5_K s = d * sc, t = -(dmin * m), the
// weight q * s + t (numpy's d * q - dm: q * s is exact, so both round once, the same way);
// Q6_K s, t = d * sc of the group's first / last 16 weights, the weight (q - 32) * s or t.
// d * sc is exact in fp32 (11 x 8 bits at most).
inline __attribute__((always_inline)) void k_group_scales(const uint8_t* sb, int64_t type,
                                                          float* s, float* t) {
  if (type == kQ6_K) {
    const float d = half_at(sb + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(sb + 192);
    for (int j = 0; j < 8; ++j) {
      s[j] = d * static_cast<float>(sc[2 * j]);
      t[j] = d * static_cast<float>(sc[2 * j + 1]);
    }
    return;
  }
  const float d = half_at(sb), dmin = half_at(sb + 2);
  const uint8_t* q = sb + 4;  // ggml's get_scale_min_k4: 6-bit scales and mins in 12 bytes
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    s[j] = d * static_cast<float>(sc);
    t[j] = -(dmin * static_cast<float>(m));
  }
}

struct LinearArgs {
  void* out;         // [T, N], row stride out_stride
  const void* x;     // [T, K], row stride x_stride
  const uint8_t* w;  // [N, row_bytes]
  int64_t tokens, n, k, row_bytes, x_stride, out_stride;
};

// Rows [begin, end) of y = x W^T for all a.tokens, with AVX-512 (quant_gguf_avx512.cpp);
// only called when the CPU has it, for every type. The same products, summed in the
// same order, as the generic kernels of quant_gguf.cpp at W = 16.
void decode_avx512(const LinearArgs& a, int64_t type, bool bf16, int64_t begin, int64_t end);

// The same with AVX2 + FMA + F16C (quant_gguf_avx2.cpp): the same products, summed in the same
// order, as the generic kernels at W = 8.
void decode_avx2(const LinearArgs& a, int64_t type, bool bf16, int64_t begin, int64_t end);

}  // namespace vllm_pp::gguf

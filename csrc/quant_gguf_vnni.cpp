// The GGUF matmul with int8 activations (llama.cpp's arithmetic): y[T, N] = x[T, K] @ W^T for
// W in Q4_0, Q4_1 or Q8_0 blocks (the kernels' row layout, quant_gguf.h), x and y float32 or
// bfloat16.
//
// Each token's x is first quantized per 32-element block b to int8 with one fp32 scale, once
// per call and shared by every weight row (llama.cpp's quantize_row_q8_0, but the scale kept
// in fp32):
//   amax = max |x_i|,  dx = amax / 127,  qx_i = round_half_even(x_i * (1 / dx))  (0 if dx = 0)
// Then each block's dot product is an exact integer, scaled once per block:
//   Q4_0: dw * dx * sum((qw_i - 8) * qx_i)
//   Q4_1: dw * dx * sum(qw_i * qx_i) + mw * (dx * sum(qx_i))
//   Q8_0: dw * dx * sum(qw_i * qx_i)
// With AVX-512 VNNI the integer sums are `vpdpbusd` (64 byte products into 16 dwords per
// instruction): unsigned weights times signed activations, so Q4_0's - 8 and Q8_0's sign
// (its quants read + 128, i.e. xor 0x80) come back as a correction, - 8 or - 128 times the
// sum of the lane's qx, preloaded into each dword lane (which then ends at its exact signed
// sum: no large intermediate values for the float steps to round). 64 bytes of quants at a time: 4 Q4
// blocks (low nibbles = weights 0-15 of each, high nibbles = weights 16-31) or 2 Q8 blocks.
// The activations are stored in the matching order (`Packed`), so a group of 64 weight bytes
// needs no shuffles: 2 logic ops (Q4), 2 vpdpbusd, 1 conversion and 2 float ops per token.
//
// The per-block float partials are summed in a different order from the numpy reference
// (tests/models/test_gguf_vnni.py), which does the integer sums exactly: equal up to fp32
// rounding of each partial and of their sum. Without VNNI (or with the ISA lowered) a scalar
// kernel computes the same integer sums from the same packed activations.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "ops.h"
#include "quant_gguf.h"

#if defined(__x86_64__)
// GCC 12 reports the intrinsics headers' deliberately undefined pass-through operands
// (_mm512_undefined_*) as "may be used uninitialized" once they are inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define VLLM_PP_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define VLLM_PP_VNNI_INLINE VLLM_PP_VNNI inline __attribute__((always_inline))
#endif

namespace vllm_pp {
namespace gguf {
namespace {

// One token's quantized activations, laid out for 64-byte groups of weight quants. A group
// covers kPer blocks (4 for Q4_0/Q4_1: 16 bytes of nibbles each; 2 for Q8_0: 32 bytes each)
// and holds, in order:
//   qa[64] int8    Q4: weights 0-15 of each of the 4 blocks; Q8: the 2 blocks' 32 values
//   qb[64] int8    Q4 only: weights 16-31 of each of the 4 blocks
//   corr[16] int32 each dword lane's initial value: - 8 (Q4_0) or - 128 (Q8_0) times the sum
//                  of the qx that lane multiplies (0 for Q4_1), so each lane ends at its
//                  exact signed sum, sum((qw - 8) qx) or sum(qw qx) over its elements
//   dx[16] f32     the block's scale in each of its 16 / kPer lanes
// After the groups: sx[blocks rounded up to 16] f32, dx * sum(qx) per block (Q4_1's minima),
// then sums[same] int32, sum(qx) per block. Blocks past the last are zero everywhere.
struct Packed {
  int64_t type, blocks, per, groups, group_bytes, sx_offset, sums_offset, row_bytes;

  Packed(int64_t type_, int64_t k) : type(type_), blocks(k / kBlock) {
    per = type == kQ8_0 ? 2 : 4;
    groups = (blocks + per - 1) / per;
    group_bytes = (type == kQ8_0 ? 64 : 128) + 64 + 64;
    sx_offset = groups * group_bytes;
    const int64_t padded = (blocks + 15) / 16 * 16;
    sums_offset = sx_offset + 4 * padded;
    row_bytes = sums_offset + 4 * padded;
  }
  int64_t qb_offset() const { return 64; }
  int64_t corr_offset() const { return type == kQ8_0 ? 64 : 128; }
  int64_t dx_offset() const { return corr_offset() + 64; }
  int64_t lanes() const { return 16 / per; }  // dword lanes per block

  // Where element i < 32 of block b sits in a token's packed row.
  int64_t q_index(int64_t b, int64_t i) const {
    const int64_t g = b / per, j = b % per;
    if (type == kQ8_0) return g * group_bytes + 32 * j + i;
    return g * group_bytes + (i < 16 ? 0 : qb_offset()) + 16 * j + i % 16;
  }
  float dx(const uint8_t* row, int64_t b) const {
    float d;
    std::memcpy(&d, row + b / per * group_bytes + dx_offset() + 4 * lanes() * (b % per), 4);
    return d;
  }
  int32_t sum(const uint8_t* row, int64_t b) const {
    int32_t s;
    std::memcpy(&s, row + sums_offset + 4 * b, 4);
    return s;
  }
};

// Block b's scale and integer sum stored (the quants already are): dx, sx, sums; and the
// correction of each of its dword lanes: lane l of the block multiplies its elements i with
// (i % 16) / 4 == l (Q4: 4 low-nibble and 4 high-nibble weights) or i / 4 == l (Q8_0).
inline void store_block_scales(const Packed& p, uint8_t* row, int64_t b, float d, int32_t sum) {
  const int64_t g = b / p.per, j = b % p.per;
  uint8_t* grp = row + g * p.group_bytes;
  if (p.type != kQ4_1) {
    int32_t lane_sums[8] = {};
    for (int64_t i = 0; i < kBlock; ++i)
      lane_sums[p.type == kQ8_0 ? i / 4 : (i % 16) / 4] +=
          static_cast<int8_t>(row[p.q_index(b, i)]);
    for (int64_t l = 0; l < p.lanes(); ++l) {
      const int32_t corr = (p.type == kQ4_0 ? -8 : -128) * lane_sums[l];
      std::memcpy(grp + p.corr_offset() + 4 * (p.lanes() * j + l), &corr, 4);
    }
  }
  for (int64_t l = 0; l < p.lanes(); ++l)
    std::memcpy(grp + p.dx_offset() + 4 * (p.lanes() * j + l), &d, 4);
  const float sx = d * static_cast<float>(sum);
  std::memcpy(row + p.sx_offset + 4 * b, &sx, 4);
  std::memcpy(row + p.sums_offset + 4 * b, &sum, 4);
}

template <typename scalar_t>
inline float to_float(scalar_t v) {
  return static_cast<float>(v);
}

// Scalar quantization of one token's x [K] into its packed row (zeroed beforehand). The IEEE
// operations (max of |x|, one division, one reciprocal, one multiply, round half to even) of
// the vector version below, so both give the same bytes.
template <typename scalar_t>
void quantize_row_scalar(const Packed& p, const scalar_t* x, uint8_t* row) {
  for (int64_t b = 0; b < p.blocks; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(to_float(x[b * kBlock + i])));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const auto q = static_cast<int32_t>(std::nearbyint(to_float(x[b * kBlock + i]) * id));
      row[p.q_index(b, i)] = static_cast<uint8_t>(static_cast<int8_t>(q));
      sum += q;
    }
    store_block_scales(p, row, b, d, sum);
  }
}

// The scalar kernel: rows [begin, end) for every token, the same integer sums, each block's
// partial dw * dx * isum (+ mw * sx) added in order.
template <typename scalar_t>
void linear_scalar(const LinearArgs& a, int64_t type, const Packed& p, const uint8_t* packed,
                   int64_t begin, int64_t end) {
  const int64_t qbytes = type == kQ8_0 ? 32 : 16;
  const int64_t scale_bytes = type == kQ4_1 ? 4 : 2;
  auto* out = static_cast<scalar_t*>(a.out);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = a.w + n * a.row_bytes;
    const uint8_t* quants = w + scale_bytes * p.blocks;
    for (int64_t t = 0; t < a.tokens; ++t) {
      const uint8_t* row = packed + t * p.row_bytes;
      const auto* qx = reinterpret_cast<const int8_t*>(row);
      float acc = 0.0f;
      for (int64_t b = 0; b < p.blocks; ++b) {
        const uint8_t* qs = quants + b * qbytes;
        int32_t isum = 0;
        for (int i = 0; i < kBlock; ++i) {
          int32_t qw;
          if (type == kQ8_0) {
            qw = static_cast<int8_t>(qs[i]);
          } else {
            qw = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
            if (type == kQ4_0) qw -= 8;
          }
          isum += qw * qx[p.q_index(b, i)];
        }
        float partial = half_at(w + 2 * b) * p.dx(row, b) * static_cast<float>(isum);
        if (type == kQ4_1)
          partial += half_at(w + 2 * p.blocks + 2 * b) * (p.dx(row, b) * p.sum(row, b));
        acc += partial;
      }
      out[t * a.out_stride + n] = static_cast<scalar_t>(acc);
    }
  }
}

#if defined(__x86_64__)

VLLM_PP_VNNI_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// bfloat16 is the top half of a float32: zero-extend and shift (exact).
VLLM_PP_VNNI_INLINE __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The first n <= 16 fp16 numbers at p as fp32 (exact); the masked load reads only those.
VLLM_PP_VNNI_INLINE __m512 halves(const uint8_t* p, int64_t n) {
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// quantize_row_scalar with vectors: one block (two zmm) at a time. vcvtps2dq rounds half to
// even (the default MXCSR mode), as nearbyint does.
template <typename scalar_t>
VLLM_PP_VNNI void quantize_row_vnni(const Packed& p, const scalar_t* x, uint8_t* row) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    const __m512 a = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
    const float d = _mm512_reduce_max_ps(a) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + p.q_index(b, 0)), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + p.q_index(b, 16)),
                     _mm512_cvtepi32_epi8(q1));
    store_block_scales(p, row, b, d, _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// Rows [row, row + RT) x tokens [tok, tok + TT). Per 16 blocks and row: the 16 scales dw
// widened once (and, Q4_1, the minima's term added: mw . sx, 16 blocks in one FMA); per group
// of 64 quant bytes and row: the quants loaded once (Q4: split into low / high nibbles), the
// group's dw spread to its blocks' lanes (vpermps), then per token the dword sums (vpdpbusd,
// from the correction), converted, times dx, and added times dw into the token's accumulator.
template <int64_t Type, int RT, int TT, typename scalar_t>
VLLM_PP_VNNI_INLINE void tile(const LinearArgs& a, const Packed& p, const uint8_t* packed,
                              int64_t row, int64_t tok) {
  using L = Layout<Type>;
  constexpr int64_t kPer = Type == kQ8_0 ? 2 : 4;
  constexpr int64_t kQBytes = Type == kQ8_0 ? 32 : 16;
  const uint8_t* w = a.w + row * a.row_bytes;
  const int64_t blocks = p.blocks;
  const int64_t quant_bytes = blocks * kQBytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // Lane l of a group's scale vector: block l / (16 / kPer) of the group.
  const __m512i spread = kPer == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3,
                                                       3, 3)
                                   : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                                       1, 1);
  __m512 acc[RT][TT];
#pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  // The next tile's bytes (its rows follow this tile's), prefetched a slice per group as
  // quant_gguf_avx512.cpp does: the hardware prefetcher does not follow 2 x RT streams.
  const char* next = reinterpret_cast<const char*>(w + RT * a.row_bytes);
  const int64_t next_lines = (RT * a.row_bytes + 63) / 64;
  const int64_t lines_per_group = (next_lines + p.groups - 1) / p.groups;
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, blocks - b0);
    __m512 dw[RT];
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r) {
      const uint8_t* w_row = w + r * a.row_bytes;
      dw[r] = halves(w_row + 2 * b0, n);
      if constexpr (Type == kQ4_1) {
        const __m512 mw = halves(L::mins(w_row, blocks) + 2 * b0, n);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          const auto* sx = reinterpret_cast<const float*>(packed + (tok + t) * p.row_bytes +
                                                          p.sx_offset) + b0;
          acc[r][t] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(sx), acc[r][t]);
        }
      }
    }
    const int64_t g_end = (b0 + n + kPer - 1) / kPer;
    for (int64_t g = b0 / kPer; g < g_end; ++g) {
      for (int64_t l = g * lines_per_group; l < std::min(next_lines, (g + 1) * lines_per_group);
           ++l)
        _mm_prefetch(next + 64 * l, _MM_HINT_T0);
      // The last group of a row may be partial: only its bytes are loaded (the rest are 0,
      // and so are the padded activations and scales they would meet).
      const int64_t left = quant_bytes - g * 64;
      const __mmask64 mask = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      const __m512i idx = _mm512_add_epi32(spread, _mm512_set1_epi32(
                                                       static_cast<int>(g * kPer - b0)));
      const uint8_t* grp[TT];
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) grp[t] = packed + (tok + t) * p.row_bytes + g * p.group_bytes;
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const uint8_t* qs = L::quants(w + r * a.row_bytes, blocks) + g * 64;
        const __m512i raw = _mm512_maskz_loadu_epi8(mask, qs);
        __m512i lo, hi;
        if constexpr (Type == kQ8_0) {
          lo = _mm512_xor_si512(raw, flip);
          hi = lo;
        } else {
          lo = _mm512_and_si512(raw, low4);
          hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        const __m512 dwg = _mm512_permutexvar_ps(idx, dw[r]);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          const uint8_t* gp = grp[t];
          __m512i s = Type == kQ4_1 ? _mm512_setzero_si512()
                                    : _mm512_loadu_si512(gp + p.corr_offset());
          s = _mm512_dpbusd_epi32(s, lo, _mm512_loadu_si512(gp));
          if constexpr (Type != kQ8_0) s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(gp + 64));
          const __m512 f =
              _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(reinterpret_cast<const float*>(
                                                       gp + p.dx_offset())));
          acc[r][t] = _mm512_fmadd_ps(f, dwg, acc[r][t]);
        }
      }
    }
  }
  auto* out = static_cast<scalar_t*>(a.out);
#pragma GCC unroll 8
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t)
      out[(tok + t) * a.out_stride + row + r] =
          static_cast<scalar_t>(_mm512_reduce_add_ps(acc[r][t]));
}

template <int64_t Type, int TT, typename scalar_t>
VLLM_PP_VNNI_INLINE void token_tile(const LinearArgs& a, const Packed& p, const uint8_t* packed,
                                    int64_t begin, int64_t end, int64_t tok) {
  constexpr int RT = 8 / TT;
  int64_t row = begin;
  for (; row + RT <= end; row += RT) tile<Type, RT, TT, scalar_t>(a, p, packed, row, tok);
  for (; row < end; ++row) tile<Type, 1, TT, scalar_t>(a, p, packed, row, tok);
}

template <int64_t Type, typename scalar_t>
VLLM_PP_VNNI void rows_vnni(const LinearArgs& a, const Packed& p, const uint8_t* packed,
                            int64_t begin, int64_t end) {
  // Row chunks of 64 so a chunk's weights stay in L1/L2 across the token tiles.
  for (int64_t r0 = begin; r0 < end; r0 += 64) {
    const int64_t r1 = std::min(end, r0 + 64);
    int64_t tok = 0;
    for (; tok + 4 <= a.tokens; tok += 4) token_tile<Type, 4, scalar_t>(a, p, packed, r0, r1, tok);
    for (; tok + 2 <= a.tokens; tok += 2) token_tile<Type, 2, scalar_t>(a, p, packed, r0, r1, tok);
    for (; tok < a.tokens; ++tok) token_tile<Type, 1, scalar_t>(a, p, packed, r0, r1, tok);
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}
#endif  // __x86_64__

// Whether the VNNI kernel runs: the CPU has it and the ISA was not lowered below AVX-512.
bool use_vnni() {
#if defined(__x86_64__)
  static const bool has = cpu_has_vnni();
  return has && active_isa().load() == VLLM_PP_ISA_AVX512;
#else
  return false;
#endif
}

// Every token of x [T, K] quantized into packed rows [T, p.row_bytes] (64-byte aligned).
template <typename scalar_t>
void quantize_all(const Packed& p, const at::Tensor& x, bool vnni, uint8_t* packed) {
  std::memset(packed, 0, x.size(0) * p.row_bytes);
  const auto* xp = static_cast<const scalar_t*>(x.data_ptr());
  for (int64_t t = 0; t < x.size(0); ++t) {
#if defined(__x86_64__)
    if (vnni) {
      quantize_row_vnni(p, xp + t * x.stride(0), packed + t * p.row_bytes);
      continue;
    }
#endif
    quantize_row_scalar(p, xp + t * x.stride(0), packed + t * p.row_bytes);
  }
}

// A per-thread buffer for the packed activations, reused across calls (no allocation per
// linear at decode).
uint8_t* packed_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < bytes + 64) buffer.resize(bytes + 64);
  const auto addr = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - addr % 64) % 64);
}

void check_x(const char* op, const at::Tensor& x, int64_t type) {
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ8_0, op, ": ggml type ", type,
              " is not supported (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be a CPU [T, K] tensor with unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % kBlock == 0, op, ": K (", x.size(1),
              ") must be a multiple of 32");
}

}  // namespace
}  // namespace gguf

void gguf_linear_q8(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    int64_t type) {
  using namespace gguf;
  constexpr const char* op = "gguf_linear_q8";
  check_x(op, x, type);
  const int64_t k = x.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte &&
                  weight.dim() == 2 && weight.is_contiguous(),
              op, ": weight must be a contiguous CPU uint8 [N, row_bytes] tensor");
  TORCH_CHECK(weight.size(1) == k / kBlock * block_bytes(type), op, ": weight rows hold ",
              weight.size(1), " bytes, expected ", k / kBlock * block_bytes(type),
              " for K = ", k);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              op, ": out must be [T, N] of x's dtype with unit last stride");
  const LinearArgs args{out.data_ptr(), x.data_ptr(), weight.data_ptr<uint8_t>(),
                        x.size(0),      weight.size(0), k,
                        weight.size(1), x.stride(0),    out.stride(0)};
  if (args.tokens == 0 || args.n == 0) return;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool vnni = use_vnni();
  const Packed p(type, k);
  uint8_t* packed = packed_buffer(args.tokens * p.row_bytes);
  if (bf16)
    quantize_all<c10::BFloat16>(p, x, vnni, packed);
  else
    quantize_all<float>(p, x, vnni, packed);
  // Rows per task: >= 256 KiB of weights, so a thread's share outweighs waking it.
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 18) / args.row_bytes);
  at::parallel_for(0, args.n, grain, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (vnni) {
#define VLLM_PP_VNNI_CASE(TYPE)                                           \
  if (type == TYPE) {                                                     \
    if (bf16)                                                             \
      rows_vnni<TYPE, c10::BFloat16>(args, p, packed, begin, end);        \
    else                                                                  \
      rows_vnni<TYPE, float>(args, p, packed, begin, end);                \
    return;                                                               \
  }
      VLLM_PP_VNNI_CASE(kQ4_0)
      VLLM_PP_VNNI_CASE(kQ4_1)
      VLLM_PP_VNNI_CASE(kQ8_0)
#undef VLLM_PP_VNNI_CASE
    }
#endif
    if (bf16)
      linear_scalar<c10::BFloat16>(args, type, p, packed, begin, end);
    else
      linear_scalar<float>(args, type, p, packed, begin, end);
  });
}

void gguf_quantize_q8(at::Tensor& q, at::Tensor& scales, const at::Tensor& x) {
  using namespace gguf;
  constexpr const char* op = "gguf_quantize_q8";
  check_x(op, x, kQ8_0);
  const int64_t tokens = x.size(0), k = x.size(1), blocks = k / kBlock;
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(0) == tokens &&
                  q.size(1) == k,
              op, ": q must be a contiguous int8 [T, K] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == tokens && scales.size(1) == blocks,
              op, ": scales must be a contiguous float32 [T, K / 32] tensor");
  // Through both packed layouts (Q4's and Q8_0's), each read back with its accessors: the
  // test sees what every kernel reads.
  auto* qp = q.data_ptr<int8_t>();
  auto* dp = scales.data_ptr<float>();
  const bool vnni = use_vnni();
  for (const int64_t type : {kQ8_0, kQ4_0}) {
    const Packed p(type, k);
    std::vector<uint8_t> packed(tokens * p.row_bytes + 64);
    if (x.scalar_type() == at::kBFloat16)
      quantize_all<c10::BFloat16>(p, x, vnni, packed.data());
    else
      quantize_all<float>(p, x, vnni, packed.data());
    for (int64_t t = 0; t < tokens; ++t) {
      const uint8_t* row = packed.data() + t * p.row_bytes;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t sum = 0;
        for (int64_t i = 0; i < kBlock; ++i) {
          const auto v = static_cast<int8_t>(row[p.q_index(b, i)]);
          sum += v;
          if (type == kQ8_0) {
            qp[t * k + b * kBlock + i] = v;
          } else {
            TORCH_CHECK(qp[t * k + b * kBlock + i] == v, op, ": the two layouts differ");
          }
        }
        TORCH_CHECK(sum == p.sum(row, b), op, ": block sum mismatch");
        if (type == kQ8_0) dp[t * blocks + b] = p.dx(row, b);
      }
    }
  }
}

}  // namespace vllm_pp

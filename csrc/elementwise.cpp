// The small per-token operations of a LLaMA layer, fused: RMSNorm (alone, or with the residual
// add before it), rotary position embedding (in place on q/k) and SwiGLU's silu(gate) * up.
// In torch each of them is a chain of elementwise ops (pow, mean, rsqrt, mul, casts, cat, neg,
// silu, add), each a pass over memory with its own dispatch and temporary; here each is one
// call that reads a row from memory once (a norm's second pass over the row runs in L1).
//
// The results must stay those of the torch code they replace (the model is checked token for
// token against HF transformers), so every kernel repeats torch's roundings step by step:
//   - bfloat16: torch computes a bf16 op in fp32 and rounds the result to bf16, so each
//     intermediate the torch code materialises in bf16 is rounded here too (Simd::round_bf16),
//     at the same points: those results are then bit-identical to torch's.
//   - float32: one fp32 rounding per torch op. Vec::round marks those points in fp32 too: GCC
//     would otherwise fuse q*cos + rot*sin into one FMA (its default for C++ is
//     -ffp-contract=fast, across statements), rounding once where torch rounds twice.
//     Elsewhere contraction stays on: silu's exp polynomial needs its FMAs to be fast.
// What cannot be identical: the order in which RMSNorm sums the squares (torch's vectorised
// reduction has its own), and silu's exp (a polynomial, not torch's SLEEF). Both stay within a
// few fp32 ulps; after rounding to bf16, silu is still identical to torch's for every bf16
// input (checked exhaustively by the tests), and RMSNorm's normalised value is at most one
// bf16 ulp off, rarely.
//
// Rows (tokens) run in parallel with at::parallel_for, only when a task gets at least torch's
// elementwise grain (32768 elements): a decode step of a few tokens stays on the calling thread.

#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "cpu_simd.h"
#include "cpu_vec.h"

namespace vllm_pp {
namespace {

// sum of x[i]^2 over a row, in fp32 (two accumulators, so the adds do not wait on each other).
template <int W, typename scalar_t>
VLLM_PP_INLINE float sum_squares(const scalar_t* x, int64_t len) {
  using V = Vec<W, scalar_t>;
  using S = typename V::S;
  using f32 = typename V::f32;
  f32 acc0{}, acc1{};
  int64_t d = 0;
  for (; d + 2 * W <= len; d += 2 * W) {
    const f32 a = S::load(x + d), b = S::load(x + d + W);
    acc0 += a * a;
    acc1 += b * b;
  }
  for (; d < len; d += W) {
    const f32 a = V::load(x + d, std::min<int64_t>(W, len - d));
    acc0 += a * a;
  }
  return S::reduce_add(acc0 + acc1);
}

// 1 / sqrt(mean + eps) exactly as torch evaluates HF's `torch.rsqrt(h.pow(2).mean(-1) + eps)`:
// the CPU mean divides the fp32 sum by the count, eps is added in fp32 (a Python float meets an
// fp32 tensor), and torch.rsqrt is 1 / sqrt with both steps correctly rounded.
VLLM_PP_INLINE float inv_rms(float sum_squares, int64_t len, float eps) {
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(len) + eps);
}

// ---- RMSNorm ------------------------------------------------------------------------------

struct NormArgs {
  void* out;            // [T, hidden], row stride out_stride (rms_norm; fused: == x)
  const void* x;        // [T, hidden], row stride x_stride
  void* residual;       // [T, hidden], row stride res_stride (fused only)
  const void* weight;   // [hidden], contiguous
  int64_t out_stride, x_stride, res_stride, hidden;
  float eps;
};

template <int W, typename scalar_t>
struct RmsNormKernel {
  using V = Vec<W, scalar_t>;
  using f32 = typename V::f32;

  // out = weight * round(h * r), h the row in fp32: HF's `weight * (h * rsqrt).to(dtype)`.
  // The product of two bf16 values is exact in fp32, so rounding it once on the store is
  // exactly torch's bf16 mul.
  static VLLM_PP_INLINE void normalize(scalar_t* out, const scalar_t* h, const scalar_t* weight,
                                       int64_t len, float r) {
    V::chunks(len, [&](int64_t d, int64_t n) VLLM_PP_LAMBDA_INLINE {
      const f32 normed = V::round(V::load(h + d, n) * r);
      V::store(out + d, V::load(weight + d, n) * normed, n);
    });
  }

  static VLLM_PP_INLINE void run(const NormArgs& a, int64_t begin, int64_t end) {
    const auto* weight = static_cast<const scalar_t*>(a.weight);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* x = static_cast<const scalar_t*>(a.x) + t * a.x_stride;
      scalar_t* out = static_cast<scalar_t*>(a.out) + t * a.out_stride;
      // Reads the whole row before writing any of it, so out may be x itself.
      const float r = inv_rms(sum_squares<W, scalar_t>(x, a.hidden), a.hidden, a.eps);
      normalize(out, x, weight, a.hidden, r);
    }
  }
};

// residual = x + residual (one rounding to the dtype, as torch's add), then x = rms_norm of it.
template <int W, typename scalar_t>
struct FusedAddRmsNormKernel {
  using V = Vec<W, scalar_t>;

  static VLLM_PP_INLINE void run(const NormArgs& a, int64_t begin, int64_t end) {
    const auto* weight = static_cast<const scalar_t*>(a.weight);
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* x = static_cast<scalar_t*>(a.out) + t * a.x_stride;
      scalar_t* res = static_cast<scalar_t*>(a.residual) + t * a.res_stride;
      // The sum, rounded to the dtype and stored (the norm reads the stored residual in torch
      // too); then rms_norm of it, the row still in L1. The squares are summed by the same
      // code as rms_norm's, in the same order, so the result does not depend on whether the
      // add was fused: a pipeline stage boundary (which materialises the sum) changes nothing.
      V::chunks(a.hidden, [&](int64_t d, int64_t n) VLLM_PP_LAMBDA_INLINE {
        V::store(res + d, V::load(x + d, n) + V::load(res + d, n), n);
      });
      const float r = inv_rms(sum_squares<W, scalar_t>(res, a.hidden), a.hidden, a.eps);
      RmsNormKernel<W, scalar_t>::normalize(x, res, weight, a.hidden, r);
    }
  }
};

// ---- Rotary embedding ---------------------------------------------------------------------

struct RotaryArgs {
  const int64_t* positions;  // [T], all in [0, max_position)
  void* query;               // [T, H*D], row stride q_stride
  void* key;                 // [T, Hkv*D], row stride k_stride
  const float* cos_cache;    // [max_position, D], contiguous
  const float* sin_cache;
  int64_t q_stride, k_stride, num_heads, num_kv_heads, head_size;
};

// Rotate-half (NeoX / HF LLaMA) layout: with x = (x1, x2) split at D/2,
//   out = x * cos + (-x2, x1) * sin.
// bf16 repeats HF's roundings: cos/sin cast to bf16, each product rounded, then their sum.
template <int W, typename scalar_t>
struct RotaryKernel {
  using V = Vec<W, scalar_t>;
  using f32 = typename V::f32;

  static VLLM_PP_INLINE void rotate_head(scalar_t* x, const float* cos, const float* sin,
                                         int64_t half) {
    V::chunks(half, [&](int64_t d, int64_t n) VLLM_PP_LAMBDA_INLINE {
      const f32 x1 = V::load(x + d, n), x2 = V::load(x + half + d, n);
      const f32 c1 = V::load(cos + d, n), c2 = V::load(cos + half + d, n);
      const f32 s1 = V::load(sin + d, n), s2 = V::load(sin + half + d, n);
      // x1 * c1 + (-x2) * s1: negation commutes with rounding, so this is torch's sum exactly.
      // Each product rounded (V::round) before the sum, as in torch, in fp32 too.
      V::store(x + d, V::round(x1 * c1) - V::round(x2 * s1), n);
      V::store(x + half + d, V::round(x2 * c2) + V::round(x1 * s2), n);
    });
  }

  static VLLM_PP_INLINE void run(const RotaryArgs& a, int64_t begin, int64_t end) {
    const int64_t D = a.head_size, half = D / 2;
    // bf16: this token's cos/sin rounded to bf16 once, shared by all its heads.
    std::vector<float> rounded(V::kBF16 ? 2 * D : 0);
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = a.cos_cache + a.positions[t] * D;
      const float* sin = a.sin_cache + a.positions[t] * D;
      if constexpr (V::kBF16) {
        V::chunks(D, [&](int64_t d, int64_t n) VLLM_PP_LAMBDA_INLINE {
          const f32 c = V::round(V::load(cos + d, n)), s = V::round(V::load(sin + d, n));
          for (int64_t i = 0; i < n; ++i) {  // n lanes only: the buffer has exactly D floats
            rounded[d + i] = c[i];
            rounded[D + d + i] = s[i];
          }
        });
        cos = rounded.data();
        sin = rounded.data() + D;
      }
      scalar_t* q = static_cast<scalar_t*>(a.query) + t * a.q_stride;
      scalar_t* k = static_cast<scalar_t*>(a.key) + t * a.k_stride;
      for (int64_t h = 0; h < a.num_heads; ++h) rotate_head(q + h * D, cos, sin, half);
      for (int64_t h = 0; h < a.num_kv_heads; ++h) rotate_head(k + h * D, cos, sin, half);
    }
  }
};

// ---- SwiGLU -------------------------------------------------------------------------------

struct SiluArgs {
  void* out;      // [T, I], row stride out_stride
  const void* x;  // [T, 2I] = (gate, up), row stride x_stride
  int64_t out_stride, x_stride, inter;
};

template <int W, typename scalar_t>
struct SiluAndMulKernel {
  using V = Vec<W, scalar_t>;
  using S = typename V::S;
  using f32 = typename V::f32;
  using u32 = typename V::u32;

  // silu(g) = g / (1 + exp(-g)) with one division and an exp whose argument is never
  // positive: with e = exp(-|g|), silu = g / (1 + e) for g >= 0 (torch's formula) and
  // g * e / (1 + e) for g < 0 (torch's, times e / e: 1 / e would cost a second division).
  // Below -87.3, exp(-|g|) is denormal, which exp_nonpositive flushes to 0, while torch's
  // exp(-g) stays finite down to g = -88.72 (its silu there is ~ -1e-37, not -0). So for
  // |g| > 80 the argument is shifted: e' = exp(16 - |g|), exact (16 - |g| keeps |g|'s binade or
  // a finer one); for g < -80, 1 + e == 1 and silu = g * e' * e^-16; for g > 80, silu = g.
  // Below g = -88.72 silu is -0, where torch's exp(-g) overflows. NaN stays NaN;
  // silu(+inf) = +inf and silu(-inf) = NaN, as in torch.
  static VLLM_PP_INLINE f32 silu(f32 g) {
    const f32 minus_abs = (f32)((u32)g | 0x80000000u);
    const auto far = minus_abs < -80.0f;
    const f32 e = S::exp_nonpositive(far ? minus_abs + 16.0f : minus_abs);
    // The factor that turns e into exp(-|g|) in the numerator: e^-16 when shifted (0 past
    // torch's overflow), else 1 (exact).
    const f32 unshift = far ? (g < -88.72283905f ? S::splat(0.0f) : S::splat(1.12535175e-7f))
                            : S::splat(1.0f);
    const f32 num = g >= 0.0f ? g : g * e * unshift;
    return num / (1.0f + (far ? S::splat(0.0f) : e));
  }

  static VLLM_PP_INLINE void run(const SiluArgs& a, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gate = static_cast<const scalar_t*>(a.x) + t * a.x_stride;
      const scalar_t* up = gate + a.inter;
      scalar_t* out = static_cast<scalar_t*>(a.out) + t * a.out_stride;
      V::chunks(a.inter, [&](int64_t d, int64_t n) VLLM_PP_LAMBDA_INLINE {
        // HF: act_fn(gate) is a dtype tensor (rounded), then multiplied by up (rounded again).
        const f32 act = V::round(silu(V::load(gate + d, n)));
        V::store(out + d, act * V::load(up + d, n), n);
      });
    }
  }
};

// ---- Per-ISA instantiation and the row loop -----------------------------------------------

// Each kernel for one dtype, as select_isa_kernel (cpu_isa.h) wants it: a class per width W.
template <template <int, typename> class Kernel, typename scalar_t>
struct OfDtype {
  template <int W>
  using At = Kernel<W, scalar_t>;
};

template <template <int, typename> class Kernel, typename scalar_t, typename Args>
auto select_rows() -> void (*)(const Args&, int64_t, int64_t) {
  return select_isa_kernel<OfDtype<Kernel, scalar_t>::template At, const Args&, int64_t,
                           int64_t>();
}

// Elements a parallel task gets at least: at::internal::GRAIN_SIZE, torch's own threshold for
// elementwise ops (ATen/TensorIterator.h, too heavy a header to include for one constant).
// Below that the fork/join of a parallel region costs more than it saves.
constexpr int64_t kGrainElems = 32768;

// Runs Kernel over rows [0, rows) of `row_elems` elements each, whole rows per task. A decode
// batch (a few rows of a few hundred elements) stays on the calling thread.
template <template <int, typename> class Kernel, typename Args>
void run_rows(const Args& a, at::ScalarType dtype, int64_t rows, int64_t row_elems) {
  const auto fn = dtype == at::kFloat ? select_rows<Kernel, float, Args>()
                                      : select_rows<Kernel, c10::BFloat16, Args>();
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
}

// ---- Argument checks ----------------------------------------------------------------------

void check_float_dtype(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16, got ", t.scalar_type());
}

void check_same_dtype(const char* op, const at::Tensor& t, const at::Tensor& ref,
                      const char* name, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " dtype ", t.scalar_type(),
              " differs from the ", ref_name, " dtype ", ref.scalar_type());
}

// A [T, width] CPU matrix whose rows may be strided but whose elements are contiguous.
void check_rows(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": CPU tensors only (", name, " is on ", t.device(), ")");
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D [T, width], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name,
              " must have a unit last stride (rows may be strided), got strides ", t.strides());
}

void check_norm_weight(const char* op, const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.device().is_cpu(), op, ": CPU tensors only (weight is on ",
              weight.device(), ")");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op,
              ": weight must be a contiguous [", x.size(1), "] tensor, got ", weight.sizes());
  check_same_dtype(op, weight, x, "weight", "input");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm";
  check_rows(op, x, "x");
  check_rows(op, out, "out");
  check_float_dtype(op, x);
  TORCH_CHECK(out.sizes() == x.sizes(), op, ": out ", out.sizes(), " must match x ", x.sizes());
  check_same_dtype(op, out, x, "out", "input");
  check_norm_weight(op, weight, x);
  const int64_t T = x.size(0), hidden = x.size(1);
  if (T == 0 || hidden == 0) return;

  NormArgs a{};
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.out_stride = out.stride(0);
  a.x_stride = x.stride(0);
  a.hidden = hidden;
  a.eps = static_cast<float>(eps);
  run_rows<RmsNormKernel>(a, x.scalar_type(), T, hidden);
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  constexpr const char* op = "fused_add_rms_norm";
  check_rows(op, x, "x");
  check_rows(op, residual, "residual");
  check_float_dtype(op, x);
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual ", residual.sizes(),
              " must match x ", x.sizes());
  check_same_dtype(op, residual, x, "residual", "input");
  check_norm_weight(op, weight, x);
  const int64_t T = x.size(0), hidden = x.size(1);
  if (T == 0 || hidden == 0) return;

  NormArgs a{};
  a.out = x.data_ptr();
  a.x = x.data_ptr();
  a.residual = residual.data_ptr();
  a.weight = weight.data_ptr();
  a.out_stride = a.x_stride = x.stride(0);
  a.res_stride = residual.stride(0);
  a.hidden = hidden;
  a.eps = static_cast<float>(eps);
  run_rows<FusedAddRmsNormKernel>(a, x.scalar_type(), T, hidden);
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache) {
  constexpr const char* op = "rotary_embedding";
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              op, ": positions must be a contiguous int64 [T] CPU tensor");
  const int64_t T = positions.size(0);
  check_rows(op, query, "query");
  check_rows(op, key, "key");
  check_float_dtype(op, query);
  check_same_dtype(op, key, query, "key", "query");
  TORCH_CHECK(query.size(0) == T && key.size(0) == T, op, ": query ", query.sizes(), " and key ",
              key.sizes(), " must have one row per position (", T, ")");
  TORCH_CHECK(head_size > 0 && head_size % 2 == 0, op,
              ": head_size must be positive and even, got ", head_size);
  TORCH_CHECK(query.size(1) % head_size == 0 && key.size(1) % head_size == 0, op,
              ": query width ", query.size(1), " and key width ", key.size(1),
              " must be multiples of head_size ", head_size);
  for (const auto* cache : {&cos_cache, &sin_cache})
    TORCH_CHECK(cache->device().is_cpu() && cache->dim() == 2 &&
                    cache->scalar_type() == at::kFloat && cache->is_contiguous() &&
                    cache->size(1) == head_size,
                op, ": cos/sin caches must be contiguous float32 [max_position, ", head_size,
                "] CPU tensors, got ", cache->scalar_type(), " ", cache->sizes());
  TORCH_CHECK(cos_cache.sizes() == sin_cache.sizes(), op, ": cos cache ", cos_cache.sizes(),
              " and sin cache ", sin_cache.sizes(), " differ");
  // Every position checked before any row is rotated: a bad one leaves q/k untouched.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_position = cos_cache.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, op, ": positions[", t, "] = ", pos[t],
                " out of range [0, ", max_position, ")");
  if (T == 0) return;

  RotaryArgs a{};
  a.positions = pos;
  a.query = query.data_ptr();
  a.key = key.data_ptr();
  a.cos_cache = cos_cache.data_ptr<float>();
  a.sin_cache = sin_cache.data_ptr<float>();
  a.q_stride = query.stride(0);
  a.k_stride = key.stride(0);
  a.num_heads = query.size(1) / head_size;
  a.num_kv_heads = key.size(1) / head_size;
  a.head_size = head_size;
  run_rows<RotaryKernel>(a, query.scalar_type(), T, query.size(1) + key.size(1));
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  constexpr const char* op = "silu_and_mul";
  check_rows(op, x, "x");
  check_rows(op, out, "out");
  check_float_dtype(op, x);
  check_same_dtype(op, out, x, "out", "input");
  TORCH_CHECK(x.size(1) % 2 == 0, op, ": x must be [T, 2*I] (gate, up), got ", x.sizes());
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2, op, ": out must be [",
              x.size(0), ", ", x.size(1) / 2, "], got ", out.sizes());
  const int64_t T = x.size(0), inter = x.size(1) / 2;
  if (T == 0 || inter == 0) return;

  SiluArgs a{};
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.out_stride = out.stride(0);
  a.x_stride = x.stride(0);
  a.inter = inter;
  run_rows<SiluAndMulKernel>(a, x.scalar_type(), T, 2 * inter);
}

}  // namespace vllm_pp

// The batched LoRA update of one linear layer, in one call: for every adapted token t of slot s,
//   out[t, slice i] += round(round(x[t] @ A[s, i]^T) @ B[s, i]^T) * scale[s]
// for each output slice i (q/k/v or gate/up of a fused layer, or the one slice of a plain
// layer) the adapter targets. That is PEFT's order of operations: `lora_B(lora_A(x)) *
// scaling` added to the base output, each step rounded as torch rounds the tensor it
// materialises (bf16: to bf16; fp32: the scale multiply and the add stay two roundings, never
// one FMA).
//
// Why a kernel: in torch the grouped update is a chain of small ops per layer (gather, two
// batched matmuls, scale, scatter back, add), each with its own dispatch and, on a CPU shared
// by several processes, its own thread barrier; the matmuls are tiny (a decode step is a few
// tokens times rank 8-64), so that overhead, not the arithmetic, was the cost. Here a layer's
// whole update is one call, and only the useful arithmetic is done: each slice's ranks against
// its own output columns (the stacked B is block diagonal: the zero blocks are never read), and
// only the ranks the slot's adapter has (ranks[s, i]; 0 skips a slice it does not target).
//
// Tokens come sorted by slot (the caller builds the order once per step for all layers), so a
// slot's A and B stay in cache while its tokens run. Tasks of at::parallel_for take contiguous
// ranges of that order; each writes only its own tokens' rows of out.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <initializer_list>
#include <vector>

#include "cpu_isa.h"
#include "cpu_vec.h"
#include "ops.h"

namespace vllm_pp {
namespace {

struct LoRAArgs {
  void* out;                // [T, out_width], row stride out_stride
  const void* x;            // [T, in], row stride x_stride
  const void* lora_a;       // [S, n * R, in], contiguous
  const void* lora_b_t;     // [S, n * R, out_width], contiguous (B transposed)
  const int64_t* tokens;    // [N] adapted tokens, sorted by slot
  const int64_t* slots;     // [N] the slot of each
  const float* scale;       // [S]
  const int64_t* ranks;     // [S, n]: the adapter's rank on each slice (0: not targeted)
  const int64_t* offsets;   // [n + 1]: slice i is output columns [offsets[i], offsets[i + 1])
  int64_t out_stride, x_stride, in, out_width, n_slices, max_rank;
};

template <int W, typename scalar_t>
struct LoRAKernel {
  using V = Vec<W, scalar_t>;
  using S = typename V::S;
  using f32 = typename V::f32;

  // h = x . a as the shrink matmul's output holds it (rounded to bf16 in a bf16 model).
  static VLLM_PP_INLINE float materialise(float h) {
    if constexpr (V::kBF16) return static_cast<float>(c10::BFloat16(h));
    return h;
  }

  // h[t][k] = x[t] . a[k] for TB tokens and K rows of A at once: each chunk of a row of A is
  // loaded once for all the tokens, each chunk of x once for all the rows. A token's sum runs
  // in the same order whatever TB, so its result does not depend on how tokens are blocked.
  template <int TB, int K>
  static VLLM_PP_INLINE void dots(float* const* h, const scalar_t* const* x, const scalar_t* a,
                                  int64_t in) {
    f32 acc[TB][K] = {};
    V::chunks(in, [&](int64_t d, int64_t n) VLLM_PP_LAMBDA_INLINE {
      f32 av[K];
      for (int k = 0; k < K; ++k) av[k] = V::load(a + k * in + d, n);
      for (int t = 0; t < TB; ++t) {
        const f32 xv = V::load(x[t] + d, n);
        for (int k = 0; k < K; ++k) acc[t][k] += xv * av[k];
      }
    });
    for (int t = 0; t < TB; ++t)
      for (int k = 0; k < K; ++k) h[t][k] = materialise(S::reduce_add(acc[t][k]));
  }

  // Shrink for tokens j .. j + TB of slot s: h[j, i * R + r] for each slice i and rank
  // r < ranks[s, i].
  template <int TB>
  static VLLM_PP_INLINE void shrink(const LoRAArgs& a, int64_t j, int64_t s, float* h_row0) {
    const int64_t n = a.n_slices, R = a.max_rank, nR = n * R;
    const scalar_t* A = static_cast<const scalar_t*>(a.lora_a) + s * nR * a.in;
    const scalar_t* x[TB];
    float* h[TB];
    for (int t = 0; t < TB; ++t) {
      x[t] = static_cast<const scalar_t*>(a.x) + a.tokens[j + t] * a.x_stride;
      h[t] = h_row0 + t * nR;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t stop = i * R + a.ranks[s * n + i];
      int64_t r = i * R;
      for (; r + 4 <= stop; r += 4) {
        float* hr[TB];
        for (int t = 0; t < TB; ++t) hr[t] = h[t] + r;
        dots<TB, 4>(hr, x, A + r * a.in, a.in);
      }
      for (; r < stop; ++r) {
        float* hr[TB];
        for (int t = 0; t < TB; ++t) hr[t] = h[t] + r;
        dots<TB, 1>(hr, x, A + r * a.in, a.in);
      }
    }
  }

  // Expand for tokens j .. j + TB over output columns [lo, hi) of one slice: Bt holds the
  // slice's `rank` rows of B^T (row stride out_width), h[t] the tokens' ranks of the slice.
  template <int TB>
  static VLLM_PP_INLINE void expand(const LoRAArgs& a, int64_t j, const float* h_row0,
                                    const scalar_t* Bt, int64_t rank, int64_t lo, int64_t hi,
                                    float scale) {
    const int64_t nR = a.n_slices * a.max_rank;
    scalar_t* out[TB];
    const float* h[TB];
    for (int t = 0; t < TB; ++t) {
      out[t] = static_cast<scalar_t*>(a.out) + a.tokens[j + t] * a.out_stride;
      h[t] = h_row0 + t * nR;
    }
    V::chunks(hi - lo, [&](int64_t d, int64_t m) VLLM_PP_LAMBDA_INLINE {
      const int64_t o = lo + d;
      f32 acc[TB] = {};
      for (int64_t r = 0; r < rank; ++r) {
        const f32 b = V::load(Bt + r * a.out_width + o, m);
        for (int t = 0; t < TB; ++t) acc[t] += S::splat(h[t][r]) * b;
      }
      for (int t = 0; t < TB; ++t) {
        // lora_B's output (rounded), times the scale (rounded), added to the base output.
        const f32 delta = V::round(V::round(acc[t]) * scale);
        V::store(out[t] + o, V::load(out[t] + o, m) + delta, m);
      }
    });
  }

  // Output columns per tile: the tile of B's rows (rank x tile) stays in L1 across a slot's
  // tokens.
  static int64_t tile_width(int64_t rank) {
    return std::max<int64_t>(W, (8192 / std::max<int64_t>(rank, 1)) / W * W);
  }

  static VLLM_PP_INLINE void run(const LoRAArgs& a, int64_t begin, int64_t end) {
    const int64_t n = a.n_slices, R = a.max_rank, nR = n * R;
    // h[j - begin, i * R + r]: the shrunk ranks of this task's tokens.
    std::vector<float> h_buf((end - begin) * nR);
    // One run of tokens of the same slot at a time, in blocks of up to kBlock tokens.
    constexpr int64_t kBlock = 4;
    for (int64_t run = begin; run < end;) {
      const int64_t s = a.slots[run];
      int64_t run_end = run + 1;
      while (run_end < end && a.slots[run_end] == s) ++run_end;
      const auto h_of = [&](int64_t j) { return h_buf.data() + (j - begin) * nR; };
      int64_t j = run;
      for (; j + kBlock <= run_end; j += kBlock) shrink<kBlock>(a, j, s, h_of(j));
      for (; j < run_end; ++j) shrink<1>(a, j, s, h_of(j));
      const float scale = a.scale[s];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t rank = a.ranks[s * n + i];
        if (rank == 0) continue;
        // Rows i * R .. i * R + rank of B^T: this slice's ranks.
        const scalar_t* Bt =
            static_cast<const scalar_t*>(a.lora_b_t) + (s * nR + i * R) * a.out_width;
        const int64_t lo = a.offsets[i], hi = a.offsets[i + 1], tile = tile_width(rank);
        for (int64_t t0 = lo; t0 < hi; t0 += tile) {
          const int64_t t1 = std::min(hi, t0 + tile);
          j = run;
          for (; j + kBlock <= run_end; j += kBlock)
            expand<kBlock>(a, j, h_of(j) + i * R, Bt, rank, t0, t1, scale);
          for (; j < run_end; ++j) expand<1>(a, j, h_of(j) + i * R, Bt, rank, t0, t1, scale);
        }
      }
      run = run_end;
    }
  }
};

template <typename scalar_t>
struct LoRAOfDtype {
  template <int W>
  using At = LoRAKernel<W, scalar_t>;
};

// Multiply-adds a parallel task gets at least (~50 us of work): below that the fork/join of a
// parallel region, a barrier that waits for the slowest thread on a machine other processes
// load, costs more than the split saves. A decode step (16 tokens of a rank-8 SmolLM2 layer:
// 0.2-0.6 M) stays on the calling thread; a prefill splits.
constexpr int64_t kMinTaskMacs = 1 << 20;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "lora_apply: CPU tensors only (", name, " is on ",
              t.device(), ")");
}

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == dim,
              "lora_apply: ", name, " must be a contiguous int64 tensor of ", dim,
              " dimension(s), got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

void lora_apply(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
                const at::Tensor& lora_b_t, const at::Tensor& tokens, const at::Tensor& slots,
                const at::Tensor& scale, const at::Tensor& ranks,
                c10::IntArrayRef slice_offsets) {
  constexpr const char* op = "lora_apply";
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &x}) {
    check_cpu(*t, "out/x");
    TORCH_CHECK(t->dim() == 2 && (t->stride(1) == 1 || t->size(1) <= 1), op,
                ": out and x must be 2-D with a unit last stride, got ", t->sizes(), " strides ",
                t->strides());
  }
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16, got ", dtype);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &lora_a, &lora_b_t}) {
    check_cpu(*t, "lora weights");
    TORCH_CHECK(t->scalar_type() == dtype, op, ": out, lora_a and lora_b_t must have x's dtype ",
                dtype, ", got ", t->scalar_type());
  }
  const int64_t T = x.size(0), in = x.size(1), out_width = out.size(1);
  const int64_t n = static_cast<int64_t>(slice_offsets.size()) - 1;
  TORCH_CHECK(n >= 1, op, ": slice_offsets needs at least two entries");
  TORCH_CHECK(out.size(0) == T, op, ": out has ", out.size(0), " rows, x has ", T);
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == in &&
                  lora_a.size(1) % n == 0,
              op, ": lora_a must be a contiguous [slots, ", n, " * max_rank, ", in, "], got ",
              lora_a.sizes());
  const int64_t num_slots = lora_a.size(0), R = lora_a.size(1) / n;
  TORCH_CHECK(lora_b_t.dim() == 3 && lora_b_t.is_contiguous() && lora_b_t.size(0) == num_slots &&
                  lora_b_t.size(1) == n * R && lora_b_t.size(2) == out_width,
              op, ": lora_b_t must be a contiguous [", num_slots, ", ", n * R, ", ", out_width,
              "], got ", lora_b_t.sizes());
  check_index(tokens, "tokens", 1);
  check_index(slots, "slots", 1);
  check_index(ranks, "ranks", 2);
  check_cpu(scale, "scale");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 &&
                  scale.size(0) == num_slots,
              op, ": scale must be a contiguous float32 [", num_slots, "], got ",
              scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK(ranks.size(0) == num_slots && ranks.size(1) == n, op, ": ranks must be [",
              num_slots, ", ", n, "], got ", ranks.sizes());
  const int64_t N = tokens.size(0);
  TORCH_CHECK(slots.size(0) == N, op, ": ", N, " tokens but ", slots.size(0), " slots");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slice_offsets[i] >= 0 && slice_offsets[i] <= slice_offsets[i + 1] &&
                    slice_offsets[n] <= out_width,
                op, ": slice_offsets must rise within [0, ", out_width, "], got ",
                slice_offsets);
  // Every index checked before any row is written: bad input leaves out untouched.
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* rank = ranks.data_ptr<int64_t>();
  for (int64_t j = 0; j < N; ++j) {
    TORCH_CHECK(tok[j] >= 0 && tok[j] < T, op, ": tokens[", j, "] = ", tok[j],
                " out of range [0, ", T, ")");
    TORCH_CHECK(slot[j] >= 0 && slot[j] < num_slots, op, ": slots[", j, "] = ", slot[j],
                " out of range [0, ", num_slots, ")");
  }
  for (int64_t i = 0; i < num_slots * n; ++i)
    TORCH_CHECK(rank[i] >= 0 && rank[i] <= R, op, ": ranks must be in [0, ", R, "], got ",
                rank[i]);
  if (N == 0 || in == 0) return;

  LoRAArgs a{};
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.lora_a = lora_a.data_ptr();
  a.lora_b_t = lora_b_t.data_ptr();
  a.tokens = tok;
  a.slots = slot;
  a.scale = scale.data_ptr<float>();
  a.ranks = rank;
  std::vector<int64_t> offsets(slice_offsets.begin(), slice_offsets.end());
  a.offsets = offsets.data();
  a.out_stride = out.stride(0);
  a.x_stride = x.stride(0);
  a.in = in;
  a.out_width = out_width;
  a.n_slices = n;
  a.max_rank = R;
  const auto fn =
      dtype == at::kFloat
          ? select_isa_kernel<LoRAOfDtype<float>::At, const LoRAArgs&, int64_t, int64_t>()
          : select_isa_kernel<LoRAOfDtype<c10::BFloat16>::At, const LoRAArgs&, int64_t,
                              int64_t>();
  // A token's work at the largest rank: shrink n*R x in, expand R x each slice's width.
  const int64_t token_macs = std::max<int64_t>(1, n * R * in + R * slice_offsets[n]);
  const int64_t grain = std::max<int64_t>(1, kMinTaskMacs / token_macs);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
}

}  // namespace vllm_pp

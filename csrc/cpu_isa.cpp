// The instruction set the CPU kernels run with: the best one this CPU supports, unless a test
// lowered it (cpu_isa.h).

#include "cpu_isa.h"

#include <c10/util/Exception.h>

#include "ops.h"

namespace vllm_pp {
namespace {

std::string best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return "avx512";
  // F16C: the AVX2 GGUF kernel loads fp16 scales with it (every AVX2 CPU has it).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return "avx2";
#endif
  return "generic";
}

int isa_rank(const std::string& isa) {
  if (isa == "avx512") return VLLM_PP_ISA_AVX512;
  if (isa == "avx2") return VLLM_PP_ISA_AVX2;
  if (isa == "generic") return VLLM_PP_ISA_GENERIC;
  return -1;
}

}  // namespace

std::atomic<int>& active_isa() {
  static std::atomic<int> rank{isa_rank(best_isa())};
  return rank;
}

std::string cpu_isa() {
  static const char* names[] = {"generic", "avx2", "avx512"};
  return names[active_isa().load()];
}

void set_cpu_isa(const std::string& isa) {
  const int rank = isa_rank(isa);
  TORCH_CHECK(rank >= 0, "set_cpu_isa: unknown ISA '", isa, "' (generic, avx2, avx512)");
  TORCH_CHECK(rank <= isa_rank(best_isa()), "set_cpu_isa: this CPU does not support ", isa);
  active_isa().store(rank);
}

}  // namespace vllm_pp

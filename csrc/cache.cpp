// Writing new tokens' K/V into the paged cache: each token's [Hkv, D] rows go to its flat slot
// (block * block_size + offset). A plain byte copy, so it works for every dtype; slots < 0 mark
// tokens that have no place in the cache (padding) and are skipped.

#include "ops.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace vllm_pp {
namespace {

void check_source(const at::Tensor& src, const at::Tensor& cache, int64_t T, const char* name) {
  TORCH_CHECK(src.dim() == 3 && src.size(0) == T && src.size(1) == cache.size(2) &&
                  src.size(2) == cache.size(3),
              "write_to_kv_cache: ", name, " must be [T, Hkv, D] matching the cache, got ",
              src.sizes());
  TORCH_CHECK(src.scalar_type() == cache.scalar_type(), "write_to_kv_cache: ", name, " dtype ",
              src.scalar_type(), " differs from the cache dtype ", cache.scalar_type());
  TORCH_CHECK(src.stride(2) == 1, "write_to_kv_cache: ", name, " head dim must be contiguous");
  TORCH_CHECK(src.device().is_cpu(), "write_to_kv_cache: CPU tensors only");
}

// Copies the [Hkv, D] rows of token t to the cache slot; rows may be strided in the source.
void copy_token(const at::Tensor& src, at::Tensor& cache, int64_t t, int64_t slot) {
  const int64_t heads = src.size(1), row_bytes = src.size(2) * src.element_size();
  const auto* from = static_cast<const char*>(src.data_ptr()) + t * src.stride(0) * src.element_size();
  auto* to = static_cast<char*>(cache.data_ptr()) + slot * heads * row_bytes;
  if (src.stride(1) == src.size(2)) {  // heads back to back: one copy for the token
    std::memcpy(to, from, heads * row_bytes);
    return;
  }
  for (int64_t h = 0; h < heads; ++h)
    std::memcpy(to + h * row_bytes, from + h * src.stride(1) * src.element_size(), row_bytes);
}

}  // namespace

void write_to_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous(),
              "write_to_kv_cache: caches must both be contiguous [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "write_to_kv_cache: CPU tensors only");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.device().is_cpu(),
              "write_to_kv_cache: slot_mapping must be a contiguous int64 [T] CPU tensor");
  const int64_t T = slot_mapping.size(0);
  check_source(key, key_cache, T, "key");
  check_source(value, value_cache, T, "value");

  // Check every slot before writing any, so a bad mapping leaves the cache untouched (as
  // index_copy_ does).
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < num_slots, "write_to_kv_cache: slot_mapping[", t, "] = ", slots[t],
                " out of range for ", num_slots, " cache slots");

  // A decode step writes a few KiB and a prefill at most a few MiB: memory-bound, serial.
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    copy_token(key, key_cache, t, slots[t]);
    copy_token(value, value_cache, t, slots[t]);
  }
}

}  // namespace vllm_pp

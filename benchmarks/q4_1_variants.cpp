// Ways to decode a Q4_1 block inside the batch-1 fp32-activation GEMV, timed on this core.
// Built and run by benchmarks/q4_1_variants.py (g++ -O3, the AVX-512 target attribute below).
//
// Every variant keeps csrc/quant_gguf_avx512.cpp's arithmetic: weight = d * q + m formed in
// fp32 (d * q exact), multiplied into the same accumulator lane in the same order, so each
// must give the production kernel's results bit for bit (checked). They differ only in how
// the 16-entry lookup and the nibble unpacking are done. Two "floor" rows are not kernels:
// without the unpacking (the quants' own bits as indices) and with the FMAs alone (the
// weights replaced by d), to show what the lookups cost.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define INLINE TARGET inline __attribute__((always_inline))

enum Variant {
  kCurrent, kShuffleLow, kShuffleBoth, kConvert, kMagic, kYmmPerm2, kHybrid, kHybridMagic,
  kNoUnpack, kFmaOnly
};

// table[idx] as two 256-bit two-table lookups of 8 weights each.
INLINE __m512 ymm_lookup(__m512i idx, __m512 table) {
  const __m256 t0 = _mm512_castps512_ps256(table), t1 = _mm512_extractf32x8_ps(table, 1);
  const __m256 a = _mm256_permutex2var_ps(t0, _mm512_castsi512_si256(idx), t1);
  const __m256 c = _mm256_permutex2var_ps(t0, _mm512_extracti32x8_epi32(idx, 1), t1);
  return _mm512_insertf32x8(_mm512_castps256_ps512(a), c, 1);
}

// Rows [0, RT) of a tile, one token: Q4_1 rows in the kernels' layout (all fp16 d, all fp16 m,
// then 16 quant bytes per block), with the production kernel's next-tile prefetch.
template <int V, int RT>
INLINE void tile(const uint8_t* w, int64_t row_bytes, int64_t k, const float* x, float* out) {
  const int64_t blocks = k / 32;
  const __m512 base = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // vpshufb control: in each 128-bit lane L, dword p <- byte 4L + p (zero-extended).
  const __m512i ctrl = _mm512_set_epi32(
      0x8080800F, 0x8080800E, 0x8080800D, 0x8080800C, 0x8080800B, 0x8080800A, 0x80808009,
      0x80808008, 0x80808007, 0x80808006, 0x80808005, 0x80808004, 0x80808003, 0x80808002,
      0x80808001, 0x80808000);
  const __m512i low4 = _mm512_set1_epi32(0xF);
  __m512 acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) float d[RT][16];
  alignas(64) float m[RT][16];
  const char* next = reinterpret_cast<const char*>(w + RT * row_bytes);
  const int64_t next_lines = (RT * row_bytes + 63) / 64;
  const int64_t per = (next_lines + blocks - 1) / blocks;
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, blocks - b0);
    const auto mask = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < RT; ++r) {
      const uint8_t* row = w + r * row_bytes;
      _mm512_store_ps(d[r], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, row + 2 * b0)));
      const uint8_t* mins = row + 2 * blocks;
      _mm512_store_ps(m[r], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + 2 * b0)));
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = b0 + j;
      for (int64_t l = b * per; l < std::min(next_lines, (b + 1) * per); ++l)
        _mm_prefetch(next + 64 * l, _MM_HINT_T0);
      const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        const uint8_t* qs = w + r * row_bytes + 4 * blocks + b * 16;
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
        const __m512 dv = _mm512_set1_ps(d[r][j]), mv = _mm512_set1_ps(m[r][j]);
        __m512 w0, w1;
        if constexpr (V == kConvert || V == kMagic) {
          const __m512i q = _mm512_cvtepu8_epi32(raw);
          const __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_srli_epi32(q, 4);
          if constexpr (V == kConvert) {
            w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), dv, mv);
            w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dv, mv);
          } else {  // float(q) as (2^23 + q) - 2^23: an add instead of a conversion
            const __m512i magic = _mm512_set1_epi32(0x4B000000);
            const __m512 big = _mm512_set1_ps(8388608.0f);
            const __m512 f0 = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(lo, magic)), big);
            const __m512 f1 = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(hi, magic)), big);
            w0 = _mm512_fmadd_ps(f0, dv, mv);
            w1 = _mm512_fmadd_ps(f1, dv, mv);
          }
        } else if constexpr (V == kHybrid || V == kHybridMagic) {
          // Weights 0-15 looked up (vpermps), 16-31 converted and FMA'd: the same value
          // fl(d * q + m) both ways, one lookup less on the shuffle pipes, one FMA more.
          const __m512i q = _mm512_cvtepu8_epi32(raw);
          w0 = _mm512_permutexvar_ps(q, _mm512_fmadd_ps(base, dv, mv));
          const __m512i hi = _mm512_srli_epi32(q, 4);  // < 16: no mask needed
          __m512 f1;
          if constexpr (V == kHybrid) {
            f1 = _mm512_cvtepi32_ps(hi);
          } else {
            const __m512i biased = _mm512_or_si512(hi, _mm512_set1_epi32(0x4B000000));
            f1 = _mm512_sub_ps(_mm512_castsi512_ps(biased), _mm512_set1_ps(8388608.0f));
          }
          w1 = _mm512_fmadd_ps(f1, dv, mv);
        } else if constexpr (V == kFmaOnly) {
          w0 = dv;
          w1 = mv;
        } else {
          const __m512 table = _mm512_fmadd_ps(base, dv, mv);
          __m512i lo, hi;
          if constexpr (V == kCurrent || V == kYmmPerm2) {
            lo = _mm512_cvtepu8_epi32(raw);
            hi = _mm512_srli_epi32(lo, 4);
          } else if constexpr (V == kShuffleLow) {
            lo = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), ctrl);
            hi = _mm512_srli_epi32(lo, 4);
          } else if constexpr (V == kShuffleBoth) {
            lo = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), ctrl);
            hi = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_srli_epi16(raw, 4)), ctrl);
          } else {  // kNoUnpack: not a kernel, x's bits as indices
            lo = _mm512_castps_si512(x0);
            hi = _mm512_castps_si512(x1);
          }
          if constexpr (V == kYmmPerm2) {  // two-table 256-bit lookups, 8 weights each
            w0 = ymm_lookup(lo, table);
            w1 = ymm_lookup(hi, table);
          } else {
            w0 = _mm512_permutexvar_ps(lo, table);
            w1 = _mm512_permutexvar_ps(hi, table);
          }
        }
        acc[r] = _mm512_fmadd_ps(w0, x0, acc[r]);
        acc[r] = _mm512_fmadd_ps(w1, x1, acc[r]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

template <int V, int RT>
TARGET __attribute__((noinline)) void gemv(const uint8_t* w, int64_t n, int64_t k, const float* x,
                                           float* out) {
  const int64_t row_bytes = k / 32 * 20;
  for (int64_t r = 0; r < n; r += RT) tile<V, RT>(w + r * row_bytes, row_bytes, k, x, out + r);
}

using Fn = void (*)(const uint8_t*, int64_t, int64_t, const float*, float*);

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 3072, k = argc > 2 ? atoll(argv[2]) : 576;
  const int64_t row_bytes = k / 32 * 20, nbytes = n * row_bytes;
  const int copies = static_cast<int>(std::max<int64_t>(2, (128 << 20) / nbytes));
  std::mt19937 gen(1);
  std::vector<std::vector<uint8_t>> ws(copies, std::vector<uint8_t>(nbytes));
  for (auto& w : ws) {
    for (auto& byte : w) byte = static_cast<uint8_t>(gen());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < k / 32 * 2; ++i) {  // finite fp16 d and m
        const _Float16 h = static_cast<_Float16>(static_cast<float>(gen() % 2000) / 1e5f - 0.01f);
        std::memcpy(&w[r * row_bytes + 2 * i], &h, 2);
      }
  }
  std::vector<float> x(k), ref(n), out(n);
  for (auto& v : x) v = static_cast<float>(gen() % 2000) / 1000.0f - 1.0f;
  gemv<kCurrent, 8>(ws[0].data(), n, k, x.data(), ref.data());
  struct Row { const char* name; Fn fn; bool kernel; };
  const Row rows[] = {
      {"current: vpmovzxbd + vpsrld, 2 vpermps (8 rows)", gemv<kCurrent, 8>, true},
      {"current, 4 rows per tile", gemv<kCurrent, 4>, true},
      {"current, 16 rows per tile", gemv<kCurrent, 16>, true},
      {"low nibbles by broadcast + vpshufb", gemv<kShuffleLow, 8>, true},
      {"both nibbles by broadcast + vpshufb", gemv<kShuffleBoth, 8>, true},
      {"no table: convert + FMA per weight", gemv<kConvert, 8>, true},
      {"no table: 2^23 trick + FMA per weight", gemv<kMagic, 8>, true},
      {"two-table 256-bit vpermt2ps", gemv<kYmmPerm2, 8>, true},
      {"hybrid: low half vpermps, high half convert + FMA", gemv<kHybrid, 8>, true},
      {"hybrid, high half by the 2^23 trick", gemv<kHybridMagic, 8>, true},
      {"floor: table + vpermps, no unpacking", gemv<kNoUnpack, 8>, false},
      {"floor: the two FMAs per block alone", gemv<kFmaOnly, 8>, false},
  };
  std::printf("Q4_1 %lld x %lld, one token; ns per block of 32 weights and row; GB/s of blocks\n",
              static_cast<long long>(n), static_cast<long long>(k));
  std::printf("%-50s %9s %8s %9s %8s  %s\n", "variant", "hot ns", "GB/s", "strm ns", "GB/s",
              "same bits");
  const double block_rows = static_cast<double>(n) * (k / 32);
  for (const Row& row : rows) {
    double best[2] = {1e9, 1e9};
    for (int streamed = 0; streamed < 2; ++streamed)
      for (int rep = 0; rep < 7; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < copies; ++c)
          row.fn(ws[streamed ? c : 0].data(), n, k, x.data(), out.data());
        const auto t1 = std::chrono::steady_clock::now();
        const double s = std::chrono::duration<double>(t1 - t0).count();
        best[streamed] = std::min(best[streamed], s / copies);
      }
    row.fn(ws[0].data(), n, k, x.data(), out.data());
    const bool same = std::memcmp(ref.data(), out.data(), n * sizeof(float)) == 0;
    std::printf("%-50s %9.2f %8.1f %9.2f %8.1f  %s\n", row.name, best[0] * 1e9 / block_rows,
                nbytes / best[0] / 1e9, best[1] * 1e9 / block_rows, nbytes / best[1] / 1e9,
                row.kernel ? (same ? "yes" : "NO") : "(not a kernel)");
  }
  return 0;
}

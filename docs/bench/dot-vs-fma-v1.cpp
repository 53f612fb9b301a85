// Instruction throughput on one core: AVX-512 float32 multiply-adds (vfmadd231ps, 32 flops each) against AVX512-BF16
// dot products (vdpbf16ps, 64 flops each), 12 independent accumulators, nothing read from memory. Why
// core/csrc/bf16_linear.cpp widens bf16 weights to float32 rather than using the dot products.
//
//     g++ -O3 -mavx512f -mavx512bf16 docs/bench/dot-vs-fma-v1.cpp -o /tmp/dot-vs-fma && /tmp/dot-vs-fma
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <int C>
__attribute__((noinline)) void multiply_adds(long n, __m512* sums, __m512 a, __m512 b) {
  __m512 r[C];
  for (int j = 0; j < C; j++) r[j] = sums[j];
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 16
    for (int j = 0; j < C; j++) r[j] = _mm512_fmadd_ps(a, b, r[j]);
  }
  for (int j = 0; j < C; j++) sums[j] = r[j];
}

template <int C>
__attribute__((noinline)) void dot_products(long n, __m512* sums, __m512bh a, __m512bh b) {
  __m512 r[C];
  for (int j = 0; j < C; j++) r[j] = sums[j];
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 16
    for (int j = 0; j < C; j++) r[j] = _mm512_dpbf16_ps(r[j], a, b);
  }
  for (int j = 0; j < C; j++) sums[j] = r[j];
}

int main() {
  constexpr long n = 100000000;
  constexpr int chains = 12;
  __m512 sums[chains];
  for (auto& s : sums) s = _mm512_setzero_ps();
  const auto one_bf16 = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  auto started = std::chrono::steady_clock::now();
  multiply_adds<chains>(n, sums, _mm512_set1_ps(1.0001f), _mm512_set1_ps(0.9999f));
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("{\"fma_per_ns\": %.3f, \"fma_gflops\": %.1f, ", n * chains / s / 1e9, n * chains * 32 / s / 1e9);
  started = std::chrono::steady_clock::now();
  dot_products<chains>(n, sums, one_bf16, one_bf16);
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("\"dpbf16_per_ns\": %.3f, \"dpbf16_gflops\": %.1f, ", n * chains / s / 1e9, n * chains * 64 / s / 1e9);
  float total = 0;
  for (auto& v : sums) total += _mm512_reduce_add_ps(v);
  std::printf("\"checksum\": %.0f}\n", total);
}

// A consumer of the attn package: the first document's 3-token example, row 1. Built three times:
// `consumer` links attn::attn, which must bring no compile flag (no -fopenmp, so `_OPENMP` is
// undefined and the kernels run on one thread; no -march, so no AVX on x86); `consumer_openmp`
// links attn::openmp and is compiled with ATTN_CONSUMER_OPENMP, and must then see OpenMP;
// `consumer_native` links attn::native and is compiled with ATTN_CONSUMER_NATIVE. Each prints the
// SIMD set it was compiled for, the CPU's and the advice (attn/simd.hpp), which
// run_consumer.cmake checks against /proc/cpuinfo.
#include <attn/attn.hpp>
#include <cmath>
#include <cstdio>
#include <string>

#if defined(ATTN_CONSUMER_OPENMP) && !defined(_OPENMP)
#error "attn::openmp was linked but _OPENMP is undefined: the OpenMP flag did not reach the program"
#endif
#if !defined(ATTN_CONSUMER_OPENMP) && defined(_OPENMP)
#error "_OPENMP is defined although only attn::attn was linked: attn added an OpenMP flag unasked"
#endif
#if !defined(ATTN_CONSUMER_NATIVE) && defined(__AVX__)
#error "__AVX__ is defined although attn::native was not linked: attn added an -march flag unasked"
#endif

int main() {
#ifdef ATTN_CONSUMER_OPENMP
  attn::set_num_threads(2);
  if (attn::num_threads() != 2) {
    std::printf("attn::num_threads() is %d after set_num_threads(2) with OpenMP\n",
                attn::num_threads());
    return 1;
  }
  const char* threads = "OpenMP";
#else
  if (attn::num_threads() != 1) {
    std::printf("attn::num_threads() is %d without OpenMP\n", attn::num_threads());
    return 1;
  }
  const char* threads = "one thread";
#endif
  attn::Matrix<double> Q(3, 2);
  Q << 1, 0, 0, 1, 1, 1;
  attn::Matrix<double> V(3, 2);
  V << 1, 0, 0, 1, 0.5, 0.5;
  const attn::Matrix<double> out = attn::scaled_dot_product_attention(Q, Q, V);
  if (std::abs(out(0, 0) - 0.6017) > 1e-4) return 1;
  std::printf("consumer ok (%s): %.4f %.4f\n", threads, out(0, 0), out(0, 1));
  std::printf("simd: compiled %s, available %s\n", attn::simd_name(attn::simd_compiled()).c_str(),
              attn::simd_name(attn::simd_available()).c_str());
  const std::string advice = attn::simd_advice();
  std::printf("advice: %s\n", advice.empty() ? "(none)" : advice.c_str());
  return 0;
}

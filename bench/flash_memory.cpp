// Peak memory of flash_attention at n = m = 32768, d = 64 (float): the materialised path would need
// 32768^2 * 4 bytes = 4 GiB for the scores alone.
//   build/bench/attn_flash_memory [n]
// Prints the resident set size before and after, and the peak growth beyond the inputs and output.

#include <sys/resource.h>

#include <attn/attn.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace {

/// Peak resident set size of this process so far, in KiB.
long peak_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

}  // namespace

int main(int argc, char** argv) {
  const attn::Index n = argc > 1 ? std::atol(argv[1]) : 32768;
  const attn::Index d = 64;
  attn::Matrix<float> Q = attn::Matrix<float>::Random(n, d);
  attn::Matrix<float> K = attn::Matrix<float>::Random(n, d);
  attn::Matrix<float> V = attn::Matrix<float>::Random(n, d);
  attn::Matrix<float> O = attn::Matrix<float>::Zero(n, d);  // the output, allocated and touched
  const long before = peak_rss_kib();
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  const auto start = std::chrono::steady_clock::now();
  O = attn::flash_attention(Q, K, V, options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const long after = peak_rss_kib();
  const double inputs_mib = 4.0 * static_cast<double>(n * d) * 4.0 / 1048576.0;
  std::printf("flash_attention n = m = %ld, d = %ld, float, causal, %d thread(s): %.2f s\n",
              static_cast<long>(n), static_cast<long>(d), attn::num_threads(), seconds);
  std::printf("inputs + output: %.1f MiB; materialised scores would be %.1f MiB\n", inputs_mib,
              static_cast<double>(n) * static_cast<double>(n) * 4.0 / 1048576.0);
  std::printf("peak RSS before the call: %.1f MiB, after: %.1f MiB, growth: %.1f MiB\n",
              static_cast<double>(before) / 1024.0, static_cast<double>(after) / 1024.0,
              static_cast<double>(after - before) / 1024.0);
  std::printf("checksum %.6f\n", static_cast<double>(O.sum()));
  return 0;
}

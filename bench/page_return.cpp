// What returning memory to the system costs the rest of a program, and what 2 MiB pages change:
// the measurements behind `MultiHeadWorkspace::large_pages` (README, "The returning overload and
// 2 MiB pages"). Linux only; a plain program (no Google Benchmark: each round is one sequence of
// system calls, timed once).
//
//   build/bench/attn_page_return [rounds]
//
// Prints two tables:
// 1. Touch a kept 128 MiB block (one write per 4 KiB page), then map, touch and unmap a 32 MiB
//    block (as a caller freeing a large result does), round after round: the time of the kept
//    block's touch, with the kept block in 4 KiB pages and in 2 MiB pages (madvise(MADV_HUGEPAGE)
//    before its first touch). On the project's virtual machines the 4 KiB case took 85-154 ms in
//    some rounds (every page faulted again), against about 1 ms.
// 2. A sum over the kept 128 MiB (best of the rounds, GB/s) in each kind of page.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

double milliseconds_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

#if defined(__linux__)
constexpr std::size_t kPage = 4096;
constexpr std::size_t kHugePage = std::size_t(2) << 20;

/// An anonymous mapping with a block of `bytes` (a multiple of 2 MiB) inside it aligned to 2 MiB,
/// advised for 2 MiB pages when `huge`, not yet touched.
struct Mapping {
  void* start;
  std::size_t length;
  char* block;
};

Mapping map_block(std::size_t bytes, bool huge) {
  const std::size_t length = bytes + kHugePage;
  void* start = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (start == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(start);
  const std::uintptr_t aligned = (first + kHugePage - 1) & ~std::uintptr_t(kHugePage - 1);
  char* block = reinterpret_cast<char*>(aligned);
  if (huge) madvise(block, bytes, MADV_HUGEPAGE);
  return {start, length, block};
}

/// One write per 4 KiB page of [block, block + bytes).
void touch(char* block, std::size_t bytes) {
  for (std::size_t i = 0; i < bytes; i += kPage) block[i] = static_cast<char>(block[i] + 1);
}

/// The sum of the floats of [block, block + bytes), in 16 independent chains.
float sum(const char* block, std::size_t bytes) {
  const float* values = reinterpret_cast<const float*>(block);
  const std::size_t n = bytes / sizeof(float);
  float chains[16] = {};
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    for (std::size_t c = 0; c < 16; ++c) chains[c] += values[i + c];
  }
  float total = 0.0f;
  for (float c : chains) total += c;
  return total;
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if defined(__linux__)
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 6;
  constexpr std::size_t kKept = std::size_t(128) << 20;
  constexpr std::size_t kReturned = std::size_t(32) << 20;
  std::printf("Kept block %zu MiB, returned block %zu MiB, %d rounds\n\n", kKept >> 20,
              kReturned >> 20, rounds);
  std::printf("| kept block in | touch of the kept block after each return (ms) |\n|---|---|\n");
  double best_sum_ms[2] = {1e300, 1e300};
  float checksum = 0.0f;
  for (int huge = 0; huge < 2; ++huge) {
    const Mapping kept_mapping = map_block(kKept, huge != 0);
    char* kept = kept_mapping.block;
    std::memset(kept, 0, kKept);
    std::string times;
    for (int round = 0; round < rounds; ++round) {
      const Clock::time_point start = Clock::now();
      touch(kept, kKept);
      times += (round > 0 ? ", " : "") + std::to_string(milliseconds_since(start)).substr(0, 6);
      const Clock::time_point summed = Clock::now();
      checksum += sum(kept, kKept);
      const double ms = milliseconds_since(summed);
      if (ms < best_sum_ms[huge]) best_sum_ms[huge] = ms;
      const Mapping returned = map_block(kReturned, false);
      touch(returned.block, kReturned);
      munmap(returned.start, returned.length);
    }
    std::printf("| %s | %s |\n", huge ? "2 MiB pages" : "4 KiB pages", times.c_str());
    munmap(kept_mapping.start, kept_mapping.length);
  }
  std::printf("\n| kept block in | sum over it, best of the rounds (GB/s) |\n|---|---:|\n");
  for (int huge = 0; huge < 2; ++huge) {
    std::printf("| %s | %.1f |\n", huge ? "2 MiB pages" : "4 KiB pages",
                static_cast<double>(kKept) / (best_sum_ms[huge] * 1e6));
  }
  std::printf("\n(checksum %g)\n", static_cast<double>(checksum));
  return 0;
#else
  (void)argc;
  (void)argv;
  std::printf("attn_page_return: Linux only\n");
  return 0;
#endif
}

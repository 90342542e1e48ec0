// How much a decoding step's time moves from one process to the next.
//   build/bench/attn_decode_spread [tokens] [calls] [processes]
// Starts `processes` runs of itself (8 by default), one after the other. Each builds a cache of
// every storage format (32 query heads over 8 key/value heads, d = 128, `tokens` tokens, 16384 by
// default), times `calls` decoding steps of each (20 by default), rotating over the formats, and
// prints the median step time of each format. The last row is the slowest process's median over
// the fastest's, per format. Within one process the medians hold still; between processes they can
// take one of two levels (see the README's Limitations), so a comparison of two builds alternates
// whole processes and looks at this spread first. OMP_NUM_THREADS chooses the threads.

#include <algorithm>
#include <attn/attn.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

using attn::Index;

struct Format {
  const char* name;
  attn::KVStorage storage;
  bool bf16_arithmetic;
  bool int8_arithmetic;
};

const std::vector<Format>& formats() {
  static const std::vector<Format> all = {
      {"float", attn::KVStorage::Same, false, false},
      {"Float16", attn::KVStorage::Float16, false, false},
      {"BFloat16", attn::KVStorage::BFloat16, false, false},
      {"Int8", attn::KVStorage::Int8, false, false},
      {"BFloat16+vdpbf16ps", attn::KVStorage::BFloat16, true, false},
      {"Int8+VNNI", attn::KVStorage::Int8, false, true},
  };
  return all;
}

/// One process's run: prints each format's median step time in ms, on one line.
void time_formats(Index tokens, int calls) {
  const Index kv_heads = 8;
  const Index d = 128;
  const attn::Matrix<float> keys = attn::Matrix<float>::Random(tokens, kv_heads * d);
  const attn::Matrix<float> values = attn::Matrix<float>::Random(tokens, kv_heads * d);
  const attn::Matrix<float> q = attn::Matrix<float>::Random(1, 4 * kv_heads * d);
  attn::Matrix<float> out(1, 4 * kv_heads * d);
  std::vector<attn::KVCache<float>> caches;
  for (const Format& format : formats()) {
    attn::KVCacheConfig<float> config;
    config.d_k = d;
    config.d_v = d;
    config.kv_heads = kv_heads;
    config.storage = format.storage;
    caches.emplace_back(config);
    caches.back().append(keys, values);
  }
  std::vector<std::vector<double>> times(formats().size());
  for (int call = 0; call < calls; ++call) {
    for (std::size_t f = 0; f < formats().size(); ++f) {
      attn::AttentionOptions<float> options;
      if (formats()[f].bf16_arithmetic || formats()[f].int8_arithmetic) {
        options.stored_arithmetic = attn::StoredArithmetic::Reduced;
      }
      const auto start = std::chrono::steady_clock::now();
      caches[f].attend(q, options, out);
      times[f].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  for (std::vector<double>& t : times) {
    std::nth_element(t.begin(), t.begin() + std::ptrdiff_t(t.size() / 2), t.end());
    std::printf(" %.3f", 1e3 * t[t.size() / 2]);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const Index tokens = argc > 1 ? std::atol(argv[1]) : 16384;
  const int calls = argc > 2 ? std::max(1, std::atoi(argv[2])) : 20;
  const int processes = argc > 3 ? std::max(1, std::atoi(argv[3])) : 8;
  if (argc > 4) {  // one of the runs
    time_formats(tokens, calls);
    return 0;
  }
  std::printf("decoding step, %ld tokens, median of %d calls per process (ms)\n\n",
              static_cast<long>(tokens), calls);
  std::printf("| process |");
  for (const Format& format : formats()) std::printf(" %s |", format.name);
  std::printf("\n|---:|");
  for (std::size_t f = 0; f < formats().size(); ++f) std::printf("---:|");
  std::printf("\n");
  std::fflush(stdout);
  const std::string command = std::string("'") + argv[0] + "' " + std::to_string(tokens) + " " +
                              std::to_string(calls) + " 1 run";
  std::vector<double> fastest(formats().size(), 1e300);
  std::vector<double> slowest(formats().size(), 0.0);
  for (int p = 0; p < processes; ++p) {
    FILE* run = popen(command.c_str(), "r");
    char line[512] = {};
    const bool read = run != nullptr && std::fgets(line, sizeof line, run) != nullptr;
    if (run == nullptr || pclose(run) != 0 || !read) {
      std::fprintf(stderr, "attn_decode_spread: run %d failed (%s)\n", p + 1, command.c_str());
      return 1;
    }
    std::istringstream fields(line);
    std::printf("| %d |", p + 1);
    for (std::size_t f = 0; f < formats().size(); ++f) {
      double ms = 0;
      fields >> ms;
      fastest[f] = std::min(fastest[f], ms);
      slowest[f] = std::max(slowest[f], ms);
      std::printf(" %.3f |", ms);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  std::printf("| slowest / fastest |");
  for (std::size_t f = 0; f < formats().size(); ++f)
    std::printf(" %.2f |", slowest[f] / fastest[f]);
  std::printf("\n");
  return 0;
}

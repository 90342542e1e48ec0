/// The differential test of the attention core (tests/support/differential.hpp): a few thousand
/// seeded random cases per scalar type, each run through every forward path and compared with the
/// long-double reference of API.md's rules and across paths.
///
/// Re-run one case:      ATTN_DIFF_SEED=123 ./attn_differential
/// More or fewer cases:  ATTN_DIFF_CASES=20000 ...   (default 1000 per scalar type)
/// Keep failing inputs:  ATTN_DIFF_WRITE=dir ...      (dir/<type>_seed_<n>.bin, a libFuzzer input:
///                                                    ./attention_fuzz dir/float_seed_123.bin)

#include "differential.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::optional<std::uint64_t> differential_env(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  return std::strtoull(text, nullptr, 10);
}

/// The input of one seed, as the fuzz target reads it: byte 0 chooses the scalar (even float, odd
/// double), the rest describe the case.
template <class T>
std::vector<std::uint8_t> differential_bytes(std::uint64_t seed) {
  std::mt19937_64 rng(seed * 2 + (std::is_same_v<T, double> ? 1 : 0));
  std::vector<std::uint8_t> bytes(512);
  for (std::uint8_t& b : bytes) b = static_cast<std::uint8_t>(rng() >> 56);
  bytes[0] = std::is_same_v<T, double> ? 1 : 0;
  return bytes;
}

template <class T>
void run_differential(const char* type) {
  const std::optional<std::uint64_t> only = differential_env("ATTN_DIFF_SEED");
  const std::uint64_t count = differential_env("ATTN_DIFF_CASES").value_or(1000);
  const std::uint64_t first = only.value_or(0);
  const std::uint64_t last = only ? *only + 1 : count;
  const char* write_dir = std::getenv("ATTN_DIFF_WRITE");
  constexpr int printed_in_full = 3;  // the first failing seeds, with shrunk reproducers
  int failing = 0;
  std::map<std::string, int> by_path;
  std::ostringstream seeds;
  for (std::uint64_t seed = first; seed < last; ++seed) {
    const std::vector<std::uint8_t> bytes = differential_bytes<T>(seed);
    const attn_diff::Outcome outcome = attn_diff::run_case<T>(bytes.data() + 1, bytes.size() - 1);
    if (only) std::cout << "seed " << seed << ": " << outcome.description << "\n";
    if (outcome.failures.empty()) continue;
    ++failing;
    std::map<std::string, int> paths;
    for (const attn_diff::Failure& f : outcome.failures.list) {
      std::string path = f.path.substr(0, f.path.find(" head "));
      path = path.substr(0, path.find(" step "));
      path = path.substr(0, path.find(" batch "));
      paths[path] = 1;
    }
    for (const auto& p : paths) by_path[p.first] += 1;
    if (failing <= 40) seeds << " " << seed;
    if (write_dir != nullptr) {
      std::ofstream file(
          std::string(write_dir) + "/" + type + "_seed_" + std::to_string(seed) + ".bin",
          std::ios::binary);
      file.write(reinterpret_cast<const char*>(bytes.data()),
                 static_cast<std::streamsize>(bytes.size()));
    }
    if (failing <= printed_in_full || only) {
      std::ostringstream text;
      text << type << " seed " << seed << " fails (re-run: ATTN_DIFF_SEED=" << seed
           << " attn_differential)\n  case: " << outcome.description;
      for (const attn_diff::Failure& f : outcome.failures.list) {
        text << "\n  " << f.path << ": " << f.message;
      }
      text << "\n"
           << attn_diff::shrunk_reproducers<T>(bytes.data() + 1, bytes.size() - 1,
                                               outcome.failures);
      ADD_FAILURE() << text.str();
    }
  }
  if (std::getenv("ATTN_DIFF_STATS") != nullptr) {
    const attn_diff::Stats& s = attn_diff::stats();
    std::cout << type << " (cumulative): cases single/heads/cache/mha " << s.cases[0] << "/"
              << s.cases[1] << "/" << s.cases[2] << "/" << s.cases[3] << ", specials " << s.specials
              << "\n  rows empty/regular/NaN/all -inf/overflow " << s.rows[0] << "/" << s.rows[1]
              << "/" << s.rows[2] << "/" << s.rows[3] << "/" << s.rows[4]
              << "\n  entries value/value-or-NaN/exact/exact-or/NaN/inf/any " << s.entries[0] << "/"
              << s.entries[1] << "/" << s.entries[2] << "/" << s.entries[3] << "/" << s.entries[4]
              << "/" << s.entries[5] << "/" << s.entries[6] << "\n";
  }
  if (failing > 0) {
    std::ostringstream summary;
    summary << type << ": " << failing << " of " << (last - first)
            << " cases fail; failing cases by path:";
    for (const auto& p : by_path) summary << "\n  " << p.first << ": " << p.second;
    summary << "\n  first failing seeds:" << seeds.str();
    ADD_FAILURE() << summary.str();
  }
}

TEST(Differential, Float) { run_differential<float>("float"); }
TEST(Differential, Double) { run_differential<double>("double"); }

// The empty input and a few hand-made ones are valid cases too (the fuzzer's starting points).
TEST(Differential, ShortInputsAreValidCases) {
  const std::vector<std::vector<std::uint8_t>> inputs = {
      {}, {0}, {10}, {12}, {14}, {255, 255, 255, 255}, {10, 1, 2, 3, 4, 5, 6, 7, 8, 9}};
  for (const auto& input : inputs) {
    const attn_diff::Outcome a = attn_diff::run_case<float>(input.data(), input.size());
    const attn_diff::Outcome b = attn_diff::run_case<float>(input.data(), input.size());
    EXPECT_EQ(a.description, b.description);  // the same bytes, the same case
  }
}

}  // namespace

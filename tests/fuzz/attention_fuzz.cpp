/// libFuzzer target of the differential test (tests/support/differential.hpp): byte 0 chooses the
/// scalar (even: float, odd: double), the rest describe one case (shapes, options, special values,
/// the seed of the bulk values, a variant). Every forward path is checked against the long-double
/// reference; a failure prints the case (and, for a single head, a shrunk C++ reproducer) and
/// aborts, so that libFuzzer keeps the input as a crash file. Re-run one:
/// ./attention_fuzz crash-<hash> (ATTN_FUZZ_PRINT=1 prints each case before it runs, for inputs
/// that a sanitizer stops).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "differential.hpp"

namespace {

template <class T>
void fuzz_one(const std::uint8_t* data, std::size_t size) {
  if (std::getenv("ATTN_FUZZ_PRINT") != nullptr) {  // before running: for sanitizer crashes
    std::fprintf(stderr, "%s case: %s\n", std::is_same_v<T, float> ? "float" : "double",
                 attn_diff::describe_case<T>(data, size).c_str());
  }
  const attn_diff::Outcome outcome = attn_diff::run_case<T>(data, size);
  if (outcome.failures.empty()) return;
  std::string text =
      std::string(std::is_same_v<T, float> ? "float" : "double") + " case: " + outcome.description;
  for (const attn_diff::Failure& f : outcome.failures.list) {
    text += "\n  " + f.path + ": " + f.message;
  }
  text += "\n" + attn_diff::shrunk_reproducers<T>(data, size, outcome.failures);
  std::fprintf(stderr, "%s\n", text.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  if (data[0] & 1) {
    fuzz_one<double>(data + 1, size - 1);
  } else {
    fuzz_one<float>(data + 1, size - 1);
  }
  return 0;
}

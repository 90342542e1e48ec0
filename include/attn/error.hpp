#pragma once
/// \file error.hpp
/// `attn::shape_error` and the boundary checks every public function runs (always on, also under
/// `NDEBUG`).

#include <cassert>
#include <sstream>
#include <stdexcept>
#include <string>

#include "types.hpp"

/// Internal invariants (never user-facing checks). Define before including `attn` to override.
#ifndef ATTN_ASSERT
#define ATTN_ASSERT(condition) assert(condition)
#endif

namespace attn {

/// Thrown when an argument has the wrong shape or an invalid value. The message names the function,
/// the operand and both shapes, e.g. `attn::scores: K has 32 columns but Q has 64 (K is 7 x 32, Q
/// is 5 x 64)`.
class shape_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// "rows x cols" of anything with rows() and cols().
template <class M>
std::string shape_of(const M& m) {
  return std::to_string(m.rows()) + " x " + std::to_string(m.cols());
}

/// Builds the message from streamable parts and throws.
template <class... Parts>
[[noreturn]] void fail(const char* function, const Parts&... parts) {
  std::ostringstream message;
  message << "attn::" << function << ": ";
  (message << ... << parts);
  throw shape_error(message.str());
}

/// `check(function)`, whose errors then name one part of the call: when it throws, it runs
/// again as `check("function (part value)")` and that error is thrown. The name is built only on
/// failure, as the checks run on every call of a hot path (a decoding step per sequence).
template <class Check>
auto naming_part(const char* function, const char* part, long long value, const Check& check) {
  try {
    return check(function);
  } catch (const shape_error&) {
    const std::string named =
        std::string(function) + " (" + part + " " + std::to_string(value) + ")";
    return check(named.c_str());
  }
}

/// Requires `a.cols() == b.cols()`.
template <class A, class B>
void require_same_cols(const char* function, const char* a_name, const A& a, const char* b_name,
                       const B& b) {
  if (a.cols() != b.cols()) {
    fail(function, a_name, " has ", a.cols(), " columns but ", b_name, " has ", b.cols(), " (",
         a_name, " is ", shape_of(a), ", ", b_name, " is ", shape_of(b), ")");
  }
}

/// Requires `a.rows() == b.rows()`.
template <class A, class B>
void require_same_rows(const char* function, const char* a_name, const A& a, const char* b_name,
                       const B& b) {
  if (a.rows() != b.rows()) {
    fail(function, a_name, " has ", a.rows(), " rows but ", b_name, " has ", b.rows(), " (", a_name,
         " is ", shape_of(a), ", ", b_name, " is ", shape_of(b), ")");
  }
}

/// Requires `a.cols() == b.rows()` (the inner dimension of the product `a b`).
template <class A, class B>
void require_inner(const char* function, const char* a_name, const A& a, const char* b_name,
                   const B& b) {
  if (a.cols() != b.rows()) {
    fail(function, a_name, " has ", a.cols(), " columns but ", b_name, " has ", b.rows(), " rows (",
         a_name, " is ", shape_of(a), ", ", b_name, " is ", shape_of(b), ")");
  }
}

/// Requires an n x m table (mask or bias) for n queries and m keys.
template <class M>
void require_table(const char* function, const char* name, const M& table, Index n, Index m) {
  if (table.rows() != n || table.cols() != m) {
    fail(function, name, " is ", shape_of(table), " but the scores are ", n, " x ", m,
         " (one row per query, one column per key)");
  }
}

/// Requires a size of at least 1.
inline void require_positive_size(const char* function, const char* name, Index value) {
  if (value <= 0) fail(function, name, " must be at least 1, got ", value);
}

/// Requires at least one column (d_k or d_in > 0).
template <class M>
void require_width(const char* function, const char* name, const M& a) {
  if (a.cols() == 0) {
    fail(function, name, " has 0 columns (", name, " is ", shape_of(a),
         "): the feature dimension must be at least 1");
  }
}

}  // namespace detail
}  // namespace attn

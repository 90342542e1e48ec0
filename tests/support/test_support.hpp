#pragma once
/// \file test_support.hpp
/// Shared helpers of the `attn` unit tests:
/// - `near` / `identical`: matrix comparisons that report the worst (or first) entry, its (i, j),
///   both values and both shapes;
/// - `Tol<T>`: the tolerances by scalar type;
/// - `naive_attention`: an independent triple-loop reference of the whole score pipeline, in
///   long double, written from the definitions in API.md (it calls nothing from `attn`);
/// - `load_case`: the PyTorch float64 reference cases of tests/data/*.json.

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <attn/attn.hpp>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef ATTN_TEST_DATA_DIR
#error "ATTN_TEST_DATA_DIR must name the directory of the reference cases (tests/data)"
#endif

namespace attn_test {

using attn::Index;

/// Sets attn's thread count for a scope and restores the default when it ends.
struct ThreadCount {
  explicit ThreadCount(int threads) { attn::set_num_threads(threads); }
  ~ThreadCount() { attn::set_num_threads(0); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;
};

/// Matrices of the naive references: long double, so that they are (much) more accurate than the
/// double code under test.
using LMatrix = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// The scalar types every typed test runs over.
using ScalarTypes = ::testing::Types<float, double>;

/// Tolerances by scalar type, for results that should agree with an exact (or long double, or
/// PyTorch float64) reference up to the rounding of the type under test. An entry passes when
/// `|actual - expected| <= abs + rel * |expected|`.
template <class T>
struct Tol;
template <>
struct Tol<float> {
  static constexpr double rel = 2e-5;
  /// For entries near zero (outputs that are sums of cancelling terms, weights that underflow).
  static constexpr double abs = 2e-6;
};
template <>
struct Tol<double> {
  static constexpr double rel = 1e-10;
  static constexpr double abs = 1e-12;
};

namespace detail {

template <class S>
long double to_ld(S value) {
  if constexpr (std::is_same_v<S, bool>) {
    return value ? 1.0L : 0.0L;
  } else {
    return static_cast<long double>(value);
  }
}

template <class S>
std::string str(S value) {
  std::ostringstream out;
  out.precision(std::numeric_limits<long double>::max_digits10);
  out << to_ld(value);
  return out.str();
}

template <class A>
std::string shape(const A& a) {
  return std::to_string(a.rows()) + " x " + std::to_string(a.cols());
}

template <class A, class B>
::testing::AssertionResult shape_mismatch(const A& actual, const B& expected) {
  return ::testing::AssertionFailure()
         << "shapes differ: actual is " << shape(actual) << ", expected is " << shape(expected);
}

}  // namespace detail

/// `actual` agrees with `expected` entrywise: `|a - e| <= abs_tol + rel_tol * |e|`. Equal
/// infinities pass; NaN never passes. On failure, reports the number of failing entries and the
/// worst one (largest error relative to its allowance): (i, j), both values, both shapes.
template <class DA, class DB>
::testing::AssertionResult near(const Eigen::DenseBase<DA>& actual,
                                const Eigen::DenseBase<DB>& expected, double rel_tol,
                                double abs_tol) {
  if (actual.rows() != expected.rows() || actual.cols() != expected.cols()) {
    return detail::shape_mismatch(actual, expected);
  }
  Index failures = 0;
  Index worst_i = -1;
  Index worst_j = -1;
  long double worst_ratio = 0;
  for (Index i = 0; i < actual.rows(); ++i) {
    for (Index j = 0; j < actual.cols(); ++j) {
      const long double a = detail::to_ld(actual(i, j));
      const long double e = detail::to_ld(expected(i, j));
      const long double allowance =
          static_cast<long double>(abs_tol) + static_cast<long double>(rel_tol) * std::fabs(e);
      long double ratio = 0;
      if (std::isnan(a) || std::isnan(e)) {
        ratio = std::numeric_limits<long double>::infinity();
      } else if (std::isinf(a) || std::isinf(e)) {
        ratio = a == e ? 0 : std::numeric_limits<long double>::infinity();
      } else {
        const long double error = std::fabs(a - e);
        ratio = error <= allowance ? 0
                : allowance > 0    ? error / allowance
                                   : std::numeric_limits<long double>::infinity();
      }
      if (ratio > 0) {
        ++failures;
        if (worst_i < 0 || ratio > worst_ratio) {
          worst_ratio = ratio;
          worst_i = i;
          worst_j = j;
        }
      }
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  const long double a = detail::to_ld(actual(worst_i, worst_j));
  const long double e = detail::to_ld(expected(worst_i, worst_j));
  return ::testing::AssertionFailure()
         << failures << " of " << actual.size() << " entries differ (shape "
         << detail::shape(actual) << "; expected " << detail::shape(expected) << "); worst at ("
         << worst_i << ", " << worst_j << "): actual " << detail::str(a) << ", expected "
         << detail::str(e) << ", |difference| " << detail::str(std::fabs(a - e)) << ", allowed "
         << detail::str(abs_tol + rel_tol * static_cast<double>(std::fabs(e))) << " (rel "
         << rel_tol << ", abs " << abs_tol << ")";
}

/// `near` with the tolerances of `T` (see `Tol`).
template <class T, class DA, class DB>
::testing::AssertionResult near_t(const Eigen::DenseBase<DA>& actual,
                                  const Eigen::DenseBase<DB>& expected) {
  return near(actual, expected, Tol<T>::rel, Tol<T>::abs);
}

/// Bitwise equality of two matrices of the same scalar type (for floating point: equal values and
/// equal signs of zero; NaN equals NaN). Reports the first differing entry and the count.
template <class DA, class DB>
::testing::AssertionResult identical(const Eigen::DenseBase<DA>& actual,
                                     const Eigen::DenseBase<DB>& expected) {
  using S = typename DA::Scalar;
  static_assert(std::is_same_v<S, typename DB::Scalar>, "identical: same scalar types only");
  if (actual.rows() != expected.rows() || actual.cols() != expected.cols()) {
    return detail::shape_mismatch(actual, expected);
  }
  Index differing = 0;
  Index first_i = -1;
  Index first_j = -1;
  for (Index i = 0; i < actual.rows(); ++i) {
    for (Index j = 0; j < actual.cols(); ++j) {
      const S a = actual(i, j);
      const S e = expected(i, j);
      bool same = a == e;
      if constexpr (std::is_floating_point_v<S>) {
        same = (same && std::signbit(a) == std::signbit(e)) || (std::isnan(a) && std::isnan(e));
      }
      if (!same) {
        if (differing == 0) {
          first_i = i;
          first_j = j;
        }
        ++differing;
      }
    }
  }
  if (differing == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << differing << " of " << actual.size() << " entries are not bitwise equal (shape "
         << detail::shape(actual) << "); first at (" << first_i << ", " << first_j << "): actual "
         << detail::str(actual(first_i, first_j)) << ", expected "
         << detail::str(expected(first_i, first_j));
}

/// Every entry is finite (no NaN, no infinity); reports the first that is not.
template <class D>
::testing::AssertionResult all_finite(const Eigen::DenseBase<D>& a) {
  for (Index i = 0; i < a.rows(); ++i) {
    for (Index j = 0; j < a.cols(); ++j) {
      if (!std::isfinite(detail::to_ld(a(i, j)))) {
        return ::testing::AssertionFailure()
               << "entry (" << i << ", " << j << ") of a " << detail::shape(a) << " matrix is "
               << detail::str(a(i, j));
      }
    }
  }
  return ::testing::AssertionSuccess();
}

/// Every entry equals zero (+0 or -0: an output row of zero weights times negative values may sum
/// to -0, which is still zero). Reports the first entry that is not.
template <class D>
::testing::AssertionResult all_zero(const Eigen::DenseBase<D>& a) {
  for (Index i = 0; i < a.rows(); ++i) {
    for (Index j = 0; j < a.cols(); ++j) {
      if (!(detail::to_ld(a(i, j)) == 0)) {
        return ::testing::AssertionFailure()
               << "entry (" << i << ", " << j << ") of a " << detail::shape(a) << " matrix is "
               << detail::str(a(i, j)) << ", not zero";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

/// A rows x cols matrix of N(0, stddev^2) entries from `rng`.
template <class T>
attn::Matrix<T> random_matrix(Index rows, Index cols, std::mt19937& rng, double stddev = 1.0) {
  std::normal_distribution<double> normal(0.0, stddev);
  attn::Matrix<T> M(rows, cols);
  for (Index i = 0; i < rows; ++i) {
    for (Index j = 0; j < cols; ++j) M(i, j) = static_cast<T>(normal(rng));
  }
  return M;
}

/// Converts a matrix of any scalar to long double.
template <class D>
LMatrix to_long_double(const Eigen::MatrixBase<D>& a) {
  LMatrix out(a.rows(), a.cols());
  for (Index i = 0; i < a.rows(); ++i) {
    for (Index j = 0; j < a.cols(); ++j) out(i, j) = detail::to_ld(a(i, j));
  }
  return out;
}

/// `X W` by the textbook triple loop, in long double.
template <class DX, class DW>
LMatrix naive_product(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DW>& W) {
  LMatrix Y(X.rows(), W.cols());
  for (Index i = 0; i < X.rows(); ++i) {
    for (Index j = 0; j < W.cols(); ++j) {
      long double sum = 0;
      for (Index k = 0; k < X.cols(); ++k) sum += detail::to_ld(X(i, k)) * detail::to_ld(W(k, j));
      Y(i, j) = sum;
    }
  }
  return Y;
}

/// The keys query `i` may attend, straight from API.md: causal `j <= i + shift`, window
/// `j >= i + shift - w`, right window `j <= i + shift + r`; `shift` is `query_offset` when set,
/// else `m - n` for bottom-right alignment and 0 otherwise.
inline bool naive_allowed(Index i, Index j, Index n, Index m, attn::Causal causal,
                          const std::optional<Index>& window,
                          const std::optional<Index>& query_offset = std::nullopt,
                          const std::optional<Index>& window_right = std::nullopt) {
  const Index shift = query_offset                          ? *query_offset
                      : causal == attn::Causal::BottomRight ? m - n
                                                            : 0;
  if (causal != attn::Causal::None && j > i + shift) return false;
  if (window && j < i + shift - *window) return false;
  if (window_right && j > i + shift + *window_right) return false;
  return true;
}

/// The result of `naive_attention`: every stage, in long double.
struct NaiveAttention {
  LMatrix logits;   ///< n x m, after scale, softcap, bias, ALiBi and masking (-inf where masked)
  LMatrix weights;  ///< n x m
  LMatrix output;   ///< n x d_v
};

/// A variant's score of a long-double logit, evaluated in T, the call's type (a variant's
/// `score` is a function of T, as the kernels call it).
template <class T, class Variant>
long double naive_variant_score(const Variant& variant, long double s, const attn::ScoreAt& at) {
  if constexpr (!attn::variant_scores_v<Variant>) {
    return s;
  } else {
    return static_cast<long double>(variant.score(static_cast<T>(s), at));
  }
}

/// The whole score pipeline of API.md by plain loops in long double: `scale * q_i . k_j` -> the
/// variant's score (variant.hpp; none by default) -> softcap `c tanh(s / c)` -> `+ bias` and
/// `- slope |i + shift - j|` -> mask (causal, window, `mask`, the variant's) -> softmax with the
/// optional sink in the denominator -> `weights V`. A row that may attend nothing gets zero
/// weights and a zero output. The variant sees query i at position i + shift, key j at j, in
/// query head `head` over key/value head `kv_head`.
template <class T, class DQ, class DK, class DV, class Variant = attn::detail::NoVariant>
NaiveAttention naive_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                               const Eigen::MatrixBase<DV>& V,
                               const attn::AttentionOptions<T>& options = {},
                               const Variant& variant = {}, Index head = 0, Index kv_head = 0) {
  const Index n = Q.rows();
  const Index m = K.rows();
  const Index d = Q.cols();
  const long double neg_inf = -std::numeric_limits<long double>::infinity();
  const long double scale =
      options.scale ? detail::to_ld(*options.scale) : 1.0L / std::sqrt(static_cast<long double>(d));
  const Index shift = options.query_offset                          ? *options.query_offset
                      : options.causal == attn::Causal::BottomRight ? m - n
                                                                    : 0;
  NaiveAttention r{LMatrix(n, m), LMatrix(n, m), LMatrix::Zero(n, V.cols())};
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      long double dot = 0;
      for (Index k = 0; k < d; ++k) dot += detail::to_ld(Q(i, k)) * detail::to_ld(K(j, k));
      long double s = scale * dot;
      attn::ScoreAt at;
      at.head = head;
      at.kv_head = kv_head;
      at.query = at.query_in_sequence = i + shift;
      at.key = at.key_in_sequence = j;
      s = naive_variant_score<T>(variant, s, at);
      if (options.softcap) {
        const long double c = detail::to_ld(*options.softcap);
        s = c * std::tanh(s / c);
      }
      bool allowed = naive_allowed(i, j, n, m, options.causal, options.window, options.query_offset,
                                   options.window_right);
      if (options.bias) {
        const long double b = detail::to_ld((*options.bias)(i, j));
        if (b == neg_inf) allowed = false;  // a -inf bias masks the key, whatever its score
        s += b;
      }
      if (options.alibi_slope) {
        s -=
            detail::to_ld(*options.alibi_slope) * static_cast<long double>(std::abs(i + shift - j));
      }
      if (options.mask && !(*options.mask)(i, j)) allowed = false;
      if constexpr (attn::variant_masks_v<Variant>) {
        if (!attn::variant_allows(variant, at)) allowed = false;
      }
      r.logits(i, j) = allowed ? s : neg_inf;
    }
    long double max = neg_inf;
    for (Index j = 0; j < m; ++j) max = std::max(max, r.logits(i, j));
    if (options.sink) max = std::max(max, detail::to_ld(*options.sink));
    long double sum = 0;
    for (Index j = 0; j < m; ++j) {
      r.weights(i, j) = r.logits(i, j) == neg_inf ? 0.0L : std::exp(r.logits(i, j) - max);
      sum += r.weights(i, j);
    }
    if (sum == 0) {  // nothing to attend (a sink alone gives no value): zero weights, zero output
      r.weights.row(i).setZero();
      continue;
    }
    if (options.sink) sum += std::exp(detail::to_ld(*options.sink) - max);
    for (Index j = 0; j < m; ++j) r.weights(i, j) /= sum;
    for (Index c = 0; c < V.cols(); ++c) {
      long double acc = 0;
      for (Index j = 0; j < m; ++j) {
        if (r.logits(i, j) != neg_inf) acc += r.weights(i, j) * detail::to_ld(V(j, c));
      }
      r.output(i, c) = acc;
    }
  }
  return r;
}

// ------------------------------------------------------------------------------------------------
// Reference cases (tests/data/*.json, PyTorch 1.13 float64; see tests/data/README.md)
// ------------------------------------------------------------------------------------------------

/// The path of a reference case file.
inline std::string case_path(const std::string& name) {
  return std::string(ATTN_TEST_DATA_DIR) + "/" + name + ".json";
}

/// One reference case. Matrices are nested lists; the string "-inf" (also "inf", "nan") stands
/// for the non-finite values JSON cannot spell.
class Case {
 public:
  Case(std::string name, nlohmann::json json) : name_(std::move(name)), json_(std::move(json)) {}

  const std::string& name() const { return name_; }
  const nlohmann::json& json() const { return json_; }
  const nlohmann::json& params() const { return json_.at("params"); }

  bool has_input(const std::string& key) const { return json_.at("inputs").contains(key); }
  bool has_expected(const std::string& key) const { return json_.at("expected").contains(key); }

  template <class T>
  attn::Matrix<T> input(const std::string& key) const {
    return matrix<T>(json_.at("inputs").at(key), "inputs." + key);
  }
  template <class T>
  attn::Matrix<T> expected(const std::string& key) const {
    return matrix<T>(json_.at("expected").at(key), "expected." + key);
  }

  /// A 0/1 table of `inputs` as a mask (1 = may attend). Any other value is an error.
  attn::Mask mask(const std::string& key) const {
    const attn::Matrix<double> values = input<double>(key);
    attn::Mask allowed(values.rows(), values.cols());
    for (Index i = 0; i < values.rows(); ++i) {
      for (Index j = 0; j < values.cols(); ++j) {
        if (values(i, j) != 0.0 && values(i, j) != 1.0) {
          throw std::runtime_error(name_ + ": inputs." + key + " holds " +
                                   std::to_string(values(i, j)) + ", not 0 or 1");
        }
        allowed(i, j) = values(i, j) == 1.0;
      }
    }
    return allowed;
  }

  /// The options of an attention case: `params` (causal "none" / "top_left" / "bottom_right",
  /// window, scale, softcap, alibi_slope, sink; null or absent = unset) plus the `mask` and `bias`
  /// inputs when present. An unknown parameter or causal value is an error, so that no generator
  /// setting is silently ignored.
  template <class T>
  attn::AttentionOptions<T> options() const {
    attn::AttentionOptions<T> o;
    for (const auto& item : params().items()) {
      const std::string& key = item.key();
      const nlohmann::json& value = item.value();
      if (key == "causal") {
        const std::string causal = value.get<std::string>();
        if (causal == "none") {
          o.causal = attn::Causal::None;
        } else if (causal == "top_left") {
          o.causal = attn::Causal::TopLeft;
        } else if (causal == "bottom_right") {
          o.causal = attn::Causal::BottomRight;
        } else {
          throw std::runtime_error(name_ + ": unknown params.causal \"" + causal + "\"");
        }
      } else if (key == "window") {
        if (!value.is_null()) o.window = value.get<Index>();
      } else if (key == "scale") {
        if (!value.is_null()) o.scale = scalar<T>(value, "params.scale");
      } else if (key == "softcap") {
        if (!value.is_null()) o.softcap = scalar<T>(value, "params.softcap");
      } else if (key == "alibi_slope") {
        if (!value.is_null()) o.alibi_slope = scalar<T>(value, "params.alibi_slope");
      } else if (key == "sink") {
        if (!value.is_null()) o.sink = scalar<T>(value, "params.sink");
      } else {
        throw std::runtime_error(name_ + ": unknown parameter params." + key);
      }
    }
    if (has_input("mask")) o.mask = mask("mask");
    if (has_input("bias")) o.bias = input<T>("bias");
    return o;
  }

 private:
  template <class T>
  T scalar(const nlohmann::json& value, const std::string& where) const {
    if (value.is_number()) return static_cast<T>(value.get<double>());
    if (value.is_string()) {
      const std::string text = value.get<std::string>();
      if (text == "-inf") return -std::numeric_limits<T>::infinity();
      if (text == "inf") return std::numeric_limits<T>::infinity();
      if (text == "nan") return std::numeric_limits<T>::quiet_NaN();
    }
    throw std::runtime_error(name_ + ": " + where + " is not a number: " + value.dump());
  }

  template <class T>
  attn::Matrix<T> matrix(const nlohmann::json& rows, const std::string& where) const {
    if (!rows.is_array()) throw std::runtime_error(name_ + ": " + where + " is not a list");
    const Index n = static_cast<Index>(rows.size());
    const Index m = n > 0 ? static_cast<Index>(rows.at(0).size()) : 0;
    attn::Matrix<T> M(n, m);
    for (Index i = 0; i < n; ++i) {
      const nlohmann::json& row = rows.at(static_cast<std::size_t>(i));
      if (!row.is_array() || static_cast<Index>(row.size()) != m) {
        throw std::runtime_error(name_ + ": " + where + " is not a rectangular list of lists");
      }
      for (Index j = 0; j < m; ++j) {
        M(i, j) = scalar<T>(row.at(static_cast<std::size_t>(j)),
                            where + "[" + std::to_string(i) + "][" + std::to_string(j) + "]");
      }
    }
    return M;
  }

  std::string name_;
  nlohmann::json json_;
};

/// Random queries (n x d), keys (m x d) and values (m x d_v), N(0, 1), from `seed`.
template <class T>
attn::QKV<T> random_qkv(Index n, Index m, Index d, Index d_v, std::uint32_t seed) {
  std::mt19937 rng(seed);
  attn::QKV<T> x;
  x.Q = random_matrix<T>(n, d, rng);
  x.K = random_matrix<T>(m, d, rng);
  x.V = random_matrix<T>(m, d_v, rng);
  return x;
}

/// `call` throws attn::shape_error whose message starts with "attn::" and contains every part
/// (the function, the operand, both shapes).
inline void expect_shape_error(const std::function<void()>& call,
                               std::initializer_list<const char*> parts) {
  try {
    call();
  } catch (const attn::shape_error& error) {
    const std::string message = error.what();
    EXPECT_EQ(message.rfind("attn::", 0), 0u) << message;
    for (const char* part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message lacks '" << part << "': " << message;
    }
    return;
  } catch (const std::exception& error) {
    ADD_FAILURE() << "threw something other than attn::shape_error: " << error.what();
    return;
  }
  ADD_FAILURE() << "did not throw attn::shape_error";
}

/// Every forward scaled-dot-product reference case (tests/data/sdpa_*.json but the gradients).
inline const std::vector<std::string> kForwardCases = {"sdpa_additive_bias",
                                                       "sdpa_bool_mask",
                                                       "sdpa_causal_bottom_right",
                                                       "sdpa_causal_more_queries",
                                                       "sdpa_causal_square",
                                                       "sdpa_causal_top_left",
                                                       "sdpa_custom_scale",
                                                       "sdpa_large_scores",
                                                       "sdpa_long",
                                                       "sdpa_long_noncausal",
                                                       "sdpa_rect",
                                                       "sdpa_sliding_window",
                                                       "sdpa_square"};

/// Loads tests/data/<name>.json; throws std::runtime_error (with the path) if it is missing or not
/// valid JSON, so a missing case fails its test loudly.
inline Case load_case(const std::string& name) {
  const std::string path = case_path(name);
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open reference case " + path);
  nlohmann::json json;
  try {
    file >> json;
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("reference case " + path + " is not valid JSON: " + e.what());
  }
  return Case(name, std::move(json));
}

}  // namespace attn_test

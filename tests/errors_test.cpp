/// error.hpp (and version.hpp): every public function rejects bad shapes and arguments with
/// `attn::shape_error` (a `std::invalid_argument`) whose message names the function, the operand
/// and both shapes. The checks are ordinary `if`s, not asserts: this file passes in Release
/// (NDEBUG) builds, which is what CI runs.

#include <gtest/gtest.h>

#include <attn/attn.hpp>
#include <attn/version.hpp>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;

static_assert(std::is_base_of_v<std::invalid_argument, attn::shape_error>,
              "attn::shape_error must derive from std::invalid_argument");

/// `call()` throws attn::shape_error, catchable as std::invalid_argument, whose message contains
/// every fragment.
template <class F>
::testing::AssertionResult throws_shape_error(F&& call, const std::vector<std::string>& fragments) {
  std::string message;
  try {
    call();
    return ::testing::AssertionFailure() << "no exception thrown";
  } catch (const attn::shape_error& e) {
    message = e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure()
           << "threw something other than attn::shape_error: " << e.what();
  }
  // The same call, caught through the standard base class.
  try {
    call();
  } catch (const std::invalid_argument&) {
    // expected
  } catch (...) {
    return ::testing::AssertionFailure() << "not catchable as std::invalid_argument";
  }
  for (const std::string& fragment : fragments) {
    if (message.find(fragment) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "the message \"" << message << "\" lacks \"" << fragment << "\"";
    }
  }
  return ::testing::AssertionSuccess() << message;
}

template <class T>
class Errors : public ::testing::Test {};
TYPED_TEST_SUITE(Errors, attn_test::ScalarTypes);

TYPED_TEST(Errors, Project) {
  using T = TypeParam;
  const attn::Matrix<T> X = attn::Matrix<T>::Ones(3, 2);
  const attn::Matrix<T> W = attn::Matrix<T>::Ones(3, 1);
  EXPECT_TRUE(throws_shape_error([&] { attn::project(X, W); }, {"attn::project", "X has 2 columns",
                                                                "W has 3 rows", "3 x 2", "3 x 1"}));
  // Bias of the wrong length, as a row and as a column, and a bias that is not a vector.
  const attn::Matrix<T> W2 = attn::Matrix<T>::Ones(2, 4);
  EXPECT_NO_THROW(attn::project(X, W2, attn::RowVector<T>::Ones(4)));
  EXPECT_TRUE(throws_shape_error([&] { attn::project(X, W2, attn::RowVector<T>::Ones(3)); },
                                 {"attn::project", "b is 1 x 3", "4 entries", "2 x 4"}));
  EXPECT_TRUE(throws_shape_error([&] { attn::project(X, W2, attn::Vector<T>::Ones(5)); },
                                 {"attn::project", "b is 5 x 1", "2 x 4"}));
  EXPECT_TRUE(throws_shape_error([&] { attn::project(X, W2, attn::Matrix<T>::Ones(2, 2)); },
                                 {"attn::project", "b is 2 x 2", "2 x 4"}));
  // A bad W is reported before the bias.
  EXPECT_TRUE(throws_shape_error([&] { attn::project(X, W, attn::RowVector<T>::Ones(1)); },
                                 {"attn::project", "3 x 2", "3 x 1"}));
}

TYPED_TEST(Errors, ProjectQkv) {
  using T = TypeParam;
  const attn::Matrix<T> X = attn::Matrix<T>::Ones(2, 4);
  const attn::Matrix<T> good = attn::Matrix<T>::Ones(4, 2);
  const attn::Matrix<T> bad_rows = attn::Matrix<T>::Ones(3, 2);
  const attn::Matrix<T> wide = attn::Matrix<T>::Ones(4, 3);
  EXPECT_NO_THROW(attn::project_qkv(X, good, good, wide));  // d_v may differ from d_k
  EXPECT_TRUE(throws_shape_error([&] { attn::project_qkv(X, bad_rows, good, good); },
                                 {"attn::project_qkv", "W_Q", "2 x 4", "3 x 2"}));
  EXPECT_TRUE(throws_shape_error([&] { attn::project_qkv(X, good, bad_rows, good); },
                                 {"attn::project_qkv", "W_K", "2 x 4", "3 x 2"}));
  EXPECT_TRUE(throws_shape_error([&] { attn::project_qkv(X, good, good, bad_rows); },
                                 {"attn::project_qkv", "W_V", "2 x 4", "3 x 2"}));
  // Queries and keys must have the same width.
  EXPECT_TRUE(throws_shape_error([&] { attn::project_qkv(X, good, wide, good); },
                                 {"attn::project_qkv", "W_K", "W_Q", "4 x 3", "4 x 2"}));
}

TYPED_TEST(Errors, Scores) {
  using T = TypeParam;
  const attn::Matrix<T> Q = attn::Matrix<T>::Ones(5, 2);
  const attn::Matrix<T> K = attn::Matrix<T>::Ones(4, 3);
  attn::Matrix<T> S;
  EXPECT_TRUE(
      throws_shape_error([&] { attn::scores(Q, K); },
                         {"attn::scores", "K has 3 columns but Q has 2", "4 x 3", "5 x 2"}));
  EXPECT_TRUE(
      throws_shape_error([&] { attn::scores(Q, K, T(1)); }, {"attn::scores", "4 x 3", "5 x 2"}));
  EXPECT_TRUE(
      throws_shape_error([&] { attn::scores(Q, K, T(1), S); }, {"attn::scores", "4 x 3", "5 x 2"}));
  // Zero-width queries and keys: d_k = 0 has no default scale.
  const attn::Matrix<T> Q0(5, 0);
  const attn::Matrix<T> K0(4, 0);
  EXPECT_TRUE(throws_shape_error([&] { attn::scores(Q0, K0); },
                                 {"attn::scores", "Q has 0 columns", "5 x 0"}));
  EXPECT_TRUE(throws_shape_error([&] { attn::scores(Q0, K0, T(1), S); },
                                 {"attn::scores", "Q has 0 columns", "5 x 0"}));
  // A non-finite scale.
  const attn::Matrix<T> K2 = attn::Matrix<T>::Ones(4, 2);
  for (const T scale : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                        -std::numeric_limits<T>::infinity()}) {
    EXPECT_TRUE(throws_shape_error([&] { attn::scores(Q, K2, scale); }, {"attn::scores", "scale"}));
    EXPECT_TRUE(
        throws_shape_error([&] { attn::scores(Q, K2, scale, S); }, {"attn::scores", "scale"}));
  }
  // Nothing was written on the way.
  EXPECT_EQ(S.size(), 0);
}

// softmax_rows and softmax_rows_inplace accept every shape (including empty ones) and every value
// (see softmax_test.cpp): they have no error to test.

TEST(Errors, CausalMask) {
  EXPECT_TRUE(throws_shape_error([] { attn::causal_mask(-1, 3); },
                                 {"attn::causal_mask", "n = -1", "m = 3"}));
  EXPECT_TRUE(throws_shape_error([] { attn::causal_mask(2, -4, attn::Causal::TopLeft); },
                                 {"attn::causal_mask", "n = 2", "m = -4"}));
}

TEST(Errors, SlidingWindowMask) {
  EXPECT_TRUE(throws_shape_error([] { attn::sliding_window_mask(3, 3, -1); },
                                 {"attn::sliding_window_mask", "window", "-1"}));
  EXPECT_TRUE(throws_shape_error([] { attn::sliding_window_mask(-3, 3, 1); },
                                 {"attn::sliding_window_mask", "n = -3"}));
  EXPECT_TRUE(throws_shape_error([] { attn::sliding_window_mask(3, -2, 1, attn::Causal::None); },
                                 {"attn::sliding_window_mask", "m = -2"}));
}

TYPED_TEST(Errors, ApplyMask) {
  using T = TypeParam;
  attn::Matrix<T> S = attn::Matrix<T>::Ones(3, 3);
  EXPECT_TRUE(throws_shape_error([&] { attn::apply_mask(S, attn::Mask::Constant(3, 2, false)); },
                                 {"attn::apply_mask", "mask is 3 x 2", "3 x 3"}));
  EXPECT_TRUE(throws_shape_error([&] { attn::apply_mask(S, attn::Mask::Constant(4, 3, false)); },
                                 {"attn::apply_mask", "mask is 4 x 3", "3 x 3"}));
  // S is left untouched.
  EXPECT_TRUE(attn_test::identical(S, attn::Matrix<T>::Ones(3, 3)));
}

/// Each attention entry point, by its name in the messages.
template <class T>
struct EntryPoint {
  const char* name;
  void (*call)(const attn::Matrix<T>&, const attn::Matrix<T>&, const attn::Matrix<T>&,
               const attn::AttentionOptions<T>&);
};

template <class T>
std::vector<EntryPoint<T>> entry_points() {
  return {
      {"attn::scaled_dot_product_attention",
       [](const attn::Matrix<T>& Q, const attn::Matrix<T>& K, const attn::Matrix<T>& V,
          const attn::AttentionOptions<T>& o) { attn::scaled_dot_product_attention(Q, K, V, o); }},
      {"attn::attention_with_weights",
       [](const attn::Matrix<T>& Q, const attn::Matrix<T>& K, const attn::Matrix<T>& V,
          const attn::AttentionOptions<T>& o) { attn::attention_with_weights(Q, K, V, o); }},
      {"attn::trace_attention",
       [](const attn::Matrix<T>& Q, const attn::Matrix<T>& K, const attn::Matrix<T>& V,
          const attn::AttentionOptions<T>& o) { attn::trace_attention(Q, K, V, o); }}};
}

TYPED_TEST(Errors, AttentionEntryPoints) {
  using T = TypeParam;
  // n = 3 queries, m = 4 keys, d_k = 2, d_v = 5.
  const attn::Matrix<T> Q = attn::Matrix<T>::Ones(3, 2);
  const attn::Matrix<T> K = attn::Matrix<T>::Ones(4, 2);
  const attn::Matrix<T> V = attn::Matrix<T>::Ones(4, 5);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T inf = std::numeric_limits<T>::infinity();
  for (const EntryPoint<T>& entry : entry_points<T>()) {
    SCOPED_TRACE(entry.name);
    const std::string f = entry.name;
    const attn::AttentionOptions<T> none;
    EXPECT_NO_THROW(entry.call(Q, K, V, none));

    const attn::Matrix<T> K3 = attn::Matrix<T>::Ones(4, 3);
    EXPECT_TRUE(throws_shape_error([&] { entry.call(Q, K3, V, none); },
                                   {f, "K has 3 columns but Q has 2", "4 x 3", "3 x 2"}));
    const attn::Matrix<T> V5 = attn::Matrix<T>::Ones(5, 5);
    EXPECT_TRUE(throws_shape_error([&] { entry.call(Q, K, V5, none); },
                                   {f, "V has 5 rows but K has 4", "5 x 5", "4 x 2"}));
    const attn::Matrix<T> Q0(3, 0);
    const attn::Matrix<T> K0(4, 0);
    EXPECT_TRUE(
        throws_shape_error([&] { entry.call(Q0, K0, V, none); }, {f, "Q has 0 columns", "3 x 0"}));

    // Each case starts from fresh options (an options object per case, not reassigned: GCC 12
    // warns about a maybe-uninitialized optional Matrix after `o = {}`).
    {
      attn::AttentionOptions<T> o;
      o.mask = attn::Mask::Constant(4, 3, true);  // transposed
      EXPECT_TRUE(
          throws_shape_error([&] { entry.call(Q, K, V, o); }, {f, "mask is 4 x 3", "3 x 4"}));
    }
    {
      attn::AttentionOptions<T> o;
      o.bias = attn::Matrix<T>::Zero(3, 5);
      EXPECT_TRUE(
          throws_shape_error([&] { entry.call(Q, K, V, o); }, {f, "bias is 3 x 5", "3 x 4"}));
    }
    {
      attn::AttentionOptions<T> o;
      o.window = -2;
      EXPECT_TRUE(throws_shape_error([&] { entry.call(Q, K, V, o); }, {f, "window", "-2"}));
    }
    for (const T bad : {T(0), T(-1), inf, nan}) {
      attn::AttentionOptions<T> o;
      o.softcap = bad;
      EXPECT_TRUE(throws_shape_error([&] { entry.call(Q, K, V, o); }, {f, "softcap"}))
          << "softcap " << bad;
    }
    for (const T bad : {nan, inf}) {
      attn::AttentionOptions<T> o;
      o.sink = bad;
      EXPECT_TRUE(throws_shape_error([&] { entry.call(Q, K, V, o); }, {f, "sink"}))
          << "sink " << bad;
    }
    for (const T bad : {nan, inf, -inf}) {
      attn::AttentionOptions<T> with_scale;
      with_scale.scale = bad;
      EXPECT_TRUE(throws_shape_error([&] { entry.call(Q, K, V, with_scale); }, {f, "scale"}))
          << "scale " << bad;
      attn::AttentionOptions<T> with_slope;
      with_slope.alibi_slope = bad;
      EXPECT_TRUE(throws_shape_error([&] { entry.call(Q, K, V, with_slope); }, {f, "alibi_slope"}))
          << "alibi_slope " << bad;
    }
    {
      // Valid edge values are accepted: window 0, a sink of -inf (no sink), a tiny softcap.
      attn::AttentionOptions<T> o;
      o.window = 0;
      o.sink = -inf;
      o.softcap = T(1e-3);
      EXPECT_NO_THROW(entry.call(Q, K, V, o));
    }
  }
}

// The version macros equal the CMake project version.
TEST(Version, MatchesProjectVersion) {
  const std::string version = std::to_string(ATTN_VERSION_MAJOR) + "." +
                              std::to_string(ATTN_VERSION_MINOR) + "." +
                              std::to_string(ATTN_VERSION_PATCH);
  EXPECT_EQ(version, std::string(ATTN_PROJECT_VERSION));
}

}  // namespace

/// projection.hpp: `project` (with and without bias) and `project_qkv`, against naive loops.

#include <gtest/gtest.h>

#include <attn/projection.hpp>
#include <random>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn_test::LMatrix;

template <class T>
class Projection : public ::testing::Test {};
TYPED_TEST_SUITE(Projection, attn_test::ScalarTypes);

TYPED_TEST(Projection, ProjectAgainstNaiveLoops) {
  using T = TypeParam;
  std::mt19937 rng(31);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(7, 12, rng);
  const attn::Matrix<T> W = attn_test::random_matrix<T>(12, 5, rng);
  const attn::Matrix<T> Y = attn::project(X, W);
  EXPECT_EQ(Y.rows(), 7);
  EXPECT_EQ(Y.cols(), 5);
  EXPECT_TRUE(attn_test::near_t<T>(Y, attn_test::naive_product(X, W)));
}

TYPED_TEST(Projection, IntegerInputsAreExact) {
  using T = TypeParam;
  attn::Matrix<T> X(2, 3);
  X << 1, 2, 0, -1, 3, 2;
  attn::Matrix<T> W(3, 2);
  W << 1, 0, 2, -1, 0, 4;
  attn::Matrix<T> expected(2, 2);  // by hand
  expected << 5, -2,               //
      5, 5;
  EXPECT_TRUE(attn_test::identical(attn::project(X, W), expected));
  attn::RowVector<T> b(2);
  b << 10, -20;
  attn::Matrix<T> with_bias(2, 2);
  with_bias << 15, -22,  //
      15, -15;
  EXPECT_TRUE(attn_test::identical(attn::project(X, W, b), with_bias));
}

TYPED_TEST(Projection, BiasAsRowOrColumnVector) {
  using T = TypeParam;
  std::mt19937 rng(32);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(6, 4, rng);
  const attn::Matrix<T> W = attn_test::random_matrix<T>(4, 3, rng);
  const attn::RowVector<T> b_row = attn_test::random_matrix<T>(1, 3, rng);
  const attn::Vector<T> b_col = b_row.transpose();

  LMatrix expected = attn_test::naive_product(X, W);
  for (Index i = 0; i < expected.rows(); ++i) {
    for (Index j = 0; j < expected.cols(); ++j)
      expected(i, j) += static_cast<long double>(b_row(j));
  }
  const attn::Matrix<T> from_row = attn::project(X, W, b_row);
  const attn::Matrix<T> from_col = attn::project(X, W, b_col);
  EXPECT_TRUE(attn_test::near_t<T>(from_row, expected));
  EXPECT_TRUE(attn_test::identical(from_col, from_row));
  // The bias is added to X W, nothing else: same as projecting, then adding.
  attn::Matrix<T> added = attn::project(X, W);
  added.rowwise() += b_row;
  EXPECT_TRUE(attn_test::identical(from_row, added));
  // A 1 x d_out row-major Matrix works as a bias too.
  const attn::Matrix<T> b_matrix = b_row;
  EXPECT_TRUE(attn_test::identical(attn::project(X, W, b_matrix), from_row));
}

TYPED_TEST(Projection, ProjectQkvEqualsThreeProjections) {
  using T = TypeParam;
  std::mt19937 rng(33);
  const attn::Matrix<T> X = attn_test::random_matrix<T>(9, 16, rng);
  const attn::Matrix<T> W_Q = attn_test::random_matrix<T>(16, 8, rng);
  const attn::Matrix<T> W_K = attn_test::random_matrix<T>(16, 8, rng);
  const attn::Matrix<T> W_V = attn_test::random_matrix<T>(16, 5, rng);  // d_v != d_k is fine
  const attn::QKV<T> qkv = attn::project_qkv(X, W_Q, W_K, W_V);
  EXPECT_TRUE(attn_test::near_t<T>(qkv.Q, attn_test::naive_product(X, W_Q)));
  EXPECT_TRUE(attn_test::near_t<T>(qkv.K, attn_test::naive_product(X, W_K)));
  EXPECT_TRUE(attn_test::near_t<T>(qkv.V, attn_test::naive_product(X, W_V)));
  EXPECT_EQ(qkv.V.cols(), 5);
  // The same GEMM on the same data as `project`: bitwise equal.
  EXPECT_TRUE(attn_test::identical(qkv.Q, attn::project(X, W_Q)));
  EXPECT_TRUE(attn_test::identical(qkv.K, attn::project(X, W_K)));
  EXPECT_TRUE(attn_test::identical(qkv.V, attn::project(X, W_V)));
}

TYPED_TEST(Projection, EmptyShapes) {
  using T = TypeParam;
  const attn::Matrix<T> none = attn::project(attn::Matrix<T>(0, 3), attn::Matrix<T>::Ones(3, 2));
  EXPECT_EQ(none.rows(), 0);
  EXPECT_EQ(none.cols(), 2);
  // d_in = 0: X W is an n x d_out matrix of zeros (an empty sum).
  const attn::Matrix<T> zero_width = attn::project(attn::Matrix<T>(2, 0), attn::Matrix<T>(0, 3));
  EXPECT_TRUE(attn_test::identical(zero_width, attn::Matrix<T>::Zero(2, 3)));
}

}  // namespace

/// softmax.hpp: `softmax_rows` and `softmax_rows_inplace`, against PyTorch (softmax_rows.json) and
/// against a naive long double softmax written here.

#include <gtest/gtest.h>

#include <algorithm>
#include <attn/detail/online_softmax.hpp>
#include <attn/softmax.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn_test::LMatrix;

/// The textbook softmax of each row, in long double: exp(x - max) / sum; -inf -> 0; an all -inf
/// row -> zeros.
template <class D>
LMatrix naive_softmax(const Eigen::MatrixBase<D>& S) {
  const long double neg_inf = -std::numeric_limits<long double>::infinity();
  LMatrix P = attn_test::to_long_double(S);
  for (Index i = 0; i < P.rows(); ++i) {
    long double max = neg_inf;
    for (Index j = 0; j < P.cols(); ++j) max = std::max(max, P(i, j));
    long double sum = 0;
    for (Index j = 0; j < P.cols(); ++j) {
      P(i, j) = max == neg_inf ? 0.0L : std::exp(P(i, j) - max);
      sum += P(i, j);
    }
    for (Index j = 0; j < P.cols(); ++j) P(i, j) = sum > 0 ? P(i, j) / sum : 0.0L;
  }
  return P;
}

template <class T>
class Softmax : public ::testing::Test {};
TYPED_TEST_SUITE(Softmax, attn_test::ScalarTypes);

// PyTorch's float64 softmax of hard rows: -inf entries, an all -inf row, 1000 vs 1001, +-3e38
// (finite in float too: FLT_MAX is 3.4e38), and -1e4.
TYPED_TEST(Softmax, ReferenceCase) {
  using T = TypeParam;
  const attn_test::Case c = attn_test::load_case("softmax_rows");
  const attn::Matrix<T> S = c.input<T>("S");
  const attn::Matrix<T> expected = c.expected<T>("P");
  ASSERT_EQ(S.rows(), 6);
  const attn::Matrix<T> P = attn::softmax_rows(S);
  EXPECT_TRUE(attn_test::all_finite(P));
  EXPECT_TRUE(attn_test::near_t<T>(P, c.expected<double>("P")));
  // Where PyTorch gives exactly 0 (every -inf entry, the all -inf row, the -3e38 entry next to
  // +3e38, and e^-1001, e^-2001, which underflow), so must we: exactly, not a denormal.
  // (Fails with the working-tree softmax.hpp of this writing: see UnderflowGivesExactZero.)
  for (Index i = 0; i < S.rows(); ++i) {
    for (Index j = 0; j < S.cols(); ++j) {
      if (expected(i, j) == T(0)) {
        EXPECT_EQ(P(i, j), T(0)) << "at (" << i << ", " << j << ")";
      }
      if (S(i, j) == -std::numeric_limits<T>::infinity()) {
        EXPECT_EQ(P(i, j), T(0)) << "at (" << i << ", " << j << ")";
      }
    }
  }
  attn::Matrix<T> in_place = S;
  attn::softmax_rows_inplace(in_place);
  EXPECT_TRUE(attn_test::identical(in_place, P));
}

TYPED_TEST(Softmax, AgainstNaiveOnRandomRows) {
  using T = TypeParam;
  std::mt19937 rng(1234);
  const attn::Matrix<T> S = attn_test::random_matrix<T>(9, 13, rng, 3.0);
  const attn::Matrix<T> P = attn::softmax_rows(S);
  EXPECT_TRUE(attn_test::near_t<T>(P, naive_softmax(S)));
  // Each row is a probability distribution.
  for (Index i = 0; i < P.rows(); ++i) {
    EXPECT_NEAR(static_cast<double>(P.row(i).sum()), 1.0, 10 * attn_test::Tol<T>::rel);
    EXPECT_GT(P.row(i).minCoeff(), T(0));
  }
}

TYPED_TEST(Softmax, NegativeInfinityGivesExactZeroAndAllNegativeInfinityRowGivesZeros) {
  using T = TypeParam;
  const T inf = std::numeric_limits<T>::infinity();
  attn::Matrix<T> S(3, 4);
  S << -inf, T(0.5), -inf, T(-2),  //
      -inf, -inf, -inf, -inf,      //
      T(3), -inf, -inf, -inf;
  const attn::Matrix<T> P = attn::softmax_rows(S);
  // Row 1: softmax of [0.5, -2] on the finite entries, computed here.
  const long double e = std::exp(-2.5L);
  EXPECT_EQ(P(0, 0), T(0));
  EXPECT_EQ(P(0, 2), T(0));
  EXPECT_NEAR(static_cast<double>(P(0, 1)), static_cast<double>(1 / (1 + e)),
              attn_test::Tol<T>::rel);
  EXPECT_NEAR(static_cast<double>(P(0, 3)), static_cast<double>(e / (1 + e)),
              attn_test::Tol<T>::rel);
  // Row 2: nothing to attend -> all zeros, not NaN.
  EXPECT_TRUE(attn_test::identical(P.row(1), attn::Matrix<T>::Zero(1, 4)));
  // Row 3: a single finite entry takes all the weight, exactly.
  EXPECT_EQ(P(2, 0), T(1));
  EXPECT_EQ(P(2, 1), T(0));
  EXPECT_EQ(P(2, 3), T(0));
}

TYPED_TEST(Softmax, LargeValuesDoNotOverflow) {
  using T = TypeParam;
  // +-1e4 and values near the largest float: only differences matter after the max is subtracted.
  attn::Matrix<T> S(4, 3);
  S << T(1e4), T(1e4) - T(1), T(-1e4),          //
      T(-1e4), T(-1e4) - T(2), T(-1e4) - T(4),  //
      T(3e38), T(-3e38), T(3e38),               //
      T(1e4), T(0), T(-1e4);
  const attn::Matrix<T> P = attn::softmax_rows(S);
  ASSERT_TRUE(attn_test::all_finite(P));
  EXPECT_TRUE(attn_test::near_t<T>(P, naive_softmax(S)));
  EXPECT_EQ(P(0, 2), T(0));  // e^-20000 underflows to 0
  EXPECT_EQ(P(2, 0), T(0.5));
  EXPECT_EQ(P(2, 2), T(0.5));
  EXPECT_EQ(P(2, 1), T(0));  // see UnderflowGivesExactZero
  EXPECT_EQ(P(3, 0), T(1));
}

// A shifted logit below log(smallest denormal) (about -745 in double, -104 in float) has an
// exponential that rounds to exactly 0, as std::exp and PyTorch give it; the weight must be 0,
// not a denormal, wherever the entry sits in the row (8 entries: whole SIMD packets and a tail).
//
// LIBRARY BUG (include/attn/softmax.hpp, detail::exp_shifted_inplace, in the working tree at the
// time of writing, not in the committed version): a row without interior -inf entries takes
// Eigen's vectorised exp, which clamps its argument at about -709.78 (double) / -88.38 (float) and
// returns a denormal (5.6e-309 in double, ~1e-39 in float) for anything below. E.g. softmax_rows
// of the double row [1000, 1001, -1000, 0] gives 4.06e-309 for the last two entries instead of 0.
// Harmless to the sums, but the weight is wrong by a factor of 10^300 and denormals are slow in
// the following P V product. This test asserts the correct behaviour.
TYPED_TEST(Softmax, UnderflowGivesExactZero) {
  using T = TypeParam;
  const T far = std::is_same_v<T, float> ? T(-200) : T(-1000);
  attn::Matrix<T> S(3, 8);
  S << T(0), far, far, far, far, far, far, far,  //
      far, far, far, T(5), far, far, far, far,   //
      far, far, far, far, far, far, far, T(-3);
  const attn::Matrix<T> P = attn::softmax_rows(S);
  attn::Matrix<T> expected = attn::Matrix<T>::Zero(3, 8);
  expected(0, 0) = T(1);
  expected(1, 3) = T(1);
  expected(2, 7) = T(1);
  EXPECT_TRUE(attn_test::identical(P, expected));
}

TYPED_TEST(Softmax, InvariantUnderAddingAConstantToARow) {
  using T = TypeParam;
  std::mt19937 rng(99);
  const attn::Matrix<T> S = attn_test::random_matrix<T>(5, 7, rng);
  attn::Matrix<T> shifted = S;
  // Adding 64 rounds each entry to the spacing of floats near 64 (7.6e-6 in float), so the
  // weights agree to a small multiple of that, not bitwise.
  shifted.array() += T(64);
  EXPECT_TRUE(attn_test::near(attn::softmax_rows(shifted), attn::softmax_rows(S),
                              100 * attn_test::Tol<T>::rel, attn_test::Tol<T>::abs));
}

TYPED_TEST(Softmax, InPlaceEqualsCopyingVersionAndEmptyShapes) {
  using T = TypeParam;
  std::mt19937 rng(7);
  const attn::Matrix<T> S = attn_test::random_matrix<T>(6, 5, rng);
  attn::Matrix<T> in_place = S;
  const T* data = in_place.data();
  attn::softmax_rows_inplace(in_place);
  EXPECT_EQ(in_place.data(), data);  // no reallocation
  EXPECT_TRUE(attn_test::identical(in_place, attn::softmax_rows(S)));
  // Expressions are accepted by softmax_rows.
  EXPECT_TRUE(attn_test::identical(attn::softmax_rows(S.topRows(3)), in_place.topRows(3)));

  // Empty shapes: nothing to do, nothing read.
  const std::pair<Index, Index> shapes[] = {{0, 0}, {0, 4}, {3, 0}};
  for (const auto& [rows, cols] : shapes) {
    attn::Matrix<T> E(rows, cols);
    attn::softmax_rows_inplace(E);
    EXPECT_EQ(E.rows(), rows);
    EXPECT_EQ(E.cols(), cols);
    const attn::Matrix<T> F = attn::softmax_rows(attn::Matrix<T>(rows, cols));
    EXPECT_EQ(F.rows(), rows);
    EXPECT_EQ(F.cols(), cols);
  }
}

}  // namespace

namespace {

/// Distance in units in the last place between two finite floats of the same sign.
int ulp_distance(float a, float b) {
  std::int32_t ia = 0;
  std::int32_t ib = 0;
  std::memcpy(&ia, &a, sizeof a);
  std::memcpy(&ib, &b, sizeof b);
  return std::abs(ia - ib);
}

// Every 61st float from -0 down to `lowest` (< 0), in order: the floats' bit patterns step by 61.
std::vector<float> every_61st_float_down_to(float lowest) {
  std::vector<float> x;
  std::uint32_t end_bits = 0;
  std::memcpy(&end_bits, &lowest, sizeof lowest);
  for (std::uint32_t bits = 0x80000000u; bits <= end_bits; bits += 61) {
    float value = 0.0f;
    std::memcpy(&value, &bits, sizeof value);
    x.push_back(value);
  }
  return x;
}

// The vectorised exp of the float rows (detail/fast_exp.hpp) against std::exp on every 61st float
// of [-104, 0] (18 million arguments; every float was checked once, with the same result): within
// 1 ulp where exp is a normal float, bit for bit below (subnormal results and the exact underflow
// to 0), 0 for -inf, NaN for NaN. The row is run at an offset, so that the packets start anywhere.
TEST(FastExp, WithinOneUlpOfStdExpAndExactUnderflow) {
  std::vector<float> x = every_61st_float_down_to(-104.0f);
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  for (const Index offset : {0, 3}) {
    std::vector<float> e(x.size() + 3, 0.0f);
    std::copy(x.begin(), x.end(), e.begin() + offset);
    attn::detail::exp_shifted_sum<float>(e.data() + offset, static_cast<Index>(x.size()), 0.0f);
    int worst = 0;
    std::size_t below_normal_mismatches = 0;
    for (std::size_t i = 0; i + 2 < x.size(); ++i) {
      const float want = std::exp(x[i]);
      const float got = e[i + static_cast<std::size_t>(offset)];
      if (want < std::numeric_limits<float>::min()) {
        below_normal_mismatches += std::memcmp(&want, &got, sizeof want) != 0;
      } else {
        worst = std::max(worst, ulp_distance(want, got));
      }
    }
    EXPECT_LE(worst, 1);
    EXPECT_EQ(below_normal_mismatches, 0u);
    EXPECT_EQ(e[x.size() - 2 + static_cast<std::size_t>(offset)], 0.0f);
    EXPECT_TRUE(std::isnan(e[x.size() - 1 + static_cast<std::size_t>(offset)]));
  }
}

// The pass for rows known to stay in the normal range (`normal`: no checks below it) gives the
// same bits as the checked pass, so within 1 ulp of std::exp, on every 61st float of
// [ln(FLT_MIN), 0], and keeps a NaN.
TEST(FastExp, NormalRangePassGivesTheSameBits) {
  std::vector<float> x = every_61st_float_down_to(attn::detail::ExpConstants::normal_floor);
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  for (const Index offset : {0, 5}) {
    std::vector<float> checked(x.size() + 5, 0.0f);
    std::copy(x.begin(), x.end(), checked.begin() + offset);
    std::vector<float> normal = checked;
    const auto size = static_cast<Index>(x.size());
    const float sum_checked =
        attn::detail::exp_shifted_sum<float>(checked.data() + offset, size, 0.0f, false);
    const float sum_normal =
        attn::detail::exp_shifted_sum<float>(normal.data() + offset, size, 0.0f, true);
    EXPECT_EQ(std::memcmp(checked.data(), normal.data(), checked.size() * sizeof(float)), 0);
    EXPECT_TRUE(std::isnan(sum_checked));
    EXPECT_TRUE(std::isnan(sum_normal));
    int worst = 0;
    for (std::size_t i = 0; i + 1 < x.size(); ++i) {
      worst = std::max(worst, ulp_distance(std::exp(x[i]), normal[i + std::size_t(offset)]));
    }
    EXPECT_LE(worst, 1);
  }
}

// One online-softmax step takes the pass without checks only for rows that need none: a row with
// masked (-inf) or far-below entries gets exactly 0 for them (not the NaN of an unchecked exp of
// -inf, which the tiled kernel's repair of non-finite rows would hide), and each row's weights
// and sum are those of std::exp within 1 ulp, whichever pass it took.
TEST(OnlineSoftmax, StepGivesExactZerosAndAgreesWithStdExp) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-20.0f, 4.0f);
  for (const Index size : {1, 16, 37, 512}) {
    for (const float odd : {0.0f, neg_inf, -200.0f, -95.0f}) {  // 0: every entry in range
      attn::RowVector<float> row(size);
      for (Index j = 0; j < size; ++j) row(j) = uniform(rng);
      if (odd != 0.0f) row(size / 2) = odd;
      const attn::RowVector<float> logits = row;
      float m = 1.0f;  // a running max from an earlier tile, below this row's
      float l = 2.0f;
      const float alpha = attn::detail::online_softmax_step<float>(row, m, l);
      float m_new = 1.0f;
      for (Index j = 0; j < size; ++j) m_new = std::max(m_new, logits(j));
      EXPECT_EQ(m, m_new);
      EXPECT_EQ(alpha, std::exp(1.0f - m_new));
      double sum = 0;
      for (Index j = 0; j < size; ++j) {
        const float want = std::exp(logits(j) - m_new);
        if (want < std::numeric_limits<float>::min()) {
          EXPECT_EQ(row(j), want) << size << " " << odd << " " << j;  // 0 or std::exp's subnormal
        } else {
          EXPECT_LE(ulp_distance(want, row(j)), 1) << size << " " << odd << " " << j;
        }
        sum += static_cast<double>(row(j));
      }
      EXPECT_NEAR(static_cast<double>(l), static_cast<double>(alpha) * 2.0 + sum,
                  1e-5 * static_cast<double>(l));
    }
  }
}

// Four rows at a time (the decoding kernel's softmax) give what one step per row gives, bit for
// bit: the logits replaced by the same weights, the same maxima, sums and rescales. The rows mix
// every case: all in range, masked (-inf) entries, entries far below the max (the checks), all
// masked with nothing seen yet and with an earlier max, a NaN alone among -inf, a NaN among
// finite logits, all NaN, and a running max above the whole tile; over row counts that leave a tail of
// 1 to 3 rows and widths that are whole pairs of packets or not (one step per row then).
TEST(OnlineSoftmax, RowsFourAtATimeEqualOneStepPerRow) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> uniform(-12.0f, 6.0f);
  int fast_rows = 0;  // rows that took the interleaved pass (no -inf, nothing far below)
  for (const Index rows : {1, 4, 7, 9, 12}) {
    for (const Index cols : {16, 32, 48, 64, 128}) {
      attn::Matrix<float> s(rows, cols);
      std::vector<float> m(static_cast<std::size_t>(rows)), l(m.size());
      for (Index r = 0; r < rows; ++r) {
        for (Index j = 0; j < cols; ++j) s(r, j) = uniform(rng);
        const auto at = static_cast<std::size_t>(r);
        m[at] = r % 3 == 0 ? neg_inf : uniform(rng);  // nothing seen yet, or an earlier tile's max
        l[at] = m[at] == neg_inf ? 0.0f : 1.5f;
        switch ((r + cols / 16) % 10) {
          case 1:
            s(r, cols / 3) = neg_inf;
            break;
          case 2:
            s(r, cols - 1) = -95.0f;
            break;  // exp is subnormal: the checks
          case 3:
            s.row(r).setConstant(neg_inf);
            break;
          case 4:
            s.row(r).setConstant(neg_inf), s(r, 0) = nan;
            break;
          case 5:
            s(r, cols / 2) = nan;
            break;
          case 6:
            m[at] = 40.0f, l[at] = 1.0f;
            break;  // the tile far below the running max
          case 7:
            s.row(r).setConstant(nan);
            break;
          default:  // all in range
            ++fast_rows;
            break;
        }
      }
      attn::Matrix<float> want = s;
      std::vector<float> want_m = m, want_l = l, want_alpha(m.size());
      for (Index r = 0; r < rows; ++r) {
        const auto at = static_cast<std::size_t>(r);
        Eigen::Map<attn::RowVector<float>> row(want.data() + r * want.outerStride(), cols);
        want_alpha[at] = attn::detail::online_softmax_step<float>(row, want_m[at], want_l[at]);
      }
      std::vector<float> alpha(m.size());
      attn::detail::online_softmax_rows<float>(s.data(), s.outerStride(), rows, cols, m.data(),
                                               l.data(), alpha.data());
      const auto bytes = [](const auto& v, std::size_t n) { return n * sizeof(v[0]); };
      EXPECT_EQ(std::memcmp(s.data(), want.data(), bytes(s.data(), std::size_t(s.size()))), 0)
          << rows << " x " << cols;
      EXPECT_EQ(std::memcmp(m.data(), want_m.data(), bytes(m, m.size())), 0)
          << rows << " x " << cols;
      EXPECT_EQ(std::memcmp(l.data(), want_l.data(), bytes(l, l.size())), 0)
          << rows << " x " << cols;
      EXPECT_EQ(std::memcmp(alpha.data(), want_alpha.data(), bytes(alpha, alpha.size())), 0)
          << rows << " x " << cols;
    }
  }
  EXPECT_GT(fast_rows, 20);
}

// The sum the exp pass returns is the sum of the entries it wrote, and a row with a NaN keeps it.
TEST(FastExp, ReturnsTheSumOfItsEntries) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-30.0f, 0.0f);
  for (const Index size : {0, 1, 7, 16, 33, 128, 131}) {
    std::vector<float> row(static_cast<std::size_t>(size));
    for (float& v : row) v = uniform(rng);
    const float sum = attn::detail::exp_shifted_sum<float>(row.data(), size, -1.0f);
    double expected = 0;
    for (const float v : row) expected += static_cast<double>(v);
    EXPECT_NEAR(static_cast<double>(sum), expected, 1e-6 * std::max(1.0, expected)) << size;
    if (size > 0) {
      row[static_cast<std::size_t>(size) / 2] = std::numeric_limits<float>::quiet_NaN();
      EXPECT_TRUE(std::isnan(attn::detail::exp_shifted_sum<float>(row.data(), size, 0.0f)));
    }
  }
}

}  // namespace

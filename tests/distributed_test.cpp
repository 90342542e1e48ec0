/// \file distributed_test.cpp
/// `ring_attention` (attn/distributed.hpp) against single-process attention over the whole
/// sequence. Run under MPI with 2, 3 and 4 ranks (tests/CMakeLists.txt, label `mpi`): every rank
/// builds the same whole sequence from one seed, passes its own rows, and compares its output
/// rows with the same rows of `scaled_dot_product_attention` on the whole sequence. Float within
/// 1e-5, double within 1e-12 (worst |o - o_ref| / max |o_ref| of the rank's rows); the result is
/// identical bit for bit from one call to the next. A failure on any rank fails every rank.

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <attn/attn.hpp>
#include <attn/distributed.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using attn::Index;
template <class T>
using Matrix = attn::Matrix<T>;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

/// A split of `total` rows over the ranks, uneven on purpose: rank r gets a share that grows with
/// r, and rank 1 (of 3 or more) none at all when `with_empty`.
std::vector<Index> uneven_split(Index total, int ranks, bool with_empty) {
  std::vector<Index> weights;
  for (int r = 0; r < ranks; ++r) weights.push_back(with_empty && ranks > 2 && r == 1 ? 0 : r + 1);
  Index weight_sum = 0;
  for (const Index w : weights) weight_sum += w;
  std::vector<Index> counts;
  Index given = 0;
  for (int r = 0; r < ranks; ++r) {
    const Index count =
        r + 1 == ranks ? total - given : total * weights[static_cast<std::size_t>(r)] / weight_sum;
    counts.push_back(count);
    given += count;
  }
  return counts;
}

/// The first row of rank r's block under `counts`.
Index first_row(const std::vector<Index>& counts, int r) {
  Index first = 0;
  for (int s = 0; s < r; ++s) first += counts[static_cast<std::size_t>(s)];
  return first;
}

template <class T>
Matrix<T> random_matrix(Index rows, Index cols, std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  Matrix<T> M(rows, cols);
  for (Index i = 0; i < rows; ++i) {
    for (Index j = 0; j < cols; ++j) M(i, j) = static_cast<T>(normal(rng));
  }
  return M;
}

/// The worst |a - b| over max |b| (max |b| taken as 1 when b is all zeros).
template <class T>
double relative_error(const Matrix<T>& a, const Matrix<T>& b) {
  if (a.size() == 0) return 0;
  const double scale = std::max(1e-300, static_cast<double>(b.cwiseAbs().maxCoeff()));
  return static_cast<double>((a - b).cwiseAbs().maxCoeff()) / scale;
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

/// This rank's rows of a case: queries [q0, q0 + n) of N, keys [k0, k0 + m) of M, split by
/// `uneven_split` (keys like the queries when N == M).
struct RankRows {
  Index q0, n, k0, m;
};

RankRows rank_rows(Index N, Index M, bool with_empty) {
  const int rank = world_rank();
  const std::vector<Index> query_counts = uneven_split(N, world_size(), with_empty);
  const std::vector<Index> key_counts =
      N == M ? query_counts : uneven_split(M, world_size(), false);
  return {first_row(query_counts, rank), query_counts[static_cast<std::size_t>(rank)],
          first_row(key_counts, rank), key_counts[static_cast<std::size_t>(rank)]};
}

/// The whole sequence's options as this rank passes them: its rows of the mask and bias.
template <class T>
attn::AttentionOptions<T> rank_options(const attn::AttentionOptions<T>& whole, Index q0, Index n) {
  attn::AttentionOptions<T> options = whole;
  if (whole.mask) options.mask = attn::Mask(whole.mask->middleRows(q0, n));
  if (whole.bias) options.bias = Matrix<T>(whole.bias->middleRows(q0, n));
  return options;
}

/// One case: N queries and M keys split unevenly, options on the whole sequence (`whole_options`
/// may carry an N x M mask or bias: each rank passes its rows of it).
template <class T>
void check_case(const std::string& name, Index N, Index M, Index d_k, Index d_v,
                const attn::AttentionOptions<T>& whole_options, bool with_empty,
                std::uint32_t seed) {
  SCOPED_TRACE(name + " on " + std::to_string(world_size()) + " ranks");
  std::mt19937 rng(seed);
  const Matrix<T> Q = random_matrix<T>(N, d_k, rng);
  const Matrix<T> K = random_matrix<T>(M, d_k, rng);
  const Matrix<T> V = random_matrix<T>(M, d_v, rng);
  const Matrix<T> reference = attn::scaled_dot_product_attention(Q, K, V, whole_options);
  const auto [q0, n, k0, m] = rank_rows(N, M, with_empty);
  const attn::AttentionOptions<T> options = rank_options(whole_options, q0, n);
  attn::RingStats stats;
  const Matrix<T> out =
      attn::ring_attention(MPI_COMM_WORLD, Q.middleRows(q0, n), K.middleRows(k0, m),
                           V.middleRows(k0, m), options, stats);
  ASSERT_EQ(out.rows(), n);
  ASSERT_EQ(out.cols(), d_v);
  const Matrix<T> expected = reference.middleRows(q0, n);
  EXPECT_LE(relative_error(out, expected), tolerance<T>());
  // Identical bits from one call to the next.
  const Matrix<T> again = attn::ring_attention(MPI_COMM_WORLD, Q.middleRows(q0, n),
                                               K.middleRows(k0, m), V.middleRows(k0, m), options);
  EXPECT_TRUE((again.array() == out.array()).all() ||
              (again.array().isNaN() == out.array().isNaN()).all());
  EXPECT_EQ(stats.ranks, world_size());
}

template <class T>
class RingAttention : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RingAttention, Scalars);

TYPED_TEST(RingAttention, FullAttention) {
  using T = TypeParam;
  check_case<T>("full, even", 96, 96, 16, 8, {}, false, 1);
  check_case<T>("full, uneven with an empty rank", 131, 131, 32, 16, {}, true, 2);
  check_case<T>("cross, 70 queries over 150 keys", 70, 150, 16, 24, {}, false, 3);
}

TYPED_TEST(RingAttention, Causal) {
  using T = TypeParam;
  attn::AttentionOptions<T> causal;
  causal.causal = attn::Causal::BottomRight;
  check_case<T>("causal, square", 157, 157, 32, 32, causal, false, 4);
  check_case<T>("causal, uneven with an empty rank", 203, 203, 16, 8, causal, true, 5);
  check_case<T>("causal bottom-right, 60 queries over 140 keys", 60, 140, 16, 16, causal, false, 6);
  causal.causal = attn::Causal::TopLeft;
  check_case<T>("causal top-left, 140 queries over 60 keys", 140, 60, 16, 16, causal, false, 7);
  causal.query_offset = 25;
  check_case<T>("causal, query_offset 25", 80, 120, 16, 16, causal, false, 8);
  // Each query sees one key ahead: the last query of a block sees exactly the first key of the
  // next block (the edge of the test that skips blocks).
  causal.query_offset = 1;
  check_case<T>("causal, query_offset 1", 97, 97, 16, 16, causal, true, 21);
  // Blocks longer than the ring's 512 query rows at a time (attn::detail::ring_query_rows).
  causal.query_offset.reset();
  causal.causal = attn::Causal::BottomRight;
  check_case<T>("causal, 2600 tokens", 2600, 2600, 16, 8, causal, false, 23);
  check_case<T>("full, 2600 tokens", 2600, 2600, 16, 8, {}, true, 24);
  // Fewer tokens than the zigzag's 2P chunks: some chunks, and some ranks, hold nothing.
  check_case<T>("causal, 5 tokens", 5, 5, 8, 8, causal, true, 25);
  check_case<T>("causal, 1 token", 1, 1, 8, 8, causal, false, 26);
}

TYPED_TEST(RingAttention, WindowsAlibiSoftcapSinkScale) {
  using T = TypeParam;
  attn::AttentionOptions<T> window;
  window.causal = attn::Causal::BottomRight;
  window.window = 19;
  check_case<T>("causal window 19", 150, 150, 16, 16, window, true, 9);
  // Window 1: the first query of a block sees exactly the last key of the block before.
  window.window = 1;
  check_case<T>("causal window 1", 77, 77, 8, 8, window, false, 22);
  attn::AttentionOptions<T> both;
  both.window = 11;
  both.window_right = 7;
  check_case<T>("window 11 left, 7 right", 120, 120, 16, 16, both, false, 10);
  attn::AttentionOptions<T> right;
  right.window_right = 5;
  check_case<T>("window_right 5 alone", 90, 90, 8, 8, right, false, 11);
  // Bounds of any Index value keep their meaning (no overflow in the ring's visibility test or in
  // a piece's query offset): "no limit" windows, and queries placed far after or before the keys.
  constexpr Index huge = std::numeric_limits<Index>::max();
  attn::AttentionOptions<T> unbounded;
  unbounded.window = huge;
  unbounded.window_right = huge;
  check_case<T>("windows INT64_MAX", 90, 90, 8, 8, unbounded, false, 27);
  unbounded.causal = attn::Causal::TopLeft;
  unbounded.query_offset = huge - 200;
  check_case<T>("causal, query_offset INT64_MAX - 200", 90, 90, 8, 8, unbounded, true, 28);
  unbounded.query_offset = std::numeric_limits<Index>::min() + 1;
  check_case<T>("causal, query_offset INT64_MIN + 1", 90, 90, 8, 8, unbounded, false, 29);
  attn::AttentionOptions<T> many;
  many.causal = attn::Causal::BottomRight;
  many.alibi_slope = T(0.125);
  many.softcap = T(5);
  many.sink = T(0.5);
  many.scale = T(0.3);
  check_case<T>("causal, ALiBi, softcap, sink, scale", 140, 140, 16, 16, many, true, 12);
  attn::AttentionOptions<T> sink;
  sink.sink = T(2);
  check_case<T>("sink alone", 64, 64, 16, 16, sink, false, 13);
}

TYPED_TEST(RingAttention, MaskAndBiasRows) {
  using T = TypeParam;
  const Index N = 110;
  std::mt19937 rng(14);
  std::bernoulli_distribution keep(0.7);
  attn::AttentionOptions<T> masked;
  masked.mask = attn::Mask(N, N);
  for (Index i = 0; i < N; ++i) {
    for (Index j = 0; j < N; ++j) (*masked.mask)(i, j) = keep(rng);
  }
  (*masked.mask).row(3).setConstant(false);  // a row that sees nothing: zeros
  check_case<T>("bool mask", N, N, 16, 16, masked, false, 15);
  masked.causal = attn::Causal::BottomRight;
  check_case<T>("bool mask and causal", N, N, 16, 16, masked, true, 16);
  attn::AttentionOptions<T> biased;
  biased.bias = random_matrix<T>(N, N, rng);
  biased.causal = attn::Causal::BottomRight;
  biased.alibi_slope = T(0.05);
  check_case<T>("bias, causal, ALiBi", N, N, 16, 16, biased, false, 17);
}

/// Rows [q0, q0 + n) of every head of X.
template <class T>
attn::Tensor3<T> head_rows(const attn::Tensor3<T>& X, Index q0, Index n) {
  attn::Tensor3<T> part(X.dimension(0), n, X.dimension(2));
  for (Index h = 0; h < X.dimension(0); ++h) {
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < X.dimension(2); ++j) part(h, i, j) = X(h, q0 + i, j);
    }
  }
  return part;
}

TYPED_TEST(RingAttention, HeadsAndGroupedQueries) {
  using T = TypeParam;
  const Index h_q = 4, h_kv = 2, N = 100, d = 16;
  std::mt19937 rng(18);
  attn::Tensor3<T> Q(h_q, N, d), K(h_kv, N, d), V(h_kv, N, d);
  for (auto* X : {&Q, &K, &V}) {
    std::normal_distribution<double> normal(0.0, 1.0);
    for (Index k = 0; k < X->size(); ++k) X->data()[k] = static_cast<T>(normal(rng));
  }
  attn::AttentionOptions<T> options;
  options.causal = attn::Causal::BottomRight;
  options.softcap = T(8);
  const attn::Tensor3<T> reference = attn::attention_heads(Q, K, V, options);
  const std::vector<Index> counts = uneven_split(N, world_size(), true);
  const int rank = world_rank();
  const Index q0 = first_row(counts, rank);
  const Index n = counts[static_cast<std::size_t>(rank)];
  const auto rows = [&](const attn::Tensor3<T>& X) { return head_rows(X, q0, n); };
  const attn::Tensor3<T> out =
      attn::ring_attention(MPI_COMM_WORLD, rows(Q), rows(K), rows(V), options);
  const attn::Tensor3<T> expected = rows(reference);
  ASSERT_EQ(out.dimension(0), h_q);
  ASSERT_EQ(out.dimension(1), n);
  double worst = 0, largest = 0;
  for (Index k = 0; k < out.size(); ++k) {
    worst = std::max(worst, std::abs(static_cast<double>(out.data()[k] - expected.data()[k])));
    largest = std::max(largest, std::abs(static_cast<double>(expected.data()[k])));
  }
  if (n > 0) {
    EXPECT_LE(worst / largest, tolerance<T>());
  }

  // The backward over heads: against attention_heads_backward on the whole sequence, with a sink
  // and a bias this time (dK and dV sum over each group's query heads; dbias and dsink over all).
  options.sink = T(0.25);
  options.bias = random_matrix<T>(N, N, rng);
  attn::Tensor3<T> dO(h_q, N, d);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (Index k = 0; k < dO.size(); ++k) dO.data()[k] = static_cast<T>(normal(rng));
  const attn::HeadGrads<T> whole = attn::attention_heads_backward(Q, K, V, dO, options);
  attn::AttentionOptions<T> mine = options;
  mine.bias = Matrix<T>(options.bias->middleRows(q0, n));
  Matrix<T> lse;
  const attn::Tensor3<T> O =
      attn::ring_attention(MPI_COMM_WORLD, rows(Q), rows(K), rows(V), mine, lse);
  ASSERT_EQ(lse.rows(), h_q);
  ASSERT_EQ(lse.cols(), n);
  const attn::HeadGrads<T> grads = attn::ring_attention_backward(MPI_COMM_WORLD, rows(Q), rows(K),
                                                                 rows(V), O, lse, rows(dO), mine);
  const auto compare = [&](const attn::Tensor3<T>& got, const attn::Tensor3<T>& of_whole,
                           const char* name) {
    const attn::Tensor3<T> want = rows(of_whole);
    ASSERT_EQ(got.size(), want.size()) << name;
    double error = 0, scale = 0;
    for (Index k = 0; k < of_whole.size(); ++k) {
      scale = std::max(scale, std::abs(static_cast<double>(of_whole.data()[k])));
    }
    for (Index k = 0; k < got.size(); ++k) {
      error = std::max(error, std::abs(static_cast<double>(got.data()[k] - want.data()[k])));
    }
    EXPECT_LE(error / scale, tolerance<T>()) << name;
  };
  compare(grads.dQ, whole.dQ, "dQ");
  compare(grads.dK, whole.dK, "dK");
  compare(grads.dV, whole.dV, "dV");
  ASSERT_EQ(grads.dbias.rows(), n);
  if (n > 0) {
    EXPECT_LE(
        static_cast<double>((grads.dbias - whole.dbias.middleRows(q0, n)).cwiseAbs().maxCoeff()) /
            static_cast<double>(whole.dbias.cwiseAbs().maxCoeff()),
        tolerance<T>());
  }
  EXPECT_NEAR(static_cast<double>(grads.dsink), static_cast<double>(whole.dsink),
              tolerance<T>() * std::max(1.0, std::abs(static_cast<double>(whole.dsink))));
}

/// The backward of one case: `ring_attention` (with its log-sum-exp) then
/// `ring_attention_backward` on each rank's rows, against `attention_backward` on the whole
/// sequence (which runs its own forward): dQ, dK, dV, dbias rows and dsink.
template <class T>
void check_backward_case(const std::string& name, Index N, Index M, Index d_k, Index d_v,
                         const attn::AttentionOptions<T>& whole_options, bool with_empty,
                         std::uint32_t seed) {
  SCOPED_TRACE("backward, " + name + " on " + std::to_string(world_size()) + " ranks");
  std::mt19937 rng(seed);
  const Matrix<T> Q = random_matrix<T>(N, d_k, rng);
  const Matrix<T> K = random_matrix<T>(M, d_k, rng);
  const Matrix<T> V = random_matrix<T>(M, d_v, rng);
  const Matrix<T> dO = random_matrix<T>(N, d_v, rng);
  const attn::AttentionGrads<T> reference = attn::attention_backward(Q, K, V, dO, whole_options);
  const auto [q0, n, k0, m] = rank_rows(N, M, with_empty);
  const attn::AttentionOptions<T> options = rank_options(whole_options, q0, n);
  const Matrix<T> Q_r = Q.middleRows(q0, n);
  const Matrix<T> K_r = K.middleRows(k0, m);
  const Matrix<T> V_r = V.middleRows(k0, m);
  const Matrix<T> dO_r = dO.middleRows(q0, n);
  attn::Vector<T> lse;
  const Matrix<T> O = attn::ring_attention(MPI_COMM_WORLD, Q_r, K_r, V_r, options, lse);
  ASSERT_EQ(lse.size(), n);
  const attn::AttentionGrads<T> grads =
      attn::ring_attention_backward(MPI_COMM_WORLD, Q_r, K_r, V_r, O, lse, dO_r, options);
  // Each gradient against the largest entry of the whole sequence's (a rank's rows may be few).
  const auto within = [](const Matrix<T>& got, const Matrix<T>& want, const Matrix<T>& whole) {
    if (got.size() == 0) return 0.0;
    return static_cast<double>((got - want).cwiseAbs().maxCoeff()) /
           std::max(1e-300, static_cast<double>(whole.cwiseAbs().maxCoeff()));
  };
  ASSERT_EQ(grads.dQ.rows(), n);
  ASSERT_EQ(grads.dK.rows(), m);
  ASSERT_EQ(grads.dV.rows(), m);
  EXPECT_LE(within(grads.dQ, reference.dQ.middleRows(q0, n), reference.dQ), tolerance<T>());
  EXPECT_LE(within(grads.dK, reference.dK.middleRows(k0, m), reference.dK), tolerance<T>());
  EXPECT_LE(within(grads.dV, reference.dV.middleRows(k0, m), reference.dV), tolerance<T>());
  if (whole_options.bias) {
    ASSERT_EQ(grads.dbias.rows(), n);
    ASSERT_EQ(grads.dbias.cols(), M);
    EXPECT_LE(within(grads.dbias, reference.dbias.middleRows(q0, n), reference.dbias),
              tolerance<T>());
  }
  if (whole_options.sink) {
    EXPECT_NEAR(static_cast<double>(grads.dsink), static_cast<double>(reference.dsink),
                tolerance<T>() * std::max(1.0, std::abs(static_cast<double>(reference.dsink))));
  }
  // The same bits from one call to the next.
  const attn::AttentionGrads<T> again =
      attn::ring_attention_backward(MPI_COMM_WORLD, Q_r, K_r, V_r, O, lse, dO_r, options);
  EXPECT_TRUE((again.dQ.array() == grads.dQ.array()).all());
  EXPECT_TRUE((again.dK.array() == grads.dK.array()).all());
  EXPECT_TRUE((again.dV.array() == grads.dV.array()).all());
  EXPECT_EQ(again.dsink, grads.dsink);
}

TYPED_TEST(RingAttention, Backward) {
  using T = TypeParam;
  check_backward_case<T>("full", 96, 96, 16, 8, {}, false, 31);
  check_backward_case<T>("cross, 70 queries over 150 keys", 70, 150, 16, 24, {}, true, 32);
  attn::AttentionOptions<T> causal;
  causal.causal = attn::Causal::BottomRight;
  check_backward_case<T>("causal (zigzag), uneven with an empty rank", 157, 157, 32, 16, causal,
                         true, 33);
  causal.window = 13;
  check_backward_case<T>("causal window 13", 120, 120, 16, 16, causal, false, 34);
  attn::AttentionOptions<T> many;
  many.causal = attn::Causal::BottomRight;
  many.alibi_slope = T(0.125);
  many.softcap = T(5);
  many.sink = T(0.5);
  many.scale = T(0.3);
  check_backward_case<T>("causal, ALiBi, softcap, sink, scale", 140, 140, 16, 16, many, true, 35);
  const Index N = 110;
  std::mt19937 rng(36);
  attn::AttentionOptions<T> tables;
  tables.causal = attn::Causal::BottomRight;
  tables.bias = random_matrix<T>(N, N, rng);
  tables.mask = attn::Mask(N, N);
  std::bernoulli_distribution keep(0.8);
  for (Index i = 0; i < N; ++i) {
    for (Index j = 0; j < N; ++j) (*tables.mask)(i, j) = keep(rng);
  }
  check_backward_case<T>("bias and mask rows, causal", N, N, 16, 16, tables, false, 37);
  causal.window.reset();
  check_backward_case<T>("causal, 2600 tokens", 2600, 2600, 16, 8, causal, false, 38);
  check_backward_case<T>("causal, 5 tokens", 5, 5, 8, 8, causal, true, 39);
}

// ---------------------------------------------------------------------------------------------
// Variants: each rank's key block is the same variant at its own key positions.

/// Worst |got - want| over max |whole| (0 when got is empty).
template <class T>
double within(const Matrix<T>& got, const Matrix<T>& want, const Matrix<T>& whole) {
  if (got.size() == 0) return 0.0;
  return static_cast<double>((got - want).cwiseAbs().maxCoeff()) /
         std::max(1e-300, static_cast<double>(whole.cwiseAbs().maxCoeff()));
}

/// `ring_attention` and `ring_attention_backward` with `variant` against `flash_attention` and
/// `attention_backward` with it on the whole sequence; the learned table's gradient (when the
/// variant learns) the same on every rank and equal to the whole sequence's.
template <class T, class V>
void check_variant_case(const std::string& name, const V& variant, Index N,
                        const attn::AttentionOptions<T>& options, bool with_empty,
                        std::uint32_t seed) {
  SCOPED_TRACE(name + " on " + std::to_string(world_size()) + " ranks");
  const Index d = 16;
  std::mt19937 rng(seed);
  const Matrix<T> Q = random_matrix<T>(N, d, rng);
  const Matrix<T> K = random_matrix<T>(N, d, rng);
  const Matrix<T> Vv = random_matrix<T>(N, d, rng);
  const Matrix<T> dO = random_matrix<T>(N, d, rng);
  const Matrix<T> reference = attn::flash_attention(Q, K, Vv, variant, options);
  attn::AttentionGrads<T> whole;
  typename attn::detail::GradientOf<V>::type dtable_whole{}, dtable{};
  if constexpr (attn::variant_learns_v<V>) {
    attn::attention_backward(Q, K, Vv, dO, variant, options, whole, dtable_whole);
  } else {
    attn::attention_backward(Q, K, Vv, dO, variant, options, whole);
  }
  const auto [q0, n, k0, m] = rank_rows(N, N, with_empty);
  const Matrix<T> Q_r = Q.middleRows(q0, n), K_r = K.middleRows(k0, m), V_r = Vv.middleRows(k0, m);
  attn::Vector<T> lse;
  const Matrix<T> out = attn::ring_attention(MPI_COMM_WORLD, Q_r, K_r, V_r, variant, options, lse);
  ASSERT_EQ(out.rows(), n);
  EXPECT_LE(within<T>(out, reference.middleRows(q0, n), reference), tolerance<T>()) << "output";
  const attn::AttentionGrads<T> grads = attn::ring_attention_backward(
      MPI_COMM_WORLD, Q_r, K_r, V_r, out, lse, Matrix<T>(dO.middleRows(q0, n)), variant, options,
      attn::variant_learns_v<V> ? &dtable : nullptr);
  EXPECT_LE(within<T>(grads.dQ, whole.dQ.middleRows(q0, n), whole.dQ), tolerance<T>()) << "dQ";
  EXPECT_LE(within<T>(grads.dK, whole.dK.middleRows(k0, m), whole.dK), tolerance<T>()) << "dK";
  EXPECT_LE(within<T>(grads.dV, whole.dV.middleRows(k0, m), whole.dV), tolerance<T>()) << "dV";
  if constexpr (attn::variant_learns_v<V>) {
    EXPECT_LE(within<T>(dtable, dtable_whole, dtable_whole), tolerance<T>()) << "the table";
    // The same bits on every rank: rank 0's table, broadcast, equals this rank's.
    Matrix<T> first = dtable;
    MPI_Bcast(first.data(), static_cast<int>(first.size()), attn::detail::mpi_datatype<T>(), 0,
              MPI_COMM_WORLD);
    EXPECT_TRUE((first.array() == dtable.array()).all()) << "the table differs between ranks";
  }
}

TYPED_TEST(RingAttention, DocumentMask) {
  using T = TypeParam;
  // Documents of ragged sizes, one of a single token; causal inside each.
  const attn::DocumentMask documents({0, 40, 41, 100, 157}, true);
  attn::AttentionOptions<T> causal;
  causal.causal = attn::Causal::BottomRight;  // the zigzag deal: rows away from their home
  check_variant_case<T>("documents, causal (zigzag)", documents, 157, causal, true, 41);
  check_variant_case<T>("documents, no causal option (home layout)", documents, 157, {}, false, 42);
  attn::AttentionOptions<T> softcap = causal;
  softcap.softcap = T(6);
  check_variant_case<T>("documents and a prefix-LM, softcap",
                        attn::both(attn::DocumentMask({0, 60, 130}, false), attn::PrefixLM{20}),
                        130, softcap, false, 43);
  attn::T5Bias<T> t5(1, 16, 64, false);
  std::mt19937 rng(44);
  t5.table() = random_matrix<T>(1, 16, rng);
  check_variant_case<T>("documents and a learned T5 table", attn::both(documents, t5), 157, causal,
                        true, 45);
}

TYPED_TEST(RingAttention, AVariantsEmptyPairsAreNeitherComputedNorSent) {
  // Two documents of 60 tokens: a rank's queries never see the other document's keys. As a
  // variant the ring skips those pairs (and does not pass on blocks no rank further needs); as
  // the same mask in a table it cannot know.
  using T = TypeParam;
  const Index N = 120, d = 8;
  std::mt19937 rng(48);
  const Matrix<T> Q = random_matrix<T>(N, d, rng), K = random_matrix<T>(N, d, rng);
  const attn::DocumentMask documents({0, 60, 120}, false);
  const Index q0 = N * world_rank() / world_size();  // even blocks: on 2 ranks, one document each
  const Index n = N * (world_rank() + 1) / world_size() - q0;
  const Index k0 = q0, m = n;
  attn::AttentionOptions<T> table;
  table.mask = attn::variant_mask(documents, N, N);
  attn::RingStats with_variant, with_table;
  const Matrix<T> a = attn::ring_attention(MPI_COMM_WORLD, Q.middleRows(q0, n), K.middleRows(k0, m),
                                           K.middleRows(k0, m), documents, {}, with_variant);
  const Matrix<T> b =
      attn::ring_attention(MPI_COMM_WORLD, Q.middleRows(q0, n), K.middleRows(k0, m),
                           K.middleRows(k0, m), rank_options(table, q0, n), with_table);
  EXPECT_LE(within<T>(a, b, b), tolerance<T>());
  const auto total = [](std::int64_t mine) {
    std::int64_t sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    return sum;
  };
  const std::int64_t pairs_variant = total(with_variant.pairs_computed);
  const std::int64_t pairs_table = total(with_table.pairs_computed);
  const std::int64_t bytes_variant = total(with_variant.ring_bytes_sent);
  const std::int64_t bytes_table = total(with_table.ring_bytes_sent);
  if (world_size() > 1) {  // one rank holds one pair and sends nothing, either way
    EXPECT_LT(pairs_variant, pairs_table);
    EXPECT_LT(bytes_variant, bytes_table);
  }
  if (world_rank() == 0) {
    std::printf("documents on %d ranks: pairs computed %lld (variant) vs %lld (table)\n",
                world_size(), static_cast<long long>(pairs_variant),
                static_cast<long long>(pairs_table));
  }
}

TYPED_TEST(RingAttention, HeadsWithAVariant) {
  using T = TypeParam;
  const Index h_q = 4, h_kv = 2, N = 90, d = 8;
  std::mt19937 rng(46);
  attn::Tensor3<T> Q(h_q, N, d), K(h_kv, N, d), V(h_kv, N, d), dO(h_q, N, d);
  for (auto* X : {&Q, &K, &V, &dO}) {
    std::normal_distribution<double> normal(0.0, 1.0);
    for (Index k = 0; k < X->size(); ++k) X->data()[k] = static_cast<T>(normal(rng));
  }
  attn::T5Bias<T> t5(h_q, 8, 32, true);  // head h reads row h
  t5.table() = random_matrix<T>(h_q, 8, rng);
  const auto variant = attn::both(attn::DocumentMask({0, 30, 90}, false), t5);
  attn::AttentionOptions<T> options;
  options.causal = attn::Causal::BottomRight;
  const attn::Tensor3<T> reference = attn::attention_heads(Q, K, V, variant, options);
  attn::HeadGrads<T> whole;
  Matrix<T> dtable_whole, dtable;
  attn::attention_heads_backward(Q, K, V, dO, variant, options, {}, whole, dtable_whole);
  const std::vector<Index> counts = uneven_split(N, world_size(), true);
  const Index q0 = first_row(counts, world_rank());
  const Index n = counts[static_cast<std::size_t>(world_rank())];
  const auto rows = [&](const attn::Tensor3<T>& X) { return head_rows(X, q0, n); };
  const auto flat = [](const attn::Tensor3<T>& X) {
    return Matrix<T>(
        Eigen::Map<const Matrix<T>>(X.data(), X.dimension(0) * X.dimension(1), X.dimension(2)));
  };
  Matrix<T> lse;
  const attn::Tensor3<T> out =
      attn::ring_attention(MPI_COMM_WORLD, rows(Q), rows(K), rows(V), variant, options, lse);
  EXPECT_LE(within<T>(flat(out), flat(rows(reference)), flat(reference)), tolerance<T>());
  const attn::HeadGrads<T> grads = attn::ring_attention_backward(
      MPI_COMM_WORLD, rows(Q), rows(K), rows(V), out, lse, rows(dO), variant, options, &dtable);
  EXPECT_LE(within<T>(flat(grads.dQ), flat(rows(whole.dQ)), flat(whole.dQ)), tolerance<T>());
  EXPECT_LE(within<T>(flat(grads.dK), flat(rows(whole.dK)), flat(whole.dK)), tolerance<T>());
  EXPECT_LE(within<T>(flat(grads.dV), flat(rows(whole.dV)), flat(whole.dV)), tolerance<T>());
  EXPECT_LE(within<T>(dtable, dtable_whole, dtable_whole), tolerance<T>());
}

TEST(RingAttentionSchedule, CausalDealsRowsOutAndSkipsBlocksAboveTheDiagonal) {
  const Index N = 256;
  std::mt19937 rng(19);
  const Matrix<double> Q = random_matrix<double>(N, 8, rng);
  const std::vector<Index> counts = uneven_split(N, world_size(), false);
  const Index q0 = first_row(counts, world_rank());
  const Index n = counts[static_cast<std::size_t>(world_rank())];
  attn::AttentionOptions<double> causal;
  causal.causal = attn::Causal::BottomRight;
  attn::RingStats stats;
  attn::ring_attention(MPI_COMM_WORLD, Q.middleRows(q0, n), Q.middleRows(q0, n),
                       Q.middleRows(q0, n), causal, stats);
  const int P = world_size();
  EXPECT_EQ(stats.zigzag, P > 1);
  // Zigzag: each rank holds chunks r and 2P-1-r of 2P, and meets all 2P key chunks around the
  // ring; query chunk c sees key chunks 0..c only. So rank r computes (r + 1) + (2P - r) = 2P + 1
  // pairs whatever r, 2P(2P + 1)/2 over all ranks; the pairs above the diagonal are skipped.
  std::int64_t computed = stats.pairs_computed;
  std::int64_t total = 0;
  MPI_Allreduce(&computed, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (P > 1) {
    EXPECT_EQ(total, static_cast<std::int64_t>(2 * P * (2 * P + 1) / 2));
    EXPECT_EQ(stats.pairs_computed, 2 * P + 1) << "every rank computes the same number of pairs";
  } else {
    EXPECT_EQ(stats.pairs_computed, 1);
  }
  // Not causal: no deal, every block goes P - 1 steps.
  attn::ring_attention(MPI_COMM_WORLD, Q.middleRows(q0, n), Q.middleRows(q0, n),
                       Q.middleRows(q0, n), attn::AttentionOptions<double>{}, stats);
  EXPECT_FALSE(stats.zigzag);
  // The rank sends blocks r, r-1, ..., r-P+2 (keys and values, 8 + 8 doubles per row).
  std::int64_t bytes = 0;
  for (int s = 0; s + 1 < P; ++s) {
    const int b = ((world_rank() - s) % P + P) % P;
    bytes += static_cast<std::int64_t>(counts[static_cast<std::size_t>(b)]) * 16 * 8;
  }
  EXPECT_EQ(stats.ring_bytes_sent, bytes);
}

TEST(RingAttentionErrors, EveryRankThrowsWhenOneRankIsWrong) {
  const int rank = world_rank();
  std::mt19937 rng(20);
  const Matrix<double> Q = random_matrix<double>(10, 8, rng);
  const Matrix<double> K = random_matrix<double>(10, rank == 0 ? 6 : 8, rng);  // rank 0: wrong d_k
  const Matrix<double> V = random_matrix<double>(10, 8, rng);
  try {
    attn::ring_attention(MPI_COMM_WORLD, Q, K, V);
    ADD_FAILURE() << "no exception";
  } catch (const attn::shape_error& error) {
    const std::string message = error.what();
    if (rank == 0) {
      EXPECT_NE(message.find("K has 6 columns but Q has 8"), std::string::npos) << message;
    } else {
      EXPECT_NE(message.find("rank 0 was given invalid arguments"), std::string::npos) << message;
    }
  }
  // A mask that is not n_r x M on the last rank.
  attn::AttentionOptions<double> options;
  const Index M = 10 * world_size();
  options.mask = attn::Mask::Constant(10, rank + 1 == world_size() ? M - 1 : M, true);
  EXPECT_THROW(attn::ring_attention(MPI_COMM_WORLD, Q, Q, V, options), attn::shape_error);
  // Ranks that disagree on d_v.
  const Matrix<double> V_odd = random_matrix<double>(10, rank == 0 ? 4 : 8, rng);
  try {
    attn::ring_attention(MPI_COMM_WORLD, Q, Q, V_odd);
    if (world_size() > 1) ADD_FAILURE() << "no exception";
  } catch (const attn::shape_error& error) {
    EXPECT_NE(std::string(error.what()).find("the ranks disagree"), std::string::npos);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (world_rank() != 0) {
    // One report: rank 0 prints; the others print only their failures.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int failed = RUN_ALL_TESTS();
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (world_rank() == 0) {
    std::printf("ring_attention tests on %d ranks: %s\n", world_size(),
                any_failed ? "FAILED on some rank" : "passed on every rank");
  }
  MPI_Finalize();
  return any_failed;
}

/// varlen.hpp: a packed batch against each sequence attended alone by `attention_heads` (bits), for
/// every path (materialised, tiled, decoding), options shared or per sequence, GQA, keys in
/// float16, variants bound to the sequence; empty sequences, one-token sequences, more queries than
/// keys (rows with nothing to see are 0, never NaN); thread invariance; bad offsets.

#include <gtest/gtest.h>

#include <attn/heads.hpp>
#include <attn/tensor.hpp>
#include <attn/threads.hpp>
#include <attn/variant.hpp>
#include <attn/varlen.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "test_support.hpp"

namespace varlen_test {

using attn::Index;
using attn::Tensor3;
using attn_test::expect_shape_error;
using attn_test::random_matrix;

template <class T>
Tensor3<T> random_tensor(Index a, Index b, Index c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0, 1.0);
  Tensor3<T> t(a, b, c);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = T(normal(rng));
  return t;
}

/// Rows [first, first + rows) of every head of a packed tensor, as a tensor of its own.
template <class S>
Tensor3<S> rows_of(const Tensor3<S>& t, Index first, Index rows) {
  Tensor3<S> out(t.dimension(0), rows, t.dimension(2));
  for (Index h = 0; h < t.dimension(0); ++h) {
    for (Index r = 0; r < rows; ++r) {
      for (Index c = 0; c < t.dimension(2); ++c) out(h, r, c) = t(h, first + r, c);
    }
  }
  return out;
}

/// Whether rows [first, first + rows) of every head of `packed` hold exactly `alone`'s bits.
template <class T>
::testing::AssertionResult same_bits(const Tensor3<T>& packed, Index first,
                                     const Tensor3<T>& alone) {
  for (Index h = 0; h < alone.dimension(0); ++h) {
    for (Index r = 0; r < alone.dimension(1); ++r) {
      for (Index c = 0; c < alone.dimension(2); ++c) {
        const T a = packed(h, first + r, c);
        const T b = alone(h, r, c);
        if (std::memcmp(&a, &b, sizeof(T)) != 0) {
          return ::testing::AssertionFailure() << "head " << h << " row " << r << " column " << c
                                               << ": packed " << a << ", alone " << b;
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<int> offsets_of(const std::vector<int>& lengths) {
  std::vector<int> offsets{0};
  for (const int n : lengths) offsets.push_back(offsets.back() + n);
  return offsets;
}

/// A packed batch: query and key lengths per sequence, heads over kv_heads, d_k = d_v = d.
template <class T, class S = T>
struct Batch {
  std::vector<int> cu_q, cu_k;
  Tensor3<T> Q;
  Tensor3<S> K, V;
  Batch(const std::vector<int>& nq, const std::vector<int>& nk, Index heads, Index kv_heads,
        Index d, std::uint32_t seed)
      : cu_q(offsets_of(nq)), cu_k(offsets_of(nk)) {
    std::mt19937 rng(seed);
    Q = random_tensor<T>(heads, cu_q.back(), d, rng);
    const Tensor3<T> K_wide = random_tensor<T>(kv_heads, cu_k.back(), d, rng);
    const Tensor3<T> V_wide = random_tensor<T>(kv_heads, cu_k.back(), d, rng);
    K = K_wide.template cast<S>();
    V = V_wide.template cast<S>();
  }
  Index batch() const { return Index(cu_q.size()) - 1; }
  Index q0(Index b) const { return cu_q[std::size_t(b)]; }
  Index n(Index b) const { return cu_q[std::size_t(b) + 1] - cu_q[std::size_t(b)]; }
  Index k0(Index b) const { return cu_k[std::size_t(b)]; }
  Index m(Index b) const { return cu_k[std::size_t(b) + 1] - cu_k[std::size_t(b)]; }
};

/// Every sequence of the packed result against `attention_heads` on that sequence alone (and the
/// log-sum-exp against the heads' forward with it), with `options_of(b)` for sequence b.
template <class T, class S, class OptionsOf>
void expect_each_sequence(const Batch<T, S>& x, const Tensor3<T>& out, const attn::Matrix<T>* lse,
                          const OptionsOf& options_of, const attn::HeadOptions<T>& per_head = {}) {
  for (Index b = 0; b < x.batch(); ++b) {
    if (x.n(b) == 0) continue;
    const Tensor3<T> Q = rows_of(x.Q, x.q0(b), x.n(b));
    const Tensor3<S> K = rows_of(x.K, x.k0(b), x.m(b));
    const Tensor3<S> V = rows_of(x.V, x.k0(b), x.m(b));
    Tensor3<T> alone;
    attn::Matrix<T> alone_lse;
    attn::detail::heads_forward<T>("test", Q, K, V, options_of(b), per_head, alone,
                                   lse ? &alone_lse : nullptr);
    EXPECT_TRUE(same_bits(out, x.q0(b), alone)) << "sequence " << b;
    if (lse) {
      for (Index h = 0; h < Q.dimension(0); ++h) {
        for (Index i = 0; i < x.n(b); ++i) {
          const T a = (*lse)(h, x.q0(b) + i);
          const T e = alone_lse(h, i);
          EXPECT_EQ(std::memcmp(&a, &e, sizeof(T)), 0)
              << "sequence " << b << " head " << h << " row " << i << ": " << a << " vs " << e;
        }
      }
    }
  }
}

// Lengths that reach every path: empty sequences (no queries, no keys), one token (the decoding
// path), short ones (materialised), long ones (tiled: more than 256 x 256 scores).
const std::vector<int> kQueries{5, 0, 1, 300, 17, 0, 64, 1};
const std::vector<int> kKeys{5, 3, 40, 300, 17, 0, 80, 2100};

TEST(Varlen, EachSequenceEqualsItsOwnCallInBits) {
  const Batch<float> x(kQueries, kKeys, 4, 2, 32, 1);
  for (const attn::Causal causal :
       {attn::Causal::None, attn::Causal::BottomRight, attn::Causal::TopLeft}) {
    attn::AttentionOptions<float> options;
    options.causal = causal;
    const Tensor3<float> out = attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, options);
    ASSERT_EQ(out.dimension(1), x.Q.dimension(1));
    expect_each_sequence<float>(x, out, nullptr, [&](Index) { return options; });
  }
}

TEST(Varlen, EveryOptionAppliesPerSequence) {
  const Batch<float> x(kQueries, kKeys, 4, 2, 16, 2);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  options.window = 50;
  options.softcap = 20.0f;
  options.alibi_slope = 0.125f;
  options.sink = 0.5;
  Tensor3<float> out;
  attn::Matrix<float> lse;
  attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, options, {}, out, lse);
  expect_each_sequence(x, out, &lse, [&](Index) { return options; });

  attn::HeadOptions<float> per_head;
  per_head.alibi_slopes = std::vector<float>{0.5f, 0.25f, 0.125f, 0.0625f};
  per_head.sinks = std::vector<float>{0.0, 1.0, -1.0, 2.0};
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::BottomRight;
  attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, causal, per_head, out, lse);
  expect_each_sequence(
      x, out, &lse, [&](Index) { return causal; }, per_head);
}

TEST(Varlen, PerSequenceOptionsAndTables) {
  const Batch<float> x(kQueries, kKeys, 2, 1, 16, 3);
  std::mt19937 rng(7);
  std::vector<attn::AttentionOptions<float>> each(std::size_t(x.batch()));
  for (Index b = 0; b < x.batch(); ++b) {
    auto& o = each[std::size_t(b)];
    o.causal = b % 2 ? attn::Causal::BottomRight : attn::Causal::None;
    if (b % 3 == 0) {
      o.mask = attn::Mask(x.n(b), x.m(b));
      for (Index i = 0; i < o.mask->size(); ++i) o.mask->data()[i] = rng() % 4 != 0;
    }
    if (b % 3 == 1) o.bias = random_matrix<float>(x.n(b), x.m(b), rng);
    if (b == 2) o.softcap = 5.0f;
  }
  Tensor3<float> out;
  attn::Matrix<float> lse;
  attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, each, {}, out, lse);
  expect_each_sequence(x, out, &lse, [&](Index b) { return each[std::size_t(b)]; });
}

TEST(Varlen, KeysAndValuesInFloat16) {
  const Batch<float, Eigen::half> x(kQueries, kKeys, 4, 2, 32, 4);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  const Tensor3<float> out = attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, options);
  expect_each_sequence<float>(x, out, nullptr, [&](Index) { return options; });
}

TEST(Varlen, RowsWithNothingToSeeAreZero) {
  // Sequence 0 has 4 queries over 2 keys, bottom-right: its first 2 rows see nothing; sequence 1
  // has 3 queries and no keys.
  const Batch<float> x({4, 3, 2}, {2, 0, 2}, 2, 2, 8, 5);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  Tensor3<float> out;
  attn::Matrix<float> lse;
  attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, options, {}, out, lse);
  for (Index h = 0; h < 2; ++h) {
    for (const Index row : {0, 1, 4, 5, 6}) {
      for (Index c = 0; c < 8; ++c) EXPECT_EQ(out(h, row, c), 0.0f) << h << " " << row;
      EXPECT_EQ(lse(h, row), -std::numeric_limits<float>::infinity());
    }
    for (const Index row : {2, 3, 7, 8}) {
      EXPECT_TRUE(std::isfinite(lse(h, row)));
      EXPECT_NE(out(h, row, 0), 0.0f);
    }
  }
  expect_each_sequence(x, out, &lse, [&](Index) { return options; });
}

/// Adds a slope that differs per sequence (`ScoreAt::batch`) and per head, and forbids the keys
/// of every third position: the fixed form (`batch` given) is the reference for one sequence.
struct PerSequenceSlope {
  Index fixed = -1;  // -1: the sequence the library binds
  template <class T>
  T score(T s, const attn::ScoreAt& at) const {
    const Index b = fixed < 0 ? at.batch : fixed;
    return s - T(0.01) * T(b + 1 + at.head) * T(std::abs(at.query - at.key));
  }
  template <class T>
  T dscore(T, const attn::ScoreAt&) const {
    return T(1);
  }
  bool allowed(const attn::ScoreAt& at) const { return at.key % 3 != 1 || at.key == at.query; }
};

TEST(Varlen, AVariantSeesEachSequenceAsItsBatchItem) {
  const Batch<float> x(kQueries, kKeys, 4, 2, 32, 6);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  const Tensor3<float> out =
      attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, PerSequenceSlope{}, options);
  for (Index b = 0; b < x.batch(); ++b) {
    if (x.n(b) == 0) continue;
    const Tensor3<float> alone =
        attn::attention_heads(rows_of(x.Q, x.q0(b), x.n(b)), rows_of(x.K, x.k0(b), x.m(b)),
                              rows_of(x.V, x.k0(b), x.m(b)), PerSequenceSlope{b}, options);
    EXPECT_TRUE(same_bits(out, x.q0(b), alone)) << "sequence " << b;
  }
}

TEST(Varlen, TheBitsDoNotDependOnTheThreadCount) {
  const Batch<float> x(kQueries, kKeys, 4, 2, 32, 8);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  attn::set_num_threads(1);
  Tensor3<float> one;
  attn::Matrix<float> lse_one;
  attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, options, {}, one, lse_one);
  attn::set_num_threads(2);
  Tensor3<float> two;
  attn::Matrix<float> lse_two;
  attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, options, {}, two, lse_two);
  attn::set_num_threads(0);
  EXPECT_TRUE(same_bits(two, 0, one));
  EXPECT_EQ(
      std::memcmp(lse_one.data(), lse_two.data(), sizeof(float) * std::size_t(lse_one.size())), 0);
}

/// Whether `a` and `b` hold the same bits.
template <class T>
::testing::AssertionResult same_matrix(const attn::Matrix<T>& a, const attn::Matrix<T>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) {
    return ::testing::AssertionFailure()
           << a.rows() << "x" << a.cols() << " vs " << b.rows() << "x" << b.cols();
  }
  if (a.size() > 0 && std::memcmp(a.data(), b.data(), sizeof(T) * std::size_t(a.size())) != 0) {
    return ::testing::AssertionFailure() << "the bits differ";
  }
  return ::testing::AssertionSuccess();
}

/// Every sequence's gradients against `attention_heads_backward` on it alone (`alone(b, Q, K, V,
/// dO)` returns them); dK and dV of the keys of sequences without queries must be zero, dQ of
/// sequences without keys too.
template <class T, class Alone>
void expect_each_gradient(const Batch<T>& x, const Tensor3<T>& dO, const attn::VarlenGrads<T>& g,
                          const Alone& alone) {
  for (Index b = 0; b < x.batch(); ++b) {
    const Tensor3<T> Q = rows_of(x.Q, x.q0(b), x.n(b));
    const Tensor3<T> K = rows_of(x.K, x.k0(b), x.m(b));
    const Tensor3<T> V = rows_of(x.V, x.k0(b), x.m(b));
    const Tensor3<T> dO_b = rows_of(dO, x.q0(b), x.n(b));
    if (x.n(b) == 0 || x.m(b) == 0) {
      for (Index h = 0; h < g.dK.dimension(0); ++h) {
        for (Index j = 0; j < x.m(b); ++j) {
          EXPECT_EQ(g.dK(h, x.k0(b) + j, 0), T(0));
          EXPECT_EQ(g.dV(h, x.k0(b) + j, 0), T(0));
        }
      }
      for (Index h = 0; h < g.dQ.dimension(0); ++h) {
        for (Index i = 0; i < x.n(b); ++i) EXPECT_EQ(g.dQ(h, x.q0(b) + i, 0), T(0));
      }
      continue;
    }
    const attn::HeadGrads<T> e = alone(b, Q, K, V, dO_b);
    EXPECT_TRUE(same_bits(g.dQ, x.q0(b), e.dQ)) << "dQ of sequence " << b;
    EXPECT_TRUE(same_bits(g.dK, x.k0(b), e.dK)) << "dK of sequence " << b;
    EXPECT_TRUE(same_bits(g.dV, x.k0(b), e.dV)) << "dV of sequence " << b;
  }
}

TEST(VarlenBackward, EachSequenceEqualsItsOwnBackwardInBits) {
  const Batch<float> x(kQueries, kKeys, 4, 2, 16, 11);
  std::mt19937 rng(12);
  const Tensor3<float> dO = random_tensor<float>(4, x.Q.dimension(1), 16, rng);
  std::vector<attn::AttentionOptions<float>> each(std::size_t(x.batch()));
  for (Index b = 0; b < x.batch(); ++b) {
    auto& o = each[std::size_t(b)];
    o.causal = attn::Causal::BottomRight;
    o.softcap = 10.0f;
    o.alibi_slope = 0.0625;
    o.sink = 0.25f * float(b);
    if (b % 2 == 0) o.bias = random_matrix<float>(x.n(b), x.m(b), rng);
  }
  const attn::VarlenGrads<float> g =
      attn::varlen_attention_backward(x.Q, x.K, x.V, dO, x.cu_q, x.cu_k, each);
  float dsink = 0;
  expect_each_gradient(
      x, dO, g, [&](Index b, const auto& Q, const auto& K, const auto& V, const auto& dO_b) {
        const attn::HeadGrads<float> e =
            attn::attention_heads_backward(Q, K, V, dO_b, each[std::size_t(b)]);
        dsink += e.dsink;
        EXPECT_EQ(g.dbias.size(), std::size_t(x.batch()));
        EXPECT_TRUE(same_matrix(g.dbias[std::size_t(b)], e.dbias)) << "dbias of sequence " << b;
        return e;
      });
  EXPECT_EQ(g.dsink, dsink);
  EXPECT_NE(g.dsink, 0.0);

  // From the forward's output and log-sum-exp: the heads' backward from the same.
  Tensor3<float> O;
  attn::Matrix<float> lse;
  attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, each, {}, O, lse);
  attn::VarlenGrads<float> given;
  attn::varlen_attention_backward(x.Q, x.K, x.V, O, lse, dO, x.cu_q, x.cu_k, each, {}, given);
  expect_each_gradient(
      x, dO, given, [&](Index b, const auto& Q, const auto& K, const auto& V, const auto& dO_b) {
        const Tensor3<float> O_b = rows_of(O, x.q0(b), x.n(b));
        const attn::Matrix<float> lse_b = lse.middleCols(x.q0(b), x.n(b));
        return attn::attention_heads_backward(Q, K, V, O_b, lse_b, dO_b, each[std::size_t(b)]);
      });
}

TEST(VarlenBackward, PerHeadSinksAndAVariant) {
  const Batch<float> x(kQueries, kKeys, 4, 2, 32, 13);
  std::mt19937 rng(14);
  const Tensor3<float> dO = random_tensor<float>(4, x.Q.dimension(1), 32, rng);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  attn::HeadOptions<float> per_head;
  per_head.sinks = std::vector<float>{0.0f, 1.0f, -1.0f, 0.5f};
  attn::VarlenGrads<float> g;
  attn::varlen_attention_backward(x.Q, x.K, x.V, dO, x.cu_q, x.cu_k, PerSequenceSlope{}, options,
                                  per_head, g);
  std::vector<float> dsinks(4, 0.0f);
  expect_each_gradient(
      x, dO, g, [&](Index b, const auto& Q, const auto& K, const auto& V, const auto& dO_b) {
        const attn::HeadGrads<float> e =
            attn::attention_heads_backward(Q, K, V, dO_b, PerSequenceSlope{b}, options, per_head);
        for (std::size_t h = 0; h < 4; ++h) dsinks[h] += e.dsinks[h];
        return e;
      });
  EXPECT_EQ(g.dsinks, dsinks);

  // The same bits on one thread.
  attn::set_num_threads(1);
  attn::VarlenGrads<float> one;
  attn::varlen_attention_backward(x.Q, x.K, x.V, dO, x.cu_q, x.cu_k, PerSequenceSlope{}, options,
                                  per_head, one);
  attn::set_num_threads(0);
  EXPECT_TRUE(same_bits(one.dQ, 0, g.dQ));
  EXPECT_TRUE(same_bits(one.dK, 0, g.dK));
  EXPECT_TRUE(same_bits(one.dV, 0, g.dV));
}

TEST(VarlenBackward, ALearnableVariantsGradientIsTheSequencesSum) {
  const Batch<float> x(kQueries, kKeys, 4, 2, 16, 15);
  std::mt19937 rng(16);
  const Tensor3<float> dO = random_tensor<float>(4, x.Q.dimension(1), 16, rng);
  attn::T5Bias<float> t5(4, 8, 64);
  t5.table() = random_matrix<float>(4, 8, rng);
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  attn::VarlenGrads<float> g;
  attn::Matrix<float> dtable;
  attn::varlen_attention_backward(x.Q, x.K, x.V, dO, x.cu_q, x.cu_k, t5, options, {}, g, dtable);
  attn::Matrix<float> expected = attn::Matrix<float>::Zero(4, 8);
  expect_each_gradient(x, dO, g,
                       [&](Index, const auto& Q, const auto& K, const auto& V, const auto& dO_b) {
                         attn::HeadGrads<float> e;
                         attn::Matrix<float> d;
                         attn::attention_heads_backward(Q, K, V, dO_b, t5, options, {}, e, d);
                         expected += d;
                         return e;
                       });
  EXPECT_TRUE(same_matrix(dtable, expected));
  EXPECT_GT(dtable.cwiseAbs().maxCoeff(), 0.0);
}

TEST(Varlen, BadOffsetsAndOptionsAreShapeErrors) {
  const Batch<float> x({2, 3}, {2, 3}, 2, 1, 8, 9);
  const auto call = [&](const std::vector<int>& cq, const std::vector<int>& ck) {
    return [&, cq, ck] { attn::varlen_attention(x.Q, x.K, x.V, cq, ck); };
  };
  expect_shape_error(call({1, 2, 5}, {0, 2, 5}), {"varlen_attention", "cu_seqlens_q[0] is 1"});
  expect_shape_error(call({0, 3, 2, 5}, {0, 2, 2, 5}),
                     {"varlen_attention", "cu_seqlens_q decreases", "= 3", "= 2"});
  expect_shape_error(call({0, 2, 4}, {0, 2, 5}),
                     {"varlen_attention", "cu_seqlens_q ends at 4", "5 queries"});
  expect_shape_error(call({0, 2, 5}, {0, 2, 6}), {"cu_seqlens_k ends at 6", "5 keys"});
  expect_shape_error(call({0, 5}, {0, 2, 5}), {"cu_seqlens_q has 2 entries", "cu_seqlens_k 3"});
  expect_shape_error(call({}, {}), {"cu_seqlens_q is empty"});
  std::vector<attn::AttentionOptions<float>> one(1);
  expect_shape_error([&] { attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, one); },
                     {"per-sequence options have 1 entries", "2 sequences"});
  std::vector<attn::AttentionOptions<float>> tables(2);
  tables[1].mask = attn::Mask::Constant(2, 2, true);  // sequence 1 is 3 x 3
  expect_shape_error([&] { attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, tables); },
                     {"varlen_attention (sequence 1)", "mask"});
  attn::HeadOptions<float> per_head;
  per_head.masks = attn::HeadMask(2, 5, 5);
  expect_shape_error([&] { attn::varlen_attention(x.Q, x.K, x.V, x.cu_q, x.cu_k, {}, per_head); },
                     {"per_head.masks"});
  const Tensor3<float> dO(2, 4, 8);
  expect_shape_error([&] { attn::varlen_attention_backward(x.Q, x.K, x.V, dO, x.cu_q, x.cu_k); },
                     {"varlen_attention_backward", "dO is"});
}

}  // namespace varlen_test

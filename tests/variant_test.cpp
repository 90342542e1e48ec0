/// variant.hpp: the compile-time checks of a variant's members, the ready variants' masks against
/// their definitions, their tile classifications against brute-force evaluation on ragged tiles
/// (never a wrong Empty or Full), composition, the score chain's derivative against central
/// differences, the bad inputs; and `flash_attention` with a variant against the long-double
/// reference evaluating the same variant densely (tests/support/test_support.hpp).

#include <gtest/gtest.h>

#include <attn/attention.hpp>
#include <attn/backward.hpp>
#include <attn/flash.hpp>
#include <attn/heads.hpp>
#include <attn/kv_cache.hpp>
#include <attn/multi_head.hpp>
#include <attn/tensor.hpp>
#include <attn/threads.hpp>
#include <attn/variant.hpp>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace variant_test {

using attn::Index;
using attn::PositionRange;
using attn::ScoreAt;
using attn::TileAt;
using attn::TileKind;

// The compile-time view of a variant.
struct WrongAllowed {
  int allowed(const ScoreAt&) const { return 1; }  // returns int, not bool
};
struct TemplateScore {
  template <class T>
  T score(T s, const ScoreAt&) const {
    return s + T(1);
  }
};
static_assert(attn::variant_masks_v<attn::CausalMask> && attn::variant_tiles_v<attn::CausalMask>);
static_assert(attn::variant_ranges_v<attn::CausalMask> && !attn::variant_ranges_v<attn::TreeMask>);
// Ranges on both sides stay a range; a rule on either side makes a rule.
static_assert(attn::variant_ranges_v<attn::Both<attn::DocumentMask, attn::PrefixLM>>);
static_assert(!attn::variant_ranges_v<attn::Both<attn::DocumentMask, attn::DilatedWindow>>);
static_assert(attn::variant_ranges_v<attn::Both<attn::DocumentMask, attn::Softcap<float>>>);
static_assert(!attn::variant_scores_v<attn::CausalMask>);
static_assert(attn::variant_scores_v<attn::Softcap<float>> &&
              !attn::variant_masks_v<attn::Softcap<float>>);
static_assert(attn::variant_scores_v<attn::Both<attn::DocumentMask, attn::Softcap<double>>>);
static_assert(!attn::variant_scores_v<attn::Both<attn::CausalMask, attn::PrefixLM>>);
// A member with the right name and the wrong signature is seen (check_variant refuses it).
static_assert(attn::detail::names_allowed<WrongAllowed>::value);
static_assert(!attn::detail::callable_allowed<WrongAllowed>::value);
// A template `score` is seen by name and checked per scalar type.
static_assert(attn::variant_scores_v<TemplateScore>);
static_assert(attn::detail::callable_score<TemplateScore, float>::value);
static_assert(attn::check_variant<attn::Softcap<double>, double, true>());
static_assert(!attn::detail::callable_score<attn::Softcap<float>, double>::value);

/// What `classify_tiles` found.
struct TileCounts {
  Index tiles = 0;  ///< tiles classified
  Index exact = 0;  ///< classified as the brute force does (not a safe Partial)
  Index wrong = 0;  ///< called Empty or Full where the mask disagrees
};

/// Every tile of several ragged sizes over positions [lo, hi) x [lo, hi), classified by the
/// variant and by brute force. A wrong Empty or Full is a test failure unless `expect_wrong`.
template <class V>
TileCounts classify_tiles(const V& variant, Index lo, Index hi, const std::string& name,
                          bool expect_wrong = false) {
  TileCounts counts;
  for (Index rows : {1, 2, 3, 5, 8}) {
    for (Index cols : {1, 3, 4, 7, 16}) {
      for (Index q = lo; q < hi; q += rows) {
        for (Index k = lo; k < hi; k += cols) {
          const TileAt tile{0, 0, 0, {q, std::min(q + rows, hi)}, {k, std::min(k + cols, hi)}};
          const TileKind claimed = attn::classify_tile(variant, tile);
          const TileKind actual = attn::classify_by_mask(variant, tile);
          ++counts.tiles;
          if (claimed == actual) ++counts.exact;
          if (claimed != TileKind::Partial && claimed != actual) {
            ++counts.wrong;
            if (!expect_wrong) {
              ADD_FAILURE() << name << ": tile [" << tile.queries.begin << ", " << tile.queries.end
                            << ") x [" << tile.keys.begin << ", " << tile.keys.end << ") called "
                            << static_cast<int>(claimed) << ", mask says "
                            << static_cast<int>(actual);
            }
          }
        }
      }
    }
  }
  return counts;
}

std::vector<Index> ragged_offsets() { return {0, 3, 3, 10, 11, 25, 40}; }

TEST(Variants, DocumentMaskFollowsItsDefinition) {
  for (bool causal : {false, true}) {
    const attn::DocumentMask documents(ragged_offsets(), causal);
    EXPECT_EQ(documents.total(), 40);
    EXPECT_EQ(documents.document(0), 0);
    EXPECT_EQ(documents.document(3), 2);  // document 1 is empty
    EXPECT_EQ(documents.document(10), 3);
    EXPECT_EQ(documents.document(39), 5);
    EXPECT_EQ(documents.document(40), -1);
    EXPECT_EQ(documents.document(-1), -1);
    const attn::Mask mask = attn::variant_mask(documents, 44, 44, -2, -2);
    for (Index i = 0; i < 44; ++i) {
      for (Index j = 0; j < 44; ++j) {
        const Index q = i - 2;
        const Index k = j - 2;
        const bool inside = q >= 0 && q < 40 && k >= 0 && k < 40;
        const bool same = inside && documents.document(q) == documents.document(k);
        EXPECT_EQ(mask(i, j), same && (!causal || k <= q)) << q << ", " << k;
      }
    }
    const TileCounts counts = classify_tiles(documents, -3, 43, "DocumentMask");
    EXPECT_GT(counts.exact, counts.tiles / 2);  // Partial only where the corners cannot tell
  }
}

TEST(Variants, DocumentMaskFromIdsEqualsItsOffsets) {
  const std::vector<Index> ids = {7, 7, 7, 2, 9, 9, 9, 9, 4};
  const attn::DocumentMask from_ids = attn::DocumentMask::from_ids(ids, true);
  const attn::DocumentMask from_offsets({0, 3, 4, 8, 9}, true);
  EXPECT_TRUE((attn::variant_mask(from_ids, 9, 9) == attn::variant_mask(from_offsets, 9, 9)).all());
  try {
    attn::DocumentMask::from_ids({1, 1, 2, 1});
    ADD_FAILURE() << "a document in two runs was accepted";
  } catch (const attn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("document 1 appears again at position 3"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(attn::DocumentMask({1, 4}), attn::shape_error);
  EXPECT_THROW(attn::DocumentMask({}), attn::shape_error);
  try {
    attn::DocumentMask({0, 5, 4});
    ADD_FAILURE() << "decreasing offsets were accepted";
  } catch (const attn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("offsets[1] = 5 then offsets[2] = 4"), std::string::npos)
        << e.what();
  }
}

TEST(Variants, CausalAndPrefixLmClassifyEveryTileExactly) {
  const attn::CausalMask causal;
  const attn::PrefixLM prefix{6};
  for (Index i = -2; i < 20; ++i) {
    for (Index j = -2; j < 20; ++j) {
      ScoreAt at;
      at.query = i;
      at.key = j;
      EXPECT_EQ(attn::variant_allows(causal, at), j <= i);
      EXPECT_EQ(attn::variant_allows(prefix, at), j < 6 || j <= i);
    }
  }
  // Exact: every tile's classification equals the brute-force one.
  const TileCounts causal_counts = classify_tiles(causal, -2, 30, "CausalMask");
  EXPECT_EQ(causal_counts.exact, causal_counts.tiles);
  const TileCounts prefix_counts = classify_tiles(prefix, -2, 30, "PrefixLM");
  EXPECT_EQ(prefix_counts.exact, prefix_counts.tiles);
}

TEST(Variants, DilatedWindowFollowsItsDefinition) {
  for (Index dilation : {1, 2, 3}) {
    const attn::DilatedWindow window(4, dilation);
    const attn::Mask mask = attn::variant_mask(window, 30, 30);
    for (Index q = 0; q < 30; ++q) {
      for (Index k = 0; k < 30; ++k) {
        bool expected = false;
        for (Index t = 0; t < 4; ++t) expected = expected || k == q - t * dilation;
        EXPECT_EQ(mask(q, k), expected) << q << ", " << k << ", dilation " << dilation;
      }
    }
    classify_tiles(window, 0, 30, "DilatedWindow");
  }
  EXPECT_THROW(attn::DilatedWindow(0), attn::shape_error);
  EXPECT_THROW(attn::DilatedWindow(3, 0), attn::shape_error);
}

TEST(Variants, TreeMaskSeesThePrefixAndTheAncestors) {
  // Prefix of 4 tokens; drafts: 0 and 1 children of the prefix, 2 and 3 children of 0, 4 of 3.
  const attn::TreeMask tree(4, {-1, -1, 0, 0, 3});
  const std::vector<std::vector<Index>> ancestors_or_self = {{0}, {1}, {0, 2}, {0, 3}, {0, 3, 4}};
  const attn::Mask mask = attn::variant_mask(tree, 10, 10);
  for (Index q = 0; q < 10; ++q) {
    for (Index k = 0; k < 10; ++k) {
      bool expected = false;
      if (q < 9 && k < 9) {
        if (k < 4) {
          expected = q >= 4 || k <= q;
        } else if (q >= 4) {
          for (Index a : ancestors_or_self[static_cast<std::size_t>(q - 4)]) {
            expected = expected || k - 4 == a;
          }
        }
      }
      EXPECT_EQ(mask(q, k), expected) << q << ", " << k;
    }
  }
  EXPECT_EQ(tree.rope_positions(), (std::vector<Index>{4, 4, 5, 5, 6}));
  classify_tiles(tree, -1, 11, "TreeMask");
  try {
    attn::TreeMask(4, {-1, 2, 0});
    ADD_FAILURE() << "a parent after its child was accepted";
  } catch (const attn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("parents[1] = 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(attn::TreeMask(4, {-2}), attn::shape_error);
  EXPECT_THROW(attn::TreeMask(-1, {}), attn::shape_error);
}

TEST(Variants, CompositionAndsAndOrsTheMasksAndKeepsTilesSound) {
  const attn::DocumentMask documents(ragged_offsets(), true);
  const attn::DilatedWindow window(5, 2);
  const attn::PrefixLM prefix{7};
  const auto both = attn::both(documents, window);
  const auto either = attn::either(prefix, window);
  const attn::Mask d = attn::variant_mask(documents, 40, 40);
  const attn::Mask w = attn::variant_mask(window, 40, 40);
  const attn::Mask p = attn::variant_mask(prefix, 40, 40);
  EXPECT_TRUE((attn::variant_mask(both, 40, 40) == (d && w)).all());
  EXPECT_TRUE((attn::variant_mask(either, 40, 40) == (p || w)).all());
  classify_tiles(both, 0, 40, "both(documents, window)");
  classify_tiles(either, 0, 40, "either(prefix, window)");
  // Random compositions of the ready masks, nested.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 20; ++trial) {
    const Index a = std::uniform_int_distribution<Index>(1, 12)(rng);
    const Index b = std::uniform_int_distribution<Index>(1, 4)(rng);
    const auto nested =
        attn::either(attn::both(documents, attn::DilatedWindow(a, b)), attn::PrefixLM{a});
    classify_tiles(nested, -1, 41, "nested " + std::to_string(trial));
  }
}

// The guard the classification tests are for: a variant that calls a Partial tile Full.
struct OverclaimingDocuments {
  attn::DocumentMask documents{{0, 5, 12}, true};
  bool allowed(const ScoreAt& at) const { return attn::variant_allows(documents, at); }
  TileKind tile(const TileAt& at) const {
    const TileKind kind = documents.tile(at);
    return kind == TileKind::Partial ? TileKind::Full : kind;
  }
};

TEST(Variants, APartialTileCalledFullIsCaught) {
  const OverclaimingDocuments wrong;
  EXPECT_GT(classify_tiles(wrong, 0, 12, "overclaiming", true).wrong, 0);
  const TileAt tile{0, 1, 0, {4, 7}, {3, 6}};  // crosses the boundary at 5
  try {
    attn::check_tile(wrong, tile);
    ADD_FAILURE() << "check_tile accepted a Partial tile called Full";
  } catch (const attn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("queries [4, 7) x keys [3, 6) (batch 0, head 1) Full but "
                                         "its mask makes it Partial"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(attn::check_tile(attn::DocumentMask({0, 5, 12}, true), tile));
}

TEST(Variants, TheBatchFormOfAScoreAgreesWithItsScore) {
  static_assert(attn::detail::callable_scores<attn::Softcap<float>, float>::value);
  static_assert(!attn::detail::callable_scores<attn::Softcap<float>, double>::value);
  const attn::Softcap<float> cap{3.0f};
  const auto chain = attn::both(attn::Softcap<float>{5.0f}, TemplateScore{});
  std::vector<float> run;
  for (int i = -40; i < 40; ++i) run.push_back(0.37f * static_cast<float>(i));
  std::vector<float> chained = run;
  ScoreAt first;
  first.key = 7;
  cap.scores(run.data(), static_cast<Index>(run.size()), first);
  chain.scores(chained.data(), static_cast<Index>(chained.size()), first);
  for (std::size_t c = 0; c < run.size(); ++c) {
    const float s = 0.37f * (static_cast<float>(c) - 40.0f);
    EXPECT_NEAR(run[c], cap.score(s, first), 4e-6f * 3.0f) << s;
    EXPECT_NEAR(chained[c], chain.score(s, first), 4e-6f * 5.0f) << s;
  }
}

TEST(Variants, ChainedScoresAndTheirDerivative) {
  const auto chain = attn::both(attn::Softcap<double>{5.0}, attn::Softcap<double>{3.0});
  const auto plain = attn::both(attn::CausalMask{}, TemplateScore{});
  const ScoreAt at;
  for (double s : {-40.0, -2.5, -0.1, 0.0, 0.7, 3.0, 12.0}) {
    const double inner = 5.0 * std::tanh(s / 5.0);
    EXPECT_DOUBLE_EQ(chain.score(s, at), 3.0 * std::tanh(inner / 3.0));
    const double h = 1e-5;
    const double central = (chain.score(s + h, at) - chain.score(s - h, at)) / (2 * h);
    EXPECT_NEAR(chain.dscore(s, at), central, 1e-8) << "s = " << s;
    EXPECT_EQ(plain.score(s, at), s + 1.0);  // (its dscore would not compile: no dscore)
  }
  EXPECT_EQ(attn::variant_score(attn::CausalMask{}, 2.5f, at), 2.5f);
  EXPECT_EQ(attn::variant_dscore(attn::CausalMask{}, 2.5f, at), 1.0f);
}

// docs/variants.md's example of a variant written by a user, as the page shows it.
struct SinksAndWindow {
  attn::Index sinks = 4;
  attn::Index window = 1024;
  bool allowed(const attn::ScoreAt& at) const {
    return at.key <= at.query && (at.key < sinks || at.query - at.key < window);
  }
  attn::TileKind tile(const attn::TileAt& at) const {
    if (at.keys.begin > at.queries.end - 1) return attn::TileKind::Empty;  // all in the future
    return attn::TileKind::Partial;  // always correct; refine for speed
  }
};

TEST(Variants, TheGuidesExampleIsAVariantWithSoundTiles) {
  static_assert(attn::check_variant<SinksAndWindow, float, true>());
  const SinksAndWindow streaming{2, 5};
  const attn::Mask mask = attn::variant_mask(streaming, 12, 12);
  EXPECT_TRUE(mask(11, 0) && mask(11, 1) && !mask(11, 2) && !mask(11, 6) && mask(11, 7));
  EXPECT_FALSE(mask(3, 4));
  classify_tiles(streaming, 0, 20, "SinksAndWindow");
}

// ---------------------------------------------------------------------------------------------
// flash_attention with a variant.

/// The log-sum-exp of each row of the reference's logits (-inf for a row that sees nothing).
attn_test::LMatrix reference_lse(const attn_test::NaiveAttention& r) {
  attn_test::LMatrix lse(r.logits.rows(), 1);
  for (Index i = 0; i < r.logits.rows(); ++i) {
    const long double max = r.logits.row(i).maxCoeff();
    if (max == -std::numeric_limits<long double>::infinity()) {
      lse(i, 0) = max;
      continue;
    }
    lse(i, 0) = max + std::log((r.logits.row(i).array() - max).exp().sum());
  }
  return lse;
}

/// flash_attention(Q, K, V, variant, options) with two tile shapes against the reference, the
/// log-sum-exp too, and attention_with_weights' output and weights; returns the default tiles'
/// output.
template <class T, class V>
attn::Matrix<T> expect_variant_matches(const V& variant, const attn::Matrix<T>& Q,
                                       const attn::Matrix<T>& K, const attn::Matrix<T>& Vv,
                                       const attn::AttentionOptions<T>& options,
                                       const std::string& name) {
  const attn_test::NaiveAttention want = attn_test::naive_attention(Q, K, Vv, options, variant);
  const attn_test::LMatrix want_lse = reference_lse(want);
  attn::Matrix<T> first;
  for (const attn::FlashTiles tiles : {attn::FlashTiles{}, attn::FlashTiles{5, 16}}) {
    attn::Vector<T> lse;
    const attn::Matrix<T> out = attn::flash_attention(Q, K, Vv, variant, options, lse, tiles);
    EXPECT_TRUE(attn_test::near(out, want.output, attn_test::Tol<T>::rel, attn_test::Tol<T>::abs))
        << name << ", tiles " << tiles.query_rows << " x " << tiles.key_cols;
    EXPECT_TRUE(attn_test::near(lse, want_lse, attn_test::Tol<T>::rel, attn_test::Tol<T>::abs))
        << name << " (log-sum-exp), tiles " << tiles.query_rows << " x " << tiles.key_cols;
    EXPECT_TRUE(attn_test::identical(attn::flash_attention(Q, K, Vv, variant, options, tiles), out))
        << name << ": with and without the log-sum-exp";
    if (first.size() == 0) first = out;
  }
  // The materialised tables show the same variant.
  const attn::Attention<T> tables = attn::attention_with_weights(Q, K, Vv, variant, options);
  EXPECT_TRUE(
      attn_test::near(tables.output, want.output, attn_test::Tol<T>::rel, attn_test::Tol<T>::abs))
      << name << " (attention_with_weights)";
  EXPECT_TRUE(
      attn_test::near(tables.weights, want.weights, attn_test::Tol<T>::rel, attn_test::Tol<T>::abs))
      << name << " (weights)";
  return first;
}

template <class T>
void every_ready_variant_through_flash() {
  std::mt19937 rng(11);
  const Index m = 70;
  const attn::Matrix<T> K = attn_test::random_matrix<T>(m, 16, rng, 2.0);
  const attn::Matrix<T> V = attn_test::random_matrix<T>(m, 12, rng);
  std::vector<Index> parents;
  for (Index i = 0; i < 30; ++i) {
    parents.push_back(std::uniform_int_distribution<Index>(-1, i - 1)(rng));
  }
  // Self-attention (n = m), and a chunk of the last 23 queries (query offset 47).
  for (const Index n : {m, Index(23)}) {
    const attn::Matrix<T> Q = attn_test::random_matrix<T>(n, 16, rng, 2.0);
    attn::AttentionOptions<T> plain;
    if (n != m) plain.query_offset = m - n;
    attn::AttentionOptions<T> with_options = plain;
    with_options.causal = attn::Causal::BottomRight;
    with_options.alibi_slope = T(0.125);
    with_options.softcap = T(3);
    for (const auto& options : {plain, with_options}) {
      const std::string tag = "n = " + std::to_string(n) + (options.softcap ? ", options" : "");
      expect_variant_matches(attn::DocumentMask(ragged_offsets(), false), Q, K, V, options,
                             "documents, " + tag);
      expect_variant_matches(attn::DocumentMask({0, 16, 17, 50, 70}, true), Q, K, V, options,
                             "causal documents, " + tag);
      expect_variant_matches(attn::PrefixLM{13}, Q, K, V, options, "prefix-LM, " + tag);
      expect_variant_matches(attn::DilatedWindow(5, 3), Q, K, V, options, "dilated, " + tag);
      expect_variant_matches(attn::TreeMask(40, parents), Q, K, V, options, "tree, " + tag);
      expect_variant_matches(attn::Softcap<T>{T(4)}, Q, K, V, options, "softcap, " + tag);
      expect_variant_matches(
          attn::both(attn::DocumentMask({0, 33, 70}, true), attn::Softcap<T>{T(6)}), Q, K, V,
          options, "both, " + tag);
      expect_variant_matches(attn::either(attn::PrefixLM{9}, attn::DilatedWindow(4, 2)), Q, K, V,
                             options, "either, " + tag);
    }
  }
}

TEST(VariantFlash, EveryReadyVariantMatchesTheReferenceFloat) {
  every_ready_variant_through_flash<float>();
}
TEST(VariantFlash, EveryReadyVariantMatchesTheReferenceDouble) {
  every_ready_variant_through_flash<double>();
}

TEST(VariantFlash, AMaskVariantGivesTheResultOfItsTable) {
  std::mt19937 rng(12);
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(300, 32, rng);
  // A rule per key: the same tiles as the table's, so the same bits.
  const attn::DilatedWindow window(40, 3);
  attn::AttentionOptions<float> window_table;
  window_table.mask = attn::variant_mask(window, 300, 300);
  // Ranges of keys: the kernel starts each block's tiles at its rows' first key, so the sums
  // run in another order than over the table.
  const attn::DocumentMask documents({0, 40, 41, 200, 300}, true);
  attn::AttentionOptions<float> documents_table;
  documents_table.mask = attn::variant_mask(documents, 300, 300);
  for (const attn::FlashTiles tiles : {attn::FlashTiles{}, attn::FlashTiles{7, 32}}) {
    EXPECT_TRUE(attn_test::identical(attn::flash_attention(Q, K, V, window, {}, tiles),
                                     attn::flash_attention(Q, K, V, window_table, tiles)));
    EXPECT_TRUE(attn_test::near(attn::flash_attention(Q, K, V, documents, {}, tiles),
                                attn::flash_attention(Q, K, V, documents_table, tiles), 1e-5,
                                1e-6));
  }
  // An identity score changes nothing either.
  struct Identity {
    float score(float s, const ScoreAt&) const { return s; }
  };
  EXPECT_TRUE(attn_test::identical(attn::flash_attention(Q, K, V, Identity{}),
                                   attn::flash_attention(Q, K, V)));
}

TEST(VariantFlash, TheCheckingModeNamesATileCalledFullWrongly) {
  std::mt19937 rng(17);
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(12, 8, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(12, 8, rng);
  const attn::Matrix<double> V = attn_test::random_matrix<double>(12, 8, rng);
  const OverclaimingDocuments wrong;
  // Unchecked, the wrong classification drops the mask where it should apply.
  const attn_test::NaiveAttention want =
      attn_test::naive_attention(Q, K, V, attn::AttentionOptions<double>{}, wrong.documents);
  EXPECT_FALSE(attn_test::near(attn::flash_attention(Q, K, V, wrong, {}, attn::FlashTiles{4, 4}),
                               want.output, 1e-9, 1e-9));
  try {
    attn::flash_attention(Q, K, V, attn::checked(wrong), {}, attn::FlashTiles{4, 4});
    ADD_FAILURE() << "the checking mode let a wrong Full through";
  } catch (const attn::shape_error& e) {
    EXPECT_NE(std::string(e.what()).find("Full but its mask makes it Partial"), std::string::npos)
        << e.what();
  }
  // A correct variant passes the check and gives the unchecked bits.
  EXPECT_TRUE(attn_test::identical(attn::flash_attention(Q, K, V, attn::checked(wrong.documents)),
                                   attn::flash_attention(Q, K, V, wrong.documents)));
}

TEST(VariantFlash, RowsThatSeeNothingGiveZeroAndMinusInfinity) {
  std::mt19937 rng(13);
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(12, 8, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(12, 8, rng);
  const attn::Matrix<double> V = attn_test::random_matrix<double>(12, 8, rng);
  const attn::TreeMask tree(4, {-1, 0, 0});  // positions 7 .. 11 belong to no token
  attn::Vector<double> lse;
  const attn::Matrix<double> out = attn::flash_attention(Q, K, V, tree, {}, lse);
  for (Index i = 7; i < 12; ++i) {
    EXPECT_TRUE(out.row(i).isZero(0)) << "row " << i;
    EXPECT_EQ(lse(i), -std::numeric_limits<double>::infinity()) << "row " << i;
  }
  EXPECT_TRUE(out.topRows(7).allFinite());
}

TEST(VariantFlash, AForbiddenKeysNanNeverReachesARow) {
  std::mt19937 rng(14);
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(96, 16, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(96, 16, rng);
  attn::Matrix<float> V = attn_test::random_matrix<float>(96, 16, rng);
  const attn::DocumentMask documents({0, 50, 96}, true);
  const attn::Matrix<float> clean = attn::flash_attention(Q, K, V, documents);
  V(49, 3) = std::numeric_limits<float>::quiet_NaN();  // the last key of document 0
  const attn::Matrix<float> out = attn::flash_attention(Q, K, V, documents);
  EXPECT_TRUE(out.topRows(49).allFinite());     // queries before key 49 do not see it
  EXPECT_TRUE(std::isnan(out(49, 3)));          // query 49 does: its NaN stays
  EXPECT_TRUE(out.bottomRows(46).allFinite());  // document 1 never sees key 49
  EXPECT_TRUE(attn_test::near(out.bottomRows(46), clean.bottomRows(46), 1e-6, 1e-7));
}

TEST(VariantFlash, TheThreadCountDoesNotChangeTheBits) {
  std::mt19937 rng(15);
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(400, 32, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(400, 32, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(400, 32, rng);
  const auto variant =
      attn::both(attn::DocumentMask({0, 100, 250, 400}, true), attn::Softcap<float>{5.0f});
  const int threads = attn::num_threads();
  attn::set_num_threads(1);
  const attn::Matrix<float> one = attn::flash_attention(Q, K, V, variant);
  attn::set_num_threads(2);
  const attn::Matrix<float> two = attn::flash_attention(Q, K, V, variant);
  attn::set_num_threads(threads);
  EXPECT_TRUE(attn_test::identical(one, two));
}

TEST(VariantFlash, StoredKeysAndValuesTakeTheVariantToo) {
  std::mt19937 rng(16);
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(64, 16, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(64, 16, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(64, 16, rng);
  using Half = Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Half K16 = K.cast<Eigen::half>();
  const Half V16 = V.cast<Eigen::half>();
  const attn::PrefixLM prefix{20};
  const attn::Matrix<float> widened = attn::flash_attention(
      Q, attn::Matrix<float>(K16.cast<float>()), attn::Matrix<float>(V16.cast<float>()), prefix);
  EXPECT_TRUE(attn_test::near(attn::flash_attention(Q, K16, V16, prefix), widened, 1e-5, 1e-6));
}

// ---------------------------------------------------------------------------------------------
// The backward with a variant.

/// A position-dependent score: s + 0.1 (query - key) + 0.05 s^2 / (1 + s^2), with its derivative.
struct BumpyBias {
  template <class T>
  T score(T s, const ScoreAt& at) const {
    return s + T(0.1) * static_cast<T>(at.query - at.key) + T(0.05) * s * s / (T(1) + s * s);
  }
  template <class T>
  T dscore(T s, const ScoreAt&) const {
    const T q = T(1) + s * s;
    return T(1) + T(0.1) * s / (q * q);
  }
};

/// L = sum(dO o O) by the long-double reference, as a function of Q, K and V.
template <class V>
long double reference_loss(const attn::Matrix<double>& Q, const attn::Matrix<double>& K,
                           const attn::Matrix<double>& Vv, const attn::Matrix<double>& dO,
                           const attn::AttentionOptions<double>& options, const V& variant) {
  const attn_test::NaiveAttention r = attn_test::naive_attention(Q, K, Vv, options, variant);
  return (r.output.array() * dO.cast<long double>().array()).sum();
}

/// Central differences of `loss()` in every entry of `X`, which it perturbs in place and restores.
template <class Loss>
attn::Matrix<double> central_differences_in_place(attn::Matrix<double>& X, const Loss& loss) {
  attn::Matrix<double> g(X.rows(), X.cols());
  const double h = 1e-5;
  for (Index i = 0; i < X.rows(); ++i) {
    for (Index j = 0; j < X.cols(); ++j) {
      const double x = X(i, j);
      X(i, j) = x + h;
      const long double up = loss();
      X(i, j) = x - h;
      const long double down = loss();
      X(i, j) = x;
      g(i, j) = static_cast<double>((up - down) / (2.0L * static_cast<long double>(h)));
    }
  }
  return g;
}

/// Central differences of the reference loss in every entry of `X` (one of Q, K, V).
template <class Loss>
attn::Matrix<double> central_differences(attn::Matrix<double> X, const Loss& loss) {
  return central_differences_in_place(X, [&] { return loss(X); });
}

template <class V>
void expect_gradients_match(const V& variant, Index n,
                            const attn::AttentionOptions<double>& options,
                            const std::string& name) {
  std::mt19937 rng(21);
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(n, 4, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(n, 4, rng);
  const attn::Matrix<double> Vv = attn_test::random_matrix<double>(n, 3, rng);
  const attn::Matrix<double> dO = attn_test::random_matrix<double>(n, 3, rng);
  const auto dQ = central_differences(Q, [&](const attn::Matrix<double>& X) {
    return reference_loss(X, K, Vv, dO, options, variant);
  });
  const auto dK = central_differences(K, [&](const attn::Matrix<double>& X) {
    return reference_loss(Q, X, Vv, dO, options, variant);
  });
  const auto dV = central_differences(Vv, [&](const attn::Matrix<double>& X) {
    return reference_loss(Q, K, X, dO, options, variant);
  });
  const attn::AttentionGrads<double> grads =
      attn::attention_backward(Q, K, Vv, dO, variant, options);
  const attn::AttentionGrads<double> tiled =
      attn::flash_attention_backward(Q, K, Vv, dO, variant, options, attn::BackwardTiles{3, 8});
  for (const auto* g : {&grads, &tiled}) {
    const std::string path = g == &grads ? "attention_backward" : "flash_attention_backward";
    EXPECT_TRUE(attn_test::near(g->dQ, dQ, 1e-6, 1e-8)) << name << ", dQ, " << path;
    EXPECT_TRUE(attn_test::near(g->dK, dK, 1e-6, 1e-8)) << name << ", dK, " << path;
    EXPECT_TRUE(attn_test::near(g->dV, dV, 1e-6, 1e-8)) << name << ", dV, " << path;
  }
}

TEST(VariantBackward, GradientsMatchCentralDifferences) {
  attn::AttentionOptions<double> plain;
  attn::AttentionOptions<double> options;
  options.softcap = 2.0;
  options.alibi_slope = 0.25;
  std::mt19937 rng(22);
  std::vector<Index> parents;
  for (Index i = 0; i < 8; ++i)
    parents.push_back(std::uniform_int_distribution<Index>(-1, i - 1)(rng));
  for (const auto& o : {plain, options}) {
    const std::string tag = o.softcap ? " with options" : "";
    expect_gradients_match(
        attn::both(attn::DocumentMask({0, 5, 6, 14}, true), attn::Softcap<double>{2.5}), 14, o,
        "documents + softcap" + tag);
    expect_gradients_match(attn::both(attn::PrefixLM{4}, BumpyBias{}), 14, o,
                           "prefix + bias" + tag);
    expect_gradients_match(attn::TreeMask(6, parents), 14, o, "tree" + tag);
    expect_gradients_match(attn::both(attn::DilatedWindow(3, 2), BumpyBias{}), 14, o,
                           "dilated + bias" + tag);
  }
}

TEST(VariantBackward, ForbiddenKeysGetExactlyZero) {
  std::mt19937 rng(23);
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(12, 6, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(12, 6, rng);
  const attn::Matrix<double> V = attn_test::random_matrix<double>(12, 5, rng);
  const attn::Matrix<double> dO = attn_test::random_matrix<double>(12, 5, rng);
  const attn::TreeMask tree(4, {-1, 0, 0});  // positions 7 .. 11 belong to no token
  for (const auto& grads : {attn::attention_backward(Q, K, V, dO, tree),
                            attn::flash_attention_backward(Q, K, V, dO, tree, {}, {4, 4})}) {
    EXPECT_TRUE(grads.dQ.bottomRows(5).isZero(0));
    EXPECT_TRUE(grads.dK.bottomRows(5).isZero(0));
    EXPECT_TRUE(grads.dV.bottomRows(5).isZero(0));
    EXPECT_TRUE(grads.dQ.allFinite() && grads.dK.allFinite() && grads.dV.allFinite());
  }
  // A NaN in a key's value that no query may see stays out of every gradient.
  attn::Matrix<double> V_nan = V;
  V_nan(9, 2) = std::numeric_limits<double>::quiet_NaN();
  const attn::AttentionGrads<double> grads = attn::attention_backward(Q, K, V_nan, dO, tree);
  EXPECT_TRUE(grads.dQ.allFinite() && grads.dK.allFinite());
  EXPECT_TRUE(grads.dV.topRows(7).allFinite());
}

TEST(VariantBackward, TheThreadCountDoesNotChangeTheBits) {
  std::mt19937 rng(24);
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> dO = attn_test::random_matrix<float>(300, 32, rng);
  const auto variant =
      attn::both(attn::DocumentMask({0, 100, 250, 300}, true), attn::Softcap<float>{5.0f});
  const int threads = attn::num_threads();
  attn::set_num_threads(1);
  const attn::AttentionGrads<float> one = attn::attention_backward(Q, K, V, dO, variant);
  attn::set_num_threads(2);
  const attn::AttentionGrads<float> two = attn::attention_backward(Q, K, V, dO, variant);
  attn::set_num_threads(threads);
  EXPECT_TRUE(attn_test::identical(one.dQ, two.dQ));
  EXPECT_TRUE(attn_test::identical(one.dK, two.dK));
  EXPECT_TRUE(attn_test::identical(one.dV, two.dV));
}

/// A document mask given as a rule per key alone (no `keys`, no `tile`).
struct DocumentsByKey {
  attn::DocumentMask documents;
  bool allowed(const ScoreAt& at) const { return attn::variant_allows(documents, at); }
};

// Without a tile classification, attention_backward classifies the mask once per call into a
// block mask (cells of 4 queries x 128 keys) that its forward (36 x 512 tiles) and its backward
// (128 x 128, and 40 x 50 here: tiles that cut cells) both read. The gradients equal those of the
// same mask with its exact tiles; ragged documents put Empty, Full and Partial cells side by side.
TEST(VariantBackward, AMaskWithoutTilesIsClassifiedOnceIntoABlockMask) {
  std::mt19937 rng(25);
  const Index n = 301;
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(n, 8, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(n, 8, rng);
  const attn::Matrix<double> V = attn_test::random_matrix<double>(n, 8, rng);
  const attn::Matrix<double> dO = attn_test::random_matrix<double>(n, 8, rng);
  const attn::DocumentMask documents({0, 3, 131, 132, 260, 301}, true);
  const DocumentsByKey by_key{documents};
  for (const attn::BackwardTiles tiles : {attn::BackwardTiles{}, attn::BackwardTiles{40, 50}}) {
    const attn::AttentionGrads<double> exact =
        attn::flash_attention_backward(Q, K, V, dO, documents, {}, tiles);
    const attn::AttentionGrads<double> cached =
        attn::flash_attention_backward(Q, K, V, dO, by_key, {}, tiles);
    EXPECT_TRUE(attn_test::near(cached.dQ, exact.dQ, 1e-13, 1e-13));
    EXPECT_TRUE(attn_test::near(cached.dK, exact.dK, 1e-13, 1e-13));
    EXPECT_TRUE(attn_test::near(cached.dV, exact.dV, 1e-13, 1e-13));
  }
}

// ---------------------------------------------------------------------------------------------
// T5's relative position bias, a variant with learnable parameters.

/// T5's bucket of `relative = key - query`, transcribed from the paper's definition (Raffel et al.
/// 2020, the Mesh TensorFlow function): independent of attn's table.
Index t5_bucket(Index relative, bool bidirectional, Index buckets, Index max_distance) {
  Index bucket = 0;
  Index n = -relative;
  if (bidirectional) {
    buckets /= 2;
    if (n < 0) bucket += buckets;
    n = std::abs(n);
  } else {
    n = std::max<Index>(n, 0);
  }
  const Index max_exact = buckets / 2;
  if (n < max_exact) return bucket + n;
  const double large =
      static_cast<double>(max_exact) +
      std::log(static_cast<double>(n) / static_cast<double>(max_exact)) /
          std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
          static_cast<double>(buckets - max_exact);
  return bucket + std::min(static_cast<Index>(large), buckets - 1);
}

TEST(T5Bias, BucketCountsAndDistancesItCannotServeAreRefused) {
  // Bidirectional with 2 buckets leaves no exact bucket per direction: T5's logarithmic buckets
  // would divide by zero (found by the fuzzer as a NaN cast to an index).
  attn_test::expect_shape_error([] { attn::T5Bias<float>(1, 2, 128, true); },
                                {"attn::T5Bias", "at least 2 per direction"});
  attn_test::expect_shape_error([] { attn::T5Bias<float>(1, 6 - 1, 128, true); }, {"attn::T5Bias"});
  attn_test::expect_shape_error([] { attn::T5Bias<float>(1, 8, 2, false); },
                                {"max_distance must exceed"});
  // Causal bucketing with 2 buckets: distance 0 and everything else.
  const attn::T5Bias<float> two(1, 2, 4, false);
  EXPECT_EQ(two.bucket(10, 10), 0);
  EXPECT_EQ(two.bucket(10, 9), 1);
  EXPECT_EQ(two.bucket(10, 11), 0);  // a later key: bucket 0, as T5's decoder
  // The largest max_distance costs no table of its size, and buckets far distances as T5 does.
  const Index max = std::numeric_limits<Index>::max();
  const attn::T5Bias<float> far(1, 32, max, true);
  for (const Index relative : {Index(-3), Index(70000), Index(-123456789), Index(1) << 40}) {
    EXPECT_EQ(far.bucket(0, relative), t5_bucket(relative, true, 32, max))
        << "relative " << relative;
  }
}

TEST(T5Bias, BucketsAsInTheT5Paper) {
  for (bool bidirectional : {true, false}) {
    for (Index buckets : {8, 32}) {
      const attn::T5Bias<float> t5(2, buckets, 128, bidirectional);
      for (Index relative = -400; relative <= 400; ++relative) {
        EXPECT_EQ(t5.bucket(1000, 1000 + relative),
                  t5_bucket(relative, bidirectional, buckets, 128))
            << "relative " << relative << ", buckets " << buckets
            << (bidirectional ? ", bidirectional" : ", causal");
      }
    }
  }
  EXPECT_THROW(attn::T5Bias<float>(0), attn::shape_error);
  EXPECT_THROW(attn::T5Bias<float>(2, 7), attn::shape_error);      // odd, bidirectional
  EXPECT_THROW(attn::T5Bias<float>(2, 32, 8), attn::shape_error);  // max_distance too short
}

template <class V>
void expect_parameter_gradient_matches(const V& variant, attn::Matrix<double>& table,
                                       const attn::AttentionOptions<double>& options,
                                       const std::string& name) {
  std::mt19937 rng(31);
  const Index n = 70;  // two row blocks of the materialised backward, several key parts tiled
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(n, 4, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(n, 4, rng);
  const attn::Matrix<double> Vv = attn_test::random_matrix<double>(n, 3, rng);
  const attn::Matrix<double> dO = attn_test::random_matrix<double>(n, 3, rng);
  const attn::Matrix<double> want = central_differences_in_place(
      table, [&] { return reference_loss(Q, K, Vv, dO, options, variant); });
  attn::AttentionGrads<double> grads;
  typename V::Gradient got;
  attn::attention_backward(Q, K, Vv, dO, variant, options, grads, got);
  EXPECT_TRUE(attn_test::near(got, want, 1e-6, 1e-8)) << name << " (attention_backward)";
  typename V::Gradient tiled;
  attn::flash_attention_backward(Q, K, Vv, dO, variant, options, attn::BackwardTiles{3, 1}, &tiled);
  EXPECT_TRUE(attn_test::near(tiled, want, 1e-6, 1e-8)) << name << " (flash_attention_backward)";
  EXPECT_GT(want.cwiseAbs().maxCoeff(), 1e-3) << name << ": the gradient is not trivially zero";
}

/// Reaches the T5Bias inside a `Both` (its first or second side).
template <class A, class B>
attn::Matrix<double>& table_of(attn::Both<A, B>& pair) {
  if constexpr (attn::variant_learns_v<A>) {
    return pair.first.table();
  } else {
    return pair.second.table();
  }
}

TEST(T5Bias, TheTablesGradientMatchesCentralDifferences) {
  std::mt19937 rng(32);
  attn::T5Bias<double> t5(1, 8, 16, true);
  t5.table() = attn_test::random_matrix<double>(1, 8, rng);
  attn::AttentionOptions<double> plain;
  attn::AttentionOptions<double> options;
  options.softcap = 2.0;
  for (const auto& o : {plain, options}) {
    const std::string tag = o.softcap ? " with the option softcap" : "";
    {
      attn::T5Bias<double> alone = t5;
      // The table is the variant's own: perturb it through a reference to the variant.
      expect_parameter_gradient_matches(alone, alone.table(), o, "T5 alone" + tag);
    }
    {
      auto documents = attn::both(attn::DocumentMask({0, 30, 70}, true), t5);
      expect_parameter_gradient_matches(documents, table_of(documents), o,
                                        "documents then T5" + tag);
    }
    {
      auto capped = attn::both(t5, attn::Softcap<double>{1.5});
      expect_parameter_gradient_matches(capped, table_of(capped), o, "T5 then softcap" + tag);
    }
  }
}

TEST(T5Bias, TheTablesGradientHasTheSameBitsForAnyThreadCount) {
  std::mt19937 rng(33);
  const attn::Matrix<float> Q = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(300, 32, rng);
  const attn::Matrix<float> dO = attn_test::random_matrix<float>(300, 32, rng);
  attn::T5Bias<float> t5(1, 32, 128, false);
  t5.table() = attn_test::random_matrix<float>(1, 32, rng);
  const auto variant = attn::both(attn::DocumentMask({0, 100, 300}, true), t5);
  const int threads = attn::num_threads();
  attn::AttentionGrads<float> grads;
  attn::Matrix<float> one, two;
  attn::set_num_threads(1);
  attn::attention_backward(Q, K, V, dO, variant, {}, grads, one);
  attn::set_num_threads(2);
  attn::attention_backward(Q, K, V, dO, variant, {}, grads, two);
  attn::set_num_threads(threads);
  EXPECT_TRUE(attn_test::identical(one, two));
  EXPECT_TRUE(one.allFinite());
}

// ---------------------------------------------------------------------------------------------
// attention_heads with a variant: each query head sees its own head and key/value head.

/// A score and a mask that differ per head: s (1 + 0.2 head) + 0.1 kv_head (key mod 3), and each
/// query head h sees the keys up to h places after the query.
/// With `head` >= 0, the variant as head `head` over key/value head `kv_head` sees it whatever
/// head calls it (the one-head reference of a call over many heads).
struct PerHead {
  Index head = -1;
  Index kv_head = -1;
  Index head_of(const ScoreAt& at) const { return head >= 0 ? head : at.head; }
  Index kv_head_of(const ScoreAt& at) const { return head >= 0 ? kv_head : at.kv_head; }
  template <class T>
  T score(T s, const ScoreAt& at) const {
    return s * (T(1) + T(0.2) * static_cast<T>(head_of(at))) +
           T(0.1) * static_cast<T>(kv_head_of(at)) * static_cast<T>(at.key % 3);
  }
  template <class T>
  T dscore(T, const ScoreAt& at) const {
    return T(1) + T(0.2) * static_cast<T>(head_of(at));
  }
  bool allowed(const ScoreAt& at) const { return at.key <= at.query + head_of(at); }
};

/// (heads, rows, cols) of uniform entries.
attn::Tensor3<double> random_tensor(Index heads, Index rows, Index cols, std::mt19937& rng) {
  attn::Tensor3<double> t(heads, rows, cols);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = u(rng);
  return t;
}

template <class V>
void expect_heads_match_reference(const V& variant, Index n, Index m,
                                  const attn::AttentionOptions<double>& options,
                                  const std::string& name) {
  std::mt19937 rng(41);
  const Index heads = 4, kv_heads = 2, d = 16;
  // d_v 16: whole packets (the decoding kernel's SIMD tiles for one query); 5: its other loop.
  for (const Index d_v : {Index(16), Index(5)}) {
    const attn::Tensor3<double> Q = random_tensor(heads, n, d, rng);
    const attn::Tensor3<double> K = random_tensor(kv_heads, m, d, rng);
    const attn::Tensor3<double> Vv = random_tensor(kv_heads, m, d_v, rng);
    const attn::Tensor3<double> out = attn::attention_heads(Q, K, Vv, variant, options);
    for (Index h = 0; h < heads; ++h) {
      const Index kv = h / (heads / kv_heads);
      const attn_test::NaiveAttention want =
          attn_test::naive_attention(attn::detail::slice(Q, h), attn::detail::slice(K, kv),
                                     attn::detail::slice(Vv, kv), options, variant, h, kv);
      EXPECT_TRUE(attn_test::near(attn::detail::slice(out, h), want.output, 1e-12, 1e-13))
          << name << ", head " << h << ", n " << n << ", d_v " << d_v;
    }
  }
}

TEST(VariantHeads, EachHeadSeesItsHeadsAsTheReferenceDoes) {
  attn::T5Bias<double> t5(4, 8, 16, true);
  std::mt19937 rng(42);
  t5.table() = attn_test::random_matrix<double>(4, 8, rng);
  attn::AttentionOptions<double> causal;
  causal.causal = attn::Causal::BottomRight;
  for (const Index n : {Index(1), Index(37)}) {
    expect_heads_match_reference(PerHead{}, n, 37, {}, "per-head score and mask");
    expect_heads_match_reference(t5, n, 37, causal, "T5 table of 4 heads, causal");
    expect_heads_match_reference(attn::both(attn::DocumentMask({0, 10, 37}, false), t5), n, 37, {},
                                 "documents and T5");
  }
}

TEST(VariantHeads, OneQueryNeverSeesAForbiddenKeysNan) {
  // One query: the decoding kernel over the 4 query heads stacked on their key/value head.
  std::mt19937 rng(44);
  attn::Tensor3<float> Q(4, 1, 16), K(1, 300, 16), V(1, 300, 16);
  for (auto* t : {&Q, &K, &V}) {
    const attn::Tensor3<double> r =
        random_tensor(t->dimension(0), t->dimension(1), t->dimension(2), rng);
    for (Index i = 0; i < t->size(); ++i) t->data()[i] = static_cast<float>(r.data()[i]);
  }
  attn::AttentionOptions<float> options;
  options.query_offset = 299;
  const attn::DocumentMask documents({0, 100, 300}, true);
  const attn::Tensor3<float> clean = attn::attention_heads(Q, K, V, documents, options);
  V(0, 50, 3) = std::numeric_limits<float>::quiet_NaN();  // a key of document 0
  const attn::Tensor3<float> out = attn::attention_heads(Q, K, V, documents, options);
  for (Index h = 0; h < 4; ++h) {
    EXPECT_TRUE(
        attn_test::near(attn::detail::slice(out, h), attn::detail::slice(clean, h), 1e-6, 1e-7))
        << "head " << h;
  }
  // The same query in document 0 does see the NaN.
  options.query_offset = 60;
  EXPECT_TRUE(std::isnan(attn::attention_heads(Q, K, V, documents, options)(0, 0, 3)));
  // Past the last document it sees nothing: zero output, no key read.
  options.query_offset = 400;
  const attn::Tensor3<float> nothing = attn::attention_heads(Q, K, V, documents, options);
  for (Index h = 0; h < 4; ++h) EXPECT_TRUE(attn::detail::slice(nothing, h).isZero(0));
}

TEST(VariantHeads, StoredKeysAndValuesAndTheThreadCount) {
  std::mt19937 rng(43);
  attn::Tensor3<float> Q(4, 50, 16), K(1, 70, 16), V(1, 70, 16);
  for (auto* t : {&Q, &K, &V}) {
    const attn::Tensor3<double> r =
        random_tensor(t->dimension(0), t->dimension(1), t->dimension(2), rng);
    for (Index i = 0; i < t->size(); ++i) t->data()[i] = static_cast<float>(r.data()[i]);
  }
  const auto variant = attn::both(attn::DocumentMask({0, 30, 70}, true), PerHead{});
  attn::AttentionOptions<float> options;
  options.query_offset = 20;
  const int threads = attn::num_threads();
  attn::set_num_threads(1);
  const attn::Tensor3<float> one = attn::attention_heads(Q, K, V, variant, options);
  attn::set_num_threads(2);
  const attn::Tensor3<float> two = attn::attention_heads(Q, K, V, variant, options);
  // One head: fewer heads than threads, so the kernel runs parallel over query blocks instead.
  attn::Tensor3<float> Q0(1, 50, 16);
  std::copy(Q.data(), Q.data() + Q0.size(), Q0.data());
  const attn::Tensor3<float> first = attn::attention_heads(Q0, K, V, variant, options);
  attn::set_num_threads(threads);
  EXPECT_TRUE(attn_test::identical(attn::detail::slice(one, 1), attn::detail::slice(two, 1)));
  EXPECT_TRUE(attn_test::identical(attn::detail::slice(first, 0), attn::detail::slice(one, 0)));
  // Keys and values in float16: the result of the widened tensors.
  const Eigen::Tensor<Eigen::half, 3, Eigen::RowMajor> K16 = K.cast<Eigen::half>();
  const Eigen::Tensor<Eigen::half, 3, Eigen::RowMajor> V16 = V.cast<Eigen::half>();
  const attn::Tensor3<float> K_wide = K16.cast<float>();
  const attn::Tensor3<float> V_wide = V16.cast<float>();
  const attn::Tensor3<float> stored = attn::attention_heads(Q, K16, V16, variant, options);
  const attn::Tensor3<float> widened = attn::attention_heads(Q, K_wide, V_wide, variant, options);
  for (Index h = 0; h < 4; ++h) {
    EXPECT_TRUE(attn_test::near(attn::detail::slice(stored, h), attn::detail::slice(widened, h),
                                1e-5, 1e-6))
        << "head " << h;
  }
  attn::Tensor3<float> K3(3, 70, 16);  // 4 query heads over 3 key/value heads
  K3.setZero();
  EXPECT_THROW(attn::attention_heads(Q, K3, K3, variant, options), attn::shape_error);
}

/// Claims every tile is Full while forbidding odd keys.
struct OddKeysCalledFull {
  bool allowed(const ScoreAt& at) const { return at.key % 2 == 0; }
  TileKind tile(const TileAt&) const { return TileKind::Full; }
};

/// attention_heads_backward with `variant` (4 query heads over 2 key/value heads) against
/// attention_backward of each head alone with `alone(h, kv)`, the variant as head h sees it:
/// dQ per head, dK and dV summed over a key/value head's query heads in head order.
template <class V, class Alone>
void expect_heads_backward_is_each_heads(const V& variant, const Alone& alone,
                                         const attn::AttentionOptions<double>& options,
                                         const std::string& name, Index n = 37) {
  std::mt19937 rng(45);
  const Index heads = 4, kv_heads = 2, d = 8, d_v = 5;
  const attn::Tensor3<double> Q = random_tensor(heads, n, d, rng);
  const attn::Tensor3<double> K = random_tensor(kv_heads, n, d, rng);
  const attn::Tensor3<double> Vv = random_tensor(kv_heads, n, d_v, rng);
  const attn::Tensor3<double> dO = random_tensor(heads, n, d_v, rng);
  const attn::HeadGrads<double> got =
      attn::attention_heads_backward(Q, K, Vv, dO, variant, options);
  attn::Matrix<double> dK[2], dV[2];
  for (Index h = 0; h < heads; ++h) {
    const Index kv = h / 2;
    const attn::AttentionGrads<double> want = attn::attention_backward(
        attn::detail::slice(Q, h), attn::detail::slice(K, kv), attn::detail::slice(Vv, kv),
        attn::detail::slice(dO, h), alone(h, kv), options);
    EXPECT_TRUE(attn_test::near(attn::detail::slice(got.dQ, h), want.dQ, 1e-13, 1e-14))
        << name << ", dQ of head " << h;
    dK[kv] = h % 2 == 0 ? want.dK : attn::Matrix<double>(dK[kv] + want.dK);
    dV[kv] = h % 2 == 0 ? want.dV : attn::Matrix<double>(dV[kv] + want.dV);
  }
  for (Index kv = 0; kv < kv_heads; ++kv) {
    EXPECT_TRUE(attn_test::near(attn::detail::slice(got.dK, kv), dK[kv], 1e-13, 1e-14))
        << name << ", dK of key/value head " << kv;
    EXPECT_TRUE(attn_test::near(attn::detail::slice(got.dV, kv), dV[kv], 1e-13, 1e-14))
        << name << ", dV of key/value head " << kv;
  }
}

TEST(VariantHeads, TheBackwardIsEachHeadsBackward) {
  attn::AttentionOptions<double> causal;
  causal.causal = attn::Causal::BottomRight;
  causal.softcap = 3.0;
  expect_heads_backward_is_each_heads(
      PerHead{},
      [](Index h, Index kv) {
        return PerHead{h, kv};
      },
      {}, "per-head score and mask");
  // Long enough for the block mask of a mask without tiles (cells of 4 x 128) to hold Empty and
  // Full cells that differ from head to head near the diagonal: each head needs its own.
  expect_heads_backward_is_each_heads(
      PerHead{},
      [](Index h, Index kv) {
        return PerHead{h, kv};
      },
      {}, "per-head score and mask, 300 tokens", 300);
  expect_heads_backward_is_each_heads(
      attn::both(attn::DocumentMask({0, 10, 37}, true), PerHead{}),
      [](Index h, Index kv) {
        return attn::both(attn::DocumentMask({0, 10, 37}, true), PerHead{h, kv});
      },
      causal, "documents and per-head, causal with softcap");
}

TEST(VariantHeads, TheBackwardGivesEachHeadsRowOfALearnedTable) {
  // T5Bias of 4 heads: head h reads and learns row h of the table, so the heads' gradient is row
  // by row the gradient of head h alone with a one-head table holding row h.
  std::mt19937 rng(46);
  const Index heads = 4, kv_heads = 2, n = 70, d = 8;
  attn::T5Bias<double> t5(heads, 8, 16, true);
  t5.table() = attn_test::random_matrix<double>(heads, 8, rng);
  const attn::DocumentMask documents({0, 30, 70}, true);
  const attn::Tensor3<double> Q = random_tensor(heads, n, d, rng);
  const attn::Tensor3<double> K = random_tensor(kv_heads, n, d, rng);
  const attn::Tensor3<double> Vv = random_tensor(kv_heads, n, d, rng);
  const attn::Tensor3<double> dO = random_tensor(heads, n, d, rng);
  attn::HeadGrads<double> grads;
  attn::Matrix<double> dtable;
  attn::attention_heads_backward(Q, K, Vv, dO, attn::both(documents, t5), {}, {}, grads, dtable);
  ASSERT_EQ(dtable.rows(), heads);
  for (Index h = 0; h < heads; ++h) {
    attn::T5Bias<double> row(1, 8, 16, true);
    row.table() = t5.table().row(h);
    attn::AttentionGrads<double> alone;
    attn::Matrix<double> drow;
    attn::attention_backward(attn::detail::slice(Q, h), attn::detail::slice(K, h / 2),
                             attn::detail::slice(Vv, h / 2), attn::detail::slice(dO, h),
                             attn::both(documents, row), {}, alone, drow);
    EXPECT_TRUE(attn_test::near(dtable.row(h), drow, 1e-13, 1e-14)) << "row " << h;
    EXPECT_TRUE(attn_test::near(attn::detail::slice(grads.dQ, h), alone.dQ, 1e-13, 1e-14))
        << "dQ of head " << h;
  }
  // The same bits for 1 and 2 threads (2 key/value heads: parallel over them).
  const int threads = attn::num_threads();
  attn::Matrix<double> one, two;
  attn::set_num_threads(1);
  attn::attention_heads_backward(Q, K, Vv, dO, attn::both(documents, t5), {}, {}, grads, one);
  const attn::Tensor3<double> dK_one = grads.dK;
  attn::set_num_threads(2);
  attn::attention_heads_backward(Q, K, Vv, dO, attn::both(documents, t5), {}, {}, grads, two);
  attn::set_num_threads(threads);
  EXPECT_TRUE(attn_test::identical(one, two));
  EXPECT_TRUE(
      attn_test::identical(attn::detail::slice(dK_one, 1), attn::detail::slice(grads.dK, 1)));
  // The checking mode names a tile the variant classifies wrongly (Full, with odd keys
  // forbidden).
  EXPECT_THROW(attn::attention_heads_backward(Q, K, Vv, dO, attn::checked(OddKeysCalledFull{})),
               attn::shape_error);
}

TEST(VariantPositions, AQueryOffsetPastTheIndexRangeIsRefusedNotWrapped) {
  // Without a variant an offset near the end of the range means "after every key"; a variant
  // would be shown positions past INT64_MAX, so every path refuses the call.
  std::mt19937 rng(47);
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(40, 8, rng);
  const attn::Matrix<double> K = attn_test::random_matrix<double>(40, 8, rng);
  const attn::DocumentMask documents({0, 20, 40}, true);
  attn::AttentionOptions<double> options;
  attn::Tensor3<double> Qt(2, 40, 8), Kt(1, 40, 8);
  Qt.setConstant(0.5);
  Kt.setConstant(0.25);
  attn::KVCache<double> cache(8, 8);
  cache.append(K, K);
  attn::MultiHeadAttention<double> layer(attn::MultiHeadConfig{8, 2}, 3);
  const Index max = std::numeric_limits<Index>::max();
  for (const Index offset : {max, max - 39, max - 20}) {
    options.query_offset = offset;
    attn_test::expect_shape_error([&] { attn::flash_attention(Q, K, K, documents, options); },
                                  {"flash_attention", "positions of the queries"});
    attn_test::expect_shape_error(
        [&] { attn::attention_with_weights(Q, K, K, documents, options); }, {"trace_attention"});
    attn_test::expect_shape_error([&] { attn::attention_backward(Q, K, K, K, documents, options); },
                                  {"attention_backward"});
    attn_test::expect_shape_error([&] { attn::attention_heads(Qt, Kt, Kt, documents, options); },
                                  {"attention_heads"});
    attn_test::expect_shape_error(
        [&] { attn::attention_heads_backward(Qt, Kt, Kt, Qt, documents, options); },
        {"attention_heads_backward"});
    attn_test::expect_shape_error([&] { cache.attend(Q, documents, options); },
                                  {"KVCache::attend"});
    attn::MultiHeadOptions<double> layer_options;
    layer_options.query_offset = offset;
    attn_test::expect_shape_error([&] { layer.forward(Q, documents, layer_options); },
                                  {"MultiHeadAttention::forward"});
  }
  // The last position that fits is a position like any other.
  options.query_offset = max - 40;
  EXPECT_TRUE(attn::flash_attention(Q, K, K, documents, options).isZero(0));  // past every document
}

// ---------------------------------------------------------------------------------------------
// KVCache::attend with a variant: the cache's keys at their absolute positions.

/// StreamingLLM's visibility as a mask: causal, the w keys before a query and the first `pinned`.
struct Streaming {
  Index window;
  Index pinned;
  bool allowed(const ScoreAt& at) const {
    return at.key <= at.query && (at.query - at.key <= window || at.key < pinned);
  }
};

/// Appends 6 blocks of 7 tokens (kv_heads 2, d 8, d_v 5) and attends the last block's 7 queries
/// (4 query heads) with `variant`; compares with attention_heads over every token, causal, with
/// `variant` and the cache's window as a mask.
template <class V>
void expect_cache_matches_heads(const V& variant, std::optional<Index> window, Index pinned,
                                attn::KVStorage storage, Index queries, double tolerance,
                                const std::string& name) {
  std::mt19937 rng(51);
  const Index kv_heads = 2, heads = 4, d = 8, d_v = 5, block = 7, blocks = 6;
  attn::KVCacheConfig<double> config;
  config.d_k = d;
  config.d_v = d_v;
  config.kv_heads = kv_heads;
  config.window = window;
  config.pinned_tokens = pinned;
  config.storage = storage;
  attn::KVCache<double> cache(config);
  const attn::Matrix<double> K =
      attn_test::random_matrix<double>(block * blocks, kv_heads * d, rng);
  const attn::Matrix<double> Vv =
      attn_test::random_matrix<double>(block * blocks, kv_heads * d_v, rng);
  for (Index b = 0; b < blocks; ++b) {
    cache.append(K.middleRows(b * block, block), Vv.middleRows(b * block, block));
  }
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(queries, heads * d, rng);
  const attn::Matrix<double> got = cache.attend(Q, variant);
  attn::AttentionOptions<double> causal;
  causal.causal = attn::Causal::BottomRight;
  const Index w = window ? *window : block * blocks;
  const auto want = [&](const attn::Tensor3<double>& Kt, const attn::Tensor3<double>& Vt) {
    return attn::merge_heads(attn::attention_heads(
        attn::split_heads(Q, heads), Kt, Vt, attn::both(variant, Streaming{w, pinned}), causal));
  };
  // The stored formats: the reference over the keys and values as the cache keeps them.
  attn::Tensor3<double> Kt = attn::split_heads(K, kv_heads), Vt = attn::split_heads(Vv, kv_heads);
  if (storage == attn::KVStorage::Float16) {
    Kt = Kt.cast<Eigen::half>().cast<double>();
    Vt = Vt.cast<Eigen::half>().cast<double>();
  }
  EXPECT_TRUE(attn_test::near(got, want(Kt, Vt), tolerance, tolerance)) << name;
}

TEST(VariantCache, TheCacheAttendsWithAVariantAtAbsolutePositions) {
  attn::T5Bias<double> t5(4, 8, 16, false);
  std::mt19937 rng(52);
  t5.table() = attn_test::random_matrix<double>(4, 8, rng);
  const attn::DocumentMask documents({0, 16, 38, 42}, true);
  const auto both = attn::both(documents, t5);
  for (const auto& [window, pinned] :
       {std::pair<std::optional<Index>, Index>{std::nullopt, 0}, {9, 0}, {9, 3}}) {
    const std::string tag = window ? ", window 9, " + std::to_string(pinned) + " pinned" : "";
    for (const Index queries : {Index(7), Index(1)}) {  // 1: the decoding kernel
      const std::string what = tag + ", " + std::to_string(queries) + " queries";
      expect_cache_matches_heads(PerHead{}, window, pinned, attn::KVStorage::Same, queries, 1e-12,
                                 "per-head" + what);
      expect_cache_matches_heads(both, window, pinned, attn::KVStorage::Same, queries, 1e-12,
                                 "documents and T5" + what);
      expect_cache_matches_heads(both, window, pinned, attn::KVStorage::Float16, queries, 1e-12,
                                 "documents and T5 in float16" + what);
    }
  }
}

TEST(VariantCache, TheCheckingModeNamesAWrongTile) {
  attn::KVCache<double> cache(8, 8);
  std::mt19937 rng(53);
  cache.append(attn_test::random_matrix<double>(40, 8, rng),
               attn_test::random_matrix<double>(40, 8, rng));
  const attn::Matrix<double> Q = attn_test::random_matrix<double>(3, 8, rng);
  EXPECT_NO_THROW(cache.attend(Q, OddKeysCalledFull{}));  // unchecked: the claim is believed
  EXPECT_THROW(cache.attend(Q, attn::checked(OddKeysCalledFull{})), attn::shape_error);
}

// ---------------------------------------------------------------------------------------------
// The layer with a variant: every (batch item, head) sees its item, head and key/value head.

/// Query i of batch item b sees the keys up to i + 2 b; with `item` >= 0, as item `item` whatever
/// item calls it (the one-item reference).
struct ItemShift {
  Index item = -1;
  bool allowed(const ScoreAt& at) const {
    return at.key <= at.query + 2 * (item >= 0 ? item : at.batch);
  }
};

/// A layer of 16 wide, 4 heads over 2 key/value heads, with random projection biases.
attn::MultiHeadAttention<double> variant_layer(std::mt19937& rng) {
  attn::MultiHeadConfig config{16, 4};
  config.num_kv_heads = 2;
  attn::MultiHeadAttention<double> layer(config, 7);
  layer.b_Q = attn_test::random_matrix<double>(1, 16, rng);
  layer.b_K = attn_test::random_matrix<double>(1, 8, rng);
  layer.b_V = attn_test::random_matrix<double>(1, 8, rng);
  layer.b_O = attn_test::random_matrix<double>(1, 16, rng);
  return layer;
}

/// Rows [b n, (b + 1) n) of a flattened (batch, n, width) tensor.
attn::Matrix<double> item_of(const attn::Tensor3<double>& t, Index b) {
  return attn::detail::slice(t, b);
}

/// The layer's projections of item b, as heads: (Q, K, V) of (4 | 2, n, 4).
struct ItemHeads {
  attn::Tensor3<double> Q, K, V;
};
ItemHeads project_item(const attn::MultiHeadAttention<double>& layer,
                       const attn::Matrix<double>& x) {
  const auto project = [&](const attn::Matrix<double>& W, const attn::RowVector<double>& bias,
                           Index heads) {
    const attn::Matrix<double> p = (x * W).rowwise() + bias;
    return attn::split_heads(p, heads);
  };
  return {project(layer.W_Q, layer.b_Q, 4), project(layer.W_K, layer.b_K, 2),
          project(layer.W_V, layer.b_V, 2)};
}

TEST(VariantLayer, ForwardAndBackwardAreTheHeadsOfEachItem) {
  std::mt19937 rng(61);
  const attn::MultiHeadAttention<double> layer = variant_layer(rng);
  const Index batch = 2, n = 11;
  attn::Tensor3<double> x(batch, n, 16), dy(batch, n, 16);
  for (auto* t : {&x, &dy}) {
    for (Index i = 0; i < t->size(); ++i)
      t->data()[i] = attn_test::random_matrix<double>(1, 1, rng)(0, 0);
  }
  attn::MultiHeadOptions<double> options;
  options.softcap = 4.0;
  const auto variant = attn::both(ItemShift{}, PerHead{});
  const attn::MultiHeadResult<double> got = layer.forward(x, x, x, variant, options);
  const attn::MultiHeadGrads<double> grads = layer.backward(x, x, x, dy, variant, options);
  for (Index b = 0; b < batch; ++b) {
    const auto alone = attn::both(ItemShift{b}, PerHead{});
    const ItemHeads p = project_item(layer, item_of(x, b));
    const attn::Matrix<double> concat =
        attn::merge_heads(attn::attention_heads(p.Q, p.K, p.V, alone, options));
    const attn::Matrix<double> want = (concat * layer.W_O).rowwise() + layer.b_O;
    EXPECT_TRUE(attn_test::near(item_of(got.output, b), want, 1e-12, 1e-13)) << "item " << b;
    // Backward: dC = dY W_O^T, the heads' backward, then through the input projections.
    const attn::Matrix<double> dC = item_of(dy, b) * layer.W_O.transpose();
    const attn::HeadGrads<double> g =
        attn::attention_heads_backward(p.Q, p.K, p.V, attn::split_heads(dC, 4), alone, options);
    const attn::Matrix<double> dx = attn::merge_heads(g.dQ) * layer.W_Q.transpose() +
                                    attn::merge_heads(g.dK) * layer.W_K.transpose() +
                                    attn::merge_heads(g.dV) * layer.W_V.transpose();
    const attn::Matrix<double> got_dx =
        item_of(grads.d_query, b) + item_of(grads.d_key, b) + item_of(grads.d_value, b);
    EXPECT_TRUE(attn_test::near(got_dx, dx, 1e-11, 1e-12)) << "dL/dx of item " << b;
  }
  // The single-sequence form is item 0.
  EXPECT_TRUE(attn_test::near(layer.forward(item_of(x, 0), variant, options),
                              item_of(got.output, 0), 1e-13, 1e-14));
  // Weights are not computed with a variant: refused, not left empty.
  options.need_weights = true;
  EXPECT_THROW(layer.forward(x, x, x, variant, options), attn::shape_error);
  options.need_weights = false;
  EXPECT_THROW(layer.forward(x, x, x, attn::checked(OddKeysCalledFull{}), options),
               attn::shape_error);
}

TEST(VariantLayer, ALearnedTablesGradientSumsTheItemsAndHeads) {
  std::mt19937 rng(62);
  const attn::MultiHeadAttention<double> layer = variant_layer(rng);
  const Index batch = 2, n = 20;
  attn::Tensor3<double> x(batch, n, 16), dy(batch, n, 16);
  for (auto* t : {&x, &dy}) {
    for (Index i = 0; i < t->size(); ++i)
      t->data()[i] = attn_test::random_matrix<double>(1, 1, rng)(0, 0);
  }
  attn::T5Bias<double> t5(4, 8, 16, true);
  t5.table() = attn_test::random_matrix<double>(4, 8, rng);
  const auto variant = attn::both(attn::DocumentMask({0, 8, 20}, true), t5);
  attn::MultiHeadWorkspace<double> workspace;
  attn::MultiHeadGrads<double> grads;
  attn::Matrix<double> dtable;
  layer.backward(x, x, x, dy, variant, {}, workspace, grads, dtable);
  attn::Matrix<double> want = attn::Matrix<double>::Zero(4, 8);
  for (Index b = 0; b < batch; ++b) {
    const ItemHeads p = project_item(layer, item_of(x, b));
    const attn::Matrix<double> dC = item_of(dy, b) * layer.W_O.transpose();
    attn::HeadGrads<double> g;
    attn::Matrix<double> d;
    attn::attention_heads_backward(p.Q, p.K, p.V, attn::split_heads(dC, 4), variant, {}, {}, g, d);
    want += d;
  }
  EXPECT_TRUE(attn_test::near(dtable, want, 1e-12, 1e-13));
  // The same bits for 1 and 2 threads.
  const int threads = attn::num_threads();
  attn::Matrix<double> one;
  attn::set_num_threads(1);
  layer.backward(x, x, x, dy, variant, {}, workspace, grads, one);
  attn::set_num_threads(threads);
  EXPECT_TRUE(attn_test::identical(one, dtable));
}

TEST(VariantLayer, DecodingStepsEqualTheWholeSequence) {
  std::mt19937 rng(63);
  const attn::MultiHeadAttention<double> layer = variant_layer(rng);
  attn::T5Bias<double> t5(4, 8, 16, false);
  t5.table() = attn_test::random_matrix<double>(4, 8, rng);
  const auto variant = attn::both(attn::DocumentMask({0, 3, 9}, true), t5);
  const attn::Matrix<double> X = attn_test::random_matrix<double>(9, 16, rng);
  attn::MultiHeadOptions<double> causal;
  causal.causal = attn::Causal::BottomRight;
  const attn::Matrix<double> whole = layer.forward(X, variant, causal);
  attn::KVCacheConfig<double> config;
  config.d_k = 4;
  config.d_v = 4;
  config.kv_heads = 2;
  attn::KVCache<double> cache(config);
  const attn::Matrix<double> prefill = layer.forward_step(X.topRows(5), cache, variant);
  EXPECT_TRUE(attn_test::near(prefill, whole.topRows(5), 1e-12, 1e-13));
  for (Index i = 5; i < 9; ++i) {
    EXPECT_TRUE(attn_test::near(layer.forward_step(X.middleRows(i, 1), cache, variant),
                                whole.row(i), 1e-12, 1e-13))
        << "step " << i;
  }
}

}  // namespace variant_test

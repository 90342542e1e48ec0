/// kv_store.hpp: the storage part of the cache on its own, without attention: rows come back in
/// position order from the pinned and recent blocks, the ring keeps what the window needs and no
/// more, positions and memory bound, errors.

#include <gtest/gtest.h>

#include <attn/kv_store.hpp>
#include <optional>
#include <random>
#include <vector>

#include "test_support.hpp"

namespace {

using attn::Index;
using attn::KVStore;
using attn::KVStoreShape;

TEST(KVStore, KeepsEveryRowWithoutAWindow) {
  std::mt19937 rng(41);
  const attn::Matrix<float> K = attn_test::random_matrix<float>(37, 2 * 3, rng);
  const attn::Matrix<float> V = attn_test::random_matrix<float>(37, 2 * 4, rng);
  KVStore<float> store(KVStoreShape{3, 4, 2, std::nullopt, 5});
  EXPECT_EQ(store.shape().pinned_tokens, 0) << "nothing is dropped, so nothing is pinned";
  for (Index t = 0; t < 37; t += 6) {
    const Index r = std::min<Index>(6, 37 - t);
    store.append(K.middleRows(t, r), V.middleRows(t, r));
  }
  EXPECT_EQ(store.size(), 37);
  EXPECT_EQ(store.position(), 37);
  EXPECT_FALSE(store.dropped_any());
  for (Index h = 0; h < 2; ++h) {
    EXPECT_TRUE(attn_test::identical(store.keys(h), K.middleCols(h * 3, 3)));
    EXPECT_TRUE(attn_test::identical(store.recent_values(h), V.middleCols(h * 4, 4)));
  }
}

TEST(KVStore, RingAndPinnedRowsInPositionOrder) {
  std::mt19937 rng(42);
  const Index total = 500, w = 7, pinned = 3;
  const attn::Matrix<double> K = attn_test::random_matrix<double>(total, 4, rng);
  const attn::Matrix<double> V = attn_test::random_matrix<double>(total, 2, rng);
  KVStore<double> store(KVStoreShape{4, 2, 1, w, pinned});
  Index t = 0;
  Index largest = 0;
  for (Index step = 0; t < total; ++step) {
    const Index r = std::min<Index>(1 + step % 5, total - t);
    largest = std::max(largest, r);
    store.append(K.middleRows(t, r), V.middleRows(t, r));
    t += r;
    // The window of each of the last r rows is kept: positions t - r - w .. t - 1.
    ASSERT_LE(store.first_recent(), std::max<Index>(t - r - w, pinned)) << "at " << t;
    ASSERT_EQ(store.pinned_held(), std::min(t, pinned));
    const std::vector<Index> positions = store.positions();
    ASSERT_EQ(static_cast<Index>(positions.size()), store.size());
    const attn::Matrix<double> keys = store.keys(0);
    for (std::size_t k = 0; k < positions.size(); ++k) {
      const Index p = positions[k];
      ASSERT_TRUE(attn_test::identical(keys.row(static_cast<Index>(k)), K.row(p)))
          << "position " << p;
      if (k > 0) {
        ASSERT_GT(p, positions[k - 1]);
      }
    }
    ASSERT_TRUE(attn_test::identical(store.pinned_keys(0), K.topRows(store.pinned_held())));
    ASSERT_TRUE(attn_test::identical(store.recent_values(0),
                                     V.middleRows(store.first_recent(), store.recent_held())));
  }
  EXPECT_TRUE(store.dropped_any());
  EXPECT_LE(store.capacity(), pinned + 2 * (w + largest)) << "the memory bound";
  store.clear();
  EXPECT_EQ(store.size(), 0);
  EXPECT_EQ(store.position(), 0);
}

TEST(KVStore, Errors) {
  attn_test::expect_shape_error(
      [] {
        KVStore<float>(KVStoreShape{0, 2, 1, std::nullopt, 0});
      },
      {"KVStore", "d_k must be at least 1, got 0"});
  attn_test::expect_shape_error(
      [] {
        KVStore<float>(KVStoreShape{2, 2, 0, std::nullopt, 0});
      },
      {"kv_heads must be at least 1"});
  attn_test::expect_shape_error(
      [] {
        KVStore<float>(KVStoreShape{2, 2, 1, -1, 0});
      },
      {"window must be >= 0, got -1"});
  attn_test::expect_shape_error(
      [] {
        KVStore<float>(KVStoreShape{2, 2, 1, 3, -2});
      },
      {"pinned_tokens must be >= 0, got -2"});
  KVStore<float> store(KVStoreShape{2, 3, 2, std::nullopt, 0});
  attn_test::expect_shape_error(
      [&] { store.append(attn::Matrix<float>::Zero(1, 4), attn::Matrix<float>::Zero(1, 5)); },
      {"KVStore::append", "V_new is 1 x 5", "r x 6"});
  attn_test::expect_shape_error([&] { store.recent_keys(2); },
                                {"kv_head must be in 0 .. 1, got 2"});
}

}  // namespace

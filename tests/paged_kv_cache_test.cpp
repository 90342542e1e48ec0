/// paged_kv_cache.hpp: a sequence's kept rows against a `KVCache` fed the same rows (bits, every
/// storage format, RoPE), appends to many sequences in one call, fork and copy on write (the
/// parent's rows unchanged after the child appends), removal, window eviction with pinned tokens,
/// an exhausted pool leaving everything as it was, the exported page tables, bad input; and
/// `paged_attention` over a caller's own pool and page table (FlashInfer's CSR, vLLM's block table).

#include <gtest/gtest.h>

#include <algorithm>
#include <attn/kv_cache.hpp>
#include <attn/paged_kv_cache.hpp>
#include <attn/threads.hpp>
#include <attn/variant.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace paged_kv_cache_test {

using attn::Index;
using attn::Matrix;
using attn::PagedKVCache;
using attn::PagedKVCacheConfig;
using attn_test::expect_shape_error;
using attn_test::random_matrix;

constexpr Index kHeads = 2;
constexpr Index kDim = 8;

PagedKVCacheConfig<float> config(Index page_size, Index pages,
                                 attn::KVStorage storage = attn::KVStorage::Same) {
  PagedKVCacheConfig<float> c;
  c.d_k = c.d_v = kDim;
  c.kv_heads = kHeads;
  c.page_size = page_size;
  c.pages = pages;
  c.storage = storage;
  return c;
}

::testing::AssertionResult same_bits(const Matrix<float>& a, const Matrix<float>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) {
    return ::testing::AssertionFailure()
           << a.rows() << "x" << a.cols() << " vs " << b.rows() << "x" << b.cols();
  }
  if (a.size() && std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(a.size())) != 0) {
    return ::testing::AssertionFailure() << "the bits differ";
  }
  return ::testing::AssertionSuccess();
}

/// Rows of K and V for `rows` tokens.
struct Rows {
  Matrix<float> K, V;
  Rows(Index rows, std::mt19937& rng, Index dim = kDim)
      : K(random_matrix<float>(rows, kHeads * dim, rng)),
        V(random_matrix<float>(rows, kHeads * dim, rng)) {}
};

/// Every kept key and value of `id` against `cache`'s, bit for bit, and the positions.
void expect_same_rows(const PagedKVCache<float>& paged, PagedKVCache<float>::SequenceId id,
                      const attn::KVCache<float>& cache) {
  EXPECT_EQ(paged.key_positions(id), cache.key_positions());
  EXPECT_EQ(paged.length(id), cache.position());
  for (Index h = 0; h < kHeads; ++h) {
    EXPECT_TRUE(same_bits(paged.keys(id, h), cache.keys(h))) << "keys of head " << h;
    EXPECT_TRUE(same_bits(paged.values(id, h), cache.values(h))) << "values of head " << h;
  }
}

TEST(PagedKVCache, SequencesHoldWhatAKVCacheHolds) {
  for (const attn::KVStorage storage : {attn::KVStorage::Same, attn::KVStorage::Float16,
                                        attn::KVStorage::BFloat16, attn::KVStorage::Int8}) {
    PagedKVCacheConfig<float> c = config(4, 64, storage);
    c.rope = attn::RopeStyle::Half;
    PagedKVCache<float> paged(c);
    attn::KVCacheConfig<float> cc;
    cc.d_k = cc.d_v = kDim;
    cc.kv_heads = kHeads;
    cc.rope = attn::RopeStyle::Half;
    cc.storage = storage;
    std::vector<attn::KVCache<float>> caches(3, attn::KVCache<float>(cc));
    const std::vector<Index> ids{paged.add_sequence(), paged.add_sequence(), paged.add_sequence()};
    std::mt19937 rng(1);
    // Appends of 0 .. 6 rows, one sequence at a time and then several in one call.
    for (int step = 0; step < 12; ++step) {
      const std::vector<int> lengths{step % 7, (3 * step) % 5, step == 0 ? 9 : 1};
      const std::vector<int> offsets{0, lengths[0], lengths[0] + lengths[1],
                                     lengths[0] + lengths[1] + lengths[2]};
      const Rows x(offsets.back(), rng);
      if (step % 2 == 0) {
        paged.append(ids, offsets, x.K, x.V);
      } else {
        for (std::size_t b = 0; b < 3; ++b) {
          paged.append(ids[b], x.K.middleRows(offsets[b], lengths[b]),
                       x.V.middleRows(offsets[b], lengths[b]));
        }
      }
      for (std::size_t b = 0; b < 3; ++b) {
        caches[b].append(x.K.middleRows(offsets[b], lengths[b]),
                         x.V.middleRows(offsets[b], lengths[b]));
      }
    }
    Index pages = 0;
    for (std::size_t b = 0; b < 3; ++b) {
      SCOPED_TRACE(int(storage));
      expect_same_rows(paged, ids[b], caches[b]);
      pages += (paged.length(ids[b]) + 3) / 4;
      EXPECT_EQ(Index(paged.page_table(ids[b]).size()), (paged.length(ids[b]) + 3) / 4);
    }
    EXPECT_EQ(paged.pages_in_use(), pages);
    EXPECT_EQ(paged.bytes_in_use(), pages * paged.page_bytes());
    EXPECT_EQ(paged.page_bytes(),
              attn::KVCache<float>::bytes_for(cc, 4));  // a page: 4 tokens of every head
  }
}

TEST(PagedKVCache, AForkSharesPagesAndCopiesThePartialOneOnWrite) {
  PagedKVCache<float> paged(config(16, 8));
  std::mt19937 rng(2);
  const Index parent = paged.add_sequence();
  const Rows prompt(21, rng);  // one full page and 5 tokens of the next
  paged.append(parent, prompt.K, prompt.V);
  const Matrix<float> parent_keys = paged.keys(parent, 1);
  const Matrix<float> parent_values = paged.values(parent, 0);

  const Index child = paged.fork(parent);
  EXPECT_EQ(paged.page_table(child), paged.page_table(parent));
  EXPECT_EQ(paged.pages_in_use(), 2);
  for (const int page : paged.page_table(parent)) EXPECT_EQ(paged.references(page), 2);

  const Rows more(3, rng);
  paged.append(child, more.K, more.V);  // into the shared partial page: copied first
  EXPECT_EQ(paged.pages_in_use(), 3);
  EXPECT_EQ(paged.page_table(child)[0], paged.page_table(parent)[0]);  // the full page: shared
  EXPECT_NE(paged.page_table(child)[1], paged.page_table(parent)[1]);
  EXPECT_EQ(paged.references(paged.page_table(parent)[1]), 1);
  EXPECT_TRUE(same_bits(paged.keys(parent, 1), parent_keys));  // the parent's rows unchanged
  EXPECT_TRUE(same_bits(paged.values(parent, 0), parent_values));
  const Matrix<float> child_keys = paged.keys(child, 1);
  EXPECT_TRUE(same_bits(child_keys.topRows(21), parent_keys));
  EXPECT_TRUE(same_bits(child_keys.bottomRows(3), more.K.rightCols(kDim)));

  // The parent now holds its partial page alone: it appends in place.
  const Rows own(2, rng);
  paged.append(parent, own.K, own.V);
  EXPECT_EQ(paged.pages_in_use(), 3);
  EXPECT_TRUE(same_bits(paged.keys(parent, 1).topRows(21), parent_keys));
  EXPECT_TRUE(same_bits(paged.keys(child, 1), child_keys));

  // Removing the parent keeps the page the child shares; removing the child frees everything.
  paged.remove(parent);
  EXPECT_EQ(paged.pages_in_use(), 2);
  EXPECT_TRUE(same_bits(paged.keys(child, 1), child_keys));
  paged.remove(child);
  EXPECT_EQ(paged.pages_in_use(), 0);
  EXPECT_EQ(paged.free_pages(), 8);
}

TEST(PagedKVCache, ParentAndChildAppendingInOneCallCopyOnce) {
  // 3 pages: the shared partial page, and one copy of it for the first of the two that append.
  PagedKVCache<float> paged(config(4, 3));
  std::mt19937 rng(3);
  const Index parent = paged.add_sequence();
  const Rows prompt(6, rng);  // pages: one full, one with 2 tokens
  paged.append(parent, prompt.K, prompt.V);
  const Index child = paged.fork(parent);
  const Rows x(2, rng);
  paged.append({parent, child}, {0, 1, 2}, x.K, x.V);
  EXPECT_EQ(paged.pages_in_use(), 3);
  EXPECT_EQ(paged.length(parent), 7);
  EXPECT_EQ(paged.length(child), 7);
  EXPECT_TRUE(same_bits(paged.keys(parent, 0).bottomRows(1), x.K.topRows(1).leftCols(kDim)));
  EXPECT_TRUE(same_bits(paged.keys(child, 0).bottomRows(1), x.K.bottomRows(1).leftCols(kDim)));
}

TEST(PagedKVCache, AWindowReturnsThePagesNoQueryCanSeeAndKeepsThePinnedOnes) {
  PagedKVCacheConfig<float> c = config(4, 32);
  c.window = 10;
  c.pinned_tokens = 3;
  PagedKVCache<float> paged(c);
  std::mt19937 rng(4);
  const Index id = paged.add_sequence();
  const Index other = paged.add_sequence();  // without appends: its state must not move
  Index length = 0;
  for (const Index r : {5, 1, 7, 1, 1, 12, 1, 3, 1, 1}) {
    const Rows x(r, rng);
    paged.append(id, x.K, x.V);
    length += r;
    const Index oldest = std::max<Index>(length - r - 10, 0);  // what the new queries can see
    // Kept: page 0 (pinned), and every page holding a position >= oldest; nothing else.
    const std::vector<int>& table = paged.page_table(id);
    Index kept = 0;
    for (Index i = 0; i < Index(table.size()); ++i) {
      const bool needed = i == 0 || (i + 1) * 4 > oldest;
      EXPECT_EQ(table[std::size_t(i)] >= 0, needed) << "page " << i << " at length " << length;
      kept += needed;
    }
    EXPECT_EQ(paged.pages_in_use(), kept);
    const std::vector<Index> positions = paged.key_positions(id);
    for (Index p = 0; p < length; ++p) {
      const bool visible = p < 3 || p >= oldest;
      if (visible) {
        EXPECT_TRUE(std::find(positions.begin(), positions.end(), p) != positions.end()) << p;
      }
    }
  }
  EXPECT_EQ(paged.length(other), 0);
  expect_shape_error([&] { paged.csr({id}); }, {"PagedKVCache::csr", "window"});
}

TEST(PagedKVCache, AnExhaustedPoolLeavesEverySequenceAsItWas) {
  PagedKVCache<float> paged(config(4, 4));
  std::mt19937 rng(5);
  const Index a = paged.add_sequence();
  const Index b = paged.add_sequence();
  const Rows first(6, rng);
  paged.append(a, first.K, first.V);  // 2 pages
  const Rows one(1, rng);
  paged.append(b, one.K, one.V);  // 1 page: 1 left
  const Matrix<float> a_keys = paged.keys(a, 0);
  const std::vector<int> a_table = paged.page_table(a);
  // a needs 1 more page for 3 rows (6 + 3 = 9 > 8), b 1 for 4 more: 2 > 1 free.
  const Rows x(7, rng);
  expect_shape_error(
      [&] {
        paged.append({a, b}, {0, 3, 7}, x.K, x.V);
      },
      {"PagedKVCache::append", "needs 2 free pages", "has 1 of 4"});
  EXPECT_EQ(paged.length(a), 6);
  EXPECT_EQ(paged.length(b), 1);
  EXPECT_EQ(paged.page_table(a), a_table);
  EXPECT_EQ(paged.free_pages(), 1);
  EXPECT_TRUE(same_bits(paged.keys(a, 0), a_keys));
  // What fits still goes in.
  paged.append({a, b}, {0, 3, 5}, x.K.topRows(5), x.V.topRows(5));  // b: 3 tokens, 1 page
  EXPECT_EQ(paged.free_pages(), 0);
  // A fork takes no page until it writes into its shared partial page, which needs a copy.
  const Index c = paged.fork(b);
  expect_shape_error([&] { paged.append(c, one.K, one.V); }, {"needs 1 free pages"});
  EXPECT_EQ(paged.length(c), 3);
  EXPECT_EQ(paged.references(paged.page_table(b)[0]), 2);
}

TEST(PagedKVCache, ThePageTablesExportAsFlashInferAndVllmHaveThem) {
  PagedKVCache<float> paged(config(4, 16));
  std::mt19937 rng(6);
  const Index a = paged.add_sequence();
  const Index b = paged.add_sequence();
  const Index empty = paged.add_sequence();
  const Rows x(13, rng);
  paged.append({a, b}, {0, 9, 13}, x.K, x.V);  // a: 9 tokens (3 pages), b: 4 (1 page)
  const attn::CsrPageTable csr = paged.csr({a, b, empty});
  EXPECT_EQ(csr.indptr, (std::vector<int>{0, 3, 4, 4}));
  std::vector<int> indices = paged.page_table(a);
  indices.push_back(paged.page_table(b)[0]);
  EXPECT_EQ(csr.indices, indices);
  EXPECT_EQ(csr.last_page_len, (std::vector<int>{1, 4, 0}));

  const attn::BlockTable vllm = paged.block_table({a, b});
  EXPECT_EQ(vllm.block_tables.rows(), 2);
  EXPECT_EQ(vllm.block_tables.cols(), 3);
  EXPECT_EQ(vllm.block_tables(1, 0), paged.page_table(b)[0]);
  EXPECT_EQ(vllm.block_tables(1, 1), -1);
  EXPECT_EQ(vllm.seq_lens, (std::vector<int>{9, 4}));

  // Slot s of the pool is (page s / 4, offset s % 4): the slots of a's tokens are where its rows
  // are, in the order of its page table.
  const std::vector<Index> slots = paged.slot_mapping(a, 0, 9);
  for (Index p = 0; p < 9; ++p) {
    EXPECT_EQ(slots[std::size_t(p)] / 4, paged.page_table(a)[std::size_t(p / 4)]);
    EXPECT_EQ(slots[std::size_t(p)] % 4, p % 4);
  }
  expect_shape_error([&] { paged.slot_mapping(a, 5, 5); }, {"slot_mapping", "positions 5 .. 9"});
}

TEST(PagedKVCache, BadInputIsAShapeErrorAndChangesNothing) {
  expect_shape_error([] { PagedKVCache<float> p(config(0, 4)); }, {"PagedKVCache", "page_size"});
  expect_shape_error([] { PagedKVCache<float> p(config(4, 0)); }, {"PagedKVCache", "pages"});
  PagedKVCache<float> paged(config(4, 8));
  std::mt19937 rng(7);
  const Index a = paged.add_sequence();
  const Rows x(4, rng);
  expect_shape_error([&] { paged.append(a + 5, x.K, x.V); },
                     {"PagedKVCache::append", "no sequence 5"});
  const Index gone = paged.add_sequence();
  paged.remove(gone);
  expect_shape_error([&] { paged.append(gone, x.K, x.V); }, {"sequence 1 was removed"});
  expect_shape_error([&] { paged.fork(gone); }, {"PagedKVCache::fork", "was removed"});
  expect_shape_error([&] { paged.append({a, a}, {0, 2, 4}, x.K, x.V); }, {"listed twice"});
  expect_shape_error([&] { paged.append({a}, {0, 3}, x.K, x.V); }, {"cu_seqlens ends at 3"});
  expect_shape_error([&] { paged.append({a}, {1, 4}, x.K, x.V); }, {"cu_seqlens[0] is 1"});
  expect_shape_error([&] { paged.append(a, x.K, x.V.leftCols(4)); }, {"V_new is 4 x 4"});
  expect_shape_error([&] { paged.references(8); }, {"page 8 is not in the pool"});
  expect_shape_error([&] { paged.keys(a, 2); }, {"kv_head must be in 0 .. 1"});
  EXPECT_EQ(paged.length(a), 0);
  EXPECT_EQ(paged.pages_in_use(), 0);
}

/// The configuration of the attention tests: d = 32, so that the decoding kernel takes its
/// vectorised tiles (and, with bfloat16 or int8 keys, the reduced arithmetic could).
PagedKVCacheConfig<float> wide(Index page_size, Index pages, attn::KVStorage storage) {
  PagedKVCacheConfig<float> c = config(page_size, pages, storage);
  c.d_k = c.d_v = 32;
  return c;
}

/// Sequences in a paged cache and, beside each, a `KVCache` of the same configuration fed the same
/// rows: `attend` must give each sequence's rows the bits of its `KVCache::attend`.
struct Twins {
  PagedKVCache<float> paged;
  attn::KVCacheConfig<float> config;
  std::vector<Index> ids;
  std::vector<attn::KVCache<float>> caches;
  std::mt19937 rng{11};
  Index query_heads = 4;
  Twins(const PagedKVCacheConfig<float>& c, std::size_t count)
      : paged(c), config(static_cast<const attn::KVCacheConfig<float>&>(c)) {
    for (std::size_t b = 0; b < count; ++b) {
      ids.push_back(paged.add_sequence());
      caches.emplace_back(config);
    }
  }
  /// Appends `lengths[b]` new rows to sequence b, all in one call.
  void append(const std::vector<int>& lengths) {
    std::vector<int> offsets{0};
    for (const int n : lengths) offsets.push_back(offsets.back() + n);
    const Rows x(offsets.back(), rng, config.d_k);
    paged.append(ids, offsets, x.K, x.V);
    for (std::size_t b = 0; b < ids.size(); ++b) {
      caches[b].append(x.K.middleRows(offsets[b], lengths[b]),
                       x.V.middleRows(offsets[b], lengths[b]));
    }
  }
  /// `n[b]` queries of sequence b in one `attend`, against each cache's own.
  void expect_attend(const std::vector<int>& n, const attn::AttentionOptions<float>& options = {}) {
    std::vector<int> offsets{0};
    for (const int k : n) offsets.push_back(offsets.back() + k);
    const Matrix<float> Q = random_matrix<float>(offsets.back(), query_heads * config.d_k, rng);
    const Matrix<float> out = paged.attend(ids, offsets, Q, options);
    for (std::size_t b = 0; b < ids.size(); ++b) {
      const Matrix<float> alone = caches[b].attend(Q.middleRows(offsets[b], n[b]), options);
      EXPECT_TRUE(same_bits(out.middleRows(offsets[b], n[b]), alone))
          << "sequence " << b << ", " << n[b] << " queries over " << caches[b].size() << " keys";
    }
  }
};

TEST(PagedAttention, EachSequenceHasTheBitsOfItsOwnKVCache) {
  for (const attn::KVStorage storage : {attn::KVStorage::Same, attn::KVStorage::Float16,
                                        attn::KVStorage::BFloat16, attn::KVStorage::Int8}) {
    SCOPED_TRACE(int(storage));
    PagedKVCacheConfig<float> c = wide(16, 512, storage);
    c.rope = attn::RopeStyle::Interleaved;
    Twins x(c, 5);
    // Prompts of 1 .. 2500 tokens (the longest splits the decoding step into parts), appended
    // together so that the sequences' pages interleave in the pool.
    x.append({1, 37, 300, 2500, 70});
    x.expect_attend({1, 1, 1, 1, 1});       // a decoding step
    x.expect_attend({1, 20, 300, 64, 33});  // prefill chunks over what is there
    x.append({3, 1, 40, 1, 9});
    x.expect_attend({3, 1, 40, 1, 9});
    attn::AttentionOptions<float> options;
    options.softcap = 30.0f;
    options.alibi_slope = 0.25f;
    options.sink = 0.5f;
    x.expect_attend({2, 1, 1, 1, 5}, options);
  }
}

TEST(PagedAttention, WindowsAndPinnedTokensAsKVCacheHasThem) {
  for (const attn::KVStorage storage : {attn::KVStorage::Same, attn::KVStorage::Int8}) {
    SCOPED_TRACE(int(storage));
    PagedKVCacheConfig<float> c = wide(16, 256, storage);
    c.window = 100;
    c.pinned_tokens = 4;
    Twins x(c, 3);
    for (const int step : {0, 1, 2, 3, 4, 5}) {
      const std::vector<int> lengths{step == 0 ? 300 : 1, 40 + step, step == 2 ? 200 : 7};
      x.append(lengths);
      x.expect_attend({1, 1, 1});
      x.expect_attend(lengths);
    }
  }
}

// Four query heads per key/value head take the decoding kernel's 4 x 4 score blocks and, with the
// reduced arithmetic, its bfloat16 and int8 instructions, where the CPU has them. Pages of 6 rows
// and a window that starts the recent block mid-page put page breaks inside the 4-key blocks (the
// tiles read through their rows' addresses); pages of 128 rows hold whole tiles (read through a
// stride) beside tiles across two pages.
TEST(PagedAttention, BlocksAcrossPageBreaksKeepTheBits) {
  for (const attn::KVStorage storage : {attn::KVStorage::Same, attn::KVStorage::Float16,
                                        attn::KVStorage::BFloat16, attn::KVStorage::Int8}) {
    for (const auto& [page_size, arithmetic] : {std::pair{6, attn::StoredArithmetic::Widened},
                                                std::pair{6, attn::StoredArithmetic::Reduced},
                                                std::pair{128, attn::StoredArithmetic::Widened},
                                                std::pair{128, attn::StoredArithmetic::Reduced}}) {
      SCOPED_TRACE(std::to_string(int(storage)) + " " + std::to_string(page_size) + " " +
                   std::to_string(int(arithmetic)));
      PagedKVCacheConfig<float> c = wide(page_size, 1024 * 6 / page_size, storage);
      c.window = 141;
      c.pinned_tokens = 3;
      Twins x(c, 3);
      x.query_heads = 8;
      attn::AttentionOptions<float> options;
      options.stored_arithmetic = arithmetic;
      x.append({700, 9, 130});
      x.expect_attend({1, 1, 1}, options);
      for (int step = 0; step < 3; ++step) {
        x.append({1, 1, 1});
        x.expect_attend({1, 1, 1}, options);
      }
    }
  }
}

// Speculative decoding: a tree of draft tokens appended after the prompt and verified in one call
// with a TreeMask gives each draft what attending it token by token gives (a cache holding the
// prompt and the draft's ancestors, the draft last), within rounding (the masked keys change the
// tiles, not the sum: float, 1e-5); and the bits of KVCache::attend with the same tree.
TEST(PagedAttention, ATreeOfDraftsEqualsTheDraftsAttendedOneByOne) {
  for (const attn::KVStorage storage : {attn::KVStorage::Same, attn::KVStorage::Float16}) {
    SCOPED_TRACE(int(storage));
    const PagedKVCacheConfig<float> c = wide(16, 64, storage);
    Twins x(c, 1);
    x.query_heads = 8;
    const Index prompt = 150;
    const std::vector<Index> parents{-1, 0, 0, 1, 1, 2, -1, 6};
    const auto drafts = static_cast<int>(parents.size());
    const Rows prompt_rows(prompt, x.rng, c.d_k);
    const Rows draft_rows(drafts, x.rng, c.d_k);
    Matrix<float> K(prompt + drafts, kHeads * c.d_k), V(K.rows(), K.cols());
    K << prompt_rows.K, draft_rows.K;
    V << prompt_rows.V, draft_rows.V;
    x.paged.append(x.ids[0], K, V);
    x.caches[0].append(K, V);
    const attn::TreeMask tree(prompt, parents);
    const Matrix<float> Q = random_matrix<float>(drafts, 8 * c.d_k, x.rng);
    const Matrix<float> out = x.paged.attend(x.ids, {0, drafts}, Q, tree);
    EXPECT_TRUE(same_bits(out, x.caches[0].attend(Q, tree)));
    for (Index i = 0; i < drafts; ++i) {
      std::vector<Index> path;  // the draft's ancestors, root first, then the draft
      for (Index a = i; a >= 0; a = parents[std::size_t(a)]) path.insert(path.begin(), a);
      attn::KVCache<float> alone(x.config);
      alone.append(prompt_rows.K, prompt_rows.V);
      for (const Index a : path) alone.append(draft_rows.K.row(a), draft_rows.V.row(a));
      const Matrix<float> expected = alone.attend(Q.row(i));
      EXPECT_LT((out.row(i) - expected).cwiseAbs().maxCoeff(), 1e-5f) << "draft " << i;
    }
  }
  expect_shape_error([] { attn::TreeMask(4, {-1, 2, 0}); }, {"TreeMask", "parents[1] = 2"});
}

// Forked sequences share their prompt's pages: a decoding step of all of them reads the shared
// pages once (cascade) and merges each one's own pages by log-sum-exp. Against each sequence alone
// (a KVCache, and the same cache with cascade off, which has its bits) the results differ by the
// rounding of the merge only: at most 2 float ulps of the largest |V| entry (2^-22 max |V|; the
// largest seen in these cases is printed).
TEST(PagedAttention, SharedPrefixesAttendedOnceAgreeWithEachSequenceAlone) {
  for (const attn::KVStorage storage : {attn::KVStorage::Same, attn::KVStorage::BFloat16}) {
    for (const bool rope : {false, true}) {
      SCOPED_TRACE(std::to_string(int(storage)) + (rope ? " RoPE" : ""));
      PagedKVCacheConfig<float> c = wide(16, 512, storage);
      if (rope) c.rope = attn::RopeStyle::Half;
      PagedKVCacheConfig<float> off = c;
      off.cascade = false;
      PagedKVCache<float> paged(c), plain(off);
      std::mt19937 rng(21);
      const Rows prompt(2100, rng, c.d_k);
      attn::KVCache<float> prompt_cache(static_cast<const attn::KVCacheConfig<float>&>(c));
      prompt_cache.append(prompt.K, prompt.V);
      const Index parent = paged.add_sequence();
      paged.append(parent, prompt.K, prompt.V);
      plain.append(plain.add_sequence(), prompt.K, prompt.V);
      std::vector<Index> ids{parent}, plain_ids{0};
      std::vector<attn::KVCache<float>> caches{prompt_cache};
      std::vector<int> cu{0, 1};
      for (int child = 0; child < 6; ++child) {
        ids.push_back(paged.fork(parent));
        plain_ids.push_back(plain.fork(0));
        caches.push_back(prompt_cache);
        cu.push_back(cu.back() + 1);
      }
      float worst = 0.0f, largest_v = prompt.V.cwiseAbs().maxCoeff();
      for (int step = 0; step < 3; ++step) {
        std::vector<int> own{0};
        for (std::size_t b = 0; b < ids.size(); ++b) own.push_back(own.back() + 1 + int(b) * step);
        const Rows x(own.back(), rng, c.d_k);
        paged.append(ids, own, x.K, x.V);
        plain.append(plain_ids, own, x.K, x.V);
        for (std::size_t b = 0; b < ids.size(); ++b) {
          caches[b].append(x.K.middleRows(own[b], own[b + 1] - own[b]),
                           x.V.middleRows(own[b], own[b + 1] - own[b]));
        }
        largest_v = std::max(largest_v, x.V.cwiseAbs().maxCoeff());
        const Matrix<float> Q = random_matrix<float>(Index(ids.size()), 8 * c.d_k, rng);
        const Matrix<float> cascaded = paged.attend(ids, cu, Q);
        const Matrix<float> each = plain.attend(plain_ids, cu, Q);
        for (std::size_t b = 0; b < ids.size(); ++b) {
          EXPECT_TRUE(same_bits(each.row(Index(b)), caches[b].attend(Q.row(Index(b)))));
        }
        worst = std::max(worst, (cascaded - each).cwiseAbs().maxCoeff());
      }
      EXPECT_LE(worst, std::ldexp(largest_v, -22));
      std::printf("cascade against each alone: %.3g of max |V| (bound 2^-22 = %.3g)\n",
                  double(worst / largest_v), std::ldexp(1.0, -22));
    }
  }
}

TEST(PagedAttention, TheBitsDoNotDependOnTheThreadCount) {
  PagedKVCacheConfig<float> c = wide(16, 512, attn::KVStorage::Float16);
  Twins x(c, 4);
  x.append({3000, 5, 700, 64});
  const Matrix<float> Q = random_matrix<float>(4, 4 * 32, x.rng);
  attn::set_num_threads(1);
  const Matrix<float> one = x.paged.attend(x.ids, {0, 1, 2, 3, 4}, Q);
  attn::set_num_threads(2);
  const Matrix<float> two = x.paged.attend(x.ids, {0, 1, 2, 3, 4}, Q);
  attn::set_num_threads(0);
  EXPECT_TRUE(same_bits(one, two));
}

TEST(PagedAttention, BadCallsAreShapeErrors) {
  PagedKVCache<float> paged(config(4, 8));
  std::mt19937 rng(12);
  const Index a = paged.add_sequence();
  const Rows x(3, rng);
  paged.append(a, x.K, x.V);
  const Matrix<float> Q = random_matrix<float>(4, 4 * kDim, rng);
  expect_shape_error(
      [&] {
        paged.attend({a}, {0, 4}, Q);
      },
      {"PagedKVCache::attend (sequence 0)", "4 queries", "seen only 3 positions"});
  expect_shape_error([&] { paged.attend({a + 1}, {0, 4}, Q); }, {"no sequence 1"});
  expect_shape_error(
      [&] {
        paged.attend({a}, {0, 3}, Q);
      },
      {"cu_seqlens_q ends at 3", "4 rows of Q"});
  expect_shape_error(
      [&] {
        paged.attend({a}, {0, 1}, Q.topRows(1).leftCols(12));
      },
      {"Q has 12 columns"});
  std::vector<attn::AttentionOptions<float>> two(2);
  expect_shape_error(
      [&] {
        paged.attend({a}, {0, 1}, Q.topRows(1), two);
      },
      {"per-sequence options have 2 entries"});
}

/// A caller's pool in vLLM's layout holding sequences of random rows in shuffled pages, and beside
/// each sequence a `KVCache` in the matching format fed the same rows.
template <class E>
struct CallerPool {
  static constexpr Index kv_heads = 2, d = 32, page_size = 16, pages = 40;
  std::vector<E> keys, values;
  attn::CsrPageTable table;
  std::vector<attn::KVCache<float>> caches;
  std::mt19937 rng{5};
  explicit CallerPool(const std::vector<Index>& lengths)
      : keys(std::size_t(pages * kv_heads * page_size * d)), values(keys.size()) {
    std::vector<int> free(pages);
    for (int p = 0; p < pages; ++p) free[std::size_t(p)] = p;
    std::shuffle(free.begin(), free.end(), rng);
    attn::KVCacheConfig<float> c;
    c.d_k = c.d_v = d;
    c.kv_heads = kv_heads;
    c.storage = std::is_same_v<E, float>         ? attn::KVStorage::Same
                : std::is_same_v<E, Eigen::half> ? attn::KVStorage::Float16
                                                 : attn::KVStorage::BFloat16;
    table.indptr.push_back(0);
    for (const Index length : lengths) {
      const Rows x(length, rng, d);
      caches.emplace_back(c);
      caches.back().append(x.K, x.V);
      for (Index p = 0; p < length; ++p) {
        if (p % page_size == 0) table.indices.push_back(free[table.indices.size()]);
        const Index page = table.indices.back();
        for (Index h = 0; h < kv_heads; ++h) {
          for (Index i = 0; i < d; ++i) {
            const auto at =
                std::size_t(((page * kv_heads + h) * page_size + p % page_size) * d + i);
            keys[at] = E(x.K(p, h * d + i));
            values[at] = E(x.V(p, h * d + i));
          }
        }
      }
      table.indptr.push_back(int(table.indices.size()));
      table.last_page_len.push_back(length == 0 ? 0 : int((length - 1) % page_size + 1));
    }
  }
  attn::PagePool<E> pool() const {
    attn::PagePool<E> p;
    p.keys = keys.data();
    p.values = values.data();
    p.pages = pages;
    p.kv_heads = kv_heads;
    p.page_size = page_size;
    p.d_k = p.d_v = d;
    return p;
  }
};

template <class E>
void expect_caller_pool_bits() {
  CallerPool<E> x({300, 1, 0, 45});
  const std::vector<int> cu{0, 1, 2, 2, 7};
  const Matrix<float> Q = random_matrix<float>(7, 4 * CallerPool<E>::d, x.rng);
  attn::AttentionOptions<float> options;
  options.softcap = 20.0f;
  const Matrix<float> out = attn::paged_attention(x.pool(), x.table, cu, Q, options);
  for (std::size_t b = 0; b < x.caches.size(); ++b) {
    const Index n = cu[b + 1] - cu[b];
    if (n == 0) continue;
    EXPECT_TRUE(
        same_bits(out.middleRows(cu[b], n), x.caches[b].attend(Q.middleRows(cu[b], n), options)))
        << "sequence " << b;
  }
  // vLLM's block table of the same pages gives the same bits.
  attn::BlockTable blocks;
  blocks.block_tables.setConstant(4, 19, -1);
  for (Index b = 0; b < 4; ++b) {
    const int first = x.table.indptr[std::size_t(b)];
    for (int i = first; i < x.table.indptr[std::size_t(b) + 1]; ++i) {
      blocks.block_tables(b, i - first) = x.table.indices[std::size_t(i)];
    }
  }
  blocks.seq_lens = {300, 1, 0, 45};
  EXPECT_TRUE(same_bits(attn::paged_attention(x.pool(), blocks, cu, Q, options), out));
}

TEST(CallerPagedAttention, EachSequenceHasTheBitsOfItsOwnKVCache) {
  expect_caller_pool_bits<float>();
  expect_caller_pool_bits<Eigen::half>();
  expect_caller_pool_bits<Eigen::bfloat16>();
}

TEST(CallerPagedAttention, BadTablesAreShapeErrors) {
  CallerPool<float> x({20, 3});
  const Matrix<float> Q = random_matrix<float>(2, 4 * CallerPool<float>::d, x.rng);
  const Matrix<float> Q5 = random_matrix<float>(5, 4 * CallerPool<float>::d, x.rng);
  const std::vector<int> cu{0, 1, 2};
  attn::CsrPageTable table = x.table;
  table.indices[1] = 40;
  expect_shape_error([&] { attn::paged_attention(x.pool(), table, cu, Q); },
                     {"paged_attention", "indices[1] = 40", "outside the pool (0 .. 39)"});
  table = x.table;
  table.last_page_len[0] = 17;
  expect_shape_error([&] { attn::paged_attention(x.pool(), table, cu, Q); },
                     {"last_page_len[0] = 17"});
  table = x.table;
  table.indptr = {0, 2, 4};
  expect_shape_error([&] { attn::paged_attention(x.pool(), table, cu, Q); },
                     {"indptr ends at 4", "3 page indices"});
  expect_shape_error(
      [&] {
        attn::paged_attention(x.pool(), x.table, {0, 1, 3}, Q);
      },
      {"cu_seqlens_q ends at 3"});
  expect_shape_error(
      [&] {
        attn::paged_attention(x.pool(), x.table, {0, 1, 5}, Q5);
      },
      {"paged_attention (sequence 1)", "4 queries", "seen only 3 positions"});
  attn::BlockTable blocks;
  blocks.block_tables.setConstant(2, 1, 0);
  blocks.seq_lens = {20, 3};
  expect_shape_error([&] { attn::paged_attention(x.pool(), blocks, cu, Q); },
                     {"seq_lens[0] = 20 needs 2 pages", "block_tables has 1 columns"});
  attn::PagePool<float> empty = x.pool();
  empty.page_size = 0;
  expect_shape_error([&] { attn::paged_attention(empty, x.table, cu, Q); }, {"pool.page_size"});
}

}  // namespace paged_kv_cache_test

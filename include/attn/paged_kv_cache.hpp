#pragma once
/// \file paged_kv_cache.hpp
/// `PagedKVCache`: the keys and values of many sequences in one pool of fixed-size pages (vLLM's
/// PagedAttention, Kwon et al. 2023; FlashInfer's page table), so that no sequence reserves more
/// than its last page, sequences forked from one another share their pages (copy on write), and a
/// sliding window returns the pages that fall out of it. The storage part: attention over it is
/// computed by the callers of its pages.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <unordered_map>
#include <vector>

#include "detail/checked.hpp"
#include "detail/paged_rows.hpp"
#include "detail/stored.hpp"
#include "error.hpp"
#include "kv_cache.hpp"
#include "rope.hpp"
#include "types.hpp"
#include "varlen.hpp"

namespace attn {

/// The shape and behaviour of a `PagedKVCache`: a `KVCacheConfig` (widths, key/value heads,
/// window, pinned tokens, RoPE, storage format, with the same meanings) and the pool's pages.
/// With a window, pages that no future query can see return to the pool.
template <class T>
struct PagedKVCacheConfig : KVCacheConfig<T> {
  Index page_size = 16;  ///< tokens per page, >= 1
  Index pages = 0;       ///< pages in the pool, >= 1: the capacity, fixed at construction
  /// Decoding steps of sequences that share their first pages (by `fork`) read those pages once
  /// for all of them and merge with each one's own pages (cascade), where it pays; their results
  /// then differ from one sequence alone in the last bits. False: every sequence alone, always the
  /// bits of `KVCache::attend`.
  bool cascade = true;
};

/// A page table in FlashInfer's CSR form: sequence b's pages are the entries of `indices` from
/// `indptr[b]` up to (not including) `indptr[b + 1]`, in position order, and its last page holds
/// `last_page_len[b]` tokens (1 to page_size; 0 for a sequence without pages).
struct CsrPageTable {
  std::vector<int> indptr;         ///< batch + 1 offsets into `indices`
  std::vector<int> indices;        ///< physical page numbers
  std::vector<int> last_page_len;  ///< tokens in each sequence's last page
};

/// A page table in vLLM's form: row b of `block_tables` lists sequence b's pages in position order
/// (padded with -1 to the longest), `seq_lens[b]` its tokens. Token p of sequence b is in slot
/// `block_tables(b, p / page_size) * page_size + p % page_size` of the pool.
struct BlockTable {
  /// batch x (the most pages of a sequence): page numbers, -1 past a sequence's last page
  Eigen::Matrix<int, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> block_tables;
  std::vector<int> seq_lens;  ///< tokens per sequence
};

/// A caller's pool of pages in vLLM's layout `[pages, kv_heads, page_size, d]`: page p's rows of
/// key/value head h are rows `(p kv_heads + h) page_size` on, each of d_k (keys) or d_v (values)
/// contiguous elements of E: the scalar type T, `Eigen::half` or `Eigen::bfloat16` (vLLM's and
/// FlashInfer's 16-bit caches). The pool is read, never written; it must outlive the call.
template <class E>
struct PagePool {
  const E* keys = nullptr;    ///< pages x kv_heads x page_size x d_k elements
  const E* values = nullptr;  ///< pages x kv_heads x page_size x d_v elements
  Index pages = 0;            ///< pages in the pool, >= 1
  Index kv_heads = 1;         ///< key/value heads, >= 1
  Index page_size = 16;       ///< tokens per page, >= 1
  Index d_k = 0;              ///< width of a key head, >= 1
  Index d_v = 0;              ///< width of a value head, >= 1
};

namespace detail {

/// A pool of pages as the kernels read it: keys and values stored by `Codec` (int8 rows with one
/// scale each), `kv_heads` blocks of `page_size` rows per page.
template <class Codec, class T>
struct PoolView {
  const typename Codec::Bits* keys;
  const T* key_scales;
  const typename Codec::Bits* values;
  const T* value_scales;
  Index page_size, kv_heads, d_k, d_v;

  /// Rows [first, first + count) of key/value head `head` of the sequence whose pages are `pages`.
  PagedRows<Codec, T> key_rows(const int* pages, Index head, Index first, Index count) const {
    return {keys, key_scales, pages, page_size, kv_heads, head, first, count, d_k};
  }
  PagedRows<Codec, T> value_rows(const int* pages, Index head, Index first, Index count) const {
    return {values, value_scales, pages, page_size, kv_heads, head, first, count, d_v};
  }
};

/// One sequence of a paged attention call: its place in the batch, its queries (rows [q0, q0 + n)
/// of the packed Q), its page table, its kept keys and its checked rule.
template <class T>
struct PagedPlan {
  Index batch, q0, n;
  const int* pages;
  KeptBlocks kept;
  ScoreRule<T> rule;
};

/// The sequences of a paged attention call, each as `KVCache::attend` attends a cache holding its
/// tokens (`attend_kept`), in parallel, longest first (each runs its heads on the thread that
/// takes it). With `rope`, each sequence's queries are rotated for their positions first. With a
/// variant (not null), sequence b's is bound to batch item b (`ScoreAt::batch`).
template <class T, class Codec, class Variant>
void attend_paged(const PoolView<Codec, T>& pool, const std::vector<PagedPlan<T>>& plans,
                  const Variant* variant, const ConstRef<T>& Q, Index heads,
                  const HeadOptions<T>& per_head, const std::optional<RopeStyle>& rope,
                  const RopeTable& rope_table, Matrix<T>& out) {
  std::vector<std::size_t> order(plans.size());
  for (std::size_t b = 0; b < order.size(); ++b) order[b] = b;
  const auto cost = [&](std::size_t b) {
    return double(plans[b].n) * double(plans[b].kept.pinned + plans[b].kept.recent);
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t c) { return cost(a) > cost(c); });
  parallel_for<Matrix<T>>(static_cast<Index>(order.size()), [&](Index t, Matrix<T>& rotated) {
    const PagedPlan<T>& plan = plans[order[static_cast<std::size_t>(t)]];
    if (plan.n == 0) return;
    if (rope) {
      rotated = Q.middleRows(plan.q0, plan.n);
      rope_kernel<T>(rotated, pool.d_k, plan.rule.q_position, *rope, rope_table);
    }
    const ConstRef<T> q = rope ? ConstRef<T>(rotated) : ConstRef<T>(Q.middleRows(plan.q0, plan.n));
    const KeptBlocks& kept = plan.kept;
    if constexpr (std::is_same_v<Variant, NoVariant>) {
      const auto keys = [&](Index first, Index count) {
        return [&pool, &plan, first, count](Index kv) {
          return pool.key_rows(plan.pages, kv, first, count);
        };
      };
      const auto values = [&](Index first, Index count) {
        return [&pool, &plan, first, count](Index kv) {
          return pool.value_rows(plan.pages, kv, first, count);
        };
      };
      attend_kept<T>(q, heads, heads / pool.kv_heads, variant, plan.batch, plan.rule, per_head,
                     kept, keys(0, kept.pinned), values(0, kept.pinned),
                     keys(kept.first_recent, kept.recent), values(kept.first_recent, kept.recent),
                     out.middleRows(plan.q0, plan.n));
    } else {
      // A variant's paths read contiguous blocks: each key/value head's rows gathered first (the
      // same rows, so the bits of a `KVCache` holding them).
      std::vector<GatherBuffer<T>> buffers(static_cast<std::size_t>(4 * pool.kv_heads));
      const auto gather = [&](bool of_values, Index first, Index count, Index which) {
        using View = decltype(gathered(pool.key_rows(plan.pages, 0, 0, 0), 0, 0, buffers[0]));
        std::vector<View> views;
        for (Index kv = 0; kv < pool.kv_heads; ++kv) {
          const auto rows = of_values ? pool.value_rows(plan.pages, kv, first, count)
                                      : pool.key_rows(plan.pages, kv, first, count);
          views.push_back(gathered(rows, 0, count,
                                   buffers[static_cast<std::size_t>(which * pool.kv_heads + kv)]));
        }
        return [views](Index kv) { return views[static_cast<std::size_t>(kv)]; };
      };
      attend_kept<T>(q, heads, heads / pool.kv_heads, variant, plan.batch, plan.rule, per_head,
                     kept, gather(false, 0, kept.pinned, 0), gather(true, 0, kept.pinned, 1),
                     gather(false, kept.first_recent, kept.recent, 2),
                     gather(true, kept.first_recent, kept.recent, 3),
                     out.middleRows(plan.q0, plan.n));
    }
  });
}

/// Decoding steps (one query each) of sequences whose first `prefix` tokens are the same pages
/// (`pages` of the first member; a multiple of the page size, before each member's last token),
/// as a cascade: the prefix read once for every member's query heads (one decoding step of the
/// stacked queries per key/value head, `decode_groups`), each member's own keys after it
/// (`decode_blocks`), and the two merged by log-sum-exp, the sink added once (`merge_block`,
/// `finish_merge`). The members' rules have options that are the same for every key (scale, softcap, sink, the
/// stored arithmetic), checked by the caller.
template <class T, class Codec>
void attend_cascade(const PoolView<Codec, T>& pool, const std::vector<const PagedPlan<T>*>& members,
                    Index prefix, const ConstRef<T>& Q, Index heads,
                    const std::optional<RopeStyle>& rope, const RopeTable& rope_table,
                    Matrix<T>& out) {
  const Index kv_heads = pool.kv_heads;
  const Index group = heads / kv_heads;
  const Index d_k = pool.d_k;
  const Index d_v = pool.d_v;
  const auto count = static_cast<Index>(members.size());
  const int* shared = members[0]->pages;
  // Each kv head's query heads of every member, stacked: row s group + j is member s's head
  // kv group + j (rotated for its position).
  std::vector<Matrix<T>> stacked(static_cast<std::size_t>(kv_heads), Matrix<T>(count * group, d_k));
  Matrix<T> row;
  for (Index s = 0; s < count; ++s) {
    const PagedPlan<T>& plan = *members[static_cast<std::size_t>(s)];
    row = Q.middleRows(plan.q0, 1);
    if (rope) rope_kernel<T>(row, d_k, plan.rule.q_position, *rope, rope_table);
    for (Index h = 0; h < heads; ++h) {
      stacked[static_cast<std::size_t>(h / group)].row(s * group + h % group) =
          row.middleCols(h * d_k, d_k);
    }
  }
  // 1. The shared prefix, once: every member's heads over it, without the sink.
  const ScoreRule<T>& first = members[0]->rule;
  ScoreRule<T> prefix_rule = first.uniform_part(count * group, prefix);
  prefix_rule.reduced_arithmetic = first.reduced_arithmetic;
  std::vector<Matrix<T>> o_prefix(static_cast<std::size_t>(kv_heads),
                                  Matrix<T>(count * group, d_v));
  std::vector<Vector<T>> lse_prefix(static_cast<std::size_t>(kv_heads), Vector<T>(count * group));
  const auto at = [](Index h) { return static_cast<std::size_t>(h); };
  decode_groups<T>(
      kv_heads, prefix_rule, [&](Index h) { return ConstRef<T>(stacked[at(h)]); },
      [&](Index h) { return pool.key_rows(shared, h, 0, prefix); },
      [&](Index h) { return pool.value_rows(shared, h, 0, prefix); },
      [&](Index h) { return Eigen::Ref<Matrix<T>>(o_prefix[at(h)]); }, BoundVariant<NoVariant>{},
      [&](Index h) { return lse_prefix[at(h)].data(); });
  // 2. Each member's own keys, merged with the prefix's result.
  parallel_for<DecodeScratch<T>>(count * kv_heads, [&](Index t, DecodeScratch<T>& scratch) {
    const Index s = t / kv_heads;
    const Index h = t % kv_heads;
    const PagedPlan<T>& plan = *members[static_cast<std::size_t>(s)];
    const Index own = plan.kept.recent - prefix;
    ScoreRule<T> own_rule = plan.rule.uniform_part(group, own);
    own_rule.reduced_arithmetic = plan.rule.reduced_arithmetic;
    Matrix<T> o_own(group, d_v);
    Vector<T> lse_own(group);
    decode_blocks<T>(
        stacked[at(h)].middleRows(s * group, group), pool.key_rows(plan.pages, h, prefix, own),
        pool.value_rows(plan.pages, h, prefix, own), own_rule, scratch, o_own, lse_own.data());
    Matrix<T> o = o_prefix[at(h)].middleRows(s * group, group);
    Vector<T> lse = lse_prefix[at(h)].segment(s * group, group);
    merge_block<T>(o, lse.data(), o_own, lse_own.data());
    finish_merge<T>(o, lse.data(), plan.rule.sink);
    for (Index j = 0; j < group; ++j) {
      out.block(plan.q0, (h * group + j) * d_v, 1, d_v) = o.row(j);
    }
  });
}

/// The codec of a caller's pool element E for scalar type T.
template <class E, class T>
struct pool_codec {
  static_assert(std::is_same_v<E, T>, "a page pool holds T, Eigen::half or Eigen::bfloat16");
  using type = SameCodec<T>;
};
template <class T>
struct pool_codec<Eigen::half, T> {
  using type = Float16Codec;
};
template <class T>
struct pool_codec<Eigen::bfloat16, T> {
  using type = BFloat16Codec;
};

/// Checks Q's columns against kv_heads and d_k; returns the query heads.
template <class DQ>
Index packed_query_heads(const char* function, const Eigen::MatrixBase<DQ>& Q, Index kv_heads,
                         Index d_k) {
  if (Q.cols() == 0 || Q.cols() % (d_k * kv_heads) != 0) {
    fail(function, "Q has ", Q.cols(),
         " columns, not a positive multiple of kv_heads * d_k = ", kv_heads * d_k, " (Q is ",
         shape_of(Q), ")");
  }
  return Q.cols() / d_k;
}

}  // namespace detail

/// Keys and values of many sequences in one pool of pages.
///
/// Storage: the pool holds `pages` pages; page p keeps, for each key/value head, `page_size` key
/// rows and `page_size` value rows, each contiguous (vLLM's `[pages, kv_heads, page_size, d]`), in
/// the configured `KVStorage` format. Each sequence has a page table: its logical page i (tokens
/// [i page_size, (i + 1) page_size)) lives in physical page `pages(id)[i]`. A page may belong to
/// several sequences (after `fork`); it returns to the pool when the last one lets it go.
///
/// Positions: each sequence counts its own tokens (`length(id)`); row r of an append of r_new rows
/// is at position `length(id) + r`.
///
/// Every operation checks everything before it changes anything: a bad argument or a pool too
/// small for an append throws `shape_error` and leaves every sequence as it was.
template <class T>
class PagedKVCache {
 public:
  /// A sequence's name, given by `add_sequence` and `fork`; never reused.
  using SequenceId = Index;

  /// An empty cache with its pool of `config.pages` pages allocated.
  /// \param config  widths, head count, page size, pool size, window, pinned tokens, RoPE, storage
  /// \throws shape_error on a non-positive width, head count, page size or page count, a negative
  ///         window or pinned count, invalid rope options, or a pool that cannot be allocated.
  explicit PagedKVCache(const PagedKVCacheConfig<T>& config)
      : config_(checked(config)),
        keys_(allocate(config_.d_k)),
        values_(allocate(config_.d_v)),
        references_(static_cast<std::size_t>(config_.pages), 0) {
    free_.reserve(static_cast<std::size_t>(config_.pages));
    for (Index p = config_.pages; p-- > 0;) free_.push_back(static_cast<int>(p));  // 0 first
    if (config_.rope) rope_table_ = detail::rope_table(function, config_.d_k, config_.rope_options);
  }

  /// The configuration, with `pinned_tokens` as the cache applies it (0 without a window).
  /// \returns the configuration
  const PagedKVCacheConfig<T>& config() const { return config_; }

  /// A new, empty sequence.
  /// \returns its id
  SequenceId add_sequence() {
    const SequenceId id = next_id_++;
    sequences_.emplace(id, Sequence{});
    return id;
  }

  /// A new sequence with the parent's tokens: it shares every page of the parent (a shared page
  /// that one of them appends into is copied first: copy on write). O(pages of the parent).
  /// \param parent  an existing sequence
  /// \returns the new sequence's id
  /// \throws shape_error if `parent` does not exist.
  SequenceId fork(SequenceId parent) {
    const Sequence copy = sequence("PagedKVCache::fork", parent);
    for (const int p : copy.pages) {
      if (p >= 0) ++references_[static_cast<std::size_t>(p)];
    }
    const SequenceId id = next_id_++;
    sequences_.emplace(id, copy);
    return id;
  }

  /// Removes a sequence: its pages that no other sequence holds return to the pool.
  /// \param id  an existing sequence
  /// \throws shape_error if `id` does not exist.
  void remove(SequenceId id) {
    Sequence& s = sequence("PagedKVCache::remove", id);
    for (const int p : s.pages) {
      if (p >= 0) release(p);
    }
    sequences_.erase(id);
  }

  /// Whether a sequence exists.
  /// \param id  any id
  /// \returns true between its `add_sequence` (or `fork`) and its `remove`
  bool contains(SequenceId id) const { return sequences_.count(id) > 0; }
  /// Sequences held.
  /// \returns the count
  Index sequences() const { return static_cast<Index>(sequences_.size()); }
  /// Tokens appended to a sequence: the position of its next token.
  /// \param id  an existing sequence
  /// \returns the count
  Index length(SequenceId id) const { return sequence("PagedKVCache::length", id).length; }

  /// Pages in the pool.
  /// \returns config().pages
  Index pages() const { return config_.pages; }
  /// Pages no sequence holds.
  /// \returns the count
  Index free_pages() const { return static_cast<Index>(free_.size()); }
  /// Pages some sequence holds (a shared page counts once).
  /// \returns pages() - free_pages()
  Index pages_in_use() const { return pages() - free_pages(); }
  /// The sequences holding a page.
  /// \param page  0 to pages() - 1
  /// \returns its reference count (0 when free)
  Index references(int page) const {
    require_page("PagedKVCache::references", page);
    return references_[static_cast<std::size_t>(page)];
  }
  /// Bytes of one page: keys and values of every key/value head in the storage format, int8
  /// scales included.
  /// \returns the count
  Index page_bytes() const { return (keys_.bytes() + values_.bytes()) / config_.pages; }
  /// Bytes of the pool (allocated at construction).
  /// \returns pages() page_bytes()
  Index bytes() const { return keys_.bytes() + values_.bytes(); }
  /// Bytes of the pages in use.
  /// \returns pages_in_use() page_bytes()
  Index bytes_in_use() const { return pages_in_use() * page_bytes(); }

  /// Appends new tokens to one sequence.
  /// \param id     an existing sequence
  /// \param K_new  r x (kv_heads d_k): one row per new token, key heads side by side (unrotated
  ///               when the cache applies RoPE)
  /// \param V_new  r x (kv_heads d_v)
  /// \throws shape_error on mismatched shapes, an unknown id, or too few free pages (the message
  ///         gives the pages needed and free); nothing changes then.
  template <class DK, class DV>
  void append(SequenceId id, const Eigen::MatrixBase<DK>& K_new,
              const Eigen::MatrixBase<DV>& V_new) {
    const std::vector<int> offsets{0, static_cast<int>(K_new.rows())};
    if (K_new.rows() > std::numeric_limits<int>::max()) {
      detail::fail("PagedKVCache::append", "K_new has ", K_new.rows(), " rows: at most ",
                   std::numeric_limits<int>::max(), " per call");
    }
    append(std::vector<SequenceId>{id}, offsets, K_new, V_new);
  }

  /// Appends new tokens to many sequences in one call: rows [cu_seqlens[b], cu_seqlens[b + 1])
  /// of K_new and V_new go to sequence ids[b].
  /// \param ids         distinct existing sequences
  /// \param cu_seqlens  ids.size() + 1 offsets: 0, non-decreasing, the last K_new's rows
  /// \param K_new       total x (kv_heads d_k), unrotated when the cache applies RoPE
  /// \param V_new       total x (kv_heads d_v)
  /// \throws shape_error on mismatched shapes or offsets, an unknown or repeated id, or too few
  ///         free pages for the whole call; nothing changes then.
  /// \note Pages are taken from the pool as tokens need them; a shared page (after `fork`) that
  ///       receives tokens is copied first. With a window, after the append the pages whose every
  ///       token is older than what the appended tokens' queries can see (and not pinned) leave the
  ///       sequence, and return to the pool when no other sequence holds them.
  template <class DK, class DV>
  void append(const std::vector<SequenceId>& ids, const std::vector<int>& cu_seqlens,
              const Eigen::MatrixBase<DK>& K_new, const Eigen::MatrixBase<DV>& V_new) {
    static_assert(std::is_same_v<typename DK::Scalar, T> && std::is_same_v<typename DV::Scalar, T>,
                  "K_new and V_new must have the cache's scalar type");
    const char* where = "PagedKVCache::append";
    if (K_new.cols() != config_.kv_heads * config_.d_k ||
        V_new.cols() != config_.kv_heads * config_.d_v || V_new.rows() != K_new.rows()) {
      detail::fail(where, "K_new is ", detail::shape_of(K_new), " and V_new is ",
                   detail::shape_of(V_new), " but the cache needs r x ",
                   config_.kv_heads * config_.d_k, " and r x ", config_.kv_heads * config_.d_v);
    }
    check_offsets(where, "cu_seqlens", ids, cu_seqlens, K_new.rows(), "rows of K_new");
    // 1. Check every sequence and count the pages the call takes, before any change. A shared
    //    last page is copied by each sequence that appends into it but the last one holding it.
    Index needed = 0;
    std::unordered_map<int, Index> copies;  // shared page -> copies the call makes of it
    for (std::size_t b = 0; b < ids.size(); ++b) {
      const Sequence& s = sequence(where, ids[b]);
      for (std::size_t c = 0; c < b; ++c) {
        if (ids[c] == ids[b]) detail::fail(where, "sequence ", ids[b], " is listed twice");
      }
      const Index r = cu_seqlens[b + 1] - cu_seqlens[b];
      if (r == 0) continue;
      detail::checked_add(where, s.length, r, "the positions of sequence", ids[b]);
      needed += (s.length + r + config_.page_size - 1) / config_.page_size -
                static_cast<Index>(s.pages.size());
      if (s.length % config_.page_size != 0) {
        const int last = s.pages.back();
        if (references_[static_cast<std::size_t>(last)] - copies[last] > 1) {
          ++copies[last];
          ++needed;
        }
      }
    }
    if (needed > free_pages()) {
      detail::fail(where, "the append needs ", needed, " free pages but the pool has ",
                   free_pages(), " of ", pages(), " (page_size ", config_.page_size,
                   "); nothing was appended");
    }
    // 2. Write (RoPE first), then let the window's old pages go.
    Matrix<T> rotated;
    for (std::size_t b = 0; b < ids.size(); ++b) {
      const Index first = cu_seqlens[b];
      const Index r = cu_seqlens[b + 1] - first;
      if (r == 0) continue;
      Sequence& s = sequences_.at(ids[b]);
      if (config_.rope) {
        rotated = K_new.middleRows(first, r);
        detail::rope_kernel<T>(rotated, config_.d_k, s.length, *config_.rope, rope_table_);
        write(s, rotated, V_new.middleRows(first, r));
      } else {
        write(s, K_new.middleRows(first, r), V_new.middleRows(first, r));
      }
      drop_old_pages(s, s.length - r);
    }
  }

  /// A sequence's page table: its logical page i in physical page `pages(id)[i]`; -1 for a page a
  /// window has let go.
  /// \param id  an existing sequence
  /// \returns ceil(length / page_size) entries
  const std::vector<int>& page_table(SequenceId id) const {
    return sequence("PagedKVCache::page_table", id).pages;
  }

  /// The positions of a sequence's kept tokens, in order: all of them without a window; with one,
  /// the pinned tokens and the tokens from the first kept page after them on (the columns of
  /// `attend`'s tables).
  /// \param id  an existing sequence
  /// \returns the positions
  std::vector<Index> key_positions(SequenceId id) const {
    const detail::KeptBlocks kept = kept_blocks(sequence("PagedKVCache::key_positions", id));
    std::vector<Index> out;
    for (Index p = 0; p < kept.pinned; ++p) out.push_back(p);
    for (Index p = 0; p < kept.recent; ++p) out.push_back(kept.first_recent + p);
    return out;
  }

  /// A sequence's kept keys of one key/value head, widened to T, rows in `key_positions` order
  /// (rotated with RoPE).
  /// \param id       an existing sequence
  /// \param kv_head  0 to kv_heads - 1
  /// \returns kept x d_k
  Matrix<T> keys(SequenceId id, Index kv_head = 0) const {
    return gathered("PagedKVCache::keys", false, id, kv_head);
  }
  /// A sequence's kept values of one key/value head, widened to T.
  /// \param id       an existing sequence
  /// \param kv_head  0 to kv_heads - 1
  /// \returns kept x d_v
  Matrix<T> values(SequenceId id, Index kv_head = 0) const {
    return gathered("PagedKVCache::values", true, id, kv_head);
  }

  /// The page tables of `ids` in FlashInfer's CSR form (`paged_kv_indptr`, `paged_kv_indices`,
  /// `paged_kv_last_page_len`).
  /// \param ids  existing sequences none of whose pages a window has let go (FlashInfer's table
  ///             starts at position 0)
  /// \returns the table
  /// \throws shape_error for an unknown id or a sequence whose window has let pages go.
  CsrPageTable csr(const std::vector<SequenceId>& ids) const {
    CsrPageTable table;
    table.indptr.push_back(0);
    for (const SequenceId id : ids) {
      const Sequence& s = whole_sequence("PagedKVCache::csr", id);
      table.indices.insert(table.indices.end(), s.pages.begin(), s.pages.end());
      table.indptr.push_back(static_cast<int>(table.indices.size()));
      table.last_page_len.push_back(
          s.length == 0
              ? 0
              : static_cast<int>(s.length - (Index(s.pages.size()) - 1) * config_.page_size));
    }
    return table;
  }

  /// The page tables of `ids` in vLLM's form (`block_tables`, `seq_lens`).
  /// \param ids  existing sequences none of whose pages a window has let go
  /// \returns the table
  /// \throws shape_error for an unknown id or a sequence whose window has let pages go.
  BlockTable block_table(const std::vector<SequenceId>& ids) const {
    std::size_t widest = 0;
    for (const SequenceId id : ids) {
      widest = std::max(widest, whole_sequence("PagedKVCache::block_table", id).pages.size());
    }
    BlockTable table;
    table.block_tables.setConstant(static_cast<Index>(ids.size()), static_cast<Index>(widest), -1);
    for (std::size_t b = 0; b < ids.size(); ++b) {
      const Sequence& s = sequences_.at(ids[b]);
      for (std::size_t i = 0; i < s.pages.size(); ++i) {
        table.block_tables(static_cast<Index>(b), static_cast<Index>(i)) = s.pages[i];
      }
      table.seq_lens.push_back(static_cast<int>(s.length));
    }
    return table;
  }

  /// vLLM's slot mapping of tokens [first, first + count) of a sequence: token p in slot
  /// `page * page_size + p % page_size` of the pool.
  /// \param id     an existing sequence
  /// \param first  the first position, >= 0
  /// \param count  positions, with first + count <= length(id)
  /// \returns count slots
  /// \throws shape_error for an unknown id, positions outside the sequence or tokens a window
  ///         has let go.
  std::vector<Index> slot_mapping(SequenceId id, Index first, Index count) const {
    const char* where = "PagedKVCache::slot_mapping";
    const Sequence& s = sequence(where, id);
    if (first < 0 || count < 0 || first > s.length || count > s.length - first) {
      detail::fail(where, "positions ", first, " .. ", first + count - 1, " are not in sequence ",
                   id, " (", s.length, " tokens)");
    }
    std::vector<Index> slots;
    for (Index p = first; p < first + count; ++p) {
      const int page = s.pages[static_cast<std::size_t>(p / config_.page_size)];
      if (page < 0)
        detail::fail(where, "position ", p, " of sequence ", id, " has left its window");
      slots.push_back(Index(page) * config_.page_size + p % config_.page_size);
    }
    return slots;
  }

  /// Attention of many sequences' new queries over their kept keys, in one call: rows
  /// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of Q are sequence ids[b]'s queries, and each sequence
  /// is attended as `KVCache::attend` attends a cache holding its tokens in the same storage
  /// format (causal; by default its n_b queries are its last n_b positions; the narrower of the
  /// cache's and the options' windows; pinned tokens as a block of their own) — with identical
  /// bits, for any thread count and whatever pages the sequence holds.
  /// \param ids           existing sequences (one may appear more than once)
  /// \param cu_seqlens_q  ids.size() + 1 offsets: 0, non-decreasing, the last Q's rows
  /// \param Q             total_q x (heads d_k), query heads side by side, heads a multiple of
  ///                      kv_heads; unrotated when the cache applies RoPE
  /// \param options       shared or per-sequence options (`SequenceOptions`), as `KVCache::attend`
  ///                      takes them; a mask or bias is n_b x (the sequence's kept keys, in
  ///                      `key_positions` order)
  /// \param per_head      per-query-head slopes, sinks, and (heads, n, kept) tables when every
  ///                      sequence has the same n and kept keys
  /// \param out           resized to total_q x (heads d_v)
  /// \throws shape_error on mismatched shapes or offsets, an unknown id, options that do not fit a
  ///         sequence (naming it), or queries that need keys a window has let go.
  /// \note Sequences run in parallel, longest first; within one, the paths of `KVCache::attend`
  ///       (the decoding kernel reads each tile of 64 keys where its pages keep it; the other
  ///       paths run on the sequence's rows gathered per query head).
  template <class DQ>
  void attend(const std::vector<SequenceId>& ids, const std::vector<int>& cu_seqlens_q,
              const Eigen::MatrixBase<DQ>& Q, const SequenceOptions<detail::identity_t<T>>& options,
              const HeadOptions<detail::identity_t<T>>& per_head, Matrix<T>& out) const {
    attend_with(ids, cu_seqlens_q, Q, static_cast<const detail::NoVariant*>(nullptr), options,
                per_head, out);
  }

  /// `attend` with a variant (variant.hpp, docs/variants.md), into caller storage: as
  /// `KVCache::attend` with a variant attends each sequence, the variant seeing each query and
  /// key at its position in the sequence and the sequence's place in `ids` as `ScoreAt::batch`
  /// (a `TreeMask` verifies a draft tree appended after the prompt). The bits of
  /// `KVCache::attend(Q_b, variant, ...)` on each sequence alone where the variant does not read
  /// `ScoreAt::batch`.
  /// \param ids           existing sequences
  /// \param cu_seqlens_q  ids.size() + 1 offsets of the queries
  /// \param Q             total_q x (heads d_k)
  /// \param variant       a variant (`is_variant_v`); `checked(variant)` checks every tile first
  /// \param options       shared or per-sequence options
  /// \param per_head      per-query-head values
  /// \param out           resized to total_q x (heads d_v)
  /// 	hrows shape_error as the overload without a variant.
  template <class DQ, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  void attend(const std::vector<SequenceId>& ids, const std::vector<int>& cu_seqlens_q,
              const Eigen::MatrixBase<DQ>& Q, const Variant& variant,
              const SequenceOptions<detail::identity_t<T>>& options,
              const HeadOptions<detail::identity_t<T>>& per_head, Matrix<T>& out) const {
    attend_with(ids, cu_seqlens_q, Q, &variant, options, per_head, out);
  }

  /// `attend` with a variant, returning total_q x (heads d_v).
  /// \param ids           existing sequences
  /// \param cu_seqlens_q  ids.size() + 1 offsets of the queries
  /// \param Q             total_q x (heads d_k)
  /// \param variant       a variant (`is_variant_v`)
  /// \param options       shared or per-sequence options
  /// \param per_head      per-query-head values
  /// \returns total_q x (heads d_v)
  template <class DQ, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  Matrix<T> attend(const std::vector<SequenceId>& ids, const std::vector<int>& cu_seqlens_q,
                   const Eigen::MatrixBase<DQ>& Q, const Variant& variant,
                   const SequenceOptions<detail::identity_t<T>>& options = {},
                   const HeadOptions<detail::identity_t<T>>& per_head = {}) const {
    Matrix<T> out;
    attend_with(ids, cu_seqlens_q, Q, &variant, options, per_head, out);
    return out;
  }

  /// `attend` returning total_q x (heads d_v) (see the overload into caller storage).
  /// \param ids           existing sequences
  /// \param cu_seqlens_q  ids.size() + 1 offsets of the queries
  /// \param Q             total_q x (heads d_k)
  /// \param options       shared or per-sequence options
  /// \param per_head      per-query-head values
  /// \returns total_q x (heads d_v)
  template <class DQ>
  Matrix<T> attend(const std::vector<SequenceId>& ids, const std::vector<int>& cu_seqlens_q,
                   const Eigen::MatrixBase<DQ>& Q,
                   const SequenceOptions<detail::identity_t<T>>& options = {},
                   const HeadOptions<detail::identity_t<T>>& per_head = {}) const {
    Matrix<T> out;
    attend(ids, cu_seqlens_q, Q, options, per_head, out);
    return out;
  }

 private:
  static constexpr const char* function = "PagedKVCache";

  struct Sequence {
    std::vector<int> pages;  ///< logical page -> physical page; -1 once a window let it go
    Index length = 0;        ///< tokens appended
    Index dropped = 0;       ///< pages a window has let go
  };

  /// `attend`, with a variant when `variant` is not null (`NoVariant` without).
  template <class DQ, class Variant>
  void attend_with(const std::vector<SequenceId>& ids, const std::vector<int>& cu_seqlens_q,
                   const Eigen::MatrixBase<DQ>& Q, const Variant* variant,
                   const SequenceOptions<T>& options, const HeadOptions<T>& per_head,
                   Matrix<T>& out) const {
    static_assert(std::is_same_v<typename DQ::Scalar, T>, "Q must have the cache's scalar type");
    const char* where = "PagedKVCache::attend";
    const Index heads = detail::packed_query_heads(where, Q, config_.kv_heads, config_.d_k);
    check_offsets(where, "cu_seqlens_q", ids, cu_seqlens_q, Q.rows(), "rows of Q");
    if (options.per_sequence() && options.size() != static_cast<Index>(ids.size())) {
      detail::fail(where, "the per-sequence options have ", options.size(),
                   " entries but there are ", ids.size(), " sequences");
    }
    // 1. Every sequence's rule, checked before anything is computed.
    std::vector<detail::PagedPlan<T>> plans;
    plans.reserve(ids.size());
    for (std::size_t b = 0; b < ids.size(); ++b) {
      const Sequence& s = sequence(where, ids[b]);
      const Index n = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
      const AttentionOptions<T>& own = options.of(static_cast<Index>(b));
      const detail::KeptBlocks kept = kept_blocks(s);
      const detail::ScoreRule<T> rule =
          detail::naming_part(where, "sequence", ids[b], [&](const char* at) {
            const detail::ScoreRule<T> r = detail::cache_rule(
                at, config_, s.length, kept, s.dropped > 0, own, per_head, heads, n);
            if constexpr (!std::is_same_v<Variant, detail::NoVariant>) {
              detail::require_variant_positions(at, r.q_position, n, 0, s.length);
            }
            return r;
          });
      plans.push_back({static_cast<Index>(b), cu_seqlens_q[b], n, s.pages.data(), kept, rule});
    }
    if (out.rows() != Q.rows() || out.cols() != heads * config_.d_v) {
      out.resize(Q.rows(), heads * config_.d_v);
    }
    // 2. Sequences that share their first pages, in cascades where it pays; the others one by
    //    one (`detail::attend_paged`).
    std::vector<std::vector<const detail::PagedPlan<T>*>> cascades;
    std::vector<Index> prefixes;
    if constexpr (std::is_same_v<Variant, detail::NoVariant>) {
      if (config_.cascade && cascade_options(options, per_head)) {
        find_cascades(plans, cascades, prefixes);
      }
    }
    std::vector<detail::PagedPlan<T>> alone;
    for (const detail::PagedPlan<T>& plan : plans) {
      bool member = false;
      for (const auto& c : cascades) member = member || std::count(c.begin(), c.end(), &plan) > 0;
      if (!member) alone.push_back(plan);
    }
    detail::with_codec<T>(config_.storage, [&](auto codec) {
      const auto pool = pool_view<decltype(codec)>();
      detail::attend_paged<T>(pool, alone, variant, Q, heads, per_head, config_.rope, rope_table_,
                              out);
      for (std::size_t c = 0; c < cascades.size(); ++c) {
        detail::attend_cascade<T>(pool, cascades[c], prefixes[c], Q, heads, config_.rope,
                                  rope_table_, out);
      }
    });
  }

  /// Whether a call's options let its decoding steps run as cascades: shared options whose rule
  /// is the same for every key of a step (scale, softcap, sink, the stored arithmetic), no
  /// per-head values, no window.
  bool cascade_options(const SequenceOptions<T>& options, const HeadOptions<T>& per_head) const {
    if (options.per_sequence() || per_head.any() || config_.window) return false;
    const AttentionOptions<T>& o = options.of(0);
    return !o.mask && !o.bias && !o.alibi_slope && !o.window && !o.window_right && !o.query_offset;
  }

  /// The cascades among the plans: decoding steps (one query) of sequences whose first pages are
  /// the same physical pages, at least `cascade_min_tokens` of them, before each one's last
  /// token; per group, its members and the shared tokens (whole pages).
  void find_cascades(const std::vector<detail::PagedPlan<T>>& plans,
                     std::vector<std::vector<const detail::PagedPlan<T>*>>& cascades,
                     std::vector<Index>& prefixes) const {
    constexpr Index cascade_min_tokens = 64;
    const Index P = config_.page_size;
    std::unordered_map<int, std::vector<const detail::PagedPlan<T>*>> by_first_page;
    for (const detail::PagedPlan<T>& plan : plans) {
      if (plan.n == 1 && plan.kept.pinned == 0 && plan.kept.first_recent == 0 &&
          plan.kept.recent > P) {
        by_first_page[plan.pages[0]].push_back(&plan);
      }
    }
    for (auto& [page, members] : by_first_page) {
      if (members.size() < 2) continue;
      const detail::PagedPlan<T>& leader = *members[0];
      Index shared = (leader.kept.recent - 1) / P;  // whole pages before the last token
      for (const detail::PagedPlan<T>* m : members) {
        Index same = 0;
        const Index most = std::min(shared, (m->kept.recent - 1) / P);
        while (same < most && m->pages[same] == leader.pages[same]) ++same;
        shared = same;
      }
      if (shared * P < cascade_min_tokens) continue;
      // Members in batch order, so that the work does not depend on the hash map's order.
      std::sort(members.begin(), members.end(),
                [](const auto* a, const auto* b) { return a->batch < b->batch; });
      cascades.push_back(members);
      prefixes.push_back(shared * P);
    }
  }

  static PagedKVCacheConfig<T> checked(PagedKVCacheConfig<T> config) {
    static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
    detail::require_positive_size(function, "d_k", config.d_k);
    detail::require_positive_size(function, "d_v", config.d_v);
    detail::require_positive_size(function, "kv_heads", config.kv_heads);
    detail::require_positive_size(function, "page_size", config.page_size);
    detail::require_positive_size(function, "pages", config.pages);
    if (config.pages > std::numeric_limits<int>::max()) {
      detail::fail(function, "pages is ", config.pages, ": page numbers are int, at most ",
                   std::numeric_limits<int>::max());
    }
    if (config.window && *config.window < 0) {
      detail::fail(function, "window must be >= 0, got ", *config.window);
    }
    if (config.pinned_tokens < 0) {
      detail::fail(function, "pinned_tokens must be >= 0, got ", config.pinned_tokens);
    }
    if (!config.window) config.pinned_tokens = 0;
    return config;
  }

  detail::StoredRows<T> allocate(Index cols) const {
    const Index rows = detail::checked_mul(
        function, detail::checked_mul(function, config_.pages, config_.kv_heads, "the pool's rows"),
        config_.page_size, "the pool's rows");
    detail::checked_mul(function, detail::checked_mul(function, rows, cols, "the pool's size"),
                        detail::element_bytes<T>(config_.storage), "the pool's bytes");
    try {
      return detail::StoredRows<T>(config_.storage, rows, cols);
    } catch (const std::bad_alloc&) {
      detail::fail(function, "cannot allocate ", config_.pages, " pages of ", config_.page_size,
                   " tokens x ", config_.kv_heads, " heads x ", cols, " ",
                   detail::storage_name(config_.storage), " values");
    }
  }

  const Sequence& sequence(const char* where, SequenceId id) const {
    const auto found = sequences_.find(id);
    if (found == sequences_.end()) {
      if (id >= 0 && id < next_id_) detail::fail(where, "sequence ", id, " was removed");
      detail::fail(where, "there is no sequence ", id);
    }
    return found->second;
  }
  Sequence& sequence(const char* where, SequenceId id) {
    return const_cast<Sequence&>(static_cast<const PagedKVCache&>(*this).sequence(where, id));
  }
  const Sequence& whole_sequence(const char* where, SequenceId id) const {
    const Sequence& s = sequence(where, id);
    if (s.dropped > 0) {
      detail::fail(where, "sequence ", id, " has let ", s.dropped,
                   " pages go (its window): the table would not start at position 0");
    }
    return s;
  }

  void require_page(const char* where, int page) const {
    if (page < 0 || page >= config_.pages) {
      detail::fail(where, "page ", page, " is not in the pool (0 .. ", config_.pages - 1, ")");
    }
  }
  void require_head(const char* where, Index kv_head) const {
    if (kv_head < 0 || kv_head >= config_.kv_heads) {
      detail::fail(where, "kv_head must be in 0 .. ", config_.kv_heads - 1, ", got ", kv_head);
    }
  }

  /// Checks a list of offsets (`detail::checked_offsets`) and its length: one per id, plus one.
  static void check_offsets(const char* where, const char* name, const std::vector<SequenceId>& ids,
                            const std::vector<int>& cu_seqlens, Index rows, const char* rows_of) {
    if (cu_seqlens.size() != ids.size() + 1) {
      detail::fail(where, name, " has ", cu_seqlens.size(), " entries but there are ", ids.size(),
                   " sequences: it needs ", ids.size() + 1);
    }
    detail::checked_offsets(where, name, cu_seqlens, rows, rows_of);
  }

  int take_page() {
    const int page = free_.back();
    free_.pop_back();
    references_[static_cast<std::size_t>(page)] = 1;
    return page;
  }

  void release(int page) {
    Index& count = references_[static_cast<std::size_t>(page)];
    if (--count == 0) free_.push_back(page);
  }

  /// Row of (page, head, slot) in the pool.
  Index row(int page, Index head, Index slot) const {
    return (Index(page) * config_.kv_heads + head) * config_.page_size + slot;
  }

  /// Copies the first `slots` tokens of a page (every head) into another page, as stored.
  void copy_page(int from, int to, Index slots) {
    for (Index h = 0; h < config_.kv_heads; ++h) {
      for (Index j = 0; j < slots; ++j) {
        keys_.copy_row(row(to, h, j), keys_, row(from, h, j));
        values_.copy_row(row(to, h, j), values_, row(from, h, j));
      }
    }
  }

  /// Stores r rows at the sequence's next positions (the pool has the pages: checked before).
  void write(Sequence& s, const detail::ConstRef<T>& K, const detail::ConstRef<T>& V) {
    const Index P = config_.page_size;
    if (s.length % P != 0 && references_[static_cast<std::size_t>(s.pages.back())] > 1) {
      const int shared = s.pages.back();
      const int own = take_page();
      copy_page(shared, own, s.length % P);
      release(shared);
      s.pages.back() = own;
    }
    for (Index i = 0; i < K.rows(); ++i) {
      const Index p = s.length + i;
      if (p % P == 0) s.pages.push_back(take_page());
      const int page = s.pages.back();
      for (Index h = 0; h < config_.kv_heads; ++h) {
        keys_.put(row(page, h, p % P), K.data() + i * K.outerStride() + h * config_.d_k);
        values_.put(row(page, h, p % P), V.data() + i * V.outerStride() + h * config_.d_v);
      }
    }
    s.length += K.rows();
  }

  /// With a window: the pages whose every token is before `first_query - window` (what the
  /// queries from position `first_query` on can see) and after the pinned tokens leave the
  /// sequence.
  void drop_old_pages(Sequence& s, Index first_query) {
    if (!config_.window) return;
    const Index oldest = detail::saturating_sub(first_query, *config_.window);
    const Index P = config_.page_size;
    const Index pinned_pages = (config_.pinned_tokens + P - 1) / P;
    for (Index i = pinned_pages; i < static_cast<Index>(s.pages.size()); ++i) {
      if ((i + 1) * P > oldest) break;  // page i holds a token at or after `oldest`
      int& page = s.pages[static_cast<std::size_t>(i)];
      if (page < 0) continue;
      release(page);
      page = -1;
      ++s.dropped;
    }
  }

  /// The kept blocks of a sequence: the pinned tokens (with a window), then the tokens from the
  /// first kept page after the pinned pages on (from the first unpinned token while no page has
  /// been let go).
  detail::KeptBlocks kept_blocks(const Sequence& s) const {
    detail::KeptBlocks kept;
    kept.pinned = config_.window ? std::min(s.length, config_.pinned_tokens) : 0;
    kept.first_recent = kept.pinned;
    if (s.dropped > 0) {
      const Index P = config_.page_size;
      Index i = (config_.pinned_tokens + P - 1) / P;
      while (s.pages[static_cast<std::size_t>(i)] < 0) ++i;
      kept.first_recent = i * P;
    }
    kept.recent = s.length - kept.first_recent;
    return kept;
  }

  /// The pool as the kernels read it, in the format `Codec`.
  template <class Codec>
  detail::PoolView<Codec, T> pool_view() const {
    detail::PoolView<Codec, T> view{nullptr,           nullptr,          nullptr,     nullptr,
                                    config_.page_size, config_.kv_heads, config_.d_k, config_.d_v};
    if constexpr (std::is_same_v<Codec, detail::SameCodec<T>>) {
      view.keys = keys_.same().data();
      view.values = values_.same().data();
    } else {
      const auto keys = keys_.template block<Codec>(0, keys_.rows());
      const auto values = values_.template block<Codec>(0, values_.rows());
      view.keys = keys.data();
      view.key_scales = keys.scales();
      view.values = values.data();
      view.value_scales = values.scales();
    }
    return view;
  }

  /// The kept keys (`values` false) or values of a sequence's key/value head, widened to T.
  Matrix<T> gathered(const char* where, bool values, SequenceId id, Index kv_head) const {
    require_head(where, kv_head);
    const Sequence& s = sequence(where, id);
    const detail::KeptBlocks kept = kept_blocks(s);
    Matrix<T> out(kept.pinned + kept.recent, values ? config_.d_v : config_.d_k);
    detail::with_codec<T>(config_.storage, [&](auto codec) {
      using Codec = decltype(codec);
      const detail::PoolView<Codec, T> pool = pool_view<Codec>();
      detail::GatherBuffer<T> buffer;
      Matrix<T> rows;
      const auto copy = [&](Index first, Index count, Index to) {
        const auto block =
            detail::gathered(values ? pool.value_rows(s.pages.data(), kv_head, first, count)
                                    : pool.key_rows(s.pages.data(), kv_head, first, count),
                             0, count, buffer);
        if constexpr (std::is_same_v<Codec, detail::SameCodec<T>>) {
          out.middleRows(to, count) = block;
        } else {
          block.widen_into(rows);
          out.middleRows(to, count) = rows;
        }
      };
      copy(0, kept.pinned, 0);
      copy(kept.first_recent, kept.recent, kept.pinned);
    });
    return out;
  }

  PagedKVCacheConfig<T> config_;
  detail::StoredRows<T> keys_;     ///< pages x kv_heads x page_size rows of d_k
  detail::StoredRows<T> values_;   ///< pages x kv_heads x page_size rows of d_v
  std::vector<Index> references_;  ///< per page: the sequences holding it
  std::vector<int> free_;          ///< free pages, the next one taken last
  std::unordered_map<SequenceId, Sequence> sequences_;
  SequenceId next_id_ = 0;
  detail::RopeTable rope_table_;
};

namespace detail {

/// Checks a caller's pool and CSR page table against a batch of `batch` sequences; returns each
/// sequence's length in tokens.
template <class E>
std::vector<Index> checked_page_table(const char* function, const PagePool<E>& pool,
                                      const CsrPageTable& table, std::size_t batch) {
  require_positive_size(function, "pool.pages", pool.pages);
  require_positive_size(function, "pool.kv_heads", pool.kv_heads);
  require_positive_size(function, "pool.page_size", pool.page_size);
  require_positive_size(function, "pool.d_k", pool.d_k);
  require_positive_size(function, "pool.d_v", pool.d_v);
  if (!pool.keys || !pool.values)
    fail(function, "pool.keys and pool.values must point to the pool");
  if (table.indptr.size() != batch + 1) {
    fail(function, "indptr has ", table.indptr.size(), " entries but there are ", batch,
         " sequences: it needs ", batch + 1);
  }
  checked_offsets(function, "indptr", table.indptr, static_cast<Index>(table.indices.size()),
                  "page indices");
  if (table.last_page_len.size() != batch) {
    fail(function, "last_page_len has ", table.last_page_len.size(), " entries but there are ",
         batch, " sequences");
  }
  for (std::size_t i = 0; i < table.indices.size(); ++i) {
    if (table.indices[i] < 0 || table.indices[i] >= pool.pages) {
      fail(function, "indices[", i, "] = ", table.indices[i],
           " names a page outside the pool (0 .. ", pool.pages - 1, ")");
    }
  }
  std::vector<Index> lengths(batch);
  for (std::size_t b = 0; b < batch; ++b) {
    const Index pages = table.indptr[b + 1] - table.indptr[b];
    const Index last = table.last_page_len[b];
    if (pages == 0 ? last != 0 : last < 1 || last > pool.page_size) {
      fail(function, "last_page_len[", b, "] = ", last, " but sequence ", b, " has ", pages,
           " pages of ", pool.page_size, " tokens (1 .. page_size tokens in its last page; 0 ",
           "without pages)");
    }
    lengths[b] = pages == 0 ? 0 : (pages - 1) * pool.page_size + last;
  }
  return lengths;
}

/// A vLLM block table as the CSR table of the same pages (checked: each sequence's pages listed,
/// -1 only after them).
inline CsrPageTable csr_of(const char* function, const BlockTable& table, Index page_size) {
  const Index batch = table.block_tables.rows();
  if (static_cast<Index>(table.seq_lens.size()) != batch) {
    fail(function, "seq_lens has ", table.seq_lens.size(), " entries but block_tables has ", batch,
         " rows");
  }
  CsrPageTable csr;
  csr.indptr.push_back(0);
  for (Index b = 0; b < batch; ++b) {
    const Index length = table.seq_lens[static_cast<std::size_t>(b)];
    const Index pages = (length + page_size - 1) / page_size;
    if (length < 0 || pages > table.block_tables.cols()) {
      fail(function, "seq_lens[", b, "] = ", length, " needs ", std::max<Index>(pages, 0),
           " pages of ", page_size, " tokens but block_tables has ", table.block_tables.cols(),
           " columns");
    }
    for (Index i = 0; i < pages; ++i) csr.indices.push_back(table.block_tables(b, i));
    csr.indptr.push_back(static_cast<int>(csr.indices.size()));
    csr.last_page_len.push_back(
        static_cast<int>(length - std::max<Index>(pages - 1, 0) * page_size));
  }
  return csr;
}

}  // namespace detail

/// Attention of a packed batch of queries over a caller's own paged cache: `pool` in vLLM's
/// layout, `table` FlashInfer's CSR page table (a `BlockTable` overload takes vLLM's). Sequence b's
/// keys and values are the tokens its pages hold, in table order; its queries, rows
/// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of Q, are its last positions (bottom-right causal, as
/// `PagedKVCache::attend` places them; `query_offset` places them elsewhere), and its options are
/// `options.of(b)`. The keys are used as stored (rotate them, and the queries, before the call
/// for RoPE). Each sequence's result has the bits of `PagedKVCache::attend` over the same tokens
/// in a cache of the same format, any thread count.
/// \param pool          the caller's pages (T, Eigen::half or Eigen::bfloat16)
/// \param table         batch sequences' pages: indptr (batch + 1), indices, last_page_len
/// \param cu_seqlens_q  batch + 1 offsets of the queries in Q
/// \param Q             total_q x (heads d_k), heads a multiple of pool.kv_heads
/// \param options       shared or per-sequence options (mask and bias n_b x m_b)
/// \param per_head      per-query-head slopes and sinks
/// \param out           resized to total_q x (heads d_v)
/// \throws shape_error on a pool of non-positive sizes, offsets that do not fit, a page index
///         outside the pool, a last_page_len that does not fit its page, or options that do not
///         fit a sequence (naming it); nothing is computed then.
template <class E, class DQ>
void paged_attention(const PagePool<E>& pool, const CsrPageTable& table,
                     const std::vector<int>& cu_seqlens_q, const Eigen::MatrixBase<DQ>& Q,
                     const SequenceOptions<typename DQ::Scalar>& options,
                     const HeadOptions<typename DQ::Scalar>& per_head,
                     Matrix<typename DQ::Scalar>& out) {
  using T = typename DQ::Scalar;
  using Codec = typename detail::pool_codec<E, T>::type;
  const char* where = "paged_attention";
  detail::checked_offsets(where, "cu_seqlens_q", cu_seqlens_q, Q.rows(), "rows of Q");
  const std::size_t batch = cu_seqlens_q.size() - 1;
  const std::vector<Index> lengths = detail::checked_page_table(where, pool, table, batch);
  const Index heads = detail::packed_query_heads(where, Q, pool.kv_heads, pool.d_k);
  if (options.per_sequence() && options.size() != static_cast<Index>(batch)) {
    detail::fail(where, "the per-sequence options have ", options.size(), " entries but there are ",
                 batch, " sequences");
  }
  KVCacheConfig<T> config;
  config.d_k = pool.d_k;
  config.d_v = pool.d_v;
  config.kv_heads = pool.kv_heads;
  std::vector<detail::PagedPlan<T>> plans;
  plans.reserve(batch);
  for (std::size_t b = 0; b < batch; ++b) {
    const Index n = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    const detail::KeptBlocks kept{0, lengths[b], 0};
    const AttentionOptions<T>& own = options.of(static_cast<Index>(b));
    plans.push_back(
        {static_cast<Index>(b), cu_seqlens_q[b], n, table.indices.data() + table.indptr[b], kept,
         detail::naming_part(where, "sequence", static_cast<long long>(b), [&](const char* at) {
           return detail::cache_rule(at, config, lengths[b], kept, false, own, per_head, heads, n);
         })});
  }
  if (out.rows() != Q.rows() || out.cols() != heads * pool.d_v)
    out.resize(Q.rows(), heads * pool.d_v);
  const detail::PoolView<Codec, T> view{reinterpret_cast<const typename Codec::Bits*>(pool.keys),
                                        nullptr,
                                        reinterpret_cast<const typename Codec::Bits*>(pool.values),
                                        nullptr,
                                        pool.page_size,
                                        pool.kv_heads,
                                        pool.d_k,
                                        pool.d_v};
  detail::attend_paged<T>(view, plans, static_cast<const detail::NoVariant*>(nullptr), Q, heads,
                          per_head, std::nullopt, detail::RopeTable{}, out);
}

/// `paged_attention` returning total_q x (heads d_v) (see the overload into caller storage).
/// \param pool          the caller's pages
/// \param table         FlashInfer's CSR page table of the batch
/// \param cu_seqlens_q  batch + 1 offsets of the queries in Q
/// \param Q             total_q x (heads d_k)
/// \param options       shared or per-sequence options
/// \param per_head      per-query-head slopes and sinks
/// \returns total_q x (heads d_v)
template <class E, class DQ>
Matrix<typename DQ::Scalar> paged_attention(
    const PagePool<E>& pool, const CsrPageTable& table, const std::vector<int>& cu_seqlens_q,
    const Eigen::MatrixBase<DQ>& Q, const SequenceOptions<typename DQ::Scalar>& options = {},
    const HeadOptions<typename DQ::Scalar>& per_head = {}) {
  Matrix<typename DQ::Scalar> out;
  paged_attention(pool, table, cu_seqlens_q, Q, options, per_head, out);
  return out;
}

/// `paged_attention` over vLLM's page table (`block_tables`, `seq_lens`), as the same pages in
/// the CSR form.
/// \param pool          the caller's pages
/// \param table         vLLM's block table of the batch
/// \param cu_seqlens_q  batch + 1 offsets of the queries in Q
/// \param Q             total_q x (heads d_k)
/// \param options       shared or per-sequence options
/// \param per_head      per-query-head slopes and sinks
/// \returns total_q x (heads d_v)
/// \throws shape_error as the CSR overload, and for seq_lens that do not fit block_tables.
template <class E, class DQ>
Matrix<typename DQ::Scalar> paged_attention(
    const PagePool<E>& pool, const BlockTable& table, const std::vector<int>& cu_seqlens_q,
    const Eigen::MatrixBase<DQ>& Q, const SequenceOptions<typename DQ::Scalar>& options = {},
    const HeadOptions<typename DQ::Scalar>& per_head = {}) {
  detail::require_positive_size("paged_attention", "pool.page_size", pool.page_size);
  return paged_attention(pool, detail::csr_of("paged_attention", table, pool.page_size),
                         cu_seqlens_q, Q, options, per_head);
}

}  // namespace attn

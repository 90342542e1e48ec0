#pragma once
/// \file kv_cache.hpp
/// `KVCache`: the keys and values of the tokens generated so far, so that each decoding step
/// computes attention for its new queries only. The storage is a `KVStore` (grouped-query heads,
/// a window kept in a ring buffer, pinned tokens kept forever: StreamingLLM, Xiao et al. 2023);
/// the cache adds rotary position embedding (with its linear, NTK-aware or YaRN scaling) applied
/// with each row's absolute position, and attention over the stored keys through the library's
/// one score rule (detail/score_rule.hpp), by blocks merged by log-sum-exp.

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "detail/online_softmax.hpp"
#include "detail/paths.hpp"
#include "detail/score_rule.hpp"
#include "error.hpp"
#include "heads.hpp"
#include "kv_store.hpp"
#include "rope.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"
#include "variant.hpp"

namespace attn {

/// The shape and behaviour of a `KVCache`.
template <class T>
struct KVCacheConfig {
  Index d_k = 0;                  ///< width of one key head, >= 1
  Index d_v = 0;                  ///< width of one value head, >= 1
  Index kv_heads = 1;             ///< key/value heads stored (query heads are a multiple of it)
  std::optional<Index> window;    ///< w >= 0: a query sees itself and the w keys before it; older
                                  ///< rows are dropped (a ring buffer)
  Index pinned_tokens = 0;        ///< with a window: the first k tokens stay visible forever
                                  ///< (StreamingLLM's "attention sinks"; not the sink logit of
                                  ///< AttentionOptions); ignored without a window
  std::optional<RopeStyle> rope;  ///< set: keys are rotated at append, queries at attend, each for
                                  ///< its absolute position
  RopeOptions<T> rope_options;    ///< base, rotary_dim, linear_scale, ntk_scale or YaRN of that
                                  ///< rotation (YaRN's attention factor scales keys and queries)
  KVStorage storage = KVStorage::Same;  ///< the format keys and values are kept in: encoded at
                                        ///< append (after RoPE), widened to T in the kernels
};

namespace detail {

/// The kept keys of one sequence of a cache as two blocks: the pinned rows (positions 0 ..
/// pinned - 1, visible whatever the window) and the recent rows (positions first_recent ..
/// first_recent + recent - 1).
struct KeptBlocks {
  Index pinned = 0;
  Index recent = 0;
  Index first_recent = 0;
};

/// Scratch of one thread of the two-block (pinned + recent) path.
template <class T>
struct MergeScratch {
  PathScratch<T> path;
  Matrix<T> o_pinned;
  Vector<T> lse_pinned, lse;
};

/// Attention of n (rotated) queries of one sequence over its kept keys by one score rule, `rule`
/// (its columns the kept keys in position order: the pinned ones, then the recent ones, as the
/// call's tables have them; the queries at rule.q_position on, causal, its window). The recent
/// block starts at its first key a query can see (the rows before it are out of every query's
/// window), so where the block starts does not depend on how many old rows the cache still
/// keeps. The pinned rows and the recent rows are two blocks of that rule (the pinned block
/// ignores the window); with both kept, each query head attends each block and the two partial
/// results are merged by log-sum-exp, the sink added once. With one block, the heads go through
/// `heads_kernel` (or `heads_variant_kernel` with a variant: not null, bound to batch item
/// `batch`, the sequence's place in a batch of sequences, else 0). The blocks are read
/// through `pinned_keys(kv)` ... `recent_values(kv)`: views of the cache's storage (stored
/// blocks, or `PagedRows`). Q n x (heads d_k), out n x (heads d_v), heads side by side.
template <class T, class Variant, class PK, class PV, class RK, class RV>
void attend_kept(ConstRef<T> Q, Index heads, Index group, const Variant* variant, Index batch,
                 const ScoreRule<T>& rule, const HeadOptions<T>& per_head, KeptBlocks kept,
                 const PK& pinned_keys, const PV& pinned_values, const RK& recent_keys,
                 const RV& recent_values, Eigen::Ref<Matrix<T>> out) {
  constexpr bool with_variant = !std::is_same_v<Variant, NoVariant>;
  const Index n = Q.rows();
  if (n == 0) return;
  const Index d_k = Q.cols() / heads;
  const Index d_v = out.cols() / heads;
  const Index pinned = kept.pinned;
  // Recent rows no query can see (before the first query's window) are left out of the block.
  const Index skip =
      rule.window_left
          ? std::clamp<Index>(saturating_sub(saturating_sub(rule.q_position, *rule.window_left),
                                             kept.first_recent),
                              0, kept.recent)
          : 0;
  const Index recent = kept.recent - skip;
  const auto pinned_block = [&](const ScoreRule<T>& r) {
    ScoreRule<T> block = r.columns(0, pinned);
    block.left_unbounded = true;  // pinned rows stay visible whatever the window
    return block;
  };
  const auto recent_block = [&](const ScoreRule<T>& r) {
    ScoreRule<T> block = r.columns(pinned + skip, recent);
    block.k_position = kept.first_recent + skip;
    return block;
  };
  const auto recent_k = [&](Index kv) { return recent_keys(kv).middleRows(skip, recent); };
  const auto recent_v = [&](Index kv) { return recent_values(kv).middleRows(skip, recent); };
  const auto q = [&](Index h) { return Q.middleCols(h * d_k, d_k); };
  const auto o = [&](Index h) { return out.middleCols(h * d_v, d_v); };
  const auto stacked_q = [&](Index kv) {
    return Eigen::Map<const Matrix<T>>(Q.data() + kv * group * d_k, group, d_k);
  };
  const auto stacked_o = [&](Index kv) {
    return Eigen::Map<Matrix<T>>(out.data() + kv * group * d_v, group, d_v);
  };
  if (pinned == 0 || recent == 0) {  // one block of keys
    const bool only_pinned = recent == 0;
    const ScoreRule<T> block = only_pinned ? pinned_block(rule) : recent_block(rule);
    const auto run = [&](const auto& keys, const auto& values) {
      if constexpr (with_variant) {
        heads_variant_kernel<T>(heads, group, block, per_head, *variant, batch, q, keys, values, o,
                                stacked_q, stacked_o, [](Index) -> T* { return nullptr; });
      } else {
        heads_kernel<T>(heads, group, block, per_head, d_k, d_v, q, keys, values, o, stacked_q,
                        stacked_o);
      }
    };
    if (only_pinned) {
      run(pinned_keys, pinned_values);
    } else {
      run(recent_k, recent_v);
    }
    return;
  }
  if constexpr (is_checked<Variant>::value) {
    for (Index h = 0; h < heads; ++h) {
      const ScoreRule<T> head = per_head.any() ? head_rule(rule, per_head, h) : rule;
      const BoundVariant<Variant> bound{variant, batch, h, h / group};
      check_kernel_tiles<T>(pinned_block(head), FlashTiles{}, bound);
      check_kernel_tiles<T>(recent_block(head), FlashTiles{}, bound);
    }
  }
  parallel_for<MergeScratch<T>>(heads, [&](Index h, MergeScratch<T>& s) {
    const Index kv = h / group;
    ScoreRule<T> head = per_head.any() ? head_rule(rule, per_head, h) : rule;
    const std::optional<T> sink = head.sink;
    head.sink.reset();
    const ScoreRule<T> a = pinned_block(head);
    const ScoreRule<T> b = recent_block(head);
    s.o_pinned.resize(n, d_v);
    s.lse_pinned.resize(n);
    s.lse.resize(n);
    Eigen::Ref<Matrix<T>> o_h = out.middleCols(h * d_v, d_v);
    if constexpr (with_variant) {
      const BoundVariant<Variant> bound{variant, batch, h, kv};
      flash_blocks<T>(q(h), kernel_block<T>(pinned_keys(kv)), kernel_block<T>(pinned_values(kv)), a,
                      FlashTiles{}, s.path.flash, s.o_pinned, s.lse_pinned.data(), bound);
      flash_blocks<T>(q(h), kernel_block<T>(recent_k(kv)), kernel_block<T>(recent_v(kv)), b,
                      FlashTiles{}, s.path.flash, o_h, s.lse.data(), bound);
    } else {
      run_path<T>(choose_path(a, d_k, d_v, false), q(h), pinned_keys(kv), pinned_values(kv), a,
                  s.path, s.o_pinned, s.lse_pinned.data());
      run_path<T>(choose_path(b, d_k, d_v, false), q(h), recent_k(kv), recent_v(kv), b, s.path, o_h,
                  s.lse.data());
    }
    merge_block<T>(o_h, s.lse.data(), s.o_pinned, s.lse_pinned.data());
    finish_merge<T>(o_h, s.lse.data(), sink);
  });
}

/// The rule of n queries of one sequence of a cache over its kept keys (`kept`; `seen` positions
/// appended, `dropped` whether a window has let rows go), the queries and options checked as both
/// caches' `attend` checks them: the queries are the last n positions unless `query_offset`
/// places them, causal with bottom-right alignment, within the narrower of the cache's and the
/// call's windows, which must not need a key the cache has let go.
template <class T>
ScoreRule<T> cache_rule(const char* function, const KVCacheConfig<T>& config, Index seen,
                        const KeptBlocks& kept, bool dropped, const AttentionOptions<T>& options,
                        const HeadOptions<T>& per_head, Index heads, Index n) {
  const Index size = kept.pinned + kept.recent;
  if (!options.query_offset && n > seen) {
    fail(function, n, " queries but the sequence has seen only ", seen,
         " positions (the queries are the last rows appended)");
  }
  if (options.causal == Causal::TopLeft && !options.query_offset) {
    fail(function, "attend is causal with bottom-right alignment; Causal::TopLeft would ",
         "hide the cache from the new queries (set query_offset to place the queries)");
  }
  const Index first = options.query_offset ? *options.query_offset : seen - n;
  if (config.rope && first < 0) {
    fail(function, "query_offset is ", first, " but RoPE needs positions >= 0");
  }
  if (config.rope) checked_add(function, first, n, "the queries' positions");
  check_options(function, options, n, size);
  check_head_options(function, options, per_head, heads, n, size);
  std::optional<Index> window = config.window;
  if (options.window) window = window ? std::min(*window, *options.window) : options.window;
  const Index oldest = window ? saturating_sub(first, *window) : 0;
  if (window && dropped && kept.first_recent > oldest) {
    fail(function, n, " queries with a window of ", *window, " (the first at position ", first,
         ") need the keys from position ", std::max<Index>(oldest, 0), " on, but the sequence ",
         "keeps positions ", kept.first_recent, " .. ", seen - 1,
         " only (attend at most as many queries as the last append's rows)");
  }
  ScoreRule<T> rule = make_rule(options, n, size, config.d_k);
  rule.q_position = first;
  rule.causal = true;
  rule.window_left = window;
  return rule;
}

}  // namespace detail

/// Keys and values of a growing sequence, for autoregressive decoding, and attention over them.
///
/// Layouts: the matrix calls take one row per token with the heads side by side in the columns
/// (head h in columns [h d, (h + 1) d)), which is what `X W_K` gives; `append_heads` /
/// `attend_heads` take (heads, tokens, features) tensors. Storage: see `KVStore` (each key/value
/// head once, in its own contiguous block, so that a decoding step streams each of them once).
///
/// Positions: the cache counts the rows appended (`position()`); row r of an append of `r_new`
/// rows is at position `position() + r`. By default the n queries of `attend` are the last n
/// positions (bottom-right causal alignment, FlashAttention's rule), so the usual step is
/// `append(K_new, V_new)` then `attend(Q_new)` with the same new tokens; `query_offset` places
/// query 0 at any absolute position instead (ONNX Attention's rule: the past length).
template <class T>
class KVCache {
 public:
  /// A single-head cache without RoPE, kept in T.
  /// \param d_k     width of the keys, >= 1
  /// \param d_v     width of the values, >= 1
  /// \param window  w >= 0: keep only what a window of w keys needs (as `KVCacheConfig::window`)
  /// \throws shape_error if d_k or d_v < 1 or window < 0.
  KVCache(Index d_k, Index d_v, std::optional<Index> window = {})
      : KVCache(KVCacheConfig<T>{d_k, d_v, 1, window, 0, std::nullopt, {}, KVStorage::Same}) {}

  /// A cache with every option (see `KVCacheConfig`).
  /// \param config  widths, head count, window, pinned tokens, RoPE and storage format
  /// \throws shape_error on a non-positive width or head count, a negative window or pinned
  ///         count, or invalid rope options.
  explicit KVCache(const KVCacheConfig<T>& config)
      : config_(config), store_(store_shape(config), "KVCache") {
    config_.pinned_tokens = store_.shape().pinned_tokens;
    if (config_.rope) {
      rope_table_ = detail::rope_table("KVCache", config_.d_k, config_.rope_options);
    }
  }

  /// The configuration, with `pinned_tokens` as the cache applies it (0 without a window).
  /// \returns the configuration
  const KVCacheConfig<T>& config() const { return config_; }
  /// The storage: pinned and recent blocks per key/value head (rotated with RoPE).
  /// \returns the `KVStore` holding the keys and values
  const KVStore<T>& store() const { return store_; }

  /// Keys currently held (the columns of `attend`'s scores): all rows without a window; with one,
  /// the kept pinned rows and the rows of the ring.
  /// \returns the count, m of the next `attend`
  Index size() const { return store_.size(); }
  /// Rows appended since construction (or `clear`): the position of the next row.
  /// \returns the count
  Index position() const { return store_.position(); }
  /// Rows allocated per key/value head: the memory bound.
  /// \returns the count
  Index capacity() const { return store_.capacity(); }

  /// Bytes of the stored keys and values: every allocated row (see `capacity`) of every key/value
  /// head, in the cache's `storage` format, int8 scales included.
  /// \returns the count
  Index bytes() const { return store_.bytes(); }
  /// The bytes `tokens` kept rows take in a cache of this configuration: what `bytes()` reports
  /// after one append of `tokens` rows to such a cache without a window. Per token and key/value
  /// head: (d_k + d_v) sizeof(T) with `Same`, 2 (d_k + d_v) with Float16 or BFloat16,
  /// d_k + d_v + 2 sizeof(T) with Int8.
  /// \param config  the cache's configuration (its window is not applied)
  /// \param tokens  kept rows, >= 0
  /// \returns the count
  /// \throws shape_error when the count does not fit in Index (or `tokens` < 0).
  static Index bytes_for(const KVCacheConfig<T>& config, Index tokens) {
    return KVStore<T>::bytes_for(store_shape(config), tokens, "KVCache::bytes_for");
  }

  /// Forgets every row (and releases the storage).
  void clear() { store_.clear(); }

  /// Appends new positions.
  /// \param K_new  r x (kv_heads d_k): one row per new token, key heads side by side (unrotated
  ///               when the cache applies RoPE)
  /// \param V_new  r x (kv_heads d_v)
  /// \throws shape_error on mismatched shapes.
  /// \note O(r (d_k + d_v) kv_heads) copies (twice with a window); RoPE costs r d_k / 2 sines and
  ///       cosines. Storage grows by amortised doubling (with a window, up to a ring of w + r
  ///       rows); storage that cannot be allocated is a shape_error, with the cache unchanged.
  template <class DK, class DV>
  void append(const Eigen::MatrixBase<DK>& K_new, const Eigen::MatrixBase<DV>& V_new) {
    static_assert(std::is_same_v<typename DK::Scalar, T> && std::is_same_v<typename DV::Scalar, T>,
                  "K_new and V_new must have the cache's scalar type");
    const char* function = "KVCache::append";
    require_columns(function, "K_new", K_new, config_.kv_heads * config_.d_k, "kv_heads * d_k");
    require_columns(function, "V_new", V_new, config_.kv_heads * config_.d_v, "kv_heads * d_v");
    detail::require_same_rows(function, "V_new", V_new, "K_new", K_new);
    if (!config_.rope) {
      store_.append(K_new, V_new);
      return;
    }
    Matrix<T> rotated = K_new;
    detail::rope_kernel<T>(rotated, config_.d_k, position(), *config_.rope, rope_table_);
    store_.append(rotated, V_new);
  }

  /// Appends new positions given per head.
  /// \param K_new  (kv_heads, r, d_k)
  /// \param V_new  (kv_heads, r, d_v)
  /// \throws shape_error on mismatched shapes.
  void append_heads(const Tensor3<T>& K_new, const Tensor3<T>& V_new) {
    const char* function = "KVCache::append_heads";
    if (K_new.dimension(0) != config_.kv_heads || V_new.dimension(0) != config_.kv_heads ||
        K_new.dimension(2) != config_.d_k || V_new.dimension(2) != config_.d_v ||
        K_new.dimension(1) != V_new.dimension(1)) {
      detail::fail(function, "K_new is ", detail::dims_of(K_new), " and V_new is ",
                   detail::dims_of(V_new), " but the cache needs (", config_.kv_heads, ", r, ",
                   config_.d_k, ") and (", config_.kv_heads, ", r, ", config_.d_v, ")");
    }
    append(merge_heads(K_new), merge_heads(V_new));
  }

  /// Attention of n queries over the cache, causal, into caller storage (no allocation once `out`
  /// has the right size, for one query without tables).
  /// \param Q_new     n x (heads d_k), query heads side by side, heads a multiple of kv_heads
  ///                  (query head h reads key/value head h / (heads / kv_heads)); unrotated when
  ///                  the cache applies RoPE
  /// \param options   scale, softcap, ALiBi, sink, mask and bias (n x size(), columns in the order
  ///                  of `key_positions()`), an extra window (the narrower of the cache's and this
  ///                  one applies), window_right, query_offset (the absolute position of query 0;
  ///                  default position() - n, and then n <= position()); `causal` must be None or
  ///                  BottomRight unless query_offset is set (attend is always causal)
  /// \param per_head  per-query-head slopes, sinks, (heads, n, size()) masks and biases
  /// \param out       resized to n x (heads d_v): each query head's output in its columns
  /// \throws shape_error on mismatched shapes or options, or when the window needs keys the cache
  ///         has already dropped (more queries than the rows of the last append).
  /// \note Reads every kept key and value once per key/value head: for one query, the query heads
  ///       of a group are stacked and go through the decoding kernel (one pass over their shared
  ///       head); otherwise each query head takes the path `detail::choose_path` picks. Pinned and
  ///       recent rows are two blocks of keys merged by log-sum-exp. Heads run in parallel.
  template <class DQ>
  void attend(const Eigen::MatrixBase<DQ>& Q_new, const AttentionOptions<T>& options,
              const HeadOptions<T>& per_head, Matrix<T>& out) const {
    attend_with(Q_new, static_cast<const detail::NoVariant*>(nullptr), options, per_head, out);
  }

  /// `attend` with a variant (variant.hpp, docs/variants.md), into caller storage: its score
  /// modification and mask beside the options', the variant seeing each query and key at its
  /// absolute position (`key_positions()`), query head h as `ScoreAt::head` and its key/value head
  /// as `kv_head`. One query over one block of keys runs the decoding kernel (as
  /// `attention_heads`); pinned and recent blocks together run the tiled kernel per block.
  /// \param Q_new     n x (heads d_k), query heads side by side, heads a multiple of kv_heads
  /// \param variant   a variant (`is_variant_v`); `checked(variant)` checks every tile first
  /// \param options   as for the overload without a variant
  /// \param per_head  per-query-head slopes, sinks, (heads, n, size()) masks and biases
  /// \param out       resized to n x (heads d_v)
  /// \throws shape_error as the overload without a variant.
  template <class DQ, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  void attend(const Eigen::MatrixBase<DQ>& Q_new, const Variant& variant,
              const AttentionOptions<T>& options, const HeadOptions<T>& per_head,
              Matrix<T>& out) const {
    check_variant<Variant, T>();
    attend_with(Q_new, &variant, options, per_head, out);
  }

  /// `attend` with a variant, returning n x (heads d_v) (see the overload writing into caller
  /// storage).
  /// \param Q_new     n x (heads d_k), query heads side by side, heads a multiple of kv_heads
  /// \param variant   a variant (`is_variant_v`)
  /// \param options   as for the overload without a variant
  /// \param per_head  per-query-head slopes, sinks, (heads, n, size()) masks and biases
  /// \returns n x (heads d_v)
  template <class DQ, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
  Matrix<T> attend(const Eigen::MatrixBase<DQ>& Q_new, const Variant& variant,
                   const AttentionOptions<T>& options = {},
                   const HeadOptions<T>& per_head = {}) const {
    Matrix<T> out;
    attend(Q_new, variant, options, per_head, out);
    return out;
  }

  /// `attend` with options shared by every head, into caller storage.
  /// \param Q_new    n x (heads d_k), query heads side by side, heads a multiple of kv_heads
  /// \param options  as for the overload taking `per_head`
  /// \param out      resized to n x (heads d_v)
  template <class DQ>
  void attend(const Eigen::MatrixBase<DQ>& Q_new, const AttentionOptions<T>& options,
              Matrix<T>& out) const {
    attend(Q_new, options, HeadOptions<T>{}, out);
  }

  /// `attend` returning n x (heads d_v) (see the overload writing into caller storage).
  /// \param Q_new     n x (heads d_k), query heads side by side, heads a multiple of kv_heads
  /// \param options   as for the overload writing into caller storage
  /// \param per_head  per-query-head slopes, sinks, (heads, n, size()) masks and biases
  /// \returns n x (heads d_v): each query head's output in its columns
  template <class DQ>
  Matrix<T> attend(const Eigen::MatrixBase<DQ>& Q_new, const AttentionOptions<T>& options = {},
                   const HeadOptions<T>& per_head = {}) const {
    Matrix<T> out;
    attend(Q_new, options, per_head, out);
    return out;
  }

  /// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile
  /// time rather than cut down: per-head values go in `HeadOptions`, padding in `mask`.
  template <class DQ, class Options, class... Rest, detail::if_extended_options<Options, T> = 0>
  Matrix<T> attend(const Eigen::MatrixBase<DQ>& Q_new, const Options& options,
                   Rest&&...) const = delete;
  /// Likewise for `attend_heads`.
  template <class Options, class... Rest, detail::if_extended_options<Options, T> = 0>
  Tensor3<T> attend_heads(const Tensor3<T>& Q_new, const Options& options,
                          Rest&&...) const = delete;

  /// `attend` on heads.
  /// \param Q_new     (heads, n, d_k), heads a multiple of kv_heads
  /// \param options   as for `attend`
  /// \param per_head  per-query-head slopes, sinks, (heads, n, size()) masks and biases
  /// \returns (heads, n, d_v)
  Tensor3<T> attend_heads(const Tensor3<T>& Q_new, const AttentionOptions<T>& options = {},
                          const HeadOptions<T>& per_head = {}) const {
    if (Q_new.dimension(2) != config_.d_k) {
      detail::fail("KVCache::attend_heads", "Q_new is ", detail::dims_of(Q_new),
                   " but the cache's heads have d_k = ", config_.d_k);
    }
    return split_heads(attend(merge_heads(Q_new), options, per_head), Q_new.dimension(0));
  }

  /// The kept keys of one key/value head, in the column order of `attend` (rotated with RoPE).
  /// \param kv_head  0 to kv_heads - 1
  /// \returns size() x d_k
  Matrix<T> keys(Index kv_head = 0) const {
    require_head("KVCache::keys", kv_head);
    return store_.keys(kv_head);
  }
  /// The kept values of one key/value head.
  /// \param kv_head  0 to kv_heads - 1
  /// \returns size() x d_v
  Matrix<T> values(Index kv_head = 0) const {
    require_head("KVCache::values", kv_head);
    return store_.values(kv_head);
  }

  /// The absolute position of each kept key, in the column order of `attend`.
  /// \returns size() positions
  std::vector<Index> key_positions() const { return store_.positions(); }

 private:
  static KVStoreShape store_shape(const KVCacheConfig<T>& config) {
    return KVStoreShape{config.d_k,    config.d_v,           config.kv_heads,
                        config.window, config.pinned_tokens, config.storage};
  }

  void require_head(const char* function, Index kv_head) const {
    if (kv_head < 0 || kv_head >= config_.kv_heads) {
      detail::fail(function, "kv_head must be in 0 .. ", config_.kv_heads - 1, ", got ", kv_head);
    }
  }

  template <class M>
  static void require_columns(const char* function, const char* name, const M& X, Index cols,
                              const char* what) {
    if (X.cols() != cols) {
      detail::fail(function, name, " has ", X.cols(), " columns but the cache needs ", what, " = ",
                   cols, " (", name, " is ", detail::shape_of(X), ")");
    }
  }

  /// The number of query heads of Q, its columns checked.
  template <class DQ>
  Index query_heads(const char* function, const Eigen::MatrixBase<DQ>& Q) const {
    const Index d_k = config_.d_k;
    if (Q.cols() == 0 || Q.cols() % (d_k * config_.kv_heads) != 0) {
      detail::fail(function, "Q_new has ", Q.cols(), " columns, not a positive multiple of ",
                   "kv_heads * d_k = ", config_.kv_heads * d_k, " (Q_new is ", detail::shape_of(Q),
                   ", d_k = ", d_k, ", kv_heads = ", config_.kv_heads, ")");
    }
    return Q.cols() / d_k;
  }

  /// `attend`, with a variant when `variant` is not null (Variant `NoVariant` without).
  template <class DQ, class Variant>
  void attend_with(const Eigen::MatrixBase<DQ>& Q_new, const Variant* variant,
                   const AttentionOptions<T>& options, const HeadOptions<T>& per_head,
                   Matrix<T>& out) const {
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "Q_new must have the cache's scalar type");
    const char* function = "KVCache::attend";
    const Index heads = query_heads(function, Q_new);
    const detail::KeptBlocks kept{store_.pinned_held(), store_.recent_held(),
                                  store_.first_recent()};
    const detail::ScoreRule<T> rule =
        detail::cache_rule(function, config_, position(), kept, store_.dropped_any(), options,
                           per_head, heads, Q_new.rows());
    const Index first = rule.q_position;
    if constexpr (!std::is_same_v<Variant, detail::NoVariant>) {
      detail::require_variant_positions(function, first, Q_new.rows(), 0, position());
    }
    out.resize(Q_new.rows(), heads * config_.d_v);
    if (config_.rope) {
      Matrix<T> rotated = Q_new;
      detail::rope_kernel<T>(rotated, config_.d_k, first, *config_.rope, rope_table_);
      attend_rows(rotated, heads, variant, rule, per_head, kept, out);
    } else {
      attend_rows(Q_new, heads, variant, rule, per_head, kept, out);
    }
  }

  /// Attention of the (rotated) queries over the kept keys (`detail::attend_kept`), the keys and
  /// values read as stored by the cache's format.
  template <class Variant>
  void attend_rows(detail::ConstRef<T> Q, Index heads, const Variant* variant,
                   const detail::ScoreRule<T>& rule, const HeadOptions<T>& per_head,
                   const detail::KeptBlocks& blocks, Matrix<T>& out) const {
    detail::with_codec<T>(config_.storage, [&](auto codec) {
      using Codec = decltype(codec);
      detail::attend_kept<T>(
          Q, heads, heads / config_.kv_heads, variant, 0, rule, per_head, blocks,
          [&](Index kv) { return store_.template pinned_keys_as<Codec>(kv); },
          [&](Index kv) { return store_.template pinned_values_as<Codec>(kv); },
          [&](Index kv) { return store_.template recent_keys_as<Codec>(kv); },
          [&](Index kv) { return store_.template recent_values_as<Codec>(kv); }, out);
    });
  }

  KVCacheConfig<T> config_;
  KVStore<T> store_;
  detail::RopeTable rope_table_;  ///< RoPE frequencies and YaRN factor (unused without)
};

}  // namespace attn

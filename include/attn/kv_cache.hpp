#pragma once
/// \file kv_cache.hpp
/// `KVCache`: the keys and values of the tokens generated so far, so that each decoding step
/// computes attention for its new queries only. Grouped-query storage (each key/value head once),
/// an optional sliding window kept in a ring buffer (memory bounded by the window), optional
/// "attention sink" tokens kept forever (StreamingLLM, Xiao et al. 2023), rotary position
/// embedding (with its linear, NTK-aware or YaRN scaling) applied with each row's absolute
/// position, and per-query-head ALiBi slopes and sink logits.

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "attention.hpp"
#include "detail/decode.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "multi_head.hpp"
#include "positional.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"

namespace attn {

/// The shape and behaviour of a `KVCache`.
template <class T>
struct KVCacheConfig {
  Index d_k = 0;                  ///< width of one key head, >= 1
  Index d_v = 0;                  ///< width of one value head, >= 1
  Index kv_heads = 1;             ///< key/value heads stored (query heads are a multiple of it)
  std::optional<Index> window;    ///< w >= 0: a query sees itself and the w keys before it; older
                                  ///< rows are dropped (a ring buffer)
  Index sink_tokens = 0;          ///< with a window: the first k tokens stay visible forever
                                  ///< (StreamingLLM); ignored without a window (all rows stay)
  std::optional<RopeStyle> rope;  ///< set: keys are rotated at append, queries at attend, each for
                                  ///< its absolute position
  RopeOptions<T> rope_options;    ///< base, rotary_dim, linear_scale, ntk_scale or YaRN of that
                                  ///< rotation (YaRN's attention factor scales keys and queries)
};

/// Keys and values of a growing sequence, for autoregressive decoding.
///
/// Layouts: the matrix calls take one row per token with the heads side by side in the columns
/// (head h in columns [h d, (h + 1) d)), which is what `X W_K` gives; `append_heads` /
/// `attend_heads` take (heads, tokens, features) tensors. Each key/value head is stored once, in
/// its own contiguous block, so that a decoding step streams each of them once.
///
/// Positions: the cache counts the rows appended (`position()`); row r of an append of `r_new`
/// rows is at position `position() + r`. The n queries of `attend` are the last n positions
/// (bottom-right causal alignment, FlashAttention's rule), so the usual step is
/// `append(K_new, V_new)` then `attend(Q_new)` with the same new tokens.
///
/// Memory per key/value head: without a window, every row (capacity doubles as needed); with a
/// window w, the sink rows plus a ring of R = w + (largest append) rows, stored twice (each row is
/// written at slots s and s + R, so that the last R rows are always one contiguous block for the
/// kernels): `sink_tokens + 2 (w + largest append)` rows, whatever the sequence length.
template <class T>
class KVCache {
 public:
  /// A single-head cache (API.md). \param window  keep only what a window of w keys needs.
  /// \throws shape_error if d_k or d_v < 1 or window < 0.
  KVCache(Index d_k, Index d_v, std::optional<Index> window = {})
      : KVCache(KVCacheConfig<T>{d_k, d_v, 1, window, 0, std::nullopt, {}}) {}

  /// A cache with every option (see `KVCacheConfig`).
  /// \throws shape_error on a non-positive width or head count, a negative window or sink count,
  ///         or invalid rope options.
  explicit KVCache(const KVCacheConfig<T>& config) : config_(config) {
    static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
    const char* function = "KVCache";
    detail::require_positive_size(function, "d_k", config_.d_k);
    detail::require_positive_size(function, "d_v", config_.d_v);
    detail::require_positive_size(function, "kv_heads", config_.kv_heads);
    if (config_.window) detail::require_window(function, *config_.window);
    if (config_.sink_tokens < 0) {
      detail::fail(function, "sink_tokens must be >= 0, got ", config_.sink_tokens);
    }
    if (!config_.window) config_.sink_tokens = 0;
    if (config_.rope) {
      rope_table_ = detail::rope_table(function, config_.d_k, config_.rope_options);
    }
    clear();
  }

  const KVCacheConfig<T>& config() const { return config_; }

  /// Keys currently held (the columns of `attend`'s scores): all rows without a window; with one,
  /// the kept sink rows and the rows of the ring.
  Index size() const { return sinks_held() + recent_held(); }
  /// Rows appended since construction (or `clear`): the position of the next row.
  Index position() const { return total_; }
  /// Rows allocated per key/value head (sink rows + ring or linear storage): the memory bound.
  Index capacity() const { return config_.sink_tokens + K_.front().rows(); }

  /// Forgets every row (and releases the ring or linear storage).
  void clear() {
    const auto heads = static_cast<std::size_t>(config_.kv_heads);
    K_.assign(heads, Matrix<T>(0, config_.d_k));
    V_.assign(heads, Matrix<T>(0, config_.d_v));
    sink_K_.assign(heads, Matrix<T>(config_.sink_tokens, config_.d_k));
    sink_V_.assign(heads, Matrix<T>(config_.sink_tokens, config_.d_v));
    ring_ = 0;
    total_ = 0;
  }

  /// Appends new positions.
  /// \param K_new  r x (kv_heads d_k): one row per new token, key heads side by side (unrotated
  ///               when the cache applies RoPE)
  /// \param V_new  r x (kv_heads d_v)
  /// \throws shape_error on mismatched shapes.
  /// \note O(r (d_k + d_v) kv_heads) copies (twice with a window); RoPE costs r d_k / 2 sines and
  ///       cosines. Storage grows (amortised doubling without a window; to w + r rows with one).
  template <class DK, class DV>
  void append(const Eigen::MatrixBase<DK>& K_new, const Eigen::MatrixBase<DV>& V_new) {
    static_assert(std::is_same_v<typename DK::Scalar, T> && std::is_same_v<typename DV::Scalar, T>,
                  "K_new and V_new must have the cache's scalar type");
    const char* function = "KVCache::append";
    require_columns(function, "K_new", K_new, config_.kv_heads * config_.d_k, "kv_heads * d_k");
    require_columns(function, "V_new", V_new, config_.kv_heads * config_.d_v, "kv_heads * d_v");
    detail::require_same_rows(function, "V_new", V_new, "K_new", K_new);
    append_rows(K_new, V_new);
  }

  /// Appends new positions given per head. \param K_new (kv_heads, r, d_k) \param V_new
  /// (kv_heads, r, d_v) \throws shape_error on mismatched shapes.
  void append_heads(const Tensor3<T>& K_new, const Tensor3<T>& V_new) {
    const char* function = "KVCache::append_heads";
    if (K_new.dimension(0) != config_.kv_heads || V_new.dimension(0) != config_.kv_heads ||
        K_new.dimension(2) != config_.d_k || V_new.dimension(2) != config_.d_v ||
        K_new.dimension(1) != V_new.dimension(1)) {
      detail::fail(function, "K_new is ", detail::dims_of(K_new), " and V_new is ",
                   detail::dims_of(V_new), " but the cache needs (", config_.kv_heads, ", r, ",
                   config_.d_k, ") and (", config_.kv_heads, ", r, ", config_.d_v, ")");
    }
    append_rows(side_by_side(K_new), side_by_side(V_new));
  }

  /// Attention of the newest n positions over the cache, causal with bottom-right alignment.
  /// \param Q_new    n x (heads d_k), query heads side by side, heads a multiple of kv_heads
  ///                 (query head h reads key/value head h / (heads / kv_heads)); unrotated when
  ///                 the cache applies RoPE; n <= position()
  /// \param options  scale, softcap, ALiBi, sink, mask and bias (n x size(), columns in the order
  ///                 of `key_positions()`), an extra window; `causal` must be None or BottomRight
  ///                 (attend is always bottom-right causal). One slope and sink for every head;
  ///                 per-head ones: the `MultiHeadOptions` overload below
  /// \returns n x (heads d_v): each query head's output in its columns.
  /// \throws shape_error on mismatched shapes or options, or when the window needs keys the cache
  ///         has already dropped (more queries than the rows of the last append).
  /// \note Reads every kept key and value once per key/value head: for one query, the query heads
  ///       of a group are stacked and go through `detail::decode_kernel` (one pass over their
  ///       shared head); otherwise the kernels of `scaled_dot_product_attention`. Key/value heads
  ///       (or query heads) run in parallel.
  template <class DQ>
  Matrix<T> attend(const Eigen::MatrixBase<DQ>& Q_new,
                   const AttentionOptions<T>& options = {}) const {
    Matrix<T> out;
    attend(Q_new, options, out);
    return out;
  }

  /// `attend` into caller storage (no allocation once `out` has the right size, for one query
  /// without mask, bias, ALiBi or sinks). \param out resized to n x (heads d_v)
  template <class DQ>
  void attend(const Eigen::MatrixBase<DQ>& Q_new, const AttentionOptions<T>& options,
              Matrix<T>& out) const {
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "Q_new must have the cache's scalar type");
    const Index heads = check_queries("KVCache::attend", Q_new, options);
    attend_checked(Q_new, heads, options, nullptr, out);
  }

  /// `attend` with one ALiBi slope and one sink logit per query head: query head h uses
  /// `options.alibi_slopes[h]` and `options.sinks[h]` where those are set (each instead of the
  /// shared `alibi_slope` / `sink`, never together with it); everything else as `attend` (bottom-
  /// right causal alignment, windows, sink tokens, RoPE, and the other `AttentionOptions`).
  /// \param Q_new    n x (heads d_k), as in `attend`
  /// \param options  the `AttentionOptions` of `attend`, plus `alibi_slopes` and `sinks` (each
  ///                 unset, or `heads` values: finite slopes, sinks below +infinity); `key_valid`
  ///                 and `need_weights` must stay unset / false (use `mask`; no weights are
  ///                 returned)
  /// \returns n x (heads d_v)
  /// \throws shape_error as `attend`, or if a per-head list does not have one value per query head
  ///         (the message gives both counts), holds a non-finite slope or a +infinity / NaN sink,
  ///         or is set together with the shared value of its kind, or on key_valid / need_weights.
  /// \note With per-head values every query head goes through the kernels of
  ///       `scaled_dot_product_attention` (never the stacked one-query decoding kernel); each
  ///       thread copies the options once (mask and bias included).
  template <class DQ>
  Matrix<T> attend(const Eigen::MatrixBase<DQ>& Q_new, const MultiHeadOptions<T>& options) const {
    Matrix<T> out;
    attend(Q_new, options, out);
    return out;
  }

  /// `attend` with per-head slopes and sinks, into caller storage. \param out resized to
  /// n x (heads d_v)
  template <class DQ>
  void attend(const Eigen::MatrixBase<DQ>& Q_new, const MultiHeadOptions<T>& options,
              Matrix<T>& out) const {
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "Q_new must have the cache's scalar type");
    const char* function = "KVCache::attend";
    const Index heads = check_queries(function, Q_new, options);
    detail::check_head_values(function, options, heads);
    if (options.key_valid) {
      detail::fail(function, "key_valid (", detail::shape_of(*options.key_valid),
                   ") is not used by the cache: pass padding as `mask` (n x size())");
    }
    if (options.need_weights) {
      detail::fail(function, "need_weights: the cache returns no attention weights");
    }
    attend_checked(Q_new, heads, options, &options, out);
  }

  /// `attend` on heads. \param Q_new (heads, n, d_k) \returns (heads, n, d_v)
  Tensor3<T> attend_heads(const Tensor3<T>& Q_new, const AttentionOptions<T>& options = {}) const {
    return attend_heads_as(Q_new, options);
  }
  /// `attend` with per-head slopes and sinks, on heads. \param Q_new (heads, n, d_k)
  /// \returns (heads, n, d_v)
  Tensor3<T> attend_heads(const Tensor3<T>& Q_new, const MultiHeadOptions<T>& options) const {
    return attend_heads_as(Q_new, options);
  }

  /// The kept keys of one key/value head, in the column order of `attend` (rotated with RoPE).
  /// \returns size() x d_k
  Matrix<T> keys(Index kv_head = 0) const { return held(kv_head, sink_K_, K_, "KVCache::keys"); }
  /// The kept values of one key/value head. \returns size() x d_v
  Matrix<T> values(Index kv_head = 0) const {
    return held(kv_head, sink_V_, V_, "KVCache::values");
  }

  /// The absolute position of each kept key, in the column order of `attend`.
  std::vector<Index> key_positions() const {
    std::vector<Index> positions;
    for (Index p = 0; p < sinks_held(); ++p) positions.push_back(p);
    for (Index p = total_ - recent_held(); p < total_; ++p) positions.push_back(p);
    return positions;
  }

 private:
  // --- Storage --------------------------------------------------------------------------------
  // Positions < k (= sink_tokens, only with a window) live in sink_K_/sink_V_; the others in
  // K_/V_: linear without a window (row q = position - k), a ring of R = ring_ rows with one
  // (position at slot q % R and again at slot q % R + R).

  Index sinks_held() const { return std::min(total_, config_.sink_tokens); }
  Index recent_total() const { return std::max<Index>(total_ - config_.sink_tokens, 0); }
  Index recent_held() const {
    return config_.window ? std::min(recent_total(), ring_) : recent_total();
  }
  /// First storage row of the contiguous block of kept recent rows.
  Index recent_start() const {
    return config_.window && ring_ > 0 ? (recent_total() - recent_held()) % ring_ : 0;
  }

  Matrix<T> held(Index kv_head, const std::vector<Matrix<T>>& sinks,
                 const std::vector<Matrix<T>>& recent, const char* function) const {
    if (kv_head < 0 || kv_head >= config_.kv_heads) {
      detail::fail(function, "kv_head must be in 0 .. ", config_.kv_heads - 1, ", got ", kv_head);
    }
    const auto h = static_cast<std::size_t>(kv_head);
    Matrix<T> out(size(), recent[h].cols());
    out.topRows(sinks_held()) = sinks[h].topRows(sinks_held());
    out.bottomRows(recent_held()) = recent[h].middleRows(recent_start(), recent_held());
    return out;
  }

  /// (heads, n, d_k) -> `attend(Q_new, options)` -> (heads, n, d_v).
  template <class Options>
  Tensor3<T> attend_heads_as(const Tensor3<T>& Q_new, const Options& options) const {
    const Index heads = Q_new.dimension(0);
    const Index n = Q_new.dimension(1);
    if (Q_new.dimension(2) != config_.d_k) {
      detail::fail("KVCache::attend_heads", "Q_new is ", detail::dims_of(Q_new),
                   " but the cache's heads have d_k = ", config_.d_k);
    }
    const Matrix<T> out = attend(side_by_side(Q_new), options);
    Tensor3<T> result(heads, n, config_.d_v);
    for (Index h = 0; h < heads; ++h) {
      detail::slice(result, h) = out.middleCols(h * config_.d_v, config_.d_v);
    }
    return result;
  }

  template <class M>
  static void require_columns(const char* function, const char* name, const M& X, Index cols,
                              const char* what) {
    if (X.cols() != cols) {
      detail::fail(function, name, " has ", X.cols(), " columns but the cache needs ", what, " = ",
                   cols, " (", name, " is ", detail::shape_of(X), ")");
    }
  }

  /// (heads, r, d) -> r x (heads d).
  static Matrix<T> side_by_side(const Tensor3<T>& t) {
    const Index heads = t.dimension(0);
    const Index d = t.dimension(2);
    Matrix<T> out(t.dimension(1), heads * d);
    for (Index h = 0; h < heads; ++h) out.middleCols(h * d, d) = detail::slice(t, h);
    return out;
  }

  /// Moves the kept recent rows into storage of the given size (ring: 2 R rows; linear: rows).
  void reallocate(Index new_ring, Index new_rows) {
    const Index start = recent_start();
    const Index kept = recent_held();
    const Index first = recent_total() - kept;  // recent index of the first kept row
    for (std::size_t h = 0; h < K_.size(); ++h) {
      const Matrix<T> old_K = K_[h].middleRows(start, kept);
      const Matrix<T> old_V = V_[h].middleRows(start, kept);
      K_[h].resize(new_rows, config_.d_k);
      V_[h].resize(new_rows, config_.d_v);
      ring_ = new_ring;
      for (Index i = 0; i < kept; ++i) store(h, first + i, old_K.row(i), old_V.row(i));
    }
    ring_ = new_ring;
  }

  /// Writes recent row q (position k + q) of head h.
  template <class RK, class RV>
  void store(std::size_t h, Index q, const RK& k_row, const RV& v_row) {
    if (config_.window) {
      const Index slot = q % ring_;
      K_[h].row(slot) = k_row;
      K_[h].row(slot + ring_) = k_row;
      V_[h].row(slot) = v_row;
      V_[h].row(slot + ring_) = v_row;
    } else {
      K_[h].row(q) = k_row;
      V_[h].row(q) = v_row;
    }
  }

  template <class DK, class DV>
  void append_rows(const Eigen::MatrixBase<DK>& K_new, const Eigen::MatrixBase<DV>& V_new) {
    const Index r = K_new.rows();
    if (r == 0) return;
    Matrix<T> K_rows = K_new;
    if (config_.rope) {
      detail::rope_kernel<T>(K_rows, config_.d_k, total_, *config_.rope, rope_table_);
    }
    // Room: a ring of w + r rows lets the r new queries see their whole windows.
    const Index recent_after = std::max<Index>(total_ + r - config_.sink_tokens, 0);
    if (config_.window) {
      const Index needed = *config_.window + r;
      if (needed > ring_) reallocate(needed, 2 * needed);
    } else if (recent_after > K_.front().rows()) {
      reallocate(0, std::max<Index>(recent_after, 2 * K_.front().rows()));
    }
    for (std::size_t h = 0; h < K_.size(); ++h) {
      const Index hk = static_cast<Index>(h) * config_.d_k;
      const Index hv = static_cast<Index>(h) * config_.d_v;
      for (Index i = 0; i < r; ++i) {
        const Index p = total_ + i;
        if (p < config_.sink_tokens) {
          sink_K_[h].row(p) = K_rows.row(i).segment(hk, config_.d_k);
          sink_V_[h].row(p) = V_new.row(i).segment(hv, config_.d_v);
        } else {
          store(h, p - config_.sink_tokens, K_rows.row(i).segment(hk, config_.d_k),
                V_new.row(i).segment(hv, config_.d_v));
        }
      }
    }
    total_ += r;
  }

  // --- Attention ------------------------------------------------------------------------------

  /// Rotates the queries (with RoPE) and runs `attend_rows`; every argument is checked.
  template <class DQ>
  void attend_checked(const Eigen::MatrixBase<DQ>& Q_new, Index heads,
                      const AttentionOptions<T>& options, const MultiHeadOptions<T>* per_head,
                      Matrix<T>& out) const {
    out.resize(Q_new.rows(), heads * config_.d_v);
    if (config_.rope) {
      Matrix<T> rotated = Q_new;
      detail::rope_kernel<T>(rotated, config_.d_k, total_ - rotated.rows(), *config_.rope,
                             rope_table_);
      attend_rows(rotated, heads, options, per_head, out);
    } else {
      attend_rows(Q_new, heads, options, per_head, out);
    }
  }

  /// The window a query sees: the cache's and the call's, whichever is narrower.
  std::optional<Index> effective_window(const AttentionOptions<T>& options) const {
    if (config_.window && options.window) return std::min(*config_.window, *options.window);
    return config_.window ? config_.window : options.window;
  }

  template <class DQ>
  Index check_queries(const char* function, const Eigen::MatrixBase<DQ>& Q,
                      const AttentionOptions<T>& options) const {
    const Index d_k = config_.d_k;
    if (Q.cols() == 0 || Q.cols() % (d_k * config_.kv_heads) != 0) {
      detail::fail(function, "Q_new has ", Q.cols(), " columns, not a positive multiple of ",
                   "kv_heads * d_k = ", config_.kv_heads * d_k, " (Q_new is ", detail::shape_of(Q),
                   ", d_k = ", d_k, ", kv_heads = ", config_.kv_heads, ")");
    }
    if (Q.rows() > total_) {
      detail::fail(function, "Q_new has ", Q.rows(), " rows but the cache has seen only ", total_,
                   " positions (the queries are the last rows appended; Q_new is ",
                   detail::shape_of(Q), ")");
    }
    if (options.causal == Causal::TopLeft) {
      detail::fail(function, "attend is causal with bottom-right alignment; Causal::TopLeft would ",
                   "hide the cache from the new queries");
    }
    detail::check_options(function, options, Q.rows(), size());
    const std::optional<Index> window = effective_window(options);
    const Index first_kept = total_ - recent_held();  // oldest kept recent position
    const Index first_needed = total_ - Q.rows() - (window ? *window : total_);
    if (recent_held() > 0 && first_kept > config_.sink_tokens && first_kept > first_needed) {
      detail::fail(function, Q.rows(), " queries with a window of ", window ? *window : 0,
                   " need the keys from position ", std::max<Index>(first_needed, 0),
                   " on, but the cache keeps positions ", first_kept, " .. ", total_ - 1,
                   " only (attend at most as many queries as the last append's rows)");
    }
    return Q.cols() / d_k;
  }

  /// One query head (or a stack of a group's query heads) against one contiguous block of keys.
  /// The tiled kernel once the n x m table would not fit in L2, or once the keys and values no
  /// longer do (more than 1 MiB: a decoding step then streams them tile by tile, reading each
  /// once, instead of materialising the scores); the materialised kernel otherwise.
  static void run_kernel(detail::ConstRef<T> q, detail::ConstRef<T> K, detail::ConstRef<T> V,
                         const AttentionOptions<T>& options, Matrix<T>& P,
                         Eigen::Ref<Matrix<T>> o) {
    const Index kv_bytes = K.rows() * (K.cols() + V.cols()) * static_cast<Index>(sizeof(T));
    if (detail::prefer_flash(q.rows(), K.rows()) || kv_bytes > (Index(1) << 20)) {
      detail::flash_kernel<T>(q, K, V, options, FlashTiles{}, o, nullptr);
    } else {
      detail::attention_kernel<T>(q, K, V, options, P, o);
    }
  }

  /// Scratch of one thread of the merged (sinks + ring) path.
  struct MergeScratch {
    Matrix<T> o_sinks, o_recent;
    Vector<T> lse_sinks, lse_recent;
    AttentionOptions<T> sink_block;  ///< per-head slopes: the sink block with head h's ALiBi
    AttentionOptions<T> ring_block;  ///< per-head slopes: the ring block with head h's slope
    bool ring_ready = false;         ///< ring_block holds this call's ring block
  };

  /// `options` for every query head, or (when `per_head` sets `alibi_slopes` or `sinks`) with query
  /// head h's slope and sink in place of the shared ones.
  void attend_rows(detail::ConstRef<T> Q, Index heads, const AttentionOptions<T>& options,
                   const MultiHeadOptions<T>* per_head, Matrix<T>& out) const {
    const Index n = Q.rows();
    if (n == 0) return;
    const Index d_k = config_.d_k;
    const Index d_v = config_.d_v;
    const Index group = heads / config_.kv_heads;
    const Index sinks = sinks_held();
    const Index recent = recent_held();
    const Index start = recent_start();
    const std::optional<Index> window = effective_window(options);
    const auto recent_K = [&](Index kv) {
      return K_[static_cast<std::size_t>(kv)].middleRows(start, recent);
    };
    const auto recent_V = [&](Index kv) {
      return V_[static_cast<std::size_t>(kv)].middleRows(start, recent);
    };
    const std::vector<T>* head_slopes =
        per_head && per_head->alibi_slopes ? &*per_head->alibi_slopes : nullptr;
    const std::vector<T>* head_sinks = per_head && per_head->sinks ? &*per_head->sinks : nullptr;
    const bool head_values = head_slopes || head_sinks;

    // 1. One query, no per-key tables, no sinks (the decoding hot path): every kept key up to the
    //    window is visible, so the group's query heads (adjacent in the row) are stacked into one
    //    group x d_k matrix and each key/value head is streamed once (`decode_kernel`). Per-head
    //    slopes or sinks differ within a group: they take path 2.
    if (n == 1 && sinks == 0 && !options.mask && !options.bias && !options.alibi_slope &&
        !head_values) {
      const Index visible = window ? std::min(recent, *window + 1) : recent;
      AttentionOptions<T> plain;
      plain.scale = detail::scale_of(options, d_k);
      plain.softcap = options.softcap;
      plain.sink = options.sink;
      detail::parallel_for<detail::DecodeScratch<T>>(
          config_.kv_heads, [&](Index kv, detail::DecodeScratch<T>& scratch) {
            const Eigen::Map<const Matrix<T>> q(Q.data() + kv * group * d_k, group, d_k);
            Eigen::Map<Matrix<T>> o(out.data() + kv * group * d_v, group, d_v);
            detail::decode_kernel<T>(q, recent_K(kv).bottomRows(visible),
                                     recent_V(kv).bottomRows(visible), plain, scratch, o);
          });
      return;
    }

    // 2. No sinks kept, or only sinks so far: one contiguous block of keys whose last row is the
    //    newest position, so bottom-right alignment gives each query its causal and window range.
    //    Per-head slopes and sinks: each thread's copy of the options, with head h's values.
    if (sinks == 0 || recent == 0) {
      AttentionOptions<T> block = options;
      block.causal = Causal::BottomRight;
      block.window = sinks == 0 ? window : std::nullopt;  // sinks stay visible whatever the window
      detail::parallel_for<detail::HeadScratch<T>>(heads, [&](Index h, detail::HeadScratch<T>& s) {
        const Index kv = h / group;
        const auto h_kv = static_cast<std::size_t>(kv);
        const detail::ConstRef<T> K = sinks == 0
                                          ? detail::ConstRef<T>(recent_K(kv))
                                          : detail::ConstRef<T>(sink_K_[h_kv].topRows(sinks));
        const detail::ConstRef<T> V = sinks == 0
                                          ? detail::ConstRef<T>(recent_V(kv))
                                          : detail::ConstRef<T>(sink_V_[h_kv].topRows(sinks));
        const AttentionOptions<T>& head_block =
            head_values ? detail::head_options(block, *per_head, h, s) : block;
        run_kernel(Q.middleCols(h * d_k, d_k), K, V, head_block, s.P, out.middleCols(h * d_v, d_v));
      });
      return;
    }

    // 3. Sinks and a ring: two blocks of keys, each through the tiled kernel with its log-sum-exp,
    //    merged exactly: with l_a = exp(lse_a), o = (l_a o_a + l_b o_b) / (l_a + l_b + exp(sink)),
    //    every exponential taken relative to M = max(lse_a, lse_b, sink).
    //    Sink block: positions 0 .. sinks-1, visible to query i (position P_i = total - n + i) iff
    //    j <= P_i; ALiBi becomes a bias -slope (P_i - j). Ring block: positions total - recent ..
    //    total - 1, the newest last: bottom-right alignment and the window as usual.
    //    Per-head slopes: each head adds its own ALiBi bias to a copy of the sink block and sets
    //    its slope in a (per-thread) copy of the ring block; per-head sinks enter the merge.
    const Index first_query = total_ - n;
    const auto add_sink_alibi = [&](Matrix<T>& bias, T slope) {
      for (Index i = 0; i < n; ++i) {
        for (Index j = 0; j < sinks; ++j) {
          bias(i, j) -= slope * static_cast<T>(std::abs(first_query + i - j));
        }
      }
    };
    AttentionOptions<T> sink_block;
    sink_block.scale = detail::scale_of(options, d_k);
    sink_block.softcap = options.softcap;
    sink_block.mask = Mask(n, sinks);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < sinks; ++j) (*sink_block.mask)(i, j) = j <= first_query + i;
    }
    if (options.mask) *sink_block.mask = *sink_block.mask && options.mask->leftCols(sinks);
    if (options.bias || options.alibi_slope || head_slopes) {
      sink_block.bias = Matrix<T>::Zero(n, sinks);
      if (options.bias) *sink_block.bias += options.bias->leftCols(sinks);
      if (options.alibi_slope) add_sink_alibi(*sink_block.bias, *options.alibi_slope);
    }
    AttentionOptions<T> ring_block = options;
    ring_block.causal = Causal::BottomRight;
    ring_block.window = window;
    ring_block.sink.reset();
    if (options.mask) ring_block.mask = Mask(options.mask->rightCols(recent));
    if (options.bias) ring_block.bias = Matrix<T>(options.bias->rightCols(recent));
    detail::parallel_for<MergeScratch>(heads, [&](Index h, MergeScratch& s) {
      const Index kv = h / group;
      const auto h_kv = static_cast<std::size_t>(kv);
      const auto i_h = static_cast<std::size_t>(h);
      const detail::ConstRef<T> q = Q.middleCols(h * d_k, d_k);
      const AttentionOptions<T>* sink_options = &sink_block;
      const AttentionOptions<T>* ring_options = &ring_block;
      if (head_slopes) {
        s.sink_block = sink_block;  // n x sinks tables: small
        add_sink_alibi(*s.sink_block.bias, (*head_slopes)[i_h]);
        sink_options = &s.sink_block;
        if (!s.ring_ready) {  // the n x recent tables are copied once per thread
          s.ring_block = ring_block;
          s.ring_ready = true;
        }
        s.ring_block.alibi_slope = (*head_slopes)[i_h];
        ring_options = &s.ring_block;
      }
      const std::optional<T> sink =
          head_sinks ? std::optional<T>((*head_sinks)[i_h]) : options.sink;
      s.o_sinks.resize(n, d_v);
      s.o_recent.resize(n, d_v);
      detail::flash_kernel<T>(q, sink_K_[h_kv].topRows(sinks), sink_V_[h_kv].topRows(sinks),
                              *sink_options, FlashTiles{}, s.o_sinks, &s.lse_sinks);
      detail::flash_kernel<T>(q, recent_K(kv), recent_V(kv), *ring_options, FlashTiles{},
                              s.o_recent, &s.lse_recent);
      constexpr T neg_inf = -std::numeric_limits<T>::infinity();
      for (Index i = 0; i < n; ++i) {
        const T a = s.lse_sinks(i);
        const T b = s.lse_recent(i);
        if (a == neg_inf && b == neg_inf) {  // no key visible: a zero row (a sink gives no value)
          out.row(i).segment(h * d_v, d_v).setZero();
          continue;
        }
        const T M = std::max({a, b, sink ? *sink : neg_inf});
        const T w_a = std::exp(a - M);
        const T w_b = std::exp(b - M);
        const T denominator = w_a + w_b + (sink ? std::exp(*sink - M) : T(0));
        out.row(i).segment(h * d_v, d_v) =
            (w_a * s.o_sinks.row(i) + w_b * s.o_recent.row(i)) / denominator;
      }
    });
  }

  KVCacheConfig<T> config_;
  detail::RopeTable rope_table_;            ///< RoPE frequencies and YaRN factor (unused without)
  std::vector<Matrix<T>> K_, V_;            ///< per key/value head: ring (2 R rows) or linear rows
  std::vector<Matrix<T>> sink_K_, sink_V_;  ///< per key/value head: sink_tokens rows
  Index ring_ = 0;                          ///< R, the ring's length (with a window)
  Index total_ = 0;                         ///< rows appended
};

}  // namespace attn

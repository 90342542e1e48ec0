#pragma once
/// \file heads.hpp
/// `attention_heads`: attention over several heads at once on (heads, tokens, features) tensors
/// (multi-head, grouped-query and multi-query attention), with options shared by every head and,
/// in a struct of their own, values that differ per query head (ALiBi slopes, sinks, masks,
/// biases).

#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "detail/paths.hpp"
#include "detail/score_rule.hpp"
#include "error.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"

namespace attn {

/// One boolean mask per query head: (heads, n, m), `true` = may attend.
using HeadMask = Eigen::Tensor<bool, 3, Eigen::RowMajor>;

/// Values that differ from one query head to the next. Each one, when set, replaces for head h
/// the shared value of its kind in `AttentionOptions` (and may not be set together with it).
template <class T>
struct HeadOptions {
  std::optional<std::vector<T>> alibi_slopes;  ///< one ALiBi slope per query head (finite)
  std::optional<std::vector<T>> sinks;         ///< one sink logit per query head (below +inf)
  std::optional<HeadMask> masks;               ///< (heads, n, m), true = may attend
  std::optional<Tensor3<T>> biases;            ///< (heads, n, m), added after the softcap

  /// Whether any per-head value is set.
  bool any() const { return alibi_slopes || sinks || masks || biases; }
};

namespace detail {

/// Checks per-head values for `heads` query heads, n queries and m keys: one per query head,
/// finite slopes, sinks below +inf, tables of the right shape, and none together with the shared
/// value of its kind.
template <class T>
void check_head_options(const char* function, const AttentionOptions<T>& shared,
                        const HeadOptions<T>& per_head, Index heads, Index n, Index m) {
  const auto check_list = [&](const std::optional<std::vector<T>>& values, const char* name,
                              bool shared_set, const char* shared_name, bool sink) {
    if (!values) return;
    if (static_cast<Index>(values->size()) != heads) {
      fail(function, name, " has ", values->size(), " entries but there are ", heads,
           " query heads");
    }
    if (shared_set) fail(function, "set ", name, " or ", shared_name, ", not both");
    for (const T v : *values) {
      if (sink ? (std::isnan(v) || v > std::numeric_limits<T>::max()) : !std::isfinite(v)) {
        fail(function, name, " holds ", v,
             sink ? ": sinks must be numbers below +inf" : ": slopes must be finite");
      }
    }
  };
  check_list(per_head.alibi_slopes, "alibi_slopes", shared.alibi_slope.has_value(), "alibi_slope",
             false);
  check_list(per_head.sinks, "sinks", shared.sink.has_value(), "sink", true);
  const auto check_table = [&](const auto& table, const char* name, bool shared_set,
                               const char* shared_name) {
    if (!table) return;
    if (table->dimension(0) != heads || table->dimension(1) != n || table->dimension(2) != m) {
      fail(function, name, " is ", dims_of(*table), " but there are ", heads,
           " query heads and the scores are ", n, " x ", m, " (heads x queries x keys)");
    }
    if (shared_set) fail(function, "set ", name, " or ", shared_name, ", not both");
  };
  check_table(per_head.masks, "masks", shared.mask.has_value(), "mask");
  check_table(per_head.biases, "biases", shared.bias.has_value(), "bias");
}

/// The rule of query head h: `shared` (the whole call, or one block of its keys) with head h's
/// values from `per_head`, whose (heads, n, table_cols) tables are read from the block's columns.
template <class T>
ScoreRule<T> head_rule(const ScoreRule<T>& shared, const HeadOptions<T>& per_head, Index h) {
  ScoreRule<T> rule = shared;
  const auto i = static_cast<std::size_t>(h);
  const Index width = shared.table_cols;
  const Index table = h * shared.n * width + shared.column0;
  if (per_head.alibi_slopes) rule.alibi_slope = (*per_head.alibi_slopes)[i];
  if (per_head.sinks) rule.sink = (*per_head.sinks)[i];
  if (per_head.masks) rule.mask = {per_head.masks->data() + table, width};
  if (per_head.biases) rule.bias = {per_head.biases->data() + table, width};
  return rule;
}

/// Checks (h_q, n, d), (h_kv, m, d), (h_kv, m, d_v) head tensors and the options.
template <class T>
void check_heads(const char* function, const Tensor3<T>& Q, const Tensor3<T>& K,
                 const Tensor3<T>& V, const AttentionOptions<T>& options,
                 const HeadOptions<T>& per_head) {
  const auto mismatch = [&](const char* what) {
    fail(function, what, " (Q is ", dims_of(Q), ", K is ", dims_of(K), ", V is ", dims_of(V),
         "; heads x tokens x features)");
  };
  if (K.dimension(0) == 0 || Q.dimension(0) % K.dimension(0) != 0) {
    mismatch("the query heads must be a multiple of the key/value heads (at least 1)");
  }
  if (V.dimension(0) != K.dimension(0)) mismatch("K and V must have the same number of heads");
  if (V.dimension(1) != K.dimension(1)) mismatch("K and V must have the same number of tokens");
  if (Q.dimension(2) == 0) mismatch("Q has 0 features: d_k must be at least 1");
  if (K.dimension(2) != Q.dimension(2)) mismatch("Q and K must have the same number of features");
  check_options(function, options, Q.dimension(1), K.dimension(1));
  check_head_options(function, options, per_head, Q.dimension(0), Q.dimension(1), K.dimension(1));
}

/// The query heads [0, heads) over their key/value heads (head h reads kv head h / group), by the
/// rule `shared` with each head's values from `per_head`, in parallel over heads. Each head runs
/// on the path `choose_path` picks for it; with one query and a rule of key ranges and scalars
/// only, the query heads of a group are stacked and each key/value head is streamed once by the
/// decoding kernel. Shape contract: q(h) n x d_k, k(kv) m x d_k, v(kv) m x d_v, o(h) n x d_v
/// (functions returning views); the heads of a group must be adjacent rows in memory for the
/// stacked path (`stacked_q(kv)` g x d_k, `stacked_o(kv)` g x d_v).
template <class T, class QHead, class KHead, class VHead, class OHead, class QGroup, class OGroup>
void heads_kernel(Index heads, Index group, const ScoreRule<T>& shared,
                  const HeadOptions<T>& per_head, Index d_k, Index d_v, const QHead& q,
                  const KHead& k, const VHead& v, const OHead& o, const QGroup& stacked_q,
                  const OGroup& stacked_o) {
  if (choose_path(shared, d_k, d_v, false) == Path::Decode && !per_head.any()) {
    decode_groups<T>(heads / group, shared, stacked_q, k, v, stacked_o);
    return;
  }
  parallel_for<PathScratch<T>>(heads, [&](Index h, PathScratch<T>& scratch) {
    const ScoreRule<T> rule = per_head.any() ? head_rule(shared, per_head, h) : shared;
    run_path<T>(choose_path(rule, d_k, d_v, false), q(h), k(h / group), v(h / group), rule, scratch,
                o(h), nullptr);
  });
}

}  // namespace detail

/// Attention over several heads at once, into caller storage.
/// \param Q         (h_q, n, d_k): query heads
/// \param K         (h_kv, m, d_k): key heads, with h_q % h_kv == 0
/// \param V         (h_kv, m, d_v): value heads
/// \param options   applied to every head (mask and bias are n x m, shared by the heads)
/// \param per_head  values that differ per query head: slopes, sinks, (h_q, n, m) masks and biases
/// \param out       resized to (h_q, n, d_v) (no allocation when it already has that shape)
/// \throws shape_error on mismatched shapes or invalid options.
/// \note Query head h uses key/value head h / (h_q / h_kv): multi-head attention when
///       h_kv == h_q, grouped-query attention when fewer, multi-query when h_kv == 1. Keys and
///       values are never copied per query head. Heads run in parallel.
template <class T>
void attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                     const AttentionOptions<detail::identity_t<T>>& options,
                     const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out) {
  const char* function = "attention_heads";
  detail::check_heads(function, Q, K, V, options, per_head);
  const Index heads = Q.dimension(0);
  const Index n = Q.dimension(1);
  const Index d_k = Q.dimension(2);
  const Index d_v = V.dimension(2);
  const Index group = heads / K.dimension(0);
  if (out.dimension(0) != heads || out.dimension(1) != n || out.dimension(2) != d_v) {
    out.resize(heads, n, d_v);
  }
  const detail::ScoreRule<T> shared = detail::make_rule(options, n, K.dimension(1), d_k);
  detail::heads_kernel<T>(
      heads, group, shared, per_head, d_k, d_v, [&](Index h) { return detail::slice(Q, h); },
      [&](Index kv) { return detail::slice(K, kv); },
      [&](Index kv) { return detail::slice(V, kv); },
      [&](Index h) { return detail::slice(out, h); },
      [&](Index kv) {
        return Eigen::Map<const Matrix<T>>(Q.data() + kv * group * d_k, group, d_k);
      },
      [&](Index kv) { return Eigen::Map<Matrix<T>>(out.data() + kv * group * d_v, group, d_v); });
}

/// `attention_heads` with shared options only, into caller storage.
template <class T>
void attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                     const AttentionOptions<detail::identity_t<T>>& options, Tensor3<T>& out) {
  attention_heads(Q, K, V, options, HeadOptions<T>{}, out);
}

/// Attention over several heads at once (see the overload writing into caller storage).
/// \returns (h_q, n, d_v)
template <class T>
Tensor3<T> attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                           const AttentionOptions<detail::identity_t<T>>& options = {},
                           const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  Tensor3<T> out;
  attention_heads(Q, K, V, options, per_head, out);
  return out;
}

/// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile time
/// rather than cut down: per-head values go in `HeadOptions`, padding in a mask.
template <class T, class Options, class... Rest, detail::if_extended_options<Options, T> = 0>
Tensor3<T> attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                           const Options& options, Rest&&...) = delete;

}  // namespace attn

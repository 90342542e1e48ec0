#pragma once
/// \file heads.hpp
/// `attention_heads`: attention over several heads at once on (heads, tokens, features) tensors
/// (multi-head, grouped-query and multi-query attention), with options shared by every head and,
/// in a struct of their own, values that differ per query head (ALiBi slopes, sinks, masks,
/// biases); and its gradients, `attention_heads_backward`.

#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "detail/backward_kernels.hpp"
#include "detail/paths.hpp"
#include "detail/score_rule.hpp"
#include "error.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"
#include "variant.hpp"

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
  /// \returns true when at least one of the four fields is set
  bool any() const { return alibi_slopes || sinks || masks || biases; }
};

/// Gradients of `attention_heads` (`attention_heads_backward`): of the loss L, given dO = dL/dO.
template <class T>
struct HeadGrads {
  Tensor3<T> dQ;          ///< (heads, n, d_k)
  Tensor3<T> dK;          ///< (kv_heads, m, d_k): a key head's sum over its query heads
  Tensor3<T> dV;          ///< (kv_heads, m, d_v): likewise
  Matrix<T> dbias;        ///< n x m when `options.bias` is set (summed over the heads), else empty
  T dsink = T(0);         ///< when `options.sink` is set (summed over the heads), else 0
  Tensor3<T> dbiases;     ///< (heads, n, m) when `per_head.biases` is set, else empty
  std::vector<T> dsinks;  ///< heads entries when `per_head.sinks` is set, else empty
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

/// Checks (heads, n, d), (kv_heads, m, d), (kv_heads, m, d_v) head tensors: heads a multiple of
/// kv_heads, K and V alike in heads and tokens, d_k >= 1 and the same in Q and K. `tokens` names
/// the middle axis in the message.
template <class T, class S>
void check_head_shapes(const char* function, const Tensor3<T>& Q, const Tensor3<S>& K,
                       const Tensor3<S>& V, const char* tokens = "tokens") {
  const auto mismatch = [&](const char* what) {
    fail(function, what, " (Q is ", dims_of(Q), ", K is ", dims_of(K), ", V is ", dims_of(V),
         "; heads x ", tokens, " x features)");
  };
  if (K.dimension(0) == 0 || Q.dimension(0) % K.dimension(0) != 0) {
    mismatch("the query heads must be a multiple of the key/value heads (at least 1)");
  }
  if (V.dimension(0) != K.dimension(0)) mismatch("K and V must have the same number of heads");
  if (V.dimension(1) != K.dimension(1)) mismatch("K and V must have the same number of tokens");
  if (Q.dimension(2) == 0) mismatch("Q has 0 features: d_k must be at least 1");
  if (K.dimension(2) != Q.dimension(2)) mismatch("Q and K must have the same number of features");
}

/// Checks (heads, n, d), (kv_heads, m, d), (kv_heads, m, d_v) head tensors and the options.
template <class T, class S>
void check_heads(const char* function, const Tensor3<T>& Q, const Tensor3<S>& K,
                 const Tensor3<S>& V, const AttentionOptions<T>& options,
                 const HeadOptions<T>& per_head) {
  check_head_shapes(function, Q, K, V);
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
/// `lse(h)` (a function returning a pointer to n entries, or null) receives each query head's
/// log-sum-exp, sink included; the stacked decoding path runs only when no head wants it.
template <class T, class QHead, class KHead, class VHead, class OHead, class QGroup, class OGroup,
          class LseHead>
void heads_kernel(Index heads, Index group, const ScoreRule<T>& shared,
                  const HeadOptions<T>& per_head, Index d_k, Index d_v, const QHead& q,
                  const KHead& k, const VHead& v, const OHead& o, const QGroup& stacked_q,
                  const OGroup& stacked_o, const LseHead& lse) {
  if (choose_path(shared, d_k, d_v, false) == Path::Decode && !per_head.any() &&
      (heads == 0 || lse(0) == nullptr)) {
    decode_groups<T>(heads / group, shared, stacked_q, k, v, stacked_o);
    return;
  }
  const double flops = double(heads) * attention_flops(shared.n, shared.m, d_k, d_v);
  parallel_for<PathScratch<T>>(heads, flops, [&](Index h, PathScratch<T>& scratch) {
    const ScoreRule<T> rule = per_head.any() ? head_rule(shared, per_head, h) : shared;
    run_path<T>(choose_path(rule, d_k, d_v, false), q(h), k(h / group), v(h / group), rule, scratch,
                o(h), lse(h));
  });
}

/// `heads_kernel` without the log-sum-exp.
template <class T, class QHead, class KHead, class VHead, class OHead, class QGroup, class OGroup>
void heads_kernel(Index heads, Index group, const ScoreRule<T>& shared,
                  const HeadOptions<T>& per_head, Index d_k, Index d_v, const QHead& q,
                  const KHead& k, const VHead& v, const OHead& o, const QGroup& stacked_q,
                  const OGroup& stacked_o) {
  heads_kernel<T>(heads, group, shared, per_head, d_k, d_v, q, k, v, o, stacked_q, stacked_o,
                  [](Index) -> T* { return nullptr; });
}

/// Head kv of a (heads, m, d) tensor of keys or values as the kernels read it: a view of T, or a
/// `StoredBlock` of `Eigen::half` / `Eigen::bfloat16` rows.
template <class T, class S>
auto kv_slice(const Tensor3<S>& t, Index kv) {
  if constexpr (std::is_same_v<S, T>) {
    return slice(t, kv);
  } else {
    const Index m = t.dimension(1);
    const Index d = t.dimension(2);
    return StoredBlock<codec_for_t<S>, T>(t.data() + kv * m * d, m, d, d, nullptr);
  }
}

/// The forward of `attention_heads`, checks included (`check_heads`, errors naming `function`):
/// Q (heads, n, d_k) of T, K (kv_heads, m, d_k) and V (kv_heads, m, d_v) of T, `Eigen::half` or
/// `Eigen::bfloat16` (read through `kv_slice`), by the rule of `options` with each head's values
/// from `per_head` (`heads_kernel`). `out` is resized to (heads, n, d_v) when its shape differs;
/// when `lse` is not null it is resized to heads x n, row h head h's log-sum-exps (sink included),
/// and one query then never takes the stacked decoding path.
template <class T, class S>
void heads_forward(const char* function, const Tensor3<T>& Q, const Tensor3<S>& K,
                   const Tensor3<S>& V, const AttentionOptions<T>& options,
                   const HeadOptions<T>& per_head, Tensor3<T>& out, Matrix<T>* lse) {
  check_heads(function, Q, K, V, options, per_head);
  const Index heads = Q.dimension(0);
  const Index n = Q.dimension(1);
  const Index d_k = Q.dimension(2);
  const Index d_v = V.dimension(2);
  const Index group = heads / K.dimension(0);
  if (out.dimension(0) != heads || out.dimension(1) != n || out.dimension(2) != d_v) {
    out.resize(heads, n, d_v);
  }
  if (lse) lse->resize(heads, n);
  const ScoreRule<T> shared = make_rule(options, n, K.dimension(1), d_k);
  heads_kernel<T>(
      heads, group, shared, per_head, d_k, d_v, [&](Index h) { return slice(Q, h); },
      [&](Index kv) { return kv_slice<T>(K, kv); }, [&](Index kv) { return kv_slice<T>(V, kv); },
      [&](Index h) { return slice(out, h); },
      [&](Index kv) {
        return Eigen::Map<const Matrix<T>>(Q.data() + kv * group * d_k, group, d_k);
      },
      [&](Index kv) { return Eigen::Map<Matrix<T>>(out.data() + kv * group * d_v, group, d_v); },
      [&](Index h) -> T* { return lse ? lse->data() + h * n : nullptr; });
}

/// The query heads [0, heads) with a variant, the variant bound to item `batch`, the head and its
/// key/value head (h / group). One query without tables: the decoding kernel over stacked groups,
/// as `heads_kernel`. Otherwise each head on the tiled kernel: in parallel over heads when there
/// are as many as threads, else head after head with the kernel parallel over query blocks (the
/// same bits either way). Shape contract as `heads_kernel`.
/// The checking mode (`checked`) checks every head's tiles before any is computed.
template <class T, class Variant, class QHead, class KHead, class VHead, class OHead, class QGroup,
          class OGroup, class LseHead>
void heads_variant_kernel(Index heads, Index group, const ScoreRule<T>& shared,
                          const HeadOptions<T>& per_head, const Variant& variant, Index batch,
                          const QHead& q, const KHead& k, const VHead& v, const OHead& o,
                          const QGroup& stacked_q, const OGroup& stacked_o, const LseHead& lse) {
  const auto rule_of = [&](Index h) {
    return per_head.any() ? head_rule(shared, per_head, h) : shared;
  };
  const auto bound_of = [&](Index h) {
    return BoundVariant<Variant>{&variant, batch, h, h / group};
  };
  if constexpr (is_checked<Variant>::value) {
    for (Index h = 0; h < heads; ++h) check_kernel_tiles<T>(rule_of(h), FlashTiles{}, bound_of(h));
  }
  // One query: the query heads of each group stacked over their key/value head, as without a
  // variant (the decoding kernel applies it entry by entry).
  if (heads > 0 && lse(0) == nullptr && !per_head.any() &&
      choose_path(shared, q(0).cols(), v(0).cols(), false) == Path::Decode) {
    decode_groups<T>(heads / group, shared, stacked_q, k, v, stacked_o,
                     BoundVariant<Variant>{&variant, batch, 0, 0});
    return;
  }
  if (heads < num_threads()) {
    for (Index h = 0; h < heads; ++h) {
      flash_kernel_on<T>(q(h), kernel_block<T>(k(h / group)), kernel_block<T>(v(h / group)),
                         rule_of(h), FlashTiles{}, o(h), lse(h), bound_of(h));
    }
    return;
  }
  const double flops =
      double(heads) * attention_flops(shared.n, shared.m, q(0).cols(), v(0).cols());
  parallel_for<FlashScratch<T>>(heads, flops, [&](Index h, FlashScratch<T>& scratch) {
    flash_blocks<T>(q(h), kernel_block<T>(k(h / group)), kernel_block<T>(v(h / group)), rule_of(h),
                    FlashTiles{}, scratch, o(h), lse(h), bound_of(h));
  });
}

/// `heads_forward` with a variant (`heads_variant_kernel`).
template <class T, class S, class Variant>
void heads_forward_variant(const char* function, const Tensor3<T>& Q, const Tensor3<S>& K,
                           const Tensor3<S>& V, const Variant& variant,
                           const AttentionOptions<T>& options, const HeadOptions<T>& per_head,
                           Tensor3<T>& out) {
  check_variant<Variant, T>();
  check_heads(function, Q, K, V, options, per_head);
  const Index heads = Q.dimension(0);
  const Index n = Q.dimension(1);
  const Index d_v = V.dimension(2);
  if (out.dimension(0) != heads || out.dimension(1) != n || out.dimension(2) != d_v) {
    out.resize(heads, n, d_v);
  }
  const Index d_k = Q.dimension(2);
  const Index group = heads / K.dimension(0);
  const ScoreRule<T> shared = make_rule(options, n, K.dimension(1), d_k);
  require_variant_positions(function, shared.q_position, n, 0, shared.m);
  heads_variant_kernel<T>(
      heads, group, shared, per_head, variant, 0, [&](Index h) { return slice(Q, h); },
      [&](Index kv) { return kv_slice<T>(K, kv); }, [&](Index kv) { return kv_slice<T>(V, kv); },
      [&](Index h) { return slice(out, h); },
      [&](Index kv) {
        return Eigen::Map<const Matrix<T>>(Q.data() + kv * group * d_k, group, d_k);
      },
      [&](Index kv) { return Eigen::Map<Matrix<T>>(out.data() + kv * group * d_v, group, d_v); },
      [](Index) -> T* { return nullptr; });
}

}  // namespace detail

/// Attention over several heads at once, into caller storage.
/// \param Q         (heads, n, d_k): query heads
/// \param K         (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V         (kv_heads, m, d_v): value heads
/// \param options   applied to every head (mask and bias are n x m, shared by the heads)
/// \param per_head  values that differ per query head: slopes, sinks, (heads, n, m) masks and
///                  biases
/// \param out       resized to (heads, n, d_v) (no allocation when it already has that shape)
/// \throws shape_error on mismatched shapes or invalid options.
/// \note Query head h uses key/value head h / group (group = heads / kv_heads): multi-head
///       attention when kv_heads == heads, grouped-query attention when fewer, multi-query when
///       kv_heads == 1. Keys and values are never copied per query head. Heads run in parallel.
template <class T>
void attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                     const AttentionOptions<detail::identity_t<T>>& options,
                     const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out) {
  detail::heads_forward<T>("attention_heads", Q, K, V, options, per_head, out, nullptr);
}

/// `attention_heads` with keys and values in `Eigen::half` or `Eigen::bfloat16` (queries and the
/// result in T), into caller storage: what a prefill over a `KVCache` kept in `KVStorage::Float16`
/// or `BFloat16` computes. The stored values are widened to T in the kernels (the decoding kernel's
/// registers, the tiled kernel's packing and value tiles; the small materialised problems widen a
/// copy of each head), so the result is exactly that of the widened tensors.
/// \param Q         (heads, n, d_k): query heads, of T
/// \param K         (kv_heads, m, d_k): key heads, in `Eigen::half` or `Eigen::bfloat16`
/// \param V         (kv_heads, m, d_v): value heads, of K's scalar type
/// \param options   applied to every head (mask and bias are n x m, shared by the heads)
/// \param per_head  values that differ per query head
/// \param out       resized to (heads, n, d_v)
template <class T, class S, std::enable_if_t<detail::is_narrow_scalar_v<S>, int> = 0>
void attention_heads(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                     const AttentionOptions<detail::identity_t<T>>& options,
                     const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out) {
  detail::heads_forward<T>("attention_heads", Q, K, V, options, per_head, out, nullptr);
}

/// `attention_heads` with `Eigen::half` or `Eigen::bfloat16` keys and values, returning
/// (heads, n, d_v).
/// \param Q         (heads, n, d_k): query heads, of T
/// \param K         (kv_heads, m, d_k): key heads, in `Eigen::half` or `Eigen::bfloat16`
/// \param V         (kv_heads, m, d_v): value heads, of K's scalar type
/// \param options   applied to every head (mask and bias are n x m, shared by the heads)
/// \param per_head  values that differ per query head
/// \returns (heads, n, d_v)
template <class T, class S, std::enable_if_t<detail::is_narrow_scalar_v<S>, int> = 0>
Tensor3<T> attention_heads(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                           const AttentionOptions<detail::identity_t<T>>& options = {},
                           const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  Tensor3<T> out;
  attention_heads(Q, K, V, options, per_head, out);
  return out;
}

/// `attention_heads` that also returns each query head's log-sum-exp (what
/// `attention_heads_backward` takes to skip the forward), into caller storage.
/// \param Q            (heads, n, d_k): query heads
/// \param K            (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V            (kv_heads, m, d_v): value heads
/// \param options      applied to every head (mask and bias are n x m, shared by the heads)
/// \param per_head     values that differ per query head
/// \param out          resized to (heads, n, d_v)
/// \param log_sum_exp  resized to heads x n: row h holds head h's `lse_i = log(sum_j exp(z_ij))`,
///                     the sink included when set (-inf for a query that may attend nothing)
/// \note As the overload without it, but one query never takes the stacked decoding path.
template <class T>
void attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                     const AttentionOptions<detail::identity_t<T>>& options,
                     const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out,
                     Matrix<T>& log_sum_exp) {
  detail::heads_forward<T>("attention_heads", Q, K, V, options, per_head, out, &log_sum_exp);
}

/// `attention_heads` with shared options only, into caller storage.
/// \param Q        (heads, n, d_k): query heads
/// \param K        (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V        (kv_heads, m, d_v): value heads
/// \param options  applied to every head (mask and bias are n x m, shared by the heads)
/// \param out      resized to (heads, n, d_v)
template <class T>
void attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                     const AttentionOptions<detail::identity_t<T>>& options, Tensor3<T>& out) {
  attention_heads(Q, K, V, options, HeadOptions<T>{}, out);
}

/// Attention over several heads at once (see the overload writing into caller storage).
/// \param Q         (heads, n, d_k): query heads
/// \param K         (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V         (kv_heads, m, d_v): value heads
/// \param options   applied to every head (mask and bias are n x m, shared by the heads)
/// \param per_head  values that differ per query head
/// \returns (heads, n, d_v)
template <class T>
Tensor3<T> attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                           const AttentionOptions<detail::identity_t<T>>& options = {},
                           const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  Tensor3<T> out;
  attention_heads(Q, K, V, options, per_head, out);
  return out;
}

/// Attention over several heads with a variant (variant.hpp, docs/variants.md), into caller
/// storage: as `flash_attention` with a variant, head by head, the variant seeing query head h as
/// `ScoreAt::head` and its key/value head h / group as `kv_head` (`batch` 0). One query without
/// tables runs the decoding kernel (the query heads of a group stacked), the rest the tiled one.
/// \param Q         (heads, n, d_k): query heads, of T
/// \param K         (kv_heads, m, d_k): key heads, of T, `Eigen::half` or `Eigen::bfloat16`
/// \param V         (kv_heads, m, d_v): value heads, of K's scalar type
/// \param variant   a variant (`is_variant_v`); `checked(variant)` checks every head's tiles first
/// \param options   applied to every head (mask and bias are n x m, shared by the heads)
/// \param per_head  values that differ per query head
/// \param out       resized to (heads, n, d_v)
/// \throws shape_error on mismatched shapes or invalid options.
template <class T, class S, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
void attention_heads(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                     const Variant& variant, const AttentionOptions<detail::identity_t<T>>& options,
                     const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out) {
  detail::heads_forward_variant<T>("attention_heads", Q, K, V, variant, options, per_head, out);
}

/// Attention over several heads with a variant (see the overload writing into caller storage).
/// \param Q         (heads, n, d_k): query heads, of T
/// \param K         (kv_heads, m, d_k): key heads, of T, `Eigen::half` or `Eigen::bfloat16`
/// \param V         (kv_heads, m, d_v): value heads, of K's scalar type
/// \param variant   a variant (`is_variant_v`)
/// \param options   applied to every head
/// \param per_head  values that differ per query head
/// \returns (heads, n, d_v)
template <class T, class S, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
Tensor3<T> attention_heads(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                           const Variant& variant,
                           const AttentionOptions<detail::identity_t<T>>& options = {},
                           const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  Tensor3<T> out;
  attention_heads(Q, K, V, variant, options, per_head, out);
  return out;
}

/// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile time
/// rather than cut down: per-head values go in `HeadOptions`, padding in a mask.
template <class T, class Options, class... Rest, detail::if_extended_options<Options, T> = 0>
Tensor3<T> attention_heads(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                           const Options& options, Rest&&...) = delete;

namespace detail {

/// Runs `body(i, scratch)` for i in [0, count): as `parallel_for` when there are at least as many
/// tasks as threads, else one task after the other on this thread, so that the kernels inside
/// use the threads instead. A body whose result depends only on i (its kernels being
/// deterministic, and no Eigen product outside them) gives the same bits either way.
template <class Scratch, class Body>
void tasks_or_kernels(Index count, Body&& body) {
  if (count >= num_threads()) {
    parallel_for<Scratch>(count, body);
    return;
  }
  Scratch scratch{};
  for (Index i = 0; i < count; ++i) body(i, scratch);
}

/// Per-thread working memory of the heads' backward.
template <class T>
struct HeadsBackwardScratch {
  AttentionGrads<T> head;  ///< one query head's gradients
  Matrix<T> O;             ///< its output (when the forward runs again)
  Vector<T> lse;           ///< its log-sum-exp
};

/// Checks dO (heads, n, d_v) and, when given, the forward's O (heads, n, d_v) and log-sum-exp
/// heads x n.
template <class T>
void check_heads_backward(const char* function, const Tensor3<T>& Q, const Tensor3<T>& V,
                          const Tensor3<T>& dO, const Tensor3<T>* O, const Matrix<T>* lse) {
  const auto require = [&](const char* name, const Tensor3<T>& t) {
    if (t.dimension(0) != Q.dimension(0) || t.dimension(1) != Q.dimension(1) ||
        t.dimension(2) != V.dimension(2)) {
      fail(function, name, " is ", dims_of(t), " but Q is ", dims_of(Q), " and V is ", dims_of(V),
           ": it must be (query heads, queries, d_v)");
    }
  };
  require("dO", dO);
  if (O) require("O", *O);
  if (lse && (lse->rows() != Q.dimension(0) || lse->cols() != Q.dimension(1))) {
    fail(function, "log_sum_exp is ", shape_of(*lse), " but Q is ", dims_of(Q),
         ": it must be query heads x queries");
  }
}

/// The backward of key/value head kv's query heads h = kv group .. kv group + group - 1, in head
/// order, each through `backward_kernel`: dK and dV (views of kv's rows) become the sum of the
/// heads' in that order; `head_done(h, grads)` receives each head's own gradients (dQ, dbias,
/// dsink) in that order. `forward(h, lse)` gives the forward's output of head h (and fills its
/// log-sum-exp into lse), or nothing, and the forward runs again (`forward_for_backward`, on the backward's path, with the
/// rule's block mask). `variant` is bound to each head (its `head` and `kv_head` set here);
/// `dparams(h)` is where head h's parameter gradient goes (or null). Views: q(h), dO(h) n x d_k and
/// n x d_v; k, v m x d_k and m x d_v.
template <class T, class Variant, class QOf, class DOOf, class RuleOf, class ForwardOf, class Done,
          class ParamsOf>
void group_backward(Index kv, Index group, ConstRef<T> k, ConstRef<T> v, const QOf& q,
                    const DOOf& dO, const RuleOf& rule_of, const ForwardOf& forward,
                    BoundVariant<Variant> variant, HeadsBackwardScratch<T>& s,
                    Eigen::Ref<Matrix<T>> dK, Eigen::Ref<Matrix<T>> dV, const Done& head_done,
                    const ParamsOf& dparams) {
  const Index d_k = k.cols();
  const Index d_v = v.cols();
  for (Index h = kv * group; h < (kv + 1) * group; ++h) {
    const ScoreRule<T> rule = rule_of(h);
    const Path path = backward_path(rule, d_k, d_v);
    const ConstRef<T> q_h = q(h);
    const Index n = q_h.rows();
    variant.head = h;
    variant.kv_head = kv;
    if (const std::optional<ConstRef<T>> O = forward(h, s.lse)) {
      backward_kernel<T>(q_h, k, v, *O, s.lse, dO(h), rule, path, BackwardTiles{}, s.head, variant,
                         dparams(h));
    } else {
      s.O.resize(n, d_v);
      with_block_mask<T>(rule, n, k.rows(), variant, [&](const auto& b) {
        forward_for_backward<T>(q_h, k, v, rule, path, s.O, s.lse, b);
        backward_kernel<T>(q_h, k, v, s.O, s.lse, dO(h), rule, path, BackwardTiles{}, s.head, b,
                           dparams(h));
      });
    }
    if (h == kv * group) {
      dK = s.head.dK;
      dV = s.head.dV;
    } else {
      dK += s.head.dK;
      dV += s.head.dV;
    }
    head_done(h, s.head);
  }
}

/// The backward of query heads over their key/value heads by the rule `shared` with each head's
/// values from `per_head`; the forward's output O and log-sum-exp when given, else the forward
/// runs again per head (`forward_for_backward`, on the backward's path). Shape contract as
/// `attention_heads_backward`.
///
/// Passes:
///   1. Key/value head kv (a task; in parallel when there are enough of them) runs its query
///      heads h = kv g ... kv g + g - 1 in head order through `backward_kernel`: dQ_h is written
///      as it is, dK_kv and dV_kv are the sum over h in that order, a shared bias's gradient is
///      summed likewise into kv's part, per-head dbias and dsink are written as they are.
///   2. The shared bias's parts are summed in kv order, the shared sink's per-head gradients in
///      head order. Every sum has a fixed order: the same bits for any thread count.
/// With a variant (not null), head h sees it bound to head h and key/value head kv (the forward
/// runs again on the tiled kernel); a learnable variant's gradient goes into `dparams` (when not
/// null) as the sum of the heads' in head order.
template <class T, class Variant = NoVariant>
void heads_backward_kernel(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                           const Tensor3<T>* O, const Matrix<T>* lse, const Tensor3<T>& dO,
                           const ScoreRule<T>& shared, const HeadOptions<T>& per_head,
                           HeadGrads<T>& grads, const Variant* variant = nullptr,
                           typename GradientOf<Variant>::type* dparams = nullptr) {
  using Gradient = typename GradientOf<Variant>::type;
  const Index heads = Q.dimension(0);
  const Index kv_heads = K.dimension(0);
  const Index group = heads / kv_heads;
  const Index n = Q.dimension(1);
  const Index m = K.dimension(1);
  const Index d_k = Q.dimension(2);
  const Index d_v = V.dimension(2);
  grads.dQ.resize(heads, n, d_k);
  grads.dK.resize(kv_heads, m, d_k);
  grads.dV.resize(kv_heads, m, d_v);
  std::vector<Matrix<T>> dbias_parts(shared.bias ? static_cast<std::size_t>(kv_heads) : 0);
  std::vector<T> dsink_heads(static_cast<std::size_t>(heads), T(0));
  std::vector<Gradient> dparams_heads(dparams ? static_cast<std::size_t>(heads) : 0);
  if (per_head.biases) {
    grads.dbiases.resize(heads, n, m);
  } else {
    grads.dbiases.resize(0, 0, 0);
  }

  // 1. Each key/value head over its query heads, in head order.
  tasks_or_kernels<HeadsBackwardScratch<T>>(kv_heads, [&](Index kv, HeadsBackwardScratch<T>& s) {
    Matrix<T>* dbias_part = shared.bias ? &dbias_parts[static_cast<std::size_t>(kv)] : nullptr;
    group_backward<T>(
        kv, group, slice(K, kv), slice(V, kv), [&](Index h) -> ConstRef<T> { return slice(Q, h); },
        [&](Index h) -> ConstRef<T> { return slice(dO, h); },
        [&](Index h) { return per_head.any() ? head_rule(shared, per_head, h) : shared; },
        [&](Index h, Vector<T>& lse_h) -> std::optional<ConstRef<T>> {
          if (!O) return std::nullopt;
          lse_h = lse->row(h).transpose();
          return ConstRef<T>(slice(*O, h));
        },
        BoundVariant<Variant>{variant, 0, 0, 0}, s, slice(grads.dK, kv), slice(grads.dV, kv),
        [&](Index h, const AttentionGrads<T>& head) {
          slice(grads.dQ, h) = head.dQ;
          if (per_head.biases) slice(grads.dbiases, h) = head.dbias;
          if (dbias_part) {
            if (h == kv * group) {
              *dbias_part = head.dbias;
            } else {
              *dbias_part += head.dbias;
            }
          }
          dsink_heads[static_cast<std::size_t>(h)] = head.dsink;
        },
        [&](Index h) -> Gradient* {
          return dparams ? &dparams_heads[static_cast<std::size_t>(h)] : nullptr;
        });
  });

  // 2. The shared values' gradients, in a fixed order.
  if (shared.bias) {
    grads.dbias = dbias_parts.front();
    for (std::size_t p = 1; p < dbias_parts.size(); ++p) grads.dbias += dbias_parts[p];
  } else {
    grads.dbias.resize(0, 0);
  }
  grads.dsink = T(0);
  if (shared.sink) {
    for (const T d : dsink_heads) grads.dsink += d;
  }
  if (per_head.sinks) {
    grads.dsinks = dsink_heads;
  } else {
    grads.dsinks.clear();
  }
  if constexpr (variant_learns_v<Variant>) {
    if (dparams) {
      *dparams = variant->zero_gradient();
      for (const Gradient& g : dparams_heads) *dparams += g;
    }
  }
}

/// `attention_heads_backward` (both forms), checks included: O and lse null when the forward
/// runs again.
template <class T>
void heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                    const Tensor3<T>* O, const Matrix<T>* lse, const Tensor3<T>& dO,
                    const AttentionOptions<T>& options, const HeadOptions<T>& per_head,
                    HeadGrads<T>& grads) {
  const char* function = "attention_heads_backward";
  check_heads(function, Q, K, V, options, per_head);
  check_heads_backward<T>(function, Q, V, dO, O, lse);
  const ScoreRule<T> shared = make_rule(options, Q.dimension(1), K.dimension(1), Q.dimension(2));
  heads_backward_kernel<T>(Q, K, V, O, lse, dO, shared, per_head, grads);
}

/// `attention_heads_backward` with a variant, checks included; its parameter gradient into
/// `dparams` when not null.
template <class T, class Variant>
void heads_backward_variant(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                            const Tensor3<T>& dO, const Variant& variant,
                            const AttentionOptions<T>& options, const HeadOptions<T>& per_head,
                            HeadGrads<T>& grads, typename GradientOf<Variant>::type* dparams) {
  const char* function = "attention_heads_backward";
  check_variant<Variant, T, true>();
  check_heads(function, Q, K, V, options, per_head);
  check_heads_backward<T>(function, Q, V, dO, nullptr, nullptr);
  const ScoreRule<T> shared = make_rule(options, Q.dimension(1), K.dimension(1), Q.dimension(2));
  require_variant_positions(function, shared.q_position, shared.n, 0, shared.m);
  if constexpr (is_checked<Variant>::value) {
    const Index group = Q.dimension(0) / K.dimension(0);
    for (Index h = 0; h < Q.dimension(0); ++h) {
      check_kernel_tiles<T>(per_head.any() ? head_rule(shared, per_head, h) : shared, FlashTiles{},
                            BoundVariant<Variant>{&variant, 0, h, h / group});
    }
  }
  heads_backward_kernel<T>(Q, K, V, nullptr, nullptr, dO, shared, per_head, grads, &variant,
                           dparams);
}

}  // namespace detail

/// Gradients of `attention_heads`: runs the forward of each head again (keeping its output and
/// log-sum-exp), then its backward (`attention_backward`'s kernels), into caller storage.
/// \param Q         (heads, n, d_k): query heads
/// \param K         (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V         (kv_heads, m, d_v): value heads
/// \param dO        (heads, n, d_v): gradient of the loss with respect to the output
/// \param options   the forward's shared options (every `AttentionOptions` field)
/// \param per_head  the forward's per-head values (slopes, sinks, masks, biases)
/// \param grads     dQ (heads, n, d_k); dK (kv_heads, m, d_k) and dV (kv_heads, m, d_v), each
///                  key/value head's the sum over its query heads; dbias (n x m) and dsink of the
///                  shared bias and sink, summed over the heads; dbiases (heads, n, m) and dsinks
///                  (heads) of the per-head ones. Fields whose option is not set are empty (dsink
///                  0).
/// \throws shape_error on mismatched shapes or invalid options.
/// \note About 3.5x the forward's flops (the forward included). Key/value heads run in parallel
///       when there are at least as many as threads, else one after the other with each head's
///       kernels in parallel; every sum over heads is in head order, so the bits do not depend on
///       the thread count. Memory per thread: one head's gradients (and its n x m tables below
///       the tiled crossover).
template <class T>
void attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                              const Tensor3<T>& dO,
                              const AttentionOptions<detail::identity_t<T>>& options,
                              const HeadOptions<detail::identity_t<T>>& per_head,
                              HeadGrads<T>& grads) {
  detail::heads_backward<T>(Q, K, V, nullptr, nullptr, dO, options, per_head, grads);
}

/// Gradients of `attention_heads` (see the overload writing into caller storage).
/// \param Q         (heads, n, d_k): query heads
/// \param K         (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V         (kv_heads, m, d_v): value heads
/// \param dO        (heads, n, d_v): gradient of the loss with respect to the output
/// \param options   the forward's shared options (every `AttentionOptions` field)
/// \param per_head  the forward's per-head values (slopes, sinks, masks, biases)
/// \returns `{dQ, dK, dV, dbias, dsink, dbiases, dsinks}`
template <class T>
HeadGrads<T> attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                                      const Tensor3<T>& dO,
                                      const AttentionOptions<detail::identity_t<T>>& options = {},
                                      const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  HeadGrads<T> grads;
  attention_heads_backward(Q, K, V, dO, options, per_head, grads);
  return grads;
}

/// Gradients of `attention_heads` from the forward's own output and log-sum-exp (the overload of
/// `attention_heads` that returns it), without running the forward again, into caller storage.
/// \param O            (heads, n, d_v): the forward's output for these operands and options
/// \param log_sum_exp  heads x n: the forward's log-sum-exp
/// \param Q, K, V, dO, options, per_head, grads  as in the overload without O
/// \throws shape_error on mismatched shapes or invalid options.
template <class T>
void attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                              const Tensor3<T>& O, const Matrix<T>& log_sum_exp,
                              const Tensor3<T>& dO,
                              const AttentionOptions<detail::identity_t<T>>& options,
                              const HeadOptions<detail::identity_t<T>>& per_head,
                              HeadGrads<T>& grads) {
  detail::heads_backward<T>(Q, K, V, &O, &log_sum_exp, dO, options, per_head, grads);
}

/// Gradients of `attention_heads` from the forward's output and log-sum-exp (see the overload
/// writing into caller storage).
/// \param Q            (heads, n, d_k): query heads
/// \param K            (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V            (kv_heads, m, d_v): value heads
/// \param O            (heads, n, d_v): the forward's output for these operands and options
/// \param log_sum_exp  heads x n: the forward's log-sum-exp
/// \param dO           (heads, n, d_v): gradient of the loss with respect to the output
/// \param options      the forward's shared options (every `AttentionOptions` field)
/// \param per_head     the forward's per-head values (slopes, sinks, masks, biases)
/// \returns `{dQ, dK, dV, dbias, dsink, dbiases, dsinks}`
template <class T>
HeadGrads<T> attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                                      const Tensor3<T>& O, const Matrix<T>& log_sum_exp,
                                      const Tensor3<T>& dO,
                                      const AttentionOptions<detail::identity_t<T>>& options = {},
                                      const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  HeadGrads<T> grads;
  attention_heads_backward(Q, K, V, O, log_sum_exp, dO, options, per_head, grads);
  return grads;
}

/// Gradients of `attention_heads` with a variant, into caller storage: each head's forward again
/// (the tiled kernel) and its backward with the variant bound to the head and its key/value head
/// (its score through `dscore`, its mask: a key it forbids gets exactly zero gradient).
/// \param Q         (heads, n, d_k): query heads
/// \param K         (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V         (kv_heads, m, d_v): value heads
/// \param dO        (heads, n, d_v): gradient of the loss with respect to the output
/// \param variant   a variant (`is_variant_v`) with `dscore` wherever it has `score`;
///                  `checked(variant)` checks every head's tiles first
/// \param options   the forward's shared options
/// \param per_head  the forward's per-head values
/// \param grads     as without a variant
/// \throws shape_error on mismatched shapes or invalid options.
/// \note Identical bits for any thread count, as without a variant.
template <class T, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
void attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                              const Tensor3<T>& dO, const Variant& variant,
                              const AttentionOptions<detail::identity_t<T>>& options,
                              const HeadOptions<detail::identity_t<T>>& per_head,
                              HeadGrads<T>& grads) {
  detail::heads_backward_variant<T>(
      Q, K, V, dO, variant, options, per_head, grads,
      static_cast<typename detail::GradientOf<Variant>::type*>(nullptr));
}

/// Gradients of `attention_heads` with a learnable variant (`variant_learns_v`, such as
/// `T5Bias`): as the overload above, and the gradient of its parameters, each head's summed in a
/// fixed order and then the heads' in head order (the same bits for any thread count).
/// \param Q, K, V, dO, variant, options, per_head, grads  as in the overload above
/// \param dparams  receives dL / d(the variant's parameters), as `Variant::Gradient`
/// \throws shape_error on mismatched shapes or invalid options.
template <class T, class Variant, std::enable_if_t<variant_learns_v<Variant>, int> = 0>
void attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                              const Tensor3<T>& dO, const Variant& variant,
                              const AttentionOptions<detail::identity_t<T>>& options,
                              const HeadOptions<detail::identity_t<T>>& per_head,
                              HeadGrads<T>& grads, typename Variant::Gradient& dparams) {
  detail::heads_backward_variant<T>(Q, K, V, dO, variant, options, per_head, grads, &dparams);
}

/// Gradients of `attention_heads` with a variant (see the overload writing into caller storage).
/// \param Q         (heads, n, d_k): query heads
/// \param K         (kv_heads, m, d_k): key heads, with heads % kv_heads == 0
/// \param V         (kv_heads, m, d_v): value heads
/// \param dO        (heads, n, d_v): gradient of the loss with respect to the output
/// \param variant   a variant (`is_variant_v`) with `dscore` wherever it has `score`
/// \param options   the forward's shared options
/// \param per_head  the forward's per-head values
/// \returns `{dQ, dK, dV, dbias, dsink, dbiases, dsinks}`
template <class T, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
HeadGrads<T> attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                                      const Tensor3<T>& dO, const Variant& variant,
                                      const AttentionOptions<detail::identity_t<T>>& options = {},
                                      const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  HeadGrads<T> grads;
  attention_heads_backward(Q, K, V, dO, variant, options, per_head, grads);
  return grads;
}

/// Options types that extend `AttentionOptions` (`MultiHeadOptions`) are refused at compile time.
template <class T, class Options, class... Rest, detail::if_extended_options<Options, T> = 0>
HeadGrads<T> attention_heads_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                                      const Tensor3<T>& dO, const Options& options,
                                      Rest&&...) = delete;

}  // namespace attn

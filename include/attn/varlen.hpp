#pragma once
/// \file varlen.hpp
/// `varlen_attention`: attention over a batch of sequences of different lengths packed by rows
/// (FlashAttention's `flash_attn_varlen_func`), without padding: each sequence attends only its
/// own keys, with every option and variant applied at positions within the sequence; and its
/// gradients, `varlen_attention_backward`.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "detail/backward_kernels.hpp"
#include "detail/paths.hpp"
#include "detail/score_rule.hpp"
#include "error.hpp"
#include "heads.hpp"
#include "tensor.hpp"
#include "threads.hpp"
#include "types.hpp"
#include "variant.hpp"

namespace attn {

/// The options of a packed batch: one `AttentionOptions` for every sequence, or one per sequence
/// (then each sequence's `mask` and `bias` are its own n_b x m_b tables). Converts implicitly from
/// either, so a call reads `varlen_attention(Q, K, V, cu_q, cu_k, options)` in both cases.
template <class T>
class SequenceOptions {
 public:
  /// Default options for every sequence.
  SequenceOptions() = default;
  /// The same options for every sequence (a `mask` or `bias` then fits only sequences of its
  /// shape; per-sequence tables go in the vector form).
  /// \param shared  applied to each sequence with its own n_b and m_b
  SequenceOptions(const AttentionOptions<T>& shared) : shared_(&shared) {}  // NOLINT: implicit
  /// One `AttentionOptions` per sequence.
  /// \param each  batch entries, entry b for sequence b
  SequenceOptions(const std::vector<AttentionOptions<T>>& each) : each_(&each) {}  // NOLINT
  /// Option types that extend `AttentionOptions` are refused rather than cut down.
  template <class Options, detail::if_extended_options<Options, T> = 0>
  SequenceOptions(const Options&) = delete;

  /// Whether the options are given per sequence.
  /// \returns true for the vector form
  bool per_sequence() const { return each_ != nullptr; }
  /// The entries of the vector form (0 otherwise).
  /// \returns the count
  Index size() const { return each_ ? static_cast<Index>(each_->size()) : 0; }
  /// The options of sequence b.
  /// \param b  0 to batch - 1
  /// \returns the shared options or entry b
  const AttentionOptions<T>& of(Index b) const {
    if (each_) return (*each_)[static_cast<std::size_t>(b)];
    return shared_ ? *shared_ : defaults();
  }

 private:
  static const AttentionOptions<T>& defaults() {
    static const AttentionOptions<T> none{};
    return none;
  }
  const AttentionOptions<T>* shared_ = nullptr;
  const std::vector<AttentionOptions<T>>* each_ = nullptr;
};

/// Gradients of `varlen_attention` (`varlen_attention_backward`): of the loss L, given dO.
template <class T>
struct VarlenGrads {
  Tensor3<T> dQ;  ///< (heads, total_q, d_k)
  Tensor3<T> dK;  ///< (kv_heads, total_k, d_k): a key head's sum over its query heads
  Tensor3<T> dV;  ///< (kv_heads, total_k, d_v): likewise
  std::vector<Matrix<T>> dbias;  ///< per sequence: n_b x m_b where its options have a bias (summed
      ///< over the heads), else empty; no entries when no sequence has one
  T dsink = T(0);         ///< of the options' sink, summed over sequences and heads
  std::vector<T> dsinks;  ///< of `per_head.sinks` (summed over sequences), else empty
};

namespace detail {

/// The validated offsets of a packed batch: sequence b's queries are rows [q[b], q[b + 1]) of the
/// packed queries, its keys rows [k[b], k[b + 1]) of the packed keys and values.
struct PackedOffsets {
  std::vector<Index> q, k;
  Index batch() const { return static_cast<Index>(q.size()) - 1; }
  Index queries(Index b) const { return at(q, b + 1) - at(q, b); }
  Index keys(Index b) const { return at(k, b + 1) - at(k, b); }
  static Index at(const std::vector<Index>& v, Index i) { return v[static_cast<std::size_t>(i)]; }
};

/// Checks one list of offsets: batch + 1 entries, starting at 0, non-decreasing, ending at the
/// packed length. Errors name `function`, the list and the offending values.
inline std::vector<Index> checked_offsets(const char* function, const char* name,
                                          const std::vector<int>& offsets, Index packed,
                                          const char* rows) {
  if (offsets.empty()) {
    fail(function, name, " is empty: it needs batch + 1 offsets, the first 0 and the last the ",
         rows, " (", packed, ")");
  }
  if (offsets.front() != 0) fail(function, name, "[0] is ", offsets.front(), ", not 0");
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    if (offsets[i] < offsets[i - 1]) {
      fail(function, name, " decreases: ", name, "[", i - 1, "] = ", offsets[i - 1], " but ", name,
           "[", i, "] = ", offsets[i], " (the offsets must be non-decreasing)");
    }
  }
  if (offsets.back() != packed) {
    fail(function, name, " ends at ", offsets.back(), " but there are ", packed, " ", rows,
         " (its last entry must be the packed length)");
  }
  return std::vector<Index>(offsets.begin(), offsets.end());
}

/// Checks the packed tensors and offsets: Q (heads, total_q, d_k), K (kv_heads, total_k, d_k),
/// V (kv_heads, total_k, d_v), heads a multiple of kv_heads, both offset lists of batch + 1
/// entries.
template <class T, class S>
PackedOffsets check_packed(const char* function, const Tensor3<T>& Q, const Tensor3<S>& K,
                           const Tensor3<S>& V, const std::vector<int>& cu_seqlens_q,
                           const std::vector<int>& cu_seqlens_k) {
  check_head_shapes(function, Q, K, V, "packed tokens");
  if (cu_seqlens_q.size() != cu_seqlens_k.size()) {
    fail(function, "cu_seqlens_q has ", cu_seqlens_q.size(), " entries and cu_seqlens_k ",
         cu_seqlens_k.size(), ": both need batch + 1");
  }
  PackedOffsets offsets;
  offsets.q = checked_offsets(function, "cu_seqlens_q", cu_seqlens_q, Q.dimension(1), "queries");
  offsets.k = checked_offsets(function, "cu_seqlens_k", cu_seqlens_k, K.dimension(1), "keys");
  return offsets;
}

/// The score rule of sequence b (its own n_b, m_b and options), its options checked; the error
/// names the sequence. Per-head tables are refused: their shape would differ per sequence (a
/// variant, bound to the sequence as `ScoreAt::batch`, says the same thing).
template <class T>
ScoreRule<T> sequence_rule(const char* function, const SequenceOptions<T>& options,
                           const HeadOptions<T>& per_head, Index heads, const PackedOffsets& at,
                           Index b, Index d_k) {
  const AttentionOptions<T>& own = options.of(b);
  const Index n = at.queries(b);
  const Index m = at.keys(b);
  naming_part(function, "sequence", b, [&](const char* where) {
    check_options(where, own, n, m);
    check_head_options(where, own, per_head, heads, n, m);
  });
  return make_rule(own, n, m, d_k);
}

/// Checks the options of every sequence and the per-head values.
template <class T>
std::vector<ScoreRule<T>> sequence_rules(const char* function, const SequenceOptions<T>& options,
                                         const HeadOptions<T>& per_head, Index heads,
                                         const PackedOffsets& at, Index d_k) {
  if (options.per_sequence() && options.size() != at.batch()) {
    fail(function, "the per-sequence options have ", options.size(), " entries but the batch has ",
         at.batch(), " sequences");
  }
  if (per_head.masks || per_head.biases) {
    fail(function, "per_head.masks and per_head.biases are (heads, n, m) tables of one sequence; ",
         "give a packed batch's tables per sequence (the options' mask and bias) or as a variant");
  }
  std::vector<ScoreRule<T>> rules;
  rules.reserve(static_cast<std::size_t>(at.batch()));
  for (Index b = 0; b < at.batch(); ++b) {
    rules.push_back(sequence_rule<T>(function, options, per_head, heads, at, b, d_k));
  }
  return rules;
}

/// Views of one sequence in the packed tensors: head h's rows [first, first + rows) of a
/// (heads, total, d) tensor.
template <class T>
Eigen::Map<const Matrix<T>> packed_rows(const Tensor3<T>& t, Index h, Index first, Index rows) {
  const Index d = t.dimension(2);
  return {t.data() + (h * t.dimension(1) + first) * d, rows, d};
}
template <class T>
Eigen::Map<Matrix<T>> packed_rows(Tensor3<T>& t, Index h, Index first, Index rows) {
  const Index d = t.dimension(2);
  return {t.data() + (h * t.dimension(1) + first) * d, rows, d};
}
/// Key/value head kv's rows [first, first + rows) as the kernels read them (`kv_slice`'s form).
template <class T, class S>
auto packed_kv(const Tensor3<S>& t, Index kv, Index first, Index rows) {
  if constexpr (std::is_same_v<S, T>) {
    return packed_rows(t, kv, first, rows);
  } else {
    const Index d = t.dimension(2);
    return StoredBlock<codec_for_t<S>, T>(t.data() + (kv * t.dimension(1) + first) * d, rows, d, d,
                                          nullptr);
  }
}
/// The `group` query heads of key/value head kv at one packed row, stacked: rows `total d` apart.
template <class T, class Tensor>
auto stacked_row(Tensor& t, Index kv, Index group, Index row) {
  using Scalar = std::conditional_t<std::is_const_v<Tensor>, const T, T>;
  using Rows = std::conditional_t<std::is_const_v<Tensor>, const Matrix<T>, Matrix<T>>;
  const Index d = t.dimension(2);
  Scalar* first = t.data() + (kv * group * t.dimension(1) + row) * d;
  return Eigen::Map<Rows, 0, Eigen::OuterStride<>>(first, group, d,
                                                   Eigen::OuterStride<>(t.dimension(1) * d));
}

/// One unit of a packed forward: a whole (sequence, head) on the path `choose_path` picks, the
/// stacked decoding step of a (sequence, key/value head), or one query tile of a (sequence, head)
/// on the tiled kernel.
struct VarlenTask {
  enum Kind : std::uint8_t { Whole, Stacked, Tile };
  Kind kind = Whole;
  Index seq = 0;
  Index head = 0;  ///< query head; the key/value head for `Stacked`
  Index row0 = 0;  ///< first query row of a tile (within the sequence)
  Index rows = 0;
  double cost = 0;  ///< scores it computes, about
  double unit = 0;  ///< the cost of its (sequence, head): tiles, the sum of theirs; else `cost`
};

/// Per-thread working memory of the packed forward.
template <class T>
struct VarlenScratch {
  PathScratch<T> path;
  Index packed_seq = -1;  ///< whose keys `path.flash.keys` holds
  Index packed_head = -1;
};

/// The scores a block of rows [row0, row0 + rows) computes by `rule`, at least 1.
template <class T>
double rows_cost(const ScoreRule<T>& rule, Index row0, Index rows) {
  if (rows == 0 || rule.m == 0) return 1.0;
  const KeyRange keys = rule.keys(row0, rows);
  return std::max(1.0, double(rows) * double(std::max<Index>(keys.end - keys.begin, 1)));
}

/// The forward of a packed batch, checks done: each sequence as `attention_heads` (or, with a
/// variant, as its variant form) computes it alone, so each sequence's bits are those of that
/// call on the sequence; the work is split into (sequence, head, query tile) tasks run longest
/// first over the threads. `lse` (heads x total_q) when not null.
template <class T, class S, class Variant>
void varlen_kernel(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                   const PackedOffsets& at, const std::vector<ScoreRule<T>>& rules,
                   const HeadOptions<T>& per_head, const Variant* variant, Tensor3<T>& out,
                   Matrix<T>* lse) {
  constexpr bool with_variant = !std::is_same_v<Variant, NoVariant>;
  const Index heads = Q.dimension(0);
  const Index group = heads / K.dimension(0);
  const Index d_k = Q.dimension(2);
  const Index d_v = V.dimension(2);
  const FlashTiles tiles{};
  const auto rule_of = [&](Index b, Index h) {
    const ScoreRule<T>& shared = rules[static_cast<std::size_t>(b)];
    return per_head.any() ? head_rule(shared, per_head, h) : shared;
  };
  const auto bound_of = [&](Index b, Index h) {
    return BoundVariant<Variant>{variant, b, h, h / group};
  };
  const auto q_of = [&](Index b, Index h) {
    return packed_rows(Q, h, at.q[std::size_t(b)], at.queries(b));
  };
  const auto k_of = [&](Index b, Index kv) {
    return packed_kv<T>(K, kv, at.k[std::size_t(b)], at.keys(b));
  };
  const auto v_of = [&](Index b, Index kv) {
    return packed_kv<T>(V, kv, at.k[std::size_t(b)], at.keys(b));
  };
  const auto o_of = [&](Index b, Index h) {
    return packed_rows(out, h, at.q[std::size_t(b)], at.queries(b));
  };
  const auto lse_of = [&](Index b, Index h) -> T* {
    return lse ? lse->data() + h * Q.dimension(1) + at.q[std::size_t(b)] : nullptr;
  };

  // The tasks, as `heads_kernel` / `heads_variant_kernel` would run each sequence.
  std::vector<VarlenTask> tasks;
  for (Index b = 0; b < at.batch(); ++b) {
    const Index n = at.queries(b);
    if (n == 0) continue;
    const ScoreRule<T>& shared = rules[static_cast<std::size_t>(b)];
    if (lse == nullptr && !per_head.any() && choose_path(shared, d_k, d_v, false) == Path::Decode) {
      for (Index kv = 0; kv < heads / group; ++kv) {
        const double cost = double(group) * double(shared.m);
        tasks.push_back({VarlenTask::Stacked, b, kv, 0, n, cost, cost});
      }
      continue;
    }
    for (Index h = 0; h < heads; ++h) {
      const ScoreRule<T> rule = rule_of(b, h);
      const bool tiled = with_variant || choose_path(rule, d_k, d_v, false) == Path::Tiled;
      // The rare sequence whose tiles' product could overflow runs whole (`with_safe_scale`).
      if (!tiled || product_may_overflow<T>(q_of(b, h), k_of(b, h / group), rule.scale)) {
        const double cost = rows_cost(rule, 0, n);
        tasks.push_back({VarlenTask::Whole, b, h, 0, n, cost, cost});
        continue;
      }
      const std::size_t first = tasks.size();
      double unit = 0;
      for (Index i0 = 0; i0 < n; i0 += tiles.query_rows) {
        const Index rows = std::min(tiles.query_rows, n - i0);
        tasks.push_back({VarlenTask::Tile, b, h, i0, rows, rows_cost(rule, i0, rows), 0});
        unit += tasks.back().cost;
      }
      for (std::size_t t = first; t < tasks.size(); ++t) tasks[t].unit = unit;
    }
  }
  // Longest (sequence, head) first, its tiles longest first and together, so that a thread's
  // next tile mostly reads the keys it has packed, and the short ones fill the threads' ends.
  // Each task writes its own rows: the order changes no bit.
  std::stable_sort(tasks.begin(), tasks.end(), [](const VarlenTask& a, const VarlenTask& c) {
    if (a.unit != c.unit) return a.unit > c.unit;
    if (a.seq != c.seq || a.head != c.head) return a.seq != c.seq ? a.seq < c.seq : a.head < c.head;
    return a.cost > c.cost;
  });

  parallel_for<VarlenScratch<T>>(
      static_cast<Index>(tasks.size()), [&](Index t, VarlenScratch<T>& s) {
        const VarlenTask& task = tasks[static_cast<std::size_t>(t)];
        const Index b = task.seq;
        if (task.kind == VarlenTask::Stacked) {
          const Index kv = task.head;
          const Index row = at.q[std::size_t(b)];
          decode_groups<T>(
              1, rules[static_cast<std::size_t>(b)],
              [&](Index) { return stacked_row<T>(Q, kv, group, row); },
              [&](Index) { return k_of(b, kv); }, [&](Index) { return v_of(b, kv); },
              [&](Index) { return stacked_row<T>(out, kv, group, row); },
              BoundVariant<Variant>{variant, b, kv * group, kv});
          return;
        }
        const Index h = task.head;
        const ScoreRule<T> rule = rule_of(b, h);
        const auto k = kernel_block<T>(k_of(b, h / group));
        const auto v = kernel_block<T>(v_of(b, h / group));
        if (task.kind == VarlenTask::Whole) {
          s.packed_seq = -1;  // the path may pack other keys into this thread's buffers
          if constexpr (with_variant) {
            flash_blocks<T>(q_of(b, h), k, v, rule, tiles, s.path.flash, o_of(b, h), lse_of(b, h),
                            bound_of(b, h));
          } else {
            run_path<T>(choose_path(rule, d_k, d_v, false), q_of(b, h), k, v, rule, s.path,
                        o_of(b, h), lse_of(b, h));
          }
          return;
        }
        if (s.packed_seq != b || s.packed_head != h) {
          s.path.flash.keys = pack_for_scores<T>(q_of(b, h), k, v, rule);
          s.packed_seq = b;
          s.packed_head = h;
        }
        flash_block<T>(q_of(b, h), k, v, *s.path.flash.keys, rule, tiles, task.row0, task.rows,
                       s.path.flash, o_of(b, h), lse_of(b, h), bound_of(b, h));
      });
}

/// A variant's positions in every sequence; with `checked(variant)`, every tile of every
/// (sequence, head) the tiled kernel classifies, before anything is computed.
template <class T, class Variant>
void check_variant_tiles(const char* function, Index heads, Index kv_heads, const PackedOffsets& at,
                         const std::vector<ScoreRule<T>>& rules, const HeadOptions<T>& per_head,
                         const Variant* variant) {
  for (Index b = 0; b < at.batch(); ++b) {
    require_variant_positions(function, rules[std::size_t(b)].q_position, at.queries(b), 0,
                              at.keys(b));
  }
  if constexpr (is_checked<Variant>::value) {
    const Index group = heads / kv_heads;
    for (Index b = 0; b < at.batch(); ++b) {
      for (Index h = 0; h < heads; ++h) {
        const ScoreRule<T>& shared = rules[std::size_t(b)];
        check_kernel_tiles<T>(per_head.any() ? head_rule(shared, per_head, h) : shared,
                              FlashTiles{}, BoundVariant<Variant>{variant, b, h, h / group});
      }
    }
  }
}

/// `varlen_attention`'s checks and forward (`varlen_kernel`); `variant` null without one.
template <class T, class S, class Variant>
void varlen_forward(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                    const std::vector<int>& cu_seqlens_q, const std::vector<int>& cu_seqlens_k,
                    const Variant* variant, const SequenceOptions<T>& options,
                    const HeadOptions<T>& per_head, Tensor3<T>& out, Matrix<T>* lse) {
  const char* function = "varlen_attention";
  const PackedOffsets at = check_packed(function, Q, K, V, cu_seqlens_q, cu_seqlens_k);
  const Index heads = Q.dimension(0);
  const std::vector<ScoreRule<T>> rules =
      sequence_rules<T>(function, options, per_head, heads, at, Q.dimension(2));
  if constexpr (!std::is_same_v<Variant, NoVariant>) {
    check_variant<Variant, T>();
    check_variant_tiles<T>(function, heads, K.dimension(0), at, rules, per_head, variant);
  }
  const Index d_v = V.dimension(2);
  if (out.dimension(0) != heads || out.dimension(1) != Q.dimension(1) || out.dimension(2) != d_v) {
    out.resize(heads, Q.dimension(1), d_v);
  }
  if (lse) lse->resize(heads, Q.dimension(1));
  varlen_kernel<T>(Q, K, V, at, rules, per_head, variant, out, lse);
}

/// The backward of a packed batch, checks done: each (sequence, key/value head) a task, longest
/// first, running its query heads in head order as `attention_heads_backward` runs them for the
/// sequence alone (`group_backward`), so each sequence's dQ, dK, dV are that call's bits. Then the
/// sums across tasks, in a fixed order: a sequence's bias gradient over its key/value heads, the
/// shared sink's over its heads and then over the sequences, each per-head sink's over the sequences, a learnable
/// variant's over its heads and then over the sequences. Rows of a sequence without queries get zero dK and dV; rows
/// of one without keys zero dQ. O and lse null: the forward runs again.
template <class T, class Variant>
void varlen_backward_kernel(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                            const Tensor3<T>* O, const Matrix<T>* lse, const Tensor3<T>& dO,
                            const PackedOffsets& at, const std::vector<ScoreRule<T>>& rules,
                            const HeadOptions<T>& per_head, const Variant* variant,
                            VarlenGrads<T>& grads, typename GradientOf<Variant>::type* dparams) {
  using Gradient = typename GradientOf<Variant>::type;
  const Index heads = Q.dimension(0);
  const Index kv_heads = K.dimension(0);
  const Index group = heads / kv_heads;
  const Index total_q = Q.dimension(1);
  const Index batch = at.batch();
  grads.dQ.resize(heads, total_q, Q.dimension(2));
  grads.dK.resize(kv_heads, K.dimension(1), K.dimension(2));
  grads.dV.resize(kv_heads, V.dimension(1), V.dimension(2));
  grads.dQ.setZero();
  grads.dK.setZero();
  grads.dV.setZero();
  const auto index = [](Index i) { return static_cast<std::size_t>(i); };
  const bool any_bias =
      std::any_of(rules.begin(), rules.end(), [](const ScoreRule<T>& r) { return bool(r.bias); });
  std::vector<Matrix<T>> dbias_parts(any_bias ? index(batch * kv_heads) : 0);
  std::vector<T> dsink_of(index(batch * heads), T(0));  // per (sequence, head)
  std::vector<Gradient> dparams_of(dparams ? index(batch * heads) : 0);

  std::vector<VarlenTask> tasks;
  for (Index b = 0; b < batch; ++b) {
    if (at.queries(b) == 0 || at.keys(b) == 0) continue;  // its gradients stay zero
    const double cost = double(group) * rows_cost(rules[index(b)], 0, at.queries(b));
    for (Index kv = 0; kv < kv_heads; ++kv) {
      tasks.push_back({VarlenTask::Whole, b, kv, 0, at.queries(b), cost, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const VarlenTask& a, const VarlenTask& c) { return a.cost > c.cost; });
  tasks_or_kernels<HeadsBackwardScratch<T>>(
      static_cast<Index>(tasks.size()), [&](Index t, HeadsBackwardScratch<T>& s) {
        const Index b = tasks[index(t)].seq;
        const Index kv = tasks[index(t)].head;
        const Index q0 = at.q[index(b)];
        const Index n = at.queries(b);
        const Index k0 = at.k[index(b)];
        const Index m = at.keys(b);
        const ScoreRule<T>& shared = rules[index(b)];
        Matrix<T>* dbias_part = shared.bias ? &dbias_parts[index(b * kv_heads + kv)] : nullptr;
        group_backward<T>(
            kv, group, packed_rows(K, kv, k0, m), packed_rows(V, kv, k0, m),
            [&](Index h) -> ConstRef<T> { return packed_rows(Q, h, q0, n); },
            [&](Index h) -> ConstRef<T> { return packed_rows(dO, h, q0, n); },
            [&](Index h) { return per_head.any() ? head_rule(shared, per_head, h) : shared; },
            [&](Index h, Vector<T>& lse_h) -> std::optional<ConstRef<T>> {
              if (!O) return std::nullopt;
              lse_h = lse->row(h).segment(q0, n).transpose();
              return ConstRef<T>(packed_rows(*O, h, q0, n));
            },
            BoundVariant<Variant>{variant, b, 0, 0}, s, packed_rows(grads.dK, kv, k0, m),
            packed_rows(grads.dV, kv, k0, m),
            [&](Index h, const AttentionGrads<T>& head) {
              packed_rows(grads.dQ, h, q0, n) = head.dQ;
              if (dbias_part) {
                if (h == kv * group) {
                  *dbias_part = head.dbias;
                } else {
                  *dbias_part += head.dbias;
                }
              }
              dsink_of[index(b * heads + h)] = head.dsink;
            },
            [&](Index h) -> Gradient* {
              return dparams ? &dparams_of[index(b * heads + h)] : nullptr;
            });
      });

  grads.dbias.clear();
  if (any_bias) {
    grads.dbias.resize(index(batch));
    for (Index b = 0; b < batch; ++b) {
      if (!rules[index(b)].bias) continue;
      Matrix<T>& dbias = grads.dbias[index(b)];
      if (at.queries(b) == 0 || at.keys(b) == 0) {
        dbias = Matrix<T>::Zero(at.queries(b), at.keys(b));
        continue;
      }
      dbias = dbias_parts[index(b * kv_heads)];
      for (Index kv = 1; kv < kv_heads; ++kv) dbias += dbias_parts[index(b * kv_heads + kv)];
    }
  }
  grads.dsink = T(0);
  grads.dsinks.clear();
  if (per_head.sinks) grads.dsinks.assign(index(heads), T(0));
  for (Index b = 0; b < batch; ++b) {
    T sequence = T(0);  // the sequence's own dsink (its heads' sum), as its call would give it
    for (Index h = 0; h < heads; ++h) {
      const T d = dsink_of[index(b * heads + h)];
      sequence += d;
      if (per_head.sinks) grads.dsinks[index(h)] += d;
    }
    if (rules[index(b)].sink && !per_head.sinks) grads.dsink += sequence;
  }
  if constexpr (variant_learns_v<Variant>) {
    if (dparams) {
      *dparams = variant->zero_gradient();
      for (Index b = 0; b < batch; ++b) {
        if (at.queries(b) == 0 || at.keys(b) == 0) continue;  // no task: no gradient
        Gradient sequence = variant->zero_gradient();  // the sequence's own, as its call gives it
        for (Index h = 0; h < heads; ++h) sequence += dparams_of[index(b * heads + h)];
        *dparams += sequence;
      }
    }
  }
}

/// `varlen_attention_backward`'s checks and backward; `variant` null without one, O and lse null
/// when the forward runs again.
template <class T, class Variant>
void varlen_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                     const Tensor3<T>* O, const Matrix<T>* lse, const Tensor3<T>& dO,
                     const std::vector<int>& cu_seqlens_q, const std::vector<int>& cu_seqlens_k,
                     const Variant* variant, const SequenceOptions<T>& options,
                     const HeadOptions<T>& per_head, VarlenGrads<T>& grads,
                     typename GradientOf<Variant>::type* dparams) {
  const char* function = "varlen_attention_backward";
  const PackedOffsets at = check_packed(function, Q, K, V, cu_seqlens_q, cu_seqlens_k);
  const Index heads = Q.dimension(0);
  const std::vector<ScoreRule<T>> rules =
      sequence_rules<T>(function, options, per_head, heads, at, Q.dimension(2));
  check_heads_backward<T>(function, Q, V, dO, O, lse);
  if constexpr (!std::is_same_v<Variant, NoVariant>) {
    check_variant<Variant, T, true>();
    check_variant_tiles<T>(function, heads, K.dimension(0), at, rules, per_head, variant);
  }
  varlen_backward_kernel<T>(Q, K, V, O, lse, dO, at, rules, per_head, variant, grads, dparams);
}

}  // namespace detail

/// Attention over a packed batch of sequences of different lengths, into caller storage.
/// \param Q             (heads, total_q, d_k): every sequence's queries, sequence b in rows
///                      [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of each head
/// \param K             (kv_heads, total_k, d_k), heads % kv_heads == 0; of T, `Eigen::half` or
///                      `Eigen::bfloat16`
/// \param V             (kv_heads, total_k, d_v), like K
/// \param cu_seqlens_q  batch + 1 offsets: 0, non-decreasing, the last total_q
/// \param cu_seqlens_k  batch + 1 offsets of the keys, likewise (the last total_k)
/// \param options       one `AttentionOptions` for every sequence, or a vector of one per sequence
///                      (`SequenceOptions`); each sequence applies its options to its own n_b
///                      queries and m_b keys, positions counted from its first row: `causal`
///                      aligns each sequence by itself (`BottomRight`: FlashAttention's rule),
///                      a mask or bias is that sequence's n_b x m_b table
/// \param per_head      per-query-head ALiBi slopes and sinks, for every sequence (per-head tables
///                      are refused: give them per sequence, or as a variant)
/// \param out           resized to (heads, total_q, d_v)
/// \throws shape_error on offsets that do not start at 0, decrease, or do not end at the packed
///         length, on mismatched shapes, or on options that do not fit a sequence (naming it).
/// \note Each sequence's result is, bit for bit, what `attention_heads` gives for it alone, for any
///       thread count: the work is split into (sequence, head, query tile) tasks, each computed as
///       that call computes it, run longest first. A sequence without keys gives 0 (rows with
///       nothing to see are 0, never NaN); one without queries is skipped.
template <class T, class S>
void varlen_attention(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                      const std::vector<int>& cu_seqlens_q, const std::vector<int>& cu_seqlens_k,
                      const SequenceOptions<detail::identity_t<T>>& options,
                      const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out) {
  detail::varlen_forward<T>(Q, K, V, cu_seqlens_q, cu_seqlens_k,
                            static_cast<const detail::NoVariant*>(nullptr), options, per_head, out,
                            nullptr);
}

/// `varlen_attention` with each query's log-sum-exp (the backward's input, FlashAttention's
/// `softmax_lse`), into caller storage.
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k)
/// \param V             (kv_heads, total_k, d_v)
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param options       shared or per-sequence options
/// \param per_head      per-query-head slopes and sinks
/// \param out           resized to (heads, total_q, d_v)
/// \param log_sum_exp   resized to heads x total_q: log of each row's softmax denominator, sink
///                      included; -inf for a row with nothing to see
template <class T, class S>
void varlen_attention(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                      const std::vector<int>& cu_seqlens_q, const std::vector<int>& cu_seqlens_k,
                      const SequenceOptions<detail::identity_t<T>>& options,
                      const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out,
                      Matrix<T>& log_sum_exp) {
  detail::varlen_forward<T>(Q, K, V, cu_seqlens_q, cu_seqlens_k,
                            static_cast<const detail::NoVariant*>(nullptr), options, per_head, out,
                            &log_sum_exp);
}

/// `varlen_attention` returning (heads, total_q, d_v) (see the overload into caller storage).
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k)
/// \param V             (kv_heads, total_k, d_v)
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param options       shared or per-sequence options
/// \param per_head      per-query-head slopes and sinks
/// \returns (heads, total_q, d_v)
template <class T, class S>
Tensor3<T> varlen_attention(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                            const std::vector<int>& cu_seqlens_q,
                            const std::vector<int>& cu_seqlens_k,
                            const SequenceOptions<detail::identity_t<T>>& options = {},
                            const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  Tensor3<T> out;
  varlen_attention(Q, K, V, cu_seqlens_q, cu_seqlens_k, options, per_head, out);
  return out;
}

/// `varlen_attention` with a variant (variant.hpp): it sees sequence b as `ScoreAt::batch` (and
/// `TileAt::batch`), positions within the sequence, query head h and its key/value head. Each
/// sequence's bits are those of `attention_heads` with the variant on that sequence alone, with
/// the variant bound to batch item b.
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k)
/// \param V             (kv_heads, total_k, d_v)
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param variant       a variant (`is_variant_v`); `checked(variant)` checks every tile first
/// \param options       shared or per-sequence options
/// \param per_head      per-query-head slopes and sinks
/// \param out           resized to (heads, total_q, d_v)
template <class T, class S, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
void varlen_attention(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                      const std::vector<int>& cu_seqlens_q, const std::vector<int>& cu_seqlens_k,
                      const Variant& variant, const SequenceOptions<detail::identity_t<T>>& options,
                      const HeadOptions<detail::identity_t<T>>& per_head, Tensor3<T>& out) {
  detail::varlen_forward<T>(Q, K, V, cu_seqlens_q, cu_seqlens_k, &variant, options, per_head, out,
                            nullptr);
}

/// `varlen_attention` with a variant, returning (heads, total_q, d_v).
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k)
/// \param V             (kv_heads, total_k, d_v)
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param variant       a variant (`is_variant_v`)
/// \param options       shared or per-sequence options
/// \param per_head      per-query-head slopes and sinks
/// \returns (heads, total_q, d_v)
template <class T, class S, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
Tensor3<T> varlen_attention(const Tensor3<T>& Q, const Tensor3<S>& K, const Tensor3<S>& V,
                            const std::vector<int>& cu_seqlens_q,
                            const std::vector<int>& cu_seqlens_k, const Variant& variant,
                            const SequenceOptions<detail::identity_t<T>>& options = {},
                            const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  Tensor3<T> out;
  varlen_attention(Q, K, V, cu_seqlens_q, cu_seqlens_k, variant, options, per_head, out);
  return out;
}

/// Gradients of `varlen_attention`, into caller storage: each sequence's forward again and its
/// backward, as `attention_heads_backward` computes them for the sequence alone (bit for bit).
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k), heads % kv_heads == 0
/// \param V             (kv_heads, total_k, d_v)
/// \param dO            (heads, total_q, d_v): gradient of the loss with respect to the output
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param options       the forward's shared or per-sequence options
/// \param per_head      the forward's per-query-head slopes and sinks
/// \param grads         dQ, dK, dV packed as Q, K, V (a key/value head's rows the sum over its
///                      query heads); dbias per sequence where its options have a bias; dsink of
///                      the options' sink summed over sequences and heads; dsinks (heads) of
///                      `per_head.sinks`, summed over sequences
/// \throws shape_error as `varlen_attention`, or when dO is not (heads, total_q, d_v).
/// \note Tasks are (sequence, key/value head), longest first; every sum across them has a fixed
///       order, so the bits do not depend on the thread count. Rows of a sequence without keys
///       (or queries) get zero gradients.
template <class T>
void varlen_attention_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                               const Tensor3<T>& dO, const std::vector<int>& cu_seqlens_q,
                               const std::vector<int>& cu_seqlens_k,
                               const SequenceOptions<detail::identity_t<T>>& options,
                               const HeadOptions<detail::identity_t<T>>& per_head,
                               VarlenGrads<T>& grads) {
  detail::varlen_backward<T>(Q, K, V, nullptr, nullptr, dO, cu_seqlens_q, cu_seqlens_k,
                             static_cast<const detail::NoVariant*>(nullptr), options, per_head,
                             grads, nullptr);
}

/// Gradients of `varlen_attention` (see the overload into caller storage).
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k)
/// \param V             (kv_heads, total_k, d_v)
/// \param dO            (heads, total_q, d_v)
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param options       the forward's shared or per-sequence options
/// \param per_head      the forward's per-query-head slopes and sinks
/// \returns `{dQ, dK, dV, dbias, dsink, dsinks}`
template <class T>
VarlenGrads<T> varlen_attention_backward(const Tensor3<T>& Q, const Tensor3<T>& K,
                                         const Tensor3<T>& V, const Tensor3<T>& dO,
                                         const std::vector<int>& cu_seqlens_q,
                                         const std::vector<int>& cu_seqlens_k,
                                         const SequenceOptions<detail::identity_t<T>>& options = {},
                                         const HeadOptions<detail::identity_t<T>>& per_head = {}) {
  VarlenGrads<T> grads;
  varlen_attention_backward(Q, K, V, dO, cu_seqlens_q, cu_seqlens_k, options, per_head, grads);
  return grads;
}

/// Gradients of `varlen_attention` from the forward's output and log-sum-exp (the forward does
/// not run again), into caller storage.
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k)
/// \param V             (kv_heads, total_k, d_v)
/// \param O             (heads, total_q, d_v): the forward's output
/// \param log_sum_exp   heads x total_q: the forward's log-sum-exp
/// \param dO            (heads, total_q, d_v)
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param options       the forward's shared or per-sequence options
/// \param per_head      the forward's per-query-head slopes and sinks
/// \param grads         as in the overload that runs the forward again
template <class T>
void varlen_attention_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                               const Tensor3<T>& O, const Matrix<T>& log_sum_exp,
                               const Tensor3<T>& dO, const std::vector<int>& cu_seqlens_q,
                               const std::vector<int>& cu_seqlens_k,
                               const SequenceOptions<detail::identity_t<T>>& options,
                               const HeadOptions<detail::identity_t<T>>& per_head,
                               VarlenGrads<T>& grads) {
  detail::varlen_backward<T>(Q, K, V, &O, &log_sum_exp, dO, cu_seqlens_q, cu_seqlens_k,
                             static_cast<const detail::NoVariant*>(nullptr), options, per_head,
                             grads, nullptr);
}

/// Gradients of `varlen_attention` with a variant, into caller storage (the variant bound to each
/// sequence as batch item b, as in the forward; its score through `dscore`).
/// \param Q             (heads, total_q, d_k)
/// \param K             (kv_heads, total_k, d_k)
/// \param V             (kv_heads, total_k, d_v)
/// \param dO            (heads, total_q, d_v)
/// \param cu_seqlens_q  batch + 1 offsets of the queries
/// \param cu_seqlens_k  batch + 1 offsets of the keys
/// \param variant       a variant with `dscore` wherever it has `score`
/// \param options       the forward's shared or per-sequence options
/// \param per_head      the forward's per-query-head slopes and sinks
/// \param grads         as without a variant
template <class T, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
void varlen_attention_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                               const Tensor3<T>& dO, const std::vector<int>& cu_seqlens_q,
                               const std::vector<int>& cu_seqlens_k, const Variant& variant,
                               const SequenceOptions<detail::identity_t<T>>& options,
                               const HeadOptions<detail::identity_t<T>>& per_head,
                               VarlenGrads<T>& grads) {
  detail::varlen_backward<T>(Q, K, V, nullptr, nullptr, dO, cu_seqlens_q, cu_seqlens_k, &variant,
                             options, per_head, grads,
                             static_cast<typename detail::GradientOf<Variant>::type*>(nullptr));
}

/// Gradients of `varlen_attention` with a learnable variant (`variant_learns_v`), and the gradient
/// of its parameters: each (sequence, head)'s, summed in that order.
/// \param Q, K, V, dO, cu_seqlens_q, cu_seqlens_k, variant, options, per_head, grads  as above
/// \param dparams  receives dL / d(the variant's parameters)
template <class T, class Variant, std::enable_if_t<variant_learns_v<Variant>, int> = 0>
void varlen_attention_backward(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
                               const Tensor3<T>& dO, const std::vector<int>& cu_seqlens_q,
                               const std::vector<int>& cu_seqlens_k, const Variant& variant,
                               const SequenceOptions<detail::identity_t<T>>& options,
                               const HeadOptions<detail::identity_t<T>>& per_head,
                               VarlenGrads<T>& grads, typename Variant::Gradient& dparams) {
  detail::varlen_backward<T>(Q, K, V, nullptr, nullptr, dO, cu_seqlens_q, cu_seqlens_k, &variant,
                             options, per_head, grads, &dparams);
}

}  // namespace attn

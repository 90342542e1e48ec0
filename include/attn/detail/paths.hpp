#pragma once
/// \file detail/paths.hpp
/// The three attention paths on one score rule, and the one function that chooses between them:
/// the materialised n x m table (small problems, or when the weights are wanted), the tiled kernel
/// (`flash.hpp`), and the decoding kernel (one query over a long range of keys, `decode.hpp`).

#include <algorithm>
#include <vector>

#include "../flash.hpp"
#include "../softmax.hpp"
#include "../threads.hpp"
#include "../types.hpp"
#include "decode.hpp"
#include "exact_rows.hpp"
#include "score_rule.hpp"

namespace attn {
namespace detail {

/// The materialised path. Shape contract: Q n x d_k, K m x d_k, V m x d_v; P becomes the n x m
/// weights; O, already n x d_v (a block of a larger matrix is fine), receives the output; lse
/// (optional) n entries. Memory: the n x m table P (reused across calls when it already has the
/// right size). Blocks of query rows run in parallel (`parallel_for`); each block goes through:
/// logits `(scale Q_b) K^T` and the score rule, row softmax, `P_b V`; rows that came out not
/// finite are recomputed key by key (`repair_rows`).
template <class T>
void materialised_kernel(ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule,
                         Matrix<T>& P, Eigen::Ref<Matrix<T>> O, T* lse) {
  ATTN_ASSERT(O.rows() == Q.rows() && O.cols() == V.cols());
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const Index n = Q.rows();
  P.resize(n, K.rows());
  constexpr Index block_rows = 64;
  const Index blocks = (n + block_rows - 1) / block_rows;
  const double flops = attention_flops(n, K.rows(), Q.cols(), V.cols());
  parallel_for<Matrix<T>>(blocks, flops, [&](Index b, Matrix<T>& q_scaled) {
    const Index i0 = b * block_rows;
    const Index rows = std::min(block_rows, n - i0);
    q_scaled.noalias() = rule.scale * Q.middleRows(i0, rows);
    Eigen::Ref<Matrix<T>> P_b = P.middleRows(i0, rows);
    P_b.noalias() = q_scaled * K.transpose();
    rule.apply(P_b, i0, 0);
    for (Index r = 0; r < rows; ++r) {
      const RowStats<T> stats = softmax_row_inplace<T>(P_b.row(r), rule.sink);
      if (lse) lse[i0 + r] = stats.sum == T(0) ? neg_inf : stats.max + std::log(stats.sum);
    }
    O.middleRows(i0, rows).noalias() = P_b * V;
    repair_rows<T>(Q, K, V, rule, i0, rows, O, lse);
  });
}

/// The attention paths.
enum class Path { Materialised, Tiled, Decode };

/// The one choice of path, for n queries of one head over the m keys of `rule`:
/// - the weights are wanted: materialised (it keeps them);
/// - one query and nothing but a key range and scalars (no mask, bias or ALiBi): decode, which
///   streams each visible key and value once;
/// - the n x m table would not fit in a core's L2 cache (256 x 256 floats = 256 KiB), or the keys
///   and values would not (more than 1 MiB: they are then streamed tile by tile, read once): tiled;
/// - more than 32 x 32 scores with at least 16 queries and 16 keys: tiled, whose register tiles
///   beat the materialised path's table from there (a crossover chosen by measurement; see
///   docs/benchmarks.md);
/// - otherwise materialised.
template <class T>
Path choose_path(const ScoreRule<T>& rule, Index d_k, Index d_v, bool need_weights) {
  if (need_weights) return Path::Materialised;
  if (rule.n == 1 && !rule.has_per_entry()) return Path::Decode;
  const Index kv_bytes = rule.m * (d_k + d_v) * static_cast<Index>(sizeof(T));
  if (rule.n * rule.m > 256 * 256 || kv_bytes > (Index(1) << 20)) return Path::Tiled;
  if (rule.n * rule.m > 32 * 32 && std::min(rule.n, rule.m) >= 16) return Path::Tiled;
  return Path::Materialised;
}

/// Per-thread working memory of any path.
template <class T>
struct PathScratch {
  Matrix<T> P;              ///< the materialised path's n x m weights
  DecodeScratch<T> decode;  ///< the decoding kernel's state
  FlashScratch<T> flash;    ///< the tiled kernel's state (one block at a time)
  Matrix<T> keys, values;   ///< stored keys and values widened to T (the paths other than decode)
  GatherBuffer<T> paged_keys, paged_values;  ///< a block of paged rows gathered (`PagedRows`)
};

/// Attention of one head by `rule` on `path`, inside a parallel loop (the tiled path then runs its
/// query blocks one after the other on this thread). Shape contract: Q n x d_k, K m x d_k, V m x
/// d_v, O n x d_v, lse (optional) n entries. The materialised path leaves the weights in
/// `scratch.P`.
template <class T>
void run_path(Path path, ConstRef<T> Q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule,
              PathScratch<T>& scratch, Eigen::Ref<Matrix<T>> O, T* lse) {
  switch (path) {
    case Path::Materialised:
      materialised_kernel<T>(Q, K, V, rule, scratch.P, O, lse);
      return;
    case Path::Decode: {
      const KeyRange keys = rule.keys(0);
      decode_kernel<T>(Q, K.middleRows(keys.begin, keys.end - keys.begin),
                       V.middleRows(keys.begin, keys.end - keys.begin), rule, scratch.decode, O,
                       lse);
      return;
    }
    case Path::Tiled:
      flash_blocks<T>(Q, K, V, rule, FlashTiles{}, scratch.flash, O, lse);
      return;
  }
}

/// `run_path` over keys and values in a stored format (detail/stored.hpp): the decoding path
/// widens them in its registers, the tiled path when it packs the keys and tile by tile for the
/// values; the materialised path (small by `choose_path`) runs on a copy widened in `scratch`.
template <class T, class Codec>
void run_path(Path path, ConstRef<T> Q, const StoredBlock<Codec, T>& K,
              const StoredBlock<Codec, T>& V, const ScoreRule<T>& rule, PathScratch<T>& scratch,
              Eigen::Ref<Matrix<T>> O, T* lse) {
  if (path == Path::Decode) {
    const KeyRange keys = rule.keys(0);
    decode_blocks<T>(Q, K.middleRows(keys.begin, keys.end - keys.begin),
                     V.middleRows(keys.begin, keys.end - keys.begin), rule, scratch.decode, O, lse);
    return;
  }
  if (path == Path::Tiled) {
    flash_blocks<T>(Q, K, V, rule, FlashTiles{}, scratch.flash, O, lse);
    return;
  }
  K.widen_into(scratch.keys);
  V.widen_into(scratch.values);
  run_path<T>(path, Q, scratch.keys, scratch.values, rule, scratch, O, lse);
}

/// `run_path` over a sequence's rows in a page pool (detail/paged_rows.hpp): the decoding path
/// reads them in place, tile by tile; the others run on the block gathered into `scratch`. The
/// bits are those of the same rows stored contiguously.
template <class T, class Codec>
void run_path(Path path, ConstRef<T> Q, const PagedRows<Codec, T>& K, const PagedRows<Codec, T>& V,
              const ScoreRule<T>& rule, PathScratch<T>& scratch, Eigen::Ref<Matrix<T>> O, T* lse) {
  if (path == Path::Decode) {
    const KeyRange keys = rule.keys(0);
    decode_blocks<T>(Q, K.middleRows(keys.begin, keys.end - keys.begin),
                     V.middleRows(keys.begin, keys.end - keys.begin), rule, scratch.decode, O, lse);
    return;
  }
  run_path<T>(path, Q, gathered(K, 0, K.rows(), scratch.paged_keys),
              gathered(V, 0, V.rows(), scratch.paged_values), rule, scratch, O, lse);
}

/// `decode_groups` without the log-sum-exp of its rows (the default).
struct NoLse {};

/// Keys per part when one decoding step is split over threads. A fixed number (not one derived
/// from the thread count), so that the parts, and the bits of the merged result, are the same for
/// any thread count. 2048 keys of d = 128 floats are 2 MiB of keys and values per part.
inline constexpr Index decode_part_keys = 2048;

/// The partial results of a split decoding step, kept per calling thread between calls (the hot
/// path allocates nothing once they have grown).
template <class T>
struct DecodeParts {
  std::vector<Matrix<T>> o;    ///< per (group, part): rows x d_v
  std::vector<Vector<T>> lse;  ///< per (group, part): rows
};

/// The key columns of `keys` that a decoding step's rows may see by a variant's ranges (their hull
/// over the `groups` x `rows` stacked query heads; `variant` binds row 0 of group 0): the step
/// never reads the others. `keys` itself for a variant without ranges.
template <class T, class Variant>
KeyRange decode_variant_keys(const BoundVariant<Variant>& variant, const ScoreRule<T>& rule,
                             KeyRange keys, Index groups, Index rows) {
  if constexpr (variant_ranges_v<Variant>) {
    Index begin = keys.end;
    Index end = keys.begin;
    for (Index h = 0; h < groups * rows; ++h) {
      BoundVariant<Variant> row = variant;
      row.head += h;
      row.kv_head += h / rows;
      const KeyRange seen = variant_columns<T>(row, rule, keys, 0, 1);
      if (seen.begin >= seen.end) continue;
      begin = std::min(begin, seen.begin);
      end = std::max(end, seen.end);
    }
    return begin < end ? KeyRange{begin, end} : KeyRange{keys.begin, keys.begin};
  } else {
    static_cast<void>(variant), static_cast<void>(rule), static_cast<void>(groups);
    static_cast<void>(rows);
    return keys;
  }
}

/// One decoding step of `groups` groups of stacked query rows, each over its own keys, by one rule
/// of key ranges and scalars (the decoding path of `choose_path`). Shape contract: q(g) rows x
/// d_k, k(g) m x d_k, v(g) m x d_v, o(g) rows x d_v (functions returning views). A visible range of
/// more than `decode_part_keys` keys is split into parts of that many: each (group, part) runs in
/// parallel without the sink, then the parts of a group are merged in part order and the sink is
/// added once (the merge protocol, `merge_block`). So even one group (one key/value head, one
/// query) uses every thread, and the result does not depend on their number.
/// A step of less work than `team_flops` runs on the calling thread. Each thread keeps its scratch
/// between calls (`KeptScratch`), and the calling thread the partial results: a repeated step of
/// the same shapes allocates nothing. With a variant, `variant` binds row 0 of group 0; row r of
/// group g is query head `variant.head + g rows + r` over key/value head `variant.kv_head + g`.
/// With `l` (not `NoLse`), l(g) is where group g's rows' log-sum-exps go (rows entries).
template <class T, class QGroup, class KGroup, class VGroup, class OGroup,
          class Variant = NoVariant, class LGroup = NoLse>
void decode_groups(Index groups, const ScoreRule<T>& rule, const QGroup& q, const KGroup& k,
                   const VGroup& v, const OGroup& o, const BoundVariant<Variant>& variant = {},
                   const LGroup& l = {}) {
  if (groups == 0) return;
  const auto lse_of = [&](Index g) -> T* {
    if constexpr (std::is_same_v<LGroup, NoLse>) {
      static_cast<void>(g);
      return nullptr;
    } else {
      return l(g);
    }
  };
  const Index rows = q(0).rows();  // per group
  const KeyRange keys = decode_variant_keys<T>(variant, rule, rule.keys(0), groups, rows);
  const Index m = keys.end - keys.begin;
  const Index parts = std::max<Index>(1, (m + decode_part_keys - 1) / decode_part_keys);
  // The variant of group g over the keys from column j0 on.
  const auto variant_of = [&](Index g, Index j0) {
    DecodeVariant<Variant> bound{variant, rule.q_position, rule.k_position + j0};
    bound.bound.head += g * rows;
    bound.bound.kv_head += g;
    return bound;
  };
  if (parts == 1) {
    const double flops = double(groups) * attention_flops(rows, m, k(0).cols(), v(0).cols());
    parallel_for<KeptScratch<DecodeScratch<T>>>(groups, flops, [&](Index g, auto& kept) {
      decode_blocks<T>(q(g), kernel_block<T>(k(g).middleRows(keys.begin, m)),
                       kernel_block<T>(v(g).middleRows(keys.begin, m)), rule, kept.get(), o(g),
                       lse_of(g), variant_of(g, keys.begin));
    });
    return;
  }
  // The calling thread's buffers: named through a reference, since inside the parallel loop the
  // name of a thread_local would mean each worker's own.
  DecodeParts<T>& store = thread_buffer<DecodeParts<T>, DecodeParts<T>>();
  const auto tasks = static_cast<std::size_t>(groups * parts);
  if (store.o.size() < tasks) {
    store.o.resize(tasks);
    store.lse.resize(tasks);
  }
  ScoreRule<T> part_rule = rule;
  part_rule.sink.reset();
  parallel_for<KeptScratch<DecodeScratch<T>>>(groups * parts, [&](Index t, auto& kept) {
    const Index g = t / parts;
    const Index j0 = keys.begin + (t % parts) * decode_part_keys;
    const Index cols = std::min(decode_part_keys, keys.end - j0);
    const auto i = static_cast<std::size_t>(t);
    store.o[i].resize(q(g).rows(), v(g).cols());
    store.lse[i].resize(q(g).rows());
    decode_blocks<T>(q(g), kernel_block<T>(k(g).middleRows(j0, cols)),
                     kernel_block<T>(v(g).middleRows(j0, cols)), part_rule, kept.get(), store.o[i],
                     store.lse[i].data(), variant_of(g, j0));
  });
  const double merge_flops = 4.0 * double(groups * parts * rows) * double(v(0).cols());
  parallel_for<KeptScratch<Vector<T>>>(groups, merge_flops, [&](Index g, auto& kept) {
    Vector<T>& lse = kept.get();
    const auto first = static_cast<std::size_t>(g * parts);
    Eigen::Ref<Matrix<T>> out = o(g);
    out = store.o[first];
    lse = store.lse[first];
    for (Index p = 1; p < parts; ++p) {
      const auto i = first + static_cast<std::size_t>(p);
      merge_block<T>(out, lse.data(), store.o[i], store.lse[i].data());
    }
    finish_merge<T>(out, lse.data(), rule.sink);
    if (T* to = lse_of(g)) std::copy(lse.data(), lse.data() + lse.size(), to);
  });
}

/// Attention of one head on the path `choose_path` picks, the tiled path parallel over its query
/// blocks: the entry point of the single-head calls. K and V are `ConstRef<T>`s or `StoredBlock`s
/// (`kernel_block`: keys and values in `Eigen::half` or `Eigen::bfloat16`).
template <class T, class KBlock, class VBlock>
void attend_one(ConstRef<T> Q, const KBlock& K, const VBlock& V, const ScoreRule<T>& rule,
                PathScratch<T>& scratch, Eigen::Ref<Matrix<T>> O, T* lse, bool need_weights) {
  const Path path = choose_path(rule, K.cols(), V.cols(), need_weights);
  if (path == Path::Tiled) {
    flash_kernel_on<T>(Q, K, V, rule, FlashTiles{}, O, lse);
  } else if (path == Path::Decode && lse == nullptr) {
    decode_groups<T>(
        1, rule, [&](Index) { return Q; }, [&](Index) { return K; }, [&](Index) { return V; },
        [&](Index) { return O; });
  } else {
    run_path<T>(path, Q, K, V, rule, scratch, O, lse);
  }
}

}  // namespace detail
}  // namespace attn

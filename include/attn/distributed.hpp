#pragma once
/// \file distributed.hpp
/// `ring_attention`: attention over a sequence split across the processes of an MPI communicator
/// (sequence parallelism, "ring attention": Liu, Zaharia and Abbeel 2023). Each rank holds a
/// contiguous block of the sequence's rows, in rank order; key/value blocks travel around the ring
/// with non-blocking sends and receives while the tiled kernel (`flash_attention`) works on the
/// block in hand, and each rank merges its partial results by log-sum-exp in a fixed order (the
/// ring's), so the result does not depend on timing.
///
/// Optional: not in the umbrella header `attn.hpp`. It needs MPI (`<mpi.h>`); the CMake package
/// offers it as the target `attn::distributed` when MPI is found.
///
/// With a causal mask, contiguous blocks would leave rank 0 one block of work and the last rank
/// all of them. The call then deals the sequence out again ("zigzag", as ring-flash-attention
/// does): the rows are cut into 2P chunks and rank r computes chunks r and 2P-1-r, one early and
/// one late, so every rank has about the same work; the rows go back to their owners at the end.
/// A key/value block travels only as far as a rank that needs it, and pairs of a query chunk and
/// a key chunk that no query can see (above the diagonal, outside a window) are never computed.

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backward.hpp"
#include "detail/online_softmax.hpp"
#include "detail/score_rule.hpp"
#include "error.hpp"
#include "flash.hpp"
#include "heads.hpp"
#include "tensor.hpp"
#include "types.hpp"

namespace attn {

/// What one rank's `ring_attention` call did (the overloads taking a `RingStats&`): for
/// benchmarks and for the fraction of the communication hidden behind compute.
struct RingStats {
  int ranks = 0;                             ///< processes in the communicator
  bool zigzag = false;                       ///< whether the rows were dealt out again (causal)
  double compute_seconds = 0;                ///< in the tiled kernel and the merges
  double wait_seconds = 0;                   ///< waiting for a block still in flight (not hidden)
  double redistribute_seconds = 0;           ///< dealing the rows out and back (zigzag only)
  std::int64_t ring_bytes_sent = 0;          ///< key/value bytes this rank sent around the ring
  std::int64_t redistribute_bytes_sent = 0;  ///< bytes this rank sent to deal rows out and back
  Index pairs_computed = 0;  ///< (query chunk, key chunk) pairs computed, all heads counted once
  Index pairs_skipped = 0;   ///< pairs no query of the chunk could see
};

namespace detail {

/// The MPI datatype of a scalar that `ring_attention` sends.
template <class S>
MPI_Datatype mpi_datatype() {
  if constexpr (std::is_same_v<S, float>) {
    return MPI_FLOAT;
  } else if constexpr (std::is_same_v<S, double>) {
    return MPI_DOUBLE;
  } else {
    static_assert(std::is_same_v<S, unsigned char>, "ring_attention: float or double only");
    return MPI_UNSIGNED_CHAR;
  }
}

/// Raises an MPI error code as a `std::runtime_error` naming the call.
inline void mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(std::string("attn::ring_attention: ") + call +
                           " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

/// Sorted, disjoint half-open ranges [first, second) of global row indices.
using RowRanges = std::vector<std::pair<Index, Index>>;

/// Which global rows each rank holds, in the order it stores them (its ranges, ascending).
struct RowLayout {
  std::vector<RowRanges> of_rank;

  /// The number of rows rank r holds.
  Index rows(int r) const {
    Index count = 0;
    for (const auto& [begin, end] : of_rank[static_cast<std::size_t>(r)]) count += end - begin;
    return count;
  }
  /// Where global row g is stored on rank r (g must be one of its rows).
  Index local_index(int r, Index g) const {
    Index offset = 0;
    for (const auto& [begin, end] : of_rank[static_cast<std::size_t>(r)]) {
      if (g < end) return offset + (g - begin);
      offset += end - begin;
    }
    ATTN_ASSERT(false);
    return -1;
  }
};

/// Each rank's own block, in rank order: rank r holds rows [sum of counts before r, + counts[r]).
inline RowLayout contiguous_layout(const std::vector<Index>& counts) {
  RowLayout layout;
  Index begin = 0;
  for (const Index count : counts) {
    layout.of_rank.push_back(count > 0 ? RowRanges{{begin, begin + count}} : RowRanges{});
    begin += count;
  }
  return layout;
}

/// The zigzag deal of `total` rows over `ranks` ranks: 2 ranks chunks of (almost) equal size,
/// chunk c = [c total / 2P, (c + 1) total / 2P); rank r holds chunks r and 2P - 1 - r.
inline RowLayout zigzag_layout(Index total, int ranks) {
  const Index chunks = 2 * static_cast<Index>(ranks);
  const auto bound = [&](Index c) {  // c total / chunks without overflow: c <= chunks
    return c / chunks * total + (c % chunks) * (total / chunks) +
           (c % chunks) * (total % chunks) / chunks;
  };
  RowLayout layout;
  for (int r = 0; r < ranks; ++r) {
    RowRanges ranges;
    for (const Index c : {static_cast<Index>(r), chunks - 1 - r}) {
      if (bound(c + 1) > bound(c)) ranges.emplace_back(bound(c), bound(c + 1));
    }
    layout.of_rank.push_back(ranges);
  }
  return layout;
}

/// The rows both range lists hold, ascending.
inline RowRanges intersect(const RowRanges& a, const RowRanges& b) {
  RowRanges both;
  for (const auto& [a_begin, a_end] : a) {
    for (const auto& [b_begin, b_end] : b) {
      const Index begin = std::max(a_begin, b_begin);
      const Index end = std::min(a_end, b_end);
      if (begin < end) both.emplace_back(begin, end);
    }
  }
  std::sort(both.begin(), both.end());
  return both;
}

/// An element count as the `int` MPI takes. \throws shape_error past INT_MAX.
inline int mpi_count(Index count) {
  if (count > static_cast<Index>(INT_MAX)) {
    fail("ring_attention", "a message of ", count, " elements exceeds MPI's int count");
  }
  return static_cast<int>(count);
}

/// Moves the rows of a row-major table of `width` columns from layout `from` to layout `to`
/// (one MPI_Alltoallv). `in` holds this rank's rows under `from`, `out` receives them under `to`.
/// \returns the bytes this rank sent to other ranks.
template <class S>
std::int64_t move_rows(MPI_Comm comm, int rank, const RowLayout& from, const RowLayout& to,
                       const S* in, Index width, S* out) {
  const int ranks = static_cast<int>(from.of_rank.size());
  const std::size_t P = static_cast<std::size_t>(ranks);
  std::vector<int> send_counts(P), send_offsets(P), recv_counts(P), recv_offsets(P);
  std::vector<S> send;
  std::int64_t bytes = 0;
  const RowRanges& mine_from = from.of_rank[static_cast<std::size_t>(rank)];
  const RowRanges& mine_to = to.of_rank[static_cast<std::size_t>(rank)];
  for (int d = 0; d < ranks; ++d) {
    send_offsets[static_cast<std::size_t>(d)] = mpi_count(static_cast<Index>(send.size()));
    for (const auto& [begin, end] : intersect(mine_from, to.of_rank[static_cast<std::size_t>(d)])) {
      const S* rows = in + from.local_index(rank, begin) * width;
      send.insert(send.end(), rows, rows + (end - begin) * width);
    }
    send_counts[static_cast<std::size_t>(d)] =
        mpi_count(static_cast<Index>(send.size())) - send_offsets[static_cast<std::size_t>(d)];
    if (d != rank) {
      bytes += static_cast<std::int64_t>(send_counts[static_cast<std::size_t>(d)]) *
               static_cast<std::int64_t>(sizeof(S));
    }
  }
  Index received = 0;
  std::vector<RowRanges> incoming(P);
  for (int s = 0; s < ranks; ++s) {
    incoming[static_cast<std::size_t>(s)] =
        intersect(from.of_rank[static_cast<std::size_t>(s)], mine_to);
    Index rows = 0;
    for (const auto& [begin, end] : incoming[static_cast<std::size_t>(s)]) rows += end - begin;
    recv_offsets[static_cast<std::size_t>(s)] = mpi_count(received);
    recv_counts[static_cast<std::size_t>(s)] = mpi_count(rows * width);
    received += rows * width;
  }
  std::vector<S> receive(static_cast<std::size_t>(received));
  mpi_check(MPI_Alltoallv(send.data(), send_counts.data(), send_offsets.data(), mpi_datatype<S>(),
                          receive.data(), recv_counts.data(), recv_offsets.data(),
                          mpi_datatype<S>(), comm),
            "MPI_Alltoallv");
  const S* at = receive.data();
  for (int s = 0; s < ranks; ++s) {
    for (const auto& [begin, end] : incoming[static_cast<std::size_t>(s)]) {
      std::copy(at, at + (end - begin) * width, out + to.local_index(rank, begin) * width);
      at += (end - begin) * width;
    }
  }
  return bytes;
}

/// Whether V's tile classification of a whole (query range, key range) pair of the ring costs
/// no evaluation of a mask: V classifies tiles itself or has no mask, and so do both sides of a
/// composition. Only such a variant is asked which pairs it leaves Empty.
template <class V>
struct tiles_cheaply : std::bool_constant<variant_tiles_v<V> || !variant_masks_v<V>> {};
template <class A, class B>
struct tiles_cheaply<Both<A, B>>
    : std::bool_constant<tiles_cheaply<A>::value && tiles_cheaply<B>::value> {};
template <class A, class B>
struct tiles_cheaply<Either<A, B>>
    : std::bool_constant<tiles_cheaply<A>::value && tiles_cheaply<B>::value> {};

/// Which (query range, key range) pairs of the whole sequence a ring call computes: those the
/// score rule's key ranges reach (its causal and window bounds; masks and biases are left to the
/// kernel) and, with a variant that classifies tiles cheaply (`tiles_cheaply`), those it does not
/// call Empty for every query head. Ranges are global rows; query i stands at `rule.q_position +
/// i`, key j at j.
template <class T, class Variant = NoVariant>
struct RingVisibility {
  ScoreRule<T> rule;  ///< the whole sequence's (its tables left out)
  const Variant* variant = nullptr;
  Index heads_q = 1;
  Index group = 1;

  Index shift() const { return rule.q_position; }

  bool operator()(std::pair<Index, Index> queries, std::pair<Index, Index> keys) const {
    if (queries.first >= queries.second || keys.first >= keys.second) return false;
    const KeyRange reach = rule.keys(queries.first, queries.second - queries.first);
    if (reach.end <= keys.first || reach.begin >= keys.second) return false;
    if constexpr (is_variant_v<Variant> && tiles_cheaply<Variant>::value) {
      for (Index h = 0; h < heads_q; ++h) {
        const TileAt tile{0,
                          h,
                          h / group,
                          {rule.q_position + queries.first, rule.q_position + queries.second},
                          {keys.first, keys.second}};
        if (classify_tile(*variant, tile) != TileKind::Empty) return true;
      }
      return false;
    }
    return true;
  }
};

/// A rank's rows of one head, read in place: row-major, rows adjacent.
template <class T>
using RowsMap = Eigen::Map<const Matrix<T>>;

/// Per-head tables under the ring's layout: the caller's own rows when the layout is the home one
/// (no copy), else the dealt copies in `storage`.
template <class T>
struct DealtHeads {
  std::vector<Matrix<T>> storage;
  std::vector<RowsMap<T>> heads;
};

/// The rows the ring computes at once: the kernel is called on at most this many queries, so that
/// a test of the messages in flight (which lets MPI move them) comes often enough.
constexpr Index ring_query_rows = 512;

/// One rank's operands under the ring's layout: per query head its rows, the key/value block it
/// starts with (all key/value heads packed: K heads, then V heads), and its mask/bias rows.
template <class T>
struct RingOperands {
  Index heads_q = 1;
  Index heads_kv = 1;
  Index d_k = 0;
  Index d_v = 0;
  DealtHeads<T> Q;           ///< heads_q tables of (this rank's rows) x d_k
  std::vector<T> block;      ///< heads_kv x rows x d_k keys, then heads_kv x rows x d_v values
  std::optional<Mask> mask;  ///< this rank's query rows x M (global key columns)
  std::optional<Matrix<T>> bias;
};

/// The options of one (query chunk, key chunk) pair: the call's, without the sink (added once,
/// after the merge, or carried by the lse in the backward) and without the tables (each pair gets
/// its slices). `for_each_pair` sets the query offset and the slices.
template <class T>
AttentionOptions<T> pair_options_of(const AttentionOptions<T>& options) {
  AttentionOptions<T> pair = options;
  pair.sink.reset();
  pair.mask.reset();
  pair.bias.reset();
  return pair;
}

/// The rule of one piece with a variant: the pair's options at the piece's global positions, so
/// that the variant sees each query and key where it stands in the whole sequence (query i at key
/// position i + shift, key j of the block at its global index).
template <class T>
ScoreRule<T> piece_rule(const AttentionOptions<T>& pair, Index rows, Index key_first,
                        Index key_count, Index d_k) {
  ScoreRule<T> rule = make_rule(pair, rows, key_count, d_k);
  rule.q_position += key_first;  // the pair's query offset counts from the block's first key
  rule.k_position = key_first;
  return rule;
}

/// A learnable variant's gradient summed over the ranks in rank order (the same bits on every
/// rank). The ring sends it as numbers: its `Gradient` must be `Matrix<T>`.
template <class T, class Gradient>
void sum_over_ranks(MPI_Comm comm, int ranks, Gradient& gradient) {
  static_assert(std::is_same_v<Gradient, Matrix<T>>,
                "attn: ring_attention_backward sums a learnable variant's gradient over the ranks "
                "as numbers: its `Gradient` must be attn::Matrix<T>");
  const Index size = gradient.size();
  std::vector<T> every(static_cast<std::size_t>(size * ranks));
  mpi_check(MPI_Allgather(gradient.data(), mpi_count(size), mpi_datatype<T>(), every.data(),
                          mpi_count(size), mpi_datatype<T>(), comm),
            "MPI_Allgather");
  gradient.setZero();
  for (int r = 0; r < ranks; ++r) {
    gradient +=
        Eigen::Map<const Matrix<T>>(every.data() + r * size, gradient.rows(), gradient.cols());
  }
}

/// The work a key block brings to this rank, in a fixed order: for each of the block's key ranges
/// and each of this rank's query ranges that may see it (`pair_visible`; pairs counted in
/// `stats`), the query rows `ring_query_rows` at a time, those that may see the keys (`visible`). For each
/// piece, `pair` gets the piece's query offset and its slices of the mask and bias rows, then
/// `work(first, rows, key_local, key_first, key_count)` runs: query rows [first, first + rows) of
/// this rank's layout against the block's rows [key_local, key_local + key_count), global key
/// position key_first on.
template <class T, class Variant, class Work>
void for_each_pair(const RowRanges& queries, const RowRanges& keys,
                   const RingVisibility<T, Variant>& visible, const RingOperands<T>& in,
                   AttentionOptions<T>& pair, RingStats& stats, Work&& work) {
  const Index shift = visible.shift();
  Index key_local = 0;
  for (const auto& k : keys) {
    const Index key_count = k.second - k.first;
    Index query_local = 0;
    for (const auto& q : queries) {
      const Index query_count = q.second - q.first;
      if (!visible(q, k)) {
        ++stats.pairs_skipped;
        query_local += query_count;
        continue;
      }
      ++stats.pairs_computed;
      for (Index c0 = 0; c0 < query_count; c0 += ring_query_rows) {
        const Index rows = std::min(ring_query_rows, query_count - c0);
        const Index first = query_local + c0;
        if (!visible({q.first + c0, q.first + c0 + rows}, k)) continue;
        pair.query_offset =
            narrow_clamped(wide(q.first + c0) + wide(shift) - wide(k.first), index_min, index_max);
        if (in.mask) pair.mask = Mask(in.mask->block(first, k.first, rows, key_count));
        if (in.bias) pair.bias = Matrix<T>(in.bias->block(first, k.first, rows, key_count));
        work(first, rows, key_local, k.first, key_count);
      }
      query_local += query_count;
    }
    key_local += key_count;
  }
}

/// The ring itself, on operands already under their layouts. Returns per query head the output
/// rows (this rank's rows under `query_layout`). With a variant (not null), each piece runs the
/// tiled kernel with it at the piece's global positions (`piece_rule`), query head h as
/// `ScoreAt::head`.
template <class T, class Variant = NoVariant>
void ring_core(MPI_Comm comm, int rank, int ranks, const RowLayout& query_layout,
               const RowLayout& key_layout, const RingVisibility<T, Variant>& visible,
               const AttentionOptions<T>& options, RingOperands<T>& in, RingStats& stats,
               std::vector<Matrix<T>>& out, std::vector<Vector<T>>& lse,
               const Variant* variant = nullptr) {
  const Index group = in.heads_q / in.heads_kv;
  const Index my_rows = query_layout.rows(rank);
  out.assign(static_cast<std::size_t>(in.heads_q), Matrix<T>::Zero(my_rows, in.d_v));
  lse.assign(static_cast<std::size_t>(in.heads_q),
             Vector<T>::Constant(my_rows, -std::numeric_limits<T>::infinity()));
  const RowRanges& my_queries = query_layout.of_rank[static_cast<std::size_t>(rank)];

  // needed[x][b]: whether rank x's queries see any key of rank b's block.
  std::vector<std::vector<bool>> needed(static_cast<std::size_t>(ranks),
                                        std::vector<bool>(static_cast<std::size_t>(ranks), false));
  for (int x = 0; x < ranks; ++x) {
    for (int b = 0; b < ranks; ++b) {
      for (const auto& q : query_layout.of_rank[static_cast<std::size_t>(x)]) {
        for (const auto& k : key_layout.of_rank[static_cast<std::size_t>(b)]) {
          if (visible(q, k)) {
            needed[static_cast<std::size_t>(x)][static_cast<std::size_t>(b)] = true;
          }
        }
      }
    }
  }
  const auto wrap = [ranks](int r) { return ((r % ranks) + ranks) % ranks; };
  // Whether the rank holding block b at step s passes it on: some rank further along needs it.
  const auto forwards = [&](int holder, int b, int s) {
    for (int t = 1; t < ranks - s; ++t) {
      if (needed[static_cast<std::size_t>(wrap(holder + t))][static_cast<std::size_t>(b)]) {
        return true;
      }
    }
    return false;
  };
  const auto block_elements = [&](int b) {
    return key_layout.rows(b) * in.heads_kv * (in.d_k + in.d_v);
  };

  AttentionOptions<T> pair_options = pair_options_of(options);  // the sink: after the merge
  std::vector<T> current = std::move(in.block);
  std::vector<T> next;
  Matrix<T> partial;
  Vector<T> partial_lse;
  const int right = wrap(rank + 1);
  const int left = wrap(rank - 1);
  for (int s = 0; s < ranks; ++s) {
    const int b = wrap(rank - s);  // the block in hand, if it came this far
    const bool have = s == 0 || forwards(left, b, s - 1);
    // Start passing the block on and receiving the next one, then compute on this one. (A rank
    // that does not hold block b does not pass it on: no rank after it needs it.)
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    const bool send = have && s + 1 < ranks && forwards(rank, b, s);
    const int b_next = wrap(rank - s - 1);
    const bool receive = s + 1 < ranks && forwards(left, b_next, s);
    if (receive) {
      next.resize(static_cast<std::size_t>(block_elements(b_next)));
      mpi_check(MPI_Irecv(next.data(), mpi_count(block_elements(b_next)), mpi_datatype<T>(), left,
                          s, comm, &requests[0]),
                "MPI_Irecv");
    }
    if (send) {
      mpi_check(MPI_Isend(current.data(), mpi_count(block_elements(b)), mpi_datatype<T>(), right, s,
                          comm, &requests[1]),
                "MPI_Isend");
      stats.ring_bytes_sent +=
          static_cast<std::int64_t>(block_elements(b)) * static_cast<std::int64_t>(sizeof(T));
    }
    const double compute_start = MPI_Wtime();
    // MPI moves a large message only while the process calls into it (no progress thread by
    // default): a test between kernel calls lets the transfer go on behind the compute.
    const auto progress = [&requests] {
      int done = 0;
      MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE);
    };
    const Index block_rows = have ? key_layout.rows(b) : 0;
    const T* keys = current.data();
    const T* values = current.data() + in.heads_kv * block_rows * in.d_k;
    const RowRanges no_keys;
    for_each_pair(
        my_queries, have ? key_layout.of_rank[static_cast<std::size_t>(b)] : no_keys, visible, in,
        pair_options, stats,
        [&](Index first, Index rows, Index key_local, Index key_first, Index key_count) {
          for (Index h = 0; h < in.heads_q; ++h) {
            const Index g = h / group;
            const RowsMap<T> K_g(keys + g * block_rows * in.d_k, block_rows, in.d_k);
            const RowsMap<T> V_g(values + g * block_rows * in.d_v, block_rows, in.d_v);
            const auto h_index = static_cast<std::size_t>(h);
            if constexpr (is_variant_v<Variant>) {
              partial.resize(rows, in.d_v);
              partial_lse.resize(rows);
              flash_kernel_on<T>(in.Q.heads[h_index].middleRows(first, rows),
                                 ConstRef<T>(K_g.middleRows(key_local, key_count)),
                                 ConstRef<T>(V_g.middleRows(key_local, key_count)),
                                 piece_rule(pair_options, rows, key_first, key_count, in.d_k),
                                 FlashTiles{}, partial, partial_lse.data(),
                                 BoundVariant<Variant>{variant, 0, h, g});
            } else {
              static_cast<void>(key_first);
              partial = flash_attention(
                  in.Q.heads[h_index].middleRows(first, rows), K_g.middleRows(key_local, key_count),
                  V_g.middleRows(key_local, key_count), pair_options, partial_lse);
            }
            merge_block<T>(out[h_index].middleRows(first, rows), lse[h_index].data() + first,
                           partial, partial_lse.data());
            progress();
          }
        });
    stats.compute_seconds += MPI_Wtime() - compute_start;
    const double wait_start = MPI_Wtime();
    mpi_check(MPI_Waitall(2, requests, MPI_STATUSES_IGNORE), "MPI_Waitall");
    stats.wait_seconds += MPI_Wtime() - wait_start;
    if (receive) std::swap(current, next);
  }
  for (Index h = 0; h < in.heads_q; ++h) {
    const auto h_index = static_cast<std::size_t>(h);
    finish_merge<T>(out[h_index], lse[h_index].data(), options.sink);
  }
}

/// The sizes every rank needs: its query rows, key rows, widths and heads, and whether its own
/// arguments passed their checks.
struct RingSizes {
  std::int64_t n = 0, m = 0, d_k = 0, d_v = 0, heads_q = 0, heads_kv = 0, ok = 1;
};

/// Gathers every rank's sizes; throws `shape_error` on every rank (so that none is left waiting)
/// when any rank's arguments are invalid or the ranks disagree on widths or heads.
inline std::vector<RingSizes> gather_sizes(MPI_Comm comm, const RingSizes& mine,
                                           const std::string& local_error) {
  int ranks = 0;
  mpi_check(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  std::vector<RingSizes> all(static_cast<std::size_t>(ranks));
  mpi_check(MPI_Allgather(&mine, 7, MPI_INT64_T, all.data(), 7, MPI_INT64_T, comm),
            "MPI_Allgather");
  for (int r = 0; r < ranks; ++r) {
    if (all[static_cast<std::size_t>(r)].ok == 0) {
      if (!local_error.empty()) throw shape_error(local_error);
      fail("ring_attention", "rank ", r, " was given invalid arguments (its message says which)");
    }
  }
  for (int r = 1; r < ranks; ++r) {
    const RingSizes& a = all[0];
    const RingSizes& b = all[static_cast<std::size_t>(r)];
    if (a.d_k != b.d_k || a.d_v != b.d_v || a.heads_q != b.heads_q || a.heads_kv != b.heads_kv) {
      fail("ring_attention", "the ranks disagree: rank 0 has d_k = ", a.d_k, ", d_v = ", a.d_v,
           ", ", a.heads_q, " query and ", a.heads_kv, " key/value heads; rank ", r,
           " has d_k = ", b.d_k, ", d_v = ", b.d_v, ", ", b.heads_q, " and ", b.heads_kv);
    }
  }
  return all;
}

/// Everything a ring call decides before it moves data: its own communicator, the sizes of every
/// rank, the layouts (home: each rank's own block; ring: the zigzag deal for causal, else home)
/// and the global query position shift. Built collectively; throws on every rank together.
class RingPlan {
 public:
  template <class T>
  RingPlan(MPI_Comm user_comm, RingSizes mine, std::string local_error,
           const AttentionOptions<T>& options) {
    mpi_check(MPI_Comm_dup(user_comm, &comm_), "MPI_Comm_dup");
    try {
      mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
      mpi_check(MPI_Comm_size(comm_, &ranks_), "MPI_Comm_size");
      // A first exchange for M, then the options' checks against it (masks and biases are this
      // rank's rows over all M keys), then the verdict of every rank.
      std::vector<std::int64_t> key_rows(static_cast<std::size_t>(ranks_));
      mpi_check(MPI_Allgather(&mine.m, 1, MPI_INT64_T, key_rows.data(), 1, MPI_INT64_T, comm_),
                "MPI_Allgather");
      std::int64_t all_keys = 0;
      for (const std::int64_t rows : key_rows) {
        all_keys = checked_add("ring_attention", all_keys, rows, "the keys of every rank");
      }
      if (local_error.empty()) {
        try {
          check_options("ring_attention", options, static_cast<Index>(mine.n),
                        static_cast<Index>(all_keys));
        } catch (const shape_error& error) {
          local_error = error.what();
        }
      }
      mine.ok = local_error.empty() ? 1 : 0;
      sizes_ = gather_sizes(comm_, mine, local_error);
    } catch (...) {
      MPI_Comm_free(&comm_);
      throw;
    }
    std::vector<Index> query_counts;
    std::vector<Index> key_counts;
    for (const RingSizes& s : sizes_) {
      query_counts.push_back(static_cast<Index>(s.n));
      key_counts.push_back(static_cast<Index>(s.m));
      N_ = checked_add("ring_attention", N_, static_cast<Index>(s.n), "the queries of every rank");
      M_ = checked_add("ring_attention", M_, static_cast<Index>(s.m), "the keys of every rank");
    }
    shift_ = query_position(options, N_, M_);
    query_home_ = contiguous_layout(query_counts);
    key_home_ = contiguous_layout(key_counts);
    // Zigzag for a causal mask without a window (with a window each rank's work is a band already).
    zigzag_ = ranks_ > 1 && options.causal != Causal::None && !options.window;
    query_layout_ = zigzag_ ? zigzag_layout(N_, ranks_) : query_home_;
    key_layout_ = zigzag_ ? zigzag_layout(M_, ranks_) : key_home_;
  }
  RingPlan(const RingPlan&) = delete;
  RingPlan& operator=(const RingPlan&) = delete;
  ~RingPlan() { MPI_Comm_free(&comm_); }

  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  bool zigzag() const { return zigzag_; }
  Index shift() const { return shift_; }
  Index keys() const { return M_; }
  Index queries() const { return N_; }
  const RingSizes& sizes(int r) const { return sizes_[static_cast<std::size_t>(r)]; }
  const RowLayout& query_layout() const { return query_layout_; }
  const RowLayout& key_layout() const { return key_layout_; }

  /// Rows of a table (`width` columns, row-major) from this rank's own block to its rows under
  /// the ring's layout (`queries`: the query rows' layouts, else the key rows'); a copy when the
  /// two are the same. \returns the bytes sent to other ranks.
  template <class S>
  std::int64_t deal(const S* in, Index width, S* out, bool queries) const {
    return move(in, width, out, queries ? query_home_ : key_home_,
                queries ? query_layout_ : key_layout_);
  }
  /// The reverse of `deal`: rows under the ring's layout back to this rank's own block.
  template <class S>
  std::int64_t undeal(const S* in, Index width, S* out, bool queries) const {
    return move(in, width, out, queries ? query_layout_ : key_layout_,
                queries ? query_home_ : key_home_);
  }

 private:
  template <class S>
  std::int64_t move(const S* in, Index width, S* out, const RowLayout& from,
                    const RowLayout& to) const {
    if (!zigzag_) {
      std::copy(in, in + from.rows(rank_) * width, out);
      return 0;
    }
    return move_rows(comm_, rank_, from, to, in, width, out);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;  // a communicator of its own: its messages meet no other's
  int rank_ = 0;
  int ranks_ = 1;
  std::vector<RingSizes> sizes_;
  Index N_ = 0;
  Index M_ = 0;
  Index shift_ = 0;
  bool zigzag_ = false;
  RowLayout query_home_, key_home_, query_layout_, key_layout_;
};

/// Per-head tables of this rank's rows (`rows` x `width` each under the ring's layout) moved by
/// `plan` into the ring's layout (`queries`: the query rows, else the key rows); read in place
/// when the layout is the home one.
template <class T>
DealtHeads<T> deal_heads(const RingPlan& plan, const std::vector<RowsMap<T>>& heads, Index rows,
                         Index width, bool queries, RingStats& stats) {
  DealtHeads<T> dealt;
  if (!plan.zigzag()) {
    for (const RowsMap<T>& head : heads) dealt.heads.push_back(head);  // (a Map cannot be assigned)
    return dealt;
  }
  for (const RowsMap<T>& head : heads) {
    dealt.storage.emplace_back(rows, width);
    stats.redistribute_bytes_sent +=
        plan.deal(head.data(), width, dealt.storage.back().data(), queries);
  }
  for (const Matrix<T>& head : dealt.storage) dealt.heads.emplace_back(head.data(), rows, width);
  return dealt;
}

/// The options' mask and bias rows moved into the ring's layout (a bool mask travels as bytes).
template <class T>
void deal_tables(const RingPlan& plan, const AttentionOptions<T>& options, Index rows,
                 RingOperands<T>& in, RingStats& stats) {
  const Index M = plan.keys();
  if (options.mask) {
    const Mask& mask = *options.mask;
    std::vector<unsigned char> bytes(static_cast<std::size_t>(mask.size()));
    for (Index i = 0; i < mask.rows(); ++i) {
      for (Index j = 0; j < M; ++j) bytes[static_cast<std::size_t>(i * M + j)] = mask(i, j) ? 1 : 0;
    }
    std::vector<unsigned char> dealt(static_cast<std::size_t>(rows * M));
    stats.redistribute_bytes_sent += plan.deal(bytes.data(), M, dealt.data(), true);
    in.mask = Mask(rows, M);
    for (Index i = 0; i < rows; ++i) {
      for (Index j = 0; j < M; ++j) {
        (*in.mask)(i, j) = dealt[static_cast<std::size_t>(i * M + j)] != 0;
      }
    }
  }
  if (options.bias) {
    in.bias = Matrix<T>(rows, M);
    stats.redistribute_bytes_sent += plan.deal(options.bias->data(), M, in.bias->data(), true);
  }
}

/// The operands of a ring call under the ring's layout: queries per head, the starting block
/// (keys, then values, of every key/value head), mask and bias rows.
template <class T>
RingOperands<T> deal_operands(const RingPlan& plan, const std::vector<RowsMap<T>>& Q,
                              const std::vector<RowsMap<T>>& K, const std::vector<RowsMap<T>>& V,
                              const AttentionOptions<T>& options, RingStats& stats) {
  const RingSizes& mine = plan.sizes(plan.rank());
  RingOperands<T> in;
  in.heads_q = static_cast<Index>(mine.heads_q);
  in.heads_kv = static_cast<Index>(mine.heads_kv);
  in.d_k = static_cast<Index>(mine.d_k);
  in.d_v = static_cast<Index>(mine.d_v);
  const Index queries = plan.query_layout().rows(plan.rank());
  const Index keys = plan.key_layout().rows(plan.rank());
  in.Q = deal_heads(plan, Q, queries, in.d_k, true, stats);
  in.block.resize(static_cast<std::size_t>(in.heads_kv * keys * (in.d_k + in.d_v)));
  for (Index g = 0; g < in.heads_kv; ++g) {
    const auto g_index = static_cast<std::size_t>(g);
    stats.redistribute_bytes_sent +=
        plan.deal(K[g_index].data(), in.d_k, in.block.data() + g * keys * in.d_k, false);
    stats.redistribute_bytes_sent +=
        plan.deal(V[g_index].data(), in.d_v,
                  in.block.data() + (in.heads_kv * in.d_k + g * in.d_v) * keys, false);
  }
  deal_tables(plan, options, queries, in, stats);
  return in;
}

/// The pairs a call computes (`RingVisibility`): the whole sequence's rule, without its tables.
template <class T, class Variant>
RingVisibility<T, Variant> ring_visibility(const RingPlan& plan, const AttentionOptions<T>& options,
                                           const RingOperands<T>& in, const Variant* variant) {
  return {make_rule(pair_options_of(options), plan.queries(), plan.keys(), in.d_k), variant,
          in.heads_q, in.heads_q / in.heads_kv};
}

/// The forward of every form of `ring_attention`, after the local checks: `Q` per query head
/// (this rank's rows), `K` and `V` per key/value head. Returns per query head the output rows and,
/// when `lse_out` is given, their log-sum-exp (sink included).
template <class T, class Variant = NoVariant>
std::vector<Matrix<T>> ring_forward(MPI_Comm user_comm, const std::vector<RowsMap<T>>& Q,
                                    const std::vector<RowsMap<T>>& K,
                                    const std::vector<RowsMap<T>>& V,
                                    const AttentionOptions<T>& options, const RingSizes& mine,
                                    const std::string& local_error, RingStats& stats,
                                    std::vector<Vector<T>>* lse_out = nullptr,
                                    const Variant* variant = nullptr) {
  stats = RingStats{};
  const RingPlan plan(user_comm, mine, local_error, options);
  if constexpr (is_variant_v<Variant>) {  // the same sizes on every rank: all throw or none
    require_variant_positions("ring_attention", plan.shift(), plan.queries(), 0, plan.keys());
  }
  stats.ranks = plan.ranks();
  stats.zigzag = plan.zigzag();
  const double deal_start = MPI_Wtime();
  RingOperands<T> in = deal_operands(plan, Q, K, V, options, stats);
  stats.redistribute_seconds += MPI_Wtime() - deal_start;

  std::vector<Matrix<T>> dealt_out;
  std::vector<Vector<T>> dealt_lse;
  ring_core<T, Variant>(plan.comm(), plan.rank(), plan.ranks(), plan.query_layout(),
                        plan.key_layout(), ring_visibility(plan, options, in, variant), options, in,
                        stats, dealt_out, dealt_lse, variant);
  if (!plan.zigzag()) {
    if (lse_out) *lse_out = std::move(dealt_lse);
    return dealt_out;
  }
  const double back_start = MPI_Wtime();
  const Index rows = static_cast<Index>(mine.n);
  std::vector<Matrix<T>> out;
  for (const Matrix<T>& O_h : dealt_out) {
    out.emplace_back(rows, in.d_v);
    stats.redistribute_bytes_sent += plan.undeal(O_h.data(), in.d_v, out.back().data(), true);
  }
  if (lse_out) {
    lse_out->clear();
    for (const Vector<T>& lse_h : dealt_lse) {
      lse_out->emplace_back(rows);
      stats.redistribute_bytes_sent += plan.undeal(lse_h.data(), 1, lse_out->back().data(), true);
    }
  }
  stats.redistribute_seconds += MPI_Wtime() - back_start;
  return out;
}

/// Gradients of one rank's rows from a ring call: per query head dQ, per key/value head dK and
/// dV, the mask-shaped dbias rows (summed over the heads) and dsink (summed over every rank).
template <class T>
struct RingGradients {
  std::vector<Matrix<T>> dQ, dK, dV;
  Matrix<T> dbias;
  T dsink = T(0);
};

/// The backward of `ring_attention`: key/value blocks go around the ring as in the forward, each
/// followed one step behind by the dK and dV it has gathered so far; after a full turn the
/// gathered gradients reach the block's owner. Each pair (query chunk, key chunk) in reach runs
/// `attention_backward` with the forward's global output and log-sum-exp, which is exact: P =
/// exp(z - lse) with the global lse is the pair's share of the whole softmax. With a variant (not
/// null), each piece's backward runs with it at the piece's global positions; a learnable
/// variant's gradient goes into `dparams` (when not null): summed piece by piece in the ring's
/// order on each rank, then over the ranks in rank order.
template <class T, class Variant = NoVariant>
RingGradients<T> ring_backward(MPI_Comm user_comm, const std::vector<RowsMap<T>>& Q,
                               const std::vector<RowsMap<T>>& K, const std::vector<RowsMap<T>>& V,
                               const std::vector<RowsMap<T>>& O,
                               const std::vector<Vector<T>>& log_sum_exp,
                               const std::vector<RowsMap<T>>& dO,
                               const AttentionOptions<T>& options, const RingSizes& mine,
                               const std::string& local_error, RingStats& stats,
                               const Variant* variant = nullptr,
                               typename GradientOf<Variant>::type* dparams = nullptr) {
  using Gradient = typename GradientOf<Variant>::type;
  stats = RingStats{};
  const RingPlan plan(user_comm, mine, local_error, options);
  if constexpr (is_variant_v<Variant>) {  // the same sizes on every rank: all throw or none
    require_variant_positions("ring_attention_backward", plan.shift(), plan.queries(), 0,
                              plan.keys());
  }
  const MPI_Comm comm = plan.comm();
  const int rank = plan.rank();
  const int ranks = plan.ranks();
  stats.ranks = ranks;
  stats.zigzag = plan.zigzag();
  const double deal_start = MPI_Wtime();
  RingOperands<T> in = deal_operands(plan, Q, K, V, options, stats);
  const Index my_rows = plan.query_layout().rows(rank);
  const DealtHeads<T> O_dealt = deal_heads(plan, O, my_rows, in.d_v, true, stats);
  const DealtHeads<T> dO_dealt = deal_heads(plan, dO, my_rows, in.d_v, true, stats);
  std::vector<Vector<T>> lse_dealt;
  for (const Vector<T>& lse_h : log_sum_exp) {
    lse_dealt.emplace_back(my_rows);
    stats.redistribute_bytes_sent += plan.deal(lse_h.data(), 1, lse_dealt.back().data(), true);
  }
  stats.redistribute_seconds += MPI_Wtime() - deal_start;

  const RowLayout& key_layout = plan.key_layout();
  const RowRanges& my_queries = plan.query_layout().of_rank[static_cast<std::size_t>(rank)];
  const Index group = in.heads_q / in.heads_kv;
  const Index width = in.d_k + in.d_v;
  const auto wrap = [ranks](int r) { return ((r % ranks) + ranks) % ranks; };
  const auto block_elements = [&](int b) { return key_layout.rows(b) * in.heads_kv * width; };
  RingGradients<T> grads;
  grads.dQ.assign(static_cast<std::size_t>(in.heads_q), Matrix<T>::Zero(my_rows, in.d_k));
  if (in.bias) grads.dbias = Matrix<T>::Zero(my_rows, plan.keys());

  AttentionOptions<T> pair_options = pair_options_of(options);  // the sink: in lse and dsink
  const RingVisibility<T, Variant> visible = ring_visibility(plan, options, in, variant);
  std::vector<T> current = std::move(in.block);
  std::vector<T> next;
  std::vector<T> gathered;  // dK, dV of the block in hand, from the ranks before
  std::vector<T> partial;   // this rank's share of them
  std::vector<T> sending;   // the sum, on its way to the next rank
  AttentionGrads<T> pair;
  Vector<T> pair_lse;
  Gradient dparams_piece{};
  if constexpr (variant_learns_v<Variant>) {
    if (dparams) *dparams = variant->zero_gradient();
  }
  const int right = wrap(rank + 1);
  const int left = wrap(rank - 1);
  MPI_Request send_gathered = MPI_REQUEST_NULL;
  for (int s = 0; s < ranks; ++s) {
    const int b = wrap(rank - s);
    const Index block_rows = key_layout.rows(b);
    MPI_Request requests[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (s + 1 < ranks) {
      const int b_next = wrap(rank - s - 1);
      next.resize(static_cast<std::size_t>(block_elements(b_next)));
      mpi_check(MPI_Irecv(next.data(), mpi_count(block_elements(b_next)), mpi_datatype<T>(), left,
                          2 * s, comm, &requests[0]),
                "MPI_Irecv");
      mpi_check(MPI_Isend(current.data(), mpi_count(block_elements(b)), mpi_datatype<T>(), right,
                          2 * s, comm, &requests[1]),
                "MPI_Isend");
      stats.ring_bytes_sent +=
          static_cast<std::int64_t>(block_elements(b)) * static_cast<std::int64_t>(sizeof(T));
    }
    if (s > 0) {
      gathered.resize(static_cast<std::size_t>(block_elements(b)));
      mpi_check(MPI_Irecv(gathered.data(), mpi_count(block_elements(b)), mpi_datatype<T>(), left,
                          2 * s - 1, comm, &requests[2]),
                "MPI_Irecv");
    }
    const double compute_start = MPI_Wtime();
    const auto progress = [&requests, &send_gathered] {
      int done = 0;
      MPI_Testall(3, requests, &done, MPI_STATUSES_IGNORE);
      MPI_Test(&send_gathered, &done, MPI_STATUS_IGNORE);
    };
    partial.assign(static_cast<std::size_t>(block_elements(b)), T(0));
    const T* keys = current.data();
    const T* values = current.data() + in.heads_kv * block_rows * in.d_k;
    T* dkeys = partial.data();
    T* dvalues = partial.data() + in.heads_kv * block_rows * in.d_k;
    for_each_pair(
        my_queries, key_layout.of_rank[static_cast<std::size_t>(b)], visible, in, pair_options,
        stats, [&](Index first, Index rows, Index key_local, Index key_first, Index key_count) {
          for (Index h = 0; h < in.heads_q; ++h) {
            const Index g = h / group;
            const auto h_index = static_cast<std::size_t>(h);
            const RowsMap<T> K_g(keys + g * block_rows * in.d_k, block_rows, in.d_k);
            const RowsMap<T> V_g(values + g * block_rows * in.d_v, block_rows, in.d_v);
            if constexpr (is_variant_v<Variant>) {
              const ScoreRule<T> rule =
                  piece_rule(pair_options, rows, key_first, key_count, in.d_k);
              pair_lse = lse_dealt[h_index].segment(first, rows);
              backward_kernel<T>(
                  in.Q.heads[h_index].middleRows(first, rows), K_g.middleRows(key_local, key_count),
                  V_g.middleRows(key_local, key_count),
                  O_dealt.heads[h_index].middleRows(first, rows), pair_lse,
                  dO_dealt.heads[h_index].middleRows(first, rows), rule,
                  backward_path(rule, in.d_k, in.d_v), BackwardTiles{}, pair,
                  BoundVariant<Variant>{variant, 0, h, g}, dparams ? &dparams_piece : nullptr);
              if constexpr (variant_learns_v<Variant>) {
                if (dparams) *dparams += dparams_piece;
              }
            } else {
              attention_backward(
                  in.Q.heads[h_index].middleRows(first, rows), K_g.middleRows(key_local, key_count),
                  V_g.middleRows(key_local, key_count),
                  O_dealt.heads[h_index].middleRows(first, rows),
                  lse_dealt[h_index].segment(first, rows),
                  dO_dealt.heads[h_index].middleRows(first, rows), pair_options, pair);
            }
            grads.dQ[h_index].middleRows(first, rows) += pair.dQ;
            Eigen::Map<Matrix<T>>(dkeys + g * block_rows * in.d_k, block_rows, in.d_k)
                .middleRows(key_local, key_count) += pair.dK;
            Eigen::Map<Matrix<T>>(dvalues + g * block_rows * in.d_v, block_rows, in.d_v)
                .middleRows(key_local, key_count) += pair.dV;
            if (in.bias) grads.dbias.block(first, key_first, rows, key_count) += pair.dbias;
            progress();
          }
        });
    stats.compute_seconds += MPI_Wtime() - compute_start;
    const double wait_start = MPI_Wtime();
    mpi_check(MPI_Wait(&requests[2], MPI_STATUS_IGNORE), "MPI_Wait");
    // What the ranks before gathered, then this rank's share: a fixed order.
    if (s > 0) {
      for (std::size_t e = 0; e < partial.size(); ++e) partial[e] = gathered[e] + partial[e];
    }
    mpi_check(MPI_Wait(&send_gathered, MPI_STATUS_IGNORE), "MPI_Wait");
    std::swap(sending, partial);
    mpi_check(MPI_Isend(sending.data(), mpi_count(block_elements(b)), mpi_datatype<T>(),
                        ranks > 1 ? right : rank, 2 * s + 1, comm, &send_gathered),
              "MPI_Isend");
    if (ranks > 1) {
      stats.ring_bytes_sent +=
          static_cast<std::int64_t>(block_elements(b)) * static_cast<std::int64_t>(sizeof(T));
    }
    mpi_check(MPI_Waitall(2, requests, MPI_STATUSES_IGNORE), "MPI_Waitall");
    stats.wait_seconds += MPI_Wtime() - wait_start;
    if (s + 1 < ranks) std::swap(current, next);
  }
  // After a full turn the gradients of this rank's own block arrive from the left (on one rank,
  // from itself).
  std::vector<T> own(static_cast<std::size_t>(block_elements(rank)));
  const double wait_start = MPI_Wtime();
  mpi_check(MPI_Recv(own.data(), mpi_count(block_elements(rank)), mpi_datatype<T>(),
                     ranks > 1 ? left : rank, 2 * ranks - 1, comm, MPI_STATUS_IGNORE),
            "MPI_Recv");
  mpi_check(MPI_Wait(&send_gathered, MPI_STATUS_IGNORE), "MPI_Wait");
  stats.wait_seconds += MPI_Wtime() - wait_start;

  // dsink = -sum_i exp(sink - lse_i) D_i, D_i = rowsum(dO o O)_i, over every rank's rows and
  // heads, summed in rank order.
  if (options.sink) {
    T local = T(0);
    for (Index h = 0; h < in.heads_q; ++h) {
      const auto h_index = static_cast<std::size_t>(h);
      for (Index i = 0; i < my_rows; ++i) {
        const T lse_i = lse_dealt[h_index](i);
        if (lse_i == -std::numeric_limits<T>::infinity()) continue;
        const T D_i = dO_dealt.heads[h_index].row(i).dot(O_dealt.heads[h_index].row(i));
        local -= std::exp(*options.sink - lse_i) * D_i;
      }
    }
    std::vector<T> every(static_cast<std::size_t>(ranks));
    mpi_check(MPI_Allgather(&local, 1, mpi_datatype<T>(), every.data(), 1, mpi_datatype<T>(), comm),
              "MPI_Allgather");
    for (const T value : every) grads.dsink += value;
  }
  if constexpr (variant_learns_v<Variant>) {
    if (dparams) sum_over_ranks<T>(comm, ranks, *dparams);
  }

  const double back_start = MPI_Wtime();
  const Index home_rows = static_cast<Index>(mine.n);
  const Index home_keys = static_cast<Index>(mine.m);
  const Index own_rows = key_layout.rows(rank);
  std::vector<Matrix<T>> dQ_home;
  for (const Matrix<T>& dQ_h : grads.dQ) {
    dQ_home.emplace_back(home_rows, in.d_k);
    stats.redistribute_bytes_sent += plan.undeal(dQ_h.data(), in.d_k, dQ_home.back().data(), true);
  }
  grads.dQ = std::move(dQ_home);
  for (Index g = 0; g < in.heads_kv; ++g) {
    grads.dK.emplace_back(home_keys, in.d_k);
    stats.redistribute_bytes_sent +=
        plan.undeal(own.data() + g * own_rows * in.d_k, in.d_k, grads.dK.back().data(), false);
    grads.dV.emplace_back(home_keys, in.d_v);
    stats.redistribute_bytes_sent +=
        plan.undeal(own.data() + (in.heads_kv * in.d_k + g * in.d_v) * own_rows, in.d_v,
                    grads.dV.back().data(), false);
  }
  if (in.bias) {
    Matrix<T> dbias_home(home_rows, plan.keys());
    stats.redistribute_bytes_sent +=
        plan.undeal(grads.dbias.data(), plan.keys(), dbias_home.data(), true);
    grads.dbias = std::move(dbias_home);
  }
  stats.redistribute_seconds += MPI_Wtime() - back_start;
  return grads;
}

/// The local checks of one rank's operands, as a message ("" when they pass).
template <class F>
std::string local_check(F&& check) {
  try {
    check();
  } catch (const shape_error& error) {
    return error.what();
  }
  return {};
}

/// `X` read in place when it is row-major with its rows adjacent (a `Matrix<T>` or some of its
/// rows), else evaluated once into `copy`.
template <class Derived>
RowsMap<typename Derived::Scalar> rows_of(const Eigen::MatrixBase<Derived>& X,
                                          Matrix<typename Derived::Scalar>& copy) {
  using T = typename Derived::Scalar;
  if constexpr (bool(Derived::Flags & Eigen::DirectAccessBit) && bool(Derived::IsRowMajor)) {
    if (X.derived().outerStride() == X.cols() || X.rows() <= 1) {
      return RowsMap<T>(X.derived().data(), X.rows(), X.cols());
    }
  }
  copy = X;
  return RowsMap<T>(copy.data(), copy.rows(), copy.cols());
}

/// The sizes of one rank's Matrix operands (one head).
template <class DQ, class DK, class DV>
detail::RingSizes matrix_sizes(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                               const Eigen::MatrixBase<DV>& V) {
  detail::RingSizes mine;
  mine.n = Q.rows();
  mine.m = K.rows();
  mine.d_k = Q.cols();
  mine.d_v = V.cols();
  mine.heads_q = 1;
  mine.heads_kv = 1;
  return mine;
}

/// The local checks of a rank's Matrix operands, as a message ("" when they pass).
template <class DQ, class DK, class DV>
std::string matrix_check(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                         const Eigen::MatrixBase<DV>& V) {
  return local_check([&] {
    require_same_cols("ring_attention", "K", K, "Q", Q);
    require_same_rows("ring_attention", "V", V, "K", K);
  });
}

/// The local checks of the backward's O, log_sum_exp and dO against Q and V, as a message.
template <class DQ, class DV, class DOut, class DL, class DG>
std::string ring_backward_check(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DV>& V,
                                const Eigen::MatrixBase<DOut>& O,
                                const Eigen::MatrixBase<DL>& log_sum_exp,
                                const Eigen::MatrixBase<DG>& dO) {
  return local_check([&] {
    constexpr const char* function = "ring_attention_backward";
    require_same_rows(function, "O", O, "Q", Q);
    require_same_cols(function, "O", O, "V", V);
    require_same_rows(function, "dO", dO, "Q", Q);
    require_same_cols(function, "dO", dO, "V", V);
    if (log_sum_exp.size() != Q.rows()) {
      fail(function, "log_sum_exp must have ", Q.rows(), " entries, got ", shape_of(log_sum_exp));
    }
  });
}

/// A ring call takes any variant but the checking mode: one rank's throw in the middle of the
/// ring would leave the others waiting.
template <class Variant, class T, bool backward>
constexpr void check_ring_variant() {
  check_variant<Variant, T, backward>();
  static_assert(!is_checked<Variant>::value,
                "attn: ring_attention does not take checked(variant) (a throw on one rank would "
                "leave the others waiting): check the variant with flash_attention first");
}

/// The Matrix forms of `ring_attention` (one head), with or without a variant: this rank's output
/// rows, their log-sum-exp into `log_sum_exp` when not null.
template <class Variant, class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> matrix_ring_forward(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const AttentionOptions<typename DQ::Scalar>& options,
    RingStats& stats, Vector<typename DQ::Scalar>* log_sum_exp, const Variant* variant) {
  using T = typename DQ::Scalar;
  require_same_scalar<DQ, DK>();
  require_same_scalar<DQ, DV>();
  if constexpr (is_variant_v<Variant>) check_ring_variant<Variant, T, false>();
  std::vector<Vector<T>> lse;
  Matrix<T> Q_copy, K_copy, V_copy;
  std::vector<Matrix<T>> out = ring_forward<T, Variant>(
      comm, {rows_of(Q, Q_copy)}, {rows_of(K, K_copy)}, {rows_of(V, V_copy)}, options,
      matrix_sizes(Q, K, V), matrix_check(Q, K, V), stats, log_sum_exp ? &lse : nullptr, variant);
  if (log_sum_exp) *log_sum_exp = std::move(lse.front());
  return std::move(out.front());
}

/// The Matrix forms of `ring_attention_backward` (one head), with or without a variant.
template <class Variant, class DQ, class DK, class DV, class DOut, class DL, class DG>
AttentionGrads<typename DQ::Scalar> matrix_ring_backward(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& O,
    const Eigen::MatrixBase<DL>& log_sum_exp, const Eigen::MatrixBase<DG>& dO,
    const AttentionOptions<typename DQ::Scalar>& options, RingStats& stats, const Variant* variant,
    typename GradientOf<Variant>::type* dparams) {
  using T = typename DQ::Scalar;
  require_same_scalar<DQ, DK>();
  require_same_scalar<DQ, DV>();
  require_same_scalar<DQ, DOut>();
  require_same_scalar<DQ, DL>();
  require_same_scalar<DQ, DG>();
  if constexpr (is_variant_v<Variant>) check_ring_variant<Variant, T, true>();
  std::string error = matrix_check(Q, K, V);
  if (error.empty()) error = ring_backward_check(Q, V, O, log_sum_exp, dO);
  const Vector<T> lse = log_sum_exp.derived().reshaped();
  Matrix<T> Q_copy, K_copy, V_copy, O_copy, dO_copy;
  RingGradients<T> grads = ring_backward<T, Variant>(
      comm, {rows_of(Q, Q_copy)}, {rows_of(K, K_copy)}, {rows_of(V, V_copy)}, {rows_of(O, O_copy)},
      {lse}, {rows_of(dO, dO_copy)}, options, matrix_sizes(Q, K, V), error, stats, variant,
      dparams);
  AttentionGrads<T> out;
  out.dQ = std::move(grads.dQ.front());
  out.dK = std::move(grads.dK.front());
  out.dV = std::move(grads.dV.front());
  out.dbias = std::move(grads.dbias);
  out.dsink = grads.dsink;
  return out;
}

}  // namespace detail

/// Attention over a sequence split across the ranks of `comm`, in rank order: rank r passes its
/// own rows of the queries, keys and values and receives its own output rows; the result equals
/// single-process attention over the concatenated sequence (`scaled_dot_product_attention` on the
/// whole Q, K and V with the same options), to rounding, and is the same bits from call to call.
///
/// Every rank calls it (it is collective over `comm`). Ranks may hold different numbers of rows,
/// zero included; n and m may differ (cross-attention: query rows and key rows are split
/// independently). The options mean what they mean on the whole sequence: causal alignment and
/// `query_offset` over the global positions, window, window_right, ALiBi, softcap, sink and scale;
/// `mask` and `bias`, when set, are this rank's rows over all M keys (n_r x M).
///
/// \param comm     the communicator; every rank of it calls
/// \param Q        n_r x d_k, this rank's queries (float or double)
/// \param K        m_r x d_k, this rank's keys
/// \param V        m_r x d_v, this rank's values
/// \param options  every `AttentionOptions` field, over the whole sequence; `mask` and `bias`
///                 n_r x M
/// \param stats    filled with what this rank did (times, bytes, pairs)
/// \returns n_r x d_v, this rank's output rows
/// \throws shape_error on every rank when any rank's arguments are invalid (the rank at fault gets
///         its own message, the others one naming that rank), or when the ranks disagree on d_k
///         or d_v; std::runtime_error when an MPI call fails.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> ring_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                           const Eigen::MatrixBase<DK>& K,
                                           const Eigen::MatrixBase<DV>& V,
                                           const AttentionOptions<typename DQ::Scalar>& options,
                                           RingStats& stats) {
  return detail::matrix_ring_forward<detail::NoVariant>(comm, Q, K, V, options, stats, nullptr,
                                                        nullptr);
}

/// `ring_attention` without the statistics.
/// \param comm     the communicator; every rank of it calls
/// \param Q        n_r x d_k, this rank's queries (float or double)
/// \param K        m_r x d_k, this rank's keys
/// \param V        m_r x d_v, this rank's values
/// \param options  every `AttentionOptions` field, over the whole sequence; `mask` and `bias`
///                 n_r x M
/// \returns n_r x d_v, this rank's output rows
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> ring_attention(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const AttentionOptions<typename DQ::Scalar>& options = {}) {
  RingStats stats;
  return ring_attention(comm, Q, K, V, options, stats);
}

/// `ring_attention` that also returns each of this rank's rows' log-sum-exp over all M keys, as
/// `flash_attention` does (the sink included when set): what `ring_attention_backward` takes.
/// \param comm         the communicator; every rank of it calls
/// \param Q            n_r x d_k, this rank's queries (float or double)
/// \param K            m_r x d_k, this rank's keys
/// \param V            m_r x d_v, this rank's values
/// \param options      every `AttentionOptions` field, over the whole sequence; `mask` and `bias`
///                     n_r x M
/// \param log_sum_exp  resized to n_r
/// \returns n_r x d_v, this rank's output rows
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> ring_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                           const Eigen::MatrixBase<DK>& K,
                                           const Eigen::MatrixBase<DV>& V,
                                           const AttentionOptions<typename DQ::Scalar>& options,
                                           Vector<typename DQ::Scalar>& log_sum_exp) {
  RingStats stats;
  return detail::matrix_ring_forward<detail::NoVariant>(comm, Q, K, V, options, stats, &log_sum_exp,
                                                        nullptr);
}

/// Gradients of `ring_attention` across the ranks of `comm` (collective), from the forward's own
/// output and log-sum-exp (`ring_attention`'s overload returning it): each rank passes its rows
/// and gets the gradients of its rows, `dQ` (n_r x d_k), `dK` (m_r x d_k), `dV` (m_r x d_v),
/// `dbias` (n_r x M, when `options.bias` is set) and `dsink` (the whole sequence's, the same on
/// every rank). Equal to `attention_backward` on the whole sequence to rounding, the same bits
/// from call to call. Key/value blocks travel around the ring as in the forward, the dK and dV
/// each block has gathered one step behind it; after a full turn they reach the block's owner.
/// \param comm         the communicator; every rank of it calls
/// \param Q            n_r x d_k, this rank's queries
/// \param K            m_r x d_k, this rank's keys
/// \param V            m_r x d_v, this rank's values
/// \param O            n_r x d_v, this rank's rows of the forward's output
/// \param log_sum_exp  n_r, this rank's rows' log-sum-exp from the forward
/// \param dO           n_r x d_v, gradient of the loss with respect to this rank's output rows
/// \param options      the forward's options (every field)
/// \param stats        filled with what this rank did (times, bytes, pairs)
/// \returns `{dQ, dK, dV, dbias, dsink}` of this rank's rows (shapes above)
/// \throws as `ring_attention`, also when O, dO or log_sum_exp do not have n_r rows.
template <class DQ, class DK, class DV, class DOut, class DL, class DG>
AttentionGrads<typename DQ::Scalar> ring_attention_backward(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& O,
    const Eigen::MatrixBase<DL>& log_sum_exp, const Eigen::MatrixBase<DG>& dO,
    const AttentionOptions<typename DQ::Scalar>& options, RingStats& stats) {
  return detail::matrix_ring_backward<detail::NoVariant>(comm, Q, K, V, O, log_sum_exp, dO, options,
                                                         stats, nullptr, nullptr);
}

/// `ring_attention_backward` without the statistics.
/// \param comm         the communicator; every rank of it calls
/// \param Q            n_r x d_k, this rank's queries
/// \param K            m_r x d_k, this rank's keys
/// \param V            m_r x d_v, this rank's values
/// \param O            n_r x d_v, this rank's rows of the forward's output
/// \param log_sum_exp  n_r, this rank's rows' log-sum-exp from the forward
/// \param dO           n_r x d_v, gradient of the loss with respect to this rank's output rows
/// \param options      the forward's options (every field)
/// \returns `{dQ, dK, dV, dbias, dsink}` of this rank's rows
template <class DQ, class DK, class DV, class DOut, class DL, class DG>
AttentionGrads<typename DQ::Scalar> ring_attention_backward(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& O,
    const Eigen::MatrixBase<DL>& log_sum_exp, const Eigen::MatrixBase<DG>& dO,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  RingStats stats;
  return ring_attention_backward(comm, Q, K, V, O, log_sum_exp, dO, options, stats);
}

/// `ring_attention` with a variant (variant.hpp, docs/variants.md): each rank's block of keys is
/// the same variant at its own key positions, so the result equals `flash_attention` with the
/// variant on the whole sequence (query i at key position i + the options' query offset, or M - N
/// when causal bottom-right). Each piece runs the tiled kernel with the variant.
/// \param comm         the communicator; every rank of it calls
/// \param Q            n_r x d_k, this rank's queries (float or double)
/// \param K            m_r x d_k, this rank's keys
/// \param V            m_r x d_v, this rank's values
/// \param variant      a variant (`is_variant_v`), the same on every rank; not `checked`
/// \param options      every `AttentionOptions` field, over the whole sequence
/// \param log_sum_exp  resized to n_r, each row's log-sum-exp (sink included)
/// \returns n_r x d_v, this rank's output rows
/// \throws as `ring_attention`.
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
Matrix<typename DQ::Scalar> ring_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                           const Eigen::MatrixBase<DK>& K,
                                           const Eigen::MatrixBase<DV>& V, const Variant& variant,
                                           const AttentionOptions<typename DQ::Scalar>& options,
                                           Vector<typename DQ::Scalar>& log_sum_exp) {
  RingStats stats;
  return detail::matrix_ring_forward(comm, Q, K, V, options, stats, &log_sum_exp, &variant);
}

/// `ring_attention` with a variant and the statistics of this rank's call (which show the pairs
/// and blocks the variant's Empty tiles spared).
/// \param comm     the communicator; every rank of it calls
/// \param Q        n_r x d_k, this rank's queries (float or double)
/// \param K        m_r x d_k, this rank's keys
/// \param V        m_r x d_v, this rank's values
/// \param variant  a variant (`is_variant_v`), the same on every rank
/// \param options  every `AttentionOptions` field, over the whole sequence
/// \param stats    filled with what this rank did (times, bytes, pairs)
/// \returns n_r x d_v, this rank's output rows
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
Matrix<typename DQ::Scalar> ring_attention(MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q,
                                           const Eigen::MatrixBase<DK>& K,
                                           const Eigen::MatrixBase<DV>& V, const Variant& variant,
                                           const AttentionOptions<typename DQ::Scalar>& options,
                                           RingStats& stats) {
  return detail::matrix_ring_forward(comm, Q, K, V, options, stats, nullptr, &variant);
}

/// `ring_attention` with a variant, without the log-sum-exp.
/// \param comm     the communicator; every rank of it calls
/// \param Q        n_r x d_k, this rank's queries (float or double)
/// \param K        m_r x d_k, this rank's keys
/// \param V        m_r x d_v, this rank's values
/// \param variant  a variant (`is_variant_v`), the same on every rank
/// \param options  every `AttentionOptions` field, over the whole sequence
/// \returns n_r x d_v, this rank's output rows
template <class DQ, class DK, class DV, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
Matrix<typename DQ::Scalar> ring_attention(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Variant& variant,
    const AttentionOptions<typename DQ::Scalar>& options = {}) {
  Vector<typename DQ::Scalar> lse;
  return ring_attention(comm, Q, K, V, variant, options, lse);
}

/// Gradients of `ring_attention` with a variant (collective), from the forward's output and
/// log-sum-exp: as without a variant, each piece's backward with the variant at the piece's
/// global positions (a key its mask forbids gets exactly zero gradient).
/// \param comm         the communicator; every rank of it calls
/// \param Q            n_r x d_k, this rank's queries
/// \param K            m_r x d_k, this rank's keys
/// \param V            m_r x d_v, this rank's values
/// \param O            n_r x d_v, this rank's rows of the forward's output
/// \param log_sum_exp  n_r, this rank's rows' log-sum-exp from the forward
/// \param dO           n_r x d_v, gradient of the loss with respect to this rank's output rows
/// \param variant      the forward's variant, with `dscore` wherever it has `score`
/// \param options      the forward's options (every field)
/// \param dparams      when not null (a learnable variant whose `Gradient` is `Matrix<T>`):
///                     the gradient of its parameters over the whole sequence, the same bits on
///                     every rank (each rank's share summed in a fixed order, then the ranks'
///                     in rank order)
/// \returns `{dQ, dK, dV, dbias, dsink}` of this rank's rows
/// \throws as `ring_attention_backward`.
template <class DQ, class DK, class DV, class DOut, class DL, class DG, class Variant,
          std::enable_if_t<is_variant_v<Variant>, int> = 0>
AttentionGrads<typename DQ::Scalar> ring_attention_backward(
    MPI_Comm comm, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& O,
    const Eigen::MatrixBase<DL>& log_sum_exp, const Eigen::MatrixBase<DG>& dO,
    const Variant& variant, const AttentionOptions<typename DQ::Scalar>& options = {},
    typename detail::GradientOf<Variant>::type* dparams = nullptr) {
  RingStats stats;
  return detail::matrix_ring_backward(comm, Q, K, V, O, log_sum_exp, dO, options, stats, &variant,
                                      dparams);
}

namespace detail {

/// The local checks and per-head tables of a rank's Tensor3 operands.
template <class T>
std::string heads_check(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V) {
  return local_check([&] {
    if (K.dimension(0) == 0 || Q.dimension(0) % K.dimension(0) != 0) {
      fail("ring_attention", "K has ", K.dimension(0), " heads, which must divide Q's ",
           Q.dimension(0));
    }
    if (K.dimension(0) != V.dimension(0) || K.dimension(1) != V.dimension(1)) {
      fail("ring_attention", "K is (", K.dimension(0), ", ", K.dimension(1), ", ", K.dimension(2),
           ") but V is (", V.dimension(0), ", ", V.dimension(1), ", ", V.dimension(2),
           "): heads and tokens must agree");
    }
    if (Q.dimension(2) != K.dimension(2)) {
      fail("ring_attention", "Q has ", Q.dimension(2), " features but K has ", K.dimension(2));
    }
  });
}

/// The heads of a (heads, rows, width) tensor as row-major tables, read in place.
template <class T>
std::vector<RowsMap<T>> split_heads(const Tensor3<T>& X) {
  std::vector<RowsMap<T>> heads;
  for (Index h = 0; h < X.dimension(0); ++h) {
    heads.emplace_back(X.data() + h * X.dimension(1) * X.dimension(2), X.dimension(1),
                       X.dimension(2));
  }
  return heads;
}

}  // namespace detail

namespace detail {

/// The sizes of a rank's Tensor3 operands.
template <class T>
RingSizes tensor_sizes(const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V) {
  RingSizes mine;
  mine.n = Q.dimension(1);
  mine.m = K.dimension(1);
  mine.d_k = Q.dimension(2);
  mine.d_v = V.dimension(2);
  mine.heads_q = Q.dimension(0);
  mine.heads_kv = K.dimension(0);
  return mine;
}

/// Per-head tables (rows x width each) as one (heads, rows, width) tensor.
template <class T>
Tensor3<T> join_heads(const std::vector<Matrix<T>>& heads, Index rows, Index width) {
  Tensor3<T> joined(static_cast<Index>(heads.size()), rows, width);
  for (std::size_t h = 0; h < heads.size(); ++h) {
    std::copy(heads[h].data(), heads[h].data() + rows * width,
              joined.data() + static_cast<Index>(h) * rows * width);
  }
  return joined;
}

}  // namespace detail

/// `ring_attention` over heads: `Q` (heads, n_r, d_k), `K` (kv_heads, m_r, d_k), `V` (kv_heads,
/// m_r, d_v), `heads % kv_heads == 0`; query head h reads key/value head `h / group` (multi-head,
/// grouped-query and multi-query attention). Every key/value head travels in one message per step.
/// `options.mask` and `options.bias` are shared by the heads (n_r x M).
/// \param comm     the communicator; every rank of it calls
/// \param Q        (heads, n_r, d_k), this rank's queries
/// \param K        (kv_heads, m_r, d_k), this rank's keys
/// \param V        (kv_heads, m_r, d_v), this rank's values
/// \param options  every `AttentionOptions` field, over the whole sequence; `mask` and `bias`
///                 n_r x M, shared by the heads
/// \param stats    filled with what this rank did (times, bytes, pairs)
/// \returns (heads, n_r, d_v)
template <class T>
Tensor3<T> ring_attention(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                          const Tensor3<T>& V, const AttentionOptions<T>& options,
                          RingStats& stats) {
  const std::vector<Matrix<T>> out = detail::ring_forward<T>(
      comm, detail::split_heads(Q), detail::split_heads(K), detail::split_heads(V), options,
      detail::tensor_sizes(Q, K, V), detail::heads_check(Q, K, V), stats);
  return detail::join_heads(out, Q.dimension(1), V.dimension(2));
}

/// `ring_attention` over heads without the statistics.
/// \param comm     the communicator; every rank of it calls
/// \param Q        (heads, n_r, d_k), this rank's queries
/// \param K        (kv_heads, m_r, d_k), this rank's keys
/// \param V        (kv_heads, m_r, d_v), this rank's values
/// \param options  every `AttentionOptions` field, over the whole sequence
/// \returns (heads, n_r, d_v)
template <class T>
Tensor3<T> ring_attention(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                          const Tensor3<T>& V, const AttentionOptions<T>& options = {}) {
  RingStats stats;
  return ring_attention(comm, Q, K, V, options, stats);
}

/// `ring_attention` over heads that also returns each query head's log-sum-exp of this rank's
/// rows, as `attention_heads` does.
/// \param comm         the communicator; every rank of it calls
/// \param Q            (heads, n_r, d_k), this rank's queries
/// \param K            (kv_heads, m_r, d_k), this rank's keys
/// \param V            (kv_heads, m_r, d_v), this rank's values
/// \param options      every `AttentionOptions` field, over the whole sequence
/// \param log_sum_exp  resized to heads x n_r (the sink included when set)
/// \returns (heads, n_r, d_v)
template <class T>
Tensor3<T> ring_attention(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                          const Tensor3<T>& V, const AttentionOptions<T>& options,
                          Matrix<T>& log_sum_exp) {
  RingStats stats;
  std::vector<Vector<T>> lse;
  const std::vector<Matrix<T>> out = detail::ring_forward<T>(
      comm, detail::split_heads(Q), detail::split_heads(K), detail::split_heads(V), options,
      detail::tensor_sizes(Q, K, V), detail::heads_check(Q, K, V), stats, &lse);
  log_sum_exp.resize(Q.dimension(0), Q.dimension(1));
  for (Index h = 0; h < Q.dimension(0); ++h) {
    log_sum_exp.row(h) = lse[static_cast<std::size_t>(h)].transpose();
  }
  return detail::join_heads(out, Q.dimension(1), V.dimension(2));
}

namespace detail {

/// `ring_attention_backward` over heads, with `variant` unless null (Variant NoVariant).
template <class T, class Variant>
HeadGrads<T> heads_ring_backward(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                                 const Tensor3<T>& V, const Tensor3<T>& O,
                                 const Matrix<T>& log_sum_exp, const Tensor3<T>& dO,
                                 const AttentionOptions<T>& options, RingStats& stats,
                                 const Variant* variant,
                                 typename GradientOf<Variant>::type* dparams) {
  std::string error = heads_check(Q, K, V);
  const auto same_shape = [&](const Tensor3<T>& X) {
    return X.dimension(0) == Q.dimension(0) && X.dimension(1) == Q.dimension(1) &&
           X.dimension(2) == V.dimension(2);
  };
  if (error.empty()) {
    error = local_check([&] {
      constexpr const char* function = "ring_attention_backward";
      for (const auto& [name, X] : {std::pair<const char*, const Tensor3<T>*>{"O", &O},
                                    std::pair<const char*, const Tensor3<T>*>{"dO", &dO}}) {
        if (!same_shape(*X)) {
          fail(function, name, " is (", X->dimension(0), ", ", X->dimension(1), ", ",
               X->dimension(2), "), expected (", Q.dimension(0), ", ", Q.dimension(1), ", ",
               V.dimension(2), ")");
        }
      }
      if (log_sum_exp.rows() != Q.dimension(0) || log_sum_exp.cols() != Q.dimension(1)) {
        fail(function, "log_sum_exp is ", shape_of(log_sum_exp), ", expected ", Q.dimension(0),
             " x ", Q.dimension(1));
      }
    });
  }
  // (When a check failed the ring throws before it reads any of these.)
  std::vector<Vector<T>> lse;
  for (Index h = 0; h < Q.dimension(0); ++h) {
    lse.push_back(error.empty() ? Vector<T>(log_sum_exp.row(h).transpose())
                                : Vector<T>::Zero(Q.dimension(1)));
  }
  RingGradients<T> grads = ring_backward<T, Variant>(
      comm, split_heads(Q), split_heads(K), split_heads(V), split_heads(error.empty() ? O : Q), lse,
      split_heads(error.empty() ? dO : Q), options, tensor_sizes(Q, K, V), error, stats, variant,
      dparams);
  HeadGrads<T> out;
  out.dQ = join_heads(grads.dQ, Q.dimension(1), Q.dimension(2));
  out.dK = join_heads(grads.dK, K.dimension(1), K.dimension(2));
  out.dV = join_heads(grads.dV, V.dimension(1), V.dimension(2));
  out.dbias = std::move(grads.dbias);
  out.dsink = grads.dsink;
  return out;
}

}  // namespace detail

/// Gradients of `ring_attention` over heads (collective), from the forward's own output O
/// (heads, n_r, d_v) and log-sum-exp (heads x n_r): dQ (heads, n_r, d_k), dK (kv_heads, m_r, d_k)
/// and dV (kv_heads, m_r, d_v) of this rank's rows, each key/value head's the sum over its query
/// heads (in head order), dbias (n_r x M, summed over the heads) and dsink (the whole sequence's,
/// summed over the heads). `dbiases` and `dsinks` stay empty (no per-head options). Equal to
/// `attention_heads_backward` on the whole sequence to rounding.
/// \param comm         the communicator; every rank of it calls
/// \param Q            (heads, n_r, d_k), this rank's queries
/// \param K            (kv_heads, m_r, d_k), this rank's keys
/// \param V            (kv_heads, m_r, d_v), this rank's values
/// \param O            (heads, n_r, d_v), this rank's rows of the forward's output
/// \param log_sum_exp  heads x n_r, from the forward
/// \param dO           (heads, n_r, d_v), gradient of the loss with respect to the output
/// \param options      the forward's options (every field)
/// \param stats        filled with what this rank did (times, bytes, pairs)
/// \returns `{dQ, dK, dV, dbias, dsink}` of this rank's rows (shapes above)
template <class T>
HeadGrads<T> ring_attention_backward(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                                     const Tensor3<T>& V, const Tensor3<T>& O,
                                     const Matrix<T>& log_sum_exp, const Tensor3<T>& dO,
                                     const AttentionOptions<T>& options, RingStats& stats) {
  return detail::heads_ring_backward<T, detail::NoVariant>(comm, Q, K, V, O, log_sum_exp, dO,
                                                           options, stats, nullptr, nullptr);
}

/// `ring_attention_backward` over heads without the statistics.
/// \param comm         the communicator; every rank of it calls
/// \param Q            (heads, n_r, d_k), this rank's queries
/// \param K            (kv_heads, m_r, d_k), this rank's keys
/// \param V            (kv_heads, m_r, d_v), this rank's values
/// \param O            (heads, n_r, d_v), this rank's rows of the forward's output
/// \param log_sum_exp  heads x n_r, from the forward
/// \param dO           (heads, n_r, d_v), gradient of the loss with respect to the output
/// \param options      the forward's options (every field)
/// \returns `{dQ, dK, dV, dbias, dsink}` of this rank's rows
template <class T>
HeadGrads<T> ring_attention_backward(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                                     const Tensor3<T>& V, const Tensor3<T>& O,
                                     const Matrix<T>& log_sum_exp, const Tensor3<T>& dO,
                                     const AttentionOptions<T>& options = {}) {
  RingStats stats;
  return ring_attention_backward(comm, Q, K, V, O, log_sum_exp, dO, options, stats);
}

/// `ring_attention` over heads with a variant: query head h sees it as `ScoreAt::head` h (and its
/// key/value head as `kv_head`), every rank's key block at its own positions (see the Matrix
/// overload with a variant).
/// \param comm         the communicator; every rank of it calls
/// \param Q            (heads, n_r, d_k), this rank's queries
/// \param K            (kv_heads, m_r, d_k), this rank's keys
/// \param V            (kv_heads, m_r, d_v), this rank's values
/// \param variant      a variant (`is_variant_v`), the same on every rank; not `checked`
/// \param options      every `AttentionOptions` field, over the whole sequence
/// \param log_sum_exp  resized to heads x n_r (the sink included when set)
/// \returns (heads, n_r, d_v)
template <class T, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
Tensor3<T> ring_attention(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                          const Tensor3<T>& V, const Variant& variant,
                          const AttentionOptions<T>& options, Matrix<T>& log_sum_exp) {
  detail::check_ring_variant<Variant, T, false>();
  RingStats stats;
  std::vector<Vector<T>> lse;
  const std::vector<Matrix<T>> out = detail::ring_forward<T, Variant>(
      comm, detail::split_heads(Q), detail::split_heads(K), detail::split_heads(V), options,
      detail::tensor_sizes(Q, K, V), detail::heads_check(Q, K, V), stats, &lse, &variant);
  log_sum_exp.resize(Q.dimension(0), Q.dimension(1));
  for (Index h = 0; h < Q.dimension(0); ++h) {
    log_sum_exp.row(h) = lse[static_cast<std::size_t>(h)].transpose();
  }
  return detail::join_heads(out, Q.dimension(1), V.dimension(2));
}

/// `ring_attention` over heads with a variant, without the log-sum-exp.
/// \param comm     the communicator; every rank of it calls
/// \param Q        (heads, n_r, d_k), this rank's queries
/// \param K        (kv_heads, m_r, d_k), this rank's keys
/// \param V        (kv_heads, m_r, d_v), this rank's values
/// \param variant  a variant (`is_variant_v`), the same on every rank
/// \param options  every `AttentionOptions` field, over the whole sequence
/// \returns (heads, n_r, d_v)
template <class T, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
Tensor3<T> ring_attention(MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K,
                          const Tensor3<T>& V, const Variant& variant,
                          const AttentionOptions<T>& options = {}) {
  Matrix<T> lse;
  return ring_attention(comm, Q, K, V, variant, options, lse);
}

/// Gradients of `ring_attention` over heads with a variant (collective): as without one, each
/// piece's backward with the variant bound to its query head at the piece's global positions.
/// \param comm         the communicator; every rank of it calls
/// \param Q            (heads, n_r, d_k), this rank's queries
/// \param K            (kv_heads, m_r, d_k), this rank's keys
/// \param V            (kv_heads, m_r, d_v), this rank's values
/// \param O            (heads, n_r, d_v), this rank's rows of the forward's output
/// \param log_sum_exp  heads x n_r, from the forward
/// \param dO           (heads, n_r, d_v), gradient of the loss with respect to the output
/// \param variant      the forward's variant, with `dscore` wherever it has `score`
/// \param options      the forward's options (every field)
/// \param dparams      when not null (a learnable variant whose `Gradient` is `Matrix<T>`): its
///                     parameters' gradient over every rank and head, the same bits on every rank
/// \returns `{dQ, dK, dV, dbias, dsink}` of this rank's rows
template <class T, class Variant, std::enable_if_t<is_variant_v<Variant>, int> = 0>
HeadGrads<T> ring_attention_backward(
    MPI_Comm comm, const Tensor3<T>& Q, const Tensor3<T>& K, const Tensor3<T>& V,
    const Tensor3<T>& O, const Matrix<T>& log_sum_exp, const Tensor3<T>& dO, const Variant& variant,
    const AttentionOptions<T>& options = {},
    typename detail::GradientOf<Variant>::type* dparams = nullptr) {
  detail::check_ring_variant<Variant, T, true>();
  RingStats stats;
  return detail::heads_ring_backward<T, Variant>(comm, Q, K, V, O, log_sum_exp, dO, options, stats,
                                                 &variant, dparams);
}

}  // namespace attn

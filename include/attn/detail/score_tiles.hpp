#pragma once
/// \file detail/score_tiles.hpp
/// The register-tiled kernel behind `attn::scores`: S = scale * Q K^T for row-major Q, K, S.
///
/// Why not Eigen's GEMM: for attention's shapes (d_k = 64 or 128, n and m in the thousands) Eigen
/// zero-fills S, re-packs K for every block of queries and writes S through the cache, and trails
/// NumPy + OpenBLAS there (bench/compare_peers.py; see docs/benchmarks.md). This kernel packs K
/// once, keeps a `rows x cols` tile of S in registers over the whole d_k sum, multiplies by the
/// scale in the register, writes each tile once, and bypasses the cache with streaming stores when
/// S is too large to stay in it.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include "../simd.hpp"
#include "../threads.hpp"
#include "../types.hpp"

namespace attn {
namespace detail {

/// Register tile of the score kernel for scalar T on the SIMD set Eigen was compiled for: `rows`
/// queries x `cols` keys (two packets), `rows * 2` accumulators. 12 x 2 packets uses 24 of the 32
/// AVX-512 registers; 6 x 2 uses 12 of 16 elsewhere (the rest hold the key packets and a
/// broadcast).
template <class T>
struct ScoreTile : Simd<T> {
  using typename Simd<T>::Packet;
  using Simd<T>::lanes;
  static constexpr std::size_t packets = 2;
  static constexpr Index rows = Simd<T>::registers >= 32 ? 12 : 6;
  static constexpr Index cols = Index(packets) * lanes;
};

/// Streaming (non-temporal) store of one packet to an address aligned to the packet's size; the
/// generic version is an ordinary aligned store.
template <class T, class Packet>
EIGEN_STRONG_INLINE void stream_packet(T* to, const Packet& value) {
  Eigen::internal::pstore(to, value);
}
#if defined(EIGEN_VECTORIZE_SSE2)
EIGEN_STRONG_INLINE void stream_packet(float* to, const __m128& value) { _mm_stream_ps(to, value); }
EIGEN_STRONG_INLINE void stream_packet(double* to, const __m128d& value) {
  _mm_stream_pd(to, value);
}
#endif
#if defined(EIGEN_VECTORIZE_AVX)
EIGEN_STRONG_INLINE void stream_packet(float* to, const __m256& value) {
  _mm256_stream_ps(to, value);
}
EIGEN_STRONG_INLINE void stream_packet(double* to, const __m256d& value) {
  _mm256_stream_pd(to, value);
}
#endif
#if defined(EIGEN_VECTORIZE_AVX512)
EIGEN_STRONG_INLINE void stream_packet(float* to, const __m512& value) {
  _mm512_stream_ps(to, value);
}
EIGEN_STRONG_INLINE void stream_packet(double* to, const __m512d& value) {
  _mm512_stream_pd(to, value);
}
#endif

/// Orders this thread's streaming stores before whatever follows (they are weakly ordered).
inline void stream_fence() {
#if defined(EIGEN_VECTORIZE_SSE2)
  _mm_sfence();
#endif
}

/// Panels of `cols` keys that hold m keys.
template <class T>
constexpr Index panel_count(Index m) {
  return (m + ScoreTile<T>::cols - 1) / ScoreTile<T>::cols;
}

/// `cols` rounded up to a whole number of register panels.
template <class T>
constexpr Index whole_panels(Index cols) {
  return panel_count<T>(cols) * ScoreTile<T>::cols;
}

/// Keys packed for the kernel: panel p holds keys [p cols, (p + 1) cols) transposed, d rows of
/// `cols` scalars each (`panel[c * cols + jj] = key(p cols + jj, c)`), zero past the last key.
/// `key(j, c)` gives feature c of key j. This packs panel p of m keys, at packed + p d cols: the
/// panels can be packed in any order, by any thread.
template <class T, class Key>
void pack_panel(Index m, Index d, const Key& key, Index p, T* packed) {
  constexpr Index cols = ScoreTile<T>::cols;
  const Index j0 = p * cols;
  const Index width = std::min(cols, m - j0);
  packed += p * d * cols;
  for (Index c = 0; c < d; ++c, packed += cols) {
    for (Index jj = 0; jj < width; ++jj) packed[jj] = key(j0 + jj, c);
    for (Index jj = width; jj < cols; ++jj) packed[jj] = T(0);
  }
}

/// Panel p of the keys K (m x d, row-major), as `pack_panel` of K(j, c), with the whole blocks of
/// `lanes` keys x `lanes` features moved a packet at a time: `lanes` rows of K loaded, transposed
/// in registers (Eigen's `ptranspose`) and stored as `lanes` rows of the panel. The scalar loop
/// reads K down its columns, one scalar per row, which made the packing a visible part of
/// `flash_attention`'s time (see docs/benchmarks.md).
// Eigen's `PacketBlock` of a SIMD type such as __m512 makes GCC warn that the type's attributes
// are ignored as a template argument (-Wignored-attributes); they are, harmlessly, as inside
// Eigen, whose own headers are system headers and so not warned about.
// GCC 12's false -Wmaybe-uninitialized inside the AVX-512 intrinsics of `ptranspose`: see
// ATTN_INTRINSICS_BEGIN.
ATTN_INTRINSICS_BEGIN
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
template <class T>
void pack_panel(ConstRef<T> K, Index p, T* packed) {
  using Packet = typename Simd<T>::Packet;
  constexpr Index lanes = Simd<T>::lanes;
  constexpr Index cols = ScoreTile<T>::cols;
  const Index j0 = p * cols;
  const Index d = K.cols();
  if constexpr (lanes > 1) {
    const Index blocked = d / lanes * lanes;
    if (K.rows() - j0 >= cols && blocked > 0) {
      T* panel = packed + p * d * cols;
      Eigen::internal::PacketBlock<Packet, int(lanes)> block;
      for (Index jb = 0; jb < cols; jb += lanes) {
        const T* rows = K.data() + (j0 + jb) * K.outerStride();
        for (Index c0 = 0; c0 < blocked; c0 += lanes) {
          for (Index r = 0; r < lanes; ++r) {
            block.packet[r] = Eigen::internal::ploadu<Packet>(rows + r * K.outerStride() + c0);
          }
          Eigen::internal::ptranspose(block);
          for (Index r = 0; r < lanes; ++r) {
            Eigen::internal::pstoreu(panel + (c0 + r) * cols + jb, block.packet[r]);
          }
        }
        for (Index c = blocked; c < d; ++c) {
          for (Index jj = jb; jj < jb + lanes; ++jj) panel[c * cols + jj] = K(j0 + jj, c);
        }
      }
      return;
    }
  }
  pack_panel<T>(
      K.rows(), d, [&K](Index j, Index c) { return K(j, c); }, p, packed);
}
#pragma GCC diagnostic pop
ATTN_INTRINSICS_END

/// Every panel of the keys K (`pack_panel`) into `packed`: `whole_panels(m) d` scalars.
template <class T>
void pack_keys_into(ConstRef<T> K, T* packed) {
  for (Index p = 0; p < panel_count<T>(K.rows()); ++p) pack_panel<T>(K, p, packed);
}

/// Where the score kernel finds its key panels: the panel of keys [j0, j0 + cols) starts at
/// `panel(j0)`, and feature c of it (`cols` scalars, aligned to a packet) `stride` scalars after
/// feature c - 1. Keys packed by `pack_panel` are one block of d x cols per panel (stride cols);
/// the columns of a row-major W as keys (a product X W, `product_kernel`) are W itself, unpacked:
/// the panel of columns [j0, j0 + cols) at W + j0, stride W's row stride.
template <class T>
struct KeyPanels {
  const T* data = nullptr;
  Index step = 0;    ///< scalars from one panel to the next
  Index stride = 0;  ///< scalars from one feature of a panel to the next
  const T* panel(Index j0) const { return data + (j0 / ScoreTile<T>::cols) * step; }
};

/// Panels packed by `pack_panel` for keys of d features.
template <class T>
KeyPanels<T> packed_key_panels(const T* packed, Index d) {
  return {packed, d * ScoreTile<T>::cols, ScoreTile<T>::cols};
}

/// f(std::integral_constant<std::size_t, i>()) for each i of the sequence in turn, as
/// straight-line code: no loop for the compiler to replace by a library call.
template <std::size_t... i, class F>
EIGEN_ALWAYS_INLINE void for_each_index(std::index_sequence<i...>, const F& f) {
  (f(std::integral_constant<std::size_t, i>()), ...);
}

/// One row of a register tile, scaled, into `to` (`width` scores; streamed past the caches when
/// asked and the panel is whole). Always inlined: as a lambda GCC 12 made it a call per row in some
/// translation units, which slowed the score kernel by about 8% there (docs/benchmarks.md).
template <class T, std::size_t packets>
EIGEN_ALWAYS_INLINE void store_tile_row(T* to,
                                        const typename ScoreTile<T>::Packet (&acc_r)[packets],
                                        const typename ScoreTile<T>::Packet& scale_p, Index width,
                                        bool stream) {
  using Tile = ScoreTile<T>;
  using Eigen::internal::pmul;
  using Eigen::internal::pstoreu;
  constexpr Index lanes = Tile::lanes;
  if (width == Tile::cols && stream) {
    for (std::size_t p = 0; p < packets; ++p) {
      stream_packet(to + Index(p) * lanes, pmul(acc_r[p], scale_p));
    }
  } else if (width == Tile::cols) {
    for (std::size_t p = 0; p < packets; ++p) {
      pstoreu(to + Index(p) * lanes, pmul(acc_r[p], scale_p));
    }
  } else {  // the last, partial panel
    EIGEN_ALIGN_MAX T tile_row[Tile::cols];
    for (std::size_t p = 0; p < packets; ++p) {
      pstoreu(tile_row + Index(p) * lanes, pmul(acc_r[p], scale_p));
    }
    std::copy(tile_row, tile_row + width, to);
  }
}

/// One register tile: S[r, 0:width) = scale * sum_c Q[r, c] * panel[c, 0:width) for `Rows` query
/// rows. Shape contract: q points at Q(i, 0) with row stride q_stride; panel is one key panel
/// (`KeyPanels`) of d features, `panel_stride` scalars apart; s points at S(i, j0) with row stride
/// s_stride; 0 < width <= cols. Each score is one accumulator summed over c in order, so its bits
/// do not depend on tiling, threads or where the panel lies.
/// Always inlined: GCC 12 left the 12-row tile a function of its own in some callers, and a call
/// per tile slowed the kernel where d = 64 (see docs/benchmarks.md).
template <class T, std::size_t... r>
EIGEN_ALWAYS_INLINE void score_tile(std::index_sequence<r...>, const T* q, Index q_stride,
                                    const T* panel, Index panel_stride, Index d, T scale, T* s,
                                    Index s_stride, Index width, bool stream) {
  using Tile = ScoreTile<T>;
  using Packet = typename Tile::Packet;
  constexpr std::size_t rows = sizeof...(r);
  constexpr std::size_t packets = Tile::packets;
  constexpr Index lanes = Tile::lanes;
  using Eigen::internal::pload;
  using Eigen::internal::pmadd;
  using Eigen::internal::pmul;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;

  // 1. Accumulate over the d_k features: `packets` key packets, one broadcast query value per row.
  //    The accumulators start at 0 in straight-line code (`for_each_index`): GCC 12 made the loop
  //    that zeroed them a call of memset on the whole array at the start of every tile (1.5 KiB
  //    for 12 rows of float), which slowed every tile (see docs/benchmarks.md).
  Packet acc[rows][packets];
  const auto zero = [](Packet(&acc_r)[packets]) {
    for_each_index(std::make_index_sequence<packets>(),
                   [&](auto p) { acc_r[p] = pset1<Packet>(T(0)); });
  };
  (zero(acc[r]), ...);
  for (Index c = 0; c < d; ++c, panel += panel_stride) {
    Packet k[packets];
    for (std::size_t p = 0; p < packets; ++p) k[p] = pload<Packet>(panel + Index(p) * lanes);
    const auto row = [&](Packet(&acc_r)[packets], const Packet& q_rc) {
      for (std::size_t p = 0; p < packets; ++p) acc_r[p] = pmadd(q_rc, k[p], acc_r[p]);
    };
    (row(acc[r], pset1<Packet>(q[Index(r) * q_stride + c])), ...);
  }

  // 2. Scale in the registers and write the tile once.
  const Packet scale_p = pset1<Packet>(scale);
  (store_tile_row<T>(s + Index(r) * s_stride, acc[r], scale_p, width, stream), ...);
}

/// Runs `tile(std::make_index_sequence<h>(), i)` down the rows [0, rows): tiles of h = Rows rows
/// while they fit, then one each of 2 Rows / 3, Rows / 3, Rows / 6 and 1 row where they fit
/// (every register kernel's cascade for the rest: 12, 8, 4, 2, 1 or 6, 4, 2, 1). A tile of one
/// row waits on its few accumulators' latency (far longer per row than a row of a full tile), so
/// the rest takes as few of them as it can: 8 rows are one tile of 8, where halves (6, 3, 1) made
/// them 6 + 1 + 1 (the layer's projections end every block of 96 rows with 8; see
/// docs/benchmarks.md).
template <std::size_t Rows, class Tile>
EIGEN_STRONG_INLINE void row_tiles(Index rows, const Tile& tile) {
  static_assert(Rows % 6 == 0, "row_tiles: tiles of 6 or 12 rows");
  Index i = 0;
  const auto run = [&](auto tile_rows) {
    for (; i + Index(tile_rows.size()) <= rows; i += Index(tile_rows.size())) tile(tile_rows, i);
  };
  const auto run_once = [&](auto tile_rows) {
    if (i + Index(tile_rows.size()) <= rows) {
      tile(tile_rows, i);
      i += Index(tile_rows.size());
    }
  };
  run(std::make_index_sequence<Rows>());
  run_once(std::make_index_sequence<Rows * 2 / 3>());
  run_once(std::make_index_sequence<Rows / 3>());
  run_once(std::make_index_sequence<Rows / 6>());
  run(std::make_index_sequence<1>());
}

/// One key panel against `rows` query rows: the register tiles down the rows. Shape contract: q
/// points at the first query row (row stride q_stride), s at its score in the panel's first column
/// (row stride s_stride); see `score_tile` for the rest.
template <class T>
void score_panel(const T* q, Index q_stride, Index rows, const T* panel, Index panel_stride,
                 Index d, T scale, T* s, Index s_stride, Index width, bool stream) {
  row_tiles<std::size_t(ScoreTile<T>::rows)>(rows, [&](auto tile_rows, Index i) {
    score_tile<T>(tile_rows, q + i * q_stride, q_stride, panel, panel_stride, d, scale,
                  s + i * s_stride, s_stride, width, stream);
  });
}

/// S = scale * Q K^T with K in panels. Shape contract: Q n x d and S n x m, row-major; `keys()`
/// returns the `KeyPanels` (ceil(m / cols) panels of d features); each thread of the team calls it
/// before its first block, so that it can pack the keys into the thread's own buffer (a copy
/// packed by the calling thread would be taken back from the other threads' caches at every call,
/// see `flash_kernel_on`).
/// Pass 1 splits the queries into blocks of 8 register tiles, in parallel (`parallel_for`); pass 2,
/// per block, walks the key panels (one panel stays in L1 while every tile of the block uses it);
/// pass 3, per panel, runs the register tiles down the block, with smaller tiles for the rest.
template <class T, class Keys>
void score_tiles(ConstRef<T> Q, const Keys& keys, T scale, Eigen::Ref<Matrix<T>> S) {
  using Tile = ScoreTile<T>;
  constexpr Index rows = Tile::rows;
  constexpr Index cols = Tile::cols;
  constexpr Index block_rows = 8 * rows;
  const Index n = S.rows();
  const Index m = S.cols();
  const Index d = Q.cols();
  const Index q_stride = Q.outerStride();
  const Index s_stride = S.outerStride();
  // Streaming stores skip the cache: worth it when S is too large for the caches, and possible when
  // every row of S starts aligned to a packet.
  constexpr Index packet_bytes = Tile::lanes * Index(sizeof(T));
  const bool stream = n * m * Index(sizeof(T)) >= (Index(8) << 20) &&
                      reinterpret_cast<std::uintptr_t>(S.data()) % packet_bytes == 0 &&
                      (s_stride * Index(sizeof(T))) % packet_bytes == 0;
  const Index blocks = (n + block_rows - 1) / block_rows;
  parallel_for<std::optional<KeyPanels<T>>>(blocks, [&](Index b, auto& panels) {
    if (!panels) panels = keys();
    const Index i_begin = b * block_rows;
    const Index i_end = std::min(n, i_begin + block_rows);
    for (Index j0 = 0; j0 < m; j0 += cols) {
      score_panel<T>(Q.data() + i_begin * q_stride, q_stride, i_end - i_begin, panels->panel(j0),
                     panels->stride, d, scale, S.data() + i_begin * s_stride + j0, s_stride,
                     std::min(cols, m - j0), stream);
    }
    if (stream) stream_fence();
  });
}

/// This thread's buffer for m keys of d features packed in panels: grows to the largest size seen
/// and is kept between calls (aligned for the packet loads).
template <class T>
T* packed_panels(Index m, Index d) {
  constexpr Index cols = ScoreTile<T>::cols;
  struct PackedPanels {};
  Vector<T>& packed = thread_buffer<PackedPanels, Vector<T>>();
  const Index size = (m + cols - 1) / cols * cols * d;
  if (packed.size() < size) packed.resize(size);
  return packed.data();
}

/// K (m x d) packed in panels into this thread's buffer (`packed_panels`): what `score_tiles` and
/// the tiled attention kernel take. Valid until this thread packs again.
template <class T>
const T* pack_keys(ConstRef<T> K) {
  T* packed = packed_panels<T>(K.rows(), K.cols());
  pack_keys_into<T>(K, packed);
  return packed;
}

/// The panels of `pack_panel` of the columns of W (d x m) as keys, for a product X W: each row of
/// a panel is a contiguous piece of a row of W. W is read row by row, in memory order (a layer's
/// weights are seldom in the cache: panel by panel, the rows 2 KiB apart defeated the prefetcher),
/// and whole pieces are copied by a loop of fixed length (no call per piece); see
/// docs/benchmarks.md.
template <class T>
void pack_columns(ConstRef<T> W, T* packed) {
  constexpr Index cols = ScoreTile<T>::cols;
  const Index d = W.rows();
  const Index whole = W.cols() / cols;
  const Index rest = W.cols() - whole * cols;
  for (Index c = 0; c < d; ++c) {
    const T* from = W.data() + c * W.outerStride();
    T* to = packed + c * cols;
    for (Index p = 0; p < whole; ++p, from += cols, to += d * cols) {
      for (Index jj = 0; jj < cols; ++jj) to[jj] = from[jj];
    }
    if (rest > 0) {
      for (Index jj = 0; jj < rest; ++jj) to[jj] = from[jj];
      for (Index jj = rest; jj < cols; ++jj) to[jj] = T(0);
    }
  }
}

/// Whether `product_kernel` reads the columns of W (d x m) in place as its key panels
/// (`KeyPanels`) for n rows of X, instead of packing them: where W's rows hold whole panels that
/// start on a packet, and the product is short next to W's size (n times W's bytes at most
/// `in_place_limit`). There packing W is a good part of the product, while in place every row
/// block reads W again through the caches, whose sets the rows (2 KiB and more apart) share. The
/// limit was chosen by measurement; see docs/benchmarks.md.
template <class T>
bool columns_in_place(ConstRef<T> W, Index n) {
  constexpr Index cols = ScoreTile<T>::cols;
  constexpr double in_place_limit = double(Index(512) << 20);
  constexpr Index packet_bytes = ScoreTile<T>::lanes * Index(sizeof(T));
  const double weight_bytes = double(W.rows()) * double(W.outerStride()) * double(sizeof(T));
  return W.cols() % cols == 0 && reinterpret_cast<std::uintptr_t>(W.data()) % packet_bytes == 0 &&
         (W.outerStride() * Index(sizeof(T))) % packet_bytes == 0 &&
         double(n) * weight_bytes <= in_place_limit;
}

/// Y = X W with the same register tiles: `project`, `project_qkv` and the multi-head layer's
/// projections. W's columns are the keys: read in place where `columns_in_place`, otherwise packed
/// (`pack_columns`). Each entry is one sum in feature order, the same bits either way.
/// Shape contract: X n x d, W d x m, Y n x m (already sized).
template <class T>
void product_kernel(ConstRef<T> X, ConstRef<T> W, Eigen::Ref<Matrix<T>> Y) {
  if (Y.size() == 0) return;
  if (X.cols() == 0) {
    Y.setZero();
    return;
  }
  if (columns_in_place<T>(W, X.rows())) {
    const KeyPanels<T> columns{W.data(), ScoreTile<T>::cols, W.outerStride()};
    score_tiles<T>(
        X, [&] { return columns; }, T(1), Y);
    return;
  }
  T* packed = packed_panels<T>(W.cols(), W.rows());
  pack_columns<T>(W, packed);
  const KeyPanels<T> panels = packed_key_panels<T>(packed, W.rows());
  score_tiles<T>(
      X, [&] { return panels; }, T(1), Y);
}

}  // namespace detail
}  // namespace attn

#pragma once
/// \file detail/value_tiles.hpp
/// The register-tiled P V step of the tiled kernel: O = diag(alpha) O + P V_tile for a block of
/// query rows, with the online softmax's rescale by alpha fused into the load of O.
///
/// Why not Eigen's GEMM: for one key tile (P rows x cols, V_tile cols x d_v) Eigen packs both
/// operands again every tile and needs O rescaled in a pass of its own before it adds P V_tile.
/// Here a register tile holds `rows` rows x `packets` packets of O (the rescale applied as they
/// are loaded), each step over a key loads that key's value packets once and adds them to every
/// row of the tile with one broadcast weight per row, and the tile is written back once per key
/// tile. V is read in place (row-major, one key's values contiguous): nothing is packed.

#include <algorithm>
#include <cstddef>
#include <utility>

#include "../types.hpp"
#include "score_tiles.hpp"

namespace attn {
namespace detail {

/// Register tile of the value kernel for scalar T: `rows` query rows x up to `packets` packets of
/// the output row. 6 x 4 accumulators use 24 of the 32 AVX-512 registers; 6 x 2 use 12 of 16
/// elsewhere (the rest hold a key's value packets and a broadcast weight).
template <class T>
struct ValueTile : Simd<T> {
  static constexpr Index packets = Simd<T>::registers >= 32 ? 4 : 2;
  static constexpr Index rows = 6;
};

/// One register tile: o[r, 0:Packets lanes) = alpha[r] o[r, ...] + sum_j p[r, j] v[j, ...] for
/// the `sizeof...(r)` rows. Shape contract: p points at P(i, 0) (row stride p_stride), v at the
/// tile's first value row at this tile's first column (row stride v_stride), o at O(i, column)
/// (row stride o_stride), alpha at alpha(i), or null for no rescale; cols keys. With `Transposed`
/// the weights are read from the transpose: p[r, j] is P(j, i + r) (P^T V without forming P^T;
/// the backward's dV = P^T dO and dK = dS^T Q). Each output is one sum over the keys in order, so
/// its bits do not depend on the tiling of the rows or on threads.
template <class T, std::size_t Packets, bool Transposed, std::size_t... r>
EIGEN_STRONG_INLINE void value_tile(std::index_sequence<r...>, const T* p, Index p_stride,
                                    const T* v, Index v_stride, Index cols, const T* alpha, T* o,
                                    Index o_stride) {
  using Packet = typename ValueTile<T>::Packet;
  constexpr Index lanes = ValueTile<T>::lanes;
  constexpr std::size_t rows = sizeof...(r);
  using Eigen::internal::pload1;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pmul;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;

  Packet acc[rows][Packets];
  const auto load = [&](Packet(&acc_r)[Packets], const T* o_r, T alpha_r) {
    const Packet a = pset1<Packet>(alpha_r);
    for (std::size_t q = 0; q < Packets; ++q) {
      acc_r[q] = pmul(a, ploadu<Packet>(o_r + Index(q) * lanes));
    }
  };
  const auto load_plain = [&](Packet(&acc_r)[Packets], const T* o_r) {
    for (std::size_t q = 0; q < Packets; ++q) acc_r[q] = ploadu<Packet>(o_r + Index(q) * lanes);
  };
  if (alpha) {
    (load(acc[r], o + Index(r) * o_stride, alpha[r]), ...);
  } else {
    (load_plain(acc[r], o + Index(r) * o_stride), ...);
  }
  for (Index j = 0; j < cols; ++j, v += v_stride) {
    Packet value[Packets];
    for (std::size_t q = 0; q < Packets; ++q) value[q] = ploadu<Packet>(v + Index(q) * lanes);
    const auto row = [&](Packet(&acc_r)[Packets], const Packet& weight) {
      for (std::size_t q = 0; q < Packets; ++q) acc_r[q] = pmadd(weight, value[q], acc_r[q]);
    };
    if constexpr (Transposed) {
      (row(acc[r], pload1<Packet>(p + j * p_stride + Index(r))), ...);
    } else {
      (row(acc[r], pload1<Packet>(p + Index(r) * p_stride + j)), ...);
    }
  }
  const auto store = [&](Packet(&acc_r)[Packets], T* o_r) {
    for (std::size_t q = 0; q < Packets; ++q) pstoreu(o_r + Index(q) * lanes, acc_r[q]);
  };
  (store(acc[r], o + Index(r) * o_stride), ...);
}

/// The tiles of `Packets` packets wide over every row: `rows`-row tiles, then 3- and 1-row ones.
template <class T, std::size_t Packets, bool Transposed>
void value_tile_rows(Index rows, const T* p, Index p_stride, const T* v, Index v_stride, Index cols,
                     const T* alpha, T* o, Index o_stride) {
  row_tiles<std::size_t(ValueTile<T>::rows)>(rows, [&](auto tile_rows, Index i) {
    value_tile<T, Packets, Transposed>(tile_rows, Transposed ? p + i : p + i * p_stride, p_stride,
                                       v, v_stride, cols, alpha ? alpha + i : nullptr,
                                       o + i * o_stride, o_stride);
  });
}

/// O = diag(alpha) O + P V_tile. Shape contract: P rows x cols (row stride p_stride; with
/// `Transposed`, P is given as its transpose, cols x rows with row stride p_stride), V_tile
/// cols x d_v (row stride v_stride), O rows x d_v (row stride o_stride), alpha rows entries or
/// null (no rescale: O += P V_tile). Whole packets of the output row go through the register
/// tiles; the columns of a width that is not a whole number of packets, one by one.
template <class T, bool Transposed = false>
void value_tiles(Index rows, Index cols, Index d_v, const T* P, Index p_stride, const T* V,
                 Index v_stride, const T* alpha, T* O, Index o_stride) {
  using Tile = ValueTile<T>;
  const Index whole = d_v / Tile::lanes;
  for (Index q0 = 0; q0 < whole; q0 += Tile::packets) {
    const Index packets = std::min(Tile::packets, whole - q0);
    const Index c0 = q0 * Tile::lanes;
    const auto run = [&](auto width) {
      value_tile_rows<T, decltype(width)::value, Transposed>(rows, P, p_stride, V + c0, v_stride,
                                                             cols, alpha, O + c0, o_stride);
    };
    if constexpr (Tile::packets >= 4) {
      if (packets == 4) run(std::integral_constant<std::size_t, 4>());
      if (packets == 3) run(std::integral_constant<std::size_t, 3>());
    }
    if (packets == 2) run(std::integral_constant<std::size_t, 2>());
    if (packets == 1) run(std::integral_constant<std::size_t, 1>());
  }
  for (Index c = whole * Tile::lanes; c < d_v; ++c) {
    for (Index i = 0; i < rows; ++i) {
      const Index p_row = Transposed ? 1 : p_stride;
      const Index p_col = Transposed ? p_stride : 1;
      const T* p = P + i * p_row;
      T sum = alpha ? alpha[i] * O[i * o_stride + c] : O[i * o_stride + c];
      for (Index j = 0; j < cols; ++j) sum += p[j * p_col] * V[j * v_stride + c];
      O[i * o_stride + c] = sum;
    }
  }
}

}  // namespace detail
}  // namespace attn

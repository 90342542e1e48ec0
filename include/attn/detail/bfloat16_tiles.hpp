#pragma once
/// \file detail/bfloat16_tiles.hpp
/// The score tiles of the tiled kernel in bfloat16 arithmetic: S = scale * Q K^T for float queries
/// rounded to bfloat16 and keys stored in bfloat16, by AVX512_BF16's `vdpbf16ps`, which multiplies
/// 32 pairs of bfloat16 and adds them into 16 float sums per instruction: twice the products of a
/// float multiply-add of the same width. Taken only with `StoredArithmetic::Reduced` (opt-in per
/// call) on a CPU that has the instruction; the float score tiles stay the portable path.
///
/// Layout. `vdpbf16ps` sums two neighbouring 16-bit elements of each 32-bit lane, so both operands
/// come in pairs of features: a query row as ceil(d / 2) 32-bit words (features 2c and 2c + 1 in
/// the low and high half), broadcast one word at a time; a key panel of 32 keys as ceil(d / 2)
/// rows of 32 such words, one per key (two registers). One register tile is `rows` queries x 32
/// keys, as in the float kernel with AVX-512.
///
/// The tile function is written in intrinsics only and compiled for its own target
/// (`avx512f,avx512bf16`) whatever the translation unit's flags, like the decoding step's bfloat16
/// scores. The float kernel's panels are 32 keys wide only when Eigen uses AVX-512, so the tiled
/// kernel takes this path only in translation units compiled for AVX-512 (`bfloat16_tiles_compiled`).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../simd.hpp"
#include "../types.hpp"
#include "score_tiles.hpp"
#include "stored.hpp"

namespace attn {
namespace detail {

/// Keys per panel of the bfloat16 score tiles (two registers of 16 float sums).
inline constexpr Index bfloat16_panel_keys = 32;

/// Whether this translation unit's tiled kernel can take the bfloat16 score tiles: x86 with GCC or
/// Clang (target attributes), and Eigen on AVX-512, whose float panels are the same 32 keys wide.
constexpr bool bfloat16_tiles_compiled() {
#if defined(ATTN_X86_TARGETS) && defined(EIGEN_VECTORIZE_AVX512)
  return ScoreTile<float>::cols == bfloat16_panel_keys;
#else
  return false;
#endif
}

/// The 16 bits of a bfloat16, as the low half of a word.
inline std::uint32_t bfloat16_bits(Eigen::bfloat16 x) {
  return Eigen::numext::bit_cast<std::uint16_t>(x);
}

/// The bits of a float rounded to bfloat16 (to nearest even; NaN stays NaN).
inline std::uint32_t bfloat16_bits(float x) { return bfloat16_bits(Eigen::bfloat16(x)); }

/// Two features as one 32-bit word: `lo` in the low half (`vdpbf16ps`'s even element).
inline std::uint32_t bfloat16_pair(std::uint32_t lo, std::uint32_t hi) { return lo | (hi << 16); }

/// Features (f, f + 1) of a row of `d`, 0 past the end.
template <class Element>
std::uint32_t bfloat16_pair_at(const Element& element, Index f, Index d) {
  return bfloat16_pair(element(f), f + 1 < d ? element(f + 1) : 0u);
}

#if defined(ATTN_X86_TARGETS)
ATTN_INTRINSICS_BEGIN
/// `count` floats (a multiple of 16) rounded to bfloat16 (to nearest even) into `out`, in order: a
/// row of probabilities as `count / 2` pairs of neighbouring keys for the value tiles. Subnormal
/// floats become 0 (`vcvtneps2bf16`), as `vdpbf16ps` takes subnormal operands anyway.
__attribute__((target("avx512f,avx512bf16"))) inline void round_to_bfloat16(const float* x,
                                                                            Index count,
                                                                            std::uint32_t* out) {
  for (Index c = 0; c < count; c += 16, out += 8) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(rounded));
  }
}
ATTN_INTRINSICS_END
#endif

/// Q (n x d) rounded to bfloat16, row i as ceil(d / 2) pairs at `pairs + i * ceil(d / 2)`: for
/// the bfloat16 score tiles, so only where the CPU has AVX512_BF16. Whole blocks of 16 features
/// by `round_to_bfloat16` (a subnormal feature becomes 0 there, which `vdpbf16ps` would take as
/// 0 anyway), the rest one by one: rounded element by element, the queries were a visible part of
/// a `flash_attention` call (see docs/benchmarks.md).
inline void pack_bfloat16_queries(ConstRef<float> Q, std::uint32_t* pairs) {
  const Index d = Q.cols();
  const Index words = (d + 1) / 2;
  for (Index i = 0; i < Q.rows(); ++i, pairs += words) {
    Index f = 0;
#if defined(ATTN_X86_TARGETS)
    f = d / 16 * 16;
    round_to_bfloat16(Q.data() + i * Q.outerStride(), f, pairs);
#endif
    const auto element = [&](Index c) { return bfloat16_bits(Q(i, c)); };
    for (; f < d; f += 2) pairs[f / 2] = bfloat16_pair_at(element, f, d);
  }
}

/// Keys stored in bfloat16 (m x d) packed for the tiles: panel p holds keys [32 p, 32 p + 32),
/// row c of a panel the pairs of features (2c, 2c + 1) of its 32 keys; zero past the last key.
ATTN_INTRINSICS_BEGIN
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // PacketBlock<Packet16f>: see `pack_panel`
inline void pack_bfloat16_keys(const StoredBlock<BFloat16Codec, float>& K, std::uint32_t* packed) {
  constexpr Index w = bfloat16_panel_keys;
  const Index m = K.rows();
  const Index d = K.cols();
  for (Index j0 = 0; j0 < m; j0 += w) {
    const Index width = std::min(w, m - j0);
    Index f = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
    // Whole panels of rows whose pairs are whole 32-bit words (d and the row stride even): blocks
    // of 16 keys x 16 pairs moved as words, transposed in registers (`ptranspose` of floats moves
    // bits, no arithmetic), faster than the pair-by-pair loop below (see docs/benchmarks.md).
    const bool words = d % 2 == 0 && K.outerStride() % 2 == 0 &&
                       reinterpret_cast<std::uintptr_t>(K.data()) % 4 == 0;
    if (width == w && words) {
      const Index pairs = d / 2;
      const Index blocked = pairs / 16 * 16;
      Eigen::internal::PacketBlock<Eigen::internal::Packet16f, 16> block;
      for (Index jb = 0; jb < w; jb += 16) {
        const Eigen::bfloat16* rows = K.data() + (j0 + jb) * K.outerStride();
        for (Index c0 = 0; c0 < blocked; c0 += 16) {
          for (Index r = 0; r < 16; ++r) {
            block.packet[r] =
                _mm512_castsi512_ps(_mm512_loadu_si512(rows + r * K.outerStride() + 2 * c0));
          }
          Eigen::internal::ptranspose(block);
          for (Index r = 0; r < 16; ++r) {
            _mm512_storeu_si512(packed + (c0 + r) * w + jb, _mm512_castps_si512(block.packet[r]));
          }
        }
      }
      f = 2 * blocked;
    }
#endif
    for (std::uint32_t* panel = packed + f / 2 * w; f < d; f += 2, panel += w) {
      for (Index jj = 0; jj < width; ++jj) {
        const Eigen::bfloat16* row = K.data() + (j0 + jj) * K.outerStride();
        const auto element = [&](Index c) { return bfloat16_bits(row[c]); };
        panel[jj] = bfloat16_pair_at(element, f, d);
      }
      std::fill(panel + width, panel + w, 0u);
    }
    packed += (d + 1) / 2 * w;
  }
}
#pragma GCC diagnostic pop
ATTN_INTRINSICS_END

/// Values stored in bfloat16 (m x d_v) packed for the value tiles: key pairs (2t, 2t + 1) for t
/// in [0, 16 ceil(m / 32)), each as d_v words, word f holding feature f of key 2t (low half) and of
/// key 2t + 1 (high half); zero past the last key, so that a padded key tile reads zeros.
inline void pack_bfloat16_values(const StoredBlock<BFloat16Codec, float>& V,
                                 std::uint32_t* packed) {
  const Index m = V.rows();
  const Index d_v = V.cols();
  const Index keys = (m + bfloat16_panel_keys - 1) / bfloat16_panel_keys * bfloat16_panel_keys;
  const auto bits = [&](Index j, Index f) -> std::uint32_t {
    return j < m ? bfloat16_bits(V.data()[j * V.outerStride() + f]) : 0u;
  };
  for (Index j = 0; j < keys; j += 2) {
    for (Index f = 0; f < d_v; ++f) *packed++ = bfloat16_pair(bits(j, f), bits(j + 1, f));
  }
}

/// Whether the value tiles can take `d_v` (whole registers of 16 features).
constexpr bool bfloat16_value_width(Index d_v) { return d_v % 16 == 0; }

#if defined(ATTN_X86_TARGETS)
ATTN_INTRINSICS_BEGIN
/// One register tile: s[r, 0:32) = scale * sum_c q[r, c] . panel[c, 0:32) for `Rows` query rows,
/// each sum over the feature pairs in order, two products per step (`vdpbf16ps`). Shape contract:
/// q points at the first row's pairs (row stride q_stride words), panel at one packed panel of
/// `pairs` rows, s at S(i, j0) (row stride s_stride); all 32 columns are written.
template <std::size_t Rows>
__attribute__((target("avx512f,avx512bf16"))) inline void bfloat16_score_tile(
    const std::uint32_t* q, Index q_stride, const std::uint32_t* panel, Index pairs, float scale,
    float* s, Index s_stride) {
  __m512 acc[Rows][2];
  for (std::size_t r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (Index c = 0; c < pairs; ++c, panel += bfloat16_panel_keys) {
    const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel));
    const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + 16));
    for (std::size_t r = 0; r < Rows; ++r) {
      const __m512bh q_rc = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int>(q[Index(r) * q_stride + c])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q_rc, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q_rc, k1);
    }
  }
  const __m512 scale_p = _mm512_set1_ps(scale);
  for (std::size_t r = 0; r < Rows; ++r) {
    _mm512_storeu_ps(s + Index(r) * s_stride, _mm512_mul_ps(acc[r][0], scale_p));
    _mm512_storeu_ps(s + Index(r) * s_stride + 16, _mm512_mul_ps(acc[r][1], scale_p));
  }
}

/// One register tile of the value product: o[r, 0:16 Packets) = alpha[r] o[r, ...] +
/// sum_t p[r, t] . v[t, ...] for `Rows` rows, over key pairs t in order, two keys per step
/// (`vdpbf16ps`). Shape contract: p points at the first row's probability pairs (row stride
/// p_stride words), v at the tile's first key pair at this tile's first feature (stride v_stride
/// words per pair), o at the rows' running output (row stride o_stride), alpha at the rows'
/// rescales.
template <std::size_t Rows, std::size_t Packets>
__attribute__((target("avx512f,avx512bf16"))) inline void bfloat16_value_tile(
    const std::uint32_t* p, Index p_stride, const std::uint32_t* v, Index v_stride, Index pairs,
    const float* alpha, float* o, Index o_stride) {
  __m512 acc[Rows][Packets];
  for (std::size_t r = 0; r < Rows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (std::size_t q = 0; q < Packets; ++q) {
      acc[r][q] = _mm512_mul_ps(a, _mm512_loadu_ps(o + Index(r) * o_stride + 16 * Index(q)));
    }
  }
  for (Index t = 0; t < pairs; ++t, v += v_stride) {
    __m512bh value[Packets];
    for (std::size_t q = 0; q < Packets; ++q) {
      value[q] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(v + 16 * Index(q)));
    }
    for (std::size_t r = 0; r < Rows; ++r) {
      const __m512bh p_rt = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int>(p[Index(r) * p_stride + t])));
      for (std::size_t q = 0; q < Packets; ++q)
        acc[r][q] = _mm512_dpbf16_ps(acc[r][q], p_rt, value[q]);
    }
  }
  for (std::size_t r = 0; r < Rows; ++r) {
    for (std::size_t q = 0; q < Packets; ++q) {
      _mm512_storeu_ps(o + Index(r) * o_stride + 16 * Index(q), acc[r][q]);
    }
  }
}

/// O = diag(alpha) O + P V_tile in bfloat16 arithmetic. Shape contract: P rows x 2 pairs
/// (`round_to_bfloat16` rows, stride p_stride words), V_tile the packed key pairs of the tile
/// (`pack_bfloat16_values`, d_v words each), O rows x d_v (row stride o_stride), d_v a multiple of
/// 16. Tiles of 6 rows (then 4, 2, 1) x 4 registers (then what is left of the row).
inline void bfloat16_value_tiles(Index rows, Index pairs, Index d_v, const std::uint32_t* P,
                                 Index p_stride, const std::uint32_t* V, const float* alpha,
                                 float* O, Index o_stride) {
  const Index packets = d_v / 16;
  for (Index q0 = 0; q0 < packets; q0 += 4) {
    const auto run = [&](auto width) {
      row_tiles<6>(rows, [&](auto tile_rows, Index i) {
        bfloat16_value_tile<decltype(tile_rows)::size(), decltype(width)::value>(
            P + i * p_stride, p_stride, V + 16 * q0, d_v, pairs, alpha + i,
            O + i * o_stride + 16 * q0, o_stride);
      });
    };
    switch (std::min<Index>(4, packets - q0)) {
      case 4:
        run(std::integral_constant<std::size_t, 4>());
        break;
      case 3:
        run(std::integral_constant<std::size_t, 3>());
        break;
      case 2:
        run(std::integral_constant<std::size_t, 2>());
        break;
      default:
        run(std::integral_constant<std::size_t, 1>());
    }
  }
}

/// One packed panel against `rows` query rows: tiles of 12 rows, then 8, 4, 2 and 1 (`row_tiles`).
inline void bfloat16_score_panel(const std::uint32_t* q, Index q_stride, Index rows,
                                 const std::uint32_t* panel, Index pairs, float scale, float* s,
                                 Index s_stride) {
  row_tiles<12>(rows, [&](auto tile_rows, Index i) {
    bfloat16_score_tile<decltype(tile_rows)::size()>(q + i * q_stride, q_stride, panel, pairs,
                                                     scale, s + i * s_stride, s_stride);
  });
}
ATTN_INTRINSICS_END
#endif

}  // namespace detail
}  // namespace attn

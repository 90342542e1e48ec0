#pragma once
/// \file detail/decode.hpp
/// One decoding step of a group of query heads over their shared key/value head: the online softmax
/// of `flash_block` with explicit SIMD loops, so that each key and value row is read from memory
/// once, used from registers by every query head of the group, and nothing else slows the stream.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "../simd.hpp"
#include "../types.hpp"
#include "../variant.hpp"
#include "exact_rows.hpp"
#include "online_softmax.hpp"
#include "paged_rows.hpp"
#include "score_rule.hpp"
#include "stored.hpp"
#include "variant_tiles.hpp"

namespace attn {
namespace detail {

/// Working memory of `decode_kernel` (kept per thread by the caller).
template <class T>
struct DecodeScratch {
  Matrix<T> q_scaled;        ///< g x d_k, the queries times the scale
  Matrix<T> s;               ///< g x tile: scores, then unnormalised probabilities
  OnlineSoftmax<T> state;    ///< g x d_v running output, running maxima and sums
  Vector<T> alpha;           ///< rescale factor of each running output for the current tile
  Matrix<T> k_wide, v_wide;  ///< a stored tile widened to T (widths that are not whole packets)
  Matrix<Eigen::bfloat16> q_bf16;  ///< the scaled queries in bfloat16 (the bfloat16 score path)
  bool bf16_scores = false;        ///< this step's bfloat16 keys go through `vdpbf16ps`
  Matrix<std::int8_t> q_i8;        ///< the scaled queries in 8 bits (the int8 score path) ...
  Vector<T> q_i8_scale;            ///< ... their scales, one per query head ...
  Vector<std::int32_t> q_i8_bias;  ///< ... and 128 times the sum of each head's entries
  bool i8_scores = false;          ///< this step's int8 keys go through `vpdpbusd`
  bool i16_values = false;         ///< this step's int8 values go through `vpdpwssd`
  GatherBuffer<T> k_tile, v_tile;  ///< a tile of paged keys and values, gathered (`PagedRows`)
  /// A paged tile's rows where they are (`ListedRows`): the addresses of this tile's and the next
  /// tile's key rows, this tile's value rows, and their int8 scales.
  const char* k_at[2][64];
  const char* v_at[64];
  T k_scales[2][64], v_scales[64];
};

template <class T>
using DecodePacket = typename Eigen::internal::packet_traits<T>::type;

template <class T>
constexpr Index decode_lanes = Eigen::internal::unpacket_traits<DecodePacket<T>>::size;

/// Asks for the cache line at `p` as non-temporal (`prefetchnta`: each key and value row is read
/// once per step, so it need not displace what the caches hold; chosen over `prefetcht1` by
/// measurement, see docs/benchmarks.md). On x86 with GCC or Clang it is an `asm volatile`, not
/// `__builtin_prefetch`: GCC 12 deletes a loop of `__builtin_prefetch` whose bounds it reads
/// through a reference (it counts the builtin as free of side effects), which left a first form
/// of `PrefetchRows` below without a single prefetch in the compiled step; an `asm volatile` is
/// never deleted.
EIGEN_STRONG_INLINE void prefetch_line(const char* p) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("prefetchnta %0" : : "m"(*p));
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 0);
#else
  Eigen::internal::prefetch(p);
#endif
}

/// The rows that one phase of `decode_tile` asks for ahead of the other phase's use (software
/// prefetch), one row per key it works on: while the scores read a tile's keys, that tile's
/// value rows; while the values read them, the next tile's key rows. Row r is the `bytes` bytes
/// at `first + r * stride`; rows [0, rows) are asked for, a line at a time (`prefetch_line`).
///
/// Why the other stream: the keys and the values are two streams read in turns of a tile (32 KiB
/// of each at d = 128 in float). Each phase asking for its own rows a tile ahead leaves the other
/// stream without requests for half the step, and a read in turns draws less bandwidth than the
/// two streams interleaved row by row. Asking for the other stream's rows keeps both streams going
/// and brings each row in about half a tile before its use rather than a whole one (chosen by
/// measurement; see docs/benchmarks.md).
struct PrefetchRows {
  const char* first = nullptr;
  Index stride = 0;  ///< bytes from one row to the next
  Index bytes = 0;   ///< bytes of a row
  Index rows = 0;    ///< rows [0, rows) are asked for

  /// Asks for row r (if it is one of the rows).
  EIGEN_STRONG_INLINE void row(Index r) const {
    if (r >= rows) return;
    const char* p = first + r * stride;
    for (Index c = 0; c < bytes; c += 64) prefetch_line(p + c);
  }

  /// Asks for rows [r, r + 4) (the 4 x 4 score blocks' keys).
  EIGEN_STRONG_INLINE void block(Index r) const {
    for (Index i = r; i < std::min(r + 4, rows); ++i) row(i);
  }

  /// The rows from `done` on, renumbered from 0 (for a loop that starts at key `done`).
  PrefetchRows rest(Index done) const {
    return {first + done * stride, stride, bytes, std::max<Index>(rows - done, 0)};
  }
};

/// `PrefetchRows` for rows at listed addresses (a paged tile, `ListedRows`): row r is the `bytes`
/// bytes at `at[r]`. A type of its own rather than a case of `PrefetchRows`: a branch between the
/// two in each row's request made the step on contiguous rows read through their addresses 1.24x
/// slower than through a stride.
struct ListedPrefetch {
  const char* const* at = nullptr;
  Index bytes = 0;
  Index rows = 0;

  EIGEN_STRONG_INLINE void row(Index r) const {
    if (r >= rows) return;
    for (Index c = 0; c < bytes; c += 64) prefetch_line(at[r] + c);
  }
  EIGEN_STRONG_INLINE void block(Index r) const {
    for (Index i = r; i < std::min(r + 4, rows); ++i) row(i);
  }
  ListedPrefetch rest(Index done) const {
    return {at + std::min(done, rows), bytes, std::max<Index>(rows - done, 0)};
  }
};

/// A decoding tile's rows stored contiguously: row j at `first + j * stride` elements.
template <class E>
struct StridedRows {
  const E* first;
  Index stride;
  const E* operator()(Index j) const { return first + j * stride; }
  /// The rows from row j on, renumbered from 0, each from its column c on.
  StridedRows from(Index j, Index c = 0) const { return {first + j * stride + c, stride}; }
  /// Rows j .. j + 3 (the 4 x 4 score blocks' keys): `four(j)[k]` is row j + k.
  StridedRows four(Index j) const { return from(j); }
  const E* operator[](Index k) const { return first + k * stride; }
};

/// A decoding tile's rows where their pages keep them: row j at the address `at[j]`, from its
/// column `column` on. The kernels read a tile through either kind of rows alike, so a paged
/// tile's arithmetic, and its bits, are those of the same rows stored contiguously.
template <class E>
struct ListedRows {
  const char* const* at;
  Index column = 0;
  const E* operator()(Index j) const { return reinterpret_cast<const E*>(at[j]) + column; }
  /// The rows from row j on, renumbered from 0, each from its column c on.
  ListedRows from(Index j, Index c = 0) const { return {at + j, column + c}; }
  /// Rows j .. j + 3 (the 4 x 4 score blocks' keys): `four(j)[k]` is row j + k.
  ListedRows four(Index j) const { return from(j); }
  const E* operator[](Index k) const { return (*this)(k); }
};

/// `PrefetchRows` for rows [0, rows) of `width` stored elements, the first at `first`, `stride`
/// elements apart.
template <class E>
PrefetchRows prefetch_rows_of(const E* first, Index stride, Index width, Index rows) {
  return {reinterpret_cast<const char*>(first), stride * Index(sizeof(E)), width * Index(sizeof(E)),
          rows};
}

/// Asks for rows [j0, j0 + count) of a sequence's paged rows (`prefetch_line`, a line at a time).
template <class Codec, class T>
void prefetch_paged(const PagedRows<Codec, T>& rows, Index j0, Index count) {
  constexpr Index line = 64;
  using Bits = typename Codec::Bits;
  rows.runs(j0, count, [&](Index row, Index run, Index) {
    const char* first = reinterpret_cast<const char*>(rows.row_data(row));
    const Index bytes = run * rows.cols() * Index(sizeof(Bits));
    for (Index b = 0; b < bytes; b += line) prefetch_line(first + b);
  });
}

/// Keeps a packet that several multiply-adds share in a register. Without it GCC 12 folds the
/// packet's load into each multiply-add as a memory operand, loading it again for each, which
/// made the decoding loops bound by loads rather than by multiply-adds (see docs/benchmarks.md).
/// An empty asm statement that claims to change the register; nothing where it is not x86 SIMD.
template <class Packet>
EIGEN_STRONG_INLINE void keep_in_register(Packet& p) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && \
    defined(__SSE2__)
  if constexpr (sizeof(Packet) >= 16) asm("" : "+v"(p));
#else
  (void)p;
#endif
}

/// Scores of heads [h0, h0 + G) against keys [0, cols) of a tile: s(h, j) = q_h . K_j.
/// Shape contract: q rows of d_k scalars (d_k a multiple of the packet size), K_tile's rows
/// (`StridedRows` or `ListedRows`) of elements stored by `Codec` (with `k_scales` for Int8). Each key row is loaded once per
/// packet, widened in registers and multiplied into the G accumulators; row j of `ahead` is asked
/// for with key j.
template <class T, class Codec, class Rows, class Ahead, std::size_t... h>
EIGEN_STRONG_INLINE void decode_scores(std::index_sequence<h...>, const T* q, Index q_stride,
                                       const Rows& K_tile, const T* k_scales, Index cols, Index d_k,
                                       T* s, Index s_stride, const Ahead& ahead) {
  using Packet = DecodePacket<T>;
  constexpr Index lanes = decode_lanes<T>;
  constexpr std::size_t G = sizeof...(h);
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::predux;
  using Eigen::internal::pset1;
  for (Index j = 0; j < cols; ++j) {
    const typename Codec::Bits* k_j = K_tile(j);
    ahead.row(j);
    Packet acc[G];
    ((acc[h] = pset1<Packet>(T(0))), ...);
    for (Index c = 0; c < d_k; c += lanes) {
      Packet k = load_stored<T, Codec>(k_j + c);
      keep_in_register(k);
      ((acc[h] = pmadd(ploadu<Packet>(q + Index(h) * q_stride + c), k, acc[h])), ...);
    }
    if constexpr (has_row_scales<Codec>) {
      ((s[Index(h) * s_stride + j] = k_scales[j] * predux(acc[h])), ...);
    } else {
      ((s[Index(h) * s_stride + j] = predux(acc[h])), ...);
    }
  }
}

#if defined(ATTN_X86_TARGETS)
ATTN_INTRINSICS_BEGIN
/// x + y, lane by lane: in float, or (`Integer`) in the 32-bit integers whose bits the packets hold.
template <bool Integer>
__attribute__((target("avx512f"))) EIGEN_STRONG_INLINE __m512 add_lanes(__m512 x, __m512 y) {
  if constexpr (Integer) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
  } else {
    return _mm512_add_ps(x, y);
  }
}

/// The sums of the 16 lanes of each of a[0..15], as one packet: lane i holds sum(a[i]). A tree of
/// 45 shuffles and adds instead of 16 separate horizontal sums (about 8 dependent steps each):
/// pairs of packets are interleaved and added four times, each time halving the packets while
/// each lane gathers the partial sums of one input. `Integer`: the packets hold the bits of 32-bit
/// integers, summed as such (the shuffles move bits, whatever they mean).
template <bool Integer = false>
__attribute__((target("avx512f"))) inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 b[8];  // per 128-bit lane: [a0_0+a0_2, a1_0+a1_2, a0_1+a0_3, a1_1+a1_3] of each pair
  for (int i = 0; i < 8; ++i) {
    b[i] = add_lanes<Integer>(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                              _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  __m512 c[4];  // per 128-bit lane: the sums over that lane of a[4i .. 4i + 3]
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(b[2 * i]);
    const __m512d hi = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = add_lanes<Integer>(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Across the 128-bit lanes: [X01, X23, Y01, Y23] from X = c[0], Y = c[1]; then [X, Y, Z, W].
  const __m512 d0 = add_lanes<Integer>(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = add_lanes<Integer>(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return add_lanes<Integer>(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/// Stores a 4 x 4 block of scores (lane 4 h + k: head h, key k) as 4 floats in each of 4 rows.
__attribute__((target("avx512f"))) inline void store_scores_4x4(__m512 sums, float* s,
                                                                Index s_stride) {
  _mm_storeu_ps(s, _mm512_extractf32x4_ps(sums, 0));
  _mm_storeu_ps(s + s_stride, _mm512_extractf32x4_ps(sums, 1));
  _mm_storeu_ps(s + 2 * s_stride, _mm512_extractf32x4_ps(sums, 2));
  _mm_storeu_ps(s + 3 * s_stride, _mm512_extractf32x4_ps(sums, 3));
}

/// Scores of 4 query heads against keys [0, cols - cols % 4) stored in bfloat16, by `vdpbf16ps`
/// (AVX512_BF16: 32 bfloat16 products per instruction, accumulated in float): the queries are
/// given in bfloat16 too (`q` rows of d_k, rounded to nearest even), so each score carries the
/// rounding of its query. 4 keys x 4 heads per block, summed by `sum_lanes16`. Compiled for its
/// own target whatever the build's flags (intrinsics only, no Eigen: the same code in every
/// translation unit), and called only with `StoredArithmetic::Reduced` on a CPU that has it. The
/// rows of `ahead` are asked for 4 per 4 keys, along the blocks, not all at once before the tile,
/// which was slower (see docs/benchmarks.md). Shape contract: d_k a multiple of 32. Returns the number of keys done.
template <class Rows, class Ahead>
__attribute__((target("avx512f,avx512bf16"))) inline Index decode_scores_bf16_4x4(
    const Eigen::bfloat16* q, Index q_stride, const Rows& K_tile, Index cols, Index d_k, float* s,
    Index s_stride, const Ahead& ahead) {
  Index j = 0;
  for (; j + 4 <= cols; j += 4) {
    const auto k = K_tile.four(j);
    ahead.block(j);
    __m512 acc[16];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    for (Index c = 0; c < d_k; c += 32) {
      __m512bh qh[4];
      for (int h = 0; h < 4; ++h) {
        qh[h] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + h * q_stride + c));
      }
      for (int key = 0; key < 4; ++key) {
        const __m512bh kv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[key] + c));
        for (int h = 0; h < 4; ++h)
          acc[4 * h + key] = _mm512_dpbf16_ps(acc[4 * h + key], qh[h], kv);
      }
    }
    const __m512 sums = sum_lanes16(acc);
    store_scores_4x4(sums, s + j, s_stride);
  }
  return j;
}

/// acc += the products of a's unsigned and b's signed 8-bit lanes, summed in fours into acc's
/// 32-bit lanes (AVX512_VNNI's `vpdpbusd`, no saturation). With GCC an `asm` of the one
/// instruction, like `add_products_i16` below (GCC 12 wraps the intrinsic in register copies).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) EIGEN_STRONG_INLINE __m512i
add_products_u8(__m512i acc, __m512i a, __m512i b) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, a, b);
#endif
}

/// acc += the products of a's 16-bit lanes and the two 16-bit integers at `pair` (broadcast to
/// every lane from memory, which leaves the registers to the accumulators), summed in pairs into
/// acc's 32-bit lanes (`vpdpwssd`). With GCC an `asm` of the one instruction: GCC 12 compiles the
/// intrinsic with a copy of the accumulator into another register and back around every
/// instruction (3 instructions for 1, and stack spills beyond 16 accumulators; counted in a 4 x 4
/// score loop with objdump).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) EIGEN_STRONG_INLINE __m512i
add_products_i16(__m512i acc, __m512i a, const std::int32_t* pair) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpwssd {%2%{1to16%}, %1, %0|%0, %1, %2%{1to16%}}" : "+v"(acc) : "v"(a), "m"(*pair));
  return acc;
#else
  return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(*pair));
#endif
}

/// Scores of 4 query heads against keys [0, cols - cols % 4) stored in int8, by `vpdpbusd`
/// (AVX512_VNNI: 64 products of an unsigned and a signed byte per instruction, summed in fours
/// into 16 32-bit lanes): the queries are given in 8 bits (`q` rows of d_k in [-127, 127]) with
/// one scale per head (`q_scale`), and each key byte k is read as the unsigned k + 128 (its top
/// bit flipped), so a lane sums (k + 128) q; `q_bias` (128 times the sum of each head's entries)
/// takes the 128 q back off. The 16 lane sums of each (head, key) pair are added by `sum_lanes16`
/// in 32-bit integers, exact: a score's d_k products are each at most 255 x 127 in magnitude,
/// below 2^31 in all up to d_k = 66311. The result is turned to float once and multiplied by the
/// head's and the key's scales. It replaced the queries in 16 bits by `vpdpwssd` (32 products
/// per instruction, each key row widened to 16 bits first), which was slower (see
/// docs/benchmarks.md). The price is the queries' rounding to 8 bits, about as large as the keys'
/// own (docs/benchmarks.md#accuracy-of-the-stored-keyvalue-formats). Compiled for its own target
/// whatever the build's flags (intrinsics only), called only with `StoredArithmetic::Reduced` on a
/// CPU that has it. Shape contract: d_k a multiple of 32 (a last 32 bytes are read masked), at
/// most 8192. Returns the number of keys done.
template <class Rows, class Ahead>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline Index decode_scores_i8_4x4(
    const std::int8_t* q, Index q_stride, const float* q_scale, const std::int32_t* q_bias,
    const Rows& K_tile, const float* k_scales, Index cols, Index d_k, float* s, Index s_stride,
    const Ahead& ahead) {
  // Lane 4 h + k of a block's sums belongs to head h: its scale and bias.
  const __m512 head_scales =
      _mm512_set_ps(q_scale[3], q_scale[3], q_scale[3], q_scale[3], q_scale[2], q_scale[2],
                    q_scale[2], q_scale[2], q_scale[1], q_scale[1], q_scale[1], q_scale[1],
                    q_scale[0], q_scale[0], q_scale[0], q_scale[0]);
  const __m512i head_biases = _mm512_set_epi32(
      q_bias[3], q_bias[3], q_bias[3], q_bias[3], q_bias[2], q_bias[2], q_bias[2], q_bias[2],
      q_bias[1], q_bias[1], q_bias[1], q_bias[1], q_bias[0], q_bias[0], q_bias[0], q_bias[0]);
  const __m512i top_bits = _mm512_set1_epi8(std::int8_t(-128));
  const Index whole = d_k - d_k % 64;  // columns read 64 at a time; then 32 masked, if any
  const __mmask64 last_32 = 0xffffffffULL;
  Index j = 0;
  for (; j + 4 <= cols; j += 4) {
    const auto k = K_tile.four(j);
    ahead.block(j);
    __m512i acc[16];
    for (__m512i& a : acc) a = _mm512_setzero_si512();
    for (Index c = 0; c < d_k; c += 64) {
      __m512i qh[4];
      __m512i kv[4];
      if (c < whole) {
        for (int h = 0; h < 4; ++h) qh[h] = _mm512_loadu_si512(q + h * q_stride + c);
        for (int key = 0; key < 4; ++key) kv[key] = _mm512_loadu_si512(k[key] + c);
      } else {  // the masked-off bytes: queries 0, so whatever the keys read, no product
        for (int h = 0; h < 4; ++h) qh[h] = _mm512_maskz_loadu_epi8(last_32, q + h * q_stride + c);
        for (int key = 0; key < 4; ++key) {
          kv[key] = _mm512_maskz_loadu_epi8(last_32, k[key] + c);
        }
      }
      for (int key = 0; key < 4; ++key) {
        const __m512i unsigned_key = _mm512_xor_si512(kv[key], top_bits);
        for (int h = 0; h < 4; ++h) {
          acc[4 * h + key] = add_products_u8(acc[4 * h + key], unsigned_key, qh[h]);
        }
      }
    }
    __m512 sums_in[16];
    for (int i = 0; i < 16; ++i) sums_in[i] = _mm512_castsi512_ps(acc[i]);
    const __m512i biased = _mm512_castps_si512(sum_lanes16<true>(sums_in));
    __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(biased, head_biases));
    sums = _mm512_mul_ps(sums, head_scales);
    sums = _mm512_mul_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(k_scales + j)));
    store_scores_4x4(sums, s + j, s_stride);
  }
  return j;
}

/// The largest decoding tile `decode_values_i16_4` takes (its 32-bit sums stay exact below 256),
/// and the pairs of 16-bit weights of each head it keeps (also the step from one head's weights
/// to the next's).
constexpr Index decode_i16_max_cols = 64;
constexpr Index decode_i16_pairs = decode_i16_max_cols / 2 + 1;

/// One pass of `decode_values_i16_4` over `Groups` groups of 32 output columns: pairs of value rows
/// (j, j + 1) widened to 16 bits (`vpmovsxbw`) and interleaved word by word (`vpunpcklwd` /
/// `vpunpckhwd` within each 128-bit lane), and multiplied by each head's pair of 16-bit
/// probabilities by `vpdpwssd`. A group's two accumulators hold its columns in the order the
/// unpacking leaves them (lo: 0-3, 8-11, 16-19, 24-27; hi: 4-7, 12-15, 20-23, 28-31); a two-source
/// permutation restores it at the end, where o_h = alpha_h o_h + scale_h sum. (Interleaving the
/// rows byte by byte before widening them, as many shuffles but on 256-bit halves, was slower;
/// see docs/benchmarks.md.)
template <int Groups, class Rows, class Ahead>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void decode_values_i16_pass(
    const std::int32_t (&p32)[4 * decode_i16_pairs], const float* scale, const float* alpha,
    const Rows& V_tile, Index cols, float* o, Index o_stride, const Ahead& ahead) {
  __m512i acc[4][std::size_t(2 * Groups)];
  for (auto& head : acc)
    for (__m512i& a : head) a = _mm512_setzero_si512();
  const std::int32_t* pair = p32;  // the weights of rows j and j + 1
  for (Index j = 0; j < cols; j += 2, ++pair) {
    const std::int8_t* a = V_tile(j);
    const std::int8_t* b = j + 1 < cols ? V_tile(j + 1) : a;  // an odd last row pairs with itself
    ahead.row(j);
    ahead.row(j + 1);
    for (int g = 0; g < Groups; ++g) {
      const __m512i wa =
          _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * g)));
      const __m512i wb =
          _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * g)));
      const __m512i lo = _mm512_unpacklo_epi16(wa, wb);
      const __m512i hi = _mm512_unpackhi_epi16(wa, wb);
      for (int h = 0; h < 4; ++h) {
        acc[h][2 * g] = add_products_i16(acc[h][2 * g], lo, pair + h * decode_i16_pairs);
        acc[h][2 * g + 1] = add_products_i16(acc[h][2 * g + 1], hi, pair + h * decode_i16_pairs);
      }
    }
  }
  // Columns 0-15 are lo's and hi's first two 128-bit lanes alternately, 16-31 their last two.
  const __m512i first_half =
      _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second_half =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int h = 0; h < 4; ++h) {
    const __m512 a = _mm512_set1_ps(alpha[h]);
    const __m512 f = _mm512_set1_ps(scale[h]);
    float* o_h = o + h * o_stride;
    for (int g = 0; g < Groups; ++g) {
      const __m512 lo = _mm512_cvtepi32_ps(acc[h][2 * g]);
      const __m512 hi = _mm512_cvtepi32_ps(acc[h][2 * g + 1]);
      const __m512 first = _mm512_permutex2var_ps(lo, first_half, hi);
      const __m512 second = _mm512_permutex2var_ps(lo, second_half, hi);
      float* out = o_h + 32 * g;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(f, first, _mm512_mul_ps(a, _mm512_loadu_ps(out))));
      _mm512_storeu_ps(out + 16,
                       _mm512_fmadd_ps(f, second, _mm512_mul_ps(a, _mm512_loadu_ps(out + 16))));
    }
  }
}

/// The mask of the first min(count, 16) lanes of a packet of 16.
inline __mmask16 first_lanes(Index count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

/// `decode_values` for 4 query heads over int8 value rows, by `vpdpwssd`: each head's weights of
/// the tile (p(h, j), already times the rows' scales) rounded to 16 bits with one scale per head
/// and tile (max_j p(h, j) / 32767, to nearest), the value rows widened from 8 to 16 bits, the
/// products of two rows at a time summed in 32-bit integers, turned to float once per tile. A
/// lane sums at most `decode_i16_max_cols` products of at most 32767 x 127: exact. Each weight is
/// off by at most half its head's step (max_j p(h, j) / 65534), so an output entry by at most
/// cols x max |V| / 65534 over the softmax's sum (tests/kv_storage_test.cpp holds the bound).
/// Returns false, having written nothing, when a weight is not finite (a NaN or an infinite
/// scale among the rows; the float path then carries it, keeping the NaN rule). Shape contract:
/// cols <= `decode_i16_max_cols`, d_v a multiple of 32. Called only with
/// `StoredArithmetic::Reduced`.
template <class Rows, class Ahead>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline bool decode_values_i16_4(
    const float* p, Index p_stride, const float* alpha, const Rows& V_tile, Index cols, Index d_v,
    float* o, Index o_stride, const Ahead& ahead) {
  ATTN_ASSERT(cols <= decode_i16_max_cols && d_v % 32 == 0);
  const __m512 finite_max = _mm512_set1_ps(std::numeric_limits<float>::max());
  float largest[4];
  for (int h = 0; h < 4; ++h) {
    __m512 m = _mm512_setzero_ps();
    for (Index j = 0; j < cols; j += 16) {
      const __mmask16 lanes = first_lanes(cols - j);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, p + h * p_stride + j);
      if (_mm512_cmp_ps_mask(x, finite_max, _CMP_NLE_UQ) != 0) return false;  // NaN or inf
      m = _mm512_max_ps(m, x);
    }
    largest[h] = _mm512_reduce_max_ps(m);
  }
  // Weights j and j + 1 of head h in the two halves of p32[h decode_i16_pairs + j / 2] (an odd
  // tile's last pair has 0 in its upper half).
  std::int32_t p32[4 * decode_i16_pairs] = {};
  float scale[4];
  for (int h = 0; h < 4; ++h) {
    scale[h] = largest[h] / 32767.0f;
    const __m512 inverse = _mm512_set1_ps(largest[h] > 0.0f ? 32767.0f / largest[h] : 0.0f);
    for (Index j = 0; j < cols; j += 16) {
      const __mmask16 lanes = first_lanes(cols - j);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, p + h * p_stride + j);
      _mm512_mask_cvtsepi32_storeu_epi16(&p32[h * decode_i16_pairs + j / 2], lanes,
                                         _mm512_cvtps_epi32(_mm512_mul_ps(x, inverse)));
    }
  }
  Index c0 = 0;
  for (; c0 + 64 <= d_v; c0 += 64) {
    decode_values_i16_pass<2>(p32, scale, alpha, V_tile.from(0, c0), cols, o + c0, o_stride,
                              c0 == 0 ? ahead : Ahead{});
  }
  if (c0 < d_v) {
    decode_values_i16_pass<1>(p32, scale, alpha, V_tile.from(0, c0), cols, o + c0, o_stride,
                              c0 == 0 ? ahead : Ahead{});
  }
  return true;
}
ATTN_INTRINSICS_END
#endif
#if defined(EIGEN_VECTORIZE_AVX512)

/// `decode_scores` for 4 float heads on AVX-512, 4 keys at a time: the 16 (head, key) dot products
/// accumulate in 16 registers (each query packet loaded once for 4 keys), and one `sum_lanes16`
/// gives their 16 scores (lane 4 h + k: head h, key k), stored as 4 floats per head. Returns the
/// number of keys done (a multiple of 4; the caller does the rest one by one).
template <class Codec, class Rows, class Ahead>
EIGEN_STRONG_INLINE Index decode_scores_4x4(const float* q, Index q_stride, const Rows& K_tile,
                                            const float* k_scales, Index cols, Index d_k, float* s,
                                            Index s_stride, const Ahead& ahead) {
  Index j = 0;
  for (; j + 4 <= cols; j += 4) {
    const auto k = K_tile.four(j);
    ahead.block(j);
    __m512 acc[16];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    for (Index c = 0; c < d_k; c += 16) {
      __m512 q0 = _mm512_loadu_ps(q + c);
      __m512 q1 = _mm512_loadu_ps(q + q_stride + c);
      __m512 q2 = _mm512_loadu_ps(q + 2 * q_stride + c);
      __m512 q3 = _mm512_loadu_ps(q + 3 * q_stride + c);
      keep_in_register(q0);
      keep_in_register(q1);
      keep_in_register(q2);
      keep_in_register(q3);
      for (int key = 0; key < 4; ++key) {
        __m512 kv = load_stored<float, Codec>(k[key] + c);
        keep_in_register(kv);
        acc[key] = _mm512_fmadd_ps(q0, kv, acc[key]);
        acc[4 + key] = _mm512_fmadd_ps(q1, kv, acc[4 + key]);
        acc[8 + key] = _mm512_fmadd_ps(q2, kv, acc[8 + key]);
        acc[12 + key] = _mm512_fmadd_ps(q3, kv, acc[12 + key]);
      }
    }
    __m512 sums = sum_lanes16(acc);
    if constexpr (has_row_scales<Codec>) {
      sums = _mm512_mul_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(k_scales + j)));
    }
    store_scores_4x4(sums, s + j, s_stride);
  }
  return j;
}
#endif

/// o_h = alpha_h o_h + sum_j p(h, j) V_j for heads [h0, h0 + G), over the columns [c0, c0 + C
/// packets) of the output: the G x C packets of output stay in registers over the whole tile, each
/// value packet is loaded (and widened) once and multiplied into the G heads; row j of `ahead` is
/// asked for with value j. The int8 scales are already in p.
template <class T, class Codec, Index C, class Rows, class Ahead, std::size_t... h>
EIGEN_STRONG_INLINE void decode_values(std::index_sequence<h...>, const T* p, Index p_stride,
                                       const T* alpha, const Rows& V_tile, Index cols, T* o,
                                       Index o_stride, const Ahead& ahead) {
  using Packet = DecodePacket<T>;
  constexpr Index lanes = decode_lanes<T>;
  constexpr std::size_t G = sizeof...(h);
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pmul;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  Packet acc[G][std::size_t(C)];
  for (Index c = 0; c < C; ++c) {
    ((acc[h][c] =
          pmul(pset1<Packet>(alpha[h]), ploadu<Packet>(o + Index(h) * o_stride + c * lanes))),
     ...);
  }
  for (Index j = 0; j < cols; ++j) {
    const typename Codec::Bits* v_j = V_tile(j);
    ahead.row(j);
    for (Index c = 0; c < C; ++c) {
      Packet v = load_stored<T, Codec>(v_j + c * lanes);
      keep_in_register(v);
      ((acc[h][c] = pmadd(pset1<Packet>(p[Index(h) * p_stride + j]), v, acc[h][c])), ...);
    }
  }
  for (Index c = 0; c < C; ++c) {
    ((pstoreu(o + Index(h) * o_stride + c * lanes, acc[h][c])), ...);
  }
}

/// The stored elements of a block (Eigen blocks of T and `StoredBlock` alike).
template <class Block>
auto block_data(const Block& B) {
  return B.data();
}

/// The per-row int8 scales of a block (null for everything else).
template <class T, class Block>
const T* block_scales(const Block& B) {
  if constexpr (has_row_scales<codec_of_t<Block, T>>) {
    return B.scales();
  } else {
    (void)B;
    return nullptr;
  }
}

/// Where a decoding step's variant acts: `bound` binds row 0 (its query head and the group's
/// key/value head; row r is query head `bound.head + r`), `query` is the query's position and
/// `first_key` the position of the block's first key.
template <class V>
struct DecodeVariant {
  BoundVariant<V> bound;
  Index query = 0;
  Index first_key = 0;
  BoundVariant<V> row(Index r) const {
    BoundVariant<V> b = bound;
    b.head += r;
    return b;
  }
  /// The positions as a rule's (query 0 at `query`, key column 0 at `first_key`).
  template <class T>
  ScoreRule<T> place() const {
    ScoreRule<T> rule;
    rule.n = 1;
    rule.q_position = query;
    rule.k_position = first_key;
    return rule;
  }
};

/// The two steps of a variant on a decoding tile: its score (before the rule's softcap) and its
/// mask (after it).
enum class VariantStep { Score, Mask };

/// One step of the variant on rows [h0, h0 + rows) of a tile of scaled scores (key columns
/// [j0, j0 + cols)), row r at query head `h0 + r` of the group; nothing without a variant.
template <VariantStep step, class T, class V>
void decode_variant(const DecodeVariant<V>& variant, T* s, Index s_stride, Index h0, Index rows,
                    Index j0, Index cols) {
  constexpr bool acts = step == VariantStep::Score ? variant_scores_v<V> : variant_masks_v<V>;
  if constexpr (acts) {
    const ScoreRule<T> place = variant.template place<T>();
    for (Index r = 0; r < rows; ++r) {
      T* row = s + r * s_stride;
      if constexpr (step == VariantStep::Score) {
        variant_scores<T>(variant.row(h0 + r), place, row, s_stride, 0, 1, j0, cols);
      } else {
        variant_mask_tile<T>(variant.row(h0 + r), place, row, s_stride, 0, 1, j0, cols);
      }
    }
  } else {
    static_cast<void>(variant), static_cast<void>(s), static_cast<void>(s_stride);
    static_cast<void>(h0), static_cast<void>(rows), static_cast<void>(j0), static_cast<void>(cols);
  }
}

/// A decoding tile of `cols` keys: their key and value rows (`StridedRows` or `ListedRows`), the
/// int8 rows' scales (null for the other formats), and what the first head group asks for ahead
/// (`PrefetchRows`): this tile's value rows while it scores, the next tile's key rows while it
/// sums the values.
template <class T, class KRows, class VRows, class Ahead>
struct DecodeTile {
  KRows k;
  VRows v;
  const T* k_scales;
  const T* v_scales;
  Index cols;
  Ahead values_ahead, keys_ahead;
};

/// One tile for the heads [h0, h0 + G): scores, online-softmax update, values. The tile's keys
/// are keys [j0, j0 + cols) of the step's block (where the variant places them).
template <class T, std::size_t G, class KCodec, class VCodec, class KRows, class VRows, class Ahead,
          class Variant = NoVariant>
void decode_tile(Index h0, const DecodeTile<T, KRows, VRows, Ahead> tile, Index d_k, Index d_v,
                 Index j0, const ScoreRule<T>& rule, DecodeScratch<T>& scratch,
                 const DecodeVariant<Variant>& variant = {}) {
  constexpr Index lanes = decode_lanes<T>;
  constexpr Index chunk = 16 / Index(G) >= 4 ? 4 : 16 / Index(G);  // packets of output per pass
  const auto heads = std::make_index_sequence<G>();
  const Index cols = tile.cols;

  // 1. Scores of the tile (each key row streamed once from memory for the G heads).
  T* s = scratch.s.data() + h0 * scratch.s.outerStride();
  const Index s_stride = scratch.s.outerStride();
  const T* q = scratch.q_scaled.data() + h0 * scratch.q_scaled.outerStride();
  const Index q_stride = scratch.q_scaled.outerStride();
  const T* scales = tile.k_scales;
  // Only the first head group asks for rows ahead (later groups find them in the caches).
  const Ahead values_ahead = h0 == 0 ? tile.values_ahead : Ahead{};
  const Ahead keys_ahead = h0 == 0 ? tile.keys_ahead : Ahead{};
  Index done = 0;
#if defined(ATTN_X86_TARGETS)
  if constexpr (G == 4 && std::is_same_v<T, float> && std::is_same_v<KCodec, BFloat16Codec>) {
    if (scratch.bf16_scores) {
      done = decode_scores_bf16_4x4(scratch.q_bf16.data() + h0 * scratch.q_bf16.outerStride(),
                                    scratch.q_bf16.outerStride(), tile.k, cols, d_k, s, s_stride,
                                    values_ahead);
    }
  }
  if constexpr (G == 4 && std::is_same_v<T, float> && std::is_same_v<KCodec, Int8Codec>) {
    if (scratch.i8_scores) {
      done = decode_scores_i8_4x4(scratch.q_i8.data() + h0 * scratch.q_i8.outerStride(),
                                  scratch.q_i8.outerStride(), scratch.q_i8_scale.data() + h0,
                                  scratch.q_i8_bias.data() + h0, tile.k, scales, cols, d_k, s,
                                  s_stride, values_ahead);
    }
  }
#endif
#if defined(EIGEN_VECTORIZE_AVX512)
  // Stored (16- and 8-bit) keys only: the 4 x 4 blocks beat the key-by-key loop with stored keys
  // but not with float keys (chosen by measurement; see docs/benchmarks.md).
  if constexpr (G == 4 && std::is_same_v<T, float> && lanes == 16 &&
                !std::is_same_v<KCodec, SameCodec<T>>) {
    if (done == 0)
      done = decode_scores_4x4<KCodec>(q, q_stride, tile.k, scales, cols, d_k, s, s_stride,
                                       values_ahead);
  }
#endif
  if (done < cols) {
    decode_scores<T, KCodec>(heads, q, q_stride, tile.k.from(done),
                             scales ? scales + done : nullptr, cols - done, d_k, s + done, s_stride,
                             values_ahead.rest(done));
  }
  if constexpr (is_variant_v<Variant>) {
    decode_variant<VariantStep::Score>(variant, s, s_stride, h0, Index(G), j0, cols);
  }
  rule.apply_uniform(scratch.s.block(h0, 0, Index(G), cols));
  if constexpr (is_variant_v<Variant>) {
    decode_variant<VariantStep::Mask>(variant, s, s_stride, h0, Index(G), j0, cols);
  }

  // 2. Online softmax (detail/online_softmax.hpp); the running output is rescaled by alpha in
  //    step 3 (o' = alpha o + sum_j p_j V_j). Int8 values: p_j times the row's scale.
  OnlineSoftmax<T>& state = scratch.state;
  online_softmax_rows<T>(s, s_stride, Index(G), cols, state.m.data() + h0, state.l.data() + h0,
                         scratch.alpha.data() + h0);
  if constexpr (has_row_scales<VCodec>) {
    const Eigen::Map<const RowVector<T>> v_scales(tile.v_scales, cols);
    scratch.s.block(h0, 0, Index(G), cols).array().rowwise() *= v_scales.array();
  }

  // 3. Values, `chunk` packets of output columns at a time (the tile's value rows stay in L1
  //    between the passes over the columns).
  const T* alpha = scratch.alpha.data() + h0;
  T* o = state.o.data() + h0 * state.o.outerStride();
#if defined(ATTN_X86_TARGETS)
  if constexpr (G == 4 && std::is_same_v<T, float> && std::is_same_v<VCodec, Int8Codec>) {
    if (scratch.i16_values && decode_values_i16_4(s, s_stride, alpha, tile.v, cols, d_v, o,
                                                  state.o.outerStride(), keys_ahead)) {
      return;
    }
  }
#endif
  Index c0 = 0;
  for (; c0 + chunk * lanes <= d_v; c0 += chunk * lanes) {
    decode_values<T, VCodec, chunk>(heads, s, s_stride, alpha, tile.v.from(0, c0), cols, o + c0,
                                    state.o.outerStride(), c0 == 0 ? keys_ahead : Ahead{});
  }
  for (; c0 < d_v; c0 += lanes) {
    decode_values<T, VCodec, 1>(heads, s, s_stride, alpha, tile.v.from(0, c0), cols, o + c0,
                                state.o.outerStride(), Ahead{});
  }
}

/// `decode_tile`, never inlined into its caller: inlined into the loop over a paged block's tiles,
/// GCC 12 kept the score accumulators on the stack (a store per multiply-add), which made the
/// step about twice as slow as on contiguous rows.
template <class T, std::size_t G, class KCodec, class VCodec, class KRows, class VRows, class Ahead,
          class Variant>
EIGEN_DONT_INLINE void decode_tile_apart(Index h0, const DecodeTile<T, KRows, VRows, Ahead>& tile,
                                         Index d_k, Index d_v, Index j0, const ScoreRule<T>& rule,
                                         DecodeScratch<T>& scratch,
                                         const DecodeVariant<Variant>& variant) {
  decode_tile<T, G, KCodec, VCodec>(h0, tile, d_k, d_v, j0, rule, scratch, variant);
}

/// The tile of keys [j0, j0 + cols) of contiguous blocks K and V (Eigen blocks of T or
/// `StoredBlock`s), read where they are.
template <class T, class KBlock, class VBlock>
auto strided_tile(const KBlock& K, const VBlock& V, Index j0, Index cols) {
  using KBits = typename codec_of_t<KBlock, T>::Bits;
  using VBits = typename codec_of_t<VBlock, T>::Bits;
  const KBits* k = block_data(K) + j0 * K.outerStride();
  const VBits* v = block_data(V) + j0 * V.outerStride();
  const T* k_scales = block_scales<T>(K);
  const T* v_scales = block_scales<T>(V);
  return DecodeTile<T, StridedRows<KBits>, StridedRows<VBits>, PrefetchRows>{
      {k, K.outerStride()},
      {v, V.outerStride()},
      k_scales ? k_scales + j0 : nullptr,
      v_scales ? v_scales + j0 : nullptr,
      cols,
      prefetch_rows_of(v, V.outerStride(), V.cols(), cols),
      prefetch_rows_of(k + cols * K.outerStride(), K.outerStride(), K.cols(),
                       std::min(cols, K.rows() - (j0 + cols)))};
}

/// `decode_tile` on the tile of keys [j0, j0 + cols) of contiguous blocks K and V.
template <class T, std::size_t G, class KBlock, class VBlock, class Variant = NoVariant>
void decode_tile(Index h0, const KBlock& K, const VBlock& V, Index j0, Index cols,
                 const ScoreRule<T>& rule, DecodeScratch<T>& scratch,
                 const DecodeVariant<Variant>& variant = {}) {
  decode_tile<T, G, codec_of_t<KBlock, T>, codec_of_t<VBlock, T>>(
      h0, strided_tile<T>(K, V, j0, cols), K.cols(), V.cols(), j0, rule, scratch, variant);
}

/// The rows of a decoding step with a variant whose output is not finite, recomputed key by key
/// (`exact_row`) by the step's scale, softcap and sink, each row at its query head.
template <class T, class KBlock, class VBlock, class Variant>
void repair_decode_rows(ConstRef<T> q, const KBlock& K, const VBlock& V, const ScoreRule<T>& rule,
                        Eigen::Ref<Matrix<T>> o, T* lse, const DecodeVariant<Variant>& variant) {
  // One query against every key of the block, nothing else of the call's rule.
  ScoreRule<T> one = rule.uniform_part(1, K.rows());
  one.sink = rule.sink;
  one.q_position = variant.query;
  one.k_position = variant.first_key;
  Matrix<T> K_wide, V_wide;
  const auto widened = [](const auto& block, Matrix<T>& wide) -> ConstRef<T> {
    if constexpr (std::is_same_v<codec_of_t<std::decay_t<decltype(block)>, T>, SameCodec<T>>) {
      return block;
    } else {
      block.widen_into(wide);
      return wide;
    }
  };
  const ConstRef<T> K_rows = widened(K, K_wide);
  const ConstRef<T> V_rows = widened(V, V_wide);
  for (Index r = 0; r < o.rows(); ++r) {
    if (!std::isfinite(o.row(r).sum())) {
      exact_row<T>(q.middleRows(r, 1), K_rows, V_rows, one, 0, o.row(r), lse ? lse + r : nullptr,
                   variant.row(r));
    }
  }
}

/// Calls `f(G, h0)` for the query heads [0, g) in groups of G = 4, then 2, then 1 (G an
/// `std::integral_constant`), the groups `decode_tile` takes.
template <class F>
void for_head_groups(Index g, const F& f) {
  Index h0 = 0;
  for (; h0 + 4 <= g; h0 += 4) f(std::integral_constant<std::size_t, 4>(), h0);
  for (; h0 + 2 <= g; h0 += 2) f(std::integral_constant<std::size_t, 2>(), h0);
  for (; h0 < g; ++h0) f(std::integral_constant<std::size_t, 1>(), h0);
}

/// The tiles of a decoding step of g query heads over paged rows (`PagedRows`), read where their
/// pages keep them: a tile whose rows are in one page, and the next tile's too, through a stride,
/// as contiguous blocks are read; any other through its rows' addresses (`ListedRows`, slower:
/// see docs/benchmarks.md#many-sequences-at-once). The tiles, and so the bits, are those of the
/// same rows stored contiguously.
template <class T, class Codec, class Variant>
void decode_paged_tiles(Index g, const PagedRows<Codec, T>& K, const PagedRows<Codec, T>& V,
                        const ScoreRule<T>& rule, DecodeScratch<T>& scratch,
                        const DecodeVariant<Variant>& variant) {
  constexpr Index tile = 64;
  using Bits = typename Codec::Bits;
  const Index m = K.rows();
  const Index k_bytes = K.cols() * Index(sizeof(Bits));
  const Index v_bytes = V.cols() * Index(sizeof(Bits));
  const auto scales = [](const T* s) { return has_row_scales<Codec> ? s : nullptr; };
  for (Index j0 = 0; j0 < m; j0 += tile) {
    const Index cols = std::min(tile, m - j0);
    const Index next = std::min(tile, m - j0 - cols);
    // K and V share their pages: the same rows are in one page in both.
    if (K.in_one_page(j0, cols) && K.in_one_page(j0 + cols, next)) {
      const Bits* k = K.row_at(j0);
      const Bits* v = V.row_at(j0);
      const DecodeTile<T, StridedRows<Bits>, StridedRows<Bits>, PrefetchRows> strided{
          {k, K.cols()},
          {v, V.cols()},
          scales(K.scale_at(j0)),
          scales(V.scale_at(j0)),
          cols,
          prefetch_rows_of(v, V.cols(), V.cols(), cols),
          next ? prefetch_rows_of(K.row_at(j0 + cols), K.cols(), K.cols(), next) : PrefetchRows{}};
      for_head_groups(g, [&](auto G, Index h0) {
        decode_tile_apart<T, decltype(G)::value, Codec, Codec>(h0, strided, K.cols(), V.cols(), j0,
                                                               rule, scratch, variant);
      });
      continue;
    }
    K.addresses(j0, cols, scratch.k_at[0], scratch.k_scales[0]);
    K.addresses(j0 + cols, next, scratch.k_at[1], scratch.k_scales[1]);
    V.addresses(j0, cols, scratch.v_at, scratch.v_scales);
    const DecodeTile<T, ListedRows<Bits>, ListedRows<Bits>, ListedPrefetch> listed{
        {scratch.k_at[0]},
        {scratch.v_at},
        scales(scratch.k_scales[0]),
        scales(scratch.v_scales),
        cols,
        ListedPrefetch{scratch.v_at, v_bytes, cols},
        ListedPrefetch{scratch.k_at[1], k_bytes, next}};
    for_head_groups(g, [&](auto G, Index h0) {
      decode_tile_apart<T, decltype(G)::value, Codec, Codec>(h0, listed, K.cols(), V.cols(), j0,
                                                             rule, scratch, variant);
    });
  }
}

/// Whether `decode_kernel` takes its SIMD path: widths that are whole packets.
template <class T>
bool decode_vectorised(Index d_k, Index d_v) {
  return d_k % decode_lanes<T> == 0 && d_v % decode_lanes<T> == 0;
}

/// One decoding step of the g query heads of a group over their key/value head, the keys and
/// values in any stored format (Eigen blocks of T, or `StoredBlock`s of detail/stored.hpp).
/// Shape contract: q g x d_k (unscaled), K m x d_k, V m x d_v, o g x d_v, lse (optional) g
/// entries; every row of K is visible to every query (the caller passes the visible range). Of
/// the rule only the scale, softcap and sink are used. Passes, per tile of 64 keys and per 4
/// (then 2, 1) query heads: scores (`decode_scores`), the online-softmax update, values
/// (`decode_values`); finally o / l, guarded. Widths that are not whole packets go through
/// Eigen's lazy products instead (stored tiles widened first). With a variant, its score and mask
/// act on every tile (the keys it forbids get weight 0), and a row that comes out not finite is
/// recomputed key by key (`exact_row`), so a forbidden key's NaN never reaches it.
template <class T, class KBlock, class VBlock, class Variant = NoVariant>
void decode_blocks(ConstRef<T> q, const KBlock& K, const VBlock& V, const ScoreRule<T>& rule,
                   DecodeScratch<T>& scratch, Eigen::Ref<Matrix<T>> o, T* lse,
                   const DecodeVariant<Variant>& variant = {}) {
  constexpr Index tile = 64;
  const Index g = q.rows();
  scratch.q_scaled.noalias() = rule.scale * q;
  scratch.bf16_scores = false;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<codec_of_t<KBlock, T>, BFloat16Codec>) {
    scratch.bf16_scores =
        K.cols() % 32 == 0 && g >= 4 && rule.reduced_arithmetic && bfloat16_arithmetic_available();
    if (scratch.bf16_scores) {
      // Every key sees the rounded queries, also the few the float path does (a tile's last
      // cols % 4).
      scratch.q_bf16 = scratch.q_scaled.template cast<Eigen::bfloat16>();
      scratch.q_scaled = scratch.q_bf16.template cast<T>();
    }
  }
  scratch.i8_scores = false;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<codec_of_t<KBlock, T>, Int8Codec>) {
    if (K.cols() % 32 == 0 && K.cols() <= 8192 && g >= 4 && rule.reduced_arithmetic &&
        int8_arithmetic_available()) {
      // Each query head's largest magnitude, NaN if the head has one (`largest_magnitude`,
      // vectorised: a check of every entry by `allFinite` was a visible part of a short step; see
      // docs/benchmarks.md). Queries that are not all finite take the float path, which keeps
      // the NaN rule.
      Vector<T>& scales = scratch.q_i8_scale;
      scales.resize(g);
      for (Index h = 0; h < g; ++h) {
        scales(h) = largest_magnitude(scratch.q_scaled.row(h).data(), K.cols());
      }
      scratch.i8_scores = scales.allFinite();
      if (scratch.i8_scores) {
        // Each query head in 8 bits with its own scale (largest / 127), to nearest (`rint`, ties
        // to even), as the keys are stored; every key sees the rounded queries, also the few the
        // float path does (a tile's last cols % 4). Clamped: where largest / 127 is subnormal it
        // is rounded, and largest / scale can pass 127 (a head whose largest entry is 2e-43
        // gives 143, which would not fit in 8 bits); where it is 0, the head is all but 0.
        scratch.q_i8.resize(g, K.cols());
        scratch.q_i8_bias.resize(g);
        for (Index h = 0; h < g; ++h) {
          const T scale = scales(h) / T(127) > T(0) ? scales(h) / T(127) : T(1);
          scales(h) = scale;
          const auto rounded =
              (scratch.q_scaled.row(h).array() / scale).rint().cwiseMax(T(-127)).cwiseMin(T(127));
          scratch.q_i8.row(h) = rounded.template cast<std::int8_t>();
          scratch.q_i8_bias(h) = 128 * scratch.q_i8.row(h).template cast<std::int32_t>().sum();
          scratch.q_scaled.row(h).array() = rounded * scale;
        }
      }
    }
  }
  scratch.i16_values = false;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<codec_of_t<VBlock, T>, Int8Codec>) {
    scratch.i16_values =
        V.cols() % 32 == 0 && g >= 4 && rule.reduced_arithmetic && int8_arithmetic_available();
  }
  scratch.state.start(g, V.cols(), rule.sink);
  scratch.alpha.resize(g);
  scratch.s.resize(g, tile);
  const bool vectorised = decode_vectorised<T>(K.cols(), V.cols());
  bool in_place = false;  // paged tiles read where they are (below)
  // The tile of keys [j0, j0 + cols) of the blocks Kb and Vb, `at` placing the variant.
  const auto run_tile = [&](const auto& Kb, const auto& Vb, Index j0, Index cols,
                            const DecodeVariant<Variant>& at) {
    if (vectorised) {
      Index h0 = 0;
      for (; h0 + 4 <= g; h0 += 4) decode_tile<T, 4>(h0, Kb, Vb, j0, cols, rule, scratch, at);
      for (; h0 + 2 <= g; h0 += 2) decode_tile<T, 2>(h0, Kb, Vb, j0, cols, rule, scratch, at);
      for (; h0 < g; ++h0) decode_tile<T, 1>(h0, Kb, Vb, j0, cols, rule, scratch, at);
      return;
    }
    Eigen::Ref<Matrix<T>> s = scratch.s.leftCols(cols);
    const auto scores_then = [&](const auto& values) {
      if constexpr (is_variant_v<Variant>) {
        decode_variant<VariantStep::Score>(at, s.data(), s.outerStride(), 0, g, j0, cols);
      }
      rule.apply_uniform(s);
      if constexpr (is_variant_v<Variant>) {
        decode_variant<VariantStep::Mask>(at, s.data(), s.outerStride(), 0, g, j0, cols);
      }
      scratch.state.step(s, values);
    };
    if constexpr (std::is_same_v<codec_of_t<std::decay_t<decltype(Kb)>, T>, SameCodec<T>>) {
      s.noalias() = scratch.q_scaled.lazyProduct(Kb.middleRows(j0, cols).transpose());
      scores_then(Vb.middleRows(j0, cols));
    } else {
      Kb.middleRows(j0, cols).widen_into(scratch.k_wide);
      Vb.middleRows(j0, cols).widen_into(scratch.v_wide);
      s.noalias() = scratch.q_scaled.lazyProduct(scratch.k_wide.transpose());
      scores_then(scratch.v_wide);
    }
  };
  if constexpr (is_paged_v<KBlock>) {
    if (vectorised) {
      decode_paged_tiles<T>(g, K, V, rule, scratch, variant);
      in_place = true;
    }
  }
  for (Index j0 = 0; j0 < K.rows() && !in_place; j0 += tile) {
    const Index cols = std::min(tile, K.rows() - j0);
    if constexpr (is_paged_v<KBlock>) {
      // The tile's rows gathered from their pages: the same tile, contiguous. The next tile's
      // rows are asked for first (the pages break the stream the hardware prefetcher follows).
      DecodeVariant<Variant> at = variant;
      at.first_key += j0;
      const auto Kt = gathered(K, j0, cols, scratch.k_tile);
      const auto Vt = gathered(V, j0, cols, scratch.v_tile);
      prefetch_paged(K, j0 + cols, std::min(tile, K.rows() - j0 - cols));
      prefetch_paged(V, j0 + cols, std::min(tile, V.rows() - j0 - cols));
      run_tile(Kt, Vt, 0, cols, at);
    } else {
      run_tile(K, V, j0, cols, variant);
    }
  }
  scratch.state.finish(o, lse);
  if constexpr (variant_masks_v<Variant>) {
    if (!std::isfinite(o.sum())) repair_decode_rows<T>(q, K, V, rule, o, lse, variant);
  }
}

/// `decode_blocks` over keys and values of T.
template <class T>
void decode_kernel(ConstRef<T> q, ConstRef<T> K, ConstRef<T> V, const ScoreRule<T>& rule,
                   DecodeScratch<T>& scratch, Eigen::Ref<Matrix<T>> o, T* lse) {
  decode_blocks<T>(q, K, V, rule, scratch, o, lse);
}

}  // namespace detail
}  // namespace attn

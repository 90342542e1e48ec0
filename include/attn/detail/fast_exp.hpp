#pragma once
/// \file detail/fast_exp.hpp
/// The vectorised exp of the softmax, for the shifted logits x = s - max <= 0 of float rows.
///
/// Method: exp(x) = 2^k exp(r) with k = round(x / ln 2) and r = x - k ln 2 in [-ln2/2, ln2/2]
/// (ln 2 split in two constants, Cody & Waite, so that k ln 2 is subtracted without rounding),
/// exp(r) by Cephes' degree-7 minimax polynomial for expf (the coefficients are S. Moshier's), 2^k
/// by writing k + 127 into the exponent field (by `vscalefps` with AVX-512: the same bits).
///
/// Error (tests/softmax_test.cpp, `FastExp`, checked against `std::exp` on every 61st float of
/// [-103.98, 0]): at most 1 unit in the last place for x in [-87.33, 0], where exp(x) is a normal
/// float. Below that, the result is exactly `std::exp`'s: 0 for x < -103.98 and for -inf (the exact
/// underflow that gives a masked key a weight of exactly 0), and a packet that holds any x whose
/// exp would be subnormal is computed by `std::exp` lane by lane. NaN gives NaN (the NaN rule).

#include <cmath>
#include <limits>
#include <type_traits>

#include "../types.hpp"

namespace attn {
namespace detail {

/// Whether `exp_shifted_sum` has a vectorised form for T on the SIMD set Eigen was compiled for
/// (float, with an integer packet of the same width).
template <class T>
struct FastExp : Simd<T> {
  using Simd<T>::lanes;
  static constexpr bool vectorised =
      std::is_same_v<T, float> && (lanes == 4 || lanes == 8 || lanes == 16);
};

/// The integer packet of a float packet of `Lanes` lanes (Eigen 3.4 names it for SSE and AVX only).
template <int Lanes>
struct IntegerPacket;
#if defined(EIGEN_VECTORIZE_SSE2) || defined(EIGEN_VECTORIZE_NEON)
template <>
struct IntegerPacket<4> {
  using type = Eigen::internal::Packet4i;
};
#endif
#if defined(EIGEN_VECTORIZE_AVX)
template <>
struct IntegerPacket<8> {
  using type = Eigen::internal::Packet8i;
};
#endif
#if defined(EIGEN_VECTORIZE_AVX512)
template <>
struct IntegerPacket<16> {
  using type = Eigen::internal::Packet16i;
};
#endif

/// Constants of the method (see the file comment).
struct ExpConstants {
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f;        ///< 8 significant bits: k ln2_hi is exact
  static constexpr float ln2_lo = -2.12194440e-4f;     ///< ln 2 - ln2_hi
  static constexpr float round = 12582912.0f;          ///< 1.5 * 2^23: adding it rounds to integer
  static constexpr float normal_floor = -87.3365479f;  ///< ln(FLT_MIN): below, exp is subnormal
  static constexpr float zero_below = -103.972778f;    ///< ln(2^-150): below, std::exp gives 0
  static constexpr float p[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

/// exp(x) of a packet of x in [ln(FLT_MIN), 0] (or NaN), whose exp is a normal float: see the
/// file comment for its error. 2^k by `vscalefps` with AVX-512 (one instruction for the four of the
/// exponent field; the same bits, both being one rounding of y 2^k).
template <class Packet>
EIGEN_STRONG_INLINE Packet exp_normal_range(const Packet& x) {
  using namespace Eigen::internal;
  using C = ExpConstants;
  // k = round(x log2 e), by the 1.5 * 2^23 trick (exact for |k| < 2^22).
  const Packet k =
      psub(pmadd(x, pset1<Packet>(C::log2e), pset1<Packet>(C::round)), pset1<Packet>(C::round));
  Packet r = pmadd(k, pset1<Packet>(-C::ln2_hi), x);
  r = pmadd(k, pset1<Packet>(-C::ln2_lo), r);
  // exp(r) = 1 + r + r^2 (p5 + r (p4 + r (p3 + r (p2 + r (p1 + r p0))))).
  Packet y = pmadd(pset1<Packet>(C::p[0]), r, pset1<Packet>(C::p[1]));
  y = pmadd(y, r, pset1<Packet>(C::p[2]));
  y = pmadd(y, r, pset1<Packet>(C::p[3]));
  y = pmadd(y, r, pset1<Packet>(C::p[4]));
  y = pmadd(y, r, pset1<Packet>(C::p[5]));
  y = pmadd(y, pmul(r, r), padd(r, pset1<Packet>(1.0f)));
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (unpacket_traits<Packet>::size == 16) return _mm512_scalef_ps(y, k);  // Packet16f
#endif
  // 2^k for k >= -126, from the exponent field.
  using PacketI = typename IntegerPacket<unpacket_traits<Packet>::size>::type;
  const PacketI biased = padd(pcast<Packet, PacketI>(k), pset1<PacketI>(127));
  return pmul(y, preinterpret<Packet>(plogical_shift_left<23>(biased)));
}

/// exp(x) of a packet of x <= 0 (or NaN): `exp_normal_range`, and 0 below the normal range (x < lo
/// is false for NaN, which stays NaN). See the file comment for its error.
template <class Packet>
EIGEN_STRONG_INLINE Packet exp_nonpositive(const Packet& x) {
  using namespace Eigen::internal;
  return pandnot(exp_normal_range(x), pcmp_lt(x, pset1<Packet>(ExpConstants::normal_floor)));
}

/// Whether a packet holds an argument whose exp is subnormal (std::exp must then decide).
template <class Packet>
EIGEN_STRONG_INLINE bool exp_has_subnormal(const Packet& x) {
  using namespace Eigen::internal;
  using C = ExpConstants;
  return predux_any(
      pand(pcmp_lt(x, pset1<Packet>(C::normal_floor)), pcmp_le(pset1<Packet>(C::zero_below), x)));
}

/// The largest of s[0, size) for float rows, in packets (a NaN may be skipped, as by Eigen's
/// maxCoeff: `tile_max` decides what a NaN means); -inf for an empty row. Written out because
/// Eigen's maxCoeff is slower on the tiled kernel's short rows (see docs/benchmarks.md). With
/// `min`, also the smallest (+inf for an empty row; a NaN may be skipped) in the same pass.
template <class T>
T packet_max(const T* s, Index size, T* min = nullptr) {
  using Packet = typename FastExp<T>::Packet;
  using namespace Eigen::internal;
  constexpr Index lanes = FastExp<T>::lanes;
  constexpr T inf = std::numeric_limits<T>::infinity();
  const auto pass = [&](auto with_min) {
    Packet max0 = pset1<Packet>(-inf);
    Packet max1 = max0;
    Packet min0 = pset1<Packet>(inf);
    Packet min1 = min0;
    Index j = 0;
    for (; j + 2 * lanes <= size; j += 2 * lanes) {
      const Packet a = ploadu<Packet>(s + j);
      const Packet b = ploadu<Packet>(s + j + lanes);
      max0 = pmax(max0, a);
      max1 = pmax(max1, b);
      if constexpr (decltype(with_min)::value) {
        min0 = pmin(min0, a);
        min1 = pmin(min1, b);
      }
    }
    for (; j + lanes <= size; j += lanes) {
      const Packet a = ploadu<Packet>(s + j);
      max0 = pmax(max0, a);
      if constexpr (decltype(with_min)::value) min0 = pmin(min0, a);
    }
    T max = predux_max(pmax(max0, max1));
    for (; j < size; ++j) max = s[j] > max ? s[j] : max;
    if constexpr (decltype(with_min)::value) {
      T low = predux_min(pmin(min0, min1));
      for (j = size / lanes * lanes; j < size; ++j) low = s[j] < low ? s[j] : low;
      *min = low;
    }
    return max;
  };
  return min ? pass(std::true_type()) : pass(std::false_type());
}

/// The end of `exp_shifted_sum`'s checked pass when it left packets for later: the packets of
/// [start, end) that still hold a shifted logit below 0 (a deferred packet has one whose exp is
/// subnormal; an exponential is never below 0) get `std::exp` in every lane, as the pass would have
/// given them, and the sums sum0 and sum1 of the packets before `start` take every packet of
/// [start, end) in the pass's order (pairs into sum0 and sum1, a last single one into sum0): the
/// bits the pass gives when it computes them in place. Out of line: the pass then calls nothing.
template <class T, class Packet>
EIGEN_DONT_INLINE T exp_deferred_packets(T* s, Index start, Index end, Packet sum0, Packet sum1) {
  using namespace Eigen::internal;
  constexpr Index lanes = unpacket_traits<Packet>::size;
  for (Index at = start; at < end; at += lanes) {
    if (predux_any(pcmp_lt(ploadu<Packet>(s + at), pzero(sum0)))) {
      for (Index t = at; t < at + lanes; ++t) s[t] = std::exp(s[t]);
    }
  }
  Index j = start;
  for (; j + 2 * lanes <= end; j += 2 * lanes) {
    sum0 = padd(sum0, ploadu<Packet>(s + j));
    sum1 = padd(sum1, ploadu<Packet>(s + j + lanes));
  }
  for (; j < end; j += lanes) sum0 = padd(sum0, ploadu<Packet>(s + j));
  return predux(padd(sum0, sum1));
}

/// `s[j] -> exp(s[j] - max)` for j in [0, size), in place, for a finite max (float rows vectorised).
/// `normal`: the caller knows that every s[j] - max is in [ln(FLT_MIN), 0] (or NaN), so that no
/// packet needs the checks below the normal range (the same bits), which shortens the exp pass
/// (see docs/benchmarks.md).
/// \returns the sum of the new entries (in packet-lane order, then the tail).
template <class T>
T exp_shifted_sum(T* s, Index size, T max, bool normal = false) {
  if constexpr (FastExp<T>::vectorised) {
    using Packet = typename FastExp<T>::Packet;
    using namespace Eigen::internal;
    constexpr Index lanes = FastExp<T>::lanes;
    const Packet shift = pset1<Packet>(max);
    Packet sum0 = pset1<Packet>(T(0));
    Packet sum1 = pset1<Packet>(T(0));
    Index j = 0;
    if (normal) {
      for (; j + 2 * lanes <= size; j += 2 * lanes) {
        const Packet e0 = exp_normal_range(psub(ploadu<Packet>(s + j), shift));
        const Packet e1 = exp_normal_range(psub(ploadu<Packet>(s + j + lanes), shift));
        pstoreu(s + j, e0);
        pstoreu(s + j + lanes, e1);
        sum0 = padd(sum0, e0);
        sum1 = padd(sum1, e1);
      }
    }
    // A packet that holds an x whose exp is subnormal keeps x for `exp_deferred_packets`: no
    // call to std::exp in this loop, whose call made GCC 12 keep the sums and the polynomial's
    // constants in memory in both loops (a load of each constant per packet, and each sum carried
    // from one packet to the next through a store and a load); see docs/benchmarks.md.
    bool deferred = false;
    const auto one = [&](Index at, Packet& sum) {
      const Packet x = psub(ploadu<Packet>(s + at), shift);
      if (EIGEN_PREDICT_FALSE(exp_has_subnormal(x))) {
        pstoreu(s + at, x);
        deferred = true;
        return;
      }
      const Packet e = exp_nonpositive(x);
      pstoreu(s + at, e);
      sum = padd(sum, e);
    };
    const Index start = j;
    const Packet sum0_start = sum0;
    const Packet sum1_start = sum1;
    for (; j + 2 * lanes <= size; j += 2 * lanes) {
      one(j, sum0);
      one(j + lanes, sum1);
    }
    for (; j + lanes <= size; j += lanes) one(j, sum0);
    T total = EIGEN_PREDICT_FALSE(deferred)
                  ? exp_deferred_packets<T>(s, start, j, sum0_start, sum1_start)
                  : predux(padd(sum0, sum1));
    for (; j < size; ++j) total += (s[j] = std::exp(s[j] - max));
    return total;
  } else {
    T total = T(0);
    for (Index j = 0; j < size; ++j) total += (s[j] = std::exp(s[j] - max));
    return total;
  }
}

}  // namespace detail
}  // namespace attn

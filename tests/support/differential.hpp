#pragma once
/// \file differential.hpp
/// The differential test of the whole attention core (issue #10, item 4), shared by the seeded
/// GoogleTest (tests/differential_test.cpp) and the libFuzzer target (tests/fuzz/attention_fuzz.cpp).
///
/// 1. A case generator driven by a byte stream (`ByteSource`): the bytes choose the kind of case,
///    the shapes (0, 1, tile edges), every option, where special values (NaN, +-inf, +-1e30,
///    denormals, 0, +-1e4) go; eight of them seed the generator of the bulk values. The same bytes
///    always give the same case, so a fuzzer input and a gtest seed are both reproducers.
/// 2. An independent reference (`reference`): API.md's rules as naive loops in long double. It
///    calls nothing from `attn`. For every output entry it states what the library must give:
///    a value within a tolerance, exactly zero, NaN, an infinity, or anything (`Kind`).
/// 3. The checks: every forward path (single head, several heads incl. GQA, KVCache token by
///    token and chunked, MultiHeadAttention) against the reference, and the paths against each
///    other where the contract says they agree bit for bit (thread counts, hot-path overloads,
///    log-sum-exp overload). A single-head case also draws a ready variant (variant.hpp) or a
///    composition of them, which the reference folds into its mask, bias or softcap, and runs the
///    paths that take one (the tiled kernel, the weights, the decoding kernel through
///    attention_heads).
/// 4. A shrinker that reduces a failing single-head case and prints it as a C++ snippet.
///
/// The contract, as the reference reads it (API.md, Conventions):
/// - Query i stands at key position i + offset (`query_offset`, else m - n for BottomRight, else 0).
///   It may attend key j iff: causal (either alignment) -> j <= i + offset; window w ->
///   j >= i + offset - w; window_right r -> j <= i + offset + r; mask(i, j); bias(i, j) != -inf
///   (a -inf bias acts as a mask: such a key is not attended, whatever K and V hold there).
/// - Logits: scale q_i.k_j -> softcap c tanh(s / c) -> + bias -> - slope |i + offset - j|.
/// - A row with no attendable key: zero output, zero weights, log-sum-exp -inf (a sink alone gives
///   no value).
/// - A NaN or +inf logit among the attendable keys (NaN in q_i, k_j, bias, inf - inf, or a +inf
///   score as in PyTorch, where exp(inf - inf) is NaN): every output entry and every weight of an
///   attendable key is NaN, and so is the log-sum-exp.
/// - A NaN value v_jc of an attendable key (with a finite logit): output entry c is NaN; both +inf
///   and -inf there: NaN; only one sign: that infinity (or NaN, when the library's weight
///   underflowed to 0 and 0 * inf became NaN). The other entries of such a row: the value or NaN.
/// - Keys the row may not attend never reach it: a NaN or inf there changes nothing.
/// - Not specified (anything accepted): a row whose every logit is a computed -inf (0 / 0: zeros
///   and NaN are both defensible), an output entry whose value column holds a non-finite value at
///   a key of computed logit -inf (0 * inf), and a row whose scores may overflow the scalar type
///   while the long-double reference stays finite ("risky": an input 1e30 times another 1e30 is
///   1e60 in long double but inf in float).
///
/// Tolerances (sound bounds from the rounding of T, derived in `reference`): each logit carries an
/// absolute error bound e_j of what T's arithmetic may give: (d + 2) u sum_k |scale q_ik k_jk| for
/// the dot product, + 2 u |s| (the default scale's rounding), softcap: min(e, 2c) + 8 u c, bias and
/// ALiBi: + u |result| each; the softmax adds 2 u |x_j - max| + 4 u (subtraction, exp, the flash
/// rescales). The perturbed softmax is bounded exactly: with log-weight perturbations of at most
/// e_j, weight j lies in [w_j e^-e_j / U, min(1, w_j e^e_j / L)], L = sum_k w_k e^-e_k and
/// U = sum_k w_k e^e_k (the sink included), which stays sound for logits like 1e30 + bias where a
/// first-order bound would not. Sums, the flash rescales and the division add g = (4 m + 32) u
/// relatively. Output entry c: 2 (sum_j dw_j |v_jc| + g sum_j (w_j + dw_j) |v_jc|) plus an
/// absolute floor 4 (m + 2) FLT_MIN (1 + max_j |v_jc|) for weights that fall below the normal
/// range. For float rows of ordinary data this is a few 1e-5 of sum_j w_j |v_jc|, for double a
/// few 1e-14.

#include <algorithm>
#include <attn/attn.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace attn_diff {

using attn::Index;
using LD = long double;
using LMatrix = Eigen::Matrix<LD, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Table = Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

inline constexpr LD kInf = std::numeric_limits<LD>::infinity();

template <class S>
LD ld(S value) {
  return static_cast<LD>(value);
}

// ================================================================================================
// Bytes
// ================================================================================================

/// The generator's only source of decisions. Past the end it reads zeros (the smallest choices),
/// so every byte string, including the empty one, is a valid case.
class ByteSource {
 public:
  ByteSource(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : std::uint8_t{0}; }
  /// A number in [0, count), count >= 1 (two bytes).
  Index below(Index count) {
    const unsigned value = (unsigned{byte()} << 8) | unsigned{byte()};
    return count <= 1 ? 0 : static_cast<Index>(value % static_cast<unsigned>(count));
  }
  /// A number in [lo, hi].
  Index range(Index lo, Index hi) { return lo + below(hi - lo + 1); }
  /// True with probability per256 / 256.
  bool chance(unsigned per256) { return unsigned{byte()} < per256; }
  template <class V>
  V pick(std::initializer_list<V> values) {
    return *(values.begin() + below(static_cast<Index>(values.size())));
  }
  std::uint64_t seed() {
    std::uint64_t s = 0;
    for (int k = 0; k < 8; ++k) s = (s << 8) | byte();
    return s;
  }
  std::size_t used() const { return pos_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// Bulk values (splitmix64: the same numbers on every platform).
class Bulk {
 public:
  explicit Bulk(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Approximately normal (sum of four uniforms, variance 1).
  double normal() {
    return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508075688772;
  }
  Index below(Index count) {
    return count <= 1 ? 0 : static_cast<Index>(next() % static_cast<std::uint64_t>(count));
  }

 private:
  std::uint64_t state_;
};

// ================================================================================================
// Values
// ================================================================================================

enum class Special : std::uint8_t {
  NaN,
  PosInf,
  NegInf,
  Huge,      // 1e30
  NegHuge,   // -1e30
  Denormal,  // a subnormal of T
  NegDenormal,
  Zero,
  Big,  // 1e4
  NegBig,
  Count
};

template <class T>
T special_value(Special s) {
  switch (s) {
    case Special::NaN:
      return std::numeric_limits<T>::quiet_NaN();
    case Special::PosInf:
      return std::numeric_limits<T>::infinity();
    case Special::NegInf:
      return -std::numeric_limits<T>::infinity();
    case Special::Huge:
      return T(1e30);
    case Special::NegHuge:
      return T(-1e30);
    case Special::Denormal:
      return std::numeric_limits<T>::denorm_min() * T(3);
    case Special::NegDenormal:
      return -std::numeric_limits<T>::min() / T(7);
    case Special::Zero:
      return T(0);
    case Special::Big:
      return T(1e4);
    case Special::NegBig:
      return T(-1e4);
    default:
      return T(0);
  }
}

/// A value printed so that it reads back exactly (a C++ literal of T).
template <class T>
std::string literal(T v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream out;
  out.precision(std::numeric_limits<T>::max_digits10);
  out << v;
  std::string s = out.str();
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

inline std::string show(LD v) {
  std::ostringstream out;
  out.precision(std::numeric_limits<LD>::max_digits10 - 2);
  out << v;
  return out.str();
}

inline const char* causal_name(attn::Causal c) {
  switch (c) {
    case attn::Causal::None:
      return "None";
    case attn::Causal::TopLeft:
      return "TopLeft";
    default:
      return "BottomRight";
  }
}

// ================================================================================================
// The contract's rules (written from API.md, nothing from attn)
// ================================================================================================

/// The key position of query 0.
template <class T>
Index query_position_offset(const attn::AttentionOptions<T>& o, Index n, Index m) {
  if (o.query_offset) return *o.query_offset;
  return o.causal == attn::Causal::BottomRight ? m - n : 0;
}

/// Whether the causal, window and window_right rules let query i see key j.
template <class T>
bool rules_allow(const attn::AttentionOptions<T>& o, Index i, Index j, Index n, Index m) {
  const Index p = i + query_position_offset(o, n, m);
  if (o.causal != attn::Causal::None && j > p) return false;
  if (o.window && j < p - *o.window) return false;
  if (o.window_right && j > p + *o.window_right) return false;
  return true;
}

/// Precision of the scalar under test.
struct Precision {
  LD u;           ///< unit roundoff, eps / 2
  LD normal_min;  ///< smallest normal
  LD tiny;        ///< smallest subnormal
  LD max;         ///< largest finite
  int digits10;
};

template <class T>
Precision precision_of() {
  return {ld(std::numeric_limits<T>::epsilon()) / 2, ld(std::numeric_limits<T>::min()),
          ld(std::numeric_limits<T>::denorm_min()), ld(std::numeric_limits<T>::max()),
          std::numeric_limits<T>::max_digits10};
}

/// One attention problem for the reference, in long double.
struct RefProblem {
  LMatrix Q, K, V;     ///< n x d, m x d, m x d_v, the library's inputs exactly
  LMatrix dQ, dK, dV;  ///< absolute uncertainty of those inputs (empty = exact); MultiHeadAttention
  Table allowed;       ///< n x m: causal, windows, mask, padding (the bias' -inf is added here)
  std::optional<LMatrix> bias;
  std::optional<LD> scale;  ///< unset: 1 / sqrt(d)
  std::optional<LD> softcap, alibi_slope, sink;
  Index offset = 0;  ///< key position of query 0 (ALiBi distances)
  Precision prec{};
};

/// What the library must give for one entry.
enum class Kind : std::uint8_t {
  Value,       ///< finite, |got - value| <= tol
  ValueOrNaN,  ///< as Value, or NaN (another entry of the row is NaN-required)
  Exact,       ///< exactly value (0, or an infinity; 0 and -0 alike)
  ExactOr,     ///< exactly value or exactly alt (where the contract reads both ways)
  NaN,         ///< NaN
  Inf,         ///< the infinity `value`, or NaN
  Any,         ///< not specified
};

struct Expect {
  Kind kind = Kind::Any;
  LD value = 0;
  LD tol = 0;
  LD alt = 0;  ///< ExactOr only
};

inline std::string describe(const Expect& e) {
  switch (e.kind) {
    case Kind::Value:
      return show(e.value) + " +- " + show(e.tol);
    case Kind::ValueOrNaN:
      return show(e.value) + " +- " + show(e.tol) + " (or NaN)";
    case Kind::Exact:
      return "exactly " + show(e.value);
    case Kind::ExactOr:
      return "exactly " + show(e.value) + " or " + show(e.alt);
    case Kind::NaN:
      return "NaN";
    case Kind::Inf:
      return show(e.value) + " (or NaN)";
    default:
      return "anything";
  }
}

inline bool satisfies(const Expect& e, LD got) {
  switch (e.kind) {
    case Kind::Value:
      return std::isfinite(got) && std::fabs(got - e.value) <= e.tol;
    case Kind::ValueOrNaN:
      return std::isnan(got) || (std::isfinite(got) && std::fabs(got - e.value) <= e.tol);
    case Kind::Exact:
      return got == e.value;
    case Kind::ExactOr:
      return got == e.value || got == e.alt;
    case Kind::NaN:
      return std::isnan(got);
    case Kind::Inf:
      return std::isnan(got) || got == e.value;
    default:
      return true;
  }
}

/// Why a row expects what it does (printed with failures).
enum class RowClass : std::uint8_t { Empty, Regular, NaNRow, AllMinusInf, Risky };

inline const char* row_class_name(RowClass c) {
  switch (c) {
    case RowClass::Empty:
      return "row attends no key";
    case RowClass::Regular:
      return "regular row";
    case RowClass::NaNRow:
      return "row with a NaN or +inf logit";
    case RowClass::AllMinusInf:
      return "every logit a computed -inf";
    default:
      return "row may overflow T (unchecked)";
  }
}

/// What the checks have seen (printed by the gtest with ATTN_DIFF_STATS=1): evidence that the
/// generator reaches every row class and expectation kind.
struct Stats {
  std::size_t rows[5] = {};     ///< reference rows by RowClass
  std::size_t entries[8] = {};  ///< compared entries by Kind
  std::size_t cases[4] = {};    ///< cases by CaseKind
  std::size_t specials = 0;     ///< special values placed
};
inline Stats& stats() {
  static Stats s;
  return s;
}

struct Reference {
  Index n = 0, m = 0, dv = 0;
  std::vector<Expect> out;      ///< n x d_v
  std::vector<Expect> weights;  ///< n x m
  std::vector<Expect> lse;      ///< n
  std::vector<Expect> raw;      ///< n x m, Q K^T
  std::vector<Expect> scaled;   ///< n x m, scale Q K^T then softcap
  std::vector<Expect> logits;   ///< n x m, after bias, ALiBi, -inf where not attended
  std::vector<Expect> row_max;  ///< n
  std::vector<Expect> row_sum;  ///< n, relative to row_max
  std::vector<RowClass> rows;
  Expect& o(Index i, Index c) { return out[static_cast<std::size_t>(i * dv + c)]; }
  const Expect& o(Index i, Index c) const { return out[static_cast<std::size_t>(i * dv + c)]; }
};

namespace detail {
inline std::size_t at(Index i, Index j, Index cols) {
  return static_cast<std::size_t>(i * cols + j);
}

/// One score through the pipeline, with its error bound in T.
struct Score {
  LD raw = 0, raw_err = 0;
  bool raw_risky = false;
  LD scaled = 0, scaled_err = 0;  ///< after softcap
  LD logit = 0, err = 0;          ///< after bias and ALiBi
  bool risky = false;
};

inline Score score(const RefProblem& p, Index i, Index j) {
  const Precision& pr = p.prec;
  const LD u = pr.u;
  const Index d = p.Q.cols();
  const LD dd = static_cast<LD>(d);
  const LD scale = p.scale ? *p.scale : 1.0L / std::sqrt(dd);
  const bool uncertain = p.dQ.size() > 0;
  Score s;
  LD finite_abs = 0;  // sum of |q k| over the finite products
  LD in_err = 0;      // from uncertain inputs
  LD max_q = 0;
  bool underflow = false;  // scale q_ik underflows to 0 in T and meets an infinite k_jk: 0 inf
  for (Index k = 0; k < d; ++k) {
    const LD q = p.Q(i, k);
    const LD kk = p.K(j, k);
    const LD prod = q * kk;
    s.raw += prod;
    if (std::isinf(kk) && std::isfinite(q) && q != 0 && std::fabs(scale * q) < pr.tiny) {
      underflow = true;
    }
    if (std::isfinite(prod)) {
      finite_abs += std::fabs(prod);
      if (uncertain) {
        in_err += p.dQ(i, k) * std::fabs(kk) + std::fabs(q) * p.dK(j, k) + p.dQ(i, k) * p.dK(j, k);
      }
    }
    if (std::isfinite(q)) max_q = std::max(max_q, std::fabs(q));
  }
  const LD limit = pr.max / 16;
  s.raw_err = (dd + 2) * u * finite_abs + (dd + 4) * pr.tiny + in_err;
  s.raw_risky = finite_abs > limit;
  s.scaled = scale * s.raw;
  s.scaled_err = std::fabs(scale) * s.raw_err + 2 * u * std::fabs(s.scaled) +
                 (dd + 4) * pr.tiny * (1 + std::fabs(scale));
  // Risky: T may overflow (or underflow into 0 inf) where long double does not. The raw Q K^T
  // alone overflowing does not count: every path computes the scaled scores as (scale q) . k, or
  // (the tiled kernel) scales Q first where the raw product could overflow.
  s.risky = underflow || std::fabs(scale) * finite_abs > limit ||
            std::fabs(scale) * max_q > limit || std::fabs(scale) * in_err > limit;
  if (p.softcap) {
    const LD c = *p.softcap;
    const LD in_err_c = s.scaled_err + 2 * u * (std::isfinite(s.scaled) ? std::fabs(s.scaled) : 0);
    s.scaled = c * std::tanh(s.scaled / c);
    s.scaled_err = std::min(in_err_c, 2 * c) + 8 * u * c;
  }
  s.logit = s.scaled;
  s.err = s.scaled_err;
  if (p.bias) {
    const LD b = (*p.bias)(i, j);
    s.logit += b;
    if (std::isfinite(b) && std::fabs(b) > limit) s.risky = true;
    s.err += u * (std::isfinite(s.logit) ? std::fabs(s.logit) : 0);
  }
  if (p.alibi_slope) {
    const LD a = *p.alibi_slope * static_cast<LD>(std::abs(i + p.offset - j));
    s.logit -= a;
    s.err += 2 * u * (std::fabs(a) + (std::isfinite(s.logit) ? std::fabs(s.logit) : 0));
  }
  return s;
}

inline Expect value_expect(LD value, LD tol, bool risky) {
  if (risky) return {Kind::Any, value, 0};
  if (std::isnan(value)) return {Kind::NaN, value, 0};
  if (std::isinf(value)) return {Kind::Inf, value, 0};
  return {Kind::Value, value, tol};
}
}  // namespace detail

/// The expected results of one problem (see the file comment for the rules and the tolerances).
inline Reference reference(const RefProblem& p) {
  using detail::at;
  const Index n = p.Q.rows();
  const Index m = p.K.rows();
  const Index dv = p.V.cols();
  const Precision& pr = p.prec;
  const LD u = pr.u;
  const LD F = 2;  // safety factor over the modelled bounds
  const LD g = (4 * static_cast<LD>(m) + 32) * u;
  const bool uncertain_v = p.dV.size() > 0;
  Reference r;
  r.n = n;
  r.m = m;
  r.dv = dv;
  r.out.assign(static_cast<std::size_t>(n * dv), {});
  r.weights.assign(static_cast<std::size_t>(n * m), {});
  r.raw.assign(static_cast<std::size_t>(n * m), {});
  r.scaled.assign(static_cast<std::size_t>(n * m), {});
  r.logits.assign(static_cast<std::size_t>(n * m), {});
  r.lse.assign(static_cast<std::size_t>(n), {});
  r.row_max.assign(static_cast<std::size_t>(n), {});
  r.row_sum.assign(static_cast<std::size_t>(n), {});
  r.rows.assign(static_cast<std::size_t>(n), RowClass::Regular);
  std::vector<detail::Score> s(static_cast<std::size_t>(m));
  std::vector<char> attends(static_cast<std::size_t>(m));
  for (Index i = 0; i < n; ++i) {
    const auto row = static_cast<std::size_t>(i);
    bool any = false, nan_row = false, risky = false, all_minus_inf = true;
    for (Index j = 0; j < m; ++j) {
      const auto sj = static_cast<std::size_t>(j);
      s[sj] = detail::score(p, i, j);
      const bool a = p.allowed(i, j) && !(p.bias && (*p.bias)(i, j) == -kInf);
      attends[sj] = a;
      r.raw[at(i, j, m)] = detail::value_expect(s[sj].raw, F * s[sj].raw_err, s[sj].raw_risky);
      r.scaled[at(i, j, m)] = detail::value_expect(s[sj].scaled, F * s[sj].scaled_err, s[sj].risky);
      if (!a) {
        r.logits[at(i, j, m)] = {Kind::Exact, -kInf, 0};
        r.weights[at(i, j, m)] = {Kind::Exact, 0, 0};
        continue;
      }
      any = true;
      risky = risky || s[sj].risky;
      const LD x = s[sj].logit;
      if (std::isnan(x) || x == kInf) nan_row = true;
      if (x != -kInf) all_minus_inf = false;
    }
    for (Index j = 0; j < m; ++j) {
      const auto sj = static_cast<std::size_t>(j);
      if (attends[sj]) {
        r.logits[at(i, j, m)] =
            detail::value_expect(s[sj].logit, F * s[sj].err, s[sj].risky || (risky && !nan_row));
      }
    }
    if (!any) {
      r.rows[row] = RowClass::Empty;
      for (Index c = 0; c < dv; ++c) r.o(i, c) = {Kind::Exact, 0, 0};
      // "-inf for a row that may attend nothing; the sink is included when set" (flash.hpp)
      // reads both ways for an empty row with a sink: log(exp(sink)) = sink is accepted too.
      r.lse[row] =
          p.sink ? Expect{Kind::ExactOr, -kInf, 0, *p.sink} : Expect{Kind::Exact, -kInf, 0};
      r.row_max[row] = {Kind::Any, 0, 0};  // -inf, or the sink
      r.row_sum[row] = {Kind::Any, 0, 0};
      continue;
    }
    if (nan_row) {
      r.rows[row] = RowClass::NaNRow;
      for (Index c = 0; c < dv; ++c) r.o(i, c) = {Kind::NaN, 0, 0};
      for (Index j = 0; j < m; ++j) {
        const auto sj = static_cast<std::size_t>(j);
        r.weights[at(i, j, m)] = attends[sj] ? Expect{Kind::NaN, 0, 0} : Expect{Kind::Any, 0, 0};
      }
      r.lse[row] = {Kind::NaN, 0, 0};
      r.row_max[row] = {Kind::Any, 0, 0};
      r.row_sum[row] = {Kind::Any, 0, 0};
      continue;
    }
    if (risky) {
      r.rows[row] = RowClass::Risky;
      for (Index c = 0; c < dv; ++c) r.o(i, c) = {Kind::Any, 0, 0};
      for (Index j = 0; j < m; ++j) r.weights[at(i, j, m)] = {Kind::Any, 0, 0};
      r.lse[row] = r.row_max[row] = r.row_sum[row] = {Kind::Any, 0, 0};
      continue;
    }
    if (all_minus_inf && !(p.sink && *p.sink > -kInf)) {
      r.rows[row] = RowClass::AllMinusInf;
      for (Index c = 0; c < dv; ++c) r.o(i, c) = {Kind::Any, 0, 0};
      for (Index j = 0; j < m; ++j) {
        if (attends[static_cast<std::size_t>(j)]) r.weights[at(i, j, m)] = {Kind::Any, 0, 0};
      }
      r.lse[row] = r.row_max[row] = r.row_sum[row] = {Kind::Any, 0, 0};
      continue;
    }

    // A regular row: finite logits (and perhaps -inf ones), the sink, the softmax.
    LD M = -kInf;
    for (Index j = 0; j < m; ++j) {
      const auto sj = static_cast<std::size_t>(j);
      if (attends[sj] && s[sj].logit != -kInf) M = std::max(M, s[sj].logit);
    }
    if (p.sink) M = std::max(M, *p.sink);
    const bool sink_term = p.sink && *p.sink > -kInf;
    LD sum = 0;
    for (Index j = 0; j < m; ++j) {
      const auto sj = static_cast<std::size_t>(j);
      if (attends[sj] && s[sj].logit != -kInf) sum += std::exp(s[sj].logit - M);
    }
    if (sink_term) sum += std::exp(*p.sink - M);
    const LD log_sum = std::log(sum);
    // Perturbation bounds (log domain) and the exact envelope L, U of the normaliser.
    std::vector<LD> e(static_cast<std::size_t>(m), 0), lw(static_cast<std::size_t>(m), -kInf);
    LD L = 0, U = 0, e_max = 0;
    for (Index j = 0; j < m; ++j) {
      const auto sj = static_cast<std::size_t>(j);
      if (!attends[sj] || s[sj].logit == -kInf) continue;
      const LD z = s[sj].logit - M;
      e[sj] = s[sj].err + 2 * u * std::fabs(z) + 4 * u;
      lw[sj] = z - log_sum;
      L += std::exp(lw[sj] - e[sj]);
      U += std::exp(lw[sj] + e[sj]);
      e_max = std::max(e_max, s[sj].err);
    }
    if (sink_term) {
      const LD z = *p.sink - M;
      const LD es = 2 * u * std::fabs(z) + 4 * u;
      L += std::exp(z - log_sum - es);
      U += std::exp(z - log_sum + es);
    }
    const LD log_L = std::log(L);
    const LD log_U = std::log(U);
    std::vector<LD> w(static_cast<std::size_t>(m), 0), dw(static_cast<std::size_t>(m), 0);
    for (Index j = 0; j < m; ++j) {
      const auto sj = static_cast<std::size_t>(j);
      if (!attends[sj]) continue;
      if (s[sj].logit == -kInf) {
        r.weights[at(i, j, m)] = {Kind::Exact, 0, 0};
        continue;
      }
      w[sj] = std::exp(lw[sj]);
      const LD hi = std::min<LD>(1, std::exp(lw[sj] + e[sj] - log_L));
      const LD lo = std::exp(lw[sj] - e[sj] - log_U);
      dw[sj] = std::max<LD>({hi - w[sj], w[sj] - lo, 0});
      r.weights[at(i, j, m)] = {Kind::Value, w[sj],
                                F * (dw[sj] + g * (w[sj] + dw[sj])) + 4 * pr.normal_min};
    }
    bool some_nan = false;
    for (Index c = 0; c < dv; ++c) {
      bool unspecified = false, nan = false, pos = false, neg = false;
      LD value = 0, spread = 0, magnitude = 0, v_err = 0, v_max = 0;
      for (Index j = 0; j < m; ++j) {
        const auto sj = static_cast<std::size_t>(j);
        if (!attends[sj]) continue;
        const LD v = p.V(j, c);
        if (s[sj].logit == -kInf) {
          if (!std::isfinite(v)) unspecified = true;
          continue;
        }
        if (std::isnan(v)) {
          nan = true;
        } else if (v == kInf) {
          pos = true;
        } else if (v == -kInf) {
          neg = true;
        } else {
          value += w[sj] * v;
          spread += dw[sj] * std::fabs(v);
          magnitude += (w[sj] + dw[sj]) * std::fabs(v);
          if (uncertain_v) v_err += (w[sj] + dw[sj]) * p.dV(j, c);
          v_max = std::max(v_max, std::fabs(v));
        }
      }
      Expect& x = r.o(i, c);
      if (unspecified) {
        x = {Kind::Any, 0, 0};
      } else if (nan || (pos && neg)) {
        x = {Kind::NaN, 0, 0};
        some_nan = true;
      } else if (pos || neg) {
        x = {Kind::Inf, pos ? kInf : -kInf, 0};
      } else {
        x = {Kind::Value, value,
             F * (spread + g * magnitude + v_err) +
                 4 * (static_cast<LD>(m) + 2) * pr.normal_min * (1 + v_max)};
      }
    }
    if (some_nan) {
      for (Index c = 0; c < dv; ++c) {
        if (r.o(i, c).kind == Kind::Value) r.o(i, c).kind = Kind::ValueOrNaN;
      }
    }
    const LD lse = M + log_sum;
    r.lse[row] = {Kind::Value, lse,
                  F * (std::max(std::fabs(log_L), std::fabs(log_U)) + g + 4 * u * std::fabs(lse))};
    r.row_max[row] = {Kind::Value, M, F * (e_max + 2 * u * std::fabs(M))};
    r.row_sum[row] = {Kind::Value, sum, sum * (std::exp(F * (2 * e_max + g)) - 1)};
  }
  for (const RowClass c : r.rows) ++stats().rows[static_cast<int>(c)];
  return r;
}

// ================================================================================================
// Failures
// ================================================================================================

struct Failure {
  std::string path;     ///< which library call
  std::string message;  ///< what differs
};

struct Failures {
  std::vector<Failure> list;
  std::size_t limit = 6;  ///< entries reported per path and table
  void add(const std::string& path, const std::string& message) { list.push_back({path, message}); }
  bool empty() const { return list.empty(); }
};

/// Compares a table of results with its expectations; reports up to `limit` entries (the first
/// rows first) plus a count.
template <class Get>
void compare(Failures& f, const std::string& path, const char* what,
             const std::vector<Expect>& expected, const std::vector<RowClass>* rows, Index n,
             Index cols, Get get) {
  std::size_t bad = 0;
  std::ostringstream text;
  for (Index i = 0; i < n; ++i) {
    for (Index c = 0; c < cols; ++c) {
      const Expect& e = expected[detail::at(i, c, cols)];
      ++stats().entries[static_cast<int>(e.kind)];
      const LD got = get(i, c);
      if (satisfies(e, got)) continue;
      if (bad < f.limit) {
        text << "\n    " << what << "(" << i << ", " << c << "): got " << show(got) << ", expected "
             << describe(e);
        if (rows) text << "  [" << row_class_name((*rows)[static_cast<std::size_t>(i)]) << "]";
      }
      ++bad;
    }
  }
  if (bad > 0) {
    f.add(path, std::string(what) + ": " + std::to_string(bad) + " of " + std::to_string(n * cols) +
                    " entries wrong" + text.str());
  }
}

template <class M>
void compare_matrix(Failures& f, const std::string& path, const char* what, const M& got,
                    const std::vector<Expect>& expected, const Reference& r, Index cols) {
  if (got.rows() != r.n || got.cols() != cols) {
    f.add(path, std::string(what) + " has shape " + std::to_string(got.rows()) + " x " +
                    std::to_string(got.cols()) + ", expected " + std::to_string(r.n) + " x " +
                    std::to_string(cols));
    return;
  }
  compare(f, path, what, expected, &r.rows, r.n, cols,
          [&](Index i, Index c) { return ld(got(i, c)); });
}

template <class M>
void compare_vector(Failures& f, const std::string& path, const char* what, const M& got,
                    const std::vector<Expect>& expected, const Reference& r) {
  if (got.size() != r.n) {
    f.add(path, std::string(what) + " has " + std::to_string(got.size()) + " entries, expected " +
                    std::to_string(r.n));
    return;
  }
  compare(f, path, what, expected, &r.rows, r.n, 1, [&](Index i, Index) { return ld(got(i)); });
}

/// Bitwise equality (NaN equals NaN, the signs of zeros too).
template <class A, class B>
void compare_identical(Failures& f, const std::string& path, const char* what, const A& a,
                       const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) {
    f.add(path, std::string(what) + ": shapes differ");
    return;
  }
  for (Index i = 0; i < a.rows(); ++i) {
    for (Index j = 0; j < a.cols(); ++j) {
      const auto x = a(i, j);
      const auto y = b(i, j);
      const bool same =
          (std::isnan(x) && std::isnan(y)) || (x == y && std::signbit(x) == std::signbit(y));
      if (!same) {
        f.add(path, std::string(what) + ": not bitwise equal at (" + std::to_string(i) + ", " +
                        std::to_string(j) + "): " + literal(x) + " vs " + literal(y));
        return;
      }
    }
  }
}

/// Runs a library call; an exception from a valid case is a failure.
template <class Body>
bool guarded(Failures& f, const std::string& path, Body&& body) {
  try {
    body();
    return true;
  } catch (const std::exception& e) {
    f.add(path, std::string("threw on a valid case: ") + e.what());
  }
  return false;
}

/// Restores the thread count when it goes out of scope.
class Threads {
 public:
  explicit Threads(int threads) { attn::set_num_threads(threads); }
  ~Threads() { attn::set_num_threads(0); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;
};

// ================================================================================================
// Generation helpers
// ================================================================================================

/// Sizes: 0, 1, small, the score kernel's register tiles (6 and 12 rows, 2 packets of keys), the
/// flash tiles (64 query rows, 256 keys), and past the materialised/tiled switch (n m > 256^2).
inline Index draw_size(ByteSource& bytes, bool allow_large) {
  const unsigned r = bytes.byte();
  if (r < 16) return bytes.pick<Index>({0, 1});
  if (r < 150) return bytes.range(1, 9);
  if (r < 215) return bytes.pick<Index>({5, 6, 7, 11, 12, 13, 15, 16, 17, 24, 25, 31, 32, 33});
  if (r < 250 || !allow_large) return bytes.pick<Index>({63, 64, 65, 70, 127, 128, 129});
  return bytes.pick<Index>({255, 256, 257, 300});
}

inline Index draw_width(ByteSource& bytes) {
  return bytes.pick<Index>({1, 2, 3, 4, 4, 5, 7, 8, 8, 9, 12, 16, 17, 32});
}

/// Bulk fill: a normal of one of several spreads, small integers (exact products, ties) or a
/// constant (all ties).
template <class T>
void fill(attn::Matrix<T>& M, ByteSource& bytes, Bulk& bulk) {
  const unsigned style = bytes.byte() % 8;
  const double spread = style < 3 ? 1.0 : style == 3 ? 0.1 : style == 4 ? 4.0 : 16.0;
  const double constant = bulk.normal();
  for (Index k = 0; k < M.size(); ++k) {
    double v = spread * bulk.normal();
    if (style == 6) v = static_cast<double>(bulk.below(5)) - 2.0;
    if (style == 7) v = constant;
    M.data()[k] = static_cast<T>(v);
  }
}

/// A note of one special value put into an input (for the case description).
struct Placed {
  std::string where;
  Index row, col;
  Special what;
};

inline const char* special_name(Special s) {
  static const char* names[] = {"NaN",      "+inf",       "-inf", "1e30", "-1e30",
                                "denormal", "-subnormal", "0",    "1e4",  "-1e4"};
  return names[static_cast<int>(s)];
}

/// Puts 0 to 3 special values (or a whole row of one) into M.
template <class T>
void sprinkle(attn::Matrix<T>& M, const char* where, ByteSource& bytes, std::vector<Placed>& log,
              unsigned per256) {
  if (M.size() == 0 || !bytes.chance(per256)) return;
  const Index count = bytes.range(1, 3);
  for (Index k = 0; k < count; ++k) {
    const auto what = static_cast<Special>(bytes.below(static_cast<Index>(Special::Count)));
    const Index i = bytes.below(M.rows());
    if (bytes.chance(48)) {  // a whole row (a poisoned key, query or value)
      M.row(i).setConstant(special_value<T>(what));
      log.push_back({where, i, -1, what});
      ++stats().specials;
    } else {
      const Index j = bytes.below(M.cols());
      M(i, j) = special_value<T>(what);
      log.push_back({where, i, j, what});
      ++stats().specials;
    }
  }
}

/// Draws the options of an n x m problem; `kv_cache` restricts them to what KVCache::attend takes.
template <class T>
attn::AttentionOptions<T> draw_options(ByteSource& bytes, Bulk& bulk, Index n, Index m,
                                       std::vector<Placed>& log, bool kv_cache) {
  attn::AttentionOptions<T> o;
  const unsigned density = bytes.byte();  // how many options: some cases get all of them
  // Lean cases (1 in 8) have no per-key tables (mask, bias, ALiBi): the decoding kernels' domain.
  const bool lean = density < 32;
  const auto on = [&](unsigned base) {
    return bytes.chance(std::min(255u, (lean ? 110u : base) + density / 3));
  };
  const auto table = [&](unsigned base) { return !lean && on(base); };
  if (kv_cache) {
    o.causal = bytes.chance(128) ? attn::Causal::None : attn::Causal::BottomRight;
  } else {
    o.causal = bytes.pick({attn::Causal::None, attn::Causal::TopLeft, attn::Causal::BottomRight});
  }
  if (on(40)) o.window = bytes.range(0, std::max<Index>(m, 1) + 1);
  if (!kv_cache && on(30)) o.window_right = bytes.range(0, std::max<Index>(m, 1) + 1);
  if (!kv_cache && on(30)) o.query_offset = bytes.range(-m - 3, m + 3);
  if (table(40)) {
    const unsigned p = bytes.pick<unsigned>({26, 128, 230, 256});
    attn::Mask mask(n, m);
    for (Index k = 0; k < mask.size(); ++k) mask.data()[k] = bulk.below(256) < p;
    if (n > 0 && bytes.chance(64)) mask.row(bytes.below(n)).setConstant(false);
    o.mask = std::move(mask);
  }
  if (table(40)) {
    attn::Matrix<T> bias(n, m);
    fill(bias, bytes, bulk);
    if (bytes.chance(128)) {  // -inf entries: a mask written in the bias
      const unsigned p = bytes.pick<unsigned>({13, 64, 200});
      for (Index k = 0; k < bias.size(); ++k) {
        if (bulk.below(256) < p) bias.data()[k] = -std::numeric_limits<T>::infinity();
      }
    }
    if (n > 0 && m > 0 && bytes.chance(40)) {
      bias.row(bytes.below(n)).setConstant(-std::numeric_limits<T>::infinity());
    }
    sprinkle(bias, "bias", bytes, log, 64);
    o.bias = std::move(bias);
  }
  if (on(40)) o.scale = static_cast<T>(bytes.pick({0.125, 1.0, 2.5, -1.0, 0.0, 1e-3, 7.0}));
  if (on(40)) o.softcap = static_cast<T>(bytes.pick({0.5, 1.0, 5.0, 30.0, 1e-2}));
  if (table(40)) o.alibi_slope = static_cast<T>(bytes.pick({0.0, 0.0625, 0.5, 1.0, -0.25}));
  if (on(40)) {
    o.sink = bytes.pick({-std::numeric_limits<T>::infinity(), T(-5), T(0), T(1.5), T(12), T(1e30)});
  }
  return o;
}

template <class T>
std::string describe_options(const attn::AttentionOptions<T>& o) {
  std::ostringstream s;
  s << "causal " << causal_name(o.causal);
  if (o.window) s << ", window " << *o.window;
  if (o.window_right) s << ", window_right " << *o.window_right;
  if (o.query_offset) s << ", query_offset " << *o.query_offset;
  if (o.mask) s << ", mask (" << o.mask->count() << " of " << o.mask->size() << " true)";
  if (o.bias) s << ", bias";
  if (o.scale) s << ", scale " << literal(*o.scale);
  if (o.softcap) s << ", softcap " << literal(*o.softcap);
  if (o.alibi_slope) s << ", alibi_slope " << literal(*o.alibi_slope);
  if (o.sink) s << ", sink " << literal(*o.sink);
  return s.str();
}

inline std::string describe_placed(const std::vector<Placed>& log) {
  std::ostringstream s;
  for (const Placed& p : log) {
    s << " " << p.where << "(" << p.row << ", ";
    if (p.col < 0) {
      s << "*";
    } else {
      s << p.col;
    }
    s << ")=" << special_name(p.what);
  }
  return s.str();
}

/// The reference problem of one head: the rules and the mask folded into `allowed`.
template <class T, class DQ, class DK, class DV>
RefProblem ref_problem(const DQ& Q, const DK& K, const DV& V, const attn::AttentionOptions<T>& o) {
  RefProblem p;
  p.Q = Q.template cast<LD>();
  p.K = K.template cast<LD>();
  p.V = V.template cast<LD>();
  const Index n = Q.rows();
  const Index m = K.rows();
  p.allowed = Table(n, m);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      p.allowed(i, j) = rules_allow(o, i, j, n, m) && (!o.mask || (*o.mask)(i, j));
    }
  }
  if (o.bias) p.bias = o.bias->template cast<LD>();
  if (o.scale) p.scale = ld(*o.scale);
  if (o.softcap) p.softcap = ld(*o.softcap);
  if (o.alibi_slope) p.alibi_slope = ld(*o.alibi_slope);
  if (o.sink) p.sink = ld(*o.sink);
  p.offset = query_position_offset(o, n, m);
  p.prec = precision_of<T>();
  return p;
}

// ================================================================================================
// Single head: every forward path of one (Q, K, V, options)
// ================================================================================================

// ================================================================================================
// Variants (variant.hpp): the ready ones, drawn at run time behind two types (one with key ranges
// and a score, one with a mask), so that each path is instantiated twice, not once per variant
// ================================================================================================

/// A mask as key ranges: causal, documents, prefix-LM, or documents and prefix-LM.
struct DrawnRanges {
  int kind = 0;
  attn::CausalMask causal;
  std::optional<attn::DocumentMask> documents;
  attn::PrefixLM prefix{0};
  std::optional<attn::Both<attn::DocumentMask, attn::PrefixLM>> documents_and_prefix;
  attn::PositionRange keys(const attn::ScoreAt& at) const {
    switch (kind) {
      case 0:
        return causal.keys(at);
      case 1:
        return documents->keys(at);
      case 2:
        return prefix.keys(at);
      default:
        return documents_and_prefix->keys(at);
    }
  }
  attn::TileKind tile(const attn::TileAt& at) const {
    switch (kind) {
      case 0:
        return attn::classify_tile(causal, at);
      case 1:
        return attn::classify_tile(*documents, at);
      case 2:
        return attn::classify_tile(prefix, at);
      default:
        return attn::classify_tile(*documents_and_prefix, at);
    }
  }
};

/// A score modification: none, a one-head T5 table, or softcap (each with its derivative).
template <class T>
struct DrawnScore {
  int kind = 0;
  std::optional<attn::T5Bias<T>> t5;
  attn::Softcap<T> softcap{T(1)};
  T score(T s, const attn::ScoreAt& at) const {
    if (kind == 1) return t5->score(s, at);
    if (kind == 2) return softcap.score(s, at);
    return s;
  }
  T dscore(T s, const attn::ScoreAt& at) const {
    if (kind == 1) return t5->dscore(s, at);
    if (kind == 2) return softcap.dscore(s, at);
    return T(1);
  }
};

/// A mask key by key: a dilated window, a tree, a prefix-LM or a dilated window, documents and a
/// dilated window.
struct DrawnMask {
  int kind = 0;
  std::optional<attn::DilatedWindow> dilated;
  std::optional<attn::TreeMask> tree;
  std::optional<attn::Either<attn::PrefixLM, attn::DilatedWindow>> prefix_or_dilated;
  std::optional<attn::Both<attn::DocumentMask, attn::DilatedWindow>> documents_and_dilated;
  bool allowed(const attn::ScoreAt& at) const {
    switch (kind) {
      case 0:
        return attn::variant_allows(*dilated, at);
      case 1:
        return attn::variant_allows(*tree, at);
      case 2:
        return attn::variant_allows(*prefix_or_dilated, at);
      default:
        return attn::variant_allows(*documents_and_dilated, at);
    }
  }
  attn::TileKind tile(const attn::TileAt& at) const {
    switch (kind) {
      case 0:
        return attn::classify_tile(*dilated, at);
      case 1:
        return attn::classify_tile(*tree, at);
      case 2:
        return attn::classify_tile(*prefix_or_dilated, at);
      default:
        return attn::classify_tile(*documents_and_dilated, at);
    }
  }
};

/// The variant a single-head case also runs with (none in some cases), and its description.
template <class T>
struct DrawnVariant {
  int type = 0;  ///< 0 none, 1 ranges and score, 2 mask
  DrawnRanges ranges;
  DrawnScore<T> score;
  DrawnMask mask;
  std::string text;
};

/// Boundaries of a few documents over positions [0, total): some empty, some of one token.
inline std::vector<Index> draw_offsets(ByteSource& bytes, Index total) {
  std::vector<Index> offsets = {0};
  const Index count = bytes.range(1, 5);
  for (Index d = 1; d < count; ++d) {
    offsets.push_back(
        std::min(total, offsets.back() + bytes.range(0, std::max<Index>(1, total / 2))));
  }
  offsets.push_back(std::max(offsets.back(), total - bytes.range(0, 2)));
  return offsets;
}

inline std::string describe_offsets(const std::vector<Index>& offsets) {
  std::ostringstream s;
  for (std::size_t i = 0; i < offsets.size(); ++i) s << (i ? "," : "") << offsets[i];
  return s.str();
}

/// Draws the variant of a case of m keys with options `o` (a score only where the reference can
/// fold it in: T5's table into an absent bias, softcap into an absent softcap).
template <class T>
DrawnVariant<T> draw_variant(ByteSource& bytes, Bulk& bulk, Index m,
                             const attn::AttentionOptions<T>& o) {
  DrawnVariant<T> v;
  v.type = static_cast<int>(bytes.below(3));
  std::ostringstream text;
  if (v.type == 1) {
    DrawnRanges& r = v.ranges;
    r.kind = static_cast<int>(bytes.below(4));
    const std::vector<Index> offsets = draw_offsets(bytes, m);
    const bool causal = bytes.chance(128);
    r.prefix.prefix = bytes.range(0, m);
    if (r.kind == 1 || r.kind == 3) r.documents.emplace(offsets, causal);
    if (r.kind == 3) r.documents_and_prefix.emplace(attn::both(*r.documents, r.prefix));
    const char* names[] = {"CausalMask", "DocumentMask", "PrefixLM",
                           "both(DocumentMask, PrefixLM)"};
    text << names[r.kind];
    if (r.kind == 1 || r.kind == 3) {
      text << " documents {" << describe_offsets(offsets) << "}" << (causal ? " causal" : "");
    }
    if (r.kind >= 2) text << " prefix " << r.prefix.prefix;
    DrawnScore<T>& sc = v.score;
    sc.kind = static_cast<int>(bytes.below(3));
    // The variant's score comes before the options' softcap: with one set, the reference could
    // not fold the variant in.
    if (o.softcap || (sc.kind == 1 && o.bias)) sc.kind = 0;
    if (sc.kind == 1) {
      const bool bidirectional = bytes.chance(128);
      const Index buckets = bidirectional ? bytes.pick<Index>({4, 8, 32})  // 2 per direction
                                          : bytes.pick<Index>({2, 4, 8, 32});
      const Index distance = buckets + bytes.pick<Index>({1, 8, 100});  // past the exact buckets
      sc.t5.emplace(1, buckets, distance, bidirectional);
      for (Index b = 0; b < buckets; ++b) sc.t5->table()(0, b) = static_cast<T>(bulk.normal());
      text << " and T5Bias(" << buckets << " buckets, " << distance
           << (bidirectional ? ", bidirectional)" : ", causal)");
    } else if (sc.kind == 2) {
      sc.softcap.cap = bytes.pick<T>({T(0.5), T(2), T(30)});
      text << " and Softcap{" << literal(sc.softcap.cap) << "}";
    }
  } else if (v.type == 2) {
    DrawnMask& k = v.mask;
    k.kind = static_cast<int>(bytes.below(4));
    const Index window = bytes.range(1, 8);
    const Index dilation = bytes.range(1, 3);
    const attn::DilatedWindow dilated(window, dilation);
    std::ostringstream w;
    w << "DilatedWindow(" << window << ", " << dilation << ")";
    if (k.kind == 0) {
      k.dilated.emplace(dilated);
      text << w.str();
    } else if (k.kind == 1) {
      const Index prefix = bytes.range(0, m);
      const Index drafts = bytes.range(0, std::max<Index>(0, m - prefix) + 2);
      std::vector<Index> parents;
      for (Index i = 0; i < drafts; ++i) parents.push_back(bytes.range(-1, i - 1));
      k.tree.emplace(prefix, parents);
      text << "TreeMask(prefix " << prefix << ", parents {" << describe_offsets(parents) << "})";
    } else if (k.kind == 2) {
      const Index prefix = bytes.range(0, m);
      k.prefix_or_dilated.emplace(attn::either(attn::PrefixLM{prefix}, dilated));
      text << "either(PrefixLM " << prefix << ", " << w.str() << ")";
    } else {
      const std::vector<Index> offsets = draw_offsets(bytes, m);
      const bool causal = bytes.chance(128);
      k.documents_and_dilated.emplace(attn::both(attn::DocumentMask(offsets, causal), dilated));
      text << "both(DocumentMask {" << describe_offsets(offsets) << "}" << (causal ? " causal" : "")
           << ", " << w.str() << ")";
    }
  }
  v.text = text.str();
  return v;
}

/// Folds the variant into a reference problem: its mask into `allowed`, a T5 table into the
/// (absent) bias, softcap into the (absent) softcap. Query i stands at `p.offset + i`.
template <class T>
void fold_variant(const DrawnVariant<T>& v, RefProblem& p) {
  const Index n = p.Q.rows();
  const Index m = p.K.rows();
  const auto at = [&](Index i, Index j) {
    const Index q = p.offset + i;
    return attn::ScoreAt{0, 0, 0, q, j, q, j};
  };
  if (v.type == 2 || v.type == 1) {
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) {
        const bool allowed = v.type == 1 ? attn::variant_allows(v.ranges, at(i, j))
                                         : attn::variant_allows(v.mask, at(i, j));
        if (!allowed) p.allowed(i, j) = false;
      }
    }
  }
  if (v.type != 1) return;
  if (v.score.kind == 1) {
    p.bias = LMatrix(n, m);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) (*p.bias)(i, j) = ld(v.score.score(T(0), at(i, j)));
    }
  } else if (v.score.kind == 2) {
    p.softcap = ld(v.score.softcap.cap);
  }
}

template <class T>
struct SingleCase {
  attn::Matrix<T> Q, K, V;
  attn::AttentionOptions<T> options;
  attn::FlashTiles tiles;
  std::vector<Placed> placed;
  int magnified = 0;  ///< Q and K were multiplied by 2^magnified, the scale divided by its square
  DrawnVariant<T> variant;  ///< run by the variant paths too (drawn last: the rest as before)
};

template <class T>
SingleCase<T> make_single(ByteSource& bytes) {
  SingleCase<T> c;
  Index n = bytes.chance(24) ? 1 : draw_size(bytes, true);  // one query: the decoding kernel
  Index m = draw_size(bytes, true);
  if (n * m > 70000) {  // keep the big ones to one dimension past the switch
    if (bytes.chance(128))
      n = std::min<Index>(n, 260);
    else
      m = std::min<Index>(m, 260);
  }
  Index d = draw_width(bytes);
  Index dv = draw_width(bytes);
  if (bytes.chance(2)) {  // past scaled_dot_product_attention's switch to the tiled path
    n = bytes.pick<Index>({257, 300});
    m = bytes.pick<Index>({255, 256, 257});
    d = std::min<Index>(d, 8);
    dv = std::min<Index>(dv, 8);
  }
  Bulk bulk(bytes.seed());
  c.Q.resize(n, d);
  c.K.resize(m, d);
  c.V.resize(m, dv);
  fill(c.Q, bytes, bulk);
  fill(c.K, bytes, bulk);
  fill(c.V, bytes, bulk);
  c.options = draw_options<T>(bytes, bulk, n, m, c.placed, false);
  sprinkle(c.Q, "Q", bytes, c.placed, 70);
  sprinkle(c.K, "K", bytes, c.placed, 70);
  sprinkle(c.V, "V", bytes, c.placed, 70);
  c.tiles.query_rows = bytes.pick<Index>({1, 2, 3, 5, 6, 7, 12, 13, 64});
  c.tiles.key_cols = bytes.pick<Index>({1, 2, 3, 4, 5, 8, 9, 16, 17, 256});
  // Entries near the top of T's range with a tiny scale (1 case in 16): Q K^T overflows T where
  // the scaled scores do not. Powers of two, so that the scaled problem is the same one exactly.
  if (bytes.chance(16)) {
    c.magnified = std::is_same_v<T, float> ? 63 : 511;
    const T scale = c.options.scale ? *c.options.scale : T(1) / std::sqrt(static_cast<T>(d));
    c.Q *= std::ldexp(T(1), c.magnified);
    c.K *= std::ldexp(T(1), c.magnified);
    c.options.scale = std::ldexp(scale, -2 * c.magnified);
  }
  c.variant = draw_variant<T>(bytes, bulk, m, c.options);
  return c;
}

template <class T>
std::string describe(const SingleCase<T>& c) {
  std::ostringstream s;
  s << "single head: n " << c.Q.rows() << ", m " << c.K.rows() << ", d_k " << c.Q.cols() << ", d_v "
    << c.V.cols() << "; " << describe_options(c.options) << "; tiles " << c.tiles.query_rows
    << " x " << c.tiles.key_cols << ";";
  if (c.magnified) s << " Q and K times 2^" << c.magnified << ";";
  if (c.variant.type != 0) s << " variant " << c.variant.text << ";";
  if (c.placed.empty()) s << " no special values";
  s << describe_placed(c.placed);
  return s.str();
}

/// The single-head paths, by name (`only` selects one, for the shrinker).
inline const std::vector<std::string>& single_paths() {
  static const std::vector<std::string> names = {"scaled_dot_product_attention",
                                                 "scaled_dot_product_attention(out)",
                                                 "attention_with_weights",
                                                 "flash_attention",
                                                 "flash_attention(tiles)",
                                                 "flash_attention(lse)",
                                                 "flash_attention(lse, tiles)",
                                                 "flash_attention(out)",
                                                 "trace_attention",
                                                 "threads 1 vs 2",
                                                 "variant flash_attention(lse, tiles)",
                                                 "variant flash_attention(out)",
                                                 "variant attention_with_weights",
                                                 "variant attention_heads"};
  return names;
}

/// The paths that take a variant, on the case with `variant` (the case's drawn one), against the
/// reference with the variant folded in.
template <class T, class V>
void check_variant_paths(const SingleCase<T>& c, const V& variant, Failures& f,
                         const std::string& only) {
  RefProblem p = ref_problem<T>(c.Q, c.K, c.V, c.options);
  fold_variant(c.variant, p);
  const Reference r = reference(p);
  const Index m = c.K.rows();
  const Index dv = c.V.cols();
  const auto want = [&](const char* name) { return only.empty() || only == name; };
  const auto& o = c.options;
  if (want("variant flash_attention(lse, tiles)")) {
    const char* path = "variant flash_attention(lse, tiles)";
    guarded(f, path, [&] {
      attn::Vector<T> lse;
      const attn::Matrix<T> out = attn::flash_attention(c.Q, c.K, c.V, variant, o, lse, c.tiles);
      compare_matrix(f, path, "output", out, r.out, r, dv);
      compare_vector(f, path, "log_sum_exp", lse, r.lse, r);
    });
  }
  if (want("variant flash_attention(out)")) {
    const char* path = "variant flash_attention(out)";
    guarded(f, path, [&] {
      attn::Matrix<T> out(2, 1);
      attn::flash_attention(c.Q, c.K, c.V, variant, o, out);
      compare_matrix(f, path, "output", out, r.out, r, dv);
    });
  }
  if (want("variant attention_with_weights")) {
    const char* path = "variant attention_with_weights";
    guarded(f, path, [&] {
      const attn::Attention<T> a = attn::attention_with_weights(c.Q, c.K, c.V, variant, o);
      compare_matrix(f, path, "output", a.output, r.out, r, dv);
      compare_matrix(f, path, "weights", a.weights, r.weights, r, m);
    });
  }
  // One head of attention_heads: one query runs the decoding kernel with the variant.
  if (want("variant attention_heads")) {
    const char* path = "variant attention_heads";
    guarded(f, path, [&] {
      const auto tensor = [](const attn::Matrix<T>& X) {
        attn::Tensor3<T> t(1, X.rows(), X.cols());
        std::copy(X.data(), X.data() + X.size(), t.data());
        return t;
      };
      const attn::Tensor3<T> out =
          attn::attention_heads(tensor(c.Q), tensor(c.K), tensor(c.V), variant, o);
      compare_matrix(f, path, "output",
                     Eigen::Map<const attn::Matrix<T>>(out.data(), c.Q.rows(), dv), r.out, r, dv);
    });
  }
}

template <class T>
void check_single(const SingleCase<T>& c, Failures& f, const std::string& only = "") {
  const RefProblem p = ref_problem<T>(c.Q, c.K, c.V, c.options);
  const Reference r = reference(p);
  const Index m = c.K.rows();
  const Index dv = c.V.cols();
  const auto want = [&](const char* name) { return only.empty() || only == name; };
  const auto& o = c.options;
  if (want("scaled_dot_product_attention")) {
    const char* path = "scaled_dot_product_attention";
    guarded(f, path, [&] {
      const attn::Matrix<T> out = attn::scaled_dot_product_attention(c.Q, c.K, c.V, o);
      compare_matrix(f, path, "output", out, r.out, r, dv);
    });
  }
  if (want("scaled_dot_product_attention(out)")) {
    const char* path = "scaled_dot_product_attention(out)";
    guarded(f, path, [&] {
      attn::Matrix<T> out(3, 2);
      attn::scaled_dot_product_attention(c.Q, c.K, c.V, o, out);
      compare_matrix(f, path, "output", out, r.out, r, dv);
      compare_identical(f, path, "vs the returning overload", out,
                        attn::scaled_dot_product_attention(c.Q, c.K, c.V, o));
    });
  }
  if (want("attention_with_weights")) {
    const char* path = "attention_with_weights";
    guarded(f, path, [&] {
      const attn::Attention<T> a = attn::attention_with_weights(c.Q, c.K, c.V, o);
      compare_matrix(f, path, "output", a.output, r.out, r, dv);
      compare_matrix(f, path, "weights", a.weights, r.weights, r, m);
    });
  }
  const auto flash = [&](const char* path, bool tiled, bool with_lse) {
    if (!want(path)) return;
    guarded(f, path, [&] {
      const attn::FlashTiles tiles = tiled ? c.tiles : attn::FlashTiles{};
      if (with_lse) {
        attn::Vector<T> lse;
        const attn::Matrix<T> out = attn::flash_attention(c.Q, c.K, c.V, o, lse, tiles);
        compare_matrix(f, path, "output", out, r.out, r, dv);
        compare_vector(f, path, "log_sum_exp", lse, r.lse, r);
        compare_identical(f, path, "vs the overload without log-sum-exp", out,
                          attn::flash_attention(c.Q, c.K, c.V, o, tiles));
      } else {
        const attn::Matrix<T> out = attn::flash_attention(c.Q, c.K, c.V, o, tiles);
        compare_matrix(f, path, "output", out, r.out, r, dv);
      }
    });
  };
  flash("flash_attention", false, false);
  flash("flash_attention(tiles)", true, false);
  flash("flash_attention(lse)", false, true);
  flash("flash_attention(lse, tiles)", true, true);
  if (want("flash_attention(out)")) {
    const char* path = "flash_attention(out)";
    guarded(f, path, [&] {
      attn::Matrix<T> out(1, 1);
      attn::flash_attention(c.Q, c.K, c.V, o, out);
      compare_matrix(f, path, "output", out, r.out, r, dv);
    });
  }
  if (want("trace_attention")) {
    const char* path = "trace_attention";
    guarded(f, path, [&] {
      const attn::AttentionTrace<T> t = attn::trace_attention(c.Q, c.K, c.V, o);
      compare_matrix(f, path, "output", t.output, r.out, r, dv);
      compare_matrix(f, path, "weights", t.weights, r.weights, r, m);
      compare_matrix(f, path, "scores", t.scores, r.raw, r, m);
      compare_matrix(f, path, "scaled", t.scaled, r.scaled, r, m);
      compare_matrix(f, path, "masked", t.masked, r.logits, r, m);
      compare_vector(f, path, "row_max", t.row_max, r.row_max, r);
      compare_vector(f, path, "row_sum", t.row_sum, r.row_sum, r);
    });
  }
#ifdef _OPENMP
  // The thread count never changes a bit (threads.hpp): the tiled path splits rows into blocks of
  // 64 queries, the materialised one too.
  if (want("threads 1 vs 2") && c.Q.rows() > 64) {
    const char* path = "threads 1 vs 2";
    guarded(f, path, [&] {
      attn::Matrix<T> one, two, flash_one, flash_two;
      {
        Threads t(1);
        one = attn::scaled_dot_product_attention(c.Q, c.K, c.V, o);
        flash_one = attn::flash_attention(c.Q, c.K, c.V, o, c.tiles);
      }
      {
        Threads t(2);
        two = attn::scaled_dot_product_attention(c.Q, c.K, c.V, o);
        flash_two = attn::flash_attention(c.Q, c.K, c.V, o, c.tiles);
      }
      compare_identical(f, path, "scaled_dot_product_attention", one, two);
      compare_identical(f, path, "flash_attention(tiles)", flash_one, flash_two);
    });
  }
#endif
  if (c.variant.type == 1) {
    check_variant_paths(c, attn::both(c.variant.ranges, c.variant.score), f, only);
  } else if (c.variant.type == 2) {
    check_variant_paths(c, c.variant.mask, f, only);
  }
}

// ================================================================================================
// Per-head values (HeadOptions): slopes, sinks, masks and biases that replace the shared ones
// ================================================================================================

/// Draws per-head values for `heads` query heads over n x m scores, each only where the shared
/// value of its kind is unset (the contract forbids both).
template <class T>
attn::HeadOptions<T> draw_head_options(ByteSource& bytes, Bulk& bulk, Index heads, Index n, Index m,
                                       const attn::AttentionOptions<T>& shared,
                                       std::vector<Placed>& log) {
  attn::HeadOptions<T> ph;
  if (!bytes.chance(90)) return ph;
  const auto size = static_cast<std::size_t>(heads);
  if (!shared.alibi_slope && bytes.chance(128)) {
    ph.alibi_slopes = std::vector<T>(size);
    for (T& s : *ph.alibi_slopes) s = static_cast<T>(bulk.below(5)) * T(0.25);
  }
  if (!shared.sink && bytes.chance(128)) {
    ph.sinks = std::vector<T>(size);
    for (T& s : *ph.sinks) s = static_cast<T>(bulk.normal() * 3);
  }
  if (!shared.mask && bytes.chance(100)) {
    ph.masks = attn::HeadMask(heads, n, m);
    const unsigned p = bytes.pick<unsigned>({64, 200, 256});
    for (Index k = 0; k < ph.masks->size(); ++k) {
      ph.masks->data()[k] = static_cast<unsigned>(bulk.below(256)) < p;
    }
  }
  if (!shared.bias && bytes.chance(100)) {
    attn::Matrix<T> all(heads * n, m);
    fill(all, bytes, bulk);
    for (Index k = 0; k < all.size(); ++k) {
      if (bulk.below(16) == 0) all.data()[k] = -std::numeric_limits<T>::infinity();
    }
    sprinkle(all, "biases (heads*n rows)", bytes, log, 60);
    ph.biases = attn::Tensor3<T>(heads, n, m);
    Eigen::Map<attn::Matrix<T>>(ph.biases->data(), heads * n, m) = all;
  }
  return ph;
}

/// Head h's options: the shared ones with head h's values in place (what the contract means).
template <class T>
attn::AttentionOptions<T> options_of_head(const attn::AttentionOptions<T>& shared,
                                          const attn::HeadOptions<T>& ph, Index h) {
  attn::AttentionOptions<T> o = shared;
  const auto i = static_cast<std::size_t>(h);
  if (ph.alibi_slopes) o.alibi_slope = (*ph.alibi_slopes)[i];
  if (ph.sinks) o.sink = (*ph.sinks)[i];
  if (ph.masks) {
    const Index n = ph.masks->dimension(1);
    const Index m = ph.masks->dimension(2);
    o.mask = Eigen::Map<const attn::Mask>(ph.masks->data() + h * n * m, n, m);
  }
  if (ph.biases) {
    const Index n = ph.biases->dimension(1);
    const Index m = ph.biases->dimension(2);
    o.bias = Eigen::Map<const attn::Matrix<T>>(ph.biases->data() + h * n * m, n, m);
  }
  return o;
}

inline std::string describe_head_options_flags(bool slopes, bool sinks, bool masks, bool biases) {
  std::string s;
  if (slopes) s += ", per-head alibi_slopes";
  if (sinks) s += ", per-head sinks";
  if (masks) s += ", per-head masks";
  if (biases) s += ", per-head biases";
  return s;
}

template <class T>
std::string describe(const attn::HeadOptions<T>& ph) {
  return describe_head_options_flags(ph.alibi_slopes.has_value(), ph.sinks.has_value(),
                                     ph.masks.has_value(), ph.biases.has_value());
}

// ================================================================================================
// Several heads: attention_heads on (heads, tokens, features) tensors, MHA / GQA / MQA
// ================================================================================================

template <class T>
struct HeadsCase {
  attn::Tensor3<T> Q, K, V;
  attn::AttentionOptions<T> options;
  attn::HeadOptions<T> per_head;
  std::vector<Placed> placed;
};

template <class T>
attn::Tensor3<T> stack(const std::vector<attn::Matrix<T>>& heads, Index rows, Index cols) {
  attn::Tensor3<T> t(static_cast<Index>(heads.size()), rows, cols);
  for (std::size_t h = 0; h < heads.size(); ++h) {
    Eigen::Map<attn::Matrix<T>>(t.data() + static_cast<Index>(h) * rows * cols, rows, cols) =
        heads[h];
  }
  return t;
}

template <class T>
Eigen::Map<const attn::Matrix<T>> head_of(const attn::Tensor3<T>& t, Index h) {
  return {t.data() + h * t.dimension(1) * t.dimension(2), t.dimension(1), t.dimension(2)};
}

template <class T>
HeadsCase<T> make_heads(ByteSource& bytes) {
  HeadsCase<T> c;
  const Index kv_heads = bytes.range(1, 3);
  const Index group = bytes.pick<Index>({1, 1, 2, 3, 4});
  const Index heads = kv_heads * group;
  const Index n = draw_size(bytes, false);
  const Index m = draw_size(bytes, false);
  const Index d = draw_width(bytes);
  const Index dv = draw_width(bytes);
  Bulk bulk(bytes.seed());
  std::vector<attn::Matrix<T>> q(static_cast<std::size_t>(heads)),
      k(static_cast<std::size_t>(kv_heads)), v(static_cast<std::size_t>(kv_heads));
  for (auto& x : q) {
    x.resize(n, d);
    fill(x, bytes, bulk);
    sprinkle(x, "Q[h]", bytes, c.placed, 30);
  }
  for (std::size_t h = 0; h < k.size(); ++h) {
    k[h].resize(m, d);
    v[h].resize(m, dv);
    fill(k[h], bytes, bulk);
    fill(v[h], bytes, bulk);
    sprinkle(k[h], "K[h]", bytes, c.placed, 40);
    sprinkle(v[h], "V[h]", bytes, c.placed, 40);
  }
  c.Q = stack(q, n, d);
  c.K = stack(k, m, d);
  c.V = stack(v, m, dv);
  c.options = draw_options<T>(bytes, bulk, n, m, c.placed, false);
  c.per_head = draw_head_options<T>(bytes, bulk, heads, n, m, c.options, c.placed);
  return c;
}

template <class T>
std::string describe(const HeadsCase<T>& c) {
  std::ostringstream s;
  s << "attention_heads: heads " << c.Q.dimension(0) << ", kv_heads " << c.K.dimension(0) << ", n "
    << c.Q.dimension(1) << ", m " << c.K.dimension(1) << ", d_k " << c.Q.dimension(2) << ", d_v "
    << c.V.dimension(2) << "; " << describe_options(c.options) << describe(c.per_head) << ";"
    << describe_placed(c.placed);
  return s.str();
}

template <class T>
void check_heads(const HeadsCase<T>& c, Failures& f) {
  const Index heads = c.Q.dimension(0);
  const Index group = heads / c.K.dimension(0);
  const Index n = c.Q.dimension(1);
  const Index dv = c.V.dimension(2);
  const bool per_head = c.per_head.any();
  std::vector<Reference> refs;
  for (Index h = 0; h < heads; ++h) {
    refs.push_back(
        reference(ref_problem<T>(head_of(c.Q, h), head_of(c.K, h / group), head_of(c.V, h / group),
                                 options_of_head(c.options, c.per_head, h))));
  }
  const auto check_out = [&](const std::string& path, const attn::Tensor3<T>& out) {
    if (out.dimension(0) != heads || out.dimension(1) != n || out.dimension(2) != dv) {
      f.add(path, "output has the wrong dimensions");
      return;
    }
    for (Index h = 0; h < heads; ++h) {
      compare_matrix(f, path + " head " + std::to_string(h), "output", head_of(out, h),
                     refs[static_cast<std::size_t>(h)].out, refs[static_cast<std::size_t>(h)], dv);
    }
  };
  const std::string path = per_head ? "attention_heads(HeadOptions)" : "attention_heads";
  const auto call = [&] {
    return per_head ? attn::attention_heads(c.Q, c.K, c.V, c.options, c.per_head)
                    : attn::attention_heads(c.Q, c.K, c.V, c.options);
  };
  attn::Tensor3<T> out;
  guarded(f, path, [&] {
    out = call();
    check_out(path, out);
  });
  guarded(f, path + "(out)", [&] {
    attn::Tensor3<T> into(1, 1, 1);
    if (per_head) {
      attn::attention_heads(c.Q, c.K, c.V, c.options, c.per_head, into);
    } else {
      attn::attention_heads(c.Q, c.K, c.V, c.options, into);
    }
    check_out(path + "(out)", into);
  });
#ifdef _OPENMP
  if (heads > 1 && out.size() > 0) {
    guarded(f, "attention_heads threads 1 vs 2", [&] {
      attn::Tensor3<T> one, two;
      {
        Threads t(1);
        one = call();
      }
      {
        Threads t(2);
        two = call();
      }
      for (Index h = 0; h < heads; ++h) {
        compare_identical(f, "attention_heads threads 1 vs 2", "output", head_of(one, h),
                          head_of(two, h));
      }
    });
  }
#endif
}

// ================================================================================================
// KVCache: token by token and chunked decoding equal causal attention over the whole sequence
// ================================================================================================

template <class T>
struct CacheCase {
  attn::KVCacheConfig<T> config;
  attn::Matrix<T> Q;  ///< total x (heads d_k)
  attn::Matrix<T> K;  ///< total x (kv_heads d_k)
  attn::Matrix<T> V;  ///< total x (kv_heads d_v)
  Index heads = 1;
  attn::AttentionOptions<T> options;  ///< per call, without the tables below
  std::optional<Index> offset_delta;  ///< set: query_offset = (first new position) + delta
  /// total x total tables over absolute positions (query position, key position): the call's
  /// mask and bias are their rows of the new queries and columns of the held keys.
  std::optional<attn::Mask> mask;
  std::optional<attn::Matrix<T>> bias;
  attn::HeadOptions<T> per_head;  ///< slopes and sinks; masks / biases: (heads, total, total)
  std::vector<Index> chunks;      ///< sizes of the appends of the chunked flow
  std::vector<Placed> placed;
};

template <class T>
CacheCase<T> make_cache(ByteSource& bytes) {
  CacheCase<T> c;
  c.config.d_k = draw_width(bytes);
  c.config.d_v = draw_width(bytes);
  c.config.kv_heads = bytes.range(1, 2);
  const Index group = bytes.pick<Index>({1, 1, 2, 3});
  c.heads = c.config.kv_heads * group;
  if (bytes.chance(110)) {
    c.config.window = bytes.range(0, 9);
    if (bytes.chance(110)) c.config.pinned_tokens = bytes.range(1, 4);
  }
  const Index total = bytes.pick<Index>({1, 2, 3, 5, 8, 13, 20, 33, 70});
  Bulk bulk(bytes.seed());
  c.Q.resize(total, c.heads * c.config.d_k);
  c.K.resize(total, c.config.kv_heads * c.config.d_k);
  c.V.resize(total, c.config.kv_heads * c.config.d_v);
  fill(c.Q, bytes, bulk);
  fill(c.K, bytes, bulk);
  fill(c.V, bytes, bulk);
  sprinkle(c.Q, "Q", bytes, c.placed, 40);
  sprinkle(c.K, "K", bytes, c.placed, 60);
  sprinkle(c.V, "V", bytes, c.placed, 60);
  c.options = draw_options<T>(bytes, bulk, total, total, c.placed, true);
  c.mask = c.options.mask;
  c.bias = c.options.bias;
  c.options.mask.reset();
  c.options.bias.reset();
  if (bytes.chance(50)) c.options.window_right = bytes.range(0, 3);
  if (!c.config.window && bytes.chance(50)) c.offset_delta = bytes.range(-3, 3);
  attn::AttentionOptions<T> with_tables = c.options;
  with_tables.mask = c.mask;
  with_tables.bias = c.bias;
  c.per_head = draw_head_options<T>(bytes, bulk, c.heads, total, total, with_tables, c.placed);
  for (Index done = 0; done < total;) {
    const Index r = std::min(total - done, bytes.pick<Index>({1, 2, 3, 4, 7, 16, 64}));
    c.chunks.push_back(r);
    done += r;
  }
  return c;
}

template <class T>
std::string describe(const CacheCase<T>& c) {
  std::ostringstream s;
  s << "KVCache: d_k " << c.config.d_k << ", d_v " << c.config.d_v << ", kv_heads "
    << c.config.kv_heads << ", heads " << c.heads << ", cache window ";
  if (c.config.window) {
    s << *c.config.window;
  } else {
    s << "none";
  }
  s << ", pinned_tokens " << c.config.pinned_tokens << ", tokens " << c.Q.rows() << ", chunks";
  for (Index r : c.chunks) s << " " << r;
  s << "; attend options: " << describe_options(c.options);
  if (c.offset_delta) s << ", query_offset = first new position + " << *c.offset_delta;
  if (c.mask) s << ", mask";
  if (c.bias) s << ", bias";
  s << describe(c.per_head) << ";" << describe_placed(c.placed);
  return s.str();
}

template <class T>
attn::AttentionOptions<T> with_tables_of(const CacheCase<T>& c) {
  attn::AttentionOptions<T> o = c.options;
  o.mask = c.mask;
  o.bias = c.bias;
  return o;
}

/// One decoding flow: append a chunk, attend its queries, against the reference of those rows.
template <class T>
void run_cache_flow(const CacheCase<T>& c, const std::vector<Index>& chunks,
                    const std::string& path, Failures& f) {
  const Index d_k = c.config.d_k;
  const Index d_v = c.config.d_v;
  const Index heads = c.heads;
  const Index group = heads / c.config.kv_heads;
  const Index all = c.Q.rows();
  std::optional<Index> window = c.config.window;
  if (c.options.window) window = window ? std::min(*window, *c.options.window) : c.options.window;
  const Index pinned = c.config.window ? c.config.pinned_tokens : 0;
  std::optional<attn::KVCache<T>> cache;
  if (!guarded(f, path, [&] { cache.emplace(c.config); })) return;
  Index done = 0;
  for (const Index r : chunks) {
    const Index total = done + r;
    bool ok =
        guarded(f, path, [&] { cache->append(c.K.middleRows(done, r), c.V.middleRows(done, r)); });
    if (!ok) return;
    const std::vector<Index> positions = cache->key_positions();
    const auto held = static_cast<Index>(positions.size());
    const Index first = c.offset_delta ? done + *c.offset_delta : done;
    // The call's tables: rows of the new queries, columns of the held keys.
    const auto query_row = [&](Index i) { return std::clamp<Index>(first + i, 0, all - 1); };
    attn::AttentionOptions<T> call = c.options;
    if (c.offset_delta) call.query_offset = first;
    const auto key_of = [&](Index col) { return positions[static_cast<std::size_t>(col)]; };
    if (c.mask) {
      attn::Mask mask(r, held);
      for (Index i = 0; i < r; ++i) {
        for (Index col = 0; col < held; ++col) mask(i, col) = (*c.mask)(query_row(i), key_of(col));
      }
      call.mask = std::move(mask);
    }
    if (c.bias) {
      attn::Matrix<T> bias(r, held);
      for (Index i = 0; i < r; ++i) {
        for (Index col = 0; col < held; ++col) bias(i, col) = (*c.bias)(query_row(i), key_of(col));
      }
      call.bias = std::move(bias);
    }
    attn::HeadOptions<T> ph;
    ph.alibi_slopes = c.per_head.alibi_slopes;
    ph.sinks = c.per_head.sinks;
    if (c.per_head.masks) {
      ph.masks = attn::HeadMask(heads, r, held);
      for (Index h = 0; h < heads; ++h) {
        for (Index i = 0; i < r; ++i) {
          for (Index col = 0; col < held; ++col) {
            (*ph.masks)(h, i, col) = (*c.per_head.masks)(h, query_row(i), key_of(col));
          }
        }
      }
    }
    if (c.per_head.biases) {
      ph.biases = attn::Tensor3<T>(heads, r, held);
      for (Index h = 0; h < heads; ++h) {
        for (Index i = 0; i < r; ++i) {
          for (Index col = 0; col < held; ++col) {
            (*ph.biases)(h, i, col) = (*c.per_head.biases)(h, query_row(i), key_of(col));
          }
        }
      }
    }
    attn::Matrix<T> out;
    const std::string step =
        path + " step " + std::to_string(done) + ".." + std::to_string(total - 1);
    ok = guarded(f, step, [&] {
      const attn::Matrix<T> q = c.Q.middleRows(done, r);
      if (ph.any()) {
        out = cache->attend(q, call, ph);
      } else {
        out = cache->attend(q, call);
      }
    });
    if (!ok) return;
    if (out.rows() != r || out.cols() != heads * d_v) {
      f.add(step,
            "output has shape " + std::to_string(out.rows()) + " x " + std::to_string(out.cols()));
      return;
    }
    // The reference: queries at positions first .. first + r - 1 over keys 0 .. total - 1,
    // always causal; keys outside the window stay visible when pinned.
    std::vector<char> is_held(static_cast<std::size_t>(total), 0);
    for (Index col = 0; col < held; ++col) is_held[static_cast<std::size_t>(key_of(col))] = 1;
    for (Index h = 0; h < heads; ++h) {
      const Index kv = h / group;
      const attn::AttentionOptions<T> o = options_of_head(with_tables_of(c), c.per_head, h);
      RefProblem p;
      p.Q = c.Q.block(done, h * d_k, r, d_k).template cast<LD>();
      p.K = c.K.block(0, kv * d_k, total, d_k).template cast<LD>();
      p.V = c.V.block(0, kv * d_v, total, d_v).template cast<LD>();
      p.allowed = Table(r, total);
      if (o.bias) p.bias = LMatrix::Zero(r, total);
      for (Index i = 0; i < r; ++i) {
        const Index pos = first + i;
        for (Index j = 0; j < total; ++j) {
          bool a = j <= pos && (!window || j >= pos - *window || j < pinned);
          if (c.options.window_right) a = a && j <= pos + *c.options.window_right;
          if (o.mask) a = a && (*o.mask)(query_row(i), j);
          if (a && !is_held[static_cast<std::size_t>(j)]) {
            f.add(step, "key position " + std::to_string(j) + " is visible to query " +
                            std::to_string(pos) + " but the cache does not hold it");
          }
          p.allowed(i, j) = a && is_held[static_cast<std::size_t>(j)];
          if (o.bias) (*p.bias)(i, j) = ld((*o.bias)(query_row(i), j));
        }
      }
      if (o.scale) p.scale = ld(*o.scale);
      if (o.softcap) p.softcap = ld(*o.softcap);
      if (o.alibi_slope) p.alibi_slope = ld(*o.alibi_slope);
      if (o.sink) p.sink = ld(*o.sink);
      p.offset = first;
      p.prec = precision_of<T>();
      const Reference ref = reference(p);
      compare_matrix(f, step + " head " + std::to_string(h), "output", out.middleCols(h * d_v, d_v),
                     ref.out, ref, d_v);
    }
    done = total;
  }
}

template <class T>
void check_cache(const CacheCase<T>& c, Failures& f) {
  run_cache_flow(c, std::vector<Index>(static_cast<std::size_t>(c.Q.rows()), 1),
                 "KVCache token by token", f);
  run_cache_flow(c, c.chunks, "KVCache chunked", f);
}

// ================================================================================================
// MultiHeadAttention: projections, heads, key padding, output projection
// ================================================================================================

template <class T>
struct MhaCase {
  attn::MultiHeadConfig config{1, 1};
  std::uint64_t seed = 0;
  attn::RowVector<T> b_Q, b_K, b_V, b_O;
  attn::Tensor3<T> query, key, value;
  attn::MultiHeadOptions<T> options;
  std::vector<Placed> placed;
};

template <class T>
MhaCase<T> make_mha(ByteSource& bytes) {
  MhaCase<T> c;
  const Index kv_heads = bytes.range(1, 2);
  const Index heads = kv_heads * bytes.pick<Index>({1, 2});
  const Index head_dim = bytes.pick<Index>({1, 2, 3, 4, 8});
  c.config.embed_dim = heads * head_dim;
  c.config.num_heads = heads;
  c.config.num_kv_heads = kv_heads;
  c.config.kdim = bytes.chance(64) ? bytes.range(1, 9) : 0;
  c.config.vdim = bytes.chance(64) ? bytes.range(1, 9) : 0;
  c.config.bias = bytes.chance(170);
  const Index batch = bytes.range(1, 3);
  const Index n = bytes.pick<Index>({0, 1, 2, 3, 5, 8, 13});
  const Index m = bytes.pick<Index>({0, 1, 2, 3, 5, 8, 13});
  c.seed = bytes.seed();
  Bulk bulk(bytes.seed());
  const Index E = c.config.embed_dim;
  const Index kdim = c.config.kdim > 0 ? c.config.kdim : E;
  const Index vdim = c.config.vdim > 0 ? c.config.vdim : E;
  const auto tensor = [&](Index rows, Index cols, const char* name, unsigned per256) {
    attn::Matrix<T> M(batch * rows, cols);
    fill(M, bytes, bulk);
    if (M.size() > 0 && bytes.chance(per256)) {  // NaN, inf or subnormals at one token
      const auto what = bytes.pick(
          {Special::NaN, Special::PosInf, Special::NegInf, Special::Denormal, Special::Zero});
      const Index i = bytes.below(M.rows());
      if (bytes.chance(128)) {
        M.row(i).setConstant(special_value<T>(what));
        c.placed.push_back({name, i, -1, what});
      } else {
        const Index j = bytes.below(M.cols());
        M(i, j) = special_value<T>(what);
        c.placed.push_back({name, i, j, what});
      }
    }
    attn::Tensor3<T> t(batch, rows, cols);
    Eigen::Map<attn::Matrix<T>>(t.data(), batch * rows, cols) = M;
    return t;
  };
  c.query = tensor(n, E, "query rows (batch*n)", 50);
  c.key = tensor(m, kdim, "key rows (batch*m)", 70);
  c.value = tensor(m, vdim, "value rows (batch*m)", 70);
  if (c.config.bias) {
    const Index w = heads * head_dim;
    const Index kvw = kv_heads * head_dim;
    const auto row = [&](Index size) {
      attn::RowVector<T> b(size);
      for (Index k = 0; k < size; ++k) b(k) = static_cast<T>(0.3 * bulk.normal());
      return b;
    };
    c.b_Q = row(w);
    c.b_K = row(kvw);
    c.b_V = row(kvw);
    c.b_O = row(E);
  }
  std::vector<Placed> ignored;
  static_cast<attn::AttentionOptions<T>&>(c.options) =
      draw_options<T>(bytes, bulk, n, m, ignored, false);
  // No 1e30 here: the projections and the output projection stay far from overflow.
  const auto tame = [](T& b) {
    if (std::isfinite(b) && std::fabs(b) > T(1e4)) b = T(3);
  };
  if (c.options.bias) {
    for (Index k = 0; k < c.options.bias->size(); ++k) tame(c.options.bias->data()[k]);
  }
  if (c.options.sink && *c.options.sink > T(1e4)) c.options.sink = T(40);
  c.options.per_head = draw_head_options<T>(bytes, bulk, heads, n, m, c.options, ignored);
  if (c.options.per_head.biases) {
    for (Index k = 0; k < c.options.per_head.biases->size(); ++k) {
      tame(c.options.per_head.biases->data()[k]);
    }
  }
  if (bytes.chance(128)) {
    attn::Mask valid(batch, m);
    for (Index k = 0; k < valid.size(); ++k) valid.data()[k] = bulk.below(4) != 0;
    c.options.key_valid = std::move(valid);
  }
  c.options.need_weights = bytes.chance(128);
  c.options.average_weights = bytes.chance(128);
  return c;
}

template <class T>
std::string describe(const MhaCase<T>& c) {
  std::ostringstream s;
  s << "MultiHeadAttention: embed " << c.config.embed_dim << ", heads " << c.config.num_heads
    << ", kv_heads " << c.config.num_kv_heads << ", kdim " << c.config.kdim << ", vdim "
    << c.config.vdim << ", bias " << c.config.bias << ", batch " << c.query.dimension(0) << ", n "
    << c.query.dimension(1) << ", m " << c.key.dimension(1) << "; " << describe_options(c.options)
    << describe(c.options.per_head);
  if (c.options.key_valid) s << ", key_valid";
  s << ", need_weights " << c.options.need_weights << ", average_weights "
    << c.options.average_weights << ";" << describe_placed(c.placed);
  return s.str();
}

namespace detail {
/// Y = X W + b in long double, with the bound of T's rounding for each finite entry.
template <class T>
void project(const LMatrix& X, const attn::Matrix<T>& W, const attn::RowVector<T>& b,
             const Precision& pr, LMatrix& Y, LMatrix& dY) {
  const Index inner = X.cols();
  Y.resize(X.rows(), W.cols());
  dY.resize(X.rows(), W.cols());
  for (Index i = 0; i < X.rows(); ++i) {
    for (Index j = 0; j < W.cols(); ++j) {
      LD sum = 0, magnitude = 0;
      for (Index k = 0; k < inner; ++k) {
        const LD prod = X(i, k) * ld(W(k, j));
        sum += prod;
        if (std::isfinite(prod)) magnitude += std::fabs(prod);
      }
      const LD bias = b.size() > 0 ? ld(b(j)) : 0;
      Y(i, j) = sum + bias;
      dY(i, j) = (static_cast<LD>(inner) + 3) * pr.u * (magnitude + std::fabs(bias)) +
                 (static_cast<LD>(inner) + 2) * pr.tiny;
    }
  }
}
}  // namespace detail

template <class T>
void check_mha(const MhaCase<T>& c, Failures& f) {
  const std::string path = "MultiHeadAttention::forward";
  std::optional<attn::MultiHeadAttention<T>> layer;
  if (!guarded(f, path, [&] { layer.emplace(c.config, c.seed); })) return;
  if (c.config.bias) {
    layer->b_Q = c.b_Q;
    layer->b_K = c.b_K;
    layer->b_V = c.b_V;
    layer->b_O = c.b_O;
  }
  attn::MultiHeadResult<T> result;
  if (!guarded(f, path, [&] { result = layer->forward(c.query, c.key, c.value, c.options); })) {
    return;
  }
  const Precision pr = precision_of<T>();
  const Index batch = c.query.dimension(0);
  const Index n = c.query.dimension(1);
  const Index m = c.key.dimension(1);
  const Index E = c.config.embed_dim;
  const Index heads = c.config.num_heads;
  const Index hd = E / heads;
  const Index group = heads / c.config.num_kv_heads;
  const auto flat = [](const attn::Tensor3<T>& t) {
    return Eigen::Map<const attn::Matrix<T>>(t.data(), t.dimension(0) * t.dimension(1),
                                             t.dimension(2))
        .template cast<LD>()
        .eval();
  };
  LMatrix Qp, dQp, Kp, dKp, Vp, dVp;
  detail::project(flat(c.query), layer->W_Q, layer->b_Q, pr, Qp, dQp);
  detail::project(flat(c.key), layer->W_K, layer->b_K, pr, Kp, dKp);
  detail::project(flat(c.value), layer->W_V, layer->b_V, pr, Vp, dVp);
  if (result.output.dimension(0) != batch || result.output.dimension(1) != n ||
      result.output.dimension(2) != E) {
    f.add(path, "output has the wrong dimensions");
    return;
  }
  const LD u = pr.u;
  for (Index b = 0; b < batch; ++b) {
    // Each head's expectations, then the output projection of the concatenated heads.
    std::vector<Reference> refs;
    for (Index h = 0; h < heads; ++h) {
      const Index kv = h / group;
      const attn::AttentionOptions<T> o = options_of_head(
          static_cast<const attn::AttentionOptions<T>&>(c.options), c.options.per_head, h);
      RefProblem p;
      // A block of an empty matrix would offset its null data pointer (UB): rows == 0 is empty.
      const auto part = [](const LMatrix& M, Index r0, Index c0, Index rows, Index cols) {
        return rows == 0 ? LMatrix(0, cols) : LMatrix(M.block(r0, c0, rows, cols));
      };
      p.Q = part(Qp, b * n, h * hd, n, hd);
      p.dQ = part(dQp, b * n, h * hd, n, hd);
      p.K = part(Kp, b * m, kv * hd, m, hd);
      p.dK = part(dKp, b * m, kv * hd, m, hd);
      p.V = part(Vp, b * m, kv * hd, m, hd);
      p.dV = part(dVp, b * m, kv * hd, m, hd);
      p.allowed = Table(n, m);
      for (Index i = 0; i < n; ++i) {
        for (Index j = 0; j < m; ++j) {
          p.allowed(i, j) = rules_allow(o, i, j, n, m) && (!o.mask || (*o.mask)(i, j)) &&
                            (!c.options.key_valid || (*c.options.key_valid)(b, j));
        }
      }
      if (o.bias) p.bias = o.bias->template cast<LD>();
      if (o.scale) p.scale = ld(*o.scale);
      if (o.softcap) p.softcap = ld(*o.softcap);
      if (o.alibi_slope) p.alibi_slope = ld(*o.alibi_slope);
      if (o.sink) p.sink = ld(*o.sink);
      p.offset = query_position_offset(o, n, m);
      p.prec = pr;
      refs.push_back(reference(p));
    }
    std::vector<Expect> expected(static_cast<std::size_t>(n * E));
    for (Index i = 0; i < n; ++i) {
      for (Index e = 0; e < E; ++e) {
        bool nan = false, any = false;
        LD value = c.config.bias ? ld(c.b_O(e)) : 0;
        LD tol = 0, magnitude = std::fabs(value);
        for (Index h = 0; h < heads; ++h) {
          for (Index k = 0; k < hd; ++k) {
            const Expect& x = refs[static_cast<std::size_t>(h)].o(i, k);
            const LD w = ld(layer->W_O(h * hd + k, e));
            if (w == 0) continue;
            if (x.kind == Kind::NaN) nan = true;
            if (x.kind == Kind::Any || x.kind == Kind::Inf || x.kind == Kind::ValueOrNaN) {
              any = true;
            }
            value += x.value * w;
            tol += std::fabs(w) * x.tol;
            magnitude += std::fabs(x.value * w) + std::fabs(w) * x.tol;
          }
        }
        Expect& out = expected[static_cast<std::size_t>(i * E + e)];
        if (nan) {
          out = {Kind::NaN, 0, 0};
        } else if (any) {
          out = {Kind::Any, 0, 0};
        } else {
          out = {Kind::Value, value,
                 tol + 2 * (static_cast<LD>(E) + 3) * u * magnitude +
                     4 * static_cast<LD>(E) * pr.tiny};
        }
      }
    }
    const Eigen::Map<const attn::Matrix<T>> got(result.output.data() + b * n * E, n, E);
    Reference shape;
    shape.n = n;
    shape.rows.assign(static_cast<std::size_t>(n), RowClass::Regular);
    compare_matrix(f, path + " batch " + std::to_string(b), "output", got, expected, shape, E);
    // Weights: per head, or their average over heads.
    if (!c.options.need_weights) continue;
    if (!c.options.average_weights) {
      if (result.head_weights.dimension(0) != batch || result.head_weights.dimension(1) != heads ||
          result.head_weights.dimension(2) != n || result.head_weights.dimension(3) != m) {
        f.add(path, "head_weights have the wrong dimensions");
        return;
      }
      for (Index h = 0; h < heads; ++h) {
        const Eigen::Map<const attn::Matrix<T>> w(
            result.head_weights.data() + (b * heads + h) * n * m, n, m);
        compare_matrix(f, path + " batch " + std::to_string(b) + " head " + std::to_string(h),
                       "head_weights", w, refs[static_cast<std::size_t>(h)].weights,
                       refs[static_cast<std::size_t>(h)], m);
      }
      continue;
    }
    if (result.weights.dimension(0) != batch || result.weights.dimension(1) != n ||
        result.weights.dimension(2) != m) {
      f.add(path, "weights have the wrong dimensions");
      return;
    }
    std::vector<Expect> mean(static_cast<std::size_t>(n * m));
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < m; ++j) {
        bool nan = false, any = false;
        LD value = 0, tol = 0;
        for (Index h = 0; h < heads; ++h) {
          const Expect& x = refs[static_cast<std::size_t>(h)].weights[detail::at(i, j, m)];
          if (x.kind == Kind::NaN) nan = true;
          if (x.kind == Kind::Any || x.kind == Kind::ValueOrNaN) any = true;
          value += x.value;
          tol += x.tol;
        }
        const LD H = static_cast<LD>(heads);
        Expect& x = mean[detail::at(i, j, m)];
        if (nan) {
          x = {Kind::NaN, 0, 0};
        } else if (any) {
          x = {Kind::Any, 0, 0};
        } else {
          x = {Kind::Value, value / H, tol / H + 4 * (H + 1) * u * value / H + pr.tiny};
        }
      }
    }
    const Eigen::Map<const attn::Matrix<T>> w(result.weights.data() + b * n * m, n, m);
    compare_matrix(f, path + " batch " + std::to_string(b), "weights (head average)", w, mean,
                   shape, m);
  }
}

// ================================================================================================
// One case from bytes
// ================================================================================================

enum class CaseKind : std::uint8_t { Single, Heads, Cache, Mha };

inline CaseKind case_kind(std::uint8_t b) {
  const unsigned k = b % 16;
  if (k < 10) return CaseKind::Single;
  if (k < 12) return CaseKind::Heads;
  if (k < 14) return CaseKind::Cache;
  return CaseKind::Mha;
}

struct Outcome {
  std::string description;
  Failures failures;
};

/// Builds the case that `data` describes (its first byte chooses the kind), runs every path and
/// returns the failures with a description of the case.
template <class T>
Outcome run_case(const std::uint8_t* data, std::size_t size) {
  ByteSource bytes(data, size);
  Outcome out;
  const CaseKind kind = case_kind(bytes.byte());
  ++stats().cases[static_cast<int>(kind)];
  switch (kind) {
    case CaseKind::Single: {
      const SingleCase<T> c = make_single<T>(bytes);
      out.description = describe(c);
      check_single(c, out.failures);
      break;
    }
    case CaseKind::Heads: {
      const HeadsCase<T> c = make_heads<T>(bytes);
      out.description = describe(c);
      check_heads(c, out.failures);
      break;
    }
    case CaseKind::Cache: {
      const CacheCase<T> c = make_cache<T>(bytes);
      out.description = describe(c);
      check_cache(c, out.failures);
      break;
    }
    case CaseKind::Mha: {
      const MhaCase<T> c = make_mha<T>(bytes);
      out.description = describe(c);
      check_mha(c, out.failures);
      break;
    }
  }
  return out;
}

/// The description of the case that `data` describes, without running it (for inputs that crash
/// a sanitizer before any failure can be printed).
template <class T>
std::string describe_case(const std::uint8_t* data, std::size_t size) {
  ByteSource bytes(data, size);
  switch (case_kind(bytes.byte())) {
    case CaseKind::Single:
      return describe(make_single<T>(bytes));
    case CaseKind::Heads:
      return describe(make_heads<T>(bytes));
    case CaseKind::Cache:
      return describe(make_cache<T>(bytes));
    default:
      return describe(make_mha<T>(bytes));
  }
}

// ================================================================================================
// Shrinking a failing single-head case, and printing it as C++
// ================================================================================================

template <class T>
SingleCase<T> drop_query(const SingleCase<T>& c, Index i) {
  SingleCase<T> s = c;
  const Index n = c.Q.rows();
  const auto drop_row = [&](auto& M) {
    auto copy = M;
    M.resize(n - 1, copy.cols());
    M.topRows(i) = copy.topRows(i);
    M.bottomRows(n - 1 - i) = copy.bottomRows(n - 1 - i);
  };
  drop_row(s.Q);
  if (s.options.mask) drop_row(*s.options.mask);
  if (s.options.bias) drop_row(*s.options.bias);
  return s;
}

template <class T>
SingleCase<T> drop_key(const SingleCase<T>& c, Index j) {
  SingleCase<T> s = c;
  const Index m = c.K.rows();
  const auto drop_row = [&](auto& M) {
    auto copy = M;
    M.resize(m - 1, copy.cols());
    M.topRows(j) = copy.topRows(j);
    M.bottomRows(m - 1 - j) = copy.bottomRows(m - 1 - j);
  };
  const auto drop_col = [&](auto& M) {
    auto copy = M;
    M.resize(copy.rows(), m - 1);
    M.leftCols(j) = copy.leftCols(j);
    M.rightCols(m - 1 - j) = copy.rightCols(m - 1 - j);
  };
  drop_row(s.K);
  drop_row(s.V);
  if (s.options.mask) drop_col(*s.options.mask);
  if (s.options.bias) drop_col(*s.options.bias);
  return s;
}

template <class M>
void drop_col_of(M& X, Index k) {
  auto copy = X;
  X.resize(copy.rows(), copy.cols() - 1);
  X.leftCols(k) = copy.leftCols(k);
  X.rightCols(copy.cols() - 1 - k) = copy.rightCols(copy.cols() - 1 - k);
}

/// Greedy shrinking of a case that fails on `path`: fewer options, queries, keys and features, and
/// plainer values, while the path still fails.
template <class T>
SingleCase<T> shrink(SingleCase<T> c, const std::string& path, int budget = 4000) {
  c.placed.clear();  // their positions no longer hold once rows go
  const auto fails = [&](const SingleCase<T>& s) {
    if (--budget < 0) return false;
    Failures f;
    check_single(s, f, path);
    return !f.empty();
  };
  bool progress = true;
  while (progress && budget > 0) {
    progress = false;
    const auto attempt = [&](const SingleCase<T>& s) {
      if (fails(s)) {
        c = s;
        progress = true;
        return true;
      }
      return false;
    };
    // Options: the case without each one in turn.
    {
      const auto without = [&](auto field) {
        SingleCase<T> s = c;
        if (!(s.options.*field)) return;
        (s.options.*field).reset();
        attempt(s);
      };
      using Options = attn::AttentionOptions<T>;
      without(&Options::mask);
      without(&Options::bias);
      without(&Options::window);
      without(&Options::window_right);
      without(&Options::query_offset);
      without(&Options::scale);
      without(&Options::softcap);
      without(&Options::alibi_slope);
      without(&Options::sink);
      SingleCase<T> s = c;
      if (s.options.causal != attn::Causal::None) {
        s.options.causal = attn::Causal::None;
        attempt(s);
        s = c;
      }
      if (s.tiles.query_rows != attn::FlashTiles{}.query_rows ||
          s.tiles.key_cols != attn::FlashTiles{}.key_cols) {
        s.tiles = attn::FlashTiles{};
        attempt(s);
      }
    }
    // Halves first (big cases), then single rows.
    for (Index i = c.Q.rows(); i-- > 0;) {
      if (c.Q.rows() > 8 && i >= c.Q.rows() / 2) {
        SingleCase<T> s = c;
        while (s.Q.rows() > c.Q.rows() / 2) s = drop_query(s, s.Q.rows() - 1);
        if (attempt(s)) break;
      }
      if (i < c.Q.rows() && attempt(drop_query(c, i))) continue;
    }
    for (Index j = c.K.rows(); j-- > 0;) {
      if (c.K.rows() > 8 && j >= c.K.rows() / 2) {
        SingleCase<T> s = c;
        while (s.K.rows() > c.K.rows() / 2) s = drop_key(s, s.K.rows() - 1);
        if (attempt(s)) break;
      }
      if (j < c.K.rows() && attempt(drop_key(c, j))) continue;
    }
    for (Index k = c.Q.cols(); k-- > 0;) {
      if (c.Q.cols() <= 1) break;
      SingleCase<T> s = c;
      drop_col_of(s.Q, k);
      drop_col_of(s.K, k);
      attempt(s);
    }
    for (Index k = c.V.cols(); k-- > 0;) {
      if (c.V.cols() <= 1) break;
      SingleCase<T> s = c;
      drop_col_of(s.V, k);
      attempt(s);
    }
    // Plainer values: round every finite entry of one matrix to a small integer / 4.
    const auto plain = [&](attn::Matrix<T>& M) {
      for (Index k = 0; k < M.size(); ++k) {
        T& x = M.data()[k];
        if (std::isfinite(x) && std::fabs(x) < T(100)) x = std::round(x * T(4)) / T(4);
      }
    };
    for (int which = 0; which < 4; ++which) {
      SingleCase<T> s = c;
      attn::Matrix<T>* M = which == 0 ? &s.Q : which == 1 ? &s.K : which == 2 ? &s.V : nullptr;
      if (which == 3) {
        if (!s.options.bias) continue;
        M = &*s.options.bias;
      }
      const attn::Matrix<T> before = *M;
      plain(*M);
      if (!(before.array() == M->array()).all() && fails(s)) {
        c = s;
        progress = true;
      }
    }
  }
  return c;
}

template <class M>
std::string matrix_literal(const char* type, const char* name, const M& X) {
  std::ostringstream s;
  s << "  " << type << " " << name << "(" << X.rows() << ", " << X.cols() << ");";
  if (X.size() == 0) return s.str() + "\n";
  s << "\n  " << name << " <<";
  for (Index i = 0; i < X.rows(); ++i) {
    s << (i == 0 ? " " : ",\n     ");
    for (Index j = 0; j < X.cols(); ++j) {
      if (j > 0) s << ", ";
      if constexpr (std::is_same_v<typename M::Scalar, bool>) {
        s << (X(i, j) ? "1" : "0");
      } else {
        const std::string v = literal(X(i, j));
        if (v == "nan") {
          s << "NAN";
        } else if (v == "inf") {
          s << "INFINITY";
        } else if (v == "-inf") {
          s << "-INFINITY";
        } else {
          s << v;
        }
      }
    }
  }
  s << ";\n";
  return s.str();
}

/// The case as a C++ snippet, with the reference's expectation for the first failing entries.
template <class T>
std::string reproducer(const SingleCase<T>& c, const std::string& path) {
  const char* type = std::is_same_v<T, float> ? "attn::Matrix<float>" : "attn::Matrix<double>";
  const char* scalar = std::is_same_v<T, float> ? "float" : "double";
  std::ostringstream s;
  s << "  // " << describe(c) << "\n";
  s << matrix_literal(type, "Q", c.Q) << matrix_literal(type, "K", c.K)
    << matrix_literal(type, "V", c.V);
  s << "  attn::AttentionOptions<" << scalar << "> o;\n";
  s << "  o.causal = attn::Causal::" << causal_name(c.options.causal) << ";\n";
  if (c.options.window) s << "  o.window = " << *c.options.window << ";\n";
  if (c.options.window_right) s << "  o.window_right = " << *c.options.window_right << ";\n";
  if (c.options.query_offset) s << "  o.query_offset = " << *c.options.query_offset << ";\n";
  if (c.options.mask) {
    s << matrix_literal("attn::Mask", "mask", *c.options.mask) << "  o.mask = mask;\n";
  }
  if (c.options.bias) {
    s << matrix_literal(type, "bias", *c.options.bias) << "  o.bias = bias;\n";
  }
  if (c.options.scale) s << "  o.scale = " << literal(*c.options.scale) << ";\n";
  if (c.options.softcap) s << "  o.softcap = " << literal(*c.options.softcap) << ";\n";
  if (c.options.alibi_slope) s << "  o.alibi_slope = " << literal(*c.options.alibi_slope) << ";\n";
  if (c.options.sink) s << "  o.sink = " << literal(*c.options.sink) << ";\n";
  if (path.find("tiles") != std::string::npos) {
    s << "  attn::FlashTiles tiles{" << c.tiles.query_rows << ", " << c.tiles.key_cols << "};\n";
  }
  s << "  // path: " << path << "\n";
  Failures f;
  f.limit = 4;
  check_single(c, f, path);
  for (const Failure& x : f.list) s << "  // " << x.path << ": " << x.message << "\n";
  return s.str();
}

/// For a failing single-head case: its shrunk form for each failing path, as C++.
template <class T>
std::string shrunk_reproducers(const std::uint8_t* data, std::size_t size,
                               const Failures& failures) {
  ByteSource bytes(data, size);
  if (case_kind(bytes.byte()) != CaseKind::Single) return "";
  const SingleCase<T> c = make_single<T>(bytes);
  std::vector<std::string> done;
  std::string text;
  for (const Failure& x : failures.list) {
    std::string path = x.path;
    if (std::find(single_paths().begin(), single_paths().end(), path) == single_paths().end()) {
      continue;
    }
    if (std::find(done.begin(), done.end(), path) != done.end()) continue;
    done.push_back(path);
    text += "shrunk reproducer for " + path + ":\n" + reproducer(shrink(c, path), path);
  }
  return text;
}

}  // namespace attn_diff

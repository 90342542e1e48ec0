#pragma once
/// \file detail/stored.hpp
/// Keys and values kept in fewer bits than the compute type T (`KVStorage`): IEEE float16,
/// bfloat16, or int8 with one scale per row (symmetric: x ~ scale * q with q in -127 .. 127 and
/// scale = max |x| / 127). Rows are encoded once, when they are stored; the kernels widen them in
/// their registers (`load_stored`), so that a decoding step reads a half or a quarter of the bytes.
///
/// A codec is a tag type: `Same<T>` (no conversion), `Float16`, `BFloat16`, `Int8`, each naming the
/// type of its stored elements (`Bits`). `StoredBlock<Codec, T>` is a read-only view of rows in a
/// codec's format, with the subset of an Eigen block's interface the kernels use.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../types.hpp"

namespace attn {
namespace detail {

/// The codecs of `KVStorage` (tags; `Bits` is the stored element).
template <class T>
struct SameCodec {
  using Bits = T;
  static constexpr KVStorage format = KVStorage::Same;
};
struct Float16Codec {
  using Bits = Eigen::half;  ///< IEEE binary16
  static constexpr KVStorage format = KVStorage::Float16;
};
struct BFloat16Codec {
  using Bits = Eigen::bfloat16;  ///< the upper 16 bits of a float
  static constexpr KVStorage format = KVStorage::BFloat16;
};
struct Int8Codec {
  using Bits = std::int8_t;  ///< q in -127 .. 127; x = scale * q with one scale per row
  static constexpr KVStorage format = KVStorage::Int8;
};

template <class Codec>
constexpr bool has_row_scales = std::is_same_v<Codec, Int8Codec>;

/// Bytes of one stored element of `format` for compute type T.
template <class T>
constexpr Index element_bytes(KVStorage format) {
  switch (format) {
    case KVStorage::Float16:
    case KVStorage::BFloat16:
      return 2;
    case KVStorage::Int8:
      return 1;
    case KVStorage::Same:
      break;
  }
  return Index(sizeof(T));
}

/// The format's name in messages.
inline const char* storage_name(KVStorage format) {
  switch (format) {
    case KVStorage::Float16:
      return "KVStorage::Float16";
    case KVStorage::BFloat16:
      return "KVStorage::BFloat16";
    case KVStorage::Int8:
      return "KVStorage::Int8";
    case KVStorage::Same:
      break;
  }
  return "KVStorage::Same";
}

/// Calls f(codec) with the tag of `format` (each codec's code is instantiated once per caller).
template <class T, class F>
decltype(auto) with_codec(KVStorage format, F&& f) {
  switch (format) {
    case KVStorage::Float16:
      return f(Float16Codec{});
    case KVStorage::BFloat16:
      return f(BFloat16Codec{});
    case KVStorage::Int8:
      return f(Int8Codec{});
    case KVStorage::Same:
      break;
  }
  return f(SameCodec<T>{});
}

/// One stored element widened to T (exact: every stored value is a float).
template <class T>
T widen(SameCodec<T>, T x, T = T(1)) {
  return x;
}
template <class T>
T widen(Float16Codec, Eigen::half x, T = T(1)) {
  return T(static_cast<float>(x));
}
template <class T>
T widen(BFloat16Codec, Eigen::bfloat16 x, T = T(1)) {
  return T(static_cast<float>(x));
}
template <class T>
T widen(Int8Codec, std::int8_t q, T scale) {
  return scale * T(q);
}

/// Encodes one row of `cols` values: out[c] the stored element, *scale (Int8 only) the row's scale.
/// float16 and bfloat16 round to nearest even (float16 overflows to +-inf beyond 65504); int8
/// rounds x / scale to nearest. A row with a non-finite entry gets a non-finite int8 scale (the
/// whole row then reads as NaN or inf: int8 has no such values); a zero row gets scale 0.
template <class T>
void narrow_row(SameCodec<T>, const T* x, Index cols, T* out, T*) {
  std::copy(x, x + cols, out);
}
template <class T>
void narrow_row(Float16Codec, const T* x, Index cols, Eigen::half* out, T*) {
  for (Index c = 0; c < cols; ++c) out[c] = Eigen::half(static_cast<float>(x[c]));
}
template <class T>
void narrow_row(BFloat16Codec, const T* x, Index cols, Eigen::bfloat16* out, T*) {
  for (Index c = 0; c < cols; ++c) out[c] = Eigen::bfloat16(static_cast<float>(x[c]));
}

/// The largest |x_c| of a row of `cols` entries (0 for none), NaN if the row holds one: a NaN or
/// an infinity must reach an int8 scale (std::max would drop a NaN). Vectorised by Eigen.
template <class T>
T largest_magnitude(const T* x, Index cols) {
  if (cols == 0) return T(0);
  return Eigen::Map<const RowVector<T>>(x, cols)
      .cwiseAbs()
      .template maxCoeff<Eigen::PropagateNaN>();
}

template <class T>
void narrow_row(Int8Codec, const T* x, Index cols, std::int8_t* out, T* scale) {
  const T largest = largest_magnitude(x, cols);
  if (!(largest < std::numeric_limits<T>::infinity())) {  // NaN or inf in the row
    *scale = largest;
    std::fill(out, out + cols, std::int8_t(1));
    return;
  }
  *scale = largest / T(127);
  // At most the largest finite T: below about 3.7e-37 (float) 127 / largest is infinite, and a 0
  // entry times it NaN, which no clamp turns into an integer. Such a row's scale is subnormal or
  // 0, so it reads back as (about) 0 whatever its bytes.
  const T inverse =
      largest > T(0) ? std::min(T(127) / largest, std::numeric_limits<T>::max()) : T(0);
  // To nearest, ties to even (`rint`, as std::nearbyint), in one vectorised expression.
  const auto rounded = (Eigen::Map<const RowVector<T>>(x, cols) * inverse).array().rint();
  Eigen::Map<Eigen::Matrix<std::int8_t, 1, Eigen::Dynamic>>(out, cols) =
      rounded.cwiseMax(T(-127)).cwiseMin(T(127)).template cast<std::int8_t>().matrix();
}

/// Rows stored by `Codec`: row j at data() + j outerStride(), and for Int8 its scale at
/// scales()[j]. The kernels' view of a block of the cache.
template <class Codec, class T>
class StoredBlock {
 public:
  using Bits = typename Codec::Bits;
  StoredBlock(const Bits* data, Index rows, Index cols, Index stride, const T* scales)
      : data_(data), rows_(rows), cols_(cols), stride_(stride), scales_(scales) {}

  const Bits* data() const { return data_; }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  Index outerStride() const { return stride_; }
  /// Int8: one scale per row (null for the other codecs).
  const T* scales() const { return scales_; }
  T scale(Index j) const { return scales_ ? scales_[j] : T(1); }

  StoredBlock middleRows(Index first, Index count) const {
    return StoredBlock(data_ + first * stride_, count, cols_, stride_,
                       scales_ ? scales_ + first : nullptr);
  }

  /// Element (j, c) widened to T.
  T operator()(Index j, Index c) const {
    return widen<T>(Codec{}, data_[j * stride_ + c], scale(j));
  }

  /// The rows widened into `out` (resized to rows() x cols()), a packet at a time
  /// (`load_stored`).
  void widen_into(Matrix<T>& out) const;

 private:
  const Bits* data_;
  Index rows_, cols_, stride_;
  const T* scales_;
};

/// The codec of a block type: `StoredBlock`'s own, `SameCodec<T>` for Eigen blocks of T.
template <class Block, class T>
struct codec_of {
  using type = SameCodec<T>;
};
template <class Codec, class T>
struct codec_of<StoredBlock<Codec, T>, T> {
  using type = Codec;
};
template <class Block, class T>
using codec_of_t = typename codec_of<Block, T>::type;

/// Whether keys and values of scalar type S are read through a codec (a user's `Eigen::half` or
/// `Eigen::bfloat16` matrices), and which.
template <class S>
constexpr bool is_narrow_scalar_v =
    std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>;
template <class S>
using codec_for_t = std::conditional_t<std::is_same_v<S, Eigen::half>, Float16Codec, BFloat16Codec>;

/// Calls f(K, V) with the caller's K and V as the kernels take them: for T, as they are; for
/// `Eigen::half` or `Eigen::bfloat16`, as `StoredBlock`s of their rows (no copy when the rows are
/// contiguous, as in a row-major matrix; otherwise Eigen evaluates a row-major copy).
template <class T, class DK, class DV, class F>
decltype(auto) with_kv_blocks(const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                              F&& f) {
  using S = typename DK::Scalar;
  if constexpr (is_narrow_scalar_v<S>) {
    using Rows = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using Codec = codec_for_t<S>;
    const Eigen::Ref<const Rows> k(K.derived());
    const Eigen::Ref<const Rows> v(V.derived());
    return f(StoredBlock<Codec, T>(k.data(), k.rows(), k.cols(), k.outerStride(), nullptr),
             StoredBlock<Codec, T>(v.data(), v.rows(), v.cols(), v.outerStride(), nullptr));
  } else {
    return f(K, V);
  }
}

/// A block as the kernels take it: `StoredBlock`s as they are, Eigen expressions of T as one
/// `ConstRef<T>` type (one instantiation of the kernels for all of them).
template <class T, class Codec>
const StoredBlock<Codec, T>& kernel_block(const StoredBlock<Codec, T>& B) {
  return B;
}
template <class T>
ConstRef<T> kernel_block(ConstRef<T> B) {
  return B;
}

/// The packet type the decoding kernel computes in.
template <class T>
using StoredPacket = typename Eigen::internal::packet_traits<T>::type;

/// One packet of T from `lanes` stored elements at p (unaligned), widened in registers where the
/// instruction set has the conversion (AVX-512F: float16 by vcvtph2ps, bfloat16 by a 16-bit
/// shift, int8 by vpmovsxbd; AVX with F16C / AVX2 and SSE likewise), else element by element.
/// The int8 scale is not applied here (the kernels apply it once per row).
template <class T, class Codec>
EIGEN_STRONG_INLINE StoredPacket<T> load_stored(const typename Codec::Bits* p) {
  using Packet = StoredPacket<T>;
  constexpr Index lanes = Eigen::internal::packet_traits<T>::size;
  using Eigen::internal::ploadu;
  if constexpr (std::is_same_v<Codec, SameCodec<T>>) {
    return ploadu<Packet>(p);
  } else {
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (std::is_same_v<T, float> && lanes == 16) {  // Packet16f
      if constexpr (std::is_same_v<Codec, Float16Codec>) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      } else if constexpr (std::is_same_v<Codec, BFloat16Codec>) {
        const __m512i wide =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      } else {
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      }
    }
#endif
#if defined(EIGEN_VECTORIZE_AVX)
    if constexpr (std::is_same_v<T, float> && lanes == 8) {  // Packet8f
#if defined(__F16C__)
      if constexpr (std::is_same_v<Codec, Float16Codec>) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      }
#endif
#if defined(EIGEN_VECTORIZE_AVX2)
      if constexpr (std::is_same_v<Codec, BFloat16Codec>) {
        const __m256i wide =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
      } else if constexpr (std::is_same_v<Codec, Int8Codec>) {
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
      }
#endif
    }
#endif
#if defined(EIGEN_VECTORIZE_SSE2)
    if constexpr (std::is_same_v<T, float> && lanes == 4) {  // Packet4f
      if constexpr (std::is_same_v<Codec, BFloat16Codec>) {
        const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
        return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), bits));
      }
    }
#endif
    // Element by element (no conversion instruction for this packet).
    alignas(64) T widened[static_cast<std::size_t>(lanes)];
    for (Index i = 0; i < lanes; ++i) widened[i] = widen<T>(Codec{}, p[i], T(1));
    return Eigen::internal::pload<Packet>(widened);
  }
}

template <class Codec, class T>
void StoredBlock<Codec, T>::widen_into(Matrix<T>& out) const {
  constexpr Index lanes = Eigen::internal::packet_traits<T>::size;
  out.resize(rows_, cols_);
  for (Index j = 0; j < rows_; ++j) {
    const Bits* row = data_ + j * stride_;
    T* to = out.data() + j * out.outerStride();
    const T s = scale(j);
    Index c = 0;
    if constexpr (!std::is_same_v<Codec, SameCodec<T>>) {
      const auto factor = Eigen::internal::pset1<StoredPacket<T>>(s);
      for (; c + lanes <= cols_; c += lanes) {
        auto packet = load_stored<T, Codec>(row + c);
        if constexpr (has_row_scales<Codec>) packet = Eigen::internal::pmul(factor, packet);
        Eigen::internal::pstoreu(to + c, packet);
      }
    }
    for (; c < cols_; ++c) to[c] = widen<T>(Codec{}, row[c], s);
  }
}

/// The rows of one key or value head in a `KVStorage` format: what `KVStore` keeps per head.
/// Rows are written from T (`put`, encoded there) or copied as stored (`copy_row`, so that moving
/// rows never re-rounds them), and read through `block` as a `StoredBlock` (or, for `Same`, the
/// matrix itself).
template <class T>
class StoredRows {
 public:
  StoredRows(KVStorage format, Index rows, Index cols) : format_(format), cols_(cols) {
    resize(rows);
  }

  KVStorage format() const { return format_; }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

  /// Makes room for `rows` rows (the contents are lost).
  void resize(Index rows) {
    rows_ = rows;
    switch (format_) {
      case KVStorage::Same:
        same_.resize(rows, cols_);
        break;
      case KVStorage::Float16:
        half_.resize(rows, cols_);
        break;
      case KVStorage::BFloat16:
        bfloat16_.resize(rows, cols_);
        break;
      case KVStorage::Int8:
        bits8_.resize(rows, cols_);
        scales_.resize(rows);
        break;
    }
  }

  /// Stores row r from cols() contiguous values of T.
  void put(Index r, const T* x) {
    with_codec<T>(format_, [&](auto codec) {
      narrow_row<T>(codec, x, cols_, row_data(codec, r), scales_.data() + (scales_.size() ? r : 0));
    });
  }

  /// Copies row s of `from` (same format and width) to row r, as stored.
  void copy_row(Index r, const StoredRows& from, Index s) {
    with_codec<T>(format_, [&](auto codec) {
      const auto* src = from.row_data(codec, s);
      std::copy(src, src + cols_, row_data(codec, r));
    });
    if (format_ == KVStorage::Int8) scales_(r) = from.scales_(s);
  }

  /// Rows [first, first + count) as stored (`Codec` must be this format's).
  template <class Codec>
  StoredBlock<Codec, T> block(Index first, Index count) const {
    const T* scales = has_row_scales<Codec> ? scales_.data() + first : nullptr;
    return StoredBlock<Codec, T>(row_data(Codec{}, first), count, cols_, cols_, scales);
  }

  /// The matrix of a `Same` store.
  const Matrix<T>& same() const { return same_; }

  /// Bytes of the stored rows (elements and int8 scales).
  Index bytes() const {
    return rows_ * cols_ * element_bytes<T>(format_) +
           (format_ == KVStorage::Int8 ? rows_ * Index(sizeof(T)) : 0);
  }

 private:
  T* row_data(SameCodec<T>, Index r) { return same_.data() + r * cols_; }
  const T* row_data(SameCodec<T>, Index r) const { return same_.data() + r * cols_; }
  Eigen::half* row_data(Float16Codec, Index r) { return half_.data() + r * cols_; }
  const Eigen::half* row_data(Float16Codec, Index r) const { return half_.data() + r * cols_; }
  Eigen::bfloat16* row_data(BFloat16Codec, Index r) { return bfloat16_.data() + r * cols_; }
  const Eigen::bfloat16* row_data(BFloat16Codec, Index r) const {
    return bfloat16_.data() + r * cols_;
  }
  std::int8_t* row_data(Int8Codec, Index r) { return bits8_.data() + r * cols_; }
  const std::int8_t* row_data(Int8Codec, Index r) const { return bits8_.data() + r * cols_; }

  template <class S>
  using Rows = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  KVStorage format_;
  Index cols_;
  Index rows_ = 0;
  Matrix<T> same_;                  ///< Same
  Rows<Eigen::half> half_;          ///< Float16
  Rows<Eigen::bfloat16> bfloat16_;  ///< BFloat16
  Rows<std::int8_t> bits8_;         ///< Int8
  Vector<T> scales_;                ///< Int8: one per row
};

}  // namespace detail
}  // namespace attn

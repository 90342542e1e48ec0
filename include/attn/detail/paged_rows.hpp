#pragma once
/// \file detail/paged_rows.hpp
/// One sequence's rows of one key or value head in a pool of pages (`PagedKVCache`), as the
/// kernels read them: the decoding kernel reads each tile where its pages keep it (through a
/// stride within a page, through the rows' addresses across pages) with the arithmetic, and the
/// bits, of the same rows stored contiguously; the other paths run on the whole block gathered.

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../types.hpp"
#include "stored.hpp"

namespace attn {
namespace detail {

/// Rows of one key/value head of a sequence in a page pool: row j is the token at position
/// `first + j`, in slot `(first + j) % page_size` of page `pages[(first + j) / page_size]`. The
/// pool keeps, per page, `heads` blocks of `page_size` rows of `cols` elements stored by `Codec`
/// (and, for Int8, one scale per row in the same order).
template <class Codec, class T>
class PagedRows {
 public:
  using Bits = typename Codec::Bits;
  PagedRows(const Bits* pool, const T* scales, const int* pages, Index page_size, Index heads,
            Index head, Index first, Index rows, Index cols)
      : pool_(pool),
        scales_(scales),
        pages_(pages),
        page_size_(page_size),
        heads_(heads),
        head_(head),
        first_(first),
        rows_(rows),
        cols_(cols) {}

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

  PagedRows middleRows(Index first, Index count) const {
    PagedRows out = *this;
    out.first_ += first;
    out.rows_ = count;
    return out;
  }

  /// Calls `f(row, run, j)` for each stretch of rows [j0, j0 + count) within one page: `run` rows
  /// from row j on, the first at pool row `row` (the rest after it).
  template <class F>
  void runs(Index j0, Index count, F&& f) const {
    for (Index j = j0; j < j0 + count;) {
      const Index p = first_ + j;
      const Index slot = p % page_size_;
      const Index run = std::min(page_size_ - slot, j0 + count - j);
      f((Index(pages_[p / page_size_]) * heads_ + head_) * page_size_ + slot, run, j);
      j += run;
    }
  }

  /// Copies rows [j0, j0 + count) as stored into `out` (count rows of cols() elements, one after
  /// the other) and, for Int8, their scales into `out_scales`: one copy per page they span.
  void gather(Index j0, Index count, Bits* out, T* out_scales) const {
    runs(j0, count, [&](Index row, Index run, Index j) {
      std::copy(pool_ + row * cols_, pool_ + (row + run) * cols_, out + (j - j0) * cols_);
      if constexpr (has_row_scales<Codec>) {
        std::copy(scales_ + row, scales_ + row + run, out_scales + (j - j0));
      }
    });
  }

  /// Whether rows [j0, j0 + count) are in one page (then stored one after the other).
  bool in_one_page(Index j0, Index count) const {
    return count == 0 || (first_ + j0) % page_size_ + count <= page_size_;
  }

  /// The pool row of row j.
  Index pool_row(Index j) const {
    const Index p = first_ + j;
    return (Index(pages_[p / page_size_]) * heads_ + head_) * page_size_ + p % page_size_;
  }

  /// The stored elements of row j (the rows after it in its page follow, `cols()` apart).
  const Bits* row_at(Index j) const { return pool_ + pool_row(j) * cols_; }

  /// For Int8, the scale of row j (those of the rows after it in its page follow); null for the
  /// formats without scales.
  const T* scale_at(Index j) const { return scales_ ? scales_ + pool_row(j) : nullptr; }

  /// The addresses of rows [j0, j0 + count) in `at` and, for Int8, their scales in `scales`.
  void addresses(Index j0, Index count, const char** at, T* scales) const {
    runs(j0, count, [&](Index row, Index run, Index j) {
      const Bits* first = pool_ + row * cols_;
      for (Index i = 0; i < run; ++i) {
        at[j - j0 + i] = reinterpret_cast<const char*>(first + i * cols_);
      }
      if constexpr (has_row_scales<Codec>) {
        std::copy(scales_ + row, scales_ + row + run, scales + (j - j0));
      } else {
        static_cast<void>(scales);
      }
    });
  }

  /// The stored elements of pool row `row` (see `runs`).
  const Bits* row_data(Index row) const { return pool_ + row * cols_; }

 private:
  const Bits* pool_;
  const T* scales_;
  const int* pages_;
  Index page_size_, heads_, head_, first_, rows_, cols_;
};

template <class Codec, class T>
struct codec_of<PagedRows<Codec, T>, T> {
  using type = Codec;
};

/// Whether a block type is `PagedRows`.
template <class Block>
struct is_paged : std::false_type {};
template <class Codec, class T>
struct is_paged<PagedRows<Codec, T>> : std::true_type {};
template <class Block>
inline constexpr bool is_paged_v = is_paged<Block>::value;

/// The kernels take `PagedRows` as they come (the decoding kernel reads them tile by tile).
template <class T, class Codec>
const PagedRows<Codec, T>& kernel_block(const PagedRows<Codec, T>& B) {
  return B;
}

/// Where rows of `PagedRows` are gathered to (kept by a thread between calls): one buffer per
/// stored element type, grown to the largest block.
template <class T>
struct GatherBuffer {
  std::vector<T> same;
  std::vector<Eigen::half> half;
  std::vector<Eigen::bfloat16> bfloat16;
  std::vector<std::int8_t> bits8;
  std::vector<T> scales;

  template <class Bits>
  std::vector<Bits>& of() {
    if constexpr (std::is_same_v<Bits, T>) {
      return same;
    } else if constexpr (std::is_same_v<Bits, Eigen::half>) {
      return half;
    } else if constexpr (std::is_same_v<Bits, Eigen::bfloat16>) {
      return bfloat16;
    } else {
      return bits8;
    }
  }
};

/// Rows [j0, j0 + count) of `rows` gathered into `buffer`, as a contiguous block the kernels read:
/// a matrix view of T for `SameCodec`, a `StoredBlock` otherwise. Valid until the buffer's next
/// use.
template <class Codec, class T>
auto gathered(const PagedRows<Codec, T>& rows, Index j0, Index count, GatherBuffer<T>& buffer) {
  using Bits = typename Codec::Bits;
  std::vector<Bits>& bits = buffer.template of<Bits>();
  const auto size = static_cast<std::size_t>(count * rows.cols());
  if (bits.size() < size) bits.resize(size);
  if constexpr (has_row_scales<Codec>) {
    if (buffer.scales.size() < static_cast<std::size_t>(count)) {
      buffer.scales.resize(static_cast<std::size_t>(count));
    }
  }
  rows.gather(j0, count, bits.data(), buffer.scales.data());
  if constexpr (std::is_same_v<Codec, SameCodec<T>>) {
    return Eigen::Map<const Matrix<T>>(bits.data(), count, rows.cols());
  } else {
    return StoredBlock<Codec, T>(bits.data(), count, rows.cols(), rows.cols(),
                                 has_row_scales<Codec> ? buffer.scales.data() : nullptr);
  }
}

}  // namespace detail
}  // namespace attn

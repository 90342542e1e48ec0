#pragma once
/// \file kv_store.hpp
/// `KVStore`: the storage part of a key/value cache, with no attention in it. Rows are appended in
/// position order, each key/value head in its own contiguous block; with a window the recent rows
/// live in a ring buffer whose kept rows are always one contiguous block, and the first
/// `pinned_tokens` rows (StreamingLLM's attention sinks, Xiao et al. 2023) are kept forever.

#include <algorithm>
#include <optional>
#include <vector>

#include "error.hpp"
#include "types.hpp"

namespace attn {

/// The shape of a `KVStore`.
struct KVStoreShape {
  Index d_k = 0;                ///< width of one key head, >= 1
  Index d_v = 0;                ///< width of one value head, >= 1
  Index kv_heads = 1;           ///< key/value heads stored
  std::optional<Index> window;  ///< w >= 0: keep what a window of w keys before a query needs
  Index pinned_tokens = 0;      ///< with a window: the first k positions are kept forever
};

/// Keys and values of a growing sequence, by key/value head.
///
/// Positions: rows appended since construction (or `clear`) are counted (`position()`); row r of
/// an append of `r_new` rows is at position `position() + r`. Kept rows come in two contiguous
/// blocks per head: the pinned rows (positions 0 .. pinned_held() - 1) and the recent rows
/// (positions first_recent() .. position() - 1).
///
/// Memory per key/value head: without a window, every row (capacity doubles as needed); with a
/// window w, the pinned rows plus a ring of R = w + (largest append) rows, stored twice (each row is
/// written at slots s and s + R, so that the last R rows are always one contiguous block):
/// `pinned_tokens + 2 (w + largest append)` rows, whatever the sequence length.
template <class T>
class KVStore {
 public:
  /// \throws shape_error on a non-positive width or head count, or a negative window or pinned
  ///         count. Without a window nothing is dropped, so `pinned_tokens` is ignored (set to 0).
  /// \param function  the name errors give (the owner's, e.g. "KVCache")
  explicit KVStore(const KVStoreShape& shape, const char* function = "KVStore") : shape_(shape) {
    static_assert(detail::is_supported_scalar_v<T>, "attn works on floating-point scalars");
    detail::require_positive_size(function, "d_k", shape_.d_k);
    detail::require_positive_size(function, "d_v", shape_.d_v);
    detail::require_positive_size(function, "kv_heads", shape_.kv_heads);
    if (shape_.window && *shape_.window < 0) {
      detail::fail(function, "window must be >= 0, got ", *shape_.window);
    }
    if (shape_.pinned_tokens < 0) {
      detail::fail(function, "pinned_tokens must be >= 0, got ", shape_.pinned_tokens);
    }
    if (!shape_.window) shape_.pinned_tokens = 0;
    clear();
  }

  const KVStoreShape& shape() const { return shape_; }

  /// Rows kept: the pinned rows and the recent ones.
  Index size() const { return pinned_held() + recent_held(); }
  /// Rows appended since construction (or `clear`): the position of the next row.
  Index position() const { return total_; }
  /// Rows allocated per key/value head (pinned rows + ring or linear storage): the memory bound.
  Index capacity() const { return shape_.pinned_tokens + K_.front().rows(); }
  /// Pinned rows kept (positions 0 .. pinned_held() - 1).
  Index pinned_held() const { return std::min(total_, shape_.pinned_tokens); }
  /// Recent rows kept (positions first_recent() .. position() - 1).
  Index recent_held() const {
    return shape_.window ? std::min(recent_total(), ring_) : recent_total();
  }
  /// The position of the oldest kept recent row.
  Index first_recent() const { return total_ - recent_held(); }
  /// Whether rows between the pinned ones and the recent ones were dropped.
  bool dropped_any() const { return first_recent() > shape_.pinned_tokens; }

  /// Forgets every row (and releases the storage).
  void clear() {
    const auto heads = static_cast<std::size_t>(shape_.kv_heads);
    K_.assign(heads, Matrix<T>(0, shape_.d_k));
    V_.assign(heads, Matrix<T>(0, shape_.d_v));
    pinned_K_.assign(heads, Matrix<T>(shape_.pinned_tokens, shape_.d_k));
    pinned_V_.assign(heads, Matrix<T>(shape_.pinned_tokens, shape_.d_v));
    ring_ = 0;
    total_ = 0;
  }

  /// Appends r new positions.
  /// \param K_new  r x (kv_heads d_k), key heads side by side
  /// \param V_new  r x (kv_heads d_v)
  /// \throws shape_error on other shapes.
  void append(const detail::ConstRef<T>& K_new, const detail::ConstRef<T>& V_new) {
    if (K_new.cols() != shape_.kv_heads * shape_.d_k ||
        V_new.cols() != shape_.kv_heads * shape_.d_v || V_new.rows() != K_new.rows()) {
      detail::fail("KVStore::append", "K_new is ", detail::shape_of(K_new), " and V_new is ",
                   detail::shape_of(V_new), " but the store needs r x ",
                   shape_.kv_heads * shape_.d_k, " and r x ", shape_.kv_heads * shape_.d_v);
    }
    const Index r = K_new.rows();
    if (r == 0) return;
    // Room: a ring of w + r rows lets the r new queries see their whole windows.
    const Index recent_after = std::max<Index>(total_ + r - shape_.pinned_tokens, 0);
    if (shape_.window) {
      const Index needed = *shape_.window + r;
      if (needed > ring_) reallocate(needed, 2 * needed);
    } else if (recent_after > K_.front().rows()) {
      reallocate(0, std::max<Index>(recent_after, 2 * K_.front().rows()));
    }
    for (std::size_t h = 0; h < K_.size(); ++h) {
      const Index hk = static_cast<Index>(h) * shape_.d_k;
      const Index hv = static_cast<Index>(h) * shape_.d_v;
      for (Index i = 0; i < r; ++i) {
        const Index p = total_ + i;
        if (p < shape_.pinned_tokens) {
          pinned_K_[h].row(p) = K_new.row(i).segment(hk, shape_.d_k);
          pinned_V_[h].row(p) = V_new.row(i).segment(hv, shape_.d_v);
        } else {
          store(h, p - shape_.pinned_tokens, K_new.row(i).segment(hk, shape_.d_k),
                V_new.row(i).segment(hv, shape_.d_v));
        }
      }
    }
    total_ += r;
  }

  /// A view of rows of a stored row-major block.
  using View = Eigen::Map<const Matrix<T>>;

  /// The pinned keys of key/value head h: pinned_held() x d_k.
  View pinned_keys(Index h) const { return rows(pinned_K_[at(h)], 0, pinned_held()); }
  /// The pinned values of key/value head h: pinned_held() x d_v.
  View pinned_values(Index h) const { return rows(pinned_V_[at(h)], 0, pinned_held()); }
  /// The recent keys of key/value head h, oldest first: recent_held() x d_k.
  View recent_keys(Index h) const { return rows(K_[at(h)], recent_start(), recent_held()); }
  /// The recent values of key/value head h, oldest first: recent_held() x d_v.
  View recent_values(Index h) const { return rows(V_[at(h)], recent_start(), recent_held()); }

  /// The kept keys of head h, pinned rows first: size() x d_k (a copy).
  Matrix<T> keys(Index h) const { return joined(pinned_keys(h), recent_keys(h)); }
  /// The kept values of head h, pinned rows first: size() x d_v (a copy).
  Matrix<T> values(Index h) const { return joined(pinned_values(h), recent_values(h)); }

  /// The absolute position of each kept row, pinned rows first.
  std::vector<Index> positions() const {
    std::vector<Index> out;
    for (Index p = 0; p < pinned_held(); ++p) out.push_back(p);
    for (Index p = first_recent(); p < total_; ++p) out.push_back(p);
    return out;
  }

 private:
  std::size_t at(Index h) const {
    if (h < 0 || h >= shape_.kv_heads) {
      detail::fail("KVStore", "kv_head must be in 0 .. ", shape_.kv_heads - 1, ", got ", h);
    }
    return static_cast<std::size_t>(h);
  }

  static View rows(const Matrix<T>& storage, Index first, Index count) {
    return View(storage.data() + first * storage.cols(), count, storage.cols());
  }

  static Matrix<T> joined(const View& a, const View& b) {
    Matrix<T> out(a.rows() + b.rows(), a.cols());
    out.topRows(a.rows()) = a;
    out.bottomRows(b.rows()) = b;
    return out;
  }

  // Positions < k (= pinned_tokens, only with a window) live in pinned_K_/pinned_V_; the others
  // in K_/V_: linear without a window (row q = position - k), a ring of R = ring_ rows with one
  // (position at slot q % R and again at slot q % R + R).
  Index recent_total() const { return std::max<Index>(total_ - shape_.pinned_tokens, 0); }
  /// First storage row of the contiguous block of kept recent rows.
  Index recent_start() const {
    return shape_.window && ring_ > 0 ? (recent_total() - recent_held()) % ring_ : 0;
  }

  /// Moves the kept recent rows into storage of the given size (ring: 2 R rows; linear: rows).
  void reallocate(Index new_ring, Index new_rows) {
    const Index start = recent_start();
    const Index kept = recent_held();
    const Index first = recent_total() - kept;  // recent index of the first kept row
    for (std::size_t h = 0; h < K_.size(); ++h) {
      const Matrix<T> old_K = K_[h].middleRows(start, kept);
      const Matrix<T> old_V = V_[h].middleRows(start, kept);
      K_[h].resize(new_rows, shape_.d_k);
      V_[h].resize(new_rows, shape_.d_v);
      ring_ = new_ring;
      for (Index i = 0; i < kept; ++i) store(h, first + i, old_K.row(i), old_V.row(i));
    }
    ring_ = new_ring;
  }

  /// Writes recent row q (position k + q) of head h.
  template <class RK, class RV>
  void store(std::size_t h, Index q, const RK& k_row, const RV& v_row) {
    if (shape_.window) {
      const Index slot = q % ring_;
      K_[h].row(slot) = k_row;
      K_[h].row(slot + ring_) = k_row;
      V_[h].row(slot) = v_row;
      V_[h].row(slot + ring_) = v_row;
    } else {
      K_[h].row(q) = k_row;
      V_[h].row(q) = v_row;
    }
  }

  KVStoreShape shape_;
  std::vector<Matrix<T>> K_, V_;                ///< per key/value head: ring (2 R rows) or linear
  std::vector<Matrix<T>> pinned_K_, pinned_V_;  ///< per key/value head: pinned_tokens rows
  Index ring_ = 0;                              ///< R, the ring's length (with a window)
  Index total_ = 0;                             ///< rows appended
};

}  // namespace attn

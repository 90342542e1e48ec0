#pragma once
/// \file kv_store.hpp
/// `KVStore`: the storage part of a key/value cache, with no attention in it. Rows are appended in
/// position order, each key/value head in its own contiguous block; with a window the recent rows
/// live in a ring buffer whose kept rows are always one contiguous block, and the first
/// `pinned_tokens` rows (StreamingLLM's attention sinks, Xiao et al. 2023) are kept forever.

#include <algorithm>
#include <optional>
#include <vector>

#include "detail/checked.hpp"
#include "detail/stored.hpp"
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
  KVStorage storage = KVStorage::Same;  ///< the format rows are kept in (encoded at append)
};

/// Keys and values of a growing sequence, by key/value head.
///
/// Positions: rows appended since construction (or `clear`) are counted (`position()`); row r of
/// an append of `r_new` rows is at position `position() + r`. Kept rows come in two contiguous
/// blocks per head: the pinned rows (positions 0 .. pinned_held() - 1) and the recent rows
/// (positions first_recent() .. position() - 1).
///
/// Memory per key/value head: without a window, every row (capacity doubles as needed); with a
/// window w, the pinned rows plus a ring of R rows stored twice (each row is written at slots s and
/// s + R, so that the last R rows are always one contiguous block). The ring grows with the
/// sequence (doubling, never past w + the largest append): at most
/// `pinned_tokens + 2 min(w + largest append, 2 (rows appended))` rows, whatever the window. Each row takes
/// `d sizeof(T)` bytes with `KVStorage::Same`, `2 d` with Float16 or BFloat16, `d + sizeof(T)` with
/// Int8 (its scale); `bytes()` is the total.
template <class T>
class KVStore {
 public:
  /// An empty store of the given shape. Without a window nothing is dropped, so `pinned_tokens`
  /// is ignored (set to 0).
  /// \param shape     widths, head count, window, pinned tokens and storage format
  /// \param function  the name errors give (the owner's, e.g. "KVCache")
  /// \throws shape_error on a non-positive width or head count, or a negative window or pinned
  ///         count, or pinned rows that cannot be allocated.
  explicit KVStore(const KVStoreShape& shape, const char* function = "KVStore")
      : shape_(shape), function_(function) {
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

  /// The shape, with `pinned_tokens` as the store applies it (0 without a window).
  /// \returns the shape
  const KVStoreShape& shape() const { return shape_; }

  /// Rows kept: the pinned rows and the recent ones.
  /// \returns pinned_held() + recent_held()
  Index size() const { return pinned_held() + recent_held(); }
  /// Rows appended since construction (or `clear`): the position of the next row.
  /// \returns the count
  Index position() const { return total_; }
  /// Rows allocated per key/value head (pinned rows + ring or linear storage): the memory bound.
  /// \returns the count
  Index capacity() const { return shape_.pinned_tokens + K_.front().rows(); }
  /// Bytes of the stored keys and values (every allocated row, int8 scales included).
  /// \returns the count
  Index bytes() const {
    Index total = 0;
    for (const auto* blocks : {&K_, &V_, &pinned_K_, &pinned_V_}) {
      for (const detail::StoredRows<T>& b : *blocks) total += b.bytes();
    }
    return total;
  }
  /// The bytes `tokens` kept rows take in a store of this shape (keys and values of every head):
  /// what `bytes()` reports after one append of `tokens` rows to a store without a window.
  /// \param shape     the store's shape (its window is not applied)
  /// \param tokens    kept rows, >= 0
  /// \param function  the name errors give
  /// \returns the count
  /// \throws shape_error when the count does not fit in Index (or `tokens` < 0).
  static Index bytes_for(const KVStoreShape& shape, Index tokens,
                         const char* function = "KVStore::bytes_for") {
    if (tokens < 0) detail::fail(function, "tokens must be >= 0, got ", tokens);
    const Index scale = shape.storage == KVStorage::Int8 ? 2 * Index(sizeof(T)) : 0;
    const Index width = detail::checked_add(function, shape.d_k, shape.d_v, "d_k + d_v");
    const Index per_head = detail::checked_add(
        function, detail::checked_mul(function, width, detail::element_bytes<T>(shape.storage)),
        scale);
    return detail::checked_mul(
        function,
        detail::checked_mul(function, tokens, shape.kv_heads, "the bytes of", tokens, "tokens"),
        per_head, "the bytes of", tokens, "tokens");
  }
  /// Pinned rows kept (positions 0 .. pinned_held() - 1).
  /// \returns the count
  Index pinned_held() const { return std::min(total_, shape_.pinned_tokens); }
  /// Recent rows kept (positions first_recent() .. position() - 1).
  /// \returns the count
  Index recent_held() const {
    return shape_.window ? std::min(recent_total(), ring_) : recent_total();
  }
  /// The position of the oldest kept recent row.
  /// \returns position() - recent_held()
  Index first_recent() const { return total_ - recent_held(); }
  /// Whether rows between the pinned ones and the recent ones were dropped.
  /// \returns true when first_recent() is past the pinned positions
  bool dropped_any() const { return first_recent() > shape_.pinned_tokens; }

  /// Forgets every row (and releases the storage).
  void clear() {
    const auto heads = static_cast<std::size_t>(shape_.kv_heads);
    std::vector<detail::StoredRows<T>> pinned_K = allocate(shape_.pinned_tokens, shape_.d_k);
    std::vector<detail::StoredRows<T>> pinned_V = allocate(shape_.pinned_tokens, shape_.d_v);
    const KVStorage format = shape_.storage;
    K_.assign(heads, detail::StoredRows<T>(format, 0, shape_.d_k));
    V_.assign(heads, detail::StoredRows<T>(format, 0, shape_.d_v));
    pinned_K_ = std::move(pinned_K);
    pinned_V_ = std::move(pinned_V);
    ring_ = 0;
    largest_append_ = 0;
    total_ = 0;
  }

  /// Appends r new positions.
  /// \param K_new  r x (kv_heads d_k), key heads side by side
  /// \param V_new  r x (kv_heads d_v)
  /// \throws shape_error on other shapes, or when the storage the rows need cannot be allocated
  ///         (the store is then unchanged).
  void append(const detail::ConstRef<T>& K_new, const detail::ConstRef<T>& V_new) {
    if (K_new.cols() != shape_.kv_heads * shape_.d_k ||
        V_new.cols() != shape_.kv_heads * shape_.d_v || V_new.rows() != K_new.rows()) {
      detail::fail("KVStore::append", "K_new is ", detail::shape_of(K_new), " and V_new is ",
                   detail::shape_of(V_new), " but the store needs r x ",
                   shape_.kv_heads * shape_.d_k, " and r x ", shape_.kv_heads * shape_.d_v);
    }
    const Index r = K_new.rows();
    if (r == 0) return;
    // Room: a ring of w + (largest append) rows lets the r new queries see their whole windows
    // (and keeps what the largest append's queries would). It grows with the sequence, doubling,
    // so that a long window costs nothing until the tokens come; while it grows it holds every
    // recent row, so which rows are kept does not depend on it.
    const Index recent_after = std::max<Index>(
        detail::checked_add("KVStore::append", total_, r, "the positions") - shape_.pinned_tokens,
        0);
    if (shape_.window) {
      largest_append_ = std::max(largest_append_, r);
      const Index full = detail::saturating_add(*shape_.window, largest_append_);
      if (ring_ < std::min(full, recent_after)) {
        const Index ring =
            std::min(full, std::max(recent_after, detail::saturating_add(ring_, ring_)));
        reallocate(ring, detail::checked_mul(function_, ring, 2, "the ring's rows"));
      }
    } else if (recent_after > K_.front().rows()) {
      reallocate(
          0, std::max(recent_after, detail::saturating_add(K_.front().rows(), K_.front().rows())));
    }
    for (std::size_t h = 0; h < K_.size(); ++h) {
      const Index hk = static_cast<Index>(h) * shape_.d_k;
      const Index hv = static_cast<Index>(h) * shape_.d_v;
      for (Index i = 0; i < r; ++i) {
        const Index p = total_ + i;
        const T* k_row = K_new.data() + i * K_new.outerStride() + hk;
        const T* v_row = V_new.data() + i * V_new.outerStride() + hv;
        if (p < shape_.pinned_tokens) {
          pinned_K_[h].put(p, k_row);
          pinned_V_[h].put(p, v_row);
        } else {
          store(h, p - shape_.pinned_tokens, k_row, v_row);
        }
      }
    }
    total_ += r;
  }

  /// A view of rows of a stored row-major block of T.
  using View = Eigen::Map<const Matrix<T>>;

  /// The pinned keys of key/value head h (`KVStorage::Same` only; any format: `keys`, or the
  /// kernels' `pinned_keys_as`).
  /// \param h  0 to kv_heads - 1
  /// \returns pinned_held() x d_k, a view into the store
  View pinned_keys(Index h) const { return rows(pinned_K_[at(h)], 0, pinned_held()); }
  /// The pinned values of key/value head h (`Same` only).
  /// \param h  0 to kv_heads - 1
  /// \returns pinned_held() x d_v, a view into the store
  View pinned_values(Index h) const { return rows(pinned_V_[at(h)], 0, pinned_held()); }
  /// The recent keys of key/value head h, oldest first (`Same` only).
  /// \param h  0 to kv_heads - 1
  /// \returns recent_held() x d_k, a view into the store
  View recent_keys(Index h) const { return rows(K_[at(h)], recent_start(), recent_held()); }
  /// The recent values of key/value head h, oldest first (`Same` only).
  /// \param h  0 to kv_heads - 1
  /// \returns recent_held() x d_v, a view into the store
  View recent_values(Index h) const { return rows(V_[at(h)], recent_start(), recent_held()); }

  /// The pinned keys of key/value head h as the kernels read them, for the store's own format
  /// `Codec` (detail/stored.hpp): a `View` for `Same`, a `detail::StoredBlock` otherwise.
  /// \param h  0 to kv_heads - 1
  /// \returns pinned_held() x d_k, a view into the store
  template <class Codec>
  auto pinned_keys_as(Index h) const {
    return block<Codec>(pinned_K_[at(h)], 0, pinned_held());
  }
  /// The pinned values of key/value head h as the kernels read them (see `pinned_keys_as`).
  /// \param h  0 to kv_heads - 1
  /// \returns pinned_held() x d_v, a view into the store
  template <class Codec>
  auto pinned_values_as(Index h) const {
    return block<Codec>(pinned_V_[at(h)], 0, pinned_held());
  }
  /// The recent keys of key/value head h as the kernels read them (see `pinned_keys_as`).
  /// \param h  0 to kv_heads - 1
  /// \returns recent_held() x d_k, a view into the store
  template <class Codec>
  auto recent_keys_as(Index h) const {
    return block<Codec>(K_[at(h)], recent_start(), recent_held());
  }
  /// The recent values of key/value head h as the kernels read them (see `pinned_keys_as`).
  /// \param h  0 to kv_heads - 1
  /// \returns recent_held() x d_v, a view into the store
  template <class Codec>
  auto recent_values_as(Index h) const {
    return block<Codec>(V_[at(h)], recent_start(), recent_held());
  }

  /// The kept keys of head h, pinned rows first, widened to T (a copy).
  /// \param h  0 to kv_heads - 1
  /// \returns size() x d_k
  Matrix<T> keys(Index h) const { return joined(pinned_K_[at(h)], K_[at(h)]); }
  /// The kept values of head h, pinned rows first, widened to T (a copy).
  /// \param h  0 to kv_heads - 1
  /// \returns size() x d_v
  Matrix<T> values(Index h) const { return joined(pinned_V_[at(h)], V_[at(h)]); }

  /// The absolute position of each kept row, pinned rows first.
  /// \returns size() positions
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

  View rows(const detail::StoredRows<T>& storage, Index first, Index count) const {
    if (shape_.storage != KVStorage::Same) {
      detail::fail("KVStore", "the views of rows need KVStorage::Same; this store keeps ",
                   detail::storage_name(shape_.storage), " (keys() and values() widen a copy)");
    }
    return View(storage.same().data() + first * storage.cols(), count, storage.cols());
  }

  template <class Codec>
  static auto block(const detail::StoredRows<T>& storage, Index first, Index count) {
    if constexpr (std::is_same_v<Codec, detail::SameCodec<T>>) {
      return View(storage.same().data() + first * storage.cols(), count, storage.cols());
    } else {
      return storage.template block<Codec>(first, count);
    }
  }

  /// The pinned rows then the recent rows of one head's pinned and recent storage, widened.
  Matrix<T> joined(const detail::StoredRows<T>& pinned, const detail::StoredRows<T>& recent) const {
    Matrix<T> a, b;
    detail::with_codec<T>(shape_.storage, [&](auto codec) {
      using Codec = decltype(codec);
      widen_block(block<Codec>(pinned, 0, pinned_held()), a);
      widen_block(block<Codec>(recent, recent_start(), recent_held()), b);
    });
    Matrix<T> out(a.rows() + b.rows(), pinned.cols());
    out.topRows(a.rows()) = a;
    out.bottomRows(b.rows()) = b;
    return out;
  }
  static void widen_block(const View& v, Matrix<T>& out) { out = v; }
  template <class Codec>
  static void widen_block(const detail::StoredBlock<Codec, T>& v, Matrix<T>& out) {
    v.widen_into(out);
  }

  // Positions < k (= pinned_tokens, only with a window) live in pinned_K_/pinned_V_; the others
  // in K_/V_: linear without a window (row q = position - k), a ring of R = ring_ rows with one
  // (position at slot q % R and again at slot q % R + R).
  Index recent_total() const { return std::max<Index>(total_ - shape_.pinned_tokens, 0); }
  /// First storage row of the contiguous block of kept recent rows.
  Index recent_start() const {
    return shape_.window && ring_ > 0 ? (recent_total() - recent_held()) % ring_ : 0;
  }

  /// One block of `rows` x `cols` per key/value head, or a shape_error naming the sizes (and
  /// nothing changed) when that does not fit in memory.
  std::vector<detail::StoredRows<T>> allocate(Index rows, Index cols) const {
    const Index heads = shape_.kv_heads;
    const Index bytes = detail::checked_mul(
        function_,
        detail::checked_mul(function_,
                            detail::checked_mul(function_, heads, rows, "the storage of"), cols,
                            "the storage of"),
        detail::element_bytes<T>(shape_.storage), "the storage of");
    try {
      return std::vector<detail::StoredRows<T>>(static_cast<std::size_t>(heads),
                                                detail::StoredRows<T>(shape_.storage, rows, cols));
    } catch (const std::bad_alloc&) {
      detail::fail(function_, "cannot allocate ", heads, " x ", rows, " rows of ", cols, " ",
                   detail::storage_name(shape_.storage), " values (", bytes, " bytes; window ",
                   shape_.window ? *shape_.window : -1, ", pinned_tokens ", shape_.pinned_tokens,
                   ")");
    }
  }

  /// Moves the kept recent rows into storage of the given size (ring: 2 R rows; linear: rows).
  /// Everything is allocated before anything moves: on failure the store is unchanged.
  void reallocate(Index new_ring, Index new_rows) {
    std::vector<detail::StoredRows<T>> K = allocate(new_rows, shape_.d_k);
    std::vector<detail::StoredRows<T>> V = allocate(new_rows, shape_.d_v);
    const Index start = recent_start();
    const Index kept = recent_held();
    const Index first = recent_total() - kept;  // recent index of the first kept row
    ring_ = new_ring;                           // slots() of the new storage
    for (std::size_t h = 0; h < K_.size(); ++h) {
      for (Index i = 0; i < kept; ++i) {
        const Slots at = slots(first + i);
        for (const Index slot : {at.first, at.second}) {
          if (slot < 0) continue;
          K[h].copy_row(slot, K_[h], start + i);
          V[h].copy_row(slot, V_[h], start + i);
        }
      }
    }
    K_ = std::move(K);
    V_ = std::move(V);
  }

  /// The storage rows of recent row q (position k + q): q without a window; in the ring, slot
  /// q % R and again slot q % R + R.
  struct Slots {
    Index first, second;  ///< second < 0: none
  };
  Slots slots(Index q) const {
    if (!shape_.window) return {q, -1};
    return {q % ring_, q % ring_ + ring_};
  }

  /// Writes recent row q (position k + q) of head h (encoded once, copied to its second slot).
  void store(std::size_t h, Index q, const T* k_row, const T* v_row) {
    const Slots at = slots(q);
    K_[h].put(at.first, k_row);
    V_[h].put(at.first, v_row);
    if (at.second >= 0) {
      K_[h].copy_row(at.second, K_[h], at.first);
      V_[h].copy_row(at.second, V_[h], at.first);
    }
  }

  KVStoreShape shape_;
  const char* function_;                      ///< the name errors give
  std::vector<detail::StoredRows<T>> K_, V_;  ///< per key/value head: ring (2 R rows) or linear
  std::vector<detail::StoredRows<T>> pinned_K_, pinned_V_;  ///< per key/value head: pinned rows
  Index ring_ = 0;            ///< R, the ring's length (with a window)
  Index largest_append_ = 0;  ///< the most rows one append brought (the ring's full length - w)
  Index total_ = 0;           ///< rows appended
};

}  // namespace attn

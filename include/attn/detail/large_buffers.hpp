#pragma once
/// \file detail/large_buffers.hpp
/// The layer's large buffers (its workspace and the results it returns) resized with the
/// operating system asked to back them with 2 MiB pages (Linux's transparent huge pages,
/// `madvise(MADV_HUGEPAGE)`, before their first touch); a hint, nothing else changes, and nothing
/// at all where the system has no such advice.
///
/// Why: where page faults are costly (virtual machines), a program that returns a large block to
/// the system (`free` of 32 MiB, as a result of `MultiHeadAttention::forward` at (8, 2048, 512) is
/// when its owner drops it) could make the next touch of every other 4 KiB page fault again, even
/// of memory touched before (`bench/page_return.cpp`); memory in 2 MiB pages did not. The layer's
/// workspace is 4 such blocks (see docs/benchmarks.md).

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../types.hpp"

namespace attn {
namespace detail {

/// The size of a transparent huge page on x86-64 and on most 64-bit Arm kernels.
inline constexpr std::size_t huge_page_bytes = std::size_t(2) << 20;

/// Buffers from this size on are advised (two huge pages: at least one lies wholly inside).
inline constexpr std::size_t large_buffer_bytes = 2 * huge_page_bytes;

/// Asks for 2 MiB pages on the whole huge pages inside [data, data + bytes). Only pages not yet
/// touched take them; a failure (no transparent huge pages) is ignored, as a hint may be.
inline void advise_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const std::uintptr_t begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t mask = ~std::uintptr_t(huge_page_bytes - 1);
  const std::uintptr_t first = (begin + huge_page_bytes - 1) & mask;
  const std::uintptr_t last = (begin + bytes) & mask;
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

/// `buffer.resize(dims...)` for an Eigen matrix or tensor of arithmetic scalars (whose resize
/// allocates without touching the memory); with `advise`, new storage of `large_buffer_bytes` or
/// more is advised as above. Eigen reallocates exactly when the number of entries changes.
template <class Buffer, class... Dims>
void resize_large(Buffer& buffer, bool advise, Dims... dims) {
  const Index before = Index(buffer.size());
  buffer.resize(dims...);
  const std::size_t bytes = std::size_t(buffer.size()) * sizeof(*buffer.data());
  if (advise && Index(buffer.size()) != before && bytes >= large_buffer_bytes) {
    advise_huge_pages(buffer.data(), bytes);
  }
}

}  // namespace detail
}  // namespace attn

#pragma once
/// \file threads.hpp
/// The thread count of `attn`'s parallel loops. Threads are opt-in: compiled with OpenMP (link the
/// CMake target `attn::openmp`, which adds OpenMP::OpenMP_CXX, i.e. `-fopenmp`) the tiled kernels
/// run in parallel; with plain `attn::attn` (no compile flag) they run serially, `num_threads()`
/// is 1 and `set_num_threads` only records the number. Results are identical bit for bit whatever
/// the thread count: every output row is computed by one thread in a fixed order.

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "types.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attn {
namespace detail {
inline int& thread_setting() {
  static int threads = 0;  // 0 = OpenMP's default (omp_get_max_threads)
  return threads;
}
}  // namespace detail

/// Sets how many threads `attn` uses; 0 restores OpenMP's default (such as OMP_NUM_THREADS).
/// \param threads  the count, or 0 for the default (a negative count counts as 0)
inline void set_num_threads(int threads) { detail::thread_setting() = threads < 0 ? 0 : threads; }

/// How many threads `attn`'s parallel loops use (1 without OpenMP).
/// \returns the count, at least 1
inline int num_threads() {
#ifdef _OPENMP
  return detail::thread_setting() > 0 ? detail::thread_setting() : omp_get_max_threads();
#else
  return 1;
#endif
}

namespace detail {
/// The calling thread's list of functions that free its kept buffers, one per kind of buffer,
/// added when the thread first uses that kind (`thread_buffer`).
inline std::vector<void (*)()>& thread_releasers() {
  static thread_local std::vector<void (*)()> releasers;
  return releasers;
}

/// The calling thread's buffer of kind `Tag` (one tag type per use site), default-constructed on
/// first use and kept between calls, so that a repeated call of the same shapes allocates
/// nothing; `release_thread_buffers` puts a fresh one in its place. Inside a parallel loop this
/// is each worker's own buffer.
template <class Tag, class Buffer>
Buffer& thread_buffer() {
  static thread_local Buffer buffer{};
  static thread_local bool listed = false;
  if (!listed) {
    listed = true;
    thread_releasers().push_back([] { thread_buffer<Tag, Buffer>() = Buffer{}; });
  }
  return buffer;
}
}  // namespace detail

/// Frees the working memory attn keeps between calls for the calling thread and, with OpenMP,
/// for the threads of a `num_threads()` team (packed keys, score tables, decoding parts, the
/// layer's workspace): each grows to the largest call a thread has made and is otherwise kept
/// until the thread ends. The next call allocates again. Call it between attn calls, for example
/// after a long prompt, in a program that runs for long; other threads' buffers are not touched.
inline void release_thread_buffers() {
  const auto release_own = [] {
    for (void (*release)() : detail::thread_releasers()) release();
  };
#ifdef _OPENMP
  const int threads = num_threads();
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    release_own();
    return;
  }
#endif
  release_own();
}

namespace detail {

#ifdef _OPENMP
/// Sets the calling task's OpenMP thread count (`omp_set_num_threads`, the count Eigen's GEMM
/// reads) to 1 for a scope and restores it when the scope ends, so that Eigen's GEMM runs serially
/// inside: it would otherwise parallelise, with other rounding. Only this task's setting changes.
class SerialEigen {
 public:
  SerialEigen() : before_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SerialEigen() { omp_set_num_threads(before_); }
  SerialEigen(const SerialEigen&) = delete;
  SerialEigen& operator=(const SerialEigen&) = delete;

 private:
  int before_;
};
#endif

/// A `Scratch` the calling thread keeps between calls, as a `parallel_for` scratch: constructing
/// one borrows the thread's own (grown by its earlier calls, so that a repeated call of the same
/// shapes allocates nothing), or, while the thread's own is borrowed (a loop inside a loop), owns
/// a fresh one. For small scratch only (what a thread keeps stays allocated until it ends).
template <class Scratch>
class KeptScratch {
 public:
  KeptScratch() : borrowed_(!borrowed()) {
    if (borrowed_) {
      borrowed() = true;
    } else {
      fresh_.emplace();
    }
  }
  ~KeptScratch() {
    if (borrowed_) borrowed() = false;
  }
  KeptScratch(const KeptScratch&) = delete;
  KeptScratch& operator=(const KeptScratch&) = delete;

  Scratch& get() { return borrowed_ ? kept() : *fresh_; }

 private:
  static Scratch& kept() { return thread_buffer<KeptScratch, Scratch>(); }
  static bool& borrowed() {
    static thread_local bool taken = false;
    return taken;
  }

  bool borrowed_;
  std::optional<Scratch> fresh_;
};

/// Runs `body(i, scratch)` for i in [0, count) on the calling thread, with one default-constructed
/// `Scratch` and Eigen's GEMM serial (`SerialEigen`), as one thread of `parallel_for` would.
template <class Scratch, class Body>
void serial_for(Index count, Body& body) {
#ifdef _OPENMP
  const SerialEigen serial;
#endif
  Scratch scratch{};
  for (Index i = 0; i < count; ++i) body(i, scratch);
}

/// The threads a loop of `count` items runs on: `num_threads()`, at most one per item, at least 1.
inline Index team_threads(Index count) {
  return std::clamp<Index>(num_threads(), 1, std::max<Index>(count, 1));
}

/// Runs `body(i, scratch)` for i in [0, count), in parallel over `num_threads()` threads when
/// OpenMP is on, with one default-constructed `Scratch` per thread. Each i runs entirely on one
/// thread, so a body whose result depends only on i gives the same bits whatever the thread count;
/// Eigen's own GEMM runs serially inside (`SerialEigen`), which keeps its results independent of
/// the thread count too. Where one thread is to run (one thread asked for, or one item), the loop
/// runs on the calling thread without entering a team: even a team of one thread costs two
/// wake-up system calls per call, a large part of a short decoding step (see docs/benchmarks.md).
/// `body` must not throw (all argument checks run before the kernels).
template <class Scratch, class Body>
void parallel_for(Index count, Body&& body) {
#ifdef _OPENMP
  const int threads = static_cast<int>(team_threads(count));
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      const SerialEigen serial;
      Scratch scratch{};
#pragma omp for schedule(dynamic, 1)
      for (Index i = 0; i < count; ++i) body(i, scratch);
    }
    return;
  }
#endif
  serial_for<Scratch>(count, body);
}

/// The work below which a loop runs on the calling thread whatever `num_threads()`: 2 MFLOP.
/// Starting and ending a team costs more than it saves below about that much work (chosen by
/// measurement; see docs/benchmarks.md).
inline constexpr double team_flops = 2e6;

/// The floating-point operations of attention of n queries over m keys: 2 n m (d_k + d_v).
inline double attention_flops(Index n, Index m, Index d_k, Index d_v) {
  return 2.0 * double(n) * double(m) * double(d_k + d_v);
}

/// The work a team takes off the calling thread in a loop of `count` items of about equal work,
/// `flops` in all: with t threads the slowest runs ceil(count / t) items, so the team saves
/// flops (1 - ceil(count / t) / count). Two threads save half of an even count, a third of 3
/// items, nothing of 1.
inline double team_saving(Index count, double flops) {
  const Index threads = team_threads(count);
  if (threads <= 1) return 0.0;
  const Index slowest = (count + threads - 1) / threads;
  return flops * (1.0 - double(slowest) / double(count));
}

/// `parallel_for` for a loop of `count` items of about equal work, `flops` floating-point
/// operations in all: in parallel where the team saves the calling thread at least half of
/// `team_flops` (`team_saving`), on the calling thread otherwise. With two threads and an even
/// count that is a loop of `team_flops` or more; an odd count needs more: two threads save only a
/// third of 3 items, too little for a team to pay (see docs/benchmarks.md). The bits do not depend
/// on which.
template <class Scratch, class Body>
void parallel_for(Index count, double flops, Body&& body) {
  if (team_saving(count, flops) < team_flops / 2) {
    serial_for<Scratch>(count, body);
    return;
  }
  parallel_for<Scratch>(count, std::forward<Body>(body));
}

}  // namespace detail
}  // namespace attn

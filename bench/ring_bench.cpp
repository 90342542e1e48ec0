// ring_attention (attn/distributed.hpp) against one process at the same total length: time, peak
// memory per rank, and how much of the ring's communication the compute hid.
//   mpirun --bind-to none -np 2 build/bench/attn_ring_bench [tokens ...]   (default: 16384 65536)
// For each length and for causal and full attention (float, d = 64, one head), in one run:
//   - one process: rank 0 alone runs flash_attention on the whole sequence, on one thread and on
//     every core of its machine (the other ranks wait);
//   - the ring: every rank holds N / P rows and runs ring_attention on its share of the cores;
//   - the ring's messages alone: the same blocks passed around the ring with nothing computed,
//     the time the communication takes when nothing hides it.
// Hidden fraction = 1 - (time the ring waited for blocks) / (time of the messages alone). Peak
// memory is the growth of the resident set (VmHWM, reset through /proc/self/clear_refs) from
// before the operands are made to the end of the call: operands, copies and work space.
// Run it with `--bind-to none` (Open MPI binds each of 2 ranks to one core by default, and the
// one-process run on every core would then share one).
// Prints a Markdown table (rank 0).

#include <mpi.h>
#if __has_include(<malloc.h>)
#include <malloc.h>  // mallopt (glibc)
#endif

#include <algorithm>
#include <attn/attn.hpp>
#include <attn/distributed.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../examples/ring_sequence.hpp"

namespace {

using attn::Index;
using Matrix = attn::Matrix<float>;

using attn_examples::sequence_rows;

/// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"); 0 where there is none.
long status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atol(line.c_str() + field.size() + 1);
  }
  return 0;
}

/// Starts a peak-memory measurement: resets the peak to the current resident set.
long start_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
  return status_kib("VmRSS");
}

/// MiB the resident set grew to since `start_peak` returned `base`.
double peak_growth_mib(long base) { return static_cast<double>(status_kib("VmHWM") - base) / 1024; }

/// A barrier that sleeps while it waits: the ranks waiting for rank 0's one-process runs must not
/// spin on the cores those runs use (MPI's own barrier polls).
void quiet_barrier() {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  int done = 0;
  while (MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

/// The ring's messages alone: P - 1 steps, each passing the block in hand (rows x (2 d) floats)
/// to the right while receiving the next from the left. \returns the slowest rank's seconds.
double messages_alone(const std::vector<Index>& rows, Index d, int rank, int ranks) {
  const auto wrap = [ranks](int r) { return ((r % ranks) + ranks) % ranks; };
  std::vector<float> current(
      static_cast<std::size_t>(rows[static_cast<std::size_t>(rank)] * 2 * d));
  std::vector<float> next;
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  for (int s = 0; s + 1 < ranks; ++s) {
    const int b_next = wrap(rank - s - 1);
    next.resize(static_cast<std::size_t>(rows[static_cast<std::size_t>(b_next)] * 2 * d));
    MPI_Request requests[2];
    MPI_Irecv(next.data(), static_cast<int>(next.size()), MPI_FLOAT, wrap(rank - 1), s,
              MPI_COMM_WORLD, &requests[0]);
    MPI_Isend(current.data(), static_cast<int>(current.size()), MPI_FLOAT, wrap(rank + 1), s,
              MPI_COMM_WORLD, &requests[1]);
    MPI_Waitall(2, requests, MPI_STATUSES_IGNORE);
    std::swap(current, next);
  }
  double seconds = MPI_Wtime() - start;
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
#if defined(M_MMAP_THRESHOLD)
  // Large blocks from mmap and back to the system when freed, always (glibc otherwise raises the
  // threshold after the first free and keeps later tables in its heap, out of the measurement).
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
#endif
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  std::vector<Index> lengths;
  for (int k = 1; k < argc; ++k) lengths.push_back(std::atol(argv[k]));
  if (lengths.empty()) lengths = {16384, 65536};
  const Index d = 64;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int share = attn_examples::core_share();

  if (rank == 0) {
    std::printf(
        "ring_attention on %d ranks (%d thread(s) each) against one process; float, d = %ld, "
        "one head; %d core(s) on rank 0's machine\n\n",
        ranks, share, static_cast<long>(d), cores);
    std::printf(
        "| N | causal | one process, 1 thread (s) | one process, %d threads (s) | ring, %d "
        "ranks (s) | ring speed-up vs 1 thread | vs %d threads | peak MiB, one process | "
        "peak MiB per rank (max) | messages alone (s) | ring waited (s) | hidden |\n",
        cores, ranks, cores);
    std::printf("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (const Index N : lengths) {
    for (const bool causal : {true, false}) {
      attn::AttentionOptions<float> options;
      if (causal) options.causal = attn::Causal::BottomRight;
      // One process (rank 0), one thread and then every core.
      double one_thread = 0;
      double all_cores = 0;
      double one_peak = 0;
      if (rank == 0) {
        for (const int threads : {1, cores}) {
          attn::set_num_threads(threads);
          const long base = start_peak();
          const Matrix Q = sequence_rows(0, N, d, 1);
          const Matrix K = sequence_rows(0, N, d, 2);
          const Matrix V = sequence_rows(0, N, d, 3);
          const double start = MPI_Wtime();
          const Matrix O = attn::flash_attention(Q, K, V, options);
          const double seconds = MPI_Wtime() - start;
          if (threads == 1) {
            one_thread = seconds;
            one_peak = peak_growth_mib(base);
          } else {
            all_cores = seconds;
          }
          if (O.rows() != N) std::abort();
        }
      }
      quiet_barrier();
      // The ring: rank r holds rows [r N / P, (r + 1) N / P).
      attn::set_num_threads(share);
      const Index first = rank * N / ranks;
      const Index count = (rank + 1) * N / ranks - first;
      const long base = start_peak();
      attn::RingStats stats;
      double ring_seconds = 0;
      {
        const Matrix Q = sequence_rows(first, count, d, 1);
        const Matrix K = sequence_rows(first, count, d, 2);
        const Matrix V = sequence_rows(first, count, d, 3);
        MPI_Barrier(MPI_COMM_WORLD);
        const double start = MPI_Wtime();
        const Matrix O = attn::ring_attention(MPI_COMM_WORLD, Q, K, V, options, stats);
        ring_seconds = MPI_Wtime() - start;
        if (O.rows() != count) std::abort();
      }
      double peak = peak_growth_mib(base);
      double waited = stats.wait_seconds;
      MPI_Allreduce(MPI_IN_PLACE, &ring_seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, &peak, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, &waited, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      // The same blocks around the ring with nothing computed (the ring's own layout: zigzag
      // chunks come in pairs of the same total size, so N / P rows per rank either way).
      std::vector<Index> rows;
      for (int r = 0; r < ranks; ++r) rows.push_back((r + 1) * N / ranks - r * N / ranks);
      const double alone = messages_alone(rows, d, rank, ranks);
      const double hidden = alone > 0 ? std::clamp(1.0 - waited / alone, 0.0, 1.0) : 1.0;
      if (rank == 0) {
        std::printf(
            "| %ld | %s | %.3f | %.3f | %.3f | %.2fx | %.2fx | %.1f | %.1f | %.4f | %.4f | "
            "%.0f%% |\n",
            static_cast<long>(N), causal ? "yes" : "no", one_thread, all_cores, ring_seconds,
            one_thread / ring_seconds, all_cores / ring_seconds, one_peak, peak, alone, waited,
            100 * hidden);
        std::fflush(stdout);
      }
    }
  }
  MPI_Finalize();
  return 0;
}

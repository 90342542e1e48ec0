/// \file ring_attention.cpp
/// `attn-ring`: one long sequence split over the processes of an MPI run, attended with
/// `attn::ring_attention` (attn/distributed.hpp). Each rank makes only its own rows (row g of Q,
/// K and V depends on g alone, so the sequence is the same whatever the number of ranks), the
/// key/value blocks travel around the ring, and each rank ends with its own output rows. Rank 0
/// prints what every rank did and, with --check, gathers the whole sequence and compares the
/// result with one process's `flash_attention` on it.
///
///     mpirun -np 2 build/examples/attn-ring                      # 16384 tokens, d = 64, causal
///     mpirun -np 2 build/examples/attn-ring --tokens 65536 --full --no-check
///     mpirun -H host1,host2 -np 2 build/examples/attn-ring       # two machines
///
/// Each rank's kernel runs on OMP_NUM_THREADS threads when that is set, else on its share of its
/// machine's cores (the cores over the ranks on that machine, at least one), so that ranks on one
/// machine do not fight over the cores.

#include <mpi.h>

#include <attn/attn.hpp>
#include <attn/distributed.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ring_sequence.hpp"

namespace {

using attn::Index;
using Matrix = attn::Matrix<float>;

using attn_examples::sequence_rows;

/// Without OMP_NUM_THREADS: this rank's share of its machine's cores.
void share_the_cores() {
  if (std::getenv("OMP_NUM_THREADS") == nullptr) attn::set_num_threads(attn_examples::core_share());
}

struct Settings {
  Index tokens = 16384;
  Index dim = 64;
  bool causal = true;
  bool check = true;
};

Settings parse(int argc, char** argv) {
  Settings settings;
  for (int k = 1; k < argc; ++k) {
    const std::string argument = argv[k];
    const auto value = [&]() -> Index {
      if (k + 1 >= argc) throw std::invalid_argument(argument + " needs a value");
      return std::stol(argv[++k]);
    };
    if (argument == "--tokens") {
      settings.tokens = value();
    } else if (argument == "--dim") {
      settings.dim = value();
    } else if (argument == "--full") {
      settings.causal = false;
    } else if (argument == "--no-check") {
      settings.check = false;
    } else if (argument == "-h" || argument == "--help") {
      throw std::invalid_argument("");
    } else {
      throw std::invalid_argument("unknown argument '" + argument + "'");
    }
  }
  if (settings.tokens < 1 || settings.dim < 1) {
    throw std::invalid_argument("--tokens and --dim must be at least 1");
  }
  return settings;
}

/// Every rank's rows gathered on rank 0 (other ranks get an empty table).
Matrix gather_rows(const Matrix& mine, const std::vector<int>& counts, int rank) {
  std::vector<int> elements;
  std::vector<int> offsets;
  int total = 0;
  for (const int count : counts) {
    offsets.push_back(total);
    elements.push_back(count * static_cast<int>(mine.cols()));
    total += elements.back();
  }
  Matrix all(rank == 0 ? total / mine.cols() : 0, mine.cols());
  MPI_Gatherv(mine.data(), static_cast<int>(mine.size()), MPI_FLOAT, all.data(), elements.data(),
              offsets.data(), MPI_FLOAT, 0, MPI_COMM_WORLD);
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  Settings settings;
  try {
    settings = parse(argc, argv);
  } catch (const std::exception& error) {
    if (rank == 0) {
      if (*error.what() != '\0') std::fprintf(stderr, "attn-ring: %s\n", error.what());
      std::fprintf(stderr,
                   "usage: mpirun -np P attn-ring [--tokens N] [--dim D] [--full] [--no-check]\n"
                   "  N tokens (default 16384) of width D (default 64), split over the P ranks;\n"
                   "  causal unless --full; --no-check skips the one-process comparison.\n");
    }
    MPI_Finalize();
    return *error.what() == '\0' ? 0 : 2;
  }
  share_the_cores();
  // Rank r holds rows [r N / P, (r + 1) N / P).
  const Index first = rank * settings.tokens / ranks;
  const Index count = (rank + 1) * settings.tokens / ranks - first;
  const Matrix Q = sequence_rows(first, count, settings.dim, 1);
  const Matrix K = sequence_rows(first, count, settings.dim, 2);
  const Matrix V = sequence_rows(first, count, settings.dim, 3);
  attn::AttentionOptions<float> options;
  if (settings.causal) options.causal = attn::Causal::BottomRight;

  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  attn::RingStats stats;
  const Matrix out = attn::ring_attention(MPI_COMM_WORLD, Q, K, V, options, stats);
  const double seconds = MPI_Wtime() - start;

  // What each rank did, printed by rank 0.
  const double mine[6] = {
      static_cast<double>(count),
      seconds,
      stats.compute_seconds,
      stats.wait_seconds,
      stats.redistribute_seconds,
      static_cast<double>(stats.ring_bytes_sent + stats.redistribute_bytes_sent)};
  std::vector<double> every(6 * static_cast<std::size_t>(ranks));
  MPI_Gather(mine, 6, MPI_DOUBLE, every.data(), 6, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("%ld tokens, d = %ld, %s, float, split over %d ranks (%d thread(s) each)%s\n",
                static_cast<long>(settings.tokens), static_cast<long>(settings.dim),
                settings.causal ? "causal" : "full attention", ranks, attn::num_threads(),
                stats.zigzag ? "; rows dealt out zigzag for balance" : "");
    std::printf("%-5s %8s %9s %10s %9s %11s %10s\n", "rank", "rows", "total s", "compute s",
                "wait s", "re-deal s", "MB sent");
    for (int r = 0; r < ranks; ++r) {
      const double* v = every.data() + 6 * r;
      std::printf("%-5d %8.0f %9.3f %10.3f %9.3f %11.3f %10.1f\n", r, v[0], v[1], v[2], v[3], v[4],
                  v[5] / 1e6);
    }
  }

  if (settings.check) {
    std::vector<int> counts(static_cast<std::size_t>(ranks));
    const int my_count = static_cast<int>(count);
    MPI_Gather(&my_count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Bcast(counts.data(), ranks, MPI_INT, 0, MPI_COMM_WORLD);
    const Matrix Q_all = gather_rows(Q, counts, rank);
    const Matrix K_all = gather_rows(K, counts, rank);
    const Matrix V_all = gather_rows(V, counts, rank);
    const Matrix O_all = gather_rows(out, counts, rank);
    if (rank == 0) {
      const Matrix reference = attn::flash_attention(Q_all, K_all, V_all, options);
      const double error = static_cast<double>((O_all - reference).cwiseAbs().maxCoeff()) /
                           static_cast<double>(reference.cwiseAbs().maxCoeff());
      std::printf(
          "check: one process's flash_attention on all %ld tokens differs by %.2e "
          "(largest |difference| / largest |output|)\n",
          static_cast<long>(settings.tokens), error);
      if (!(error < 1e-5)) {
        std::printf("check FAILED\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
  }
  MPI_Finalize();
  return 0;
}

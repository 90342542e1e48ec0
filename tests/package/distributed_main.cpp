// A consumer of attn::distributed: the first document's 3 tokens split over the ranks of
// MPI_COMM_WORLD (on one rank, the whole sequence), attended by ring_attention. Built by the
// package tests when MPI is found (run_consumer.cmake runs it with mpiexec on 2 ranks); prints
// each rank's rows.
#include <mpi.h>

#include <attn/distributed.hpp>
#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  attn::Matrix<double> Q(3, 2), V(3, 2);
  Q << 1, 0, 0, 1, 1, 1;
  V << 1, 0, 0, 1, 0.5, 0.5;
  // Rank 0 holds token 1, the last rank the rest (one rank: all three).
  const attn::Index first = rank == 0 ? 0 : 1;
  const attn::Index count = ranks == 1 ? 3 : rank == 0 ? 1 : rank + 1 == ranks ? 2 : 0;
  const attn::Matrix<double> out =
      attn::ring_attention(MPI_COMM_WORLD, Q.middleRows(first, count), Q.middleRows(first, count),
                           V.middleRows(first, count));
  for (attn::Index i = 0; i < out.rows(); ++i) {
    std::printf("rank %d: token %d -> [%.4f, %.4f]\n", rank, static_cast<int>(first + i + 1),
                out(i, 0), out(i, 1));
  }
  MPI_Finalize();
  return 0;
}

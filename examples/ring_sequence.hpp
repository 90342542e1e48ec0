#pragma once
/// \file ring_sequence.hpp
/// What `attn-ring` (examples/ring_attention.cpp) and `attn_ring_bench` (bench/ring_bench.cpp)
/// share: a sequence whose rows each rank can make on its own, and this rank's share of its
/// machine's cores.

#include <mpi.h>

#include <attn/attn.hpp>
#include <cstdint>
#include <random>
#include <thread>

namespace attn_examples {

/// Rows [first, first + count) of a table of N(0, 1) floats in which row g depends on g and `salt`
/// alone (its own generator, seeded from both): the same sequence whatever the number of ranks.
inline attn::Matrix<float> sequence_rows(attn::Index first, attn::Index count, attn::Index cols,
                                         std::uint64_t salt) {
  attn::Matrix<float> rows(count, cols);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (attn::Index i = 0; i < count; ++i) {
    std::mt19937_64 generator(static_cast<std::uint64_t>(first + i) * 0x9E3779B97F4A7C15ULL ^ salt);
    for (attn::Index j = 0; j < cols; ++j) rows(i, j) = normal(generator);
  }
  return rows;
}

/// This rank's share of its machine's cores: the cores over the ranks of MPI_COMM_WORLD on the
/// same machine (MPI_COMM_TYPE_SHARED), at least one.
inline int core_share() {
  MPI_Comm machine = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &machine);
  int here = 1;
  MPI_Comm_size(machine, &here);
  MPI_Comm_free(&machine);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return cores > here ? cores / here : 1;
}

}  // namespace attn_examples

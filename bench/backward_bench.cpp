// Attention backward against its forward, in one run: what a training step pays.
//   build/bench/attn_backward_bench
//   python3 bench/compare_backward.py --build build   (the ratio table backward / forward)
// BM_Forward: `flash_attention` with the log-sum-exp (the forward a training step keeps).
// BM_Backward: `attention_backward` from that forward's output and log-sum-exp (what a training
// loop calls), into caller storage. BM_BackwardNaive: the baseline, whole-matrix Eigen products
// of the materialised formulas (P, dP and dS as n x n tables). Both over `heads` heads, one after
// the other, each head on all of attn's threads. FLOP/s counts the useful flops: 4 n n d per head
// for the forward, 10 n n d for the backward (five products: S, dP, dV, dK, dQ; FlashAttention-2
// counts the same 2.5x), halved when causal. Wall-clock (UseRealTime); read ratios within one run.

#include <vector>

#include "bench_support.hpp"

namespace {

using attn::Index;

/// One case: `heads` heads of Q, K, V, dO (n x d each) from fixed seeds, the forward's outputs
/// and the gradients allocated and touched. Arguments (n, d, heads, causal).
template <class T>
struct Case {
  explicit Case(const benchmark::State& state)
      : n(state.range(0)), d(state.range(1)), heads(state.range(2)), causal(state.range(3) != 0) {
    for (Index h = 0; h < heads; ++h) {
      const auto seed = static_cast<std::uint32_t>(4 * h);
      Q.push_back(attn_bench::random_matrix<T>(n, d, seed + 1));
      K.push_back(attn_bench::random_matrix<T>(n, d, seed + 2));
      V.push_back(attn_bench::random_matrix<T>(n, d, seed + 3));
      dO.push_back(attn_bench::random_matrix<T>(n, d, seed + 4));
    }
    if (causal) options.causal = attn::Causal::BottomRight;
    O.resize(static_cast<std::size_t>(heads));
    lse.resize(static_cast<std::size_t>(heads));
    grads.resize(static_cast<std::size_t>(heads));
    for (std::size_t h = 0; h < Q.size(); ++h) {
      O[h] = attn::flash_attention(Q[h], K[h], V[h], options, lse[h]);
      attn::attention_backward(Q[h], K[h], V[h], O[h], lse[h], dO[h], options, grads[h]);
    }
  }
  double pairs() const {
    const double all = static_cast<double>(heads) * static_cast<double>(n) * static_cast<double>(n);
    return causal ? 0.5 * all : all;
  }
  Index n, d, heads;
  bool causal;
  std::vector<attn::Matrix<T>> Q, K, V, dO, O;
  std::vector<attn::Vector<T>> lse;
  std::vector<attn::AttentionGrads<T>> grads;
  attn::AttentionOptions<T> options;
};

template <class Call>
void time_calls(benchmark::State& state, const Call& call, double flops) {
  for (auto _ : state) {
    call();
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void BM_Forward(benchmark::State& state) {
  Case<T> c(state);
  time_calls(
      state,
      [&] {
        for (std::size_t h = 0; h < c.Q.size(); ++h) {
          c.O[h] = attn::flash_attention(c.Q[h], c.K[h], c.V[h], c.options, c.lse[h]);
          benchmark::DoNotOptimize(c.O[h].data());
        }
      },
      4.0 * c.pairs() * static_cast<double>(c.d));
}

template <class T>
void BM_Backward(benchmark::State& state) {
  Case<T> c(state);
  time_calls(
      state,
      [&] {
        for (std::size_t h = 0; h < c.Q.size(); ++h) {
          attn::attention_backward(c.Q[h], c.K[h], c.V[h], c.O[h], c.lse[h], c.dO[h], c.options,
                                   c.grads[h]);
          benchmark::DoNotOptimize(c.grads[h].dQ.data());
        }
      },
      10.0 * c.pairs() * static_cast<double>(c.d));
}

/// The materialised formulas as whole-matrix Eigen products, serially (the baseline a user would
/// write): P from the scores, dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(dP o P)),
/// dQ = scale dS K, dK = scale dS^T Q.
template <class T>
void BM_BackwardNaive(benchmark::State& state) {
  Case<T> c(state);
  const T scale = T(1) / std::sqrt(static_cast<T>(c.d));
  attn::Matrix<T> P(c.n, c.n), dP(c.n, c.n);
  time_calls(
      state,
      [&] {
        for (std::size_t h = 0; h < c.Q.size(); ++h) {
          P.noalias() = scale * (c.Q[h] * c.K[h].transpose());
          if (c.causal) attn::apply_mask(P, attn::causal_mask(c.n, c.n));
          attn::softmax_rows_inplace(P);
          attn::AttentionGrads<T>& g = c.grads[h];
          g.dV.noalias() = P.transpose() * c.dO[h];
          dP.noalias() = c.dO[h] * c.V[h].transpose();
          const attn::Vector<T> D = (P.array() * dP.array()).rowwise().sum();
          dP = P.array() * (dP.colwise() - D).array();
          g.dQ.noalias() = scale * (dP * c.K[h]);
          g.dK.noalias() = scale * (dP.transpose() * c.Q[h]);
          benchmark::DoNotOptimize(g.dQ.data());
        }
      },
      10.0 * c.pairs() * static_cast<double>(c.d));
}

/// A document mask given as a rule per key alone, without `keys` or `tile`.
struct DocumentsByKey {
  const attn::DocumentMask* documents;
  bool allowed(const attn::ScoreAt& at) const { return attn::variant_allows(*documents, at); }
};

/// Documents packed into one sequence (`docs` documents of n / docs tokens, causal inside each),
/// forward and backward (`attention_backward` without the forward's output, so each way runs
/// its own forward): way 0, one call per document; way 1, the `DocumentMask` variant over the
/// packed sequence; way 2, the variant without causality beside the option `causal`; way 3, the
/// causal document mask as a rule per key alone (`DocumentsByKey`: the library classifies each
/// tile by evaluating it, into the backward's block mask). FLOP/s: the useful flops (14 n n d /
/// docs, each document's causal half) over the time. The variants issue's target: way 1 within
/// 1.15x of way 0.
///   build/bench/attn_backward_bench --benchmark_filter=BM_DocumentMaskBackward
void BM_DocumentMaskBackward(benchmark::State& state) {
  const Index n = state.range(0);
  const Index docs = state.range(1);
  const Index d = state.range(2);
  const Index way = state.range(3);
  const Index length = n / docs;
  const attn::Matrix<float> Q = attn_bench::random_matrix<float>(n, d, 1);
  const attn::Matrix<float> K = attn_bench::random_matrix<float>(n, d, 2);
  const attn::Matrix<float> V = attn_bench::random_matrix<float>(n, d, 3);
  const attn::Matrix<float> dO = attn_bench::random_matrix<float>(n, d, 4);
  std::vector<Index> offsets;
  for (Index doc = 0; doc <= docs; ++doc) offsets.push_back(doc * length);
  const attn::DocumentMask causal_documents(offsets, true);
  const attn::DocumentMask documents(offsets, false);
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::BottomRight;
  std::vector<attn::AttentionGrads<float>> grads(static_cast<std::size_t>(docs));
  attn::AttentionGrads<float> packed;
  const double pairs = static_cast<double>(docs) * 0.5 * static_cast<double>(length * length);
  time_calls(
      state,
      [&] {
        if (way == 0) {
          for (Index doc = 0; doc < docs; ++doc) {
            const Index at = doc * length;
            attn::attention_backward(Q.middleRows(at, length), K.middleRows(at, length),
                                     V.middleRows(at, length), dO.middleRows(at, length), causal,
                                     grads[static_cast<std::size_t>(doc)]);
          }
        } else if (way == 1) {
          attn::attention_backward(Q, K, V, dO, causal_documents, {}, packed);
        } else if (way == 3) {
          attn::attention_backward(Q, K, V, dO, DocumentsByKey{&causal_documents}, {}, packed);
        } else {
          attn::attention_backward(Q, K, V, dO, documents, causal, packed);
        }
        benchmark::DoNotOptimize(packed.dQ.data());
      },
      14.0 * pairs * static_cast<double>(d));
}
BENCHMARK(BM_DocumentMaskBackward)
    ->ArgsProduct({{4096}, {8}, {64}, {0, 1, 2, 3}})
    ->ArgNames({"n", "docs", "d", "way"})
    ->UseRealTime();

const std::vector<int64_t> kSizes = {512, 1024, 2048, 4096};

BENCHMARK(BM_Forward<float>)
    ->ArgsProduct({kSizes, {64}, {1, 8}, {0, 1}})
    ->ArgNames({"n", "d", "heads", "causal"})
    ->UseRealTime();
BENCHMARK(BM_Backward<float>)
    ->ArgsProduct({kSizes, {64}, {1, 8}, {0, 1}})
    ->ArgNames({"n", "d", "heads", "causal"})
    ->UseRealTime();
BENCHMARK(BM_BackwardNaive<float>)
    ->ArgsProduct({{512, 1024, 2048}, {64}, {1}, {0, 1}})
    ->ArgNames({"n", "d", "heads", "causal"})
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return attn_bench::run_benchmarks(argc, argv); }

// The n x n score kernel, single-head attention (the path `scaled_dot_product_attention` picks, the
// materialised and the tiled paths) and `attention_heads`, each beside its naive baseline.
//   build/bench/attn_bench --benchmark_filter=Scores
//   python3 bench/compare_ort.py --build build     (the same shapes against ONNX Runtime)
// Every timed call writes into storage allocated and touched before the timing, through the
// caller-storage overloads, so no page fault of a fresh output is timed; the one exception says so
// in its name (BM_MaterialisedAllocating). Times and FLOP/s are wall-clock (UseRealTime): the
// kernels run on attn's threads (OMP_NUM_THREADS with the openmp target). Read ratios within one
// run: these machines are shared and noisy.

#include <vector>

#include "bench_support.hpp"

namespace {

using attn::Index;

constexpr double kFlopsPerScore = 2.0;      // one multiply-add per (i, j, c)
constexpr double kFlopsPerAttention = 4.0;  // Q K^T and P V

/// Times `call` in the benchmark loop (its output at `out` kept alive) and sets the FLOP/s counter:
/// `flops` per call over the wall-clock time.
template <class Call>
void time_calls(benchmark::State& state, const Call& call, const void* out, double flops) {
  for (auto _ : state) {
    call();
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

/// Useful flops of attention over n queries and n keys of width d, per head: causal counts the
/// visible half of the pairs, a window its n (window + 1) pairs.
double attention_flops(Index n, Index d, bool causal, Index window = 0) {
  const double pairs = window > 0 ? static_cast<double>(n) * static_cast<double>(window + 1)
                       : causal   ? 0.5 * static_cast<double>(n * n)
                                  : static_cast<double>(n * n);
  return kFlopsPerAttention * pairs * static_cast<double>(d);
}

template <class T>
attn::AttentionOptions<T> options_for(bool causal, Index window = 0) {
  attn::AttentionOptions<T> options;
  if (causal) options.causal = attn::Causal::BottomRight;
  if (window > 0) options.window = window;
  return options;
}

/// One single-head case: Q, K, V of n x d from fixed seeds, the n x d output allocated and
/// touched, the options. Arguments (n, d, causal[, window]).
template <class T>
struct Single {
  Single(const benchmark::State& state, bool has_window)
      : n(state.range(0)),
        d(state.range(1)),
        causal(state.range(2) != 0),
        window(has_window ? state.range(3) : 0),
        Q(attn_bench::random_matrix<T>(n, d, 1)),
        K(attn_bench::random_matrix<T>(n, d, 2)),
        V(attn_bench::random_matrix<T>(n, d, 3)),
        O(attn::Matrix<T>::Zero(n, d)),
        options(options_for<T>(causal, window)) {}
  double flops() const { return attention_flops(n, d, causal, window); }
  Index n, d;
  bool causal;
  Index window;
  attn::Matrix<T> Q, K, V, O;
  attn::AttentionOptions<T> options;
};

/// One `attention_heads` case: (heads, n, d) tensors, the layout it takes, and the output
/// allocated and touched. Arguments (n, d, heads, causal).
template <class T>
struct Heads {
  explicit Heads(const benchmark::State& state)
      : n(state.range(0)),
        d(state.range(1)),
        heads(state.range(2)),
        causal(state.range(3) != 0),
        Q(attn_bench::random_tensor<T>(heads, n, d, 1)),
        K(attn_bench::random_tensor<T>(heads, n, d, 2)),
        V(attn_bench::random_tensor<T>(heads, n, d, 3)),
        O(heads, n, d),
        options(options_for<T>(causal)) {
    O.setZero();
  }
  double flops() const { return static_cast<double>(heads) * attention_flops(n, d, causal); }
  Index n, d, heads;
  bool causal;
  attn::Tensor3<T> Q, K, V, O;
  attn::AttentionOptions<T> options;
};

/// The score kernel into caller storage (T = float or double), or its naive baseline.
template <class T, bool naive>
void score_case(benchmark::State& state) {
  const Index n = state.range(0);
  const Index d = state.range(1);
  const attn::Matrix<T> Q = attn_bench::random_matrix<T>(n, d, 1);
  const attn::Matrix<T> K = attn_bench::random_matrix<T>(n, d, 2);
  attn::Matrix<T> S = attn::Matrix<T>::Zero(n, n);  // touched: no page faults in the timing
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  time_calls(
      state,
      [&] {
        if constexpr (naive) {
          attn_bench::naive_scores<T>(Q, K, scale, S);
        } else {
          attn::scores(Q, K, scale, S);
        }
      },
      S.data(), kFlopsPerScore * static_cast<double>(n * n * d));
}

template <class T>
void BM_Scores(benchmark::State& state) {
  score_case<T, false>(state);
}

template <class T>
void BM_ScoresNaive(benchmark::State& state) {
  score_case<T, true>(state);
}

/// `scaled_dot_product_attention` into caller storage: the path it picks for the shape.
template <class T>
void BM_Attention(benchmark::State& state) {
  Single<T> c(state, false);
  time_calls(
      state, [&] { attn::scaled_dot_product_attention(c.Q, c.K, c.V, c.options, c.O); }, c.O.data(),
      c.flops());
}

/// The materialised path through `attention_with_weights`, which keeps the n x m weights and has no
/// caller-storage overload: its output and weights are allocated on every call, and timed.
template <class T>
void BM_MaterialisedAllocating(benchmark::State& state) {
  const Single<T> c(state, false);
  attn::Attention<T> result;
  time_calls(
      state, [&] { result = attn::attention_with_weights(c.Q, c.K, c.V, c.options); }, &result,
      c.flops());
}

/// The tiled path into caller storage; window > 0 adds a causal sliding window (FLOPs count the
/// visible keys only).
template <class T>
void BM_Flash(benchmark::State& state) {
  Single<T> c(state, true);
  time_calls(
      state, [&] { attn::flash_attention(c.Q, c.K, c.V, c.options, c.O); }, c.O.data(), c.flops());
}

/// The tiled kernel's overflow guard alone (`detail::product_may_overflow`: max |q| and max |k|,
/// one pass over Q and one over K), on `BM_Flash`'s case; its FLOP/s counter is the call's flops
/// over the guard's time, so that the guard's share of a call is the ratio of the two counters.
/// docs/benchmarks.md runs both in one process:
///   build/bench/attn_bench --benchmark_filter='BM_Flash(OverflowGuard)?<float>/n:(64|128|256|1024|4096)/d:(64|128)/causal:0/window:0/'
template <class T>
void BM_FlashOverflowGuard(benchmark::State& state) {
  Single<T> c(state, true);
  bool may_overflow = false;
  const T scale = T(1) / std::sqrt(static_cast<T>(c.d));
  time_calls(
      state, [&] { may_overflow = attn::detail::product_may_overflow<T>(c.Q, c.K, scale); },
      &may_overflow, c.flops());
}

/// `BM_Flash<float>` (n = 2048, one head) with the given tile sizes, to compare them in one run:
///   build/bench/attn_bench --benchmark_filter=BM_FlashTiles --benchmark_repetitions=3
/// Arguments (n, d, causal, query rows, key columns): 72 x 128 (the defaults until 2026-12) and the
/// defaults now, 36 x 512, each beside the other two combinations.
void BM_FlashTiles(benchmark::State& state) {
  Single<float> c(state, false);
  const attn::FlashTiles tiles{state.range(3), state.range(4)};
  time_calls(
      state, [&] { attn::flash_attention(c.Q, c.K, c.V, c.options, c.O, tiles); }, c.O.data(),
      c.flops());
}

/// Documents packed into one sequence (`docs` documents of n / docs tokens, causal inside each):
/// way 0, one causal `flash_attention` per document (the ideal: no work across documents); way 1,
/// the `DocumentMask` variant over the packed sequence; way 2, the same mask as an n x n table
/// (`options.mask`); way 3, the variant without causality beside the option `causal`. Counter
/// FLOP/s: the useful flops (each document's causal half) over the time, so the ways compare by
/// it. The variants issue's target (way 1 within 1.15x of way 0):
///   build/bench/attn_bench --benchmark_filter=BM_DocumentMask
void BM_DocumentMask(benchmark::State& state) {
  const Index n = state.range(0);
  const Index docs = state.range(1);
  const Index d = state.range(2);
  const Index way = state.range(3);
  const Index length = n / docs;
  const attn::Matrix<float> Q = attn_bench::random_matrix<float>(n, d, 1);
  const attn::Matrix<float> K = attn_bench::random_matrix<float>(n, d, 2);
  const attn::Matrix<float> V = attn_bench::random_matrix<float>(n, d, 3);
  attn::Matrix<float> O = attn::Matrix<float>::Zero(n, d);
  std::vector<Index> offsets;
  for (Index doc = 0; doc <= docs; ++doc) offsets.push_back(doc * length);
  const attn::DocumentMask causal_documents(offsets, true);
  const attn::DocumentMask documents(offsets, false);
  attn::AttentionOptions<float> causal;
  causal.causal = attn::Causal::BottomRight;
  attn::AttentionOptions<float> table;
  if (way == 2) table.mask = attn::variant_mask(causal_documents, n, n);
  std::vector<attn::Matrix<float>> outs(static_cast<std::size_t>(docs));
  const double flops = static_cast<double>(docs) * attention_flops(length, d, true);
  time_calls(
      state,
      [&] {
        if (way == 0) {
          for (Index doc = 0; doc < docs; ++doc) {
            const Index at = doc * length;
            attn::flash_attention(Q.middleRows(at, length), K.middleRows(at, length),
                                  V.middleRows(at, length), causal,
                                  outs[static_cast<std::size_t>(doc)]);
          }
        } else if (way == 1) {
          attn::flash_attention(Q, K, V, causal_documents, {}, O);
        } else if (way == 2) {
          attn::flash_attention(Q, K, V, table, O);
        } else {
          attn::flash_attention(Q, K, V, documents, causal, O);
        }
      },
      O.data(), flops);
}

/// A variant's score modification against the same without a variant (`BM_Flash<float>`'s case):
/// way 0, no variant; 1, a variant whose score is the identity; 2, the option `softcap` (c = 30);
/// 3, the `Softcap` variant (c = 30). The variants issue's targets: 1 within 3% of 0, 3 within 3%
/// of 2.   build/bench/attn_bench --benchmark_filter=BM_FlashScoreVariant
void BM_FlashScoreVariant(benchmark::State& state) {
  Single<float> c(state, false);
  const Index way = state.range(3);
  struct Identity {
    float score(float s, const attn::ScoreAt&) const { return s; }
  };
  const attn::Softcap<float> softcap{30.0f};
  attn::AttentionOptions<float> capped = c.options;
  capped.softcap = 30.0f;
  time_calls(
      state,
      [&] {
        if (way == 0) {
          attn::flash_attention(c.Q, c.K, c.V, c.options, c.O);
        } else if (way == 1) {
          attn::flash_attention(c.Q, c.K, c.V, Identity{}, c.options, c.O);
        } else if (way == 2) {
          attn::flash_attention(c.Q, c.K, c.V, capped, c.O);
        } else {
          attn::flash_attention(c.Q, c.K, c.V, softcap, c.options, c.O);
        }
      },
      c.O.data(), c.flops());
}

/// `BM_Flash<float>` with the keys and values in bfloat16 (`Eigen::bfloat16` matrices, what a
/// prefill over a `KVStorage::BFloat16` cache reads). vdpbf16ps = 0: widened when the keys are
/// packed and tile by tile for the values, then the float kernel's arithmetic; 1: bfloat16
/// arithmetic asked for (`StoredArithmetic::Reduced`), the score and value tiles by
/// `vdpbf16ps` where the CPU has AVX512_BF16 (counter `vdpbf16ps`: whether they ran).
/// bench/compare_flash_bf16.py sets these beside `BM_Flash<float>` in one run.
void BM_FlashBFloat16Keys(benchmark::State& state) {
  Single<float> c(state, true);
  using Rows = Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Rows K = c.K.cast<Eigen::bfloat16>();
  const Rows V = c.V.cast<Eigen::bfloat16>();
  const bool reduced = state.range(4) != 0;
  attn::AttentionOptions<float> options = c.options;
  if (reduced) options.stored_arithmetic = attn::StoredArithmetic::Reduced;
  state.counters["vdpbf16ps"] =
      reduced && attn::bfloat16_arithmetic_available() && attn::detail::bfloat16_tiles_compiled()
          ? 1
          : 0;
  time_calls(
      state, [&] { attn::flash_attention(c.Q, K, V, options, c.O); }, c.O.data(), c.flops());
}

template <class T>
void BM_AttentionNaive(benchmark::State& state) {
  Single<T> c(state, false);
  attn::Matrix<T> S = attn::Matrix<T>::Zero(c.n, c.n);
  time_calls(
      state, [&] { attn_bench::naive_attention<T>(c.Q, c.K, c.V, c.causal, S, c.O); }, c.O.data(),
      c.flops());
}

/// `attention_heads` into caller storage: `heads` query heads, each over its own key/value head.
template <class T>
void BM_Heads(benchmark::State& state) {
  Heads<T> c(state);
  time_calls(
      state, [&] { attn::attention_heads(c.Q, c.K, c.V, c.options, c.O); }, c.O.data(), c.flops());
}

/// The naive baseline of `attention_heads`: the plain loops of BM_AttentionNaive, head by head.
template <class T>
void BM_HeadsNaive(benchmark::State& state) {
  Heads<T> c(state);
  attn::Matrix<T> S = attn::Matrix<T>::Zero(c.n, c.n);
  const auto each_head = [&] {
    for (Index h = 0; h < c.heads; ++h) {
      attn_bench::naive_attention<T>(attn::detail::slice(c.Q, h), attn::detail::slice(c.K, h),
                                     attn::detail::slice(c.V, h), c.causal, S,
                                     attn::detail::slice(c.O, h));
    }
  };
  time_calls(state, each_head, c.O.data(), c.flops());
}

const std::vector<int64_t> kSizes = {128, 256, 512, 1024, 2048, 4096};

BENCHMARK(BM_Scores<float>)->ArgsProduct({kSizes, {64, 128}})->ArgNames({"n", "d"})->UseRealTime();
BENCHMARK(BM_Scores<double>)->ArgsProduct({kSizes, {64, 128}})->ArgNames({"n", "d"})->UseRealTime();
BENCHMARK(BM_ScoresNaive<float>)
    ->ArgsProduct({{128, 512, 1024}, {64}})
    ->ArgNames({"n", "d"})
    ->UseRealTime();
BENCHMARK(BM_Attention<float>)
    ->ArgsProduct({{32, 64, 128, 512, 1024, 2048}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->UseRealTime();
BENCHMARK(BM_Attention<double>)
    ->ArgsProduct({{128, 512, 1024, 2048}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->UseRealTime();
BENCHMARK(BM_MaterialisedAllocating<float>)
    ->ArgsProduct({{512, 1024, 2048}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->UseRealTime();
BENCHMARK(BM_Flash<float>)
    ->ArgsProduct({{512, 1024, 2048, 4096}, {64, 128}, {0, 1}, {0}})
    ->ArgNames({"n", "d", "causal", "window"})
    ->UseRealTime();
BENCHMARK(BM_Flash<float>)
    ->ArgsProduct({{2048, 4096}, {64}, {1}, {256}})
    ->ArgNames({"n", "d", "causal", "window"})
    ->UseRealTime();
BENCHMARK(BM_Flash<float>)
    ->ArgsProduct({{64, 128, 256}, {64, 128}, {0}, {0}})
    ->ArgNames({"n", "d", "causal", "window"})
    ->UseRealTime();
BENCHMARK(BM_FlashOverflowGuard<float>)
    ->ArgsProduct({{64, 128, 256, 1024, 4096}, {64, 128}, {0}, {0}})
    ->ArgNames({"n", "d", "causal", "window"})
    ->UseRealTime();
BENCHMARK(BM_DocumentMask)
    ->ArgsProduct({{4096}, {8}, {64}, {0, 1, 2, 3}})
    ->Args({16384, 8, 64, 0})
    ->Args({16384, 8, 64, 1})
    ->Args({16384, 8, 64, 2})
    ->Args({16384, 8, 64, 3})
    ->ArgNames({"n", "docs", "d", "way"})
    ->UseRealTime();
BENCHMARK(BM_FlashScoreVariant)
    ->ArgsProduct({{512, 2048}, {64}, {0, 1}, {0, 1, 2, 3}})
    ->ArgNames({"n", "d", "causal", "way"})
    ->UseRealTime();
BENCHMARK(BM_FlashTiles)
    ->ArgsProduct({{2048}, {64, 128}, {0, 1}, {72, 36}, {128, 512}})
    ->ArgNames({"n", "d", "causal", "rows", "cols"})
    ->UseRealTime();
BENCHMARK(BM_FlashBFloat16Keys)
    ->ArgsProduct({{512, 2048}, {64, 128}, {0, 1}, {0}, {0, 1}})
    ->ArgNames({"n", "d", "causal", "window", "vdpbf16ps"})
    ->UseRealTime();
BENCHMARK(BM_Flash<double>)
    ->ArgsProduct({{512, 2048}, {64}, {0, 1}, {0}})
    ->ArgNames({"n", "d", "causal", "window"})
    ->UseRealTime();
BENCHMARK(BM_AttentionNaive<float>)
    ->ArgsProduct({{128, 512, 1024}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->UseRealTime();
BENCHMARK(BM_Heads<float>)
    ->ArgsProduct({{16, 64, 512, 2048, 4096}, {64}, {8}, {0, 1}})
    ->ArgNames({"n", "d", "heads", "causal"})
    ->UseRealTime();
BENCHMARK(BM_HeadsNaive<float>)
    ->ArgsProduct({{512}, {64}, {8}, {0, 1}})
    ->ArgNames({"n", "d", "heads", "causal"})
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return attn_bench::run_benchmarks(argc, argv); }

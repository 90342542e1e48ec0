// One decoding step through a KVCache: 1 query, 32 query heads over 8 key/value heads (GQA),
// d = 128, float, over caches of 1k, 4k and 16k tokens. A step reads every cached key and value
// once, so its speed is a memory bandwidth: the `bytes_per_second` of each run counts the K/V bytes
// streamed (tokens * kv_heads * d * 2 * 4 bytes), and BM_stream_sum, in the same binary, measures
// what the machine streams at all (a sum over a buffer larger than the largest cache, split over
// the same threads). The ratio of the two is the fraction of the bandwidth a decoding step
// achieves.
//   build/bench/attn_decode_bench --benchmark_counters_tabular=true
// BM_decode_stored is the same step with the cache's keys and values in float16, bfloat16 or int8
// (`KVCacheConfig::storage`, the second argument: 1, 2, 3), its bytes_per_second counting the
// bytes it streams (`KVCache::bytes()`). bench/compare_decode.py runs them all in one run and
// prints each format's speed-up over the float step and its fraction of the bandwidth.
// BM_decode_naive is the plain-loop baseline (scores, softmax, weighted sum per query head). Both
// write into an output allocated before the timing (`attend`'s caller-storage overload).
// BM_decode_step and BM_decode_int8_arithmetic also run over a short cache of 128 tokens, where
// the cost of a step outside its tiles shows. BM_decode_phase times the phases of the step's tiles
// alone (scores, online softmax, values) and whole; compare_decode.py prints them per key.
// BM_decode_documents is a step with a `DocumentMask` variant beside its ideal and the full step.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench_support.hpp"

namespace {

using attn::Index;

constexpr Index query_heads = 32;
constexpr Index kv_heads = 8;
constexpr Index head_dim = 128;

std::int64_t kv_bytes(Index tokens) {
  return static_cast<std::int64_t>(tokens * kv_heads * head_dim * 2) *
         static_cast<std::int64_t>(sizeof(float));
}

attn::KVCache<float> filled_cache(Index tokens, attn::KVStorage storage = attn::KVStorage::Same) {
  attn::KVCacheConfig<float> config;
  config.d_k = head_dim;
  config.d_v = head_dim;
  config.kv_heads = kv_heads;
  config.storage = storage;
  attn::KVCache<float> cache(config);
  cache.append(attn_bench::random_matrix<float>(tokens, kv_heads * head_dim, 1),
               attn_bench::random_matrix<float>(tokens, kv_heads * head_dim, 2));
  return cache;
}

/// Times one decoding step over `cache` (1 query, every query head) and counts the bytes it
/// streams (`KVCache::bytes()`: K and V of every key/value head in the cache's format).
void time_steps(benchmark::State& state, const attn::KVCache<float>& cache,
                attn::StoredArithmetic arithmetic = attn::StoredArithmetic::Widened) {
  const attn::Matrix<float> q = attn_bench::random_matrix<float>(1, query_heads * head_dim, 3);
  attn::Matrix<float> out = attn::Matrix<float>::Zero(1, query_heads * head_dim);
  attn::AttentionOptions<float> options;
  options.stored_arithmetic = arithmetic;
  for (auto _ : state) {
    cache.attend(q, options, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(cache.bytes()));
  state.counters["threads"] = attn::num_threads();
}

void BM_decode_step(benchmark::State& state) {
  const Index tokens = state.range(0);
  time_steps(state, filled_cache(tokens));
  // 2 GEMVs of tokens x d per query head: 4 tokens d flops each.
  state.counters["flops"] = benchmark::Counter(static_cast<double>(state.iterations()) * 4.0 *
                                                   static_cast<double>(tokens) *
                                                   static_cast<double>(head_dim * query_heads),
                                               benchmark::Counter::kIsRate);
}

void BM_decode_stored(benchmark::State& state) {
  time_steps(state, filled_cache(state.range(0), static_cast<attn::KVStorage>(state.range(1))));
}

/// BM_decode_stored with bfloat16 keys and bfloat16 arithmetic (`StoredArithmetic::Reduced`: the
/// scores by AVX512_BF16's vdpbf16ps where the CPU has it; the counter says whether it ran).
void BM_decode_bf16_arithmetic(benchmark::State& state) {
  state.counters["vdpbf16ps"] = attn::bfloat16_arithmetic_available() ? 1 : 0;
  time_steps(state, filled_cache(state.range(0), attn::KVStorage::BFloat16),
             attn::StoredArithmetic::Reduced);
}

/// BM_decode_stored with int8 keys and values and integer arithmetic (`StoredArithmetic::Reduced`:
/// the scores by AVX512_VNNI's vpdpbusd and the values by its vpdpwssd where the CPU has it; the
/// counter says whether it ran).
void BM_decode_int8_arithmetic(benchmark::State& state) {
  state.counters["vnni"] = attn::int8_arithmetic_available() ? 1 : 0;
  time_steps(state, filled_cache(state.range(0), attn::KVStorage::Int8),
             attn::StoredArithmetic::Reduced);
}

/// The phases of decoding tiles, alone, over 8 tiles of 64 keys (one per key/value head, d = 128,
/// 4 query heads each; 256 KiB of float keys, 64 KiB in int8, as many values: in the second-level
/// cache of the project's machines, where a step's arithmetic rather than its reads decides): 0 the
/// scores, 1 the online softmax, 2 the weighted sum of the values, 3 the whole tile
/// (`detail::decode_tile`: the three with what joins them). The second argument is the storage
/// format (0-3, as `KVStorage`). `per_key` is the time per key and key/value head; `flops`
/// counts the phase's products (4 heads x 2 d per key for the scores and for the values, both for
/// a tile), to set beside `attn_peak_fma_bench`. The sum of phases 0-2 against phase 3 is what the
/// tile loses between its phases; phase 3 against `BM_decode_stored`'s time per token (over 8
/// heads) is what the step adds around its tiles. Phases 0 and 2 call the kernels that
/// `detail::decode_tile` picks with float arithmetic (`StoredArithmetic::Widened`), in its order: a change to its steps 1 and 3 must be made here too.
/// (Splitting those steps out of `decode_tile` into functions this could call changed GCC 12's
/// code for the step: 1.02-1.09x its time at 1k tokens with stored keys, 2026-12-04.)
void BM_decode_phase(benchmark::State& state) {
  namespace detail = attn::detail;
  constexpr Index tile = 64;
  constexpr Index group = 4;  // query heads per key/value head
  const int phase = static_cast<int>(state.range(0));
  const auto format = static_cast<attn::KVStorage>(state.range(1));
  const Index rows = kv_heads * tile;
  const attn::Matrix<float> keys = attn_bench::random_matrix<float>(rows, head_dim, 1);
  const attn::Matrix<float> values = attn_bench::random_matrix<float>(rows, head_dim, 2);
  detail::StoredRows<float> K(format, rows, head_dim);
  detail::StoredRows<float> V(format, rows, head_dim);
  for (Index r = 0; r < rows; ++r) {
    K.put(r, keys.row(r).data());
    V.put(r, values.row(r).data());
  }
  detail::DecodeScratch<float> scratch;
  scratch.q_scaled = attn_bench::random_matrix<float>(group, head_dim, 3) /
                     std::sqrt(static_cast<float>(head_dim));
  scratch.s = attn::Matrix<float>::Zero(group, tile);
  scratch.alpha.resize(group);
  detail::ScoreRule<float> rule;
  rule.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const auto heads = std::make_index_sequence<std::size_t(group)>();
  const detail::PrefetchRows none{};
  float* s = scratch.s.data();
  const Index s_stride = scratch.s.outerStride();
  detail::with_codec<float>(format, [&](auto codec) {
    using Codec = decltype(codec);
    // The rows as the step reads them: the matrix itself for `Same`, else a `StoredBlock`.
    const auto as_read = [&](const detail::StoredRows<float>& X) {
      if constexpr (std::is_same_v<Codec, detail::SameCodec<float>>) {
        return detail::ConstRef<float>(X.same());
      } else {
        return X.template block<Codec>(0, rows);
      }
    };
    const auto K_all = as_read(K);
    const auto V_all = as_read(V);
    const auto* k_data = detail::block_data(K_all);
    const auto* v_data = detail::block_data(V_all);
    const float* k_scales = detail::block_scales<float>(K_all);
    for (auto _ : state) {
      scratch.state.start(group, head_dim, std::nullopt);
      for (Index h = 0; h < kv_heads; ++h) {
        const Index j0 = h * tile;
        switch (phase) {
          case 0: {
            // decode_tile's step 1 with the float arithmetic's kernels: the 4 x 4 blocks for
            // stored keys where the build has AVX-512, the key-by-key loop for the rest.
            const detail::StridedRows<std::remove_cv_t<std::remove_pointer_t<decltype(k_data)>>>
                K_tile{k_data + j0 * head_dim, head_dim};
            const float* scales = k_scales ? k_scales + j0 : nullptr;
            Index done = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
            if constexpr (!std::is_same_v<Codec, detail::SameCodec<float>>) {
              done = detail::decode_scores_4x4<Codec>(scratch.q_scaled.data(), head_dim, K_tile,
                                                      scales, tile, head_dim, s, s_stride, none);
            }
#endif
            if (done < tile) {
              detail::decode_scores<float, Codec>(heads, scratch.q_scaled.data(), head_dim,
                                                  K_tile.from(done),
                                                  scales ? scales + done : nullptr, tile - done,
                                                  head_dim, s + done, s_stride, none);
            }
            break;
          }
          case 1:
            detail::online_softmax_rows<float>(s, s_stride, group, tile, scratch.state.m.data(),
                                               scratch.state.l.data(), scratch.alpha.data());
            break;
          case 2:
            // decode_tile's step 3: passes of 4 packets (64 columns) for 4 heads.
            for (Index c0 = 0; c0 < head_dim; c0 += 64) {
              using VBits = std::remove_cv_t<std::remove_pointer_t<decltype(v_data)>>;
              detail::decode_values<float, Codec, 4>(
                  heads, s, s_stride, scratch.alpha.data(),
                  detail::StridedRows<VBits>{v_data + j0 * head_dim + c0, head_dim}, tile,
                  scratch.state.o.data() + c0, scratch.state.o.outerStride(), none);
            }
            break;
          default:
            detail::decode_tile<float, group>(0, K_all, V_all, j0, tile, rule, scratch);
        }
      }
      benchmark::DoNotOptimize(scratch.state.o.data());
      benchmark::DoNotOptimize(s);
      benchmark::ClobberMemory();
    }
  });
  const double keys_done = static_cast<double>(state.iterations() * rows);
  state.counters["per_key"] =
      benchmark::Counter(keys_done, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  const double products = phase == 1 ? 0.0 : phase == 3 ? 2.0 : 1.0;
  state.counters["flops"] = benchmark::Counter(keys_done * products * 2.0 * group * head_dim,
                                               benchmark::Counter::kIsRate);
}

void BM_decode_naive(benchmark::State& state) {
  const Index tokens = state.range(0);
  const attn::KVCache<float> cache = filled_cache(tokens);
  std::vector<attn::Matrix<float>> K;
  std::vector<attn::Matrix<float>> V;
  for (Index h = 0; h < kv_heads; ++h) {
    K.push_back(cache.keys(h));
    V.push_back(cache.values(h));
  }
  const attn::Matrix<float> q = attn_bench::random_matrix<float>(1, query_heads * head_dim, 3);
  attn::Matrix<float> out(1, query_heads * head_dim);
  std::vector<float> p(static_cast<std::size_t>(tokens));
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (auto _ : state) {
    for (Index h = 0; h < query_heads; ++h) {
      const attn::Matrix<float>& K_h = K[static_cast<std::size_t>(h / (query_heads / kv_heads))];
      const attn::Matrix<float>& V_h = V[static_cast<std::size_t>(h / (query_heads / kv_heads))];
      float max = -std::numeric_limits<float>::infinity();
      for (Index j = 0; j < tokens; ++j) {
        float dot = 0;
        for (Index c = 0; c < head_dim; ++c) dot += q(0, h * head_dim + c) * K_h(j, c);
        p[static_cast<std::size_t>(j)] = scale * dot;
        max = std::max(max, scale * dot);
      }
      float sum = 0;
      for (float& x : p) sum += (x = std::exp(x - max));
      for (Index c = 0; c < head_dim; ++c) out(0, h * head_dim + c) = 0;
      for (Index j = 0; j < tokens; ++j) {
        const float w = p[static_cast<std::size_t>(j)] / sum;
        for (Index c = 0; c < head_dim; ++c) out(0, h * head_dim + c) += w * V_h(j, c);
      }
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kv_bytes(tokens));
}

/// A decoding step over documents packed into one cache (8 of 512 tokens in 4096), the query the
/// last token of the last document: 0 through `attend` with a `DocumentMask` (the step reads only
/// the keys the variant's ranges leave), 1 the same step over a cache that holds only that
/// document (the ideal), 2 the step over all 4096 tokens without a variant. docs/benchmarks.md,
/// "Attention variants", sets the three side by side.
void BM_decode_documents(benchmark::State& state) {
  const Index mode = state.range(0);
  constexpr Index tokens = 4096, length = 512;
  const attn::KVCache<float> cache = filled_cache(mode == 1 ? length : tokens);
  std::vector<Index> offsets;
  for (Index p = 0; p <= tokens; p += length) offsets.push_back(p);
  const attn::DocumentMask documents(offsets, true);
  const attn::Matrix<float> q = attn_bench::random_matrix<float>(1, query_heads * head_dim, 3);
  attn::Matrix<float> out = attn::Matrix<float>::Zero(1, query_heads * head_dim);
  for (auto _ : state) {
    if (mode == 0) {
      cache.attend(q, documents, {}, {}, out);
    } else {
      cache.attend(q, attn::AttentionOptions<float>{}, out);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}

/// The streaming baseline (`attn_bench::stream_sum`), in as many chunks as the cache has key and
/// value rows per head (the same split as a decoding step).
void BM_stream_sum(benchmark::State& state) { attn_bench::stream_sum(state, 2 * kv_heads); }

/// The cache lengths of the decoding cases: 1k, 4k and 16k tokens, timed in microseconds.
void cache_lengths(benchmark::internal::Benchmark* b) {
  b->Arg(1024)->Arg(4096)->Arg(16384)->ArgNames({"tokens"});
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

/// A short cache (the first steps after a short prompt), where what a step costs besides its
/// tiles (the queries' preparation, the threads) shows: 16 tokens (about 1 MFLOP, below
/// `detail::team_flops`: one thread whatever the count) and 128.
void short_cache(benchmark::internal::Benchmark* b) {
  b->Arg(16)->Arg(128)->ArgNames({"tokens"});
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_stream_sum)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode_step)->Apply(cache_lengths);
BENCHMARK(BM_decode_stored)
    ->ArgsProduct({{1024, 4096, 16384}, {1, 2, 3}})
    ->ArgNames({"tokens", "storage"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_decode_bf16_arithmetic)->Apply(cache_lengths);
BENCHMARK(BM_decode_int8_arithmetic)->Apply(cache_lengths);
BENCHMARK(BM_decode_step)->Apply(short_cache);
BENCHMARK(BM_decode_int8_arithmetic)->Apply(short_cache);
BENCHMARK(BM_decode_phase)
    ->ArgsProduct({{0, 1, 2, 3}, {0, 1, 2, 3}})
    ->ArgNames({"phase", "storage"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_decode_documents)
    ->DenseRange(0, 2)
    ->ArgNames({"mode"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_decode_naive)
    ->Arg(1024)
    ->Arg(16384)
    ->ArgNames({"tokens"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

int main(int argc, char** argv) { return attn_bench::run_benchmarks(argc, argv); }

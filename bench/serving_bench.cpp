// Many sequences at once (issue 41): the packed variable-length prefill against the loop it
// replaces. bench/compare_serving.py runs every case in one process per round and prints the
// ratios against the targets.
//   build/bench/attn_serving_bench --benchmark_filter=varlen
// BM_varlen_prefill: `varlen_attention` over 16 sequences of 64 .. 4096 tokens (causal,
// bottom-right; 8 query heads over 2 key/value heads, d = 64), on `threads` threads.
// BM_per_sequence_flash: the same work as one `flash_attention` call per sequence and query head.
// BM_paged_decode: one decoding step of a batch in one `PagedKVCache::attend` call (32 query heads
// over 8 key/value heads, d = 128, float16 storage, pages of 16 tokens, the default, or of 256:
// page:256), its bytes_per_second the keys and values it reads; BM_kvcache_loop: the same step as one `KVCache::attend` per sequence
// over the same rows. batch:0 is 32 sequences of mixed lengths (128k tokens in all), batch:1 64
// sequences of 64 .. 512 tokens. BM_stream_sum: what the machine streams at all.
// BM_cache_memory: the bytes 64 sequences of 100 .. 8000 tokens take in pages and in one KVCache
// each (counters; the time is the appends'). BM_shared_prefix: a decoding step of 16 sequences
// forked from one 4096-token prompt, each with 256 tokens of its own, with cascades (cascade:1) or
// each sequence reading the shared pages itself (cascade:0).

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "bench_support.hpp"

namespace {

using attn::Index;

constexpr Index prefill_heads = 8;
constexpr Index prefill_kv_heads = 2;
constexpr Index prefill_dim = 64;

/// 16 lengths drawn uniformly from 64 .. 4096 by a fixed seed (the same batch in every run).
std::vector<int> prefill_lengths() {
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> length(64, 4096);
  std::vector<int> lengths(16);
  for (int& n : lengths) n = length(rng);
  return lengths;
}

struct PackedPrefill {
  std::vector<int> offsets{0};
  attn::Tensor3<float> Q, K, V, out;
  double flops = 0;  // the causal products: 2 (d_k + d_v) per visible (query, key), per head
  PackedPrefill() {
    for (const int n : prefill_lengths()) {
      offsets.push_back(offsets.back() + n);
      flops +=
          2.0 * double(2 * prefill_dim) * double(prefill_heads) * double(n) * double(n + 1) / 2.0;
    }
    const Index total = offsets.back();
    Q = attn_bench::random_tensor<float>(prefill_heads, total, prefill_dim, 1);
    K = attn_bench::random_tensor<float>(prefill_kv_heads, total, prefill_dim, 2);
    V = attn_bench::random_tensor<float>(prefill_kv_heads, total, prefill_dim, 3);
    out.resize(prefill_heads, total, prefill_dim);
  }
};

const PackedPrefill& prefill() {
  static const PackedPrefill batch;
  return batch;
}

void set_counters(benchmark::State& state, double flops) {
  state.counters["threads"] = attn::num_threads();
  state.counters["FLOP/s"] =
      benchmark::Counter(double(state.iterations()) * flops, benchmark::Counter::kIsRate);
}

void BM_varlen_prefill(benchmark::State& state) {
  attn::set_num_threads(int(state.range(0)));
  const PackedPrefill& x = prefill();
  attn::Tensor3<float> out = x.out;
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  for (auto _ : state) {
    attn::varlen_attention(x.Q, x.K, x.V, x.offsets, x.offsets, options, {}, out);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, x.flops);
  attn::set_num_threads(0);
}

void BM_per_sequence_flash(benchmark::State& state) {
  attn::set_num_threads(int(state.range(0)));
  const PackedPrefill& x = prefill();
  const Index total = x.offsets.back();
  const Index group = prefill_heads / prefill_kv_heads;
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::BottomRight;
  attn::Matrix<float> out;
  const auto rows = [&](const attn::Tensor3<float>& t, Index h, Index first, Index n) {
    return Eigen::Map<const attn::Matrix<float>>(t.data() + (h * total + first) * prefill_dim, n,
                                                 prefill_dim);
  };
  for (auto _ : state) {
    for (std::size_t b = 0; b + 1 < x.offsets.size(); ++b) {
      const Index first = x.offsets[b];
      const Index n = x.offsets[b + 1] - first;
      for (Index h = 0; h < prefill_heads; ++h) {
        attn::flash_attention(rows(x.Q, h, first, n), rows(x.K, h / group, first, n),
                              rows(x.V, h / group, first, n), options, out);
        benchmark::DoNotOptimize(out.data());
      }
    }
  }
  set_counters(state, x.flops);
  attn::set_num_threads(0);
}

constexpr Index decode_heads = 32;
constexpr Index decode_kv_heads = 8;
constexpr Index decode_dim = 128;

/// The decoding batches: 32 sequences of lengths drawn from 1 .. 8000 and scaled to 128k tokens in
/// all (batch 0), or 64 sequences of 64 .. 512 tokens (batch 1); fixed seeds.
std::vector<int> decode_lengths(Index batch) {
  std::mt19937 rng(batch == 0 ? 7 : 8);
  if (batch == 1) {
    std::uniform_int_distribution<int> length(64, 512);
    std::vector<int> lengths(64);
    for (int& n : lengths) n = length(rng);
    return lengths;
  }
  std::uniform_int_distribution<int> length(1, 8000);
  std::vector<double> drawn(32);
  for (double& n : drawn) n = length(rng);
  const double sum = std::accumulate(drawn.begin(), drawn.end(), 0.0);
  std::vector<int> lengths;
  for (const double n : drawn) lengths.push_back(std::max(1, int(n * 131072.0 / sum)));
  return lengths;
}

attn::KVCacheConfig<float> decode_config() {
  attn::KVCacheConfig<float> config;
  config.d_k = config.d_v = decode_dim;
  config.kv_heads = decode_kv_heads;
  config.storage = attn::KVStorage::Float16;
  return config;
}

/// The same rows in a paged cache and in one KVCache per sequence.
struct DecodeBatch {
  std::vector<int> lengths;
  attn::PagedKVCache<float> paged;
  std::vector<attn::PagedKVCache<float>::SequenceId> ids;
  std::vector<attn::KVCache<float>> caches;
  attn::Matrix<float> q;  // one query per sequence
  std::vector<int> offsets{0};
  std::int64_t bytes = 0;  // the keys and values a step reads
  static attn::PagedKVCacheConfig<float> paged_config(const std::vector<int>& lengths,
                                                      Index page_size) {
    attn::PagedKVCacheConfig<float> config;
    static_cast<attn::KVCacheConfig<float>&>(config) = decode_config();
    config.page_size = page_size;
    Index pages = 0;
    for (const int n : lengths) pages += (n + page_size - 1) / page_size;
    config.pages = pages;
    return config;
  }
  DecodeBatch(Index batch, Index page_size)
      : lengths(decode_lengths(batch)), paged(paged_config(lengths, page_size)) {
    std::uint32_t seed = 10;
    for (const int n : lengths) {
      const attn::Matrix<float> K =
          attn_bench::random_matrix<float>(n, decode_kv_heads * decode_dim, seed++);
      const attn::Matrix<float> V =
          attn_bench::random_matrix<float>(n, decode_kv_heads * decode_dim, seed++);
      ids.push_back(paged.add_sequence());
      paged.append(ids.back(), K, V);
      caches.emplace_back(decode_config());
      caches.back().append(K, V);
      offsets.push_back(offsets.back() + 1);
      bytes += attn::KVCache<float>::bytes_for(decode_config(), n);
    }
    q = attn_bench::random_matrix<float>(Index(lengths.size()), decode_heads * decode_dim, 3);
  }
};

/// The decoding batch `batch` in pages of `page_size` tokens (16, the default, or 256), made once.
const DecodeBatch& decode_batch(Index batch, Index page_size = 16) {
  static const DecodeBatch mixed(0, 16);
  static const DecodeBatch short_ones(1, 16);
  if (page_size == 16) return batch == 0 ? mixed : short_ones;
  static const DecodeBatch mixed_256(0, 256);
  static const DecodeBatch short_256(1, 256);
  return batch == 0 ? mixed_256 : short_256;
}

void BM_paged_decode(benchmark::State& state) {
  attn::set_num_threads(int(state.range(2)));
  const DecodeBatch& x = decode_batch(state.range(0), state.range(1));
  attn::Matrix<float> out(x.q.rows(), decode_heads * decode_dim);
  for (auto _ : state) {
    x.paged.attend(x.ids, x.offsets, x.q, attn::AttentionOptions<float>{}, {}, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * x.bytes);
  state.counters["threads"] = attn::num_threads();
  attn::set_num_threads(0);
}

void BM_kvcache_loop(benchmark::State& state) {
  attn::set_num_threads(int(state.range(1)));
  const DecodeBatch& x = decode_batch(state.range(0));
  attn::Matrix<float> out(1, decode_heads * decode_dim);
  for (auto _ : state) {
    for (std::size_t b = 0; b < x.caches.size(); ++b) {
      x.caches[b].attend(x.q.row(Index(b)), attn::AttentionOptions<float>{}, out);
      benchmark::DoNotOptimize(out.data());
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * x.bytes);
  state.counters["threads"] = attn::num_threads();
  attn::set_num_threads(0);
}

void BM_stream_sum(benchmark::State& state) {
  attn::set_num_threads(int(state.range(0)));
  attn_bench::stream_sum(state, 2 * decode_kv_heads);
  attn::set_num_threads(0);
}

/// 16 sequences forked from one prompt of 4096 tokens, each with 256 tokens of its own, in a paged
/// cache with cascades (`cascade` 1) or without (0: each sequence reads the shared pages itself, as
/// 16 unshared sequences would): one decoding step of all 16 on two threads.
void BM_shared_prefix(benchmark::State& state) {
  attn::set_num_threads(2);
  const bool cascade = state.range(0) != 0;
  attn::PagedKVCacheConfig<float> config;
  static_cast<attn::KVCacheConfig<float>&>(config) = decode_config();
  config.pages = (4096 + 16 * 256) / 16 + 16;
  config.cascade = cascade;
  attn::PagedKVCache<float> cache(config);
  const Index prompt = cache.add_sequence();
  const Index width = decode_kv_heads * decode_dim;
  cache.append(prompt, attn_bench::random_matrix<float>(4096, width, 1),
               attn_bench::random_matrix<float>(4096, width, 2));
  std::vector<attn::PagedKVCache<float>::SequenceId> ids;
  std::vector<int> offsets{0};
  for (int b = 0; b < 16; ++b) {
    ids.push_back(cache.fork(prompt));
    offsets.push_back(b + 1);
  }
  std::vector<int> own{0};
  for (int b = 0; b < 16; ++b) own.push_back(own.back() + 256);
  cache.append(ids, own, attn_bench::random_matrix<float>(16 * 256, width, 3),
               attn_bench::random_matrix<float>(16 * 256, width, 4));
  const attn::Matrix<float> q = attn_bench::random_matrix<float>(16, decode_heads * decode_dim, 5);
  attn::Matrix<float> out;
  for (auto _ : state) {
    cache.attend(ids, offsets, q, attn::AttentionOptions<float>{}, {}, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  attn::set_num_threads(0);
}

/// 64 sequences of 100 .. 8000 tokens appended (in chunks of up to 512 tokens, as a server's
/// prefill chunks would come) to a paged cache and to one KVCache each: the bytes each holds
/// and the tokens' own bytes, as counters.
void BM_cache_memory(benchmark::State& state) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> length(100, 8000);
  std::vector<int> lengths(64);
  for (int& n : lengths) n = length(rng);
  const attn::KVCacheConfig<float> config = decode_config();
  attn::PagedKVCacheConfig<float> paged_config;
  static_cast<attn::KVCacheConfig<float>&>(paged_config) = config;
  paged_config.pages = 0;
  for (const int n : lengths) paged_config.pages += (n + 15) / 16;
  const attn::Matrix<float> K =
      attn_bench::random_matrix<float>(512, decode_kv_heads * decode_dim, 1);
  double paged_bytes = 0, contiguous_bytes = 0, token_bytes = 0;
  for (auto _ : state) {
    attn::PagedKVCache<float> paged(paged_config);
    std::vector<attn::KVCache<float>> caches;
    for (const int n : lengths) {
      const auto id = paged.add_sequence();
      caches.emplace_back(config);
      for (int done = 0; done < n; done += 512) {
        const Index rows = std::min(512, n - done);
        paged.append(id, K.topRows(rows), K.topRows(rows));
        caches.back().append(K.topRows(rows), K.topRows(rows));
      }
    }
    paged_bytes = double(paged.bytes_in_use());
    contiguous_bytes = 0;
    token_bytes = 0;
    for (std::size_t b = 0; b < caches.size(); ++b) {
      contiguous_bytes += double(caches[b].bytes());
      token_bytes += double(attn::KVCache<float>::bytes_for(config, lengths[b]));
    }
  }
  state.counters["paged_bytes"] = paged_bytes;
  state.counters["kvcache_bytes"] = contiguous_bytes;
  state.counters["token_bytes"] = token_bytes;
}

void thread_counts(benchmark::internal::Benchmark* b) {
  b->Arg(1)->Arg(2)->ArgNames({"threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_varlen_prefill)->Apply(thread_counts);
BENCHMARK(BM_per_sequence_flash)->Apply(thread_counts);
BENCHMARK(BM_paged_decode)
    ->ArgsProduct({{0, 1}, {16, 256}, {2}})
    ->ArgNames({"batch", "page", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_kvcache_loop)
    ->ArgsProduct({{0, 1}, {2}})
    ->ArgNames({"batch", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_stream_sum)
    ->Arg(2)
    ->ArgNames({"threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_shared_prefix)
    ->Arg(0)
    ->Arg(1)
    ->ArgNames({"cascade"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_cache_memory)->Iterations(1)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) { return attn_bench::run_benchmarks(argc, argv); }

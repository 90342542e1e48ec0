// Serving many sequences at once: a toy decoder of two attention layers (random weights, RoPE,
// float16 keys and values) answers a stream of requests by continuous batching over one paged
// cache per layer. Each step is one `forward_step` per layer for the whole batch: chunks of new
// prompts and one token of every sequence that is generating, mixed. Half the requests start with
// the same system prompt, read once and shared by `fork`; some ask for two samples, forked after
// their prompt. A finished sequence is removed and its pages go back to the pool for the next
// requests. It prints a progress line as it goes, then tokens per second, the pages in use and the
// memory one `KVCache` per sequence would have held. The check at the end replays one request
// alone, one `KVCache` per layer and the same chunks, and must produce the same tokens.
//
//   build/examples/attn-serve [--requests N] [--budget ROWS] [--pages N]
#include <algorithm>
#include <attn/attn.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <vector>

namespace {

using attn::Index;
using Matrix = attn::Matrix<float>;

constexpr Index vocab = 256;
constexpr Index d_model = 256;
constexpr Index layers = 2;
constexpr Index chunk = 64;  // prompt rows per sequence and step

/// The model: token embeddings (also the output projection) and two layers with residuals.
struct Model {
  Matrix embedding;
  std::vector<attn::MultiHeadAttention<float>> layer;
  Model() : embedding(Matrix::Random(vocab, d_model)) {
    attn::MultiHeadConfig config{d_model, 8};
    config.num_kv_heads = 2;
    for (Index l = 0; l < layers; ++l) {
      layer.emplace_back(config, /*seed=*/unsigned(l + 1));
      layer.back().rope = attn::RopeStyle::Half;
    }
  }
  attn::KVCacheConfig<float> cache_config() const {
    attn::KVCacheConfig<float> c;
    c.d_k = c.d_v = layer[0].head_dim();
    c.kv_heads = 2;
    c.storage = attn::KVStorage::Float16;
    return c;
  }
  Matrix embed(const std::vector<Index>& tokens) const {
    Matrix x(Index(tokens.size()), d_model);
    for (std::size_t i = 0; i < tokens.size(); ++i) x.row(Index(i)) = embedding.row(tokens[i]);
    return x;
  }
  /// A token drawn from the softmax of the logits E h^T at temperature 0.5.
  Index sample(const Matrix& h_row, std::mt19937& rng) const {
    const Eigen::VectorXf logits = embedding * h_row.transpose() / 0.5f;
    const Eigen::VectorXf p = (logits.array() - logits.maxCoeff()).exp().matrix();
    std::uniform_real_distribution<float> u(0.0f, p.sum());
    float r = u(rng);
    for (Index t = 0; t < vocab; ++t) {
      if ((r -= p(t)) <= 0.0f) return t;
    }
    return vocab - 1;
  }
};

/// One sequence being served: its prompt (after the shared system prompt, if any), what it has
/// generated, and the rows it has had per step (for the replay).
struct Sequence {
  Index id = 0;  // the same id in every layer's cache (they add and fork in the same order)
  Index request = 0;
  bool system = false;
  std::vector<Index> prompt;
  Index prefilled = 0;
  std::vector<Index> generated;
  Index max_new = 0;
  bool twin = false;  // a second sample, forked when the prompt is read
  std::mt19937 rng;
  std::vector<Index> steps;  // rows per step, in order
};

}  // namespace

int main(int argc, char** argv) {
  Index requests = 128;
  Index budget = 256;  // rows per step
  Index pages = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--requests") == 0) requests = std::atol(argv[i + 1]);
    if (std::strcmp(argv[i], "--budget") == 0) budget = std::atol(argv[i + 1]);
    if (std::strcmp(argv[i], "--pages") == 0) pages = std::atol(argv[i + 1]);
  }
  if (requests < 1 || budget < chunk || pages < 64) {
    std::fprintf(stderr,
                 "usage: attn-serve [--requests N >= 1] [--budget ROWS >= 64] [--pages N >= 64]\n");
    return 2;
  }
  std::srand(1);
  const Model model;
  attn::PagedKVCacheConfig<float> config;
  static_cast<attn::KVCacheConfig<float>&>(config) = model.cache_config();
  config.page_size = 16;
  config.pages = pages;
  const attn::PagedKVCache<float> empty(config);
  std::vector<attn::PagedKVCache<float>> cache(static_cast<std::size_t>(layers), empty);

  // The requests: prompts of 16 .. 256 tokens, 16 .. 64 new tokens, every other one after the
  // system prompt, every third one with two samples.
  std::mt19937 draw(7);
  std::vector<Index> system_prompt(128);
  for (Index& t : system_prompt) t = Index(draw() % vocab);
  struct Request {
    std::vector<Index> prompt;
    Index max_new, samples;
    bool system;
  };
  std::deque<Request> waiting;
  for (Index r = 0; r < requests; ++r) {
    Request q;
    q.prompt.resize(16 + draw() % 241);
    for (Index& t : q.prompt) t = Index(draw() % vocab);
    q.max_new = 16 + Index(draw() % 49);
    q.samples = r % 3 == 2 ? 2 : 1;
    q.system = r % 2 == 0;
    waiting.push_back(q);
  }

  // The system prompt, read once (in chunks, as any prompt) into a sequence of its own.
  std::vector<Index> system_steps;
  Index system_id = 0;
  for (auto& c : cache) system_id = c.add_sequence();
  for (Index done = 0; done < Index(system_prompt.size()); done += chunk) {
    const Index n = std::min<Index>(chunk, Index(system_prompt.size()) - done);
    Matrix h = model.embed({system_prompt.begin() + done, system_prompt.begin() + done + n});
    for (Index l = 0; l < layers; ++l) {
      h += model.layer[std::size_t(l)].forward_step(h, cache[std::size_t(l)], {system_id},
                                                    {0, int(n)});
    }
    system_steps.push_back(n);
  }

  std::vector<Sequence> running;
  std::vector<Sequence> finished;
  Index next_request = 0, tokens_done = 0, step = 0, peak_pages = 0;
  double peak_kvcache_bytes = 0;
  const auto started = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  };
  const Index page_tokens = config.page_size;
  while (!waiting.empty() || !running.empty()) {
    // Admit requests while the pool has room for their prompts and answers (every sample's own
    // pages, the system prompt's shared).
    while (!waiting.empty()) {
      const Request& q = waiting.front();
      const Index tokens = Index(q.prompt.size()) + q.max_new + 1;
      const Index need = q.samples * (tokens / page_tokens + 2);
      Index reserved = 0;
      for (const Sequence& s : running) {
        const Index to_come =
            Index(s.prompt.size()) + s.max_new + 1 - s.prefilled - Index(s.generated.size());
        reserved += (s.twin ? 2 : 1) * (to_come / page_tokens + 2);
      }
      if (cache[0].free_pages() - reserved < need) {
        if (running.empty()) {
          std::fprintf(stderr, "attn-serve: a request needs %ld pages, the pool has %ld\n",
                       long(need), long(cache[0].free_pages()));
          return 2;
        }
        break;
      }
      Sequence s;
      s.request = next_request++;
      s.system = q.system;
      s.prompt = q.prompt;
      s.max_new = q.max_new;
      s.rng.seed(unsigned(1000 + s.request));
      for (auto& c : cache) s.id = q.system ? c.fork(system_id) : c.add_sequence();
      s.twin = q.samples == 2;
      running.push_back(s);
      waiting.pop_front();
    }
    // One step: a row for every generating sequence, then prompt chunks within the budget.
    std::vector<Index> ids;
    std::vector<int> cu{0};
    std::vector<Index> tokens;
    std::vector<std::size_t> who;
    Index left = budget;
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t i = 0; i < running.size() && left > 0; ++i) {
        Sequence& s = running[i];
        const bool prefilling = s.prefilled < Index(s.prompt.size());
        if (prefilling != (pass == 1)) continue;
        const Index n =
            prefilling ? std::min({chunk, Index(s.prompt.size()) - s.prefilled, left}) : 1;
        if (prefilling) {
          tokens.insert(tokens.end(), s.prompt.begin() + s.prefilled,
                        s.prompt.begin() + s.prefilled + n);
        } else {
          tokens.push_back(s.generated.back());
        }
        ids.push_back(s.id);
        cu.push_back(cu.back() + int(n));
        who.push_back(i);
        s.steps.push_back(n);
        left -= n;
      }
    }
    Matrix h = model.embed(tokens);
    for (Index l = 0; l < layers; ++l) {
      h += model.layer[std::size_t(l)].forward_step(h, cache[std::size_t(l)], ids, cu);
    }
    tokens_done += Index(tokens.size());
    // Each sequence whose prompt is read, or which is generating, draws its next token.
    std::vector<Sequence> forks;
    for (std::size_t b = 0; b < who.size(); ++b) {
      Sequence& s = running[who[b]];
      const bool was_prefilling = s.prefilled < Index(s.prompt.size());
      if (was_prefilling) s.prefilled += cu[b + 1] - cu[b];
      if (s.prefilled < Index(s.prompt.size())) continue;
      const Matrix last = h.row(cu[b + 1] - 1);
      if (s.twin) {  // two samples: the second shares every page of the first
        s.twin = false;
        Sequence twin = s;
        for (auto& c : cache) twin.id = c.fork(s.id);
        twin.rng.seed(unsigned(2000 + s.request));
        twin.generated.push_back(model.sample(last, twin.rng));
        forks.push_back(twin);
      }
      s.generated.push_back(model.sample(last, s.rng));
    }
    for (Sequence& twin : forks) running.push_back(twin);
    // Memory, at its peak: the pages in use against one KVCache per sequence.
    double kvcache_bytes =
        double(attn::KVCache<float>::bytes_for(model.cache_config(), Index(system_prompt.size())));
    for (const Sequence& s : running) {
      kvcache_bytes +=
          double(attn::KVCache<float>::bytes_for(model.cache_config(), cache[0].length(s.id)));
    }
    if (cache[0].pages_in_use() > peak_pages) {
      peak_pages = cache[0].pages_in_use();
      peak_kvcache_bytes = kvcache_bytes * double(layers);
    }
    // Finished sequences leave; their pages return to the pool.
    for (std::size_t i = running.size(); i-- > 0;) {
      Sequence& s = running[i];
      if (Index(s.generated.size()) >= s.max_new) {
        for (auto& c : cache) c.remove(s.id);
        finished.push_back(std::move(s));
        running.erase(running.begin() + std::ptrdiff_t(i));
      }
    }
    if (++step % 25 == 0) {
      std::printf(
          "step %4ld: %3zu running, %3zu waiting, %3zu done, %6.0f tokens/s, pages %4ld / %ld\n",
          long(step), running.size(), waiting.size(), finished.size(),
          double(tokens_done) / seconds(), long(cache[0].pages_in_use()), long(pages));
      std::fflush(stdout);
    }
  }
  const double elapsed = seconds();
  const double page_bytes = double(cache[0].page_bytes()) * double(layers);
  std::printf(
      "served %ld requests (%zu sequences) in %ld steps: %ld tokens in %.2f s, %.0f tokens/s\n",
      long(requests), finished.size(), long(step), long(tokens_done), elapsed,
      double(tokens_done) / elapsed);
  std::printf(
      "memory at the peak: %ld pages in use per layer, %.2f MiB in all; one KVCache per "
      "sequence would have held %.2f MiB (%.2fx)\n",
      long(peak_pages), double(peak_pages) * page_bytes / 1048576.0, peak_kvcache_bytes / 1048576.0,
      peak_kvcache_bytes / (double(peak_pages) * page_bytes));

  // The check: the first request, replayed alone through one KVCache per layer with the same
  // chunks (the system prompt's, then its own) and the same random draws, gives the same tokens.
  const auto first = std::find_if(finished.begin(), finished.end(),
                                  [](const Sequence& s) { return s.request == 0; });
  const attn::KVCache<float> fresh(model.cache_config());
  std::vector<attn::KVCache<float>> alone(static_cast<std::size_t>(layers), fresh);
  const auto run = [&](const std::vector<Index>& rows) {
    Matrix h = model.embed(rows);
    for (Index l = 0; l < layers; ++l) {
      h += model.layer[std::size_t(l)].forward_step(h, alone[std::size_t(l)]);
    }
    return h;
  };
  if (first->system) {
    Index done = 0;
    for (const Index n : system_steps) {
      run({system_prompt.begin() + done, system_prompt.begin() + done + n});
      done += n;
    }
  }
  std::mt19937 rng(1000u);
  std::vector<Index> replayed;
  Index read = 0;
  for (const Index n : first->steps) {
    const bool prompt = read < Index(first->prompt.size());
    const Matrix h = prompt ? run({first->prompt.begin() + read, first->prompt.begin() + read + n})
                            : run({replayed.back()});
    if (prompt) read += n;
    if (read == Index(first->prompt.size())) replayed.push_back(model.sample(h.bottomRows(1), rng));
  }
  const bool same = replayed == first->generated;
  std::printf("check: request 0's %zu tokens, replayed alone over one KVCache per layer: %s\n",
              first->generated.size(), same ? "the same tokens" : "DIFFERENT tokens");
  return same ? 0 : 1;
}

/// \file part3_causal.cpp
/// Part 3: Part 1's tokens with a causal mask (`attn::Causal::BottomRight`): the masked scores,
/// the softmax over the keys each token may see, the outputs. The steps are Part 1's. Then the
/// same outputs token by token through a `KVCache` (decoding), and what such a cache costs in
/// memory for a Llama-style model in each storage format (`KVCache::bytes_for`).

#include <attn/attn.hpp>
#include <cstdio>
#include <iostream>
#include <string>

#include "../documents.hpp"
#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {

void part3() {
  print_heading("Part 3: the same 3 tokens with a causal mask (attn::Causal::BottomRight)");
  std::cout << "A causal mask sets the scores of future positions to -inf before the softmax, so\n"
               "their weights become exactly 0: token i attends to tokens 1..i only.\n\n";
  const attn::QKV<double> tokens = attn_examples::three_tokens();
  attn::AttentionOptions<double> options;
  options.causal = attn::Causal::BottomRight;
  const Trace trace = attn::trace_attention(tokens.Q, tokens.K, tokens.V, options);

  std::cout << "Masked scores (scaled; future keys -inf):\n\n";
  print_score_rows(trace.masked);
  print_softmax_rows(trace);
  std::cout << "\n";
  print_outputs(trace, tokens.V);

  std::cout << "\nDecoding: a model generating text sees one new token at a time. A KVCache keeps\n"
               "the keys and values of the tokens so far, so each step computes attention for\n"
               "its new query only; its outputs are the causal rows above:\n\n";
  attn::KVCache<double> cache(tokens.K.cols(), tokens.V.cols());
  for (Index i = 0; i < tokens.Q.rows(); ++i) {
    cache.append(tokens.K.row(i), tokens.V.row(i));
    const Matrix out = cache.attend(tokens.Q.row(i));
    std::cout << "  • Step " << token_number(i) << ": cache of " << cache.size()
              << (cache.size() == 1 ? " token" : " tokens") << " → output "
              << bracketed_row(out, 0, four_places) << "\n";
  }

  // A Llama-style shape: 32 query heads over 8 key/value heads of d = 128, 32 layers.
  constexpr Index tokens_held = 32768;
  constexpr Index layers = 32;
  std::cout
      << "\nEach step reads the whole cache, and the cache grows with the context. For a\n"
         "Llama-style model (32 layers; 32 query heads sharing 8 key/value heads of d = 128)\n"
         "at "
      << tokens_held << " tokens, the cache takes (KVCache::bytes_for, times 32 layers):\n\n";
  attn::KVCacheConfig<float> config;
  config.d_k = 128;
  config.d_v = 128;
  config.kv_heads = 8;
  struct Storage {
    attn::KVStorage storage;
    const char* name;
  };
  for (const Storage f :
       {Storage{attn::KVStorage::Same, "float (KVStorage::Same)"},
        Storage{attn::KVStorage::Float16, "KVStorage::Float16"},
        Storage{attn::KVStorage::BFloat16, "KVStorage::BFloat16"},
        Storage{attn::KVStorage::Int8, "KVStorage::Int8 (+ one scale per row)"}}) {
    config.storage = f.storage;
    const double bytes =
        static_cast<double>(attn::KVCache<float>::bytes_for(config, tokens_held) * layers);
    char line[128];
    std::snprintf(line, sizeof line, "  • %-40s %6.2f GiB\n", f.name, bytes / (1 << 30));
    std::cout << line;
  }
  std::cout << "\nFewer bytes per key are also a faster step: decoding streams the cache once.\n";
}

}  // namespace walkthrough

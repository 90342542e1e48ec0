// Decoding with a key/value cache: a toy language model of one attention layer (8 query heads over
// 2 key/value heads, RoPE, float16 keys and values in the cache) reads a prompt in one call, then
// generates tokens one at a time, each step one `forward_step` over the cache. At the end the
// whole sequence goes through the layer's full causal forward, which must give what the steps
// gave, up to the cache's float16 rounding.
//
//   build/examples/attn-decode [--prompt N] [--steps N]
#include <attn/attn.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  using attn::Index;
  using Matrix = attn::Matrix<float>;
  Index prompt = 12;
  Index steps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--prompt") == 0) prompt = std::atol(argv[i + 1]);
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atol(argv[i + 1]);
  }
  if (prompt < 1 || steps < 0) {
    std::fprintf(stderr, "usage: attn-decode [--prompt N >= 1] [--steps N >= 0]\n");
    return 2;
  }
  constexpr Index vocab = 64;
  constexpr Index d_model = 256;

  // The model: token embeddings (also the output projection, as in GPT-2) and one layer.
  std::srand(1);
  const Matrix embedding = Matrix::Random(vocab, d_model);
  attn::MultiHeadConfig config{d_model, 8};
  config.num_kv_heads = 2;
  attn::MultiHeadAttention<float> layer(config, /*seed=*/1);
  layer.rope = attn::RopeStyle::Half;  // rotate queries and keys by position (GPT-NeoX pairing)

  // The cache: the layer's 2 key/value heads of width 32, kept as float16.
  attn::KVCacheConfig<float> cache_config;
  cache_config.d_k = layer.head_dim();
  cache_config.d_v = layer.head_dim();
  cache_config.kv_heads = 2;
  cache_config.storage = attn::KVStorage::Float16;
  attn::KVCache<float> cache(cache_config);

  // The next token: the embedding closest to the attention's output (the logits E out^T).
  const auto next_token = [&](const Matrix& out) {
    Index best = 0;
    (embedding * out.transpose()).col(0).maxCoeff(&best);
    return best;
  };

  std::vector<Index> tokens;
  for (Index i = 0; i < prompt; ++i) tokens.push_back((7 * i + 3) % vocab);  // any prompt
  Matrix inputs(prompt + steps, d_model);   // every token's embedding, for the check
  Matrix stepped(prompt + steps, d_model);  // every step's output
  for (Index i = 0; i < prompt; ++i) inputs.row(i) = embedding.row(tokens[std::size_t(i)]);

  // Prefill: the whole prompt in one call (its keys and values go into the cache).
  stepped.topRows(prompt) = layer.forward_step(inputs.topRows(prompt), cache);
  Index next = next_token(stepped.row(prompt - 1));
  // Decode: one token per step, attending over everything before it.
  for (Index t = prompt; t < prompt + steps; ++t) {
    tokens.push_back(next);
    inputs.row(t) = embedding.row(next);
    stepped.row(t) = layer.forward_step(inputs.row(t), cache);
    next = next_token(stepped.row(t));
  }

  std::printf("prompt:   ");
  for (Index i = 0; i < prompt; ++i) std::printf(" %ld", static_cast<long>(tokens[std::size_t(i)]));
  std::printf("\ngenerated:");
  for (Index i = prompt; i < prompt + steps; ++i) {
    std::printf(" %ld", static_cast<long>(tokens[std::size_t(i)]));
  }
  std::printf("\ncache: %ld tokens, %ld bytes (float16)\n", static_cast<long>(cache.size()),
              static_cast<long>(cache.bytes()));

  // The check: the full causal forward over the same inputs (float keys and values).
  attn::MultiHeadOptions<float> causal;
  causal.causal = attn::Causal::BottomRight;
  const Matrix full = layer.forward(inputs, causal);
  const float error = (stepped - full).cwiseAbs().maxCoeff() / full.cwiseAbs().maxCoeff();
  std::printf("check: the steps differ from the full causal forward by %.1e of its largest entry\n",
              static_cast<double>(error));
  return error < 1e-2f ? 0 : 1;
}

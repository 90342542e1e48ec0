#pragma once
/// \file documents.hpp
/// The inputs of the teaching documents' small examples, typed in once: the first document's 3
/// tokens and the second document's "I love AI". `attn-walkthrough` prints and draws them, the
/// click-a-word page (it_example.hpp) steps through the 3 tokens, tests/render_test.cpp checks
/// both pictures.

#include <attn/attn.hpp>
#include <string>
#include <vector>

namespace attn_examples {

using Matrix = attn::Matrix<double>;
using attn::Index;

/// The first document's three tokens: Q, K and V given directly (d_k = 2).
inline attn::QKV<double> three_tokens() {
  attn::QKV<double> t{Matrix(3, 2), Matrix(3, 2), Matrix(3, 2)};
  t.Q << 1, 0, 0, 1, 1, 1;
  t.K << 1, 0, 0, 1, 1, 1;
  t.V << 1, 0, 0, 1, 0.5, 0.5;
  return t;
}

/// The second document's "I love AI" NumPy example: words, X (3 x 4) and W_q, W_k, W_v (4 x 2).
struct ILoveAi {
  std::vector<std::string> words{"I", "love", "AI"};
  Matrix X{3, 4};
  Matrix W_q{4, 2};
  Matrix W_k{4, 2};
  Matrix W_v{4, 2};
  ILoveAi() {
    X << 1, 0, 1, 0,  // "I"
        0, 2, 0, 1,   // "love"
        1, 1, 1, 1;   // "AI"
    W_q << 1, 0, 0, 1, 1, 0, 0, 1;
    W_k << 0, 1, 1, 0, 0, 1, 1, 0;
    W_v << 1, 0, 0, 1, 1, 1, 0, 0;
  }
  /// The 3 x 3 attention weights, softmax(Q K^T / sqrt(2)).
  Matrix weights() const {
    const attn::QKV<double> qkv = attn::project_qkv(X, W_q, W_k, W_v);
    return attn::attention_with_weights(qkv.Q, qkv.K, qkv.V).weights;
  }
};

}  // namespace attn_examples

#include <attn/attn.hpp>
#include <iostream>

int main() {
  attn::Matrix<double> Q(3, 2), V(3, 2);
  Q << 1, 0,   // token 1
       0, 1,   // token 2
       1, 1;   // token 3
  V << 1, 0, 0, 1, 0.5, 0.5;
  const attn::Matrix<double>& K = Q;  // the document uses the same vectors for Q and K

  // softmax(Q K^T / sqrt(2)) V: row 1 is [0.6017, 0.3983]
  std::cout << attn::scaled_dot_product_attention(Q, K, V) << "\n";

  attn::AttentionOptions<double> causal;
  causal.causal = attn::Causal::BottomRight;  // token i sees tokens 1..i only
  std::cout << attn::attention_with_weights(Q, K, V, causal).weights << "\n";
}

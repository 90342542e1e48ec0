// A consumer of the attn package: the first document's 3-token example, row 1.
#include <attn/attn.hpp>
#include <cmath>
#include <cstdio>

int main() {
  attn::Matrix<double> Q(3, 2);
  Q << 1, 0, 0, 1, 1, 1;
  attn::Matrix<double> V(3, 2);
  V << 1, 0, 0, 1, 0.5, 0.5;
  const attn::Matrix<double> out = attn::scaled_dot_product_attention(Q, Q, V);
  if (std::abs(out(0, 0) - 0.6017) > 1e-4) return 1;
  std::printf("consumer ok: %.4f %.4f\n", out(0, 0), out(0, 1));
  return 0;
}

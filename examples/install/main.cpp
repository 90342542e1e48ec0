// A program built against an installed attn (see CMakeLists.txt): the first teaching document's
// three tokens, one output row per token.
#include <attn/attn.hpp>
#include <cstdio>

int main() {
  attn::Matrix<double> Q(3, 2), V(3, 2);
  Q << 1, 0, 0, 1, 1, 1;
  V << 1, 0, 0, 1, 0.5, 0.5;
  const attn::Matrix<double> out = attn::scaled_dot_product_attention(Q, Q, V);
  for (attn::Index i = 0; i < 3; ++i) {
    std::printf("token %ld -> [%.4f, %.4f]\n", static_cast<long>(i + 1), out(i, 0), out(i, 1));
  }
  std::printf("attn %d.%d.%d, installed\n", ATTN_VERSION_MAJOR, ATTN_VERSION_MINOR,
              ATTN_VERSION_PATCH);
  return 0;
}

// Training on documents packed into one sequence, with a learnable T5 relative position bias, by
// plain SGD through the exact backward of attention with a variant (docs/variants.md).
// Each step packs a few documents of random lengths into one sequence; the task is to predict, at
// each token, the token two places back in the same document. The queries and keys carry no
// information (zero), so only the bias can find "two back": the variant is
// both(DocumentMask(causal), T5Bias), and its table learns, through `attention_backward`'s
// parameter gradient, to weigh distance 2. The loss (cross-entropy) must fall by more than half and
// distance 2 must carry the table's largest bias.
//
//   build/examples/attn-packed-documents [--steps N]
#include <attn/attn.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  using attn::Index;
  using Matrix = attn::Matrix<float>;
  int steps = 300;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
  }
  constexpr Index vocab = 8, documents = 6, lag = 2;
  constexpr float learning_rate = 2.0f;
  std::mt19937 rng(5);
  std::uniform_int_distribution<Index> length(6, 20), token(0, vocab - 1);

  attn::T5Bias<float> bias(/*heads=*/1, /*buckets=*/16, /*max_distance=*/32,
                           /*bidirectional=*/false);
  Matrix W_out = Matrix::Zero(vocab, vocab);  // the read-out: attended one-hot token -> logits
  double first_loss = 0, loss = 0;
  for (int step = 0; step <= steps; ++step) {
    // A packed batch: documents of random lengths, their boundaries, one-hot tokens, targets.
    std::vector<Index> offsets{0};
    for (Index d = 0; d < documents; ++d) offsets.push_back(offsets.back() + length(rng));
    const Index n = offsets.back();
    std::vector<Index> tokens(static_cast<std::size_t>(n));
    for (Index& t : tokens) t = token(rng);
    const Matrix Q = Matrix::Zero(n, 1), K = Matrix::Zero(n, 1);  // scores come from the bias
    Matrix V = Matrix::Zero(n, vocab);
    for (Index i = 0; i < n; ++i) V(i, tokens[static_cast<std::size_t>(i)]) = 1;
    const auto variant = attn::both(attn::DocumentMask(offsets, /*causal=*/true), bias);

    // Forward: attention, read-out, softmax, cross-entropy where two tokens back is in the same
    // document (dZ = p - onehot there, 0 elsewhere).
    const Matrix O = attn::flash_attention(Q, K, V, variant);
    const Matrix Z = O * W_out;
    const Matrix P = attn::softmax_rows(Z);
    Matrix dZ = Matrix::Zero(n, vocab);
    loss = 0;
    Index counted = 0;
    for (Index d = 0; d < documents; ++d) {
      for (Index i = offsets[static_cast<std::size_t>(d)] + lag;
           i < offsets[static_cast<std::size_t>(d) + 1]; ++i) {
        const Index target = tokens[static_cast<std::size_t>(i - lag)];
        loss -= std::log(std::max(double(P(i, target)), 1e-12));
        dZ.row(i) = P.row(i);
        dZ(i, target) -= 1;
        ++counted;
      }
    }
    loss /= double(counted);
    dZ /= static_cast<float>(counted);
    if (step == 0) first_loss = loss;
    if (step % 50 == 0) std::printf("step %3d: loss %.4f\n", step, loss);
    if (step == steps) break;

    // Backward: the read-out's gradient, then attention's, with the bias table's.
    const Matrix dW_out = O.transpose() * dZ;
    const Matrix dO = dZ * W_out.transpose();
    attn::AttentionGrads<float> grads;
    Matrix d_table;
    attn::attention_backward(Q, K, V, dO, variant, {}, grads, d_table);
    W_out -= learning_rate * dW_out;
    bias.table() -= learning_rate * d_table;
  }

  // What the table learned: the bias of each distance back, and the weight on two back.
  std::printf("bias by distance back:");
  for (Index distance = 0; distance <= 4; ++distance) {
    std::printf(" %d: %.2f", int(distance), double(bias.table()(0, bias.bucket(distance, 0))));
  }
  std::printf("\nafter %d steps: loss %.4f, from %.4f\n", steps, loss, first_loss);
  bool two_back_wins = true;
  for (Index distance = 0; distance <= 8; ++distance) {
    if (distance != lag &&
        !(bias.table()(0, bias.bucket(distance, 0)) < bias.table()(0, bias.bucket(lag, 0)))) {
      two_back_wins = false;
    }
  }
  if (!(loss < 0.5 * first_loss) || !two_back_wins) {
    std::printf(
        "check: the loss did not fall by half, or distance %d does not carry the largest bias\n",
        int(lag));
    return 1;
  }
  std::printf("check: the loss fell by %.0f%%\n", 100.0 * (1.0 - loss / first_loss));
  return 0;
}

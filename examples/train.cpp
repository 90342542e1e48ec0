// Training one attention layer by plain SGD through its exact backward: the layer learns to copy
// the previous token (a task attention can only solve by position: RoPE gives it the positions).
// Each step draws a batch of random token sequences, runs `backward` (the forward included) and
// moves every weight against its gradient. The loss is the mean squared error between the output
// and the previous token's embedding; it must fall by more than 30% from its start.
//
//   build/examples/attn-train [--steps N] [--lr RATE]
#include <attn/attn.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

int main(int argc, char** argv) {
  using attn::Index;
  using Matrix = attn::Matrix<float>;
  int steps = 300;
  float learning_rate = 0.2f;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--lr") == 0) learning_rate = std::strtof(argv[i + 1], nullptr);
  }
  constexpr Index vocab = 16, d_model = 32, n = 12, batch = 8;

  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Matrix embedding(vocab, d_model);  // fixed random token vectors of length about 1
  for (Index i = 0; i < embedding.size(); ++i) {
    embedding.data()[i] = normal(rng) / std::sqrt(float(d_model));
  }
  attn::MultiHeadConfig config{d_model, 4};
  attn::MultiHeadAttention<float> layer(config, /*seed=*/3);
  layer.rope = attn::RopeStyle::Half;
  attn::MultiHeadOptions<float> causal;
  causal.causal = attn::Causal::BottomRight;  // a token sees itself and the tokens before it

  std::uniform_int_distribution<Index> token(0, vocab - 1);
  attn::Tensor3<float> x(batch, n, d_model), target(batch, n, d_model), d_out(batch, n, d_model);
  float first_loss = 0, loss = 0;
  for (int step = 0; step <= steps; ++step) {
    // A batch: token sequences, and as target each position's previous token (the first: itself).
    for (Index b = 0; b < batch; ++b) {
      Index previous = token(rng);
      for (Index i = 0; i < n; ++i) {
        const Index t = i == 0 ? previous : token(rng);
        for (Index c = 0; c < d_model; ++c) {
          x(b, i, c) = embedding(t, c);
          target(b, i, c) = embedding(previous, c);
        }
        previous = t;
      }
    }
    const attn::Tensor3<float> y = layer.forward(x, x, x, causal).output;
    loss = 0;
    for (Index k = 0; k < y.size(); ++k) {
      const float e = y.data()[k] - target.data()[k];
      loss += e * e / float(batch * n);
      d_out.data()[k] = 2 * e / float(batch * n);  // d(loss)/d(output)
    }
    if (step == 0) first_loss = loss;
    if (step % 50 == 0) std::printf("step %4d  loss %.4f\n", step, static_cast<double>(loss));
    if (step == steps) break;
    // The gradients of every weight and bias, then one SGD step.
    const attn::MultiHeadGrads<float> g = layer.backward(x, x, x, d_out, causal);
    layer.W_Q -= learning_rate * g.dW_Q;
    layer.W_K -= learning_rate * g.dW_K;
    layer.W_V -= learning_rate * g.dW_V;
    layer.W_O -= learning_rate * g.dW_O;
    layer.b_Q -= learning_rate * g.db_Q;
    layer.b_K -= learning_rate * g.db_K;
    layer.b_V -= learning_rate * g.db_V;
    layer.b_O -= learning_rate * g.db_O;
  }
  std::printf("loss %.4f -> %.4f after %d steps\n", static_cast<double>(first_loss),
              static_cast<double>(loss), steps);
  return loss < 0.7f * first_loss ? 0 : 1;
}

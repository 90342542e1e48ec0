/// \file part6_gradients.cpp
/// Part 6: gradients. First the first document's trap ("without [the 1/√d_k scaling], large dot
/// products push softmax into a near-one-hot, tiny-gradient regime"), measured for d_k = 16 to
/// 1024; then one causal self-attention layer that learns a small task by plain SGD, its
/// gradients by the chain rule and `attn::attention_backward`.
///
/// Every random number comes from `SplitMix64` below (a fixed seed, the same stream on every
/// platform); tests/data/check_gradient_trap.py draws the same numbers and recomputes the trap
/// table with NumPy, independently of attn.

#include <algorithm>
#include <attn/attn.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {
namespace {

/// splitmix64 (Steele, Lea and Flood 2014, the seeding generator of Java's SplittableRandom):
/// a 64-bit counter passed through a mixing function. Chosen because its few lines are easy to
/// repeat exactly in another language (the Python check does).
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  /// Uniform in (0, 1] (53 random bits), so that its log is finite.
  double uniform() { return (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53; }

  /// N(0, 1) by the Box-Muller transform, one value from two uniforms: sqrt(-2 ln u1) cos(2π u2).
  double normal() {
    const double radius = std::sqrt(-2.0 * std::log(uniform()));
    return radius * std::cos(2.0 * std::acos(-1.0) * uniform());
  }

  /// rows x cols N(0, 1) entries, drawn row by row.
  Matrix normal_matrix(Index rows, Index cols) {
    Matrix M(rows, cols);
    for (Index i = 0; i < rows; ++i) {
      for (Index j = 0; j < cols; ++j) M(i, j) = normal();
    }
    return M;
  }

 private:
  std::uint64_t state_;
};

/// The median of `values` (the mean of the two middle ones for an even count).
double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t half = values.size() / 2;
  return values.size() % 2 == 1 ? values[half] : 0.5 * (values[half - 1] + values[half]);
}

// ---------------------------------------------------------------------------------------------
// The trap
// ---------------------------------------------------------------------------------------------

constexpr std::uint64_t trap_seed = 6;
constexpr Index trap_tokens = 64;  // n = m

/// One side (scaled or not) of one row of the trap table, from the weights P and dS.
struct TrapSide {
  double weight = 0;    // median over rows of max_j P_ij
  double gradient = 0;  // median over rows of ||dS_i||
  double table = 0;     // ||dS||_F over the whole table
  Index one_hot = 0;    // rows whose largest weight exceeds 0.99
};

TrapSide measure_side(const Matrix& P, const Matrix& dS) {
  std::vector<double> largest;
  std::vector<double> gradient;
  TrapSide side;
  for (Index i = 0; i < P.rows(); ++i) {
    largest.push_back(P.row(i).maxCoeff());
    gradient.push_back(dS.row(i).norm());
    if (largest.back() > 0.99) ++side.one_hot;
  }
  side.weight = median(largest);
  side.gradient = median(gradient);
  side.table = dS.norm();
  return side;
}

// ---------------------------------------------------------------------------------------------
// The training demo: one causal self-attention layer learns "repeat the symbol two places back"
// ---------------------------------------------------------------------------------------------

constexpr std::uint64_t training_seed = 12;
constexpr Index vocabulary = 6;  // symbols a..f
constexpr Index length = 10;     // tokens per sequence
constexpr Index lag = 2;         // the target at position i is the symbol at i - lag
constexpr Index features = vocabulary + length;  // one-hot symbol, then one-hot position
constexpr Index width = 16;                      // d_k = d_v
constexpr Index batch = 16;                      // sequences per SGD step
constexpr int steps = 300;
constexpr int report_every = 25;
constexpr double learning_rate = 1.0;

/// The layer's parameters (and, with the same shapes, their gradients).
struct Layer {
  Matrix W_Q = Matrix::Zero(features, width);
  Matrix W_K = Matrix::Zero(features, width);
  Matrix W_V = Matrix::Zero(features, width);
  Matrix W_O = Matrix::Zero(width, vocabulary);
};

/// `length` random symbols 0..vocabulary-1.
std::vector<Index> random_sequence(SplitMix64& random) {
  std::vector<Index> symbols;
  for (Index i = 0; i < length; ++i) {
    symbols.push_back(static_cast<Index>(random.next() % static_cast<std::uint64_t>(vocabulary)));
  }
  return symbols;
}

/// "c a f f b ...": `count` symbols from the first one.
std::string letters(const std::vector<Index>& symbols, Index count) {
  std::vector<std::string> items;
  for (Index k = 0; k < count; ++k) {
    items.push_back(std::string(1, static_cast<char>('a' + symbols[static_cast<std::size_t>(k)])));
  }
  return join(items, " ");
}

/// Step 1 of the math: X = [one-hot symbol | one-hot position], length x features.
Matrix embed(const std::vector<Index>& symbols) {
  Matrix X = Matrix::Zero(length, features);
  for (Index i = 0; i < length; ++i) {
    X(i, symbols[static_cast<std::size_t>(i)]) = 1.0;
    X(i, vocabulary + i) = 1.0;
  }
  return X;
}

attn::AttentionOptions<double> causal_options() {
  attn::AttentionOptions<double> options;
  options.causal = attn::Causal::BottomRight;  // token i sees tokens 0..i
  return options;
}

/// What one pass over a batch gives: the summed loss, the right guesses, the predictions counted.
struct Tally {
  double loss = 0;
  Index correct = 0;
  Index predictions = 0;
};

/// The forward pass over one sequence (steps 1 to 5) and, when `grads` is given, the backward pass
/// (steps 6 to 8), its gradients (of the loss summed over the sequence, divided by `scale_down`)
/// added into `grads`.
void run_sequence(const Layer& layer, const std::vector<Index>& symbols, double scale_down,
                  Tally& tally, Layer* grads) {
  // 1. Embed: X is length x features.
  const Matrix X = embed(symbols);
  // 2. Project: Q = X W_Q, K = X W_K, V = X W_V (length x width each).
  const attn::QKV<double> qkv = attn::project_qkv(X, layer.W_Q, layer.W_K, layer.W_V);
  // 3. Attend: O = softmax(Q K^T / √d_k, causal) V.
  const Matrix O = attn::scaled_dot_product_attention(qkv.Q, qkv.K, qkv.V, causal_options());
  // 4. Read out: logits Z = O W_O (length x vocabulary), probabilities p = softmax of each row.
  const Matrix Z = O * layer.W_O;
  const Matrix p = attn::softmax_rows(Z);
  // 5. Loss: cross-entropy -log p_i[target_i] at each position i >= lag (the first `lag`
  //    positions have nothing to repeat). Its gradient with respect to the logits is
  //    dZ_i = p_i - onehot(target_i), and 0 at the positions without a target.
  Matrix dZ = Matrix::Zero(length, vocabulary);
  for (Index i = lag; i < length; ++i) {
    const Index target = symbols[static_cast<std::size_t>(i - lag)];
    Index guess = 0;
    p.row(i).maxCoeff(&guess);
    tally.loss -= std::log(p(i, target));
    tally.correct += guess == target ? 1 : 0;
    ++tally.predictions;
    dZ.row(i) = p.row(i) / scale_down;
    dZ(i, target) -= 1.0 / scale_down;
  }
  if (grads == nullptr) return;
  // 6. Through the read-out Z = O W_O: dW_O = O^T dZ, dO = dZ W_O^T.
  grads->W_O.noalias() += O.transpose() * dZ;
  const Matrix dO = dZ * layer.W_O.transpose();
  // 7. Through attention: dQ, dK, dV (attn::attention_backward, the same causal options).
  const attn::AttentionGrads<double> d =
      attn::attention_backward(qkv.Q, qkv.K, qkv.V, dO, causal_options());
  // 8. Through the projections Q = X W_Q etc.: dW_Q = X^T dQ, dW_K = X^T dK, dW_V = X^T dV.
  grads->W_Q.noalias() += X.transpose() * d.dQ;
  grads->W_K.noalias() += X.transpose() * d.dK;
  grads->W_V.noalias() += X.transpose() * d.dV;
}

/// "100.0%".
std::string percent(Index part, Index whole) {
  return fixed(100.0 * static_cast<double>(part) / static_cast<double>(whole), 1) + "%";
}

void print_trap() {
  std::cout
      << "The first document's trap: \"without [the 1/√d_k scaling], large dot products push "
         "softmax into a\nnear-one-hot, tiny-gradient regime\". Measured: for each d_k, Q and K "
         "are "
      << trap_tokens << " x d_k with N(0, 1)\nentries (splitmix64 and Box-Muller, seed "
      << trap_seed
      << "), so each raw score Q_i·K_j has variance d_k, and\n"
         "P = softmax_rows(S) with S = Q K^T / √d_k (scaled) or S = Q K^T (unscaled). For the "
         "loss\n"
         "L = sum(G ∘ P), G a fixed "
      << trap_tokens << " x " << trap_tokens
      << " N(0, 1) table, dL/dP = G, and\n"
         "dS = softmax_rows_backward(P, G) = P ∘ (G - rowsum(G ∘ P)) is the gradient that reaches "
         "the\nscores, and through them Q and K (dQ = scale dS K). Per row i: its largest weight "
         "max_j P_ij and\nits gradient norm ||dS_i||; the table gives the medians over the "
      << trap_tokens << " rows (a typical query).\n\n";
  const std::vector<TrapRow> rows = measure_trap();
  std::vector<std::vector<std::string>> table{
      {"d_k", "max weight scaled", "unscaled", "grad norm scaled", "unscaled"}};
  Index one_hot_scaled = 0;  // the most at any d_k
  for (const TrapRow& row : rows) {
    table.push_back({std::to_string(row.d_k), four_places(row.weight_scaled),
                     four_places(row.weight_unscaled), scientific(row.gradient_scaled),
                     scientific(row.gradient_unscaled)});
    one_hot_scaled = std::max(one_hot_scaled, row.one_hot_scaled);
  }
  print_table(table);
  const TrapRow& first = rows.front();
  const TrapRow& last = rows.back();
  std::cout
      << "\nUnscaled, the scores spread as √d_k: from d_k = " << first.d_k << " to " << last.d_k
      << " the typical row goes one-hot\n(largest weight " << four_places(first.weight_unscaled)
      << " -> " << four_places(last.weight_unscaled) << ") and its gradient vanishes\n("
      << scientific(first.gradient_unscaled) << " -> " << scientific(last.gradient_unscaled) << ", "
      << fixed(first.gradient_unscaled / last.gradient_unscaled, 0)
      << " times smaller). Scaled, the scores keep variance 1 and both stay put.\n"
      << "Rows with one weight above 0.99, unscaled: " << first.one_hot_unscaled << " of "
      << trap_tokens << " at d_k = " << first.d_k << ", " << last.one_hot_unscaled << " of "
      << trap_tokens << " at d_k = " << last.d_k << ";\nscaled: "
      << (one_hot_scaled == 0
              ? "0 of " + std::to_string(trap_tokens) + " at every d_k"
              : "at most " + std::to_string(one_hot_scaled) + " of " + std::to_string(trap_tokens))
      << ".\n"
      << "The whole table's ||dS||_F falls less (unscaled " << fixed(first.table_unscaled, 4)
      << " -> " << fixed(last.table_unscaled, 4) << ", scaled " << fixed(first.table_scaled, 4)
      << " -> " << fixed(last.table_scaled, 4)
      << "):\nthe few rows whose top two keys nearly tie keep a large gradient, the others get "
         "almost none.\n";
}

void print_training() {
  std::cout << "\nA layer that learns. One causal self-attention layer is trained by plain SGD to "
               "repeat the symbol\n"
            << lag << " places back: sequences of " << length << " symbols from a.."
            << static_cast<char>('a' + vocabulary - 1) << ", and at each position i >= " << lag + 1
            << " (counting from 1) the\ntarget is the symbol at position i - " << lag << ".\n";
  SplitMix64 random(training_seed);
  const std::vector<Index> example = random_sequence(random);
  std::cout << "  e.g. " << letters(example, length) << " -> targets at positions " << lag + 1
            << " to " << length << ": " << letters(example, length - lag) << "\n"
            << "Embedding x_i = [one-hot symbol (" << vocabulary << "), one-hot position ("
            << length << ")], fixed. Learned: W_Q, W_K, W_V\n(" << features << " x " << width
            << ") and W_O (" << width << " x " << vocabulary
            << "); logits = Attention(X W_Q, X W_K, X W_V, causal) W_O, cross-entropy.\n"
            << "Each step: " << batch
            << " new random sequences, the forward pass, the backward pass (the chain rule by "
               "hand,\nattn::attention_backward for attention itself), W -= "
            << fixed(learning_rate, 1) << " dW.\n"
            << "Chance: loss log " << vocabulary << " = "
            << fixed(std::log(static_cast<double>(vocabulary)), 4) << ", accuracy 1/" << vocabulary
            << " = " << percent(1, vocabulary) << ".\n\n";

  // Initial weights: small random W_Q and W_K (nearly uniform attention at first), W_V and W_O
  // of unit gain.
  Layer layer;
  const double q_gain = 0.5 / std::sqrt(static_cast<double>(features));
  layer.W_Q = q_gain * random.normal_matrix(features, width);
  layer.W_K = q_gain * random.normal_matrix(features, width);
  layer.W_V = random.normal_matrix(features, width) / std::sqrt(static_cast<double>(features));
  layer.W_O = random.normal_matrix(width, vocabulary) / std::sqrt(static_cast<double>(width));

  std::vector<std::vector<std::string>> curve{{"step", "loss", "accuracy"}};
  const double predictions_per_step = static_cast<double>(batch * (length - lag));
  for (int step = 0; step <= steps; ++step) {
    Layer grads;
    Tally tally;
    for (Index b = 0; b < batch; ++b) {
      run_sequence(layer, random_sequence(random), predictions_per_step, tally, &grads);
    }
    if (step % report_every == 0) {
      curve.push_back({std::to_string(step), fixed(tally.loss / predictions_per_step, 4),
                       percent(tally.correct, tally.predictions)});
    }
    if (step == steps) break;  // the last line reports the trained layer; no update after it
    // 9. SGD: W <- W - learning_rate dW (the loss is the mean over the step's predictions).
    layer.W_Q -= learning_rate * grads.W_Q;
    layer.W_K -= learning_rate * grads.W_K;
    layer.W_V -= learning_rate * grads.W_V;
    layer.W_O -= learning_rate * grads.W_O;
  }
  print_table(curve);

  // The trained layer on sequences it has never seen.
  constexpr Index held_out = 256;
  Tally test;
  for (Index k = 0; k < held_out; ++k)
    run_sequence(layer, random_sequence(random), 1.0, test, nullptr);
  std::cout << "\nAfter training, on " << held_out << " new sequences: loss "
            << fixed(test.loss / static_cast<double>(test.predictions), 4) << ", accuracy "
            << percent(test.correct, test.predictions) << " (" << test.correct << " of "
            << test.predictions << " predictions).\n";
  // Where the last token looks: its attention weights over the example's tokens.
  const attn::QKV<double> qkv = attn::project_qkv(embed(example), layer.W_Q, layer.W_K, layer.W_V);
  const Matrix P = attn::attention_with_weights(qkv.Q, qkv.K, qkv.V, causal_options()).weights;
  std::vector<std::string> weights;
  for (Index j = 0; j < length; ++j) weights.push_back(fixed(P(length - 1, j), 2));
  std::cout << "What it learned, on the example: position " << length
            << "'s attention weights over positions 1 to " << length << "\n(its target is at "
            << length - lag << "): [" << join(weights, ", ") << "]\n";
}

}  // namespace

std::vector<TrapRow> measure_trap() {
  SplitMix64 random(trap_seed);
  const Matrix G = random.normal_matrix(trap_tokens, trap_tokens);  // the fixed dL/dP
  std::vector<TrapRow> rows;
  for (const Index d_k : {16, 32, 64, 128, 256, 512, 1024}) {
    const Matrix Q = random.normal_matrix(trap_tokens, d_k);
    const Matrix K = random.normal_matrix(trap_tokens, d_k);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d_k));
    const Matrix P_scaled = attn::softmax_rows(attn::scores(Q, K, scale));
    const Matrix P_unscaled = attn::softmax_rows(attn::scores(Q, K, 1.0));
    const TrapSide scaled = measure_side(P_scaled, attn::softmax_rows_backward(P_scaled, G));
    const TrapSide unscaled = measure_side(P_unscaled, attn::softmax_rows_backward(P_unscaled, G));
    rows.push_back({d_k, scaled.weight, unscaled.weight, scaled.gradient, unscaled.gradient,
                    scaled.table, unscaled.table, scaled.one_hot, unscaled.one_hot});
  }
  return rows;
}

void part6() {
  print_heading("Part 6: gradients (why divide by √d_k, and one layer that learns)");
  print_trap();
  print_training();
}

}  // namespace walkthrough

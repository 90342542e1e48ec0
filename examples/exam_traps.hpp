#pragma once
/// \file exam_traps.hpp
/// The first document's six exam traps, each computed by `attn` on the documents' own numbers as the
/// wrong way beside the right way. `attn-walkthrough` prints them (Part 7), the click-a-word page
/// shows them as toggles on the 3-token step-through (it_example.hpp embeds these tables), and
/// tests/check_walkthrough.cmake and tests/browser_check.cmake check the figures against numbers
/// worked out independently.
///
/// The traps, in the document's order:
/// 1. the √d_k scaling is not cosmetic: the 3-token weights without it (Part 6 measures the trap
///    as d_k grows);
/// 2. softmax per query row, not down a column: the column-wise softmax of the same scores;
/// 3. no notion of order without positions: the 3 tokens in reverse order give the same output
///    rows, reversed (Part 5 shows it on "dog bites man");
/// 4. the output averages the values, not the queries or keys: weights · Q, weights · K and
///    weights · V side by side;
/// 5. three separate matrices W_Q, W_K, W_V: "I love AI" with W_q reused for all three;
/// 6. a token attends to itself: the diagonal of the weights, and the outputs when it is masked.

#include <attn/attn.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "documents.hpp"

namespace attn_examples {

/// The first document's trap list, word for word, in its order.
inline const std::vector<std::string>& exam_trap_sentences() {
  static const std::vector<std::string> traps{
      "The √d_k scaling is not a cosmetic detail — without it, large dot products push softmax "
      "into a near-one-hot, tiny-gradient regime, which hurts training.",
      "Softmax normalizes per query row (across all keys for one token), not down a column.",
      "Self-attention by itself has no notion of token order — it's a function of content, token "
      "identity and value, not position (that's what positional encoding exists to fix).",
      "The output for a token is a weighted average of other tokens' values, not of their queries "
      "or keys.",
      "Q, K, V are produced by three separate learned matrices W_Q, W_K, W_V — they are not the "
      "same projection reused three times, even though they all come from the same input X.",
      "A token's own position is included when computing its output — a token attends to itself "
      "too, not just to the other tokens in the sequence (unless explicitly masked out, as in "
      "decoders)."};
  return traps;
}

/// The 3-token example's traps (Q, K and V of `three_tokens()`; d_k = 2). Weights are 3 x 3, row
/// = query token, column = key token; outputs 3 x 2.
struct ThreeTokenTraps {
  attn::QKV<double> tokens;  ///< the inputs
  Matrix scaled;             ///< Q K^T / √d_k
  Matrix weights;            ///< the right way: softmax of each row of `scaled`
  Matrix output;             ///< weights · V (what `attn::scaled_dot_product_attention` returns)

  // Trap 1: no 1/√d_k.
  Matrix unscaled_weights;  ///< softmax of each row of Q K^T
  Matrix unscaled_output;   ///< unscaled_weights · V

  // Trap 2: softmax down each column (each column sums to 1, the rows do not).
  Matrix column_weights;  ///< softmax_rows(scaled^T)^T
  Matrix column_output;  ///< column_weights · V: not an average (its rows' weights do not sum to 1)

  // Trap 3: the tokens in reverse order (3, 2, 1), no positions.
  Matrix reversed_output;  ///< row r: the output of the token now at position r

  // Trap 4: weighted averages of the queries and of the keys instead of the values.
  Matrix average_of_queries;  ///< weights · Q
  Matrix average_of_keys;     ///< weights · K

  // Trap 6: a token may not attend to itself (the diagonal masked out).
  Matrix self_masked_weights;  ///< the weights with a mask that is false on the diagonal
  Matrix self_masked_output;   ///< self_masked_weights · V
};

/// Every table of `ThreeTokenTraps`, computed by attn (`trace_attention`, `softmax_rows`,
/// `attention_with_weights` with a boolean mask).
inline ThreeTokenTraps three_token_traps() {
  ThreeTokenTraps t;
  t.tokens = three_tokens();
  const Matrix& Q = t.tokens.Q;
  const Matrix& K = t.tokens.K;
  const Matrix& V = t.tokens.V;
  const attn::AttentionTrace<double> trace = attn::trace_attention(Q, K, V);
  t.scaled = trace.scaled;
  t.weights = trace.weights;
  t.output = trace.output;

  attn::AttentionOptions<double> unscaled;
  unscaled.scale = 1.0;
  const attn::Attention<double> plain = attn::attention_with_weights(Q, K, V, unscaled);
  t.unscaled_weights = plain.weights;
  t.unscaled_output = plain.output;

  t.column_weights = attn::softmax_rows(t.scaled.transpose()).transpose();
  t.column_output = t.column_weights * V;

  const Index n = Q.rows();
  const Matrix Q_reversed = Q.colwise().reverse();
  const Matrix K_reversed = K.colwise().reverse();
  const Matrix V_reversed = V.colwise().reverse();
  t.reversed_output = attn::scaled_dot_product_attention(Q_reversed, K_reversed, V_reversed);

  t.average_of_queries = t.weights * Q;
  t.average_of_keys = t.weights * K;

  attn::AttentionOptions<double> not_itself;
  attn::Mask others = attn::Mask::Constant(n, K.rows(), true);
  for (Index i = 0; i < n; ++i) others(i, i) = false;
  not_itself.mask = others;
  const attn::Attention<double> masked = attn::attention_with_weights(Q, K, V, not_itself);
  t.self_masked_weights = masked.weights;
  t.self_masked_output = masked.output;
  return t;
}

/// "I love AI"'s traps: trap 4 on its distinct Q, K and V, and trap 5 (W_q reused for K and V).
struct ILoveAiTraps {
  attn::QKV<double> qkv;  ///< X W_q, X W_k, X W_v: the document's three projections
  Matrix weights;         ///< softmax(Q K^T / √2), the document's weights
  Matrix output;          ///< weights · V, the document's output

  // Trap 4
  Matrix average_of_queries;  ///< weights · Q
  Matrix average_of_keys;     ///< weights · K

  // Trap 5: one matrix for all three, Q = K = V = X W_q.
  Matrix shared;          ///< X W_q
  Matrix shared_weights;  ///< softmax(shared shared^T / √2)
  Matrix shared_output;   ///< shared_weights · shared
};

/// Every table of `ILoveAiTraps`, computed by attn (`project_qkv`, `attention_with_weights`).
inline ILoveAiTraps i_love_ai_traps() {
  const ILoveAi love;
  ILoveAiTraps t;
  t.qkv = attn::project_qkv(love.X, love.W_q, love.W_k, love.W_v);
  const attn::Attention<double> right = attn::attention_with_weights(t.qkv.Q, t.qkv.K, t.qkv.V);
  t.weights = right.weights;
  t.output = right.output;
  t.average_of_queries = t.weights * t.qkv.Q;
  t.average_of_keys = t.weights * t.qkv.K;

  const attn::QKV<double> reused = attn::project_qkv(love.X, love.W_q, love.W_q, love.W_q);
  t.shared = reused.Q;
  const attn::Attention<double> wrong = attn::attention_with_weights(reused.Q, reused.K, reused.V);
  t.shared_weights = wrong.weights;
  t.shared_output = wrong.output;
  return t;
}

}  // namespace attn_examples

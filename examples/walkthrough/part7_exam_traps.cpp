/// \file part7_exam_traps.cpp
/// Part 7: the first document's six exam traps, in its order, each computed live on the
/// documents' own numbers (exam_traps.hpp) and printed as the wrong way beside the right way, so
/// the part can be read beside the document's list line by line.

#include <algorithm>
#include <attn/attn.hpp>
#include <cmath>
#include <cstddef>
#include <iostream>
#include <string>
#include <vector>

#include "../documents.hpp"
#include "../exam_traps.hpp"
#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {
namespace {

/// "Trap 2 of 6: <the document's sentence>", wrapped at about 100 columns under a 2-space indent.
void print_trap_heading(std::size_t number) {
  const std::string& text = attn_examples::exam_trap_sentences()[number - 1];
  std::cout << "Trap " << number << " of " << attn_examples::exam_trap_sentences().size()
            << " (the document: \"";
  std::size_t column = 32;
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t end = text.find(' ', at);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(at, end - at);
    if (column + word.size() > 98) {
      std::cout << "\n  ";
      column = 2;
    } else if (at > 0) {
      std::cout << ' ';
      ++column;
    }
    std::cout << word;
    column += word.size();
    at = end + 1;
  }
  std::cout << "\")\n\n";
}

/// The largest |a - b| over all entries.
double largest_difference(const Matrix& a, const Matrix& b) {
  return (a - b).cwiseAbs().maxCoeff();
}

/// Whether two tables agree to rounding (1e-12).
bool same(const Matrix& a, const Matrix& b) { return largest_difference(a, b) < 1e-12; }

/// Whether row `i` of `a` and row `k` of `b` agree to rounding (1e-12).
bool same_row(const Matrix& a, Index i, const Matrix& b, Index k) {
  for (Index j = 0; j < a.cols(); ++j) {
    if (std::abs(a(i, j) - b(k, j)) >= 1e-12) return false;
  }
  return true;
}

/// "yes" / "no".
std::string yes_no(bool value) { return value ? "yes" : "no"; }

/// "12%" from a weight.
std::string percent(double weight) { return std::to_string(std::lround(100.0 * weight)) + "%"; }

/// The rows of `M` as "[a, b], [c, d], [e, f]" with 4 decimals.
std::string all_rows(const Matrix& M) {
  std::vector<std::string> rows;
  for (Index i = 0; i < M.rows(); ++i) rows.push_back(bracketed_row(M, i, four_places));
  return join(rows, ", ");
}

void trap1_scaling(const attn_examples::ThreeTokenTraps& t) {
  print_trap_heading(1);
  std::cout << "The 3 tokens (d_k = 2) without ÷√2 beside with it (Part 1):\n\n";
  std::vector<std::vector<std::string>> table{
      {"", "weights of Q K^T (wrong)", "weights of Q K^T / √2 (right)"}};
  for (Index i = 0; i < t.weights.rows(); ++i) {
    table.push_back({"  Row " + token_number(i), bracketed_row(t.unscaled_weights, i, four_places),
                     bracketed_row(t.weights, i, four_places)});
  }
  print_table(table);
  const Index last = t.weights.rows() - 1;
  std::cout << "\nAlready at d_k = 2 each row's largest weight grows (row " << token_number(last)
            << ": " << four_places(t.weights.row(last).maxCoeff()) << " -> "
            << four_places(t.unscaled_weights.row(last).maxCoeff())
            << ");\nthe dot products grow with d_k, and so does the effect.\n";
  const std::vector<TrapRow> rows = measure_trap();
  const TrapRow& first = rows.front();
  const TrapRow& widest = rows.back();
  std::cout << "Part 6 measures it for d_k = " << first.d_k << " to " << widest.d_k
            << ": without the scaling the median largest weight of a row\ngoes "
            << four_places(first.weight_unscaled) << " -> " << four_places(widest.weight_unscaled)
            << " and the softmax's gradient " << scientific(first.gradient_unscaled) << " -> "
            << scientific(widest.gradient_unscaled) << ";\nwith it the weight stays near "
            << four_places(widest.weight_scaled) << " and the gradient near "
            << scientific(widest.gradient_scaled) << ".\n\n";
}

void trap2_rows(const attn_examples::ThreeTokenTraps& t) {
  print_trap_heading(2);
  const Matrix column_row_sums = t.column_weights.rowwise().sum();
  const Matrix column_column_sums = t.column_weights.colwise().sum();
  const Matrix row_sums = t.weights.rowwise().sum();
  std::cout << "The 3 tokens' scaled scores, softmax down each column (wrong) and along each row "
               "(right):\n\n";
  std::vector<std::vector<std::string>> table{
      {"", "per column (wrong)", "row sum", "per row (right)", "row sum"}};
  for (Index i = 0; i < t.weights.rows(); ++i) {
    table.push_back({"  Row " + token_number(i), bracketed_row(t.column_weights, i, four_places),
                     four_places(column_row_sums(i, 0)), bracketed_row(t.weights, i, four_places),
                     four_places(row_sums(i, 0))});
  }
  table.push_back({"  column sum", bracketed_row(column_column_sums, 0, four_places), "", "", ""});
  print_table(table);
  std::cout
      << "\nDown the columns, each key's weights sum to 1 and each token's do not: weights · V "
         "is then no\nlonger an average of the values (token "
      << token_number(2) << " gets " << bracketed_row(t.column_output, 2, four_places)
      << " from weights summing to " << four_places(column_row_sums(2, 0))
      << ").\nEach query's row must sum to 1: it shares one token's attention among the keys.\n";
  if (same(t.scaled, t.scaled.transpose())) {
    std::cout << "(The scores are symmetric here, since Q = K, so the wrong table is the right one "
                 "transposed.)\n";
  }
  std::cout << "\n";
}

void trap3_order(const attn_examples::ThreeTokenTraps& t) {
  print_trap_heading(3);
  const Matrix back = t.reversed_output.colwise().reverse();
  std::cout << "The 3 tokens in the order 3, 2, 1, without positions, give the outputs\n"
            << all_rows(t.reversed_output)
            << ".\nThey are Part 1's outputs in reverse order: " << yes_no(same(back, t.output))
            << ". Nothing in the calculation knows which token came\nfirst. "
               "Part 5 shows it on \"dog bites man\" and \"man bites dog\", and how a sinusoidal "
               "encoding or RoPE\nmakes the two differ.\n\n";
}

void trap4_values(const attn_examples::ILoveAiTraps& love) {
  print_trap_heading(4);
  const std::vector<std::string> words = attn_examples::ILoveAi().words;
  std::cout << "\"I love AI\" (Part 2), whose Q, K and V all differ: the same weights applied to "
               "each:\n\n";
  std::vector<std::vector<std::string>> table{
      {"", "weights · Q (wrong)", "weights · K (wrong)", "weights · V (right)"}};
  for (Index i = 0; i < love.weights.rows(); ++i) {
    table.push_back({"  " + words[static_cast<std::size_t>(i)],
                     bracketed_row(love.average_of_queries, i, four_places),
                     bracketed_row(love.average_of_keys, i, four_places),
                     bracketed_row(love.output, i, four_places)});
  }
  print_table(table);
  const Matrix library = attn::scaled_dot_product_attention(love.qkv.Q, love.qkv.K, love.qkv.V);
  std::cout << "\nattn::scaled_dot_product_attention returns the last column (largest difference "
            << scientific(largest_difference(library, love.output))
            << ").\nThe queries and keys are used up in making the weights (how well each key "
               "answers each query);\nthe values are what a token hands on, so the layer's output "
               "is their average, and W_V alone\ndecides what that output can carry.\n\n";
}

void trap5_three_matrices(const attn_examples::ILoveAiTraps& love) {
  print_trap_heading(5);
  const std::vector<std::string> words = attn_examples::ILoveAi().words;
  std::cout << "\"I love AI\" with W_q reused for all three (Q = K = V = X W_q), beside the "
               "document's three\nmatrices:\n\n";
  std::vector<std::vector<std::string>> table{
      {"", "weights, W_q reused (wrong)", "output", "weights, W_q W_k W_v (right)", "output"}};
  for (Index i = 0; i < love.weights.rows(); ++i) {
    table.push_back({"  " + words[static_cast<std::size_t>(i)],
                     bracketed_row(love.shared_weights, i, four_places),
                     bracketed_row(love.shared_output, i, four_places),
                     bracketed_row(love.weights, i, four_places),
                     bracketed_row(love.output, i, four_places)});
  }
  print_table(table);

  // Which rows put their largest weight on the word itself (ties within 1e-12 count).
  const auto on_diagonal = [](const Matrix& P) {
    Index count = 0;
    for (Index i = 0; i < P.rows(); ++i) count += P(i, i) >= P.row(i).maxCoeff() - 1e-12 ? 1 : 0;
    return count;
  };
  const auto diagonal = [](const Matrix& P) {
    Matrix d(1, P.rows());
    for (Index i = 0; i < P.rows(); ++i) d(0, i) = P(i, i);
    return d;
  };
  Index love_index = 1;
  Index first = 0;
  std::cout << "\nThe diagonal (each word on itself): "
            << bracketed_row(diagonal(love.weights), 0, four_places) << " with three matrices,\n"
            << bracketed_row(diagonal(love.shared_weights), 0, four_places)
            << " with one. Rows whose largest weight is the word itself: "
            << on_diagonal(love.weights) << " of 3 with three\nmatrices, "
            << on_diagonal(love.shared_weights)
            << " of 3 with one (q_i·q_i = |q_i|² while q_i·q_j <= |q_i| |q_j|: a word's own score "
               "wins\nunless another word's vector is longer).\nThe document's \"I puts "
            << percent(love.weights(first, love_index)) << " on love\" becomes "
            << percent(love.shared_weights(first, love_index)) << ", and I puts "
            << percent(love.shared_weights(first, first))
            << " on itself: with one matrix\na word mostly finds itself.\n\n";
}

void trap6_itself(const attn_examples::ThreeTokenTraps& t) {
  print_trap_heading(6);
  Matrix diagonal(1, t.weights.rows());
  for (Index i = 0; i < t.weights.rows(); ++i) diagonal(0, i) = t.weights(i, i);
  std::cout << "The 3 tokens' weights on themselves (the diagonal of Part 1's weights): "
            << bracketed_row(diagonal, 0, four_places) << ".\n"
            << "With the diagonal masked out (attn::AttentionOptions::mask false on it):\n\n";
  for (Index i = 0; i < t.weights.rows(); ++i) {
    const bool unchanged = same_row(t.self_masked_output, i, t.output, i);
    std::cout << "• Row " << token_number(i) << ": weights "
              << bracketed_row(t.self_masked_weights, i, weight_figure) << ", output "
              << bracketed_row(t.self_masked_output, i, four_places) << " (with itself "
              << bracketed_row(t.output, i, four_places) << (unchanged ? ": unchanged" : "")
              << ")\n";
  }
  // Why a row did not move: its own value is the average of the values it still sees.
  const Matrix& V = t.tokens.V;
  for (Index i = 0; i < t.weights.rows(); ++i) {
    if (!same_row(t.self_masked_output, i, t.output, i)) continue;
    const Matrix seen = t.self_masked_weights.row(i) * V;
    if (same_row(seen, 0, V, i)) {
      std::cout << "\nRow " << token_number(i) << " does not move: V" << token_number(i) << " = "
                << bracketed_row(V, i, short_figure)
                << " is itself the weighted average of the values it still sees.\n";
    }
  }
  std::cout << "A decoder's causal mask (Part 3) hides the later tokens, never the token itself: "
               "there token 1\nsees only itself.\n";
}

}  // namespace

void part7() {
  print_heading("Part 7: the first document's exam traps, checked live");
  std::cout
      << "The document's six traps in its order, each computed on the documents' own numbers:\n"
         "the wrong way beside the right way.\n\n";
  const attn_examples::ThreeTokenTraps three = attn_examples::three_token_traps();
  const attn_examples::ILoveAiTraps love = attn_examples::i_love_ai_traps();
  trap1_scaling(three);
  trap2_rows(three);
  trap3_order(three);
  trap4_values(love);
  trap5_three_matrices(love);
  trap6_itself(three);
}

}  // namespace walkthrough

/// \file part1_three_tokens.cpp
/// Part 1: the first document's worked example, 3 tokens with Q, K and V given directly (d_k = 2):
/// raw scores, scaling, softmax (the document's form and the library's stable one), outputs. Also
/// the steps that Part 3 repeats with a causal mask.

#include <algorithm>
#include <attn/attn.hpp>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "../documents.hpp"
#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {
namespace {

/// The document's e^x of a score: the trace keeps e^(x - row_max), so e^x = trace.exp * e^row_max.
double document_exp(const Trace& trace, Index i, Index j) {
  return trace.exp(i, j) * std::exp(trace.row_max(i));
}

/// The document's row sum of e^x: trace.row_sum * e^row_max.
double document_sum(const Trace& trace, Index i) {
  return trace.row_sum(i) * std::exp(trace.row_max(i));
}

/// "• Row 1: Q1·K1=1, Q1·K2=0, Q1·K3=1" from the raw scores.
void print_raw_scores(const Trace& trace) {
  std::cout << "Raw scores QK^T (row = query token, col = key token):\n\n";
  for (Index i = 0; i < trace.scores.rows(); ++i) {
    std::vector<std::string> products;
    for (Index j = 0; j < trace.scores.cols(); ++j) {
      products.push_back("Q" + token_number(i) + "·K" + token_number(j) + "=" +
                         short_figure(trace.scores(i, j)));
    }
    std::cout << "• Row " << token_number(i) << ": " << join(products, ", ") << "\n";
  }
  std::cout << "\n";
}

/// The weight the first document prints for row 3, keys 1 and 2 (quoted to compare, not computed).
constexpr double document_row3_weight = 0.2482;

/// The library's own (stable) softmax: it subtracts each row's maximum before exponentiating.
void print_stable_softmax(const Trace& trace) {
  std::cout
      << "How the library computes the same weights (the stable form: subtract the row's\n"
         "maximum first, so no e^x can overflow; the factor e^-max cancels in the ratio):\n\n";
  for (Index i = 0; i < trace.exp.rows(); ++i) {
    std::cout << "• Row " << token_number(i) << ": max = " << short_figure(trace.row_max(i))
              << ", e^(x-max) = " << bracketed_row(trace.exp, i, short_figure)
              << ", sum = " << four_places(trace.row_sum(i)) << " → weights "
              << bracketed_row(trace.weights, i, weight_figure) << "\n";
  }
  std::cout << "\n";
}

}  // namespace

void print_score_rows(const Matrix& table) {
  for (Index i = 0; i < table.rows(); ++i) {
    std::cout << "• Row " << token_number(i) << ": " << bracketed_row(table, i, short_figure)
              << "\n";
  }
  std::cout << "\n";
}

void print_softmax_rows(const Trace& trace) {
  // Each distinct score once, in order of first appearance, with its e^x.
  std::vector<std::string> seen;
  std::vector<std::string> exponentials;
  for (Index i = 0; i < trace.masked.rows(); ++i) {
    for (Index j = 0; j < trace.masked.cols(); ++j) {
      const std::string score = short_figure(trace.masked(i, j));
      if (std::find(seen.begin(), seen.end(), score) != seen.end()) continue;
      seen.push_back(score);
      const double e = document_exp(trace, i, j);
      exponentials.push_back("e^" + score + " " + equals_or_approx(e) + " " + short_figure(e));
    }
  }
  std::cout << "Softmax each row (using " << join(exponentials, ", ") << "):\n\n";
  for (Index i = 0; i < trace.masked.rows(); ++i) {
    std::vector<std::string> terms;
    for (Index j = 0; j < trace.masked.cols(); ++j) {
      terms.push_back(short_figure(document_exp(trace, i, j)));
    }
    std::cout << "• Row " << token_number(i) << ": sum = " << join(terms, "+") << " = "
              << four_places(document_sum(trace, i)) << " → weights "
              << bracketed_row(trace.weights, i, weight_figure) << "\n";
  }
}

void print_outputs(const Trace& trace, const Matrix& V) {
  std::cout << "Output = weights · V:\n\n";
  for (Index i = 0; i < trace.output.rows(); ++i) {
    std::vector<std::string> terms;
    for (Index j = 0; j < V.rows(); ++j) {
      terms.push_back(weight_figure(trace.weights(i, j)) + "·" +
                      bracketed_row(V, j, short_figure, ","));
    }
    std::cout << "• Output " << token_number(i) << " = " << join(terms, " + ") << " = "
              << bracketed_row(trace.output, i, four_places) << "\n";
  }
  std::cout << "\n";
}

void part1() {
  print_heading("Part 1: the first document's worked example (3 tokens)");
  const attn::QKV<double> tokens = attn_examples::three_tokens();
  const Trace trace = attn::trace_attention(tokens.Q, tokens.K, tokens.V);

  std::vector<std::vector<std::string>> table{{"token", "Q", "K", "V"}};
  for (Index i = 0; i < tokens.Q.rows(); ++i) {
    table.push_back({token_number(i), bracketed_row(tokens.Q, i, short_figure),
                     bracketed_row(tokens.K, i, short_figure),
                     bracketed_row(tokens.V, i, short_figure)});
  }
  print_table(table);

  const Index d_k = tokens.K.cols();
  const std::string root =
      "√" + std::to_string(d_k) + " ≈ " + four_places(std::sqrt(static_cast<double>(d_k)));
  std::cout << "\nd_k = " << d_k << " and the scaling factor is " << root << "\n\n";

  print_raw_scores(trace);
  std::cout << "Scaled (÷ " << root << "):\n\n";
  print_score_rows(trace.scaled);
  print_softmax_rows(trace);

  const Index last = trace.weights.rows() - 1;
  if (four_places(trace.weights(last, 0)) != four_places(document_row3_weight)) {
    std::cout << "  (The document prints " << four_places(document_row3_weight)
              << " here and in Output " << token_number(last)
              << ", rounding down: the exact value is " << fixed(trace.weights(last, 0), 6)
              << ".)\n";
  }
  std::cout << "\n";
  print_stable_softmax(trace);
  print_outputs(trace, tokens.V);
}

}  // namespace walkthrough

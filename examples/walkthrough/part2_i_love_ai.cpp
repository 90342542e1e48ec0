/// \file part2_i_love_ai.cpp
/// Part 2: the second document's "I love AI" NumPy example, printed as NumPy prints it: the
/// inputs as the document's Python source, Q, K and V, the scaled scores, the rounded weights and
/// outputs, the first row read aloud, and the weights as a terminal heatmap.

#include <algorithm>
#include <attn/attn.hpp>
#include <attn/render.hpp>
#include <cmath>
#include <cstddef>
#include <iostream>
#include <string>
#include <vector>

#include "../documents.hpp"
#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {
namespace {

/// The document's Python source for a matrix: `name = np.array([[1, 0], [0, 1]])` on one line, or
/// one row per line, each followed by its comment (`# "I"`), when `comments` are given.
/// \param name      the Python variable ("X", "W_q")
/// \param M         rows x cols, printed with the first document's figures
/// \param comments  one comment per row (the first rows when fewer), or none
void print_python_matrix(const std::string& name, const Matrix& M,
                         const std::vector<std::string>& comments = {}) {
  std::vector<std::string> rows;
  for (Index i = 0; i < M.rows(); ++i) rows.push_back(bracketed_row(M, i, short_figure));
  const std::string opening = name + " = np.array([";
  if (comments.empty()) {
    std::cout << opening << join(rows, ", ") << "])\n";
    return;
  }
  const std::string indent(opening.size(), ' ');
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const bool last = r + 1 == rows.size();
    std::cout << (r == 0 ? opening : indent) << rows[r] << (last ? "])  " : ",   ");
    if (r < comments.size()) std::cout << "  # " << comments[r];
    std::cout << "\n";
  }
}

}  // namespace

void part2() {
  print_heading("Part 2: the second document's \"I love AI\" example (NumPy)");
  const attn_examples::ILoveAi love;
  const std::vector<std::string>& words = love.words;

  std::vector<std::string> quoted;
  for (const std::string& word : words) quoted.push_back("\"" + word + "\"");
  std::cout << "words = [" << join(quoted, ", ") << "]\n";
  print_python_matrix("X", love.X, quoted);
  print_python_matrix("W_q", love.W_q);
  print_python_matrix("W_k", love.W_k);
  print_python_matrix("W_v", love.W_v);

  const attn::QKV<double> qkv = attn::project_qkv(love.X, love.W_q, love.W_k, love.W_v);
  std::cout << "\nQ, K, V = X @ W_q, X @ W_k, X @ W_v      (attn::project_qkv)\n";
  std::cout << "Q:\n" << numpy_array(qkv.Q) << "\n";
  std::cout << "K:\n" << numpy_array(qkv.K) << "\n";
  std::cout << "V:\n" << numpy_array(qkv.V) << "\n";

  const Trace trace = attn::trace_attention(qkv.Q, qkv.K, qkv.V);
  std::cout << "\nd_k = K.shape[-1] = " << qkv.K.cols() << "\n";
  std::cout << "scores = Q @ K.T / np.sqrt(d_k):\n" << numpy_array(trace.scaled) << "\n\n";

  // The document's print("...:\n", array) puts a space before the array's first line.
  const Matrix weights = numpy_rounded(trace.weights, 2);
  const Matrix output = numpy_rounded(trace.output, 2);
  std::cout << "Attention weights:\n " << numpy_array(weights) << "\n";
  std::cout << "Output:\n " << numpy_array(output) << "\n\n";

  // The first row's two largest weights, in percent.
  const Index first = 0;
  std::vector<Index> keys;
  for (Index j = 0; j < trace.weights.cols(); ++j) keys.push_back(j);
  std::sort(keys.begin(), keys.end(),
            [&](Index a, Index b) { return trace.weights(first, a) > trace.weights(first, b); });
  const auto word = [&](Index j) { return words[static_cast<std::size_t>(j)]; };
  const auto percent = [&](Index j) {
    return std::to_string(std::lround(100.0 * trace.weights(first, j))) + "%";
  };
  std::vector<std::string> first_output;
  for (Index c = 0; c < output.cols(); ++c) first_output.push_back(numpy_float(output(first, c)));
  std::cout << "Read the first row: the word " << word(first) << " puts " << percent(keys[0])
            << " of its attention on " << word(keys[0]) << " and " << percent(keys[1]) << " on "
            << word(keys[1]) << ".\nIts new vector [" << join(first_output, ", ")
            << "] is mostly made of the value of \"" << word(keys[0]) << "\".\n";

  // The same weights as a heatmap (attn/render.hpp): colours on a terminal, else plain numbers.
  attn::HeatmapOptions heatmap;
  heatmap.title = "\nThe weights as a heatmap (row = query word, column = key word):";
  std::cout << attn::heatmap_terminal(trace.weights, words, words, heatmap);
}

}  // namespace walkthrough

/// \file walkthrough.cpp
/// `attn-walkthrough`: both teaching documents' calculations, computed live by `attn` (double
/// precision) and printed in the documents' own layout, so the output can be laid beside them and
/// read line by line.
///
/// - Part 1: the first document's 3-token example (scores, scaling, softmax, outputs).
/// - Part 2: the second document's "I love AI" NumPy example, printed as NumPy prints it.
/// - Part 3: Part 1's tokens again with a causal mask.
/// - Part 4: the second document's multi-head layer, nn.MultiheadAttention(512, 8), on x of shape
///   (2, 10, 512): output and weight shapes, the parameter count, one head's weights.
/// - Part 5: positions: "dog bites man" and "man bites dog" give the same rows permuted without
///   positions, different ones with a sinusoidal encoding or RoPE; a sinusoidal table; a rotation.
///
/// Only the documents' inputs are typed in below; every other number comes from the library at run
/// time (`attn::project_qkv` and `attn::trace_attention`, whose trace keeps every intermediate
/// table; `attn::MultiHeadAttention` for Part 4).
///
/// Pictures (attn/render.hpp, it_example.hpp): `--svg DIR` writes the heatmaps of Parts 1 to 4 as
/// SVG files; `--html FILE` writes the self-contained click-a-word page (illustrative hand-set
/// weights, not a trained model) with the 3-token step-through.

#include <algorithm>
#include <attn/attn.hpp>
#include <attn/render.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "it_example.hpp"

namespace {

using Matrix = attn::Matrix<double>;
using Trace = attn::AttentionTrace<double>;
using attn::Index;

// ---------------------------------------------------------------------------------------------
// Number formatting
// ---------------------------------------------------------------------------------------------

/// `x` with exactly `places` decimals: fixed(0.70710678, 4) == "0.7071". Never prints "-0.0000".
std::string fixed(double x, int places) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(places);
  out << x;
  std::string text = out.str();
  if (text.front() == '-' && text.find_first_not_of("-0.") == std::string::npos) text.erase(0, 1);
  return text;
}

/// The first document's style for inputs and intermediate figures: up to 4 decimals, trailing zeros
/// dropped ("0.7071", "0.5", "1", "0", "-inf").
std::string short_figure(double x) {
  std::string text = fixed(x, 4);
  if (text.find('.') == std::string::npos) return text;  // "-inf", "inf", "nan"
  text.erase(text.find_last_not_of('0') + 1);
  if (text.back() == '.') text.pop_back();
  return text;
}

/// The first document's style for weights and outputs: 4 decimals ("0.4011", "0.5000").
std::string four_places(double x) { return fixed(x, 4); }

/// A weight: 4 decimals, but a weight that is exactly 0 (a masked key) prints as "0".
std::string weight_figure(double x) { return x == 0.0 ? "0" : four_places(x); }

/// "=" when the printed 4-decimal figure is the exact value (e^0 = 1), "≈" otherwise.
std::string equals_or_approx(double x) { return std::stod(fixed(x, 4)) == x ? "=" : "≈"; }

using Format = std::string (*)(double);

/// The entries of row `i` of `M`, each formatted.
std::vector<std::string> row_figures(const Matrix& M, Index i, Format format) {
  std::vector<std::string> figures;
  for (Index j = 0; j < M.cols(); ++j) figures.push_back(format(M(i, j)));
  return figures;
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string text;
  for (std::size_t k = 0; k < items.size(); ++k) text += (k == 0 ? "" : separator) + items[k];
  return text;
}

/// "[a, b, c]" (or "[a,b,c]" with separator ",") for row `i` of `M`.
std::string bracketed_row(const Matrix& M, Index i, Format format,
                          const std::string& separator = ", ") {
  return "[" + join(row_figures(M, i, format), separator) + "]";
}

/// Documents count tokens from 1; Eigen counts rows from 0.
std::string token_number(Index i) { return std::to_string(i + 1); }

// ---------------------------------------------------------------------------------------------
// NumPy's print layout (the second document prints `weights.round(2)` and `output.round(2)`)
// ---------------------------------------------------------------------------------------------

/// `np.round(x, decimals)`: scale, round half to even, scale back.
double numpy_round(double x, int decimals) {
  const double factor = std::pow(10.0, decimals);
  return std::nearbyint(x * factor) / factor;
}

/// How NumPy writes one float of an array (default precision 8): the fewest decimals that read back
/// as the same double, keeping the point ("0.8", "0.01", "0." for zero, "4.24264069").
std::string numpy_float(double x) {
  constexpr int numpy_precision = 8;
  for (int places = 0; places < numpy_precision; ++places) {
    const std::string text = fixed(x, places);
    if (std::stod(text) == x) return places == 0 ? text + "." : text;
  }
  std::string text = fixed(x, numpy_precision);
  text.erase(text.find_last_not_of('0') + 1);
  return text;
}

/// What `print(M)` shows for a 2-D array: "[[a b]\n [c d]]". NumPy pads every float to a common
/// width: integer parts on the left, decimals on the right ("0.8 " beside "0.01"). A matrix of
/// whole numbers prints as the document's integer arrays do ("[[2 0]"). (NumPy switches to
/// scientific notation for very large or very small values; the documents' numbers never need it.)
std::string numpy_array(const Matrix& M) {
  const bool whole_numbers = (M.array() == M.array().round()).all();
  std::vector<std::string> integer_parts;
  std::vector<std::string> decimal_parts;
  for (Index i = 0; i < M.rows(); ++i) {
    for (Index j = 0; j < M.cols(); ++j) {
      const std::string text =
          whole_numbers ? std::to_string(static_cast<long long>(M(i, j))) : numpy_float(M(i, j));
      const std::size_t point = text.find('.');
      integer_parts.push_back(text.substr(0, point));
      decimal_parts.push_back(point == std::string::npos ? "" : text.substr(point));
    }
  }
  std::size_t integer_width = 0;
  std::size_t decimal_width = 0;
  for (std::size_t k = 0; k < integer_parts.size(); ++k) {
    integer_width = std::max(integer_width, integer_parts[k].size());
    decimal_width = std::max(decimal_width, decimal_parts[k].size());
  }
  std::string text = "[";
  std::size_t k = 0;
  for (Index i = 0; i < M.rows(); ++i) {
    text += i == 0 ? "[" : "\n [";
    for (Index j = 0; j < M.cols(); ++j, ++k) {
      if (j > 0) text += " ";
      text += std::string(integer_width - integer_parts[k].size(), ' ') + integer_parts[k];
      text += decimal_parts[k] + std::string(decimal_width - decimal_parts[k].size(), ' ');
    }
    text += "]";
  }
  return text + "]";
}

/// `M.round(decimals)`, element by element as NumPy rounds.
Matrix numpy_rounded(const Matrix& M, int decimals) {
  return M.unaryExpr([decimals](double x) { return numpy_round(x, decimals); });
}

// ---------------------------------------------------------------------------------------------
// Layout helpers
// ---------------------------------------------------------------------------------------------

void print_heading(const std::string& title) {
  std::cout << "\n" << title << "\n" << std::string(title.size(), '=') << "\n\n";
}

/// Prints `rows` as left-aligned columns two spaces apart (the document's tab-separated table).
void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (std::size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (std::size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(widths[c] - row[c].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

/// The document's e^x of a score: the trace keeps e^(x - row_max), so e^x = trace.exp * e^row_max.
double document_exp(const Trace& trace, Index i, Index j) {
  return trace.exp(i, j) * std::exp(trace.row_max(i));
}

/// The document's row sum of e^x: trace.row_sum * e^row_max.
double document_sum(const Trace& trace, Index i) {
  return trace.row_sum(i) * std::exp(trace.row_max(i));
}

// ---------------------------------------------------------------------------------------------
// The first document's steps, shared by Part 1 and Part 3
// ---------------------------------------------------------------------------------------------

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

/// "• Row 1: [0.7071, 0, 0.7071]" for every row of `table` (the scaled or the masked scores).
void print_score_rows(const Matrix& table) {
  for (Index i = 0; i < table.rows(); ++i) {
    std::cout << "• Row " << token_number(i) << ": " << bracketed_row(table, i, short_figure)
              << "\n";
  }
  std::cout << "\n";
}

/// "Softmax each row (using e^0.7071 ≈ 2.0281, e^0 = 1, e^1.4142 ≈ 4.1133):" then, per row,
/// "• Row 1: sum = 2.0281+1+2.0281 = 5.0562 → weights [0.4011, 0.1978, 0.4011]".
/// The e^x and sums are the document's (unshifted) ones, recovered from the trace.
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

/// "• Output 1 = 0.4011·[1,0] + 0.1978·[0,1] + 0.4011·[0.5,0.5] = [0.6017, 0.3983]".
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

/// The first document's three tokens (its table: Q, K and V given directly, d_k = 2).
struct ThreeTokens {
  Matrix Q{3, 2};
  Matrix K{3, 2};
  Matrix V{3, 2};
  ThreeTokens() {
    Q << 1, 0,  //
        0, 1,   //
        1, 1;
    K << 1, 0,  //
        0, 1,   //
        1, 1;
    V << 1, 0,  //
        0, 1,   //
        0.5, 0.5;
  }
};

// ---------------------------------------------------------------------------------------------
// Part 1: the first document's worked example
// ---------------------------------------------------------------------------------------------

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

void part1() {
  print_heading("Part 1: the first document's worked example (3 tokens)");
  const ThreeTokens tokens;
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

// ---------------------------------------------------------------------------------------------
// Part 2: the second document's "I love AI" NumPy example
// ---------------------------------------------------------------------------------------------

/// The document's Python source for a matrix: `name = np.array([[1, 0], [0, 1]])` on one line, or
/// one row per line, each followed by its comment (`# "I"`), when `comments` are given.
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

void part2() {
  print_heading("Part 2: the second document's \"I love AI\" example (NumPy)");
  const std::vector<std::string> words{"I", "love", "AI"};
  Matrix X(3, 4);
  X << 1, 0, 1, 0,  // "I"
      0, 2, 0, 1,   // "love"
      1, 1, 1, 1;   // "AI"
  Matrix W_q(4, 2);
  W_q << 1, 0, 0, 1, 1, 0, 0, 1;
  Matrix W_k(4, 2);
  W_k << 0, 1, 1, 0, 0, 1, 1, 0;
  Matrix W_v(4, 2);
  W_v << 1, 0, 0, 1, 1, 1, 0, 0;

  std::vector<std::string> quoted;
  for (const std::string& word : words) quoted.push_back("\"" + word + "\"");
  std::cout << "words = [" << join(quoted, ", ") << "]\n";
  print_python_matrix("X", X, quoted);
  print_python_matrix("W_q", W_q);
  print_python_matrix("W_k", W_k);
  print_python_matrix("W_v", W_v);

  const attn::QKV<double> qkv = attn::project_qkv(X, W_q, W_k, W_v);
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

// ---------------------------------------------------------------------------------------------
// Part 3: Part 1's tokens with a causal mask
// ---------------------------------------------------------------------------------------------

void part3() {
  print_heading("Part 3: the same 3 tokens with a causal mask (attn::Causal::BottomRight)");
  std::cout << "A causal mask sets the scores of future positions to -inf before the softmax, so\n"
               "their weights become exactly 0: token i attends to tokens 1..i only.\n\n";
  const ThreeTokens tokens;
  attn::AttentionOptions<double> options;
  options.causal = attn::Causal::BottomRight;
  const Trace trace = attn::trace_attention(tokens.Q, tokens.K, tokens.V, options);

  std::cout << "Masked scores (scaled; future keys -inf):\n\n";
  print_score_rows(trace.masked);
  print_softmax_rows(trace);
  std::cout << "\n";
  print_outputs(trace, tokens.V);
}

// ---------------------------------------------------------------------------------------------
// Part 4: the second document's multi-head layer
// ---------------------------------------------------------------------------------------------

using Tensor3 = attn::Tensor3<double>;
using Tensor4 = attn::Tensor4<double>;

/// The seeds of Part 4 (the document draws x with torch.randn and lets PyTorch initialise the
/// layer; the shapes and the parameter count do not depend on the values drawn, the printed
/// weights do).
constexpr std::uint64_t layer_seed = 2017;
constexpr std::uint64_t input_seed = 1;

/// `torch.randn(batch, tokens, features)`: N(0, 1) entries by the Box-Muller transform from a
/// 64-bit Mersenne twister (whose output is the same on every platform; std::normal_distribution's
/// is not).
Tensor3 randn(Index batch, Index tokens, Index features, std::uint64_t seed) {
  std::mt19937_64 engine(seed);
  const auto uniform = [&engine] {  // in (0, 1], so that its log is finite
    return (static_cast<double>(engine() >> 11) + 1.0) * 0x1.0p-53;
  };
  const double two_pi = 2.0 * std::acos(-1.0);
  Tensor3 x(batch, tokens, features);
  for (Index k = 0; k < x.size(); ++k) {
    const double radius = std::sqrt(-2.0 * std::log(uniform()));
    x.data()[k] = radius * std::cos(two_pi * uniform());
  }
  return x;
}

/// How PyTorch prints a shape: "torch.Size([2, 10, 512])".
template <class Tensor>
std::string torch_size(const Tensor& t) {
  std::vector<std::string> dims;
  for (std::size_t k = 0; k < static_cast<std::size_t>(Tensor::NumDimensions); ++k) {
    dims.push_back(std::to_string(t.dimension(k)));
  }
  return "torch.Size([" + join(dims, ", ") + "])";
}

/// The document's thousands separators: 1050624 -> "1,050,624".
std::string with_commas(Index value) {
  std::string digits = std::to_string(value);
  for (auto k = static_cast<std::ptrdiff_t>(digits.size()) - 3; k > 0; k -= 3) {
    digits.insert(static_cast<std::size_t>(k), ",");
  }
  return digits;
}

void part4() {
  print_heading("Part 4: multi-head attention (the second document's nn.MultiheadAttention)");
  const attn::MultiHeadConfig config{512, 8};
  const attn::MultiHeadAttention<double> mha(config, layer_seed);
  const Tensor3 x = randn(2, 10, config.embed_dim, input_seed);

  std::cout << "mha = nn.MultiheadAttention(embed_dim=" << config.embed_dim
            << ", num_heads=" << config.num_heads << ", batch_first=True)\n"
            << "    # attn::MultiHeadAttention<double>, Xavier-uniform weights from seed "
            << layer_seed << "\n"
            << "x = torch.randn(" << x.dimension(0) << ", " << x.dimension(1) << ", "
            << x.dimension(2) << ")                  # " << x.dimension(0) << " sentences, "
            << x.dimension(1) << " tokens each (seed " << input_seed << ")\n"
            << "out, attn = mha(x, x, x)                     # self-attention: Q, K, V all come "
               "from x\n\n";

  attn::MultiHeadOptions<double> options;
  options.need_weights = true;  // and average_weights = true, PyTorch's default
  const attn::MultiHeadResult<double> result = mha.forward(x, x, x, options);
  std::cout << "print(out.shape)   ->  " << torch_size(result.output) << "\n"
            << "print(attn.shape)  ->  " << torch_size(result.weights)
            << "     # averaged over heads by default\n"
            << "print(sum(p.numel() for p in mha.parameters()))  ->  " << mha.parameter_count()
            << "     # mha.parameter_count()\n\n";

  // The document's breakdown, every figure read off the layer.
  const std::vector<const attn::Matrix<double>*> matrices{&mha.W_Q, &mha.W_K, &mha.W_V, &mha.W_O};
  const std::vector<const attn::RowVector<double>*> biases{&mha.b_Q, &mha.b_K, &mha.b_V, &mha.b_O};
  Index total = 0;
  for (const attn::Matrix<double>* W : matrices) total += W->size();
  for (const attn::RowVector<double>* b : biases) total += b->size();
  std::cout << "Each head works with d_k = " << config.embed_dim << " / " << config.num_heads
            << " = " << mha.head_dim() << " numbers.\n"
            << "The parameter count is " << matrices.size() << " matrices of " << mha.W_Q.rows()
            << " × " << mha.W_Q.cols() << " (Q, K, V and output) plus their biases:\n"
            << matrices.size() << " × " << with_commas(mha.W_Q.size()) << " + " << biases.size()
            << " × " << with_commas(mha.b_Q.size()) << " = " << with_commas(total) << "\n\n";

  // One head's weights: the same call with average_weights = false keeps each head's table.
  options.average_weights = false;
  const attn::MultiHeadResult<double> per_head = mha.forward(x, x, x, options);
  const Tensor4& heads = per_head.head_weights;
  const Index sentence = 0;
  const Index head = 0;
  const Index n = heads.dimension(2);
  const Index m = heads.dimension(3);
  const Matrix weights =
      Eigen::Map<const Matrix>(heads.data() + (sentence * heads.dimension(1) + head) * n * m, n, m);
  std::cout << "Per-head weights (average_weights = false): " << torch_size(heads) << "\n"
            << "Head " << head + 1 << " of sentence " << sentence + 1 << ", " << n << " × " << m
            << " because every token attends to every token; each row sums to 1:\n\n";
  for (Index i = 0; i < n; ++i) {
    std::cout << "• Row " << std::setw(2) << token_number(i) << ": "
              << bracketed_row(weights, i, four_places)
              << "  sum = " << four_places(weights.row(i).sum()) << "\n";
  }
}

// ---------------------------------------------------------------------------------------------
// Part 5: positions (the second document's "dog bites man")
// ---------------------------------------------------------------------------------------------

/// "[a, b, ...]" with 4 decimals.
std::string four_decimals(const Matrix& M, Index i) {
  std::vector<std::string> items;
  for (Index j = 0; j < M.cols(); ++j) items.push_back(fixed(M(i, j), 4));
  return "[" + join(items, ", ") + "]";
}

/// Self-attention of the rows of X with Part 2's weights; `rope` rotates Q and K by position.
Matrix sentence_attention(const Matrix& X, const Matrix& W_q, const Matrix& W_k, const Matrix& W_v,
                          bool rope) {
  attn::QKV<double> qkv = attn::project_qkv(X, W_q, W_k, W_v);
  if (rope) {
    attn::rope_inplace(qkv.Q, 0, attn::RopeStyle::Interleaved);
    attn::rope_inplace(qkv.K, 0, attn::RopeStyle::Interleaved);
  }
  return attn::scaled_dot_product_attention(qkv.Q, qkv.K, qkv.V);
}

void part5() {
  print_heading("Part 5: positions (\"dog bites man\" vs \"man bites dog\")");
  // Three 4-number embeddings and Part 2's weight matrices.
  const Matrix dog = (Matrix(1, 4) << 1, 0, 1, 0).finished();
  const Matrix bites = (Matrix(1, 4) << 0, 2, 0, 1).finished();
  const Matrix man = (Matrix(1, 4) << 1, 1, 1, 1).finished();
  const Matrix W_q = (Matrix(4, 2) << 1, 0, 0, 1, 1, 0, 0, 1).finished();
  const Matrix W_k = (Matrix(4, 2) << 0, 1, 1, 0, 0, 1, 1, 0).finished();
  const Matrix W_v = (Matrix(4, 2) << 1, 0, 0, 1, 1, 1, 0, 0).finished();
  Matrix dbm(3, 4);
  dbm << dog, bites, man;
  Matrix mbd(3, 4);
  mbd << man, bites, dog;
  const Matrix PE = attn::sinusoidal_encoding<double>(3, 4);

  // "dog" is row 0 of the first sentence and row 2 of the second; "man" the other way round.
  const auto compare = [&](const std::string& title, const Matrix& a, const Matrix& b) {
    std::cout << title << "\n"
              << "  dog bites man -> dog " << four_decimals(a, 0) << ", bites "
              << four_decimals(a, 1) << ", man " << four_decimals(a, 2) << "\n"
              << "  man bites dog -> dog " << four_decimals(b, 2) << ", bites "
              << four_decimals(b, 1) << ", man " << four_decimals(b, 0) << "\n";
    const double gap = std::max({(a.row(0) - b.row(2)).cwiseAbs().maxCoeff(),
                                 (a.row(1) - b.row(1)).cwiseAbs().maxCoeff(),
                                 (a.row(2) - b.row(0)).cwiseAbs().maxCoeff()});
    return gap;
  };
  const double plain =
      compare("Without positions (a bag of words):", sentence_attention(dbm, W_q, W_k, W_v, false),
              sentence_attention(mbd, W_q, W_k, W_v, false));
  std::cout << "  same rows, permuted: " << (plain < 1e-12 ? "yes" : "no") << "\n\n";
  const double sinusoidal = compare(
      "With sinusoidal encoding (X + PE):", sentence_attention(dbm + PE, W_q, W_k, W_v, false),
      sentence_attention(mbd + PE, W_q, W_k, W_v, false));
  std::cout << "  sinusoidal: the outputs differ: " << (sinusoidal > 1e-3 ? "yes" : "no")
            << " (largest difference " << fixed(sinusoidal, 4) << ")\n\n";
  const double rotary =
      compare("With RoPE on Q and K:", sentence_attention(dbm, W_q, W_k, W_v, true),
              sentence_attention(mbd, W_q, W_k, W_v, true));
  std::cout << "  RoPE: the outputs differ: " << (rotary > 1e-3 ? "yes" : "no")
            << " (largest difference " << fixed(rotary, 4) << ")\n\n";

  std::cout << "Sinusoidal table, d_model = 4: PE[p, 2i] = sin(p / 10000^(2i/4)), PE[p, 2i+1] = "
               "cos(...)\n";
  const Matrix table = attn::sinusoidal_encoding<double>(4, 4);
  for (Index p = 0; p < table.rows(); ++p) {
    std::cout << "  p = " << p << ": " << four_decimals(table, p) << "\n";
  }
  const Matrix x = (Matrix(1, 4) << 1, 0, 1, 0).finished();
  const Matrix rotated = attn::rope(x, 1, attn::RopeStyle::Interleaved);
  std::cout << "\nRoPE of x = " << four_decimals(x, 0)
            << " at position 1 (pairs (0,1) and (2,3) turn by 1 and 1/100 radian):\n"
            << "  " << four_decimals(rotated, 0) << ", length " << fixed(rotated.norm(), 4) << " = "
            << fixed(x.norm(), 4) << "\n";
}

// ---------------------------------------------------------------------------------------------
// Pictures: --svg DIR and --html FILE
// ---------------------------------------------------------------------------------------------

/// Writes `text` to `path` and says so; throws naming the path when it cannot.
void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  if (!out) throw std::runtime_error("cannot write '" + path.string() + "'");
  std::cout << "wrote " << path.string() << "\n";
}

/// The heatmaps of Parts 1 to 4 as SVG files in `dir` (created if needed): three_tokens.svg,
/// i_love_ai.svg, causal.svg (masked cells hatched) and multi_head_head1.svg.
void write_svgs(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const ThreeTokens three;
  const std::vector<std::string> tokens{"token 1", "token 2", "token 3"};
  attn::HeatmapOptions options;
  options.title = "Part 1: 3 tokens, softmax(Q K^T / √2)";
  write_file(dir / "three_tokens.svg",
             attn::heatmap_svg(attn::attention_with_weights(three.Q, three.K, three.V).weights,
                               tokens, tokens, options));

  const attn_examples::ILoveAi love;
  options.title = "Part 2: \"I love AI\" attention weights";
  write_file(dir / "i_love_ai.svg",
             attn::heatmap_svg(love.weights(), love.words, love.words, options));

  attn::AttentionOptions<double> causal;
  causal.causal = attn::Causal::BottomRight;
  options.title = "Part 3: 3 tokens with a causal mask";
  options.causal = attn::Causal::BottomRight;  // hatch the future
  write_file(
      dir / "causal.svg",
      attn::heatmap_svg(attn::attention_with_weights(three.Q, three.K, three.V, causal).weights,
                        tokens, tokens, options));
  options.causal = attn::Causal::None;

  // Part 4's layer and input; head 1 of sentence 1.
  const attn::MultiHeadAttention<double> mha(attn::MultiHeadConfig{512, 8}, layer_seed);
  const Tensor3 x = randn(2, 10, 512, input_seed);
  attn::MultiHeadOptions<double> mh_options;
  mh_options.need_weights = true;
  mh_options.average_weights = false;
  const Tensor4 heads = mha.forward(x, x, x, mh_options).head_weights;
  const Index n = heads.dimension(2);
  const Index m = heads.dimension(3);
  const Matrix head1 = Eigen::Map<const Matrix>(heads.data(), n, m);
  std::vector<std::string> positions;
  for (Index i = 0; i < n; ++i) positions.push_back("x" + token_number(i));
  options.title = "Part 4: head 1 of 8, sentence 1 (random x, Xavier weights, seed " +
                  std::to_string(layer_seed) + ")";
  write_file(dir / "multi_head_head1.svg", attn::heatmap_svg(head1, positions, positions, options));
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

constexpr const char* usage =
    "usage: attn-walkthrough [--help]\n"
    "\n"
    "Walks through both teaching documents' self-attention calculations, computed live by the\n"
    "attn library and printed in the documents' own layout:\n"
    "  Part 1  the first document's 3-token example (scores, scaling, softmax, outputs)\n"
    "  Part 2  the second document's \"I love AI\" NumPy example\n"
    "  Part 3  the 3-token example with a causal mask\n"
    "  Part 4  the second document's multi-head layer (E = 512, 8 heads) on x of (2, 10, 512)\n"
    "\n"
    "options:\n"
    "  -h, --help     print this help and exit\n"
    "  --svg DIR      write the heatmaps of Parts 1 to 4 as SVG files into DIR (created if\n"
    "                 needed)\n"
    "  --html FILE    write the click-a-word page (self-contained HTML: \"The animal didn't cross\n"
    "                 the street because it was too tired/wide\", illustrative hand-set weights,\n"
    "                 not a trained model) and the 3-token step-through\n"
    "With --svg or --html the program writes the files and does not print the walkthrough.\n";

/// What the command line asked for. To add an option (say `--svg FILE`): a field here, a line in
/// `usage`, a branch in `parse_command_line`.
struct CommandLine {
  bool help = false;
  std::string svg_dir;    ///< --svg DIR; empty when absent
  std::string html_file;  ///< --html FILE; empty when absent
};

/// A command line that cannot be understood; `main` reports it and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// \param arguments  the arguments after the program name
/// \throws UsageError naming the first argument it does not understand.
CommandLine parse_command_line(const std::vector<std::string>& arguments) {
  CommandLine command_line;
  for (std::size_t k = 0; k < arguments.size(); ++k) {
    const std::string& argument = arguments[k];
    // The value of an option that takes one ("--svg DIR" or "--svg=DIR").
    const auto value_of = [&](const std::string& option) {
      if (argument.rfind(option + "=", 0) == 0) return argument.substr(option.size() + 1);
      if (k + 1 == arguments.size() || arguments[k + 1].empty()) {
        throw UsageError("option '" + option + "' needs a value");
      }
      return arguments[++k];
    };
    const auto is = [&](const std::string& option) {
      return argument == option || argument.rfind(option + "=", 0) == 0;
    };
    if (argument == "-h" || argument == "--help") {
      command_line.help = true;
    } else if (is("--svg")) {
      command_line.svg_dir = value_of("--svg");
    } else if (is("--html")) {
      command_line.html_file = value_of("--html");
    } else {
      throw UsageError("unknown argument '" + argument + "'");
    }
  }
  return command_line;
}

}  // namespace

int main(int argc, char** argv) {
  CommandLine command_line;
  try {
    command_line = parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const UsageError& error) {
    std::cerr << "attn-walkthrough: " << error.what() << "\n"
              << "Try 'attn-walkthrough --help' for usage.\n";
    return 2;
  }
  if (command_line.help) {
    std::cout << usage;
    return 0;
  }
  if (!command_line.svg_dir.empty() || !command_line.html_file.empty()) {
    try {
      if (!command_line.svg_dir.empty()) write_svgs(command_line.svg_dir);
      if (!command_line.html_file.empty()) {
        write_file(command_line.html_file, attn_examples::attention_page_html());
      }
    } catch (const std::exception& error) {
      std::cerr << "attn-walkthrough: " << error.what() << "\n";
      return 1;
    }
    return 0;
  }
  try {
    part1();
    part2();
    part3();
    part4();
    part5();
  } catch (const std::exception& error) {
    std::cerr << "attn-walkthrough: " << error.what() << "\n";
    return 1;
  }
  return 0;
}

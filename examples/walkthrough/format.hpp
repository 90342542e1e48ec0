#pragma once
/// \file format.hpp
/// How `attn-walkthrough` writes numbers and tables: the first document's figures ("0.7071",
/// "0.5", "-inf"), NumPy's print layout for the second document's arrays, headings and aligned
/// columns. Shared by every part (walkthrough.hpp).

#include <algorithm>
#include <attn/types.hpp>
#include <cmath>
#include <cstddef>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace walkthrough {

using Matrix = attn::Matrix<double>;
using attn::Index;

// ---------------------------------------------------------------------------------------------
// Number formatting
// ---------------------------------------------------------------------------------------------

/// `x` with exactly `places` decimals: fixed(0.70710678, 4) == "0.7071". Never prints "-0.0000".
inline std::string fixed(double x, int places) {
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
inline std::string short_figure(double x) {
  std::string text = fixed(x, 4);
  if (text.find('.') == std::string::npos) return text;  // "-inf", "inf", "nan"
  text.erase(text.find_last_not_of('0') + 1);
  if (text.back() == '.') text.pop_back();
  return text;
}

/// The first document's style for weights and outputs: 4 decimals ("0.4011", "0.5000").
inline std::string four_places(double x) { return fixed(x, 4); }

/// A weight: 4 decimals, but a weight that is exactly 0 (a masked key) prints as "0".
inline std::string weight_figure(double x) { return x == 0.0 ? "0" : four_places(x); }

/// "1.71e-01": 3 significant digits, as C's printf("%.2e") and Python's f"{x:.2e}" write it.
inline std::string scientific(double x) {
  std::ostringstream out;
  out.setf(std::ios::scientific);
  out.precision(2);
  out << x;
  return out.str();
}

/// "=" when the printed 4-decimal figure is the exact value (e^0 = 1), "≈" otherwise.
inline std::string equals_or_approx(double x) { return std::stod(fixed(x, 4)) == x ? "=" : "≈"; }

/// One of the figure styles above.
using Format = std::string (*)(double);

/// The entries of row `i` of `M`, each formatted.
inline std::vector<std::string> row_figures(const Matrix& M, Index i, Format format) {
  std::vector<std::string> figures;
  for (Index j = 0; j < M.cols(); ++j) figures.push_back(format(M(i, j)));
  return figures;
}

/// `items` with `separator` between them.
inline std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string text;
  for (std::size_t k = 0; k < items.size(); ++k) text += (k == 0 ? "" : separator) + items[k];
  return text;
}

/// "[a, b, c]" (or "[a,b,c]" with separator ",") for row `i` of `M`.
inline std::string bracketed_row(const Matrix& M, Index i, Format format,
                                 const std::string& separator = ", ") {
  return "[" + join(row_figures(M, i, format), separator) + "]";
}

/// Documents count tokens from 1; Eigen counts rows from 0.
inline std::string token_number(Index i) { return std::to_string(i + 1); }

// ---------------------------------------------------------------------------------------------
// NumPy's print layout (the second document prints `weights.round(2)` and `output.round(2)`)
// ---------------------------------------------------------------------------------------------

/// `np.round(x, decimals)`: scale, round half to even, scale back.
inline double numpy_round(double x, int decimals) {
  const double factor = std::pow(10.0, decimals);
  return std::nearbyint(x * factor) / factor;
}

/// How NumPy writes one float of an array (default precision 8): the fewest decimals that read back
/// as the same double, keeping the point ("0.8", "0.01", "0." for zero, "4.24264069").
inline std::string numpy_float(double x) {
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
inline std::string numpy_array(const Matrix& M) {
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
inline Matrix numpy_rounded(const Matrix& M, int decimals) {
  return M.unaryExpr([decimals](double x) { return numpy_round(x, decimals); });
}

// ---------------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------------

/// A part's title, underlined, with a blank line before and after.
inline void print_heading(const std::string& title) {
  std::cout << "\n" << title << "\n" << std::string(title.size(), '=') << "\n\n";
}

/// How many columns `text` takes on a terminal: its UTF-8 characters ("·" and "√" count one).
inline std::size_t display_width(const std::string& text) {
  std::size_t width = 0;
  for (const char c : text) width += (static_cast<unsigned char>(c) & 0xC0) == 0x80 ? 0 : 1;
  return width;
}

/// Prints `rows` as left-aligned columns two spaces apart (the document's tab-separated table).
inline void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (std::size_t c = 0; c < row.size(); ++c) {
      widths[c] = std::max(widths[c], display_width(row[c]));
    }
  }
  for (const auto& row : rows) {
    std::string line;
    for (std::size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(widths[c] - display_width(row[c]) + 2, ' ');
    }
    line.erase(line.find_last_not_of(' ') + 1);
    std::cout << line << "\n";
  }
}

}  // namespace walkthrough

#pragma once
/// \file render.hpp
/// Pictures of an attention matrix (or any n x m table) with row and column labels, without any
/// dependency beyond the standard library and Eigen:
/// - `heatmap_svg`: a standalone SVG heatmap with a colour scale legend, the value in each cell
///   when the table is small, and hatching over the cells a mask forbids;
/// - `heatmap_terminal`: the same table as text, each cell on a 24-bit ANSI background colour, or
///   plain numbers when stdout is not a terminal or `NO_COLOR` is set (https://no-color.org).
///
/// Not part of the umbrella header `attn.hpp`: include `<attn/render.hpp>` to use it.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <locale>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "error.hpp"
#include "mask.hpp"
#include "types.hpp"

#if defined(_WIN32)
#include <io.h>
#else
#include <unistd.h>
#endif

namespace attn {

/// Whether `heatmap_terminal` colours its cells.
enum class ColorChoice {
  Auto,    ///< colour when stdout is a terminal and `NO_COLOR` is unset or empty
  Always,  ///< 24-bit ANSI colours
  Never    ///< plain numbers
};

/// Options of `heatmap_svg` and `heatmap_terminal`.
struct HeatmapOptions {
  /// A caption above the picture (SVG) or the table (terminal); none when empty.
  std::string title;
  /// Hatches the cells that this causal alignment forbids (`causal_mask(n, m, causal)` is false).
  Causal causal = Causal::None;
  /// n x m, `true` = may attend; the other cells are hatched. Combined with `causal`.
  std::optional<Mask> mask;
  /// The value mapped to the low end of the colour scale. By default the scale is [0, 1] when
  /// every finite value lies in it (attention weights), else the smallest to the largest finite
  /// value.
  std::optional<double> low;
  /// The value mapped to the high end of the colour scale (the default: see `low`).
  std::optional<double> high;
  /// Each cell shows its value when the table has at most this many rows and columns.
  Index values_up_to = 12;
  /// Decimals of the printed values, 0 to 9.
  int decimals = 2;
  /// Side of one SVG cell in pixels.
  double cell_size = 44.0;
  /// Colours in `heatmap_terminal` (the SVG is always coloured).
  ColorChoice color = ColorChoice::Auto;
};

namespace detail {

/// An sRGB colour.
struct Rgb {
  int r, g, b;
};

/// The viridis colour map (perceptually uniform, readable in grey and by colour-blind readers) at
/// `t` in [0, 1], by linear interpolation between nine of its samples.
inline Rgb viridis(double t) {
  static constexpr std::array<Rgb, 9> samples{{{68, 1, 84},
                                               {71, 44, 122},
                                               {59, 81, 139},
                                               {44, 113, 142},
                                               {33, 144, 141},
                                               {39, 173, 129},
                                               {92, 200, 99},
                                               {170, 220, 50},
                                               {253, 231, 37}}};
  if (!(t > 0.0)) t = 0.0;  // also NaN
  if (t > 1.0) t = 1.0;
  const double position = t * static_cast<double>(samples.size() - 1);
  const auto k = std::min(static_cast<std::size_t>(position), samples.size() - 2);
  const double f = position - static_cast<double>(k);
  const auto mix = [f](int a, int b) {
    return static_cast<int>(std::lround(static_cast<double>(a) + f * static_cast<double>(b - a)));
  };
  return {mix(samples[k].r, samples[k + 1].r), mix(samples[k].g, samples[k + 1].g),
          mix(samples[k].b, samples[k + 1].b)};
}

/// Black or white, whichever reads better on `background` (by its relative luminance).
inline Rgb text_color_on(Rgb background) {
  const double luminance = 0.2126 * background.r + 0.7152 * background.g + 0.0722 * background.b;
  return luminance > 140.0 ? Rgb{0, 0, 0} : Rgb{255, 255, 255};
}

/// "#rrggbb".
inline std::string hex(Rgb c) {
  char text[8];
  std::snprintf(text, sizeof text, "#%02x%02x%02x", c.r, c.g, c.b);
  return text;
}

/// `x` with `decimals` decimals in the classic locale; never "-0.00"; "-inf", "inf", "nan" as such.
inline std::string fixed_figure(double x, int decimals) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out.setf(std::ios::fixed);
  out.precision(decimals);
  out << x;
  std::string text = out.str();
  if (text.front() == '-' && text.find_first_not_of("-0.") == std::string::npos) text.erase(0, 1);
  return text;
}

/// A number for an SVG attribute: at most 2 decimals, no trailing zeros.
inline std::string coordinate(double x) {
  std::string text = fixed_figure(x, 2);
  if (text.find('.') != std::string::npos) {
    text.erase(text.find_last_not_of('0') + 1);
    if (text.back() == '.') text.pop_back();
  }
  return text;
}

/// `text` escaped for XML character data and attribute values. Characters XML 1.0 forbids
/// (control characters other than tab, line feed and carriage return) become U+FFFD.
inline std::string xml_escape(const std::string& text) {
  std::string escaped;
  escaped.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        escaped += "&amp;";
        break;
      case '<':
        escaped += "&lt;";
        break;
      case '>':
        escaped += "&gt;";
        break;
      case '"':
        escaped += "&quot;";
        break;
      case '\'':
        escaped += "&apos;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
          escaped += "\xEF\xBF\xBD";
        } else {
          escaped += c;
        }
    }
  }
  return escaped;
}

/// The opening of a standalone SVG document of width x height (user units = pixels) in the
/// pictures' font, with its `<title>` when `title` is not empty.
inline void svg_open(std::ostream& svg, double width, double height, double font,
                     const std::string& title) {
  const auto c = coordinate;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << c(width) << "\" height=\""
      << c(height) << "\" viewBox=\"0 0 " << c(width) << " " << c(height)
      << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"" << c(font)
      << "\">\n";
  if (!title.empty()) svg << "<title>" << xml_escape(title) << "</title>\n";
}

/// Characters shown for a UTF-8 string (code points; wide characters count as one).
inline std::size_t display_width(const std::string& text) {
  std::size_t width = 0;
  for (const char c : text) width += (static_cast<unsigned char>(c) & 0xC0) != 0x80 ? 1 : 0;
  return width;
}

/// `text` cut to at most `width` code points (the last one an ellipsis when cut).
inline std::string truncate_to(const std::string& text, std::size_t width) {
  if (display_width(text) <= width) return text;
  std::string cut;
  std::size_t shown = 0;
  for (std::size_t k = 0; k < text.size(); ++k) {
    const bool starts = (static_cast<unsigned char>(text[k]) & 0xC0) != 0x80;
    if (starts && ++shown == width) break;
    cut += text[k];
  }
  return width == 0 ? std::string() : cut + "\xE2\x80\xA6";
}

/// `text` padded with spaces to `width` code points, on the left (`right_align`) or the right.
inline std::string pad(const std::string& text, std::size_t width, bool right_align) {
  const std::size_t shown = display_width(text);
  const std::string spaces(width > shown ? width - shown : 0, ' ');
  return right_align ? spaces + text : text + spaces;
}

/// Everything both renderers need, checked: the table in double, which cells are allowed and the
/// colour range.
struct HeatmapInput {
  Matrix<double> values;
  Mask allowed;
  double low = 0.0;
  double high = 1.0;
  bool show_values = true;
};

inline HeatmapInput prepare_heatmap(const char* function, const Eigen::Ref<const Matrix<double>>& M,
                                    const std::vector<std::string>& row_labels,
                                    const std::vector<std::string>& col_labels,
                                    const HeatmapOptions& options) {
  const Index n = M.rows();
  const Index m = M.cols();
  if (static_cast<Index>(row_labels.size()) != n) {
    fail(function, "row_labels has ", row_labels.size(), " labels but the matrix has ", n,
         " rows (the matrix is ", shape_of(M), ")");
  }
  if (static_cast<Index>(col_labels.size()) != m) {
    fail(function, "col_labels has ", col_labels.size(), " labels but the matrix has ", m,
         " columns (the matrix is ", shape_of(M), ")");
  }
  if (options.decimals < 0 || options.decimals > 9) {
    fail(function, "decimals is ", options.decimals, " but must lie in 0..9");
  }
  if (!(options.cell_size > 0.0) || !std::isfinite(options.cell_size)) {
    fail(function, "cell_size is ", options.cell_size, " but must be finite and positive");
  }
  HeatmapInput input;
  input.values = M;
  input.allowed = Mask::Constant(n, m, true);
  if (options.mask) {
    require_table(function, "mask", *options.mask, n, m);
    input.allowed = *options.mask;
  }
  if (options.causal != Causal::None && n > 0 && m > 0) {
    input.allowed = input.allowed && causal_mask(n, m, options.causal);
  }
  double smallest = 0.0;
  double largest = 1.0;
  bool any = false;
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      const double x = M(i, j);
      if (!std::isfinite(x)) continue;
      smallest = any ? std::min(smallest, x) : x;
      largest = any ? std::max(largest, x) : x;
      any = true;
    }
  }
  const bool unit_range = !any || (smallest >= 0.0 && largest <= 1.0);
  input.low = options.low.value_or(unit_range ? 0.0 : smallest);
  input.high = options.high.value_or(unit_range ? 1.0 : largest);
  if (!std::isfinite(input.low) || !std::isfinite(input.high) || !(input.low < input.high)) {
    if (options.low || options.high) {
      fail(function, "the colour range [", input.low, ", ", input.high,
           "] must be finite with low < high");
    }
    input.high = input.low + 1.0;  // a constant table: any non-empty range
  }
  input.show_values = n <= options.values_up_to && m <= options.values_up_to;
  return input;
}

/// Where `x` falls on the colour scale, in [0, 1].
inline double scale_position(const HeatmapInput& input, double x) {
  return (x - input.low) / (input.high - input.low);
}

inline std::string svg_heatmap_kernel(const HeatmapInput& input,
                                      const std::vector<std::string>& row_labels,
                                      const std::vector<std::string>& col_labels,
                                      const HeatmapOptions& options) {
  const Index n = input.values.rows();
  const Index m = input.values.cols();
  const double cell = options.cell_size;
  const double font = std::clamp(cell * 0.3, 9.0, 16.0);
  const double char_width = 0.62 * font;  // a generous average for sans-serif
  std::size_t row_chars = 1;
  std::size_t col_chars = 1;
  for (const std::string& label : row_labels) row_chars = std::max(row_chars, display_width(label));
  for (const std::string& label : col_labels) col_chars = std::max(col_chars, display_width(label));
  // Column labels are turned 45 degrees when they do not fit across a cell.
  const bool turn_columns = static_cast<double>(col_chars) * char_width > cell - 4.0;
  const double title_height = options.title.empty() ? 0.0 : font * 2.0;
  const double left = 10.0 + static_cast<double>(row_chars) * char_width + 8.0;
  const double top =
      10.0 + title_height +
      (turn_columns ? static_cast<double>(col_chars) * char_width * 0.72 + font : font * 1.6);
  const double grid_width = cell * static_cast<double>(m);
  const double grid_height = cell * static_cast<double>(n);
  const double legend_x = left + grid_width + 24.0;
  const double legend_width = 16.0;
  const double legend_height = std::max(grid_height, 120.0);
  const std::string low_text = fixed_figure(input.low, options.decimals);
  const std::string high_text = fixed_figure(input.high, options.decimals);
  const double legend_text_width =
      static_cast<double>(std::max(low_text.size(), high_text.size())) * char_width;
  const double title_width = static_cast<double>(display_width(options.title)) * char_width * 1.1;
  const double width =
      std::max(legend_x + legend_width + 8.0 + legend_text_width, 10.0 + title_width) + 10.0;
  const double height = top + std::max(grid_height, legend_height) + 10.0;

  std::ostringstream svg;
  svg.imbue(std::locale::classic());
  const auto c = coordinate;
  svg_open(svg, width, height, font, options.title);
  // Defs: the hatching of forbidden cells and the legend's gradient (viridis, low at the bottom).
  svg << "<defs>\n"
      << "<pattern id=\"attn-hatch\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
         "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f2f2f2\"/>"
         "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#a0a0a0\" stroke-width=\"2\"/>"
         "</pattern>\n"
      << "<linearGradient id=\"attn-scale\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">";
  for (int k = 0; k <= 8; ++k) {
    const double t = k / 8.0;
    svg << "<stop offset=\"" << c(t) << "\" stop-color=\"" << hex(viridis(t)) << "\"/>";
  }
  svg << "</linearGradient>\n</defs>\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  if (!options.title.empty()) {
    svg << "<text class=\"title\" x=\"10\" y=\"" << c(10.0 + font * 1.2)
        << "\" font-weight=\"bold\">" << xml_escape(options.title) << "</text>\n";
  }
  // Labels: keys across the top, queries down the left.
  svg << "<g class=\"col-labels\">\n";
  for (Index j = 0; j < m; ++j) {
    const double x = left + cell * (static_cast<double>(j) + 0.5);
    const double y = top - 6.0;
    svg << "<text class=\"col-label\" x=\"" << c(x) << "\" y=\"" << c(y) << "\"";
    if (turn_columns) {
      svg << " transform=\"rotate(-45 " << c(x) << " " << c(y) << ")\"";
    } else {
      svg << " text-anchor=\"middle\"";
    }
    svg << ">" << xml_escape(col_labels[static_cast<std::size_t>(j)]) << "</text>\n";
  }
  svg << "</g>\n<g class=\"row-labels\">\n";
  for (Index i = 0; i < n; ++i) {
    svg << "<text class=\"row-label\" x=\"" << c(left - 8.0) << "\" y=\""
        << c(top + cell * (static_cast<double>(i) + 0.5)) << "\" text-anchor=\"end\""
        << " dominant-baseline=\"central\">" << xml_escape(row_labels[static_cast<std::size_t>(i)])
        << "</text>\n";
  }
  svg << "</g>\n";
  // Cells: one <rect class="cell"> per entry, row by row, with its value as a tooltip.
  svg << "<g class=\"cells\">\n";
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      const double value = input.values(i, j);
      const bool allowed = input.allowed(i, j);
      const double x = left + cell * static_cast<double>(j);
      const double y = top + cell * static_cast<double>(i);
      const Rgb fill = viridis(scale_position(input, value));
      const std::string figure = fixed_figure(value, options.decimals);
      svg << "<rect class=\"cell" << (allowed ? "" : " masked") << "\" data-row=\"" << i
          << "\" data-col=\"" << j << "\" x=\"" << c(x) << "\" y=\"" << c(y) << "\" width=\""
          << c(cell) << "\" height=\"" << c(cell) << "\" fill=\""
          << (allowed && std::isfinite(value) ? hex(fill) : std::string("url(#attn-hatch)"))
          << "\" stroke=\"#ffffff\" stroke-width=\"1\"><title>"
          << xml_escape(row_labels[static_cast<std::size_t>(i)]) << " \xE2\x86\x92 "
          << xml_escape(col_labels[static_cast<std::size_t>(j)]) << ": "
          << (allowed ? figure : std::string("masked")) << "</title></rect>\n";
      if (input.show_values && allowed) {
        svg << "<text class=\"value\" x=\"" << c(x + cell / 2.0) << "\" y=\"" << c(y + cell / 2.0)
            << "\" text-anchor=\"middle\" dominant-baseline=\"central\" font-size=\""
            << c(font * 0.85) << "\" fill=\""
            << hex(std::isfinite(value) ? text_color_on(fill) : Rgb{0, 0, 0}) << "\">" << figure
            << "</text>\n";
      }
    }
  }
  svg << "</g>\n";
  // Legend: the gradient bar with its two ends and the middle labelled.
  svg << "<g class=\"legend\">\n"
      << "<rect x=\"" << c(legend_x) << "\" y=\"" << c(top) << "\" width=\"" << c(legend_width)
      << "\" height=\"" << c(legend_height)
      << "\" fill=\"url(#attn-scale)\" stroke=\"#808080\" stroke-width=\"0.5\"/>\n";
  for (int k = 0; k <= 2; ++k) {
    const double t = k / 2.0;
    const double y = top + legend_height * (1.0 - t);
    svg << "<line x1=\"" << c(legend_x + legend_width) << "\" y1=\"" << c(y) << "\" x2=\""
        << c(legend_x + legend_width + 4.0) << "\" y2=\"" << c(y)
        << "\" stroke=\"#808080\"/><text class=\"legend-label\" x=\""
        << c(legend_x + legend_width + 7.0) << "\" y=\"" << c(y)
        << "\" dominant-baseline=\"central\" font-size=\"" << c(font * 0.8) << "\">"
        << fixed_figure(input.low + t * (input.high - input.low), options.decimals) << "</text>\n";
  }
  svg << "</g>\n</svg>\n";
  return svg.str();
}

inline std::string terminal_heatmap_kernel(const HeatmapInput& input,
                                           const std::vector<std::string>& row_labels,
                                           const std::vector<std::string>& col_labels,
                                           const HeatmapOptions& options, bool color) {
  const Index n = input.values.rows();
  const Index m = input.values.cols();
  std::vector<std::string> figures;
  std::size_t cell_width = 1;
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      figures.push_back(input.allowed(i, j) ? fixed_figure(input.values(i, j), options.decimals)
                                            : std::string("-"));
      cell_width = std::max(cell_width, figures.back().size());
    }
  }
  cell_width += 2;  // a space either side
  std::size_t label_width = 0;
  for (const std::string& label : row_labels)
    label_width = std::max(label_width, display_width(label));

  std::string text;
  if (!options.title.empty()) text += options.title + "\n";
  text += std::string(label_width, ' ');
  for (Index j = 0; j < m; ++j) {
    text +=
        pad(truncate_to(col_labels[static_cast<std::size_t>(j)], cell_width - 1), cell_width, true);
  }
  text += "\n";
  std::size_t k = 0;
  for (Index i = 0; i < n; ++i) {
    text += pad(row_labels[static_cast<std::size_t>(i)], label_width, false);
    for (Index j = 0; j < m; ++j, ++k) {
      const std::string cell_text = pad(figures[k] + " ", cell_width, true);
      const double value = input.values(i, j);
      if (!color) {
        text += cell_text;
        continue;
      }
      const Rgb background = input.allowed(i, j) && std::isfinite(value)
                                 ? viridis(scale_position(input, value))
                                 : Rgb{90, 90, 90};
      const Rgb foreground = text_color_on(background);
      text += "\x1b[48;2;" + std::to_string(background.r) + ";" + std::to_string(background.g) +
              ";" + std::to_string(background.b) + "m\x1b[38;2;" + std::to_string(foreground.r) +
              ";" + std::to_string(foreground.g) + ";" + std::to_string(foreground.b) + "m" +
              cell_text + "\x1b[0m";
    }
    text += "\n";
  }
  return text;
}

}  // namespace detail

/// The decision `ColorChoice::Auto` makes, as a pure function so that tests can inject both
/// inputs: colour only on a terminal and only when `NO_COLOR` is unset or empty.
/// \param stdout_is_terminal  whether standard output is a terminal (`isatty`)
/// \param no_color            the value of the `NO_COLOR` environment variable, or nullptr
/// \returns whether to colour
inline bool color_wanted(bool stdout_is_terminal, const char* no_color) {
  return stdout_is_terminal && (no_color == nullptr || *no_color == '\0');
}

/// `color_wanted` for this process: `isatty(stdout)` and `getenv("NO_COLOR")`.
/// \returns whether this process's standard output gets colour under `ColorChoice::Auto`
inline bool stdout_wants_color() {
#if defined(_WIN32)
  const bool terminal = _isatty(_fileno(stdout)) != 0;
#else
  const bool terminal = isatty(fileno(stdout)) != 0;
#endif
  return color_wanted(terminal, std::getenv("NO_COLOR"));
}

/// An n x m table (attention weights, scores, ...) as a standalone SVG heatmap: one
/// `<rect class="cell">` per entry in row-major order (masked cells also have class `masked` and a
/// hatched fill), `<text class="row-label">` / `<text class="col-label">` labels, the value of each
/// allowed cell when n and m are at most `options.values_up_to`, and a viridis colour scale legend.
/// Non-finite entries (the `-inf` of masked scores) are drawn hatched.
/// \param values      n x m table (any Eigen expression of a floating-point type)
/// \param row_labels  n labels, one per row (queries), escaped for XML
/// \param col_labels  m labels, one per column (keys), escaped for XML
/// \param options     title, causal alignment and/or mask to hatch, colour range, decimals, sizes
/// \returns the SVG document (UTF-8, with an XML declaration).
/// \throws shape_error when a label count differs from the table's rows or columns, the mask is not
///         n x m, `decimals` is outside 0..9, `cell_size` is not positive or the range is empty.
/// \note O(n m) time and output size; the table is copied once into double.
template <class Derived>
std::string heatmap_svg(const Eigen::MatrixBase<Derived>& values,
                        const std::vector<std::string>& row_labels,
                        const std::vector<std::string>& col_labels,
                        const HeatmapOptions& options = {}) {
  const Matrix<double> table = values.template cast<double>();
  const detail::HeatmapInput input =
      detail::prepare_heatmap("heatmap_svg", table, row_labels, col_labels, options);
  return detail::svg_heatmap_kernel(input, row_labels, col_labels, options);
}

/// An n x m table as terminal text: a header line of column labels (cut to the cell width), then
/// one line per row, its label and its values with `options.decimals` decimals; cells a mask
/// forbids print as "-". With colour each cell has a 24-bit ANSI background (viridis) and a
/// readable foreground, reset after the cell.
/// \param values      n x m table (any Eigen expression of a floating-point type)
/// \param row_labels  n labels, one per row
/// \param col_labels  m labels, one per column
/// \param options     `color` (`Auto`: `stdout_wants_color()`), title, mask, range, decimals
/// \returns the text, ending in a newline.
/// \throws shape_error as `heatmap_svg` does.
/// \note O(n m); meant for small tables (each row is one line).
template <class Derived>
std::string heatmap_terminal(const Eigen::MatrixBase<Derived>& values,
                             const std::vector<std::string>& row_labels,
                             const std::vector<std::string>& col_labels,
                             const HeatmapOptions& options = {}) {
  const Matrix<double> table = values.template cast<double>();
  const detail::HeatmapInput input =
      detail::prepare_heatmap("heatmap_terminal", table, row_labels, col_labels, options);
  const bool color = options.color == ColorChoice::Always ||
                     (options.color == ColorChoice::Auto && stdout_wants_color());
  return detail::terminal_heatmap_kernel(input, row_labels, col_labels, options, color);
}

}  // namespace attn

#pragma once
/// \file line_chart.hpp
/// Line charts as a standalone SVG, for Part 6's picture (pictures.cpp): one or more panels side by
/// side, each with its own axes (linear or logarithmic), light grid lines at the ticks, each series
/// a `<polyline class="series">` with a `<circle class="point">` (and a tooltip) at each point, and
/// a legend under each panel. The text escaping and number layout are attn/render.hpp's.
///
/// Kept beside the walkthrough rather than in attn/render.hpp: it serves this one picture and has
/// only the picture test (tests/check_pictures.cmake), not unit tests of its own.

#include <algorithm>
#include <attn/render.hpp>
#include <cmath>
#include <cstddef>
#include <locale>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace walkthrough {

/// One curve.
struct ChartSeries {
  std::string name;       ///< its legend entry
  std::vector<double> x;  ///< k values, finite (positive on a log axis)
  std::vector<double> y;  ///< k values, finite (positive on a log axis)
  std::string color = "#3b518b";
  bool dashed = false;
};

/// One panel: axes, ticks and the curves drawn on them.
struct ChartPanel {
  std::string title;
  std::string x_label;
  std::string y_label;
  bool log_x = false;
  bool log_y = false;
  /// The x values that get a tick and a label; empty: those of the first series.
  std::vector<double> x_ticks;
  /// The y range; by default the data's (on a log axis widened to whole powers of 10).
  std::optional<double> y_low;
  std::optional<double> y_high;
  std::vector<ChartSeries> series;
};

namespace chart_detail {

/// An axis: its range and whether it is logarithmic, mapping a value to [0, 1].
struct Axis {
  double low = 0;
  double high = 1;
  bool log = false;

  double position(double value) const {
    const auto f = [this](double v) { return log ? std::log10(v) : v; };
    return (f(value) - f(low)) / (f(high) - f(low));
  }
};

/// Ticks for a y axis: each power of 10 (log), or steps of 1, 2 or 5 times a power of 10 giving
/// at most 6 steps across the range (linear).
inline std::vector<double> y_ticks(const Axis& axis) {
  std::vector<double> ticks;
  if (axis.log) {
    for (double e = std::ceil(std::log10(axis.low) - 1e-9); e <= std::log10(axis.high) + 1e-9;
         e += 1.0) {
      ticks.push_back(std::pow(10.0, e));
    }
    return ticks;
  }
  const double span = axis.high - axis.low;
  const double base = std::pow(10.0, std::floor(std::log10(span)));
  double step = base;
  for (const double factor : {0.5, 0.2, 0.1}) {
    if (span / (base * factor) > 6.0) break;
    step = base * factor;
  }
  for (double t = std::ceil(axis.low / step - 1e-9) * step; t <= axis.high + 1e-9 * span;
       t += step) {
    ticks.push_back(t);
  }
  return ticks;
}

/// A tick label: "10^k" as 10 with a raised exponent (log axis), else at most 2 decimals.
inline std::string tick_label(double value, bool log) {
  if (!log) return attn::detail::coordinate(value);
  const long exponent = std::lround(std::log10(value));
  return "10<tspan dy=\"-6\" font-size=\"9\">" + std::to_string(exponent) + "</tspan>";
}

/// Throws naming the panel and series unless the points can be drawn on these axes.
inline void check_series(const ChartPanel& panel, const ChartSeries& series) {
  const std::string where = "line chart '" + panel.title + "', series '" + series.name + "': ";
  if (series.x.size() != series.y.size() || series.x.empty()) {
    throw std::invalid_argument(where + "needs as many y as x values, at least one (got " +
                                std::to_string(series.x.size()) + " x and " +
                                std::to_string(series.y.size()) + " y)");
  }
  for (std::size_t k = 0; k < series.x.size(); ++k) {
    const double x = series.x[k];
    const double y = series.y[k];
    if (!std::isfinite(x) || !std::isfinite(y) || (panel.log_x && !(x > 0)) ||
        (panel.log_y && !(y > 0))) {
      throw std::invalid_argument(where + "point " + std::to_string(k) +
                                  " is not finite, or not positive on a log axis");
    }
  }
}

}  // namespace chart_detail

/// The panels side by side in one SVG document.
/// \param title   a caption above the panels (and the document's <title>); none when empty
/// \param panels  at least one panel, each with at least one series
/// \returns the SVG document (UTF-8, with an XML declaration).
/// \throws std::invalid_argument when a series has mismatched or no points, a point is not finite,
///         or a point on a log axis is not positive.
inline std::string line_chart_svg(const std::string& title, const std::vector<ChartPanel>& panels) {
  using attn::detail::coordinate;
  using attn::detail::svg_open;
  using attn::detail::xml_escape;
  if (panels.empty()) throw std::invalid_argument("line chart '" + title + "': no panels");
  constexpr double font = 12.0;
  constexpr double plot_width = 300.0;
  constexpr double plot_height = 220.0;
  constexpr double margin_left = 70.0;  // y tick labels and the y axis label
  constexpr double margin_right = 24.0;
  constexpr double panel_title_height = 28.0;
  constexpr double below_plot = 70.0;  // x tick labels, the x axis label, the legend
  const double title_height = title.empty() ? 10.0 : 36.0;
  const double panel_width = margin_left + plot_width + margin_right;
  const double width = panel_width * static_cast<double>(panels.size()) + 10.0;
  const double height = title_height + panel_title_height + plot_height + below_plot + 10.0;

  std::ostringstream svg;
  svg.imbue(std::locale::classic());
  const auto c = coordinate;
  svg_open(svg, width, height, font, title);
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  if (!title.empty()) {
    svg << "<text class=\"title\" x=\"10\" y=\"24\" font-weight=\"bold\">" << xml_escape(title)
        << "</text>\n";
  }
  for (std::size_t p = 0; p < panels.size(); ++p) {
    const ChartPanel& panel = panels[p];
    if (panel.series.empty()) {
      throw std::invalid_argument("line chart '" + panel.title + "': no series");
    }
    // 1. The axes' ranges: the data's, unless the panel sets y.
    chart_detail::Axis x_axis{panel.series[0].x[0], panel.series[0].x[0], panel.log_x};
    chart_detail::Axis y_axis{panel.series[0].y[0], panel.series[0].y[0], panel.log_y};
    for (const ChartSeries& series : panel.series) {
      chart_detail::check_series(panel, series);
      x_axis.low = std::min(x_axis.low, *std::min_element(series.x.begin(), series.x.end()));
      x_axis.high = std::max(x_axis.high, *std::max_element(series.x.begin(), series.x.end()));
      y_axis.low = std::min(y_axis.low, *std::min_element(series.y.begin(), series.y.end()));
      y_axis.high = std::max(y_axis.high, *std::max_element(series.y.begin(), series.y.end()));
    }
    if (panel.log_y) {
      y_axis.low = std::pow(10.0, std::floor(std::log10(y_axis.low)));
      y_axis.high = std::pow(10.0, std::ceil(std::log10(y_axis.high)));
    }
    y_axis.low = panel.y_low.value_or(y_axis.low);
    y_axis.high = panel.y_high.value_or(y_axis.high);
    if (!(x_axis.low < x_axis.high)) x_axis.high = x_axis.low + 1.0;  // one x value
    if (!(y_axis.low < y_axis.high)) y_axis.high = y_axis.low + 1.0;  // a flat curve

    // 2. Pixels: x grows to the right from `left`, y grows upwards from `bottom`.
    const double left = 10.0 + panel_width * static_cast<double>(p) + margin_left;
    const double top = title_height + panel_title_height;
    const double bottom = top + plot_height;
    const auto px = [&](double x) { return left + plot_width * x_axis.position(x); };
    const auto py = [&](double y) { return bottom - plot_height * y_axis.position(y); };

    svg << "<g class=\"panel\">\n"
        << "<text class=\"panel-title\" x=\"" << c(left) << "\" y=\"" << c(top - 10.0)
        << "\" font-weight=\"bold\">" << xml_escape(panel.title) << "</text>\n";
    // 3. Grid lines and tick labels.
    const std::vector<double> x_ticks = panel.x_ticks.empty() ? panel.series[0].x : panel.x_ticks;
    for (const double x : x_ticks) {
      svg << "<line class=\"grid\" x1=\"" << c(px(x)) << "\" y1=\"" << c(top) << "\" x2=\""
          << c(px(x)) << "\" y2=\"" << c(bottom) << "\" stroke=\"#e0e0e0\"/>"
          << "<text class=\"tick\" x=\"" << c(px(x)) << "\" y=\"" << c(bottom + 16.0)
          << "\" text-anchor=\"middle\">" << coordinate(x) << "</text>\n";
    }
    for (const double y : chart_detail::y_ticks(y_axis)) {
      svg << "<line class=\"grid\" x1=\"" << c(left) << "\" y1=\"" << c(py(y)) << "\" x2=\""
          << c(left + plot_width) << "\" y2=\"" << c(py(y)) << "\" stroke=\"#e0e0e0\"/>"
          << "<text class=\"tick\" x=\"" << c(left - 6.0) << "\" y=\"" << c(py(y) + 4.0)
          << "\" text-anchor=\"end\">" << chart_detail::tick_label(y, panel.log_y) << "</text>\n";
    }
    // 4. The frame and the axis labels.
    svg << "<rect class=\"frame\" x=\"" << c(left) << "\" y=\"" << c(top) << "\" width=\""
        << c(plot_width) << "\" height=\"" << c(plot_height)
        << "\" fill=\"none\" stroke=\"#808080\"/>\n"
        << "<text class=\"axis-label\" x=\"" << c(left + plot_width / 2.0) << "\" y=\""
        << c(bottom + 34.0) << "\" text-anchor=\"middle\">" << xml_escape(panel.x_label)
        << "</text>\n";
    const double label_x = left - margin_left + 14.0;
    const double label_y = top + plot_height / 2.0;
    svg << "<text class=\"axis-label\" x=\"" << c(label_x) << "\" y=\"" << c(label_y)
        << "\" text-anchor=\"middle\" transform=\"rotate(-90 " << c(label_x) << " " << c(label_y)
        << ")\">" << xml_escape(panel.y_label) << "</text>\n";
    // 5. The curves, each point with its value as a tooltip.
    for (const ChartSeries& series : panel.series) {
      const std::string dash = series.dashed ? "\" stroke-dasharray=\"6 4" : "";
      svg << "<polyline class=\"series\" fill=\"none\" stroke=\"" << xml_escape(series.color)
          << dash << "\" stroke-width=\"2\" points=\"";
      for (std::size_t k = 0; k < series.x.size(); ++k) {
        svg << (k == 0 ? "" : " ") << c(px(series.x[k])) << "," << c(py(series.y[k]));
      }
      svg << "\"><title>" << xml_escape(series.name) << "</title></polyline>\n";
      for (std::size_t k = 0; k < series.x.size(); ++k) {
        std::ostringstream value;
        value.imbue(std::locale::classic());
        value.precision(3);
        value << series.y[k];
        svg << "<circle class=\"point\" cx=\"" << c(px(series.x[k])) << "\" cy=\""
            << c(py(series.y[k])) << "\" r=\"3\" fill=\"" << xml_escape(series.color)
            << "\"><title>" << xml_escape(series.name) << ": " << xml_escape(panel.x_label) << " "
            << coordinate(series.x[k]) << ", " << value.str() << "</title></circle>\n";
      }
    }
    // 6. The legend, one entry per series in a row under the axis label.
    double entry_x = left;
    const double entry_y = bottom + 56.0;
    for (const ChartSeries& series : panel.series) {
      const std::string dash = series.dashed ? "\" stroke-dasharray=\"6 4" : "";
      svg << "<g class=\"legend-entry\"><line x1=\"" << c(entry_x) << "\" y1=\"" << c(entry_y - 4.0)
          << "\" x2=\"" << c(entry_x + 24.0) << "\" y2=\"" << c(entry_y - 4.0) << "\" stroke=\""
          << xml_escape(series.color) << dash << "\" stroke-width=\"2\"/><text x=\""
          << c(entry_x + 30.0) << "\" y=\"" << c(entry_y) << "\">" << xml_escape(series.name)
          << "</text></g>\n";
      const double text_width = static_cast<double>(attn::detail::display_width(series.name)) *
                                0.55 * font;  // DejaVu Sans averages about 0.55 em
      entry_x += 30.0 + text_width + 16.0;
    }
    svg << "</g>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace walkthrough

/// \file pictures.cpp
/// `--svg DIR` and `--html FILE`: the heatmaps of Parts 1 to 4 (attn/render.hpp), Part 6's trap as
/// line charts (line_chart.hpp) and the click-a-word page (it_example.hpp). The documents' inputs
/// are those of documents.hpp.

#include <attn/attn.hpp>
#include <attn/render.hpp>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../documents.hpp"
#include "../it_example.hpp"
#include "format.hpp"
#include "line_chart.hpp"
#include "walkthrough.hpp"

namespace walkthrough {
namespace {

/// Writes `text` to `path` and says so; throws naming the path when it cannot.
void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  if (!out) throw std::runtime_error("cannot write '" + path.string() + "'");
  std::cout << "wrote " << path.string() << "\n";
}

}  // namespace

void write_svgs(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const attn::QKV<double> three = attn_examples::three_tokens();
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

  // Part 6's trap: the typical row's gradient norm (left) and largest weight (right) against d_k,
  // with and without the 1/√d_k scale.
  const std::vector<TrapRow> trap = measure_trap();
  ChartSeries scaled{"scaled, Q K^T / √d_k", {}, {}, "#3b518b", false};
  ChartSeries unscaled{"unscaled, Q K^T", {}, {}, "#e8710a", true};
  for (const TrapRow& row : trap) {
    scaled.x.push_back(static_cast<double>(row.d_k));
    scaled.y.push_back(row.gradient_scaled);
    unscaled.y.push_back(row.gradient_unscaled);
  }
  unscaled.x = scaled.x;
  ChartPanel gradient;
  gradient.title = "Gradient: median over rows of ||dS_i||";
  gradient.x_label = "d_k (log scale)";
  gradient.y_label = "||dS_i|| (log scale)";
  gradient.log_x = true;
  gradient.log_y = true;
  gradient.series = {scaled, unscaled};

  for (std::size_t k = 0; k < trap.size(); ++k) {
    scaled.y[k] = trap[k].weight_scaled;
    unscaled.y[k] = trap[k].weight_unscaled;
  }
  ChartPanel weight;
  weight.title = "Largest weight: median of max_j P_ij";
  weight.x_label = "d_k (log scale)";
  weight.y_label = "max_j P_ij";
  weight.log_x = true;
  weight.y_low = 0.0;
  weight.y_high = 1.0;
  weight.series = {scaled, unscaled};
  write_file(dir / "gradient_trap.svg",
             line_chart_svg("Part 6: the 1/√d_k trap (64 x 64 scores from random Q and K)",
                            {gradient, weight}));
}

void write_page(const std::filesystem::path& path) {
  write_file(path, attn_examples::attention_page_html());
}

}  // namespace walkthrough

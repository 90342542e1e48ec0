/// \file part4_multi_head.cpp
/// Part 4: the second document's multi-head layer, nn.MultiheadAttention(embed_dim=512,
/// num_heads=8), on x of shape (2, 10, 512): the output and weight shapes PyTorch prints, the
/// parameter count read off the layer, and one head's 10 x 10 weights.

#include <attn/attn.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {
namespace {

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

}  // namespace

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

}  // namespace walkthrough

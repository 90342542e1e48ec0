/// \file part5_positions.cpp
/// Part 5: positions (the second document's "dog bites man"). Without positions, self-attention
/// gives "dog bites man" and "man bites dog" the same rows, permuted; a sinusoidal encoding added
/// to the embeddings, or RoPE on Q and K, makes them differ. Then a sinusoidal table, and RoPE's
/// rotation of one vector.

#include <algorithm>
#include <attn/attn.hpp>
#include <iostream>
#include <string>
#include <vector>

#include "../documents.hpp"
#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {
namespace {

/// "[a, b, ...]": row `i` of `M` with 4 decimals.
std::string four_decimals(const Matrix& M, Index i) {
  std::vector<std::string> items;
  for (Index j = 0; j < M.cols(); ++j) items.push_back(fixed(M(i, j), 4));
  return "[" + join(items, ", ") + "]";
}

/// Self-attention of the rows of X with Part 2's weights; `rope` rotates Q and K by position.
/// \param X     n x 4 embeddings, one row per word
/// \param love  Part 2's example, whose W_q, W_k and W_v (4 x 2) are used
/// \param rope  whether Q and K are rotated (RoPE, interleaved pairs, row r at position r)
/// \returns n x 2
Matrix sentence_attention(const Matrix& X, const attn_examples::ILoveAi& love, bool rope) {
  attn::QKV<double> qkv = attn::project_qkv(X, love.W_q, love.W_k, love.W_v);
  if (rope) {
    attn::rope_inplace(qkv.Q, 0, attn::RopeStyle::Interleaved);
    attn::rope_inplace(qkv.K, 0, attn::RopeStyle::Interleaved);
  }
  return attn::scaled_dot_product_attention(qkv.Q, qkv.K, qkv.V);
}

}  // namespace

void part5() {
  print_heading("Part 5: positions (\"dog bites man\" vs \"man bites dog\")");
  // Three 4-number embeddings and Part 2's weight matrices.
  const Matrix dog = (Matrix(1, 4) << 1, 0, 1, 0).finished();
  const Matrix bites = (Matrix(1, 4) << 0, 2, 0, 1).finished();
  const Matrix man = (Matrix(1, 4) << 1, 1, 1, 1).finished();
  const attn_examples::ILoveAi love;
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
      compare("Without positions (a bag of words):", sentence_attention(dbm, love, false),
              sentence_attention(mbd, love, false));
  std::cout << "  same rows, permuted: " << (plain < 1e-12 ? "yes" : "no") << "\n\n";
  const double sinusoidal =
      compare("With sinusoidal encoding (X + PE):", sentence_attention(dbm + PE, love, false),
              sentence_attention(mbd + PE, love, false));
  std::cout << "  sinusoidal: the outputs differ: " << (sinusoidal > 1e-3 ? "yes" : "no")
            << " (largest difference " << fixed(sinusoidal, 4) << ")\n\n";
  const double rotary = compare("With RoPE on Q and K:", sentence_attention(dbm, love, true),
                                sentence_attention(mbd, love, true));
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

}  // namespace walkthrough

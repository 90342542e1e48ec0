#pragma once
/// \file walkthrough.hpp
/// What the files of `attn-walkthrough` share: the seven parts (one file each), the first
/// document's steps that Part 3 repeats with a causal mask, Part 4's input and Part 6's
/// measurement that the pictures draw again, and the pictures themselves. main.cpp reads the
/// command line and calls them.
///
/// - Part 1 (part1_three_tokens.cpp): the first document's 3-token example (scores, scaling,
///   softmax, outputs).
/// - Part 2 (part2_i_love_ai.cpp): the second document's "I love AI" NumPy example, printed as
///   NumPy prints it.
/// - Part 3 (part3_causal.cpp): Part 1's tokens again with a causal mask.
/// - Part 4 (part4_multi_head.cpp): the second document's multi-head layer,
///   nn.MultiheadAttention(512, 8), on x of shape (2, 10, 512): output and weight shapes, the
///   parameter count, one head's weights.
/// - Part 5 (part5_positions.cpp): positions: "dog bites man" and "man bites dog" give the same
///   rows permuted without positions, different ones with a sinusoidal encoding or RoPE; a
///   sinusoidal table; a rotation.
/// - Part 6 (part6_gradients.cpp): gradients: the first document's trap (without 1/√d_k the
///   softmax goes one-hot and its gradient vanishes as d_k grows) measured for d_k = 16 to 1024,
///   and one causal self-attention layer trained by SGD (`attn::attention_backward`).
/// - Part 7 (part7_exam_traps.cpp): the first document's six exam traps in its order, each
///   computed on the documents' numbers (../exam_traps.hpp) as the wrong way beside the right way.
/// - Pictures (pictures.cpp, with line_chart.hpp): `--svg DIR` and `--html FILE`.
///
/// The documents' inputs are typed in once, in documents.hpp (the 3 tokens, "I love AI") or in the
/// part that uses them; every other number comes from the library at run time.

#include <attn/attention.hpp>
#include <attn/tensor.hpp>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "format.hpp"

namespace walkthrough {

using Trace = attn::AttentionTrace<double>;
using Tensor3 = attn::Tensor3<double>;
using Tensor4 = attn::Tensor4<double>;

// ---------------------------------------------------------------------------------------------
// The parts: each prints its heading and its figures to std::cout
// ---------------------------------------------------------------------------------------------

void part1();  ///< the first document's worked example (3 tokens)
void part2();  ///< the second document's "I love AI" example (NumPy)
void part3();  ///< the same 3 tokens with a causal mask
void part4();  ///< multi-head attention (the second document's nn.MultiheadAttention)
void part5();  ///< positions ("dog bites man" vs "man bites dog")
void part6();  ///< gradients: why 1/√d_k, and one attention layer trained by SGD
void part7();  ///< the first document's six exam traps, computed live

// ---------------------------------------------------------------------------------------------
// The first document's steps (part1_three_tokens.cpp), repeated by Part 3
// ---------------------------------------------------------------------------------------------

/// "• Row 1: [0.7071, 0, 0.7071]" for every row of `table` (the scaled or the masked scores).
/// \param table  n x m scores
void print_score_rows(const Matrix& table);

/// "Softmax each row (using e^0.7071 ≈ 2.0281, e^0 = 1, e^1.4142 ≈ 4.1133):" then, per row,
/// "• Row 1: sum = 2.0281+1+2.0281 = 5.0562 → weights [0.4011, 0.1978, 0.4011]".
/// The e^x and sums are the document's (unshifted) ones, recovered from the trace.
/// \param trace  the trace of n queries over m keys
void print_softmax_rows(const Trace& trace);

/// "• Output 1 = 0.4011·[1,0] + 0.1978·[0,1] + 0.4011·[0.5,0.5] = [0.6017, 0.3983]".
/// \param trace  the trace of n queries over m keys
/// \param V      m x d_v, the values the trace's weights average
void print_outputs(const Trace& trace, const Matrix& V);

// ---------------------------------------------------------------------------------------------
// Part 4's layer and input (part4_multi_head.cpp), drawn again by --svg
// ---------------------------------------------------------------------------------------------

/// The seeds of Part 4 (the document draws x with torch.randn and lets PyTorch initialise the
/// layer; the shapes and the parameter count do not depend on the values drawn, the printed
/// weights do).
constexpr std::uint64_t layer_seed = 2017;
constexpr std::uint64_t input_seed = 1;

/// `torch.randn(batch, tokens, features)`: N(0, 1) entries by the Box-Muller transform from a
/// 64-bit Mersenne twister (whose output is the same on every platform; std::normal_distribution's
/// is not).
/// \returns batch x tokens x features
Tensor3 randn(Index batch, Index tokens, Index features, std::uint64_t seed);

// ---------------------------------------------------------------------------------------------
// Part 6's measurement of the trap (part6_gradients.cpp), drawn again by --svg
// ---------------------------------------------------------------------------------------------

/// One d_k of the trap table: 64 x 64 weights P = softmax_rows(scale Q K^T) from N(0, 1) Q and K
/// (64 x d_k), with scale = 1/√d_k ("scaled") or 1 ("unscaled"), and dS =
/// softmax_rows_backward(P, G) for a fixed N(0, 1) table G (the gradient of sum(G ∘ P)).
struct TrapRow {
  Index d_k = 0;
  double weight_scaled = 0;  ///< median over rows of the row's largest weight
  double weight_unscaled = 0;
  double gradient_scaled = 0;  ///< median over rows of ||dS_i||
  double gradient_unscaled = 0;
  double table_scaled = 0;  ///< ||dS||_F, the whole table
  double table_unscaled = 0;
  Index one_hot_scaled = 0;  ///< rows whose largest weight exceeds 0.99
  Index one_hot_unscaled = 0;
};

/// The trap table for d_k = 16, 32, ..., 1024 (seed 6; tests/data/check_gradient_trap.py
/// recomputes it independently).
std::vector<TrapRow> measure_trap();

// ---------------------------------------------------------------------------------------------
// Pictures (pictures.cpp)
// ---------------------------------------------------------------------------------------------

/// The heatmaps of Parts 1 to 4 as SVG files in `dir` (created if needed): three_tokens.svg,
/// i_love_ai.svg, causal.svg (masked cells hatched) and multi_head_head1.svg; and Part 6's trap
/// as line charts, gradient_trap.svg. Says "wrote <path>" for each.
/// \throws std::runtime_error naming the file that cannot be written.
void write_svgs(const std::filesystem::path& dir);

/// The click-a-word page (it_example.hpp) as one self-contained HTML file at `path`.
/// \throws std::runtime_error naming the file when it cannot be written.
void write_page(const std::filesystem::path& path);

}  // namespace walkthrough

/// \file part3_causal.cpp
/// Part 3: Part 1's tokens with a causal mask (`attn::Causal::BottomRight`): the masked scores,
/// the softmax over the keys each token may see, the outputs. The steps are Part 1's.

#include <attn/attn.hpp>
#include <iostream>

#include "../documents.hpp"
#include "format.hpp"
#include "walkthrough.hpp"

namespace walkthrough {

void part3() {
  print_heading("Part 3: the same 3 tokens with a causal mask (attn::Causal::BottomRight)");
  std::cout << "A causal mask sets the scores of future positions to -inf before the softmax, so\n"
               "their weights become exactly 0: token i attends to tokens 1..i only.\n\n";
  const attn::QKV<double> tokens = attn_examples::three_tokens();
  attn::AttentionOptions<double> options;
  options.causal = attn::Causal::BottomRight;
  const Trace trace = attn::trace_attention(tokens.Q, tokens.K, tokens.V, options);

  std::cout << "Masked scores (scaled; future keys -inf):\n\n";
  print_score_rows(trace.masked);
  print_softmax_rows(trace);
  std::cout << "\n";
  print_outputs(trace, tokens.V);
}

}  // namespace walkthrough

/// \file main.cpp
/// `attn-walkthrough`: both teaching documents' calculations, computed live by `attn` (double
/// precision) and printed in the documents' own layout, so the output can be laid beside them and
/// read line by line. One file per part (see walkthrough.hpp); this one reads the command line.
///
/// Only the documents' inputs are typed in; every other number comes from the library at run time
/// (`attn::project_qkv` and `attn::trace_attention`, whose trace keeps every intermediate table;
/// `attn::MultiHeadAttention` for Part 4; `attn::softmax_rows_backward` and
/// `attn::attention_backward` for Part 6).
///
/// Pictures (attn/render.hpp, line_chart.hpp, it_example.hpp): `--svg DIR` writes the heatmaps
/// of Parts 1 to 4 and Part 6's line charts as SVG files; `--html FILE` writes the
/// self-contained click-a-word page (illustrative hand-set weights, not a trained model) with the
/// 3-token step-through.
///
/// At start, when the program was compiled for another SIMD set than the best this CPU has
/// (attn/simd.hpp), it prints `attn::simd_advice()` to stderr: one line, which names the CMake
/// target `attn::native` when the CPU has more.

#include <attn/simd.hpp>
#include <cstddef>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "walkthrough.hpp"

namespace {

constexpr const char* usage =
    "usage: attn-walkthrough [--help] [--svg DIR] [--html FILE]\n"
    "\n"
    "Walks through both teaching documents' self-attention calculations, computed live by the\n"
    "attn library and printed in the documents' own layout:\n"
    "  Part 1  the first document's 3-token example (scores, scaling, softmax, outputs)\n"
    "  Part 2  the second document's \"I love AI\" NumPy example\n"
    "  Part 3  the 3-token example with a causal mask\n"
    "  Part 4  the second document's multi-head layer (E = 512, 8 heads) on x of (2, 10, 512)\n"
    "  Part 5  positions: \"dog bites man\" vs \"man bites dog\" without positions, with a\n"
    "          sinusoidal encoding and with RoPE\n"
    "  Part 6  gradients: why the scores are divided by sqrt(d_k) (the softmax's gradient with\n"
    "          and without it, d_k = 16 to 1024), and one attention layer trained by SGD\n"
    "  Part 7  the first document's six exam traps, each computed on the documents' numbers\n"
    "          as the wrong way beside the right way\n"
    "\n"
    "options:\n"
    "  -h, --help     print this help and exit\n"
    "  --svg DIR      write the heatmaps of Parts 1 to 4 and Part 6's gradient chart as SVG\n"
    "                 files into DIR (created if needed)\n"
    "  --html FILE    write the click-a-word page (self-contained HTML: \"The animal didn't cross\n"
    "                 the street because it was too tired/wide\", illustrative hand-set weights,\n"
    "                 not a trained model) and the 3-token step-through\n"
    "With --svg or --html the program writes the files and does not print the walkthrough.\n"
    "\n"
    "When it was compiled for another SIMD set than the best this CPU has (say SSE2 on an\n"
    "AVX-512 machine), the program first prints one line of advice to stderr; for more SIMD,\n"
    "build it with the CMake target attn::native (-march=native).\n";

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
/// \returns the options found ("--svg DIR" and "--svg=DIR" alike)
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
  if (const std::string advice = attn::simd_advice(); !advice.empty()) std::cerr << advice << "\n";
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
      if (!command_line.svg_dir.empty()) walkthrough::write_svgs(command_line.svg_dir);
      if (!command_line.html_file.empty()) walkthrough::write_page(command_line.html_file);
    } catch (const std::exception& error) {
      std::cerr << "attn-walkthrough: " << error.what() << "\n";
      return 1;
    }
    return 0;
  }
  try {
    walkthrough::part1();
    walkthrough::part2();
    walkthrough::part3();
    walkthrough::part4();
    walkthrough::part5();
    walkthrough::part6();
    walkthrough::part7();
  } catch (const std::exception& error) {
    std::cerr << "attn-walkthrough: " << error.what() << "\n";
    return 1;
  }
  return 0;
}

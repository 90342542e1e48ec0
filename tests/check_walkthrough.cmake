# Runs attn-walkthrough and checks that it prints the documents' figures.
# Usage: cmake -DPROGRAM=<path to attn-walkthrough> -P check_walkthrough.cmake
#
# Every figure below was computed independently of attn (by hand, with Python's math module, or
# with NumPy in tests/data/check_gradient_trap.py), not copied from the program's output. Each
# missing figure is reported by name; the script fails at the end.

if(NOT PROGRAM)
  message(FATAL_ERROR "check_walkthrough.cmake: pass -DPROGRAM=<path to attn-walkthrough>")
endif()

set(problems "")   # one line per problem
set(problem_count 0)

# problem(<text>): records one problem (a string, not a list: the figures contain brackets).
function(problem text)
  math(EXPR count "${problem_count} + 1")
  set(problem_count ${count} PARENT_SCOPE)
  set(problems "${problems}\n  ${text}" PARENT_SCOPE)
endfunction()

# --- The walkthrough itself --------------------------------------------------------------------
execute_process(COMMAND "${PROGRAM}"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "attn-walkthrough exited with '${result}'\nstdout:\n${output}\nstderr:\n${errors}")
endif()

# expect(<name> <text>): <text> must appear literally in the output.
function(expect name text)
  string(FIND "${output}" "${text}" position)
  if(position EQUAL -1)
    problem("missing ${name}: '${text}'")
    set(problem_count ${problem_count} PARENT_SCOPE)
    set(problems "${problems}" PARENT_SCOPE)
  endif()
endfunction()

# Part 1: the first document's 3-token example.
expect("sqrt(2)" "1.4142")
expect("raw scores, row 1" "Row 1: Q1·K1=1, Q1·K2=0, Q1·K3=1")
expect("raw scores, row 3" "Row 3: Q3·K1=1, Q3·K2=1, Q3·K3=2")
expect("scaled scores, row 1" "[0.7071, 0, 0.7071]")
expect("scaled scores, row 3" "[0.7071, 0.7071, 1.4142]")
expect("e^0.7071" "2.0281")
expect("e^1.4142" "4.1133")
expect("row 1 sum" "sum = 2.0281+1+2.0281 = 5.0562")
expect("row 3 sum" "sum = 2.0281+2.0281+4.1133 = 8.1695")
expect("row 1 weights" "[0.4011, 0.1978, 0.4011]")
expect("row 2 weights" "[0.1978, 0.4011, 0.4011]")
expect("row 3 weights" "[0.2483, 0.2483, 0.5035]")
expect("row 3 exact weight" "0.248255")
expect("output 1" "= [0.6017, 0.3983]")
expect("output 2" "= [0.3983, 0.6017]")
expect("output 3" "= [0.5000, 0.5000]")
expect("stable form, row 1 e^(x-max)" "[1, 0.4931, 1]")

# Part 2: the second document's "I love AI" example, in NumPy's layout.
expect("Q" "[[2 0]\n [0 3]\n [2 2]]")
expect("K" "[[0 2]\n [3 0]\n [2 2]]")
expect("V" "[[2 1]\n [0 2]\n [2 2]]")
expect("attention weights" "Attention weights:\n [[0.01 0.8  0.19]\n [0.5  0.01 0.5 ]\n [0.05 0.19 0.77]]")
expect("output" "Output:\n [[0.41 1.99]\n [1.99 1.5 ]\n [1.63 1.95]]")
expect("first-row sentence" "the word I puts 80% of its attention on love and 19% on AI")
expect("first-row vector" "[0.41, 1.99]")

# Part 3: causal mask. Row 2 sees keys 1 and 2: e^0 = 1, e^0.7071 = 2.0281, sum 3.0281,
# weights 1/3.0281 = 0.3302 and 2.0281/3.0281 = 0.6698; row 1 sees only itself.
expect("causal masked row 1" "[0.7071, -inf, -inf]")
expect("causal masked row 2" "[0, 0.7071, -inf]")
expect("causal row 1 sum" "sum = 2.0281+0+0 = 2.0281")
expect("causal row 2 sum" "sum = 1+2.0281+0 = 3.0281")
expect("causal row 1 weights" "[1.0000, 0, 0]")
expect("causal row 2 weights" "[0.3302, 0.6698, 0]")
expect("causal output 1" "= [1.0000, 0.0000]")
expect("causal output 2" "= [0.3302, 0.6698]")
# Decoding through a KVCache gives the causal rows: step 1 sees only token 1 (output V_1 = [1, 0]),
# step 2 the first two ([0.3302, 0.6698] as above).
expect("decode step 1" "Step 1: cache of 1 token → output [1.0000, 0.0000]")
expect("decode step 2" "Step 2: cache of 2 tokens → output [0.3302, 0.6698]")
# A 32k-token cache of 32 layers, 8 key/value heads of d = 128: per token and layer
# 8 * (128 + 128) values. float: 2048 * 4 bytes * 32768 * 32 = 8 GiB; 16-bit: 4 GiB; int8:
# 8 * (256 + 2 * 4) = 2112 bytes per token and layer, * 32768 * 32 = 2.0625 GiB.
expect("32k cache float" "float (KVStorage::Same)                    8.00 GiB")
expect("32k cache float16" "KVStorage::Float16                         4.00 GiB")
expect("32k cache int8" "KVStorage::Int8 (+ one scale per row)      2.06 GiB")

# Part 4: the second document's nn.MultiheadAttention(embed_dim=512, num_heads=8) on x of shape
# (2, 10, 512). 4 * 512 * 512 + 4 * 512 = 1048576 + 2048 = 1050624; 512 / 8 = 64.
expect("output shape" "torch.Size([2, 10, 512])")
expect("head-averaged weights shape" "torch.Size([2, 10, 10])")
expect("per-head weights shape" "torch.Size([2, 8, 10, 10])")
expect("parameter count" "1050624")
expect("parameter breakdown" "4 × 262,144 + 4 × 512 = 1,050,624")
expect("head width" "d_k = 512 / 8 = 64")
# One head's 10 x 10 weights: ten rows, each followed by "  sum = 1.0000" (the match leaves out the
# row's closing bracket: brackets would break the CMake list).
string(REGEX MATCHALL "  sum = 1\\.0000\n" head_rows "${output}")
list(LENGTH head_rows head_row_count)
if(NOT head_row_count EQUAL 10)
  problem("one head's weights: expected 10 rows with 'sum = 1.0000', found ${head_row_count}")
endif()

# Part 5: positions. sin 1 = 0.84147, cos 1 = 0.54030, sin 0.01 = 0.0099998, cos 0.01 = 0.99995,
# sin 2 = 0.90930, cos 2 = -0.41615, sin 0.02 = 0.019999, cos 0.02 = 0.99980 (Python's math); the
# rotation of [1, 0, 1, 0] by 1 and 0.01 radian is [cos 1, sin 1, cos 0.01, sin 0.01], length sqrt 2.
expect("bag of words" "same rows, permuted: yes")
expect("sinusoidal breaks the symmetry" "sinusoidal: the outputs differ: yes")
expect("RoPE breaks the symmetry" "RoPE: the outputs differ: yes")
expect("sinusoidal row 1" "p = 1: [0.8415, 0.5403, 0.0100, 1.0000]")
expect("sinusoidal row 2" "p = 2: [0.9093, -0.4161, 0.0200, 0.9998]")
expect("RoPE rotation" "[0.5403, 0.8415, 1.0000, 0.0100], length 1.4142 = 1.4142")

# Part 6: gradients. The trap table and its summary were computed independently of attn by
# tests/data/check_gradient_trap.py (NumPy, the same splitmix64 + Box-Muller numbers; rerun it with
# /usr/bin/python3 tests/data/check_gradient_trap.py: it prints these lines).
# expect_row(<name> <figure>...): a line of the table holds the figures in order, spaces between.
function(expect_row name)
  string(REPLACE ";" " +" pattern "${ARGN}")
  string(REPLACE "." "\\." pattern "${pattern}")
  if(NOT output MATCHES "\n${pattern}\n")
    string(REPLACE ";" "  " figures "${ARGN}")
    problem("missing ${name}: a table row '${figures}'")
    set(problem_count ${problem_count} PARENT_SCOPE)
    set(problems "${problems}" PARENT_SCOPE)
  endif()
endfunction()
expect_row("trap d_k = 16" "16" "0.0856" "0.5352" "1.71e-01" "2.35e-01")
expect_row("trap d_k = 32" "32" "0.0874" "0.5870" "1.78e-01" "2.22e-01")
expect_row("trap d_k = 64" "64" "0.0946" "0.9109" "1.62e-01" "6.57e-02")
expect_row("trap d_k = 128" "128" "0.0993" "0.9668" "1.71e-01" "3.03e-02")
expect_row("trap d_k = 256" "256" "0.0923" "0.9952" "1.64e-01" "8.47e-03")
expect_row("trap d_k = 512" "512" "0.0909" "0.9987" "1.68e-01" "2.39e-03")
expect_row("trap d_k = 1024" "1024" "0.0921" "0.9996" "1.63e-01" "2.65e-04")
expect("trap: weights go one-hot" "(largest weight 0.5352 -> 0.9996)")
expect("trap: gradients vanish" "(2.35e-01 -> 2.65e-04, 888 times smaller)")
expect("trap: one-hot rows, unscaled" "unscaled: 0 of 64 at d_k = 16, 46 of 64 at d_k = 1024;")
expect("trap: one-hot rows, scaled" "scaled: 0 of 64 at every d_k")
expect("trap: whole-table norm" "(unscaled 2.8881 -> 1.1660, scaled 1.5185 -> 1.3948)")
# The training demo: robust facts, not every digit. Chance for 6 symbols is ln 6 = 1.791759 and
# 1/6 = 16.7%; 256 held-out sequences of 10 symbols predict 8 each, 2048 in all.
expect("training: chance" "Chance: loss log 6 = 1.7918, accuracy 1/6 = 16.7%")
if(NOT output MATCHES "\nstep +loss +accuracy\n0 +1\\.[6-9][0-9][0-9][0-9] ")
  problem("training: the loss at step 0 should be near chance, 1.6 to 2.0")
endif()
if(NOT output MATCHES "\n300 +0\\.0[0-4][0-9][0-9] +100\\.0%\n")
  problem("training: at step 300 the loss should be below 0.05 at 100.0% accuracy")
endif()
expect("training: held-out accuracy" "accuracy 100.0% (2048 of 2048 predictions)")
# The last position's weights: position 8 (two back from 10) must take the most, at least half.
if(output MATCHES "\\(its target is at 8\\): \\[([0-9., ]+)\\]")
  string(REPLACE ", " ";" weights "${CMAKE_MATCH_1}")
  list(GET weights 7 target_weight)
  set(others ${weights})
  list(REMOVE_AT others 7)
  set(largest_other 0)
  foreach(weight ${others})
    if(weight GREATER largest_other)
      set(largest_other ${weight})
    endif()
  endforeach()
  if(NOT largest_other LESS target_weight)
    problem("training: position 10 puts ${largest_other} on another position, ${target_weight} on 8")
  endif()
  if(target_weight LESS 0.5)
    problem("training: position 10 puts only ${target_weight} on position 8")
  endif()
else()
  problem("training: missing the last position's attention weights")
endif()

# Part 7: the first document's six exam traps. Every figure below was recomputed independently of
# attn by tests/data/check_exam_traps.py (NumPy, from the definitions; rerun it with
# /usr/bin/python3 tests/data/check_exam_traps.py: it prints these figures).
expect("part 7 heading" "Part 7: the first document's exam traps, checked live")
foreach(number 1 2 3 4 5 6)
  expect("trap ${number} heading" "Trap ${number} of 6 (the document: ")
endforeach()
# Trap 1: softmax of Q K^T without 1/sqrt(2).
expect("trap 1 unscaled row 1" "Row 1  [0.4223, 0.1554, 0.4223]  [0.4011, 0.1978, 0.4011]")
expect("trap 1 unscaled row 3" "Row 3  [0.2119, 0.2119, 0.5761]  [0.2483, 0.2483, 0.5035]")
expect("trap 1 points to part 6" "Part 6 measures it for d_k = 16 to 1024")
# Trap 2: softmax down the columns; its rows sum to 0.8471, 0.8471 and 1.3057.
expect("trap 2 column row 1" "[0.4011, 0.1978, 0.2483]  0.8471   [0.4011, 0.1978, 0.4011]  1.0000")
expect("trap 2 column row 3" "[0.4011, 0.4011, 0.5035]  1.3057   [0.2483, 0.2483, 0.5035]  1.0000")
expect("trap 2 column sums" "column sum  [1.0000, 1.0000, 1.0000]")
expect("trap 2 not an average" "token 3 gets [0.6529, 0.6529] from weights summing to 1.3057")
# Trap 3: the tokens in the order 3, 2, 1.
expect("trap 3 reversed outputs" "[0.5000, 0.5000], [0.3983, 0.6017], [0.6017, 0.3983].")
expect("trap 3 permuted" "outputs in reverse order: yes")
# Trap 4: "I love AI", the weights applied to Q, K and V.
expect("trap 4 row I" "I     [0.4095, 2.7724]     [2.7724, 0.4095]     [0.4095, 1.9886]")
expect("trap 4 row love" "love  [1.9857, 1.0143]     [1.0143, 1.9857]     [1.9857, 1.5036]")
expect("trap 4 the library returns weights . V" "returns the last column (largest difference 0.00e+00)")
# Trap 5: "I love AI" with W_q for all three.
expect("trap 5 row I" "I     [0.4856, 0.0287, 0.4856]     [1.9426, 1.0574]")
expect("trap 5 row love" "love  [0.0015, 0.8916, 0.1069]     [0.2168, 2.8885]")
expect("trap 5 diagonal" "[0.4856, 0.8916, 0.7679] with one")
expect("trap 5 diagonal wins" "1 of 3 with three\nmatrices, 3 of 3 with one")
expect("trap 5 80% disappears" "\"I puts 80% on love\" becomes 3%, and I puts 49% on itself")
# Trap 6: the diagonal, then the weights and outputs with it masked.
expect("trap 6 diagonal" "the diagonal of Part 1's weights): [0.4011, 0.4011, 0.5035]")
expect("trap 6 row 1" "Row 1: weights [0, 0.3302, 0.6698], output [0.3349, 0.6651] (with itself [0.6017, 0.3983])")
expect("trap 6 row 2" "Row 2: weights [0.3302, 0, 0.6698], output [0.6651, 0.3349] (with itself [0.3983, 0.6017])")
expect("trap 6 row 3" "Row 3: weights [0.5000, 0.5000, 0], output [0.5000, 0.5000] (with itself [0.5000, 0.5000]: unchanged)")

if(output MATCHES "(^|[^A-Za-z])nan([^A-Za-z]|$)")
  problem("the output contains 'nan'")
endif()

# stderr holds nothing, or the one line of attn::simd_advice() (a build without attn::native).
if(NOT errors STREQUAL "" AND NOT errors MATCHES "^attn: compiled for [^\n]+\n$")
  problem("stderr holds more than the SIMD advice line: '${errors}'")
endif()

# --- The command line --------------------------------------------------------------------------
execute_process(COMMAND "${PROGRAM}" --help RESULT_VARIABLE result OUTPUT_VARIABLE help_output)
string(FIND "${help_output}" "usage:" position)
if(NOT result EQUAL 0 OR position EQUAL -1)
  problem("--help: expected exit code 0 and a usage text, got '${result}'")
endif()
# --help lists exactly the parts the walkthrough prints (headings "Part N: ..."), in order.
string(REGEX MATCHALL "\nPart [0-9]+:" headings "${output}")
string(REGEX MATCHALL "\n  Part [0-9]+  " listed "${help_output}")
set(printed_parts "")
foreach(heading ${headings})
  string(REGEX MATCH "[0-9]+" part "${heading}")
  list(APPEND printed_parts ${part})
endforeach()
set(listed_parts "")
foreach(line ${listed})
  string(REGEX MATCH "[0-9]+" part "${line}")
  list(APPEND listed_parts ${part})
endforeach()
list(LENGTH printed_parts heading_count)
if(heading_count LESS 7)
  problem("expected at least 7 parts, found ${heading_count} headings 'Part N:'")
endif()
if(NOT printed_parts STREQUAL listed_parts)
  problem("--help lists the parts '${listed_parts}', the program prints the parts '${printed_parts}'")
endif()
string(FIND "${help_output}" "attn::native" position)
if(position EQUAL -1)
  problem("--help does not mention attn::native (the SIMD advice)")
endif()
execute_process(COMMAND "${PROGRAM}" --no-such-option
  RESULT_VARIABLE result OUTPUT_QUIET ERROR_VARIABLE unknown_errors)
string(FIND "${unknown_errors}" "--no-such-option" position)
if(NOT result EQUAL 2 OR position EQUAL -1)
  problem(
    "unknown argument: expected exit code 2 and a message naming it, got '${result}': ${unknown_errors}")
endif()

if(problem_count GREATER 0)
  message(FATAL_ERROR "attn-walkthrough: ${problem_count} problem(s):${problems}\n\nOutput was:\n${output}")
endif()
message(STATUS "attn-walkthrough: all figures present")

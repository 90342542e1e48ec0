# Runs attn-walkthrough --svg and --html and checks what they write.
# Usage: cmake -DPROGRAM=<attn-walkthrough> -DOUT_DIR=<folder> [-DDOCS_DIR=<repo>/docs]
#              -P check_pictures.cmake
#
# - --svg DIR creates DIR and writes the four SVG heatmaps, each an <svg> document with one
#   class="cell" rectangle per weight (3 x 3 = 9 for the document examples, 10 x 10 for the head);
# - and Part 6's gradient_trap.svg: two panels (gradient norm, largest weight), each with two
#   curves (scaled, unscaled) of 7 points (d_k = 16 to 1024), positive coordinates only;
# - docs/i_love_ai.svg (the README's picture) is byte for byte the program's own output;
# - --html FILE writes one self-contained page: the illustrative-weights note, the embedded data,
#   and nothing fetched from elsewhere (the XML and the data are checked in render_test.cpp).

foreach(variable PROGRAM OUT_DIR)
  if(NOT ${variable})
    message(FATAL_ERROR "check_pictures.cmake: pass -D${variable}=...")
  endif()
endforeach()

set(problems "")
file(REMOVE_RECURSE "${OUT_DIR}")
set(svg_dir "${OUT_DIR}/svg/nested")  # not there yet: --svg must create it
execute_process(COMMAND "${PROGRAM}" --svg "${svg_dir}" --html "${OUT_DIR}/page.html"
  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "attn-walkthrough --svg --html failed (${result}):\n${output}\n${errors}")
endif()

foreach(case "three_tokens;9" "i_love_ai;9" "causal;9" "multi_head_head1;100")
  list(GET case 0 name)
  list(GET case 1 cells)
  set(file "${svg_dir}/${name}.svg")
  if(NOT EXISTS "${file}")
    string(APPEND problems "\n  missing ${file}")
    continue()
  endif()
  file(READ "${file}" svg)
  string(REGEX MATCHALL "<rect class=\"cell" found "${svg}")
  list(LENGTH found count)
  if(NOT count EQUAL cells)
    string(APPEND problems "\n  ${name}.svg: ${count} cells, expected ${cells}")
  endif()
  if(NOT svg MATCHES "^<\\?xml[^\n]*\n<svg xmlns=\"http://www.w3.org/2000/svg\"" OR
     NOT svg MATCHES "</svg>\n$")
    string(APPEND problems "\n  ${name}.svg does not start with <svg xmlns=...> or end with </svg>")
  endif()
endforeach()
set(file "${svg_dir}/gradient_trap.svg")
if(EXISTS "${file}")
  file(READ "${file}" svg)
  if(NOT svg MATCHES "^<\\?xml[^\n]*\n<svg xmlns=\"http://www.w3.org/2000/svg\"" OR
     NOT svg MATCHES "</svg>\n$")
    string(APPEND problems "\n  gradient_trap.svg does not start with <svg xmlns=...> or end with </svg>")
  endif()
  foreach(case "<g class=\"panel\">;2" "<polyline class=\"series\";4" "<circle class=\"point\";28")
    list(GET case 0 needle)
    list(GET case 1 expected)
    string(REGEX MATCHALL "${needle}" found "${svg}")
    list(LENGTH found count)
    if(NOT count EQUAL expected)
      string(APPEND problems "\n  gradient_trap.svg: ${count} of '${needle}', expected ${expected}")
    endif()
  endforeach()
  # Every point lies inside the picture (no NaN, no infinity, no negative coordinate).
  if(svg MATCHES "(c[xy]|points)=\"[^\"]*(nan|inf|-)")
    string(APPEND problems "\n  gradient_trap.svg has a point outside the picture")
  endif()
  # Balanced elements: as many opening <g> as closing </g>, <text> as </text>.
  foreach(tag g text title)
    string(REGEX MATCHALL "<${tag}[ >]" opened "${svg}")
    string(REGEX MATCHALL "</${tag}>" closed "${svg}")
    list(LENGTH opened open_count)
    list(LENGTH closed close_count)
    if(NOT open_count EQUAL close_count)
      string(APPEND problems
        "\n  gradient_trap.svg: ${open_count} <${tag}> but ${close_count} </${tag}>")
    endif()
  endforeach()
else()
  string(APPEND problems "\n  missing ${file}")
endif()

file(READ "${svg_dir}/causal.svg" causal)
string(REGEX MATCHALL "class=\"cell masked\"" masked "${causal}")
list(LENGTH masked masked_count)
if(NOT masked_count EQUAL 3)
  string(APPEND problems "\n  causal.svg: ${masked_count} hatched cells, expected 3")
endif()

if(DOCS_DIR AND EXISTS "${DOCS_DIR}/i_love_ai.svg")
  file(SHA256 "${DOCS_DIR}/i_love_ai.svg" committed)
  file(SHA256 "${svg_dir}/i_love_ai.svg" generated)
  if(NOT committed STREQUAL generated)
    string(APPEND problems "\n  docs/i_love_ai.svg differs from the program's output: regenerate "
                           "it (attn-walkthrough --svg DIR, then copy DIR/i_love_ai.svg)")
  endif()
elseif(DOCS_DIR)
  string(APPEND problems "\n  ${DOCS_DIR}/i_love_ai.svg is missing")
endif()

file(READ "${OUT_DIR}/page.html" page)
foreach(needle "<!DOCTYPE html>" "Illustrative weights, not a trained model" "id=\"attn-data\""
               "\"tired\":{\"words\":" "\"wide\":{\"words\":" "\"three_tokens\":")
  string(FIND "${page}" "${needle}" position)
  if(position EQUAL -1)
    string(APPEND problems "\n  page.html lacks '${needle}'")
  endif()
endforeach()
foreach(external "http:" "https:" "src=" "href=")
  string(FIND "${page}" "${external}" position)
  if(NOT position EQUAL -1)
    string(APPEND problems "\n  page.html refers to something external ('${external}')")
  endif()
endforeach()

if(problems)
  message(FATAL_ERROR "attn-walkthrough pictures:${problems}")
endif()
message(STATUS "attn-walkthrough pictures: 5 SVG files and the page are as expected")

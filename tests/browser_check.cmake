# Opens the click-a-word page in headless Chromium from a local file:// URL and checks the DOM.
# Usage: cmake -DPROGRAM=<attn-walkthrough> -DCHROMIUM=<chromium> -DOUT_DIR=<build folder>
#              -P browser_check.cmake
#
# 1. attn-walkthrough --html <OUT_DIR>/it_page.html writes the page.
# 2. For "#word=it&last=tired" and "#word=it&last=wide", `chromium --dump-dom` prints the DOM after
#    the page's script ran; the sentence must report "it" selected and the most-attended word
#    ("animal", then "street"), and exactly that word's button must carry class most-attended.
# 3. A screenshot of "#word=it&last=tired": <OUT_DIR>/it_tired.png (1200 x 900), and one of the
#    exam-trap panel, "#trap=columns": <OUT_DIR>/it_trap_columns.png (1200 x 1900).
# Each Chromium run gets a fresh --user-data-dir; the flags keep it off the network.

foreach(variable PROGRAM CHROMIUM OUT_DIR)
  if(NOT ${variable})
    message(FATAL_ERROR "browser_check.cmake: pass -D${variable}=...")
  endif()
endforeach()

set(page "${OUT_DIR}/it_page.html")
execute_process(COMMAND "${PROGRAM}" --html "${page}" RESULT_VARIABLE result
  OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 0 OR NOT EXISTS "${page}")
  message(FATAL_ERROR "attn-walkthrough --html failed (${result}):\n${output}\n${errors}")
endif()

set(flags --headless --no-sandbox --disable-gpu --disable-quic --no-first-run
  --disable-background-networking --disable-component-update --disable-sync)

# run_chromium(<out-var> <url> <extra args...>): runs Chromium with a fresh profile, returns stdout.
function(run_chromium out_var url)
  string(RANDOM LENGTH 10 suffix)
  set(profile "${OUT_DIR}/chromium-profile-${suffix}")
  file(REMOVE_RECURSE "${profile}")
  execute_process(
    COMMAND "${CHROMIUM}" ${flags} "--user-data-dir=${profile}" ${ARGN} "${url}"
    RESULT_VARIABLE chromium_result OUTPUT_VARIABLE chromium_output ERROR_VARIABLE chromium_errors
    TIMEOUT 90)
  file(REMOVE_RECURSE "${profile}")
  if(NOT chromium_result EQUAL 0)
    message(FATAL_ERROR "chromium failed (${chromium_result}) on ${url}:\n${chromium_errors}")
  endif()
  set(${out_var} "${chromium_output}" PARENT_SCOPE)
endfunction()

set(failures "")
foreach(case "tired;animal" "wide;street")
  list(GET case 0 last)
  list(GET case 1 expected)
  set(url "file://${page}#word=it&last=${last}")
  run_chromium(dom "${url}" --dump-dom)
  # The sentence element: <div id="sentence" ... data-selected="it" data-last=... data-most-attended=...>
  string(REGEX MATCH "<div id=\"sentence\"[^>]*>" sentence "${dom}")
  if(NOT sentence)
    string(APPEND failures "\n  ${last}: no sentence element in the DOM (did the script run?)")
    continue()
  endif()
  foreach(attribute "data-selected=\"it\"" "data-last=\"${last}\""
                    "data-most-attended=\"${expected}\"")
    string(FIND "${sentence}" "${attribute}" position)
    if(position EQUAL -1)
      string(APPEND failures "\n  ${last}: expected ${attribute} on ${sentence}")
    endif()
  endforeach()
  # Exactly one word button is marked most-attended, and it is the expected word. (Semicolons, as
  # in style="...;", would split the CMake list of matches: replace them first.)
  string(REPLACE ";" "," dom "${dom}")
  string(REGEX MATCHALL "<button[^>]*class=\"word[^\"]*most-attended[^>]*>" marked "${dom}")
  list(LENGTH marked marked_count)
  if(NOT marked_count EQUAL 1)
    string(APPEND failures "\n  ${last}: ${marked_count} words marked most-attended, expected 1")
  else()
    string(FIND "${marked}" "data-word=\"${expected}\"" position)
    if(position EQUAL -1)
      string(APPEND failures "\n  ${last}: the most-attended button is ${marked}")
    endif()
  endif()
  # Its weight is the largest of the row: the button shows it as data-weight.
  string(REGEX MATCH "data-weight=\"([0-9.]+)\"" weight_match "${marked}")
  message(STATUS "it + ${last}: most attended '${expected}' (weight ${CMAKE_MATCH_1})")
endforeach()

# 4. The exam-trap panel of the 3-token step-through: for "#trap=<key>" the panel says which trap
#    is on, exactly that toggle is pressed, and the wrong table holds the trap's figures. The
#    figures were computed independently of attn by tests/data/check_exam_traps.py (NumPy).
set(trap_cases
  "scale|<td>0.4223</td><td>0.1554</td><td>0.4223</td>|<td>0.2119</td><td>0.2119</td><td>0.5761</td>"
  "columns|<td>0.2483</td><td>0.8471</td>|<td>0.5035</td><td>1.3057</td>"
  "order|<tr><th>token 3</th><td>0.5000</td><td>0.5000</td></tr><tr><th>token 2</th><td>0.3983</td><td>0.6017</td></tr>|<tr><th>token 1</th><td>0.6017</td><td>0.3983</td></tr>"
  "values|<td>0.8022</td><td>0.5989</td>|<td>0.7517</td><td>0.7517</td>"
  "matrices|<th>I</th><td>0.4856</td><td>0.0287</td><td>0.4856</td>|<th>love</th><td>0.0015</td><td>0.8916</td><td>0.1069</td>"
  "itself|<td>0.0000</td><td>0.3302</td><td>0.6698</td>|<td>0.3349</td><td>0.6651</td>")
foreach(case ${trap_cases})
  string(REPLACE "|" ";" fields "${case}")
  list(GET fields 0 trap)
  list(SUBLIST fields 1 -1 figures)
  run_chromium(dom "file://${page}#trap=${trap}" --dump-dom)
  string(REGEX MATCH "<div id=\"traps\"[^>]*>" panel "${dom}")
  string(FIND "${panel}" "data-trap=\"${trap}\"" position)
  if(position EQUAL -1)
    string(APPEND failures "\n  trap ${trap}: the panel is '${panel}'")
  endif()
  string(REGEX MATCHALL "<button[^>]*aria-pressed=\"true\"[^>]*>[^<]*</button>" pressed "${dom}")
  set(pressed_traps "")
  foreach(button ${pressed})
    if(button MATCHES "id=\"trap-([a-z]+)\"")
      list(APPEND pressed_traps ${CMAKE_MATCH_1})
    endif()
  endforeach()
  if(NOT pressed_traps STREQUAL trap)
    string(APPEND failures "\n  trap ${trap}: pressed trap toggles '${pressed_traps}'")
  endif()
  foreach(figure ${figures})
    string(FIND "${dom}" "${figure}" position)
    if(position EQUAL -1)
      string(APPEND failures "\n  trap ${trap}: the tables lack ${figure}")
    endif()
  endforeach()
  message(STATUS "trap ${trap}: panel on, figures present")
endforeach()

set(screenshot "${OUT_DIR}/it_tired.png")
file(REMOVE "${screenshot}")
run_chromium(ignored "file://${page}#word=it&last=tired" "--screenshot=${screenshot}"
  --window-size=1200,900)
if(NOT EXISTS "${screenshot}")
  string(APPEND failures "\n  no screenshot at ${screenshot}")
else()
  file(SIZE "${screenshot}" screenshot_size)
  if(screenshot_size LESS 10000)
    string(APPEND failures "\n  the screenshot ${screenshot} is only ${screenshot_size} bytes")
  endif()
  message(STATUS "screenshot: ${screenshot} (${screenshot_size} bytes)")
endif()

set(trap_screenshot "${OUT_DIR}/it_trap_columns.png")
file(REMOVE "${trap_screenshot}")
run_chromium(ignored "file://${page}#trap=columns&step=4" "--screenshot=${trap_screenshot}"
  --window-size=1200,1900)
if(NOT EXISTS "${trap_screenshot}")
  string(APPEND failures "\n  no screenshot at ${trap_screenshot}")
endif()

if(failures)
  message(FATAL_ERROR "browser check failed:${failures}")
endif()
message(STATUS "browser check: the page highlights animal (tired) and street (wide); the six trap toggles show their figures")

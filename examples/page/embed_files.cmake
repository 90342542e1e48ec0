# Writes a C++17 header that holds files as string constants, byte for byte.
# Usage (script mode, run by examples/page/CMakeLists.txt at build time):
#   cmake -DOUTPUT=<header> -DINPUT_DIR=<folder> -DNAMES=<a.html,b.css,...> -DNAMESPACE=<ns>
#         -P embed_files.cmake
#
# Each file <name> becomes `inline constexpr std::string_view <name with '.' and '-' as '_'>` in
# namespace <ns>. The bytes are written as \xHH escapes, 32 to a string literal, so that no byte
# of a file (a quote, a backslash, `)"`, a non-ASCII character) can end or change a literal, and
# no literal grows past the length some compilers allow (MSVC: 16 KiB); the length is given
# explicitly, so a NUL byte would be kept too.

foreach(variable OUTPUT INPUT_DIR NAMES NAMESPACE)
  if(NOT DEFINED ${variable} OR "${${variable}}" STREQUAL "")
    message(FATAL_ERROR "embed_files.cmake: pass -D${variable}=...")
  endif()
endforeach()

string(REPLACE "," ";" names "${NAMES}")
string(REPEAT "[0-9a-f][0-9a-f]" 32 line_of_bytes)

string(REPLACE "," ", " listed "${NAMES}")
set(header "// Generated at build time by examples/page/embed_files.cmake from ${INPUT_DIR}:\n")
string(APPEND header "// ${listed}. Do not edit: edit those files.\n")
string(APPEND header "#pragma once\n\n#include <string_view>\n\nnamespace ${NAMESPACE} {\n")
foreach(name IN LISTS names)
  set(file "${INPUT_DIR}/${name}")
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "embed_files.cmake: no file ${file}")
  endif()
  file(READ "${file}" hex HEX)
  string(LENGTH "${hex}" hex_length)
  math(EXPR size "${hex_length} / 2")
  string(MAKE_C_IDENTIFIER "${name}" identifier)
  # 32 bytes a line, each byte as \xHH, each line one literal.
  string(REGEX REPLACE "(${line_of_bytes})" "\\1\n" hex "${hex}")
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "\\\\x\\1" escaped "${hex}")
  string(REGEX REPLACE "([^\n]+)" "    \"\\1\"" literals "${escaped}")
  string(REGEX REPLACE "\n$" "" literals "${literals}")
  if(size EQUAL 0)
    set(literals "    \"\"")
  endif()
  string(APPEND header "\n/// ${name}, ${size} bytes.\n"
                       "inline constexpr std::string_view ${identifier}{\n${literals},\n    ${size}};\n")
endforeach()
string(APPEND header "\n}  // namespace ${NAMESPACE}\n")

file(WRITE "${OUTPUT}.tmp" "${header}")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")

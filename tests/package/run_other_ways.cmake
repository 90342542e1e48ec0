# The other ways a program finds attn, each with the plain consumer (tests/package/main.cpp, the
# first document's row 1): the build tree as a package (attn_DIR = attn's build folder, no
# install), pkg-config on an installed tree (`pkg-config --cflags attn`), examples/install (the
# README's install and CMAKE_PREFIX_PATH), and FetchContent with the
# README's own snippet (extracted from README.md; the download is replaced by the source tree
# through FETCHCONTENT_SOURCE_DIR_ATTN, the mechanism FetchContent gives for exactly that). The
# last line, "other ways in passed", is what ctest looks for.
cmake_minimum_required(VERSION 3.21)

include("${CMAKE_CURRENT_LIST_DIR}/run.cmake")

function(expect_row program)
  run("${program}")
  if(NOT run_output MATCHES "consumer ok \\(one thread\\): 0\\.6017 0\\.3983")
    message(FATAL_ERROR "${program} did not print the document's row 1:\n${run_output}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(common -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release)

# 1. The build tree: find_package(attn CONFIG REQUIRED) with attn_DIR set to attn's build folder.
run("${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/package/consumer" -B "${WORK_DIR}/build-tree"
    ${common} "-Dattn_DIR=${ATTN_BINARY_DIR}")
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/build-tree" --target consumer)
expect_row("${WORK_DIR}/build-tree/consumer")
message("build tree: find_package(attn) with attn_DIR=${ATTN_BINARY_DIR} builds and runs")

# 2. pkg-config, on a staged install (skipped, and said so, where pkg-config is not installed;
#    CI installs it).
find_program(pkg_config NAMES pkg-config pkgconf)
if(NOT pkg_config)
  message("pkg-config: not installed here (apt-get install pkg-config), this part skipped")
else()
  run("${CMAKE_COMMAND}" --install "${ATTN_BINARY_DIR}" --prefix "${WORK_DIR}/prefix")
  set(ENV{PKG_CONFIG_PATH} "${WORK_DIR}/prefix/share/pkgconfig")
  run("${pkg_config}" --cflags attn)
  string(STRIP "${run_output}" cflags)
  if(NOT cflags MATCHES "-I[^ ]*/prefix/share/pkgconfig/\\.\\./\\.\\./include" AND
     NOT cflags MATCHES "-I${WORK_DIR}/prefix/include")
    message(FATAL_ERROR "pkg-config --cflags attn gave '${cflags}': no -I to the installed headers")
  endif()
  if(NOT cflags MATCHES "eigen3")
    message(FATAL_ERROR "pkg-config --cflags attn gave '${cflags}': no Eigen folder")
  endif()
  run("${pkg_config}" --modversion attn)
  string(STRIP "${run_output}" pc_version)
  if(NOT pc_version STREQUAL PROJECT_VERSION)
    message(FATAL_ERROR "pkg-config --modversion attn gave ${pc_version}, the project is ${PROJECT_VERSION}")
  endif()
  separate_arguments(cflag_list UNIX_COMMAND "${cflags}")
  run("${CXX_COMPILER}" -std=c++17 -O1 ${cflag_list} "${SOURCE_DIR}/tests/package/main.cpp"
      -o "${WORK_DIR}/consumer_pkg_config")
  expect_row("${WORK_DIR}/consumer_pkg_config")
  message("pkg-config: `pkg-config --cflags attn` = ${cflags}; the consumer builds and runs")
endif()

# 3. examples/install, as its CMakeLists.txt says: the documented install, then the project found
#    through CMAKE_PREFIX_PATH.
run("${CMAKE_COMMAND}" --install "${ATTN_BINARY_DIR}" --prefix "${WORK_DIR}/example-prefix")
run("${CMAKE_COMMAND}" -S "${SOURCE_DIR}/examples/install" -B "${WORK_DIR}/example-user" ${common}
    "-DCMAKE_PREFIX_PATH=${WORK_DIR}/example-prefix")
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/example-user")
run("${WORK_DIR}/example-user/attn-user")
if(NOT run_output MATCHES "token 1 -> \\[0\\.6017, 0\\.3983\\]")
  message(FATAL_ERROR "examples/install's program did not print the document's row 1:\n${run_output}")
endif()
message("examples/install: built against the install and run")

# 4. FetchContent, with the README's snippet as written.
file(READ "${SOURCE_DIR}/README.md" readme)
if(NOT readme MATCHES "<!-- fetchcontent -->[^`]*```cmake\n([^`]*)```")
  message(FATAL_ERROR "README.md has no ```cmake block after <!-- fetchcontent -->")
endif()
set(snippet "${CMAKE_MATCH_1}")
file(WRITE "${WORK_DIR}/fetch/CMakeLists.txt"
  "cmake_minimum_required(VERSION 3.21)\nproject(fetch_consumer LANGUAGES CXX)\n"
  "add_executable(my_app \"${SOURCE_DIR}/tests/package/main.cpp\")\n"
  "# The README's snippet:\n${snippet}")
run("${CMAKE_COMMAND}" -S "${WORK_DIR}/fetch" -B "${WORK_DIR}/fetch/build" ${common}
    "-DFETCHCONTENT_SOURCE_DIR_ATTN=${SOURCE_DIR}" -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
if(EXISTS "${WORK_DIR}/fetch/build/_deps/attn-build/tests")
  message(FATAL_ERROR "attn built its own tests when fetched: ATTN_BUILD_TESTS must default OFF")
endif()
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/fetch/build" --target my_app)
expect_row("${WORK_DIR}/fetch/build/my_app")
message("FetchContent: the README's snippet builds and runs")

message("other ways in passed")

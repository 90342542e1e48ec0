# Builds and runs a tiny consumer project against attn, either installed into a staging prefix
# (MODE=install: find_package(attn CONFIG REQUIRED [COMPONENTS openmp])) or taken as a subdirectory
# (MODE=subdirectory). The consumer is built twice from one main.cpp: `consumer` with attn::attn,
# whose compile command must hold no OpenMP flag, and `consumer_openmp` with attn::openmp. Finally
# the consumer is configured as if OpenMP were missing: asking for attn::openmp must then fail,
# with a message that names OpenMP. The last line, "package test passed", is what ctest looks for.
cmake_minimum_required(VERSION 3.21)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "command failed (${result}): ${ARGN}\n${out}\n${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(configure_args -S "${CONSUMER_DIR}" -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
    -DCMAKE_BUILD_TYPE=Release)

if(MODE STREQUAL "install")
  run("${CMAKE_COMMAND}" --install "${ATTN_BINARY_DIR}" --prefix "${WORK_DIR}/prefix")
  foreach(installed include/attn/attn.hpp share/cmake/attn/attnConfig.cmake
                    share/cmake/attn/attnConfigVersion.cmake share/cmake/attn/attnTargets.cmake
                    share/cmake/attn/attnOpenMPTargets.cmake)
    if(NOT EXISTS "${WORK_DIR}/prefix/${installed}")
      message(FATAL_ERROR "the install did not produce ${installed}")
    endif()
  endforeach()
  list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
else()
  list(APPEND configure_args "-DATTN_SOURCE_DIR=${ATTN_SOURCE_DIR}")
endif()

set(build "${WORK_DIR}/build")
run("${CMAKE_COMMAND}" ${configure_args} -B "${build}" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
run("${CMAKE_COMMAND}" --build "${build}")
if(MODE STREQUAL "subdirectory" AND EXISTS "${build}/attn/tests")
  message(FATAL_ERROR "attn built its own tests as a subproject: ATTN_BUILD_TESTS must default OFF")
endif()

# The compile commands (Ninja and Makefile generators write them): OpenMP only where asked for.
if(EXISTS "${build}/compile_commands.json")
  file(READ "${build}/compile_commands.json" commands)
  string(JSON count LENGTH "${commands}")
  math(EXPR last "${count} - 1")
  set(checked "")
  foreach(i RANGE ${last})
    string(JSON command GET "${commands}" ${i} command)
    string(TOLOWER "${command}" command_lower)
    string(FIND "${command_lower}" "openmp" openmp_flag)
    if(command MATCHES "CMakeFiles/consumer\\.dir/")
      if(NOT openmp_flag EQUAL -1)
        message(FATAL_ERROR "attn::attn gave the consumer an OpenMP flag it did not ask for:\n"
                            "${command}")
      endif()
      list(APPEND checked consumer)
    elseif(command MATCHES "CMakeFiles/consumer_openmp\\.dir/")
      if(openmp_flag EQUAL -1)
        message(FATAL_ERROR "attn::openmp gave the consumer no OpenMP flag:\n${command}")
      endif()
      list(APPEND checked consumer_openmp)
    endif()
  endforeach()
  if(NOT checked MATCHES "consumer;consumer_openmp|consumer_openmp;consumer")
    message(FATAL_ERROR "compile_commands.json lacks a consumer's command: ${commands}")
  endif()
  message("compile commands: -fopenmp in consumer_openmp only")
endif()

run("${build}/consumer")
message("${run_output}")
run("${build}/consumer_openmp")
message("${run_output}")

# OpenMP missing: asking for attn::openmp is then a clear error, not a silently serial build.
execute_process(
  COMMAND "${CMAKE_COMMAND}" ${configure_args} -B "${WORK_DIR}/build-without-openmp"
          -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(MODE STREQUAL "install")
  set(expected "needs OpenMP for C\\+\\+")  # attnConfig.cmake's message for the openmp component
else()
  set(expected "OpenMP::OpenMP_CXX")  # CMake's message for the missing target attn::openmp links
endif()
string(REGEX REPLACE "[ \n]+" " " err_one_line "${err}")  # CMake wraps its messages
if(result EQUAL 0 OR NOT err_one_line MATCHES "${expected}")
  message(FATAL_ERROR "without OpenMP, asking for attn::openmp must fail with a message matching "
                      "'${expected}'; the configure returned ${result}:\n${out}\n${err}")
endif()
message("without OpenMP: asking for attn::openmp fails, naming OpenMP")
message("package test passed")

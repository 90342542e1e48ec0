# Builds and runs a tiny consumer project against attn, either installed into a staging prefix
# (MODE=install: find_package(attn CONFIG REQUIRED)) or taken as a subdirectory (MODE=subdirectory).
cmake_minimum_required(VERSION 3.21)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "command failed (${result}): ${ARGN}\n${out}\n${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(configure_args -S "${CONSUMER_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release)

if(MODE STREQUAL "install")
  run("${CMAKE_COMMAND}" --install "${ATTN_BINARY_DIR}" --prefix "${WORK_DIR}/prefix")
  foreach(installed include/attn/attn.hpp share/cmake/attn/attnConfig.cmake
                    share/cmake/attn/attnConfigVersion.cmake share/cmake/attn/attnTargets.cmake)
    if(NOT EXISTS "${WORK_DIR}/prefix/${installed}")
      message(FATAL_ERROR "the install did not produce ${installed}")
    endif()
  endforeach()
  list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
else()
  list(APPEND configure_args "-DATTN_SOURCE_DIR=${ATTN_SOURCE_DIR}")
endif()

run("${CMAKE_COMMAND}" ${configure_args})
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
if(MODE STREQUAL "subdirectory" AND EXISTS "${WORK_DIR}/build/attn/tests")
  message(FATAL_ERROR "attn built its own tests as a subproject: ATTN_BUILD_TESTS must default OFF")
endif()
run("${WORK_DIR}/build/consumer")
message("${run_output}")

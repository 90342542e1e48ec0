# Builds and runs a tiny consumer project against attn, either installed into a staging prefix
# (MODE=install: find_package(attn CONFIG REQUIRED [COMPONENTS openmp])) or taken as a subdirectory
# (MODE=subdirectory). The consumer is built three times from one main.cpp: `consumer` with
# attn::attn, whose compile command must hold no OpenMP flag and no -march flag, `consumer_native`
# with attn::native (-march=native), and `consumer_openmp` with attn::openmp. Each prints the SIMD
# set it was compiled for (attn::simd_compiled), the CPU's (attn::simd_available) and the advice:
# `consumer` must report SSE2 on x86-64 and, on a CPU with more, advice naming attn::native;
# `consumer_native` must report the CPU's set (read here from /proc/cpuinfo where there is one),
# and no advice. Finally the consumer is configured as if OpenMP were missing: asking for
# attn::openmp must then fail, with a message that names OpenMP. The last line, "package test
# passed", is what ctest looks for.
cmake_minimum_required(VERSION 3.21)

include("${CMAKE_CURRENT_LIST_DIR}/run.cmake")

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

# The compile commands (Ninja and Makefile generators write them): OpenMP and -march only where
# asked for.
if(EXISTS "${build}/compile_commands.json")
  file(READ "${build}/compile_commands.json" commands)
  string(JSON count LENGTH "${commands}")
  math(EXPR last "${count} - 1")
  set(checked "")
  foreach(i RANGE ${last})
    string(JSON command GET "${commands}" ${i} command)
    string(TOLOWER "${command}" command_lower)
    string(FIND "${command_lower}" "openmp" openmp_flag)
    string(FIND "${command_lower}" "-march=" march_flag)
    string(FIND "${command_lower}" "-march=native" native_flag)
    if(command MATCHES "CMakeFiles/consumer\\.dir/")
      if(NOT openmp_flag EQUAL -1)
        message(FATAL_ERROR "attn::attn gave the consumer an OpenMP flag it did not ask for:\n"
                            "${command}")
      endif()
      if(NOT march_flag EQUAL -1)
        message(FATAL_ERROR "attn::attn gave the consumer a -march flag it did not ask for:\n"
                            "${command}")
      endif()
      list(APPEND checked consumer)
    elseif(command MATCHES "CMakeFiles/consumer_openmp\\.dir/")
      if(openmp_flag EQUAL -1)
        message(FATAL_ERROR "attn::openmp gave the consumer no OpenMP flag:\n${command}")
      endif()
      if(NOT march_flag EQUAL -1)
        message(FATAL_ERROR "attn::openmp gave the consumer a -march flag:\n${command}")
      endif()
      list(APPEND checked consumer_openmp)
    elseif(command MATCHES "CMakeFiles/consumer_native\\.dir/")
      if(native_flag EQUAL -1 OR NOT openmp_flag EQUAL -1)
        message(FATAL_ERROR "attn::native must give the consumer -march=native and no OpenMP "
                            "flag:\n${command}")
      endif()
      list(APPEND checked consumer_native)
    endif()
  endforeach()
  list(SORT checked)
  if(NOT checked STREQUAL "consumer;consumer_native;consumer_openmp")
    message(FATAL_ERROR "compile_commands.json lacks a consumer's command: ${commands}")
  endif()
  message("compile commands: -fopenmp in consumer_openmp only, -march=native in consumer_native "
          "only")
endif()

# The SIMD set of this machine, independently of attn: the flags of /proc/cpuinfo (Linux), in the
# names of attn::simd_name. Empty where there is no such file or the CPU is not x86.
cmake_host_system_information(RESULT processor QUERY OS_PLATFORM)
set(x86_64 OFF)
if(processor MATCHES "^(x86_64|AMD64|amd64)$")
  set(x86_64 ON)
endif()
set(cpu_simd "")
if(x86_64 AND EXISTS /proc/cpuinfo)
  file(STRINGS /proc/cpuinfo cpu_flags REGEX "^flags[ \t]*:" LIMIT_COUNT 1)
  string(APPEND cpu_flags " ")
  set(fma "")
  if(cpu_flags MATCHES " fma ")
    set(fma "+FMA")
  endif()
  if(cpu_flags MATCHES " avx512f ")
    set(cpu_simd "AVX-512")  # which always has FMA
  elseif(cpu_flags MATCHES " avx2 ")
    set(cpu_simd "AVX2${fma}")
  elseif(cpu_flags MATCHES " avx ")
    set(cpu_simd "AVX${fma}")
  else()
    set(cpu_simd "SSE2${fma}")
  endif()
endif()

# simd_check(<program> <expected compiled set or empty> <advice wanted: ON/OFF>): runs a consumer
# and checks the line "simd: compiled X, available Y" and the line "advice: ...".
function(simd_check program expected_compiled advice_wanted)
  run("${build}/${program}")
  message("${run_output}")
  if(NOT run_output MATCHES "simd: compiled ([^,\n]+), available ([^\n]+)\nadvice: ([^\n]*)")
    message(FATAL_ERROR "${program} printed no 'simd: ... advice: ...' lines:\n${run_output}")
  endif()
  set(compiled "${CMAKE_MATCH_1}")
  set(available "${CMAKE_MATCH_2}")
  set(advice "${CMAKE_MATCH_3}")
  if(cpu_simd AND NOT available STREQUAL cpu_simd)
    message(FATAL_ERROR "${program}: attn::simd_available() says ${available}, /proc/cpuinfo "
                        "says ${cpu_simd}")
  endif()
  if(expected_compiled AND NOT compiled STREQUAL expected_compiled)
    message(FATAL_ERROR "${program} was compiled for ${compiled}, expected ${expected_compiled}")
  endif()
  if(advice_wanted)
    set(wanted "attn: compiled for ${compiled} but this CPU has ${available}: link attn::native")
    string(FIND "${advice}" "${wanted}" position)
    if(NOT position EQUAL 0)
      message(FATAL_ERROR "${program}: expected advice starting '${wanted}', got '${advice}'")
    endif()
  elseif(NOT advice STREQUAL "(none)")
    message(FATAL_ERROR "${program}: expected no advice, got '${advice}'")
  endif()
endfunction()

# attn::attn: SSE2 on x86-64, and advice when the CPU has more.
if(x86_64)
  set(advice_wanted OFF)
  if(cpu_simd AND NOT cpu_simd MATCHES "^SSE2")
    set(advice_wanted ON)
  endif()
  simd_check(consumer "SSE2" ${advice_wanted})
else()
  run("${build}/consumer")
  message("${run_output}")
endif()
# attn::native: what the CPU has (the available set, checked against /proc/cpuinfo), no advice.
if(x86_64 AND cpu_simd)
  simd_check(consumer_native "${cpu_simd}" OFF)
else()
  simd_check(consumer_native "" OFF)
endif()
message("simd: attn::attn compiled for SSE2 with advice where the CPU has more, attn::native for "
        "the CPU's own set without advice")
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
# attn::distributed, built where MPI was found: 2 ranks (oversubscribed on a smaller machine;
# Open MPI's settings for running as root, as CI does) print the 3 tokens' outputs, token 1 on
# rank 0 and tokens 2 and 3 on rank 1, the first document's [0.6017, 0.3983] ... [0.5000, 0.5000].
if(EXISTS "${build}/consumer_distributed")
  find_program(mpiexec NAMES mpiexec mpirun REQUIRED)
  set(ENV{OMPI_MCA_rmaps_base_oversubscribe} 1)
  set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
  set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
  set(ENV{OMP_NUM_THREADS} 1)
  run("${mpiexec}" -n 2 "${build}/consumer_distributed")
  foreach(line "rank 0: token 1 -> [0.6017, 0.3983]" "rank 1: token 2 -> [0.3983, 0.6017]"
               "rank 1: token 3 -> [0.5000, 0.5000]")
    string(FIND "${run_output}" "${line}" position)
    if(position EQUAL -1)
      message(FATAL_ERROR "consumer_distributed did not print '${line}':\n${run_output}")
    endif()
  endforeach()
  message("attn::distributed: ring_attention on 2 ranks printed the document's outputs")
endif()

message("package test passed")

# The libFuzzer targets and their CTest runs (label `fuzz`, 30 seconds each, run side by side):
# attention_fuzz, the differential test of the attention core (tests/fuzz/attention_fuzz.cpp), and
# onnx_fuzz, the ONNX adapter on hostile shapes and attributes (tests/fuzz/onnx_fuzz.cpp). Clang
# only: libFuzzer ships with it (Debian: libclang-rt-14-dev).
#   CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_FUZZ=ON
#   cmake --build build-fuzz --target attention_fuzz onnx_fuzz && ctest --test-dir build-fuzz -L fuzz
option(ATTN_BUILD_FUZZ "Build the libFuzzer target attention_fuzz (Clang only)" OFF)
if(NOT ATTN_BUILD_FUZZ)
  return()
endif()
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  message(WARNING "attn: ATTN_BUILD_FUZZ needs Clang (libFuzzer); ${CMAKE_CXX_COMPILER_ID} "
                  "found, so the fuzz targets are not built")
  return()
endif()

set(attn_fuzz_flags -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
                    -fno-omit-frame-pointer)
add_executable(attention_fuzz fuzz/attention_fuzz.cpp)
target_include_directories(attention_fuzz PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/support")
target_link_libraries(attention_fuzz PRIVATE attn::attn)
# -g1: line tables (the sanitizers' reports keep file and line) at a fraction of -g's compile time.
target_compile_options(attention_fuzz PRIVATE ${attn_fuzz_flags} -g1)
target_link_options(attention_fuzz PRIVATE ${attn_fuzz_flags})
attn_own_program(attention_fuzz)

# New inputs go to a corpus in the build folder; tests/fuzz/corpus holds the few committed seeds.
# A failing input is written to fuzz-artifacts/ and printed with its case and a C++ reproducer.
set(attn_fuzz_work "${CMAKE_CURRENT_BINARY_DIR}/fuzz-corpus")
set(attn_fuzz_artifacts "${CMAKE_CURRENT_BINARY_DIR}/fuzz-artifacts")
file(MAKE_DIRECTORY "${attn_fuzz_work}" "${attn_fuzz_artifacts}")
add_test(NAME attention_fuzz
  COMMAND attention_fuzz -max_total_time=30 -max_len=1024 -timeout=60 -rss_limit_mb=2048
    -print_final_stats=1 -artifact_prefix=${attn_fuzz_artifacts}/
    "${attn_fuzz_work}" "${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus")
set_tests_properties(attention_fuzz PROPERTIES LABELS fuzz TIMEOUT 180
  ENVIRONMENT "OMP_NUM_THREADS=2;UBSAN_OPTIONS=print_stacktrace=1;ASAN_OPTIONS=detect_leaks=1")

# The ONNX adapter's target: no committed corpus (its inputs are cheap to find from nothing).
set(attn_onnx_fuzz_work "${CMAKE_CURRENT_BINARY_DIR}/onnx-fuzz-corpus")
file(MAKE_DIRECTORY "${attn_onnx_fuzz_work}")
add_executable(onnx_fuzz fuzz/onnx_fuzz.cpp)
target_link_libraries(onnx_fuzz PRIVATE attn::attn)
target_compile_options(onnx_fuzz PRIVATE ${attn_fuzz_flags} -g1)
target_link_options(onnx_fuzz PRIVATE ${attn_fuzz_flags})
attn_own_program(onnx_fuzz)
# allocator_may_return_null: a shape the adapter accepts but the machine cannot hold must come
# back as an exception (which the target reports), not as the sanitizer's own abort.
add_test(NAME onnx_fuzz
  COMMAND onnx_fuzz -max_total_time=30 -max_len=512 -timeout=30 -rss_limit_mb=2048
    -print_final_stats=1 -artifact_prefix=${attn_fuzz_artifacts}/onnx- "${attn_onnx_fuzz_work}")
set_tests_properties(onnx_fuzz PROPERTIES LABELS fuzz TIMEOUT 180
  ENVIRONMENT "OMP_NUM_THREADS=1;UBSAN_OPTIONS=print_stacktrace=1;ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1")

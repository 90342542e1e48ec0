# Strict warnings for attn's own tests, benchmarks, examples and header checks (never on attn::attn).
function(attn_strict_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion -Wdouble-promotion
      -Wold-style-cast -Wnon-virtual-dtor -Woverloaded-virtual -Wnull-dereference
      -Wcast-align -Wformat=2 -Wimplicit-fallthrough)
    if(ATTN_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
    # GCC 12.1 and 12.2 report a false 'is used uninitialized' / 'may be used uninitialized'
    # inside their own AVX-512 intrinsics headers (avx512fintrin.h: the deliberate `__m512 __Y =
    # __Y;` of _mm512_undefined_ps, inlined from Eigen's GEMM, predux_max, ...; GCC bug 105593,
    # fixed in 12.3) when the code is compiled with -march=native on an AVX-512 machine. Both are
    # off for attn's own programs built with attn::native (ATTN_NATIVE) by those compilers (and
    # older ones); the plain build (CI's sanitizer build) keeps -Wuninitialized.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND ATTN_WITH_NATIVE
       AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 12.3)
      target_compile_options(${target} PRIVATE -Wno-uninitialized -Wno-maybe-uninitialized)
    endif()
    # Clang's -Wpedantic flags GoogleTest's TYPED_TEST_SUITE(Name, Types) (its variadic macro
    # called without the optional name generator): GoogleTest's documented use, not our code.
    if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      target_compile_options(${target} PRIVATE -Wno-gnu-zero-variadic-macro-arguments)
    endif()
  elseif(MSVC)
    target_compile_options(${target} PRIVATE /W4 /permissive- $<$<BOOL:${ATTN_WERROR}>:/WX>)
  endif()
endfunction()

# One of attn's own programs (a test, benchmark or example): strict warnings, and attn::openmp and
# attn::native as the top-level options chose (ATTN_WITH_OPENMP, ATTN_WITH_NATIVE), on this target
# only. The header checks (tests/headers.cmake) are not programs: they see plain attn::attn.
function(attn_own_program target)
  attn_strict_warnings(${target})
  if(ATTN_WITH_OPENMP)
    target_link_libraries(${target} PRIVATE attn::openmp)
  endif()
  if(ATTN_WITH_NATIVE)
    target_link_libraries(${target} PRIVATE attn::native)
  endif()
endfunction()

# Strict warnings for attn's own tests, benchmarks and examples (never on the attn::attn target).
function(attn_strict_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion -Wdouble-promotion
      -Wold-style-cast -Wnon-virtual-dtor -Woverloaded-virtual -Wnull-dereference
      -Wcast-align -Wformat=2 -Wimplicit-fallthrough)
    if(ATTN_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  elseif(MSVC)
    target_compile_options(${target} PRIVATE /W4 /permissive- $<$<BOOL:${ATTN_WERROR}>:/WX>)
  endif()
endfunction()

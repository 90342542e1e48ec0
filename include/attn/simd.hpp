#pragma once
/// \file simd.hpp
/// Which SIMD instructions `attn`'s kernels were compiled for, which this CPU has, and one line of
/// advice when they differ.
///
/// Eigen picks its packet types (SSE2, AVX, AVX2, AVX-512, NEON) at compile time from the
/// compiler's target macros (`__AVX2__`, ...), and so do attn's own kernels. A consumer that links
/// `attn::attn` and passes no `-march` flag gets SSE2 on x86-64 whatever the CPU. The fix is a
/// compile flag, not a run-time switch: link the CMake target `attn::native` (`-march=native`) in
/// every translation unit of the program that includes attn. Dispatching at run time is not
/// possible in a header-only library: compiling the same inline Eigen and attn functions for two
/// instruction sets in one program breaks the one-definition rule (the linker keeps one copy of
/// each), so each set would need its own build of the kernels in its own namespace, which Eigen
/// does not support.
///
/// Two exceptions are dispatched at run time: bfloat16 arithmetic and integer arithmetic over int8
/// keys and values (`AttentionOptions::stored_arithmetic`), whose kernels are written in intrinsics
/// only, with their instruction sets named in target attributes, so that every
/// translation unit compiles the same code whatever its flags.
///
/// `simd_compiled`, `simd_available` and `simd_advice()` have internal linkage (`static`): each
/// translation unit gets its own copy, which reports the flags that unit was compiled with. As
/// inline functions they would be merged by the linker into one copy, the very problem above.

#include <Eigen/Core>
#include <atomic>
#include <string>

// Where functions can name their own instruction sets (`__attribute__((target(...)))`): the
// run-time dispatched kernels are compiled there only.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_X86_TARGETS 1
#include <immintrin.h>
#endif

// Around the run-time dispatched kernels: GCC 12.1 and 12.2 warn, falsely, inside their own
// AVX-512 intrinsics (the deliberately undefined register of _mm512_undefined_ps; GCC bug 105593),
// which is not for attn's code to answer.
#if defined(__GNUC__) && !defined(__clang__)
#define ATTN_INTRINSICS_BEGIN                                                                \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define ATTN_INTRINSICS_END _Pragma("GCC diagnostic pop")
#else
#define ATTN_INTRINSICS_BEGIN
#define ATTN_INTRINSICS_END
#endif

namespace attn {

/// A SIMD instruction set as Eigen uses it. The x86 sets are ordered: each includes the ones
/// before it.
enum class Simd { None, SSE2, AVX, AVX2, AVX512, NEON };

/// An instruction set and whether fused multiply-add is used (or available) with it.
struct SimdSet {
  /// The instruction set.
  Simd isa = Simd::None;
  /// Whether fused multiply-add is used (or available) with it.
  bool fma = false;
};

/// Whether two sets are the same instruction set with the same FMA.
/// \param a  one set
/// \param b  the other
/// \returns `a.isa == b.isa && a.fma == b.fma`
constexpr bool operator==(SimdSet a, SimdSet b) { return a.isa == b.isa && a.fma == b.fma; }
/// Whether two sets differ in their instruction set or in FMA.
/// \param a  one set
/// \param b  the other
/// \returns `!(a == b)`
constexpr bool operator!=(SimdSet a, SimdSet b) { return !(a == b); }

/// The name of an instruction set, as the benchmarks and `simd_advice` print it.
/// \param set  the instruction set and its FMA
/// \returns the set's name: "none", "SSE2", "AVX", "AVX+FMA", "AVX2", "AVX2+FMA", "AVX-512" (which
/// always has FMA: Eigen requires it and every AVX-512 CPU has it), "NEON" or "NEON+FMA".
inline std::string simd_name(SimdSet set) {
  std::string name;
  switch (set.isa) {
    case Simd::None:
      return "none";
    case Simd::SSE2:
      name = "SSE2";
      break;
    case Simd::AVX:
      name = "AVX";
      break;
    case Simd::AVX2:
      name = "AVX2";
      break;
    case Simd::AVX512:
      return "AVX-512";
    case Simd::NEON:
      name = "NEON";
      break;
  }
  return set.fma ? name + "+FMA" : name;
}

/// The advice for a program whose kernels were compiled for `compiled` and runs on a CPU that has
/// `available` (a pure function; `simd_advice()` passes this translation unit's pair).
/// \param compiled   the set the kernels were compiled for (`simd_compiled()`)
/// \param available  the set the CPU has (`simd_available()`)
/// \returns an empty string when the two are equal; when the CPU has more, one sentence naming
///   both sets and `attn::native`, e.g. "attn: compiled for SSE2 but this CPU has AVX-512: link
///   attn::native (CMake) or compile with -march=native for the faster kernels"; when it has
///   less (a program built with `-march=native` elsewhere), one sentence saying that the program
///   may stop on an illegal instruction.
inline std::string simd_advice(SimdSet compiled, SimdSet available) {
  if (compiled == available) return "";
  const std::string sets = "attn: compiled for " + simd_name(compiled) + " but this CPU has ";
  const bool cpu_has_more =
      compiled.isa != available.isa ? compiled.isa < available.isa : available.fma;
  if (cpu_has_more) {
    return sets + simd_name(available) +
           ": link attn::native (CMake) or compile with -march=native for the faster kernels";
  }
  return sets + "only " + simd_name(available) +
         ": the program may stop on an illegal instruction; build it on this machine, or "
         "without -march=native";
}

/// The instruction set this translation unit's kernels use: Eigen's choice, read from its macros
/// (`EIGEN_VECTORIZE_AVX512`, `_AVX2`, `_AVX`, `_SSE2`, `_NEON`, and `EIGEN_VECTORIZE_FMA`; on NEON,
/// FMA is `__ARM_FEATURE_FMA`). `Simd::None` when Eigen does not vectorise
/// (`EIGEN_DONT_VECTORIZE`, or no SIMD flag on a 32-bit target).
/// \returns the set and whether FMA is used with it
static constexpr SimdSet simd_compiled() {
  SimdSet set;
#if defined(EIGEN_VECTORIZE_AVX512)
  set.isa = Simd::AVX512;
#elif defined(EIGEN_VECTORIZE_AVX2)
  set.isa = Simd::AVX2;
#elif defined(EIGEN_VECTORIZE_AVX)
  set.isa = Simd::AVX;
#elif defined(EIGEN_VECTORIZE_SSE2)
  set.isa = Simd::SSE2;
#elif defined(EIGEN_VECTORIZE_NEON)
  set.isa = Simd::NEON;
#endif
#if defined(EIGEN_VECTORIZE_FMA) || (defined(EIGEN_VECTORIZE_NEON) && defined(__ARM_FEATURE_FMA))
  set.fma = true;
#endif
  return set;
}

/// The best instruction set this CPU (and its operating system) offers, in the terms of
/// `simd_compiled`: on x86 with GCC or Clang, from `__builtin_cpu_supports` ("avx512f", "avx2",
/// "avx", "sse2", "fma"). Elsewhere (other CPUs, other compilers) attn does not look and returns
/// `simd_compiled()`, so that `simd_advice()` is empty there.
/// \returns the set and whether the CPU has FMA
/// \note Cheap (the compiler's runtime reads CPUID once); safe before `main`.
static inline SimdSet simd_available() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();  // needed only before main (constructors); harmless after
  SimdSet set;
  if (__builtin_cpu_supports("avx512f")) {
    set.isa = Simd::AVX512;
  } else if (__builtin_cpu_supports("avx2")) {
    set.isa = Simd::AVX2;
  } else if (__builtin_cpu_supports("avx")) {
    set.isa = Simd::AVX;
  } else if (__builtin_cpu_supports("sse2")) {
    set.isa = Simd::SSE2;
  }
  set.fma = set.isa != Simd::None && __builtin_cpu_supports("fma") != 0;
  return set;
#else
  return simd_compiled();
#endif
}

/// `simd_advice(simd_compiled(), simd_available())`: empty when this translation unit was
/// compiled for the best set this CPU has (and wherever `simd_available` does not look), else one
/// sentence such as "attn: compiled for SSE2 but this CPU has AVX-512: link attn::native (CMake) or
/// compile with -march=native for the faster kernels". A program may print it at start.
/// \returns the advice, or an empty string
static inline std::string simd_advice() { return simd_advice(simd_compiled(), simd_available()); }

/// Whether this CPU runs AVX512_BF16's `vdpbf16ps` (on x86 with GCC or Clang, from
/// `__builtin_cpu_supports`; false elsewhere). Asked once. Where it does, a call with
/// `StoredArithmetic::Reduced` over float queries and bfloat16 keys computes:
/// - a decoding step over keys kept in `KVStorage::BFloat16` (4 query heads per key/value head,
///   d_k a multiple of 32): its scores with `vdpbf16ps`, on the scaled queries rounded to bfloat16;
/// - the tiled kernel (`flash_attention` and `attention_heads` with `Eigen::bfloat16` K and V, a
///   `KVStorage::BFloat16` cache's several queries), in translation units compiled for AVX-512
///   (`attn::native` on such a CPU): its score tiles with `vdpbf16ps` on the queries rounded to
///   bfloat16 and, when d_v is a multiple of 16, its value tiles on the probabilities rounded to
///   bfloat16 (the softmax's sums stay in float).
/// The results carry those roundings (tests/kv_storage_test.cpp bounds them).
/// \returns whether the CPU has AVX512F and AVX512_BF16
inline bool bfloat16_arithmetic_available() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  }();
  return yes;
#else
  return false;
#endif
}

/// Whether this CPU runs AVX512_VNNI (`vpdpbusd`, `vpdpwssd`) with AVX512BW (on x86 with GCC or
/// Clang, from `__builtin_cpu_supports`; false elsewhere). Asked once. Where it does, a decoding
/// step with `StoredArithmetic::Reduced` over a cache kept in `KVStorage::Int8` (4 query heads per
/// key/value head, float) computes in integers, summed exactly in 32 bits: its scores by
/// `vpdpbusd` (d_k a multiple of 32 up to 8192: the scaled queries rounded to 8 bits like the
/// keys, one scale per query head, max |q| / 127) and its weighted sum of the values by
/// `vpdpwssd` (d_v a multiple of 32: each tile's weights rounded to 16 bits, one scale per query
/// head and tile of 64 keys, max p / 32767); the output carries those roundings
/// (`docs/benchmarks.md#accuracy-of-the-stored-keyvalue-formats`).
/// \returns whether the CPU has AVX512F, AVX512BW and AVX512_VNNI
inline bool int8_arithmetic_available() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace attn

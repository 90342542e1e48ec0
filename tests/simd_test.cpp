/// simd.hpp: `simd_compiled` against this translation unit's Eigen (its macros, its own list of the
/// sets in use and its packet width), `simd_available` against /proc/cpuinfo, and the advice. With
/// ATTN_TEST_EXPECT_NATIVE (tests/CMakeLists.txt defines it when attn's own programs are built with
/// attn::native) the kernels must be compiled for everything this CPU has: the test that proves the
/// fast path runs when it should.

#include <gtest/gtest.h>

#include <attn/simd.hpp>
#include <fstream>
#include <string>

namespace simd_test {

using attn::Simd;
using attn::SimdSet;

/// Whether Eigen::SimdInstructionSetsInUse() starts with `prefix`. Eigen 3.4's list is "AVX512, FMA,
/// AVX2, ..." for AVX-512, "AVX SSE, SSE2, ..." for both AVX and AVX2, "SSE, SSE2, ..." for SSE2 to
/// SSE4.2, "ARM NEON" and "None".
bool eigen_list_starts_with(const std::string& prefix) {
  return std::string(Eigen::SimdInstructionSetsInUse()).rfind(prefix, 0) == 0;
}

/// The "flags" line of /proc/cpuinfo, padded with spaces; empty where there is none.
std::string cpuinfo_flags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) return " " + line.substr(line.find(':') + 1) + " ";
  }
  return "";
}

TEST(Simd, CompiledIsWhatEigenUses) {
  // Eigen's own list of the sets it uses, and the width of its float packets: 16 floats with
  // AVX-512, 8 with AVX and AVX2, 4 with SSE2 and NEON, 1 without SIMD. (Eigen's list does not tell
  // AVX2 from AVX, nor name FMA below AVX-512: the compiler's macros do.)
  const SimdSet compiled = attn::simd_compiled();
  const int floats = Eigen::internal::packet_traits<float>::size;
  const char* in_use = Eigen::SimdInstructionSetsInUse();
  switch (compiled.isa) {
    case Simd::AVX512:
      EXPECT_TRUE(eigen_list_starts_with("AVX512,")) << in_use;
      EXPECT_EQ(floats, 16);
      break;
    case Simd::AVX2:
    case Simd::AVX:
      EXPECT_TRUE(eigen_list_starts_with("AVX SSE,")) << in_use;
      EXPECT_EQ(floats, 8);
      break;
    case Simd::SSE2:
      EXPECT_TRUE(eigen_list_starts_with("SSE, SSE2")) << in_use;
      EXPECT_EQ(floats, 4);
      break;
    case Simd::NEON:
      EXPECT_TRUE(eigen_list_starts_with("ARM NEON")) << in_use;
      EXPECT_EQ(floats, 4);
      break;
    case Simd::None:
      EXPECT_TRUE(eigen_list_starts_with("None")) << in_use;
      EXPECT_EQ(floats, 1);
      break;
  }
#if defined(__aarch64__)
  EXPECT_EQ(attn::simd_name(compiled), "NEON+FMA");  // both are part of the aarch64 base set
#endif
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#ifdef __AVX2__
  constexpr bool compiler_avx2 = true;
#else
  constexpr bool compiler_avx2 = false;
#endif
#ifdef __FMA__
  constexpr bool compiler_fma = true;
#else
  constexpr bool compiler_fma = false;
#endif
  if (compiled.isa == Simd::AVX2 || compiled.isa == Simd::AVX) {
    EXPECT_EQ(compiled.isa == Simd::AVX2, compiler_avx2);
  }
  EXPECT_EQ(compiled.fma, compiler_fma);
#endif
}

TEST(Simd, AvailableIsWhatTheKernelReports) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  const std::string flags = cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo to compare with";
  const auto has = [&](const char* flag) {
    return flags.find(" " + std::string(flag) + " ") != std::string::npos;
  };
  SimdSet expected;
  expected.isa = has("avx512f") ? Simd::AVX512
                 : has("avx2")  ? Simd::AVX2
                 : has("avx")   ? Simd::AVX
                 : has("sse2")  ? Simd::SSE2
                                : Simd::None;
  expected.fma = expected.isa != Simd::None && has("fma");
  EXPECT_EQ(attn::simd_name(attn::simd_available()), attn::simd_name(expected));
  EXPECT_TRUE(attn::simd_available() == expected);
#else
  EXPECT_TRUE(attn::simd_available() == attn::simd_compiled());  // attn does not look there
#endif
}

#ifdef ATTN_TEST_EXPECT_NATIVE
// attn's own programs are built with attn::native: the kernels must use everything the CPU has.
TEST(Simd, NativeBuildUsesEverythingTheCpuHas) {
  EXPECT_EQ(attn::simd_name(attn::simd_compiled()), attn::simd_name(attn::simd_available()));
  EXPECT_TRUE(attn::simd_compiled() == attn::simd_available());
  EXPECT_EQ(attn::simd_advice(), "");
}
#else
// A plain build (no attn::native): on a CPU with more than the compiled set, the advice says how to
// get it.
TEST(Simd, PlainBuildAdvisesAttnNative) {
  const SimdSet compiled = attn::simd_compiled();
  const SimdSet available = attn::simd_available();
  if (compiled == available) {
    EXPECT_EQ(attn::simd_advice(), "");
    GTEST_SKIP() << "this CPU has nothing beyond " << attn::simd_name(compiled);
  }
  const std::string advice = attn::simd_advice();
  EXPECT_EQ(advice, attn::simd_advice(compiled, available));
  EXPECT_NE(advice.find("attn::native"), std::string::npos) << advice;
  EXPECT_NE(advice.find("compiled for " + attn::simd_name(compiled)), std::string::npos) << advice;
  EXPECT_NE(advice.find("this CPU has " + attn::simd_name(available)), std::string::npos) << advice;
}
#endif

TEST(Simd, Names) {
  EXPECT_EQ(attn::simd_name({Simd::None, false}), "none");
  EXPECT_EQ(attn::simd_name({Simd::SSE2, false}), "SSE2");
  EXPECT_EQ(attn::simd_name({Simd::AVX, true}), "AVX+FMA");
  EXPECT_EQ(attn::simd_name({Simd::AVX2, false}), "AVX2");
  EXPECT_EQ(attn::simd_name({Simd::AVX2, true}), "AVX2+FMA");
  EXPECT_EQ(attn::simd_name({Simd::AVX512, true}), "AVX-512");
  EXPECT_EQ(attn::simd_name({Simd::NEON, true}), "NEON+FMA");
}

TEST(Simd, AdviceForEachPair) {
  const SimdSet sse2{Simd::SSE2, false};
  const SimdSet avx2{Simd::AVX2, false};
  const SimdSet avx2_fma{Simd::AVX2, true};
  const SimdSet avx512{Simd::AVX512, true};
  EXPECT_EQ(attn::simd_advice(avx512, avx512), "");
  EXPECT_EQ(attn::simd_advice(sse2, sse2), "");
  EXPECT_EQ(attn::simd_advice(sse2, avx512),
            "attn: compiled for SSE2 but this CPU has AVX-512: link attn::native (CMake) or "
            "compile with -march=native for the faster kernels");
  EXPECT_EQ(attn::simd_advice(sse2, avx2_fma),
            "attn: compiled for SSE2 but this CPU has AVX2+FMA: link attn::native (CMake) or "
            "compile with -march=native for the faster kernels");
  // The same set without FMA (-mavx2 alone) is less than the CPU has.
  EXPECT_EQ(attn::simd_advice(avx2, avx2_fma),
            "attn: compiled for AVX2 but this CPU has AVX2+FMA: link attn::native (CMake) or "
            "compile with -march=native for the faster kernels");
  // Built with -march=native elsewhere, run on an older CPU.
  EXPECT_EQ(attn::simd_advice(avx512, avx2_fma),
            "attn: compiled for AVX-512 but this CPU has only AVX2+FMA: the program may stop on an "
            "illegal instruction; build it on this machine, or without -march=native");
  EXPECT_EQ(attn::simd_advice(avx2_fma, avx2),
            "attn: compiled for AVX2+FMA but this CPU has only AVX2: the program may stop on an "
            "illegal instruction; build it on this machine, or without -march=native");
}

}  // namespace simd_test

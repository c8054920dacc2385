// SPDX-License-Identifier: Apache-2.0
// The main of a test executable whose one translation unit is built for an x86-64 level
// (MEDUSA_TEST_X86_LEVEL 3 or 4, with -march=x86-64-v3 or -march=x86-64-v4 in its test_*.cmake):
// include it first, then the tests. Before anything else of the program runs, it checks that the
// CPU has that level, and exits 77 (skipped) with the reason when it has not. The unit brings its
// own doctest main so that no unit built for another instruction set is linked in.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>

#include "../checked_nothing.hpp"

namespace {

#if defined(__x86_64__) && (MEDUSA_TEST_X86_LEVEL == 3 || MEDUSA_TEST_X86_LEVEL == 4)
bool cpu_has_x86_level() {
  __builtin_cpu_init();  // constructors run before libgcc's own initialisation may have
#if defined(__clang__)    // knows feature names only
  bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
            __builtin_cpu_supports("bmi2");
#if MEDUSA_TEST_X86_LEVEL == 4
  ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd");
#endif
  return ok;
#elif MEDUSA_TEST_X86_LEVEL == 4
  return __builtin_cpu_supports("x86-64-v4");
#else
  return __builtin_cpu_supports("x86-64-v3");
#endif
}
#else
bool cpu_has_x86_level() { return false; }
#endif

// Priority 101: before the unit's other static initialisers, which the compiler may already have
// written with the level's instructions.
[[gnu::constructor(101)]] void require_x86_level() {
  if (cpu_has_x86_level()) return;
  std::printf("skipped: this test is built for x86-64-v%d, which this CPU (or build target) lacks\n",
              MEDUSA_TEST_X86_LEVEL);
  std::fflush(stdout);
  std::_Exit(77);
}

}  // namespace

int main(int argc, char** argv) {
  return medusa_test::run(argc, argv);
}

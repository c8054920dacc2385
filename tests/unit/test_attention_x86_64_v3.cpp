// SPDX-License-Identifier: Apache-2.0
// The attention tests again, the whole executable built with -march=x86-64-v3 (AVX2, FMA, F16C;
// test_attention_x86_64_v3.cmake): skipped (exit 77) on a CPU without them.
#define MEDUSA_TEST_X86_LEVEL 3
#include "x86_level_main.hpp"
#include "test_attention.cpp"  // NOLINT(bugprone-suspicious-include)

TEST_CASE("this unit runs the AVX2 kernels") { CHECK(std::string(medusa::kernel_isa()) == "avx2"); }

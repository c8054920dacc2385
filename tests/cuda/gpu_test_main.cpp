// SPDX-License-Identifier: Apache-2.0
// The GPU tests' main, linked into each: "skipped" (exit 77, the ctest SKIP_RETURN_CODE) on
// machines without a CUDA device or when no case checked anything, else doctest's result.
// Compiled once by the C++ compiler, so nvcc does not compile doctest's implementation again for
// every test.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <medusa/cuda/common.cuh>

#include <cstdio>

#include "../checked_nothing.hpp"

int main(int argc, char** argv) {
  if (medusa::cuda::device_count() == 0) {
    std::puts("no CUDA device: GPU tests skipped");
    return 77;
  }
  return medusa_test::run(argc, argv);
}

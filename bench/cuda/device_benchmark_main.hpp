// SPDX-License-Identifier: Apache-2.0
// The main of a CUDA benchmark: without a device it prints why and exits 77 (ctest's skip code);
// otherwise it runs Google Benchmark as BENCHMARK_MAIN() does.
#pragma once

#include <benchmark/benchmark.h>
#include <medusa/cuda/common.cuh>

#include <cstdio>

#define MEDUSA_DEVICE_BENCHMARK_MAIN()                     \
  int main(int argc, char** argv) {                        \
    if (medusa::cuda::device_count() == 0) {               \
      std::puts("no CUDA device: CUDA benchmarks skipped"); \
      return 77;                                           \
    }                                                      \
    benchmark::Initialize(&argc, argv);                    \
    benchmark::RunSpecifiedBenchmarks();                   \
    benchmark::Shutdown();                                 \
    return 0;                                              \
  }

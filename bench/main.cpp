// SPDX-License-Identifier: Apache-2.0
// The benchmarks' main: Google Benchmark's, after making a misdetecting OpenBLAS use its AVX-512
// kernels (the engine's prefill, the heads' and the trainer's GEMMs run through it;
// medusa_llama/openblas_env.hpp), so that no figure is taken on its SSE3 fallback.
#include <benchmark/benchmark.h>

#include <medusa_llama/openblas_env.hpp>

int main(int argc, char** argv) {
  medusa_llama::reexec_with_fast_openblas(argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

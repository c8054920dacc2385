// SPDX-License-Identifier: Apache-2.0
// Built whenever nvcc is available; exits 77 (ctest: skipped) on machines without a CUDA device.
#include "gpu_test.hpp"

#include <cstdio>

namespace {
__global__ void add_one(int* data, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += 1;
}
}  // namespace

TEST_CASE("a kernel runs and its result comes back") {
  constexpr int n = 1000;
  int* d = nullptr;
  medusa::cuda::check(cudaMalloc(&d, n * sizeof(int)), "cudaMalloc");
  medusa::cuda::check(cudaMemset(d, 0, n * sizeof(int)), "cudaMemset");
  add_one<<<(n + 127) / 128, 128>>>(d, n);
  medusa::cuda::check(cudaGetLastError(), "add_one launch");
  int h[n];
  medusa::cuda::check(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(d);
  for (int v : h) REQUIRE(v == 1);
}

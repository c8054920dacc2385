// SPDX-License-Identifier: Apache-2.0
// The linear layers of a decode or tree step on a CUDA device: the library's batch-invariant skinny
// GEMM (`cuda/skinny_gemm.cuh`) against cuBLAS's own choice (`cublasGemmEx`, default algorithm),
// bf16 weights and activations, float output, for the Llama-2-7B shapes (q/k/v 12288×4096, o
// 4096², gate/up 22016×4096, down 4096×11008, lm_head 32000×4096) and 1 to 128 rows. Each iteration
// times 20 back-to-back launches with CUDA events (manual time), the weights rotated over 8 copies
// (≥ 1.4 GB ≫ the 50 MB L2) so each launch streams its weights from memory; the counter `TB/s` is
// the weights' bytes over the time. Exits 77 without a device.
//
// `BM_skinny_gemm_two_blocks` times a candidate for 33 rows and more: the library's 8-row-tile
// instance compiled for two blocks an SM (`__launch_bounds__(256, 2)`: 128 registers and about 100
// bytes of spills, where the library's instance takes 142 registers and fits one; docs/cuda.md,
// known issues). It runs the same body, so it must give the same bits: each case first compares
// its output with the library's on random data and fails otherwise. Counter `blocks/SM`: the
// resident blocks an SM holds of the instance timed (in `BM_skinny_gemm` too).
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/skinny_gemm.cuh>
#include <medusa/half.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "device_benchmark_main.hpp"

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using T = medusa::bfloat16;

namespace {

constexpr int launches = 20;
constexpr int copies = 8;

struct shape {
  const char* name;
  int n, k;
};
constexpr shape shapes[] = {{"qkv", 12288, 4096}, {"o", 4096, 4096}, {"gate_up", 22016, 4096},
                            {"down", 4096, 11008}, {"lm_head", 32000, 4096}};
constexpr std::size_t max_weight = 32000ull * 4096;  // elements of the largest weight

struct device_bytes {
  void* p = nullptr;
  explicit device_bytes(std::size_t n) { mc::check(cudaMalloc(&p, n), "cudaMalloc"); }
  ~device_bytes() { cudaFree(p); }
  device_bytes(const device_bytes&) = delete;
  device_bytes& operator=(const device_bytes&) = delete;
};

// Weight copies, activations and output, allocated once for every benchmark.
struct buffers {
  std::vector<std::unique_ptr<device_bytes>> w;
  device_bytes x{128ull * 11008 * sizeof(T)}, y{128ull * 32000 * sizeof(float)};
  buffers() {
    for (int c = 0; c < copies; ++c) {
      w.push_back(std::make_unique<device_bytes>(max_weight * sizeof(T)));
      mc::check(cudaMemset(w.back()->p, 0x3c, max_weight * sizeof(T)), "cudaMemset");  // bf16 ≈ 0.0115
    }
    mc::check(cudaMemset(x.p, 0x3c, 128ull * 11008 * sizeof(T)), "cudaMemset");
  }
};
buffers& shared_buffers() {
  static buffers b;
  return b;
}

template <class Launch>
void time_launches(benchmark::State& state, const shape& sh, int rows, Launch&& launch) {
  buffers& b = shared_buffers();
  cudaStream_t s;
  mc::check(cudaStreamCreate(&s), "cudaStreamCreate");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < copies; ++i) launch(b.w[static_cast<std::size_t>(i)]->p, b.x.p, b.y.p, s);  // warm-up
  for (auto _ : state) {
    cudaEventRecord(e0, s);
    for (int i = 0; i < launches; ++i) launch(b.w[static_cast<std::size_t>(i % copies)]->p, b.x.p, b.y.p, s);
    cudaEventRecord(e1, s);
    mc::check(cudaEventSynchronize(e1), "gemm launches");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    state.SetIterationTime(static_cast<double>(ms) * 1e-3 / launches);
  }
  mc::check(cudaGetLastError(), "gemm launches");
  state.SetLabel(sh.name);
  state.counters["rows"] = rows;
  state.counters["TB/s"] = benchmark::Counter(static_cast<double>(sh.n) * sh.k * sizeof(T) * 1e-12,
                                              benchmark::Counter::kIsIterationInvariantRate);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
}

// Resident blocks an SM of a GEMM kernel (its shared memory granted).
template <class Kernel>
int blocks_per_sm(Kernel kernel, std::size_t shared_bytes) {
  int blocks = 0;
  mc::check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, mk::skinny_gemm_threads, shared_bytes),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

void BM_skinny_gemm(benchmark::State& state) {
  const shape& sh = shapes[state.range(0)];
  const int rows = static_cast<int>(state.range(1));
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = sh.n, .k = sh.k, .rows = rows});
  time_launches(state, sh, rows, [&](void* w, void* x, void* y, cudaStream_t s) {
    mc::check(mc::run(plan, mk::skinny_gemm_params<T>{static_cast<const T*>(w), static_cast<const T*>(x),
                                                      static_cast<float*>(y), false},
                      s),
              "skinny gemm");
  });
  state.counters["blocks/SM"] = mk::with_skinny_gemm_variant(plan, [&](auto rt, auto ft) {
    return blocks_per_sm(mc::detail::skinny_gemm_kernel<decltype(rt)::value, decltype(ft)::value, T>, plan.launch.shared_bytes);
  });
}

void BM_cublas_gemm(benchmark::State& state) {
  const shape& sh = shapes[state.range(0)];
  const int rows = static_cast<int>(state.range(1));
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.0f, zero = 0.0f;
  time_launches(state, sh, rows, [&](void* w, void* x, void* y, cudaStream_t s) {
    cublasSetStream(h, s);
    if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, rows, sh.k, &one, w, CUDA_R_16BF, sh.k, x, CUDA_R_16BF, sh.k,
                     &zero, y, CUDA_R_32F, sh.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("cublasGemmEx failed");
  });
  cublasDestroy(h);
}

// The library's 8-row-tile instance (33 rows and more) bounded to two blocks an SM.
__global__ void __launch_bounds__(mk::skinny_gemm_threads, 2)
    skinny_gemm_two_blocks(const mk::skinny_gemm_plan plan, const mk::skinny_gemm_params<T> a, bool aligned) {
  mc::device_context ctx;
  mk::skinny_gemm_body<mk::skinny_gemm_max_row_tiles, 2>(ctx, plan, a, aligned);
}

// Fills p[0, n) with values in [-1, 1) from a hash of the index: varied data for the bits check.
__global__ void fill_hash(T* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 0x9e3779b9u ^ seed;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    p[i] = T(static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
}

void BM_skinny_gemm_two_blocks(benchmark::State& state) {
  const shape& sh = shapes[state.range(0)];
  const int rows = static_cast<int>(state.range(1));
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = sh.n, .k = sh.k, .rows = rows});
  if (plan.row_tiles != mk::skinny_gemm_max_row_tiles) {
    state.SkipWithError("the variant is the 8-row-tile instance: 33 rows or more");
    return;
  }
  mc::check(cudaFuncSetAttribute(skinny_gemm_two_blocks, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(plan.launch.shared_bytes)),
            "cudaFuncSetAttribute");
  const dim3 grid(static_cast<unsigned>(plan.launch.grid_x), static_cast<unsigned>(plan.launch.grid_y));
  const auto launch = [&](const void* w, const void* x, void* y, cudaStream_t s) {
    const mk::skinny_gemm_params<T> a{static_cast<const T*>(w), static_cast<const T*>(x), static_cast<float*>(y), false};
    skinny_gemm_two_blocks<<<grid, plan.launch.threads, plan.launch.shared_bytes, s>>>(plan, a,
                                                                                       mk::skinny_gemm_aligned(plan, a));
  };
  {  // The same bits as the library's instance, on random W and X.
    const std::size_t out = static_cast<std::size_t>(rows) * static_cast<std::size_t>(sh.n);
    device_bytes w(static_cast<std::size_t>(sh.n) * sh.k * sizeof(T)), x(static_cast<std::size_t>(rows) * sh.k * sizeof(T));
    device_bytes y_lib(out * sizeof(float)), y_var(out * sizeof(float));
    fill_hash<<<1024, 256>>>(static_cast<T*>(w.p), static_cast<std::size_t>(sh.n) * sh.k, 1u);
    fill_hash<<<1024, 256>>>(static_cast<T*>(x.p), static_cast<std::size_t>(rows) * sh.k, 2u);
    mc::check(mc::run(plan, mk::skinny_gemm_params<T>{static_cast<const T*>(w.p), static_cast<const T*>(x.p),
                                                      static_cast<float*>(y_lib.p), false},
                      nullptr),
              "skinny gemm");
    launch(w.p, x.p, y_var.p, nullptr);
    mc::check(cudaGetLastError(), "two-block skinny gemm");
    mc::check(cudaDeviceSynchronize(), "bits check");
    std::vector<float> a(out), b(out);
    mc::check(cudaMemcpy(a.data(), y_lib.p, out * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
    mc::check(cudaMemcpy(b.data(), y_var.p, out * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (std::memcmp(a.data(), b.data(), out * sizeof(float)) != 0) {
      state.SkipWithError("the two-block instance's bits differ from the library instance's");
      return;
    }
  }
  time_launches(state, sh, rows, [&](void* w, void* x, void* y, cudaStream_t s) {
    launch(w, x, y, s);
    mc::check(cudaGetLastError(), "two-block skinny gemm");
  });
  state.counters["blocks/SM"] = blocks_per_sm(skinny_gemm_two_blocks, plan.launch.shared_bytes);
}

void gemm_sizes(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < static_cast<int>(std::size(shapes)); ++s)
    for (const int rows : {1, 2, 4, 8, 16, 32, 64, 128}) b->Args({s, rows});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void wide_gemm_sizes(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < static_cast<int>(std::size(shapes)); ++s)
    for (const int rows : {40, 64, 128}) b->Args({s, rows});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_skinny_gemm)->Apply(gemm_sizes);
BENCHMARK(BM_cublas_gemm)->Apply(gemm_sizes);
BENCHMARK(BM_skinny_gemm_two_blocks)->Apply(wide_gemm_sizes);

}  // namespace

MEDUSA_DEVICE_BENCHMARK_MAIN()

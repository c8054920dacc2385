// SPDX-License-Identifier: Apache-2.0
// The linear layers of a decode or tree step on a CUDA device: the library's batch-invariant skinny
// GEMM (`cuda/skinny_gemm.cuh`) against cuBLAS's own choice (`cublasGemmEx`, default algorithm),
// bf16 weights and activations, float output, for the Llama-2-7B shapes (q/k/v 12288×4096, o
// 4096², gate/up 22016×4096, down 4096×11008, lm_head 32000×4096) and 1 to 128 rows. Each iteration
// times 20 back-to-back launches with CUDA events (manual time), the weights rotated over 8 copies
// (≥ 1.4 GB ≫ the 50 MB L2) so each launch streams its weights from memory; the counter `TB/s` is
// the weights' bytes over the time. Exits 77 without a device.
//
// `BM_skinny_gemm_schedule<RT, F, S, CH, B>` times other schedules of the library's body
// (`skinny_gemm_body<RT, F, S, CH>`: row tiles, 16-feature tiles, ring stages, chunks a stage)
// compiled for at least B blocks an SM (B = 0: `__launch_bounds__(256)` alone, as the library's
// instances), beside `BM_skinny_gemm` (the library's instances: 1, 1, 2, 2 up to 8 rows; 4, 1, 3,
// 1 up to 32; 8, 2, 2, 1 from 33 rows, whose 142 registers fit one block an SM). A schedule
// reorders the copies, not an element's arithmetic, so it must give the library's bits: each case
// first compares its output with the library's on random data and fails otherwise. Counter
// `blocks/SM`: the resident blocks an SM holds of the kernel timed.
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/skinny_gemm_instances.cuh>
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

// The body with another schedule, at least `MinBlocks` blocks an SM (0: no bound, as the library's
// instances; ptxas allocates registers differently for a bound of 1).
template <int RT, int F, int S, int CH, int MinBlocks>
__global__ void __launch_bounds__(mk::skinny_gemm_threads, MinBlocks)
    skinny_gemm_schedule(const mk::skinny_gemm_plan plan, const mk::skinny_gemm_params<T> a, bool aligned) {
  mc::device_context ctx;
  mk::skinny_gemm_body<RT, F, S, CH>(ctx, plan, a, aligned);
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

template <int RT, int F, int S, int CH, int MinBlocks>
void BM_skinny_gemm_schedule(benchmark::State& state) {
  const shape& sh = shapes[state.range(0)];
  const int rows = static_cast<int>(state.range(1));
  const mk::skinny_gemm_plan library = mk::plan_skinny_gemm({.n = sh.n, .k = sh.k, .rows = rows});
  const mk::skinny_gemm_plan plan = mk::detail::skinny_gemm_rescheduled<RT, F, S, CH>(library);
  constexpr auto kernel = skinny_gemm_schedule<RT, F, S, CH, MinBlocks>;
  mc::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(plan.launch.shared_bytes)),
            "cudaFuncSetAttribute");
  const dim3 grid(static_cast<unsigned>(plan.launch.grid_x), static_cast<unsigned>(plan.launch.grid_y));
  const auto launch = [&](const void* w, const void* x, void* y, cudaStream_t s) {
    const mk::skinny_gemm_params<T> a{static_cast<const T*>(w), static_cast<const T*>(x), static_cast<float*>(y), false};
    kernel<<<grid, plan.launch.threads, plan.launch.shared_bytes, s>>>(plan, a, mk::skinny_gemm_aligned(plan, a));
  };
  {  // The library instance's bits, on random W and X.
    const std::size_t out = static_cast<std::size_t>(rows) * static_cast<std::size_t>(sh.n);
    device_bytes w(static_cast<std::size_t>(sh.n) * sh.k * sizeof(T)), x(static_cast<std::size_t>(rows) * sh.k * sizeof(T));
    device_bytes y_lib(out * sizeof(float)), y_var(out * sizeof(float));
    fill_hash<<<1024, 256>>>(static_cast<T*>(w.p), static_cast<std::size_t>(sh.n) * sh.k, 1u);
    fill_hash<<<1024, 256>>>(static_cast<T*>(x.p), static_cast<std::size_t>(rows) * sh.k, 2u);
    mc::check(mc::run(library, mk::skinny_gemm_params<T>{static_cast<const T*>(w.p), static_cast<const T*>(x.p),
                                                      static_cast<float*>(y_lib.p), false},
                      nullptr),
              "skinny gemm");
    launch(w.p, x.p, y_var.p, nullptr);
    mc::check(cudaGetLastError(), "skinny gemm schedule");
    mc::check(cudaDeviceSynchronize(), "bits check");
    std::vector<float> a(out), b(out);
    mc::check(cudaMemcpy(a.data(), y_lib.p, out * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
    mc::check(cudaMemcpy(b.data(), y_var.p, out * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (std::memcmp(a.data(), b.data(), out * sizeof(float)) != 0) {
      state.SkipWithError("the schedule's bits differ from the library instance's");
      return;
    }
  }
  time_launches(state, sh, rows, [&](void* w, void* x, void* y, cudaStream_t s) {
    launch(w, x, y, s);
    mc::check(cudaGetLastError(), "skinny gemm schedule");
  });
  state.counters["blocks/SM"] = blocks_per_sm(kernel, plan.launch.shared_bytes);
}

// The first `Shapes` shapes at `Rows`.
template <int Shapes, int... Rows>
void sizes(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < Shapes; ++s)
    for (const int rows : {Rows...}) b->Args({s, rows});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}
constexpr auto gemm_sizes = sizes<static_cast<int>(std::size(shapes)), 1, 2, 4, 8, 16, 32, 64, 128>;
// The linear layers (not lm_head) at `Rows`.
template <int... Rows>
constexpr auto layer_sizes = sizes<4, Rows...>;

BENCHMARK(BM_skinny_gemm)->Apply(gemm_sizes);
BENCHMARK(BM_cublas_gemm)->Apply(gemm_sizes);
// 9 to 32 rows: the library's schedule bounded to one block an SM (ptxas then gives it 90
// registers on sm_90 instead of 64), 2 row tiles (a pass of 16 in one group), more stages or
// chunks a stage, 2 feature tiles.
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 4, 1, 3, 1, 1)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 2, 1, 3, 1, 0)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 2, 1, 2, 2, 0)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 4, 1, 4, 1, 0)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 4, 1, 2, 2, 0)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 4, 2, 2, 1, 0)->Apply(layer_sizes<16, 32>);
// More features a block: each block re-reads the pass's X rows from L2 (8·RT rows × k) for its
// 16·F rows of W, so at 4 row tiles and one feature tile it reads twice as many bytes of X as of W.
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 4, 2, 3, 1, 0)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 4, 4, 2, 1, 0)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 2, 2, 3, 1, 0)->Apply(layer_sizes<16, 32>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 2, 4, 2, 1, 0)->Apply(layer_sizes<16, 32>);
// 33 rows on: the library's schedule bounded to two blocks an SM (128 registers, about 100 bytes
// of spills), one feature tile (78 registers) with 2 or 3 stages, 4 row tiles in two groups.
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 8, 2, 2, 1, 2)->Apply(layer_sizes<64, 128>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 8, 1, 2, 1, 0)->Apply(layer_sizes<64, 128>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 8, 1, 3, 1, 0)->Apply(layer_sizes<64, 128>);
BENCHMARK_TEMPLATE(BM_skinny_gemm_schedule, 4, 1, 3, 1, 0)->Apply(layer_sizes<64, 128>);

}  // namespace

MEDUSA_DEVICE_BENCHMARK_MAIN()

// SPDX-License-Identifier: Apache-2.0
// One decode step of the Medusa heads (M = 1 hidden state): portable GEMM vs OpenBLAS, f32 and
// bf16 weights, fused vs unfused first layer, for a 7B-class shape (d = 4096, V = 32000, K = 5,
// one ResBlock) and pycode-15m (d = 384, V = 2048, K = 4). Counters: GFLOP/s, GB/s of weights
// streamed, and the fraction of the machine's sgemm peak (a large cblas_sgemm measured here).
#include <medusa/gemm.hpp>
#include <medusa/heads.hpp>
#include <medusa/io/head_checkpoint.hpp>

#include "../examples/blas/openblas_gemm.hpp"

#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// A persistent pool of one extra worker: the parallel-for an engine would hand the portable GEMM.
class two_thread_pool {
 public:
  two_thread_pool() : worker_([this] { loop(); }) {}
  ~two_thread_pool() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
      ++gen_;
    }
    cv_.notify_one();
    worker_.join();
  }
  void run(std::size_t n, const std::function<void(std::size_t)>& body) {
    if (n <= 1) {
      if (n == 1) body(0);
      return;
    }
    {
      std::lock_guard lk(m_);
      body_ = &body;
      n_ = n;
      next_.store(0);
      done_.store(0);
      ++gen_;
    }
    cv_.notify_one();
    work();
    while (done_.load(std::memory_order_acquire) != n) std::this_thread::yield();
  }

 private:
  void work() {
    for (std::size_t i; (i = next_.fetch_add(1)) < n_;) {
      (*body_)(i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }
  void loop() {
    std::uint64_t seen = 0;
    for (;;) {
      std::unique_lock lk(m_);
      cv_.wait(lk, [&] { return gen_ != seen; });
      seen = gen_;
      if (stop_) return;
      lk.unlock();
      work();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::uint64_t gen_ = 0;
  bool stop_ = false;
  const std::function<void(std::size_t)>* body_ = nullptr;
  std::size_t n_ = 0;
  std::atomic<std::size_t> next_{0}, done_{0};
  std::thread worker_;
};

two_thread_pool& pool() {
  static two_thread_pool p;
  return p;
}

struct pool_for {
  template <class F>
  void operator()(std::size_t n, F&& body) const {
    pool().run(n, std::function<void(std::size_t)>(std::forward<F>(body)));
  }
};

double sgemm_gflops(int n, int reps) {
  std::vector<float> a(static_cast<std::size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * n * n * static_cast<double>(n) * reps / s * 1e-9;
}

double peak_gflops() {
  static const double peak = sgemm_gflops(1536, 3);
  return peak;
}

// The reference "peak": a large square sgemm through OpenBLAS.
void BM_peak_sgemm(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  std::vector<float> a(static_cast<std::size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * static_cast<double>(n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_peak_sgemm)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

struct shape {
  std::size_t d, V, K, L;
};
constexpr shape big{4096, 32000, 5, 1};
constexpr shape small{384, 2048, 4, 1};

// One model alive at a time (the f32 7B-class heads are ~3 GB): filled with a fast xorshift.
std::unique_ptr<medusa::head_weights>& cached(const shape& s, medusa::weight_dtype dt) {
  static std::unique_ptr<medusa::head_weights> w;
  static shape ws{};
  static medusa::weight_dtype wdt{};
  if (!w || ws.d != s.d || ws.V != s.V || ws.K != s.K || ws.L != s.L || wdt != dt) {
    w.reset();
    w = std::make_unique<medusa::head_weights>(s.d, s.V, s.K, s.L, medusa::projection_kind::per_head, dt);
    // 1 MiB of xorshift values tiled over the weights: set-up stays at memcpy speed (the values
    // do not change the timing; they are small normal numbers, never subnormal).
    std::vector<std::byte> block(1u << 20);
    std::uint64_t x = 0x9e3779b97f4a7c15ull;
    for (std::size_t i = 0; i < block.size(); i += 4) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      const std::uint32_t f32 = 0x3c000000u | static_cast<std::uint32_t>(x >> 41);
      const std::uint32_t two_bf16 = 0x3c003c00u | static_cast<std::uint32_t>((x >> 57) & 0x7fu) | static_cast<std::uint32_t>((x >> 33) & 0x7fu) << 16;
      const std::uint32_t v = dt == medusa::weight_dtype::f32 ? f32 : two_bf16;
      std::memcpy(block.data() + i, &v, 4);
    }
    auto fill = [&](std::span<std::byte> bytes) {
      for (std::size_t off = 0; off < bytes.size(); off += block.size())
        std::memcpy(bytes.data() + off, block.data(), std::min(block.size(), bytes.size() - off));
    };
    for (std::size_t h = 0; h < s.K; ++h) {
      for (std::size_t l = 0; l < s.L; ++l) {
        fill(w->resblock_weight_bytes(h, l));
        fill(w->resblock_bias_bytes(h, l));
      }
      fill(w->projection_bytes(h));
    }
    ws = s;
    wdt = dt;
  }
  return w;
}

template <class Gemm>
void run_heads(benchmark::State& state, const shape& s, medusa::weight_dtype dt, bool fuse, Gemm gemm) {
  const auto& w = cached(s, dt);
  const auto heads = w->view();
  std::vector<float> hidden(s.d, 0.01f), logits(s.K * s.V), ws(heads.workspace_size(1));
  const medusa::head_forward_options opt{fuse};
  for (auto _ : state) {
    heads.forward(gemm, hidden, 1, logits, ws, opt);
    benchmark::DoNotOptimize(logits.data());
  }
  const double flops = 2.0 * static_cast<double>(s.K) * (static_cast<double>(s.L) * s.d * s.d + static_cast<double>(s.V) * s.d);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(w->size_bytes()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_sgemm_GFLOP/s"] = peak_gflops();
}

void BM_heads_portable(benchmark::State& state, shape s, medusa::weight_dtype dt, bool fuse) {
  run_heads(state, s, dt, fuse, medusa::portable_gemm<pool_for>{});
}
void BM_heads_openblas(benchmark::State& state, shape s, medusa::weight_dtype dt, bool fuse) {
  run_heads(state, s, dt, fuse, medusa_blas::openblas_gemm{});
}

using medusa::weight_dtype;
// Grouped by (shape, dtype) so only one set of weights is alive at a time.
BENCHMARK_CAPTURE(BM_heads_portable, pycode15m_f32_fused, small, weight_dtype::f32, true)->UseRealTime();
BENCHMARK_CAPTURE(BM_heads_portable, pycode15m_f32_unfused, small, weight_dtype::f32, false)->UseRealTime();
BENCHMARK_CAPTURE(BM_heads_openblas, pycode15m_f32_fused, small, weight_dtype::f32, true)->UseRealTime();
BENCHMARK_CAPTURE(BM_heads_openblas, pycode15m_f32_unfused, small, weight_dtype::f32, false)->UseRealTime();
BENCHMARK_CAPTURE(BM_heads_portable, pycode15m_bf16_fused, small, weight_dtype::bf16, true)->UseRealTime();
BENCHMARK_CAPTURE(BM_heads_openblas, pycode15m_bf16_fused, small, weight_dtype::bf16, true)->UseRealTime();
BENCHMARK_CAPTURE(BM_heads_portable, d4096_v32000_k5_f32_fused, big, weight_dtype::f32, true)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_heads_portable, d4096_v32000_k5_f32_unfused, big, weight_dtype::f32, false)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_heads_openblas, d4096_v32000_k5_f32_fused, big, weight_dtype::f32, true)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_heads_portable, d4096_v32000_k5_bf16_fused, big, weight_dtype::bf16, true)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_heads_openblas, d4096_v32000_k5_bf16_fused, big, weight_dtype::bf16, true)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

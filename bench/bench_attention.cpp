// SPDX-License-Identifier: Apache-2.0
// CPU tree attention: 64 tree nodes over a 2048-token context, 32 query heads / 8 KV heads /
// head_dim 128, for float, bfloat16 and half caches (contiguous NHD and paged); and, for
// comparison, one query over the same context (a plain decoding step); and one query at the
// pycode-15m shape (6 query heads, 6 KV heads, head_dim 64) over short contexts, the per-request
// attention of plain batched decoding.
#include <medusa/attention.hpp>
#include <medusa/kv_cache.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr int kCtx = 2048, kNodes = 64;

struct shape {
  int q_heads, kv_heads, dim;
};
constexpr shape kLarge{32, 8, 128};
constexpr shape kPycode{6, 6, 64};

// A Medusa-like 64-node tree (root, 3-way fan-out by levels), as a packed ancestor mask.
std::vector<std::uint32_t> tree_mask(int n, int wpr) {
  std::vector<int> parent(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) parent[static_cast<std::size_t>(i)] = (i - 1) / 3;
  std::vector<std::uint32_t> w(static_cast<std::size_t>(n * wpr), 0u);
  for (int i = 0; i < n; ++i)
    for (int u = i; u >= 0; u = parent[static_cast<std::size_t>(u)])
      w[static_cast<std::size_t>(i * wpr + u / 32)] |= 1u << (u % 32);
  return w;
}

template <class T>
std::vector<T> random_buffer(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = T(u(rng));
  return v;
}

struct two_threads {  // a minimal caller-side parallel-for: one helper thread per call
  template <class F>
  void operator()(std::size_t count, F&& body) const {
    std::thread t([&] {
      for (std::size_t i = 0; i < count; i += 2) body(i);
    });
    for (std::size_t i = 1; i < count; i += 2) body(i);
    t.join();
  }
};

template <class T, bool Paged = false, class PF = medusa::sequential_for>
void run(benchmark::State& state, int num_queries, int L, shape sh = kLarge) {
  const int cap = L + num_queries;
  const std::size_t row = static_cast<std::size_t>(sh.kv_heads) * static_cast<std::size_t>(sh.dim);
  const std::size_t elems = static_cast<std::size_t>(cap) * row;
  const int page = 16;
  const int blocks = (cap + page - 1) / page;
  const std::size_t pool_elems = static_cast<std::size_t>(blocks) * page * row;
  auto k = random_buffer<T>(Paged ? pool_elems : elems, 1), v = random_buffer<T>(k.size(), 2);
  std::vector<std::int32_t> table(static_cast<std::size_t>(blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(3));
  auto q = random_buffer<float>(static_cast<std::size_t>(num_queries * sh.q_heads * sh.dim), 4);
  std::vector<float> out(q.size());
  const int wpr = (num_queries + 31) / 32;
  const auto mask = tree_mask(num_queries, wpr);
  auto body = [&](const auto& kv) {
    for (auto _ : state) {
      medusa::tree_attention(kv, 0, L, q, num_queries, sh.q_heads, medusa::tree_mask_view{mask, wpr}, out, {}, PF{});
      benchmark::DoNotOptimize(out.data());
    }
  };
  if constexpr (Paged)
    body(medusa::make_paged_kv_view<T>(k, v, {1, sh.kv_heads, sh.dim}, page, medusa::kv_layout::nhd, table));
  else
    body(medusa::make_kv_view<T>(k, v, {1, sh.kv_heads, sh.dim}, cap, medusa::kv_layout::nhd));
  // useful flops: QK and PV over the visible keys (prefix + ~depth tree keys), 2 flops per MAC
  const double flops = 4.0 * num_queries * sh.q_heads * static_cast<double>(L) * sh.dim;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * static_cast<double>(state.iterations()) / 1e9,
                                                 benchmark::Counter::kIsRate);
}

void BM_tree64_ctx2048_f32(benchmark::State& s) { run<float>(s, kNodes, kCtx); }
void BM_tree64_ctx2048_bf16(benchmark::State& s) { run<medusa::bfloat16>(s, kNodes, kCtx); }
void BM_tree64_ctx2048_f16(benchmark::State& s) { run<medusa::half>(s, kNodes, kCtx); }
void BM_tree64_ctx2048_f32_paged16(benchmark::State& s) { run<float, true>(s, kNodes, kCtx); }
void BM_tree64_ctx2048_bf16_2threads(benchmark::State& s) {
  run<medusa::bfloat16, false, two_threads>(s, kNodes, kCtx);
}
void BM_query1_ctx2048_f32(benchmark::State& s) { run<float>(s, 1, kCtx); }
void BM_query1_ctx2048_bf16(benchmark::State& s) { run<medusa::bfloat16>(s, 1, kCtx); }
void BM_query1_ctx2048_f16(benchmark::State& s) { run<medusa::half>(s, 1, kCtx); }
void BM_query1_pycode_ctx128_f32(benchmark::State& s) { run<float>(s, 1, 128, kPycode); }
void BM_query1_pycode_ctx512_f32(benchmark::State& s) { run<float>(s, 1, 512, kPycode); }
void BM_query1_pycode_ctx128_f32_paged16(benchmark::State& s) { run<float, true>(s, 1, 128, kPycode); }
void BM_query1_pycode_ctx512_f32_paged16(benchmark::State& s) { run<float, true>(s, 1, 512, kPycode); }

}  // namespace

BENCHMARK(BM_tree64_ctx2048_f32)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_tree64_ctx2048_bf16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_tree64_ctx2048_f16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_tree64_ctx2048_f32_paged16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_tree64_ctx2048_bf16_2threads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_query1_ctx2048_f32)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_query1_ctx2048_bf16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_query1_ctx2048_f16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_query1_pycode_ctx128_f32)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_query1_pycode_ctx512_f32)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_query1_pycode_ctx128_f32_paged16)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_query1_pycode_ctx512_f32_paged16)->Unit(benchmark::kMicrosecond);

// SPDX-License-Identifier: Apache-2.0
// The example CPU Llama engine on pycode-15m (60 MB of float32 weights):
//  * BM_decode: vanilla single-token decode at a context of 128, with the fraction of the
//    bandwidth roofline it reaches (weight bytes ÷ measured read bandwidth ÷ time per token);
//  * BM_tree_step: one forward of N tree tokens (a random tree, N = 1..64) at a context of 128, and
//    its cost relative to N = 1 of the same weight format (the denominator of Medusa's speedup);
//  * BM_batch_step: one ragged pass of the serving engine (batch_engine, paged KV) over B requests
//    of N rows each (N = 1: plain decoding, N > 1: a tree), every request at a context of 128, and
//    its cost relative to B = 1, N = 1: what batching and trees cost together.
// With float32 (weights:0), bf16 (1), q8_0 (3) and q4_0 (4) packed weights; backend 2 = OpenBLAS for T > 1.
// Set MEDUSA_SHARED_DIR to point elsewhere; skipped when the model is absent.
#include <medusa_llama/cpu.hpp>
#include <medusa_llama/llama.hpp>

#include <medusa/candidates.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

namespace {

using namespace medusa_llama;
constexpr int kContext = 128;

std::filesystem::path model_path() {
  const char* env = std::getenv("MEDUSA_SHARED_DIR");
  return std::filesystem::path(env != nullptr ? env : MEDUSA_SHARED_DIR) / "models/pycode-15m/model.bin";
}

const model* pycode() {
  static const std::optional<model> m = []() -> std::optional<model> {
    if (!std::filesystem::exists(model_path())) return std::nullopt;
    return model::load_llama2c(model_path());
  }();
  return m ? &*m : nullptr;
}

// Read bandwidth in bytes/s over the weights themselves (2 threads, best of 5 passes).
double weight_bandwidth(const model& m, int threads) {
  static std::map<int, double> cache;
  if (auto it = cache.find(threads); it != cache.end()) return it->second;
  const float* p = m.token_embedding();  // the mapping starts with the embedding: all weights follow
  const std::size_t n = m.weight_bytes() / sizeof(float);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<double> part(static_cast<std::size_t>(threads));
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    auto sum = [&](int t) {
      const std::size_t lo = n * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
      const std::size_t hi = n * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
      float s[16] = {};
      for (std::size_t i = lo; i + 16 <= hi; i += 16)
        for (int k = 0; k < 16; ++k) s[k] += p[i + static_cast<std::size_t>(k)];
      double r = 0;
      for (float x : s) r += x;
      part[static_cast<std::size_t>(t)] = r;
    };
    for (int t = 1; t < threads; ++t) th.emplace_back(sum, t);
    sum(0);
    for (auto& x : th) x.join();
    benchmark::DoNotOptimize(part.data());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(m.weight_bytes()) / s);
  }
  return cache[threads] = best;
}

// Wall seconds per iteration of a benchmark loop that started at `t0`.
double seconds_per_iteration(const benchmark::State& state, std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
}

std::vector<int> context_tokens() {
  std::mt19937 rng(11);
  std::vector<int> t(kContext);
  t[0] = 1;
  for (int i = 1; i < kContext; ++i) t[static_cast<std::size_t>(i)] = 259 + static_cast<int>(rng() % 1789);
  return t;
}

void BM_decode(benchmark::State& state) {
  const model* m = pycode();
  if (m == nullptr) {
    state.SkipWithError("pycode-15m is absent (set MEDUSA_SHARED_DIR)");
    return;
  }
  const int threads = static_cast<int>(state.range(0));
  const auto fmt = static_cast<weight_format>(state.range(1));
  engine e(*m, {.capacity = 512, .threads = threads, .weights = fmt});
  state.SetLabel(medusa_llama::cpu_target());  // the kernels' instruction set (MEDUSA_CPU_TARGET limits it)
  std::vector<float> logits(static_cast<std::size_t>(m->config().vocab_size));
  e.prefill(context_tokens(), 0, logits, {});
  int tok = 300;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    e.decode(tok, kContext, logits);
    tok = 259 + medusa::argmax(logits) % 1789;
  }
  const double per_token = seconds_per_iteration(state, t0);
  const double bw = weight_bandwidth(*m, 2);
  // roofline time (weight bytes ÷ bandwidth) ÷ measured time per token; the goal is ≥ 0.6
  const auto bytes = static_cast<double>(e.weight_bytes());  // packed: a quarter of float32 for q8_0
  state.counters["roofline_fraction"] = bytes / bw / per_token;
  state.counters["weight_MB"] = bytes / 1e6;
  state.counters["bandwidth_GBps"] = bw / 1e9;
  // seconds per token at the roofline; the fraction is roofline time ÷ measured time per token
  state.counters["roofline_ms"] = 1e3 * bytes / bw;
  state.counters["tok_per_s"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
}
// weights: 0 f32, 1 bf16, 3 q8_0, 4 q4_0 (medusa_llama::weight_format)
BENCHMARK(BM_decode)->ArgsProduct({{1, 2}, {0, 1, 3, 4}})->ArgNames({"threads", "weights"})->Unit(benchmark::kMillisecond)->UseRealTime();

// A random tree of N nodes (parents uniformly among earlier nodes, so depth grows like log N)
// packed as the engine's mask rows.
std::vector<std::uint32_t> random_tree(int n, std::vector<int>& depth) {
  std::mt19937 rng(static_cast<unsigned>(n));
  const int w = (n + 31) / 32;
  std::vector<std::uint32_t> mask(static_cast<std::size_t>(n * w), 0);
  std::vector<int> parent(static_cast<std::size_t>(n), -1);
  depth.assign(static_cast<std::size_t>(n), 0);
  for (int i = 1; i < n; ++i) {
    parent[static_cast<std::size_t>(i)] = static_cast<int>(rng() % static_cast<unsigned>(i));
    depth[static_cast<std::size_t>(i)] = depth[static_cast<std::size_t>(parent[static_cast<std::size_t>(i)])] + 1;
  }
  for (int i = 0; i < n; ++i)
    for (int j = i; j >= 0; j = parent[static_cast<std::size_t>(j)])
      mask[static_cast<std::size_t>(i * w + j / 32)] |= 1u << (j % 32);
  return mask;
}

void BM_tree_step(benchmark::State& state) {
  const model* m = pycode();
  if (m == nullptr) {
    state.SkipWithError("pycode-15m is absent (set MEDUSA_SHARED_DIR)");
    return;
  }
  const int n = static_cast<int>(state.range(0));
  const auto backend = static_cast<gemm_backend>(state.range(1));
  const auto fmt = static_cast<weight_format>(state.range(2));
  engine e(*m, {.capacity = 512, .max_batch = 64, .threads = 2, .backend = backend, .weights = fmt});
  state.SetLabel(medusa_llama::cpu_target());  // the kernels' instruction set (MEDUSA_CPU_TARGET limits it)
  const auto V = static_cast<std::size_t>(m->config().vocab_size);
  std::vector<float> last(V);
  e.prefill(context_tokens(), 0, last, {});
  std::vector<int> depth;
  const auto mask = random_tree(n, depth);
  std::vector<int> tok(static_cast<std::size_t>(n)), pos(tok.size());
  for (int i = 0; i < n; ++i) {
    const auto u = static_cast<std::size_t>(i);
    tok[u] = 259 + (i * 37) % 1789;
    pos[u] = kContext + depth[u];
  }
  std::vector<float> logits(static_cast<std::size_t>(n) * V), hidden(static_cast<std::size_t>(n) * static_cast<std::size_t>(m->config().dim));
  medusa::forward_batch batch;
  batch.tokens = tok;
  batch.positions = pos;
  batch.cache_length = kContext;
  batch.tree_mask = {mask, (n + 31) / 32};
  batch.logits = logits;
  batch.hidden = hidden;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    e.forward(batch);
    benchmark::DoNotOptimize(logits.data());
  }
  const double per_step = seconds_per_iteration(state, t0);
  // The cost curve time(N) / time(1), relative to the N = 1 run of this process with the same
  // weight format (automatic backend).
  static std::map<long, double> one;
  if (n == 1) one[state.range(2)] = per_step;
  if (auto it = one.find(state.range(2)); it != one.end())
    state.counters["cost_vs_N1"] = per_step / it->second;
  state.counters["tokens"] = n;
  state.counters["tok_per_s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_tree_step)
    ->ArgsProduct({{1, 4, 6, 8, 16, 32, 64}, {static_cast<long>(gemm_backend::automatic)}, {0, 1, 3, 4}})
    ->ArgsProduct({{4, 16, 64}, {static_cast<long>(gemm_backend::blas)}, {0}})
    ->ArgNames({"N", "backend", "weights"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_batch_step(benchmark::State& state) {
  const model* m = pycode();
  if (m == nullptr) {
    state.SkipWithError("pycode-15m is absent (set MEDUSA_SHARED_DIR)");
    return;
  }
  const int B = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  batch_engine e(*m, {.max_requests = B, .max_tokens = std::max(256, B * n), .threads = 2});
  state.SetLabel(medusa_llama::cpu_target());  // the kernels' instruction set (MEDUSA_CPU_TARGET limits it)
  const auto V = static_cast<std::size_t>(m->config().vocab_size), d = static_cast<std::size_t>(m->config().dim);
  const auto ctx = context_tokens();
  std::vector<int> ids(static_cast<std::size_t>(B)), indptr(static_cast<std::size_t>(B) + 1), lengths(ids.size());
  std::vector<std::int32_t> tok, pos;
  for (int b = 0; b < B; ++b) {  // each request's prompt: the same 128 tokens, its own pages
    ids[static_cast<std::size_t>(b)] = b;
    e.reserve(b, kContext + n);
    indptr[static_cast<std::size_t>(b)] = b * kContext;
    tok.insert(tok.end(), ctx.begin(), ctx.end());
    for (int i = 0; i < kContext; ++i) pos.push_back(i);
  }
  indptr.back() = B * kContext;
  std::vector<float> last(static_cast<std::size_t>(B) * V);
  medusa::ragged_batch prefill;
  prefill.requests = ids;
  prefill.qo_indptr = indptr;
  prefill.tokens = tok;
  prefill.positions = pos;
  prefill.cache_lengths = lengths;
  prefill.last_row_only = true;
  prefill.logits = last;
  e.forward(prefill);

  std::vector<int> depth;
  const auto mask = random_tree(n, depth);
  tok.clear();
  pos.clear();
  for (int b = 0; b < B; ++b) {
    indptr[static_cast<std::size_t>(b)] = b * n;
    lengths[static_cast<std::size_t>(b)] = kContext;
    for (int i = 0; i < n; ++i) {
      tok.push_back(259 + (i * 37 + b * 11) % 1789);
      pos.push_back(kContext + depth[static_cast<std::size_t>(i)]);
    }
  }
  indptr.back() = B * n;
  std::vector<float> logits(static_cast<std::size_t>(B * n) * V), hidden(static_cast<std::size_t>(B * n) * d);
  medusa::ragged_batch step;
  step.requests = ids;
  step.qo_indptr = indptr;
  step.tokens = tok;
  step.positions = pos;
  step.cache_lengths = lengths;
  const std::vector<medusa::tree_mask_view> masks(static_cast<std::size_t>(B), {mask, (n + 31) / 32});
  step.request_masks = masks;
  step.logits = logits;
  step.hidden = hidden;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    e.forward(step);
    benchmark::DoNotOptimize(logits.data());
  }
  const double per_step = seconds_per_iteration(state, t0);
  static double one = 0;  // B = 1, N = 1 of this process
  if (B == 1 && n == 1) one = per_step;
  if (one > 0) state.counters["cost_vs_B1N1"] = per_step / one;
  state.counters["rows"] = B * n;
  state.counters["rows_per_s"] = benchmark::Counter(static_cast<double>(B * n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_batch_step)
    ->ArgsProduct({{1, 2, 4, 8, 16, 32}, {1, 6}})
    ->ArgNames({"B", "N"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

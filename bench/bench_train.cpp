// SPDX-License-Identifier: Apache-2.0
// Medusa head training step on the CPU (examples/train): one AdamW step of K heads over a batch
// of positions, at pycode-15m sizes (d 384, V 2048), and the evaluation forward.
#include <medusa_train/trainer.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

namespace {

struct setup {
  medusa_train::head_shape shape;
  std::vector<float> lm_head, x, hw;
  std::vector<std::int32_t> targets;
  setup(std::size_t K, std::size_t L, std::size_t B) : shape{384, 2048, K, L} {
    std::mt19937 rng(1);
    std::normal_distribution<float> n(0.0f, 1.0f);
    lm_head.resize(shape.V * shape.d);
    for (auto& v : lm_head) v = 0.05f * n(rng);
    x.resize(B * shape.d);
    for (auto& v : x) v = n(rng);
    targets.resize(B * K);
    for (auto& t : targets) t = static_cast<std::int32_t>(rng() % shape.V);
    hw.assign(K, 1.0f);
  }
};

// Args: heads, layers, batch, threads.
void BM_train_step(benchmark::State& state) {
  const auto K = static_cast<std::size_t>(state.range(0)), L = static_cast<std::size_t>(state.range(1));
  const auto B = static_cast<std::size_t>(state.range(2));
  setup s(K, L, B);
  medusa_train::head_trainer t(s.shape, s.lm_head.data(), 1, static_cast<int>(state.range(3)));
  medusa_train::optimizer_options o;
  for (auto _ : state) {
    auto st = t.step(s.x.data(), B, s.targets.data(), s.hw, 1e-3, o);
    benchmark::DoNotOptimize(st.loss);
  }
  state.counters["positions/s"] = benchmark::Counter(static_cast<double>(B) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_train_step)->Args({4, 1, 256, 1})->Args({4, 1, 256, 2})->Args({4, 1, 512, 2})->Args({4, 2, 256, 2})->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_head_logits(benchmark::State& state) {
  const auto B = static_cast<std::size_t>(state.range(0));
  setup s(4, 1, B);
  medusa_train::head_trainer t(s.shape, s.lm_head.data(), 1, static_cast<int>(state.range(1)));
  std::vector<float> out(B * 4 * s.shape.V);
  for (auto _ : state) {
    t.logits(s.x.data(), B, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["positions/s"] = benchmark::Counter(static_cast<double>(B) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_head_logits)->Args({256, 2})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

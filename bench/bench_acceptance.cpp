// SPDX-License-Identifier: Apache-2.0
// CPU cost of the per-step candidate and acceptance work: per-head top-k, tree verification
// (greedy / typical / rejection) on the 64-node mc_sim_7b_63 tree, and the whole step.
//   build/<dir>/bench/bench_acceptance --benchmark_min_time=0.5
#include <medusa/acceptance.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

namespace {

constexpr int num_heads = 4;

std::vector<float> normal_logits(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// A realistic step: LM-like logits (normal, sd 2) with a planted argmax chain of depth 3 through
// the tree, so greedy accepts 3 drafts and typical prepares a handful of parents.
struct step_fixture {
  medusa::tree t = medusa::tree::preset("mc_sim_7b_63");
  int vocab;
  std::vector<float> heads;
  std::vector<std::int32_t> tokens;
  std::vector<float> logits;

  explicit step_fixture(int v) : vocab(v) {
    heads = normal_logits(static_cast<std::size_t>(num_heads * vocab), 1, 2.0f);
    tokens.resize(static_cast<std::size_t>(t.num_nodes()));
    medusa::candidate_workspace cw(t, num_heads);
    cw.generate(t, 1, heads, vocab, tokens);
    logits = normal_logits(static_cast<std::size_t>(t.num_nodes()) * static_cast<std::size_t>(vocab), 2, 2.0f);
    // Path along rank 0 to depth 3.
    int u = 0;
    for (int d = 0; d < 3 && t.child_count(u) > 0; ++d) {
      const int c = t.child_begin(u);
      logits[static_cast<std::size_t>(u) * static_cast<std::size_t>(vocab) + static_cast<std::size_t>(tokens[static_cast<std::size_t>(c)])] = 20.0f;
      u = c;
    }
  }
  medusa::verify_request request(std::uint64_t step = 0) const {
    return {.node_tokens = tokens, .logits = logits, .vocab = vocab, .seed = 7, .step = step};
  }
};

void BM_TopK4Heads(benchmark::State& state) {
  const int vocab = static_cast<int>(state.range(0));
  const auto heads = normal_logits(static_cast<std::size_t>(num_heads * vocab), 3, 2.0f);
  std::vector<std::int32_t> ids(10);
  for (auto _ : state) {
    for (int h = 0; h < num_heads; ++h) {
      medusa::top_k(std::span<const float>(heads).subspan(static_cast<std::size_t>(h) * static_cast<std::size_t>(vocab),
                                                          static_cast<std::size_t>(vocab)),
                    ids);
      benchmark::DoNotOptimize(ids.data());
    }
  }
  state.SetItemsProcessed(state.iterations() * num_heads * vocab);
}
BENCHMARK(BM_TopK4Heads)->Arg(32000)->Arg(128256)->Unit(benchmark::kMicrosecond);

void BM_Candidates(benchmark::State& state) {
  step_fixture f(static_cast<int>(state.range(0)));
  medusa::candidate_workspace cw(f.t, num_heads);
  for (auto _ : state) {
    cw.generate(f.t, 1, f.heads, f.vocab, f.tokens);
    benchmark::DoNotOptimize(f.tokens.data());
  }
}
BENCHMARK(BM_Candidates)->Arg(32000)->Arg(128256)->Unit(benchmark::kMicrosecond);

template <class Policy>
void BM_Verify(benchmark::State& state, Policy policy) {
  step_fixture f(static_cast<int>(state.range(0)));
  medusa::acceptance_workspace ws(f.t.num_nodes(), f.vocab);
  std::uint64_t step = 0;
  int accepted = 0;
  for (auto _ : state) {
    const auto r = medusa::verify(f.t, f.request(step++), policy, ws);
    accepted += r.accept_length;
    benchmark::DoNotOptimize(r.bonus);
  }
  state.counters["mean_A"] = benchmark::Counter(accepted, benchmark::Counter::kAvgIterations);
}
BENCHMARK_CAPTURE(BM_Verify, greedy, medusa::greedy_policy{})->Arg(32000)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Verify, typical_T0_7, medusa::typical_policy{.temperature = 0.7f})
    ->Arg(32000)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Verify, rejection_T0_7, medusa::rejection_policy{{.temperature = 0.7f}})
    ->Arg(32000)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Verify, rejection_T0_7_topp0_9, medusa::rejection_policy{{.temperature = 0.7f, .top_p = 0.9f}})
    ->Arg(32000)
    ->Unit(benchmark::kMicrosecond);

// The whole per-step CPU acceptance work: top-k of 4 heads + gather + verify.
template <class Policy>
void BM_Step(benchmark::State& state, Policy policy) {
  step_fixture f(static_cast<int>(state.range(0)));
  medusa::candidate_workspace cw(f.t, num_heads);
  medusa::acceptance_workspace ws(f.t.num_nodes(), f.vocab);
  std::vector<std::int32_t> tokens(f.tokens.size());
  std::uint64_t step = 0;
  for (auto _ : state) {
    cw.generate(f.t, 1, f.heads, f.vocab, tokens);
    // Verify the fixture's tokens (same candidates) so the planted path is accepted.
    const auto r = medusa::verify(f.t, f.request(step++), policy, ws);
    benchmark::DoNotOptimize(r.bonus);
  }
}
BENCHMARK_CAPTURE(BM_Step, greedy, medusa::greedy_policy{})->Arg(32000)->Arg(128256)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Step, typical_T0_7, medusa::typical_policy{.temperature = 0.7f})
    ->Arg(32000)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Step, rejection_T0_7, medusa::rejection_policy{{.temperature = 0.7f}})
    ->Arg(32000)
    ->Unit(benchmark::kMicrosecond);

}  // namespace

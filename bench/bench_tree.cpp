// SPDX-License-Identifier: Apache-2.0
// Tree compiler cost: building every buffer of a run-time tree (64, 256, 1024 nodes) from paths,
// parsing + building a preset from its text, and the FlashInfer full-row stream.
// Axis: nodes (tree size, root included).
#include <medusa/drafts.hpp>
#include <medusa/tree.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

// A deterministic random prefix-closed tree with `n` nodes (topk 16, depth <= 8), shuffled.
std::vector<std::vector<int>> make_paths(int n) {
  std::mt19937 rng(static_cast<unsigned>(n));
  std::vector<std::vector<int>> nodes{{}};
  std::vector<std::set<int>> used(1);
  while (static_cast<int>(nodes.size()) < n) {
    const auto p = std::uniform_int_distribution<std::size_t>(0, nodes.size() - 1)(rng);
    if (nodes[p].size() >= 8 || used[p].size() >= 16) continue;
    int r;
    do r = std::uniform_int_distribution<int>(0, 15)(rng);
    while (used[p].count(r));
    used[p].insert(r);
    auto c = nodes[p];
    c.push_back(r);
    nodes.push_back(c);
    used.emplace_back();
  }
  nodes.erase(nodes.begin());
  std::shuffle(nodes.begin(), nodes.end(), rng);
  return nodes;
}

void BM_tree_build(benchmark::State& state) {
  const auto paths = make_paths(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    auto t = medusa::tree::from_paths(paths, {.topk = 16});
    benchmark::DoNotOptimize(t.packed_mask().data());
  }
  state.counters["nodes"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_tree_build)->ArgName("nodes")->Arg(64)->Arg(256)->Arg(1024);

void BM_tree_parse_preset_text(benchmark::State& state) {
  const std::string text(medusa::preset_text("mc_sim_7b_63"));
  for (auto _ : state) {
    auto t = medusa::tree::from_text(text);
    benchmark::DoNotOptimize(t.packed_mask().data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(text.size()));
}
BENCHMARK(BM_tree_parse_preset_text);

void BM_tree_parse_only(benchmark::State& state) {
  const std::string text(medusa::preset_text("mc_sim_7b_63"));
  for (auto _ : state) {
    auto p = medusa::parse_tree_text(text);
    benchmark::DoNotOptimize(p.data());
  }
}
BENCHMARK(BM_tree_parse_only);

void BM_full_row_stream(benchmark::State& state) {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const int L = static_cast<int>(state.range(0));
  std::vector<std::uint8_t> out(medusa::full_row_stream_bytes(t.num_nodes(), L));
  for (auto _ : state) {
    medusa::write_full_row_stream(t, L, out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_full_row_stream)->ArgName("prefix")->Arg(0)->Arg(1024);

}  // namespace

// Per-step drafts (drafts.hpp): the work a step_drafter adds to every tree step: the heads' top-k
// (and, for dynamic trees, their softmax), the lookup, and compiling the step's tree. Compare with
// a tree step of the engine (docs/performance.md: ~1.3 ms for pycode-15m on 2 threads).
// Arguments: vocabulary, 0 = fixed tree + lookup / 1 = dynamic tree + lookup.
static void BM_step_drafter(benchmark::State& state) {
  const int vocab = static_cast<int>(state.range(0)), heads = 4;
  const bool dynamic = state.range(1) != 0;
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::vector<float> logits(static_cast<std::size_t>(heads) * static_cast<std::size_t>(vocab));
  for (float& x : logits) x = n(rng);
  std::vector<std::int32_t> history;  // 400 tokens of code-like text that repeats itself
  for (int i = 0; i < 400; ++i) history.push_back(static_cast<std::int32_t>((i % 37) * 13 % vocab));
  medusa::step_drafter_options o;
  if (dynamic) o.dynamic_nodes = 6;
  else o.paths = {{0}, {1}, {0, 0}, {0, 0, 0}, {0, 0, 0, 0}};
  o.lookup = medusa::ngram_lookup{.min_ngram = 2, .max_ngram = 4, .max_tokens = 8};
  medusa::step_drafter d(o, heads);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(d.max_nodes()));
  for (auto _ : state) {
    auto t = d.draft(history, logits, vocab, tokens);
    benchmark::DoNotOptimize(t);
  }
}
BENCHMARK(BM_step_drafter)->ArgNames({"vocab", "dynamic"})->Args({2048, 0})->Args({2048, 1})->Args({32000, 0})->Args({32000, 1})->Unit(benchmark::kMicrosecond);

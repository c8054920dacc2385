// SPDX-License-Identifier: Apache-2.0
// Tree compiler cost: building every buffer of a run-time tree (64, 256, 1024 nodes) from paths,
// parsing + building a preset from its text, and the FlashInfer full-row stream.
// Axis: nodes (tree size, root included).
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

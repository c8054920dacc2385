// SPDX-License-Identifier: Apache-2.0
// The CUDA verification kernel bodies, run by the host emulation, against `medusa::verify`:
// greedy bit-exact, typical, rejection and speculative sampling with the same Philox seeds, for
// every preset (run-time trees) and a compile-time tree, batches, EOS, f32/bf16/f16 logits and
// data errors.
#include <doctest/doctest.h>
#include <medusa/acceptance.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/tree_arrays.hpp>
#include <medusa/cuda/kernels/verify.hpp>
#include <medusa/tree.hpp>
#include <medusa/tree/presets.hpp>

#include <cmath>
#include <algorithm>
#include <limits>
#include <random>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;

namespace {

struct batch_data {
  int batch = 0, nodes = 0, vocab = 0;
  std::vector<float> logits;         // [B][N][V]
  std::vector<std::int32_t> tokens;  // [B][N]
  std::vector<float> drafts;         // [B][N][V] (speculative)
  std::vector<std::uint64_t> seeds, steps;
  std::vector<std::int32_t> eos;
};

// Random rows; each node's token is its parent row's argmax with probability `hit`, else drawn
// from the node's draft row (a softmax of random logits), so every policy accepts some paths.
template <class Tree>
batch_data make_batch(const Tree& t, int batch, int vocab, std::uint32_t seed, double hit = 0.75,
                      bool mask_odd = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  batch_data d;
  d.batch = batch;
  d.nodes = t.num_nodes();
  d.vocab = vocab;
  const auto cells = static_cast<std::size_t>(batch) * static_cast<std::size_t>(d.nodes) * static_cast<std::size_t>(vocab);
  d.logits.resize(cells);
  d.drafts.resize(cells);
  for (auto& x : d.logits) x = normal(rng);
  if (mask_odd)  // every odd token masked (-Inf) in every row
    for (std::size_t i = 1; i < d.logits.size(); i += 2) d.logits[i] = -std::numeric_limits<float>::infinity();
  for (std::size_t r = 0; r < cells / static_cast<std::size_t>(vocab); ++r) {
    double sum = 0.0;
    float* q = d.drafts.data() + r * static_cast<std::size_t>(vocab);
    for (int i = 0; i < vocab; ++i) sum += q[i] = std::exp(normal(rng));
    for (int i = 0; i < vocab; ++i) q[i] = static_cast<float>(q[i] / sum);
  }
  d.tokens.resize(static_cast<std::size_t>(batch * d.nodes));
  for (int b = 0; b < batch; ++b) {
    for (int u = 0; u < d.nodes; ++u) {
      std::int32_t token = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(vocab));
      if (u > 0 && unit(rng) < hit) {
        const float* z = d.logits.data() + (static_cast<std::size_t>(b * d.nodes + t.parent(u))) * static_cast<std::size_t>(vocab);
        token = static_cast<std::int32_t>(std::max_element(z, z + vocab) - z);
      }
      d.tokens[static_cast<std::size_t>(b * d.nodes + u)] = token;
    }
    d.seeds.push_back(1000 + static_cast<std::uint64_t>(b) * 7919);
    d.steps.push_back(static_cast<std::uint64_t>(b) + 3);
    d.eos.push_back(-1);
  }
  return d;
}

struct outputs {
  std::vector<std::int32_t> accept_length, next_node, bonus, eos, best_row, nodes, tokens, status;
};

template <mk::verify_kind Kind, class T, class Tree>
outputs run_emulated(const Tree& t, const batch_data& d, float temperature) {
  const mk::verify_plan plan = mk::plan_verify(Kind, d.batch, d.nodes, t.depth(), d.vocab, temperature);
  std::vector<T> logits(d.logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = T(d.logits[i]);
  std::vector<unsigned char> workspace(plan.workspace_bytes);
  const auto b = static_cast<std::size_t>(d.batch);
  const int stride = t.depth() + 1;
  outputs o;
  for (auto* v : {&o.accept_length, &o.next_node, &o.bonus, &o.eos, &o.best_row, &o.status}) v->assign(b, -9);
  o.nodes.assign(b * static_cast<std::size_t>(stride), -9);
  o.tokens.assign(o.nodes.size(), -9);
  mk::verify_args<T> a;
  a.logits = logits.data();
  a.row_stride = d.vocab;
  a.node_tokens = d.tokens.data();
  a.draft_probs = d.drafts.data();
  a.seeds = d.seeds.data();
  a.steps = d.steps.data();
  a.eos_tokens = d.eos.data();
  a.temperature = temperature;
  a.path_stride = stride;
  a.accept_length = o.accept_length.data();
  a.next_node = o.next_node.data();
  a.bonus = o.bonus.data();
  a.eos = o.eos.data();
  a.best_row = o.best_row.data();
  a.path_nodes = o.nodes.data();
  a.path_tokens = o.tokens.data();
  a.status = o.status.data();
  REQUIRE(mk::bind_verify_workspace(plan, a, workspace.data(), workspace.size()));
  if constexpr (Kind == mk::verify_kind::greedy || Kind == mk::verify_kind::typical) {
    mc::emulate(plan.rows, [&](auto& ctx) { mk::node_rows<Kind>(ctx, a); });
    mc::emulate(plan.path, [&](auto& ctx) { mk::select_path<Kind>(ctx, t, a); });
  } else {
    mc::emulate(plan.path, [&](auto& ctx) { mk::sample_path<Kind == mk::verify_kind::speculative>(ctx, t, a); });
  }
  return o;
}

// Rounds logits to T and back, so the CPU sees what the kernels see.
template <class T>
batch_data rounded(batch_data d) {
  for (auto& x : d.logits) x = static_cast<float>(T(x));
  return d;
}

// `tree` is the CPU's tree, `kernel_tree` what the kernels read (the same tree, or its arrays).
template <mk::verify_kind Kind, class T, class Tree, class KernelTree, class Policy>
int compare(const Tree& tree, const KernelTree& kernel_tree, const batch_data& raw, const Policy& policy,
            float temperature) {
  const batch_data d = rounded<T>(raw);
  const outputs o = run_emulated<Kind, T>(kernel_tree, d, temperature);
  medusa::acceptance_workspace ws;
  int accepted_total = 0;
  const auto v = static_cast<std::size_t>(d.vocab);
  const auto n = static_cast<std::size_t>(d.nodes);
  for (int b = 0; b < d.batch; ++b) {
    CAPTURE(b);
    const auto bb = static_cast<std::size_t>(b);
    medusa::verify_request req{
        .node_tokens = std::span<const std::int32_t>(d.tokens).subspan(bb * n, n),
        .logits = std::span<const float>(d.logits).subspan(bb * n * v, n * v),
        .vocab = d.vocab,
        .draft_probs = std::span<const float>(d.drafts).subspan(bb * n * v, n * v),
        .seed = d.seeds[bb],
        .step = d.steps[bb],
        .eos_token = d.eos[bb]};
    const medusa::verify_result r = medusa::verify(tree, req, policy, ws);
    CHECK(o.status[bb] == 0);
    CHECK(o.accept_length[bb] == r.accept_length);
    CHECK(o.next_node[bb] == r.next_node);
    CHECK(o.bonus[bb] == r.bonus);
    CHECK(o.eos[bb] == (r.eos ? 1 : 0));
    CHECK(o.best_row[bb] == r.best_row);
    const auto stride = static_cast<std::size_t>(tree.depth() + 1);
    for (int j = 0; j <= r.accept_length; ++j) {
      CHECK(o.nodes[bb * stride + static_cast<std::size_t>(j)] == r.node_ids[static_cast<std::size_t>(j)]);
      CHECK(o.tokens[bb * stride + static_cast<std::size_t>(j)] == r.token_ids[static_cast<std::size_t>(j)]);
    }
    accepted_total += r.accept_length;
  }
  return accepted_total;
}

}  // namespace

TEST_CASE("greedy verification equals the CPU's for every preset, batched, f32/bf16/f16") {
  int accepted = 0;
  for (const auto name : medusa::preset_names()) {
    CAPTURE(name);
    const auto t = medusa::tree::preset(std::string(name));
    const std::vector<int> packed = mc::pack_tree(t);
    const auto view = mc::tree_arrays::over(t, packed.data());
    const auto d = make_batch(t, 3, 97, 7u);
    accepted += compare<mk::verify_kind::greedy, float>(t, view, d, medusa::greedy_policy{}, 0.0f);
  }
  CHECK(accepted > 20);  // the data makes paths of several drafts
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const std::vector<int> packed = mc::pack_tree(t);
  const auto view = mc::tree_arrays::over(t, packed.data());
  const auto d = make_batch(t, 2, 300, 9u);
  compare<mk::verify_kind::greedy, medusa::bfloat16>(t, view, d, medusa::greedy_policy{}, 0.0f);
  compare<mk::verify_kind::greedy, medusa::half>(t, view, d, medusa::greedy_policy{}, 0.0f);
}

TEST_CASE("a compile-time tree gives the same results as its run-time twin") {
  constexpr auto& st = medusa::presets::named<"mc_sim_7b_63">;
  const auto d = make_batch(st, 3, 120, 21u);
  compare<mk::verify_kind::greedy, float>(st, st, d, medusa::greedy_policy{}, 0.0f);
  compare<mk::verify_kind::typical, float>(st, st, d, medusa::typical_policy{.temperature = 0.7f}, 0.7f);
  compare<mk::verify_kind::rejection, float>(st, st, d, medusa::rejection_policy{{.temperature = 0.8f}}, 0.8f);
}

TEST_CASE("typical verification equals the CPU's decisions") {
  for (const char* text : {"mc_sim_7b_63", "[[0],[0,0],[0,0,0],[0,0,0,0]]", "vicuna_7b_stage2"}) {
    CAPTURE(text);
    const auto t = text[0] == '[' ? medusa::tree::from_text(text) : medusa::tree::preset(text);
    const std::vector<int> packed = mc::pack_tree(t);
    const auto view = mc::tree_arrays::over(t, packed.data());
    const auto d = make_batch(t, 4, 150, 33u);
    for (const float temp : {0.0f, 0.7f, 1.3f}) {
      CAPTURE(temp);
      compare<mk::verify_kind::typical, float>(t, view, d, medusa::typical_policy{.temperature = temp}, temp);
    }
  }
}

TEST_CASE("rejection and speculative sampling draw the same paths and bonus tokens as the CPU") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const std::vector<int> packed = mc::pack_tree(t);
  const auto view = mc::tree_arrays::over(t, packed.data());
  int accepted = 0;
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    auto d = make_batch(t, 4, 64, seed, 0.9);
    for (const float temp : {0.0f, 0.5f, 1.0f}) {
      CAPTURE(temp);
      accepted += compare<mk::verify_kind::rejection, float>(t, view, d, medusa::rejection_policy{{.temperature = temp}}, temp);
      accepted += compare<mk::verify_kind::speculative, float>(t, view, d, medusa::speculative_policy{{.temperature = temp}}, temp);
    }
  }
  CHECK(accepted > 10);
}

TEST_CASE("an accepted EOS draft ends the path without a bonus, per request") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const std::vector<int> packed = mc::pack_tree(t);
  const auto view = mc::tree_arrays::over(t, packed.data());
  auto d = make_batch(t, 3, 80, 5u, 1.0);
  // Request 0 stops at its first accepted draft; request 2 has no EOS.
  d.eos = {d.tokens[1], d.tokens[static_cast<std::size_t>(d.nodes) + 1], -1};
  compare<mk::verify_kind::greedy, float>(t, view, d, medusa::greedy_policy{}, 0.0f);
  compare<mk::verify_kind::rejection, float>(t, view, d, medusa::rejection_policy{{.temperature = 0.0f}}, 0.0f);
  const outputs o = run_emulated<mk::verify_kind::greedy, float>(view, d, 0.0f);
  CHECK(o.eos[0] == 1);
  CHECK(o.bonus[0] == -1);
}

TEST_CASE("bad data marks its own request; the others are verified") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const std::vector<int> packed = mc::pack_tree(t);
  const auto view = mc::tree_arrays::over(t, packed.data());
  auto d = make_batch(t, 3, 50, 8u, 1.0);
  d.logits[static_cast<std::size_t>(0 * d.nodes) * 50 + 3] = std::numeric_limits<float>::quiet_NaN();  // request 0, root row
  d.tokens[static_cast<std::size_t>(2 * d.nodes + 5)] = 50;                                              // request 2, out of range
  for (const auto kind : {0, 1}) {
    const outputs o = kind == 0 ? run_emulated<mk::verify_kind::greedy, float>(view, d, 0.0f)
                                : run_emulated<mk::verify_kind::rejection, float>(view, d, 0.7f);
    CHECK(o.status[0] == static_cast<std::int32_t>(mc::request_status::non_finite_logit));
    CHECK(o.status[1] == 0);
    CHECK(o.status[2] == static_cast<std::int32_t>(mc::request_status::token_out_of_range));
    CHECK(o.bonus[0] == -1);
    CHECK(o.accept_length[2] == 0);
  }
  auto s = make_batch(t, 1, 50, 9u, 1.0);
  s.drafts[static_cast<std::size_t>(1) * 50 + 4] = -0.5f;  // node 1's draft row
  const outputs o = run_emulated<mk::verify_kind::speculative, float>(view, s, 0.7f);
  CHECK(o.status[0] == static_cast<std::int32_t>(mc::request_status::bad_draft));
}

TEST_CASE("verify plans refuse what the kernels do not implement") {
  CHECK_THROWS_AS(mk::plan_verify(mk::verify_kind::greedy, 0, 10, 2, 100), mc::launch_error);
  CHECK_THROWS_AS(mk::plan_verify(mk::verify_kind::greedy, 1, 300, 2, 100), mc::launch_error);
  CHECK_THROWS_WITH_AS(mk::plan_verify(mk::verify_kind::rejection, 1, 10, 2, 100, 0.7f, 40),
                       doctest::Contains("temperature only"), mc::launch_error);
  CHECK_THROWS_AS(mk::plan_verify(mk::verify_kind::typical, 1, 10, 2, 100, -1.0f), mc::launch_error);
}

TEST_CASE("masked logits (-Inf on half the tokens) verify as on the CPU for every policy") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const std::vector<int> packed = mc::pack_tree(t);
  const auto view = mc::tree_arrays::over(t, packed.data());
  int accepted = 0;
  for (std::uint32_t seed = 1; seed <= 3; ++seed) {
    auto d = make_batch(t, 3, 96, seed, 0.85, /*mask_odd=*/true);
    d.tokens[5] |= 1;  // a masked draft token
    accepted += compare<mk::verify_kind::greedy, float>(t, view, d, medusa::greedy_policy{}, 0.0f);
    compare<mk::verify_kind::greedy, medusa::bfloat16>(t, view, d, medusa::greedy_policy{}, 0.0f);
    compare<mk::verify_kind::typical, float>(t, view, d, medusa::typical_policy{.temperature = 0.7f}, 0.7f);
    compare<mk::verify_kind::rejection, float>(t, view, d, medusa::rejection_policy{{.temperature = 0.9f}}, 0.9f);
    compare<mk::verify_kind::speculative, float>(t, view, d, medusa::speculative_policy{{.temperature = 0.9f}}, 0.9f);
  }
  CHECK(accepted > 5);
  // A read row with every token masked is a data error of its request only.
  auto d = make_batch(t, 2, 64, 4u, 0.85, true);
  std::fill(d.logits.begin(), d.logits.begin() + 64, -std::numeric_limits<float>::infinity());
  const outputs o = run_emulated<mk::verify_kind::greedy, float>(view, d, 0.0f);
  CHECK(o.status[0] == static_cast<std::int32_t>(mc::request_status::non_finite_logit));
  CHECK(o.status[1] == 0);
}

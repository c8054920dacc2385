// SPDX-License-Identifier: Apache-2.0
// An EAGLE-style feature drafter as the branch of a step drafter (feature_draft.hpp): the decoders
// hand it the target's features of every prompt position and every committed token, in order, and
// they are the target's own hidden states (an oracle drafter recomputes them); an oracle that
// predicts the target exactly gets every draft accepted; any drafter decodes exactly as plain greedy
// decoding, alone or beside the heads' tree, for one request or a batch whose requests keep their
// own drafter caches (freed when they leave); the catch-up runs each position about once; bad
// shapes and out-of-order features are refused with errors that name them. Chains sampled from a
// feature drafter's own distribution (`feature_draft_sampler`) and verified against their rows keep
// the target's distribution (chi-square), the oracle's every draft accepted; T = 0 is greedy.
#include "sampled_chains.hpp"
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/draft_sampler.hpp>
#include <medusa/drafts.hpp>
#include <medusa/feature_draft.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using tiny::random_heads;
using tiny::tiny_model;

constexpr int capacity = 512;
constexpr int V = tiny_model::vocab, D = tiny_model::dim;
const std::vector<std::int32_t> prompt = {1, 5, 9, 13, 2, 7};

// Predicts the target exactly: it rebuilds each request's tokens from its rows (row i carries
// t_{i+1}; t_0 is the prompt's first token) and runs a copy of the target over them from scratch.
// Every feature it is given must be the target's hidden state at that position.
struct oracle_drafter {
  tiny_model target{capacity};
  std::map<int, std::vector<std::int32_t>> seqs;
  std::map<int, std::int32_t> first;  // t_0 of each request (default: prompt[0])
  int checked = 0, mismatches = 0;

  int vocab_size() const { return V; }
  int hidden_size() const { return D; }
  int max_context() const { return capacity - 1; }
  void release(int request) { seqs.erase(request); }
  void forward(const medusa::feature_batch& b) {
    const auto f = first.find(b.request);
    auto& seq = seqs.try_emplace(b.request, std::vector<std::int32_t>{f == first.end() ? prompt[0] : f->second}).first->second;
    REQUIRE(b.cache_length <= static_cast<int>(seq.size()) - 1);
    seq.resize(static_cast<std::size_t>(b.cache_length) + 1);
    for (std::size_t i = 0; i < b.tokens.size(); ++i) {
      REQUIRE(b.positions[i] == b.cache_length + static_cast<int>(i));
      seq.push_back(b.tokens[i]);
    }
    const tiny::sequence_outputs all = tiny::outputs_of(target, seq);
    for (std::size_t i = 0; i < b.tokens.size(); ++i) {  // row i's feature: the hidden state at its position
      const auto p = static_cast<std::size_t>(b.positions[i]);
      for (int c = 0; c < D; ++c)
        if (std::abs(b.features[i * D + static_cast<std::size_t>(c)] - all.hidden[p * D + static_cast<std::size_t>(c)]) > 1e-4f) {
          ++mismatches;
          break;
        }
      ++checked;
    }
    const std::size_t last = seq.size() - 1;
    std::copy_n(all.logits.begin() + static_cast<std::ptrdiff_t>(last * V), V, b.logits.begin());
    std::copy_n(all.hidden.begin() + static_cast<std::ptrdiff_t>(last * D), D, b.hidden.begin());
  }
};

// A drafter unlike the target: random maps of (feature, token) to logits and a predicted feature,
// plus a term from every cached slot of its request, so that a wrong cache changes its drafts.
struct random_drafter {
  std::vector<float> a, bt, c;
  std::map<int, std::vector<float>> caches;  // per request: one value per slot
  int vocab_size() const { return V; }
  int hidden_size() const { return D; }
  int max_context() const { return capacity; }
  void release(int request) { caches.erase(request); }
  explicit random_drafter(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto* w : {&a, &c}) {
      w->resize(static_cast<std::size_t>(V) * D);
      for (float& x : *w) x = n(rng) * 0.3f;
    }
    bt.resize(static_cast<std::size_t>(V) * V);
    for (float& x : bt) x = n(rng);
  }
  void forward(const medusa::feature_batch& b) {
    auto& slots = caches[b.request];
    REQUIRE(b.cache_length <= static_cast<int>(slots.size()));
    slots.resize(static_cast<std::size_t>(b.cache_length));
    float sum = 0;
    for (float s : slots) sum += s;
    std::vector<float> logits(V), hidden(D);
    for (std::size_t i = 0; i < b.tokens.size(); ++i) {
      const float* f = b.features.data() + i * D;
      float fs = 0;
      for (int k = 0; k < D; ++k) fs += f[k];
      slots.push_back(0.01f * fs + static_cast<float>(b.tokens[i]));
      sum += slots.back();
      for (int v = 0; v < V; ++v) {
        float z = bt[static_cast<std::size_t>(b.tokens[i]) * V + static_cast<std::size_t>(v)] + std::sin(0.01f * sum + static_cast<float>(v));
        for (int k = 0; k < D; ++k) z += a[static_cast<std::size_t>(v) * D + static_cast<std::size_t>(k)] * f[k];
        logits[static_cast<std::size_t>(v)] = z;
      }
      for (int k = 0; k < D; ++k) hidden[static_cast<std::size_t>(k)] = std::tanh(f[k] + c[static_cast<std::size_t>(b.tokens[i]) * D + static_cast<std::size_t>(k)]);
    }
    std::copy(logits.begin(), logits.end(), b.logits.begin());
    std::copy(hidden.begin(), hidden.end(), b.hidden.begin());
  }
};

medusa::decode_options tokens(int n) {
  medusa::decode_options opt;
  opt.max_new_tokens = n;
  return opt;
}

}  // namespace

TEST_CASE("an oracle feature drafter: the features are the target's, every draft accepted, tokens equal plain decoding") {
  tiny_model target(capacity);
  const auto opt = tokens(90);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  for (const int k : {1, 4}) {
    CAPTURE(k);
    oracle_drafter oracle;
    medusa::feature_draft_branch<oracle_drafter> b(oracle, V, D, {.max_tokens = k});
    random_heads heads(2, 3);
    medusa::decoder dec(target, heads, medusa::basic_step_drafter<decltype(b)>({.lookup = b}, 2), medusa::greedy_policy{});
    const auto r = dec.generate(prompt, opt);
    CHECK(r.tokens == plain.tokens);
    CHECK(oracle.checked > 0);
    CHECK(oracle.mismatches == 0);
    const int per_step = k + 1;
    CHECK(r.stats.steps <= (r.stats.new_tokens + per_step - 1) / per_step + 1);
    // Each position is caught up once; each step adds at most k − 1 predicted rows.
    CHECK(b.tokens_run() <= static_cast<std::int64_t>(prompt.size()) + r.stats.new_tokens + static_cast<std::int64_t>(r.stats.steps) * (k - 1));
    MESSAGE(k << "-token chains: " << r.stats.steps << " steps for " << r.stats.new_tokens << " tokens; the drafter ran "
              << b.tokens_run() << " rows in " << b.passes() << " passes");
  }
}

TEST_CASE("a feature drafter unlike the target is lossless, alone and beside the heads' tree") {
  tiny_model target(capacity);
  const auto opt = tokens(120);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  random_drafter drafter(3);
  medusa::feature_draft_branch<random_drafter> b(drafter, V, D, {.max_tokens = 5});
  random_heads heads(3, 4);
  medusa::decoder alone(target, heads, medusa::basic_step_drafter<decltype(b)>({.lookup = b}, 3), medusa::greedy_policy{});
  CHECK(alone.generate(prompt, opt).tokens == plain.tokens);
  b.release(0);
  medusa::decoder both(target, heads, medusa::basic_step_drafter<decltype(b)>({.paths = {{0}, {1}, {0, 0}}, .lookup = b}, 3),
                       medusa::greedy_policy{});
  CHECK(both.generate(prompt, opt).tokens == plain.tokens);
}

TEST_CASE("a batch keeps one drafter cache per request, each decoding as plain greedy, freed when it leaves") {
  tiny_model target(capacity);
  tiny::batch_engine engine(target, capacity);
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 5, 9, 13}, {3, 3, 8}, {20, 1, 2, 30, 4, 11, 6}};
  for (const bool oracle_kind : {true, false}) {
    CAPTURE(oracle_kind);
    oracle_drafter oracle;
    random_drafter rnd(5);
    auto run = [&](auto& model) {
      medusa::feature_draft_branch<std::remove_reference_t<decltype(model)>> b(model, V, D, {.max_tokens = 3});
      medusa::no_heads none;
      medusa::batch_decoder dec(engine, none, medusa::basic_step_drafter<decltype(b)>({.lookup = b}, 1), medusa::greedy_policy{}, 4);
      tiny::check_batch_lossless(dec, prompts, capacity);
    };
    if (oracle_kind) {
      for (int r = 0; r < 3; ++r) oracle.first[10 + r] = prompts[static_cast<std::size_t>(r)][0];
      run(oracle);
      CHECK(oracle.seqs.empty());
      CHECK(oracle.checked > 0);
      CHECK(oracle.mismatches == 0);
    } else {
      run(rnd);
      CHECK(rnd.caches.empty());
    }
  }
}

TEST_CASE("a feature drafter refuses another shape, features out of order and drafting without them") {
  random_drafter d(1);
  using branch = medusa::feature_draft_branch<random_drafter>;
  try {
    branch(d, V + 1, D);
    FAIL("expected invalid_input");
  } catch (const medusa::invalid_input& e) {
    CHECK(std::string(e.what()).find(std::to_string(V + 1)) != std::string::npos);
  }
  CHECK_THROWS_AS(branch(d, V, D + 1), medusa::invalid_input);
  CHECK_THROWS_AS(branch(d, V, D, {.max_tokens = 0}), medusa::invalid_input);
  branch b(d, V, D);
  std::vector<float> rows(3 * D, 0.5f);
  CHECK_THROWS_AS(b.observe(0, 0, std::span<const float>(rows).first(D + 1)), medusa::invalid_input);
  b.observe(0, 0, rows);
  CHECK_THROWS_WITH_AS(b.observe(0, 5, rows), doctest::Contains("position 5 where position 3"), medusa::invalid_input);
  std::vector<std::int32_t> out(4);
  const std::vector<std::int32_t> history = {1, 2, 3, 4, 5, 6};  // needs 5 features, has 3
  CHECK_THROWS_WITH_AS(b.find(0, history, out), doctest::Contains("needs 5"), medusa::invalid_input);
  const std::vector<std::int32_t> four = {1, 2, 3, V};
  CHECK_THROWS_AS(b.find(0, four, out), medusa::invalid_input);
  const std::vector<std::int32_t> ok = {1, 2, 3, 4};
  CHECK(b.find(0, ok, out) == 4);
}

TEST_CASE("sampled feature-drafter chains keep the target's distribution; T = 0 is greedy decoding") {
  tiny_model target(capacity);
  const medusa::sampling_warp warps[] = {{.temperature = 1.0f}, {.temperature = 0.7f, .top_p = 0.9f}};
  for (const auto& w : warps)
    for (const bool oracle_kind : {false, true}) {
      oracle_drafter oracle;
      random_drafter rnd(7);
      auto check = [&](auto& model) {
        const medusa::feature_draft_sampler<std::remove_reference_t<decltype(model)>> drafts(model, V, D, {.max_tokens = 3, .warp = w});
        const auto r = sampled_chains::first_three(target, prompt, drafts, w, sampled_chains::trials / 3);
        INFO("T=" << w.temperature << " top_p=" << w.top_p << std::string(oracle_kind ? " (oracle)" : " (random drafter)"));
        MESSAGE("T=" << w.temperature << " top_p=" << w.top_p << std::string(oracle_kind ? " (oracle)" : " (random drafter)")
                     << ": chi2(first two)=" << r.first_two.stat << "/" << r.first_two.dof << " p=" << r.first_two.p
                     << ", tokens/step=" << r.per_step);
        CHECK(!r.first_two.impossible);
        CHECK(r.first.p > 0.001);
        CHECK(r.first_two.p > 0.001);
        CHECK(!r.second_third.impossible);
        CHECK(r.second_third.p > 0.001);
        if (oracle_kind) CHECK(r.per_step > 2.9);  // q = p: every draft accepted (3 tokens, the limit)
        else CHECK(r.per_step > 1.01);
      };
      if (oracle_kind) check(oracle);
      else check(rnd);
    }
  random_drafter rnd(8);
  const auto opt = tokens(60);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  const medusa::feature_draft_sampler<random_drafter> drafts(rnd, V, D, {.max_tokens = 4, .warp = {.temperature = 0.0f}});
  medusa::no_heads none;
  medusa::decoder dec(target, none, drafts, medusa::speculative_policy{{.temperature = 0.0f}});
  CHECK(dec.generate(prompt, opt).tokens == plain.tokens);
  CHECK_THROWS_AS(medusa::feature_draft_sampler<random_drafter>(rnd, V, D + 1, {}), medusa::invalid_input);
}

// SPDX-License-Identifier: Apache-2.0
// Speculative sampling with a draft model (draft_sampler.hpp): chains sampled from the draft's own
// warped distribution and verified with `speculative_policy` against each node's draft row keep
// the target's distribution exactly (chi-square on the first three generated tokens through the
// decoder, a draft unlike the target and the target as its own draft, several warps); the test
// catches a biased variant; T = 0 is greedy decoding; the rows are the distributions drawn from.
#include "sampled_chains.hpp"

#include <medusa/decoder.hpp>
#include <medusa/draft_sampler.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace {

using sampled_chains::last_logits;
using sampled_chains::trials;
using stats::reference_warp;
using tiny::tiny_model;

constexpr int V = tiny_model::vocab;
const std::vector<std::int32_t> prompt = {1, 5, 9, 13};

// A sampler whose rows claim a hotter distribution than the one drawn from: biased.
template <class Draft>
struct claims_hotter {
  medusa::draft_model_sampler<Draft> inner;
  std::vector<float> hot;
  int max_nodes() const { return inner.max_nodes(); }
  int max_depth() const { return inner.max_depth(); }
  int heads_depth() const { return 0; }
  std::optional<medusa::tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> hl, int vocab,
                                    std::span<std::int32_t> tokens, std::uint64_t seed, std::uint64_t step) {
    auto t = inner.draft(request, history, hl, vocab, tokens, seed, step);
    const auto rows = inner.draft_probs(request);
    hot.assign(rows.begin(), rows.end());
    for (std::size_t u = 1; u * V < hot.size(); ++u) {  // flatten each row halfway towards uniform
      float* q = hot.data() + u * V;
      for (int x = 0; x < V; ++x) q[x] = 0.5f * q[x] + 0.5f / V;
    }
    return t;
  }
  std::span<const float> draft_probs(int) const { return hot; }
};

// The first three tokens through the decoder, after this file's prompt.
template <class Drafts>
sampled_chains::result first_three(tiny_model& target, const Drafts& drafts, const medusa::sampling_warp& warp, int n) {
  return sampled_chains::first_three(target, prompt, drafts, warp, n);
}

}  // namespace

TEST_CASE("sampled draft chains verified with their rows keep the target's distribution") {
  tiny_model target(64), unlike(64, 11), same(64);  // same seed as the target: the same model
  const medusa::sampling_warp warps[] = {{.temperature = 1.0f}, {.temperature = 0.7f, .top_p = 0.9f}, {.temperature = 1.3f, .top_k = 6}};
  for (const auto& w : warps)
    for (tiny_model* d : {&unlike, &same}) {
      const medusa::draft_model_sampler<tiny_model> drafts(*d, V, {.max_tokens = 3, .warp = w});
      const auto r = first_three(target, drafts, w, trials);
      const std::string which = d == &same ? " (the target as draft)" : " (another model as draft)";
      INFO("T=" << w.temperature << " top_p=" << w.top_p << " top_k=" << w.top_k << which);
      MESSAGE("T=" << w.temperature << " top_p=" << w.top_p << " top_k=" << w.top_k << which
                   << ": chi2(first)=" << r.first.stat << "/" << r.first.dof << " p=" << r.first.p << ", chi2(first two)="
                   << r.first_two.stat << "/" << r.first_two.dof << " p=" << r.first_two.p << ", tokens/step=" << r.per_step);
      CHECK(!r.first.impossible);
      CHECK(!r.first_two.impossible);
      CHECK(r.first.p > 0.001);
      CHECK(r.first_two.p > 0.001);
      CHECK(!r.second_third.impossible);
      CHECK(r.second_third.p > 0.001);
      if (d == &same) CHECK(r.per_step > 2.9);  // q = p: every draft accepted (3 tokens, the limit)
      else CHECK(r.per_step > 1.05);            // some drafts accepted: the residual path is exercised too
    }
}

TEST_CASE("the chi-square check catches rows that are not the distribution drawn from") {
  tiny_model target(64), unlike(64, 11);
  const medusa::sampling_warp w{.temperature = 1.0f};
  const claims_hotter<tiny_model> biased{medusa::draft_model_sampler<tiny_model>(unlike, V, {.max_tokens = 3, .warp = w}), {}};
  const auto r = first_three(target, biased, w, sampled_chains::power_trials);
  MESSAGE("biased rows: chi2(first two)=" << r.first_two.stat << "/" << r.first_two.dof << " p=" << r.first_two.p);
  CHECK(r.first_two.p < 1e-6);  // the first token is the prefill's own draw: the drafts decide the second
}

TEST_CASE("T = 0: sampled chains are greedy chains, and decoding equals plain greedy decoding") {
  tiny_model target(128), unlike(128, 11);
  medusa::decode_options opt;
  opt.max_new_tokens = 60;
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  const medusa::draft_model_sampler<tiny_model> drafts(unlike, V, {.max_tokens = 4, .warp = {.temperature = 0.0f}});
  medusa::no_heads heads;
  medusa::decoder dec(target, heads, drafts, medusa::speculative_policy{{.temperature = 0.0f}});
  CHECK(dec.generate(prompt, opt).tokens == plain.tokens);
}

TEST_CASE("each node's row is the warped draft distribution its token was drawn from") {
  tiny_model draft(64, 11);
  medusa::draft_model_sampler<tiny_model> s(draft, V, {.max_tokens = 3, .warp = {.temperature = 0.8f}});
  CHECK(s.draft_probs(0).empty());
  std::vector<std::int32_t> tokens(4), history = prompt;
  const auto t = s.draft(0, history, {}, V, tokens, 5, 1);
  REQUIRE(t);
  CHECK(t->num_nodes() == 4);
  CHECK(tokens[0] == prompt.back());
  const auto rows = s.draft_probs(0);
  REQUIRE(rows.size() == 4u * V);
  tiny_model fresh(64, 11);
  auto ctx = prompt;
  for (int u = 1; u <= 3; ++u) {
    const auto expect = reference_warp(last_logits(fresh, ctx).data(), V, 0.8, 0, 1.0);
    double sum = 0;
    for (int x = 0; x < V; ++x) {
      CHECK(rows[static_cast<std::size_t>(u * V + x)] == doctest::Approx(expect[static_cast<std::size_t>(x)]).epsilon(1e-4));
      sum += rows[static_cast<std::size_t>(u * V + x)];
    }
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-5));
    CHECK(rows[static_cast<std::size_t>(u * V + tokens[static_cast<std::size_t>(u)])] > 0.0f);
    ctx.push_back(tokens[static_cast<std::size_t>(u)]);
  }
  // Another seed, other draws (the same rows for the first node: the same context).
  std::vector<std::int32_t> other(4);
  int differ = 0;
  for (std::uint64_t seed = 6; seed < 16; ++seed) {
    s.release(0);
    (void)s.draft(0, history, {}, V, other, seed, 1);
    differ += other[1] != tokens[1];
  }
  CHECK(differ > 0);
  CHECK_THROWS_AS(medusa::draft_model_sampler<tiny_model>(draft, V + 1, {}), medusa::invalid_input);
  CHECK_THROWS_AS(medusa::draft_model_sampler<tiny_model>(draft, V, {.max_tokens = 0, .warp = {}}), medusa::invalid_input);
  CHECK_THROWS_AS(medusa::draft_model_sampler<tiny_model>(draft, V, {.warp = {.temperature = -1.0f}}), medusa::acceptance_error);
}

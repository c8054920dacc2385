// SPDX-License-Identifier: Apache-2.0
// Per-step drafts through the decoder (step_drafter, drafts.hpp): a drafter over a fixed tree
// decodes exactly as that tree; dynamic trees, lookup branches and both are lossless against
// plain greedy decoding; a lookup finds the loops of a repetitive continuation.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/drafts.hpp>

#include <doctest/doctest.h>

#include <limits>
#include <vector>

namespace {

using tiny::oracle_heads;
using tiny::random_heads;
using tiny::tiny_model;

const std::vector<std::int32_t> prompt = {1, 5, 9, 13, 2, 7};

oracle_heads oracle_for(tiny_model& model, const std::vector<std::int32_t>& p, const medusa::decode_result& plain, int heads) {
  oracle_heads o{heads, p, {}};
  o.sequence.insert(o.sequence.end(), plain.tokens.begin(), plain.tokens.end());
  o.states = tiny::states_of(model, o.sequence);
  return o;
}

}  // namespace

TEST_CASE("a step drafter over a fixed tree decodes exactly as that tree") {
  tiny_model model(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 80;
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  auto heads = oracle_for(model, prompt, plain, 4);
  for (const char* name : {"mc_sim_7b_63", "vicuna_33b_stage1"}) {
    CAPTURE(name);
    const medusa::tree t = medusa::tree::preset(name);
    medusa::decoder fixed(model, heads, t, medusa::greedy_policy{});
    const auto a = fixed.generate(prompt, opt);
    medusa::decoder drafted(model, heads, medusa::step_drafter({.paths = t.sorted_paths()}, 4), medusa::greedy_policy{});
    const auto b = drafted.generate(prompt, opt);
    CHECK(a.tokens == plain.tokens);
    CHECK(b.tokens == plain.tokens);
    CHECK(b.stats.steps == a.stats.steps);
    CHECK(b.stats.accepted_histogram == a.stats.accepted_histogram);
  }
}

TEST_CASE("dynamic trees, lookup branches and both are lossless (greedy, rejection at T = 0, typical runs)") {
  tiny_model model(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 120;
  // A repetitive prompt: the tiny model's greedy continuation loops, so lookups find matches.
  const std::vector<std::int32_t> loop_prompt = {1, 5, 9, 13, 5, 9, 13, 5, 9, 13, 5};
  for (const auto& p : {prompt, loop_prompt}) {
    const auto plain = medusa::generate_vanilla(model, p, medusa::greedy_policy{}, opt);
    auto oracle = oracle_for(model, p, plain, 4);
    random_heads rnd(4, 3);
    const medusa::ngram_lookup look{.min_ngram = 1, .max_ngram = 3, .max_tokens = 8};
    const std::vector<medusa::step_drafter_options> configs = {
        {.dynamic_nodes = 2}, {.dynamic_nodes = 6}, {.dynamic_nodes = 16},
        {.paths = {{0}, {0, 0}, {1}}, .lookup = look}, {.dynamic_nodes = 6, .lookup = look}, {.lookup = look}};
    for (std::size_t c = 0; c < configs.size(); ++c) {
      CAPTURE(c);
      const medusa::step_drafter drafter(configs[c], 4);
      medusa::decoder a(model, oracle, drafter, medusa::greedy_policy{});
      const auto ra = a.generate(p, opt);
      CHECK(ra.tokens == plain.tokens);
      CHECK(ra.stats.steps <= ra.stats.new_tokens);
      medusa::decoder b(model, rnd, drafter, medusa::greedy_policy{});
      CHECK(b.generate(p, opt).tokens == plain.tokens);
      medusa::rejection_policy greedy_rejection;
      greedy_rejection.temperature = 0.0f;
      medusa::decoder c0(model, rnd, drafter, greedy_rejection);
      CHECK(c0.generate(p, opt).tokens == plain.tokens);
      medusa::decoder t(model, oracle, drafter, medusa::typical_policy{.temperature = 0.0f});  // the oracle follows greedy paths
      CHECK(t.generate(p, opt).tokens.size() == plain.tokens.size());
    }
  }
}

TEST_CASE("a lookup alone accepts the loops of a repetitive continuation, and plain steps elsewhere") {
  tiny_model model(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 150;
  const std::vector<std::int32_t> loop_prompt = {1, 5, 9, 13, 5, 9, 13, 5, 9, 13, 5};
  const auto plain = medusa::generate_vanilla(model, loop_prompt, medusa::greedy_policy{}, opt);
  random_heads rnd(2, 9);
  medusa::decoder dec(model, rnd, medusa::step_drafter({.lookup = medusa::ngram_lookup{.min_ngram = 1, .max_tokens = 8}}, 2),
                      medusa::greedy_policy{});
  const auto r = dec.generate(loop_prompt, opt);
  CHECK(r.tokens == plain.tokens);
  // Whether the continuation repeats itself decides how much a lookup accepts: count the
  // positions whose token a 1-gram lookup over the history would have predicted.
  std::vector<std::int32_t> h(loop_prompt);
  int predictable = 0;
  for (std::int32_t t : plain.tokens) {
    std::int32_t next[1] = {-1};
    if (medusa::ngram_lookup{.min_ngram = 1, .max_ngram = 3, .max_tokens = 1}.find(h, next) == 1 && next[0] == t) ++predictable;
    h.push_back(t);
  }
  INFO("predictable " << predictable << " of " << plain.tokens.size() << ", steps " << r.stats.steps);
  if (predictable > 30) CHECK(r.stats.steps < r.stats.new_tokens);  // some lookups were accepted
  CHECK(r.stats.steps <= r.stats.new_tokens);
}

TEST_CASE("bad drafter options are refused") {
  CHECK_THROWS_AS(medusa::step_drafter({}, 4), medusa::invalid_input);  // nothing to draft
  CHECK_THROWS_AS(medusa::step_drafter({.dynamic_nodes = 4}, 0), medusa::invalid_input);
  CHECK_THROWS_AS(medusa::step_drafter({.dynamic_nodes = -1}, 4), medusa::invalid_input);
  CHECK_THROWS_AS(medusa::step_drafter({.paths = {{0}, {0, 0}, {0, 0, 0}}}, 2), medusa::tree_error);  // deeper than the heads
  CHECK_THROWS_AS(medusa::step_drafter({.paths = {{0}}, .lookup = medusa::ngram_lookup{.max_tokens = 0}}, 2), medusa::invalid_input);
}

TEST_CASE("a step whose drafts cannot be built fails its request with the drafter's error") {
  tiny_model model(128);
  struct nan_heads {
    int num_heads() const { return 2; }
    void forward(std::span<const float>, std::span<float> logits) const {
      for (float& x : logits) x = std::numeric_limits<float>::quiet_NaN();
    }
  } heads;
  medusa::decode_options opt;
  opt.max_new_tokens = 8;
  medusa::decoder dec(model, heads, medusa::step_drafter({.dynamic_nodes = 4}, 2), medusa::greedy_policy{});
  CHECK_THROWS_AS(dec.generate(prompt, opt), medusa::acceptance_error);
  // The decoder is still usable afterwards: with a lookup alone (no heads read), it decodes.
  medusa::decoder lookup_only(model, heads, medusa::step_drafter({.lookup = medusa::ngram_lookup{}}, 2), medusa::greedy_policy{});
  CHECK(lookup_only.generate(prompt, opt).tokens == medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt).tokens);
}

// SPDX-License-Identifier: Apache-2.0
// The decoding loop on the tiny transformer of tiny_transformer.hpp (2 layers, GQA, RoPE, SiLU MLP,
// library tree attention and KV commit): greedy Medusa output must equal plain greedy output
// token for token, whatever the heads, the tree, the limits and the context size.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using tiny::tiny_model;
using tiny::random_heads;
using tiny::oracle_heads;
using tiny::states_of;

const std::vector<std::int32_t> prompt = {1, 5, 9, 13, 2, 7};

}  // namespace

TEST_CASE("greedy Medusa equals plain greedy with random heads on every preset") {
  tiny_model model(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 60;
  const auto vanilla = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  REQUIRE(vanilla.tokens.size() == 60);
  CHECK(vanilla.reason == medusa::stop_reason::max_tokens);
  CHECK(vanilla.stats.steps == 59);  // the last token needs no forward pass
  random_heads heads(5, 11);
  for (std::string_view name : medusa::preset_names()) {
    CAPTURE(name);
    const medusa::tree tree = medusa::tree::preset(name);
    medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
    std::vector<std::int32_t> streamed;
    const auto out = dec.generate(prompt, opt, [&](std::int32_t t) { streamed.push_back(t); });
    CHECK(out.tokens == vanilla.tokens);
    CHECK(streamed == out.tokens);
    CHECK(out.stats.tree_steps > 0);
    CHECK(out.stats.new_tokens == 60);
  }
}

TEST_CASE("oracle heads: multi-token acceptance, identical tokens, fewer forward passes") {
  tiny_model model(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 120;
  const auto vanilla = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  oracle_heads heads{5, prompt, {}};
  heads.sequence.insert(heads.sequence.end(), vanilla.tokens.begin(), vanilla.tokens.end());
  heads.states = states_of(model, heads.sequence);
  for (std::string_view name : {"mc_sim_7b_63", "vicuna_7b_stage1", "vicuna_33b_stage1"}) {
    CAPTURE(name);
    const medusa::tree tree = medusa::tree::preset(name);
    medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
    const auto out = dec.generate(prompt, opt);
    CHECK(out.tokens == vanilla.tokens);
    CHECK(out.stats.mean_accepted() > 2.0);
    int deep = 0;
    for (std::size_t a = 2; a < out.stats.accepted_histogram.size(); ++a) deep += out.stats.accepted_histogram[a];
    CHECK(deep > 0);
    // Every tree step's accepted length is counted once.
    int sum = 0;
    for (int c : out.stats.accepted_histogram) sum += c;
    CHECK(sum == out.stats.tree_steps);
    CHECK(out.stats.accepted_at_depth[0] >= out.stats.accepted_at_depth[1]);
  }
}

TEST_CASE("rejection sampling at temperature 0 equals greedy") {
  tiny_model model(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 50;
  const auto vanilla = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  oracle_heads heads{4, prompt, {}};
  heads.sequence.insert(heads.sequence.end(), vanilla.tokens.begin(), vanilla.tokens.end());
  heads.states = states_of(model, heads.sequence);
  medusa::rejection_policy policy;
  policy.temperature = 0.0f;
  medusa::decoder dec(model, heads, medusa::tree::preset("mc_sim_7b_63"), policy);
  CHECK(dec.generate(prompt, opt).tokens == vanilla.tokens);
  CHECK(medusa::generate_vanilla(model, prompt, policy, opt).tokens == vanilla.tokens);
}

TEST_CASE("sampled decoding is reproducible for a seed and stays in the vocabulary") {
  tiny_model model(256);
  random_heads heads(4, 3);
  medusa::rejection_policy policy;
  policy.temperature = 0.8f;
  policy.top_p = 0.9f;
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  opt.seed = 1234;
  medusa::decoder dec(model, heads, medusa::tree::preset("mc_sim_7b_63"), policy);
  const auto a = dec.generate(prompt, opt);
  const auto b = dec.generate(prompt, opt);
  CHECK(a.tokens == b.tokens);
  CHECK(a.tokens.size() == 40);
  for (auto t : a.tokens) CHECK((t >= 0 && t < tiny_model::vocab));
  opt.seed = 99;
  CHECK(dec.generate(prompt, opt).tokens != a.tokens);
}

TEST_CASE("stops: EOS, callback, max tokens, context end are identical to plain decoding") {
  tiny_model model(512);
  random_heads heads(5, 5);
  const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
  medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  const auto full = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);

  SUBCASE("EOS: the first occurrence ends the output, unemitted") {
    opt.eos_token = full.tokens[17];
    const auto v = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
    const auto m = dec.generate(prompt, opt);
    CHECK(v.reason == medusa::stop_reason::eos);
    CHECK(m.reason == medusa::stop_reason::eos);
    CHECK(m.tokens == v.tokens);
    CHECK(v.tokens.size() <= 17);
  }
  SUBCASE("callback returning false stops after that token") {
    int seen = 0;
    const auto m = dec.generate(prompt, opt, [&](std::int32_t) { return ++seen < 9; });
    CHECK(m.reason == medusa::stop_reason::callback);
    CHECK(m.tokens == std::vector<std::int32_t>(full.tokens.begin(), full.tokens.begin() + 9));
  }
  SUBCASE("max_new_tokens of 0, 1 and 2") {
    for (int n : {0, 1, 2}) {
      opt.max_new_tokens = n;
      CHECK(dec.generate(prompt, opt).tokens == std::vector<std::int32_t>(full.tokens.begin(), full.tokens.begin() + n));
    }
  }
  SUBCASE("a context too small for the tree near its end falls back to single steps") {
    tiny_model small(prompt.size() + 70);  // 64-node tree fits only at the start
    medusa::decoder dsmall(small, heads, tree, medusa::greedy_policy{});
    opt.max_new_tokens = 500;
    const auto v = medusa::generate_vanilla(small, prompt, medusa::greedy_policy{}, opt);
    const auto m = dsmall.generate(prompt, opt);
    CHECK(v.reason == medusa::stop_reason::context_full);
    CHECK(m.reason == medusa::stop_reason::context_full);
    CHECK(v.tokens.size() == 71);  // 70 free slots, and the last token needs none
    CHECK(m.tokens == v.tokens);
    CHECK(m.stats.tree_steps >= 1);
  }
}

TEST_CASE("bad input is rejected with a typed error") {
  tiny_model model(32);
  random_heads heads(2, 1);
  medusa::decode_options opt;
  CHECK_THROWS_AS(medusa::generate_vanilla(model, std::vector<std::int32_t>{}, medusa::greedy_policy{}, opt),
                  medusa::decode_error);
  CHECK_THROWS_AS(medusa::generate_vanilla(model, std::vector<std::int32_t>(33, 1), medusa::greedy_policy{}, opt),
                  medusa::decode_error);
  CHECK_THROWS_AS(medusa::generate_vanilla(model, std::vector<std::int32_t>{1, 40}, medusa::greedy_policy{}, opt),
                  medusa::decode_error);
  opt.prefill_chunk = 0;
  CHECK_THROWS_AS(medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt), medusa::decode_error);
  // A 4-deep tree needs 4 heads.
  CHECK_THROWS_AS((medusa::decoder(model, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{})),
                  medusa::decode_error);
}

TEST_CASE("prefill in chunks gives the same continuation") {
  tiny_model model(256);
  std::vector<std::int32_t> long_prompt;
  for (int i = 0; i < 50; ++i) long_prompt.push_back((i * 11 + 3) % tiny_model::vocab);
  medusa::decode_options opt;
  opt.max_new_tokens = 20;
  opt.prefill_chunk = 512;
  const auto whole = medusa::generate_vanilla(model, long_prompt, medusa::greedy_policy{}, opt);
  opt.prefill_chunk = 7;
  const auto chunked = medusa::generate_vanilla(model, long_prompt, medusa::greedy_policy{}, opt);
  CHECK(chunked.tokens == whole.tokens);
  CHECK(chunked.stats.prompt_tokens == 50);
}

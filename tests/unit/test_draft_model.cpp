// SPDX-License-Identifier: Apache-2.0
// A draft model as the branch of a step drafter (draft_model.hpp): greedy decoding with its chains
// equals plain greedy decoding, whether the draft is the target itself (every draft accepted), a
// different model, or one whose context ends first; the draft's cache is reused across steps (it
// runs each token about once, not the whole history every step); the heads are not run for a tree
// of the draft alone; vocabularies that differ and
// tokens outside the draft's vocabulary are refused with errors that name them.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/draft_model.hpp>
#include <medusa/drafts.hpp>

#include <doctest/doctest.h>

#include <span>
#include <string>
#include <vector>

namespace {

using tiny::random_heads;
using tiny::tiny_model;
using branch = medusa::draft_model_branch<tiny_model>;

const std::vector<std::int32_t> prompt = {1, 5, 9, 13, 2, 7};

// Random heads that count their calls: a tree of the draft alone reads none.
struct counting_heads {
  random_heads inner;
  int calls = 0;
  int num_heads() const { return inner.num_heads(); }
  void forward(std::span<const float> h, std::span<float> logits) {
    ++calls;
    inner.forward(h, logits);
  }
};

medusa::decode_options tokens(int n) {
  medusa::decode_options opt;
  opt.max_new_tokens = n;
  return opt;
}

}  // namespace

TEST_CASE("a draft model identical to the target: every draft accepted, tokens equal plain decoding") {
  tiny_model target(512), draft(512);  // same seed: the same model
  const auto opt = tokens(90);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  for (const int k : {1, 4}) {
    CAPTURE(k);
    branch b(draft, target.vocab_size(), {.max_tokens = k});
    counting_heads heads{random_heads(2, 3)};
    medusa::decoder dec(target, heads, medusa::basic_step_drafter<branch>({.lookup = b}, 2), medusa::greedy_policy{});
    const auto r = dec.generate(prompt, opt);
    CHECK(r.tokens == plain.tokens);
    CHECK(heads.calls == 0);  // the draft's chain alone reads no head
    MESSAGE(k << "-token chains: " << r.stats.steps << " steps for " << r.stats.new_tokens << " tokens, the draft ran "
              << b.tokens_run() << " tokens in " << b.passes() << " passes");
    // Each step accepts the whole chain and adds the bonus token.
    const int per_step = k + 1;
    CHECK(r.stats.steps <= (r.stats.new_tokens + per_step - 1) / per_step + 1);
    // The cache is reused: the prompt once, then per step the bonus token and k − 1 chain tokens.
    CHECK(b.tokens_run() <= static_cast<std::int64_t>(prompt.size()) + static_cast<std::int64_t>(r.stats.steps) * (k + 1));
    b.release(0);
  }
}

TEST_CASE("a different draft model is lossless, with and without the heads' tree, and reuses its cache") {
  tiny_model target(512), draft(512, /*seed=*/11);
  const auto opt = tokens(120);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  branch b(draft, target.vocab_size(), {.max_tokens = 5});
  random_heads heads(4, 4);
  medusa::decoder alone(target, heads, medusa::basic_step_drafter<branch>({.lookup = b}, 4), medusa::greedy_policy{});
  const auto r = alone.generate(prompt, opt);
  CHECK(r.tokens == plain.tokens);
  CHECK(r.stats.steps <= r.stats.new_tokens);
  MESSAGE("other draft: " << r.stats.steps << " steps for " << r.stats.new_tokens << " tokens, the draft ran "
                          << b.tokens_run() << " tokens");
  // Re-running the whole history each step would cost about steps × (prompt + new / 2) tokens.
  CHECK(b.tokens_run() <= static_cast<std::int64_t>(prompt.size()) + static_cast<std::int64_t>(r.stats.steps) * 6);

  b.release(0);
  medusa::decoder with_heads(target, heads,
                             medusa::basic_step_drafter<branch>(
                                 {.paths = medusa::tree::preset("mc_sim_7b_63").sorted_paths(), .lookup = b}, 4),
                             medusa::greedy_policy{});
  CHECK(with_heads.generate(prompt, opt).tokens == plain.tokens);
}

TEST_CASE("a draft whose context ends before the target's drafts less, then nothing, and stays lossless") {
  tiny_model target(512), draft(24);
  const auto opt = tokens(60);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  branch b(draft, target.vocab_size(), {.max_tokens = 4});
  CHECK(b.seconds() == 0.0);
  random_heads heads(2, 5);
  medusa::decoder dec(target, heads, medusa::basic_step_drafter<branch>({.lookup = b}, 2), medusa::greedy_policy{});
  const auto r = dec.generate(prompt, opt);
  CHECK(r.tokens == plain.tokens);
  CHECK(b.seconds() > 0.0);  // the draft's own time, counted over its passes
  CHECK(b.seconds() < r.stats.seconds.total);
  // The draft writes at most its 24 slots (tiny_model::forward requires it), so no draft past them.
  CHECK(b.tokens_run() <= 24 + 4);

  std::vector<std::int32_t> out(4), full(24, 3), near(22, 3);
  CHECK(b.find(full, out) == 1);   // 24 tokens: the root's successor needs no further slot
  CHECK(b.find(near, out) == 3);   // 22: three more tokens fit
  full.push_back(3);
  CHECK(b.find(full, out) == 0);   // past the draft's context: no draft, a plain step
}

TEST_CASE("bad drafts are refused: another vocabulary, a token outside it, another request of a single draft") {
  tiny_model draft(64);
  try {
    (void)branch(draft, tiny_model::vocab + 1);
    FAIL("accepted a vocabulary mismatch");
  } catch (const medusa::invalid_input& e) {
    const std::string what = e.what();
    CHECK(what.find(std::to_string(tiny_model::vocab)) != std::string::npos);
    CHECK(what.find(std::to_string(tiny_model::vocab + 1)) != std::string::npos);
  }
  CHECK_THROWS_AS(branch(draft, tiny_model::vocab, {.max_tokens = 0}), medusa::invalid_input);
  branch b(draft, tiny_model::vocab);
  std::vector<std::int32_t> out(4);
  const std::vector<std::int32_t> outside = {1, tiny_model::vocab};
  CHECK_THROWS_AS(b.find(outside, out), medusa::invalid_input);
  const std::vector<std::int32_t> fine = {1, 2};
  CHECK_THROWS_AS(b.find(1, fine, out), medusa::invalid_input);  // a single-request draft serves request 0
  CHECK(b.find(0, fine, out) == 4);
  CHECK(b.find(std::vector<std::int32_t>{}, out) == 0);
}

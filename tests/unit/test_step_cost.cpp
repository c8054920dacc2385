// SPDX-License-Identifier: Apache-2.0
// measure_step_cost (decoder/step_cost.hpp) on the tiny transformer: a valid curve that grows with
// the step size, the budget honoured, bad options refused, and decoding unchanged afterwards.
#include "tiny_transformer.hpp"

#include <medusa/decoder/step_cost.hpp>

#include <doctest/doctest.h>

#include <vector>

TEST_CASE("the measured curve is valid, starts at a plain step and never falls with the step size") {
  tiny::tiny_model model(256);
  tiny::random_heads heads(3, 5);
  const auto curve = medusa::measure_step_cost(model, heads, {.rows = {1, 8, 64}, .context = 64, .repeats = 2, .budget_seconds = 1});
  CHECK_NOTHROW(curve.validate());
  CHECK(curve.rows == std::vector<int>{1, 8, 64});
  CHECK(curve.seconds[1] >= curve.seconds[0]);
  CHECK(curve.seconds[2] >= curve.seconds[1]);
  CHECK(curve.head_seconds > 0.0);
  CHECK(model.forward_calls >= 1 + 1 + 3 * 2);  // prefill, warm-up, sizes x rounds
}

TEST_CASE("past the budget, no new round starts") {
  tiny::tiny_model model(256);
  tiny::random_heads heads(2, 5);
  const auto curve = medusa::measure_step_cost(model, heads, {.rows = {1, 2, 4, 8}, .context = 16, .repeats = 5, .budget_seconds = 0});
  CHECK(curve.rows == std::vector<int>{1, 2, 4, 8});
  CHECK(model.forward_calls == 1 + 1 + 4);  // prefill, one warm-up step, one round
}

TEST_CASE("bad options are refused; the context is clamped to the cache") {
  tiny::tiny_model model(32);
  tiny::random_heads heads(2, 5);
  CHECK_THROWS_WITH_AS((void)medusa::measure_step_cost(model, heads, {.rows = {2, 4}}), doctest::Contains("must be 1"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::measure_step_cost(model, heads, {.rows = {1, 32}}), doctest::Contains("does not fit"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::measure_step_cost(model, heads, {.rows = {1}, .repeats = 0}), doctest::Contains("repeats"),
                       medusa::invalid_input);
  const auto curve = medusa::measure_step_cost(model, heads, {.rows = {1, 16}, .context = 1000});  // 16 + 16 slots
  CHECK(curve.rows.size() == 2);
}

TEST_CASE("decoding after a measurement is unchanged") {
  tiny::tiny_model model(128);
  tiny::random_heads heads(2, 9);
  const std::vector<std::int32_t> prompt{1, 5, 9, 3};
  medusa::decode_options opt;
  opt.max_new_tokens = 20;
  const auto before = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  (void)medusa::measure_step_cost(model, heads, {.rows = {1, 4, 16}, .context = 32});
  const auto after = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  CHECK(before.tokens == after.tokens);
}

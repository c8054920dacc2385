// SPDX-License-Identifier: Apache-2.0
// measure_step_cost (decoder/step_cost.hpp) on the tiny transformer: a valid curve that grows with
// the step size, the budget honoured, bad options refused, and decoding unchanged afterwards.
#include "tiny_transformer.hpp"

#include <medusa/decoder/calibrate.hpp>
#include <medusa/decoder/step_cost.hpp>
#include <medusa/io/tree_search_files.hpp>

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

TEST_CASE("count_paths: every position's head ranks, as the heads gave them") {
  tiny::tiny_model model(256);
  const std::vector<std::int32_t> prompt{1, 5, 9, 3};
  medusa::decode_options opt;
  opt.max_new_tokens = 60;
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  tiny::oracle_heads heads{3, prompt, {}};
  heads.sequence.insert(heads.sequence.end(), plain.tokens.begin(), plain.tokens.end());
  heads.states = tiny::states_of(model, heads.sequence);
  medusa::path_counter counts(3, 10);
  medusa::count_paths(model, heads, heads.sequence, counts);
  const int T = static_cast<int>(heads.sequence.size());
  CHECK(counts.positions() == static_cast<std::uint64_t>(T - 2));
  // The oracle puts the truth of head k at position t at rank ((t·2654435761 + k·40503) >> 16) % 4,
  // or (3) leaves it at its rank in the base row, (7·truth + 3k + t) mod 40; recount [0] and [0,0].
  const auto& seq = heads.sequence;
  auto rank_of = [&](int t, int k) {
    const int planted = static_cast<int>((static_cast<unsigned>(t) * 2654435761u + static_cast<unsigned>(k) * 40503u) >> 16) % 4;
    return planted < 3 ? planted : (7 * seq[static_cast<std::size_t>(t + 2 + k)] + 3 * k + t) % tiny::tiny_model::vocab;
  };
  std::uint64_t zero = 0, zero_zero = 0;
  for (int t = 0; t + 2 < T; ++t) {
    if (rank_of(t, 0) != 0) continue;
    ++zero;
    zero_zero += t + 3 < T && rank_of(t, 1) == 0;
  }
  CHECK(counts.counts().at({0}) == zero);
  CHECK(counts.counts().at({0, 0}) == zero_zero);
  const auto cal = medusa::parse_calibration(medusa::calibration_json(counts));
  CHECK(cal.conditional());
  CHECK(cal.probability(std::vector<int>{0, 0}) == doctest::Approx(static_cast<double>(zero_zero) / static_cast<double>(T - 2)));
  // From a first position on: the earlier positions are not counted.
  medusa::path_counter later(3, 10);
  medusa::count_paths(model, heads, heads.sequence, later, 10);
  CHECK(later.positions() == static_cast<std::uint64_t>(T - 2 - 10));
  CHECK_THROWS_AS(medusa::count_paths(model, heads, std::vector<std::int32_t>{1}, counts), medusa::invalid_input);
  medusa::path_counter too_many(4, 10);
  CHECK_THROWS_AS(medusa::count_paths(model, heads, heads.sequence, too_many), medusa::invalid_input);
}

// SPDX-License-Identifier: Apache-2.0
// Tree search (tree/search.hpp) and its files (io/tree_search_files.hpp): the ranking is
// prefix-closed and within budget, expected tokens grow with the budget, the optimiser finds the
// brute-force optimum on small calibrations, and bad calibrations and cost curves are refused.
#include <medusa/io/tree_search_files.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace {

using paths_t = std::vector<std::vector<int>>;

// Every path of up to `depth` ranks below `topk`, in canonical order (parents before children).
paths_t universe(int topk, int depth) {
  paths_t all, level{{}};
  for (int d = 1; d <= depth; ++d) {
    paths_t next;
    for (const auto& p : level)
      for (int r = 0; r < topk; ++r) {
        auto c = p;
        c.push_back(r);
        next.push_back(c);
      }
    all.insert(all.end(), next.begin(), next.end());
    level = next;
  }
  return all;
}

// Path-conditional counts drawn from a random "decoding": each position's true rank tuple, with
// correlated heads (a right head makes the next one more likely right), truncated at the first
// rank >= topk.
medusa::path_calibration random_counts(std::mt19937& rng, int heads, int topk, int positions) {
  std::map<std::vector<int>, std::uint64_t> counts;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < positions; ++i) {
    std::vector<int> tuple;
    double right = 0.6;
    for (int k = 0; k < heads; ++k) {
      int rank = u(rng) < right ? 0 : 1 + static_cast<int>(u(rng) * u(rng) * 2 * topk);
      if (rank >= topk) break;
      tuple.push_back(rank);
      ++counts[tuple];
      right = rank == 0 ? 0.8 : 0.3;
    }
  }
  return medusa::path_calibration::from_counts(heads, topk, static_cast<std::uint64_t>(positions),
                                               {counts.begin(), counts.end()});
}

medusa::path_calibration random_accuracy(std::mt19937& rng, int heads, int topk) {
  std::vector<std::vector<double>> acc(static_cast<std::size_t>(heads));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& row : acc) {
    double left = 0.9;
    for (int r = 0; r < topk; ++r) {
      row.push_back(left * u(rng) * 0.7);
      left -= row.back();
    }
  }
  return medusa::path_calibration::from_accuracy(acc);
}

bool prefix_closed(const paths_t& paths) {
  const std::set<std::vector<int>> all(paths.begin(), paths.end());
  if (all.size() != paths.size()) return false;
  for (const auto& p : paths)
    if (p.size() > 1 && !all.count(std::vector<int>(p.begin(), p.end() - 1))) return false;
  return true;
}

int depth_of(const paths_t& paths) {
  int d = 0;
  for (const auto& p : paths) d = std::max(d, static_cast<int>(p.size()));
  return d;
}

// Brute force: the best speedup over every prefix-closed tree with 1..max_paths paths.
double brute_force_best(const medusa::path_calibration& cal, const medusa::step_cost_curve& cost, int max_paths,
                        paths_t* best_tree) {
  const paths_t all = universe(cal.topk(), cal.num_heads());
  std::set<std::vector<int>> in;
  paths_t chosen;
  double best = 0.0;
  std::function<void(std::size_t)> walk = [&](std::size_t i) {
    if (i == all.size()) {
      if (chosen.empty()) return;
      const double s = cal.expected_tokens(chosen) /
                       (cost.medusa_seconds(static_cast<int>(chosen.size()) + 1, depth_of(chosen)) / cost.plain_seconds());
      if (s > best + 1e-12) {
        best = s;
        *best_tree = chosen;
      }
      return;
    }
    const auto& p = all[i];
    const bool parent_in = p.size() == 1 || in.count(std::vector<int>(p.begin(), p.end() - 1));
    if (parent_in && static_cast<int>(chosen.size()) < max_paths) {
      in.insert(p);
      chosen.push_back(p);
      walk(i + 1);
      chosen.pop_back();
      in.erase(p);
    }
    walk(i + 1);
  };
  walk(0);
  return best;
}

}  // namespace

TEST_CASE("ranked paths are prefix-closed at every size, within budget and depth") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const auto cal = trial % 2 ? random_counts(rng, 4, 10, 3000) : random_accuracy(rng, 4, 10);
    const int max_depth = 1 + trial % 4;
    const auto ranked = medusa::ranked_paths(cal, 63, max_depth);
    CHECK(ranked.size() <= 63);
    double previous = 2.0;
    for (std::size_t n = 1; n <= ranked.size(); ++n) {
      const paths_t head(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(n));
      CHECK(prefix_closed(head));
      CHECK(depth_of(head) <= max_depth);
      const double p = cal.probability(ranked[n - 1]);
      CHECK(p > 0.0);
      CHECK(p <= previous);  // ranked by probability
      previous = p;
      REQUIRE_NOTHROW((void)medusa::tree::from_paths(head));
    }
  }
}

TEST_CASE("expected tokens of the best tree grow with the budget") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 10; ++trial) {
    const auto cal = trial % 2 ? random_counts(rng, 4, 10, 2000) : random_accuracy(rng, 4, 10);
    double last = 1.0;
    for (int budget = 2; budget <= 64; budget *= 2) {
      const auto best = medusa::ranked_paths(cal, budget - 1);
      const double e = cal.expected_tokens(best);
      CHECK(e >= last);
      last = e;
      // A free forward (constant cost) makes the largest tree the best.
      const medusa::step_cost_curve free_cost{.rows = {1, 1000}, .seconds = {1.0, 1.0}};
      const auto plan = medusa::optimize_tree(cal, free_cost, {.max_nodes = budget});
      CHECK(plan.nodes() <= budget);
      CHECK(plan.expected_tokens == doctest::Approx(e));
      CHECK(prefix_closed(plan.paths));
    }
  }
}

TEST_CASE("the optimiser finds the brute-force optimum on small calibrations") {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 24; ++trial) {
    const auto cal = trial % 3 ? random_counts(rng, 3, 3, 400) : random_accuracy(rng, 3, 3);
    // Forward costs: flat up to a knee, then steep; heads costing 0 .. 20% of a plain step.
    const double knee = 2 + trial % 4, head = 0.05 * (trial % 5);
    medusa::step_cost_curve cost{.rows = {1, static_cast<int>(knee), 16}, .seconds = {1.0, 1.05, 1.05 + 0.3 * (16 - knee)},
                                 .head_seconds = head, .overhead_seconds = 0.01};
    const int max_nodes = 2 + trial % 5;  // brute force over up to 5 paths
    paths_t brute_tree;
    const double brute = brute_force_best(cal, cost, max_nodes - 1, &brute_tree);
    const auto plan = medusa::optimize_tree(cal, cost, {.max_nodes = max_nodes});
    INFO("trial " << trial);
    CHECK(plan.predicted_speedup == doctest::Approx(brute).epsilon(1e-12));
    const double check = cal.expected_tokens(plan.paths) /
                         (cost.medusa_seconds(plan.nodes(), depth_of(plan.paths)) / cost.plain_seconds());
    CHECK(check == doctest::Approx(plan.predicted_speedup).epsilon(1e-12));
    CHECK(prefix_closed(plan.paths));
    CHECK(plan.nodes() <= max_nodes);
    CHECK(cal.expected_tokens(plan.paths) == doctest::Approx(cal.expected_tokens(brute_tree)).epsilon(1e-12));
  }
}

TEST_CASE("correlated heads: path counts pick the chain the independence model misses") {
  // Heads right together or wrong together (a model that loops): the chain [0],[0,0],[0,0,0] is
  // right 50% of the time, any second rank-1 branch almost never.
  const auto cal = medusa::path_calibration::from_counts(
      3, 10, 1000, {{{0}, 500}, {{1}, 150}, {{0, 0}, 500}, {{0, 0, 0}, 500}, {{1, 0}, 10}, {{0, 1}, 0}});
  CHECK(cal.probability(std::vector<int>{0, 0, 0}) == doctest::Approx(0.5));
  CHECK(cal.probability(std::vector<int>{0, 1}) == 0.0);
  CHECK(cal.probability(std::vector<int>{2}) == 0.0);
  const auto four = medusa::ranked_paths(cal, 3);
  CHECK(four == paths_t{{0}, {0, 0}, {0, 0, 0}});
  // The same marginals as independent heads would put [1] before [0,0,0].
  const auto indep = medusa::path_calibration::from_accuracy({{0.5, 0.15}, {0.51, 0.0}, {0.5, 0.0}});
  CHECK(medusa::ranked_paths(indep, 3) == paths_t{{0}, {0, 0}, {1}});
  // A flat cost up to 4 rows and a steep one after: the 4-node chain wins.
  const medusa::step_cost_curve cost{.rows = {1, 4, 5}, .seconds = {1.0, 1.0, 3.0}};
  const auto plan = medusa::optimize_tree(cal, cost, {.max_nodes = 16});
  CHECK(plan.paths == paths_t{{0}, {0, 0}, {0, 0, 0}});
  CHECK(plan.expected_tokens == doctest::Approx(2.5));
  CHECK(plan.predicted_speedup == doctest::Approx(2.5));
  CHECK(plan.sizes.size() == 5);  // 2..6 nodes: 5 paths were ever right
}

TEST_CASE("costs: interpolation, heads, overhead, and a machine where no tree pays") {
  const medusa::step_cost_curve c{.rows = {1, 2, 8}, .seconds = {1.0, 1.2, 2.4}, .head_seconds = 0.1, .overhead_seconds = 0.05};
  CHECK(c.forward_seconds(1) == 1.0);
  CHECK(c.forward_seconds(5) == doctest::Approx(1.8));
  CHECK(c.forward_seconds(14) == doctest::Approx(3.6));  // extrapolated
  CHECK(c.medusa_seconds(8, 3) == doctest::Approx(2.4 + 0.3 + 0.05));
  const auto cal = medusa::path_calibration::from_accuracy({{0.05}, {0.05}});
  const medusa::step_cost_curve steep{.rows = {1, 2}, .seconds = {1.0, 2.0}, .head_seconds = 0.2};
  const auto plan = medusa::optimize_tree(cal, steep, {.max_nodes = 8});
  CHECK(plan.predicted_speedup < 1.0);
  CHECK(plan.paths == paths_t{{0}});
}

TEST_CASE("bad calibrations and cost curves are refused with a message") {
  using medusa::path_calibration;
  CHECK_THROWS_WITH_AS(path_calibration::from_accuracy({}), doctest::Contains("empty"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_accuracy({{0.5, 0.6}}), doctest::Contains("sum to"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_accuracy({{0.5}, {0.1, 0.1}}), doctest::Contains("ranks"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_accuracy({{-0.1}}), doctest::Contains("not in [0, 1]"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_counts(2, 3, 0, {}), doctest::Contains("no positions"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_counts(2, 3, 10, {{{0, 0}, 2}}), doctest::Contains("prefix [0] is not"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_counts(2, 3, 10, {{{0}, 2}, {{0, 0}, 3}}), doctest::Contains("> its prefix"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_counts(2, 3, 10, {{{3}, 2}}), doctest::Contains("rank 3"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_counts(1, 3, 10, {{{0}, 2}, {{0, 0}, 1}}), doctest::Contains("deeper"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_counts(2, 3, 10, {{{0}, 11}}), doctest::Contains("> 10 positions"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS(path_calibration::from_counts(2, 3, 10, {{{0}, 1}, {{0}, 1}}), doctest::Contains("twice"),
                       medusa::invalid_input);
  const auto cal = path_calibration::from_accuracy({{0.5}});
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {2}, .seconds = {1.0}}), doctest::Contains("must be 1"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {1, 4, 2}, .seconds = {1, 1, 1}}), doctest::Contains("ascend"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {1}, .seconds = {0.0}}), doctest::Contains("1-token step"),
                       medusa::invalid_input);
  // Times beyond a physical range would overflow the search's ratios (a predicted speedup of 0).
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {1}, .seconds = {1e-3}, .overhead_seconds = 1e306}),
                       doctest::Contains("overhead_seconds is 1e+306"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {1}, .seconds = {1e-3}, .head_seconds = 2e6}),
                       doctest::Contains("head_seconds is 2e+06"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {1, 4}, .seconds = {1e-3, 1e-300}}),
                       doctest::Contains("4-token step is 1e-300 s"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {1}, .seconds = {1.0, 2.0}}), doctest::Contains("2 times"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::optimize_tree(cal, {.rows = {1}, .seconds = {1.0}}, {.max_nodes = 1}),
                       doctest::Contains("max_nodes"), medusa::invalid_input);
}

TEST_CASE("calibration and step-cost files: both versions, round trip, errors") {
  const auto v1 = medusa::parse_calibration(
      R"({"format": "medusa-calibration", "version": 1, "num_heads": 2, "topk": 2, "accuracy": [[0.5, 0.2], [0.4, 0.1]]})");
  CHECK_FALSE(v1.conditional());
  CHECK(v1.probability(std::vector<int>{1, 0}) == doctest::Approx(0.08));
  const auto v2 = medusa::parse_calibration(
      R"({"format": "medusa-calibration", "version": 2, "num_heads": 2, "topk": 2, "accuracy": [[0.5, 0.2], [0.4, 0.1]],
          "path_positions": 100, "path_counts": [[[0], 50], [[1], 20], [[0, 0], 40]]})");
  CHECK(v2.conditional());
  CHECK(v2.probability(std::vector<int>{0, 0}) == doctest::Approx(0.4));
  CHECK(v2.probability(std::vector<int>{1, 0}) == 0.0);
  CHECK_THROWS_WITH_AS((void)medusa::parse_calibration(R"({"format": "x", "version": 1})"), doctest::Contains("format"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::parse_calibration(R"({"format": "medusa-calibration", "version": 3})"),
                       doctest::Contains("version 3"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::parse_calibration(R"({"format": "medusa-calibration", "version": 2, "num_heads": 2,
      "topk": 2, "path_positions": 10, "path_counts": [[0, 5]]})"),
                       doctest::Contains("path_counts[0]"), medusa::invalid_input);
  CHECK_THROWS_AS((void)medusa::parse_calibration("{"), medusa::json_error);
  CHECK_THROWS_AS((void)medusa::read_calibration(MEDUSA_TEST_TMPDIR "/no-such-calibration.json"), medusa::io_error);

  const medusa::step_cost_curve c{.rows = {1, 4, 16}, .seconds = {1e-3, 1.25e-3, 2.5e-3}, .head_seconds = 4e-5, .overhead_seconds = 1e-5};
  const auto back = medusa::parse_step_cost(medusa::step_cost_json(c, "cpu=x threads=2"));
  CHECK(back.rows == c.rows);
  CHECK(back.seconds == c.seconds);
  CHECK(back.head_seconds == c.head_seconds);
  CHECK(back.overhead_seconds == c.overhead_seconds);
  CHECK_THROWS_WITH_AS((void)medusa::parse_step_cost(
                           R"({"format": "medusa-step-cost", "version": 1, "rows": [1], "seconds": [-1], "head_seconds": 0, "overhead_seconds": 0})"),
                       doctest::Contains("1-token step"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS((void)medusa::parse_step_cost(R"({"format": "medusa-step-cost", "version": 1, "rows": [1], "seconds": [1]})"),
                       doctest::Contains("head_seconds"), medusa::invalid_input);
}

TEST_CASE("a recorded decoding is replayed: steps skip the positions they accepted") {
  // One sequence: positions 0-2 right for [0,0], 3 for [0] (rank 5 next), 4 for [1,0]; the last
  // position has no target and is not recorded.
  medusa::path_counter c(2, 10);
  c.next_sequence();
  for (const auto& r : std::vector<std::vector<int>>{{0, 0}, {0, 0}, {0, 0}, {0, 5}, {1, 0}, {-1, -1}}) c.add(r);
  const auto cal = c.calibration();
  REQUIRE(cal.sequences().size() == 1);
  // Chain [0],[0,0]: steps at 0 (3 tokens) and 3 ([0] right: 2 tokens): 5 / 2.
  CHECK(cal.replay_tokens_per_step({{0}, {0, 0}}) == doctest::Approx(2.5));
  // Per position, the same tree looks better: 1 + 4/5 + 3/5 (positions with a head-0 target: 5).
  CHECK(cal.expected_tokens({{0}, {0, 0}}) == doctest::Approx(2.4));
  // [1] is right only at the last recorded position, where nothing follows: 5 steps of 1.
  CHECK(cal.replay_tokens_per_step({{1}}) == doctest::Approx(1.0));
  // The optimiser predicts with the replay; the file keeps the recording.
  const medusa::step_cost_curve flat{.rows = {1, 64}, .seconds = {1.0, 1.0}};
  const auto plan = medusa::optimize_tree(cal, flat, {.max_nodes = 3});
  CHECK(plan.expected_tokens == doctest::Approx(cal.replay_tokens_per_step(plan.paths)));
  const auto back = medusa::parse_calibration(medusa::calibration_json(c));
  CHECK(back.sequences() == cal.sequences());
  CHECK(back.replay_tokens_per_step({{0}, {0, 0}}) == doctest::Approx(2.5));
}

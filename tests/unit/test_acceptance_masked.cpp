// SPDX-License-Identifier: Apache-2.0
// Masked logits: -Inf marks a banned token. Every policy treats it as probability 0 (the same
// results as a finite value far below the others), sampling never accepts or draws one, and only
// NaN, +Inf and rows with every token masked are errors.
#include <doctest/doctest.h>
#include <medusa/acceptance.hpp>
#include <medusa/tree.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace {

constexpr float masked = -std::numeric_limits<float>::infinity();

struct masked_case {
  medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");
  int vocab = 200;
  std::vector<float> logits, low, drafts;  // `low`: the masks replaced by -1e30
  std::vector<std::int32_t> tokens;
};

// Half the tokens (odd ids) masked in every row; node tokens mostly the parent's argmax, some of
// them masked tokens on purpose.
masked_case make_case(std::uint32_t seed) {
  masked_case c;
  const int n = c.tree.num_nodes(), v = c.vocab;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  c.logits.resize(static_cast<std::size_t>(n * v));
  for (std::size_t i = 0; i < c.logits.size(); ++i) c.logits[i] = i % 2 == 1 ? masked : normal(rng);
  c.low = c.logits;
  for (auto& x : c.low)
    if (x == masked) x = -1e30f;
  c.drafts.resize(c.logits.size());
  for (int r = 0; r < n; ++r) {
    double sum = 0.0;
    for (int i = 0; i < v; ++i) sum += c.drafts[static_cast<std::size_t>(r * v + i)] = std::exp(normal(rng));
    for (int i = 0; i < v; ++i) c.drafts[static_cast<std::size_t>(r * v + i)] /= static_cast<float>(sum);
  }
  for (int u = 0; u < n; ++u) {
    auto token = static_cast<std::int32_t>(rng() % static_cast<unsigned>(v));
    if (u > 0 && rng() % 4 != 0) {
      const float* z = c.logits.data() + static_cast<std::ptrdiff_t>(c.tree.parent(u) * v);
      token = static_cast<std::int32_t>(std::max_element(z, z + v) - z);
    }
    c.tokens.push_back(token);
  }
  return c;
}

template <class Policy>
medusa::verify_result run(const masked_case& c, const std::vector<float>& logits, const Policy& policy,
                          std::uint64_t seed) {
  medusa::verify_request req{.node_tokens = c.tokens, .logits = logits, .vocab = c.vocab, .draft_probs = c.drafts,
                             .seed = seed, .step = 1};
  return medusa::verify(c.tree, req, policy);
}

void check_same(const medusa::verify_result& a, const medusa::verify_result& b) {
  CHECK(a.accept_length == b.accept_length);
  CHECK(a.next_node == b.next_node);
  CHECK(a.bonus == b.bonus);
  CHECK(a.best_row == b.best_row);
  for (int j = 0; j <= a.accept_length; ++j) CHECK(a.token_ids[static_cast<std::size_t>(j)] == b.token_ids[static_cast<std::size_t>(j)]);
}

}  // namespace

TEST_CASE("masked tokens give the results of a finite value far below the others, for every policy") {
  int accepted = 0;
  for (std::uint32_t seed = 1; seed <= 6; ++seed) {
    CAPTURE(seed);
    const masked_case c = make_case(seed);
    const auto greedy = run(c, c.logits, medusa::greedy_policy{}, seed);
    check_same(greedy, run(c, c.low, medusa::greedy_policy{}, seed));
    accepted += greedy.accept_length;
    check_same(run(c, c.logits, medusa::typical_policy{.temperature = 0.7f}, seed),
               run(c, c.low, medusa::typical_policy{.temperature = 0.7f}, seed));
    const medusa::rejection_policy rejection{{.temperature = 0.8f, .top_k = 0, .top_p = 0.9f}};
    check_same(run(c, c.logits, rejection, seed), run(c, c.low, rejection, seed));
    const medusa::speculative_policy speculative{{.temperature = 1.0f}};
    check_same(run(c, c.logits, speculative, seed), run(c, c.low, speculative, seed));
  }
  CHECK(accepted > 6);
}

TEST_CASE("sampling never accepts or draws a masked token") {
  const masked_case c = make_case(11);
  int drafts_accepted = 0;
  for (std::uint64_t seed = 0; seed < 400; ++seed) {
    for (const float temperature : {0.5f, 1.0f, 2.0f}) {
      const auto r = run(c, c.logits, medusa::rejection_policy{{.temperature = temperature}}, seed);
      for (int j = 1; j <= r.accept_length; ++j) CHECK(r.token_ids[static_cast<std::size_t>(j)] % 2 == 0);
      CHECK(r.bonus % 2 == 0);
      const auto s = run(c, c.logits, medusa::speculative_policy{{.temperature = temperature}}, seed);
      for (int j = 1; j <= s.accept_length; ++j) CHECK(s.token_ids[static_cast<std::size_t>(j)] % 2 == 0);
      CHECK(s.bonus % 2 == 0);
      drafts_accepted += r.accept_length + s.accept_length;
    }
  }
  CHECK(drafts_accepted > 100);  // the walk does reach masked children and passes over them
  // A sampled first root never lands on a masked token either.
  medusa::acceptance_workspace ws;
  for (std::uint64_t seed = 0; seed < 500; ++seed)
    CHECK(medusa::sample_token(std::span<const float>(c.logits).first(200), {.temperature = 3.0f}, seed, 0, ws) % 2 == 0);
}

TEST_CASE("NaN, +Inf and rows with every token masked are errors; a masked row that is not read is not") {
  masked_case c = make_case(3);
  const int v = c.vocab;
  auto fails_with = [&](const char* text) {
    CHECK_THROWS_WITH_AS(run(c, c.logits, medusa::greedy_policy{}, 0), doctest::Contains(text), medusa::acceptance_error);
  };
  c.logits[4] = std::numeric_limits<float>::quiet_NaN();  // the root's row is always read
  fails_with("logit 4 is NaN");
  c.logits[4] = std::numeric_limits<float>::infinity();
  fails_with("logit 4 is +Inf");
  std::fill(c.logits.begin(), c.logits.begin() + v, masked);
  fails_with("all tokens masked");
  // Node 63's row (a leaf of a path greedy never reaches here) may be all masked.
  c = make_case(3);
  for (auto& t : c.tokens) t = t % 2 == 0 ? t + 1 : t;  // every draft is a masked token: A = 0
  std::fill(c.logits.end() - v, c.logits.end(), masked);
  CHECK(run(c, c.logits, medusa::greedy_policy{}, 0).accept_length == 0);
}

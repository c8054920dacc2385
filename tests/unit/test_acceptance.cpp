// SPDX-License-Identifier: Apache-2.0
// Acceptance (docs/acceptance.md): greedy, typical, rejection properties, a user policy, batches,
// errors.
#include <medusa/acceptance.hpp>
#include <medusa/dispatch/policy.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

namespace {

medusa::tree notebook_tree() {
  return medusa::tree::from_paths({{0}, {0, 0}, {0, 1}, {0, 2}, {1}, {1, 0}, {1, 1}, {1, 2}});
}

// One tree step with random candidates and random logits in [-1, 1].
struct step_data {
  int vocab;
  std::vector<std::int32_t> tokens;
  std::vector<float> logits;

  std::span<float> row(int u) {
    return std::span<float>(logits).subspan(static_cast<std::size_t>(u) * static_cast<std::size_t>(vocab),
                                            static_cast<std::size_t>(vocab));
  }
  medusa::verify_request request(std::uint64_t seed = 0, std::uint64_t step = 0) const {
    return {.node_tokens = tokens, .logits = logits, .vocab = vocab, .seed = seed, .step = step};
  }
};

step_data random_step(const medusa::tree& t, int vocab, std::mt19937& rng) {
  step_data s{vocab, std::vector<std::int32_t>(static_cast<std::size_t>(t.num_nodes())),
              std::vector<float>(static_cast<std::size_t>(t.num_nodes() * vocab))};
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> heads(static_cast<std::size_t>(t.depth() * vocab));
  for (auto& v : heads) v = u(rng);
  medusa::candidate_workspace cw(t, t.depth());
  cw.generate(t, static_cast<std::int32_t>(rng() % static_cast<unsigned>(vocab)), heads, vocab, s.tokens);
  for (auto& v : s.logits) v = u(rng);
  return s;
}

std::vector<std::int32_t> child_tokens(const medusa::tree& t, const step_data& s, int v) {
  std::vector<std::int32_t> out;
  for (int c = t.child_begin(v); c < t.child_begin(v) + t.child_count(v); ++c)
    out.push_back(s.tokens[static_cast<std::size_t>(c)]);
  return out;
}

// Makes `target` the exact greedy outcome: every ancestor's argmax is the next token on the
// path, every other row's argmax (value 5) is a token that none of its children carries.
void force_greedy_path(const medusa::tree& t, step_data& s, int target, std::mt19937& rng) {
  std::vector<int> on_path(static_cast<std::size_t>(t.num_nodes()), -1);  // child on path
  for (int u = target; u > 0; u = t.parent(u)) on_path[static_cast<std::size_t>(t.parent(u))] = u;
  for (int v = 0; v < t.num_nodes(); ++v) {
    auto r = s.row(v);
    if (on_path[static_cast<std::size_t>(v)] >= 0) {
      r[static_cast<std::size_t>(s.tokens[static_cast<std::size_t>(on_path[static_cast<std::size_t>(v)])])] = 5.0f;
      continue;
    }
    const auto kids = child_tokens(t, s, v);
    std::int32_t x;
    do x = static_cast<std::int32_t>(rng() % static_cast<unsigned>(s.vocab));
    while (std::find(kids.begin(), kids.end(), x) != kids.end());
    r[static_cast<std::size_t>(x)] = 5.0f;
  }
}

int first_row_through(const medusa::tree& t, int node) {
  for (int p = 0; p < t.num_leaves(); ++p)
    if (t.retrieve(p, t.node_depth(node)) == node) return p;
  return -1;
}

void check_path_result(const medusa::tree& t, const step_data& s, const medusa::verify_result& r,
                       int target) {
  CHECK(r.accept_length == t.node_depth(target));
  CHECK(r.next_node == target);
  CHECK(r.best_row == first_row_through(t, target));
  REQUIRE(r.nodes().size() == static_cast<std::size_t>(r.accept_length + 1));
  CHECK(r.nodes()[0] == 0);
  for (int j = 0; j <= r.accept_length; ++j) {
    CHECK(r.nodes()[static_cast<std::size_t>(j)] == t.retrieve(r.best_row, j));
    CHECK(r.tokens()[static_cast<std::size_t>(j)] == s.tokens[static_cast<std::size_t>(r.nodes()[static_cast<std::size_t>(j)])]);
  }
}

// User-defined policy (docs/acceptance.md): accept only the argmax, and only when it beats the
// runner-up by more than `min_margin` logits.
struct margin_policy {
  float min_margin = 1.0f;
  struct parent_state {
    std::int32_t top;
    float margin;
  };
  parent_state prepare(std::span<const float> z) const {
    std::array<std::int32_t, 2> best{};
    medusa::top_k(z, best);
    return {best[0], z[static_cast<std::size_t>(best[0])] - z[static_cast<std::size_t>(best[1])]};
  }
  bool accepts(const parent_state& s, std::span<const float>, std::int32_t token) const {
    return token == s.top && s.margin > min_margin;
  }
};
static_assert(medusa::acceptance_policy<margin_policy>);
static_assert(medusa::node_test_policy<medusa::greedy_policy>);
static_assert(medusa::node_test_policy<medusa::typical_policy>);
static_assert(medusa::sampling_policy<medusa::rejection_policy>);
static_assert(medusa::sampling_policy<medusa::speculative_policy>);
static_assert(!medusa::acceptance_policy<int>);

}  // namespace

TEST_CASE("typical defaults are pinned (threshold 0.09, alpha 0.3, T 0.7), the same as dispatch_policy's") {
  const medusa::typical_policy p;
  CHECK(p.posterior_threshold == 0.09f);
  CHECK(p.posterior_alpha == 0.3f);
  CHECK(p.temperature == 0.7f);
  const auto named = medusa::make_policy<medusa::typical_policy>({});
  CHECK(named.temperature == p.temperature);
  CHECK(named.posterior_threshold == p.posterior_threshold);
  CHECK(named.posterior_alpha == p.posterior_alpha);
  const medusa::rejection_policy r;
  CHECK(r.temperature == 1.0f);
  CHECK(r.top_k == 0);
  CHECK(r.top_p == 1.0f);
}

TEST_CASE("Philox4x32-10 known answers (Random123 test vectors) and the uniform stream") {
  using medusa::detail::philox4x32_10;
  auto a = philox4x32_10({{0, 0, 0, 0}}, 0, 0);
  CHECK(a.v[0] == 0x6627e8d5u);
  CHECK(a.v[3] == 0x9b00dbd8u);
  auto b = philox4x32_10({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  CHECK(b.v[0] == 0x408f276du);
  CHECK(b.v[1] == 0x41c83b0eu);
  auto c = philox4x32_10({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  CHECK(c.v[0] == 0xd16cfe09u);
  CHECK(c.v[2] == 0x5001e420u);
  static_assert(medusa::detail::philox_uniform(1, 2, 3) >= 0.0 && medusa::detail::philox_uniform(1, 2, 3) < 1.0);
  double sum = 0.0;
  for (int i = 0; i < 10000; ++i) sum += medusa::detail::philox_uniform(42, 7, static_cast<std::uint64_t>(i));
  CHECK(std::abs(sum / 10000 - 0.5) < 0.01);
  CHECK(medusa::detail::philox_uniform(42, 7, 0) != medusa::detail::philox_uniform(42, 8, 0));
  CHECK(medusa::detail::philox_uniform(42, 7, 0) != medusa::detail::philox_uniform(43, 7, 0));
}

TEST_CASE("fast exp2/log kernels agree with libm to float accuracy") {
  for (float t = -130.0f; t <= 127.0f; t += 0.0137f) {
    const double want = std::exp2(static_cast<double>(t));  // below 2^-126.5 the kernel flushes to 0
    CHECK(std::abs(medusa::detail::exp2_approx(t) - want) <= 4e-7 * want + 2e-38);
  }
  CHECK(medusa::detail::exp2_approx(200.0f) == medusa::detail::exp2_approx(127.0f));  // clamped, finite
  CHECK(medusa::detail::exp2_approx(std::nanf("")) == 0.0f);
  for (float y = 1e-5f; y < 2.0f; y *= 1.01f)
    CHECK(std::abs(medusa::detail::log_pos(y) - std::log(static_cast<double>(y))) < 3e-7 * (1 + std::abs(std::log(y))));
}

TEST_CASE("greedy accepts exactly a planted argmax path (property, preset and random targets)") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  std::mt19937 rng(2024);
  medusa::acceptance_workspace ws(t.num_nodes(), 300);
  for (int trial = 0; trial < 200; ++trial) {
    auto s = random_step(t, 300, rng);
    const int target = static_cast<int>(rng() % static_cast<unsigned>(t.num_nodes()));
    force_greedy_path(t, s, target, rng);
    const auto r = medusa::verify(t, s.request(), medusa::greedy_policy{}, ws);
    check_path_result(t, s, r, target);
    CHECK(r.bonus == medusa::argmax(s.row(target)));
    CHECK_FALSE(r.eos);
    // Typical at a tiny temperature behaves like greedy on this margin case, and T = 0 is greedy.
    const auto ty = medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 0.05f}, ws);
    check_path_result(t, s, ty, target);
    CHECK(ty.bonus == r.bonus);
    const auto t0 = medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 0.0f}, ws);
    check_path_result(t, s, t0, target);
    // Rejection sampling at T = 0 is greedy plus bonus = argmax, whatever the seed.
    const auto rj = medusa::verify(t, s.request(static_cast<std::uint64_t>(trial), 3),
                                   medusa::rejection_policy{{.temperature = 0.0f}}, ws);
    check_path_result(t, s, rj, target);
    CHECK(rj.bonus == r.bonus);
  }
}

TEST_CASE("rejection at T = 0 equals greedy on unconstrained random steps") {
  std::mt19937 rng(5);
  for (const char* name : {"mc_sim_7b_63", "vicuna_33b_stage1"}) {
    const auto t = medusa::tree::preset(name);
    medusa::acceptance_workspace ws;
    for (int trial = 0; trial < 300; ++trial) {
      const int vocab = 10 + static_cast<int>(rng() % 14);  // small vocab: frequent acceptance
      auto s = random_step(t, vocab, rng);
      const auto g = medusa::verify(t, s.request(), medusa::greedy_policy{}, ws);
      const auto rj = medusa::verify(t, s.request(99, static_cast<std::uint64_t>(trial)),
                                     medusa::rejection_policy{{.temperature = 0.0f, .top_k = 3, .top_p = 0.5f}}, ws);
      CHECK(rj.accept_length == g.accept_length);
      CHECK(rj.next_node == g.next_node);
      CHECK(rj.best_row == g.best_row);
      CHECK(rj.bonus == g.bonus);
    }
  }
}

TEST_CASE("padded cells never pass: a short row stops at its leaf") {
  // Sorted nodes: 1 = [0], 2 = [1], 3 = [0,0]; rows: [0,1,3], [0,2,-1].
  const auto t = medusa::tree::from_paths({{0}, {1}, {0, 0}});
  step_data s{4, {3, 1, 2, 1}, std::vector<float>(16, 0.0f)};
  s.row(0)[2] = 1.0f;  // node 2 (token 2) passes, node 1 fails
  s.row(2)[0] = 1.0f;  // the leaf's argmax is token 0: the reference would accept a padded cell
  s.row(3)[0] = 1.0f;
  const auto r = medusa::verify(t, s.request(), medusa::greedy_policy{});
  CHECK(r.accept_length == 1);
  CHECK(r.best_row == 1);
  CHECK(r.nodes()[1] == 2);
  CHECK(r.bonus == 0);
  const auto ty = medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 0.1f});
  CHECK(ty.accept_length == 1);
  CHECK(ty.best_row == 1);
}

TEST_CASE("typical: equal accept length is ranked by summed log-probability, exact ties → first row") {
  const auto t = notebook_tree();
  // Node tokens: depth 1 = {10, 11}, depth 2 = {20, 21, 22} under both parents (cousins share).
  step_data s{40, {1, 10, 11, 20, 21, 22, 20, 21, 22}, std::vector<float>(9 * 40, 0.0f)};
  const medusa::typical_policy p{.temperature = 1.0f};
  // Root: tokens 10 and 11 equally likely and well above τ; rows 1 and 2 identical, token 20 likely.
  s.row(0)[10] = 4.0f;
  s.row(0)[11] = 4.0f;
  for (int v : {1, 2}) s.row(v)[20] = 4.0f;
  auto r = medusa::verify(t, s.request(), p);
  CHECK(r.accept_length == 2);
  // Rows: [0,2,8],[0,2,7],[0,2,6],[0,1,5],[0,1,4],[0,1,3]; nodes 3 and 6 tie exactly → row 2.
  CHECK(r.best_row == 2);
  CHECK(r.next_node == 6);
  // Make the path through node 1 more likely: row 5 (node 3) now wins despite coming later.
  s.row(0)[10] = 4.5f;
  r = medusa::verify(t, s.request(), p);
  CHECK(r.best_row == 5);
  CHECK(r.next_node == 3);
  CHECK(r.tokens()[1] == 10);
  CHECK(r.tokens()[2] == 20);
}

TEST_CASE("typical thresholds: strict >, τ = min(threshold, alpha·exp(−H))") {
  // Chain of one draft: the root row is uniform over V = 4 → q = 0.25 everywhere, H ≈ ln 4.
  const auto t = medusa::tree::from_paths({{0}});
  step_data s{4, {0, 2}, std::vector<float>(8, 0.0f)};
  const double h = -4 * 0.25 * std::log(0.25 + 1e-5);
  const double tau_alpha = 0.3 * std::exp(-h);  // ≈ 0.075 < 0.09
  CHECK(medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 1.0f}).accept_length == 1);
  // Threshold just above / below q = 0.25 with a large alpha: τ = threshold.
  CHECK(medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 1.0f, .posterior_threshold = 0.2501f,
                                                              .posterior_alpha = 10.0f})
            .accept_length == 0);
  CHECK(medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 1.0f, .posterior_threshold = 0.2499f,
                                                              .posterior_alpha = 10.0f})
            .accept_length == 1);
  // alpha just above 0.25/exp(-H): τ = alpha·exp(−H) slightly above 0.25 → reject.
  const auto alpha_hi = static_cast<float>(0.3 * 0.2501 / tau_alpha);
  CHECK(medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 1.0f, .posterior_threshold = 1.0f,
                                                              .posterior_alpha = alpha_hi})
            .accept_length == 0);
}

TEST_CASE("a user-defined policy plugs in as a template parameter") {
  const auto t = medusa::tree::from_paths({{0}, {0, 0}, {0, 0, 0}});
  step_data s{10, {9, 1, 2, 3}, std::vector<float>(40, 0.0f)};
  s.row(0)[1] = 3.0f;  // margin 3
  s.row(1)[2] = 2.5f;  // margin 2.5
  s.row(2)[3] = 0.5f;  // margin 0.5: the greedy chain continues, the margin policy stops
  s.row(3)[7] = 1.0f;
  CHECK(medusa::verify(t, s.request(), medusa::greedy_policy{}).accept_length == 3);
  const auto r = medusa::verify(t, s.request(), margin_policy{.min_margin = 1.0f});
  CHECK(r.accept_length == 2);
  CHECK(r.bonus == 3);  // default bonus: argmax of the final node's row
  CHECK(medusa::verify(t, s.request(), margin_policy{.min_margin = 2.7f}).accept_length == 1);
}

TEST_CASE("EOS: the accepted path stops at an EOS draft and there is no bonus") {
  const auto t = medusa::tree::from_paths({{0}, {0, 0}, {0, 0, 0}});
  step_data s{10, {9, 1, 2, 3}, std::vector<float>(40, 0.0f)};
  s.row(0)[1] = 3.0f;
  s.row(1)[2] = 3.0f;
  s.row(2)[3] = 3.0f;
  auto req = s.request();
  req.eos_token = 2;
  for (int pol = 0; pol < 2; ++pol) {
    const auto r = pol == 0 ? medusa::verify(t, req, medusa::greedy_policy{})
                            : medusa::verify(t, req, medusa::rejection_policy{{.temperature = 0.0f}});
    CHECK(r.eos);
    CHECK(r.accept_length == 2);
    CHECK(r.next_node == 2);
    CHECK(r.bonus == -1);
    CHECK(r.tokens().back() == 2);
  }
}

TEST_CASE("rejection is deterministic per (seed, step) and varies across steps") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  std::mt19937 rng(77);
  auto s = random_step(t, 32, rng);
  for (auto& v : s.logits) v *= 3.0f;
  const medusa::rejection_policy p{{.temperature = 1.0f}};
  medusa::acceptance_workspace ws(t.num_nodes(), 32);
  const auto a = medusa::verify(t, s.request(1, 1), p, ws);
  const auto b = medusa::verify(t, s.request(1, 1), p, ws);
  CHECK(a.bonus == b.bonus);
  CHECK(a.next_node == b.next_node);
  std::set<std::int32_t> bonuses;
  for (std::uint64_t step = 0; step < 64; ++step) bonuses.insert(medusa::verify(t, s.request(1, step), p, ws).bonus);
  CHECK(bonuses.size() > 3);
}

TEST_CASE("verify_batch equals per-request verify and fills commit offsets") {
  const auto t = medusa::tree::preset("vicuna_7b_stage2");
  std::mt19937 rng(3);
  std::vector<step_data> steps;
  for (int b = 0; b < 4; ++b) {
    steps.push_back(random_step(t, 64 + 16 * b, rng));
    force_greedy_path(t, steps.back(), static_cast<int>(rng() % 64), rng);
  }
  std::vector<medusa::verify_request> reqs;
  for (std::size_t b = 0; b < steps.size(); ++b) reqs.push_back(steps[b].request(b, 5));
  std::vector<medusa::verify_result> out(reqs.size());
  std::vector<int> offsets(reqs.size() + 1);
  medusa::acceptance_workspace ws;
  medusa::verify_batch(t, std::span<const medusa::verify_request>(reqs), medusa::greedy_policy{}, ws,
                       std::span<medusa::verify_result>(out), offsets);
  int total = 0;
  for (std::size_t b = 0; b < reqs.size(); ++b) {
    const auto one = medusa::verify(t, reqs[b], medusa::greedy_policy{});
    CHECK(out[b].accept_length == one.accept_length);
    CHECK(out[b].best_row == one.best_row);
    CHECK(out[b].bonus == one.bonus);
    CHECK(offsets[b] == total);
    total += one.accept_length + 1;
  }
  CHECK(offsets.back() == total);
  // Same for the sampling path.
  medusa::verify_batch(t, std::span<const medusa::verify_request>(reqs), medusa::rejection_policy{}, ws,
                       std::span<medusa::verify_result>(out));
  for (std::size_t b = 0; b < reqs.size(); ++b) {
    const auto one = medusa::verify(t, reqs[b], medusa::rejection_policy{});
    CHECK(out[b].next_node == one.next_node);
    CHECK(out[b].bonus == one.bonus);
  }
  std::vector<medusa::verify_result> short_out(2);
  CHECK_THROWS_AS(medusa::verify_batch(t, std::span<const medusa::verify_request>(reqs), medusa::greedy_policy{},
                                       ws, std::span<medusa::verify_result>(short_out)),
                  medusa::acceptance_error);
}

TEST_CASE("bad input: typed errors naming the node, sizes and parameters") {
  const auto t = notebook_tree();
  std::mt19937 rng(11);
  auto s = random_step(t, 20, rng);
  auto code = [](auto&& f) {
    try {
      f();
    } catch (const medusa::acceptance_error& e) {
      return e.code();
    }
    FAIL("no acceptance_error");
    return medusa::acceptance_errc::bad_parameter;
  };
  using E = medusa::acceptance_errc;
  // NaN in the root row (always read) names node 0; NaN in a row nobody reads is not an error.
  force_greedy_path(t, s, 4, rng);  // accepted path 0 → 1 → 4
  const float saved = s.row(1)[7];
  s.row(1)[7] = std::numeric_limits<float>::quiet_NaN();
  try {
    medusa::verify(t, s.request(), medusa::greedy_policy{});
    FAIL("no throw");
  } catch (const medusa::acceptance_error& e) {
    CHECK(e.code() == E::non_finite_logit);
    CHECK(e.node() == 1);
    CHECK(std::string(e.what()).find("node 1") != std::string::npos);
  }
  s.row(1)[7] = saved;
  s.row(8)[3] = std::numeric_limits<float>::infinity();
  CHECK(medusa::verify(t, s.request(), medusa::greedy_policy{}).next_node == 4);
  s.row(8)[3] = 0.0f;

  auto req = s.request();
  req.vocab = 19;  // 9 x 20 logits read as vocab 19
  CHECK(code([&] { medusa::verify(t, req, medusa::greedy_policy{}); }) == E::vocab_mismatch);
  req.vocab = 0;
  CHECK(code([&] { medusa::verify(t, req, medusa::greedy_policy{}); }) == E::vocab_mismatch);
  req = s.request();
  req.logits = req.logits.first(req.logits.size() - 20);  // 8 rows of 20 for 9 nodes
  CHECK(code([&] { medusa::verify(t, req, medusa::greedy_policy{}); }) == E::size_mismatch);
  auto bad_tokens = s.tokens;
  bad_tokens[5] = 20;
  req = s.request();
  req.node_tokens = bad_tokens;
  try {
    medusa::verify(t, req, medusa::greedy_policy{});
    FAIL("no throw");
  } catch (const medusa::acceptance_error& e) {
    CHECK(e.code() == E::token_out_of_range);
    CHECK(e.node() == 5);
  }
  req.node_tokens = std::span<const std::int32_t>(s.tokens).first(8);
  CHECK(code([&] { medusa::verify(t, req, medusa::greedy_policy{}); }) == E::size_mismatch);
  CHECK(code([&] { medusa::verify(t, s.request(), medusa::typical_policy{.temperature = -1.0f}); }) ==
        E::bad_parameter);
  CHECK(code([&] {
          medusa::verify(t, s.request(), medusa::typical_policy{.temperature = 1.0f, .posterior_threshold = NAN});
        }) == E::bad_parameter);
  CHECK(code([&] { medusa::verify(t, s.request(), medusa::rejection_policy{{.top_p = -0.5f}}); }) ==
        E::bad_parameter);
  CHECK(code([&] { medusa::verify(t, s.request(), medusa::speculative_policy{}); }) == E::size_mismatch);
  std::vector<float> draft(s.logits.size(), 0.0f);
  req = s.request();
  req.draft_probs = draft;
  CHECK(code([&] { medusa::verify(t, req, medusa::speculative_policy{}); }) == E::bad_draft);
}

TEST_CASE("sample_token: T = 0 is the argmax, top-k 1 is the argmax, draws stay in the support") {
  std::vector<float> z{0.1f, 2.0f, -1.0f, 2.0f, 0.5f};
  medusa::acceptance_workspace ws;
  CHECK(medusa::sample_token(z, {.temperature = 0.0f}, 1, 0, ws) == 1);
  for (std::uint64_t step = 0; step < 50; ++step) {
    CHECK(medusa::sample_token(z, {.temperature = 1.0f, .top_k = 1}, 9, step, ws) == 1);
    const auto x = medusa::sample_token(z, {.temperature = 1.0f, .top_k = 2}, 9, step, ws);
    CHECK((x == 1 || x == 3));
    // top-p 0: only the top token (ties by id) survives.
    CHECK(medusa::sample_token(z, {.temperature = 2.0f, .top_p = 0.0f}, 9, step, ws) == 1);
  }
}

TEST_CASE("warp: top-k and top-p keep exactly the reference nucleus on large vocabularies") {
  std::mt19937 rng(8);
  for (int v : {50, 5000, 40000}) {
    std::vector<float> z(static_cast<std::size_t>(v));
    std::normal_distribution<float> nd(0.0f, 2.0f);
    for (auto& x : z) x = std::round(nd(rng) * 8.0f) / 8.0f;  // many ties
    for (float temp : {0.5f, 1.0f}) {
      for (float top_p : {0.0f, 0.3f, 0.9f, 0.999f}) {
        for (int top_k : {0, 7, 3000}) {
          std::vector<double> r(static_cast<std::size_t>(v));
          std::vector<std::int32_t> ids(static_cast<std::size_t>(v));
          std::vector<std::uint64_t> keys(static_cast<std::size_t>(v));
          const double mass = medusa::detail::warp_into(z, {.temperature = temp, .top_k = top_k, .top_p = top_p},
                                                        r.data(), ids.data(), keys.data());
          // Reference: full stable sort by logit, libm exp.
          std::vector<int> order(static_cast<std::size_t>(v));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[static_cast<std::size_t>(a)] > z[static_cast<std::size_t>(b)]; });
          const std::size_t kk = top_k > 0 && top_k < v ? static_cast<std::size_t>(top_k) : order.size();
          const float m = z[static_cast<std::size_t>(order[0])];
          double total = 0.0;
          for (std::size_t i = 0; i < kk; ++i) total += std::exp((z[static_cast<std::size_t>(order[i])] - m) / temp);
          std::size_t keep = 0;
          double above = 0.0;
          for (; keep < kk; ++keep) {
            if (above > top_p * total) break;
            above += std::exp((z[static_cast<std::size_t>(order[keep])] - m) / temp);
          }
          std::size_t kept = 0;
          for (std::size_t i = 0; i < order.size(); ++i) {
            const bool in = r[static_cast<std::size_t>(order[i])] > 0.0;
            if (i < keep) CHECK_MESSAGE(in, "v=" << v << " T=" << temp << " top_p=" << top_p << " top_k=" << top_k << " rank " << i);
            else if (in) ++kept;
          }
          CHECK_MESSAGE(kept == 0, "v=" << v << " T=" << temp << " top_p=" << top_p << " top_k=" << top_k);
          double sum = 0.0;
          for (double x : r) sum += x;
          CHECK(std::abs(sum - mass) <= 1e-9 * mass);
        }
      }
    }
  }
}

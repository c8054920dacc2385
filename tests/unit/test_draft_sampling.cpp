// SPDX-License-Identifier: Apache-2.0
// draft_sampling_policy and sample_candidates (docs/acceptance.md): candidates drawn without
// replacement from one draft distribution per depth, verified by recursive rejection sampling.
// Statistical losslessness (chi-square on the first two generated tokens, small vocabularies,
// several trees and warps), the power of that check against biased variants, T = 0 = greedy,
// typed errors, and the batch decoder end to end on the tiny transformer.
#include "stats_common.hpp"
#include "tiny_transformer.hpp"

#include <medusa/acceptance.hpp>
#include <medusa/candidates.hpp>
#include <medusa/decoder.hpp>
#include <medusa/dispatch.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using stats::chi2_result;
using stats::chi2_survival;
using stats::chi2_test;
using stats::reference_warp;

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A toy autoregressive model: logits in [-scale, scale] as a hash of the whole context, built
// incrementally so that a tree node extends its parent.
std::uint64_t extend(std::uint64_t h, int token) { return splitmix(h ^ static_cast<std::uint64_t>(token + 1)); }

std::uint64_t context_hash(const std::vector<int>& context, std::uint64_t salt) {
  std::uint64_t h = splitmix(salt);
  for (int t : context) h = extend(h, t);
  return h;
}

void logits_of(std::uint64_t h, int vocab, float scale, float* out) {
  for (int x = 0; x < vocab; ++x)
    out[x] = static_cast<float>((static_cast<double>(splitmix(h ^ (0x100u + static_cast<unsigned>(x))) >> 40) /
                                     16777216.0 * 2.0 - 1.0) *
                                static_cast<double>(scale));
}

constexpr std::uint64_t target_salt = 0x7A26E7;
constexpr std::uint64_t head_salt = 0x4EAD5;

struct config {
  float temperature;
  float top_p;
  int top_k = 0;
};

// How one simulated step builds and verifies its drafts.
enum class variant {
  exact,            // sample_candidates + draft_sampling_policy
  no_removal,       // same draws, verified as independent draws (speculative_policy, rows p_d per node)
  mismatched_rows,  // draws from the heads at 2T, rows claim T
  top_k,            // the heads' top-K with rejection_policy (the deterministic baseline)
};

struct step_scratch {
  std::vector<std::int32_t> tokens;
  std::vector<float> heads, rows, rows2, logits, per_node;
  std::vector<std::uint64_t> th;
};

// One step at context `ctx` (its last token is the root): draft heads = the toy model at the root
// context under per-depth salts (scale `head_scale`), drafts drawn without replacement, target =
// the toy model along each node's path. Returns the committed drafts, then the bonus.
std::vector<int> run_step(const medusa::tree& t, const std::vector<int>& ctx, int vocab, const config& c,
                          std::uint64_t step, variant how, medusa::acceptance_workspace& ws, step_scratch& sc,
                          float head_scale = 1.5f) {
  const int n = t.num_nodes(), depth = t.depth();
  const auto un = static_cast<std::size_t>(n), v = static_cast<std::size_t>(vocab);
  sc.tokens.resize(un);
  sc.heads.resize(static_cast<std::size_t>(depth) * v);
  sc.rows.resize(static_cast<std::size_t>(depth) * v);
  sc.logits.resize(un * v);
  sc.th.resize(un);
  // Head d guesses the token d+1 ahead: the target's logits after the greedy continuation, plus
  // noise of scale `head_scale`.
  const std::uint64_t ch = context_hash(ctx, head_salt);
  std::uint64_t th = context_hash(ctx, target_salt);
  std::vector<float> noise(v);
  for (int d = 0; d < depth; ++d) {
    float* row = sc.heads.data() + static_cast<std::size_t>(d) * v;
    logits_of(th, vocab, 2.0f, row);
    logits_of(splitmix(ch + static_cast<std::uint64_t>(d)), vocab, head_scale, noise.data());
    th = extend(th, static_cast<int>(std::max_element(row, row + vocab) - row));
    for (std::size_t x = 0; x < v; ++x) row[x] += noise[x];
  }
  const medusa::draft_sampling_policy policy{{.temperature = c.temperature, .top_k = c.top_k, .top_p = c.top_p}};
  constexpr std::uint64_t seed = 0x5EED;
  if (how == variant::mismatched_rows) {
    medusa::sampling_warp hot = policy;
    hot.temperature *= 2.0f;
    sc.rows2.resize(sc.rows.size());
    medusa::sample_candidates(t, ctx.back(), sc.heads, vocab, hot, seed, step, sc.tokens, sc.rows2, ws);
    std::vector<std::int32_t> unused(un);
    medusa::sample_candidates(t, ctx.back(), sc.heads, vocab, policy, seed, step, unused, sc.rows, ws);
    // The hot draws may have zero mass under the claimed rows: retry is not an option, so give
    // such a token a tiny mass (the bias is what is being measured).
    for (int u = 1; u < n; ++u) {
      float* row = sc.rows.data() + static_cast<std::size_t>(t.node_depth(u) - 1) * v;
      float& p = row[sc.tokens[static_cast<std::size_t>(u)]];
      if (p == 0.0f) p = 1e-6f;
    }
  } else if (how == variant::top_k) {
    std::vector<std::int32_t> flat(medusa::flat_candidates_size(t, depth));
    medusa::generate_candidates(t, ctx.back(), sc.heads, vocab, flat, sc.tokens);
  } else {
    medusa::sample_candidates(t, ctx.back(), sc.heads, vocab, policy, seed, step, sc.tokens, sc.rows, ws);
  }
  sc.th[0] = context_hash(ctx, target_salt);
  for (int u = 0; u < n; ++u) {
    const auto uu = static_cast<std::size_t>(u);
    if (u > 0) sc.th[uu] = extend(sc.th[static_cast<std::size_t>(t.parent(u))], sc.tokens[uu]);
    logits_of(sc.th[uu], vocab, 2.0f, sc.logits.data() + uu * v);
  }
  medusa::verify_request req{.node_tokens = sc.tokens, .logits = sc.logits, .vocab = vocab, .seed = seed, .step = step};
  medusa::verify_result r;
  if (how == variant::no_removal) {
    sc.per_node.assign(un * v, 0.0f);
    for (int u = 1; u < n; ++u)
      std::copy_n(sc.rows.data() + static_cast<std::size_t>(t.node_depth(u) - 1) * v, v, sc.per_node.data() + static_cast<std::size_t>(u) * v);
    req.draft_probs = sc.per_node;
    r = medusa::verify(t, req, medusa::speculative_policy{policy}, ws);
  } else if (how == variant::top_k) {
    r = medusa::verify(t, req, medusa::rejection_policy{policy}, ws);
  } else {
    req.draft_rows = sc.rows;
    r = medusa::verify(t, req, policy, ws);
  }
  std::vector<int> out(r.tokens().begin() + 1, r.tokens().end());
  out.push_back(r.bonus);
  return out;
}

struct lossless_stats {
  chi2_result first, first_two;
  double mean_accepted = 0.0;
};

// Joint distribution of the first two generated tokens after context {0} against the exact one.
lossless_stats sample_first_two(const medusa::tree& t, int vocab, const config& c, int trials, variant how) {
  const std::vector<int> ctx{0};
  std::vector<float> z(static_cast<std::size_t>(vocab));
  logits_of(context_hash(ctx, target_salt), vocab, 2.0f, z.data());
  const auto q1 = reference_warp(z.data(), vocab, c.temperature, c.top_k, c.top_p);
  const auto v = static_cast<std::size_t>(vocab);
  std::vector<double> p12(v * v);
  for (int a = 0; a < vocab; ++a) {
    logits_of(context_hash({0, a}, target_salt), vocab, 2.0f, z.data());
    const auto q2 = reference_warp(z.data(), vocab, c.temperature, c.top_k, c.top_p);
    for (int b = 0; b < vocab; ++b) p12[static_cast<std::size_t>(a * vocab + b)] = q1[static_cast<std::size_t>(a)] * q2[static_cast<std::size_t>(b)];
  }
  std::vector<long> o1(v), o12(v * v);
  medusa::acceptance_workspace ws(t.num_nodes(), vocab);
  step_scratch sc;
  long accepted = 0;
  for (int i = 0; i < trials; ++i) {
    auto g = run_step(t, ctx, vocab, c, 2 * static_cast<std::uint64_t>(i), how, ws, sc);
    accepted += static_cast<long>(g.size()) - 1;
    if (g.size() < 2) {  // only the bonus: the next step (root = bonus) gives the second token
      const auto g2 = run_step(t, {0, g[0]}, vocab, c, 2 * static_cast<std::uint64_t>(i) + 1, how, ws, sc);
      g.push_back(g2[0]);
    }
    ++o1[static_cast<std::size_t>(g[0])];
    ++o12[static_cast<std::size_t>(g[0] * vocab + g[1])];
  }
  lossless_stats s;
  s.first = chi2_test(q1, o1, trials);
  s.first_two = chi2_test(p12, o12, trials);
  s.mean_accepted = static_cast<double>(accepted) / trials;
  return s;
}

const config lossless_configs[] = {{0.5f, 1.0f}, {1.0f, 1.0f}, {1.5f, 1.0f}, {1.0f, 0.7f}, {1.5f, 0.8f, 4}};

void check_lossless_tree(const medusa::tree& t, int vocab, int trials) {
  for (const config& c : lossless_configs) {
    const lossless_stats s = sample_first_two(t, vocab, c, trials, variant::exact);
    MESSAGE("V=" << vocab << " nodes=" << t.num_nodes() << " T=" << c.temperature << " top_p=" << c.top_p
                 << " top_k=" << c.top_k << ": chi2(first)=" << s.first.stat << "/" << s.first.dof
                 << " p=" << s.first.p << ", chi2(first two)=" << s.first_two.stat << "/" << s.first_two.dof
                 << " p=" << s.first_two.p << ", accepted/step=" << s.mean_accepted);
    CHECK(!s.first.impossible);
    CHECK(!s.first_two.impossible);
    CHECK(s.first.p > 0.001);
    CHECK(s.first_two.p > 0.001);
    CHECK(s.mean_accepted > 0.1);  // the drafts do get accepted: the tree is exercised
  }
}

// Trials of a lossless check. Under AddressSanitizer, where the sampling runs several times
// slower, fewer: the same chi-square test at the same level, with less power; the power check
// below keeps the full count.
constexpr int power_trials = 150000;
#if defined(__SANITIZE_ADDRESS__)
constexpr int stat_trials = 15000;
#else
constexpr int stat_trials = power_trials;
#endif

}  // namespace

TEST_CASE("sampled drafts: lossless on a chain (V = 6)") {
  check_lossless_tree(medusa::tree::from_paths({{0}, {0, 0}, {0, 0, 0}}), 6, stat_trials);
}

TEST_CASE("sampled drafts: lossless on a wide tree (V = 7)") {
  check_lossless_tree(medusa::tree::from_paths({{0}, {1}, {2}, {3}}), 7, stat_trials);
}

TEST_CASE("sampled drafts: lossless on a mixed tree (V = 8)") {
  check_lossless_tree(medusa::tree::from_paths({{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}}), 8, stat_trials);
}

TEST_CASE("sampled drafts: lossless when a parent skips ranks of its depth (V = 6)") {
  // Depth 2 draws ranks 0, 1, 2; node {0} has children of ranks 0 and 2, node {1} only rank 1.
  check_lossless_tree(medusa::tree::from_paths({{0}, {1}, {2}, {0, 0}, {0, 2}, {1, 1}, {0, 2, 0}}), 6, stat_trials);
}

TEST_CASE("sampled drafts: lossless when a depth lacks ranks (V = 6)") {
  // Depth 1 has ranks 0 and 2 only, depth 2 rank 1 only: absent ranks are never drawn.
  check_lossless_tree(medusa::tree::from_paths({{0}, {2}, {0, 1}, {2, 1}}), 6, stat_trials);
}

TEST_CASE("sampled drafts: the chi-square check catches biased variants") {
  const auto t = medusa::tree::from_paths({{0}, {1}, {2}, {3}, {0, 0}, {0, 1}});
  const config c{1.0f, 1.0f};
  const lossless_stats exact = sample_first_two(t, 6, c, power_trials, variant::exact);
  const lossless_stats no_removal = sample_first_two(t, 6, c, power_trials, variant::no_removal);
  const lossless_stats mismatched = sample_first_two(t, 6, c, power_trials, variant::mismatched_rows);
  MESSAGE("exact: chi2(first)=" << exact.first.stat << "/" << exact.first.dof << " p=" << exact.first.p
                                << ", chi2(first two)=" << exact.first_two.stat << "/" << exact.first_two.dof);
  MESSAGE("siblings not removed from p_i: chi2(first)=" << no_removal.first.stat << "/" << no_removal.first.dof
                                                       << " p=" << no_removal.first.p << ", chi2(first two)="
                                                       << no_removal.first_two.stat << "/" << no_removal.first_two.dof
                                                       << " p=" << no_removal.first_two.p);
  MESSAGE("rows not the draws' distribution: chi2(first)=" << mismatched.first.stat << "/" << mismatched.first.dof
                                                          << " p=" << mismatched.first.p << ", chi2(first two)="
                                                          << mismatched.first_two.stat << "/"
                                                          << mismatched.first_two.dof << " p=" << mismatched.first_two.p);
  CHECK(exact.first.p > 0.001);
  CHECK(exact.first_two.p > 0.001);
  CHECK(no_removal.first_two.p < 1e-6);
  CHECK(mismatched.first_two.p < 1e-6);
}

TEST_CASE("sampled drafts accept more than top-K drafts at T > 0 (same heads, same tree)") {
  const auto t = medusa::tree::from_paths({{0}, {1}, {2}, {3}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}, {0, 0, 1}});
  for (const config& c : {config{0.7f, 1.0f}, config{1.0f, 1.0f}, config{1.0f, 0.9f}}) {
    const lossless_stats sampled = sample_first_two(t, 8, c, 20000, variant::exact);
    const lossless_stats top_k = sample_first_two(t, 8, c, 20000, variant::top_k);
    MESSAGE("T=" << c.temperature << " top_p=" << c.top_p << ": accepted drafts per step, sampled "
                 << sampled.mean_accepted << " vs top-K " << top_k.mean_accepted << " (top-K chi2(first two) p="
                 << top_k.first_two.p << ")");
    CHECK(top_k.first_two.p > 0.001);  // both are lossless
    CHECK(sampled.first_two.p > 0.001);
    CHECK(sampled.mean_accepted > top_k.mean_accepted);
  }
}

TEST_CASE("sampled drafts at T = 0: top-K candidates and exactly greedy verification") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  constexpr int vocab = 24;
  const auto v = static_cast<std::size_t>(vocab);
  const auto n = static_cast<std::size_t>(t.num_nodes());
  const auto depth = static_cast<std::size_t>(t.depth());
  medusa::draft_sampling_policy policy;
  policy.temperature = 0.0f;
  medusa::acceptance_workspace ws(t.num_nodes(), vocab);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> heads((depth + 1) * v), rows(depth * v), logits(n * v);
  std::vector<std::int32_t> sampled(n), topk(n), flat(medusa::flat_candidates_size(t, t.depth() + 1));
  int deep = 0;
  for (int trial = 0; trial < 300; ++trial) {
    for (float& x : heads) x = normal(rng);
    const auto root = static_cast<std::int32_t>(trial % vocab);
    medusa::sample_candidates(t, root, heads, vocab, policy, 9, static_cast<std::uint64_t>(trial), sampled, rows, ws);
    medusa::generate_candidates(t, root, heads, vocab, flat, topk);
    REQUIRE(sampled == topk);
    // Target rows: random, but the argmax of a node's row is often one of its children's tokens.
    for (std::size_t u = 0; u < n; ++u) {
      float* z = logits.data() + u * v;
      for (std::size_t x = 0; x < v; ++x) z[x] = normal(rng);
      const int cc = t.child_count(static_cast<int>(u));
      if (cc > 0 && rng() % 3 != 0) z[topk[static_cast<std::size_t>(t.child_begin(static_cast<int>(u)) + static_cast<int>(rng() % static_cast<unsigned>(cc)))]] = 5.0f;
    }
    const medusa::verify_request req{.node_tokens = sampled, .logits = logits, .vocab = vocab, .seed = 1,
                                     .step = static_cast<std::uint64_t>(trial), .draft_rows = rows};
    const auto got = medusa::verify(t, req, policy, ws);
    const auto want = medusa::verify(t, req, medusa::greedy_policy{}, ws);
    CHECK(got.accept_length == want.accept_length);
    CHECK(got.next_node == want.next_node);
    CHECK(got.bonus == want.bonus);
    CHECK(std::equal(got.nodes().begin(), got.nodes().end(), want.nodes().begin(), want.nodes().end()));
    deep += got.accept_length >= 2;
  }
  CHECK(deep > 10);
}

TEST_CASE("sampled drafts: bad input throws acceptance_error") {
  const auto t = medusa::tree::from_paths({{0}, {1}, {0, 0}, {1, 0}});
  constexpr int vocab = 5;
  const auto v = static_cast<std::size_t>(vocab);
  const auto n = static_cast<std::size_t>(t.num_nodes());
  medusa::draft_sampling_policy policy;
  medusa::acceptance_workspace ws(t.num_nodes(), vocab);
  std::vector<float> heads(2 * v), rows(2 * v), logits(n * v, 0.0f);
  for (std::size_t i = 0; i < heads.size(); ++i) heads[i] = static_cast<float>((i * 7) % 5);
  std::vector<std::int32_t> tokens(n);
  medusa::sample_candidates(t, 1, heads, vocab, policy, 1, 1, tokens, rows, ws);
  auto code_of = [&](auto&& f) {
    try {
      f();
    } catch (const medusa::acceptance_error& e) {
      return std::string(medusa::to_string(e.code()));
    }
    return std::string("none");
  };
  auto verify_with = [&](std::vector<std::int32_t> tok, std::vector<float> r) {
    return code_of([&] {
      const medusa::verify_request req{.node_tokens = tok, .logits = logits, .vocab = vocab, .draft_rows = r};
      (void)medusa::verify(t, req, policy, ws);
    });
  };
  CHECK(verify_with(tokens, rows) == "none");
  SUBCASE("draft rows of the wrong size") {
    CHECK(verify_with(tokens, std::vector<float>(rows.begin(), rows.end() - 1)) == "size_mismatch");
    CHECK(verify_with(tokens, {}) == "size_mismatch");
  }
  SUBCASE("NaN, negative, or a row that does not sum to 1") {
    auto r = rows;
    r[2] = std::numeric_limits<float>::quiet_NaN();
    CHECK(verify_with(tokens, r) == "bad_draft");
    r = rows;
    r[v + 1] = -0.25f;
    r[v + 2] += 0.25f;
    // depth 2 is read only after a depth-1 acceptance; force it with a one-hot target.
    auto tok = tokens;
    std::fill(logits.begin(), logits.end(), -50.0f);
    logits[static_cast<std::size_t>(tok[1])] = 50.0f;
    CHECK(verify_with(tok, r) == "bad_draft");
    std::fill(logits.begin(), logits.end(), 0.0f);
    r = rows;
    for (std::size_t i = 0; i < v; ++i) r[i] *= 0.5f;
    CHECK(verify_with(tokens, r) == "bad_draft");
  }
  SUBCASE("a node token with draft probability 0") {
    auto r = rows;
    const float moved = r[static_cast<std::size_t>(tokens[1])];
    r[static_cast<std::size_t>(tokens[1])] = 0.0f;
    for (std::size_t i = 0; i < v; ++i)
      if (static_cast<std::int32_t>(i) != tokens[1] && static_cast<std::int32_t>(i) != tokens[2]) {
        r[i] += moved;
        break;
      }
    CHECK(verify_with(tokens, r) == "bad_draft");
  }
  SUBCASE("nodes of one depth and rank disagree, or a token repeats within a depth") {
    auto tok = tokens;
    tok[2] = tok[1];  // two draws of depth 1 with the same token
    logits[static_cast<std::size_t>(tok[1])] = -50.0f;  // the root rejects the first one
    CHECK(verify_with(tok, rows) == "bad_draft");
    logits[static_cast<std::size_t>(tok[1])] = 0.0f;
    tok = tokens;
    tok[4] = static_cast<std::int32_t>((tok[3] + 1) % vocab);  // {1, 0} differs from {0, 0}
    std::fill(logits.begin(), logits.end(), -50.0f);
    logits[static_cast<std::size_t>(tok[2])] = 50.0f;  // the root accepts node {1}
    CHECK(verify_with(tok, rows) == "bad_draft");
    std::fill(logits.begin(), logits.end(), 0.0f);
  }
  SUBCASE("sample_candidates validates its arguments") {
    std::vector<float> bad_heads = heads;
    bad_heads[3] = std::numeric_limits<float>::infinity();
    CHECK(code_of([&] { medusa::sample_candidates(t, 1, bad_heads, vocab, policy, 1, 1, tokens, rows, ws); }) ==
          "non_finite_logit");
    std::vector<float> short_rows(v);
    CHECK(code_of([&] { medusa::sample_candidates(t, 1, heads, vocab, policy, 1, 1, tokens, short_rows, ws); }) ==
          "size_mismatch");
    CHECK(code_of([&] { medusa::sample_candidates(t, vocab, heads, vocab, policy, 1, 1, tokens, rows, ws); }) ==
          "token_out_of_range");
    medusa::sampling_warp cold = policy;
    cold.temperature = -1.0f;
    CHECK(code_of([&] { medusa::sample_candidates(t, 1, heads, vocab, cold, 1, 1, tokens, rows, ws); }) ==
          "bad_parameter");
    const auto wide = medusa::tree::from_paths({{0}, {1}, {2}});
    std::vector<std::int32_t> wide_tokens(4);
    std::vector<float> wide_heads(2), wide_rows(2);
    CHECK(code_of([&] { medusa::sample_candidates(wide, 0, wide_heads, 2, policy, 1, 1, wide_tokens, wide_rows, ws); }) ==
          "vocab_mismatch");
  }
}

TEST_CASE("sampled drafts: draws are without replacement, follow the draft rows, and use their own counters") {
  const auto t = medusa::tree::from_paths({{0}, {1}, {2}, {3}, {0, 0}, {1, 0}});
  constexpr int vocab = 6;
  const auto v = static_cast<std::size_t>(vocab);
  medusa::draft_sampling_policy policy;
  policy.temperature = 1.0f;
  medusa::acceptance_workspace ws(t.num_nodes(), vocab);
  std::vector<float> heads = {2.0f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 0.3f, 0.2f, 0.1f, 0.0f, -0.1f, -0.2f};
  std::vector<float> rows(2 * v);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(t.num_nodes()));
  constexpr int trials = 40000;
  std::vector<long> first(v), second_given_top(v);
  long top_first = 0;
  for (int i = 0; i < trials; ++i) {
    medusa::sample_candidates(t, 0, heads, vocab, policy, 77, static_cast<std::uint64_t>(i), tokens, rows, ws);
    // Distinct tokens at depth 1; both depth-2 nodes (rank 0) share one draw.
    std::vector<std::int32_t> d1(tokens.begin() + 1, tokens.begin() + 5);
    std::sort(d1.begin(), d1.end());
    CHECK(std::adjacent_find(d1.begin(), d1.end()) == d1.end());
    CHECK(tokens[5] == tokens[6]);
    ++first[static_cast<std::size_t>(tokens[1])];
    if (tokens[1] == 0) {
      ++top_first;
      ++second_given_top[static_cast<std::size_t>(tokens[2])];
    }
  }
  const std::vector<double> p0(rows.begin(), rows.begin() + vocab);
  const auto a = chi2_test(p0, first, trials);
  std::vector<double> p1 = p0;  // second draw given that token 0 came first
  p1[0] = 0.0;
  for (auto& x : p1) x /= 1.0 - p0[0];
  const auto b = chi2_test(p1, second_given_top, top_first);
  MESSAGE("first draw chi2=" << a.stat << "/" << a.dof << " p=" << a.p << "; second | first=0 chi2=" << b.stat << "/"
                             << b.dof << " p=" << b.p);
  CHECK(a.p > 0.001);
  CHECK(b.p > 0.001);
  // The first draft draw of (seed, step) is Philox draw 2^63, not the verify call's draw 0.
  auto inverse_cdf = [&](double u) {
    double sum = 0.0, c = 0.0;
    for (std::size_t x = 0; x < v; ++x) sum += static_cast<double>(rows[x]);
    for (int x = 0; x < vocab; ++x)
      if (u * sum < (c += static_cast<double>(rows[static_cast<std::size_t>(x)]))) return x;
    return vocab - 1;
  };
  int same_as_draw0 = 0;
  for (int i = 0; i < 2000; ++i) {
    const auto step = static_cast<std::uint64_t>(i);
    medusa::sample_candidates(t, 0, heads, vocab, policy, 5, step, tokens, rows, ws);
    CHECK(inverse_cdf(medusa::detail::philox_uniform(5, step, medusa::detail::draft_draw_offset)) == tokens[1]);
    same_as_draw0 += inverse_cdf(medusa::detail::philox_uniform(5, step, 0)) == tokens[1];
  }
  CHECK(same_as_draw0 < 1500);  // agreement by chance only (Σ p² of the row)
}

// ------------------------------------------------------------------------------------------------
// End to end: the batch decoder on the tiny transformer
// ------------------------------------------------------------------------------------------------

namespace {

using tiny::tiny_model;

// Logits of the last position after `seq` (a fresh forward from slot 0).
std::vector<float> last_logits(tiny_model& m, const std::vector<std::int32_t>& seq) {
  const auto logits = tiny::outputs_of(m, seq).logits;
  return {logits.end() - tiny_model::vocab, logits.end()};
}

}  // namespace

TEST_CASE("sampled drafts end to end: Medusa decoding has the distribution of plain sampling") {
  tiny_model model(64);
  tiny::random_heads heads(3, 21);
  const std::vector<std::int32_t> prompt = {1, 5, 9, 13};
  const auto tree = medusa::tree::from_paths({{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}});
  medusa::draft_sampling_policy policy;
  policy.temperature = 1.0f;
  policy.top_p = 0.95f;
  const medusa::rejection_policy plain{{policy.temperature, policy.top_k, policy.top_p}};
  constexpr int V = tiny_model::vocab;
  // Exact joint distribution of the first two tokens.
  std::vector<double> p12(static_cast<std::size_t>(V) * V);
  {
    auto z = last_logits(model, prompt);
    const auto q1 = reference_warp(z.data(), V, policy.temperature, policy.top_k, policy.top_p);
    for (int a = 0; a < V; ++a) {
      if (q1[static_cast<std::size_t>(a)] == 0.0) continue;
      auto seq = prompt;
      seq.push_back(a);
      z = last_logits(model, seq);
      const auto q2 = reference_warp(z.data(), V, policy.temperature, policy.top_k, policy.top_p);
      for (int b = 0; b < V; ++b) p12[static_cast<std::size_t>(a * V + b)] = q1[static_cast<std::size_t>(a)] * q2[static_cast<std::size_t>(b)];
    }
  }
  medusa::decoder dec(model, heads, tree, policy);
  medusa::decode_options opt;
  opt.max_new_tokens = 4;
  constexpr int runs = 6000;
  std::vector<long> medusa12(p12.size()), plain12(p12.size());
  std::vector<long> medusa3(V), plain3(V);
  long drafts_accepted = 0, tree_steps = 0;
  for (int i = 0; i < runs; ++i) {
    opt.seed = 1000 + static_cast<std::uint64_t>(i);
    const auto m = dec.generate(prompt, opt);
    REQUIRE(m.tokens.size() == 4);
    ++medusa12[static_cast<std::size_t>(m.tokens[0] * V + m.tokens[1])];
    ++medusa3[static_cast<std::size_t>(m.tokens[2])];
    drafts_accepted += m.stats.new_tokens - m.stats.steps;
    tree_steps += m.stats.tree_steps;
    opt.seed = 500000 + static_cast<std::uint64_t>(i);
    const auto p = medusa::generate_vanilla(model, prompt, plain, opt);
    ++plain12[static_cast<std::size_t>(p.tokens[0] * V + p.tokens[1])];
    ++plain3[static_cast<std::size_t>(p.tokens[2])];
  }
  const auto cm = chi2_test(p12, medusa12, runs);
  const auto cp = chi2_test(p12, plain12, runs);
  // Third token: two-sample chi-square, Medusa against plain sampling.
  double stat3 = 0.0;
  int cells3 = 0;
  for (int x = 0; x < V; ++x) {
    const double a = static_cast<double>(medusa3[static_cast<std::size_t>(x)]);
    const double b = static_cast<double>(plain3[static_cast<std::size_t>(x)]);
    if (a + b < 10) continue;
    stat3 += (a - b) * (a - b) / (a + b);
    ++cells3;
  }
  const double p3 = chi2_survival(stat3, cells3 - 1);
  MESSAGE("Medusa first two: chi2=" << cm.stat << "/" << cm.dof << " p=" << cm.p << "; plain: chi2=" << cp.stat << "/"
                                    << cp.dof << " p=" << cp.p << "; third token two-sample chi2=" << stat3 << "/"
                                    << cells3 - 1 << " p=" << p3 << "; drafts accepted per tree step "
                                    << static_cast<double>(drafts_accepted) / static_cast<double>(tree_steps));
  CHECK(!cm.impossible);
  CHECK(cm.p > 0.001);
  CHECK(cp.p > 0.001);
  CHECK(p3 > 0.001);
  CHECK(tree_steps > 0);
  CHECK(drafts_accepted > 0);
}

TEST_CASE("sampled drafts in the decoder: reproducible for a seed, T = 0 is greedy decoding") {
  tiny_model model(256);
  tiny::random_heads heads(4, 3);
  medusa::draft_sampling_policy policy;
  policy.temperature = 0.8f;
  policy.top_p = 0.9f;
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  medusa::decode_options opt;
  opt.max_new_tokens = 30;
  opt.seed = 42;
  const std::vector<std::int32_t> prompt = {1, 5, 9, 13, 2, 7};
  medusa::decoder dec(model, heads, tree, policy);
  const auto a = dec.generate(prompt, opt);
  const auto b = dec.generate(prompt, opt);
  CHECK(a.tokens == b.tokens);
  CHECK(a.tokens.size() == 30);
  CHECK(a.stats.tree_steps > 0);
  for (auto t : a.tokens) CHECK((t >= 0 && t < tiny_model::vocab));
  // T = 0: identical to greedy decoding.
  policy.temperature = 0.0f;
  medusa::decoder greedy_dec(model, heads, tree, policy);
  CHECK(greedy_dec.generate(prompt, opt).tokens == medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt).tokens);
}

namespace {

// One tiny_model per request (same weights), driven as a batch model: each request's rows of the
// ragged batch run through its own model.
struct per_request_models {
  std::vector<std::unique_ptr<tiny_model>> models;
  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  medusa::kv_cache_view<float> kv_cache(int request) { return models[static_cast<std::size_t>(request)]->kv_cache(); }
  void forward(const medusa::ragged_batch& b) {
    constexpr std::size_t V = tiny_model::vocab, D = tiny_model::dim;
    for (int i = 0; i < b.size(); ++i) {
      const auto r0 = static_cast<std::size_t>(b.qo_indptr[static_cast<std::size_t>(i)]);
      const int T = b.count(i);
      const std::size_t out0 = b.last_row_only ? static_cast<std::size_t>(i) : r0;
      const std::size_t rows = b.last_row_only ? 1 : static_cast<std::size_t>(T);
      medusa::forward_batch f;
      f.tokens = b.tokens.subspan(r0, static_cast<std::size_t>(T));
      f.positions = b.positions.subspan(r0, static_cast<std::size_t>(T));
      f.cache_length = b.cache_lengths[static_cast<std::size_t>(i)];
      f.tree_mask = T > 1 ? b.mask_of(i) : medusa::tree_mask_view{};
      f.first_output_row = b.last_row_only ? T - 1 : 0;
      f.logits = b.logits.subspan(out0 * V, rows * V);
      f.hidden = b.hidden.subspan(out0 * D, rows * D);
      models[static_cast<std::size_t>(b.requests[static_cast<std::size_t>(i)])]->forward(f);
    }
  }
};

}  // namespace

TEST_CASE("sampled drafts in a batch: each request gets exactly the tokens it gets alone") {
  tiny::random_heads heads(4, 9);
  medusa::draft_sampling_policy policy;
  policy.temperature = 0.9f;
  policy.top_k = 20;
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 5, 9}, {2, 4, 6, 8, 10}, {3}};
  tiny_model one(256);
  std::vector<medusa::decode_result> alone;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    opt.seed = 100 + i;
    medusa::decoder single(one, heads, tree, policy);
    alone.push_back(single.generate(prompts[i], opt));
  }
  per_request_models engine;
  for (std::size_t i = 0; i < prompts.size(); ++i) engine.models.push_back(std::make_unique<tiny_model>(256));
  medusa::batch_decoder dec(engine, heads, tree, policy, 3);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    opt.seed = 100 + i;
    dec.join(static_cast<int>(i), prompts[i], opt);
  }
  std::vector<std::vector<std::int32_t>> got(prompts.size());
  while (!dec.empty())
    for (auto& u : dec.step()) {
      INFO(u.error_message());
      CHECK(u.reason != medusa::stop_reason::failed);
      got[static_cast<std::size_t>(u.request)].insert(got[static_cast<std::size_t>(u.request)].end(), u.tokens.begin(), u.tokens.end());
    }
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == alone[i].tokens);
    CHECK(alone[i].stats.tree_steps > 0);
  }
  CHECK(got[0] != got[1]);
}

TEST_CASE("draft_sampling_policy by name: 'sampled', options applied and validated") {
  static_assert(medusa::depth_draft_policy<medusa::draft_sampling_policy>);
  static_assert(!medusa::depth_draft_policy<medusa::speculative_policy>);
  static_assert(medusa::acceptance_policy<medusa::draft_sampling_policy>);
  CHECK(medusa::draft_sampling_policy::name == "sampled");
  using run_list = medusa::policy_list<medusa::greedy_policy, medusa::rejection_policy, medusa::draft_sampling_policy>;
  medusa::policy_options o;
  o.temperature = 0.7f;
  o.top_p = 0.9f;
  const auto p = medusa::dispatch_policy(
      "sampled", o,
      [](const auto& policy) -> medusa::draft_sampling_policy {
        if constexpr (std::is_same_v<std::decay_t<decltype(policy)>, medusa::draft_sampling_policy>) return policy;
        else return {};
      },
      run_list{});
  CHECK(p.temperature == 0.7f);
  CHECK(p.top_p == 0.9f);
  CHECK(medusa::make_policy<medusa::draft_sampling_policy>({}).temperature == 1.0f);
  o.temperature = -1.0f;
  CHECK_THROWS_AS(medusa::make_policy<medusa::draft_sampling_policy>(o), medusa::acceptance_error);
}

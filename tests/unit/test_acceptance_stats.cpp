// SPDX-License-Identifier: Apache-2.0
// Statistical losslessness of tree rejection sampling (docs/acceptance.md): the first and the
// first two generated tokens (accepted drafts, then the bonus, continued by the next step when
// needed) are distributed exactly as autoregressive sampling from the warped target. Vocab 8, a
// 3-level tree, 200k seeded trials per configuration, chi-square with p > 0.001 (Wilson–Hilferty).
#include "stats_common.hpp"

#include <medusa/acceptance.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int vocab = 8;
constexpr int trials = 200000;

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A toy autoregressive model: logits in [-2, 2] as a hash of the whole context. The context
// hash is built incrementally (hash of a prefix + one token), so a tree node extends its parent.
std::uint64_t extend(std::uint64_t h, int token) { return splitmix(h ^ static_cast<std::uint64_t>(token + 1)); }

std::uint64_t context_hash(const std::vector<int>& context, std::uint64_t salt) {
  std::uint64_t h = splitmix(salt);
  for (int t : context) h = extend(h, t);
  return h;
}

void logits_of(std::uint64_t h, float* out) {
  for (int x = 0; x < vocab; ++x)
    out[x] = static_cast<float>(static_cast<double>(splitmix(h ^ (0x100u + static_cast<unsigned>(x))) >> 40) /
                                16777216.0 * 4.0 - 2.0);
}

constexpr std::uint64_t target_salt = 0x7A26E7;
constexpr std::uint64_t draft_salt = 0xD4AF7;

void model_logits(const std::vector<int>& context, std::uint64_t salt, float* out) {
  logits_of(context_hash(context, salt), out);
}

// Independent reference of the warp (double, libm, full sort; stats_common.hpp).
std::array<double, vocab> reference_warp(const float* z, double temperature, double top_p) {
  const auto q = stats::reference_warp(z, vocab, temperature, 0, top_p);
  std::array<double, vocab> out{};
  std::copy(q.begin(), q.end(), out.begin());
  return out;
}

using stats::chi2_survival;

// Pearson chi-square over cells (stats::chi2_test); zero-probability cells must stay empty.
// Returns the p-value.
double chi2_p(const std::vector<double>& expected_prob, const std::vector<long>& observed, long n) {
  const auto r = stats::chi2_test(expected_prob, observed, n);
  CHECK_FALSE(r.impossible);
  return r.p;
}

struct config {
  float temperature;
  float top_p;
};

// Buffers of one simulated step, reused across trials.
struct step_scratch {
  std::vector<std::int32_t> tokens;
  std::vector<float> logits, dprobs;
  std::vector<std::uint64_t> th, dh;  // per node: context hash under the target / draft model
};

// One verify step at context `ctx` (whose last token is the root). Deterministic drafts: the
// token of a node is a fixed function of (depth, rank, root), distinct among siblings. With
// `draft`, each child token is sampled independently from a draft model's softmax at its parent.
template <class Policy>
std::vector<int> generate(const medusa::tree& t, const std::vector<int>& ctx, const Policy& policy,
                          std::uint64_t step, bool draft, std::mt19937_64& draft_rng,
                          medusa::acceptance_workspace& ws, step_scratch& sc) {
  const int n = t.num_nodes();
  const auto un = static_cast<std::size_t>(n);
  sc.tokens.resize(un);
  sc.logits.resize(un * vocab);
  sc.dprobs.resize(draft ? un * vocab : 0);
  sc.th.resize(un);
  sc.dh.resize(un);
  sc.th[0] = context_hash(ctx, target_salt);
  sc.dh[0] = context_hash(ctx, draft_salt);
  sc.tokens[0] = ctx.back();
  std::uniform_real_distribution<double> uni;
  for (int u = 0; u < n; ++u) {
    const auto uu = static_cast<std::size_t>(u);
    if (u > 0) {
      const auto p = static_cast<std::size_t>(t.parent(u));
      std::int32_t tok;
      if (draft) {
        float dz[vocab];
        logits_of(sc.dh[p], dz);
        double s = 0.0;
        float* row = sc.dprobs.data() + uu * vocab;
        double e[vocab];
        for (int x = 0; x < vocab; ++x) s += e[x] = std::exp(static_cast<double>(dz[x]));
        for (int x = 0; x < vocab; ++x) row[x] = static_cast<float>(e[x] / s);
        double c = 0.0;
        const double r = uni(draft_rng);
        tok = vocab - 1;
        for (int x = 0; x < vocab - 1; ++x)
          if (r < (c += static_cast<double>(row[x]))) {
            tok = x;
            break;
          }
      } else {
        tok = (3 * t.node_depth(u) + 5 * t.rank(u) + sc.tokens[0]) % vocab;
      }
      sc.tokens[uu] = tok;
      sc.th[uu] = extend(sc.th[p], tok);
      sc.dh[uu] = extend(sc.dh[p], tok);
    }
    logits_of(sc.th[uu], sc.logits.data() + uu * vocab);
  }
  medusa::verify_request req{.node_tokens = sc.tokens, .logits = sc.logits, .vocab = vocab,
                             .draft_probs = sc.dprobs, .seed = 0x5EED, .step = step};
  const auto r = medusa::verify(t, req, policy, ws);
  std::vector<int> out(r.tokens().begin() + 1, r.tokens().end());
  out.push_back(r.bonus);
  return out;
}

template <class Policy>
void check_lossless(const medusa::tree& t, const config& c, bool draft) {
  const Policy policy{{.temperature = c.temperature, .top_p = c.top_p}};
  const std::vector<int> ctx{0};
  float z[vocab];
  model_logits(ctx, target_salt, z);
  const auto q1 = reference_warp(z, c.temperature, c.top_p);
  std::vector<double> p1(q1.begin(), q1.end()), p12(vocab * vocab);
  for (int a = 0; a < vocab; ++a) {
    model_logits({0, a}, target_salt, z);
    const auto q2 = reference_warp(z, c.temperature, c.top_p);
    for (int b = 0; b < vocab; ++b) p12[static_cast<std::size_t>(a * vocab + b)] = q1[static_cast<std::size_t>(a)] * q2[static_cast<std::size_t>(b)];
  }
  std::vector<long> o1(vocab), o12(vocab * vocab);
  medusa::acceptance_workspace ws(t.num_nodes(), vocab);
  std::mt19937_64 draft_rng(99);
  step_scratch sc;
  for (int i = 0; i < trials; ++i) {
    auto g = generate(t, ctx, policy, 2 * static_cast<std::uint64_t>(i), draft, draft_rng, ws, sc);
    if (g.size() < 2) {  // only the bonus: the next step (root = bonus) gives the second token
      const auto g2 = generate(t, {0, g[0]}, policy, 2 * static_cast<std::uint64_t>(i) + 1, draft, draft_rng, ws, sc);
      g.push_back(g2[0]);
    }
    ++o1[static_cast<std::size_t>(g[0])];
    ++o12[static_cast<std::size_t>(g[0] * vocab + g[1])];
  }
  const double pa = chi2_p(p1, o1, trials);
  const double pb = chi2_p(p12, o12, trials);
  MESSAGE("T=" << c.temperature << " top_p=" << c.top_p << std::string(draft ? " draft" : " top-k drafts")
               << " nodes=" << t.num_nodes() << ": p(first)=" << pa << " p(first two)=" << pb);
  CHECK(pa > 0.001);
  CHECK(pb > 0.001);
}

const config configs[] = {{0.7f, 1.0f}, {1.0f, 1.0f}, {0.7f, 0.8f}, {1.0f, 0.8f}};

}  // namespace

TEST_CASE("chi-square helper: known quantiles") {
  CHECK(std::abs(chi2_survival(3.841, 1) - 0.05) < 0.01);
  CHECK(std::abs(chi2_survival(18.307, 10) - 0.05) < 0.005);
  CHECK(std::abs(chi2_survival(29.588, 10) - 0.001) < 0.0005);
}

TEST_CASE("rejection sampling over a tree of deterministic drafts is lossless") {
  const auto t = medusa::tree::from_paths({{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}});
  for (const auto& c : configs) check_lossless<medusa::rejection_policy>(t, c, false);
}

TEST_CASE("speculative sampling with draft distributions is lossless (tree and chain)") {
  const auto t = medusa::tree::from_paths({{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}});
  for (const auto& c : configs) check_lossless<medusa::speculative_policy>(t, c, true);
  const auto chain = medusa::tree::from_paths({{0}, {0, 0}, {0, 0, 0}});
  check_lossless<medusa::speculative_policy>(chain, {1.0f, 1.0f}, true);
}

TEST_CASE("the chi-square check has power: a biased sampler is caught") {
  // Half of the time emit the first child's token unconditionally (a verifier that skips the
  // rejection test), otherwise sample exactly; the check must reject this.
  const auto t = medusa::tree::from_paths({{0}, {1}, {2}});
  const std::vector<int> ctx{0};
  float z[vocab];
  model_logits(ctx, target_salt, z);
  const auto q1 = reference_warp(z, 1.0, 1.0);
  std::vector<long> o1(vocab);
  medusa::acceptance_workspace ws(t.num_nodes(), vocab);
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<double> u;
  const int first_child_token = (3 + 0) % vocab;
  for (int i = 0; i < 20000; ++i) {
    // Biased: a fair coin decides between the first child and an exact sample.
    if (u(rng) < 0.5) {
      ++o1[first_child_token];
    } else {
      double c = 0.0, x = u(rng);
      int k = 0;
      for (; k < vocab - 1; ++k) if (x < (c += q1[static_cast<std::size_t>(k)])) break;
      ++o1[static_cast<std::size_t>(k)];
    }
  }
  CHECK(chi2_p(std::vector<double>(q1.begin(), q1.end()), o1, 20000) < 0.001);
}

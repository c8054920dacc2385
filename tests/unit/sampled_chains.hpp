// SPDX-License-Identifier: Apache-2.0
// The distribution test of the sampled-chain drafters (test_draft_sampler, test_feature_draft):
// the first two tokens of many seeded generations through the decoder with `speculative_policy`,
// against the exact warped target.
#pragma once

#include "stats_common.hpp"
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

namespace sampled_chains {

// The target's logits after `context` (one causal pass from slot 0).
inline std::vector<float> last_logits(tiny::tiny_model& m, const std::vector<std::int32_t>& context) {
  const auto logits = tiny::outputs_of(m, context).logits;
  return {logits.end() - tiny::tiny_model::vocab, logits.end()};
}

struct result {
  stats::chi2_result first, first_two;
  stats::chi2_result second_third;
  double per_step = 0;
};

// The first three tokens of `trials` generations after `prompt` (seed = trial) against the exact
// warped target: the first alone (drawn from the prefill's logits), the first two jointly (the
// second comes from the first step's drafts), and the second and third jointly, summed over the
// first (the first step's first two emissions when its first draft is accepted).
template <class Drafts>
result first_three(tiny::tiny_model& target, const std::vector<std::int32_t>& prompt, const Drafts& drafts,
                   const medusa::sampling_warp& warp, int trials) {
  constexpr int V = tiny::tiny_model::vocab;
  auto warped = [&](const std::vector<std::int32_t>& ctx) {
    return stats::reference_warp(last_logits(target, ctx).data(), V, warp.temperature, warp.top_k, warp.top_p);
  };
  const auto q1 = warped(prompt);
  std::vector<double> p12(V * V), p23(V * V);
  for (int a = 0; a < V; ++a) {
    const double pa = q1[static_cast<std::size_t>(a)];
    if (pa == 0.0) continue;
    auto ctx = prompt;
    ctx.push_back(a);
    const auto q2 = warped(ctx);
    for (int b = 0; b < V; ++b) {
      const double pab = pa * q2[static_cast<std::size_t>(b)];
      p12[static_cast<std::size_t>(a * V + b)] = pab;
      if (pab == 0.0) continue;
      auto ctx2 = ctx;
      ctx2.push_back(b);
      const auto q3 = warped(ctx2);
      for (int c = 0; c < V; ++c) p23[static_cast<std::size_t>(b * V + c)] += pab * q3[static_cast<std::size_t>(c)];
    }
  }
  medusa::no_heads heads;
  medusa::decoder dec(target, heads, drafts, medusa::speculative_policy{warp});
  std::vector<long> o1(V), o12(V * V), o23(V * V);
  double steps = 0, tokens = 0;
  medusa::decode_options opt;
  opt.max_new_tokens = 3;
  for (int i = 0; i < trials; ++i) {
    opt.seed = static_cast<std::uint64_t>(i);
    const auto r = dec.generate(prompt, opt);
    REQUIRE(r.tokens.size() >= 3);
    ++o1[static_cast<std::size_t>(r.tokens[0])];
    ++o12[static_cast<std::size_t>(r.tokens[0] * V + r.tokens[1])];
    ++o23[static_cast<std::size_t>(r.tokens[1] * V + r.tokens[2])];
    steps += r.stats.steps;
    tokens += r.stats.new_tokens;
  }
  result res;
  res.first = stats::chi2_test(q1, o1, trials);
  res.first_two = stats::chi2_test(p12, o12, trials);
  res.second_third = stats::chi2_test(p23, o23, trials);
  res.per_step = tokens / steps;
  return res;
}

// Under a sanitizer, which checks the memory and threads and runs the sampling several times slower,
// fewer: the same chi-square tests at the same level, with less power.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr int trials = 2500;
inline constexpr int power_trials = 10000;  // a check that wrong rows are caught
#else
inline constexpr int trials = 30000;
inline constexpr int power_trials = 30000;
#endif

}  // namespace sampled_chains
